//! The RL loop: rollout → reward → filter → advantages → optimizer steps → weight sync, with
//! eval, metrics, checkpoints and exact resume.
//!
//! One iteration ("step" in the metrics, slime's rollout id + 1):
//! 1. draw `rollout-batch-size` prompts (`over-sampling-batch-size` with dynamic sampling,
//!    which drops groups whose rewards have zero spread and draws again until the batch is
//!    full), `n-samples-per-prompt` responses each from the embedded engine;
//! 2. score them; a failed reward marks the sample failed: it is counted and left out;
//! 3. old logprobs (the trainer's, or the rollout's with `use-rollout-logprobs`), reference
//!    logprobs for the KL terms, the off-policy correction, the advantages. With one
//!    optimizer step per rollout and nothing that reads the old logprobs before it (no TIS/MIS,
//!    no KL reward shaping), they are the step's own forward's, detached: the policy before
//!    the step is the old policy, so a separate forward would compute the same bits;
//! 4. `num-steps-per-rollout` optimizer steps over consecutive slices of the batch, each
//!    accumulated over micro-batches; a step whose loss or gradient is not finite is skipped
//!    and counted (`train/skipped_steps`);
//! 5. weight sync: the engine repacks the policy it shares with the trainer (one copy of the
//!    weights, updated in place).
//!
//! Every random choice is a function of the seeds and the iteration number (shuffles of
//! `(rollout-seed, epoch)`, rollout draws of `(rollout-seed, iteration, round)`), so a run
//! resumed from a checkpoint (weights, AdamW moments, data cursor, iteration) computes the
//! same bits as one that never stopped.
//!
//! Fault injection for the tests (`MILES_FAULT`, on rank `MILES_FAULT_RANK` only when set):
//! `abort-after-rollout:K` aborts the process after iteration K (and its checkpoint) completes; `nan-loss-at-step:K` replaces the loss of
//! optimizer step K (1-based, counting attempted steps) with NaN; `abort-during-save` is the
//! checkpoint writer's.

use std::borrow::Cow;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use miles_core::config::{LossType, RunConfig};
use miles_core::{
    Advantage, Correction, Reward, Rollout, RoutingReplay, Sample, SamplingParams, Status,
};
use miles_data::{Cursor, DataSource, Dataset, PromptRow};
use miles_model::moe::{RoutingMismatch, SparseOutputs};
use miles_model::{
    DeviceForward, DeviceModel, Forward, Model, PackedBatch, PackedLinears, Tokenizer, Weights,
};
use miles_rollout::{CpuPolicy, DevicePolicy, Engine, EngineConfig, Policy};
use miles_tensor::cpu::{self, AdamW};
use miles_tensor::{DType, Device};
use serde_json::{Map, Value, json};

use crate::Optimizer;
use crate::batch::{self, TrainSample, concat, split_ranges};
use crate::checkpoint::{self, CheckpointRef};
use crate::dist::{Dist, GradBuckets, check_split};
use crate::loss::{LossInput, LossMetrics, PolicyLossConfig, SftLossConfig, policy_loss, sft_loss};
use crate::schedule::LrSchedule;

/// One line of `metrics.jsonl`.
pub type Record = Map<String, Value>;

/// Everything a run needs, assembled by the driver.
pub struct Setup {
    pub config: RunConfig,
    /// The initial policy (from `--hf-checkpoint`, or the demo's).
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Copied into checkpoints so each is a loadable HF model.
    pub tokenizer_dir: Option<PathBuf>,
    pub train_data: Dataset,
    pub eval_data: Option<Dataset>,
    /// Needed unless the run is SFT only (`--loss-type sft_loss` without eval).
    pub reward: Option<Box<dyn Reward>>,
    pub advantage: Box<dyn Advantage>,
    pub correction: Option<Box<dyn Correction>>,
    /// The `r3` plugin, with `--use-rollout-routing-replay`.
    pub replay: Option<Box<dyn RoutingReplay>>,
    pub run_dir: PathBuf,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    pub iterations: usize,
    pub resumed_from: Option<u64>,
    pub final_eval: Option<f64>,
    pub skipped_steps: u64,
    pub weights: Weights,
}

/// Name of the metrics file in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Extra weight set saved with a checkpoint when the reference is not `--hf-checkpoint`.
const REF_WEIGHTS: &str = "ref";

/// The reward of a run that scores nothing (SFT without eval); never called.
struct Unscored;

impl Reward for Unscored {
    fn score(&self, _: &Sample) -> Result<miles_core::RewardValue, miles_core::RewardError> {
        Err(miles_core::RewardError::new("this run has no reward (set --rm-type)"))
    }
}

/// Test-only faults, from `MILES_FAULT`.
#[derive(Debug, Default)]
struct Faults {
    abort_after_rollout: Option<usize>,
    nan_loss_at_step: Option<u64>,
}

impl Faults {
    fn from_env() -> Faults {
        // `MILES_FAULT_RANK=r`: only rank r of a run over several processes has the fault.
        let rank = std::env::var("RANK").unwrap_or_else(|_| "0".into());
        if std::env::var("MILES_FAULT_RANK").is_ok_and(|r| r != rank) {
            return Faults::default();
        }
        let spec = std::env::var("MILES_FAULT").unwrap_or_default();
        let at = |prefix: &str| spec.strip_prefix(prefix).and_then(|n| n.parse().ok());
        Faults {
            abort_after_rollout: at("abort-after-rollout:"),
            nan_loss_at_step: at("nan-loss-at-step:").map(|n: usize| n as u64),
        }
    }
}

/// Mixes seeds and counters into one draw seed (splitmix64 finalizer).
fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Appends records to `metrics.jsonl`, flushing each line, and with `--use-tensorboard` the
/// same numbers as TensorBoard scalars under `<run dir>/tensorboard/`.
struct MetricsLog {
    /// `None` on ranks other than 0 of a run over several processes: rank 0 logs.
    file: Option<std::fs::File>,
    path: PathBuf,
    tensorboard: Option<miles_tensorboard::EventWriter>,
}

/// Where `--use-tensorboard` writes its event files, inside the run directory.
pub const TENSORBOARD_DIR: &str = "tensorboard";

impl MetricsLog {
    /// A fresh log, or on resume from iteration `k` the old one without the records of
    /// iterations after `k` (they are about to be run again). A resumed run's TensorBoard
    /// events go to a new file; TensorBoard drops the old file's points past step `k` when the
    /// new one goes back to it.
    fn open(
        run_dir: &Path,
        resumed_from: Option<u64>,
        tensorboard: bool,
    ) -> anyhow::Result<MetricsLog> {
        std::fs::create_dir_all(run_dir)
            .with_context(|| format!("--run-dir: cannot create {}", run_dir.display()))?;
        let path = run_dir.join(METRICS_FILE);
        let mut kept = String::new();
        if let (Some(k), Ok(text)) = (resumed_from, std::fs::read_to_string(&path)) {
            for line in text.lines() {
                let Ok(record) = serde_json::from_str::<Record>(line) else { continue };
                let sft = record.get("phase").is_some();
                let step = record.get("step").and_then(Value::as_u64).unwrap_or(0);
                if sft || step <= k {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        std::fs::write(&path, kept).with_context(|| format!("cannot write {}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let tensorboard = match tensorboard {
            true => Some(miles_tensorboard::EventWriter::create(&run_dir.join(TENSORBOARD_DIR))?),
            false => None,
        };
        Ok(MetricsLog { file: Some(file), path, tensorboard })
    }

    /// A log that writes nothing (a rank other than 0).
    fn silent(run_dir: &Path) -> MetricsLog {
        MetricsLog { file: None, path: run_dir.join(METRICS_FILE), tensorboard: None }
    }

    fn write(&mut self, record: &Record) -> anyhow::Result<()> {
        let Some(file) = self.file.as_mut() else { return Ok(()) };
        let line = serde_json::to_string(record)?;
        writeln!(file, "{line}")
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        if let Some(tb) = &mut self.tensorboard {
            // Every number but the step itself, at the record's step (SFT warm-up records
            // carry theirs in `step` too).
            let step = record.get("step").and_then(Value::as_i64).unwrap_or(0);
            let scalars: Vec<(&str, f64)> = record
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)))
                .collect();
            tb.write_scalars(step, miles_tensorboard::wall_time_now(), &scalars)?;
        }
        Ok(())
    }
}

/// The loop's state that a checkpoint carries besides weights and optimizer.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct LoopState {
    /// Iterations done.
    iteration: usize,
    data: Cursor,
    skipped_steps: u64,
    attempted_steps: u64,
    rollout_seed: u64,
    rollout_shuffle: bool,
}

