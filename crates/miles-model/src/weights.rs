//! Model weights as f32 master copies, in HF tensor names; safetensors in and out (single file
//! or sharded with `model.safetensors.index.json`).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use half::{bf16, f16};
use miles_tensor::cpu;
use miles_tensor::rng::Rng;
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::{Error, ModelConfig, Result};

/// The weights of one decoder layer; a tensor the model does not have is empty: `q_norm`/
/// `k_norm` without q/k norms (Llama, Qwen2), the biases without biases (Qwen2 has q/k/v's);
/// a sparse layer of a Qwen3-MoE model has `router` and `experts` instead of `gate_proj`/
/// `up_proj`/`down_proj` (empty there, and `router`/`experts` empty in a dense layer).
/// DeepSeek-V3's latent attention has the `q_a`/`q_b`/`kv_a`/`kv_b` tensors (or `q_proj`
/// beside `kv_*` without q_lora) in place of `k_proj`/`v_proj`, and its sparse layers a
/// `router_bias` and shared experts.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub q_proj: Vec<f32>,
    pub q_bias: Vec<f32>,
    pub k_proj: Vec<f32>,
    pub k_bias: Vec<f32>,
    pub v_proj: Vec<f32>,
    pub v_bias: Vec<f32>,
    /// DeepSeek's low-rank query (`q_a_proj`, `q_a_layernorm`, `q_b_proj`).
    pub q_a_proj: Vec<f32>,
    pub q_a_norm: Vec<f32>,
    pub q_b_proj: Vec<f32>,
    /// DeepSeek's compressed keys and values with the shared rotary key
    /// (`kv_a_proj_with_mqa`), their norm and their expansion (`kv_b_proj`).
    pub kv_a_proj: Vec<f32>,
    pub kv_a_norm: Vec<f32>,
    pub kv_b_proj: Vec<f32>,
    pub o_proj: Vec<f32>,
    pub o_bias: Vec<f32>,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// Gemma's norms before and after the MLP (its `post_norm` follows the attention).
    pub pre_ff_norm: Vec<f32>,
    pub post_ff_norm: Vec<f32>,
    pub gate_proj: Vec<f32>,
    pub gate_bias: Vec<f32>,
    pub up_proj: Vec<f32>,
    pub up_bias: Vec<f32>,
    pub down_proj: Vec<f32>,
    pub down_bias: Vec<f32>,
    /// `mlp.gate.weight` `[num_experts × hidden]`.
    pub router: Vec<f32>,
    /// DeepSeek's `mlp.gate.e_score_correction_bias` `[num_experts]`: steers the choice only.
    pub router_bias: Vec<f32>,
    /// DeepSeek's shared experts, one MLP (`mlp.shared_experts.*`).
    pub shared: ExpertWeights,
    pub experts: Vec<ExpertWeights>,
}

/// One expert of a sparse layer: a SwiGLU MLP of `moe_intermediate_size`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ExpertWeights {
    pub gate_proj: Vec<f32>,
    pub up_proj: Vec<f32>,
    pub down_proj: Vec<f32>,
}

/// All weights (or, with the same shapes, all gradients) of a model.
#[derive(Debug, Clone, PartialEq)]
pub struct Weights {
    pub embed: Vec<f32>,
    /// A draft's input stage, [`MTP_INPUT`]'s tensors in order (empty in other models).
    pub mtp: Vec<Vec<f32>>,
    pub layers: Vec<LayerWeights>,
    pub final_norm: Vec<f32>,
    /// `None` when the head is tied to the embedding.
    pub lm_head: Option<Vec<f32>>,
}

/// A draft's input stage ([`crate::draft`]), in [`tensor_spec`] order: the norms of the next
/// tokens' embeddings and of the policy's hidden states, and the projection's halves that
/// take them (`[hidden × hidden]` each).
pub const MTP_INPUT: [&str; 4] = [
    "mtp.token_norm.weight",
    "mtp.hidden_norm.weight",
    "mtp.token_proj.weight",
    "mtp.hidden_proj.weight",
];

