//! Parity with HF transformers' fixtures (`tests/fixtures/hf`, written by
//! `tests/fixtures/make_hf_parity.py`): a tiny checkpoint, a packed batch, and transformers'
//! logprobs, entropies and gradients; and the model on the CPU in f32, the reference. Shared by
//! the integration tests and the device model's tests (every device).

use std::path::{Path, PathBuf};

use miles_tensor::{DType, Device};

use crate::file_layout::file_tensors;
use crate::weights::TensorFiles;
use crate::{DeviceModel, Model, ModelConfig, PackedBatch, Result, Weights};

/// `model` on the CPU in f32: the reference every other device and dtype is checked against.
pub fn on_cpu(model: &Model) -> DeviceModel {
    DeviceModel::new(model, &Device::Cpu, DType::F32).expect("a model on the CPU in f32")
}

/// `tests/fixtures/hf/<name>` of this workspace.
pub fn hf_fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf").join(name)
}

/// A fixture: the model, the batch and what transformers computed on it.
pub struct HfReference {
    pub model: Model,
    pub batch: PackedBatch,
    pub temperature: f32,
    /// d(loss)/d(logp) and d(loss)/d(entropy) of the fixture's loss.
    pub advantages: Vec<f32>,
    pub entropy_coefs: Vec<f32>,
    pub logp: Vec<f32>,
    pub entropy: Vec<f32>,
    files: TensorFiles,
}

impl HfReference {
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_file(&dir.join("config.json"))?;
        let model = Model::new(config.clone(), Weights::load(dir, &config)?);
        let files = TensorFiles::single(&dir.join("reference.safetensors"))?;
        let text = std::fs::read_to_string(dir.join("reference.json"))
            .map_err(|e| crate::Error::Invalid(format!("{}: {e}", dir.display())))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| crate::Error::Invalid(format!("{}: {e}", dir.display())))?;
        let ids = files.i32("input_ids")?.1;
        let cu = files.i32("cu_seqlens")?.1;
        let prompts = files.i32("prompt_lens")?.1;
        let sequences: Vec<(Vec<u32>, usize)> = cu
            .windows(2)
            .zip(&prompts)
            .map(|(w, &p)| {
                (ids[w[0] as usize..w[1] as usize].iter().map(|&t| t as u32).collect(), p as usize)
            })
            .collect();
        let vector = |n: &str| files.shape(n).and_then(|shape| files.f32(n, &shape));
        Ok(HfReference {
            model,
            batch: PackedBatch::new(&sequences)?,
            temperature: json["temperature"].as_f64().unwrap_or(1.0) as f32,
            advantages: vector("advantages")?,
            entropy_coefs: vector("entropy_coefs")?,
            logp: vector("logp")?,
            entropy: vector("entropy")?,
            files,
        })
    }

    /// Panics at the first value beyond the CPU's tolerances: 1e-5 on logp and entropy; per
    /// gradient 1e-3 relative L2 and 1e-3·|theirs| + 1e-5 per element.
    pub fn assert_matches(&self, what: &str, logp: &[f32], entropy: &[f32], grads: &Weights) {
        assert_eq!(logp.len(), self.logp.len(), "{what}: response tokens");
        for (k, ((a, b), (c, d))) in
            logp.iter().zip(&self.logp).zip(entropy.iter().zip(&self.entropy)).enumerate()
        {
            assert!((a - b).abs() <= 1e-5, "{what}: logp[{k}] {a} vs transformers {b}");
            assert!((c - d).abs() <= 1e-5, "{what}: entropy[{k}] {c} vs transformers {d}");
        }
        self.assert_grads_within(what, grads, 1e-3);
    }

    /// Panics at the first gradient whose relative L2 distance from transformers' is `rel` or
    /// more, or with an element beyond `rel`·|theirs| + 1e-5.
    pub fn assert_grads_within(&self, what: &str, grads: &Weights, rel: f64) {
        let c = &self.model.config;
        for (tensor, shape, ours) in file_tensors(c, grads) {
            if tensor.ends_with("e_score_correction_bias") {
                // (A buffer in transformers, steering the choice only: no gradient.)
                assert!(ours.iter().all(|&g| g == 0.0), "{what}: {tensor} has a gradient");
                continue;
            }
            let theirs = self.files.f32(&format!("grad.{tensor}"), &shape).expect("fixture grad");
            let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let diff: Vec<f32> = ours.iter().zip(&theirs).map(|(a, b)| a - b).collect();
            let d = norm(&diff) / norm(&theirs).max(1e-12);
            assert!(d < rel, "{what}: gradient of {tensor} differs by {d:.2e} (relative L2)");
            for (a, b) in ours.iter().zip(&theirs) {
                assert!(
                    f64::from((a - b).abs()) <= rel * f64::from(b.abs()) + 1e-5,
                    "{what}: {tensor}: {a} vs transformers {b}"
                );
            }
        }
    }
}

/// `model` with the weights named in `covered` fake-quantized to INT4 in groups of `group`:
/// the values INT4 QAT's forward reads.
pub fn int4_fake_quantized(model: &Model, covered: &[String], group: usize) -> Model {
    let mut f = model.clone();
    let spec = crate::weights::tensor_spec(&f.config);
    for ((name, shape), t) in spec.iter().zip(f.weights.tensors_mut()) {
        if covered.contains(name) {
            *t = miles_tensor::cpu::fake_quantize_int4(t, shape[1], group)
                .expect("a group that divides the weight's rows");
        }
    }
    f
}

/// One AdamW step of `dm` at `lr` from random gradients of its logprobs and entropies on
/// `batch` (at temperature 1).
pub fn random_adamw_step(dm: &mut DeviceModel, batch: &PackedBatch, lr: f32) {
    let f = dm.forward(batch, 1.0).expect("the forward");
    let mut rng = miles_tensor::rng::Rng::new(4);
    let (ga, gb) = (rng.vec(f.logp.len(), 1.0), rng.vec(f.logp.len(), 1.0));
    dm.backward(&f, batch, &ga, &gb).expect("the backward");
    let hyper =
        miles_tensor::cpu::AdamW { lr, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.0 };
    dm.adamw_step(&hyper, 1.0).expect("the AdamW step");
}
