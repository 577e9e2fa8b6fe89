//! `miles generate`: prompts in, one `Sample` per response out, through the embedded engine.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use clap::Args;
use miles_core::config::SpeculativeAlgorithm;
use miles_core::{Sample, SamplingParams, Status};
use miles_data::{Dataset, Keys};
use miles_model::draft::{Draft, draft_config};
use miles_model::{DeviceModel, Model, PackedBatch, Tokenizer};
use miles_rollout::{Engine, EngineConfig, Progress, kv_cache_budget};

use crate::common::{EngineArgs, SpecFlags, chat_kwargs, load_model, speculator};
use crate::generate_output::{Output, read_kept};

#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// HF checkpoint directory: config.json, safetensors, tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: PathBuf,
    /// JSONL prompts; `FILE@[a:b]` keeps rows a..b (0-based, either end optional).
    #[arg(long, value_name = "FILE")]
    pub prompt_data: String,
    /// Key of the prompt (text or chat messages) in each line.
    #[arg(long, default_value = "input")]
    pub input_key: String,
    /// Key of the label, copied into each sample's `label` (numbers and booleans as text).
    #[arg(long)]
    pub label_key: Option<String>,
    /// Key of per-prompt metadata (any JSON), copied into each sample's `metadata`.
    #[arg(long)]
    pub metadata_key: Option<String>,
    /// Render prompts through the tokenizer's chat template (generation prompt appended).
    #[arg(long)]
    pub apply_chat_template: bool,
    /// Extra variables of the chat template, a JSON object (`'{"enable_thinking": false}'`).
    #[arg(long)]
    pub apply_chat_template_kwargs: Option<String>,
    #[arg(long, default_value_t = 1)]
    pub n_samples_per_prompt: usize,
    #[arg(long, default_value_t = 1024)]
    pub rollout_max_response_len: usize,
    /// Prompts longer than this are skipped (written with status `failed` and the reason).
    #[arg(long)]
    pub rollout_max_prompt_len: Option<usize>,
    #[arg(long, default_value_t = 1.0)]
    pub rollout_temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub rollout_top_p: f32,
    /// -1 disables top-k; 1 is greedy decoding.
    #[arg(long, default_value_t = -1, allow_negative_numbers = true)]
    pub rollout_top_k: i64,
    #[arg(long, default_value_t = 42)]
    pub rollout_seed: u64,
    /// Stop after any of these strings (repeat the flag for several).
    #[arg(long)]
    pub rollout_stop: Vec<String>,
    /// Stop after any of these token ids, besides the model's EOS.
    #[arg(long, value_delimiter = ',')]
    pub rollout_stop_token_ids: Vec<u32>,
    /// KV cache budget in MiB; sequences wait when it is full.
    #[arg(long, default_value_t = 1024)]
    pub rollout_kv_cache_mb: usize,
    /// KV cache budget as a share of the GPU's free memory after the weights are loaded
    /// (SGLang's --mem-fraction-static role); replaces --rollout-kv-cache-mb.
    #[arg(long, value_name = "F")]
    pub rollout_kv_cache_fraction: Option<f64>,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Speculative decoding (the eagle-spec plugin): EAGLE (or NEXTN) with the MTP draft of
    /// --sglang-speculative-draft-model-path; the tokens are distributed as without it.
    #[arg(long, value_name = "NAME", value_parser = parse_algorithm)]
    pub sglang_speculative_algorithm: Option<SpeculativeAlgorithm>,
    /// The draft: an MTP layer's safetensors (DeepSeek-V3's or MiMo's names; a `miles train`
    /// checkpoint's draft/).
    #[arg(long, value_name = "DIR")]
    pub sglang_speculative_draft_model_path: Option<PathBuf>,
    /// Draft tokens proposed per step (3).
    #[arg(long, value_name = "N")]
    pub sglang_speculative_num_steps: Option<usize>,
    /// Chain drafting only: 1.
    #[arg(long, value_name = "N")]
    pub sglang_speculative_eagle_topk: Option<usize>,
    /// Tokens verified per step: steps + 1.
    #[arg(long, value_name = "N")]
    pub sglang_speculative_num_draft_tokens: Option<usize>,
    /// After generating, score every sample with the same model as the trainer would (packed
    /// forward) and report whether the rollout logprobs equal it bit for bit.
    #[arg(long)]
    pub check_logprobs: bool,
    /// Most sequences decoding at once.
    #[arg(long, default_value_t = 64)]
    pub rollout_max_running: usize,
    /// Samples as JSONL, appended as each prompt's samples finish (a killed run keeps them),
    /// in prompt order at the end.
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Continue a run that stopped: prompts whose every sample is in --output already, none of
    /// them failed, are not generated again (the others are, with the same draws as in one
    /// uninterrupted run).
    #[arg(long)]
    pub resume: bool,
}

