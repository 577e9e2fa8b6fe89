//! Eval: mean reward and pass@k on the eval prompts, with a fixed seed.

use std::time::Instant;

use miles_core::config::RunConfig;
use miles_core::{Reward, Rollout, SamplingParams};
use miles_data::{Dataset, PromptRow};
use miles_model::Tokenizer;
use serde_json::json;

use super::collect::make_groups;
use super::metrics::Record;
use super::mix;
use super::score::score_groups;
use crate::dist::Dist;

/// An eval set: its prompts, and its name when the run has several (slime's
/// `--eval-prompt-data NAME FILE …`).
pub struct EvalSet {
    pub name: Option<String>,
    pub data: Dataset,
}

/// Eval on every prompt of `set`: mean reward, pass@1 (the fraction of samples with a
/// positive reward) and, with several samples per prompt, pass@n (`eval/reward`,
/// `eval/pass@1`; a named set's `eval/NAME`, `eval/NAME/pass@1`). Its draws use a fixed seed,
/// so successive evals differ only by the policy. Over several processes each rank evaluates
/// a contiguous part of the prompts (their draws keyed by their one-process indices) and the
/// counts are summed: the figures of one process, in a fraction of its time.
pub(super) fn evaluate(
    cfg: &RunConfig,
    engine: &mut dyn Rollout,
    tok: &Tokenizer,
    set: &EvalSet,
    reward: &dyn Reward,
    record: &mut Record,
    dist: Option<&Dist>,
) -> anyhow::Result<EvalOutcome> {
    let eval = &set.data;
    let started = Instant::now();
    let n = cfg.n_samples_per_eval_prompt;
    let total = eval.rows.len();
    let share = match dist {
        Some(d) => d.rank * total / d.size..(d.rank + 1) * total / d.size,
        None => 0..total,
    };
    let rows: Vec<(usize, PromptRow)> = share.clone().map(|i| (i, eval.rows[i].clone())).collect();
    let indices: Vec<usize> = share.collect();
    let groups = make_groups(&rows, &indices, n, cfg, tok, &eval.source)?;
    let params = SamplingParams {
        temperature: cfg.eval_temperature.unwrap_or(cfg.rollout_temperature),
        top_k: usize::try_from(cfg.eval_top_k.unwrap_or(cfg.rollout_top_k)).unwrap_or(0),
        top_p: cfg.eval_top_p.unwrap_or(cfg.rollout_top_p),
        max_new_tokens: cfg.eval_max_response_len.unwrap_or(cfg.rollout_max_response_len),
        seed: mix(cfg.rollout_seed, 0xE7A1),
        ..cfg.sampling_params()
    };
    let groups = if groups.is_empty() { groups } else { engine.generate(groups, &params)? };
    let (_, rewards, failed) = score_groups(reward, groups, cfg)?;
    // Reward sum, solved samples, scored samples, prompts solved at least once, failures.
    let mut sums = [0.0, 0.0, 0.0, 0.0, failed as f64];
    for rewards in rewards.chunks(n) {
        let live: Vec<f32> = rewards.iter().flatten().copied().collect();
        sums[0] += live.iter().map(|&r| f64::from(r)).sum::<f64>();
        sums[1] += live.iter().filter(|&&r| r > 0.0).count() as f64;
        sums[2] += live.len() as f64;
        sums[3] += f64::from(u8::from(live.iter().any(|&r| r > 0.0)));
    }
    if let Some(d) = dist {
        d.sum(&mut sums)?;
    }
    let [sum, solved, count, any, failed] = sums;
    let mean = sum / count.max(1.0);
    let (reward_key, prefix) = match &set.name {
        Some(name) => (format!("eval/{name}"), format!("eval/{name}/")),
        None => ("eval/reward".to_string(), "eval/".to_string()),
    };
    record.insert(reward_key, json!(mean));
    record.insert(format!("{prefix}pass@1"), json!(solved / count.max(1.0)));
    if n > 1 {
        record.insert(format!("{prefix}pass@{n}"), json!(any / total.max(1) as f64));
    }
    // (Several sets: their failures and times add up.)
    let add = |record: &mut Record, key: &str, x: f64| {
        let before = record.get(key).and_then(serde_json::Value::as_f64).unwrap_or(0.0);
        record.insert(key.into(), json!(before + x));
    };
    add(record, "rollout/eval_failed", failed);
    add(record, "perf/eval_time", started.elapsed().as_secs_f64());
    Ok(EvalOutcome { reward: mean, scored: count as usize, failed: failed as usize })
}

/// An eval's mean reward over the samples the reward scored, and how many it could not score
/// (the reward failed, or the rollout): a mean of none is no score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalOutcome {
    pub reward: f64,
    pub scored: usize,
    pub failed: usize,
}

impl std::fmt::Display for EvalOutcome {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (scored, failed) = (self.scored, self.failed);
        match (scored, failed) {
            (0, 0) => write!(f, "none (no eval sample)"),
            (0, _) => write!(
                f,
                "none: every one of the {failed} eval samples failed (rollout/eval_failed; each \
                 sample's metadata says why)"
            ),
            (_, 0) => write!(f, "{:.3}", self.reward),
            _ => write!(
                f,
                "{:.3} ({failed} of {} eval samples failed)",
                self.reward,
                scored + failed
            ),
        }
    }
}
