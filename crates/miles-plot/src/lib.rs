//! Line charts of a run's `metrics.jsonl`, drawn to PNG with no font files or GUI stack.
//!
//! A run logs one JSON object per training step with slime's flat metric names
//! (`rollout/raw_reward`, `train/ppo_kl`, `perf/step_time`, …). [`read_metrics`] reads them,
//! [`CHARTS`] says which metrics share a picture, and [`plot_run`] writes one PNG per chart that
//! has data. The pixels are drawn here: [`canvas`] (lines, text), [`font`] (a built-in bitmap
//! font), [`chart`] (axes, ticks, legend).

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter};
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

pub mod canvas;
pub mod chart;
pub mod font;

pub use chart::{Chart, Series, Size, Ticks, nice_ticks};

/// The file a run directory logs its metrics to.
pub const METRICS_FILE: &str = "metrics.jsonl";

/// One line of metrics.jsonl: metric name → value.
pub type Record = Map<String, Value>;

/// What can go wrong plotting a run; each message names the file (and line) it is about.
/// The underlying error is part of the message rather than a `source()`, so a printed chain
/// does not repeat it.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    #[error("cannot read {}: {error}; check the path (a run directory holds {})",
        path.display(), METRICS_FILE)]
    Read { path: PathBuf, error: std::io::Error },
    #[error("{}:{line}:{column}: not valid JSON ({message}); each line must be one JSON object",
        path.display())]
    Malformed { path: PathBuf, line: usize, column: usize, message: String },
    #[error("{}:{line}: a metrics line must be a JSON object, got {found}", path.display())]
    NotAnObject { path: PathBuf, line: usize, found: &'static str },
    #[error("{} holds no metrics; has the run logged a step yet?", path.display())]
    Empty { path: PathBuf },
    #[error("cannot write {}: {error}", path.display())]
    Write { path: PathBuf, error: std::io::Error },
    #[error("cannot encode {}: {error}", path.display())]
    Encode { path: PathBuf, error: png::EncodingError },
}

/// Reads a metrics.jsonl file: one object per non-blank line. A file without any record is
/// [`PlotError::Empty`], so a wrong path or a run that never logged is caught here.
pub fn read_metrics(path: &Path) -> Result<Vec<Record>, PlotError> {
    let read_err = |error| PlotError::Read { path: path.to_path_buf(), error };
    let file = File::open(path).map_err(read_err)?;
    let mut records = Vec::new();
    for (index, line) in BufReader::new(file).lines().enumerate() {
        let line = line.map_err(read_err)?;
        if line.trim().is_empty() {
            continue;
        }
        let line_number = index + 1;
        let value: Value = serde_json::from_str(&line).map_err(|error| {
            // serde_json's own " at line 1 column N" counts within this one line; say it once.
            let location = format!(" at line {} column {}", error.line(), error.column());
            let message = error.to_string();
            PlotError::Malformed {
                path: path.to_path_buf(),
                line: line_number,
                column: error.column(),
                message: message.strip_suffix(&location).unwrap_or(&message).to_string(),
            }
        })?;
        match value {
            Value::Object(record) => records.push(record),
            other => {
                return Err(PlotError::NotAnObject {
                    path: path.to_path_buf(),
                    line: line_number,
                    found: json_kind(&other),
                });
            }
        }
    }
    if records.is_empty() {
        return Err(PlotError::Empty { path: path.to_path_buf() });
    }
    Ok(records)
}

fn json_kind(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The x of a record: its numeric "step", or its position among the records when it has none.
pub fn step_of(record: &Record, index: usize) -> f64 {
    record.get("step").and_then(Value::as_f64).unwrap_or(index as f64)
}

/// What a chart's x axis measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum XAxis {
    /// The record's step ([`step_of`]).
    Step,
    /// Seconds of training up to and including the record: the running sum of its
    /// `perf/rollout_time`, `perf/train_time` and `perf/update_weights_time` (evals excluded).
    TrainingTime,
}

impl XAxis {
    fn label(self) -> &'static str {
        match self {
            XAxis::Step => "step",
            XAxis::TrainingTime => "training time (s)",
        }
    }

    /// The x of every record.
    pub fn values(self, records: &[Record]) -> Vec<f64> {
        let mut clock = 0.0;
        let seconds = |r: &Record, k: &str| r.get(k).and_then(Value::as_f64).unwrap_or(0.0);
        records
            .iter()
            .enumerate()
            .map(|(i, r)| match self {
                XAxis::Step => step_of(r, i),
                XAxis::TrainingTime => {
                    let keys = ["perf/rollout_time", "perf/train_time", "perf/update_weights_time"];
                    clock += keys.iter().map(|k| seconds(r, k)).sum::<f64>();
                    clock
                }
            })
            .collect()
    }
}

/// The points of metric `key` over the run, against the step. Records without the key, or with
/// a null, string or other non-numeric value there, are skipped.
pub fn series(records: &[Record], key: &str) -> Series {
    series_against(records, &XAxis::Step.values(records), key)
}

/// The points of metric `key` at the x values `xs` (one per record).
fn series_against(records: &[Record], xs: &[f64], key: &str) -> Series {
    let points = records
        .iter()
        .zip(xs)
        .filter_map(|(r, &x)| r.get(key).and_then(Value::as_f64).map(|y| (x, y)))
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    Series { name: key.to_string(), points }
}

