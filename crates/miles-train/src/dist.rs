//! One run over several processes (`miles train --nproc-per-node N`, or torchrun and Slurm's
//! variables): every rank draws the same prompts, rolls out its part of each optimizer step's
//! prompt groups ([`miles_dist::shard`]; the samples keep the indices, and so the draws, they
//! have in a one-process run), and trains on them; a step's loss is normalized by the whole batch's
//! denominator, the gradients are summed over the ranks in rank order before the one AdamW
//! step every rank takes, and the metrics are summed the same way. Rank 0 logs, evaluates and
//! writes checkpoints. Over TCP on the CPU (the GPUs' NCCL is still to come).

use std::cell::RefCell;
use std::time::Duration;

use anyhow::{Context, bail};
use miles_core::config::{AdvantageEstimator, RunConfig};
use miles_dist::{Group, World};

/// How long a rank waits for the others at a collective before calling them dead.
const TIMEOUT: Duration = Duration::from_secs(600);

pub(crate) struct Dist {
    group: RefCell<Group>,
    pub rank: usize,
    pub size: usize,
}

impl Dist {
    /// This process's group when the environment names several ranks; `None` for one process.
    pub fn join() -> anyhow::Result<Option<Dist>> {
        let world = World::from_env(|k| std::env::var(k).ok())?;
        let Some(world) = world.filter(|w| w.world_size > 1) else { return Ok(None) };
        let group = Group::join(&world, TIMEOUT)
            .with_context(|| format!("rank {} of {}", world.rank, world.world_size))?;
        Ok(Some(Dist { group: RefCell::new(group), rank: world.rank, size: world.world_size }))
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

    pub fn barrier(&self) -> anyhow::Result<()> {
        Ok(self.group.borrow_mut().barrier()?)
    }

    /// The mean over all ranks of per-rank means `value` of `weight` items each.
    pub fn mean(&self, value: f64, weight: f64) -> anyhow::Result<f64> {
        let mut v = [value * weight, weight];
        self.sum(&mut v)?;
        Ok(v[0] / v[1].max(1e-300))
    }
}

/// What a run over several processes does not take yet, with the flag to change.
pub(crate) fn check_supported(
    cfg: &RunConfig,
    on_device: bool,
    size: usize,
    steps: usize,
) -> anyhow::Result<()> {
    if on_device {
        bail!(
            "--device {}: several processes train on the CPU so far (NCCL on GPUs is next)",
            cfg.device
        );
    }
    // Each of these normalizes over the whole batch, which no rank holds alone.
    let whitened = matches!(
        cfg.advantage_estimator,
        AdvantageEstimator::ReinforcePlusPlus | AdvantageEstimator::ReinforcePlusPlusBaseline
    );
    let refuse = [
        (cfg.over_sampling_batch_size.is_some(), "--over-sampling-batch-size"),
        (cfg.normalize_advantages, "--normalize-advantages"),
        (whitened, "--advantage-estimator reinforce_plus_plus(_baseline)"),
        (cfg.use_tis, "--use-tis"),
    ];
    if let Some((_, flag)) = refuse.iter().find(|(on, _)| *on) {
        bail!("{flag}: not supported with several processes yet; run it in one");
    }
    miles_dist::shard(cfg.rollout_batch_size, steps, size, 0).context("--rollout-batch-size")?;
    Ok(())
}
