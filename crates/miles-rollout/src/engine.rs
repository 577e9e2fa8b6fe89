//! The scheduler: continuous batching over the paged KV cache.
//!
//! Every step runs one forward over a mix of rows: one decode row per running sequence and the
//! whole prompt of each sequence admitted this step. A finished sequence frees its blocks at
//! once and a waiting one takes them at the next step. The samples of one prompt are admitted
//! together: the prompt is prefilled once, its full blocks are shared and each sample gets a
//! copy of the partial last block. When a running sequence needs a block and none is free, the
//! most recently admitted sequence is preempted: its blocks are freed and it waits to be
//! prefilled again with everything it generated (the forward is batch-invariant and the RNG is
//! counter-based, so resuming changes no bit of its result).

use std::collections::VecDeque;
use std::time::Instant;

use miles_core::{Prompt, Rollout, Sample, SamplingParams, Status};
use miles_model::{BlockId, KvCache, Model, PackedLinears, StepRow, Tokenizer, Weights};
use miles_tensor::cpu::{KEY_BLOCK, tempered_log_softmax};
use rayon::prelude::*;

use crate::blocks::BlockAllocator;
use crate::sampler::{Draw, sample, uniform};

/// Limits of the engine (flags `--rollout-kv-cache-mb`, `--rollout-max-running`,
/// `--rollout-max-prefill-tokens`, `--rollout-max-prompt-len`).
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Bytes of KV cache; bounds how many tokens can be cached at once.
    pub kv_cache_bytes: usize,
    /// Most sequences decoding at once.
    pub max_running: usize,
    /// Most prompt tokens prefilled in one step (one longer prompt still runs, alone).
    pub max_prefill_tokens: usize,
    /// Longer prompts are skipped: the sample comes back `Failed` with the reason.
    pub max_prompt_len: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_cache_bytes: 1 << 30,
            max_running: 64,
            max_prefill_tokens: 4096,
            max_prompt_len: None,
        }
    }
}

/// What the engine did, summed over its life.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct EngineStats {
    pub steps: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    pub preemptions: usize,
    /// Most sequences in one step.
    pub peak_running: usize,
    pub skipped_prompts: usize,
    /// Most KV blocks in use at once, out of `total_blocks`.
    pub peak_blocks: usize,
    pub total_blocks: usize,
    /// Seconds in steps that prefilled something, and in pure decode steps.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Seconds from the first `generate` call's start to its first sampled token.
    pub first_token_seconds: Option<f64>,
}

/// Progress reported after every step.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    pub finished: usize,
    pub total: usize,
    pub generated_tokens: usize,
}

pub struct Engine {
    model: Model,
    packed: PackedLinears,
    tokenizer: Option<Tokenizer>,
    config: EngineConfig,
    kv: KvCache,
    stats: EngineStats,
    weight_version: u64,
    /// The weights changed through [`Engine::policy_mut`] and are not repacked yet.
    stale: bool,
}

/// One sequence being generated.
struct Seq {
    /// Where its result goes: (group, member).
    slot: (usize, usize),
    /// Its identity for the RNG.
    key: u64,
    tokens: Vec<u32>,
    prompt_len: usize,
    logprobs: Vec<f32>,
    blocks: Vec<BlockId>,
    admitted: u64,
}

impl Seq {
    fn response_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }
}

/// Sequences admitted together: one sequence, or the samples of one prompt sharing its prefill.
type Unit = Vec<Seq>;

fn blocks_for(tokens: usize) -> usize {
    tokens.div_ceil(KEY_BLOCK)
}

/// Blocks a unit needs to be prefilled: the prompt's, plus one private copy of a partial last
/// block per extra member.
fn unit_blocks(unit: &Unit) -> usize {
    let len = unit[0].tokens.len();
    blocks_for(len) + (unit.len() - 1) * usize::from(!len.is_multiple_of(KEY_BLOCK))
}

fn failed(mut s: Sample, reason: String) -> Sample {
    s.status = Status::Failed;
    if !s.metadata.is_object() {
        s.metadata = serde_json::json!({});
    }
    s.metadata["rollout_error"] = reason.into();
    s
}

