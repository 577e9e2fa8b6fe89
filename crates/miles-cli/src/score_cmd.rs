use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, bail};
use clap::Args;
use miles_model::{DeviceModel, Model, PackedBatch, Tokenizer};
use miles_tensor::{DType, Device};

use crate::common::{DTypeArg, chat_kwargs, load_model, parse_device};
use serde_json::Value;

use crate::jsonl;

#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// HF checkpoint directory: config.json, model.safetensors (or shards), tokenizer.json.
    #[arg(long, value_name = "DIR")]
    pub hf_checkpoint: PathBuf,
    /// JSONL: `prompt` (text or chat messages) and `response` per line, or exact `tokens` with
    /// `response_length` (as `miles generate` writes them).
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Where to write the per-token logprobs (JSONL); standard output when absent.
    #[arg(long, value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Key of the prompt in each line.
    #[arg(long, default_value = "prompt")]
    pub input_key: String,
    /// Render prompts through the tokenizer's chat template (generation prompt appended).
    #[arg(long)]
    pub apply_chat_template: bool,
    /// Extra variables of the chat template, a JSON object (`'{"enable_thinking": false}'`).
    #[arg(long)]
    pub apply_chat_template_kwargs: Option<String>,
    /// Temperature of the distribution the logprobs are taken from (the rollout's).
    #[arg(long = "rollout-temperature", default_value_t = 1.0)]
    pub temperature: f32,
    /// Tokens per packed forward pass.
    #[arg(long, default_value_t = 8192)]
    pub max_tokens_per_batch: usize,
    /// Where the model runs: cpu, cuda (device 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Compute dtype on a GPU (the CPU computes in f32).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
    /// Also write the experts each token was routed to (Qwen3-MoE), as `routed_experts` in
    /// `rollout_routed_experts`' layout: every position but the last, so it compares with
    /// what `miles generate` recorded.
    #[arg(long)]
    pub routed_experts: bool,
}

/// The model where `--device` puts it (f32 on the CPU, `--dtype` on a GPU).
struct Scorer(DeviceModel);

impl Scorer {
    fn new(model: Model, args: &ScoreArgs) -> anyhow::Result<Self> {
        let device = args.device;
        device.ensure_available().with_context(|| format!("--device {device}"))?;
        let dtype = if device == Device::Cpu { DType::F32 } else { args.dtype.dtype() };
        Ok(Scorer(DeviceModel::new(&model, &device, dtype)?))
    }

    /// Logprobs and entropies, and with `routed` the experts of every token.
    #[allow(clippy::type_complexity)]
    fn logprobs(
        &self,
        batch: &PackedBatch,
        temperature: f32,
        routed: bool,
    ) -> anyhow::Result<(Vec<f32>, Vec<f32>, Option<Vec<u16>>)> {
        if !routed {
            let (lp, ent) = self.0.logprobs(batch, temperature)?;
            return Ok((lp, ent, None));
        }
        let f = self.0.forward(batch, temperature)?;
        let experts = f.routed_experts().ok_or_else(|| {
            anyhow::anyhow!(
                "--routed-experts: {} has no experts to report",
                self.0.config.architecture.hf_class()
            )
        })?;
        Ok((f.logp, f.entropy, Some(experts)))
    }
}

/// One line of `miles score`'s output. Serialized field by field, so each f32 is written in
/// its shortest form, as `miles generate` writes `rollout_log_probs`: a reader that parses
/// JSON numbers as f64 (Python) then sees equal numbers where the f32 are equal. (Through
/// `json!` they would be widened to f64 first and printed with all of the f64's digits.)
#[derive(serde::Serialize)]
struct ScoredRow<'a> {
    line: usize,
    prompt_length: usize,
    response_length: usize,
    response_tokens: &'a [u32],
    log_probs: &'a [f32],
    entropy: &'a [f32],
    sum_log_prob: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    routed_experts: Option<miles_core::RoutedExperts>,
}

/// One line to score: its number, the tokens and where the response starts.
struct Item {
    line: usize,
    tokens: Vec<u32>,
    prompt_len: usize,
}

