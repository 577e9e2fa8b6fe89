//! The embedded default of `miles train`: a tiny policy learns the addition table.
//!
//! Prompts are `"7+8="`, the label is the sum (`"15"`), the reward is `exact_match` on the
//! response (generation ends at EOS). The policy is the `tiny` Qwen3-shaped decoder over the
//! project's byte-level tokenizer (one token per character), randomly initialized from
//! `--seed`. A short SFT warm-up on reference answers teaches it the format and a few sums
//! (eval accuracy about 0.3 when sampling at temperature 1); GRPO has to do the rest from the
//! reward alone.

use std::path::Path;

use miles_core::Prompt;
use miles_core::config::{DemoArch, RunConfig};
use miles_data::{Dataset, PromptRow};
use miles_model::{Architecture, Model, Tokenizer, Weights, presets, tokenizer};

/// The demo's settings, under every flag and `--config` file (flags still override them).
pub const DEFAULTS: &str = include_str!("demo.toml");

/// Operands run over 0..OPERANDS: the task is the whole table of single-digit sums.
const OPERANDS: u32 = 10;

/// The policy at `seed`: the `tiny` preset (2 layers, hidden 64) over the byte-level
/// tokenizer, Qwen3-shaped unless `--arch` says otherwise.
pub fn model(seed: u64, arch: Option<DemoArch>) -> anyhow::Result<Model> {
    let arch = match arch {
        None | Some(DemoArch::Qwen3) => Architecture::Qwen3,
        Some(DemoArch::Llama) => Architecture::Llama,
        Some(DemoArch::Qwen3Moe) => Architecture::Qwen3Moe,
    };
    let config = presets::preset("tiny", Some(arch))?;
    let weights = Weights::random(&config, seed);
    Ok(Model::new(config, weights))
}

/// Writes the byte-level tokenizer into `dir` and loads it.
pub fn tokenizer(dir: &Path) -> anyhow::Result<Tokenizer> {
    std::fs::create_dir_all(dir)?;
    tokenizer::write_byte_level_tokenizer(dir)?;
    Ok(Tokenizer::load(dir)?)
}

/// Every problem `a+b=` with single-digit operands, in order, labelled with the sum.
fn table(name: &str) -> Dataset {
    let rows = (0..OPERANDS)
        .flat_map(|a| (0..OPERANDS).map(move |b| (a, b)))
        .enumerate()
        .map(|(i, (a, b))| PromptRow {
            prompt: Prompt::Text(format!("{a}+{b}=")),
            label: Some((a + b).to_string()),
            metadata: serde_json::Value::Null,
            line: i + 1,
        })
        .collect();
    Dataset { source: format!("builtin:{name}"), rows }
}

/// The training prompts: the whole table, drawn in a shuffled order each epoch.
pub fn train_data() -> Dataset {
    table("addition")
}

/// Eval covers the whole table too, so `eval/reward` is the policy's accuracy on the task.
pub fn eval_data() -> Dataset {
    table("addition-eval")
}

/// Whether `cfg` asks for the demo: no model and no data given.
pub fn is_demo(cfg: &RunConfig) -> bool {
    cfg.hf_checkpoint.is_none() && cfg.prompt_data.is_none()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_is_complete_and_correct() {
        let d = train_data();
        assert_eq!(d.rows.len(), 100);
        assert_eq!(d.rows[99].prompt, Prompt::Text("9+9=".into()));
        for row in &d.rows {
            let Prompt::Text(p) = &row.prompt else { panic!("text prompt") };
            let (a, b) = p.trim_end_matches('=').split_once('+').unwrap();
            let sum: u64 = a.parse::<u64>().unwrap() + b.parse::<u64>().unwrap();
            assert_eq!(row.label.as_deref(), Some(sum.to_string().as_str()));
        }
        assert_eq!(eval_data().rows, d.rows);
    }

    #[test]
    fn demo_defaults_are_valid_run_settings() {
        let value: toml::Table = toml::from_str(DEFAULTS).unwrap();
        let json = serde_json::to_value(value).unwrap();
        RunConfig::from_json(json).unwrap().validate().unwrap();
    }
}
