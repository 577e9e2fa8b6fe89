//! `miles serve`: the embedded engine behind SGLang's HTTP API ([`miles_server`]): requests
//! from any number of clients share its continuous batching, and their tokens and logprobs
//! are those a `miles train` rollout gets.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use miles_model::Tokenizer;
use miles_rollout::{Engine, EngineConfig, kv_cache_budget};

use crate::common::{EngineArgs, load_model};

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// HF checkpoint directory: config.json, safetensors, tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: PathBuf,
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// SGLang's port; 0 takes a free one (printed).
    #[arg(long, default_value_t = 30000)]
    pub port: u16,
    /// KV cache budget in MiB; requests wait when it is full.
    #[arg(long, default_value_t = 1024)]
    pub rollout_kv_cache_mb: usize,
    /// KV cache budget as a share of the GPU's free memory after the weights are loaded
    /// (SGLang's --mem-fraction-static role); replaces --rollout-kv-cache-mb.
    #[arg(long, value_name = "F")]
    pub rollout_kv_cache_fraction: Option<f64>,
    /// Most sequences decoding at once.
    #[arg(long, default_value_t = 256)]
    pub rollout_max_running: usize,
    /// Prompts longer than this are refused (400).
    #[arg(long)]
    pub rollout_max_prompt_len: Option<usize>,
    /// Seed of every request's draws (samples are numbered in the order they arrive).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn run(args: &ServeArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let dir = &args.hf_checkpoint;
    let model = load_model(dir)?;
    let tok = Tokenizer::load(dir)
        .with_context(|| format!("--hf-checkpoint {}: serve needs a tokenizer", dir.display()))?;
    let device = args.engine.device;
    let mut model = args.engine.place(&model)?;
    let config = EngineConfig {
        kv_cache_bytes: kv_cache_budget(
            args.rollout_kv_cache_mb,
            args.rollout_kv_cache_fraction,
            &device,
        )?,
        max_running: args.rollout_max_running.max(1),
        max_prompt_len: args.rollout_max_prompt_len,
        cuda_graphs: !args.engine.disable_cuda_graph,
        chunked_prefill_size: args.engine.chunked_prefill_size,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(&model, Some(tok.clone()), config)?;
    let listener = std::net::TcpListener::bind((args.host.as_str(), args.port))
        .with_context(|| format!("--host {} --port {}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    writeln!(out, "miles serve: {} on http://{addr} (POST /generate)", dir.display())?;
    out.flush()?;
    let (requests, queue) = std::sync::mpsc::channel();
    let router = miles_server::router(requests, Some(tok), dir.display().to_string(), args.seed);
    // The HTTP side on its own runtime; the engine here, until the HTTP side stops.
    let http = std::thread::spawn(move || miles_server::serve_blocking(listener, router));
    engine.serve(&mut model, &queue)?;
    match http.join() {
        Ok(result) => result.context("the HTTP server"),
        Err(_) => anyhow::bail!("the HTTP server panicked"),
    }
}
