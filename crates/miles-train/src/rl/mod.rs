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
//! 5. weight sync: the optimizer updated the model the engine shares with the trainer in place
//!    (one copy of the weights); the engine bumps its policy version.
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

mod actor;
mod collect;
mod custom_generate;
mod eval;
mod metrics;
mod prepare;
mod run;
mod score;
mod sft;
mod step;

use std::path::PathBuf;

use anyhow::{Context, anyhow, bail};
use miles_core::config::{LossType, RunConfig};
use miles_core::{Advantage, Correction, Quantizer, Reward, RoutingReplay, Speculator};
use miles_data::{Cursor, DataSource, Dataset};
use miles_model::draft::{Draft, DraftFormat};
use miles_model::{Model, Tokenizer, Weights};
use miles_rollout::EngineConfig;
use miles_tensor::Device;
use miles_tensor::cpu::AdamW;

use crate::Optimizer;
use crate::checkpoint;
use crate::dist::{Dist, check_split};
use crate::schedule::LrSchedule;
use actor::{Actor, Behind, Reference};
use metrics::MetricsLog;
use prepare::old_logprobs_in_step;
use run::{Progress, Run};
use score::Unscored;
use sft::sft_warmup;

pub use eval::{EvalOutcome, EvalSet};
pub use metrics::{Record, TENSORBOARD_DIR};

/// Everything a run needs, assembled by the driver.
pub struct Setup {
    pub config: RunConfig,
    /// The initial policy (from `--hf-checkpoint`, or the demo's).
    pub model: Model,
    pub tokenizer: Tokenizer,
    /// Copied into checkpoints so each is a loadable HF model.
    pub tokenizer_dir: Option<PathBuf>,
    pub train_data: Dataset,
    /// The eval sets (none, one, or slime's named ones).
    pub eval_data: Vec<EvalSet>,
    /// Needed unless the run is SFT only (`--loss-type sft_loss` without eval).
    pub reward: Option<Box<dyn Reward>>,
    pub advantage: Box<dyn Advantage>,
    pub correction: Option<Box<dyn Correction>>,
    /// The `r3` plugin, with `--use-rollout-routing-replay`.
    pub replay: Option<Box<dyn RoutingReplay>>,
    /// The `fp8` plugin, with `--fp8-format`: it writes `--save-hf` in FP8.
    pub quantizer: Option<Box<dyn Quantizer>>,
    /// `--hf-checkpoint` is an FP8 model: without `--fp8-format` the run is rollout-only FP8
    /// (miles' default for such a checkpoint).
    pub fp8_checkpoint: bool,
    /// The `eagle-spec` plugin, with `--sglang-speculative-algorithm`.
    pub speculator: Option<Box<dyn Speculator>>,
    pub run_dir: PathBuf,
}

/// What a finished run reports.
#[derive(Debug, Clone)]
pub struct Summary {
    pub iterations: usize,
    pub resumed_from: Option<u64>,
    pub final_eval: Option<EvalOutcome>,
    pub skipped_steps: u64,
    pub weights: Weights,
}

/// Name of the metrics file in the run directory.
pub const METRICS_FILE: &str = "metrics.jsonl";
/// Extra weight set saved with a checkpoint when the reference is not `--hf-checkpoint`.
const REF_WEIGHTS: &str = "ref";

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
    /// `--partial-rollout`: the groups the last rollout aborted, to continue first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    partial: Vec<Vec<miles_core::Sample>>,
    /// `--async`: the next iteration's batch, rolled out one version behind while the last
    /// one trained.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    prefetched: Option<Prefetched>,
}

