//! Several processes as one run: which process this is ([`World`], from the variables torchrun
//! and Slurm set), starting one worker per GPU on this host ([`launch_local`]), the rendezvous
//! and the collectives the workers run over TCP ([`Group`]: broadcast, all-reduce summed in rank
//! order so a run is reproducible, barrier; every wait bounded, so a dead worker stops the run
//! with an error on every rank, never a hang), and each rank's share of the prompt groups
//! ([`shard`]). NCCL carries the gradients on GPUs; this group carries its unique id, the
//! metrics, and everything on the CPU.

mod group;
mod launch;
mod world;

pub use group::Group;
pub use launch::launch_local;
pub use world::World;

/// What goes wrong between processes; each message says which rank, variable or peer.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{var}: {message}")]
    Env { var: &'static str, message: String },
    #[error("{what}: {source}")]
    Io { what: String, source: std::io::Error },
    #[error("{0}")]
    Peer(String),
}

pub type Result<T> = std::result::Result<T, Error>;

/// Rank `rank`'s prompt groups of a rollout of `groups` trained in `steps` optimizer steps:
/// step `k` trains on groups `[k·groups/steps, (k+1)·groups/steps)`, as in one process, and
/// each rank takes its equal, contiguous part of every step's groups (a group never splits
/// across ranks). In step order, so splitting a rank's samples into `steps` equal slices gives
/// each step's share.
pub fn shard(groups: usize, steps: usize, world_size: usize, rank: usize) -> Result<Vec<usize>> {
    if world_size == 0 || rank >= world_size || steps == 0 {
        return Err(Error::Peer(format!("rank {rank} of a world of {world_size}, {steps} steps")));
    }
    if !groups.is_multiple_of(steps * world_size) {
        return Err(Error::Peer(format!(
            "{groups} prompt groups in {steps} optimizer steps do not split evenly over \
             {world_size} processes: make --rollout-batch-size a multiple of {}",
            steps * world_size
        )));
    }
    let (per_step, per_rank) = (groups / steps, groups / steps / world_size);
    Ok((0..steps)
        .flat_map(|k| {
            let start = k * per_step + rank * per_rank;
            start..start + per_rank
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_give_every_rank_its_part_of_every_step() {
        for (world, steps) in [(1, 1), (2, 1), (2, 4), (4, 2), (8, 4)] {
            let mut all: Vec<usize> =
                (0..world).flat_map(|r| shard(32, steps, world, r).unwrap()).collect();
            all.sort_unstable();
            assert_eq!(all, (0..32).collect::<Vec<_>>(), "{world} ranks, {steps} steps");
            // Each rank's k-th slice lies inside step k.
            for r in 0..world {
                let mine = shard(32, steps, world, r).unwrap();
                for (k, part) in mine.chunks(mine.len() / steps).enumerate() {
                    assert!(part.iter().all(|&g| g / (32 / steps) == k), "{mine:?}");
                }
            }
        }
        assert_eq!(shard(8, 2, 2, 1).unwrap(), vec![2, 3, 6, 7]);
        assert!(shard(6, 1, 4, 0).unwrap_err().to_string().contains("multiple of 4"));
        assert!(shard(8, 4, 4, 0).unwrap_err().to_string().contains("multiple of 16"));
        assert!(shard(8, 1, 2, 2).is_err());
    }
}
