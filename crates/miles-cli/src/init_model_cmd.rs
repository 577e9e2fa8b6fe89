use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, ValueEnum};
use miles_model::draft::{Draft, DraftFormat};
use miles_model::{Architecture, Weights, presets, tokenizer};

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ArchArg {
    Qwen3,
    Llama,
    /// Qwen3-MoE (Qwen3MoeForCausalLM): routed SwiGLU experts.
    Qwen3Moe,
    /// Qwen2/Qwen2.5 (Qwen2ForCausalLM): biases on q, k and v.
    Qwen2,
    /// Gemma 2 (Gemma2ForCausalLM): Gemma 3 without q/k norms, soft-capped scores and logits.
    Gemma2,
    /// Gemma 3 text (Gemma3ForCausalLM): sliding-window layers, GeGLU, (1 + w) norms.
    Gemma3,
    /// GLM-4 (Glm4ForCausalLM): q/k/v biases, norms after attention and the MLP, a rotary over
    /// half of each head.
    Glm4,
    /// DeepSeek-V3 (DeepseekV3ForCausalLM): latent attention, routed and shared experts, and
    /// its MTP layer.
    DeepseekV3,
}

impl From<ArchArg> for Architecture {
    fn from(a: ArchArg) -> Self {
        match a {
            ArchArg::Qwen3 => Architecture::Qwen3,
            ArchArg::Llama => Architecture::Llama,
            ArchArg::Qwen3Moe => Architecture::Qwen3Moe,
            ArchArg::Qwen2 => Architecture::Qwen2,
            ArchArg::Gemma2 => Architecture::Gemma2,
            ArchArg::Gemma3 => Architecture::Gemma3,
            ArchArg::Glm4 => Architecture::Glm4,
            ArchArg::DeepseekV3 => Architecture::DeepseekV3,
        }
    }
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum DtypeArg {
    F32,
    Bf16,
}

#[derive(Debug, Args)]
pub struct InitModelArgs {
    /// Architecture; the published presets have their own.
    #[arg(long, value_enum)]
    pub arch: Option<ArchArg>,
    /// Shape: tiny, tiny-h64 (tiny with heads of 64), qwen3-0.6b, qwen3-8b, smollm2-135m,
    /// qwen3-30b-a3b-4l (Qwen3-30B-A3B's layers, 4 of its 48), deepseek-v3-4l (DeepSeek-V3's
    /// first 4 layers, one of them sparse), qwen2.5-0.5b, qwen2.5-1.5b,
    /// llama3.2-1b, gemma3-1b, gemma2-2b or glm4-9b.
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Checkpoint directory to write (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Storage dtype of model.safetensors.
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: DtypeArg,
}

/// Shards above this size, as transformers does.
const MAX_SHARD_BYTES: usize = 5 << 30;

pub fn run(args: &InitModelArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let config = presets::preset(&args.preset, args.arch.map(Into::into)).context("--preset")?;
    let (dtype, name) = match args.dtype {
        DtypeArg::F32 => (safetensors::Dtype::F32, "float32"),
        DtypeArg::Bf16 => (safetensors::Dtype::BF16, "bfloat16"),
    };
    let dir = &args.out;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let config_path = dir.join("config.json");
    let text = serde_json::to_string_pretty(&config.to_hf_json(name))?;
    std::fs::write(&config_path, text)
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    let weights = Weights::random(&config, args.seed);
    // DeepSeek-V3's MTP layer sits in the checkpoint after the model's layers.
    let mtp = match config.mla.as_ref().is_some_and(|m| m.mtp_layers > 0) {
        true => Some(Draft::random(&config, DraftFormat::DeepSeek, args.seed ^ 0x6d7470)?),
        false => None,
    };
    let extra = match &mtp {
        Some(d) => d.checkpoint_tensors(&config, &weights)?,
        None => Vec::new(),
    };
    weights.save_with(dir, &config, dtype, MAX_SHARD_BYTES, extra)?;
    tokenizer::write_byte_level_tokenizer(dir)?;
    writeln!(
        out,
        "wrote {} ({} {}, {} parameters{}, {name}, seed {}) with the byte-level tokenizer",
        dir.display(),
        args.preset,
        config.architecture.model_type(),
        config.num_parameters(),
        if mtp.is_some() { " and an MTP layer" } else { "" },
        args.seed
    )?;
    Ok(())
}
