//! One run over several processes (`miles train --nproc-per-node N`, or torchrun and Slurm's
//! variables): every rank draws the same prompts, rolls out its part of each optimizer step's
//! prompt groups ([`miles_dist::shard`]; the samples keep the indices, and so the draws, they
//! have in a one-process run), and trains on them; a step's loss is normalized by the whole batch's
//! denominator, the gradients are summed over the ranks in rank order before the one AdamW
//! step every rank takes, and the metrics are summed the same way. Each rank evaluates its part
//! of the eval prompts; rank 0 logs and writes checkpoints. On GPUs (`--device cuda`: each rank on the GPU of its local rank) the
//! gradients and the starting weights go through NCCL; on the CPU, and for a device model on
//! host tensors, through the TCP group. A device model's gradients are summed in buckets
//! ([`GradBuckets`]) started during the last backward of a step, as its layers finish, so on
//! GPUs the sums run beside the rest of the backward.

use std::cell::{OnceCell, RefCell};
use std::time::Duration;

use anyhow::{Context, bail};
use miles_core::config::{DeviceSpec, DistBackend, LossType, RunConfig};
use miles_dist::{Group, World};
use miles_model::DeviceModel;
use miles_tensor::{Collective, Device, Tensor};

/// How long a rank waits for the others at a collective before calling them dead.
const TIMEOUT: Duration = Duration::from_secs(600);

/// Gradient bytes a bucket gathers before its sum starts (PyTorch DDP's default size);
/// `MILES_GRAD_BUCKET_BYTES` overrides it (tests make many small buckets with it).
const BUCKET_BYTES: usize = 25 << 20;