/// HF name and shape of every tensor, in the order of [`Weights::tensors`].
pub fn tensor_spec(c: &ModelConfig) -> Vec<(String, Vec<usize>)> {
    let (h, d, i) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (q, kv) = (c.num_attention_heads * d, c.num_key_value_heads * d);
    let mut spec = vec![("model.embed_tokens.weight".to_string(), vec![c.vocab_size, h])];
    if c.mtp_input {
        for (name, shape) in MTP_INPUT.iter().zip([vec![h], vec![h], vec![h, h], vec![h, h]]) {
            spec.push((name.to_string(), shape));
        }
    }
    // A projection's weight, then its bias when it has one.
    let linear = |spec: &mut Vec<_>, name: String, (rows, cols), bias: bool| {
        spec.push((format!("{name}.weight"), vec![rows, cols]));
        if bias {
            spec.push((format!("{name}.bias"), vec![rows]));
        }
    };
    let b = c.bias;
    for l in 0..c.num_hidden_layers {
        let p = format!("model.layers.{l}.");
        spec.push((format!("{p}input_layernorm.weight"), vec![h]));
        if let Some(m) = &c.mla {
            mla_spec(&mut spec, &p, c, m);
        } else {
            linear(&mut spec, format!("{p}self_attn.q_proj"), (q, h), b.qkv);
            linear(&mut spec, format!("{p}self_attn.k_proj"), (kv, h), b.qkv);
            linear(&mut spec, format!("{p}self_attn.v_proj"), (kv, h), b.qkv);
            linear(&mut spec, format!("{p}self_attn.o_proj"), (h, q), b.o);
        }
        if c.architecture.has_qk_norm() {
            spec.push((format!("{p}self_attn.q_norm.weight"), vec![d]));
            spec.push((format!("{p}self_attn.k_norm.weight"), vec![d]));
        }
        spec.push((format!("{p}post_attention_layernorm.weight"), vec![h]));
        // (GLM-4's norms in the same places go by Gemma's names here: see file_layout.)
        if c.sandwich_norms() {
            spec.push((format!("{p}pre_feedforward_layernorm.weight"), vec![h]));
            spec.push((format!("{p}post_feedforward_layernorm.weight"), vec![h]));
        }
        match &c.moe {
            Some(m) if m.is_sparse(l) => {
                let i = m.moe_intermediate_size;
                spec.push((format!("{p}mlp.gate.weight"), vec![m.num_experts, h]));
                if m.routing != crate::Routing::Softmax {
                    spec.push((
                        format!("{p}mlp.gate.e_score_correction_bias"),
                        vec![m.num_experts],
                    ));
                }
                if m.shared_experts > 0 {
                    let (p, s) = (format!("{p}mlp.shared_experts."), m.shared_experts * i);
                    spec.push((format!("{p}gate_proj.weight"), vec![s, h]));
                    spec.push((format!("{p}up_proj.weight"), vec![s, h]));
                    spec.push((format!("{p}down_proj.weight"), vec![h, s]));
                }
                for e in 0..m.num_experts {
                    let p = format!("{p}mlp.experts.{e}.");
                    spec.push((format!("{p}gate_proj.weight"), vec![i, h]));
                    spec.push((format!("{p}up_proj.weight"), vec![i, h]));
                    spec.push((format!("{p}down_proj.weight"), vec![h, i]));
                }
            }
            _ => {
                linear(&mut spec, format!("{p}mlp.gate_proj"), (i, h), b.mlp);
                linear(&mut spec, format!("{p}mlp.up_proj"), (i, h), b.mlp);
                linear(&mut spec, format!("{p}mlp.down_proj"), (h, i), b.mlp);
            }
        }
    }
    spec.push(("model.norm.weight".to_string(), vec![h]));
    if !c.tie_word_embeddings {
        spec.push(("lm_head.weight".to_string(), vec![c.vocab_size, h]));
    }
    spec
}