/// A batch rolled out ahead (`--async`), with its rollout metrics and the seconds it took.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Prefetched {
    samples: Vec<crate::batch::TrainSample>,
    record: Record,
    seconds: f64,
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
        quantizer,
        fp8_checkpoint,
        speculator,
        run_dir,
    } = setup;
    cfg.validate()?;
    if cfg.int4_qat && quantizer.is_none() {
        bail!(
            "--int4-qat: the run has no int4-qat plugin (build with `cargo xtask build --features \
             int4-qat`)"
        );
    }
    if cfg.fp8_format.is_some() && quantizer.is_none() {
        bail!(
            "--fp8-format: the run has no fp8 plugin (build with `cargo xtask build --features fp8`)"
        );
    }
    check_run(&cfg, &mut model, correction.is_some(), replay.is_some())?;
    if cfg.one_step_off && fp8_checkpoint {
        bail!(
            "--async: not with an FP8 --hf-checkpoint yet (the copy that rolls out would need its \
             own FP8 weights)"
        );
    }
    let eval_every = cfg.eval_interval.filter(|_| !eval_data.is_empty());
    let sft_run = cfg.loss_type == LossType::SftLoss;
    let reward: Box<dyn Reward> = match reward {
        Some(r) => r,
        None if sft_run && eval_every.is_none() => Box::new(Unscored),
        None => bail!(
            "--rm-type: say how to score responses (e.g. --rm-type math, --rm-url URL for a \
             reward server, or --custom-rm-path LIB); `miles plugins` lists the rewards"
        ),
    };
    let faults = Faults::from_env();
    let total = total_iterations(&cfg, train_data.len())?;
    let steps_per_rollout = steps_per_rollout(&cfg)?;
    let dist = Dist::join(cfg.distributed_backend)?;
    if let Some(d) = &dist {
        check_split(&cfg, d.size, steps_per_rollout)?;
    }
    let device =
        dist.as_ref().map_or(crate::dist::rank_device(cfg.device, 0), |d| d.device(cfg.device));
    if device != Device::Cpu {
        device.ensure_available().with_context(|| format!("--device {}", cfg.device))?;
    }
    let hyper = adamw(&cfg, cfg.lr);
    let schedule = LrSchedule::from_run_config(&cfg, total * steps_per_rollout);
    let config = model.config.clone();
    let eos = eos_id(&model, &tokenizer)?;

    let needs_ref = cfg.use_kl_loss || cfg.kl_coef != 0.0;
    // With a warm-up the reference is the warmed-up policy, saved beside each checkpoint.
    let saved_ref: &[&str] =
        if needs_ref && cfg.sft_warmup_steps > 0 { &[REF_WEIGHTS] } else { &[] };

    let resumed = match &cfg.load {
        Some(root) if checkpoint::latest_iteration(root)?.is_some() => {
            let clip = f64::from(cfg.clip_grad);
            match cfg.load_fallback {
                true => {
                    let (loaded, skipped) = checkpoint::load_intact(root, hyper, clip, saved_ref)?;
                    for (iteration, why) in skipped {
                        eprintln!(
                            "--load-fallback: skipping iteration {iteration}, damaged: {why}"
                        );
                    }
                    Some(loaded)
                }
                false => {
                    Some(checkpoint::load(root, hyper, clip, saved_ref).map_err(|e| match e {
                        checkpoint::Error::Damaged { .. } => anyhow!(
                            "--load: {e}; --load-fallback resumes from the newest intact \
                             checkpoint before it"
                        ),
                        other => other.into(),
                    })?)
                }
            }
        }
        _ => None,
    };
    let resumed_from = resumed.as_ref().map(|l| l.iteration);
    let mut log = match dist.as_ref().is_none_or(Dist::root) {
        true => MetricsLog::open(&run_dir, resumed_from, cfg.use_tensorboard)?,
        false => MetricsLog::silent(&run_dir),
    };
    let mut data = DataSource::new(train_data, cfg.rollout_shuffle, cfg.rollout_seed)?;
    let mut emit = |r: Record| -> anyhow::Result<()> {
        log.write(&r)?;
        observe(&r);
        Ok(())
    };
    let start = Start { cfg: &cfg, needs_ref, hyper };
    let saved_draft = resumed.as_ref().and_then(|l| l.draft.clone());
    let (policy, optimizer, state, reference) = start.run(model, resumed, &mut data)?;
    let (draft, kept_mtp) = draft_start(&cfg, &policy.config, saved_draft)?;
    let engine = (engine_config(&cfg), &tokenizer);
    let fp8 = actor::fp8_layers(&cfg, fp8_checkpoint);
    let speculation = (draft, speculator.map(std::sync::Arc::from));
    let mut actor =
        Actor::new(&policy, &optimizer, (device, fp8), &cfg, engine, speculation, dist.as_ref())?;
    drop(policy);
    if resumed_from.is_none() && cfg.sft_warmup_steps > 0 {
        sft_warmup(&cfg, &mut actor, &tokenizer, eos, &data, &mut emit)?;
    }
    // A fresh run's reference is the policy RL starts from (the warmed-up one with a warm-up).
    let reference = match reference {
        Some(weights) => Some(weights),
        None if needs_ref => Some(actor.weights()?),
        None => None,
    };
    // (In rollout-only FP8 the reference, which only scores, computes without it.)
    let fp8 = fp8.filter(|f| !f.rollout_only);
    let quant = (fp8, actor::int4_layers(&cfg));
    let reference = reference.map(|w| Reference::new(&config, w, device, quant)).transpose()?;
    // A test hook: the separate old-logprob forward even where the step's own would do, to
    // show both give the same bits.
    let separate_old = std::env::var_os("MILES_SEPARATE_OLD_LOGPROBS").is_some();
    let old_logprobs_in_step = !separate_old && old_logprobs_in_step(&cfg, steps_per_rollout);
    let sync_dir = match cfg.rollout_url.as_deref() {
        Some(urls) => {
            let urls: Vec<String> = urls.split(',').map(String::from).collect();
            let timeout = std::time::Duration::from_secs(3600);
            let remote = miles_rollout::remote::Remote::connect(&urls, timeout)?;
            actor.roll_out_on(remote);
            Some(run_dir.join("weight_sync"))
        }
        None => None,
    };
    if cfg.custom_generate_function_path.is_some() {
        actor.generate_with(custom_generate::CustomGenerate::start(&cfg, &tokenizer)?);
    }
    let run = Run {
        cfg: &cfg,
        tokenizer: &tokenizer,
        tokenizer_dir: tokenizer_dir.as_deref(),
        eval: eval_every.map(|every| (every, eval_data.as_slice())),
        reward: reward.as_ref(),
        advantage: advantage.as_ref(),
        correction: correction.as_deref(),
        replay: replay.as_deref(),
        quantizer: quantizer.as_deref(),
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
        sync_dir,
        kept_mtp,
    };
    let behind = match cfg.one_step_off {
        true => Some(Behind::new(&actor, engine_config(&cfg), &tokenizer, state.iteration as u64)?),
        false => None,
    };
    let progress = Progress { state, data, log, resumed_from };
    run.iterate((actor, behind), progress, observe)
}

