//! The draft of speculative rollouts: one MTP layer, as DeepSeek-V3 and MiMo train theirs. At
//! position t it reads the policy's state there (final-normed, the one its head reads, as
//! SGLang hands it to a NextN draft: [`DeviceModel::head_states`]) and the embedding of token
//! t + 1 (both detached), each through an RMSNorm of its own; a projection of the two
//! concatenated (2·hidden → hidden) feeds one decoder layer of the policy's shape, whose
//! output, normed, goes through the policy's LM head (shared, detached) to predict token
//! t + 2. Chained, the draft's next step reads its own normed output in place of the
//! policy's state.
//!
//! On a device the draft is a model of [`draft_config`] ([`Draft::model_weights`]):
//! [`DeviceModel::forward_draft`] and [`DeviceModel::backward_draft`] train it,
//! [`DeviceModel::step_draft`] proposes over the paged cache with the forward's bits.
//!
//! Checkpoints come in DeepSeek-V3's names (`model.layers.{N}.enorm`, `hnorm`, `eh_proj`,
//! `shared_head.norm` and the layer's own, N the policy's layer count) or MiMo's
//! (`model.mtp_layers.0.token_layernorm`, `hidden_layernorm`, `input_proj`, `final_layernorm`);
//! DeepSeek concatenates [embedding, hidden], MiMo [hidden, embedding]. Their copies of the
//! embedding and head, where present, are checked against the policy's vocabulary and not
//! used: the draft shares the policy's.

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::Path;

use miles_tensor::rng::Rng;
use safetensors::{Dtype, tensor::TensorView};

use crate::file_layout::FileTensor;
use crate::weights::{LayerWeights, TensorFiles, Weights, tensor_spec};
use crate::{Architecture, DeviceModel, Error, ModelConfig, PackedBatch, Result};

/// Whose names and concatenation order a draft's checkpoint has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftFormat {
    /// `model.layers.{N}.…`, input `[embedding, hidden]`.
    DeepSeek,
    /// `model.mtp_layers.0.…`, input `[hidden, embedding]`.
    MiMo,
}

/// One MTP layer's weights (f32 masters), for a policy of config `policy`.
#[derive(Debug, Clone, PartialEq)]
pub struct Draft {
    pub format: DraftFormat,
    /// The RMSNorms of the embedding and of the policy's hidden state.
    pub token_norm: Vec<f32>,
    pub hidden_norm: Vec<f32>,
    /// `[hidden × 2·hidden]`, over the concatenation in `format`'s order.
    pub proj: Vec<f32>,
    pub layer: LayerWeights,
    /// The norm before the policy's head.
    pub final_norm: Vec<f32>,
}

/// What a draft trains on for a policy's packed batch ([`DraftBatch::of`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftBatch {
    /// Each kept sequence less its first token, with the same prompt length: the draft at
    /// position t reads token t + 1, and its targets are the response tokens from the second
    /// on (miles' loss mask shifted by one).
    pub batch: PackedBatch,
    /// The policy's rows whose states the draft reads, in the draft batch's token order: each
    /// kept sequence's positions but its last.
    pub state_rows: Vec<u32>,
    /// The policy batch's sequences kept: those with at least two response tokens.
    pub sequences: Vec<usize>,
}

impl DraftBatch {
    /// The draft's batch for `batch`; `None` when no sequence has two response tokens.
    pub fn of(batch: &PackedBatch) -> Option<DraftBatch> {
        let mut seqs = Vec::new();
        let mut sequences = Vec::new();
        let mut state_rows = Vec::new();
        for (s, (w, &p)) in batch.cu_seqlens.windows(2).zip(&batch.prompt_lens).enumerate() {
            if w[1] - w[0] < p + 2 {
                continue;
            }
            seqs.push((batch.tokens[w[0] + 1..w[1]].to_vec(), p));
            state_rows.extend(w[0] as u32..w[1] as u32 - 1);
            sequences.push(s);
        }
        let batch = PackedBatch::new(&seqs).ok().filter(|_| !seqs.is_empty())?;
        Some(DraftBatch { batch, state_rows, sequences })
    }
}