fn tokenize(
    line: usize,
    obj: &serde_json::Map<String, Value>,
    args: &ScoreArgs,
    tok: &Option<Tokenizer>,
) -> anyhow::Result<Item> {
    let at = || format!("{}:{line}", args.input.display());
    if let Some(tokens) = obj.get("tokens") {
        let tokens: Vec<u32> = serde_json::from_value(tokens.clone())
            .with_context(|| format!("{}: `tokens` must be a list of token ids", at()))?;
        let response_length = obj
            .get("response_length")
            .and_then(Value::as_u64)
            .with_context(|| format!("{}: `tokens` needs `response_length`", at()))?
            as usize;
        if response_length >= tokens.len() {
            bail!(
                "{}: response_length {response_length} leaves no prompt token of {}",
                at(),
                tokens.len()
            );
        }
        return Ok(Item { line, prompt_len: tokens.len() - response_length, tokens });
    }
    let tok = tok
        .as_ref()
        .with_context(|| format!("{}: text input needs tokenizer.json in --hf-checkpoint", at()))?;
    let prompt = obj
        .get(&args.input_key)
        .with_context(|| format!("{}: missing key '{}'", at(), args.input_key))?;
    let response = obj
        .get("response")
        .and_then(Value::as_str)
        .with_context(|| format!("{}: missing string key 'response'", at()))?;
    let mut ids = tok
        .encode_prompt(prompt, args.apply_chat_template)
        .with_context(|| format!("{}: key '{}'", at(), args.input_key))?;
    if ids.is_empty() {
        bail!(
            "{}: the prompt is empty after tokenization; a response needs at least one token before it",
            at()
        );
    }
    let prompt_len = ids.len();
    ids.extend(tok.encode(response, false)?);
    Ok(Item { line, tokens: ids, prompt_len })
}

pub fn run(args: &ScoreArgs, out: &mut dyn Write) -> anyhow::Result<()> {
    let lines = jsonl::read_objects(&args.input)?;
    let dir = &args.hf_checkpoint;
    let model = load_model(dir)?;
    // (sparse layers, top-k) of a mixture-of-experts model, for --routed-experts.
    let model_moe = model.config.moe.as_ref().map(|m| {
        let c = &model.config;
        ((0..c.num_hidden_layers).filter(|&l| m.is_sparse(l)).count(), m.num_experts_per_tok)
    });
    let scorer = Scorer::new(model, args)?;
    let kwargs = chat_kwargs(args.apply_chat_template_kwargs.as_deref())?;
    let tokenizer = match dir.join("tokenizer.json").exists() {
        true => Some(Tokenizer::load(dir)?.with_chat_kwargs(kwargs)?),
        false => None,
    };
    let items: Vec<Item> = lines
        .iter()
        .map(|l| tokenize(l.number, &l.object, args, &tokenizer))
        .collect::<anyhow::Result<_>>()?;

    let mut rendered = String::new();
    let mut start = 0;
    while start < items.len() {
        // Pack whole sequences up to the token budget (at least one per batch).
        let mut end = start;
        let mut tokens = 0;
        while end < items.len()
            && (end == start || tokens + items[end].tokens.len() <= args.max_tokens_per_batch)
        {
            tokens += items[end].tokens.len();
            end += 1;
        }
        let group = &items[start..end];
        let pairs: Vec<(Vec<u32>, usize)> =
            group.iter().map(|i| (i.tokens.clone(), i.prompt_len)).collect();
        let batch = PackedBatch::new(&pairs)?;
        let (logp, entropy, experts) =
            scorer.logprobs(&batch, args.temperature, args.routed_experts)?;
        let moe = model_moe.as_ref();
        let row_width = moe.map_or(0, |(layers, k)| layers * k);
        let mut offset = 0;
        let mut token_at = 0;
        for item in group {
            let n = item.tokens.len() - item.prompt_len;
            let (lp, ent) = (&logp[offset..offset + n], &entropy[offset..offset + n]);
            offset += n;
            let row = ScoredRow {
                line: item.line,
                prompt_length: item.prompt_len,
                response_length: n,
                response_tokens: &item.tokens[item.prompt_len..],
                log_probs: lp,
                entropy: ent,
                sum_log_prob: lp.iter().map(|v| f64::from(*v)).sum::<f64>(),
                routed_experts: experts.as_ref().zip(moe).map(|(ids, &(num_layers, top_k))| {
                    let positions = item.tokens.len() - 1;
                    let ids =
                        ids[token_at * row_width..(token_at + positions) * row_width].to_vec();
                    miles_core::RoutedExperts { num_layers, top_k, ids }
                }),
            };
            token_at += item.tokens.len();
            rendered.push_str(&serde_json::to_string(&row)?);
            rendered.push('\n');
        }
        start = end;
    }
    match &args.output {
        Some(path) => {
            std::fs::write(path, rendered)
                .with_context(|| format!("cannot write {}", path.display()))?;
            writeln!(
                out,
                "scored {} sequences with {}, wrote {}",
                items.len(),
                dir.display(),
                path.display()
            )?;
        }
        None => out.write_all(rendered.as_bytes())?,
    }
    Ok(())
}
