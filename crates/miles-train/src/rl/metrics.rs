//! What a run writes down: `metrics.jsonl` (and TensorBoard scalars), and the means of an
//! iteration's optimizer steps under slime's metric names.

use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::Context;
use miles_model::moe::RoutingMismatch;
use miles_tensor::Device;
use serde_json::{Map, Value, json};

use super::METRICS_FILE;
use super::step::StepResult;
use crate::loss::LossMetrics;

/// One line of `metrics.jsonl`.
pub type Record = Map<String, Value>;

/// Appends records to `metrics.jsonl`, flushing each line, and with `--use-tensorboard` the
/// same numbers as TensorBoard scalars under `<run dir>/tensorboard/`.
pub(super) struct MetricsLog {
    /// `None` on ranks other than 0 of a run over several processes: rank 0 logs.
    pub(super) file: Option<std::fs::File>,
    pub(super) path: PathBuf,
    pub(super) tensorboard: Option<miles_tensorboard::EventWriter>,
}

/// Where `--use-tensorboard` writes its event files, inside the run directory.
pub const TENSORBOARD_DIR: &str = "tensorboard";

impl MetricsLog {
    /// A fresh log, or on resume from iteration `k` the old one without the records of
    /// iterations after `k` (they are about to be run again). A resumed run's TensorBoard
    /// events go to a new file; TensorBoard drops the old file's points past step `k` when the
    /// new one goes back to it.
    pub(super) fn open(
        run_dir: &Path,
        resumed_from: Option<u64>,
        tensorboard: bool,
    ) -> anyhow::Result<MetricsLog> {
        std::fs::create_dir_all(run_dir)
            .with_context(|| format!("--run-dir: cannot create {}", run_dir.display()))?;
        let path = run_dir.join(METRICS_FILE);
        let mut kept = String::new();
        if let (Some(k), Ok(text)) = (resumed_from, std::fs::read_to_string(&path)) {
            for line in text.lines() {
                let Ok(record) = serde_json::from_str::<Record>(line) else { continue };
                let sft = record.get("phase").is_some();
                let step = record.get("step").and_then(Value::as_u64).unwrap_or(0);
                if sft || step <= k {
                    kept.push_str(line);
                    kept.push('\n');
                }
            }
        }
        std::fs::write(&path, kept).with_context(|| format!("cannot write {}", path.display()))?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        let tensorboard = match tensorboard {
            true => Some(miles_tensorboard::EventWriter::create(&run_dir.join(TENSORBOARD_DIR))?),
            false => None,
        };
        Ok(MetricsLog { file: Some(file), path, tensorboard })
    }

    /// A log that writes nothing (a rank other than 0).
    pub(super) fn silent(run_dir: &Path) -> MetricsLog {
        MetricsLog { file: None, path: run_dir.join(METRICS_FILE), tensorboard: None }
    }

    pub(super) fn write(&mut self, record: &Record) -> anyhow::Result<()> {
        let Some(file) = self.file.as_mut() else { return Ok(()) };
        let line = serde_json::to_string(record)?;
        writeln!(file, "{line}")
            .with_context(|| format!("cannot write {}", self.path.display()))?;
        if let Some(tb) = &mut self.tensorboard {
            // Every number but the step itself, at the record's step (SFT warm-up records
            // carry theirs in `step` too).
            let step = record.get("step").and_then(Value::as_i64).unwrap_or(0);
            let scalars: Vec<(&str, f64)> = record
                .iter()
                .filter(|(k, _)| k.as_str() != "step")
                .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()?)))
                .collect();
            tb.write_scalars(step, miles_tensorboard::wall_time_now(), &scalars)?;
        }
        Ok(())
    }
}

/// Means of the applied steps' metrics.
#[derive(Default)]
pub(super) struct StepSums {
    pub(super) steps: usize,
    pub(super) loss: f64,
    pub(super) metrics: LossMetrics,
    pub(super) grad_norm: f64,
    pub(super) lr: f32,
    pub(super) router_aux_loss: Option<f64>,
    pub(super) routing: Option<RoutingMismatch>,
    /// The draft's MTP loss and gradient norm, summed over the steps.
    pub(super) mtp: Option<(f64, f64)>,
    /// The draft's loss after its warm-up, on the step that took it.
    pub(super) mtp_warmup: Option<f64>,
}

impl StepSums {
    pub(super) fn add(&mut self, s: &StepResult, lr: f32) {
        self.steps += 1;
        self.loss += s.loss;
        self.grad_norm += s.grad_norm;
        self.metrics.add_scaled(&s.metrics, 1.0);
        self.lr = lr;
        if let Some(aux) = s.router_aux_loss {
            *self.router_aux_loss.get_or_insert(0.0) += aux;
        }
        if let Some(m) = &s.routing {
            self.routing.get_or_insert_default().merge(m);
        }
        if let Some((loss, norm)) = s.mtp {
            let sum = self.mtp.get_or_insert((0.0, 0.0));
            *sum = (sum.0 + loss, sum.1 + norm);
        }
        self.mtp_warmup = s.mtp_warmup.or(self.mtp_warmup);
    }

    /// `corrected` and `opsm` add the metrics slime reports with TIS and OPSM.
    pub(super) fn write(&self, record: &mut Record, corrected: bool, opsm: bool) {
        record.insert("train/steps".into(), json!(self.steps));
        if self.steps == 0 {
            return;
        }
        let k = self.steps as f64;
        record.insert("train/loss".into(), json!(self.loss / k));
        for (name, v) in self.metrics.named(corrected, opsm) {
            record.insert(name.into(), json!(v / k));
        }
        record.insert("train/grad_norm".into(), json!(self.grad_norm / k));
        record.insert("train/lr".into(), json!(self.lr));
        if let Some(aux) = self.router_aux_loss {
            record.insert("train/router_aux_loss".into(), json!(aux / k));
        }
        if let Some((loss, norm)) = self.mtp {
            record.insert("train/mtp_loss".into(), json!(loss / k));
            record.insert("train/mtp_grad_norm".into(), json!(norm / k));
        }
        if let Some(loss) = self.mtp_warmup {
            record.insert("train/mtp_warmup_loss".into(), json!(loss));
        }
        // Of the (token, sparse layer) pairs with a rollout record: how often training's own
        // top-k differs from the rollout's experts, and how often the experts it used do
        // (0 with --use-rollout-routing-replay).
        if let Some(m) = self.routing.filter(|m| m.compared > 0) {
            let n = m.compared as f64;
            record.insert("train/routed_experts_mismatch".into(), json!(m.own_differs as f64 / n));
            record
                .insert("train/replayed_experts_mismatch".into(), json!(m.used_differs as f64 / n));
        }
    }
}

/// Dense bf16 tensor-core FLOP/s of the device's chip, where known (for the MFU metric).
pub(super) fn peak_bf16_flops(device: &Device) -> Option<f64> {
    let name = device.name().ok()?;
    ["H100", "H200", "H800", "GH200"].iter().any(|n| name.contains(n)).then_some(989e12)
}
