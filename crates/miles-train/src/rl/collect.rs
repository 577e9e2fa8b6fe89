//! Step 1 of an iteration: prompts drawn, responses generated through [`Rollout`], scored and
//! filtered (dynamic sampling), and over several processes each rank's part of every step.

use std::time::Instant;

use anyhow::{Context, bail};
use miles_core::config::RunConfig;
use miles_core::{Flow, Reward, Rollout, Sample, SamplingParams, Status};
use miles_data::{DataSource, PromptRow};
use miles_model::Tokenizer;
use serde_json::json;

use super::metrics::Record;
use super::mix;
use super::score::{failure_reason, score_groups};
use crate::batch::{self, TrainSample};
use crate::dist::Dist;

/// Prompt rows as pending samples, `n` per prompt, tokenized.
pub(super) fn make_groups(
    rows: &[(usize, PromptRow)],
    indices: &[usize],
    n: usize,
    cfg: &RunConfig,
    tok: &Tokenizer,
    source: &str,
) -> anyhow::Result<Vec<Vec<Sample>>> {
    rows.iter()
        .enumerate()
        .map(|(g, (_, row))| {
            let prompt = serde_json::to_value(&row.prompt)?;
            let tokens = tok
                .encode_prompt(&prompt, cfg.apply_chat_template)
                .with_context(|| format!("{source}: line {}: key '{}'", row.line, cfg.input_key))?;
            if tokens.is_empty() {
                bail!("{source}: line {}: the prompt encodes to no tokens", row.line);
            }
            let sample = Sample {
                prompt: row.prompt.clone(),
                tokens,
                label: row.label.clone(),
                metadata: row.metadata.clone(),
                ..Sample::default()
            };
            // Indices as in a one-process run (they key the rollout's draws).
            let g = indices[g];
            Ok((0..n)
                .map(|i| Sample { group_index: g, index: g * n + i, ..sample.clone() })
                .collect())
        })
        .collect()
}

/// Which of a rank's samples each optimizer step of an iteration takes.
pub(super) type StepParts = Vec<std::ops::Range<usize>>;

