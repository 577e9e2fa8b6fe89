//! `miles train`: the RL loop, from flags and `--config run.toml`. With no model and no data
//! it runs the embedded demo (see `demo.rs`).

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{Context, bail};
use miles_core::config::{AdvantageEstimator, DeviceSpec, DistBackend, RunConfig};
use miles_core::{Correction, Quantizer, Reward, RoutingReplay, registry};
use miles_data::{Dataset, Keys};
use miles_model::Tokenizer;
use miles_plugin_abi::host::DynamicReward;
use miles_rewards::{PythonReward, PythonRewardConfig, python_spec};
use miles_tensor::Device;
use miles_train::advantage::AdvantageConfig;
use miles_train::rl::{self, Record, Setup};
use serde_json::Value;

use crate::common::{SpecFlags, chat_kwargs, launch, load_model};
use crate::run_flags::{TrainArgs, build_run_config};
use crate::{demo, linked};

/// The keys `args` sets, from its flags and its `--config` file (an unreadable file sets none
/// here; [`build_run_config`] reports it).
fn keys_set(args: &TrainArgs) -> Vec<String> {
    let mut keys: Vec<String> = args.flags.keys().cloned().collect();
    let table = args.config.as_ref().and_then(|p| std::fs::read_to_string(p).ok());
    if let Some(table) = table.and_then(|t| t.parse::<toml::Table>().ok()) {
        keys.extend(table.keys().map(|k| k.replace('_', "-")));
    }
    keys
}

/// The run configuration of `args`: the demo's defaults underneath when it names no model and
/// no data.
pub fn run_config(args: &TrainArgs) -> anyhow::Result<RunConfig> {
    let keys = keys_set(args);
    let has = |k: &str| keys.iter().any(|x| x == k);
    let mut cfg = demo_or_given(args, &has)?;
    if cfg.rollout_backend != miles_core::config::RolloutBackend::Embedded && !has("use-tis") {
        // External servers' logprobs may differ from the trainer's.
        eprintln!("--rollout-backend sglang: --use-tis is on (--use-tis=false turns it off)");
        cfg.use_tis = true;
    }
    Ok(cfg)
}

/// The configuration of `args` over the demo's defaults when it names no model and no data.
fn demo_or_given(args: &TrainArgs, has: &dyn Fn(&str) -> bool) -> anyhow::Result<RunConfig> {
    if has("hf-checkpoint") || has("prompt-data") {
        return build_run_config(&serde_json::Map::new(), args);
    }
    let table: toml::Table = toml::from_str(demo::DEFAULTS).context("the demo's defaults")?;
    let Value::Object(mut base) = serde_json::to_value(table)? else {
        bail!("the demo's defaults are not a table")
    };
    if has("num-epoch") {
        // The user's length wins over the demo's.
        base.remove("num-rollout");
    }
    build_run_config(&base, args)
}

/// The reward of `--rm-type`, `--rm-url` (remote_rm) or `--custom-rm-path`; none when none
/// is named (the loop says whether it needs one).
fn make_reward(cfg: &RunConfig) -> anyhow::Result<Option<Box<dyn Reward>>> {
    linked::plugins();
    let mut config: Value = match &cfg.custom_rm_config {
        Some(text) => serde_json::from_str(text)
            .with_context(|| format!("--custom-rm-config is not valid JSON: {text}"))?,
        None => Value::Null,
    };
    if let Some(spec) = &cfg.custom_rm_path {
        if let Some((file, function)) = python_spec(spec) {
            let reward =
                python_reward(&file, &function, cfg.rm_python.clone(), config, cfg.group_rm)?;
            let info = reward.info();
            eprintln!(
                "reward: {} in a Python {} worker (pid {}, called as {}{})",
                reward.label(),
                info.python_version,
                reward.worker_pid().unwrap_or_default(),
                info.call,
                if info.is_async { ", async" } else { "" }
            );
            return Ok(Some(Box::new(reward)));
        }
        return Ok(Some(Box::new(DynamicReward::load(spec, &config)?)));
    }
    let name = match (&cfg.rm_type, &cfg.rm_url) {
        (Some(name), _) => name.as_str(),
        (None, Some(_)) => "remote_rm",
        (None, None) => return Ok(None),
    };
    if name == "remote_rm" {
        let url = cfg.rm_url.as_deref().context("--rm-url: remote_rm needs the server's URL")?;
        if config.is_null() {
            config = serde_json::json!({});
        }
        let Some(map) = config.as_object_mut() else {
            bail!("--custom-rm-config: remote_rm takes a JSON object of settings");
        };
        map.insert("url".into(), url.into());
        map.insert("group".into(), cfg.group_rm.into());
    }
    Ok(Some(registry::create_reward(name, &config).context("--rm-type")?))
}