/// Trains per `setup.config`; `observe` sees every record as it is written.
pub fn train(setup: Setup, observe: &mut dyn FnMut(&Record)) -> anyhow::Result<Summary> {
    let Setup {
        config: cfg,
        mut model,
        tokenizer,
        tokenizer_dir,
        train_data,
        eval_data,
        reward,
        advantage,
        correction,
        replay,
        run_dir,
    } = setup;
    cfg.validate()?;
    if cfg.use_tis && correction.is_none() {
        bail!("--use-tis: this binary has no `tis` correction plugin (build with --features tis)");
    }
    let eval_every = cfg.eval_interval.filter(|_| eval_data.is_some());
    let sft_run = cfg.loss_type == LossType::SftLoss;
    let reward: Box<dyn Reward> = match reward {
        Some(r) => r,
        None if sft_run && eval_every.is_none() => Box::new(Unscored),
        None => bail!(
            "--rm-type: say how to score responses (e.g. --rm-type math, --rm-url URL for a \
             reward server, or --custom-rm-path LIB); `miles plugins` lists the rewards"
        ),
    };
    let device: Device = cfg.device.parse().map_err(|e| anyhow!("--device: {e}"))?;
    let faults = Faults::from_env();
    let total = total_iterations(&cfg, train_data.len())?;
    let steps_per_rollout = steps_per_rollout(&cfg)?;
    let dist = Dist::join(cfg.distributed_backend)?;
    if let Some(d) = &dist {
        check_split(&cfg, d.size, steps_per_rollout)?;
    }
    let device = dist.as_ref().map_or(device, |d| d.device(device, &cfg.device));
    if device != Device::Cpu {
        device.ensure_available().with_context(|| format!("--device {}", cfg.device))?;
    }
    if cfg.partial_rollout {
        bail!(
            "--partial-rollout: not supported by the loop yet (the engine resumes aborted samples)"
        );
    }
    if cfg.use_rollout_routing_replay && replay.is_none() {
        bail!(
            "--use-rollout-routing-replay: this binary has no `r3` plugin (build with --features \
             r3)"
        );
    }
    if cfg.use_rollout_routing_replay && model.config.moe.is_none() {
        bail!(
            "--use-rollout-routing-replay: replays a mixture-of-experts policy's routing; {} \
             has no experts",
            model.config.architecture.hf_class()
        );
    }
    if let Some(coef) = cfg.router_aux_loss_coef {
        let arch = model.config.architecture.hf_class();
        let Some(moe) = model.config.moe.as_mut() else {
            bail!("--router-aux-loss-coef: the policy ({arch}) has no experts");
        };
        if coef.is_nan() || coef < 0.0 {
            bail!("--router-aux-loss-coef: {coef} must be a number ≥ 0");
        }
        moe.router_aux_loss_coef = coef;
    }
    let hyper = adamw(&cfg, cfg.lr);
    let schedule = LrSchedule::from_run_config(&cfg, total * steps_per_rollout);
    let config = model.config.clone();
    let eos = eos_id(&model, &tokenizer)?;

    let needs_ref = cfg.use_kl_loss || cfg.kl_coef != 0.0;
    // With a warm-up the reference is the warmed-up policy, saved beside each checkpoint.
    let saved_ref: &[&str] =
        if needs_ref && cfg.sft_warmup_steps > 0 { &[REF_WEIGHTS] } else { &[] };

    // Resume, or start fresh (with the SFT warm-up).
    let loaded = match &cfg.load {
        Some(root) if checkpoint::latest_iteration(root)?.is_some() => {
            Some(checkpoint::load(root, hyper, f64::from(cfg.clip_grad), saved_ref)?)
        }
        _ => None,
    };
    let resumed_from = loaded.as_ref().map(|l| l.iteration);
    let root = dist.as_ref().is_none_or(Dist::root);
    let mut log = if root {
        MetricsLog::open(&run_dir, resumed_from, cfg.use_tensorboard)?
    } else {
        MetricsLog::silent(&run_dir)
    };
    let mut data = DataSource::new(train_data, cfg.rollout_shuffle, cfg.rollout_seed)?;
    // The frozen reference is the policy RL starts from: the initial model, or the warmed-up
    // one (then saved with each checkpoint).
    let (policy, optimizer, state, reference) = match loaded {
        Some(l) => {
            let state = resume_state(&l, &config, &cfg, &mut data)?;
            let saved = l.extra.into_iter().find(|(n, _)| n == REF_WEIGHTS).map(|(_, w)| w);
            let reference = needs_ref.then(|| saved.unwrap_or(model.weights));
            (Model::new(config.clone(), l.weights), l.optimizer, state, reference)
        }
        None => {
            let mut policy = model;
            if cfg.sft_warmup_steps > 0 {
                // On the host, before the policy moves to its device.
                sft_warmup(&cfg, &mut policy, &tokenizer, eos, &data, &mut |r| {
                    log.write(&r)?;
                    observe(&r);
                    Ok(())
                })?;
            }
            let optimizer = Optimizer::new(&config, hyper, f64::from(cfg.clip_grad));
            let state = LoopState {
                rollout_seed: cfg.rollout_seed,
                rollout_shuffle: cfg.rollout_shuffle,
                ..LoopState::default()
            };
            let reference = needs_ref.then(|| policy.weights.clone());
            (policy, optimizer, state, reference)
        }
    };
    // A test hook: the GPU loop's actor on host tensors, so CI runs its code.
    let device_on_host = std::env::var_os("MILES_DEVICE_ACTOR_ON_HOST").is_some();
    let on_device = device != Device::Cpu || device_on_host;
    let reference = match reference {
        Some(weights) => Some(Reference::new(&config, weights, on_device.then_some(device))?),
        None => None,
    };
    let engine_config = EngineConfig {
        kv_cache_bytes: cfg.rollout_kv_cache_mb.saturating_mul(1 << 20),
        max_running: cfg.rollout_max_running,
        max_prompt_len: cfg.rollout_max_prompt_len,
        ..EngineConfig::default()
    };
    // A test hook: the separate old-logprob forward even where the step's own would do, to
    // show both give the same bits.
    let separate_old = std::env::var_os("MILES_SEPARATE_OLD_LOGPROBS").is_some();
    let old_logprobs_in_step = !separate_old && old_logprobs_in_step(&cfg, steps_per_rollout);
    let run = Run {
        cfg: &cfg,
        tokenizer: &tokenizer,
        tokenizer_dir: tokenizer_dir.as_deref(),
        eval: eval_every.zip(eval_data.as_ref()),
        reward: reward.as_ref(),
        advantage: advantage.as_ref(),
        correction: correction.as_deref(),
        replay: replay.as_deref(),
        reference: reference.as_ref(),
        saved_ref,
        config: &config,
        total,
        steps_per_rollout,
        old_logprobs_in_step,
        schedule,
        faults,
        sft_run,
        eos,
        dist: dist.as_ref(),
    };
    let progress = Progress { state, data, log, resumed_from };
    if !on_device {
        // The engine holds the one copy of the policy; the trainer updates it in place.
        let engine = Engine::new(policy, Some(tokenizer.clone()), engine_config)?;
        run.iterate(CpuActor { engine, optimizer }, progress, observe)
    } else {
        let actor = DeviceActor::new(
            &policy,
            &optimizer,
            device,
            &cfg,
            (engine_config, &tokenizer),
            dist.as_ref(),
        )?;
        drop(policy);
        run.iterate(actor, progress, observe)
    }
}

/// AdamW's settings of the run at learning rate `lr`.
fn adamw(cfg: &RunConfig, lr: f32) -> AdamW {
    AdamW {
        lr,
        beta1: cfg.adam_beta1,
        beta2: cfg.adam_beta2,
        eps: cfg.adam_eps,
        weight_decay: cfg.weight_decay,
    }
}