fn bucket_bytes() -> usize {
    std::env::var("MILES_GRAD_BUCKET_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&b| b > 0)
        .unwrap_or(BUCKET_BYTES)
}

/// A step's gradient sums: consecutive groups of [`DeviceModel::grad_groups`] (in the order the
/// backward finishes them) gathered into buckets of about [`BUCKET_BYTES`]. Every rank makes
/// the same buckets and starts them in the same order, whether during its backward or after
/// (a rank without samples for a step, or one whose loss was not finite), so the collectives
/// line up and every step sums the same chunks the same way.
pub(crate) struct GradBuckets {
    /// Each bucket's gradient indices and the last group it holds.
    buckets: Vec<(Vec<usize>, usize)>,
    started: usize,
}

impl GradBuckets {
    fn new(groups: &[Vec<usize>], bytes: impl Fn(usize) -> usize, cap: usize) -> GradBuckets {
        let mut buckets = Vec::new();
        let (mut open, mut size) = (Vec::new(), 0);
        for (g, group) in groups.iter().enumerate() {
            open.extend(group);
            size += group.iter().map(|&i| bytes(i)).sum::<usize>();
            if size >= cap || g + 1 == groups.len() {
                buckets.push((std::mem::take(&mut open), g));
                size = 0;
            }
        }
        GradBuckets { buckets, started: 0 }
    }

    /// The buckets whose groups are all finished once group `done` is, not started yet.
    fn ready(&mut self, done: usize) -> std::ops::Range<usize> {
        let from = self.started;
        while self.started < self.buckets.len() && self.buckets[self.started].1 <= done {
            self.started += 1;
        }
        from..self.started
    }
}

pub(crate) struct Dist {
    group: RefCell<Group>,
    /// NCCL between the ranks' GPUs, joined on first use.
    collective: OnceCell<Collective>,
    /// `--distributed-backend tcp`: GPU tensors go through the TCP group too.
    tcp_only: bool,
    pub rank: usize,
    pub size: usize,
    local_rank: usize,
}

impl Dist {
    /// This process's group when the environment names several ranks; `None` for one process.
    pub fn join(backend: Option<DistBackend>) -> anyhow::Result<Option<Dist>> {
        let Some(world) = World::from_env(|k| std::env::var(k).ok())? else { return Ok(None) };
        let group = Group::join(&world, TIMEOUT)
            .with_context(|| format!("rank {} of {}", world.rank, world.world_size))?;
        Ok(Some(Dist {
            group: RefCell::new(group),
            collective: OnceCell::new(),
            tcp_only: backend == Some(DistBackend::Tcp),
            rank: world.rank,
            size: world.world_size,
            local_rank: world.local_rank,
        }))
    }

    pub fn root(&self) -> bool {
        self.rank == 0
    }

    /// Sums `values` over the ranks (in rank order) on every rank.
    pub fn sum(&self, values: &mut [f64]) -> anyhow::Result<()> {
        Ok(self.group.borrow_mut().all_reduce_sum_f64(values)?)
    }

    /// [`Dist::sum`] in f32 (gradients).
    pub fn sum_f32(&self, values: &mut [f32]) -> anyhow::Result<()> {
        Ok(self.group.borrow_mut().all_reduce_sum(values)?)
    }

    /// The first of the ranks' `mine` in rank order, on rank 0 (`None` on the others); a later
    /// rank's is named by its rank.
    pub fn first_on_root(&self, mine: Option<&str>) -> anyhow::Result<Option<String>> {
        let all = self.group.borrow_mut().gather(mine.unwrap_or_default().as_bytes())?;
        Ok(all.and_then(|all| {
            let (rank, text) = all.into_iter().enumerate().find(|(_, t)| !t.is_empty())?;
            let text = String::from_utf8_lossy(&text).into_owned();
            Some(if rank == 0 { text } else { format!("rank {rank}: {text}") })
        }))
    }

    pub fn barrier(&self) -> anyhow::Result<()> {
        Ok(self.group.borrow_mut().barrier()?)
    }

    /// The device this rank trains on (see [`rank_device`]).
    pub fn device(&self, spec: DeviceSpec) -> Device {
        rank_device(spec, self.local_rank)
    }

    /// NCCL on `device`, joined on first use (rank 0 makes the id and hands it over the TCP
    /// group); `None` for host tensors and `--distributed-backend tcp`.
    fn collective(&self, device: Device) -> anyhow::Result<Option<&Collective>> {
        if device == Device::Cpu || self.tcp_only {
            return Ok(None);
        }
        if let Some(c) = self.collective.get() {
            return Ok(Some(c));
        }
        let mut id = if self.root() { Collective::new_id()? } else { Vec::new() };
        self.group.borrow_mut().broadcast(&mut id)?;
        let c = Collective::join(&device, &id, self.rank, self.size, TIMEOUT)
            .with_context(|| format!("rank {} joining NCCL on {device}", self.rank))?;
        Ok(Some(self.collective.get_or_init(|| c)))
    }

    /// A step's gradient buckets for `model`.
    pub fn grad_buckets(&self, model: &DeviceModel) -> GradBuckets {
        let sizes: Vec<usize> = model.grad_lens().iter().map(|len| 4 * len).collect();
        GradBuckets::new(&model.grad_groups(), |i| sizes[i], bucket_bytes())
    }

    /// Starts the sums of the buckets that group `done` of the backward completes (NCCL on
    /// its own stream; over TCP, for host tensors, they run now).
    pub fn start_ready(
        &self,
        buckets: &mut GradBuckets,
        done: usize,
        grads: &mut [Tensor],
    ) -> anyhow::Result<()> {
        for b in buckets.ready(done) {
            let indices = &buckets.buckets[b].0;
            let device = grads[indices[0]].device();
            let mut picked: Vec<&mut Tensor> = grads
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| indices.contains(i))
                .map(|(_, g)| g)
                .collect();
            match self.collective(device)? {
                Some(c) => c.start_all_reduce_sum(&mut picked)?,
                None => {
                    // One message per bucket; each element is still summed in rank order.
                    let mut all = Vec::new();
                    for g in &picked {
                        all.extend(g.to_vec_f32()?);
                    }
                    self.sum_f32(&mut all)?;
                    let mut at = 0;
                    for g in picked {
                        let n = g.len();
                        *g = Tensor::from_f32(g.shape(), all[at..at + n].to_vec(), &device)?;
                        at += n;
                    }
                }
            }
        }
        Ok(())
    }

    /// Finishes a step's sums: starts the buckets not started yet, then waits for them all.
    pub fn finish_grads(
        &self,
        mut buckets: GradBuckets,
        model: &mut DeviceModel,
    ) -> anyhow::Result<()> {
        let last = model.grad_groups().len() - 1;
        self.start_ready(&mut buckets, last, model.grads_mut())?;
        if let Some(c) = self.collective(model.device())? {
            c.wait()?;
        }
        Ok(())
    }

    /// Every rank takes rank 0's master weights (they load the same ones; this makes sure).
    pub fn broadcast_weights(&self, model: &mut DeviceModel) -> anyhow::Result<()> {
        let device = model.device();
        match self.collective(device)? {
            Some(c) => model.set_masters_with(|masters| Ok(c.broadcast(masters, 0)?))?,
            None => {
                let mut values = Vec::new();
                for w in model.to_weights()?.tensors() {
                    let mut bytes: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
                    self.group.borrow_mut().broadcast(&mut bytes)?;
                    values.push(
                        bytes
                            .chunks_exact(4)
                            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                            .collect::<Vec<f32>>(),
                    );
                }
                model.set_masters_with(|masters| {
                    for (m, v) in masters.iter_mut().zip(values) {
                        **m = Tensor::from_f32(m.shape(), v, &device)?;
                    }
                    Ok(())
                })?;
            }
        }
        Ok(())
    }

    /// The mean over all ranks of per-rank means `value` of `weight` items each.
    pub fn mean(&self, value: f64, weight: f64) -> anyhow::Result<f64> {
        let mut v = [value * weight, weight];
        self.sum(&mut v)?;
        Ok(v[0] / v[1].max(1e-300))
    }
}