/// The Python reward of `--custom-rm-path FILE.py:FUNCTION`, its worker started and ready;
/// `--group-rm` makes the function score whole groups.
pub(crate) fn python_reward(
    file: &std::path::Path,
    function: &str,
    python: Option<PathBuf>,
    config: Value,
    group_rm: bool,
) -> anyhow::Result<PythonReward> {
    let mut config = PythonRewardConfig::from_json(&config)?;
    config.group |= group_rm;
    Ok(PythonReward::start(file, function, python, config)?)
}

fn make_advantage(cfg: &RunConfig) -> anyhow::Result<Box<dyn miles_core::Advantage>> {
    linked::plugins();
    if cfg.advantage_estimator == AdvantageEstimator::Ppo {
        bail!(
            "--advantage-estimator: ppo needs a critic, which miles-rs does not train yet; use \
             grpo, gspo, reinforce_plus_plus, reinforce_plus_plus_baseline or rloo"
        );
    }
    let name = serde_json::to_value(cfg.advantage_estimator)?;
    let name = name.as_str().unwrap_or_default();
    let config = AdvantageConfig::from_run_config(cfg);
    config.validate()?;
    registry::create_advantage(name, &config.to_json()).context("--advantage-estimator")
}

fn make_correction(cfg: &RunConfig) -> anyhow::Result<Option<Box<dyn Correction>>> {
    if !cfg.use_tis {
        return Ok(None);
    }
    linked::plugins();
    let c = registry::create_correction("tis", &cfg.tis_config()).context("--use-tis")?;
    Ok(Some(c))
}

/// With `--fp8-format`, the `fp8` plugin (which this build must link), having checked the format;
/// Transformer Engine's `NVTE_FP8_BLOCK_SCALING_FP32_SCALES` is accepted when it asks for f32
/// scales, the only kind here (power-of-two scales are not implemented).
/// miles' switches of INT4 QAT, read as `--int4-qat` and `--int4-group-size` (a flag given
/// with another value wins over the variable).
const INT4_FLAG: &str = "OPEN_TRAINING_INT4_FAKE_QAT_FLAG";
const INT4_GROUP: &str = "OPEN_TRAINING_INT4_GROUP_SIZE";

/// Applies miles' INT4 environment variables (their values given) to `cfg`.
fn int4_env(
    cfg: &mut RunConfig,
    flag: Option<String>,
    group: Option<String>,
) -> anyhow::Result<()> {
    match flag.as_deref().map(str::trim) {
        None | Some("" | "0" | "false" | "False") => {}
        Some("1" | "true" | "True") => cfg.int4_qat = true,
        Some(v) => bail!("{INT4_FLAG}={v}: set it to 1 (or 0), or use --int4-qat"),
    }
    if let Some(v) = group {
        let g: usize = v.trim().parse().map_err(|_| {
            anyhow::anyhow!("{INT4_GROUP}={v}: a group size, 128 or 32 (or --int4-group-size)")
        })?;
        if cfg.int4_group_size == RunConfig::default().int4_group_size {
            cfg.int4_group_size = g;
        }
    }
    Ok(())
}

/// The run's quantizer: the `int4-qat` plugin with `--int4-qat`, `fp8` with `--fp8-format`.
fn make_quantizer(cfg: &RunConfig) -> anyhow::Result<Option<Box<dyn Quantizer>>> {
    if cfg.int4_qat {
        linked::plugins();
        let settings = serde_json::json!({
            "group_size": cfg.int4_group_size,
            "experts_only": cfg.int4_experts_only,
        });
        let q = registry::create_quantizer("int4-qat", &settings).context("--int4-qat")?;
        return Ok(Some(q));
    }
    let Some(format) = cfg.fp8_format else { return Ok(None) };
    linked::plugins();
    let fmt = serde_json::to_value(format)?;
    let q = registry::create_quantizer("fp8", &serde_json::json!({ "fmt": fmt }))
        .context("--fp8-format")?;
    const NVTE: &str = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES";
    if let Some(v) = std::env::var_os(NVTE) {
        let v = v.to_string_lossy();
        if !matches!(v.trim(), "1" | "true" | "True") {
            bail!(
                "{NVTE}={v}: miles-rs scales FP8 blocks in f32 only (as miles does on Hopper); \
                 unset it or set it to 1"
            );
        }
    }
    Ok(Some(q))
}