/// The loop state of checkpoint `l`, checked against this run (same model, same data order),
/// with the data source moved to where the checkpoint left it.
fn resume_state(
    l: &checkpoint::Loaded,
    config: &miles_model::ModelConfig,
    cfg: &RunConfig,
    data: &mut DataSource,
) -> anyhow::Result<LoopState> {
    let at = l.dir.display();
    let state: LoopState = serde_json::from_value(l.state.clone())
        .with_context(|| format!("{at}: trainer_state.json is not this version's loop state"))?;
    if &l.config != config {
        bail!("--load {at}: the checkpoint's config.json is another model than this run's");
    }
    if (state.rollout_seed, state.rollout_shuffle) != (cfg.rollout_seed, cfg.rollout_shuffle) {
        bail!(
            "--load {at}: the run was started with --rollout-seed {} and rollout-shuffle {}; \
             resume with the same (or start a new run from its weights)",
            state.rollout_seed,
            state.rollout_shuffle
        );
    }
    data.restore(state.data).with_context(|| format!("{at}: data cursor"))?;
    Ok(state)
}

/// The frozen KL reference: on the host, or beside the policy on its device.
enum Reference {
    Host(Model, PackedLinears),
    /// The device model, and its weights on the host for checkpoints.
    Device(Box<DeviceModel>, Weights),
}

impl Reference {
    /// `weights` as the reference, on `device` when the run's policy is on one.
    fn new(
        config: &miles_model::ModelConfig,
        weights: Weights,
        device: Option<Device>,
    ) -> anyhow::Result<Reference> {
        let model = Model::new(config.clone(), weights);
        Ok(match device {
            None => {
                let packed = PackedLinears::new(&model)?;
                Reference::Host(model, packed)
            }
            Some(d) => {
                let dtype = if d == Device::Cpu { DType::F32 } else { DType::BF16 };
                let dm = DeviceModel::new(&model, &d, dtype)?;
                Reference::Device(Box::new(dm), model.weights)
            }
        })
    }

    fn weights(&self) -> &Weights {
        match self {
            Reference::Host(m, _) => &m.weights,
            Reference::Device(_, w) => w,
        }
    }

    fn logprobs(
        &self,
        samples: &[TrainSample],
        temperature: f32,
        micro: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        Ok(match self {
            Reference::Host(m, p) => batch::logprobs(m, p, samples, temperature, micro)?,
            Reference::Device(dm, _) => {
                batch::logprobs_by(samples, micro, |b| Ok(dm.logprobs(b, temperature)?.0))?
            }
        })
    }
}

/// What an RL (or supervised) run needs besides the policy: settings, data, rewards.
struct Run<'a> {
    cfg: &'a RunConfig,
    tokenizer: &'a Tokenizer,
    tokenizer_dir: Option<&'a Path>,
    /// Every how many iterations, on what.
    eval: Option<(usize, &'a Dataset)>,
    reward: &'a dyn Reward,
    advantage: &'a dyn Advantage,
    correction: Option<&'a dyn Correction>,
    replay: Option<&'a dyn RoutingReplay>,
    reference: Option<&'a Reference>,
    saved_ref: &'a [&'a str],
    config: &'a miles_model::ModelConfig,
    total: usize,
    steps_per_rollout: usize,
    /// The old logprobs are the optimizer step's own forward's ([`old_logprobs_in_step`]).
    old_logprobs_in_step: bool,
    schedule: LrSchedule,
    faults: Faults,
    sft_run: bool,
    eos: u32,
    /// The other processes of a run over several (rank 0 logs, evaluates and saves).
    dist: Option<&'a Dist>,
}

/// Where the loop stands: its state, the data cursor, the metrics log.
struct Progress {
    state: LoopState,
    data: DataSource,
    log: MetricsLog,
    resumed_from: Option<u64>,
}

impl Run<'_> {
    /// The iterations, from `progress` to `--num-rollout`: rollout, reward, old logprobs and
    /// advantages, optimizer steps, weight sync, eval, checkpoint.
    fn iterate<A: Actor>(
        &self,
        mut actor: A,
        progress: Progress,
        observe: &mut dyn FnMut(&Record),
    ) -> anyhow::Result<Summary> {
        let cfg = self.cfg;
        let Progress { mut state, mut data, mut log, resumed_from } = progress;
        let mut emit = |log: &mut MetricsLog, record: Record| -> anyhow::Result<()> {
            log.write(&record)?;
            observe(&record);
            Ok(())
        };
        // The policy version is the number of weight syncs so far, one per iteration.
        actor.engine().set_weight_version(state.iteration as u64);
        let loss_cfg = PolicyLossConfig::from_run_config(cfg);
        loss_cfg.validate()?;
        let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
        let mut final_eval = None;

        let root = self.dist.is_none_or(Dist::root);
        if state.iteration == 0
            && let Some((_, eval)) = self.eval
        {
            let mut record = Record::new();
            record.insert("step".into(), json!(0));
            let (tok, reward) = (self.tokenizer, self.reward);
            let score = evaluate(cfg, actor.engine(), tok, eval, reward, &mut record, self.dist)?;
            final_eval = Some(score);
            emit(&mut log, record)?;
        }

        while state.iteration < self.total {
            let started = Instant::now();
            if let Some(device) = actor.device() {
                device.reset_peak_memory()?;
            }
            let mut record = Record::new();
            record.insert("step".into(), json!(state.iteration + 1));

            // 1–2. Rollout and reward, with dynamic sampling when over-sampling; an SFT run
            // (`--loss-type sft_loss`) trains on the labels instead, as slime's SFT rollout does.
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
                let samples = sft_samples(
                    &rows,
                    cfg,
                    self.tokenizer,
                    self.eos,
                    source,
                    "--loss-type sft_loss",
                )?;
                (samples, None)
            } else {
                rollout(
                    cfg,
                    actor.engine(),
                    self.tokenizer,
                    &mut data,
                    self.reward,
                    state.iteration,
                    &mut record,
                    self.dist,
                    self.steps_per_rollout,
                )?
            };
            if let Some(r) = self.replay {
                // R3: the trainer's forwards use the experts the rollout recorded.
                for s in &mut samples {
                    if let Some(record) = &s.routed_experts {
                        s.replay_experts = Some(r.replay(record, s.tokens.len())?);
                    }
                }
            }
            let rollout_time = started.elapsed().as_secs_f64();
            let train_started = Instant::now();
            if !self.sft_run {
                let old = if self.old_logprobs_in_step {
                    OldLogprobs::InStep
                } else {
                    OldLogprobs::Separate
                };
                prepare(
                    cfg,
                    &actor,
                    &mut samples,
                    old,
                    self.reference,
                    self.correction,
                    self.advantage,
                    &mut record,
                    self.dist,
                )?;
            }

            // 4. Optimizer steps over consecutive slices of the batch.
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
                let part = &samples[range];
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
                let step = actor.train_step(
                    part,
                    kind,
                    cfg.rollout_temperature,
                    micro,
                    lr,
                    nan,
                    self.dist,
                )?;
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
                    forward_logp.extend(actor.logprobs(rest, cfg.rollout_temperature, micro)?);
                }
                let per_token = cfg.calculate_per_token_loss;
                let diff = batch::rollout_logprob_abs_diff(&samples, &forward_logp, per_token);
                let diff = match self.dist {
                    Some(d) => d.mean(diff, batch::aggregation_weight(&samples, per_token))?,
                    None => diff,
                };
                record.insert("train/train_rollout_logprob_abs_diff".into(), json!(diff));
            }
            sums.write(&mut record, cfg.use_tis, cfg.use_opsm);
            record.insert("train/skipped_steps".into(), json!(state.skipped_steps));
            let train_time = train_started.elapsed().as_secs_f64();

            // 5. Weight sync: the optimizer updated the engine's own weights.
            let sync_started = Instant::now();
            actor.weights_updated()?;
            let sync_time = sync_started.elapsed().as_secs_f64();
            state.iteration += 1;
            state.data = data.cursor();

            record.insert("perf/rollout_time".into(), json!(rollout_time));
            record.insert("perf/train_time".into(), json!(train_time));
            record.insert("perf/update_weights_time".into(), json!(sync_time));
            let generated = record.get("rollout/generated_tokens").and_then(Value::as_f64);
            record.insert(
                "perf/tokens_per_s".into(),
                json!(generated.unwrap_or(0.0) / rollout_time.max(1e-9)),
            );
            let tokens: usize = samples.iter().map(|s| s.tokens.len()).sum();
            let step_seconds = started.elapsed().as_secs_f64();
            record.insert(
                "perf/tokens_per_gpu_per_sec".into(),
                json!(tokens as f64 / step_seconds.max(1e-9)),
            );
            if let Some(device) = actor.device() {
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
            if let Some((every, eval)) = self.eval
                && (state.iteration % every == 0 || state.iteration == self.total)
            {
                let (tok, reward) = (self.tokenizer, self.reward);
                let score =
                    evaluate(cfg, actor.engine(), tok, eval, reward, &mut record, self.dist)?;
                final_eval = Some(score);
            }
            record.insert("perf/step_time".into(), json!(started.elapsed().as_secs_f64()));
            emit(&mut log, record)?;

            let due = cfg.save_interval.is_some_and(|k| state.iteration.is_multiple_of(k));
            if let Some(save_dir) = &cfg.save
                && root
                && (due || state.iteration == self.total)
            {
                let extra_ref;
                let extra: &[(&str, &Weights)] = match self.reference {
                    Some(r) if !self.saved_ref.is_empty() => {
                        extra_ref = [(REF_WEIGHTS, r.weights())];
                        &extra_ref
                    }
                    _ => &[],
                };
                let state_json = serde_json::to_value(&state)?;
                let (weights, optimizer) = actor.checkpoint_parts()?;
                checkpoint::save(
                    save_dir,
                    state.iteration as u64,
                    &CheckpointRef {
                        config: self.config,
                        weights: &weights,
                        optimizer: &optimizer,
                        state: &state_json,
                        tokenizer_dir: self.tokenizer_dir,
                        extra,
                    },
                )
                .with_context(|| format!("--save {}", save_dir.display()))?;
            }
            if let Some(d) = self.dist {
                // The others wait for rank 0's checkpoint before the next iteration.
                d.barrier()?;
            }
            if self.faults.abort_after_rollout == Some(state.iteration) {
                std::process::abort();
            }
        }
        let weights = actor.into_weights()?;
        if let Some(dir) = cfg.save_hf.as_ref().filter(|_| root) {
            checkpoint::export_hf(dir, self.config, &weights, self.tokenizer_dir)
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
}

