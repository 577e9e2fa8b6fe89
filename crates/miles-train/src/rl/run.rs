//! The loop itself: the iterations from where a run stands to `--num-rollout`.

use std::path::Path;
use std::time::Instant;

use anyhow::Context;
use miles_core::config::RunConfig;
use miles_core::{Advantage, Correction, Quantizer, Reward, Rollout, RoutingReplay};
use miles_data::DataSource;
use miles_model::{Tokenizer, Weights};
use serde_json::{Value, json};

use super::actor::{Actor, Behind, Reference, logprobs_of};
use super::collect::{StepParts, rollout};
use super::eval::{EvalOutcome, EvalSet, evaluate};
use super::metrics::{MetricsLog, Record, StepSums, peak_bf16_flops};
use super::prepare::{OldLogprobs, prepare};
use super::sft::sft_samples;
use super::step::{StepLoss, StepSpec};
use super::{Faults, LoopState, Prefetched, REF_WEIGHTS, Summary};
use crate::batch::{self, TrainSample, split_ranges};
use crate::checkpoint::{self, CheckpointRef};
use crate::dist::Dist;
use crate::loss::{PolicyLossConfig, SftLossConfig};
use crate::schedule::LrSchedule;

/// What an RL (or supervised) run needs besides the policy: settings, data, rewards.
pub(super) struct Run<'a> {
    pub(super) cfg: &'a RunConfig,
    pub(super) tokenizer: &'a Tokenizer,
    pub(super) tokenizer_dir: Option<&'a Path>,
    /// Every how many iterations, on what.
    pub(super) eval: Option<(usize, &'a [EvalSet])>,
    pub(super) reward: &'a dyn Reward,
    pub(super) advantage: &'a dyn Advantage,
    pub(super) correction: Option<&'a dyn Correction>,
    pub(super) replay: Option<&'a dyn RoutingReplay>,
    pub(super) quantizer: Option<&'a dyn Quantizer>,
    pub(super) reference: Option<&'a Reference>,
    pub(super) saved_ref: &'a [&'a str],
    pub(super) config: &'a miles_model::ModelConfig,
    pub(super) total: usize,
    pub(super) steps_per_rollout: usize,
    /// The old logprobs are the optimizer step's own forward's ([`old_logprobs_in_step`]).
    pub(super) old_logprobs_in_step: bool,
    pub(super) schedule: LrSchedule,
    pub(super) faults: Faults,
    pub(super) sft_run: bool,
    pub(super) eos: u32,
    /// The other processes of a run over several (rank 0 logs, evaluates and saves).
    pub(super) dist: Option<&'a Dist>,
    /// `--rollout-backend sglang`: where the policy's weights are written for the servers.
    pub(super) sync_dir: Option<std::path::PathBuf>,
    /// The MTP layer of a DeepSeek-V3 `--hf-checkpoint` in a run without a draft: `--save-hf`
    /// writes it back as it came.
    pub(super) kept_mtp: Option<miles_model::draft::Draft>,
}

/// A checkpoint that a thread of its own is writing (`--async-save`).
pub(super) struct PendingSave {
    iteration: usize,
    dir: std::path::PathBuf,
    thread: std::thread::JoinHandle<checkpoint::Result<std::path::PathBuf>>,
}

/// What the rollout that runs ahead (`--async`) needs, shared with the trainer's thread.
struct Ahead<'a> {
    cfg: &'a RunConfig,
    tokenizer: &'a Tokenizer,
    reward: &'a dyn Reward,
}

impl Ahead<'_> {
    /// Iteration `iteration`'s batch, rolled out by `behind` (one process: no step parts).
    fn rollout(
        &self,
        behind: &mut Behind,
        (data, partial): (&mut DataSource, &mut Vec<Vec<miles_core::Sample>>),
        iteration: usize,
        steps: usize,
    ) -> anyhow::Result<Prefetched> {
        let started = Instant::now();
        let mut record = Record::new();
        let (cfg, tok, reward) = (self.cfg, self.tokenizer, self.reward);
        let engine = &mut behind.rollout();
        let (samples, _) =
            rollout(cfg, engine, tok, data, reward, iteration, &mut record, None, steps, partial)?;
        Ok(Prefetched { samples, record, seconds: started.elapsed().as_secs_f64() })
    }
}

