use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::{Args, Subcommand, ValueEnum};
use miles_core::config::SpeculativeAlgorithm;
use miles_core::{Rollout, Sample, SamplingParams, Status};
use miles_model::draft::{Draft, DraftFormat, draft_config};
use miles_model::{DeviceModel, Fp8Layers, Model, PackedBatch, Weights, presets};
use miles_rollout::{Engine, EngineConfig};
use miles_tensor::cpu::AdamW;
use miles_tensor::rng::Rng;
use miles_tensor::{DType, Device};
use serde_json::{Value, json};

use crate::common::{DTypeArg, EngineArgs, SpecFlags, load_model, parse_device};

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Tokens/s of one training step: forward, backward and AdamW over a packed batch.
    Train(BenchArgs),
    /// Tokens/s of the logprob forward (old, reference and scoring logprobs).
    Logprob(BenchArgs),
    /// The rollout engine: prefill tokens/s, decode tokens/s and time to first token.
    Rollout(RolloutBenchArgs),
    /// The gradient sum between ranks (NCCL between GPUs, TCP between host processes): bus
    /// bandwidth per buffer size, one process per rank (`--nproc-per-node`, or torchrun).
    Allreduce(crate::allreduce_bench::AllReduceBenchArgs),
}

#[derive(Debug, Args)]
pub struct RolloutBenchArgs {
    /// Model shape (random weights): tiny, tiny-h64, qwen3-0.6b, qwen3-8b, smollm2-135m,
    /// qwen3-30b-a3b-4l.
    #[arg(long, default_value = "tiny", conflicts_with = "hf_checkpoint")]
    pub preset: String,
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// GPU matrix products: `invariant` (rollout logprobs equal the trainer's) or `cublas`
    /// (cuBLAS's per-call choice), to measure what true on-policy costs.
    #[arg(long, value_enum, default_value = "invariant")]
    pub gemm: GemmArg,
    /// Sequences decoded together.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Random prompt tokens per sequence.
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// Tokens generated per sequence (EOS ignored).
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    #[command(flatten)]
    pub fp8: Fp8Arg,
    /// INT4 QAT's weights (every linear fake-quantized in groups of this many inputs, 32 or
    /// 128): on a GPU in bf16 the engine's decode steps read them packed (W4A16).
    #[arg(long, value_name = "G")]
    pub int4_group_size: Option<usize>,
    /// Speculative decoding (EAGLE chains of this many draft tokens per step), with the draft
    /// of --sglang-speculative-draft-model-path or else a random one: a random draft keeps
    /// almost none of its tokens, so it measures what a speculative step costs against a
    /// plain one (the tokens per verification it must keep to pay for itself).
    #[arg(long, value_name = "N")]
    pub sglang_speculative_num_steps: Option<usize>,
    #[arg(long, value_name = "DIR", requires = "sglang_speculative_num_steps")]
    pub sglang_speculative_draft_model_path: Option<PathBuf>,
    /// Also serve the same prompts through `miles serve`'s HTTP API to this many concurrent
    /// clients (one request each, a thread each; SGLang's /generate with logprobs), and report
    /// the served tokens/s beside the in-process rollout's and the requests lost.
    #[arg(long, value_name = "N", conflicts_with = "sglang_speculative_num_steps")]
    pub serve_clients: Option<usize>,
    /// Waits for the device after each phase of a speculative step, so that `spec_phases_ms`
    /// are the phases' device times (the step is slower for it).
    #[arg(long, requires = "sglang_speculative_num_steps")]
    pub spec_phase_sync: bool,
    /// Runs whole speculative steps as one CUDA graph each (experimental, see
    /// `EngineConfig::spec_step_graphs`).
    #[arg(long, requires = "sglang_speculative_num_steps")]
    pub spec_step_graphs: bool,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// `--fp8-format e4m3`: every projection and expert in FP8 E4M3 with 128 × 128 blocks, as a
/// unified FP8 run computes them (`--fp8-recipe blockwise`).
#[derive(Debug, Args)]
pub struct Fp8Arg {
    #[arg(long, value_enum)]
    pub fp8_format: Option<Fp8Format>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Fp8Format {
    E4m3,
}

impl Fp8Arg {
    /// Puts `dm`'s matrices in FP8 when asked.
    fn apply(&self, dm: &mut DeviceModel) -> anyhow::Result<()> {
        if self.fp8_format.is_some() {
            let unified = Fp8Layers { bf16_at_start: 0, bf16_at_end: 0, rollout_only: false };
            dm.set_fp8(Some(unified)).context("--fp8-format")?;
        }
        Ok(())
    }