/// A mixture of experts' load-balancing loss weight (0 for a dense model).
fn aux_coef(c: &miles_model::ModelConfig) -> f64 {
    c.moe.as_ref().map_or(0.0, |m| f64::from(m.router_aux_loss_coef))
}

/// Dense bf16 tensor-core FLOP/s of the device's chip, where known (for the MFU metric).
fn peak_bf16_flops(device: &Device) -> Option<f64> {
    let name = device.name().ok()?;
    ["H100", "H200", "H800", "GH200"].iter().any(|n| name.contains(n)).then_some(989e12)
}

/// Where the policy lives during a run: the rollout engine over it and the trainer that
/// updates it in place, so one copy of the weights serves both (zero-copy weight sync).
trait Actor {
    type P: Policy;
    fn engine(&mut self) -> &mut Engine<Self::P>;
    /// Each sample's response logprobs under the current weights, `micro` samples per forward.
    fn logprobs(
        &self,
        samples: &[TrainSample],
        temperature: f32,
        micro: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>>;
    /// One optimizer step over `part` ([`train_step`]).
    #[allow(clippy::too_many_arguments)]
    fn train_step(
        &mut self,
        part: &[TrainSample],
        loss: StepLoss,
        temperature: f32,
        micro: usize,
        lr: f32,
        inject_nan: bool,
        dist: Option<&Dist>,
    ) -> anyhow::Result<StepOutcome>;
    /// Optimizer steps taken (the learning-rate schedule's position).
    fn steps(&self) -> u64;
    /// After an iteration's steps: the engine generates with the new weights from now on.
    fn weights_updated(&mut self) -> anyhow::Result<()>;
    /// The weights and optimizer state for a checkpoint, on the host.
    fn checkpoint_parts(&self) -> anyhow::Result<(Cow<'_, Weights>, Cow<'_, Optimizer>)>;
    fn into_weights(self) -> anyhow::Result<Weights>;
    /// The device of a device actor, for the memory and MFU figures; `None` for the CPU's.
    fn device(&self) -> Option<Device>;
}

/// The CPU: the engine's `Model` with the host AdamW.
struct CpuActor {
    engine: Engine,
    optimizer: Optimizer,
}

impl Actor for CpuActor {
    type P = CpuPolicy;

    fn engine(&mut self) -> &mut Engine {
        &mut self.engine
    }

    fn logprobs(
        &self,
        samples: &[TrainSample],
        temperature: f32,
        micro: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let (m, p) = (self.engine.model(), self.engine.packed());
        Ok(batch::logprobs(m, p, samples, temperature, micro)?)
    }

    fn train_step(
        &mut self,
        part: &[TrainSample],
        loss: StepLoss,
        temperature: f32,
        micro: usize,
        lr: f32,
        inject_nan: bool,
        dist: Option<&Dist>,
    ) -> anyhow::Result<StepOutcome> {
        let mut learner = CpuLearner::new(self.engine.policy_mut(), &mut self.optimizer)?;
        train_step(&mut learner, part, loss, temperature, micro, lr, inject_nan, dist)
    }

    fn steps(&self) -> u64 {
        self.optimizer.steps()
    }

    fn weights_updated(&mut self) -> anyhow::Result<()> {
        // Repacks the linears the engine's forward reads.
        Ok(self.engine.weights_updated()?)
    }

    fn checkpoint_parts(&self) -> anyhow::Result<(Cow<'_, Weights>, Cow<'_, Optimizer>)> {
        Ok((Cow::Borrowed(&self.engine.model().weights), Cow::Borrowed(&self.optimizer)))
    }

    fn into_weights(self) -> anyhow::Result<Weights> {
        Ok(self.engine.into_model().weights)
    }

    fn device(&self) -> Option<Device> {
        None
    }
}

/// A GPU: the engine's `DeviceModel` (f32 masters, bf16 compute copies, gradients and AdamW
/// moments all there), trained in place; its KV cache is allocated beside it once.
struct DeviceActor {
    engine: Engine<DevicePolicy>,
    hyper: AdamW,
    clip: f64,
    device: Device,
}

impl DeviceActor {
    /// `policy` (and the optimizer state of a resumed run) on `device`, with the rollout
    /// engine's KV cache; prints the memory plan, and fails naming the flag when the cache
    /// does not fit.
    fn new(
        policy: &Model,
        optimizer: &Optimizer,
        device: Device,
        cfg: &RunConfig,
        (engine_config, tokenizer): (EngineConfig, &Tokenizer),
        dist: Option<&Dist>,
    ) -> anyhow::Result<Self> {
        // bf16 on a GPU; f32 where the device loop runs on host tensors (a test).
        let dtype = if device == Device::Cpu { DType::F32 } else { DType::BF16 };
        let mut dm = DeviceModel::new(policy, &device, dtype)?;
        if let Some(d) = dist {
            d.broadcast_weights(&mut dm)?;
        }
        if optimizer.steps() > 0 {
            let (m, v) = optimizer.moments();
            dm.set_moments(m, v, optimizer.steps())?;
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let kv = engine_config.kv_cache_bytes as u64;
        if let Some((free, total)) = device.memory_info()? {
            eprintln!(
                "memory plan on {device}: model, gradients and AdamW state {:.2} GiB in use, \
                 KV cache {:.2} GiB (--rollout-kv-cache-mb), {:.2} GiB free of {:.2} GiB before \
                 it; training activations come from what is left",
                gib(total - free),
                gib(kv),
                gib(free),
                gib(total)
            );
            if kv > free {
                bail!(
                    "--rollout-kv-cache-mb {}: the KV cache needs {:.2} GiB and {device} has \
                     {:.2} GiB free beside the model; lower it",
                    cfg.rollout_kv_cache_mb,
                    gib(kv),
                    gib(free)
                );
            }
        }
        let engine = Engine::on_device(dm, Some(tokenizer.clone()), engine_config)?;
        Ok(DeviceActor {
            engine,
            hyper: adamw(cfg, cfg.lr),
            clip: f64::from(cfg.clip_grad),
            device,
        })
    }
}

impl Actor for DeviceActor {
    type P = DevicePolicy;

    fn engine(&mut self) -> &mut Engine<DevicePolicy> {
        &mut self.engine
    }

    fn logprobs(
        &self,
        samples: &[TrainSample],
        temperature: f32,
        micro: usize,
    ) -> anyhow::Result<Vec<Vec<f32>>> {
        let dm = self.engine.device_model();
        Ok(batch::logprobs_by(samples, micro, |b| Ok(dm.logprobs(b, temperature)?.0))?)
    }

    fn train_step(
        &mut self,
        part: &[TrainSample],
        loss: StepLoss,
        temperature: f32,
        micro: usize,
        lr: f32,
        inject_nan: bool,
        dist: Option<&Dist>,
    ) -> anyhow::Result<StepOutcome> {
        let dm = self.engine.device_model_mut();
        let mut learner = DeviceLearner::new(dm, self.hyper, self.clip)?;
        train_step(&mut learner, part, loss, temperature, micro, lr, inject_nan, dist)
    }

