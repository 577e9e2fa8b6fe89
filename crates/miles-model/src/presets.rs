//! Model shapes by name, for `miles init-model` and benchmarks.

use crate::tokenizer::BYTE_TOKENIZER_SPECIALS;
use crate::{Architecture, Error, ModelConfig, Result};

pub const PRESETS: [&str; 3] = ["tiny", "qwen3-0.6b", "smollm2-135m"];

/// The configuration of preset `name`. `tiny` takes either architecture (default Qwen3); the
/// published shapes have theirs, and asking for another is an error.
pub fn preset(name: &str, arch: Option<Architecture>) -> Result<ModelConfig> {
    let fixed = |own: Architecture| match arch {
        Some(a) if a != own => Err(Error::Invalid(format!(
            "preset {name} is a {} model; drop --arch or use --arch {}",
            own.model_type(),
            own.model_type()
        ))),
        _ => Ok(own),
    };
    let c = match name {
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
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: true,
            max_position_embeddings: 2048,
            bos_token_id: None,
            eos_token_ids: vec![258],
            moe: None,
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
            rms_norm_eps: 1e-6,
            rope_theta: 1_000_000.0,
            tie_word_embeddings: true,
            max_position_embeddings: 40_960,
            bos_token_id: None,
            eos_token_ids: vec![151_645],
            moe: None,
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
            rms_norm_eps: 1e-5,
            rope_theta: 100_000.0,
            tie_word_embeddings: true,
            max_position_embeddings: 8192,
            bos_token_id: Some(1),
            eos_token_ids: vec![2],
            moe: None,
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
        // SmolLM2-135M: 134.5M parameters with the tied head.
        assert_eq!(preset("smollm2-135m", None).unwrap().num_parameters(), 134_515_008);
        assert_eq!(
            preset("tiny", Some(Architecture::Llama)).unwrap().architecture,
            Architecture::Llama
        );
        let err = preset("smollm2-135m", Some(Architecture::Qwen3)).unwrap_err().to_string();
        assert!(err.contains("is a llama model"), "{err}");
        assert!(preset("gpt2", None).unwrap_err().to_string().contains("presets: tiny"));
    }
}