/// Supervised steps of `draft` (a model of [`draft_config`]) on `batch`, sequences of the
/// policy's: its cross-entropy on the responses from their second token, read from the
/// policy's states of one forward; `steps` AdamW steps of `hyper` over the whole batch. The
/// mean loss of the last step (`None` when no response has two tokens).
pub fn fit_draft(
    policy: &DeviceModel,
    draft: &mut DeviceModel,
    batch: &PackedBatch,
    steps: usize,
    hyper: &miles_tensor::cpu::AdamW,
) -> Result<Option<f64>> {
    let Some(d) = DraftBatch::of(batch) else { return Ok(None) };
    let states = policy.head_states(&policy.forward(batch, 1.0)?)?;
    let states = miles_tensor::ops::gather_rows(&states, &d.state_rows)?;
    let all: Vec<u32> = (0..d.state_rows.len() as u32).collect();
    let mut loss = None;
    for _ in 0..steps {
        draft.zero_grads()?;
        let f =
            draft.forward_draft(&d.batch, 1.0, miles_tensor::ops::gather_rows(&states, &all)?)?;
        let n = f.logp.len();
        loss = Some(-f.logp.iter().map(|&l| f64::from(l)).sum::<f64>() / n as f64);
        draft.backward_draft(&f, &d.batch, &vec![-1.0 / n as f32; n], &vec![0.0; n])?;
        draft.adamw_step(hyper, 1.0)?;
    }
    Ok(loss)
}

/// The draft as a model: one decoder layer of the policy's shape (dense, attending over the
/// whole sequence; DeepSeek-V3's a sparse one, as its MTP layer is) fed by the input stage ([`ModelConfig::mtp_input`]), with the policy's
/// embedding and head.
pub fn draft_config(policy: &ModelConfig) -> Result<ModelConfig> {
    if policy.architecture == Architecture::Glm4 {
        return Err(Error::Invalid(
            "a speculative draft for GLM-4 is not supported (drafts have Llama's layer)".into(),
        ));
    }
    let mut c = policy.clone();
    c.num_hidden_layers = 1;
    // DeepSeek-V3's MTP layer is one of its sparse layers; other drafts are dense.
    match c.moe.as_mut().filter(|_| policy.mla.is_some()) {
        Some(m) => m.mlp_only_layers.clear(),
        None => c.moe = None,
    }
    c.mtp_input = true;
    if let Some(g) = c.gemma.as_mut() {
        g.sliding = vec![false];
    }
    Ok(c)
}

/// Names of the draft's own tensors (not its layer's) in `format`, in the order
/// [`Draft::own`] lists them, under the layer prefix.
fn own_names(format: DraftFormat) -> [&'static str; 4] {
    match format {
        DraftFormat::DeepSeek => {
            ["enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight"]
        }
        DraftFormat::MiMo => [
            "token_layernorm.weight",
            "hidden_layernorm.weight",
            "input_proj.weight",
            "final_layernorm.weight",
        ],
    }
}

/// The prefix of the draft's tensors: DeepSeek's sits after the policy's layers.
fn prefix(format: DraftFormat, policy: &ModelConfig) -> String {
    match format {
        DraftFormat::DeepSeek => format!("model.layers.{}.", policy.num_hidden_layers),
        DraftFormat::MiMo => "model.mtp_layers.0.".into(),
    }
}

impl Draft {
    /// HF-style initialization (normal(0, 0.02) matrices, unit norms, zero biases; Gemma's
    /// (1 + w) norms zero), seeded.
    pub fn random(policy: &ModelConfig, format: DraftFormat, seed: u64) -> Result<Self> {
        let c = draft_config(policy)?;
        let layer = Weights::random(&c, seed).layers.remove(0);
        let h = policy.hidden_size;
        let unit = if policy.gemma.is_some() { 0.0 } else { 1.0 };
        Ok(Draft {
            format,
            token_norm: vec![unit; h],
            hidden_norm: vec![unit; h],
            proj: Rng::new(seed ^ 0x6d74_7064_7261_6674).vec(2 * h * h, 0.02),
            layer,
            final_norm: vec![unit; h],
        })
    }