/// One picture: the metrics it draws and the file it goes to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChartSpec {
    /// File name inside the output directory.
    pub file: &'static str,
    pub title: &'static str,
    /// Metrics drawn when present, in this order (and in this legend order).
    pub keys: &'static [&'static str],
    /// Every metric whose name starts with this is drawn too, in order of first appearance.
    pub prefix: Option<&'static str>,
    pub x: XAxis,
}

impl ChartSpec {
    /// The metrics this chart would draw, as a phrase for "no data for …".
    pub fn describe(&self) -> String {
        let mut names: Vec<String> = self.keys.iter().map(|k| k.to_string()).collect();
        names.extend(self.prefix.map(|p| format!("{p}*")));
        names.join(", ")
    }

    /// The chart for `records`; `has_data()` is false when none of its metrics was logged.
    pub fn chart(&self, records: &[Record]) -> Chart {
        let mut keys: Vec<&str> = self.keys.to_vec();
        if let Some(prefix) = self.prefix {
            for record in records {
                for key in record.keys() {
                    if key.starts_with(prefix) && !keys.contains(&key.as_str()) {
                        keys.push(key);
                    }
                }
            }
        }
        let xs = self.x.values(records);
        let series = keys
            .iter()
            .map(|k| series_against(records, &xs, k))
            .filter(|s| !s.points.is_empty())
            .collect();
        Chart { title: self.title.to_string(), x_label: self.x.label().to_string(), series }
    }
}

/// Every chart `miles plot` draws.
pub const CHARTS: &[ChartSpec] = &[
    ChartSpec {
        file: "reward.png",
        title: "Reward",
        keys: &["rollout/raw_reward"],
        prefix: Some("eval/"),
        x: XAxis::Step,
    },
    ChartSpec {
        file: "eval_time.png",
        title: "Held-out eval against training time",
        keys: &[],
        prefix: Some("eval/"),
        x: XAxis::TrainingTime,
    },
    ChartSpec {
        file: "kl.png",
        title: "KL",
        keys: &["train/ppo_kl", "train/kl_loss", "train/train_rollout_logprob_abs_diff"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "clipfrac.png",
        title: "Clip fraction",
        keys: &["train/pg_clipfrac", "train/tis_clipfrac"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "response_len.png",
        title: "Response length (tokens)",
        keys: &["rollout/response_len/mean"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "entropy.png",
        title: "Entropy of the policy (nats per token)",
        keys: &["train/entropy_loss"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "truncated.png",
        title: "Truncated responses (ratio)",
        keys: &["rollout/truncated_ratio"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "step_time.png",
        title: "Step time (s)",
        keys: &["perf/step_time", "perf/rollout_time", "perf/train_time"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "loss.png",
        title: "Loss",
        keys: &["train/loss", "train/pg_loss", "sft/loss", "train/mtp_loss"],
        prefix: None,
        x: XAxis::Step,
    },
    ChartSpec {
        file: "spec_accept.png",
        title: "Speculative drafts kept (ratio)",
        keys: &["rollout/spec_accept_rate"],
        prefix: None,
        x: XAxis::Step,
    },
];

/// What [`plot_records`] did.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PlotReport {
    /// The PNG files written, in [`CHARTS`] order.
    pub written: Vec<PathBuf>,
    /// Charts left out because none of their metrics was logged.
    pub skipped: Vec<ChartSpec>,
}

/// Draws every chart of [`CHARTS`] that has data into `out_dir` (created if missing).
pub fn plot_records(records: &[Record], out_dir: &Path) -> Result<PlotReport, PlotError> {
    plot_runs(&[("", records)], out_dir)
}

/// [`plot_records`] for several runs side by side: each chart draws every run's series, named
/// `label: metric` (a run with an empty label keeps the metric's name).
pub fn plot_runs(runs: &[(&str, &[Record])], out_dir: &Path) -> Result<PlotReport, PlotError> {
    std::fs::create_dir_all(out_dir)
        .map_err(|error| PlotError::Write { path: out_dir.to_path_buf(), error })?;
    let mut report = PlotReport::default();
    for spec in CHARTS {
        let mut chart = Chart {
            title: spec.title.to_string(),
            x_label: spec.x.label().to_string(),
            series: Vec::new(),
        };
        for (label, records) in runs {
            for mut s in spec.chart(records).series {
                if !label.is_empty() {
                    s.name = format!("{label}: {}", s.name);
                }
                chart.series.push(s);
            }
        }
        if !chart.has_data() {
            report.skipped.push(*spec);
            continue;
        }
        let path = out_dir.join(spec.file);
        write_png(&chart.render(Size::default()), &path)?;
        report.written.push(path);
    }
    Ok(report)
}

fn write_png(canvas: &canvas::Canvas, path: &Path) -> Result<(), PlotError> {
    let file =
        File::create(path).map_err(|error| PlotError::Write { path: path.to_path_buf(), error })?;
    canvas
        .write_png(BufWriter::new(file))
        .map_err(|error| PlotError::Encode { path: path.to_path_buf(), error })
}

/// Reads `run_dir/metrics.jsonl` and writes its charts into `out_dir`; returns the files
/// written. [`plot_records`] also says which charts were skipped.
pub fn plot_run(run_dir: &Path, out_dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    let records = read_metrics(&run_dir.join(METRICS_FILE))?;
    Ok(plot_records(&records, out_dir)?.written)
}

#[cfg(test)]
mod tests;