/// Generates and scores one iteration's batch; records slime's `rollout/*` metrics. Over
/// several processes, also this rank's part of each optimizer step ([`step_parts`]).
///
/// Under dynamic sampling in one process, groups are scored as they complete and the
/// generation is aborted once the batch is full; with `--partial-rollout` the groups it cut
/// off go to `partial`, which the next rollout continues before drawing new prompts.
#[allow(clippy::too_many_arguments)]
pub(super) fn rollout(
    cfg: &RunConfig,
    engine: &mut dyn Rollout,
    tok: &Tokenizer,
    data: &mut DataSource,
    reward: &dyn Reward,
    iteration: usize,
    record: &mut Record,
    dist: Option<&Dist>,
    steps: usize,
    partial: &mut Vec<Vec<Sample>>,
) -> anyhow::Result<(Vec<TrainSample>, Option<StepParts>)> {
    let n = cfg.n_samples_per_prompt;
    let want = cfg.rollout_batch_size;
    let draw = cfg.over_sampling_batch_size.unwrap_or(want);
    let filter = cfg.over_sampling_batch_size.is_some();
    // Dynamic sampling draws again until the batch is full; bounded so a task the policy
    // always solves (or never does) still trains on what it has.
    let max_rounds = if filter { 8 } else { 1 };
    let source = data.dataset().source.clone();
    let mut kept: Vec<TrainSample> = Vec::new();
    let mut t = Tally::default();
    let mut groups_kept = 0;
    for round in 0..max_rounds {
        if groups_kept >= want {
            break;
        }
        // Partial rollout: the groups an earlier rollout cut off come first (one process).
        let resumed: Vec<Vec<Sample>> = partial.drain(..partial.len().min(draw)).collect();
        let rows = data.next_batch(draw - resumed.len());
        // Over several processes, this rank's part of every optimizer step's groups (every
        // rank drew the same rows); under dynamic sampling an even part of the drawn groups,
        // which are kept is decided below over all of them.
        let share: Vec<usize> = match dist {
            Some(d) if filter => miles_dist::shard(rows.len(), 1, d.size, d.rank)?,
            Some(d) => miles_dist::shard(rows.len(), steps, d.size, d.rank)?,
            None => (0..rows.len()).collect(),
        };
        let mine: Vec<(usize, PromptRow)> = share.iter().map(|&g| rows[g].clone()).collect();
        let first_new = resumed.len();
        let indices: Vec<usize> = share.iter().map(|&g| first_new + g).collect();
        let mut groups = numbered(resumed, n);
        groups.extend(make_groups(&mine, &indices, n, cfg, tok, &source)?);
        let params = SamplingParams {
            seed: mix(cfg.rollout_seed, ((iteration as u64) << 8) | round as u64),
            ..cfg.sampling_params()
        };
        let generate_started = Instant::now();
        if filter && dist.is_none() && !whole_rounds() {
            let version = iteration as u64;
            let keep = Keep { reward, cfg, want, version };
            let out = keep.stream(engine, groups, &params, &mut t, &mut kept, &mut groups_kept)?;
            t.generate_time += generate_started.elapsed().as_secs_f64();
            for group in out {
                // (Groups without an aborted member were handed over as they completed.)
                let aborted = group.iter().filter(|s| s.status == Status::Aborted).count();
                t.aborted += aborted;
                if aborted > 0 && cfg.partial_rollout {
                    partial.push(group);
                }
            }
            continue;
        }
        let groups = engine.generate(groups, &params)?;
        t.generate_time += generate_started.elapsed().as_secs_f64();
        let (flat, rewards, fails) = score_groups(reward, groups, cfg)?;
        t.failed += fails;
        if t.first_error.is_none() {
            t.first_error = flat.iter().find_map(failure_reason);
        }
        let keepable: Vec<bool> = flat
            .chunks(n)
            .zip(rewards.chunks(n))
            .map(|(group, rewards)| t.add_group(group, rewards, filter))
            .collect();
        // Each group's index in the batch, in drawn order until the batch is full; under
        // dynamic sampling over several processes, over every rank's groups.
        let index: Vec<Option<usize>> = match dist {
            Some(d) if filter => {
                let mut all = vec![0.0; rows.len()];
                for (&g, &k) in share.iter().zip(&keepable) {
                    all[g] = f64::from(u8::from(k));
                }
                d.sum(&mut all)?;
                let mut index = vec![None; rows.len()];
                for (g, &k) in all.iter().enumerate() {
                    if k > 0.0 && groups_kept < want {
                        index[g] = Some(groups_kept);
                        groups_kept += 1;
                    }
                }
                share.iter().map(|&g| index[g]).collect()
            }
            // Over several processes without dynamic sampling, a group's index among the
            // drawn ones (every drawn group is wanted).
            Some(_) => share.iter().zip(&keepable).map(|(&g, &k)| k.then_some(g)).collect(),
            None => keepable
                .iter()
                .map(|&k| {
                    let g = (k && groups_kept < want).then_some(groups_kept);
                    groups_kept += usize::from(g.is_some());
                    g
                })
                .collect(),
        };
        for ((group, rewards), g) in flat.chunks(n).zip(rewards.chunks(n)).zip(index) {
            let Some(g) = g else { continue };
            for (s, r) in group.iter().zip(rewards) {
                if let Some(r) = r
                    && let Some(ts) = TrainSample::from_sample(s, g, *r)
                {
                    t.add_kept(&ts, iteration as u64);
                    kept.push(ts);
                }
            }
        }
    }
    t.write(record, kept.len(), dist)?;
    // Over several processes each step takes the samples one process's step would, whichever
    // samples or groups were dropped (failed rewards, empty responses) on any rank.
    let parts = match dist {
        Some(d) => Some(step_parts(d, &kept, if filter { groups_kept } else { draw }, steps)?),
        None => None,
    };
    Ok((kept, parts))
}