    fn steps(&self) -> u64 {
        self.engine.device_model().steps()
    }

    fn weights_updated(&mut self) -> anyhow::Result<()> {
        // AdamW refreshed the bf16 copies the engine reads, in place: nothing to move.
        self.engine.device_weights_updated();
        Ok(())
    }

    fn checkpoint_parts(&self) -> anyhow::Result<(Cow<'_, Weights>, Cow<'_, Optimizer>)> {
        let dm = self.engine.device_model();
        let config = &dm.config;
        let optimizer = match dm.moments_to_host()? {
            Some((m, v, steps)) => {
                Optimizer::from_state(config, self.hyper, self.clip, m, v, steps)?
            }
            None => Optimizer::new(config, self.hyper, self.clip),
        };
        Ok((Cow::Owned(dm.to_weights()?), Cow::Owned(optimizer)))
    }

    fn into_weights(self) -> anyhow::Result<Weights> {
        Ok(self.engine.device_model().to_weights()?)
    }

    fn device(&self) -> Option<Device> {
        Some(self.device)
    }
}

/// Where an iteration's old logprobs come from.
#[derive(Clone, Copy, PartialEq)]
enum OldLogprobs {
    /// A forward of their own before the steps.
    Separate,
    /// The optimizer step's forward ([`old_logprobs_in_step`]).
    InStep,
}

/// Whether the old logprobs can be the optimizer step's own forward's, detached, instead of a
/// separate forward's: with one step per rollout the weights before it are the old policy, and
/// nothing may read the old logprobs before the step (TIS/MIS weights, KL reward shaping), nor
/// replace them (`--use-rollout-logprobs`). The bits are the same; one forward fewer.
fn old_logprobs_in_step(cfg: &RunConfig, steps_per_rollout: usize) -> bool {
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
fn prepare<A: Actor>(
    cfg: &RunConfig,
    actor: &A,
    samples: &mut [TrainSample],
    old: OldLogprobs,
    reference: Option<&Reference>,
    correction: Option<&dyn Correction>,
    advantage: &dyn Advantage,
    record: &mut Record,
    dist: Option<&Dist>,
) -> anyhow::Result<()> {
    let temperature = cfg.rollout_temperature;
    let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
    if old == OldLogprobs::Separate {
        let trainer = actor.logprobs(samples, temperature, micro)?;
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
    }
    if let Some(r) = reference {
        let refs = r.logprobs(samples, temperature, micro)?;
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

/// `--num-rollout`, or enough iterations for `--num-epoch` passes over the data.
pub fn total_iterations(cfg: &RunConfig, rows: usize) -> anyhow::Result<usize> {
    match (cfg.num_rollout, cfg.num_epoch) {
        (Some(n), _) => Ok(n),
        (None, Some(e)) => Ok(miles_data::num_rollouts_for_epochs(rows, e, cfg.rollout_batch_size)),
        (None, None) => bail!("--num-rollout: say how long to train (or give --num-epoch)"),
    }
}

/// Optimizer steps per rollout: `rollout-batch-size × n-samples-per-prompt / global-batch-size`
/// when a global batch is given, else `num-steps-per-rollout`.
fn steps_per_rollout(cfg: &RunConfig) -> anyhow::Result<usize> {
    let Some(g) = cfg.global_batch_size else { return Ok(cfg.num_steps_per_rollout) };
    let per_prompt = if cfg.loss_type == LossType::SftLoss { 1 } else { cfg.n_samples_per_prompt };
    let steps = (cfg.rollout_batch_size * per_prompt / g).max(1);
    if cfg.num_steps_per_rollout != 1 && cfg.num_steps_per_rollout != steps {
        bail!(
            "--num-steps-per-rollout: {} disagrees with --global-batch-size {g}, which means {steps} \
             steps per rollout; give one of the two",
            cfg.num_steps_per_rollout
        );
    }
    Ok(steps)
}

fn eos_id(model: &Model, tok: &Tokenizer) -> anyhow::Result<u32> {
    if let Some(&id) = model.config.eos_token_ids.first() {
        return Ok(id);
    }
    tok.eos_token().and_then(|e| tok.token_to_id(e)).ok_or_else(|| {
        anyhow!("the model has no eos_token_id in config.json and the tokenizer no eos_token")
    })
}

/// Prompt rows as pending samples, `n` per prompt, tokenized.
fn make_groups(
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

/// Scores every sample in place: `reward` set, or status failed with the reason in metadata.
/// Returns the scalar reward per sample (`None` for failures) and the failure count.
fn score(
    reward: &dyn Reward,
    samples: &mut [Sample],
    cfg: &RunConfig,
) -> (Vec<Option<f32>>, usize) {
    let results = miles_rewards::score_all(reward, samples, cfg.group_rm);
    let mut failures = 0;
    let scalars = samples
        .iter_mut()
        .zip(results)
        .map(|(s, r)| {
            if s.status == Status::Failed {
                failures += 1;
                return None;
            }
            let value = r.and_then(|v| {
                let x = v.scalar(cfg.reward_key.as_deref())?;
                s.reward = Some(v);
                if x.is_finite() {
                    Ok(x as f32)
                } else {
                    Err(miles_core::RewardError::new(format!("the reward is {x}")))
                }
            });
            match value {
                Ok(x) => Some(x),
                Err(e) => {
                    failures += 1;
                    s.status = Status::Failed;
                    if !s.metadata.is_object() {
                        s.metadata = json!({});
                    }
                    s.metadata["reward_error"] = e.to_string().into();
                    None
                }
            }
        })
        .collect();
    (scalars, failures)
}

/// Why a sample failed, from its metadata (the engine's or the reward's reason).
fn failure_reason(s: &Sample) -> Option<String> {
    if s.status != Status::Failed {
        return None;
    }
    let m = &s.metadata;
    let reason = m.get("reward_error").or_else(|| m.get("rollout_error"))?;
    Some(reason.as_str().map_or_else(|| reason.to_string(), String::from))
}

/// Scores a generation's groups in one call (so a reward server sees the whole batch); the
/// samples come back flat, in group order, with their rewards. A reward that can score no more
/// ([`Reward::fatal`]) stops the run.
fn score_groups(
    reward: &dyn Reward,
    groups: Vec<Vec<Sample>>,
    cfg: &RunConfig,
) -> anyhow::Result<(Vec<Sample>, Vec<Option<f32>>, usize)> {
    let mut flat: Vec<Sample> = groups.into_iter().flatten().collect();
    let (rewards, failed) = score(reward, &mut flat, cfg);
    if let Some(why) = reward.fatal() {
        anyhow::bail!("the reward stopped working: {why}");
    }
    Ok((flat, rewards, failed))
}

/// Which of a rank's samples each optimizer step of an iteration takes.
type StepParts = Vec<std::ops::Range<usize>>;

/// Generates and scores one iteration's batch; records slime's `rollout/*` metrics. Over
/// several processes, also this rank's part of each optimizer step ([`step_parts`]).
#[allow(clippy::too_many_arguments)]
fn rollout<P: Policy>(
    cfg: &RunConfig,
    engine: &mut Engine<P>,
    tok: &Tokenizer,
    data: &mut DataSource,
    reward: &dyn Reward,
    iteration: usize,
    record: &mut Record,
    dist: Option<&Dist>,
    steps: usize,
) -> anyhow::Result<(Vec<TrainSample>, Option<StepParts>)> {
    let n = cfg.n_samples_per_prompt;
    let want = cfg.rollout_batch_size;
    let draw = cfg.over_sampling_batch_size.unwrap_or(want);
    let filter = cfg.over_sampling_batch_size.is_some();
    // Dynamic sampling draws again until the batch is full; bounded so a task the policy
    // always solves (or never does) still trains on what it has.
    let max_rounds = if filter { 8 } else { 1 };
    let source = data.dataset().source.clone();
    let (mut kept, mut all_rewards): (Vec<TrainSample>, Vec<f32>) = (Vec::new(), Vec::new());
    let (mut zero_std, mut failed, mut truncated, mut samples_total, mut resp_tokens) =
        (0usize, 0usize, 0usize, 0usize, 0usize);
    let mut groups_kept = 0;
    let mut first_error = None;
    // The engine's share of the rollout time (the rest: prompts, rewards, batching).
    let mut generate_time = 0.0;
    for round in 0..max_rounds {
        if groups_kept >= want {
            break;
        }
        let rows = data.next_batch(draw);
        // Over several processes, this rank's part of every optimizer step's groups (every
        // rank drew the same rows); under dynamic sampling an even part of the drawn groups,
        // which are kept is decided below over all of them.
        let share: Vec<usize> = match dist {
            Some(d) if filter => miles_dist::shard(rows.len(), 1, d.size, d.rank)?,
            Some(d) => miles_dist::shard(rows.len(), steps, d.size, d.rank)?,
            None => (0..rows.len()).collect(),
        };
        let mine: Vec<(usize, PromptRow)> = share.iter().map(|&g| rows[g].clone()).collect();
        let groups = make_groups(&mine, &share, n, cfg, tok, &source)?;
        let params = SamplingParams {
            seed: mix(cfg.rollout_seed, ((iteration as u64) << 8) | round as u64),
            ..cfg.sampling_params()
        };
        let generate_started = Instant::now();
        let groups = engine.generate(groups, &params)?;
        generate_time += generate_started.elapsed().as_secs_f64();
        let (flat, rewards, fails) = score_groups(reward, groups, cfg)?;
        failed += fails;
        if first_error.is_none() {
            first_error = flat.iter().find_map(failure_reason);
        }
        let mut keepable = Vec::with_capacity(share.len());
        for (group, rewards) in flat.chunks(n).zip(rewards.chunks(n)) {
            samples_total += group.len();
            truncated += group.iter().filter(|s| s.status == Status::Truncated).count();
            resp_tokens += group.iter().map(|s| s.response_length).sum::<usize>();
            let live: Vec<f32> = rewards.iter().flatten().copied().collect();
            all_rewards.extend(&live);
            let spread = live.iter().any(|&r| r != live[0]);
            if !spread && !live.is_empty() {
                zero_std += 1;
            }
            keepable.push(!live.is_empty() && (spread || !filter));
        }
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
                    && let Some(t) = TrainSample::from_sample(s, g, *r)
                {
                    kept.push(t);
                }
            }
        }
    }
    // Sums over the ranks of a run over several processes.
    let mut sums = [
        all_rewards.iter().map(|&x| f64::from(x)).sum::<f64>(),
        all_rewards.len() as f64,
        resp_tokens as f64,
        samples_total as f64,
        truncated as f64,
        zero_std as f64,
        failed as f64,
        kept.len() as f64,
    ];
    if let Some(d) = dist {
        d.sum(&mut sums)?;
    }
    let [reward_sum, rewards, resp_tokens, samples_total, truncated, zero_std, failed, kept_all] =
        sums;
    record.insert("rollout/raw_reward".into(), json!(reward_sum / rewards.max(1.0)));
    record.insert("rollout/response_len/mean".into(), json!(resp_tokens / samples_total.max(1.0)));
    record.insert("rollout/truncated_ratio".into(), json!(truncated / samples_total.max(1.0)));
    record.insert("rollout/zero_std/count".into(), json!(zero_std as usize));
    record.insert("rollout/failed".into(), json!(failed as usize));
    // Over several processes, whichever rank saw one (rank 0 logs it).
    let first_error = match dist {
        Some(d) => d.first_on_root(first_error.as_deref())?,
        None => first_error,
    };
    if let Some(e) = first_error {
        record.insert("rollout/first_error".into(), json!(e));
    }
    record.insert("rollout/samples".into(), json!(kept_all as usize));
    record.insert("perf/rollout_generate_time".into(), json!(generate_time));
    record.insert("rollout/generated_tokens".into(), json!(resp_tokens as usize));
    // Over several processes each step takes the samples one process's step would, whichever
    // samples or groups were dropped (failed rewards, empty responses) on any rank.
    let parts = match dist {
        Some(d) => Some(step_parts(d, &kept, if filter { groups_kept } else { draw }, steps)?),
        None => None,
    };
    Ok((kept, parts))
}

/// This rank's part of each optimizer step over several processes (`samples` in the order of
/// their groups' indices in the batch of `groups`, which may be anywhere in it under dynamic
/// sampling): step k takes positions [k·N/steps, (k+1)·N/steps) of the whole batch's N samples,
/// as [`batch::split_ranges`] cuts one process's batch, so dropped samples on any rank move
/// every rank's boundaries as they move one process's.
fn step_parts(
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

/// Which loss a step minimizes.
enum StepLoss<'a> {
    Policy(&'a PolicyLossConfig),
    Sft(SftLossConfig),
}

/// What one optimizer step measured.
struct StepResult {
    loss: f64,
    metrics: LossMetrics,
    grad_norm: f64,
    /// The load-balancing loss of a mixture of experts (unweighted).
    router_aux_loss: Option<f64>,
    routing: Option<RoutingMismatch>,
}

impl StepResult {
    /// The loss and metrics summed over the ranks: each rank's are its samples' shares of the
    /// whole batch's. One sum of a fixed length, whatever this rank's part held (a rank without
    /// samples has no mixture-of-experts figures; the others' still come through).
    fn sum_over(&mut self, d: &Dist) -> anyhow::Result<()> {
        let m = &mut self.metrics;
        let r = self.routing.unwrap_or_default();
        let mut v = [
            self.loss,
            m.pg_loss,
            m.pg_clipfrac,
            m.ppo_kl,
            m.kl_loss,
            m.entropy_loss,
            m.ois,
            m.opsm_clipfrac,
            self.router_aux_loss.unwrap_or(0.0),
            f64::from(u8::from(self.router_aux_loss.is_some())),
            f64::from(u8::from(self.routing.is_some())),
            r.compared as f64,
            r.own_differs as f64,
            r.used_differs as f64,
        ];
        d.sum(&mut v)?;
        let [
            loss,
            pg_loss,
            pg_clipfrac,
            ppo_kl,
            kl_loss,
            entropy_loss,
            ois,
            opsm_clipfrac,
            aux,
            has_aux,
            has_routing,
            compared,
            own_differs,
            used_differs,
        ] = v;
        self.loss = loss;
        [m.pg_loss, m.pg_clipfrac, m.ppo_kl, m.kl_loss, m.entropy_loss, m.ois, m.opsm_clipfrac] =
            [pg_loss, pg_clipfrac, ppo_kl, kl_loss, entropy_loss, ois, opsm_clipfrac];
        self.router_aux_loss = (has_aux > 0.0).then_some(aux);
        self.routing = (has_routing > 0.0).then_some(RoutingMismatch {
            compared: compared as usize,
            own_differs: own_differs as usize,
            used_differs: used_differs as usize,
        });
        Ok(())
    }
}

/// What [`train_step`] did: the step's result, `None` when its loss or gradient was not finite
/// and nothing was applied, and the response logprobs its forwards computed before the update,
/// per sample of the part in order (up to where a non-finite loss stopped it).
struct StepOutcome {
    applied: Option<StepResult>,
    logp: Vec<Vec<f32>>,
}

/// The model a training step updates and its optimizer: on the CPU the engine's own copy with
/// the host AdamW; on a GPU the device model, whose weights, gradients and moments stay there.
/// Only per-token logp and entropy and their gradients cross this seam.
trait Learner {
    type Forward;
    fn forward(&mut self, batch: &PackedBatch, temperature: f32) -> anyhow::Result<Self::Forward>;
    /// `(logp, entropy)` of the response tokens.
    fn outputs(f: &Self::Forward) -> (&[f32], &[f32]);
    /// What the forward reports of a mixture of experts' sparse layers.
    fn sparse(f: &mut Self::Forward) -> &mut SparseOutputs;
    /// The load-balancing loss's weight in the loss (the backward adds its gradient).
    fn aux_coef(&self) -> f64;
    /// Adds the gradient of the loss whose derivatives these are. `last` (a run over several
    /// processes, the step's last micro-batch) may start summing the gradients over the ranks
    /// as the backward finishes them; [`Learner::reduce_grads`] completes the sums.
    fn backward(
        &mut self,
        f: Self::Forward,
        batch: &PackedBatch,
        d_logp: &[f32],
        d_entropy: &[f32],
        last: Option<&Dist>,
    ) -> anyhow::Result<()>;
    fn grad_norm(&mut self) -> anyhow::Result<f64>;
    /// Sums the gradients over the ranks of a run over several processes (or finishes the sums
    /// the last backward started).
    fn reduce_grads(&mut self, dist: &Dist) -> anyhow::Result<()>;
    /// Clips and applies the summed gradients at `lr`; the norm before clipping.
    fn apply(&mut self, lr: f32) -> anyhow::Result<f64>;
}

struct CpuLearner<'a> {
    policy: &'a mut Model,
    optimizer: &'a mut Optimizer,
    packed: PackedLinears,
    grads: Weights,
}

impl<'a> CpuLearner<'a> {
    fn new(policy: &'a mut Model, optimizer: &'a mut Optimizer) -> anyhow::Result<Self> {
        let packed = PackedLinears::new(policy)?;
        let grads = Weights::zeros(&policy.config);
        Ok(CpuLearner { policy, optimizer, packed, grads })
    }
}

impl Learner for CpuLearner<'_> {
    type Forward = Forward;

    fn forward(&mut self, batch: &PackedBatch, temperature: f32) -> anyhow::Result<Forward> {
        Ok(self.policy.forward_with(&self.packed, batch, temperature)?)
    }

    fn outputs(f: &Forward) -> (&[f32], &[f32]) {
        (&f.logp, &f.entropy)
    }

    fn sparse(f: &mut Forward) -> &mut SparseOutputs {
        &mut f.sparse
    }

    fn aux_coef(&self) -> f64 {
        aux_coef(&self.policy.config)
    }

    fn backward(
        &mut self,
        f: Forward,
        batch: &PackedBatch,
        d_logp: &[f32],
        d_entropy: &[f32],
        _last: Option<&Dist>,
    ) -> anyhow::Result<()> {
        Ok(self.policy.backward(&f, batch, d_logp, d_entropy, &mut self.grads)?)
    }

    fn reduce_grads(&mut self, dist: &Dist) -> anyhow::Result<()> {
        let arch = self.policy.config.architecture;
        for t in self.grads.tensors_mut(arch) {
            dist.sum_f32(t)?;
        }
        Ok(())
    }

    fn grad_norm(&mut self) -> anyhow::Result<f64> {
        let arch = self.policy.config.architecture;
        let views: Vec<&[f32]> = self.grads.tensors(arch).into_iter().map(Vec::as_slice).collect();
        Ok(cpu::global_norm(&views))
    }

    fn apply(&mut self, lr: f32) -> anyhow::Result<f64> {
        Ok(self.optimizer.step(&mut self.policy.weights, &mut self.grads, lr)?.grad_norm)
    }
}

struct DeviceLearner<'a> {
    model: &'a mut DeviceModel,
    hyper: AdamW,
    clip_grad: f64,
    /// The gradient sums the step's last backward started.
    sums: Option<GradBuckets>,
}

impl<'a> DeviceLearner<'a> {
    fn new(model: &'a mut DeviceModel, hyper: AdamW, clip_grad: f64) -> anyhow::Result<Self> {
        model.zero_grads()?;
        Ok(DeviceLearner { model, hyper, clip_grad, sums: None })
    }
}

impl Learner for DeviceLearner<'_> {
    type Forward = DeviceForward;

