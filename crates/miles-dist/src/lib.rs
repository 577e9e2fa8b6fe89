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

/// Rank `rank`'s share of `groups` prompt groups: a contiguous range, the same size on every
/// rank, so a group never splits across ranks and the global batch is the same as one
/// process's.
pub fn shard(groups: usize, world_size: usize, rank: usize) -> Result<std::ops::Range<usize>> {
    if world_size == 0 || rank >= world_size {
        return Err(Error::Peer(format!("rank {rank} of a world of {world_size}")));
    }
    if !groups.is_multiple_of(world_size) {
        return Err(Error::Peer(format!(
            "{groups} prompt groups do not split evenly over {world_size} processes: make \
             --rollout-batch-size a multiple of the process count"
        )));
    }
    let per = groups / world_size;
    Ok(rank * per..(rank + 1) * per)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_cover_the_groups_without_splitting_any() {
        for world in [1, 2, 4, 8] {
            let ranges: Vec<_> = (0..world).map(|r| shard(32, world, r).unwrap()).collect();
            assert_eq!(ranges[0].start, 0);
            assert_eq!(ranges[world - 1].end, 32);
            for w in ranges.windows(2) {
                assert_eq!(w[0].end, w[1].start);
                assert_eq!(w[0].len(), w[1].len());
            }
        }
        assert!(shard(6, 4, 0).unwrap_err().to_string().contains("--rollout-batch-size"));
        assert!(shard(8, 2, 2).is_err());
    }
}