/// A test hook: dynamic sampling in one process generates whole rounds, as over several
/// processes (which cannot abort mid-round), so that both keep the same samples.
fn whole_rounds() -> bool {
    std::env::var_os("MILES_DYNAMIC_SAMPLING_ROUNDS").is_some()
}

/// A round's groups renumbered from 0 in order (their samples' draws are keyed by index).
fn numbered(groups: Vec<Vec<Sample>>, n: usize) -> Vec<Vec<Sample>> {
    groups
        .into_iter()
        .enumerate()
        .map(|(g, group)| {
            let samples = group.into_iter().enumerate();
            samples.map(|(i, s)| Sample { group_index: g, index: g * n + i, ..s }).collect()
        })
        .collect()
}

/// Dynamic sampling in one process: which completed groups join the batch.
struct Keep<'a> {
    reward: &'a dyn Reward,
    cfg: &'a RunConfig,
    /// Groups the batch takes.
    want: usize,
    /// The policy version training on the batch.
    version: u64,
}

impl Keep<'_> {
    /// Generates `groups`, scoring each as it completes and keeping it when its rewards have
    /// a spread, until the batch is full: then the engine aborts the rest, which it returns
    /// (with the groups already handed over).
    fn stream(
        &self,
        engine: &mut dyn Rollout,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        t: &mut Tally,
        kept: &mut Vec<TrainSample>,
        groups_kept: &mut usize,
    ) -> anyhow::Result<Vec<Vec<Sample>>> {
        let mut failure = None;
        let out = engine.generate_until(groups, params, &mut |_, group| {
            // (Groups completed in the step that filled the batch are not taken.)
            if failure.is_some() || *groups_kept >= self.want {
                return Flow::Abort;
            }
            match score_groups(self.reward, vec![group.to_vec()], self.cfg) {
                Err(e) => {
                    failure = Some(e);
                    return Flow::Abort;
                }
                Ok((flat, rewards, fails)) => {
                    t.failed += fails;
                    if t.first_error.is_none() {
                        t.first_error = flat.iter().find_map(failure_reason);
                    }
                    if t.add_group(&flat, &rewards, true) {
                        for (s, r) in flat.iter().zip(&rewards) {
                            if let Some(r) = r
                                && let Some(mut ts) = TrainSample::from_sample(s, *groups_kept, *r)
                            {
                                t.add_kept(&ts, self.version);
                                if self.cfg.mask_offpolicy_in_partial_rollout {
                                    // The tokens of a continued response from before its last
                                    // continuation do not train (miles' meaning).
                                    let newest = ts.versions.iter().copied().max().unwrap_or(0);
                                    let tokens = ts.loss_mask.iter_mut().zip(&ts.versions);
                                    tokens.filter(|(_, v)| **v < newest).for_each(|(m, _)| *m = 0);
                                }
                                kept.push(ts);
                            }
                        }
                        *groups_kept += 1;
                    }
                }
            }
            if *groups_kept >= self.want { Flow::Abort } else { Flow::Continue }
        })?;
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}

/// What an iteration's rollout counts for slime's `rollout/*` metrics.
#[derive(Default)]
struct Tally {
    rewards: Vec<f32>,
    response_tokens: usize,
    samples: usize,
    truncated: usize,
    /// Groups whose rewards have no spread.
    zero_std: usize,
    failed: usize,
    first_error: Option<String>,
    /// The engine's share of the rollout time (the rest: prompts, rewards, batching).
    generate_time: f64,
    /// Speculative rollouts: verifications, draft tokens proposed and kept (the samples'
    /// `spec_verify_ct`, `spec_draft_token_num`, `spec_accept_token_num`).
    spec: [usize; 3],
    /// Samples the engine aborted once the batch was full.
    aborted: usize,
    /// Kept samples continued from an older policy's partial response, and per kept sample
    /// the versions between its oldest token and the trainer (staleness).
    partial: usize,
    staleness: Vec<u64>,
}

impl Tally {
    /// Counts a kept sample's staleness against the trainer's policy `version`.
    fn add_kept(&mut self, s: &TrainSample, version: u64) {
        let oldest = s.versions.iter().copied().min().unwrap_or(version);
        let stale = version.saturating_sub(oldest);
        self.partial += usize::from(stale > 0);
        self.staleness.push(stale);
    }

