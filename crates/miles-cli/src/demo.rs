//! The embedded default of `miles train`: a tiny policy learns multi-digit addition.
//!
//! Prompts are `"47+38="`, the label is the sum, the reward is `exact_match` on the response
//! (generation ends at EOS). The policy is a small Qwen3-shaped decoder over the project's
//! byte-level tokenizer (one token per character), randomly initialized from `--seed`. A short
//! SFT warm-up on reference answers teaches it the format and a little arithmetic; GRPO then
//! has to do the rest from the reward alone.

use std::path::Path;

use miles_core::{Prompt, config::RunConfig};
use miles_data::{Dataset, PromptRow};
use miles_model::{Architecture, Model, ModelConfig, Tokenizer, Weights, presets, tokenizer};

/// The demo's settings, under every flag and `--config` file (flags still override them).
pub const DEFAULTS: &str = include_str!("demo.toml");

/// Problems in the built-in training set and in the held-out eval set.
const TRAIN_ROWS: usize = 2000;
const EVAL_ROWS: usize = 64;
/// Operands are drawn from 0..OPERAND_LIMIT.
const OPERAND_LIMIT: u64 = 100;

/// The demo's model shape: the tiny preset, a little wider and deeper.
pub fn model_config() -> ModelConfig {
    let tiny = presets::preset("tiny", Some(Architecture::Qwen3)).expect("the tiny preset exists");
    ModelConfig {
        hidden_size: 128,
        intermediate_size: 256,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        head_dim: 32,
        max_position_embeddings: 64,
        ..tiny
    }
}

/// The policy at `seed`.
pub fn model(seed: u64) -> Model {
    let config = model_config();
    let weights = Weights::random(&config, seed);
    Model::new(config, weights)
}

/// Writes the byte-level tokenizer into `dir` and loads it.
pub fn tokenizer(dir: &Path) -> anyhow::Result<Tokenizer> {
    std::fs::create_dir_all(dir)?;
    tokenizer::write_byte_level_tokenizer(dir)?;
    Ok(Tokenizer::load(dir)?)
}

/// `rows` addition problems drawn from `seed` (splitmix64, the same everywhere).
fn problems(name: &str, rows: usize, seed: u64) -> Dataset {
    let mut state = seed;
    let mut next = || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) % OPERAND_LIMIT
    };
    let rows = (0..rows)
        .map(|i| {
            let (a, b) = (next(), next());
            PromptRow {
                prompt: Prompt::Text(format!("{a}+{b}=")),
                label: Some((a + b).to_string()),
                metadata: serde_json::Value::Null,
                line: i + 1,
            }
        })
        .collect();
    Dataset { source: format!("builtin:{name}"), rows }
}

/// The training problems.
pub fn train_data() -> Dataset {
    problems("addition-train", TRAIN_ROWS, 1)
}

/// The held-out eval problems (another seed; a few may coincide with training ones).
pub fn eval_data() -> Dataset {
    problems("addition-eval", EVAL_ROWS, 2)
}

/// Whether `cfg` asks for the demo: no model and no data given.
pub fn is_demo(cfg: &RunConfig) -> bool {
    cfg.hf_checkpoint.is_none() && cfg.prompt_data.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn problems_are_well_formed_and_reproducible() {
        let d = train_data();
        assert_eq!(d.rows.len(), TRAIN_ROWS);
        assert_eq!(d, train_data());
        for row in &d.rows {
            let Prompt::Text(p) = &row.prompt else { panic!("text prompt") };
            let (a, b) = p.trim_end_matches('=').split_once('+').unwrap();
            let sum: u64 = a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap();
            assert_eq!(row.label.as_deref(), Some(sum.to_string().as_str()));
        }
        assert_ne!(eval_data().rows[..8], d.rows[..8]);
    }

    #[test]
    fn demo_defaults_are_valid_run_settings() {
        let value: toml::Table = toml::from_str(DEFAULTS).unwrap();
        let json = serde_json::to_value(value).unwrap();
        RunConfig::from_json(json).unwrap().validate().unwrap();
    }
}
