//! `config.json` of HF checkpoints, for the architectures this crate implements.

use std::path::{Path, PathBuf};

use serde_json::{Value, json};

use crate::{Error, Result, RopeScaling};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `Qwen3ForCausalLM`: Llama's layout plus an RMSNorm on each query and key head.
    Qwen3,
    /// `LlamaForCausalLM` (SmolLM2 among others).
    Llama,
    /// `Qwen3MoeForCausalLM`: Qwen3's attention, and in its sparse layers a router over
    /// SwiGLU experts ([`MoeConfig`]).
    Qwen3Moe,
    /// `Qwen2ForCausalLM` (Qwen2, Qwen2.5): Llama's layout with biases on q, k and v.
    Qwen2,
    /// `Gemma2ForCausalLM`: Gemma 3's layout without q/k norms, with soft-capped attention
    /// scores and logits, one rotary for every layer.
    Gemma2,
    /// `Gemma3ForCausalLM` (Gemma 3's text models): (1 + w) norms around attention and the
    /// MLP, q/k norms, GeGLU, an embedding scaled by √hidden, sliding-window layers with a
    /// rotary of their own ([`GemmaConfig`]).
    Gemma3,
    /// `Glm4ForCausalLM` (GLM-4-0414, dense): Llama's layout with q/k/v biases, norms after
    /// attention and after the MLP as Gemma has them (plain w, not 1 + w), and a rotary over
    /// part of each head (`partial_rotary_factor`, 0.5) whose pairs are interleaved; its files
    /// fuse gate and up (see [`crate::file_layout::file_tensors`]).
    Glm4,
    /// `DeepseekV3ForCausalLM` (DeepSeek-V3, R1): multi-head latent attention ([`MlaConfig`])
    /// and, after `first_k_dense_replace` dense layers, DeepSeekMoE: shared experts beside
    /// routed ones chosen by bias-corrected sigmoid scores within groups ([`Routing`]).
    DeepseekV3,
}

impl Architecture {
    pub fn hf_class(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Glm4 => "Glm4ForCausalLM",
            Architecture::DeepseekV3 => "DeepseekV3ForCausalLM",
        }
    }

    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Qwen3 => "qwen3",
            Architecture::Llama => "llama",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen2 => "qwen2",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Glm4 => "glm4",
            Architecture::DeepseekV3 => "deepseek_v3",
        }
    }

    pub fn has_qk_norm(self) -> bool {
        matches!(self, Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3)
    }
}

/// Which projections add a bias: q/k/v (Qwen2 always; `attention_bias` elsewhere), o
/// (`attention_bias` in Llama and Qwen3), the MLP's three (`mlp_bias`, Llama).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Biases {
    pub qkv: bool,
    pub o: bool,
    pub mlp: bool,
}

/// What a Gemma model adds to a decoder (config.json's names).
#[derive(Debug, Clone, PartialEq)]
pub struct GemmaConfig {
    /// Queries are scaled by `query_pre_attn_scalar^-1/2` (not head_dim's).
    pub query_pre_attn_scalar: f32,
    pub sliding_window: usize,
    /// Per layer: whether it attends over the last `sliding_window` keys only.
    pub sliding: Vec<bool>,
    /// The sliding layers' rotary (`rope_parameters.sliding_attention`, or
    /// `rope_local_base_freq`); the full layers take the config's own. Gemma 2: the same.
    pub local_rope_theta: f32,
    pub local_rope_scaling: RopeScaling,
    /// Gemma 2's `attn_logit_softcapping`, and `final_logit_softcapping` (Gemma 2; Gemma 3 when
    /// its config sets one).
    pub attn_softcap: Option<f32>,
    pub final_softcap: Option<f32>,
}

/// DeepSeek's multi-head latent attention (config.json's names). Each head's query and key
/// are a part without position (`qk_nope_head_dim`) and a rotary part (`qk_rope_head_dim`);
/// the keys' non-rotary parts and the values come from one compressed vector per token
/// (`kv_lora_rank`, normed, then `kv_b_proj`), the rotary part of the key is one per token,
/// shared by every head.
#[derive(Debug, Clone, PartialEq)]
pub struct MlaConfig {
    /// Queries through a low-rank projection and its norm (`q_a_proj`, `q_a_layernorm`,
    /// `q_b_proj`) when set; one `q_proj` otherwise.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// Whether the checkpoint's rotary turns interleaved pairs (2j, 2j + 1) (`rope_interleave`,
    /// DeepSeek's default) rather than halves.
    pub rope_interleave: bool,
    /// The scores' scale: `(qk_nope_head_dim + qk_rope_head_dim)^-1/2`, times the square of
    /// YaRN's factor of `mscale_all_dim` (the rope's, 0: none) where the rope is scaled.
    pub softmax_scale: f32,
    pub mscale_all_dim: f32,
    /// Multi-token-prediction layers the checkpoint holds after the decoder's
    /// (`num_nextn_predict_layers`).
    pub mtp_layers: usize,
}

impl MlaConfig {
    /// The attention's parameters in a layer of `heads` heads over `hidden`.
    fn parameters(&self, hidden: usize, heads: usize) -> usize {
        let qk = self.qk_nope_head_dim + self.qk_rope_head_dim;
        let q = match self.q_lora_rank {
            Some(r) => hidden * r + r + r * heads * qk,
            None => hidden * heads * qk,
        };
        let kv = hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim);
        q + kv + heads * self.v_head_dim * hidden
    }
}

/// How a sparse layer's router turns its logits into each token's experts and weights.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Routing {
    /// Qwen3-MoE: a softmax over the experts, the top-k of its probabilities.
    Softmax,
    /// DeepSeek-V3 (`scoring_func` sigmoid, `topk_method` noaux_tc): sigmoid scores; the
    /// choice ranks score + `e_score_correction_bias` among the experts of the `topk_group`
    /// groups (of `n_group`) whose two best such sums are highest; the weights are the chosen
    /// scores (renormalized with `norm_topk_prob`) times `routed_scaling_factor`.
    GroupedSigmoid { n_group: usize, topk_group: usize, scaling: f32 },
}

/// The mixture of experts of a `Qwen3MoeForCausalLM` or a `DeepseekV3ForCausalLM` (its
/// config.json's names).
#[derive(Debug, Clone, PartialEq)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts per token (top-k).
    pub num_experts_per_tok: usize,
    pub moe_intermediate_size: usize,
    /// Renormalize the top-k probabilities to sum to one.
    pub norm_topk_prob: bool,
    /// Layer `l` is sparse when `(l + 1) % decoder_sparse_step == 0` and `l` is not in
    /// `mlp_only_layers`.
    pub decoder_sparse_step: usize,
    pub mlp_only_layers: Vec<usize>,
    /// The load-balancing loss's weight; 0 (off) unless config.json sets
    /// `output_router_logits`, as transformers adds it only then.
    pub router_aux_loss_coef: f32,
    pub routing: Routing,
    /// One SwiGLU MLP of `shared_experts · moe_intermediate_size` beside the routed experts,
    /// which every token runs through (DeepSeek's `n_shared_experts`; 0 in Qwen3-MoE).
    pub shared_experts: usize,
}

impl MoeConfig {
    pub fn is_sparse(&self, layer: usize) -> bool {
        !self.mlp_only_layers.contains(&layer)
            && self.num_experts > 0
            && (layer + 1).is_multiple_of(self.decoder_sparse_step.max(1))
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    /// The dimensions of a head the rotary turns (`head_dim · partial_rotary_factor`); the
    /// rest pass through. `head_dim` except in GLM-4.
    pub rotary_dim: usize,
    pub bias: Biases,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// The rotary frequencies' scaling (`rope_parameters.rope_type`).
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
    /// The experts of a Qwen3-MoE or DeepSeek-V3 model; `None` for dense ones.
    pub moe: Option<Box<MoeConfig>>,
    /// DeepSeek's latent attention; `None` for every other family. Then `head_dim` is the
    /// query's and key's head (`qk_nope_head_dim + qk_rope_head_dim`) and `rotary_dim` its
    /// rotary part.
    pub mla: Option<Box<MlaConfig>>,
    /// Gemma's additions; `None` for every other family.
    pub gemma: Option<Box<GemmaConfig>>,
    /// A speculative draft ([`crate::draft`]): its layers take the policy's hidden states and
    /// the next tokens' embeddings, each normed, through two projections (`mtp.*` weights),
    /// instead of the embedded tokens. Never set by a config.json.
    pub mtp_input: bool,
}

struct Fields<'a> {
    path: &'a Path,
    obj: &'a serde_json::Map<String, Value>,
}