    fn forward(&mut self, batch: &PackedBatch, temperature: f32) -> anyhow::Result<DeviceForward> {
        Ok(self.model.forward(batch, temperature)?)
    }

    fn outputs(f: &DeviceForward) -> (&[f32], &[f32]) {
        (&f.logp, &f.entropy)
    }

    fn sparse(f: &mut DeviceForward) -> &mut SparseOutputs {
        &mut f.sparse
    }

    fn aux_coef(&self) -> f64 {
        aux_coef(&self.model.config)
    }

    fn backward(
        &mut self,
        f: DeviceForward,
        batch: &PackedBatch,
        d_logp: &[f32],
        d_entropy: &[f32],
        last: Option<&Dist>,
    ) -> anyhow::Result<()> {
        let Some(dist) = last else {
            return Ok(self.model.backward(&f, batch, d_logp, d_entropy)?);
        };
        let mut sums = dist.grad_buckets(self.model);
        let mut failed = None;
        self.model.backward_with(&f, batch, d_logp, d_entropy, &mut |done, grads| {
            // The model's error type carries no anyhow context: keep the first failure aside.
            if failed.is_none()
                && let Err(e) = dist.start_ready(&mut sums, done, grads)
            {
                failed = Some(e);
            }
            Ok(())
        })?;
        self.sums = Some(sums);
        failed.map_or(Ok(()), Err)
    }

