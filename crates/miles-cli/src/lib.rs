//! The `miles` driver, as a library so the integration tests can run commands in-process.

use std::ffi::OsString;
use std::io::Write;

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod allreduce_bench;
mod bench_cmd;
mod common;
mod convert_cmd;
pub mod demo;
mod generate_cmd;
mod generate_output;
mod init_model_cmd;
mod jsonl;
pub mod linked;
mod plot_cmd;
mod plugins_cmd;
mod reward_cmd;
pub mod run_flags;
mod score_cmd;
mod serve_cmd;
pub mod slime_compat;
pub mod train_cmd;

pub use bench_cmd::{BenchArgs, BenchCommand, RolloutBenchArgs};
pub use convert_cmd::{ConvertCommand, Fp8Args, GgufArgs};
pub use generate_cmd::GenerateArgs;
pub use init_model_cmd::InitModelArgs;
pub use plot_cmd::PlotArgs;
pub use plugins_cmd::PluginsArgs;
pub use reward_cmd::RewardArgs;
pub use run_flags::TrainArgs;
pub use score_cmd::ScoreArgs;
pub use serve_cmd::ServeArgs;

/// miles-rs: LLM reinforcement-learning post-training in one binary.
#[derive(Debug, Parser)]
#[command(name = "miles", about, disable_version_flag = false)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// RL post-training (GRPO and its family); with no model and no data, the built-in demo.
    Train(TrainArgs),
    /// List every plugin this binary can use: kind, name, version, static or dynamic.
    Plugins(PluginsArgs),
    /// Score a JSONL file of samples offline with a reward, to test it before a run.
    Reward(RewardArgs),
    /// Write a random-initialized HF checkpoint (config, safetensors, tokenizer) of a preset shape.
    InitModel(InitModelArgs),
    /// Per-token logprobs and entropy of prompt/response pairs under a checkpoint, as JSONL.
    Score(ScoreArgs),
    /// Generate responses to JSONL prompts with the embedded rollout engine; one Sample per line.
    Generate(Box<GenerateArgs>),
    /// Serve a checkpoint over HTTP with SGLang's API (POST /generate), into the embedded
    /// engine's continuous batching.
    Serve(ServeArgs),
    /// Benchmarks of whole paths, one JSON line each.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Convert other model formats into HF checkpoints.
    #[command(subcommand)]
    Convert(ConvertCommand),
    /// Draw a run's metrics (reward, KL, clip fraction, response length, step time) to PNG files.
    Plot(PlotArgs),
}

/// `miles 0.1.0 (features: tis)`: the version and the plugin features compiled in.
pub fn version_line() -> String {
    let features =
        if linked::FEATURES.is_empty() { "none".to_string() } else { linked::FEATURES.join(", ") };
    format!("{} (features: {features})", env!("CARGO_PKG_VERSION"))
}

impl Cli {
    fn command_with_version() -> clap::Command {
        // clap wants a 'static version string; it is built once per process.
        let version: &'static str = Box::leak(version_line().into_boxed_str());
        Cli::command().version(version)
    }

    /// Parses `args`; `--help`, `--version` and bad flags come back as a clap error.
    pub fn try_parse_args<I, T>(args: I) -> Result<Cli, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<OsString> + Clone,
    {
        let matches = Cli::command_with_version()
            .try_get_matches_from(args)
            .map_err(run_flags::explain_unknown_argument)?;
        Cli::from_arg_matches(&matches)
    }

    /// Parses the process arguments, printing help or the error and exiting as clap does.
    pub fn parse_or_exit() -> Cli {
        Cli::try_parse_args(std::env::args_os()).unwrap_or_else(|e| e.exit())
    }
}

/// Runs a parsed command, writing its report to `out`.
pub fn execute(cli: Cli, out: &mut dyn Write) -> anyhow::Result<()> {
    let hint = memory_hint(&cli.command);
    let result = match cli.command {
        Command::Train(args) => train_cmd::run(&args, out),
        Command::Plugins(args) => plugins_cmd::run(&args, out),
        Command::Reward(args) => reward_cmd::run(&args, out),
        Command::InitModel(args) => init_model_cmd::run(&args, out),
        Command::Generate(args) => generate_cmd::run(&args, out),
        Command::Score(args) => score_cmd::run(&args, out),
        Command::Serve(args) => serve_cmd::run(&args, out),
        Command::Bench(command) => bench_cmd::run(&command, out),
        Command::Convert(command) => convert_cmd::run(&command, out),
        Command::Plot(args) => plot_cmd::run(&args, out),
    };
    result.map_err(|e| with_memory_hint(e, hint))
}

/// `e`, told what to lower when it is a device allocation that found no memory.
fn with_memory_hint(e: anyhow::Error, hint: Option<&str>) -> anyhow::Error {
    match hint {
        Some(hint) if is_out_of_memory(&e) => e.context(format!("out of GPU memory: {hint}")),
        _ => e,
    }
}

/// Whether `e` is a device allocation that found no memory (CUDA's OUT_OF_MEMORY).
fn is_out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|cause| {
        let text = cause.to_string();
        text.contains("OUT_OF_MEMORY") || text.contains("out of memory")
    })
}

/// What to lower when `command` runs out of GPU memory.
fn memory_hint(command: &Command) -> Option<&'static str> {
    Some(match command {
        Command::Train(_) => {
            "lower --micro-batch-size (the sequences of one forward), --rollout-max-response-len \
             or --rollout-kv-cache-mb (the rollout engine's cache, allocated first beside the \
             model)"
        }
        Command::Bench(BenchCommand::Train(_) | BenchCommand::Logprob(_)) => {
            "lower --batch or --seq-len"
        }
        Command::Bench(BenchCommand::Rollout(_)) => {
            "lower --rollout-kv-cache-mb, --batch or --prompt-len"
        }
        Command::Generate(_) | Command::Serve(_) => {
            "lower --rollout-kv-cache-mb or --rollout-max-running"
        }
        Command::Score(_) => "lower --max-tokens-per-batch",
        _ => return None,
    })
}

/// Parses and runs `args` (the first item is the program name), as `main` does.
pub fn run<I, T>(args: I, out: &mut dyn Write) -> anyhow::Result<()>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    execute(Cli::try_parse_args(args)?, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn out_of_memory_errors_name_what_to_lower() {
        let oom = || {
            anyhow::anyhow!("CUDA alloc: DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")")
                .context("training step")
        };
        let cli = Cli::try_parse_args(["miles", "bench", "train"]).unwrap();
        let e = with_memory_hint(oom(), memory_hint(&cli.command));
        assert!(format!("{e:#}").starts_with("out of GPU memory: lower --batch or --seq-len"));
        let cli = Cli::try_parse_args(["miles", "train"]).unwrap();
        let e = format!("{:#}", with_memory_hint(oom(), memory_hint(&cli.command)));
        assert!(e.contains("lower --micro-batch-size") && e.contains("OUT_OF_MEMORY"), "{e}");
        // Other errors pass unchanged.
        let e = with_memory_hint(anyhow::anyhow!("bad flag"), memory_hint(&cli.command));
        assert_eq!(format!("{e:#}"), "bad flag");
    }
}