    fn own(&self) -> [&Vec<f32>; 4] {
        [&self.token_norm, &self.hidden_norm, &self.proj, &self.final_norm]
    }

    /// Every tensor with its checkpoint name and shape: the draft's own, then its layer's.
    pub fn named(&self, policy: &ModelConfig) -> Result<Vec<FileTensor<'_>>> {
        let c = draft_config(policy)?;
        let (h, p) = (policy.hidden_size, prefix(self.format, policy));
        let shapes = [vec![h], vec![h], vec![h, 2 * h], vec![h]];
        let mut out: Vec<FileTensor<'_>> = own_names(self.format)
            .iter()
            .zip(shapes)
            .zip(self.own())
            .map(|((n, s), t)| (format!("{p}{n}"), s, Cow::Borrowed(&t[..])))
            .collect();
        let layer_spec = tensor_spec(&c).into_iter().filter_map(|(name, shape)| {
            Some((name.strip_prefix("model.layers.0.")?.to_string(), shape))
        });
        for ((rest, shape), t) in layer_spec.zip(self.layer.tensors()) {
            let rows = crate::file_layout::layer_rows(&c, &rest, t, shape[0], true);
            out.push((format!("{p}{rest}"), shape, rows));
        }
        Ok(out)
    }

    /// The tensors a DeepSeek-V3 checkpoint holds for its MTP layer beside the policy's:
    /// [`Draft::named`], and in DeepSeek's format the copies of the policy's embedding and
    /// head that the layer carries (`embed_tokens`, `shared_head.head`).
    pub fn checkpoint_tensors<'a>(
        &'a self,
        policy: &ModelConfig,
        policy_weights: &'a Weights,
    ) -> Result<Vec<FileTensor<'a>>> {
        let mut out = self.named(policy)?;
        if self.format == DraftFormat::DeepSeek {
            let p = prefix(self.format, policy);
            let shape = vec![policy.vocab_size, policy.hidden_size];
            let head = policy_weights.lm_head.as_ref().unwrap_or(&policy_weights.embed);
            out.push((
                format!("{p}embed_tokens.weight"),
                shape.clone(),
                Cow::Borrowed(&policy_weights.embed),
            ));
            out.push((format!("{p}shared_head.head.weight"), shape, Cow::Borrowed(head)));
        }
        Ok(out)
    }

    /// The MTP layer that a DeepSeek-V3 checkpoint in `dir` carries for `policy` (its
    /// `num_nextn_predict_layers` and `model.layers.{num_hidden_layers}.eh_proj`), if any.
    pub fn of_checkpoint(dir: &Path, policy: &ModelConfig) -> Result<Option<Self>> {
        if policy.mla.as_ref().is_none_or(|m| m.mtp_layers == 0) {
            return Ok(None);
        }
        let proj = format!("{}eh_proj.weight", prefix(DraftFormat::DeepSeek, policy));
        if !TensorFiles::open(dir)?.names().iter().any(|n| *n == proj) {
            return Ok(None);
        }
        Self::load(dir, policy).map(Some)
    }

    /// The draft as a model of [`draft_config`]: the policy's embedding and head (copies,
    /// which the model keeps frozen), the input stage with the projection split into the
    /// halves that take the embedding and the policy's states, the layer, the final norm.
    pub fn model_weights(&self, policy: &ModelConfig, policy_weights: &Weights) -> Result<Weights> {
        let h = policy.hidden_size;
        let (token, hidden) = self.proj_halves(h);
        Ok(Weights {
            embed: policy_weights.embed.clone(),
            mtp: vec![self.token_norm.clone(), self.hidden_norm.clone(), token, hidden],
            layers: vec![self.layer.clone()],
            final_norm: self.final_norm.clone(),
            lm_head: policy_weights.lm_head.clone(),
        })
    }

    /// The draft of a model of [`draft_config`]'s weights (after training), in `format`.
    pub fn from_model_weights(format: DraftFormat, w: &Weights) -> Result<Self> {
        let ([tn, hn, token, hidden], [layer]) = (&w.mtp[..], &w.layers[..]) else {
            return Err(Error::Invalid(
                "not a draft's weights: no input stage or not one layer".into(),
            ));
        };
        let h = tn.len();
        let mut proj = vec![0.0; 2 * h * h];
        let (t_at, h_at) = Self::halves_at(format, h);
        for i in 0..h {
            let row = &mut proj[i * 2 * h..(i + 1) * 2 * h];
            row[t_at..t_at + h].copy_from_slice(&token[i * h..(i + 1) * h]);
            row[h_at..h_at + h].copy_from_slice(&hidden[i * h..(i + 1) * h]);
        }
        Ok(Draft {
            format,
            token_norm: tn.clone(),
            hidden_norm: hn.clone(),
            proj,
            layer: layer.clone(),
            final_norm: w.final_norm.clone(),
        })
    }

    /// Where the embedding's and the states' columns start in a row of the projection.
    fn halves_at(format: DraftFormat, h: usize) -> (usize, usize) {
        match format {
            DraftFormat::DeepSeek => (0, h),
            DraftFormat::MiMo => (h, 0),
        }
    }

    /// The projection's `[h × h]` halves over the embedding and over the policy's states.
    fn proj_halves(&self, h: usize) -> (Vec<f32>, Vec<f32>) {
        let (t_at, h_at) = Self::halves_at(self.format, h);
        let half = |at: usize| -> Vec<f32> {
            self.proj.chunks(2 * h).flat_map(|row| row[at..at + h].iter().copied()).collect()
        };
        (half(t_at), half(h_at))
    }

    /// Reads a draft from `dir` (`model.safetensors` or shards with their index) in either
    /// format, for `policy`; a tensor of the wrong shape (another hidden size or vocabulary)
    /// or missing is an error naming it.
    pub fn load(dir: &Path, policy: &ModelConfig) -> Result<Self> {
        let files = TensorFiles::open(dir)?;
        let names = files.names();
        let format = if names.iter().any(|n| n.starts_with("model.mtp_layers.0.")) {
            DraftFormat::MiMo
        } else if names.iter().any(|n| n.ends_with(".eh_proj.weight")) {
            DraftFormat::DeepSeek
        } else {
            return Err(Error::Config {
                path: dir.to_path_buf(),
                message:
                    "no MTP layer found: expected DeepSeek-V3's model.layers.N.eh_proj.weight \
                          or MiMo's model.mtp_layers.0.input_proj.weight"
                        .into(),
            });
        };
        // DeepSeek's layer index is the policy's layer count; a checkpoint of the draft alone
        // may hold it at another index: take the one there.
        let p = match format {
            DraftFormat::MiMo => prefix(format, policy),
            DraftFormat::DeepSeek => {
                let proj = names.iter().find(|n| n.ends_with(".eh_proj.weight")).expect("found");
                proj.trim_end_matches("eh_proj.weight").to_string()
            }
        };
        let h = policy.hidden_size;
        let mismatch = |name: &str, message: String| -> Result<()> {
            Err(Error::Tensor { path: dir.to_path_buf(), tensor: name.into(), message })
        };
        // The shared copies a DeepSeek MTP layer carries: the policy's vocabulary and width.
        for copy in ["embed_tokens.weight", "shared_head.head.weight"] {
            let name = format!("{p}{copy}");
            if let Ok(shape) = files.shape(&name)
                && shape != [policy.vocab_size, h]
            {
                mismatch(
                    &name,
                    format!(
                        "shape {shape:?}, but the policy's vocabulary and hidden size are \
                         [{}, {h}]: a draft of another model",
                        policy.vocab_size
                    ),
                )?;
            }
        }
        let [tn, hn, proj, fnorm] = own_names(format).map(|n| format!("{p}{n}"));
        let proj_shape = files.shape(&proj)?;
        if proj_shape != [h, 2 * h] {
            mismatch(
                &proj,
                format!(
                    "shape {proj_shape:?}, expected [{h}, {}]: the draft's hidden size differs \
                     from the policy's hidden_size {h}",
                    2 * h
                ),
            )?;
        }
        let c = draft_config(policy)?;
        let experts = c.moe.as_ref().map_or(0, |m| m.num_experts);
        let mut layer =
            LayerWeights { experts: vec![Default::default(); experts], ..Default::default() };
        for (name, shape) in tensor_spec(&c) {
            let Some(rest) = name.strip_prefix("model.layers.0.") else { continue };
            let slot = layer.slot(rest).expect("tensor_spec names a layer tensor");
            let data = files.f32(&format!("{p}{rest}"), &shape)?;
            *slot = crate::file_layout::layer_rows(&c, rest, &data, shape[0], false).into_owned();
        }
        Ok(Draft {
            format,
            token_norm: files.f32(&tn, &[h])?,
            hidden_norm: files.f32(&hn, &[h])?,
            proj: files.f32(&proj, &[h, 2 * h])?,
            layer,
            final_norm: files.f32(&fnorm, &[h])?,
        })
    }

    /// Writes `dir/model.safetensors` (f32) in the draft's format.
    pub fn save(&self, dir: &Path, policy: &ModelConfig) -> Result<()> {
        std::fs::create_dir_all(dir)
            .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
        let named = self.named(policy)?;
        let bytes: Vec<Vec<u8>> = named
            .iter()
            .map(|(_, _, t)| t.iter().flat_map(|v| v.to_le_bytes()).collect())
            .collect();
        let views = named
            .iter()
            .zip(&bytes)
            .map(|((name, shape, _), data)| {
                let view = TensorView::new(Dtype::F32, shape.clone(), data)
                    .map_err(|e| Error::Invalid(format!("draft tensor {name}: {e}")))?;
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let path = dir.join("model.safetensors");
        let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
        safetensors::serialize_to_file(views, Some(metadata), &path)
            .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::preset;

    fn temp(tag: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("miles-draft-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn drafts_round_trip_in_both_formats_bit_for_bit() {
        for arch in [
            Architecture::Qwen3,
            Architecture::Qwen2,
            Architecture::Gemma3,
            Architecture::DeepseekV3,
        ] {
            let policy = preset("tiny", Some(arch)).unwrap();
            for format in [DraftFormat::DeepSeek, DraftFormat::MiMo] {
                let d = Draft::random(&policy, format, 3).unwrap();
                assert_eq!(d.proj.len(), 2 * 64 * 64);
                let dir = temp(&format!("{arch:?}-{format:?}"));
                d.save(&dir, &policy).unwrap();
                let back = Draft::load(&dir, &policy).unwrap();
                assert_eq!(back, d, "{arch:?} {format:?}");
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        // DeepSeek's names sit after the policy's layers.
        let policy = preset("tiny", None).unwrap();
        let d = Draft::random(&policy, DraftFormat::DeepSeek, 1).unwrap();
        let names: Vec<String> = d.named(&policy).unwrap().into_iter().map(|t| t.0).collect();
        assert!(names.contains(&"model.layers.2.eh_proj.weight".to_string()), "{names:?}");
        assert!(names.contains(&"model.layers.2.self_attn.q_norm.weight".to_string()));
        // DeepSeek-V3's MTP layer is sparse, its query heads in the files' order.
        let policy = preset("tiny", Some(Architecture::DeepseekV3)).unwrap();
        let d = Draft::random(&policy, DraftFormat::DeepSeek, 1).unwrap();
        let named = d.named(&policy).unwrap();
        let find = |n: &str| named.iter().find(|t| t.0 == n).map(|t| t.2.to_vec());
        assert!(find("model.layers.2.mlp.experts.7.down_proj.weight").is_some());
        assert!(find("model.layers.2.mlp.shared_experts.up_proj.weight").is_some());
        let q = find("model.layers.2.self_attn.q_b_proj.weight").unwrap();
        assert_ne!(q, d.layer.q_b_proj, "reordered in the file");
    }

    #[test]
    fn a_draft_of_another_width_or_vocabulary_is_refused_naming_the_tensor() {
        let policy = preset("tiny", None).unwrap();
        let dir = temp("mismatch");
        Draft::random(&policy, DraftFormat::DeepSeek, 1).unwrap().save(&dir, &policy).unwrap();
        let wider = ModelConfig { hidden_size: 96, ..policy.clone() };
        let e = Draft::load(&dir, &wider).unwrap_err().to_string();
        assert!(e.contains("tensor 'model.layers.2.eh_proj.weight'"), "{e}");
        assert!(e.contains("differs from the policy's hidden_size 96"), "{e}");
        let e = Draft::load(&dir.join("nowhere"), &policy).unwrap_err().to_string();
        assert!(e.contains("nowhere"), "{e}");
        // A DeepSeek layer's copy of the head with another vocabulary.
        let d = Draft::random(&policy, DraftFormat::DeepSeek, 1).unwrap();
        let head = vec![0.0f32; 100 * 64];
        let mut named = d.named(&policy).unwrap();
        named.push(("model.layers.2.shared_head.head.weight".into(), vec![100, 64], head.into()));
        let bytes: Vec<Vec<u8>> =
            named.iter().map(|t| t.2.iter().flat_map(|v| v.to_le_bytes()).collect()).collect();
        let views: Vec<(String, TensorView<'_>)> = named
            .iter()
            .zip(&bytes)
            .map(|(t, b)| (t.0.clone(), TensorView::new(Dtype::F32, t.1.clone(), b).unwrap()))
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
        let e = Draft::load(&dir, &policy).unwrap_err().to_string();
        assert!(e.contains("shared_head.head.weight") && e.contains("another model"), "{e}");
        // No MTP layer at all.
        policy_checkpoint(&dir, &policy);
        let e = Draft::load(&dir, &policy).unwrap_err().to_string();
        assert!(e.contains("no MTP layer found"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn policy_checkpoint(dir: &Path, policy: &ModelConfig) {
        Weights::random(policy, 0).save(dir, policy, Dtype::F32, usize::MAX).unwrap();
    }

    /// The draft on the CPU in f32: every trainable tensor's gradient (the input stage, the
    /// layer, the final norm) against finite differences of the same loss, the policy's
    /// embedding and head frozen (no gradient, unchanged by AdamW), and the model's weights
    /// back to the same draft in both formats.
    #[test]
    fn the_drafts_gradients_match_finite_differences() {
        use crate::model::tests::{batch, model, tiny};
        use crate::{DeviceModel, Model};
        use miles_tensor::testing::{check_gradient, dot};
        use miles_tensor::{DType, Device, Tensor};
        let deepseek = crate::presets::preset("tiny", Some(Architecture::DeepseekV3)).unwrap();
        for config in [tiny(Architecture::Qwen3, true), tiny(Architecture::Llama, false), deepseek]
        {
            let arch = config.architecture;
            let policy = model(config, 4);
            let pc = &policy.config;
            let c = draft_config(pc).unwrap();
            let mut w = Draft::random(pc, DraftFormat::MiMo, 2)
                .unwrap()
                .model_weights(pc, &policy.weights)
                .unwrap();
            // Away from the init's unit norms and small matrices, as the policy's (so every
            // path matters); the policy's embedding and head as they are.
            let mut rng = Rng::new(6);
            let shared = [w.embed.clone(), w.lm_head.clone().unwrap_or_default()];
            for t in w.tensors_mut().into_iter().filter(|t| !shared.contains(*t)) {
                t.iter_mut().for_each(|v| {
                    *v = if *v == 1.0 { 1.0 + 0.3 * rng.normal() } else { 0.4 * rng.normal() }
                });
            }
            let draft = Draft::from_model_weights(DraftFormat::MiMo, &w).unwrap();
            assert_eq!(draft.model_weights(pc, &policy.weights).unwrap(), w);
            let mut dm =
                DeviceModel::new(&Model::new(c.clone(), w.clone()), &Device::Cpu, DType::F32)
                    .unwrap();
            let b = batch();
            let (t, h) = (b.tokens.len(), pc.hidden_size);
            let hidden = rng.vec(t * h, 1.0);
            let states = || Tensor::from_f32(&[t, h], hidden.clone(), &Device::Cpu).unwrap();
            let fwd = dm.forward_draft(&b, 0.8, states()).unwrap();
            let (ga, gb) = (rng.vec(fwd.logp.len(), 1.0), rng.vec(fwd.logp.len(), 1.0));
            dm.backward_draft(&fwd, &b, &ga, &gb).unwrap();
            let grads = dm.grads_to_host().unwrap();
            assert!(grads.embed.iter().all(|g| *g == 0.0), "{arch:?}: the embedding is frozen");
            if let Some(head) = &grads.lm_head {
                assert!(head.iter().all(|g| *g == 0.0), "{arch:?}: the head is frozen");
            }
            let spec = tensor_spec(&c);
            for (k, (name, _)) in spec.iter().enumerate() {
                if name == "model.embed_tokens.weight" || name == "lm_head.weight" {
                    continue;
                }
                let analytic = grads.tensors()[k].clone();
                let mut probe = w.clone();
                let mut x = probe.tensors()[k].clone();
                check_gradient(name, &mut x, &analytic, 12, |x| {
                    *probe.tensors_mut()[k] = x.to_vec();
                    dm.set_weights(&probe).unwrap();
                    let f = dm.forward_draft(&b, 0.8, states()).unwrap();
                    dot(&ga, &f.logp) + dot(&gb, &f.entropy)
                });
            }
            // AdamW moves the draft's own tensors only.
            dm.set_weights(&w).unwrap();
            let hyper = miles_tensor::cpu::AdamW {
                lr: 1e-2,
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.1,
            };
            dm.adamw_step(&hyper, 1.0).unwrap();
            let after = dm.to_weights().unwrap();
            assert_eq!((&after.embed, &after.lm_head), (&w.embed, &w.lm_head));
            assert_ne!(after.mtp, w.mtp);
        }
    }

    /// The draft's incremental steps over the paged cache (a prompt, then a row at a time)
    /// give each row the bits of its forward over the whole sequences, in f32 and bf16.
    #[test]
    fn draft_steps_have_the_bits_of_the_drafts_forward() {
        use crate::model::tests::{batch, model, tiny};
        use crate::{DeviceModel, KvCache, Model, StepRow};
        use miles_tensor::{DType, Device, Tensor};
        let policy = model(tiny(Architecture::Qwen3, true), 3);
        let pc = &policy.config;
        let w = Draft::random(pc, DraftFormat::DeepSeek, 5)
            .unwrap()
            .model_weights(pc, &policy.weights)
            .unwrap();
        let c = draft_config(pc).unwrap();
        for dtype in [DType::F32, DType::BF16] {
            let dm =
                DeviceModel::new(&Model::new(c.clone(), w.clone()), &Device::Cpu, dtype).unwrap();
            let b = batch();
            let (t, h) = (b.tokens.len(), pc.hidden_size);
            let states = Tensor::from_f32(&[t, h], Rng::new(2).vec(t * h, 1.0), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let f = dm.forward_draft(&b, 1.0, states.to_dtype(dtype).unwrap()).unwrap();
            let bits = |t: &Tensor| -> Vec<u32> {
                t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
            };
            let want = bits(&dm.head_states(&f).unwrap());
            let all = bits(&states);
            let mut kv = KvCache::new(&c, 4, &Device::Cpu, dtype).unwrap();
            for (s, w0) in b.cu_seqlens.windows(2).enumerate() {
                let (start, n) = (w0[0], w0[1] - w0[0]);
                let table = [s as crate::BlockId];
                // The prompt (all but the last two), then one row a step.
                let mut cuts = vec![(0, n - 2)];
                cuts.extend((n - 2..n).map(|p| (p, p + 1)));
                for (p0, p1) in cuts {
                    let rows: Vec<StepRow> = (p0..p1)
                        .map(|p| StepRow {
                            token: b.tokens[start + p],
                            position: p,
                            blocks: &table,
                        })
                        .collect();
                    let picked: Vec<f32> = all[(start + p0) * h..(start + p1) * h]
                        .iter()
                        .map(|&x| f32::from_bits(x))
                        .collect();
                    let rows_states = Tensor::from_f32(&[p1 - p0, h], picked, &Device::Cpu)
                        .unwrap()
                        .to_dtype(dtype)
                        .unwrap();
                    let got = bits(&dm.step_draft(&rows, &rows_states, &mut kv).unwrap());
                    assert!(
                        got == want[(start + p0) * h..(start + p1) * h],
                        "{dtype}: sequence {s} rows {p0}..{p1}"
                    );
                }
            }
        }
    }

    /// After the policy changes, the draft's copies of its embedding and head follow it by
    /// `copy_weights_from`: the draft then scores as one built afresh from the new weights.
    #[test]
    fn a_draft_follows_its_policys_embedding_and_head() {
        use crate::model::tests::{batch, model, tiny};
        use crate::{DeviceModel, Model};
        use miles_tensor::{DType, Device, Tensor};
        for dtype in [DType::F32, DType::BF16] {
            let (old, new) = (
                model(tiny(Architecture::Llama, false), 1),
                model(tiny(Architecture::Llama, false), 2),
            );
            let pc = &old.config;
            let draft = Draft::random(pc, DraftFormat::DeepSeek, 3).unwrap();
            let c = draft_config(pc).unwrap();
            let on = |w: Weights| {
                DeviceModel::new(&Model::new(c.clone(), w), &Device::Cpu, dtype).unwrap()
            };
            let mut dm = on(draft.model_weights(pc, &old.weights).unwrap());
            let fresh = on(draft.model_weights(pc, &new.weights).unwrap());
            let policy = DeviceModel::new(&new, &Device::Cpu, dtype).unwrap();
            dm.copy_weights_from(&policy, &["model.embed_tokens.weight", "lm_head.weight"])
                .unwrap();
            let b = batch();
            let (t, h) = (b.tokens.len(), pc.hidden_size);
            let states = || {
                Tensor::from_f32(&[t, h], Rng::new(2).vec(t * h, 1.0), &Device::Cpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap()
            };
            let (got, want) = (
                dm.forward_draft(&b, 1.0, states()).unwrap(),
                fresh.forward_draft(&b, 1.0, states()).unwrap(),
            );
            assert_eq!((got.logp, got.entropy), (want.logp, want.entropy), "{dtype}");
            let e = dm.copy_weights_from(&policy, &["model.layers.1.mlp.up_proj.weight"]);
            assert!(e.unwrap_err().to_string().contains("not a weight of both models"));
        }
    }

    /// The draft's batch: each sequence with two response tokens or more, less its first
    /// token; the targets are the response from its second token on, read from the states of
    /// the positions before.
    #[test]
    fn a_draft_batch_shifts_each_sequence_by_one() {
        let b = PackedBatch::new(&[
            (vec![1, 2, 3, 4, 5], 2),
            (vec![6, 7, 8], 2),
            (vec![9, 10, 11, 12], 1),
        ])
        .unwrap();
        let d = DraftBatch::of(&b).unwrap();
        assert_eq!(d.sequences, [0, 2]);
        assert_eq!(d.batch.tokens, [2, 3, 4, 5, 10, 11, 12]);
        assert_eq!(d.batch.prompt_lens, [2, 1]);
        assert_eq!(d.state_rows, [0, 1, 2, 3, 8, 9, 10]);
        // Targets: the responses' second tokens on (4, 5 and 11, 12), each read at the row of
        // the token two before it, whose policy state is state_rows[row].
        let (rows, targets) = d.batch.response_rows();
        assert_eq!(targets, [4, 5, 11, 12]);
        let states: Vec<u32> = rows.iter().map(|&r| d.state_rows[r]).collect();
        assert_eq!(states, [1, 2, 8, 9]);
        assert!(DraftBatch::of(&PackedBatch::new(&[(vec![1, 2, 3], 2)]).unwrap()).is_none());
    }

    #[test]
    fn glm4_policies_get_a_clear_refusal() {
        let policy = preset("tiny", Some(Architecture::Glm4)).unwrap();
        let e = Draft::random(&policy, DraftFormat::DeepSeek, 0).unwrap_err().to_string();
        assert!(e.contains("GLM-4 is not supported"), "{e}");
    }
}