impl Fields<'_> {
    fn err(&self, message: String) -> Error {
        Error::Config { path: self.path.to_path_buf(), message }
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.err(format!("field '{key}' must be a non-negative integer, found {v}"))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.err(format!("missing field '{key}'")))
    }

    /// `num_hidden_layers`, bounded, where something is made per layer before the sizes are
    /// checked.
    fn layers(&self) -> Result<usize> {
        let layers = self.usize("num_hidden_layers")?;
        if layers > MAX_LAYERS {
            return Err(self.err(format!(
                "'num_hidden_layers' is {layers}; this loader accepts at most {MAX_LAYERS} layers"
            )));
        }
        Ok(layers)
    }

    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|n| Some(n as f32))
                .ok_or_else(|| self.err(format!("field '{key}' must be a number, found {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(self.err(format!("field '{key}' must be true or false, found {v}"))),
        }
    }

    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.obj.get(key) {
            None | Some(Value::Null) => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .map(|n| n as u32)
                        .ok_or_else(|| self.err(format!("field '{key}' holds a non-integer {v}")))
                })
                .collect(),
            Some(v) => v.as_u64().map(|n| vec![n as u32]).ok_or_else(|| {
                self.err(format!("field '{key}' must be a token id or a list of them, found {v}"))
            }),
        }
    }
}

impl Fields<'_> {
    /// Gemma 3's additions; `local_rope` is the `sliding_attention` rope dictionary of a newer
    /// config.json (older ones say `rope_local_base_freq`).
    fn gemma(
        &self,
        architecture: Architecture,
        local_rope: Option<(&str, &Value)>,
        max_positions: usize,
    ) -> Result<GemmaConfig> {
        let gemma2 = architecture == Architecture::Gemma2;
        if self.opt_bool("use_bidirectional_attention")? == Some(true) {
            return Err(self.err(
                "'use_bidirectional_attention': true is not supported (causal attention only)"
                    .into(),
            ));
        }
        let layers = self.layers()?;
        let sliding = match self.obj.get("layer_types") {
            Some(Value::Array(types)) => types
                .iter()
                .map(|t| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(self.err(format!(
                        "'layer_types' holds {t}: only sliding_attention and full_attention"
                    ))),
                })
                .collect::<Result<Vec<bool>>>()?,
            _ => {
                // Gemma 2 alternates, sliding first; Gemma 3 slides 5 layers in 6.
                let default = if gemma2 { 2 } else { 6 };
                let pattern = self.opt_usize("sliding_window_pattern")?.unwrap_or(default).max(1);
                (0..layers).map(|l| !(l + 1).is_multiple_of(pattern)).collect()
            }
        };
        if sliding.len() != layers {
            return Err(self.err(format!(
                "'layer_types' lists {} layers; num_hidden_layers is {layers}",
                sliding.len()
            )));
        }
        let (local_rope_theta, local_rope_scaling) = match local_rope {
            Some((key, Value::Object(r))) => (
                r.get("rope_theta").and_then(Value::as_f64).map_or(10_000.0, |t| t as f32),
                RopeScaling::from_json(Some((key, r)), max_positions).map_err(|m| self.err(m))?,
            ),
            Some((key, v)) => {
                return Err(
                    self.err(format!("'{key}.sliding_attention' must be an object, found {v}"))
                );
            }
            None => (self.opt_f32("rope_local_base_freq")?.unwrap_or(10_000.0), RopeScaling::None),
        };
        let cap = |key: &str, read: bool| -> Result<Option<f32>> {
            let cap = if read { self.opt_f32(key)? } else { None };
            match cap {
                Some(c) if !(c > 0.0 && c.is_finite()) => {
                    Err(self.err(format!("'{key}' must be a positive number, found {c}")))
                }
                _ => Ok(cap),
            }
        };
        Ok(GemmaConfig {
            query_pre_attn_scalar: self.opt_f32("query_pre_attn_scalar")?.unwrap_or(256.0),
            sliding_window: self.opt_usize("sliding_window")?.unwrap_or(4096).max(1),
            sliding,
            local_rope_theta,
            local_rope_scaling,
            attn_softcap: cap("attn_logit_softcapping", gemma2)?,
            final_softcap: cap("final_logit_softcapping", true)?,
        })
    }

    fn moe(&self) -> Result<MoeConfig> {
        let mlp_only_layers = match self.obj.get("mlp_only_layers") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().map(|n| n as usize).ok_or_else(|| {
                        self.err(format!("field 'mlp_only_layers' holds a non-integer {v}"))
                    })
                })
                .collect::<Result<_>>()?,
            Some(v) => {
                return Err(self.err(format!("field 'mlp_only_layers' must be a list, found {v}")));
            }
        };
        let aux = self.opt_bool("output_router_logits")?.unwrap_or(false);
        Ok(MoeConfig {
            // The hub's Qwen3-MoE configs say num_experts; transformers 5 writes
            // num_local_experts (Mixtral's name).
            num_experts: match self.opt_usize("num_experts")? {
                Some(n) => n,
                None => self.opt_usize("num_local_experts")?.ok_or_else(|| {
                    self.err("missing field 'num_experts' (or 'num_local_experts')".into())
                })?,
            },
            num_experts_per_tok: self.usize("num_experts_per_tok")?,
            moe_intermediate_size: self.usize("moe_intermediate_size")?,
            norm_topk_prob: self.opt_bool("norm_topk_prob")?.unwrap_or(false),
            decoder_sparse_step: self.opt_usize("decoder_sparse_step")?.unwrap_or(1),
            mlp_only_layers,
            router_aux_loss_coef: if aux {
                self.opt_f32("router_aux_loss_coef")?.unwrap_or(0.001)
            } else {
                0.0
            },
            routing: Routing::Softmax,
            shared_experts: 0,
        })
    }

    /// DeepSeek-V3's experts: sparse from layer `first_k_dense_replace` on, no auxiliary loss
    /// (the correction bias balances the load).
    fn deepseek_moe(&self, layers: usize) -> Result<MoeConfig> {
        let scoring = self.obj.get("scoring_func").and_then(Value::as_str).unwrap_or("sigmoid");
        if scoring != "sigmoid" {
            return Err(self.err(format!(
                "'scoring_func' '{scoring}' is not supported: DeepSeek-V3's sigmoid scores only \
                 (DeepSeek-V2's softmax routing is not implemented)"
            )));
        }
        let method = self.obj.get("topk_method").and_then(Value::as_str).unwrap_or("noaux_tc");
        if method != "noaux_tc" {
            return Err(self.err(format!(
                "'topk_method' '{method}' is not supported: DeepSeek-V3's noaux_tc only"
            )));
        }
        let num_experts = match self.opt_usize("n_routed_experts")? {
            Some(n) => n,
            None => self.opt_usize("num_local_experts")?.ok_or_else(|| {
                self.err("missing field 'n_routed_experts' (or 'num_local_experts')".into())
            })?,
        };
        let dense = self.opt_usize("first_k_dense_replace")?.unwrap_or(0).min(layers);
        if self.opt_usize("moe_layer_freq")?.is_some_and(|f| f != 1) {
            return Err(self.err("'moe_layer_freq' other than 1 is not supported".into()));
        }
        let scaling = self.opt_f32("routed_scaling_factor")?.unwrap_or(1.0);
        if !(scaling > 0.0 && scaling.is_finite()) {
            return Err(self.err(format!(
                "'routed_scaling_factor' must be a positive number, found {scaling}"
            )));
        }
        Ok(MoeConfig {
            num_experts,
            num_experts_per_tok: self.usize("num_experts_per_tok")?,
            moe_intermediate_size: self.usize("moe_intermediate_size")?,
            norm_topk_prob: self.opt_bool("norm_topk_prob")?.unwrap_or(true),
            decoder_sparse_step: 1,
            mlp_only_layers: (0..dense).collect(),
            router_aux_loss_coef: 0.0,
            routing: Routing::GroupedSigmoid {
                n_group: self.opt_usize("n_group")?.unwrap_or(1),
                topk_group: self.opt_usize("topk_group")?.unwrap_or(1),
                scaling,
            },
            shared_experts: self.opt_usize("n_shared_experts")?.unwrap_or(0),
        })
    }

    /// DeepSeek's latent attention, its scores' scale from the rope's YaRN `mscale_all_dim`.
    fn mla(&self, rope: Option<&serde_json::Map<String, Value>>) -> Result<MlaConfig> {
        let (nope, rope_dim) = (self.usize("qk_nope_head_dim")?, self.usize("qk_rope_head_dim")?);
        let mut scale = ((nope + rope_dim) as f64).powf(-0.5);
        let kind = rope.and_then(|r| r.get("rope_type").or_else(|| r.get("type")));
        let scaled = kind.and_then(Value::as_str).unwrap_or("default") != "default";
        let all = rope.and_then(|r| r.get("mscale_all_dim")).and_then(Value::as_f64);
        let all = all.filter(|_| scaled).unwrap_or(0.0);
        let factor = rope.and_then(|r| r.get("factor")).and_then(Value::as_f64).unwrap_or(1.0);
        if all != 0.0 && factor > 1.0 {
            // (transformers' yarn_get_mscale, in f64 as Python computes it.)
            let m = 0.1 * all * factor.ln() + 1.0;
            scale *= m * m;
        }
        Ok(MlaConfig {
            q_lora_rank: self.opt_usize("q_lora_rank")?,
            kv_lora_rank: self.usize("kv_lora_rank")?,
            qk_nope_head_dim: nope,
            qk_rope_head_dim: rope_dim,
            v_head_dim: self.usize("v_head_dim")?,
            rope_interleave: self.opt_bool("rope_interleave")?.unwrap_or(true),
            softmax_scale: scale as f32,
            mscale_all_dim: all as f32,
            mtp_layers: self.opt_usize("num_nextn_predict_layers")?.unwrap_or(0),
        })
    }
}

