use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use miles_core::registry;
use miles_gguf::OutputDtype;
use miles_model::Fp8Layers;
use miles_model::draft::Draft;
use miles_train::checkpoint::{QuantExport, export_hf};

use crate::common::load_model;

#[derive(Debug, Subcommand)]
pub enum ConvertCommand {
    /// A llama.cpp GGUF model (llama, qwen3; byte-level BPE tokenizer) to an HF checkpoint:
    /// config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Gguf(GgufArgs),
    /// An HF checkpoint to DeepSeek-V3's FP8 format (what miles' convert_hf_to_fp8.py writes):
    /// every attention and MLP projection and expert in E4M3 with one f32 scale per 128 × 128
    /// block (`<name>_scale_inv`), the rest in F32, and a `quantization_config` saying so.
    /// `miles train` from it without `--fp8-format` is rollout-only FP8, as in miles.
    Fp8(Fp8Args),
}

#[derive(Debug, Args)]
pub struct Fp8Args {
    /// The HF checkpoint directory (config.json, safetensors, tokenizer.json).
    #[arg(value_name = "SRC")]
    pub src: PathBuf,
    /// Checkpoint directory to write (replaced if it exists).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum ConvertDtype {
    F32,
    Bf16,
}

#[derive(Debug, Args)]
pub struct GgufArgs {
    /// The .gguf file (GGUF v2 or v3).
    #[arg(value_name = "SRC")]
    pub src: PathBuf,
    /// Checkpoint directory to write (created if missing).
    #[arg(long, value_name = "DIR")]
    pub out: PathBuf,
    /// Storage dtype of model.safetensors (the weights are dequantized to f32 first).
    #[arg(long, value_enum, default_value = "f32")]
    pub dtype: ConvertDtype,
}

pub fn run(command: &ConvertCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    match command {
        ConvertCommand::Gguf(args) => gguf(args, out),
        ConvertCommand::Fp8(args) => fp8(args, out),
    }
}

fn fp8(args: &Fp8Args, out: &mut dyn Write) -> anyhow::Result<()> {
    let src = &args.src;
    let model = load_model(src).with_context(|| format!("convert fp8 {}", src.display()))?;
    crate::linked::plugins();
    let quantizer = registry::create_quantizer("fp8", &serde_json::json!({ "fmt": "e4m3" }))
        .context("convert fp8 (build with the fp8 plugin: cargo xtask build --features fp8)")?;
    let names = miles_model::fp8_weight_names(&model.config, Fp8Layers::default());
    let tokenizer = src.join("tokenizer.json").is_file().then_some(src.as_path());
    let fp8 = QuantExport { quantizer: &*quantizer, names };
    let mtp = Draft::of_checkpoint(src, &model.config)
        .with_context(|| format!("convert fp8 {}: its MTP layer", src.display()))?;
    export_hf(&args.out, &model.config, &model.weights, tokenizer, Some(&fp8), mtp.as_ref())
        .with_context(|| format!("convert fp8: writing {}", args.out.display()))?;
    writeln!(
        out,
        "converted {} to FP8 at {}: {} matrices in E4M3 (128 × 128 blocks, f32 scales), the \
         embedding, norms{} kept in F32",
        src.display(),
        args.out.display(),
        fp8.names.len(),
        if model.config.tie_word_embeddings { "" } else { " and LM head" },
    )?;
    Ok(())
}

fn gguf(args: &GgufArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let dtype = match args.dtype {
        ConvertDtype::F32 => OutputDtype::F32,
        ConvertDtype::Bf16 => OutputDtype::Bf16,
    };
    let s = miles_gguf::convert(&args.src, &args.out, dtype)
        .with_context(|| format!("convert gguf {}", args.src.display()))?;
    let c = &s.config;
    let types: Vec<String> = s.tensor_types.iter().map(|(t, n)| format!("{t} {n}")).collect();
    writeln!(
        out,
        "converted {} ({}GGUF v{}, tensors: {}) to {}",
        args.src.display(),
        s.name.as_deref().map(|n| format!("{n}, ")).unwrap_or_default(),
        s.gguf_version,
        types.join(", "),
        s.out_dir.display()
    )?;
    writeln!(
        out,
        "{}: {} layers, hidden {}, {} heads ({} kv, dim {}), vocab {}, {} parameters, {} head, {} in {:.2} s",
        c.architecture.model_type(),
        c.num_hidden_layers,
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        c.vocab_size,
        c.num_parameters(),
        if c.tie_word_embeddings { "tied" } else { "separate" },
        dtype.torch_name(),
        s.seconds
    )?;
    Ok(())
}