    /// Counts a scored group; whether it may be kept (some reward, and under dynamic sampling
    /// some spread).
    fn add_group(&mut self, group: &[Sample], rewards: &[Option<f32>], filter: bool) -> bool {
        self.samples += group.len();
        self.truncated += group.iter().filter(|s| s.status == Status::Truncated).count();
        self.response_tokens += group.iter().map(|s| s.response_length).sum::<usize>();
        for s in group {
            let keys = ["spec_verify_ct", "spec_draft_token_num", "spec_accept_token_num"];
            for (sum, key) in self.spec.iter_mut().zip(keys) {
                *sum +=
                    s.metadata.get(key).and_then(serde_json::Value::as_u64).unwrap_or(0) as usize;
            }
        }
        let live: Vec<f32> = rewards.iter().flatten().copied().collect();
        self.rewards.extend(&live);
        let spread = live.iter().any(|&r| r != live[0]);
        if !spread && !live.is_empty() {
            self.zero_std += 1;
        }
        !live.is_empty() && (spread || !filter)
    }

    /// The metrics, summed over the ranks of a run over several processes.
    fn write(self, record: &mut Record, kept: usize, dist: Option<&Dist>) -> anyhow::Result<()> {
        let mut sums = [
            self.rewards.iter().map(|&x| f64::from(x)).sum::<f64>(),
            self.rewards.len() as f64,
            self.response_tokens as f64,
            self.samples as f64,
            self.truncated as f64,
            self.zero_std as f64,
            self.failed as f64,
            kept as f64,
            self.spec[0] as f64,
            self.spec[1] as f64,
            self.spec[2] as f64,
            self.aborted as f64,
            self.partial as f64,
            self.staleness.iter().sum::<u64>() as f64,
        ];
        if let Some(d) = dist {
            d.sum(&mut sums)?;
        }
        let [
            reward_sum,
            rewards,
            resp_tokens,
            samples_total,
            truncated,
            zero_std,
            failed,
            kept_all,
            verifies,
            drafted,
            accepted,
            aborted,
            partial,
            staleness,
        ] = sums;
        // (Partial rollouts run in one process: the largest staleness is this one's.)
        let stale_max = self.staleness.iter().copied().max().unwrap_or(0);
        record.insert("rollout/aborted".into(), json!(aborted as usize));
        record.insert("rollout/partial_ratio".into(), json!(partial / kept_all.max(1.0)));
        record.insert("rollout/staleness/mean".into(), json!(staleness / kept_all.max(1.0)));
        record.insert("rollout/staleness/max".into(), json!(stale_max));
        if verifies > 0.0 {
            // miles' names: kept drafts per draft, and tokens per verification.
            record.insert("rollout/spec_accept_rate".into(), json!(accepted / drafted.max(1.0)));
            record.insert(
                "rollout/spec_accept_length".into(),
                json!((accepted + verifies) / verifies),
            );
        }
        record.insert("rollout/raw_reward".into(), json!(reward_sum / rewards.max(1.0)));
        record.insert(
            "rollout/response_len/mean".into(),
            json!(resp_tokens / samples_total.max(1.0)),
        );
        record.insert("rollout/truncated_ratio".into(), json!(truncated / samples_total.max(1.0)));
        record.insert("rollout/zero_std/count".into(), json!(zero_std as usize));
        record.insert("rollout/failed".into(), json!(failed as usize));
        // Over several processes, whichever rank saw one (rank 0 logs it).
        let first_error = match dist {
            Some(d) => d.first_on_root(self.first_error.as_deref())?,
            None => self.first_error,
        };
        if let Some(e) = first_error {
            record.insert("rollout/first_error".into(), json!(e));
        }
        record.insert("rollout/samples".into(), json!(kept_all as usize));
        record.insert("perf/rollout_generate_time".into(), json!(self.generate_time));
        record.insert("rollout/generated_tokens".into(), json!(resp_tokens as usize));
        Ok(())
    }
}