impl ModelConfig {
    /// Whether decoder layer `layer` routes its tokens over experts.
    pub fn is_sparse_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// Reads `config.json`; a missing file, bad JSON, an unsupported architecture or a missing
    /// field names the file and the field.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_json(&value, path)
    }

    /// Parses a config object; `path` is only used in messages.
    pub fn from_json(value: &Value, path: &Path) -> Result<Self> {
        let obj = value.as_object().ok_or_else(|| Error::Config {
            path: path.to_path_buf(),
            message: "expected a JSON object".into(),
        })?;
        let f = Fields { path, obj };
        let class = obj
            .get("architectures")
            .and_then(|a| a.get(0))
            .and_then(Value::as_str)
            .or_else(|| obj.get("model_type").and_then(Value::as_str))
            .ok_or_else(|| {
                f.err("missing field 'architectures' (e.g. [\"Qwen3ForCausalLM\"])".into())
            })?;
        let architecture = match class {
            "Qwen3ForCausalLM" | "qwen3" => Architecture::Qwen3,
            "LlamaForCausalLM" | "llama" => Architecture::Llama,
            "Qwen3MoeForCausalLM" | "qwen3_moe" => Architecture::Qwen3Moe,
            "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
            "Gemma3ForCausalLM" | "gemma3_text" => Architecture::Gemma3,
            "Gemma2ForCausalLM" | "gemma2" => Architecture::Gemma2,
            "Glm4ForCausalLM" | "glm4" => Architecture::Glm4,
            "DeepseekV3ForCausalLM" | "deepseek_v3" => Architecture::DeepseekV3,
            "Gemma3ForConditionalGeneration" | "gemma3" => {
                return Err(f.err(
                    "Gemma3ForConditionalGeneration (text and images) is not supported: use a \
                     text-only Gemma3ForCausalLM checkpoint (gemma-3-1b, or the text model \
                     extracted)"
                        .into(),
                ));
            }
            other => {
                return Err(f.err(format!(
                    "architecture '{other}' is not supported; supported: Qwen3ForCausalLM, \
                     Qwen2ForCausalLM, LlamaForCausalLM, Qwen3MoeForCausalLM, Gemma2ForCausalLM, \
                     Gemma3ForCausalLM, Glm4ForCausalLM, DeepseekV3ForCausalLM"
                )));
            }
        };
        let gemma = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
        let (act_key, act_want) =
            if gemma { ("hidden_activation", "gelu_pytorch_tanh") } else { ("hidden_act", "silu") };
        if let Some(act) = obj.get(act_key).and_then(Value::as_str)
            && act != act_want
        {
            return Err(f.err(format!(
                "{act_key} '{act}' is not supported for {} (only {act_want})",
                architecture.hf_class()
            )));
        }
        let glm = architecture == Architecture::Glm4;
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(glm);
        let mlp_bias = f.opt_bool("mlp_bias")?.unwrap_or(false);
        let bias = match architecture {
            // transformers' Qwen2 has q/k/v biases whatever the config says.
            Architecture::Qwen2 => Biases { qkv: true, o: false, mlp: false },
            // GLM-4's o_proj has none.
            Architecture::Glm4 => Biases { qkv: attention_bias, o: false, mlp: false },
            Architecture::DeepseekV3 if attention_bias => {
                return Err(f.err(
                    "'attention_bias': true is not supported for DeepseekV3ForCausalLM (the \
                     released checkpoints set it false)"
                        .into(),
                ));
            }
            _ => Biases { qkv: attention_bias, o: attention_bias, mlp: mlp_bias },
        };
        if mlp_bias && architecture != Architecture::Llama {
            return Err(f.err(format!(
                "'mlp_bias': true is not supported for {} (transformers has no MLP biases there)",
                architecture.hf_class()
            )));
        }
        if f.opt_bool("use_sliding_window")? == Some(true) {
            return Err(f.err(
                "'use_sliding_window': true is not supported (released Qwen2 and Qwen2.5 \
                 checkpoints set it false)"
                    .into(),
            ));
        }
        // Keys that change the math of families not implemented here: refused, not ignored.
        if let Some(Value::Array(types)) = obj.get("layer_types").filter(|_| !gemma)
            && let Some(other) = types.iter().find(|t| t.as_str() != Some("full_attention"))
        {
            return Err(f.err(format!(
                "'layer_types' holds {other}: only full_attention layers are supported"
            )));
        }
        // (Gemma 2 applies both caps, Gemma 3 the final one: transformers' Gemma 3 reads
        // attn_logit_softcapping but never applies it, so neither is it here.)
        let capped: &[&str] =
            if gemma { &[] } else { &["attn_logit_softcapping", "final_logit_softcapping"] };
        for &key in capped {
            if let Some(v) = obj.get(key).filter(|v| !v.is_null()) {
                return Err(f.err(format!("'{key}': {v} is not supported (no soft-capping)")));
            }
        }
        let partial = obj.get("partial_rotary_factor").or_else(|| {
            ["rope_parameters", "rope_scaling"]
                .iter()
                .find_map(|k| obj.get(*k)?.get("partial_rotary_factor"))
        });
        // transformers' GLM-4 turns half of each head unless told otherwise.
        let partial = match partial.filter(|p| !p.is_null()) {
            None => glm.then_some(0.5),
            Some(p) => Some(p.as_f64().ok_or_else(|| {
                f.err(format!("'partial_rotary_factor' must be a number, found {p}"))
            })?),
        };
        if let Some(p) = partial.filter(|&p| p != 1.0 && !glm) {
            return Err(f.err(format!(
                "'partial_rotary_factor': {p} is not supported for {} (rotary embeddings over \
                 whole heads; GLM-4's partial one is implemented)",
                architecture.hf_class()
            )));
        }
        // Newer transformers write `rope_parameters`, older `rope_theta` and `rope_scaling`.
        let rope = ["rope_parameters", "rope_scaling"]
            .into_iter()
            .find_map(|key| obj.get(key).filter(|v| !v.is_null()).map(|v| (key, v)));
        // Gemma 3 in newer transformers: one rope dictionary per layer type.
        let nested = rope.and_then(|(key, r)| {
            let full = r.get("full_attention").filter(|_| gemma)?;
            Some((key, full, r.get("sliding_attention")))
        });
        let local_rope = nested.and_then(|(key, _, local)| Some((key, local?)));
        let rope = nested.map(|(key, full, _)| (key, full)).or(rope);
        let rope = match rope {
            Some((key, Value::Object(r))) => Some((key, r)),
            Some((key, v)) => return Err(f.err(format!("'{key}' must be an object, found {v}"))),
            None => None,
        };
        let max_position_embeddings = f.opt_usize("max_position_embeddings")?.unwrap_or(4096);
        let rope_scaling =
            RopeScaling::from_json(rope, max_position_embeddings).map_err(|m| f.err(m))?;
        if let Some(q) = obj.get("quantization_config").filter(|v| !v.is_null()) {
            check_quantization(q).map_err(|m| f.err(format!("quantization_config: {m}")))?;
        }
        let rope_theta = match rope.and_then(|(_, r)| r.get("rope_theta")).and_then(Value::as_f64) {
            Some(t) => t as f32,
            None => f.opt_f32("rope_theta")?.unwrap_or(10_000.0),
        };
        let gemma = if gemma {
            let mut g = f.gemma(architecture, local_rope, max_position_embeddings)?;
            if architecture == Architecture::Gemma2 {
                // One rotary for every layer.
                (g.local_rope_theta, g.local_rope_scaling) = (rope_theta, rope_scaling.clone());
            }
            Some(Box::new(g))
        } else {
            None
        };
        let hidden_size = f.usize("hidden_size")?;
        let num_attention_heads = f.usize("num_attention_heads")?;
        let num_key_value_heads =
            f.opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads);
        let mla = match architecture {
            Architecture::DeepseekV3 => Some(Box::new(f.mla(rope.map(|(_, r)| r))?)),
            _ => None,
        };
        let head_dim = match (f.opt_usize("head_dim")?, &mla) {
            // (transformers writes DeepSeek's head_dim as the rotary part's.)
            (_, Some(m)) => m.qk_nope_head_dim + m.qk_rope_head_dim,
            (Some(d), None) => d,
            (None, None) if num_attention_heads > 0 => hidden_size / num_attention_heads,
            (None, None) => 0,
        };
        // (int(head_dim · factor), as transformers rounds it.)
        let rotary_dim = match &mla {
            Some(m) => m.qk_rope_head_dim,
            None => partial.map_or(head_dim, |p| (head_dim as f64 * p) as usize),
        };
        let config = ModelConfig {
            architecture,
            vocab_size: f.usize("vocab_size")?,
            hidden_size,
            intermediate_size: f.usize("intermediate_size")?,
            num_hidden_layers: f.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rotary_dim,
            bias,
            rms_norm_eps: f.opt_f32("rms_norm_eps")?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            // Gemma ties its head unless told otherwise.
            tie_word_embeddings: f.opt_bool("tie_word_embeddings")?.unwrap_or(gemma.is_some()),
            max_position_embeddings,
            bos_token_id: f.token_ids("bos_token_id")?.first().copied(),
            eos_token_ids: f.token_ids("eos_token_id")?,
            moe: match architecture {
                Architecture::Qwen3Moe => Some(Box::new(f.moe()?)),
                Architecture::DeepseekV3 => Some(Box::new(f.deepseek_moe(f.layers()?)?)),
                _ => None,
            },
            mla,
            gemma,
            mtp_input: false,
        };
        config.validate().map_err(|message| f.err(message))?;
        Ok(config)
    }

    fn validate(&self) -> std::result::Result<(), String> {
        let c = self;
        let positive = [
            ("vocab_size", c.vocab_size),
            ("hidden_size", c.hidden_size),
            ("intermediate_size", c.intermediate_size),
            ("num_hidden_layers", c.num_hidden_layers),
            ("num_attention_heads", c.num_attention_heads),
            ("num_key_value_heads", c.num_key_value_heads),
            ("head_dim", c.head_dim),
        ];
        if let Some((key, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("field '{key}' must be at least 1"));
        }
        if !c.num_attention_heads.is_multiple_of(c.num_key_value_heads) {
            return Err(format!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                c.num_attention_heads, c.num_key_value_heads
            ));
        }
        if let Some(m) = &c.mla {
            validate_mla(c, m)?;
        }
        if !c.head_dim.is_multiple_of(2) {
            return Err(format!("head_dim {} must be even for rotary embeddings", c.head_dim));
        }
        if !(c.rotary_dim.is_multiple_of(2) && (2..=c.head_dim).contains(&c.rotary_dim)) {
            return Err(format!(
                "partial_rotary_factor gives a rotary over {} of head_dim {} dimensions: it must \
                 be even and between 2 and head_dim",
                c.rotary_dim, c.head_dim
            ));
        }
        if !(c.rms_norm_eps > 0.0 && c.rope_theta > 0.0) {
            return Err("rms_norm_eps and rope_theta must be positive".into());
        }
        if let Some(m) = &c.moe {
            if m.num_experts == 0 || m.moe_intermediate_size == 0 || m.decoder_sparse_step == 0 {
                return Err("num_experts, moe_intermediate_size and decoder_sparse_step must be \
                            at least 1"
                    .into());
            }
            if !(1..=m.num_experts).contains(&m.num_experts_per_tok) {
                return Err(format!(
                    "num_experts_per_tok {} must be in 1..={} (num_experts)",
                    m.num_experts_per_tok, m.num_experts
                ));
            }
            if m.router_aux_loss_coef.is_nan() || m.router_aux_loss_coef < 0.0 {
                return Err("router_aux_loss_coef must be a number ≥ 0".into());
            }
            if let Routing::GroupedSigmoid { n_group, topk_group, .. } = m.routing {
                validate_groups(m, n_group, topk_group)?;
            }
        }
        // Bounded before anything is allocated or counted in usize: every layer counted as the
        // larger of a dense and a sparse one, in u128 (no product of these sizes overflows it).
        let (h, d) = (c.hidden_size as u128, c.head_dim as u128);
        let attn = h * d * 2 * (c.num_attention_heads + c.num_key_value_heads) as u128;
        let sparse = c.moe.as_ref().map_or(0, |m| {
            (m.num_experts + m.shared_experts) as u128
                * h
                * (1 + 3 * m.moe_intermediate_size as u128)
        });
        let mlp = sparse.max(3 * h * c.intermediate_size as u128);
        let layers = c.num_hidden_layers as u128 * (attn + mlp + 2 * (h + d));
        let total = 2 * c.vocab_size as u128 * h + layers + h;
        if total > MAX_PARAMETERS {
            return Err(format!(
                "its sizes describe about {total:.3e} parameters, more than the {MAX_PARAMETERS:.1e} \
                 this loader accepts: check num_hidden_layers ({}), hidden_size ({}), \
                 intermediate_size ({}), vocab_size ({}){}",
                c.num_hidden_layers,
                c.hidden_size,
                c.intermediate_size,
                c.vocab_size,
                c.moe.as_ref().map_or(String::new(), |m| format!(
                    ", num_experts ({}), moe_intermediate_size ({})",
                    m.num_experts, m.moe_intermediate_size
                ))
            ));
        }
        Ok(())
    }

    /// The `config.json` this crate writes: readable by transformers (old and new key names).
    pub fn to_hf_json(&self, dtype: &str) -> Value {
        let c = self;
        let mut v = json!({
            "architectures": [c.architecture.hf_class()],
            "model_type": c.architecture.model_type(),
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": c.rms_norm_eps,
            "rope_theta": c.rope_theta,
            "rope_parameters": c.rope_scaling.to_json(c.rope_theta),
            "max_position_embeddings": c.max_position_embeddings,
            "tie_word_embeddings": c.tie_word_embeddings,
            "attention_bias": c.bias.qkv && c.architecture != Architecture::Qwen2,
            "attention_dropout": 0.0,
            "torch_dtype": dtype,
            "use_cache": true,
        });
        if c.architecture == Architecture::Llama {
            v["mlp_bias"] = json!(c.bias.mlp);
        }
        if c.architecture == Architecture::Qwen2 {
            v["use_sliding_window"] = json!(false);
        }
        if c.architecture == Architecture::Glm4 {
            let p = c.rotary_dim as f64 / c.head_dim as f64;
            v["partial_rotary_factor"] = json!(p);
            v["rope_parameters"]["partial_rotary_factor"] = json!(p);
            // (transformers' default, 151329, is past a small vocabulary; its embedding would
            // zero that row's gradient, which this trainer does not.)
            v["pad_token_id"] = Value::Null;
        }
        if let Some(g) = &c.gemma {
            let obj = v.as_object_mut().expect("an object");
            obj.remove("hidden_act");
            v["hidden_activation"] = json!("gelu_pytorch_tanh");
            // (transformers wants an integer here, as the released configs have it.)
            let q = g.query_pre_attn_scalar;
            v["query_pre_attn_scalar"] = if q.fract() == 0.0 { json!(q as i64) } else { json!(q) };
            v["sliding_window"] = json!(g.sliding_window);
            v["layer_types"] = json!(
                g.sliding
                    .iter()
                    .map(|&s| if s { "sliding_attention" } else { "full_attention" })
                    .collect::<Vec<_>>()
            );
            v["rope_parameters"] = json!({
                "full_attention": c.rope_scaling.to_json(c.rope_theta),
                "sliding_attention": g.local_rope_scaling.to_json(g.local_rope_theta),
            });
            v["final_logit_softcapping"] = json!(g.final_softcap);
            v["attn_logit_softcapping"] = json!(g.attn_softcap);
            if c.architecture == Architecture::Gemma2 {
                v["rope_parameters"] = c.rope_scaling.to_json(c.rope_theta);
            }
        }
        if let Some(m) = &c.mla {
            v["q_lora_rank"] = json!(m.q_lora_rank);
            v["kv_lora_rank"] = json!(m.kv_lora_rank);
            v["qk_nope_head_dim"] = json!(m.qk_nope_head_dim);
            v["qk_rope_head_dim"] = json!(m.qk_rope_head_dim);
            v["v_head_dim"] = json!(m.v_head_dim);
            v["head_dim"] = json!(m.qk_rope_head_dim);
            v["rope_interleave"] = json!(m.rope_interleave);
            v["num_nextn_predict_layers"] = json!(m.mtp_layers);
            if m.mscale_all_dim != 0.0 {
                v["rope_parameters"]["mscale_all_dim"] = json!(m.mscale_all_dim);
            }
        }
        if let Some(m) = c.moe.as_ref().filter(|_| c.mla.is_some()) {
            let Routing::GroupedSigmoid { n_group, topk_group, scaling } = m.routing else {
                unreachable!("DeepSeek's routing")
            };
            v["n_routed_experts"] = json!(m.num_experts);
            v["num_experts_per_tok"] = json!(m.num_experts_per_tok);
            v["moe_intermediate_size"] = json!(m.moe_intermediate_size);
            v["norm_topk_prob"] = json!(m.norm_topk_prob);
            v["first_k_dense_replace"] = json!(m.mlp_only_layers.len());
            v["n_shared_experts"] = json!(m.shared_experts);
            v["n_group"] = json!(n_group);
            v["topk_group"] = json!(topk_group);
            v["routed_scaling_factor"] = json!(scaling);
            v["scoring_func"] = json!("sigmoid");
            v["topk_method"] = json!("noaux_tc");
        } else if let Some(m) = &c.moe {
            v["num_experts"] = json!(m.num_experts);
            v["num_experts_per_tok"] = json!(m.num_experts_per_tok);
            v["moe_intermediate_size"] = json!(m.moe_intermediate_size);
            v["norm_topk_prob"] = json!(m.norm_topk_prob);
            v["decoder_sparse_step"] = json!(m.decoder_sparse_step);
            v["mlp_only_layers"] = json!(m.mlp_only_layers);
            v["output_router_logits"] = json!(m.router_aux_loss_coef > 0.0);
            v["router_aux_loss_coef"] =
                json!(if m.router_aux_loss_coef > 0.0 { m.router_aux_loss_coef } else { 0.001 });
        }
        if let Some(bos) = c.bos_token_id {
            v["bos_token_id"] = json!(bos);
        }
        match c.eos_token_ids.as_slice() {
            [] => {}
            [one] => v["eos_token_id"] = json!(one),
            many => v["eos_token_id"] = json!(many),
        }
        v
    }

    /// The attention of decoder layer `layer`: its heads and how its scores are formed.
    pub fn attention_shape(&self, layer: usize) -> miles_tensor::cpu::AttentionShape {
        let mut shape = miles_tensor::cpu::AttentionShape::new(
            self.num_attention_heads,
            self.num_key_value_heads,
            self.head_dim,
        );
        if let Some(m) = &self.mla {
            shape.scores.scale = m.softmax_scale;
        }
        if let Some(g) = &self.gemma {
            shape.scores.scale = (f64::from(g.query_pre_attn_scalar).powf(-0.5)) as f32;
            shape.scores.window = g.sliding[layer].then_some(g.sliding_window);
            shape.scores.softcap = g.attn_softcap;
        }
        shape
    }

    /// The gated MLP's activation: Gemma's tanh GELU, SiLU elsewhere.
    pub fn gate(&self) -> miles_tensor::cpu::Gate {
        match self.gemma {
            Some(_) => miles_tensor::cpu::Gate::GeluTanh,
            None => miles_tensor::cpu::Gate::Silu,
        }
    }

    /// Whether the attention's and the MLP's outputs are normed before the residual adds
    /// (Gemma, GLM-4).
    pub fn sandwich_norms(&self) -> bool {
        self.gemma.is_some() || self.architecture == Architecture::Glm4
    }

    /// Gemma's embedding scale, √hidden; 1 elsewhere.
    pub fn embed_scale(&self) -> f32 {
        if self.gemma.is_some() { (self.hidden_size as f64).sqrt() as f32 } else { 1.0 }
    }

    /// Whether layer `layer` rotates by the sliding layers' rotary (Gemma 3's local one).
    pub fn local_rope(&self, layer: usize) -> bool {
        self.gemma.as_ref().is_some_and(|g| g.sliding[layer])
    }

    /// The rotary cos and sin tables `[positions × head_dim/2]` of `positions`, as transformers
    /// computes them for this config.
    pub fn rope_tables(&self, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        self.tables(&self.rope_scaling, self.rope_theta, positions)
    }

    /// The tables of one rotary; past `rotary_dim` (a partial rotary) the pairs get cos 1 and
    /// sin 0, which the rotation passes through unchanged.
    fn tables(&self, scaling: &RopeScaling, theta: f32, positions: &[u32]) -> (Vec<f32>, Vec<f32>) {
        let (inv_freq, scale) = scaling.frequencies(self.rotary_dim, theta);
        let (cos, sin) = miles_tensor::cpu::rope_tables(positions, &inv_freq, scale);
        let (turned, half) = (self.rotary_dim / 2, self.head_dim / 2);
        if turned == half {
            return (cos, sin);
        }
        let pad = |t: Vec<f32>, rest: f32| -> Vec<f32> {
            t.chunks(turned.max(1))
                .flat_map(|row| row.iter().copied().chain(std::iter::repeat_n(rest, half - turned)))
                .collect()
        };
        (pad(cos, 1.0), pad(sin, 0.0))
    }

    /// [`Self::rope_tables`] of the sliding layers' rotary, when the model has one of its own
    /// (not Gemma 2's, the same as the others').
    pub fn local_rope_tables(&self, positions: &[u32]) -> Option<(Vec<f32>, Vec<f32>)> {
        let g = self.gemma.as_ref()?;
        if (g.local_rope_theta, &g.local_rope_scaling) == (self.rope_theta, &self.rope_scaling) {
            return None;
        }
        Some(self.tables(&g.local_rope_scaling, g.local_rope_theta, positions))
    }

    /// Parameters in the model (the tied head counted once), every expert included.
    pub fn num_parameters(&self) -> usize {
        self.parameters(false)
    }

    /// Parameters a token runs through: [`Self::num_parameters`] with only its top-k experts
    /// of each sparse layer (the router counted whole). The same for dense models.
    pub fn active_parameters(&self) -> usize {
        self.parameters(true)
    }

    fn parameters(&self, active: bool) -> usize {
        let c = self;
        let (h, d) = (c.hidden_size, c.head_dim);
        let attn = match &c.mla {
            Some(m) => m.parameters(h, c.num_attention_heads),
            None => h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads),
        };
        let qk_norm = if c.architecture.has_qk_norm() { 2 * d } else { 0 };
        let attn_bias =
            usize::from(c.bias.qkv) * d * (c.num_attention_heads + 2 * c.num_key_value_heads)
                + usize::from(c.bias.o) * h;
        let mlp_bias = usize::from(c.bias.mlp) * (2 * c.intermediate_size + h);
        let mlp = |layer: usize| match &c.moe {
            Some(m) if m.is_sparse(layer) => {
                let experts = if active { m.num_experts_per_tok } else { m.num_experts };
                let bias = match m.routing {
                    Routing::GroupedSigmoid { .. } => m.num_experts,
                    Routing::Softmax => 0,
                };
                m.num_experts * h
                    + bias
                    + (experts + m.shared_experts) * 3 * h * m.moe_intermediate_size
            }
            _ => 3 * h * c.intermediate_size + mlp_bias,
        };
        // Gemma's and GLM-4's norms after attention and around the MLP: four a layer.
        let norms = if c.sandwich_norms() { 4 * h } else { 2 * h };
        let layers: usize =
            (0..c.num_hidden_layers).map(|l| attn + attn_bias + qk_norm + mlp(l) + norms).sum();
        let head = if c.tie_word_embeddings { 0 } else { c.vocab_size * h };
        c.vocab_size * h + layers + h + head
    }
}

