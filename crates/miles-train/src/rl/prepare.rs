//! Step 3: old and reference logprobs, the off-policy correction and the advantages.

use miles_core::config::{LossType, RunConfig};
use miles_core::{Advantage, Correction};
use serde_json::json;

use super::actor::{Actor, Reference, logprobs_of};
use super::metrics::Record;
use crate::batch::{self, TrainSample};
use crate::dist::Dist;

/// Where an iteration's old logprobs come from.
#[derive(Clone, Copy, PartialEq)]
pub(super) enum OldLogprobs {
    /// A forward of their own before the steps.
    Separate,
    /// The optimizer step's forward ([`old_logprobs_in_step`]).
    InStep,
}

/// Whether the old logprobs can be the optimizer step's own forward's, detached, instead of a
/// separate forward's: with one step per rollout the weights before it are the old policy, and
/// nothing may read the old logprobs before the step (TIS/MIS weights, KL reward shaping), nor
/// replace them (`--use-rollout-logprobs`). The bits are the same; one forward fewer.
pub(super) fn old_logprobs_in_step(cfg: &RunConfig, steps_per_rollout: usize) -> bool {
    cfg.loss_type != LossType::SftLoss
        && steps_per_rollout == 1
        && !cfg.use_tis
        && cfg.kl_coef == 0.0
        && !cfg.use_rollout_logprobs
}

/// Step 3 of an RL iteration: old logprobs (and their gap to the rollout's, unless they come
/// from the step), reference logprobs, the off-policy correction and the advantages of every
/// sample.
#[allow(clippy::too_many_arguments)]
pub(super) fn prepare(
    cfg: &RunConfig,
    actor: &Actor,
    samples: &mut [TrainSample],
    (old, version): (OldLogprobs, u64),
    reference: Option<&Reference>,
    correction: Option<&dyn Correction>,
    advantage: &dyn Advantage,
    record: &mut Record,
    dist: Option<&Dist>,
) -> anyhow::Result<()> {
    let temperature = cfg.rollout_temperature;
    let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
    if old == OldLogprobs::Separate {
        let trainer = logprobs_of(actor.model(), samples, temperature, micro)?;
        for (s, t) in samples.iter_mut().zip(&trainer) {
            let old = if cfg.use_rollout_logprobs { &s.rollout_logp } else { t };
            s.old_logp = old.clone();
        }
        let per_token = cfg.calculate_per_token_loss;
        let diff = batch::rollout_logprob_abs_diff(samples, &trainer, per_token);
        let diff = match dist {
            Some(d) => d.mean(diff, batch::aggregation_weight(samples, per_token))?,
            None => diff,
        };
        record.insert("train/train_rollout_logprob_abs_diff".into(), json!(diff));
        batch::record_gap_by_staleness(record, samples, &trainer, version);
    }
    if let Some(r) = reference {
        let refs = logprobs_of(r.model(), samples, temperature, micro)?;
        for (s, r) in samples.iter_mut().zip(refs) {
            s.ref_logp = Some(r);
        }
    }
    let per_token = cfg.calculate_per_token_loss;
    if let Some(corr) = correction.filter(|_| cfg.use_tis) {
        let mut batch_sum = |sums: &mut [f64]| match dist {
            // (The plugin's error type; the message is the group's.)
            Some(d) => d.sum(sums).map_err(|e| miles_core::Error::Plugin(format!("{e:#}"))),
            None => Ok(()),
        };
        let mut metrics = batch::apply_correction(corr, samples, per_token, &mut batch_sum)?;
        if let Some(d) = dist {
            // The weighted means over the ranks, in one sum. A rank without samples has no
            // metric values; it takes the names from a one-token sequence (they depend on the
            // configuration only) with weight 0.
            if samples.is_empty() {
                metrics = batch::correction_metric_names(corr)?.map(|k| (k, 0.0)).collect();
            }
            let weight = batch::aggregation_weight(samples, per_token);
            let mut sums: Vec<f64> = metrics.values().flat_map(|&v| [v * weight, weight]).collect();
            d.sum(&mut sums)?;
            for (v, s) in metrics.values_mut().zip(sums.chunks_exact(2)) {
                *v = s[0] / s[1].max(1e-300);
            }
            // No samples anywhere: no figures, as one process reports none.
            if sums.get(1).is_some_and(|&w| w == 0.0) {
                metrics.clear();
            }
        }
        for (k, v) in metrics {
            record.insert(format!("train/{k}"), json!(v));
        }
    }
    let shaping_kl = (cfg.kl_coef != 0.0).then_some(cfg.kl_loss_type);
    let mut batch_sum = |sums: &mut [f64]| match dist {
        Some(d) => d.sum(sums),
        None => Ok(()),
    };
    batch::compute_advantages(
        advantage,
        samples,
        shaping_kl,
        cfg.normalize_advantages,
        &mut batch_sum,
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn old_logprobs_come_from_the_step_only_where_nothing_reads_them_before_it() {
        let base = || RunConfig { num_steps_per_rollout: 1, ..RunConfig::default() };
        assert!(old_logprobs_in_step(&base(), 1));
        assert!(!old_logprobs_in_step(&base(), 2), "a second step's old policy is not its own");
        let not = [
            RunConfig { use_tis: true, ..base() },
            RunConfig { kl_coef: 0.1, ..base() },
            RunConfig { use_rollout_logprobs: true, ..base() },
            RunConfig { loss_type: LossType::SftLoss, ..base() },
        ];
        for cfg in not {
            assert!(!old_logprobs_in_step(&cfg, 1), "{cfg:?}");
        }
    }
}