/// What `train` checks of the plugins and the policy before anything runs; sets a mixture of
/// experts' `--router-aux-loss-coef`.
fn check_run(
    cfg: &RunConfig,
    model: &mut Model,
    has_correction: bool,
    has_replay: bool,
) -> anyhow::Result<()> {
    if cfg.use_tis && !has_correction {
        bail!("--use-tis: this binary has no `tis` correction plugin (build with --features tis)");
    }
    if cfg.use_rollout_routing_replay && !has_replay {
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
    Ok(())
}

/// How a run starts: from its checkpoint, or fresh.
struct Start<'a> {
    cfg: &'a RunConfig,
    /// A KL term needs the frozen reference.
    needs_ref: bool,
    hyper: AdamW,
}

impl Start<'_> {
    /// The policy, its optimizer, the loop state and, on resume, the frozen reference's
    /// weights (the saved warmed-up policy, else the initial `model`): the checkpoint's, or
    /// `model` with a fresh optimizer.
    fn run(
        &self,
        model: Model,
        resumed: Option<checkpoint::Loaded>,
        data: &mut DataSource,
    ) -> anyhow::Result<(Model, Optimizer, LoopState, Option<Weights>)> {
        let (cfg, config) = (self.cfg, model.config.clone());
        if let Some(l) = resumed {
            let state = resume_state(&l, &config, cfg, data)?;
            let saved = l.extra.into_iter().find(|(n, _)| n == REF_WEIGHTS).map(|(_, w)| w);
            let reference = self.needs_ref.then(|| saved.unwrap_or(model.weights));
            return Ok((Model::new(config, l.weights), l.optimizer, state, reference));
        }
        let optimizer = Optimizer::new(&config, self.hyper, f64::from(cfg.clip_grad));
        let state = LoopState {
            rollout_seed: cfg.rollout_seed,
            rollout_shuffle: cfg.rollout_shuffle,
            ..LoopState::default()
        };
        Ok((model, optimizer, state, None))
    }
}