/// DeepSeek's latent attention's tensors of the layer whose names start with `p`.
fn mla_spec(spec: &mut Vec<(String, Vec<usize>)>, p: &str, c: &ModelConfig, m: &crate::MlaConfig) {
    let (h, heads) = (c.hidden_size, c.num_attention_heads);
    let qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    let a = format!("{p}self_attn.");
    match m.q_lora_rank {
        Some(r) => {
            spec.push((format!("{a}q_a_proj.weight"), vec![r, h]));
            spec.push((format!("{a}q_a_layernorm.weight"), vec![r]));
            spec.push((format!("{a}q_b_proj.weight"), vec![heads * qk, r]));
        }
        None => spec.push((format!("{a}q_proj.weight"), vec![heads * qk, h])),
    }
    spec.push((
        format!("{a}kv_a_proj_with_mqa.weight"),
        vec![m.kv_lora_rank + m.qk_rope_head_dim, h],
    ));
    spec.push((format!("{a}kv_a_layernorm.weight"), vec![m.kv_lora_rank]));
    let kv = heads * (m.qk_nope_head_dim + m.v_head_dim);
    spec.push((format!("{a}kv_b_proj.weight"), vec![kv, m.kv_lora_rank]));
    spec.push((format!("{a}o_proj.weight"), vec![h, heads * m.v_head_dim]));
}

/// A layer's tensors in [`tensor_spec`] order (`&` or `&mut`), absent ones (empty) included.
macro_rules! layer_tensors {
    ($l:expr, $($r:tt)+) => {
        [
            $($r)+ $l.input_norm, $($r)+ $l.q_proj, $($r)+ $l.q_bias, $($r)+ $l.q_a_proj,
            $($r)+ $l.q_a_norm, $($r)+ $l.q_b_proj, $($r)+ $l.k_proj, $($r)+ $l.k_bias,
            $($r)+ $l.v_proj, $($r)+ $l.v_bias, $($r)+ $l.kv_a_proj, $($r)+ $l.kv_a_norm,
            $($r)+ $l.kv_b_proj, $($r)+ $l.o_proj, $($r)+ $l.o_bias, $($r)+ $l.q_norm,
            $($r)+ $l.k_norm, $($r)+ $l.post_norm, $($r)+ $l.pre_ff_norm,
            $($r)+ $l.post_ff_norm, $($r)+ $l.gate_proj, $($r)+ $l.gate_bias, $($r)+ $l.up_proj,
            $($r)+ $l.up_bias, $($r)+ $l.down_proj, $($r)+ $l.down_bias, $($r)+ $l.router,
            $($r)+ $l.router_bias, $($r)+ $l.shared.gate_proj, $($r)+ $l.shared.up_proj,
            $($r)+ $l.shared.down_proj,
        ]
    };
}

impl LayerWeights {
    /// The layer's tensors in [`tensor_spec`] order, absent ones left out.
    pub fn tensors(&self) -> Vec<&Vec<f32>> {
        let mut out: Vec<&Vec<f32>> =
            layer_tensors!(self, &).into_iter().filter(|t| !t.is_empty()).collect();
        for e in &self.experts {
            out.extend([&e.gate_proj, &e.up_proj, &e.down_proj]);
        }
        out
    }

