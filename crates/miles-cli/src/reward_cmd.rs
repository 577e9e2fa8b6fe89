use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use miles_core::{Reward, RewardError, RewardValue, Sample, Status};
use miles_plugin_abi::host::DynamicReward;
use miles_rewards::python_spec;

use crate::jsonl::{self, Line};
use crate::linked;
use crate::train_cmd::python_reward;

#[derive(Debug, Args)]
#[command(group = clap::ArgGroup::new("reward").required(true).args(["rm_type", "custom_rm_path"]))]
pub struct RewardArgs {
    /// JSONL samples: one object per line with `prompt`, `response` and `label` (any other
    /// `Sample` field may be present and is kept).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// A built-in reward by name (`miles plugins` lists them).
    #[arg(long, value_name = "NAME")]
    pub rm_type: Option<String>,
    /// A reward plugin library, `LIB[:SYMBOL]`, or a Python function, `FILE.py[:FUNCTION]`
    /// (default compute_score), run in a worker process.
    #[arg(long, value_name = "LIB")]
    pub custom_rm_path: Option<String>,
    /// The Python interpreter for a `FILE.py` --custom-rm-path (default: python3).
    #[arg(long, value_name = "PATH")]
    pub rm_python: Option<PathBuf>,
    /// JSON configuration handed to the reward when it is created.
    #[arg(long, value_name = "JSON")]
    pub custom_rm_config: Option<String>,
    /// Score each prompt group (consecutive samples with one `group_index`) in one call.
    #[arg(long)]
    pub group_rm: bool,
    /// Write the samples with their rewards here (JSONL, input fields kept).
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
}

pub fn run(args: &RewardArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let lines = jsonl::read_objects(&args.input)?;
    let shown = args.input.display();
    let samples: Vec<Sample> = lines
        .iter()
        .map(|line| {
            serde_json::from_value(serde_json::Value::Object(line.object.clone()))
                .with_context(|| format!("{shown}:{}: not a sample", line.number))
        })
        .collect::<anyhow::Result<_>>()?;

    let config: serde_json::Value = match &args.custom_rm_config {
        Some(text) => serde_json::from_str(text)
            .with_context(|| format!("--custom-rm-config is not valid JSON: {text}"))?,
        None => serde_json::Value::Null,
    };
    let (reward, label): (Box<dyn Reward>, String) = match (&args.rm_type, &args.custom_rm_path) {
        (Some(name), _) => {
            linked::plugins();
            let reward = miles_core::registry::create_reward(name, &config)
                .with_context(|| "--rm-type".to_string())?;
            (reward, format!("{name} (static)"))
        }
        (None, Some(spec)) => match python_spec(spec) {
            Some((file, function)) => {
                let python = args.rm_python.clone();
                let reward = python_reward(&file, &function, python, config, args.group_rm)?;
                let info = reward.info();
                let label = format!(
                    "{} (Python {} worker, called as {}{})",
                    reward.label(),
                    info.python_version,
                    info.call,
                    if info.is_async { ", async" } else { "" }
                );
                (Box::new(reward), label)
            }
            None => {
                let plugin = DynamicReward::load(spec, &config)?;
                let label = format!("{} {} (dynamic, {spec})", plugin.name(), plugin.version());
                (Box::new(plugin), label)
            }
        },
        (None, None) => unreachable!("clap requires one of --rm-type and --custom-rm-path"),
    };

    let started = Instant::now();
    let results = miles_rewards::score_all(reward.as_ref(), &samples, args.group_rm);
    let elapsed = started.elapsed();
    if let Some(why) = reward.fatal() {
        bail!("the reward stopped working: {why}");
    }

    let summary = Summary::of(&lines, &results);
    writeln!(
        out,
        "scored {} samples from {shown} with {label} in {:.1} ms",
        samples.len(),
        elapsed.as_secs_f64() * 1e3
    )?;
    summary.write(out)?;

    if let Some(path) = &args.output {
        write_scored(path, &lines, &results)?;
        writeln!(out, "wrote {}", path.display())?;
    }
    Ok(())
}

/// Per reward key (`reward` for scalar rewards): count, mean, std, min, max.
struct Summary {
    stats: BTreeMap<String, Vec<f64>>,
    failures: Vec<(usize, String)>,
}

impl Summary {
    fn of(lines: &[Line], results: &[Result<RewardValue, RewardError>]) -> Summary {
        let mut stats: BTreeMap<String, Vec<f64>> = BTreeMap::new();
        let mut failures = Vec::new();
        for (line, result) in lines.iter().zip(results) {
            match result {
                Ok(RewardValue::Scalar(v)) => stats.entry("reward".into()).or_default().push(*v),
                Ok(RewardValue::Named(map)) => {
                    for (k, v) in map {
                        stats.entry(k.clone()).or_default().push(*v);
                    }
                }
                Err(e) => failures.push((line.number, e.to_string())),
            }
        }
        Summary { stats, failures }
    }

    fn write(&self, out: &mut dyn Write) -> std::io::Result<()> {
        for (key, values) in &self.stats {
            let n = values.len() as f64;
            let mean = values.iter().sum::<f64>() / n;
            let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
            let min = values.iter().copied().fold(f64::INFINITY, f64::min);
            let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            writeln!(
                out,
                "  {key}: n {}  mean {mean:.4}  std {:.4}  min {min}  max {max}",
                values.len(),
                var.sqrt()
            )?;
        }
        if let Some((line, first)) = self.failures.first() {
            writeln!(out, "  failed: {} (first at line {line}: {first})", self.failures.len())?;
        }
        Ok(())
    }
}

/// Each input object with `reward` set; a failed sample gets `status: failed` and the reason
/// in `metadata.reward_error`. Written aside and renamed, so a crash leaves no half file.
fn write_scored(
    path: &std::path::Path,
    lines: &[Line],
    results: &[Result<RewardValue, RewardError>],
) -> anyhow::Result<()> {
    let mut text = String::new();
    for (line, result) in lines.iter().zip(results) {
        let mut object = line.object.clone();
        match result {
            Ok(value) => {
                object.insert("reward".into(), serde_json::to_value(value)?);
            }
            Err(e) => {
                object.insert("status".into(), serde_json::to_value(Status::Failed)?);
                let metadata = object.entry("metadata").or_insert_with(|| serde_json::json!({}));
                if !metadata.is_object() {
                    *metadata = serde_json::json!({ "original": metadata.clone() });
                }
                metadata["reward_error"] = serde_json::Value::String(e.to_string());
            }
        }
        text.push_str(&serde_json::to_string(&object)?);
        text.push('\n');
    }
    let tmp = path.with_extension("jsonl.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
    std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(())
}