    fn reduce_grads(&mut self, dist: &Dist) -> anyhow::Result<()> {
        let sums = self.sums.take().unwrap_or_else(|| dist.grad_buckets(self.model));
        dist.finish_grads(sums, self.model)
    }

    fn grad_norm(&mut self) -> anyhow::Result<f64> {
        Ok(self.model.grad_norm()?)
    }

    fn apply(&mut self, lr: f32) -> anyhow::Result<f64> {
        Ok(self.model.adamw_step(&AdamW { lr, ..self.hyper }, self.clip_grad)?.0)
    }
}

/// One optimizer step over `part`, accumulated over micro-batches of `micro` sequences, each
/// weighted by its share of the step's denominator so the sum is the loss of the whole part.
/// A sample without old logprobs takes its own from this forward ([`OldLogprobs::InStep`]).
#[allow(clippy::too_many_arguments)]
fn train_step<L: Learner>(
    learner: &mut L,
    part: &[TrainSample],
    loss: StepLoss,
    temperature: f32,
    micro: usize,
    lr: f32,
    inject_nan: bool,
    dist: Option<&Dist>,
) -> anyhow::Result<StepOutcome> {
    let per_token = match &loss {
        StepLoss::Policy(c) => c.per_token_loss,
        StepLoss::Sft(c) => c.per_token_loss,
    };
    let weight = |s: &[TrainSample]| -> f64 {
        if per_token {
            s.iter().map(TrainSample::denominator).sum::<usize>() as f64
        } else {
            s.len() as f64
        }
    };
    // Over several processes, the denominator is the whole batch's.
    let whole = match dist {
        Some(d) => {
            let mut w = [weight(part)];
            d.sum(&mut w)?;
            w[0]
        }
        None => weight(part),
    };
    let mut finite = true;
    let mut total = StepResult {
        loss: 0.0,
        metrics: LossMetrics::default(),
        grad_norm: 0.0,
        router_aux_loss: None,
        routing: None,
    };
    let mut seen = Vec::with_capacity(part.len());
    let micro_batches = part.len().div_ceil(micro.max(1));
    for (i, mb) in part.chunks(micro.max(1)).enumerate() {
        let batch = batch::pack(mb)?;
        let fwd = learner.forward(&batch, temperature)?;
        let (logp, entropy) = L::outputs(&fwd);
        let mut at = 0;
        for s in mb {
            seen.push(logp[at..at + s.response_len()].to_vec());
            at += s.response_len();
        }
        let in_step =
            matches!(loss, StepLoss::Policy(_)) && mb.iter().all(|s| s.old_logp.is_empty());
        let old = if in_step { logp.to_vec() } else { concat(mb, |s| &s.old_logp) };
        let adv = concat(mb, |s| &s.advantages);
        let mask = concat(mb, |s| &s.loss_mask);
        let lengths: Vec<usize> = mb.iter().map(TrainSample::response_len).collect();
        let refs = mb
            .iter()
            .all(|s| s.ref_logp.is_some())
            .then(|| concat(mb, |s| s.ref_logp.as_deref().unwrap_or_default()));
        let cw = mb
            .iter()
            .all(|s| s.correction_weights.is_some())
            .then(|| concat(mb, |s| s.correction_weights.as_deref().unwrap_or_default()));
        let cm = mb
            .iter()
            .all(|s| s.correction_mask.is_some())
            .then(|| concat(mb, |s| s.correction_mask.as_deref().unwrap_or_default()));
        let input = LossInput {
            logp,
            old_logp: &old,
            ref_logp: refs.as_deref(),
            entropy,
            advantages: &adv,
            loss_mask: &mask,
            response_lengths: &lengths,
            correction_weights: cw.as_deref(),
            correction_mask: cm.as_deref(),
        };
        let mut out = match &loss {
            StepLoss::Policy(c) => policy_loss(c, &input)?,
            StepLoss::Sft(c) => sft_loss(c, &input)?,
        };
        if inject_nan {
            out.loss = f64::NAN;
        }
        if !out.loss.is_finite() {
            finite = false;
            // Alone, stop here; with other ranks, take part in their collectives first.
            if dist.is_none() {
                return Ok(StepOutcome { applied: None, logp: seen });
            }
            break;
        }
        let share = weight(mb) / whole;
        let coef = learner.aux_coef();
        let mut fwd = fwd;
        let sparse = L::sparse(&mut fwd);
        if let Some(aux) = sparse.router_aux_loss {
            out.loss += coef * aux;
            *total.router_aux_loss.get_or_insert(0.0) += share * aux;
        }
        if let Some(m) = &sparse.routing_mismatch {
            total.routing.get_or_insert_default().merge(m);
        }
        let scale = share as f32;
        out.d_logp.iter_mut().for_each(|g| *g *= scale);
        out.d_entropy.iter_mut().for_each(|g| *g *= scale);
        L::sparse(&mut fwd).aux_weight = scale;
        let last = dist.filter(|_| i + 1 == micro_batches);
        learner.backward(fwd, &batch, &out.d_logp, &out.d_entropy, last)?;
        total.loss += share * out.loss;
        total.metrics.add_scaled(&out.metrics, share);
    }
    if let Some(d) = dist {
        // One summed gradient (the last backward started its sums; a rank that stopped at a
        // non-finite loss, or had no samples, makes the same ones now), then skipped everywhere
        // if any rank's loss was not finite.
        learner.reduce_grads(d)?;
        let mut bad = [f64::from(u8::from(!finite))];
        d.sum(&mut bad)?;
        if bad[0] > 0.0 {
            return Ok(StepOutcome { applied: None, logp: seen });
        }
        total.sum_over(d)?;
    }
    if !learner.grad_norm()?.is_finite() {
        return Ok(StepOutcome { applied: None, logp: seen });
    }
    total.grad_norm = learner.apply(lr)?;
    Ok(StepOutcome { applied: Some(total), logp: seen })
}

/// Means of the applied steps' metrics.
#[derive(Default)]
struct StepSums {
    steps: usize,
    loss: f64,
    metrics: LossMetrics,
    grad_norm: f64,
    lr: f32,
    router_aux_loss: Option<f64>,
    routing: Option<RoutingMismatch>,
}

impl StepSums {
    fn add(&mut self, s: &StepResult, lr: f32) {
        self.steps += 1;
        self.loss += s.loss;
        self.grad_norm += s.grad_norm;
        self.metrics.add_scaled(&s.metrics, 1.0);
        self.lr = lr;
        if let Some(aux) = s.router_aux_loss {
            *self.router_aux_loss.get_or_insert(0.0) += aux;
        }
        if let Some(m) = &s.routing {
            self.routing.get_or_insert_default().merge(m);
        }
    }