/// `--nproc-per-node N` with `--device cuda` puts rank i on GPU i: the host needs N of them
/// (unless the ranks share one through the TCP group). `gpus`: how many the host has.
fn check_gpus(cfg: &RunConfig, gpus: usize) -> anyhow::Result<()> {
    let n = cfg.nproc_per_node;
    let shared = cfg.distributed_backend == Some(DistBackend::Tcp);
    if cfg.device == DeviceSpec::Cuda && !shared && gpus > 0 && gpus < n {
        bail!(
            "--nproc-per-node {n}: with --device cuda rank i takes GPU i, and this host has \
             {gpus}; start at most {gpus} processes (or let them share GPU 0 with --device \
             cuda:0 --distributed-backend tcp)"
        );
    }
    Ok(())
}

/// The `r3` plugin with `--use-rollout-routing-replay`.
fn make_replay(cfg: &RunConfig) -> anyhow::Result<Option<Box<dyn RoutingReplay>>> {
    if !cfg.use_rollout_routing_replay {
        return Ok(None);
    }
    linked::plugins();
    let r = registry::create_replay("r3", &serde_json::json!({}))
        .context("--use-rollout-routing-replay")?;
    Ok(Some(r))
}

/// `runs/<kind>-<unix seconds>` unless `--run-dir` (or `--save`, where metrics sit beside the
/// checkpoints so a resumed run appends to them) says otherwise.
fn run_dir(cfg: &RunConfig, kind: &str) -> PathBuf {
    if let Some(dir) = cfg.run_dir.clone().or_else(|| cfg.save.clone()) {
        return dir;
    }
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    PathBuf::from("runs").join(format!("{kind}-{secs}"))
}

fn load_data(spec: &str, cfg: &RunConfig, flag: &str) -> anyhow::Result<Dataset> {
    let keys = Keys {
        input_key: cfg.input_key.clone(),
        label_key: cfg.label_key.clone(),
        metadata_key: cfg.metadata_key.clone(),
    };
    Dataset::load(spec, &keys).with_context(|| format!("--{flag}"))
}

/// Everything the loop needs, from the configuration.
pub fn setup(mut cfg: RunConfig) -> anyhow::Result<Setup> {
    let var = |name| std::env::var(name).ok();
    int4_env(&mut cfg, var(INT4_FLAG), var(INT4_GROUP))?;
    for warning in cfg.warnings() {
        eprintln!("warning: {warning}");
    }
    let reward = make_reward(&cfg)?;
    let advantage = make_advantage(&cfg)?;
    let correction = make_correction(&cfg)?;
    let replay = make_replay(&cfg)?;
    let quantizer = make_quantizer(&cfg)?;
    let speculator = crate::common::speculator(&SpecFlags {
        algorithm: cfg.sglang_speculative_algorithm,
        num_steps: cfg.sglang_speculative_num_steps,
        eagle_topk: cfg.sglang_speculative_eagle_topk,
        num_draft_tokens: cfg.sglang_speculative_num_draft_tokens,
    })?;
    if demo::is_demo(&cfg) {
        let run_dir = run_dir(&cfg, "demo");
        let tok_dir = run_dir.join("tokenizer");
        let tokenizer = demo::tokenizer(&tok_dir)?;
        return Ok(Setup {
            model: demo::model(cfg.seed, cfg.arch)?,
            tokenizer,
            tokenizer_dir: Some(tok_dir),
            train_data: demo::train_data(),
            // (The demo evaluates on its table unless eval sets are given.)
            eval_data: match cfg.eval_prompt_data.is_empty() {
                true => vec![rl::EvalSet { name: None, data: demo::eval_data() }],
                false => eval_sets(&cfg)?,
            },
            reward,
            advantage,
            correction,
            replay,
            quantizer,
            speculator,
            fp8_checkpoint: false,
            run_dir,
            config: cfg,
        });
    }
    let Some(dir) = cfg.hf_checkpoint.clone() else {
        bail!("--hf-checkpoint: --prompt-data was given, so a model is needed too");
    };
    if let Some(arch) = cfg.arch {
        bail!(
            "--arch {}: the built-in demo's architecture; {}/config.json names the \
             checkpoint's",
            arch.as_str(),
            dir.display()
        );
    }
    let Some(prompts) = cfg.prompt_data.clone() else {
        bail!(
            "--prompt-data: the JSONL prompts to train on (--input-key says where the prompt is)"
        );
    };
    let model = load_model(&dir).with_context(|| format!("--hf-checkpoint {}", dir.display()))?;
    let fp8_checkpoint = miles_model::config::is_fp8_checkpoint(&dir)?;
    let tokenizer = Tokenizer::load(&dir).with_context(|| {
        format!("--hf-checkpoint {}: training needs a tokenizer", dir.display())
    })?;
    let tokenizer =
        tokenizer.with_chat_kwargs(chat_kwargs(cfg.apply_chat_template_kwargs.as_deref())?)?;
    let train_data = load_data(&prompts, &cfg, "prompt-data")?;
    let eval_data = eval_sets(&cfg)?;
    Ok(Setup {
        model,
        tokenizer,
        tokenizer_dir: Some(dir),
        train_data,
        eval_data,
        reward,
        advantage,
        correction,
        replay,
        quantizer,
        speculator,
        fp8_checkpoint,
        run_dir: run_dir(&cfg, "train"),
        config: cfg,
    })
}