    /// The tensor of HF name `name` within a layer (`self_attn.q_proj.weight`, …).
    pub(crate) fn slot(&mut self, name: &str) -> Option<&mut Vec<f32>> {
        if let Some(rest) = name.strip_prefix("mlp.experts.") {
            let (e, part) = rest.split_once('.')?;
            let e = self.experts.get_mut(e.parse::<usize>().ok()?)?;
            return match part {
                "gate_proj.weight" => Some(&mut e.gate_proj),
                "up_proj.weight" => Some(&mut e.up_proj),
                "down_proj.weight" => Some(&mut e.down_proj),
                _ => None,
            };
        }
        Some(match name {
            "input_layernorm.weight" => &mut self.input_norm,
            "self_attn.q_proj.weight" => &mut self.q_proj,
            "self_attn.q_proj.bias" => &mut self.q_bias,
            "self_attn.k_proj.weight" => &mut self.k_proj,
            "self_attn.k_proj.bias" => &mut self.k_bias,
            "self_attn.v_proj.weight" => &mut self.v_proj,
            "self_attn.v_proj.bias" => &mut self.v_bias,
            "self_attn.o_proj.weight" => &mut self.o_proj,
            "self_attn.o_proj.bias" => &mut self.o_bias,
            "self_attn.q_norm.weight" => &mut self.q_norm,
            "self_attn.k_norm.weight" => &mut self.k_norm,
            "post_attention_layernorm.weight" => &mut self.post_norm,
            "pre_feedforward_layernorm.weight" => &mut self.pre_ff_norm,
            "post_feedforward_layernorm.weight" => &mut self.post_ff_norm,
            "mlp.gate_proj.weight" => &mut self.gate_proj,
            "mlp.gate_proj.bias" => &mut self.gate_bias,
            "mlp.up_proj.weight" => &mut self.up_proj,
            "mlp.up_proj.bias" => &mut self.up_bias,
            "mlp.down_proj.weight" => &mut self.down_proj,
            "mlp.down_proj.bias" => &mut self.down_bias,
            "mlp.gate.weight" => &mut self.router,
            "mlp.gate.e_score_correction_bias" => &mut self.router_bias,
            "self_attn.q_a_proj.weight" => &mut self.q_a_proj,
            "self_attn.q_a_layernorm.weight" => &mut self.q_a_norm,
            "self_attn.q_b_proj.weight" => &mut self.q_b_proj,
            "self_attn.kv_a_proj_with_mqa.weight" => &mut self.kv_a_proj,
            "self_attn.kv_a_layernorm.weight" => &mut self.kv_a_norm,
            "self_attn.kv_b_proj.weight" => &mut self.kv_b_proj,
            "mlp.shared_experts.gate_proj.weight" => &mut self.shared.gate_proj,
            "mlp.shared_experts.up_proj.weight" => &mut self.shared.up_proj,
            "mlp.shared_experts.down_proj.weight" => &mut self.shared.down_proj,
            _ => return None,
        })
    }
}

fn numel(shape: &[usize]) -> usize {
    shape.iter().product()
}

fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

impl Weights {
    /// The tensor of HF name `name`.
    fn slot(&mut self, name: &str) -> Option<&mut Vec<f32>> {
        match name {
            "model.embed_tokens.weight" => Some(&mut self.embed),
            "model.norm.weight" => Some(&mut self.final_norm),
            _ if name.starts_with("mtp.") => {
                let k = MTP_INPUT.iter().position(|n| *n == name)?;
                self.mtp.get_mut(k)
            }
            "lm_head.weight" => self.lm_head.as_mut(),
            _ => {
                let rest = name.strip_prefix("model.layers.")?;
                let (l, rest) = rest.split_once('.')?;
                self.layers.get_mut(l.parse::<usize>().ok()?)?.slot(rest)
            }
        }
    }
}

impl Weights {
    /// Builds weights whose tensor `k` of [`tensor_spec`] is `make(name, shape)`.
    pub(crate) fn build<E>(
        c: &ModelConfig,
        mut make: impl FnMut(&str, &[usize]) -> std::result::Result<Vec<f32>, E>,
    ) -> std::result::Result<Self, E> {
        let mut w = Weights {
            embed: Vec::new(),
            mtp: if c.mtp_input { vec![Vec::new(); MTP_INPUT.len()] } else { Vec::new() },
            layers: (0..c.num_hidden_layers)
                .map(|l| LayerWeights {
                    experts: match &c.moe {
                        Some(m) if m.is_sparse(l) => vec![ExpertWeights::default(); m.num_experts],
                        _ => Vec::new(),
                    },
                    ..LayerWeights::default()
                })
                .collect(),
            final_norm: Vec::new(),
            lm_head: (!c.tie_word_embeddings).then(Vec::new),
        };
        for (name, shape) in tensor_spec(c) {
            let value = make(&name, &shape)?;
            *w.slot(&name).unwrap_or_else(|| unreachable!("tensor_spec's {name} has a slot")) =
                value;
        }
        Ok(w)
    }