    /// `corrected` and `opsm` add the metrics slime reports with TIS and OPSM.
    fn write(&self, record: &mut Record, corrected: bool, opsm: bool) {
        record.insert("train/steps".into(), json!(self.steps));
        if self.steps == 0 {
            return;
        }
        let k = self.steps as f64;
        record.insert("train/loss".into(), json!(self.loss / k));
        for (name, v) in self.metrics.named(corrected, opsm) {
            record.insert(name.into(), json!(v / k));
        }
        record.insert("train/grad_norm".into(), json!(self.grad_norm / k));
        record.insert("train/lr".into(), json!(self.lr));
        if let Some(aux) = self.router_aux_loss {
            record.insert("train/router_aux_loss".into(), json!(aux / k));
        }
        // Of the (token, sparse layer) pairs with a rollout record: how often training's own
        // top-k differs from the rollout's experts, and how often the experts it used do
        // (0 with --use-rollout-routing-replay).
        if let Some(m) = self.routing.filter(|m| m.compared > 0) {
            let n = m.compared as f64;
            record.insert("train/routed_experts_mismatch".into(), json!(m.own_differs as f64 / n));
            record
                .insert("train/replayed_experts_mismatch".into(), json!(m.used_differs as f64 / n));
        }
    }
}

/// (prompt, label) rows as SFT samples: the label's tokens and EOS are the response.
fn sft_samples(
    rows: &[(usize, PromptRow)],
    cfg: &RunConfig,
    tok: &Tokenizer,
    eos: u32,
    source: &str,
    why: &str,
) -> anyhow::Result<Vec<TrainSample>> {
    let mut samples = Vec::with_capacity(rows.len());
    for (_, row) in rows {
        let label = row.label.as_deref().ok_or_else(|| {
            anyhow!(
                "{source}: line {}: {why} trains on the label as the answer, and this row has \
                 none (set --label-key)",
                row.line
            )
        })?;
        let prompt = serde_json::to_value(&row.prompt)?;
        let mut tokens = tok
            .encode_prompt(&prompt, cfg.apply_chat_template)
            .with_context(|| format!("{source}: line {}", row.line))?;
        let prompt_len = tokens.len();
        if prompt_len == 0 {
            bail!("{source}: line {}: the prompt encodes to no tokens", row.line);
        }
        tokens.extend(tok.encode(label, false)?);
        tokens.push(eos);
        let n = tokens.len() - prompt_len;
        samples.push(TrainSample {
            group: samples.len(),
            tokens,
            prompt_len,
            reward: 0.0,
            loss_mask: vec![1; n],
            rollout_logp: vec![0.0; n],
            old_logp: vec![0.0; n],
            ref_logp: None,
            advantages: vec![0.0; n],
            correction_weights: None,
            correction_mask: None,
            routed_experts: None,
            replay_experts: None,
        });
    }
    Ok(samples)
}

/// Supervised steps on (prompt, label) pairs before RL: the label's tokens and EOS are the
/// response. A fresh optimizer at `sft-lr`; prompts are drawn from a copy of the data source
/// so RL's data order is the same with or without a warm-up.
fn sft_warmup(
    cfg: &RunConfig,
    policy: &mut Model,
    tok: &Tokenizer,
    eos: u32,
    data: &DataSource,
    emit: &mut dyn FnMut(Record) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut source = DataSource::new(data.dataset().clone(), true, mix(cfg.seed, 0x5F7))?;
    let lr = cfg.sft_lr.unwrap_or(cfg.lr);
    let hyper = adamw(cfg, lr);
    let mut optimizer = Optimizer::new(&policy.config, hyper, f64::from(cfg.clip_grad));
    let sft = SftLossConfig::from_run_config(cfg);
    let where_ = data.dataset().source.clone();
    for step in 0..cfg.sft_warmup_steps {
        let started = Instant::now();
        let rows = source.next_batch(cfg.rollout_batch_size);
        let samples = sft_samples(&rows, cfg, tok, eos, &where_, "--sft-warmup-steps")?;
        let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
        let result = train_step(
            &mut CpuLearner::new(policy, &mut optimizer)?,
            &samples,
            StepLoss::Sft(sft),
            cfg.rollout_temperature,
            micro,
            lr,
            false,
            None,
        )?
        .applied;
        let mut record = Record::new();
        record.insert("phase".into(), json!("sft"));
        // Warm-up steps come before RL iteration 1 on the metrics' time axis: 1 − W, …, 0.
        record.insert("step".into(), json!(step as i64 + 1 - cfg.sft_warmup_steps as i64));
        record.insert("sft/step".into(), json!(step + 1));
        if let Some(r) = result {
            record.insert("sft/loss".into(), json!(r.loss));
            record.insert("sft/grad_norm".into(), json!(r.grad_norm));
        }
        record.insert("sft/step_time".into(), json!(started.elapsed().as_secs_f64()));
        emit(record)?;
    }
    Ok(())
}

/// Eval on every prompt of `eval`: mean reward, pass@1 (the fraction of samples with a
/// positive reward) and, with several samples per prompt, pass@n. Its draws use a fixed seed,
/// so successive evals differ only by the policy. Over several processes each rank evaluates
/// a contiguous part of the prompts (their draws keyed by their one-process indices) and the
/// counts are summed: the figures of one process, in a fraction of its time.
fn evaluate<P: Policy>(
    cfg: &RunConfig,
    engine: &mut Engine<P>,
    tok: &Tokenizer,
    eval: &Dataset,
    reward: &dyn Reward,
    record: &mut Record,
    dist: Option<&Dist>,
) -> anyhow::Result<f64> {
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
    record.insert("eval/reward".into(), json!(mean));
    record.insert("eval/pass@1".into(), json!(solved / count.max(1.0)));
    if n > 1 {
        record.insert(format!("eval/pass@{n}"), json!(any / total.max(1) as f64));
    }
    record.insert("rollout/eval_failed".into(), json!(failed as usize));
    record.insert("perf/eval_time".into(), json!(started.elapsed().as_secs_f64()));
    Ok(mean)
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