/// Where the loop stands: its state, the data cursor, the metrics log.
pub(super) struct Progress {
    pub(super) state: LoopState,
    pub(super) data: DataSource,
    pub(super) log: MetricsLog,
    pub(super) resumed_from: Option<u64>,
}

impl Run<'_> {
    /// The iterations, from `progress` to `--num-rollout`: collect (rollout and reward),
    /// prepare (old and reference logprobs, correction, advantages), optimizer steps, weight
    /// sync, eval, checkpoint. With `behind` (`--async`) each iteration's steps run beside the
    /// next iteration's rollout on that copy, which then takes the new weights.
    pub(super) fn iterate(
        &self,
        (mut actor, mut behind): (Actor, Option<Behind>),
        progress: Progress,
        observe: &mut dyn FnMut(&Record),
    ) -> anyhow::Result<Summary> {
        let Progress { mut state, mut data, mut log, resumed_from } = progress;
        let mut emit = |log: &mut MetricsLog, record: Record| -> anyhow::Result<()> {
            log.write(&record)?;
            observe(&record);
            Ok(())
        };
        // The policy version is the number of weight syncs so far, one per iteration.
        actor.rollout().set_weight_version(state.iteration as u64);
        self.sync_remote(&actor)?;
        let mut final_eval = None;
        let mut pending = None;
        if state.iteration == 0
            && let Some((_, eval)) = self.eval
        {
            let mut record = Record::new();
            record.insert("step".into(), json!(0));
            final_eval = self.evaluate(&mut actor, eval, &mut record)?;
            emit(&mut log, record)?;
        }
        while state.iteration < self.total {
            let started = Instant::now();
            if let Some(device) = actor.gpu() {
                device.reset_peak_memory()?;
            }
            let mut record = Record::new();
            let k = state.iteration;
            record.insert("step".into(), json!(k + 1));
            let (mut samples, parts, rollout_time) = match state.prefetched.take() {
                // Rolled out one version behind while the last iteration trained.
                Some(p) => {
                    record.extend(p.record);
                    let mut samples = p.samples;
                    self.replay_experts(&mut samples)?;
                    (samples, None, p.seconds)
                }
                None => {
                    let buffers = (&mut data, &mut state.partial);
                    let (samples, parts) = self.collect(&mut actor, buffers, k, &mut record)?;
                    (samples, parts, started.elapsed().as_secs_f64())
                }
            };
            let train_started = Instant::now();
            // `--async`: the next iteration's rollout meanwhile, on the copy one version behind.
            let ahead = behind.as_mut().filter(|_| k + 1 < self.total);
            let mut partial = std::mem::take(&mut state.partial);
            let (trained, prefetched, waited) = std::thread::scope(|scope| {
                let job = ahead.map(|b| {
                    let (data, partial) = (&mut data, &mut partial);
                    let ahead =
                        Ahead { cfg: self.cfg, tokenizer: self.tokenizer, reward: self.reward };
                    let steps = self.steps_per_rollout;
                    scope.spawn(move || ahead.rollout(b, (data, partial), k + 1, steps))
                });
                let trained = (|| {
                    if !self.sft_run {
                        self.prepare(&actor, &mut samples, k as u64, &mut record)?;
                    }
                    self.train(&mut actor, samples.as_slice(), parts, &mut state, &mut record)
                })();
                let wait = Instant::now();
                let prefetched =
                    job.map(|j| j.join().unwrap_or_else(|p| std::panic::resume_unwind(p)));
                (trained, prefetched.transpose(), wait.elapsed().as_secs_f64())
            });
            state.partial = partial;
            trained?;
            state.prefetched = prefetched?;
            let train_time = train_started.elapsed().as_secs_f64() - waited;
            let sync_started = Instant::now();
            actor.weights_updated();
            self.sync_remote(&actor)?;
            actor.rollout().set_weight_version(k as u64 + 1);
            if let Some(b) = behind.as_mut() {
                b.sync(&actor, k as u64 + 1)?;
                record.insert("perf/rollout_wait_time".into(), json!(waited));
            }
            let sync_time = sync_started.elapsed().as_secs_f64();
            state.iteration += 1;
            state.data = data.cursor();
            let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
            let times = [rollout_time, train_time, sync_time];
            self.perf(&actor, &mut record, started, times, tokens)?;
            if let Some((every, eval)) = self.eval
                && (state.iteration % every == 0 || state.iteration == self.total)
            {
                final_eval = self.evaluate(&mut actor, eval, &mut record)?;
            }
            record.insert("perf/step_time".into(), json!(started.elapsed().as_secs_f64()));
            emit(&mut log, record)?;
            self.save(&actor, &state, &mut pending)?;
            if self.faults.abort_after_rollout == Some(state.iteration) {
                std::process::abort();
            }
        }
        self.finish_save(pending.take())?;
        let weights = actor.weights()?;
        if let Some(dir) = self.cfg.save_hf.as_ref().filter(|_| self.root()) {
            let model = actor.model();
            let names = match (model.fp8(), model.int4()) {
                (Some(_), _) => Some(model.fp8_weight_names()),
                (_, Some(_)) => Some(model.int4_weight_names()),
                _ => None,
            };
            let quant = self
                .quantizer
                .zip(names)
                .map(|(quantizer, names)| checkpoint::QuantExport { quantizer, names });
            let draft = actor.draft_parts()?.map(|d| d.draft);
            let mtp = draft.as_ref().or(self.kept_mtp.as_ref());
            let to = (quant.as_ref(), mtp);
            checkpoint::export_hf(dir, self.config, &weights, self.tokenizer_dir, to.0, to.1)
                .with_context(|| format!("--save-hf {}", dir.display()))?;
        }
        Ok(Summary {
            iterations: state.iteration,
            resumed_from,
            final_eval,
            skipped_steps: state.skipped_steps,
            weights,
        })
    }

    /// `--rollout-backend sglang`: the servers load the policy's weights, written for them as
    /// an HF checkpoint in the run directory.
    fn sync_remote(&self, actor: &Actor) -> anyhow::Result<()> {
        let (Some(remote), Some(dir)) = (actor.remote(), &self.sync_dir) else { return Ok(()) };
        let weights = actor.weights()?;
        checkpoint::export_hf(dir, self.config, &weights, self.tokenizer_dir, None, None)
            .with_context(|| format!("the weights for the rollout servers, {}", dir.display()))?;
        Ok(remote.load_weights(dir)?)
    }

    /// Rank 0 of a run over several processes, or the one process: it logs and saves.
    fn root(&self) -> bool {
        self.dist.is_none_or(Dist::root)
    }

    /// Every eval set in turn; the outcome of the first.
    fn evaluate(
        &self,
        actor: &mut Actor,
        sets: &[EvalSet],
        record: &mut Record,
    ) -> anyhow::Result<Option<EvalOutcome>> {
        let (cfg, tok, reward) = (self.cfg, self.tokenizer, self.reward);
        let mut first = None;
        for set in sets {
            let outcome = evaluate(cfg, &mut actor.rollout(), tok, set, reward, record, self.dist)?;
            first.get_or_insert(outcome);
        }
        Ok(first)
    }

    /// Steps 1–2: the iteration's samples (rollout and reward, with dynamic sampling when
    /// over-sampling; an SFT run, `--loss-type sft_loss`, trains on the labels instead, as
    /// slime's SFT rollout does) and their replayed experts; over several processes, also this
    /// rank's part of each step.
    fn collect(
        &self,
        actor: &mut Actor,
        (data, partial): (&mut DataSource, &mut Vec<Vec<miles_core::Sample>>),
        iteration: usize,
        record: &mut Record,
    ) -> anyhow::Result<(Vec<TrainSample>, Option<StepParts>)> {
        let cfg = self.cfg;
        let (mut samples, parts) = if self.sft_run {
            let rows = data.next_batch(cfg.rollout_batch_size);
            // Over several processes, this rank's part of every step's rows.
            let rows = match self.dist {
                Some(d) => {
                    let share =
                        miles_dist::shard(rows.len(), self.steps_per_rollout, d.size, d.rank)?;
                    share.into_iter().map(|i| rows[i].clone()).collect()
                }
                None => rows,
            };
            let source = &data.dataset().source;
            let why = "--loss-type sft_loss";
            (sft_samples(&rows, cfg, self.tokenizer, self.eos, source, why)?, None)
        } else {
            let steps = self.steps_per_rollout;
            let (tok, reward, dist) = (self.tokenizer, self.reward, self.dist);
            let engine = &mut actor.rollout();
            rollout(cfg, engine, tok, data, reward, iteration, record, dist, steps, partial)?
        };
        self.replay_experts(&mut samples)?;
        Ok((samples, parts))
    }

    /// R3: the trainer's forwards use the experts the rollout recorded.
    fn replay_experts(&self, samples: &mut [TrainSample]) -> anyhow::Result<()> {
        if let Some(r) = self.replay {
            for s in samples {
                if let Some(record) = &s.routed_experts {
                    s.replay_experts = Some(r.replay(record, s.tokens.len())?);
                }
            }
        }
        Ok(())
    }

    /// Step 3 (counted in the train time): old and reference logprobs, the off-policy
    /// correction and the advantages.
    fn prepare(
        &self,
        actor: &Actor,
        samples: &mut [TrainSample],
        version: u64,
        record: &mut Record,
    ) -> anyhow::Result<()> {
        let old =
            if self.old_logprobs_in_step { OldLogprobs::InStep } else { OldLogprobs::Separate };
        let (reference, correction, advantage) = (self.reference, self.correction, self.advantage);
        let (cfg, dist) = (self.cfg, self.dist);
        let how = (old, version);
        prepare(cfg, actor, samples, how, reference, correction, advantage, record, dist)
    }

    /// Step 4: the optimizer steps over consecutive slices of the batch, and their metrics.
    fn train(
        &self,
        actor: &mut Actor,
        samples: &[TrainSample],
        parts: Option<StepParts>,
        state: &mut LoopState,
        record: &mut Record,
    ) -> anyhow::Result<()> {
        let cfg = self.cfg;
        let loss_cfg = PolicyLossConfig::from_run_config(cfg);
        loss_cfg.validate()?;
        let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
        let mut sums = StepSums::default();
        let mut forward_logp = Vec::with_capacity(samples.len());
        // Over several processes every rank takes every step (its part may be empty), so the
        // collectives line up.
        let ranges = match (parts, self.dist) {
            (Some(parts), _) => parts,
            // Supervised iterations over several processes: every row is a sample, and each
            // rank holds its equal part of every step's rows.
            (None, Some(_)) => (0..self.steps_per_rollout)
                .map(|i| {
                    let n = samples.len();
                    i * n / self.steps_per_rollout..(i + 1) * n / self.steps_per_rollout
                })
                .collect(),
            (None, None) => split_ranges(samples.len(), self.steps_per_rollout),
        };
        // A step without samples is skipped; over several processes, only one that no rank
        // has samples for (all of them skip it), and a rank left without samples for a
        // step still takes part in its collectives.
        let mut counts: Vec<f64> = ranges.iter().map(|r| r.len() as f64).collect();
        if let Some(d) = self.dist {
            d.sum(&mut counts)?;
        }
        for (range, count) in ranges.into_iter().zip(counts) {
            if count == 0.0 {
                continue;
            }
            state.attempted_steps += 1;
            let nan = self.faults.nan_loss_at_step == Some(state.attempted_steps);
            let lr = self.schedule.at(actor.steps() as usize);
            let kind = if self.sft_run {
                StepLoss::Sft(SftLossConfig::from_run_config(cfg))
            } else {
                StepLoss::Policy(&loss_cfg)
            };
            let t = cfg.rollout_temperature;
            let spec = StepSpec {
                loss: kind,
                temperature: t,
                micro,
                lr,
                inject_nan: nan,
                dist: self.dist,
            };
            let step = actor.train_step(&samples[range], spec)?;
            match step.applied {
                Some(result) => sums.add(&result, lr),
                None => state.skipped_steps += 1,
            }
            forward_logp.extend(step.logp);
        }
        if self.old_logprobs_in_step && !self.sft_run {
            // A skipped step stops at the non-finite loss; the rest of the batch, under the
            // same (unchanged) weights, gets a forward of its own.
            let rest = &samples[forward_logp.len()..];
            if !rest.is_empty() {
                let temperature = cfg.rollout_temperature;
                forward_logp.extend(logprobs_of(actor.model(), rest, temperature, micro)?);
            }
            let per_token = cfg.calculate_per_token_loss;
            let diff = batch::rollout_logprob_abs_diff(samples, &forward_logp, per_token);
            let diff = match self.dist {
                Some(d) => d.mean(diff, batch::aggregation_weight(samples, per_token))?,
                None => diff,
            };
            record.insert("train/train_rollout_logprob_abs_diff".into(), json!(diff));
            let version = state.iteration as u64;
            batch::record_gap_by_staleness(record, samples, &forward_logp, version);
        }
        sums.write(record, cfg.use_tis, cfg.use_opsm);
        record.insert("train/skipped_steps".into(), json!(state.skipped_steps));
        Ok(())
    }

    /// The iteration's `perf/*` figures: phase times, throughput, and on a device its peak
    /// memory and model FLOPs utilization.
    fn perf(
        &self,
        actor: &Actor,
        record: &mut Record,
        started: Instant,
        [rollout_time, train_time, sync_time]: [f64; 3],
        tokens: usize,
    ) -> anyhow::Result<()> {
        record.insert("perf/rollout_time".into(), json!(rollout_time));
        record.insert("perf/train_time".into(), json!(train_time));
        record.insert("perf/update_weights_time".into(), json!(sync_time));
        let generated = record.get("rollout/generated_tokens").and_then(Value::as_f64);
        record.insert(
            "perf/tokens_per_s".into(),
            json!(generated.unwrap_or(0.0) / rollout_time.max(1e-9)),
        );
        let step_seconds = started.elapsed().as_secs_f64();
        record.insert(
            "perf/tokens_per_gpu_per_sec".into(),
            json!(tokens as f64 / step_seconds.max(1e-9)),
        );
        if let Some(device) = actor.gpu() {
            // Forward and backward: 6 FLOPs per active parameter and token, over the peak.
            if let Some(peak) = peak_bf16_flops(&device) {
                let flops = 6.0 * self.config.active_parameters() as f64 * tokens as f64;
                record.insert(
                    "perf/actor_train_mfu".into(),
                    json!(flops / train_time.max(1e-9) / peak),
                );
            }
            let peak = device.peak_memory()? as f64 / (1u64 << 30) as f64;
            record.insert("perf/peak_gpu_memory_gib".into(), json!(peak));
        }
        Ok(())
    }

    /// Waits for the checkpoint a thread is writing (`--async-save`), and handles its failure
    /// as a failed save.
    pub(super) fn finish_save(&self, pending: Option<PendingSave>) -> anyhow::Result<()> {
        let Some(PendingSave { iteration, dir, thread }) = pending else { return Ok(()) };
        match thread.join() {
            Ok(Ok(_)) => Ok(()),
            Ok(Err(e)) => self.save_failed(&dir, iteration, e),
            Err(_) => anyhow::bail!(
                "--save {}: the thread writing iteration {iteration} panicked",
                dir.display()
            ),
        }
    }

    /// A save that failed stops the run, saying which checkpoint stays the latest and how to
    /// go on; with `--continue-on-save-error` it is a warning and training goes on.
    fn save_failed(
        &self,
        dir: &Path,
        iteration: usize,
        e: checkpoint::Error,
    ) -> anyhow::Result<()> {
        let kept = match checkpoint::latest_iteration(dir) {
            Ok(Some(i)) => format!("{} stays the latest checkpoint", checkpoint::iter_dir_name(i)),
            _ => "no earlier checkpoint exists".to_string(),
        };
        let fix = match e {
            checkpoint::Error::NoSpace { .. } => "free space",
            _ => "fix that",
        };
        let what = format!("--save {}: iteration {iteration}: {e}; {kept}", dir.display());
        if self.cfg.continue_on_save_error {
            eprintln!("warning: {what}; training goes on (--continue-on-save-error)");
            return Ok(());
        }
        anyhow::bail!(
            "{what}: {fix}, then run again with --load {} to resume from it, or pass \
             --continue-on-save-error to train on past failed saves",
            dir.display()
        )
    }

    /// A checkpoint when one is due (every `--save-interval` iterations, and the last); over
    /// several processes rank 0 writes it and the others wait for it. The host copies are
    /// taken here; with `--async-save` a thread writes them while training goes on (one save
    /// at a time: the last one is finished first, and at the end of the run).
    fn save(
        &self,
        actor: &Actor,
        state: &LoopState,
        pending: &mut Option<PendingSave>,
    ) -> anyhow::Result<()> {
        let due = self.cfg.save_interval.is_some_and(|k| state.iteration.is_multiple_of(k));
        if let Some(save_dir) = &self.cfg.save
            && self.root()
            && (due || state.iteration == self.total)
        {
            self.finish_save(pending.take())?;
            let reference = match self.reference {
                Some(r) if !self.saved_ref.is_empty() => Some(r.weights()),
                _ => None,
            };
            let state_json = serde_json::to_value(state)?;
            let (weights, optimizer) = actor.checkpoint_parts()?;
            let draft = actor.draft_parts()?;
            let (config, tokenizer_dir) =
                (self.config.clone(), self.tokenizer_dir.map(Path::to_path_buf));
            let iteration = state.iteration;
            let write = move |root: &Path, reference: Option<&Weights>| {
                let extra_ref;
                let extra: &[(&str, &Weights)] = match reference {
                    Some(w) => {
                        extra_ref = [(REF_WEIGHTS, w)];
                        &extra_ref
                    }
                    None => &[],
                };
                let ckpt = CheckpointRef {
                    config: &config,
                    weights: &weights,
                    optimizer: &optimizer,
                    state: &state_json,
                    tokenizer_dir: tokenizer_dir.as_deref(),
                    extra,
                    draft: draft.as_ref(),
                };
                checkpoint::save(root, iteration as u64, &ckpt)
            };
            if self.cfg.async_save {
                let (root, reference) = (save_dir.clone(), reference.cloned());
                let thread = std::thread::Builder::new()
                    .name("miles-save".into())
                    .spawn(move || write(&root, reference.as_ref()))
                    .context("--async-save: cannot start the thread that writes checkpoints")?;
                *pending = Some(PendingSave { iteration, dir: save_dir.clone(), thread });
            } else if let Err(e) = write(save_dir, reference) {
                self.save_failed(save_dir, iteration, e)?;
            }
        }
        if let Some(d) = self.dist {
            // The others wait for rank 0's checkpoint before the next iteration.
            d.barrier()?;
        }
        Ok(())
    }
}