/// Where the run's draft starts, when it has one (speculative rollouts or MTP training): the
/// checkpoint's on resume, else `--sglang-speculative-draft-model-path`, else the MTP layer
/// that a DeepSeek-V3 `--hf-checkpoint` carries, else a fresh one (HF's initialization,
/// seeded by `--seed`) that MTP training teaches from scratch. A run without a draft still
/// gets the checkpoint's MTP layer back (second), for `--save-hf` to keep.
fn draft_start(
    cfg: &RunConfig,
    policy: &miles_model::ModelConfig,
    saved: Option<checkpoint::DraftState>,
) -> anyhow::Result<(Option<checkpoint::DraftState>, Option<Draft>)> {
    let own = || -> anyhow::Result<Option<Draft>> {
        let Some(dir) = &cfg.hf_checkpoint else { return Ok(None) };
        Draft::of_checkpoint(dir, policy)
            .with_context(|| format!("--hf-checkpoint {}: its MTP layer", dir.display()))
    };
    let speculates = cfg.sglang_speculative_algorithm.is_some();
    if !speculates && !cfg.enable_mtp_training {
        return Ok((None, own()?));
    }
    if let Some(saved) = saved {
        return Ok((Some(saved), None));
    }
    let draft = match (&cfg.sglang_speculative_draft_model_path, own()?) {
        (Some(dir), _) => Draft::load(dir, policy)
            .with_context(|| format!("--sglang-speculative-draft-model-path {}", dir.display()))?,
        (None, Some(own)) => own,
        (None, None) if !cfg.enable_mtp_training => bail!(
            "--sglang-speculative-algorithm EAGLE needs a draft: \
             --sglang-speculative-draft-model-path DIR (an MTP layer's safetensors), \
             --enable-mtp-training to train one from scratch during the run, or a DeepSeek-V3 \
             --hf-checkpoint with its MTP layer (this one carries none)"
        ),
        (None, None) => Draft::random(policy, DraftFormat::DeepSeek, cfg.seed)
            .context("--enable-mtp-training: a fresh draft for this policy")?,
    };
    Ok((Some(checkpoint::DraftState { draft, moments: None }), None))
}

/// The rollout engine's settings of the run.
fn engine_config(cfg: &RunConfig) -> EngineConfig {
    EngineConfig {
        kv_cache_bytes: cfg.rollout_kv_cache_mb.saturating_mul(1 << 20),
        max_running: cfg.rollout_max_running,
        max_prompt_len: cfg.rollout_max_prompt_len,
        ..EngineConfig::default()
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
    let mut state = state;
    if !state.partial.is_empty() && !cfg.partial_rollout {
        eprintln!(
            "warning: --load {at}: the checkpoint holds {} unfinished groups of a \
             --partial-rollout run; without --partial-rollout they are dropped",
            state.partial.len()
        );
        state.partial.clear();
    }
    if let Some(g) = state.partial.iter().find(|g| g.len() != cfg.n_samples_per_prompt) {
        bail!(
            "--load {at}: its unfinished groups (--partial-rollout) hold {} samples each, this \
             run's --n-samples-per-prompt is {}; resume with the same",
            g.len(),
            cfg.n_samples_per_prompt
        );
    }
    Ok(state)
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