/// This rank's part of each optimizer step over several processes (`samples` in the order of
/// their groups' indices in the batch of `groups`, which may be anywhere in it under dynamic
/// sampling): step k takes positions [k·N/steps, (k+1)·N/steps) of the whole batch's N samples,
/// as [`batch::split_ranges`] cuts one process's batch, so dropped samples on any rank move
/// every rank's boundaries as they move one process's.
pub(super) fn step_parts(
    d: &Dist,
    samples: &[TrainSample],
    groups: usize,
    steps: usize,
) -> anyhow::Result<StepParts> {
    let mut counts = vec![0.0; groups];
    for s in samples {
        counts[s.group] += 1.0;
    }
    d.sum(&mut counts)?;
    let mut starts = Vec::with_capacity(groups);
    let mut total = 0;
    for &c in &counts {
        starts.push(total);
        total += c as usize;
    }
    let mut next = 0;
    let positions: Vec<usize> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            if i == 0 || samples[i - 1].group != s.group {
                next = starts[s.group];
            }
            next += 1;
            next - 1
        })
        .collect();
    Ok(batch::split_ranges(total, steps)
        .into_iter()
        .map(|r| {
            positions.partition_point(|&p| p < r.start)..positions.partition_point(|&p| p < r.end)
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_core::{RewardError, RewardValue};

    /// An engine whose responses are given: every group comes back as scripted.
    struct Scripted(Vec<Vec<Sample>>);

    impl Rollout for Scripted {
        fn generate(
            &mut self,
            _: Vec<Vec<Sample>>,
            _: &SamplingParams,
        ) -> miles_core::Result<Vec<Vec<Sample>>> {
            Ok(self.0.clone())
        }

        fn set_weight_version(&mut self, _: u64) {}
    }

    /// Odd samples solve the task.
    struct Odd;

    impl Reward for Odd {
        fn score(&self, s: &Sample) -> Result<RewardValue, RewardError> {
            Ok(RewardValue::Scalar((s.index % 2) as f64))
        }
    }

    /// A group of two: 4 prompt tokens, then a response of 4 whose first 3 tokens came from
    /// policy version 2 and the last from version 3 (continued after a weight sync).
    fn continued_group() -> Vec<Sample> {
        (0..2)
            .map(|i| Sample {
                index: i,
                tokens: (0..8).collect(),
                response_length: 4,
                loss_mask: vec![1; 4],
                rollout_log_probs: vec![-0.5; 4],
                status: Status::Completed,
                weight_version: 3,
                weight_versions: vec![2, 2, 2, 3],
                ..Sample::default()
            })
            .collect()
    }

    /// A continued response keeps its older tokens trainable (corrected against their own
    /// logprobs) unless `--mask-offpolicy-in-partial-rollout`, which masks exactly those; its
    /// staleness is counted against the trainer's version.
    #[test]
    fn older_policies_tokens_are_masked_only_when_asked() {
        for mask in [false, true] {
            let cfg = RunConfig {
                partial_rollout: true,
                mask_offpolicy_in_partial_rollout: mask,
                over_sampling_batch_size: Some(2),
                ..RunConfig::default()
            };
            let keep = Keep { reward: &Odd, cfg: &cfg, want: 1, version: 3 };
            let mut engine = Scripted(vec![continued_group()]);
            let (mut t, mut kept, mut groups_kept) = (Tally::default(), Vec::new(), 0);
            let params = SamplingParams::default();
            let groups = vec![continued_group()];
            keep.stream(&mut engine, groups, &params, &mut t, &mut kept, &mut groups_kept).unwrap();
            assert_eq!((kept.len(), groups_kept), (2, 1));
            let want: Vec<u8> = if mask { vec![0, 0, 0, 1] } else { vec![1; 4] };
            assert!(kept.iter().all(|s| s.loss_mask == want), "mask {mask}");
            assert!(kept.iter().all(|s| s.versions == [2, 2, 2, 3]));
            assert_eq!((t.partial, t.staleness.clone()), (2, vec![1, 1]));
        }
    }
}