/// `--device cuda` (no ordinal) is the GPU of the rank's local rank, as torchrun's workers
/// pick theirs (device 0 in a single process); `cuda:N` and `cpu` stay as given.
pub fn rank_device(spec: DeviceSpec, local_rank: usize) -> Device {
    match spec {
        DeviceSpec::Cpu => Device::Cpu,
        DeviceSpec::Cuda => Device::Cuda(local_rank),
        DeviceSpec::CudaOrdinal(n) => Device::Cuda(n),
    }
}

/// Whether the batch splits evenly over `size` processes; the error names the flag to change.
pub(crate) fn check_split(cfg: &RunConfig, size: usize, steps: usize) -> anyhow::Result<()> {
    // Dynamic sampling splits each draw evenly over the ranks and keeps groups from any of them
    // (supervised iterations draw no more than the batch).
    if let Some(over) = cfg.over_sampling_batch_size.filter(|_| cfg.loss_type != LossType::SftLoss)
    {
        if !over.is_multiple_of(size) {
            bail!(
                "--over-sampling-batch-size: {over} prompt groups a draw do not split evenly \
                 over {size} processes: make it a multiple of {size}"
            );
        }
        return Ok(());
    }
    miles_dist::shard(cfg.rollout_batch_size, steps, size, 0).context("--rollout-batch-size")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Buckets gather whole groups in the backward's order until 25 MiB, the last one takes
    /// the rest; a finished group starts exactly the buckets it completes, once each.
    #[test]
    fn gradient_buckets_follow_the_backward() {
        // Groups: the final norm, three "layers" of 10 MiB, the embedding of 30 MiB.
        let mib = 1 << 20;
        let groups = vec![vec![4], vec![3], vec![2], vec![1], vec![0]];
        let bytes = |i: usize| match i {
            0 => 30 * mib,
            4 => 1024,
            _ => 10 * mib,
        };
        let mut b = GradBuckets::new(&groups, bytes, BUCKET_BYTES);
        let plan: Vec<(Vec<usize>, usize)> = b.buckets.clone();
        assert_eq!(plan, [(vec![4, 3, 2, 1], 3), (vec![0], 4)]);
        assert_eq!(b.ready(0), 0..0);
        assert_eq!(b.ready(2), 0..0);
        assert_eq!(b.ready(3), 0..1);
        assert_eq!(b.ready(3), 1..1);
        assert_eq!(b.ready(4), 1..2);
        assert_eq!(b.ready(4), 2..2);
        // Finishing after the backward (a rank without samples) starts them all at once.
        let mut late = GradBuckets::new(&groups, bytes, BUCKET_BYTES);
        assert_eq!(late.ready(4), 0..2);
        // Every index is summed exactly once.
        let mut all: Vec<usize> = plan.iter().flat_map(|(i, _)| i.clone()).collect();
        all.sort_unstable();
        assert_eq!(all, [0, 1, 2, 3, 4]);
    }

    #[test]
    fn each_rank_takes_the_gpu_of_its_local_rank() {
        assert_eq!(rank_device(DeviceSpec::Cuda, 3), Device::Cuda(3));
        assert_eq!(rank_device(DeviceSpec::CudaOrdinal(1), 3), Device::Cuda(1));
        assert_eq!(rank_device(DeviceSpec::Cpu, 3), Device::Cpu);
    }
}