/// `--eval-prompt-data`: one FILE, or slime's NAME FILE pairs (names unique).
fn eval_sets(cfg: &RunConfig) -> anyhow::Result<Vec<rl::EvalSet>> {
    let given = &cfg.eval_prompt_data;
    if given.len() == 1 {
        let data = load_data(&given[0], cfg, "eval-prompt-data")?;
        return Ok(vec![rl::EvalSet { name: None, data }]);
    }
    let mut sets: Vec<rl::EvalSet> = Vec::new();
    for pair in given.chunks(2) {
        let [name, file] = pair else { unreachable!("pairs (validated)") };
        if sets.iter().any(|s| s.name.as_deref() == Some(name)) {
            bail!("--eval-prompt-data: the set name '{name}' is given twice");
        }
        let data = load_data(file, cfg, &format!("eval-prompt-data {name}"))?;
        sets.push(rl::EvalSet { name: Some(name.clone()), data });
    }
    Ok(sets)
}

fn number(r: &Record, key: &str) -> Option<f64> {
    r.get(key).and_then(Value::as_f64)
}

/// One human line per record: step, rewards, loss, time.
fn describe(r: &Record, total: usize) -> String {
    if r.get("phase").and_then(Value::as_str) == Some("sft") {
        let step = number(r, "sft/step").unwrap_or(0.0);
        let loss = number(r, "sft/loss").map_or("-".into(), |l| format!("{l:.3}"));
        return format!("sft warm-up {step}: loss {loss}");
    }
    let step = number(r, "step").unwrap_or(0.0) as usize;
    let mut line = format!("step {step}/{total}");
    let mut put = |label: &str, key: &str| {
        if let Some(v) = number(r, key) {
            line.push_str(&format!(" {label} {v:.3}"));
        }
    };
    put("reward", "rollout/raw_reward");
    put("eval", "eval/reward");
    put("loss", "train/loss");
    put("kl", "train/ppo_kl");
    put("clip", "train/pg_clipfrac");
    put("s/step", "perf/step_time");
    if let Some(e) = r.get("rollout/first_error").and_then(Value::as_str) {
        let failed = number(r, "rollout/failed").unwrap_or(0.0);
        line.push_str(&format!(" | {failed} samples failed, first: {e}"));
    }
    line
}

/// `[=======>        ] `: `done` of `total`.
fn progress_bar(done: usize, total: usize) -> String {
    let width = 24;
    let filled = (done * width).checked_div(total).unwrap_or(width).min(width);
    let head = if filled < width { ">" } else { "" };
    format!("[{}{head}{}] ", "=".repeat(filled), " ".repeat(width - filled - head.len()))
}

