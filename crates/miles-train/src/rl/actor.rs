//! Where the policy lives during a run: the actor (the rollout engine over the policy and the
//! trainer that updates it in place) and the frozen KL reference.

use std::borrow::Cow;

use anyhow::bail;
use miles_core::Rollout;
use miles_core::config::RunConfig;
use miles_model::{DeviceModel, Model, PackedLinears, Tokenizer, Weights};
use miles_rollout::{DevicePolicy, Engine, EngineConfig};
use miles_tensor::cpu::AdamW;
use miles_tensor::{DType, Device};

use super::adamw;
use super::step::{CpuLearner, DeviceLearner, StepLoss, StepOutcome, train_step};
use crate::Optimizer;
use crate::batch::{self, TrainSample};
use crate::dist::Dist;

/// Where the policy lives during a run: the rollout engine over it and the trainer that
/// updates it in place, so one copy of the weights serves both (zero-copy weight sync).
pub(super) trait Actor {
    /// The rollout engine over the policy.
    fn rollout(&mut self) -> &mut dyn Rollout;
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
pub(super) struct CpuActor {
    pub(super) engine: Engine,
    pub(super) optimizer: Optimizer,
}

impl Actor for CpuActor {
    fn rollout(&mut self) -> &mut dyn Rollout {
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
pub(super) struct DeviceActor {
    pub(super) engine: Engine<DevicePolicy>,
    pub(super) hyper: AdamW,
    pub(super) clip: f64,
    pub(super) device: Device,
}

impl DeviceActor {
    /// `policy` (and the optimizer state of a resumed run) on `device`, with the rollout
    /// engine's KV cache; prints the memory plan, and fails naming the flag when the cache
    /// does not fit.
    pub(super) fn new(
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
    fn rollout(&mut self) -> &mut dyn Rollout {
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

/// The frozen KL reference: on the host, or beside the policy on its device.
pub(super) enum Reference {
    Host(Model, PackedLinears),
    /// The device model, and its weights on the host for checkpoints.
    Device(Box<DeviceModel>, Weights),
}

impl Reference {
    /// `weights` as the reference, on `device` when the run's policy is on one.
    pub(super) fn new(
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

    pub(super) fn weights(&self) -> &Weights {
        match self {
            Reference::Host(m, _) => &m.weights,
            Reference::Device(_, w) => w,
        }
    }

    pub(super) fn logprobs(
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

/// A mixture of experts' load-balancing loss weight (0 for a dense model).
pub(super) fn aux_coef(c: &miles_model::ModelConfig) -> f64 {
    c.moe.as_ref().map_or(0.0, |m| f64::from(m.router_aux_loss_coef))
}
