//! Where the policy lives during a run: the actor (the policy, which it trains in place and
//! lends to the rollout engine) and the frozen KL reference, on the run's device.

use std::sync::Arc;

use anyhow::{Context, bail};
use miles_core::config::{RunConfig, StateDtype};
use miles_core::{Rollout, Speculator};
use miles_model::draft::{Draft, DraftFormat, draft_config};
use miles_model::{DeviceModel, Fp8Layers, Int4Layers, KvCache, Model, Tokenizer, Weights};
use miles_rollout::{Engine, EngineConfig};
use miles_tensor::cpu::AdamW;
use miles_tensor::{DType, Device};

use super::adamw;
use super::step::{Learner, Mtp, StepOutcome, StepSpec, train_step};
use crate::Optimizer;
use crate::batch::{self, TrainSample};
use crate::checkpoint::DraftState;
use crate::dist::Dist;

/// The compute dtype on `device`: f32 on the CPU (its batch-invariant kernels), bf16 on a GPU.
fn compute_dtype(device: Device) -> DType {
    if device == Device::Cpu { DType::F32 } else { DType::BF16 }
}

/// FP8 as the run asks for it: unified with `--fp8-format` (and the bf16 layers), for the
/// policy and the reference alike; else rollout-only when the checkpoint is FP8, as miles
/// serves such a checkpoint in FP8 and trains in bf16 (the mismatch is reported as
/// `train/train_rollout_logprob_abs_diff`; `--use-tis` corrects it).
pub(super) fn fp8_layers(cfg: &RunConfig, fp8_checkpoint: bool) -> Option<Fp8Layers> {
    let layers = Fp8Layers {
        bf16_at_start: cfg.num_layers_at_start_in_bf16,
        bf16_at_end: cfg.num_layers_at_end_in_bf16,
        rollout_only: cfg.fp8_format.is_none(),
    };
    (cfg.fp8_format.is_some() || fp8_checkpoint).then_some(layers)
}

/// INT4 QAT as the run asks for it (`--int4-qat`), for the policy and the reference alike.
pub(super) fn int4_layers(cfg: &RunConfig) -> Option<Int4Layers> {
    cfg.int4_qat.then_some(Int4Layers {
        group_size: cfg.int4_group_size,
        experts_only: cfg.int4_experts_only,
        w4a16: true,
    })
}

/// The policy during a run: a `DeviceModel` (f32 masters, the forward's compute copies,
/// gradients and AdamW moments, all on the run's device), trained in place and lent to the
/// rollout engine, so one copy of the weights serves rollout and training (zero-copy weight
/// sync); the engine's KV cache is allocated beside it once.
pub(super) struct Actor {
    model: DeviceModel,
    engine: Engine,
    hyper: AdamW,
    clip: f64,
    device: Device,
    /// The speculative draft (`--sglang-speculative-algorithm`, `--enable-mtp-training`).
    draft: Option<DraftActor>,
    /// `--rollout-backend sglang`: the servers that roll out instead of the engine.
    remote: Option<miles_rollout::remote::Remote>,
    /// `--custom-generate-function-path`: the function that makes each sample.
    custom: Option<super::custom_generate::CustomGenerate>,
}

/// The draft beside the policy on its device: lent to the engine with the policy when the run
/// speculates, trained by each optimizer step with `--enable-mtp-training`; its copies of the
/// policy's embedding and head follow the policy after every step.
struct DraftActor {
    model: DeviceModel,
    format: DraftFormat,
    speculate: bool,
    /// How it is trained, when it is.
    train: Option<DraftTraining>,
}

/// `--mtp-loss-scaling-factor`, `--mtp-lr` and `--mtp-warmup-steps`.
#[derive(Clone, Copy)]
struct DraftTraining {
    scale: f32,
    lr: Option<f32>,
    warmup: usize,
}

/// The policy's tensors a draft keeps frozen copies of.
fn shared_names(config: &miles_model::ModelConfig) -> Vec<&'static str> {
    let mut names = vec!["model.embed_tokens.weight"];
    if !config.tie_word_embeddings {
        names.push("lm_head.weight");
    }
    names
}