impl Engine {
    pub fn new(
        model: Model,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> crate::Result<Self> {
        let per_block = KvCache::bytes_per_block(&model.config);
        let num_blocks = config.kv_cache_bytes / per_block.max(1);
        if num_blocks == 0 {
            return Err(crate::Error::config(
                "rollout-kv-cache-mb",
                format!(
                    "{} bytes hold no KV block of this model ({per_block} bytes per {KEY_BLOCK} tokens)",
                    config.kv_cache_bytes
                ),
            ));
        }
        let kv = KvCache::new(&model.config, num_blocks).map_err(model_error)?;
        let packed = PackedLinears::new(&model).map_err(model_error)?;
        let stats = EngineStats { total_blocks: num_blocks, ..EngineStats::default() };
        Ok(Engine { model, packed, tokenizer, config, kv, stats, weight_version: 0, stale: false })
    }

    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The current policy's packed linears, for scoring with [`Model::logprobs_with`] without
    /// packing again.
    pub fn packed(&self) -> &PackedLinears {
        &self.packed
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// The policy version stamped on samples; grows with every weight update.
    pub fn weight_version(&self) -> u64 {
        self.weight_version
    }

    /// Sets the policy version, e.g. to where a resumed run had got to.
    pub fn set_weight_version(&mut self, version: u64) {
        self.weight_version = version;
    }

    /// The policy itself, for a trainer in the same process to update in place: the one copy
    /// of the weights serves training and rollout (zero-copy weight sync). Call
    /// [`Engine::weights_updated`] before generating again.
    pub fn policy_mut(&mut self) -> &mut Model {
        self.stale = true;
        &mut self.model
    }

    /// Finishes an in-place update: repacks the linears and bumps the policy version.
    pub fn weights_updated(&mut self) -> crate::Result<()> {
        self.model.weights.check(&self.model.config).map_err(model_error)?;
        self.packed = PackedLinears::new(&self.model).map_err(model_error)?;
        self.stale = false;
        self.weight_version += 1;
        Ok(())
    }

    /// The policy, taken out of the engine (the end of a run).
    pub fn into_model(self) -> Model {
        self.model
    }

    /// Weight sync: takes the trainer's new weights (moved, not copied through a file) and
    /// repacks them for the forward kernel.
    pub fn update_weights(&mut self, weights: Weights) -> crate::Result<()> {
        weights.check(&self.model.config).map_err(model_error)?;
        let model = Model::new(self.model.config.clone(), weights);
        // Packed first: a failure leaves the engine on its old policy, whole.
        self.packed = PackedLinears::new(&model).map_err(model_error)?;
        self.model = model;
        self.weight_version += 1;
        Ok(())
    }

    /// Token ids that end a sequence: the config's EOS ids, else the tokenizer's EOS token.
    fn eos_ids(&self) -> Vec<u32> {
        let ids = &self.model.config.eos_token_ids;
        if !ids.is_empty() {
            return ids.clone();
        }
        let tok = self.tokenizer.as_ref();
        tok.and_then(|t| t.eos_token().and_then(|e| t.token_to_id(e))).into_iter().collect()
    }

    /// [`Rollout::generate`] with a callback after every step.
    pub fn generate_with_progress(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        progress: &mut dyn FnMut(Progress),
    ) -> crate::Result<Vec<Vec<Sample>>> {
        check_params(params)?;
        if self.stale {
            return Err(crate::Error::Invalid(
                "the policy changed through policy_mut(); call weights_updated() first".into(),
            ));
        }
        if !params.stop.is_empty() && self.tokenizer.is_none() {
            return Err(crate::Error::config(
                "rollout-stop",
                "stop strings need the checkpoint's tokenizer.json to read the response",
            ));
        }
        let start = Instant::now();
        let eos = if params.ignore_eos { Vec::new() } else { self.eos_ids() };
        let mut run = Run::new(self, groups, params, &eos)?;
        let mut admissions = 0u64;
        while run.remaining > 0 {
            self.grow(&mut run);
            let admitted = self.admit(&mut run, &mut admissions);
            if run.running.is_empty() && admitted.is_empty() {
                return Err(crate::Error::Invalid(
                    "rollout engine: no sequence could be scheduled (this is a bug)".into(),
                ));
            }
            let step_start = Instant::now();
            let draws = self.step(&run.running, &admitted, params)?;
            let seconds = step_start.elapsed().as_secs_f64();
            if admitted.is_empty() {
                self.stats.decode_seconds += seconds;
            } else {
                self.stats.prefill_seconds += seconds;
            }
            self.stats.first_token_seconds.get_or_insert(start.elapsed().as_secs_f64());
            self.stats.steps += 1;
            self.stats.decode_tokens += run.running.len();
            self.stats.prefill_tokens += admitted.iter().map(|u| u[0].tokens.len()).sum::<usize>();
            let (running_draws, unit_draws) = draws.split_at(run.running.len());
            let running = std::mem::take(&mut run.running);
            let mut next: Vec<Seq> = Vec::new();
            for (seq, draw) in running.into_iter().zip(running_draws) {
                next.extend(run.advance(self, seq, draw[0], &eos, params));
            }
            for (unit, draws) in admitted.into_iter().zip(unit_draws) {
                let seqs = self.fork(unit);
                for (seq, draw) in seqs.into_iter().zip(draws) {
                    next.extend(run.advance(self, seq, *draw, &eos, params));
                }
            }
            next.sort_by_key(|s| s.admitted);
            let in_step = draws.iter().map(Vec::len).sum::<usize>();
            self.stats.peak_running = self.stats.peak_running.max(in_step);
            run.running = next;
            self.stats.peak_blocks = self.stats.peak_blocks.max(run.blocks.peak_used());
            progress(Progress {
                finished: run.total - run.remaining,
                total: run.total,
                generated_tokens: run.generated,
            });
        }
        Ok(run.out)
    }

    /// Gives every running sequence the block its next position needs, preempting the most
    /// recently admitted sequences when the cache is full.
    fn grow(&mut self, run: &mut Run) {
        let mut i = 0;
        while i < run.running.len() {
            let needs = run.running[i].tokens.len() - 1 == run.running[i].blocks.len() * KEY_BLOCK;
            if !needs {
                i += 1;
                continue;
            }
            if let Some(b) = run.blocks.allocate() {
                run.running[i].blocks.push(b);
                i += 1;
                continue;
            }
            // Newest first; it may be the sequence asking, which then waits too.
            let victim = run.running.pop().expect("the asking sequence is running");
            run.blocks.release(&victim.blocks);
            let mut victim = victim;
            victim.blocks.clear();
            run.waiting.push_front(vec![victim]);
            self.stats.preemptions += 1;
        }
    }

    /// Takes waiting units while sequences, prefill tokens and blocks allow. Blocks are
    /// allocated here (shared full prompt blocks included), so a step never runs out.
    fn admit(&mut self, run: &mut Run, admissions: &mut u64) -> Vec<Unit> {
        let mut admitted: Vec<Unit> = Vec::new();
        let mut prefill = 0;
        while let Some(unit) = run.waiting.front() {
            let len = unit[0].tokens.len();
            let seqs = run.running.len() + admitted.iter().map(Vec::len).sum::<usize>();
            let need = unit_blocks(unit);
            // Keep a block of headroom per running sequence when others are running, so a
            // newcomer is not preempted at its first decode step.
            let headroom = if seqs == 0 { 0 } else { seqs + unit.len() };
            let fits_blocks = need + headroom <= run.blocks.num_free()
                || (seqs == 0 && need <= run.blocks.num_free());
            let fits_batch = seqs + unit.len() <= self.config.max_running.max(1);
            let fits_prefill =
                prefill + len <= self.config.max_prefill_tokens || admitted.is_empty();
            if !(fits_blocks && fits_batch && fits_prefill) {
                if seqs == 0 && unit.len() > 1 {
                    // Even alone the group does not fit at once: let its samples go one by one.
                    let unit = run.waiting.pop_front().expect("front exists");
                    for seq in unit.into_iter().rev() {
                        run.waiting.push_front(vec![seq]);
                    }
                    continue;
                }
                break;
            }
            let mut unit = run.waiting.pop_front().expect("front exists");
            for _ in 0..blocks_for(len) {
                unit[0].blocks.push(run.blocks.allocate().expect("counted free blocks"));
            }
            let (full, partial) = (len / KEY_BLOCK, !len.is_multiple_of(KEY_BLOCK));
            let shared: Vec<BlockId> = unit[0].blocks[..full].to_vec();
            for seq in &mut unit[1..] {
                for &b in &shared {
                    run.blocks.share(b);
                }
                seq.blocks = shared.clone();
                if partial {
                    seq.blocks.push(run.blocks.allocate().expect("counted free blocks"));
                }
            }
            for seq in &mut unit {
                seq.admitted = *admissions;
                *admissions += 1;
            }
            prefill += len;
            admitted.push(unit);
        }
        admitted
    }

    /// After a unit's prefill: the other members copy the prefilled partial last block.
    fn fork(&mut self, unit: Unit) -> Vec<Seq> {
        let len = unit[0].tokens.len();
        if unit.len() > 1 && !len.is_multiple_of(KEY_BLOCK) {
            let src = *unit[0].blocks.last().expect("a prefilled sequence has blocks");
            for seq in &unit[1..] {
                self.kv.copy_block(src, *seq.blocks.last().expect("allocated at admission"));
            }
        }
        unit
    }

    /// One forward over the running sequences' next positions and the admitted prompts;
    /// returns the draws, one list per running sequence (of one) then per admitted unit.
    fn step(
        &mut self,
        running: &[Seq],
        admitted: &[Unit],
        params: &SamplingParams,
    ) -> crate::Result<Vec<Vec<Option<Draw>>>> {
        let mut rows: Vec<StepRow> = Vec::new();
        let mut sample_rows: Vec<usize> = Vec::new();
        let mut members: Vec<Vec<(u64, usize)>> = Vec::new();
        for seq in running {
            let p = seq.tokens.len() - 1;
            sample_rows.push(rows.len());
            rows.push(StepRow { token: seq.tokens[p], position: p, blocks: &seq.blocks });
            members.push(vec![(seq.key, seq.response_len())]);
        }
        for unit in admitted {
            let lead = &unit[0];
            for (p, &token) in lead.tokens.iter().enumerate() {
                rows.push(StepRow { token, position: p, blocks: &lead.blocks });
            }
            sample_rows.push(rows.len() - 1);
            members.push(unit.iter().map(|s| (s.key, s.response_len())).collect());
        }
        let hidden = self.model.step(&self.packed, &rows, &mut self.kv).map_err(model_error)?;
        let h = self.model.config.hidden_size;
        let picked: Vec<f32> =
            sample_rows.iter().flat_map(|&r| hidden[r * h..(r + 1) * h].iter().copied()).collect();
        let mut logits = self.model.logits(&self.packed, &picked).map_err(model_error)?;
        let vocab = self.model.config.vocab_size;
        let (t, k, p, seed) = (params.temperature, params.top_k, params.top_p, params.seed);
        Ok(logits
            .par_chunks_mut(vocab)
            .zip(&members)
            .map(|(z, members)| {
                let lse = tempered_log_softmax(z, t);
                members
                    .iter()
                    .map(|&(key, step)| sample(z, lse, k, p, uniform(seed, key, step as u64)))
                    .collect()
            })
            .collect())
    }
}

/// The state of one `generate` call.
struct Run {
    out: Vec<Vec<Sample>>,
    waiting: VecDeque<Unit>,
    running: Vec<Seq>,
    blocks: BlockAllocator,
    total: usize,
    remaining: usize,
    generated: usize,
}

impl Run {
    fn new(
        engine: &mut Engine,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        eos: &[u32],
    ) -> crate::Result<Run> {
        let total = groups.iter().map(Vec::len).sum();
        let mut run = Run {
            out: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            blocks: BlockAllocator::new(engine.kv.num_blocks()),
            total,
            remaining: 0,
            generated: 0,
        };
        let capacity = engine.kv.num_blocks() * KEY_BLOCK;
        // A sample's draws are keyed by its index: two samples sharing one would be twins.
        let mut seen = std::collections::HashSet::new();
        if let Some(s) = groups.iter().flatten().find(|s| !seen.insert(s.index)) {
            return Err(crate::Error::Invalid(format!(
                "two samples have index {}: the rollout RNG is keyed by Sample.index, so give \
                 every sample of a batch its own",
                s.index
            )));
        }
        for (g, group) in groups.into_iter().enumerate() {
            let mut unit: Unit = Vec::new();
            let mut samples = Vec::with_capacity(group.len());
            for (m, mut s) in group.into_iter().enumerate() {
                match engine.intake(&mut s, params, eos, capacity) {
                    Err(reason) => {
                        engine.stats.skipped_prompts += 1;
                        samples.push(failed(s, reason));
                        continue;
                    }
                    Ok(None) => samples.push(s), // nothing left to generate
                    Ok(Some(prompt_len)) => {
                        let seq = Seq {
                            slot: (g, m),
                            key: s.index as u64,
                            tokens: s.tokens.clone(),
                            prompt_len,
                            logprobs: s.rollout_log_probs.clone(),
                            blocks: Vec::new(),
                            admitted: 0,
                        };
                        samples.push(s);
                        run.remaining += 1;
                        // Fresh samples of one prompt share its prefill.
                        let joins = unit.first().is_some_and(|u: &Seq| {
                            u.tokens == seq.tokens
                                && u.response_len() == 0
                                && seq.response_len() == 0
                        });
                        let full = unit.len() >= engine.config.max_running.max(1);
                        if (!joins || full) && !unit.is_empty() {
                            run.waiting.push_back(std::mem::take(&mut unit));
                        }
                        unit.push(seq);
                    }
                }
            }
            if !unit.is_empty() {
                run.waiting.push_back(unit);
            }
            run.out.push(samples);
        }
        Ok(run)
    }

    /// Appends a draw; a finished sequence frees its blocks and fills its sample.
    fn advance(
        &mut self,
        engine: &Engine,
        mut seq: Seq,
        draw: Option<Draw>,
        eos: &[u32],
        params: &SamplingParams,
    ) -> Option<Seq> {
        let status = match draw {
            None => Err("the model produced non-finite logits".to_string()),
            Some(d) => {
                seq.tokens.push(d.token);
                seq.logprobs.push(d.logprob);
                self.generated += 1;
                Ok(finish_status(engine, &seq, d.token, eos, params))
            }
        };
        if matches!(status, Ok(None)) {
            return Some(seq);
        }
        self.blocks.release(&seq.blocks);
        self.remaining -= 1;
        let (g, m) = seq.slot;
        let s = std::mem::take(&mut self.out[g][m]);
        self.out[g][m] = match status {
            Err(reason) => failed(s, reason),
            Ok(status) => engine.finish(s, seq, status.expect("finished")),
        };
        None
    }
}

/// Whether `seq` stops after its newest token `token`, and how.
fn finish_status(
    engine: &Engine,
    seq: &Seq,
    token: u32,
    eos: &[u32],
    params: &SamplingParams,
) -> Option<Status> {
    if eos.contains(&token) || params.stop_token_ids.contains(&token) {
        return Some(Status::Completed);
    }
    if !params.stop.is_empty()
        && let Some(tok) = engine.tokenizer.as_ref()
        && let Ok(text) = tok.decode(&seq.tokens[seq.prompt_len..], false)
        && params.stop.iter().any(|s| text.contains(s.as_str()))
    {
        return Some(Status::Completed);
    }
    (seq.response_len() >= params.max_new_tokens).then_some(Status::Truncated)
}

impl Engine {
    /// Prepares a sample for generation: its prompt tokens (encoding a text prompt when no
    /// tokens are given) and checks. `Ok(Some(prompt_len))` to generate, `Ok(None)` when it is
    /// already done, `Err(reason)` to skip it.
    fn intake(
        &self,
        s: &mut Sample,
        params: &SamplingParams,
        eos: &[u32],
        capacity: usize,
    ) -> Result<Option<usize>, String> {
        let max_new = params.max_new_tokens;
        if let Some(meta) = s.metadata.as_object_mut() {
            meta.remove("rollout_error");
        }
        let resuming = s.status == Status::Aborted && s.response_length > 0;
        if resuming && s.tokens.is_empty() {
            return Err("an aborted sample to continue needs its prompt and partial response in \
                        `tokens`"
                .into());
        }
        if !resuming {
            s.tokens.truncate(s.tokens.len() - s.response_length.min(s.tokens.len()));
            s.response_length = 0;
            s.rollout_log_probs.clear();
        }
        if s.tokens.is_empty() {
            match (&s.prompt, &self.tokenizer) {
                (Prompt::Text(text), Some(tok)) => {
                    s.tokens = tok.encode(text, true).map_err(|e| e.to_string())?;
                }
                _ => return Err("the sample has no prompt tokens".into()),
            }
        }
        let prompt_len = s.prompt_length().map_err(|e| e.to_string())?;
        if prompt_len == 0 {
            return Err("the prompt is empty".into());
        }
        if let Some(max) = self.config.max_prompt_len
            && prompt_len > max
        {
            return Err(format!(
                "the prompt has {prompt_len} tokens, more than --rollout-max-prompt-len {max}"
            ));
        }
        if let Some(&bad) = s.tokens.iter().find(|&&t| t as usize >= self.model.config.vocab_size) {
            return Err(format!("token id {bad} is outside the model's vocabulary"));
        }
        if s.rollout_log_probs.len() != s.response_length {
            return Err(format!(
                "{} rollout_log_probs for a partial response of {} tokens",
                s.rollout_log_probs.len(),
                s.response_length
            ));
        }
        // A partial response that already ended (EOS or a stop id last) is complete.
        let last = s.tokens.last().filter(|_| s.response_length > 0);
        if last.is_some_and(|t| eos.contains(t) || params.stop_token_ids.contains(t)) {
            s.status = Status::Completed;
            return Ok(None);
        }
        if s.response_length >= max_new {
            s.status = Status::Truncated;
            return Ok(None);
        }
        // The last sampled token is never cached.
        if prompt_len + max_new - 1 > capacity {
            return Err(format!(
                "{prompt_len} prompt + {max_new} response tokens do not fit the KV cache of \
                 {capacity} tokens; raise --rollout-kv-cache-mb"
            ));
        }
        Ok(Some(prompt_len))
    }

    fn finish(&self, mut s: Sample, seq: Seq, status: Status) -> Sample {
        let response = &seq.tokens[seq.prompt_len..];
        s.response = match &self.tokenizer {
            Some(tok) => tok.decode(response, true).unwrap_or_default(),
            None => String::new(),
        };
        s.response_length = response.len();
        // A continued response keeps the mask of its earlier part (tool output stays masked).
        let earlier = s.response_length.min(s.loss_mask.len());
        s.loss_mask.truncate(earlier);
        s.loss_mask.resize(response.len(), 1);
        s.tokens = seq.tokens;
        s.rollout_log_probs = seq.logprobs;
        s.status = status;
        s.weight_version = self.weight_version;
        s
    }
}

fn check_params(p: &SamplingParams) -> crate::Result<()> {
    if p.temperature.is_nan() || p.temperature <= 0.0 {
        return Err(crate::Error::config(
            "rollout-temperature",
            format!("{} must be > 0 (greedy decoding is --rollout-top-k 1)", p.temperature),
        ));
    }
    if p.top_p.is_nan() || p.top_p <= 0.0 || p.top_p > 1.0 {
        return Err(crate::Error::config(
            "rollout-top-p",
            format!("{} is outside (0, 1]", p.top_p),
        ));
    }
    if p.max_new_tokens == 0 {
        return Err(crate::Error::config("rollout-max-response-len", "must be at least 1"));
    }
    if p.stop.iter().any(String::is_empty) {
        return Err(crate::Error::config(
            "rollout-stop",
            "an empty stop string would end every sample",
        ));
    }
    Ok(())
}

fn model_error(e: miles_model::Error) -> crate::Error {
    crate::Error::Invalid(format!("rollout engine: {e}"))
}

impl Rollout for Engine {
    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        self.generate_with_progress(groups, params, &mut |_| {})
    }
}
