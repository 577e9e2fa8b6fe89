use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::{Args, Subcommand, ValueEnum};
use miles_gguf::OutputDtype;

#[derive(Debug, Subcommand)]
pub enum ConvertCommand {
    /// A llama.cpp GGUF model (llama, qwen3; byte-level BPE tokenizer) to an HF checkpoint:
    /// config.json, model.safetensors, tokenizer.json, tokenizer_config.json.
    Gguf(GgufArgs),
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
    }
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