impl Actor {
    /// `policy` (and the optimizer state of a resumed run) on `device`, with the rollout
    /// engine's KV cache; prints the memory plan, and fails naming the flag when the cache
    /// does not fit.
    pub(super) fn new(
        policy: &Model,
        optimizer: &Optimizer,
        (device, fp8): (Device, Option<Fp8Layers>),
        cfg: &RunConfig,
        (engine_config, tokenizer): (EngineConfig, &Tokenizer),
        (draft, speculator): (Option<DraftState>, Option<Arc<dyn Speculator>>),
        dist: Option<&Dist>,
    ) -> anyhow::Result<Self> {
        let mut dm = DeviceModel::new(policy, &device, compute_dtype(device))?;
        if fp8.is_some_and(|f| f.rollout_only) {
            eprintln!(
                "rollout-only FP8: --hf-checkpoint is an FP8 model, so the rollout engine runs \
                 E4M3 weights (requantized at every weight sync) and training does not; the \
                 mismatch shows as train/train_rollout_logprob_abs_diff (--use-tis corrects \
                 it; --fp8-format e4m3 trains in FP8 too, with none)"
            );
        }
        dm.set_fp8(fp8).context("FP8")?;
        dm.set_int4(int4_layers(cfg)).context("--int4-qat")?;
        if let Some(d) = dist {
            d.broadcast_weights(&mut dm)?;
        }
        let moments = [cfg.exp_avg_dtype, cfg.exp_avg_sq_dtype].map(|d| match d {
            StateDtype::Fp32 => DType::F32,
            StateDtype::Bf16 => DType::BF16,
        });
        dm.set_moment_dtypes(moments[0], moments[1]).context("--exp-avg-dtype")?;
        // (After the broadcast: ranks start from rank 0's f32 masters.)
        if cfg.main_params_dtype == StateDtype::Bf16 {
            dm.set_bf16_masters(cfg.seed).context("--main-params-dtype bf16")?;
        }
        if cfg.use_precision_aware_optimizer {
            let params: usize = dm.grad_lens().iter().sum();
            let bytes: usize = moments.iter().map(|d| params * d.size_in_bytes()).sum();
            let mib = |b: usize| b as f64 / (1u64 << 20) as f64;
            eprintln!(
                "precision-aware optimizer: master weights in {} (norms fp32), AdamW's moments \
                 in {} and {}, {:.1} MiB ({:.1} MiB in fp32)",
                cfg.main_params_dtype.label(),
                cfg.exp_avg_dtype.label(),
                cfg.exp_avg_sq_dtype.label(),
                mib(bytes),
                mib(params * 8)
            );
        }
        if optimizer.steps() > 0 {
            let (m, v) = optimizer.moments();
            dm.set_moments(m, v, optimizer.steps())?;
        }
        let mut engine_config = engine_config;
        match (cfg.rollout_kv_cache_fraction, device) {
            (Some(_), Device::Cpu) => eprintln!(
                "warning: --rollout-kv-cache-fraction is a share of GPU memory; on the CPU the \
                 KV cache takes --rollout-kv-cache-mb ({} MiB)",
                cfg.rollout_kv_cache_mb
            ),
            (Some(f), _) => {
                let budget = miles_rollout::kv_cache_budget(0, Some(f), &device);
                engine_config.kv_cache_bytes = budget.context("--rollout-kv-cache-fraction")?;
            }
            (None, _) => {}
        }
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let kv = engine_config.kv_cache_bytes as u64;
        let per_token = KvCache::bytes_per_token(&dm.config, dm.dtype());
        let held = match &dm.config.mla {
            Some(m) => format!(
                "the latent attention's kv_lora_rank {} + qk_rope_head_dim {} values a layer",
                m.kv_lora_rank, m.qk_rope_head_dim
            ),
            None => "every kv head's key and value a layer".into(),
        };
        eprintln!(
            "KV cache: {per_token} bytes a token ({held}, {} layers), {} tokens in {:.2} GiB",
            dm.config.num_hidden_layers,
            kv / per_token as u64,
            gib(kv)
        );
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
            if dm.int4_w4a16() {
                eprintln!(
                    "INT4 QAT: the rollout engine's decode steps read {:.2} GiB of weights, the \
                     covered matrices packed (W4A16; their bf16 copies stay for training)",
                    gib(dm.rollout_weight_bytes() as u64)
                );
            }
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
        let draft = match draft {
            Some(start) => Some(DraftActor::new(&dm, start, cfg, speculator.is_some(), dist)?),
            None => None,
        };
        let tokenizer = Some(tokenizer.clone());
        let engine = match (&draft, speculator) {
            (Some(d), Some(s)) if d.speculate => {
                let config = EngineConfig { speculator: Some(s), ..engine_config };
                Engine::with_draft(&dm, &d.model, tokenizer, config)?
            }
            _ => Engine::new(&dm, tokenizer, engine_config)?,
        };
        let (hyper, clip) = (adamw(cfg, cfg.lr), f64::from(cfg.clip_grad));
        Ok(Actor { model: dm, engine, hyper, clip, device, draft, remote: None, custom: None })
    }