/// The latent attention's sizes, named by their keys.
fn validate_mla(c: &ModelConfig, m: &MlaConfig) -> std::result::Result<(), String> {
    let sizes = [
        ("kv_lora_rank", m.kv_lora_rank),
        ("qk_nope_head_dim", m.qk_nope_head_dim),
        ("qk_rope_head_dim", m.qk_rope_head_dim),
        ("v_head_dim", m.v_head_dim),
        ("q_lora_rank", m.q_lora_rank.unwrap_or(1)),
    ];
    if let Some((key, _)) = sizes.iter().find(|(_, v)| *v == 0) {
        return Err(format!("field '{key}' must be at least 1"));
    }
    if !m.qk_rope_head_dim.is_multiple_of(2) {
        return Err(format!(
            "'qk_rope_head_dim' {} must be even: the rotary turns pairs of dimensions",
            m.qk_rope_head_dim
        ));
    }
    if c.num_key_value_heads != c.num_attention_heads {
        return Err(format!(
            "'num_key_value_heads' {} differs from 'num_attention_heads' {}: latent attention \
             expands a key and a value per query head",
            c.num_key_value_heads, c.num_attention_heads
        ));
    }
    Ok(())
}

/// Group-limited routing's sizes, named by their keys.
fn validate_groups(m: &MoeConfig, groups: usize, kept: usize) -> std::result::Result<(), String> {
    if groups == 0 || !m.num_experts.is_multiple_of(groups) {
        return Err(format!(
            "'n_group' {groups} must divide 'n_routed_experts' {} into equal groups",
            m.num_experts
        ));
    }
    if groups > 1 && m.num_experts / groups < 2 {
        return Err(format!(
            "'n_group' {groups} leaves {} expert a group: a group is ranked by its two best \
             experts",
            m.num_experts / groups
        ));
    }
    if !(1..=groups).contains(&kept) {
        return Err(format!("'topk_group' {kept} must be between 1 and 'n_group' ({groups})"));
    }
    if m.num_experts_per_tok > kept * (m.num_experts / groups) {
        return Err(format!(
            "'num_experts_per_tok' {} is more than the {} experts of 'topk_group' {kept} groups",
            m.num_experts_per_tok,
            kept * (m.num_experts / groups)
        ));
    }
    Ok(())
}