/// The prompts of `--prompt-data` as samples (label and metadata copied), tokenized.
fn load_prompts(args: &GenerateArgs, tok: &Tokenizer) -> anyhow::Result<Vec<Sample>> {
    let keys = Keys {
        input_key: args.input_key.clone(),
        label_key: args.label_key.clone(),
        metadata_key: args.metadata_key.clone(),
    };
    let dataset = Dataset::load(&args.prompt_data, &keys).context("--prompt-data")?;
    let (path, _, _) = miles_data::parse_slice(&args.prompt_data)?;
    dataset
        .rows
        .into_iter()
        .map(|row| {
            let at = || format!("{}:{}: key '{}'", path.display(), row.line, args.input_key);
            let prompt = serde_json::to_value(&row.prompt)?;
            let tokens = tok.encode_prompt(&prompt, args.apply_chat_template).with_context(at)?;
            Ok(Sample {
                prompt: row.prompt,
                tokens,
                label: row.label,
                metadata: row.metadata,
                ..Sample::default()
            })
        })
        .collect()
}

/// Progress on standard error: a bar redrawn on a terminal, else a line every 10 s.
struct Reporter {
    started: Instant,
    terminal: bool,
    last_line: Option<Instant>,
    warned: bool,
    kv_mb: usize,
    max_running: usize,
}

impl Reporter {
    fn new(kv_mb: usize, max_running: usize) -> Self {
        let terminal = std::io::stderr().is_terminal();
        let started = Instant::now();
        Reporter { started, terminal, last_line: None, warned: false, kv_mb, max_running }
    }

    fn report(&mut self, p: &Progress) {
        let seconds = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = p.generated_tokens as f64 / seconds;
        let eta = match p.finished {
            0 => "?".to_string(),
            f => format!("{:.0} s", seconds * (p.total - f) as f64 / f as f64),
        };
        let kv = 100 * p.blocks_used / p.total_blocks.max(1);
        let text = format!(
            "{}/{} samples, {} tokens, {rate:.1} tok/s, {} preemptions, KV cache {kv}% used, \
             ETA {eta}",
            p.finished, p.total, p.generated_tokens, p.preemptions
        );
        if self.terminal {
            let width = 30;
            let filled = (p.finished * width).checked_div(p.total).unwrap_or(width);
            eprint!("\r\x1b[2K[{}{}] {text}", "=".repeat(filled), " ".repeat(width - filled));
        } else if self.last_line.is_none_or(|t| t.elapsed().as_secs() >= 10) {
            eprintln!("{text}");
            self.last_line = Some(Instant::now());
        }
        if !self.warned && cache_too_small(p, self.max_running) {
            self.warned = true;
            if self.terminal {
                eprintln!();
            }
            eprintln!(
                "warning: {} preemptions, {} sequences running where --rollout-max-running \
                 allows {}: the KV cache ({} MiB) holds too few sequences at once; raise \
                 --rollout-kv-cache-mb",
                p.preemptions, p.running, self.max_running, self.kv_mb
            );
        }
    }

    fn done(&self) {
        if self.terminal {
            eprintln!();
        }
    }
}

/// Whether the KV cache is what holds the batch back: sequences are being preempted (each
/// prefills again from its start), and while others wait, fewer than half the sequences
/// `max_running` allows fit at once.
fn cache_too_small(p: &Progress, max_running: usize) -> bool {
    let waiting = p.total - p.finished - p.running;
    p.preemptions >= 16 && waiting > 0 && 2 * p.running < max_running
}