    /// Rolls out on `remote`'s servers from now on (`--rollout-backend sglang`).
    pub(super) fn roll_out_on(&mut self, remote: miles_rollout::remote::Remote) {
        self.remote = Some(remote);
    }

    /// Rolls out through `custom`'s generate function from now on.
    pub(super) fn generate_with(&mut self, custom: super::custom_generate::CustomGenerate) {
        self.custom = Some(custom);
    }

    /// The external servers that roll out, when the run has them.
    pub(super) fn remote(&self) -> Option<&miles_rollout::remote::Remote> {
        self.remote.as_ref()
    }

    /// Who rolls out: the external servers, or the engine with the policy lent to it (and the
    /// draft, when speculating).
    pub(super) fn rollout(&mut self) -> Box<dyn Rollout + '_> {
        if let Some(remote) = &mut self.remote {
            return Box::new(remote);
        }
        let lent = match self.draft.as_ref().filter(|d| d.speculate) {
            Some(d) => self.engine.lend_with_draft(&self.model, &d.model),
            None => self.engine.lend(&self.model),
        };
        match &self.custom {
            Some(custom) => Box::new(custom.rollout(lent)),
            None => Box::new(lent),
        }
    }

    /// The policy under the current weights.
    pub(super) fn model(&self) -> &DeviceModel {
        &self.model
    }

    /// One optimizer step over `part` ([`train_step`]).
    pub(super) fn train_step(
        &mut self,
        part: &[TrainSample],
        spec: StepSpec,
    ) -> anyhow::Result<StepOutcome> {
        let mtp = self.draft.as_mut().and_then(|d| {
            let train = d.train?;
            // A draft that has taken no step yet warms up after this one.
            let warmup = if d.model.steps() == 0 { train.warmup } else { 0 };
            Some(Mtp::new(&mut d.model, train.scale, train.lr, warmup))
        });
        let mut learner = Learner::new(&mut self.model, self.hyper, self.clip, mtp)?;
        let outcome = train_step(&mut learner, part, spec)?;
        if outcome.applied.is_some()
            && let Some(d) = &mut self.draft
        {
            // The draft reads the new embedding and head from now on.
            d.model.copy_weights_from(&self.model, &shared_names(&self.model.config))?;
        }
        Ok(outcome)
    }

    /// Optimizer steps taken (the learning-rate schedule's position).
    pub(super) fn steps(&self) -> u64 {
        self.model.steps()
    }

    /// A fresh optimizer after the SFT warm-up (which has its own); the rollouts see the
    /// warmed-up weights as a new policy version.
    pub(super) fn reset_optimizer(&mut self) {
        self.model.reset_moments();
        self.engine.weights_updated();
    }

    /// After an iteration's steps: the engine generates with the new weights from now on
    /// (AdamW refreshed the copies the engine reads, in place: nothing moves).
    pub(super) fn weights_updated(&mut self) {
        self.engine.weights_updated();
    }

    /// The weights, on the host.
    pub(super) fn weights(&self) -> anyhow::Result<Weights> {
        Ok(self.model.to_weights()?)
    }

    /// The weights and optimizer state for a checkpoint, on the host.
    pub(super) fn checkpoint_parts(&self) -> anyhow::Result<(Weights, Optimizer)> {
        let dm = &self.model;
        let config = &dm.config;
        let optimizer = match dm.moments_to_host()? {
            Some((m, v, steps)) => {
                Optimizer::from_state(config, self.hyper, self.clip, m, v, steps)?
            }
            None => Optimizer::new(config, self.hyper, self.clip),
        };
        Ok((dm.to_weights()?, optimizer))
    }

    /// The draft's MTP layer and AdamW state for a checkpoint, on the host (moments as drafts
    /// of the same shape, with the step count); `None` without a draft.
    pub(super) fn draft_parts(&self) -> anyhow::Result<Option<DraftState>> {
        let Some(d) = &self.draft else { return Ok(None) };
        let draft = Draft::from_model_weights(d.format, &d.model.to_weights()?)?;
        let moments = match d.model.moments_to_host()? {
            Some((m, v, steps)) => Some((
                Draft::from_model_weights(d.format, &m)?,
                Draft::from_model_weights(d.format, &v)?,
                steps,
            )),
            None => None,
        };
        Ok(Some(DraftState { draft, moments }))
    }

    /// The GPU, for the memory and MFU figures; `None` on the CPU.
    pub(super) fn gpu(&self) -> Option<Device> {
        (self.device != Device::Cpu).then_some(self.device)
    }
}