    /// Zeros of every shape: the gradient buffers.
    pub fn zeros(c: &ModelConfig) -> Self {
        Self::build(c, |_, shape| Ok::<_, Error>(vec![0.0; numel(shape)]))
            .expect("zeros cannot fail")
    }

    /// HF-style initialization: normal(0, 0.02) matrices, unit norms (Gemma's (1 + w): zero),
    /// zero biases; seeded.
    pub fn random(c: &ModelConfig, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let unit = if c.gemma.is_some() { 0.0 } else { 1.0 };
        Self::build(c, |name, shape| {
            Ok::<_, Error>(if is_norm(name) {
                vec![unit; numel(shape)]
            } else if name.ends_with(".bias") || name.ends_with("e_score_correction_bias") {
                vec![0.0; numel(shape)]
            } else {
                rng.vec(numel(shape), 0.02)
            })
        })
        .expect("random init cannot fail")
    }

    /// Errors unless every tensor has the size `config` gives it (weights from elsewhere, such
    /// as a weight sync, before they are used).
    pub fn check(&self, c: &ModelConfig) -> Result<()> {
        let spec = tensor_spec(c);
        let tensors = self.tensors();
        let layers_ok = self.layers.len() == c.num_hidden_layers;
        if !layers_ok || tensors.len() != spec.len() {
            return Err(Error::Invalid(format!(
                "weights hold {} tensors in {} layers; the config wants {} in {}",
                tensors.len(),
                self.layers.len(),
                spec.len(),
                c.num_hidden_layers
            )));
        }
        for ((name, shape), t) in spec.iter().zip(tensors) {
            if t.len() != shape.iter().product::<usize>() {
                return Err(Error::Invalid(format!(
                    "weight {name}: {} values, the config's shape {shape:?} wants {}",
                    t.len(),
                    shape.iter().product::<usize>()
                )));
            }
        }
        Ok(())
    }

    /// Every tensor, in [`tensor_spec`] order.
    pub fn tensors(&self) -> Vec<&Vec<f32>> {
        let mut out = vec![&self.embed];
        out.extend(&self.mtp);
        for l in &self.layers {
            out.extend(l.tensors());
        }
        out.push(&self.final_norm);
        out.extend(self.lm_head.as_ref());
        out
    }

    /// Every tensor mutably, in [`tensor_spec`] order.
    pub fn tensors_mut(&mut self) -> Vec<&mut Vec<f32>> {
        let mut out = vec![&mut self.embed];
        out.extend(&mut self.mtp);
        for l in &mut self.layers {
            out.extend(layer_tensors!(l, &mut).into_iter().filter(|t| !t.is_empty()));
            for e in &mut l.experts {
                out.extend([&mut e.gate_proj, &mut e.up_proj, &mut e.down_proj]);
            }
        }
        out.push(&mut self.final_norm);
        out.extend(self.lm_head.as_mut());
        out
    }

    /// Loads `dir/model.safetensors` or the shards listed in `dir/model.safetensors.index.json`.
    /// A missing or mis-shaped tensor names the file and the tensor.
    pub fn load(dir: &Path, c: &ModelConfig) -> Result<Self> {
        let files = TensorFiles::open(dir)?;
        files.check_counts(c, &crate::config::config_path(dir))?;
        crate::file_layout::weights_from_files(c, |name, shape| files.f32(name, shape))
    }

    /// Writes `dir/model.safetensors` (or shards of at most `max_shard_bytes` plus the index)
    /// in `dtype`, F32 or BF16.
    pub fn save(
        &self,
        dir: &Path,
        c: &ModelConfig,
        dtype: Dtype,
        max_shard_bytes: usize,
    ) -> Result<()> {
        self.save_with(dir, c, dtype, max_shard_bytes, Vec::new())
    }