pub fn run(args: &GenerateArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    if args.n_samples_per_prompt == 0 {
        bail!("--n-samples-per-prompt: must be at least 1");
    }
    let dir = &args.hf_checkpoint;
    let model = load_model(dir)?;
    let tok = Tokenizer::load(dir).with_context(|| {
        format!("--hf-checkpoint {}: generate needs a tokenizer", dir.display())
    })?;
    let tok = tok.with_chat_kwargs(chat_kwargs(args.apply_chat_template_kwargs.as_deref())?)?;
    let prompts = load_prompts(args, &tok)?;
    let n = args.n_samples_per_prompt;
    let groups: Vec<Vec<Sample>> = prompts
        .into_iter()
        .enumerate()
        .map(|(g, s)| {
            (0..n).map(|i| Sample { group_index: g, index: g * n + i, ..s.clone() }).collect()
        })
        .collect();
    let device = args.engine.device;
    let speculator = speculator(&SpecFlags {
        algorithm: args.sglang_speculative_algorithm,
        num_steps: args.sglang_speculative_num_steps,
        eagle_topk: args.sglang_speculative_eagle_topk,
        num_draft_tokens: args.sglang_speculative_num_draft_tokens,
    })?;
    let draft = place_draft(args, &model, speculator.is_some())?;
    let model = args.engine.place_for_rollout(&model)?;
    let kv_cache_bytes =
        kv_cache_budget(args.rollout_kv_cache_mb, args.rollout_kv_cache_fraction, &device)?;
    let config = EngineConfig {
        kv_cache_bytes,
        max_running: args.rollout_max_running.max(1),
        max_prompt_len: args.rollout_max_prompt_len,
        cuda_graphs: !args.engine.disable_cuda_graph,
        chunked_prefill_size: args.engine.chunked_prefill_size,
        speculator: speculator.map(std::sync::Arc::from),
        ..EngineConfig::default()
    };
    let params = SamplingParams {
        temperature: args.rollout_temperature,
        top_p: args.rollout_top_p,
        top_k: usize::try_from(args.rollout_top_k).unwrap_or(0),
        max_new_tokens: args.rollout_max_response_len,
        stop: args.rollout_stop.clone(),
        stop_token_ids: args.rollout_stop_token_ids.clone(),
        ignore_eos: false,
        seed: args.rollout_seed,
    };
    let kept = if args.resume { read_kept(&args.output, &groups)? } else { Vec::new() };
    let done: std::collections::HashSet<usize> = kept.iter().map(|g| g[0].group_index).collect();
    let todo: Vec<Vec<Sample>> =
        groups.into_iter().filter(|g| !done.contains(&g[0].group_index)).collect();
    if args.resume {
        eprintln!(
            "--resume: {} prompts complete in {}, {} to generate",
            kept.len(),
            args.output.display(),
            todo.len()
        );
    }
    let mut output = Output::create(&args.output, &kept)?;
    let started = Instant::now();
    let t = params.temperature;
    let mut reporter = Reporter::new(kv_cache_bytes >> 20, config.max_running);
    let mut engine = match &draft {
        Some(d) => Engine::with_draft(&model, d, Some(tok), config)?,
        None => Engine::new(&model, Some(tok), config)?,
    };
    let new = engine.generate_speculative(&model, draft.as_ref(), todo, &params, &mut |p| {
        for (_, group) in &p.groups_done {
            output.append(group);
        }
        reporter.report(&p);
        miles_core::Flow::Continue
    })?;
    reporter.done();
    let seconds = started.elapsed().as_secs_f64();
    let new_samples: usize = new.iter().map(Vec::len).sum();
    let new_tokens: usize = new.iter().flatten().map(|s| s.response_length).sum();
    let mut groups = kept;
    groups.extend(new);
    groups.sort_by_key(|g| g[0].group_index);
    output.finish(&groups)?;
    let check = args
        .check_logprobs
        .then(|| check_logprobs(&groups, |b| Ok(model.logprobs(b, t)?.0)))
        .transpose()?;
    let stats = engine.stats().clone();
    let samples: Vec<&Sample> = groups.iter().flatten().collect();
    let count = |st: Status| samples.iter().filter(|s| s.status == st).count();
    writeln!(
        out,
        "generated {new_samples} samples, {new_tokens} tokens in {seconds:.2} s: {:.1} tokens/s \
         (prefill {} tokens, {} preemptions); wrote {} samples ({} completed, {} truncated, {} \
         failed) to {}",
        new_tokens as f64 / seconds.max(1e-9),
        stats.prefill_tokens,
        stats.preemptions,
        samples.len(),
        count(Status::Completed),
        count(Status::Truncated),
        count(Status::Failed),
        args.output.display()
    )?;
    if draft.is_some() {
        let c = stats.spec;
        writeln!(
            out,
            "speculative: {} of {} draft tokens accepted ({:.3}), {:.2} tokens per verification",
            c.accepted,
            c.drafted,
            c.accepted as f64 / c.drafted.max(1) as f64,
            (c.accepted + c.verifies) as f64 / c.verifies.max(1) as f64
        )?;
    }
    if let Some(check) = check {
        writeln!(out, "{check}")?;
    }
    Ok(())
}

