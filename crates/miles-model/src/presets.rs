//! Model shapes by name, for `miles init-model` and benchmarks.

use crate::tokenizer::BYTE_TOKENIZER_SPECIALS;
use crate::{
    Architecture, Biases, Error, GemmaConfig, ModelConfig, MoeConfig, Result, RopeScaling,
};

pub const PRESETS: [&str; 13] = [
    "tiny",
    "tiny-h64",
    "qwen3-0.6b",
    "qwen3-8b",
    "smollm2-135m",
    "qwen3-30b-a3b-4l",
    "deepseek-v3-4l",
    "qwen2.5-0.5b",
    "qwen2.5-1.5b",
    "llama3.2-1b",
    "gemma3-1b",
    "gemma2-2b",
    "glm4-9b",
];

/// DeepSeek-V3's published config.json (its FP8 quantization_config left out).
pub(crate) const DEEPSEEK_V3: &str = r#"{
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": false, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": true, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-6, "rope_theta": 10000, "routed_scaling_factor": 2.5,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "scoring_func": "sigmoid", "tie_word_embeddings": false, "topk_group": 4,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
    "bos_token_id": 0, "eos_token_id": 1, "aux_loss_alpha": 0.001, "seq_aux": true
}"#;

/// The configuration of preset `name`. `tiny` takes any architecture (default Qwen3; with
/// Qwen3-MoE, 8 experts of which 2 per token), and so does `tiny-h64`, the same with heads of
/// 64 (a head size the GPU's attention runs); the published shapes have theirs, and asking
/// for another is an error.
pub fn preset(name: &str, arch: Option<Architecture>) -> Result<ModelConfig> {
    if name == "tiny-h64" {
        let mut c = preset("tiny", arch)?;
        if let Some(m) = c.mla.as_mut() {
            // A latent-attention head of 64: 48 + a rotary 16, values of 32.
            (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) = (48, 16, 32);
            m.softmax_scale = (64f64.powf(-0.5)) as f32;
        }
        return Ok(ModelConfig { head_dim: 64, rotary_dim: 64 * c.rotary_dim / c.head_dim, ..c });
    }
    let fixed = |own: Architecture| match arch {
        Some(a) if a != own => Err(Error::Invalid(format!(
            "preset {name} is a {} model; drop --arch or use --arch {}",
            own.model_type(),
            own.model_type()
        ))),
        _ => Ok(own),
    };
    let glm = arch == Some(Architecture::Glm4);
    let c = match name {
        // DeepSeek-V3's layout at the tiny size: latent attention with q_lora and interleaved
        // pairs (a q/k head of 32, the tensor cores' sizes; values of 16), a dense first
        // layer, 8 experts in 4 groups (2 kept), one shared expert, an MTP layer.
        "tiny" if arch == Some(Architecture::DeepseekV3) => {
            let mla = crate::MlaConfig {
                q_lora_rank: Some(24),
                kv_lora_rank: 32,
                qk_nope_head_dim: 24,
                qk_rope_head_dim: 8,
                v_head_dim: 16,
                rope_interleave: true,
                softmax_scale: (32f64.powf(-0.5)) as f32,
                mscale_all_dim: 0.0,
                // (As DeepSeek-V3 ships: one MTP layer, which `miles init-model` writes.)
                mtp_layers: 1,
            };
            let tiny = preset("tiny", None)?;
            ModelConfig {
                architecture: Architecture::DeepseekV3,
                num_key_value_heads: tiny.num_attention_heads,
                head_dim: 32,
                rotary_dim: 8,
                tie_word_embeddings: false,
                moe: Some(Box::new(MoeConfig {
                    num_experts: 8,
                    num_experts_per_tok: 2,
                    moe_intermediate_size: 32,
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: vec![0],
                    router_aux_loss_coef: 0.0,
                    routing: crate::Routing::GroupedSigmoid {
                        n_group: 4,
                        topk_group: 2,
                        scaling: 2.5,
                    },
                    shared_experts: 1,
                })),
                mla: Some(Box::new(mla)),
                ..tiny
            }
        }
        // Sized for tests and the CPU demo; its vocabulary is the project's byte tokenizer.
        "tiny" => ModelConfig {
            architecture: arch.unwrap_or(Architecture::Qwen3),
            vocab_size: 256 + BYTE_TOKENIZER_SPECIALS.len(),
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            // GLM-4 turns half of each head.
            rotary_dim: if glm { 8 } else { 16 },
            // Qwen2's and GLM-4's q/k/v biases go with the architecture.
            bias: Biases { qkv: glm || arch == Some(Architecture::Qwen2), ..Biases::default() },
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: true,
            max_position_embeddings: 2048,
            bos_token_id: None,
            eos_token_ids: vec![258],
            moe: (arch == Some(Architecture::Qwen3Moe)).then(|| {
                Box::new(MoeConfig {
                    num_experts: 8,
                    num_experts_per_tok: 2,
                    moe_intermediate_size: 64,
                    norm_topk_prob: true,
                    decoder_sparse_step: 1,
                    mlp_only_layers: Vec::new(),
                    router_aux_loss_coef: 0.0,
                    routing: crate::Routing::Softmax,
                    shared_experts: 0,
                })
            }),
            // Gemma 3: a sliding layer (window 8) before a full one, its own query scale.
            // (Gemma 2 soft-caps its scores and logits and has one rotary.)
            gemma: matches!(arch, Some(Architecture::Gemma2 | Architecture::Gemma3)).then(|| {
                let gemma2 = arch == Some(Architecture::Gemma2);
                Box::new(GemmaConfig {
                    query_pre_attn_scalar: 12.0,
                    sliding_window: 8,
                    sliding: vec![true, false],
                    local_rope_theta: 10_000.0,
                    local_rope_scaling: RopeScaling::None,
                    attn_softcap: gemma2.then_some(5.0),
                    final_softcap: gemma2.then_some(3.0),
                })
            }),
            mtp_input: false,
            mla: None,
        },
        // Qwen3-0.6B's published config.json.
        "qwen3-0.6b" => ModelConfig {
            architecture: fixed(Architecture::Qwen3)?,
            vocab_size: 151_936,
            hidden_size: 1024,
            intermediate_size: 3072,
            num_hidden_layers: 28,
            num_attention_heads: 16,
            num_key_value_heads: 8,
            head_dim: 128,
            rotary_dim: 128,
            bias: Biases::default(),
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: true,
            max_position_embeddings: 40_960,
            bos_token_id: None,
            eos_token_ids: vec![151_645],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        // Qwen3-8B's published config.json (weight-bound decode benchmarks).
        "qwen3-8b" => ModelConfig {
            architecture: fixed(Architecture::Qwen3)?,
            vocab_size: 151_936,
            hidden_size: 4096,
            intermediate_size: 12_288,
            num_hidden_layers: 36,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            rotary_dim: 128,
            bias: Biases::default(),
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: false,
            max_position_embeddings: 40_960,
            bos_token_id: None,
            eos_token_ids: vec![151_645],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        // SmolLM2-135M's published config.json (Llama architecture).
        "smollm2-135m" => ModelConfig {
            architecture: fixed(Architecture::Llama)?,
            vocab_size: 49_152,
            hidden_size: 576,
            intermediate_size: 1536,
            num_hidden_layers: 30,
            num_attention_heads: 9,
            num_key_value_heads: 3,
            head_dim: 64,
            rotary_dim: 64,
            bias: Biases::default(),
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: true,
            max_position_embeddings: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        // Qwen3-30B-A3B's published config.json with 4 of its 48 layers: the layers' shapes
        // for benchmarks (3.1 B parameters, 0.85 B active, 0.6 B of them the embedding and head).
        "qwen3-30b-a3b-4l" => ModelConfig {
            architecture: fixed(Architecture::Qwen3Moe)?,
            vocab_size: 151_936,
            hidden_size: 2048,
            intermediate_size: 6144,
            num_hidden_layers: 4,
            num_attention_heads: 32,
            num_key_value_heads: 4,
            head_dim: 128,
            rotary_dim: 128,
            bias: Biases::default(),
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: false,
            max_position_embeddings: 40_960,
            bos_token_id: None,
            eos_token_ids: vec![151_645],
            moe: Some(Box::new(MoeConfig {
                num_experts: 128,
                num_experts_per_tok: 8,
                moe_intermediate_size: 768,
                norm_topk_prob: true,
                decoder_sparse_step: 1,
                mlp_only_layers: Vec::new(),
                router_aux_loss_coef: 0.0,
                routing: crate::Routing::Softmax,
                shared_experts: 0,
            })),
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        // DeepSeek-V3 as released with 4 layers: 3 dense, one of 256 experts.
        "deepseek-v3-4l" => {
            fixed(Architecture::DeepseekV3)?;
            let mut v: serde_json::Value =
                serde_json::from_str(DEEPSEEK_V3).expect("the embedded config is JSON");
            v["num_hidden_layers"] = 4.into();
            ModelConfig::from_json(&v, std::path::Path::new("preset deepseek-v3-4l"))?
        }
        // Qwen2.5-0.5B-Instruct's and Qwen2.5-1.5B-Instruct's published config.json.
        "qwen2.5-0.5b" | "qwen2.5-1.5b" => {
            let small = name == "qwen2.5-0.5b";
            ModelConfig {
                architecture: fixed(Architecture::Qwen2)?,
                vocab_size: 151_936,
                hidden_size: if small { 896 } else { 1536 },
                intermediate_size: if small { 4864 } else { 8960 },
                num_hidden_layers: if small { 24 } else { 28 },
                num_attention_heads: if small { 14 } else { 12 },
                num_key_value_heads: 2,
                head_dim: if small { 64 } else { 128 },
                rotary_dim: if small { 64 } else { 128 },
                bias: Biases { qkv: true, o: false, mlp: false },
                rms_norm_eps: 1e-6,
                rope_theta: 1_000_000.0,
                rope_scaling: RopeScaling::None,
                tie_word_embeddings: true,
                max_position_embeddings: 32_768,
                bos_token_id: None,
                eos_token_ids: vec![151_645],
                moe: None,
                gemma: None,
                mtp_input: false,
                mla: None,
            }
        }
        // Llama-3.2-1B-Instruct's published config.json (llama3 rope scaling).
        "llama3.2-1b" => ModelConfig {
            architecture: fixed(Architecture::Llama)?,
            vocab_size: 128_256,
            hidden_size: 2048,
            intermediate_size: 8192,
            num_hidden_layers: 16,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 64,
            rotary_dim: 64,
            bias: Biases::default(),
            rms_norm_eps: 1e-5,
            rope_theta: 500_000.0,
            rope_scaling: RopeScaling::Llama3 {
                factor: 32.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 8192.0,
            },
            tie_word_embeddings: true,
            max_position_embeddings: 131_072,
            bos_token_id: Some(128_000),
            eos_token_ids: vec![128_001, 128_008, 128_009],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        // gemma-3-1b-it's and gemma-2-2b-it's published config.json: heads of 256, every 6th
        // layer global (Gemma 3) or every 2nd (Gemma 2).
        "gemma3-1b" | "gemma2-2b" => {
            let three = name == "gemma3-1b";
            let layers = 26;
            let pattern = if three { 6 } else { 2 };
            ModelConfig {
                architecture: fixed(if three {
                    Architecture::Gemma3
                } else {
                    Architecture::Gemma2
                })?,
                vocab_size: if three { 262_144 } else { 256_000 },
                hidden_size: if three { 1152 } else { 2304 },
                intermediate_size: if three { 6912 } else { 9216 },
                num_hidden_layers: layers,
                num_attention_heads: if three { 4 } else { 8 },
                num_key_value_heads: if three { 1 } else { 4 },
                head_dim: 256,
                rotary_dim: 256,
                bias: Biases::default(),
                rms_norm_eps: 1e-6,
                rope_theta: if three { 1_000_000.0 } else { 10_000.0 },
                rope_scaling: RopeScaling::None,
                tie_word_embeddings: true,
                max_position_embeddings: if three { 32_768 } else { 8192 },
                bos_token_id: Some(2),
                eos_token_ids: vec![1, if three { 106 } else { 107 }],
                moe: None,
                gemma: Some(Box::new(GemmaConfig {
                    query_pre_attn_scalar: 256.0,
                    sliding_window: if three { 512 } else { 4096 },
                    sliding: (0..layers).map(|l| !(l + 1).is_multiple_of(pattern)).collect(),
                    local_rope_theta: 10_000.0,
                    local_rope_scaling: RopeScaling::None,
                    attn_softcap: (!three).then_some(50.0),
                    final_softcap: (!three).then_some(30.0),
                })),
                mtp_input: false,
                mla: None,
            }
        }
        // GLM-4-9B-0414's published config.json.
        "glm4-9b" => ModelConfig {
            architecture: fixed(Architecture::Glm4)?,
            vocab_size: 151_552,
            hidden_size: 4096,
            intermediate_size: 13_696,
            num_hidden_layers: 40,
            num_attention_heads: 32,
            num_key_value_heads: 2,
            head_dim: 128,
            rotary_dim: 64,
            bias: Biases { qkv: true, o: false, mlp: false },
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: false,
            max_position_embeddings: 32_768,
            bos_token_id: None,
            eos_token_ids: vec![151_329, 151_336, 151_338],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        },
        other => {
            return Err(Error::Invalid(format!(
                "unknown preset '{other}'; presets: {}",
                PRESETS.join(", ")
            )));
        }
    };
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_published_sizes() {
        assert_eq!(preset("qwen3-0.6b", None).unwrap().num_parameters(), 596_049_920);
        assert_eq!(preset("qwen3-8b", None).unwrap().num_parameters(), 8_190_735_360);
        // SmolLM2-135M: 134.5M parameters with the tied head.
        assert_eq!(preset("smollm2-135m", None).unwrap().num_parameters(), 134_515_008);
        // The counts the hub's safetensors hold (biases of q/k/v included for Qwen2.5).
        assert_eq!(preset("qwen2.5-0.5b", None).unwrap().num_parameters(), 494_032_768);
        assert_eq!(preset("qwen2.5-1.5b", None).unwrap().num_parameters(), 1_543_714_304);
        assert_eq!(preset("llama3.2-1b", None).unwrap().num_parameters(), 1_235_814_400);
        assert_eq!(preset("gemma3-1b", None).unwrap().num_parameters(), 999_885_952);
        assert_eq!(preset("gemma2-2b", None).unwrap().num_parameters(), 2_614_341_888);
        // GLM-4-9B-0414: 9.40 B (its four norms a layer and q/k/v biases counted).
        assert_eq!(preset("glm4-9b", None).unwrap().num_parameters(), 9_400_279_040);
        assert_eq!(
            preset("tiny", Some(Architecture::Llama)).unwrap().architecture,
            Architecture::Llama
        );
        let err = preset("smollm2-135m", Some(Architecture::Qwen3)).unwrap_err().to_string();
        assert!(err.contains("is a llama model"), "{err}");
        assert!(preset("gpt2", None).unwrap_err().to_string().contains("presets: tiny"));
        let moe = preset("qwen3-30b-a3b-4l", None).unwrap();
        assert_eq!((moe.num_parameters(), moe.active_parameters()), (3_114_814_464, 849_890_304));
        let ds = preset("deepseek-v3-4l", None).unwrap();
        // 15.1 B, 4.2 B active; a bf16 latent cache keeps 4 × (512 + 64) × 2 bytes a token.
        assert_eq!((ds.num_parameters(), ds.active_parameters()), (15_111_101_696, 4_189_134_080));
        assert_eq!(crate::KvCache::bytes_per_token(&ds, miles_tensor::DType::BF16), 4 * 576 * 2);
        let tiny = preset("tiny", Some(Architecture::Qwen3Moe)).unwrap();
        assert!(tiny.moe.is_some() && preset("tiny", None).unwrap().moe.is_none());
        let h64 = preset("tiny-h64", Some(Architecture::Qwen3Moe)).unwrap();
        assert_eq!((h64.head_dim, h64.moe.is_some(), h64.hidden_size), (64, true, 64));
        let err = preset("qwen3-30b-a3b-4l", Some(Architecture::Qwen3)).unwrap_err().to_string();
        assert!(err.contains("is a qwen3_moe model"), "{err}");
    }
}
