use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use miles_model::{Model, PackedBatch, Weights, presets};
use miles_tensor::cpu::AdamW;
use miles_tensor::rng::Rng;
use miles_train::Optimizer;
use serde_json::json;

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Tokens/s of one training step: forward, backward and AdamW over a packed batch.
    Train(BenchArgs),
    /// Tokens/s of the logprob forward (old, reference and scoring logprobs).
    Logprob(BenchArgs),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DeviceArg {
    Cpu,
    Cuda,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model shape (random weights): tiny, qwen3-0.6b, smollm2-135m.
    #[arg(long, default_value = "tiny", conflicts_with = "hf_checkpoint")]
    pub preset: String,
    /// Benchmark a checkpoint's weights instead of a preset.
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: Option<PathBuf>,
    #[arg(long, value_enum, default_value = "cpu")]
    pub device: DeviceArg,
    /// Sequences per step.
    #[arg(long, default_value_t = 4)]
    pub batch: usize,
    /// Tokens per sequence (all but the first are scored, as in the HF peer).
    #[arg(long, default_value_t = 256)]
    pub seq_len: usize,
    /// Timed steps (after the warm-up); the median is reported.
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn run(command: &BenchCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    let (args, what) = match command {
        BenchCommand::Train(a) => (a, "train_step"),
        BenchCommand::Logprob(a) => (a, "logprob_forward"),
    };
    if args.device == DeviceArg::Cuda {
        bail!(
            "--device cuda: the model runs on the CPU in this build; the CUDA backend so far covers matmul and RMSNorm (miles-tensor ops)"
        );
    }
    if args.batch == 0 || args.seq_len < 2 || args.steps == 0 {
        bail!("--batch must be >= 1, --seq-len >= 2 and --steps >= 1");
    }
    let (mut model, label) = match &args.hf_checkpoint {
        Some(dir) => (crate::score_cmd::load_model(dir)?, dir.display().to_string()),
        None => {
            let config = presets::preset(&args.preset, None).context("--preset")?;
            let weights = Weights::random(&config, args.seed);
            (Model::new(config, weights), args.preset.clone())
        }
    };
    let config = model.config.clone();
    let mut rng = Rng::new(args.seed + 1);
    let sequences: Vec<(Vec<u32>, usize)> = (0..args.batch)
        .map(|_| ((0..args.seq_len).map(|_| rng.below(config.vocab_size) as u32).collect(), 1))
        .collect();
    let batch = PackedBatch::new(&sequences)?;
    let scored = args.batch * (args.seq_len - 1);
    let advantages = rng.vec(scored, 1.0);
    let d_logp: Vec<f32> = advantages.iter().map(|a| -a / scored as f32).collect();
    let d_entropy = vec![0.0; scored];
    let hyper = AdamW { lr: 1e-6, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let mut optimizer = Optimizer::new(&config, hyper, 1.0);
    let mut grads = Weights::zeros(&config);

    let mut times = Vec::new();
    for i in 0..args.warmup + args.steps {
        let started = Instant::now();
        if what == "train_step" {
            let fwd = model.forward(&batch, 1.0)?;
            grads.tensors_mut(config.architecture).into_iter().for_each(|g| g.fill(0.0));
            model.backward(&fwd, &batch, &d_logp, &d_entropy, &mut grads)?;
            optimizer.step(&mut model.weights, &mut grads, hyper.lr)?;
        } else {
            model.logprobs(&batch, 1.0)?;
        }
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];
    let tokens = (args.batch * args.seq_len) as f64;
    let params = config.num_parameters() as f64;
    let flops_per_token = if what == "train_step" { 6.0 } else { 2.0 };
    let line = json!({
        "what": what,
        "model": label,
        "device": "cpu",
        "threads": rayon::current_num_threads(),
        "params": config.num_parameters(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "gflops_by_nd": flops_per_token * params * tokens / seconds / 1e9,
    });
    writeln!(out, "{line}")?;
    Ok(())
}