    /// [`Weights::save`] with `extra` tensors after the model's (a DeepSeek-V3 checkpoint's
    /// MTP layer).
    pub fn save_with(
        &self,
        dir: &Path,
        c: &ModelConfig,
        dtype: Dtype,
        max_shard_bytes: usize,
        extra: Vec<crate::file_layout::FileTensor<'_>>,
    ) -> Result<()> {
        let elem = match dtype {
            Dtype::F32 => 4,
            Dtype::BF16 => 2,
            other => {
                return Err(Error::Invalid(format!(
                    "cannot save weights as {other:?}: use F32 or BF16"
                )));
            }
        };
        std::fs::create_dir_all(dir)
            .map_err(|source| Error::Io { path: dir.to_path_buf(), source })?;
        let mut tensors = crate::file_layout::file_tensors(c, self);
        tensors.extend(extra);
        // Group tensors into shards in order.
        let mut shards: Vec<Vec<usize>> = vec![Vec::new()];
        let mut bytes = 0usize;
        for (k, (_, _, t)) in tensors.iter().enumerate() {
            let size = t.len() * elem;
            if bytes > 0 && bytes + size > max_shard_bytes {
                shards.push(Vec::new());
                bytes = 0;
            }
            shards.last_mut().expect("one shard").push(k);
            bytes += size;
        }
        let n = shards.len();
        let file_name = |s: usize| {
            if n == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{n:05}.safetensors", s + 1)
            }
        };
        let mut weight_map = BTreeMap::new();
        for (s, members) in shards.iter().enumerate() {
            let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = members
                .iter()
                .map(|&k| {
                    let (name, shape, data) = &tensors[k];
                    (name.clone(), shape.clone(), encode(data, dtype))
                })
                .collect();
            let views = encoded
                .iter()
                .map(|(name, shape, data)| {
                    let view = TensorView::new(dtype, shape.clone(), data)
                        .map_err(|e| Error::Invalid(format!("tensor {name}: {e}")))?;
                    Ok((name.clone(), view))
                })
                .collect::<Result<Vec<_>>>()?;
            let path = dir.join(file_name(s));
            let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
            safetensors::serialize_to_file(views, Some(metadata), &path)
                .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
            for &k in members {
                weight_map.insert(tensors[k].0.clone(), file_name(s));
            }
        }
        if n > 1 {
            let total: usize = tensors.iter().map(|t| t.2.len() * elem).sum();
            let index =
                serde_json::json!({"metadata": {"total_size": total}, "weight_map": weight_map});
            let path = dir.join("model.safetensors.index.json");
            std::fs::write(&path, serde_json::to_string_pretty(&index).expect("json"))
                .map_err(|source| Error::Io { path, source })?;
        }
        Ok(())
    }
}

fn encode(data: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => data.iter().flat_map(|v| bf16::from_f32(*v).to_le_bytes()).collect(),
        _ => data.iter().flat_map(|v| v.to_le_bytes()).collect(),
    }
}

/// The safetensors files of a checkpoint, read into memory, with the file of each tensor.
pub struct TensorFiles {
    buffers: Vec<(PathBuf, Vec<u8>)>,
    location: HashMap<String, usize>,
}

