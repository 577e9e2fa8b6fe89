//! A GGUF model (`llama`, `qwen3`) to an HF checkpoint: config.json, model.safetensors,
//! tokenizer.json and tokenizer_config.json.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use miles_model::weights::tensor_spec;
use miles_model::{Architecture, Biases, ModelConfig, RopeScaling, Weights};
use safetensors::Dtype;

use crate::reader::GgufFile;
use crate::{Error, Result, tokenizer};

/// Storage dtype of model.safetensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputDtype {
    #[default]
    F32,
    Bf16,
}

impl OutputDtype {
    fn safetensors(self) -> Dtype {
        match self {
            OutputDtype::F32 => Dtype::F32,
            OutputDtype::Bf16 => Dtype::BF16,
        }
    }

    /// transformers' `torch_dtype` name.
    pub fn torch_name(self) -> &'static str {
        match self {
            OutputDtype::F32 => "float32",
            OutputDtype::Bf16 => "bfloat16",
        }
    }
}

/// What a conversion did.
#[derive(Debug, Clone)]
pub struct Summary {
    pub out_dir: PathBuf,
    pub gguf_version: u32,
    /// `general.name`, when the file has one.
    pub name: Option<String>,
    pub config: ModelConfig,
    /// Tensors per ggml type in the source, by type name.
    pub tensor_types: BTreeMap<&'static str, usize>,
    pub seconds: f64,
}

