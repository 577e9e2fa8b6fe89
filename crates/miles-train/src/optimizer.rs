use miles_model::{ModelConfig, Weights};
use miles_tensor::cpu::{self, AdamW};

/// AdamW over every tensor of a model: f32 master weights, first and second moments of the
/// same shapes, a step counter, and global-norm clipping before the update.
#[derive(Debug, Clone)]
pub struct Optimizer {
    pub hyper: AdamW,
    /// Clip the global gradient norm to this (0 disables).
    pub clip_grad: f64,
    m: Weights,
    v: Weights,
    step: u64,
}

/// What one optimizer step saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// The factor the gradients were scaled by (1 when not clipped).
    pub clip_scale: f32,
}

impl Optimizer {
    pub fn new(config: &ModelConfig, hyper: AdamW, clip_grad: f64) -> Self {
        Optimizer {
            hyper,
            clip_grad,
            m: Weights::zeros(config),
            v: Weights::zeros(config),
            step: 0,
        }
    }

    /// Rebuilds an optimizer from saved state (a checkpoint): the first and second moments `m`
    /// and `v` and the steps taken. Errors unless both moments have the shapes of `config`.
    pub fn from_state(
        config: &ModelConfig,
        hyper: AdamW,
        clip_grad: f64,
        m: Weights,
        v: Weights,
        step: u64,
    ) -> miles_model::Result<Self> {
        for (what, w) in [("first moments (exp_avg)", &m), ("second moments (exp_avg_sq)", &v)] {
            w.check(config).map_err(|e| {
                miles_model::Error::Invalid(format!("optimizer state, {what}: {e}"))
            })?;
        }
        Ok(Optimizer { hyper, clip_grad, m, v, step })
    }

    /// Steps taken so far.
    pub fn steps(&self) -> u64 {
        self.step
    }

    /// The first and second moments (`exp_avg`, `exp_avg_sq`), in the shapes of the weights.
    pub fn moments(&self) -> (&Weights, &Weights) {
        (&self.m, &self.v)
    }

    /// Clips `grads` (in place) to the global norm and applies one AdamW update at `lr`.
    pub fn step(
        &mut self,
        weights: &mut Weights,
        grads: &mut Weights,
        lr: f32,
    ) -> miles_tensor::Result<StepStats> {
        let grad_norm = {
            let views: Vec<&[f32]> = grads.tensors().into_iter().map(Vec::as_slice).collect();
            cpu::global_norm(&views)
        };
        let clip_scale = cpu::clip_scale(grad_norm, self.clip_grad);
        self.step += 1;
        let hyper = AdamW { lr, ..self.hyper };
        let tensors = weights.tensors_mut().into_iter().zip(grads.tensors_mut());
        let moments = self.m.tensors_mut().into_iter().zip(self.v.tensors_mut());
        for ((p, g), (m, v)) in tensors.zip(moments) {
            if clip_scale != 1.0 {
                g.iter_mut().for_each(|x| *x *= clip_scale);
            }
            hyper.step(p, g, m, v, self.step)?;
        }
        Ok(StepStats { grad_norm, clip_scale })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_model::Architecture;
    use miles_model::{DeviceModel, Model, PackedBatch, presets};
    use miles_tensor::{DType, Device};

    /// Fitting one fixed sequence must raise its log-likelihood: forward, backward and AdamW
    /// agree on what "downhill" means.
    #[test]
    fn a_few_steps_fit_a_fixed_sequence() {
        let config = presets::preset("tiny", Some(Architecture::Qwen3)).unwrap();
        let mut weights = Weights::random(&config, 7);
        let model = Model::new(config.clone(), weights.clone());
        let mut model = DeviceModel::new(&model, &Device::Cpu, DType::F32).unwrap();
        let tokens: Vec<u32> = "12+7=19;".bytes().map(u32::from).collect();
        let batch = PackedBatch::new(&[(tokens, 1)]).unwrap();
        let hyper = AdamW { lr: 1e-2, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.0 };
        let mut opt = Optimizer::new(&config, hyper, 1.0);
        let mean = |v: &[f32]| v.iter().sum::<f32>() / v.len() as f32;
        let before = mean(&model.logprobs(&batch, 1.0).unwrap().0);
        for _ in 0..30 {
            let fwd = model.forward(&batch, 1.0).unwrap();
            let n = fwd.logp.len() as f32;
            let d_logp = vec![-1.0 / n; fwd.logp.len()];
            model.zero_grads().unwrap();
            model.backward(&fwd, &batch, &d_logp, &vec![0.0; fwd.logp.len()]).unwrap();
            let mut grads = model.grads_to_host().unwrap();
            let stats = opt.step(&mut weights, &mut grads, hyper.lr).unwrap();
            model.set_weights(&weights).unwrap();
            assert!(stats.grad_norm.is_finite() && stats.clip_scale <= 1.0);
        }
        let after = mean(&model.logprobs(&batch, 1.0).unwrap().0);
        assert!(before < -4.0 && after > -0.5, "mean logp {before} -> {after}");
        assert_eq!(opt.steps(), 30);
    }

    #[test]
    fn from_state_restores_the_moments_and_checks_their_shapes() {
        let config = presets::preset("tiny", Some(Architecture::Qwen3)).unwrap();
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.0 };
        let mut weights = Weights::random(&config, 1);
        let mut opt = Optimizer::new(&config, hyper, 1.0);
        opt.step(&mut weights, &mut Weights::random(&config, 2), hyper.lr).unwrap();
        let (m, v) = opt.moments();
        let back =
            Optimizer::from_state(&config, hyper, 1.0, m.clone(), v.clone(), opt.steps()).unwrap();
        assert_eq!(back.moments(), opt.moments());
        assert_eq!(back.steps(), 1);
        let llama = presets::preset("tiny", Some(Architecture::Llama)).unwrap();
        let err = Optimizer::from_state(&config, hyper, 1.0, Weights::zeros(&llama), v.clone(), 1)
            .unwrap_err()
            .to_string();
        assert!(err.contains("first moments"), "{err}");
    }
}