impl TensorFiles {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index = dir.join("model.safetensors.index.json");
        if index.exists() {
            let text = std::fs::read_to_string(&index)
                .map_err(|source| Error::Io { path: index.clone(), source })?;
            let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Config {
                path: index.clone(),
                message: format!("not valid JSON: {e}"),
            })?;
            let map = v["weight_map"].as_object().ok_or_else(|| Error::Config {
                path: index.clone(),
                message: "missing object 'weight_map'".into(),
            })?;
            let mut files: Vec<String> =
                map.values().filter_map(|f| f.as_str().map(String::from)).collect();
            files.sort();
            files.dedup();
            let mut out = TensorFiles { buffers: Vec::new(), location: HashMap::new() };
            for f in files {
                out.add(&dir.join(f))?;
            }
            Ok(out)
        } else {
            let mut out = TensorFiles { buffers: Vec::new(), location: HashMap::new() };
            out.add(&dir.join("model.safetensors"))?;
            Ok(out)
        }
    }

    /// One safetensors file.
    pub fn single(path: &Path) -> Result<Self> {
        let mut out = TensorFiles { buffers: Vec::new(), location: HashMap::new() };
        out.add(path)?;
        Ok(out)
    }

    fn add(&mut self, path: &Path) -> Result<()> {
        let bytes =
            std::fs::read(path).map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let names = SafeTensors::deserialize(&bytes)
            .map_err(|e| Error::Config {
                path: path.to_path_buf(),
                message: format!("not a safetensors file: {e}"),
            })?
            .names()
            .into_iter()
            .map(String::from)
            .collect::<Vec<_>>();
        let k = self.buffers.len();
        for n in names {
            self.location.insert(n, k);
        }
        self.buffers.push((path.to_path_buf(), bytes));
        Ok(())
    }

    /// Refuses a config that counts more layers, or more experts in a sparse layer, than
    /// these files hold, before anything is allocated per layer or expert: a huge count in
    /// `config` (`config.json`) is then an error naming the key, not an abort.
    pub fn check_counts(&self, c: &ModelConfig, config: &Path) -> Result<()> {
        // The largest index + 1 among names "{prefix}{index}.…".
        let held = |prefix: &str| {
            let index = |n: &String| n.strip_prefix(prefix)?.split('.').next()?.parse().ok();
            self.location.keys().filter_map(index).map(|i: usize| i + 1).max().unwrap_or(0)
        };
        let err = |message: String| Error::Config { path: config.to_path_buf(), message };
        let layers = held("model.layers.");
        if c.num_hidden_layers > layers {
            return Err(err(format!(
                "num_hidden_layers is {}, but the checkpoint's tensors hold {layers} layers \
                 (model.layers.N.*); fix the config or the checkpoint",
                c.num_hidden_layers
            )));
        }
        let Some(m) = &c.moe else { return Ok(()) };
        let Some(layer) = (0..c.num_hidden_layers).find(|&l| m.is_sparse(l)) else {
            return Ok(());
        };
        let experts = held(&format!("model.layers.{layer}.mlp.experts."));
        if m.num_experts > experts {
            return Err(err(format!(
                "num_experts is {}, but layer {layer} of the checkpoint holds {experts} experts \
                 (model.layers.{layer}.mlp.experts.N.*); fix the config or the checkpoint",
                m.num_experts
            )));
        }
        Ok(())
    }

    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.location.keys().map(String::as_str).collect();
        v.sort();
        v
    }

    fn view(&self, name: &str) -> Result<(&Path, TensorView<'_>)> {
        let Some(&k) = self.location.get(name) else {
            let path = self.buffers.first().map(|b| b.0.clone()).unwrap_or_default();
            return Err(Error::Tensor {
                path,
                tensor: name.into(),
                message: "missing from the checkpoint".into(),
            });
        };
        let (path, bytes) = &self.buffers[k];
        let st = SafeTensors::deserialize(bytes)
            .map_err(|e| Error::Config { path: path.clone(), message: e.to_string() })?;
        let view = st.tensor(name).map_err(|e| Error::Tensor {
            path: path.clone(),
            tensor: name.into(),
            message: e.to_string(),
        })?;
        Ok((path, view))
    }

    /// The tensor `name` as f32 (from F32, BF16, F16, or F8_E4M3 with its block scales),
    /// checked against `shape`.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let packed = format!("{name}_packed");
        if !self.location.contains_key(name) && self.location.contains_key(&packed) {
            return self.int4(name, shape);
        }
        let (path, view) = self.view(name)?;
        let err = |message: String| Error::Tensor {
            path: path.to_path_buf(),
            tensor: name.into(),
            message,
        };
        if view.shape() != shape {
            return Err(err(format!("shape {:?}, expected {shape:?}", view.shape())));
        }
        let data = view.data();
        Ok(match view.dtype() {
            Dtype::F32 => {
                data.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect()
            }
            Dtype::BF16 => {
                data.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            Dtype::F16 => {
                data.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f32()).collect()
            }
            Dtype::F8_E4M3 => self.fp8(name, shape, data)?,
            other => {
                return Err(err(format!(
                    "dtype {other:?} is not supported (F32, BF16, F16, F8_E4M3)"
                )));
            }
        })
    }

    /// An FP8 checkpoint's matrix (DeepSeek-V3's and Qwen3's FP8 releases): E4M3 `codes` with
    /// one scale per 128 × 128 block in `<name>_scale_inv` (w = q · s), dequantized to f32.
    fn fp8(&self, name: &str, shape: &[usize], codes: &[u8]) -> Result<Vec<f32>> {
        let &[rows, cols] = shape else {
            let (path, _) = self.view(name)?;
            return Err(Error::Tensor {
                path: path.to_path_buf(),
                tensor: name.into(),
                message: format!("F8_E4M3 is read for matrices, and its shape is {shape:?}"),
            });
        };
        let blocks = [rows.div_ceil(cpu::FP8_BLOCK), cols.div_ceil(cpu::FP8_BLOCK)];
        let scales = self.f32(&format!("{name}_scale_inv"), &blocks)?;
        Ok(cpu::dequantize_blocks(codes, &scales, rows, cols))
    }

    /// A compressed-tensors `pack-quantized` matrix: `<name>_packed` (int32 words of eight
    /// INT4 levels), `<name>_scale` (one per group of a row) and `<name>_shape`, dequantized to
    /// f32 (w = q · s); the group size is the row over the scales per row.
    fn int4(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let (path, _) = self.view(&format!("{name}_packed"))?;
        let err = |tensor: String, message: String| Error::Tensor {
            path: path.to_path_buf(),
            tensor,
            message,
        };
        let &[rows, cols] = shape else {
            return Err(err(name.into(), format!("INT4 is read for matrices, not {shape:?}")));
        };
        let stored = self.ints(&format!("{name}_shape"))?;
        if stored != [rows as i64, cols as i64] {
            return Err(err(format!("{name}_shape"), format!("{stored:?}, expected {shape:?}")));
        }
        let (_, packed) = self.i32(&format!("{name}_packed"))?;
        let scale = format!("{name}_scale");
        let scale_shape = self.shape(&scale)?;
        let groups = match scale_shape[..] {
            [r, g] if r == rows && g > 0 && cols.is_multiple_of(g) => g,
            _ => {
                return Err(err(
                    scale,
                    format!(
                        "shape {scale_shape:?}: a [{rows}, groups] scale whose groups divide the \
                         row of {cols}"
                    ),
                ));
            }
        };
        let scales = self.f32(&scale, &scale_shape)?;
        let named = |e: miles_tensor::Error| err(format!("{name}_packed"), e.to_string());
        let q = cpu::unpack_int4(&packed, rows, cols).map_err(named)?;
        cpu::dequantize_int4(&q, &scales, cols / groups).map_err(named)
    }

    /// The integer tensor `name` (I32 or I64) as i64.
    fn ints(&self, name: &str) -> Result<Vec<i64>> {
        let (path, view) = self.view(name)?;
        let data = view.data();
        match view.dtype() {
            Dtype::I32 => Ok(data
                .chunks_exact(4)
                .map(|b| i64::from(i32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                .collect()),
            Dtype::I64 => Ok(data
                .chunks_exact(8)
                .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
                .collect()),
            other => Err(Error::Tensor {
                path: path.to_path_buf(),
                tensor: name.into(),
                message: format!("dtype {other:?}, expected I32 or I64"),
            }),
        }
    }

    /// The tensor `name` as i32 with its shape.
    pub fn i32(&self, name: &str) -> Result<(Vec<usize>, Vec<i32>)> {
        let (path, view) = self.view(name)?;
        if view.dtype() != Dtype::I32 {
            return Err(Error::Tensor {
                path: path.to_path_buf(),
                tensor: name.into(),
                message: format!("dtype {:?}, expected I32", view.dtype()),
            });
        }
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Ok((view.shape().to_vec(), data))
    }

    /// The shape of tensor `name`.
    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.view(name)?.1.shape().to_vec())
    }
}