/// Accepts the quantization of an FP8 checkpoint as DeepSeek-V3 and Qwen3 release them (E4M3
/// weights in 128 × 128 blocks, activations scaled dynamically), whose weights load
/// dequantized; any other is refused, naming the field.
fn check_quantization(q: &Value) -> std::result::Result<(), String> {
    let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("(none)");
    if method == "compressed-tensors" {
        return check_compressed_tensors(q);
    }
    if method != "fp8" {
        return Err(format!(
            "quant_method '{method}' is not supported: fp8 checkpoints (E4M3 in 128×128 \
             blocks) and compressed-tensors' pack-quantized INT4 load"
        ));
    }
    if let Some(fmt) = q.get("fmt").filter(|v| !v.is_null())
        && fmt != "e4m3"
    {
        return Err(format!("fmt {fmt} is not supported: only \"e4m3\""));
    }
    if let Some(block) = q.get("weight_block_size").filter(|v| !v.is_null())
        && *block != json!([128, 128])
    {
        return Err(format!("weight_block_size {block} is not supported: only [128, 128]"));
    }
    if let Some(scheme) = q.get("activation_scheme").filter(|v| !v.is_null())
        && scheme != "dynamic"
    {
        return Err(format!("activation_scheme {scheme} is not supported: only \"dynamic\""));
    }
    Ok(())
}