fn parse_algorithm(s: &str) -> Result<SpeculativeAlgorithm, String> {
    serde_json::from_value(serde_json::Value::from(s))
        .map_err(|_| format!("{s}: EAGLE (or NEXTN, the same) is the algorithm implemented"))
}

/// The draft of `--sglang-speculative-draft-model-path` for `model`, on the engine's device,
/// when speculating; refuses one flag without the other.
fn place_draft(
    args: &GenerateArgs,
    model: &Model,
    speculating: bool,
) -> anyhow::Result<Option<DeviceModel>> {
    let Some(dir) = &args.sglang_speculative_draft_model_path else {
        if speculating {
            bail!(
                "--sglang-speculative-algorithm: needs --sglang-speculative-draft-model-path \
                 (an MTP layer's safetensors, such as a miles train checkpoint's draft/)"
            );
        }
        if args.sglang_speculative_num_steps.is_some()
            || args.sglang_speculative_eagle_topk.is_some()
            || args.sglang_speculative_num_draft_tokens.is_some()
        {
            bail!(
                "--sglang-speculative-num-steps and its partners take effect only with \
                   --sglang-speculative-algorithm EAGLE"
            );
        }
        return Ok(None);
    };
    if !speculating {
        bail!(
            "--sglang-speculative-draft-model-path: given without \
             --sglang-speculative-algorithm EAGLE, which speculates with it"
        );
    }
    let context = || format!("--sglang-speculative-draft-model-path {}", dir.display());
    let pc = &model.config;
    let draft = Draft::load(dir, pc).with_context(context)?;
    let weights = draft.model_weights(pc, &model.weights).with_context(context)?;
    let config = draft_config(pc).with_context(context)?;
    Ok(Some(args.engine.place(&Model::new(config, weights))?))
}

/// Scores the generated samples with `score` (packed batches of up to 8192 tokens) and says
/// how many have rollout logprobs equal to it bit for bit, and the largest difference.
fn check_logprobs(
    groups: &[Vec<Sample>],
    score: impl Fn(&PackedBatch) -> anyhow::Result<Vec<f32>>,
) -> anyhow::Result<String> {
    let samples: Vec<&Sample> = groups.iter().flatten().filter(|s| s.response_length > 0).collect();
    let (mut same, mut max_diff) = (0, 0f32);
    let mut at = 0;
    while at < samples.len() {
        let mut end = at;
        let mut tokens = 0;
        while end < samples.len() && (end == at || tokens + samples[end].tokens.len() <= 8192) {
            tokens += samples[end].tokens.len();
            end += 1;
        }
        let seqs: Vec<(Vec<u32>, usize)> = samples[at..end]
            .iter()
            .map(|s| Ok((s.tokens.clone(), s.prompt_length()?)))
            .collect::<anyhow::Result<_>>()?;
        let lp = score(&PackedBatch::new(&seqs)?)?;
        let mut row = 0;
        for s in &samples[at..end] {
            let got = &lp[row..row + s.response_length];
            row += s.response_length;
            same += usize::from(
                got.iter().zip(&s.rollout_log_probs).all(|(a, b)| a.to_bits() == b.to_bits()),
            );
            for (a, b) in got.iter().zip(&s.rollout_log_probs) {
                max_diff = max_diff.max((a - b).abs());
            }
        }
        at = end;
    }
    Ok(format!(
        "rollout logprobs equal the scorer's bit for bit on {same} of {} samples (largest \
         difference {max_diff:e})",
        samples.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_kv_warning_comes_when_the_cache_holds_the_batch_back() {
        let at = |preemptions, finished, running| Progress {
            finished,
            total: 512,
            generated_tokens: 0,
            preemptions,
            running,
            blocks_used: 0,
            total_blocks: 1,
            groups_done: Vec::new(),
        };
        // The case (160 MiB for Qwen3-0.6B): two sequences at a time, preempted.
        assert!(cache_too_small(&at(16, 16, 2), 64));
        // A roomy cache preempts now and then with 40 of 64 running: no warning; nor at the
        // end of a run, when nothing waits; nor before 16 preemptions.
        assert!(!cache_too_small(&at(37, 300, 40), 64));
        assert!(!cache_too_small(&at(37, 502, 10), 64));
        assert!(!cache_too_small(&at(15, 10, 2), 64));
    }
}