impl DraftActor {
    /// `start` as a draft of the policy `dm` on its device (the policy's embedding and head
    /// copied in), broadcast from rank 0 over several processes; its moments restored.
    fn new(
        dm: &DeviceModel,
        start: DraftState,
        cfg: &RunConfig,
        speculate: bool,
        dist: Option<&Dist>,
    ) -> anyhow::Result<Self> {
        let pc = &dm.config;
        let policy_head = dm.to_weights()?;
        let weights = start.draft.model_weights(pc, &policy_head)?;
        let model = Model::new(draft_config(pc)?, weights);
        let mut draft = DeviceModel::new(&model, &dm.device(), dm.dtype())?;
        if let Some(d) = dist {
            d.broadcast_weights(&mut draft)?;
        }
        if let Some((m, v, steps)) = start.moments.filter(|m| m.2 > 0) {
            let lm_head = policy_head.lm_head.as_ref().map(|h| vec![0.0; h.len()]);
            let zeros =
                Weights { embed: vec![0.0; policy_head.embed.len()], lm_head, ..policy_head };
            let (m, v) = (m.model_weights(pc, &zeros)?, v.model_weights(pc, &zeros)?);
            draft.set_moments(&m, &v, steps)?;
        }
        let train = cfg.enable_mtp_training.then_some(DraftTraining {
            scale: cfg.mtp_loss_scaling_factor,
            lr: cfg.mtp_lr,
            warmup: cfg.mtp_warmup_steps,
        });
        Ok(DraftActor { model: draft, format: start.draft.format, speculate, train })
    }
}

/// With `--async`, the copy of the policy that rolls out one version behind while the policy
/// trains: its own weights and KV cache on the policy's device, synced from the policy after
/// every iteration.
pub(super) struct Behind {
    model: DeviceModel,
    engine: Engine,
}

impl Behind {
    /// A copy of `actor`'s policy as it is now (policy version `version`), with an engine of
    /// its own.
    pub(super) fn new(
        actor: &Actor,
        config: EngineConfig,
        tokenizer: &Tokenizer,
        version: u64,
    ) -> anyhow::Result<Self> {
        let policy = Model::new(actor.model.config.clone(), actor.weights()?);
        let model = DeviceModel::new(&policy, &actor.device, actor.model.dtype())?;
        let mut engine = Engine::new(&model, Some(tokenizer.clone()), config)
            .context("--async: the KV cache of the copy that rolls out")?;
        engine.lend(&model).set_weight_version(version);
        Ok(Behind { model, engine })
    }

    /// Its engine with its copy lent to it.
    pub(super) fn rollout(&mut self) -> impl Rollout + '_ {
        self.engine.lend(&self.model)
    }

    /// Takes the policy's weights, policy version `version` from now on.
    pub(super) fn sync(&mut self, actor: &Actor, version: u64) -> anyhow::Result<()> {
        self.model.sync_from(&actor.model)?;
        self.engine.lend(&self.model).set_weight_version(version);
        Ok(())
    }
}

/// The frozen KL reference, beside the policy on its device, and its weights on the host for
/// checkpoints.
pub(super) struct Reference {
    model: DeviceModel,
    weights: Weights,
}

impl Reference {
    /// `weights` as the reference on `device`, in FP8 or INT4 QAT as the policy when `fp8`
    /// or `int4` says so.
    pub(super) fn new(
        config: &miles_model::ModelConfig,
        weights: Weights,
        device: Device,
        (fp8, int4): (Option<Fp8Layers>, Option<Int4Layers>),
    ) -> anyhow::Result<Reference> {
        let model = Model::new(config.clone(), weights);
        let mut dm = DeviceModel::new(&model, &device, compute_dtype(device))?;
        dm.set_fp8(fp8)?;
        // (The reference never rolls out: no packed forms.)
        dm.set_int4(int4.map(|q| Int4Layers { w4a16: false, ..q }))?;
        Ok(Reference { model: dm, weights: model.weights })
    }

    pub(super) fn weights(&self) -> &Weights {
        &self.weights
    }

    pub(super) fn model(&self) -> &DeviceModel {
        &self.model
    }
}

/// Each sample's response logprobs under `dm`, `micro` samples per forward.
pub(super) fn logprobs_of(
    dm: &DeviceModel,
    samples: &[TrainSample],
    temperature: f32,
    micro: usize,
) -> anyhow::Result<Vec<Vec<f32>>> {
    Ok(batch::logprobs_by(samples, micro, |b| Ok(dm.logprobs(b, temperature)?.0))?)
}

/// A mixture of experts' load-balancing loss weight (0 for a dense model).
pub(super) fn aux_coef(c: &miles_model::ModelConfig) -> f64 {
    c.moe.as_ref().map_or(0.0, |m| f64::from(m.router_aux_loss_coef))
}