pub fn run(args: &TrainArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let cfg = run_config(args)?;
    let world = miles_dist::World::from_env(|k| std::env::var(k).ok())?;
    if cfg.nproc_per_node > 1 && world.is_none() {
        if cfg.device == DeviceSpec::Cuda {
            check_gpus(&cfg, Device::cuda_count())?;
        }
        return launch(cfg.nproc_per_node, "train", out);
    }
    // Rank 0 of a run over several processes reports; the others work quietly.
    let rank = world.as_ref().map_or(0, |w| w.rank);
    if rank != 0 {
        let setup = setup(cfg)?;
        rl::train(setup, &mut |_| {})?;
        return Ok(());
    }
    let demo = demo::is_demo(&cfg);
    let setup = setup(cfg)?;
    let total = rl::total_iterations(&setup.config, setup.train_data.len())?;
    let run_dir = setup.run_dir.clone();
    if demo {
        writeln!(
            out,
            "miles train: no --hf-checkpoint/--prompt-data, so the built-in demo: a {}-parameter \
             policy learns two-digit addition (SFT warm-up, then GRPO); run dir {}",
            setup.model.config.num_parameters(),
            run_dir.display()
        )?;
    }
    if let Some(dir) = &setup.config.load
        && miles_train::checkpoint::latest_iteration(dir)?.is_none()
    {
        writeln!(out, "--load {}: no checkpoint there yet, starting fresh", dir.display())?;
    }
    let terminal = std::io::stderr().is_terminal();
    let mut failure = None;
    let summary = rl::train(setup, &mut |r| {
        let line = describe(r, total);
        if terminal {
            // One bar line redrawn in place; eval results stay on screen.
            let step = number(r, "step").unwrap_or(0.0) as usize;
            let sft = r.get("phase").is_some();
            let bar = if sft { String::new() } else { progress_bar(step, total) };
            eprint!("\r\x1b[2K{bar}{line}");
            if number(r, "eval/reward").is_some() {
                eprintln!();
            }
        } else if let Err(e) = writeln!(out, "{line}") {
            failure.get_or_insert(e);
        }
    })?;
    if terminal {
        eprintln!();
    }
    if let Some(e) = failure {
        return Err(e.into());
    }
    let plots = miles_plot::plot_run(&run_dir, &run_dir.join("plots"))?;
    if let Some(from) = summary.resumed_from {
        writeln!(out, "resumed from iteration {from}")?;
    }
    let eval = summary.final_eval.map_or("-".into(), |e| e.to_string());
    writeln!(
        out,
        "trained {} iterations ({} steps skipped), final eval reward {eval}; metrics in {}, \
         {} plots in {}",
        summary.iterations,
        summary.skipped_steps,
        run_dir.join(rl::METRICS_FILE).display(),
        plots.len(),
        run_dir.join("plots").display()
    )?;
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn mileses_int4_variables_read_as_the_flags() {
        let read = |flag: Option<&str>, group: Option<&str>, cfg: &mut RunConfig| {
            super::int4_env(cfg, flag.map(String::from), group.map(String::from))
        };
        let mut cfg = RunConfig::default();
        read(Some("1"), Some("32"), &mut cfg).unwrap();
        assert!(cfg.int4_qat && cfg.int4_group_size == 32);
        let mut cfg = RunConfig { int4_group_size: 32, ..RunConfig::default() };
        read(Some("0"), Some("128"), &mut cfg).unwrap();
        assert!(!cfg.int4_qat && cfg.int4_group_size == 32, "the flag wins");
        let e = read(Some("yes"), None, &mut cfg).unwrap_err().to_string();
        assert!(e.contains("OPEN_TRAINING_INT4_FAKE_QAT_FLAG=yes"), "{e}");
        let e = read(None, Some("x"), &mut cfg).unwrap_err().to_string();
        assert!(e.contains("OPEN_TRAINING_INT4_GROUP_SIZE=x"), "{e}");
    }

    use super::*;

    /// More processes than GPUs under `--device cuda` is an error before any starts, naming
    /// both ways out; ranks sharing a GPU, an explicit ordinal or a machine without GPUs pass.
    #[test]
    fn more_ranks_than_gpus_is_an_error_at_launch() {
        let cfg = |device: &str, backend| RunConfig {
            device: device.parse().unwrap(),
            nproc_per_node: 4,
            distributed_backend: backend,
            ..RunConfig::default()
        };
        let e = check_gpus(&cfg("cuda", None), 2).unwrap_err().to_string();
        assert!(e.starts_with("--nproc-per-node 4: with --device cuda rank i takes GPU i"), "{e}");
        assert!(e.contains("--distributed-backend tcp"), "{e}");
        assert!(check_gpus(&cfg("cuda", None), 4).is_ok());
        assert!(check_gpus(&cfg("cuda", Some(DistBackend::Tcp)), 1).is_ok());
        assert!(check_gpus(&cfg("cuda:0", None), 1).is_ok(), "NCCL names the duplicate GPU");
        assert!(check_gpus(&cfg("cuda", None), 0).is_ok(), "the ranks say why there is none");
        assert!(check_gpus(&cfg("cpu", None), 1).is_ok());
    }
}