/// compressed-tensors' `pack-quantized` INT4 weights (W4A16: symmetric integer groups, no
/// activation quantization), which load dequantized.
fn check_compressed_tensors(q: &Value) -> std::result::Result<(), String> {
    let format = q.get("format").and_then(Value::as_str).unwrap_or("(none)");
    if format != "pack-quantized" {
        return Err(format!("format '{format}' is not supported: only \"pack-quantized\" (INT4)"));
    }
    let Some(groups) = q.get("config_groups").and_then(Value::as_object) else {
        return Err("config_groups: missing (the quantization scheme of each group)".into());
    };
    for (name, group) in groups {
        let at = |field: &str| format!("config_groups.{name}.{field}");
        let w = &group["weights"];
        let want = [
            ("num_bits", json!(4)),
            ("type", json!("int")),
            ("symmetric", json!(true)),
            ("strategy", json!("group")),
        ];
        for (field, value) in want {
            if w[field] != value {
                return Err(format!(
                    "{} {} is not supported: INT4 weights are {value} (symmetric integer groups)",
                    at(&format!("weights.{field}")),
                    w[field]
                ));
            }
        }
        if w["group_size"].as_u64().is_none_or(|g| g == 0) {
            return Err(format!(
                "{} {}: a group size > 0",
                at("weights.group_size"),
                w["group_size"]
            ));
        }
        if !group["input_activations"].is_null() {
            return Err(format!(
                "{} is set: only weight-only INT4 (W4A16) loads",
                at("input_activations")
            ));
        }
    }
    Ok(())
}

/// The most parameters a config may describe: 2^44 (17.6 T, 26 times DeepSeek-V3's 671 B).
const MAX_PARAMETERS: u128 = 1 << 44;

/// The most layers a config may have (DeepSeek-V3 has 61, Llama 3.1 405B 126): per-layer
/// settings are made before the sizes are checked, and must not be a vector of 10^13. (Below
/// this, a count the tensors do not hold is named against them, a clearer message.)
const MAX_LAYERS: usize = 1 << 24;

