//! Supervised samples from (prompt, label) rows, and the SFT warm-up before RL.

use std::time::Instant;

use anyhow::{Context, anyhow, bail};
use miles_core::config::RunConfig;
use miles_data::{DataSource, PromptRow};
use miles_model::Tokenizer;
use serde_json::json;

use super::actor::Actor;
use super::metrics::Record;
use super::mix;
use super::step::{StepLoss, StepSpec};
use crate::batch::TrainSample;
use crate::loss::SftLossConfig;

/// (prompt, label) rows as SFT samples: the label's tokens and EOS are the response.
pub(super) fn sft_samples(
    rows: &[(usize, PromptRow)],
    cfg: &RunConfig,
    tok: &Tokenizer,
    eos: u32,
    source: &str,
    why: &str,
) -> anyhow::Result<Vec<TrainSample>> {
    let mut samples = Vec::with_capacity(rows.len());
    for (_, row) in rows {
        let label = row.label.as_deref().ok_or_else(|| {
            anyhow!(
                "{source}: line {}: {why} trains on the label as the answer, and this row has \
                 none (set --label-key)",
                row.line
            )
        })?;
        let prompt = serde_json::to_value(&row.prompt)?;
        let mut tokens = tok
            .encode_prompt(&prompt, cfg.apply_chat_template)
            .with_context(|| format!("{source}: line {}", row.line))?;
        let prompt_len = tokens.len();
        if prompt_len == 0 {
            bail!("{source}: line {}: the prompt encodes to no tokens", row.line);
        }
        tokens.extend(tok.encode(label, false)?);
        tokens.push(eos);
        let n = tokens.len() - prompt_len;
        samples.push(TrainSample {
            group: samples.len(),
            tokens,
            prompt_len,
            reward: 0.0,
            loss_mask: vec![1; n],
            rollout_logp: vec![0.0; n],
            old_logp: vec![0.0; n],
            advantages: vec![0.0; n],
            ..TrainSample::default()
        });
    }
    Ok(samples)
}

/// Supervised steps on (prompt, label) pairs before RL: the label's tokens and EOS are the
/// response, on the run's device, at `sft-lr`, with an optimizer of its own (RL starts with a
/// fresh one); prompts are drawn from a copy of the data source so RL's data order is the same
/// with or without a warm-up.
pub(super) fn sft_warmup(
    cfg: &RunConfig,
    actor: &mut Actor,
    tok: &Tokenizer,
    eos: u32,
    data: &DataSource,
    emit: &mut dyn FnMut(Record) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let mut source = DataSource::new(data.dataset().clone(), true, mix(cfg.seed, 0x5F7))?;
    let lr = cfg.sft_lr.unwrap_or(cfg.lr);
    let sft = SftLossConfig::from_run_config(cfg);
    let where_ = data.dataset().source.clone();
    for step in 0..cfg.sft_warmup_steps {
        let started = Instant::now();
        let rows = source.next_batch(cfg.rollout_batch_size);
        let samples = sft_samples(&rows, cfg, tok, eos, &where_, "--sft-warmup-steps")?;
        let micro = cfg.micro_batch_size.unwrap_or(usize::MAX);
        let t = cfg.rollout_temperature;
        let spec = StepSpec {
            loss: StepLoss::Sft(sft),
            temperature: t,
            micro,
            lr,
            inject_nan: false,
            dist: None,
        };
        let result = actor.train_step(&samples, spec)?;
        let result = result.applied;
        let mut record = Record::new();
        record.insert("phase".into(), json!("sft"));
        // Warm-up steps come before RL iteration 1 on the metrics' time axis: 1 − W, …, 0.
        record.insert("step".into(), json!(step as i64 + 1 - cfg.sft_warmup_steps as i64));
        record.insert("sft/step".into(), json!(step + 1));
        if let Some(r) = result {
            record.insert("sft/loss".into(), json!(r.loss));
            record.insert("sft/grad_norm".into(), json!(r.grad_norm));
            if let Some((loss, _)) = r.mtp {
                record.insert("sft/mtp_loss".into(), json!(loss));
            }
        }
        record.insert("sft/step_time".into(), json!(started.elapsed().as_secs_f64()));
        emit(record)?;
    }
    actor.reset_optimizer();
    Ok(())
}