/// llama.cpp's per-layer tensor names (`blk.N.…`) and their HF counterparts
/// (`model.layers.N.…`).
const LAYER_NAMES: [(&str, &str); 11] = [
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_output", "self_attn.o_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("ffn_norm", "post_attention_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
];

/// The HF name of a llama.cpp tensor name, when it has one.
pub fn hf_name(gguf: &str) -> Option<String> {
    let (stem, suffix) = gguf.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match stem {
        "token_embd" => "model.embed_tokens".to_string(),
        "output_norm" => "model.norm".to_string(),
        "output" => "lm_head".to_string(),
        _ => {
            let rest = stem.strip_prefix("blk.")?;
            let (layer, part) = rest.split_once('.')?;
            let layer: usize = layer.parse().ok()?;
            let (_, hf) = LAYER_NAMES.iter().find(|(g, _)| *g == part)?;
            format!("model.layers.{layer}.{hf}")
        }
    };
    Some(format!("{hf}.{suffix}"))
}

/// llama.cpp's Q/K row order for `llama` (convert_hf_to_gguf.py's `permute`): within each head
/// the rows `[half 0 | half 1]` of HF's rotate-half RoPE are interleaved, row `2i + j` of the
/// GGUF head being row `j * D/2 + i` of the HF head. `w` is `[rows × cols]` row-major.
pub fn permute_rows(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    reorder_rows(w, n_head, cols, false)
}

/// The inverse of [`permute_rows`]: GGUF Q/K rows back to HF order.
pub fn unpermute_rows(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    reorder_rows(w, n_head, cols, true)
}

fn reorder_rows(w: &[f32], n_head: usize, cols: usize, to_hf: bool) -> Vec<f32> {
    let rows = w.len() / cols;
    let d = rows / n_head;
    let half = d / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for i in 0..half {
            for j in 0..2 {
                let gguf = h * d + 2 * i + j;
                let hf = h * d + j * half + i;
                let (src, dst) = if to_hf { (gguf, hf) } else { (hf, gguf) };
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&w[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn unsupported(g: &GgufFile, message: String) -> Error {
    Error::Unsupported { path: g.path.clone(), message }
}

/// The model configuration from `{arch}.*` metadata, the token list and the tensors present.
pub fn model_config(g: &GgufFile) -> Result<ModelConfig> {
    let m = &g.metadata;
    let arch_name = m.str("general.architecture")?;
    let architecture = match arch_name {
        "llama" => Architecture::Llama,
        "qwen3" => Architecture::Qwen3,
        "qwen2" => Architecture::Qwen2,
        other => {
            return Err(unsupported(
                g,
                format!("architecture '{other}' is not supported; supported: llama, qwen2, qwen3"),
            ));
        }
    };
    let key = |k: &str| format!("{arch_name}.{k}");
    if m.opt_usize(&key("expert_count"))?.unwrap_or(0) > 0 {
        return Err(unsupported(g, "mixture-of-experts models are not supported".into()));
    }
    if let Some(kind) = m.opt_str(&key("rope.scaling.type"))?
        && kind != "none"
    {
        return Err(unsupported(g, format!("rope scaling '{kind}' is not supported")));
    }
    if g.tensor("rope_freqs.weight").is_some() {
        return Err(unsupported(
            g,
            "tensor 'rope_freqs.weight' (Llama 3.1 rope scaling) is not supported".into(),
        ));
    }
    let hidden_size = m.usize(&key("embedding_length"))?;
    let num_attention_heads = m.usize(&key("attention.head_count"))?;
    let num_key_value_heads =
        m.opt_usize(&key("attention.head_count_kv"))?.unwrap_or(num_attention_heads);
    let head_dim = match m.opt_usize(&key("attention.key_length"))? {
        Some(d) => d,
        None => hidden_size.checked_div(num_attention_heads).unwrap_or(0),
    };
    if let Some(v) = m.opt_usize(&key("attention.value_length"))?
        && v != head_dim
    {
        return Err(m.err(
            &key("attention.value_length"),
            format!("{v} differs from the key length {head_dim}; not supported"),
        ));
    }
    if let Some(r) = m.opt_usize(&key("rope.dimension_count"))?
        && r != head_dim
    {
        return Err(m.err(
            &key("rope.dimension_count"),
            format!("partial rotary embeddings ({r} of {head_dim} dims) are not supported"),
        ));
    }
    let vocab_size = match m.opt_strings("tokenizer.ggml.tokens")? {
        Some(tokens) => tokens.len(),
        None => m.usize(&key("vocab_size"))?,
    };
    let config = ModelConfig {
        architecture,
        vocab_size,
        hidden_size,
        intermediate_size: m.usize(&key("feed_forward_length"))?,
        num_hidden_layers: m.usize(&key("block_count"))?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rotary_dim: head_dim,
        // Qwen2's q/k/v biases, which llama.cpp keeps as `attn_{q,k,v}.bias`.
        bias: Biases { qkv: architecture == Architecture::Qwen2, ..Biases::default() },
        rms_norm_eps: m.opt_f32(&key("attention.layer_norm_rms_epsilon"))?.unwrap_or(1e-6),
        rope_theta: m.opt_f32(&key("rope.freq_base"))?.unwrap_or(10_000.0),
        rope_scaling: RopeScaling::None,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        max_position_embeddings: m.opt_usize(&key("context_length"))?.unwrap_or(4096),
        bos_token_id: m.opt_u32("tokenizer.ggml.bos_token_id")?,
        eos_token_ids: m.opt_u32("tokenizer.ggml.eos_token_id")?.into_iter().collect(),
        moe: None,
        gemma: None,
        mtp_input: false,
        mla: None,
    };
    // miles-model's own checks (positive sizes, heads divisible, even head_dim, …).
    ModelConfig::from_json(&config.to_hf_json("float32"), &g.path).map_err(|e| {
        unsupported(g, format!("the model configuration from its metadata is invalid: {e}"))
    })?;
    Ok(config)
}

/// Every tensor dequantized into HF names, order and shapes; Q/K rows un-permuted for llama.
pub fn load_weights(g: &GgufFile, c: &ModelConfig) -> Result<Weights> {
    // The layer count first: the names of every layer's tensors are made next, and metadata
    // claiming millions of tiny layers must not make millions of names.
    let held = g
        .tensors
        .iter()
        .filter_map(|t| t.name.strip_prefix("blk.")?.split('.').next()?.parse::<usize>().ok())
        .max()
        .map_or(0, |last| last + 1);
    if c.num_hidden_layers != held {
        return Err(unsupported(
            g,
            format!(
                "its metadata says {} layers (block_count) but its tensors hold {held}",
                c.num_hidden_layers
            ),
        ));
    }
    let mut by_hf: BTreeMap<String, &crate::TensorInfo> = BTreeMap::new();
    let mut unmapped = Vec::new();
    for t in &g.tensors {
        match hf_name(&t.name) {
            Some(hf) => {
                by_hf.insert(hf, t);
            }
            None => unmapped.push(t.name.as_str()),
        }
    }
    let spec = tensor_spec(c);
    let wanted: Vec<&str> = spec.iter().map(|(n, _)| n.as_str()).collect();
    unmapped.extend(
        by_hf.iter().filter(|(hf, _)| !wanted.contains(&hf.as_str())).map(|(_, t)| t.name.as_str()),
    );
    if !unmapped.is_empty() {
        return Err(unsupported(
            g,
            format!(
                "tensors with no place in a {} checkpoint: {}",
                c.architecture.hf_class(),
                unmapped.join(", ")
            ),
        ));
    }
    // Every tensor is there, of its shape, before the weights are made: the metadata's sizes
    // are only believed once the file's tensors (bounded by its length) agree with them.
    let tensors = spec
        .iter()
        .map(|(hf, shape)| {
            let t = *by_hf.get(hf.as_str()).ok_or_else(|| {
                unsupported(g, format!("no tensor for {hf} (its llama.cpp name is missing)"))
            })?;
            if t.shape() != *shape {
                return Err(Error::Tensor {
                    path: g.path.clone(),
                    tensor: t.name.clone(),
                    message: format!(
                        "GGUF dims {:?} (shape {:?}) do not match {hf} {shape:?} from the metadata",
                        t.dims,
                        t.shape()
                    ),
                });
            }
            Ok(t)
        })
        .collect::<Result<Vec<_>>>()?;
    let mut weights = Weights::zeros(c);
    for (((hf, shape), t), slot) in spec.iter().zip(tensors).zip(weights.tensors_mut()) {
        let mut data = g.dequantize(t)?;
        if c.architecture == Architecture::Llama {
            let heads = if hf.ends_with("q_proj.weight") {
                Some(c.num_attention_heads)
            } else if hf.ends_with("k_proj.weight") {
                Some(c.num_key_value_heads)
            } else {
                None
            };
            if let Some(heads) = heads {
                data = unpermute_rows(&data, heads, shape[1]);
            }
        }
        *slot = data;
    }
    Ok(weights)
}

/// Converts `src` into the checkpoint directory `out` (created if missing).
pub fn convert(src: &Path, out: &Path, dtype: OutputDtype) -> Result<Summary> {
    let start = Instant::now();
    let g = GgufFile::open(src)?;
    let config = model_config(&g)?;
    let files = tokenizer::build(&g.metadata, config.max_position_embeddings)?;
    let weights = load_weights(&g, &config)?;
    std::fs::create_dir_all(out).map_err(|source| Error::Io { path: out.to_path_buf(), source })?;
    let write_json = |name: &str, value: &serde_json::Value| -> Result<()> {
        let path = out.join(name);
        let text = serde_json::to_string_pretty(value).expect("JSON values serialize");
        std::fs::write(&path, text).map_err(|source| Error::Io { path, source })
    };
    write_json("config.json", &config.to_hf_json(dtype.torch_name()))?;
    write_json("tokenizer.json", &files.tokenizer)?;
    write_json("tokenizer_config.json", &files.config)?;
    // One file: the models GGUF holds are small enough, and one file is what tools expect.
    weights.save(out, &config, dtype.safetensors(), usize::MAX)?;
    // What we wrote must load: a vocabulary the tokenizers crate refuses fails here.
    miles_model::Tokenizer::load(out)?;
    let mut tensor_types = BTreeMap::new();
    for t in &g.tensors {
        *tensor_types.entry(t.ggml_type.name()).or_insert(0) += 1;
    }
    Ok(Summary {
        out_dir: out.to_path_buf(),
        gguf_version: g.version,
        name: g.metadata.opt_str("general.name")?.map(String::from),
        config,
        tensor_types,
        seconds: start.elapsed().as_secs_f64(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_undoes_permute() {
        let (heads, d, cols) = (3, 8, 5);
        let w: Vec<f32> = (0..heads * d * cols).map(|i| i as f32).collect();
        let p = permute_rows(&w, heads, cols);
        assert_ne!(p, w);
        assert_eq!(unpermute_rows(&p, heads, cols), w);
        assert_eq!(permute_rows(&unpermute_rows(&w, heads, cols), heads, cols), w);
    }

    #[test]
    fn unpermute_matches_a_hand_made_head() {
        // One head of dim 4, one column: HF rows [a0 a1 | a2 a3] are stored as [a0 a2 a1 a3]
        // (numpy: reshape(1, 2, 2, 1).swapaxes(1, 2)).
        assert_eq!(permute_rows(&[0.0, 1.0, 2.0, 3.0], 1, 1), vec![0.0, 2.0, 1.0, 3.0]);
        assert_eq!(unpermute_rows(&[0.0, 2.0, 1.0, 3.0], 1, 1), vec![0.0, 1.0, 2.0, 3.0]);
        // Two heads of dim 4, two columns: each head is reordered on its own, rows move whole.
        let gguf = [10., 11., 30., 31., 20., 21., 40., 41., 50., 51., 70., 71., 60., 61., 80., 81.];
        let hf = [10., 11., 20., 21., 30., 31., 40., 41., 50., 51., 60., 61., 70., 71., 80., 81.];
        assert_eq!(unpermute_rows(&gguf, 2, 2), hf);
    }

    #[test]
    fn llama_cpp_names_map_to_hf_names() {
        let cases = [
            ("token_embd.weight", "model.embed_tokens.weight"),
            ("output_norm.weight", "model.norm.weight"),
            ("output.weight", "lm_head.weight"),
            ("blk.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"),
            ("blk.12.attn_output.weight", "model.layers.12.self_attn.o_proj.weight"),
            ("blk.3.attn_k_norm.weight", "model.layers.3.self_attn.k_norm.weight"),
            ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight"),
            ("blk.1.ffn_down.weight", "model.layers.1.mlp.down_proj.weight"),
            ("blk.0.attn_q.bias", "model.layers.0.self_attn.q_proj.bias"),
        ];
        for (gguf, hf) in cases {
            assert_eq!(hf_name(gguf).as_deref(), Some(hf), "{gguf}");
        }
        for none in [
            "rope_freqs.weight",
            "blk.x.attn_q.weight",
            "blk.0.attn_q.scale",
            "blk.0.ffn_gate_exps.weight",
        ] {
            assert_eq!(hf_name(none), None, "{none}");
        }
    }
}