/// Whether `dir/config.json` describes an FP8 checkpoint (a `quantization_config` with
/// `quant_method: fp8`; [`ModelConfig::from_file`] checks the rest of it).
pub fn is_fp8_checkpoint(dir: &Path) -> Result<bool> {
    let path = config_path(dir);
    let text = std::fs::read_to_string(&path)
        .map_err(|source| Error::Io { path: path.clone(), source })?;
    let value: Value = serde_json::from_str(&text)
        .map_err(|e| Error::Config { path, message: format!("not valid JSON: {e}") })?;
    Ok(value.pointer("/quantization_config/quant_method").and_then(Value::as_str) == Some("fp8"))
}

/// `dir/config.json`.
pub fn config_path(dir: &Path) -> PathBuf {
    dir.join("config.json")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen3_json() -> Value {
        json!({
            "architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
            "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
            "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
            "rope_theta": 1000000, "tie_word_embeddings": true, "eos_token_id": 151645,
            "hidden_act": "silu", "rope_scaling": null
        })
    }

    #[test]
    fn reads_qwen3_0_6b_and_counts_its_parameters() {
        let c = ModelConfig::from_json(&qwen3_json(), Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3);
        assert_eq!((c.head_dim, c.rope_theta, c.eos_token_ids.clone()), (128, 1e6, vec![151645]));
        // Qwen3-0.6B has 596M parameters with the tied head (0.44B without embeddings).
        assert_eq!(c.num_parameters(), 596_049_920);
        let back = ModelConfig::from_json(&c.to_hf_json("bfloat16"), Path::new("x")).unwrap();
        assert_eq!(back, c);
    }

    /// Qwen3-30B-A3B's published config.json: 30.5 B parameters, 3.4 B active.
    #[test]
    fn reads_qwen3_moe_and_counts_its_total_and_active_parameters() {
        let v = json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
            "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000,
            "tie_word_embeddings": false, "hidden_act": "silu", "num_experts": 128,
            "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "output_router_logits": false,
            "router_aux_loss_coef": 0.001
        });
        let c = ModelConfig::from_json(&v, Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::Qwen3Moe);
        let m = c.moe.clone().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok, m.moe_intermediate_size), (128, 8, 768));
        assert!(m.norm_topk_prob && (0..48).all(|l| c.is_sparse_layer(l)));
        assert_eq!(m.router_aux_loss_coef, 0.0, "off unless output_router_logits");
        assert_eq!(c.num_parameters(), 30_532_122_624);
        assert_eq!(c.active_parameters(), 3_353_032_704);
        let back = ModelConfig::from_json(&c.to_hf_json("bfloat16"), Path::new("x")).unwrap();
        assert_eq!(back, c);

        let mut v2 = v.clone();
        v2["decoder_sparse_step"] = json!(2);
        v2["mlp_only_layers"] = json!([3]);
        v2["output_router_logits"] = json!(true);
        let c = ModelConfig::from_json(&v2, Path::new("c.json")).unwrap();
        let sparse: Vec<usize> = (0..8).filter(|&l| c.is_sparse_layer(l)).collect();
        assert_eq!(sparse, [1, 5, 7]);
        assert_eq!(c.moe.as_ref().unwrap().router_aux_loss_coef, 0.001);
        let back = ModelConfig::from_json(&c.to_hf_json("bfloat16"), Path::new("x")).unwrap();
        assert_eq!(back, c);

        let err = |key: &str, value: Value| {
            let mut bad = v.clone();
            bad[key] = value;
            ModelConfig::from_json(&bad, Path::new("moe/config.json")).unwrap_err().to_string()
        };
        assert!(err("num_experts_per_tok", json!(129)).contains("must be in 1..=128"));
        assert!(err("mlp_only_layers", json!("all")).contains("'mlp_only_layers' must be a list"));
        // transformers 5 writes num_local_experts.
        let mut local = v.clone();
        let n = local.as_object_mut().unwrap().remove("num_experts").unwrap();
        local["num_local_experts"] = n;
        let c = ModelConfig::from_json(&local, Path::new("c.json")).unwrap();
        assert_eq!(c.moe.as_ref().unwrap().num_experts, 128);
        local.as_object_mut().unwrap().remove("num_local_experts");
        let e = ModelConfig::from_json(&local, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("missing field 'num_experts' (or 'num_local_experts')"), "{e}");
        let mut missing = v.clone();
        missing.as_object_mut().unwrap().remove("moe_intermediate_size");
        let e = ModelConfig::from_json(&missing, Path::new("m.json")).unwrap_err().to_string();
        assert_eq!(e, "m.json: missing field 'moe_intermediate_size'");
    }

    fn deepseek_v3_json() -> Value {
        serde_json::from_str(crate::presets::DEEPSEEK_V3).unwrap()
    }

    /// 671 B parameters (its MTP layer's 14 B apart), 37 B active, as DeepSeek reports them.
    #[test]
    fn reads_deepseek_v3_and_counts_its_total_and_active_parameters() {
        let v = deepseek_v3_json();
        let c = ModelConfig::from_json(&v, Path::new("config.json")).unwrap();
        assert_eq!(c.architecture, Architecture::DeepseekV3);
        assert_eq!((c.head_dim, c.rotary_dim), (192, 64));
        let m = c.mla.clone().unwrap();
        assert_eq!((m.q_lora_rank, m.kv_lora_rank, m.v_head_dim), (Some(1536), 512, 128));
        assert!(m.rope_interleave && m.mtp_layers == 1);
        // 192^-1/2 · (0.1 · ln 40 + 1)^2
        let mscale = 0.1 * 40f64.ln() + 1.0;
        assert_eq!(m.softmax_scale, (192f64.powf(-0.5) * mscale * mscale) as f32);
        let moe = c.moe.clone().unwrap();
        let grouped = Routing::GroupedSigmoid { n_group: 8, topk_group: 4, scaling: 2.5 };
        assert_eq!((moe.routing, moe.shared_experts, moe.num_experts), (grouped, 1, 256));
        assert_eq!(moe.mlp_only_layers, [0, 1, 2]);
        assert!(!c.is_sparse_layer(2) && c.is_sparse_layer(3) && c.is_sparse_layer(60));
        let (total, active) = (c.num_parameters() as f64, c.active_parameters() as f64);
        assert!((total / 1e9 - 671.0).abs() < 0.5, "{total}");
        assert!((active / 1e9 - 37.5).abs() < 0.5, "{active}");
        let back = ModelConfig::from_json(&c.to_hf_json("bfloat16"), Path::new("x")).unwrap();
        assert_eq!(back, c);

        let err = |edit: &dyn Fn(&mut Value)| {
            let mut bad = v.clone();
            edit(&mut bad);
            ModelConfig::from_json(&bad, Path::new("ds/config.json")).unwrap_err().to_string()
        };
        let e = err(&|v| v["topk_group"] = json!(9));
        assert!(e.contains("'topk_group' 9 must be between 1 and 'n_group' (8)"), "{e}");
        let e = err(&|v| v["qk_rope_head_dim"] = json!(63));
        assert!(e.contains("'qk_rope_head_dim' 63 must be even"), "{e}");
        let e = err(&|v| {
            v.as_object_mut().unwrap().remove("kv_lora_rank");
        });
        assert_eq!(e, "ds/config.json: missing field 'kv_lora_rank'");
        let e = err(&|v| v["n_group"] = json!(7));
        assert!(e.contains("'n_group' 7 must divide 'n_routed_experts' 256"), "{e}");
        let e = err(&|v| v["n_group"] = json!(256));
        assert!(e.contains("a group is ranked by its two best experts"), "{e}");
        let e = err(&|v| v["num_experts_per_tok"] = json!(200));
        assert!(e.contains("more than the 128 experts of 'topk_group' 4 groups"), "{e}");
        let e = err(&|v| v["scoring_func"] = json!("softmax"));
        assert!(e.contains("'scoring_func' 'softmax' is not supported"), "{e}");
        let e = err(&|v| v["topk_method"] = json!("group_limited_greedy"));
        assert!(e.contains("'topk_method' 'group_limited_greedy' is not supported"), "{e}");
        let e = err(&|v| v["num_key_value_heads"] = json!(1));
        assert!(e.contains("'num_key_value_heads' 1 differs from 'num_attention_heads' 128"));
        let e = err(&|v| v["attention_bias"] = json!(true));
        assert!(e.contains("'attention_bias': true is not supported for DeepseekV3"), "{e}");
        let e = err(&|v| v["routed_scaling_factor"] = json!(0));
        assert!(e.contains("'routed_scaling_factor' must be a positive number"), "{e}");
    }

    /// The parity fixtures' configs as transformers 5 writes them: rope_parameters, head_dim
    /// the rotary part's, no q_lora.
    #[test]
    fn reads_the_deepseek_v3_fixtures_as_transformers_writes_them() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf");
        let c = ModelConfig::from_file(&dir.join("deepseek_v3/config.json")).unwrap();
        let m = c.mla.clone().unwrap();
        assert_eq!((c.head_dim, c.rotary_dim, m.q_lora_rank, m.v_head_dim), (24, 8, None, 12));
        let mscale = 0.1 * 0.8f64 * 4f64.ln() + 1.0;
        assert_eq!(m.softmax_scale, (24f64.powf(-0.5) * mscale * mscale) as f32);
        let moe = c.moe.clone().unwrap();
        assert_eq!(
            moe.routing,
            Routing::GroupedSigmoid { n_group: 4, topk_group: 2, scaling: 2.5 }
        );
        assert_eq!((moe.mlp_only_layers.as_slice(), moe.shared_experts), (&[0][..], 1));
        assert!(matches!(c.rope_scaling, RopeScaling::Yarn { .. }));
        let back = ModelConfig::from_json(&c.to_hf_json("float32"), Path::new("x")).unwrap();
        assert_eq!(back, c);

        let c = ModelConfig::from_file(&dir.join("deepseek_v3_q_lora/config.json")).unwrap();
        let m = c.mla.clone().unwrap();
        assert_eq!((m.q_lora_rank, m.rope_interleave), (Some(24), false));
        assert_eq!(m.softmax_scale, 24f64.powf(-0.5) as f32);
        assert!(c.moe.as_ref().is_some_and(|m| m.mlp_only_layers.is_empty() && !m.norm_topk_prob));
    }

    #[test]
    fn gemma3_applies_a_final_cap_and_ignores_the_attention_cap_as_transformers_does() {
        let c = crate::presets::preset("tiny", Some(Architecture::Gemma3)).unwrap();
        let mut v = c.to_hf_json("float32");
        v["final_logit_softcapping"] = json!(30.0);
        v["attn_logit_softcapping"] = json!(50.0);
        let g = ModelConfig::from_json(&v, Path::new("c.json")).unwrap().gemma.unwrap();
        assert_eq!((g.final_softcap, g.attn_softcap), (Some(30.0), None));
        v["final_logit_softcapping"] = json!(-1.0);
        let e = ModelConfig::from_json(&v, Path::new("c.json")).unwrap_err().to_string();
        assert!(e.contains("'final_logit_softcapping' must be a positive number"), "{e}");
    }

    #[test]
    fn every_family_reads_back_the_config_it_writes() {
        for arch in [
            Architecture::Qwen3,
            Architecture::Llama,
            Architecture::Qwen3Moe,
            Architecture::Qwen2,
            Architecture::Gemma2,
            Architecture::Gemma3,
            Architecture::Glm4,
            Architecture::DeepseekV3,
        ] {
            for name in ["tiny", "tiny-h64"] {
                let c = crate::presets::preset(name, Some(arch)).unwrap();
                let back = ModelConfig::from_json(&c.to_hf_json("float32"), Path::new("c.json"));
                assert_eq!(back.unwrap(), c, "{name} {arch:?}");
            }
        }
        let c = crate::presets::preset("llama3.2-1b", None).unwrap();
        assert_eq!(ModelConfig::from_json(&c.to_hf_json("bfloat16"), Path::new("c")).unwrap(), c);
    }

    #[test]
    fn reads_rope_parameters_of_newer_transformers() {
        let mut v = qwen3_json();
        v.as_object_mut().unwrap().remove("rope_theta");
        v["rope_parameters"] = json!({"rope_type": "default", "rope_theta": 5000.0});
        let c = ModelConfig::from_json(&v, Path::new("c.json")).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
    }

    #[test]
    fn errors_name_the_file_and_the_field() {
        let p = Path::new("ckpt/config.json");
        let err = |v: Value| ModelConfig::from_json(&v, p).unwrap_err().to_string();
        let mut v = qwen3_json();
        v["architectures"] = json!(["MistralForCausalLM"]);
        assert!(
            err(v).starts_with(
                "ckpt/config.json: architecture 'MistralForCausalLM' is not supported"
            )
        );
        let mut v = qwen3_json();
        v.as_object_mut().unwrap().remove("hidden_size");
        assert_eq!(err(v), "ckpt/config.json: missing field 'hidden_size'");
        let mut v = qwen3_json();
        v["num_key_value_heads"] = json!(3);
        assert!(err(v).contains("not a multiple of num_key_value_heads 3"));
        let mut v = qwen3_json();
        v["vocab_size"] = json!("big");
        assert!(err(v).contains("field 'vocab_size' must be a non-negative integer"));
        let mut v = qwen3_json();
        v["rope_scaling"] = json!({"rope_type": "longrope", "factor": 4.0});
        assert!(err(v).contains("'rope_scaling.rope_type' 'longrope' is not supported"));
        for (key, value, want) in [
            ("layer_types", json!(["full_attention", "sliding_attention"]), "'layer_types' holds"),
            ("final_logit_softcapping", json!(30.0), "'final_logit_softcapping': 30.0 is not"),
            ("partial_rotary_factor", json!(0.5), "'partial_rotary_factor': 0.5 is not"),
            ("use_sliding_window", json!(true), "'use_sliding_window': true is not"),
            ("mlp_bias", json!(true), "'mlp_bias': true is not supported for Qwen3ForCausalLM"),
        ] {
            let mut v = qwen3_json();
            v[key] = value;
            let e = err(v);
            assert!(e.starts_with("ckpt/config.json: ") && e.contains(want), "{e}");
        }
        let mut v = qwen3_json();
        v["layer_types"] = json!(vec!["full_attention"; 28]);
        v["partial_rotary_factor"] = json!(1.0);
        ModelConfig::from_json(&v, p).unwrap();
        // Found by fuzzing (fuzz/regressions/config-json): a Gemma config with 4.7·10^13
        // layers made its per-layer list before any size was checked, and the allocation
        // aborted the process.
        let v = json!({"model_type": "gemma2", "num_hidden_layers": 47270157310813u64});
        let e = err(v);
        assert!(e.contains("'num_hidden_layers' is 47270157310813; this loader accepts at most"));
        for (q, want) in [
            (json!({"quant_method": "awq"}), "quant_method 'awq' is not supported"),
            (json!({"quant_method": "fp8", "fmt": "e5m2"}), "fmt \"e5m2\" is not supported"),
            (
                json!({"quant_method": "fp8", "weight_block_size": [64, 64]}),
                "weight_block_size [64,64] is not supported",
            ),
            (
                json!({"quant_method": "fp8", "activation_scheme": "static"}),
                "activation_scheme \"static\" is not supported",
            ),
        ] {
            let mut v = qwen3_json();
            v["quantization_config"] = q;
            let e = err(v);
            assert!(e.starts_with("ckpt/config.json: quantization_config: "), "{e}");
            assert!(e.contains(want), "{e}");
        }
        let dir = std::env::temp_dir().join("miles-model-bad-config.json");
        std::fs::write(&dir, "{ not json").unwrap();
        let e = ModelConfig::from_file(&dir).unwrap_err().to_string();
        assert!(e.contains("miles-model-bad-config.json: not valid JSON"), "{e}");
    }
}