    fn label(&self) -> Option<&'static str> {
        self.fp8_format.map(|_| "e4m3")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum GemmArg {
    Invariant,
    Cublas,
}

/// The H200's measured dense bf16 GEMM ceiling (TFLOP/s), the denominator of MFU.
const H200_BF16_TFLOPS: f64 = 790.0;

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Model shape (random weights): tiny, tiny-h64, qwen3-0.6b, qwen3-8b, smollm2-135m,
    /// qwen3-30b-a3b-4l.
    #[arg(long, default_value = "tiny", conflicts_with = "hf_checkpoint")]
    pub preset: String,
    /// Benchmark a checkpoint's weights instead of a preset.
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: Option<PathBuf>,
    /// Where the model runs: cpu, cuda (device 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Compute dtype on a GPU (the CPU computes in f32).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
    /// GPU matrix products: `invariant` (pinned cuBLASLt algorithms, batch-invariant) or
    /// `cublas` (cuBLAS's per-call choice), to measure what invariance costs.
    #[arg(long, value_enum, default_value = "invariant")]
    pub gemm: GemmArg,
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
    #[command(flatten)]
    pub fp8: Fp8Arg,
    /// The optimizer state's dtypes in a train step, as `miles train`'s with
    /// `--use-precision-aware-optimizer`: the matrices' master weights (bf16: their own
    /// compute copies, rounded stochastically) and AdamW's first and second moments.
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub main_params_dtype: String,
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub exp_avg_dtype: String,
    #[arg(long, default_value = "fp32", value_parser = ["fp32", "bf16"])]
    pub exp_avg_sq_dtype: String,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

fn bench_model(preset: &str, dir: &Option<PathBuf>, seed: u64) -> anyhow::Result<(Model, String)> {
    Ok(match dir {
        Some(dir) => (load_model(dir)?, dir.display().to_string()),
        None => {
            let config = presets::preset(preset, None).context("--preset")?;
            let weights = Weights::random(&config, seed);
            (Model::new(config, weights), preset.to_string())
        }
    })
}

pub fn run(command: &BenchCommand, out: &mut dyn Write) -> anyhow::Result<()> {
    let (args, what) = match command {
        BenchCommand::Train(a) => (a, "train_step"),
        BenchCommand::Logprob(a) => (a, "logprob_forward"),
        BenchCommand::Rollout(a) => return rollout(a, out),
        BenchCommand::Allreduce(a) => return crate::allreduce_bench::run(a, out),
    };
    if args.batch == 0 || args.seq_len < 2 || args.steps == 0 {
        bail!("--batch must be >= 1, --seq-len >= 2 and --steps >= 1");
    }
    let (model, label) = bench_model(&args.preset, &args.hf_checkpoint, args.seed)?;
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
    let step = Step {
        train: what == "train_step",
        batch: &batch,
        d_logp: &d_logp,
        d_entropy: &d_entropy,
        hyper,
    };
    model_bench(args, what, &model, &label, &step, out)
}

/// One generate call over `batch` random prompts: every prompt is prefilled in the first step,
/// then all sequences decode together to `new_tokens`. On a GPU a short call first loads the
/// kernels and pins the GEMM algorithms.
fn rollout(args: &RolloutBenchArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.batch == 0 || args.prompt_len == 0 || args.new_tokens < 2 {
        bail!("--batch and --prompt-len must be >= 1, --new-tokens >= 2");
    }
    let (model, label) = bench_model(&args.preset, &args.hf_checkpoint, args.seed)?;
    let vocab = model.config.vocab_size;
    let tokens = args.batch * (args.prompt_len + args.new_tokens);
    let spec = SpecFlags {
        algorithm: args.sglang_speculative_num_steps.map(|_| SpeculativeAlgorithm::Eagle),
        num_steps: args.sglang_speculative_num_steps,
        ..SpecFlags::default()
    };
    let speculator: Option<std::sync::Arc<dyn miles_core::Speculator>> =
        crate::common::speculator(&spec)?.map(std::sync::Arc::from);
    let config = |per_block: usize| EngineConfig {
        kv_cache_bytes: (tokens.div_ceil(64) + 2 * args.batch) * per_block,
        max_running: args.batch,
        max_prefill_tokens: args.batch * args.prompt_len,
        max_prompt_len: None,
        cuda_graphs: !args.engine.disable_cuda_graph,
        chunked_prefill_size: args.engine.chunked_prefill_size,
        speculator: speculator.clone(),
        spec_phase_sync: args.spec_phase_sync,
        spec_step_graphs: args.spec_step_graphs,
    };
    let mut rng = Rng::new(args.seed + 1);
    let groups: Vec<Vec<Sample>> = (0..args.batch)
        .map(|i| {
            let tokens = (0..args.prompt_len).map(|_| rng.below(vocab) as u32).collect();
            vec![Sample { index: i, group_index: i, tokens, ..Sample::default() }]
        })
        .collect();
    let params = SamplingParams {
        max_new_tokens: args.new_tokens,
        ignore_eos: true,
        seed: args.seed,
        ..SamplingParams::default()
    };
    let device = args.engine.device;
    if device != Device::Cpu {
        set_route(args.gemm);
    }
    let before = device.memory_in_use()?;
    // An engine that only generates holds its rollout weights only, as a served model would
    // (quantized ones made from the masters first).
    let mut dm = match args.fp8.fp8_format.is_some() || args.int4_group_size.is_some() {
        true => {
            let mut dm = args.engine.place(&model).context("placing the model")?;
            args.fp8.apply(&mut dm)?;
            if let Some(group_size) = args.int4_group_size {
                let q = miles_model::Int4Layers { group_size, experts_only: false, w4a16: true };
                dm.set_int4(Some(q)).context("--int4-group-size")?;
            }
            dm.keep_rollout_weights_only()?;
            dm
        }
        false => args.engine.place_for_rollout(&model).context("placing the model")?,
    };
    let weights_resident = device.memory_in_use()?.saturating_sub(before);
    device.synchronize()?;
    let resident = device.peak_memory()?;
    let dtype = dm.dtype();
    let per_block = miles_model::KvCache::bytes_per_block(&model.config, dtype);
    let draft = match &speculator {
        Some(_) => Some(bench_draft(args, &model)?),
        None => None,
    };
    let mut engine = match &draft {
        Some(d) => {
            let per_block = per_block + miles_model::KvCache::bytes_per_block(&d.config, dtype);
            Engine::with_draft(&dm, d, None, config(per_block))
        }
        None => Engine::new(&dm, None, config(per_block)),
    }
    .context("the engine's KV cache")?;
    let steps = args.sglang_speculative_num_steps.unwrap_or(0);
    if device != Device::Cpu {
        // The timed generation once, so that every step shape it meets has its graphs
        // captured (a speculative run's sequences finish apart, and each smaller batch is a
        // graph of its own).
        let warm = params.clone();
        timed_generate(&mut engine, (&dm, draft.as_ref()), groups.clone(), &warm)
            .context("the warm-up generation")?;
        engine.reset_stats();
        miles_model::stage_clock::reset();
    }
    let served_groups = args.serve_clients.map(|_| groups.clone());
    let seconds = timed_generate(&mut engine, (&dm, draft.as_ref()), groups, &params)?;
    if let Some(stages) = miles_model::stage_clock::report() {
        eprintln!("stage times of the timed generation (MILES_STAGE_TIMES):\n{stages}");
    }
    let replay = engine.decode_replay_seconds(50)?;
    // A speculative step's verifying forward and one draft round, each its widest graph.
    let widest = |r: &[(usize, f64)]| r.iter().max_by_key(|r| r.0).map(|r| 1e3 * r.1);
    let [verify, rounds, whole] = engine.spec_replay_seconds(50)?;
    let s = engine.stats().clone();
    let dtype = if dtype == DType::BF16 { "bf16" } else { "f32" };
    // The widest captured step's device time: the decode step's wall time less this is host
    // time (scheduling, copies, the launch) during which the GPU waits.
    let replay_ms = widest(&replay);
    // Per speculative decode step (host time: queuing each phase, then the wait).
    let (p, per) = (s.spec_phases, 1e3 / s.spec_phases.steps.max(1) as f64);
    let per_captured = 1e3 / p.captured.max(1) as f64;
    let phases = json!({"propose": p.propose * per, "forward": p.forward * per,
                        "verify": p.verify * per, "wait": p.wait * per});
    let served = match (args.serve_clients, served_groups) {
        (Some(clients), Some(groups)) => {
            let (served_s, lost) = serve_bench(&mut engine, &mut dm, groups, &params, clients)?;
            let in_process = (args.batch * args.new_tokens) as f64 / seconds;
            let served = (args.batch * args.new_tokens) as f64 / served_s;
            json!({"clients": clients, "tokens_per_s": served, "vs_in_process": served / in_process,
                   "lost": lost})
        }
        _ => Value::Null,
    };
    let line = json!({
        "what": "rollout",
        "serve": served,
        "model": label,
        "device": device.to_string(),
        "dtype": dtype,
        "cuda_graphs": device != Device::Cpu && !args.engine.disable_cuda_graph,
        "gemm": format!("{:?}", args.gemm).to_lowercase(),
        "fp8": args.fp8.label(),
        "int4_group_size": args.int4_group_size,
        "w4a16": dm.int4_w4a16(),
        "rollout_weight_gib": dm.rollout_weight_bytes() as f64 / (1u64 << 30) as f64,
        "weights_resident_gib": weights_resident as f64 / (1u64 << 30) as f64,
        "kv_bytes_per_token": miles_model::KvCache::bytes_per_token(&model.config, dm.dtype()),
        "threads": rayon::current_num_threads(),
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "seconds": seconds,
        "tokens_per_s": (args.batch * args.new_tokens) as f64 / seconds,
        "prefill_tokens_per_s": s.prefill_tokens as f64 / s.prefill_seconds,
        "decode_tokens_per_s": s.decode_tokens as f64 / s.decode_seconds,
        "time_to_first_token_s": s.first_token_seconds,
        "decode_step_ms": 1e3 * s.decode_seconds / (s.steps - 1).max(1) as f64,
        "decode_graph_ms": replay_ms,
        "spec_steps": steps,
        "spec_phases_ms": phases,
        "spec_verify_graph_ms": widest(&verify),
        "spec_draft_graph_ms": widest(&rounds),
        "spec_captured_steps": p.captured,
        "spec_captures": p.captures,
        "spec_capture_failed": p.capture_failed,
        "spec_captured_ms": json!({"prepare": p.captured_prepare * per_captured,
            "load": p.captured_load * per_captured, "replay": p.captured_replay * per_captured,
            "after": p.captured_after * per_captured}),
        "spec_step_graph_ms": widest(&whole),
        "spec_accept_rate": s.spec.accepted as f64 / s.spec.drafted.max(1) as f64,
        "spec_tokens_per_verification":
            (s.spec.accepted + s.spec.verifies) as f64 / s.spec.verifies.max(1) as f64,
        "resident_after_load_gib": resident as f64 / (1u64 << 30) as f64,
        "peak_memory_gib": device.peak_memory()? as f64 / (1u64 << 30) as f64,
    });
    writeln!(out, "{line}")?;
    Ok(())
}

/// The same rollout served over HTTP ([`miles_server`] on a local port, the engine on this
/// thread) to `clients` concurrent clients ([`miles_rollout::remote::Remote`], a thread per
/// request): its seconds from the first request sent to the last answer, and the requests
/// that came back without their tokens.
fn serve_bench(
    engine: &mut Engine,
    model: &mut DeviceModel,
    groups: Vec<Vec<Sample>>,
    params: &SamplingParams,
    clients: usize,
) -> anyhow::Result<(f64, usize)> {
    use miles_rollout::Job;
    let listener = std::net::TcpListener::bind(("127.0.0.1", 0)).context("a local port")?;
    let url = format!("http://{}", listener.local_addr()?);
    let (jobs, queue) = std::sync::mpsc::channel();
    let router = miles_server::router(jobs.clone(), None, "bench".into(), params.seed);
    std::thread::spawn(move || miles_server::serve_blocking(listener, router));
    let expected = groups.iter().map(Vec::len).sum::<usize>();
    std::thread::scope(|scope| {
        let client = scope.spawn(move || {
            let run = || -> anyhow::Result<(Vec<Vec<Sample>>, f64)> {
                let timeout = std::time::Duration::from_secs(3600);
                let mut remote = miles_rollout::remote::Remote::connect(&[url], timeout)?
                    .with_in_flight(clients);
                let started = Instant::now();
                let out = remote.generate(groups, params)?;
                Ok((out, started.elapsed().as_secs_f64()))
            };
            let result = run();
            // (However the clients fared, the engine stops serving.)
            let _ = jobs.send(Job::Stop);
            result
        });
        engine.serve(model, &queue)?;
        let (out, seconds) =
            client.join().map_err(|_| anyhow::anyhow!("the clients panicked"))??;
        let kept = out
            .iter()
            .flatten()
            .filter(|s| matches!(s.status, Status::Completed | Status::Truncated))
            .filter(|s| s.response_length == params.max_new_tokens)
            .count();
        Ok((seconds, expected - kept))
    })
}

/// Seconds of one `generate` call.
fn timed_generate(
    engine: &mut Engine,
    (model, draft): (&DeviceModel, Option<&DeviceModel>),
    groups: Vec<Vec<Sample>>,
    params: &SamplingParams,
) -> anyhow::Result<f64> {
    let started = Instant::now();
    engine
        .generate_speculative(model, draft, groups, params, &mut |_| miles_core::Flow::Continue)?;
    Ok(started.elapsed().as_secs_f64())
}

/// The bench's draft for `model` on the engine's device: a checkpoint's, or a random one.
fn bench_draft(args: &RolloutBenchArgs, model: &Model) -> anyhow::Result<DeviceModel> {
    let pc = &model.config;
    let draft = match &args.sglang_speculative_draft_model_path {
        Some(dir) => Draft::load(dir, pc)
            .with_context(|| format!("--sglang-speculative-draft-model-path {}", dir.display()))?,
        None => Draft::random(pc, DraftFormat::DeepSeek, args.seed + 2)?,
    };
    let weights = draft.model_weights(pc, &model.weights)?;
    args.engine.place(&Model::new(draft_config(pc)?, weights))
}

fn set_route(gemm: GemmArg) {
    miles_tensor::set_gemm_route(match gemm {
        GemmArg::Invariant => miles_tensor::GemmRoute::Invariant,
        GemmArg::Cublas => miles_tensor::GemmRoute::Cublas,
    });
}

/// One timed step's inputs.
struct Step<'a> {
    train: bool,
    batch: &'a PackedBatch,
    d_logp: &'a [f32],
    d_entropy: &'a [f32],
    hyper: AdamW,
}

/// The bench on `--device`: the model resident there (f32 on the CPU, `--dtype` on a GPU), each
/// step synchronized before its clock stops.
fn model_bench(
    args: &BenchArgs,
    what: &str,
    model: &Model,
    label: &str,
    step: &Step,
    out: &mut dyn Write,
) -> anyhow::Result<()> {
    let device = args.device;
    device.ensure_available().with_context(|| format!("--device {device}"))?;
    let dtype = if device == Device::Cpu { DType::F32 } else { args.dtype.dtype() };
    if device != Device::Cpu {
        set_route(args.gemm);
    }
    // (A forward alone needs no masters: none beside the compute copies.)
    let bf16_masters = step.train && args.main_params_dtype == "bf16";
    let mut dm = match step.train || args.fp8.fp8_format.is_some() {
        true if bf16_masters => DeviceModel::with_bf16_masters(model, &device, dtype, args.seed)?,
        true => DeviceModel::new(model, &device, dtype)?,
        false => DeviceModel::for_rollout(model, &device, dtype)?,
    };
    args.fp8.apply(&mut dm)?;
    let moment = |d: &str| if d == "bf16" { DType::BF16 } else { DType::F32 };
    if step.train {
        dm.set_moment_dtypes(moment(&args.exp_avg_dtype), moment(&args.exp_avg_sq_dtype))?;
    }
    device.synchronize()?;
    let resident = device.peak_memory()?;
    let mut times = Vec::new();
    for i in 0..args.warmup + args.steps {
        let started = Instant::now();
        if step.train {
            dm.zero_grads()?;
            let fwd = dm.forward(step.batch, 1.0)?;
            dm.backward(&fwd, step.batch, step.d_logp, step.d_entropy)?;
            drop(fwd);
            dm.adamw_step(&step.hyper, 1.0)?;
        } else {
            dm.logprobs(step.batch, 1.0)?;
        }
        device.synchronize()?;
        if i >= args.warmup {
            times.push(started.elapsed().as_secs_f64());
        }
    }
    times.sort_by(f64::total_cmp);
    let seconds = times[times.len() / 2];
    let tokens = (args.batch * args.seq_len) as f64;
    let config = &model.config;
    let params = config.active_parameters() as f64;
    let flops_per_token = if step.train { 6.0 } else { 2.0 };
    let tflops = flops_per_token * params * tokens / seconds / 1e12;
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let line = json!({
        "what": what,
        "model": label,
        "device": device.to_string(),
        "dtype": dtype.to_string(),
        "gemm": format!("{:?}", args.gemm).to_lowercase(),
        "fp8": args.fp8.label(),
        "optimizer_state": step.train.then_some(
            [&args.main_params_dtype, &args.exp_avg_dtype, &args.exp_avg_sq_dtype]
        ),
        "threads": rayon::current_num_threads(),
        "params": config.num_parameters(),
        "active_params": config.active_parameters(),
        "batch": args.batch,
        "seq_len": args.seq_len,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "tflops_by_nd": tflops,
        "mfu": (device != Device::Cpu).then(|| tflops / H200_BF16_TFLOPS),
        "resident_after_load_gib": gib(resident),
        "peak_memory_gib": gib(device.peak_memory()?),
    });
    writeln!(out, "{line}")?;
    Ok(())
}
