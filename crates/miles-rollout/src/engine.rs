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
use std::sync::Arc;
use std::time::Instant;

use miles_core::{
    Flow, Prompt, Rollout, RoutedExperts, Sample, SamplingParams, Speculator, Status,
};
use miles_model::{BlockId, DeviceModel, StepRow, Tokenizer};
use miles_tensor::cpu::KEY_BLOCK;

use crate::blocks::BlockAllocator;
use crate::policy::{DrawRequest, Policy, model_error};
use crate::sampler::{Draw, uniform};

mod speculative;
use speculative::{DraftFeed, SpecCounts};

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
    /// Replay decode steps as CUDA graphs (flag `--disable-cuda-graph` turns it off).
    pub cuda_graphs: bool,
    /// Prefill tokens per step when set (SGLang's `--chunked-prefill-size`): a longer prompt is
    /// prefilled over several steps, beside the decode rows of the others.
    pub chunked_prefill_size: Option<usize>,
    /// The speculative scheme of an engine with a draft ([`Engine::with_draft`]): how many
    /// tokens the draft proposes and which a verification keeps (the `eagle-spec` plugin).
    pub speculator: Option<Arc<dyn Speculator>>,
    /// Waits for the device at the end of each phase of a speculative step, so that
    /// [`SpecPhases`] holds each phase's device time as well as its queuing (`miles bench
    /// rollout --spec-phase-sync`: it slows the step, for finding where the time goes).
    pub spec_phase_sync: bool,
    /// Runs each speculative step whose sequences all propose the full chain as one CUDA
    /// graph ([`miles_model::SpecGraphs`]; `miles bench rollout --spec-step-graphs`). Off by
    /// default: on the H100 it is slower than the phased step (the replay waits ~1.4 ms
    /// beyond the graph's device time) and its sampled runs draw other tokens than the
    /// phased step's (issue 30); the phased step's parts replay graphs of their own.
    pub spec_step_graphs: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            kv_cache_bytes: 1 << 30,
            max_running: 64,
            max_prefill_tokens: 4096,
            max_prompt_len: None,
            cuda_graphs: true,
            chunked_prefill_size: None,
            speculator: None,
            spec_phase_sync: false,
            spec_step_graphs: false,
        }
    }
}

fn replay_seconds(
    captured: &crate::policy::Captured,
    iters: u64,
) -> crate::Result<Vec<(usize, f64)>> {
    match &captured.graphs {
        Some(g) => g.replay_seconds(iters).map_err(model_error),
        None => Ok(Vec::new()),
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
    /// Samples ended unfinished because a caller aborted the call ([`Flow::Abort`]) or their
    /// request ([`Job::Abort`]).
    pub aborted: usize,
    /// Most KV blocks in use at once, out of `total_blocks`.
    pub peak_blocks: usize,
    pub total_blocks: usize,
    /// Seconds in steps that prefilled something, and in pure decode steps.
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Seconds from the first `generate` call's start to its first sampled token.
    pub first_token_seconds: Option<f64>,
    /// Speculative decoding: verifications, draft tokens proposed and kept.
    pub spec: SpecCounts,
    /// Host seconds of the speculative steps' phases ([`SpecPhases`]).
    pub spec_phases: SpecPhases,
}

/// Where a speculative step's time goes, in host seconds summed over the steps: queuing the
/// draft's rounds, queuing the verifying forward, queuing the heads and the verification, and
/// waiting for the device to finish them (then the bookkeeping). The first three are the
/// host's own cost (the device runs behind it); the last is what the device had left.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpecPhases {
    /// Speculative steps without prompts, timed by phase (eager ones).
    pub steps: usize,
    /// Speculative steps replayed as one captured graph each, and their host seconds: laying
    /// out the rows and gathering the draft's feeds, loading the graph's inputs, replaying it
    /// and reading back (the device's time), and the bookkeeping after.
    pub captured: usize,
    pub captured_prepare: f64,
    pub captured_load: f64,
    pub captured_replay: f64,
    pub captured_after: f64,
    /// Whole-step graphs captured (each batch bucket once, again for wider block tables).
    pub captures: usize,
    /// Whether a capture failed (its bucket's steps then run the same body eagerly).
    pub capture_failed: bool,
    pub propose: f64,
    pub forward: f64,
    pub verify: f64,
    pub wait: f64,
}

/// Progress reported after every step, with the groups it completed.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// Samples finished, of `total`.
    pub finished: usize,
    pub total: usize,
    pub generated_tokens: usize,
    /// Preemptions so far in this call (each one a prefill to run again).
    pub preemptions: usize,
    /// Sequences running after this step.
    pub running: usize,
    /// KV blocks in use now, of `total_blocks`.
    pub blocks_used: usize,
    pub total_blocks: usize,
    /// Groups whose every sample is now final, each once in the call (its index among the
    /// call's groups, its samples): a caller can keep them before the call returns.
    pub groups_done: Vec<(usize, &'a [Sample])>,
}

/// The rollout engine: the scheduler and its [`Policy`] (the KV cache) for one
/// [`DeviceModel`], on the CPU or a GPU. The model is lent for each call
/// ([`Engine::generate`], or [`Engine::lend`] for a [`Rollout`]): the trainer owns it, and its
/// optimizer steps are the rollouts' new weights (zero-copy weight sync).
pub struct Engine {
    policy: Policy,
    tokenizer: Option<Tokenizer>,
    config: EngineConfig,
    stats: EngineStats,
    weight_version: u64,
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
    /// The experts each position run so far was routed to (mixture of experts; empty else).
    routes: Vec<u16>,
    blocks: Vec<BlockId>,
    admitted: u64,
    /// What its draft has not seen yet (speculative decoding; `None` until prefilled).
    feed: Option<DraftFeed>,
    spec: SpecCounts,
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
    /// The engine for `model`: its KV cache on the model's device in the model's compute
    /// dtype; the forward, the LM head and the sampler run there too.
    pub fn new(
        model: &DeviceModel,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> crate::Result<Self> {
        let policy = Policy::new(model, config.kv_cache_bytes, config.cuda_graphs)?;
        let stats = EngineStats { total_blocks: policy.num_blocks(), ..EngineStats::default() };
        Ok(Engine { policy, tokenizer, config, stats, weight_version: 0 })
    }

    /// A speculative engine: `draft` (a one-layer MTP draft of `model`,
    /// [`miles_model::draft`]) proposes the `config.speculator`'s number of tokens per
    /// sequence and step, which one forward of the policy verifies; its keys and values take
    /// a cache of their own beside the policy's, in the same blocks and the same budget.
    pub fn with_draft(
        model: &DeviceModel,
        draft: &DeviceModel,
        tokenizer: Option<Tokenizer>,
        config: EngineConfig,
    ) -> crate::Result<Self> {
        speculative::check_draft(model, draft, config.speculator.as_deref())?;
        let policy = Policy::with_draft(model, draft, config.kv_cache_bytes, config.cuda_graphs)?;
        let stats = EngineStats { total_blocks: policy.num_blocks(), ..EngineStats::default() };
        Ok(Engine { policy, tokenizer, config, stats, weight_version: 0 })
    }

    /// The engine with `model` lent to it: the [`Rollout`] of a loop that owns its model.
    pub fn lend<'a>(&'a mut self, model: &'a DeviceModel) -> Lent<'a> {
        Lent { engine: self, model, draft: None }
    }

    /// [`Engine::lend`] with the draft of a speculative engine ([`Engine::with_draft`]).
    pub fn lend_with_draft<'a>(
        &'a mut self,
        model: &'a DeviceModel,
        draft: &'a DeviceModel,
    ) -> Lent<'a> {
        Lent { engine: self, model, draft: Some(draft) }
    }

    /// The model's weights changed (a trainer's step, or new weights set from elsewhere):
    /// samples generated from now on carry the next policy version.
    pub fn weights_updated(&mut self) {
        self.weight_version += 1;
    }

    /// Device seconds of one replay of each captured decode step, `(rows, seconds)`
    /// ([`miles_model::DecodeGraphs::replay_seconds`]); empty without graphs. For benchmarks.
    pub fn decode_replay_seconds(&self, iters: u64) -> crate::Result<Vec<(usize, f64)>> {
        replay_seconds(&self.policy.graphs, iters)
    }

    /// [`Engine::decode_replay_seconds`] of a speculative step's graphs: the policy's
    /// verifying forwards, the draft's proposal rounds (of eager steps), and whole steps.
    pub fn spec_replay_seconds(&self, iters: u64) -> crate::Result<[Vec<(usize, f64)>; 3]> {
        let p = &self.policy;
        let whole = match &p.spec_graphs {
            Some(g) => g.replay_seconds(iters).map_err(model_error)?,
            None => Vec::new(),
        };
        Ok([
            replay_seconds(&p.verify_graphs, iters)?,
            replay_seconds(&p.draft_graphs, iters)?,
            whole,
        ])
    }

    pub fn tokenizer(&self) -> Option<&Tokenizer> {
        self.tokenizer.as_ref()
    }

    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    /// Starts the statistics afresh (after a warm-up call).
    pub fn reset_stats(&mut self) {
        self.stats =
            EngineStats { total_blocks: self.policy.num_blocks(), ..EngineStats::default() };
    }

    /// The policy version stamped on samples; grows with every weight update.
    pub fn weight_version(&self) -> u64 {
        self.weight_version
    }

    /// Token ids that end a sequence: the config's EOS ids, else the tokenizer's EOS token.
    fn eos_ids(&self) -> Vec<u32> {
        let ids = &self.policy.config().eos_token_ids;
        if !ids.is_empty() {
            return ids.clone();
        }
        let tok = self.tokenizer.as_ref();
        tok.and_then(|t| t.eos_token().and_then(|e| t.token_to_id(e))).into_iter().collect()
    }

    /// Responses for `groups` from `model` (the one the engine was built for): every sample
    /// gets its tokens, rollout logprobs and status ([`Rollout::generate`]).
    pub fn generate(
        &mut self,
        model: &DeviceModel,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        self.generate_with_progress(model, groups, params, &mut |_| Flow::Continue)
    }

    /// [`Engine::generate`] with a callback after every step. When it answers
    /// [`Flow::Abort`], every sequence still waiting or running ends there, its blocks freed
    /// and its sample `Aborted` with the tokens and logprobs generated so far.
    pub fn generate_with_progress(
        &mut self,
        model: &DeviceModel,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        progress: &mut dyn FnMut(Progress<'_>) -> Flow,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        self.generate_speculative(model, None, groups, params, progress)
    }

    /// [`Engine::generate_with_progress`] with the draft of a speculative engine: each step
    /// the draft proposes and the policy verifies, so a sequence advances by one to
    /// `speculative_steps + 1` tokens, distributed as the policy's own draws and with its
    /// logprobs ([`Speculator::verify`]).
    pub fn generate_speculative(
        &mut self,
        model: &DeviceModel,
        draft: Option<&DeviceModel>,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        progress: &mut dyn FnMut(Progress<'_>) -> Flow,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        self.policy.check(model)?;
        match draft {
            Some(d) => self.policy.check_draft(d)?,
            None if self.policy.has_draft() => {
                return Err(crate::Error::Invalid(
                    "rollout engine: a speculative engine generates with its draft \
                     (Engine::lend_with_draft, Engine::generate_speculative)"
                        .into(),
                ));
            }
            None => {}
        }
        check_params(params)?;
        if self.config.chunked_prefill_size == Some(0) {
            return Err(crate::Error::config("rollout-chunked-prefill-size", "must be at least 1"));
        }
        if !params.stop.is_empty() && self.tokenizer.is_none() {
            return Err(crate::Error::config(
                "rollout-stop",
                "stop strings need the checkpoint's tokenizer.json to read the response",
            ));
        }
        let eos = if params.ignore_eos { Vec::new() } else { self.eos_ids() };
        let run = Run::new(self, groups, params, &eos)?;
        self.drive((model, draft), run, (params, &eos), progress, &mut |_, _| None)
    }

    /// The steps of a call until every sample is final: before each, `intake` may add groups
    /// (`idle`: none is left to generate; then `None` ends the call) and name groups to abort.
    fn drive(
        &mut self,
        (model, draft): (&DeviceModel, Option<&DeviceModel>),
        mut run: Run,
        (params, eos): (&SamplingParams, &[u32]),
        progress: &mut dyn FnMut(Progress<'_>) -> Flow,
        intake: &mut Intake<'_>,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        let start = Instant::now();
        let preempted_before = self.stats.preemptions;
        let mut admissions = 0u64;
        let mut aborts = Vec::new();
        loop {
            if let Some(groups) = intake(run.remaining == 0, &mut aborts) {
                run.add(self, groups, params, eos)?;
            }
            if !aborts.is_empty() {
                self.stats.aborted += run.abort_groups(self, &aborts);
                aborts.clear();
            }
            if run.remaining == 0 {
                break;
            }
            self.grow(&mut run, params);
            let admitted = self.admit(&mut run, &mut admissions);
            let chunk = self.chunk(&run, &admitted);
            if run.running.is_empty() && admitted.is_empty() && chunk.is_none() {
                return Err(crate::Error::Invalid(
                    "rollout engine: no sequence could be scheduled (this is a bug)".into(),
                ));
            }
            let step_start = Instant::now();
            let prefilling = run.prefilling.as_ref().map(|(unit, _)| unit);
            let in_chunk = prefilling.zip(chunk.clone());
            let chunked = in_chunk.as_ref().map(|(_, c)| c.clone());
            let out = match draft {
                Some(d) => self.spec_step((model, d), &run.running, &admitted, in_chunk, params)?,
                None => self.step(model, &run.running, &admitted, in_chunk, params)?,
            };
            let StepOut { mut draws, routes, running_rows, feeds } = out;
            let mut admitted = admitted;
            if !routes.is_empty() {
                record_routes(&routes, &mut run, &mut admitted, chunked, &running_rows, &draws);
            }
            let seconds = step_start.elapsed().as_secs_f64();
            let prefilled: usize = admitted.iter().map(|u| u[0].tokens.len()).sum::<usize>()
                + chunk.as_ref().map_or(0, ExactSizeIterator::len);
            if prefilled == 0 {
                self.stats.decode_seconds += seconds;
            } else {
                self.stats.prefill_seconds += seconds;
            }
            self.stats.first_token_seconds.get_or_insert(start.elapsed().as_secs_f64());
            self.stats.steps += 1;
            self.stats.decode_tokens += running_rows.iter().sum::<usize>();
            self.stats.prefill_tokens += prefilled;
            // Sequences: one per running, one per admitted member (a chunk's only at its end).
            let in_step =
                run.running.len() + draws[run.running.len()..].iter().map(Vec::len).sum::<usize>();
            // A chunked prompt's last chunk: its samples have drawn their first tokens.
            let mut units = admitted;
            if let Some(c) = chunk {
                let (unit, done) = run.prefilling.as_mut().expect("a chunk of the prefilling unit");
                *done = c.end;
                if c.end == unit[0].tokens.len() {
                    units.push(run.prefilling.take().expect("checked above").0);
                } else {
                    draws.pop();
                }
            }
            let (running_draws, unit_draws) = draws.split_at(run.running.len());
            let running = std::mem::take(&mut run.running);
            let mut feeds = feeds.into_iter();
            let mut next: Vec<Seq> = Vec::new();
            for (mut seq, draws) in running.into_iter().zip(running_draws) {
                if let Some(f) = feeds.next() {
                    seq.spec.add(f.counts, &mut self.stats.spec);
                    seq.feed = f.feed;
                }
                next.extend(run.advance_by(self, seq, draws, eos, params));
            }
            for (unit, draws) in units.into_iter().zip(unit_draws) {
                let seqs = self.fork(unit)?;
                for (mut seq, draw) in seqs.into_iter().zip(draws) {
                    seq.feed = feeds.next().and_then(|f| f.feed);
                    next.extend(run.advance(self, seq, *draw, eos, params));
                }
            }
            next.sort_by_key(|s| s.admitted);
            self.stats.peak_running = self.stats.peak_running.max(in_step);
            run.running = next;
            self.stats.peak_blocks = self.stats.peak_blocks.max(run.blocks.peak_used());
            if progress(run.progress(self.stats.preemptions - preempted_before)) == Flow::Abort {
                self.stats.aborted += run.abort(self);
                return Ok(run.out);
            }
        }
        if !run.done_now.is_empty() {
            // Groups with nothing to generate, when no step ran.
            progress(run.progress(0));
        }
        Ok(run.out)
    }

    /// Gives every running sequence the block its next position needs, preempting the most
    /// recently admitted sequences when the cache is full.
    fn grow(&mut self, run: &mut Run, params: &SamplingParams) {
        let mut i = 0;
        while i < run.running.len() {
            // Positions up to the newest token's plus the draft tokens verified after it.
            let s = &run.running[i];
            let needs = s.tokens.len() + self.lookahead(s, params) > s.blocks.len() * KEY_BLOCK;
            if !needs {
                i += 1;
                continue;
            }
            if let Some(b) = run.blocks.allocate() {
                run.running[i].blocks.push(b);
                continue;
            }
            // Newest first; it may be the sequence asking, which then waits too.
            let victim = run.running.pop().expect("the asking sequence is running");
            run.blocks.release(&victim.blocks);
            let mut victim = victim;
            victim.blocks.clear();
            victim.feed = None;
            run.waiting.push_front(vec![victim]);
            self.stats.preemptions += 1;
        }
    }

    /// Takes waiting units while sequences, prefill tokens and blocks allow. Blocks are
    /// allocated here (shared full prompt blocks included), so a step never runs out.
    fn admit(&mut self, run: &mut Run, admissions: &mut u64) -> Vec<Unit> {
        let mut admitted: Vec<Unit> = Vec::new();
        let chunk_size = self.config.chunked_prefill_size;
        let max_prefill = chunk_size.unwrap_or(self.config.max_prefill_tokens);
        // What the prompt being prefilled in chunks takes of this step's budget.
        let mut prefill = match (&run.prefilling, chunk_size) {
            (Some((unit, done)), Some(size)) => (unit[0].tokens.len() - done).min(size),
            _ => 0,
        };
        while let Some(unit) = run.waiting.front() {
            let len = unit[0].tokens.len();
            // Longer than a chunk: prefilled over several steps, one such prompt at a time.
            let chunked = chunk_size.is_some_and(|size| len > size);
            if chunked && (run.prefilling.is_some() || prefill >= max_prefill) {
                break;
            }
            let seqs = run.running.len()
                + admitted.iter().map(Vec::len).sum::<usize>()
                + run.prefilling.as_ref().map_or(0, |(u, _)| u.len());
            let need = unit_blocks(unit);
            // Keep a block of headroom per running sequence when others are running, so a
            // newcomer is not preempted at its first decode step.
            let headroom = if seqs == 0 { 0 } else { seqs + unit.len() };
            let fits_blocks = need + headroom <= run.blocks.num_free()
                || (seqs == 0 && need <= run.blocks.num_free());
            let fits_batch = seqs + unit.len() <= self.config.max_running.max(1);
            let fits_prefill = chunked
                || prefill + len <= max_prefill
                || (admitted.is_empty() && run.prefilling.is_none());
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
            if chunked {
                run.prefilling = Some((unit, 0));
                break;
            }
            prefill += len;
            admitted.push(unit);
        }
        admitted
    }

    /// The positions of the chunked prompt prefilled this step: what the chunk size leaves
    /// after the prompts admitted whole.
    fn chunk(&self, run: &Run, admitted: &[Unit]) -> Option<std::ops::Range<usize>> {
        let (unit, done) = run.prefilling.as_ref()?;
        let size = self.config.chunked_prefill_size?;
        let taken: usize = admitted.iter().map(|u| u[0].tokens.len()).sum();
        let end = (done + size.saturating_sub(taken)).min(unit[0].tokens.len());
        (end > *done).then_some(*done..end)
    }

    /// After a unit's prefill: the other members copy the prefilled partial last block (and
    /// the prompt's routed experts).
    fn fork(&mut self, mut unit: Unit) -> crate::Result<Vec<Seq>> {
        let len = unit[0].tokens.len();
        let routes = unit[0].routes.clone();
        for seq in &mut unit[1..] {
            seq.routes.clone_from(&routes);
        }
        if unit.len() > 1 && !len.is_multiple_of(KEY_BLOCK) {
            let src = *unit[0].blocks.last().expect("a prefilled sequence has blocks");
            for seq in &unit[1..] {
                let dst = *seq.blocks.last().expect("allocated at admission");
                self.policy.copy_block(src, dst)?;
            }
        }
        Ok(unit)
    }

    /// One forward over the running sequences' next positions and the admitted prompts;
    /// returns the draws, one list per running sequence (of one) then per admitted unit, and
    /// the rows' routed experts ([`Policy::step`]).
    fn step(
        &mut self,
        model: &DeviceModel,
        running: &[Seq],
        admitted: &[Unit],
        chunk: Option<(&Unit, std::ops::Range<usize>)>,
        params: &SamplingParams,
    ) -> crate::Result<StepOut> {
        let mut rows: Vec<StepRow> = Vec::new();
        let mut draws: Vec<DrawRequest> = Vec::new();
        let mut sizes: Vec<usize> = Vec::new();
        let u = |seq: &Seq| uniform(params.seed, seq.key, seq.response_len() as u64);
        for seq in running {
            let p = seq.tokens.len() - 1;
            draws.push((rows.len(), u(seq)));
            sizes.push(1);
            rows.push(StepRow { token: seq.tokens[p], position: p, blocks: &seq.blocks });
        }
        for unit in admitted {
            let lead = &unit[0];
            for (p, &token) in lead.tokens.iter().enumerate() {
                rows.push(StepRow { token, position: p, blocks: &lead.blocks });
            }
            draws.extend(unit.iter().map(|s| (rows.len() - 1, u(s))));
            sizes.push(unit.len());
        }
        // The chunk's rows; its members draw only from the prompt's last row.
        if let Some((unit, range)) = chunk {
            let lead = &unit[0];
            let last = range.end == lead.tokens.len();
            for p in range {
                rows.push(StepRow { token: lead.tokens[p], position: p, blocks: &lead.blocks });
            }
            if last {
                draws.extend(unit.iter().map(|s| (rows.len() - 1, u(s))));
            }
            sizes.push(if last { unit.len() } else { 0 });
        }
        let (drawn, routes) = self.policy.step(model, &rows, &draws, params)?;
        let mut drawn = drawn.into_iter();
        Ok(StepOut {
            draws: sizes.iter().map(|&n| drawn.by_ref().take(n).collect()).collect(),
            routes,
            running_rows: vec![1; running.len()],
            feeds: Vec::new(),
        })
    }
}

/// What one step gave: draws, one list per running sequence then per admitted unit (a
/// speculative step's running sequences may have several); the rows' routed experts and the
/// rows each running sequence had; for a speculative step, what each running sequence and
/// then each member of an admitted unit feeds its draft next.
struct StepOut {
    draws: Vec<Vec<Option<Draw>>>,
    routes: Vec<u16>,
    running_rows: Vec<usize>,
    feeds: Vec<speculative::Fed>,
}

/// Hands a step's routed experts (`[rows × width]`, rows in [`Engine::step`]'s order) to the
/// sequences whose positions they are: a running sequence's next position, an admitted
/// prompt's positions (for its lead; [`Engine::fork`] copies them to the unit), the chunk's
/// (a prefill restarted after preemption starts over).
fn record_routes(
    routes: &[u16],
    run: &mut Run,
    admitted: &mut [Unit],
    chunk: Option<std::ops::Range<usize>>,
    running_rows: &[usize],
    draws: &[Vec<Option<Draw>>],
) {
    let rows = running_rows.iter().sum::<usize>()
        + admitted.iter().map(|u| u[0].tokens.len()).sum::<usize>()
        + chunk.as_ref().map_or(0, ExactSizeIterator::len);
    let width = routes.len() / rows.max(1);
    let mut at = routes.chunks(width.max(1));
    // A running sequence's rows are its positions from its newest token's on; those whose
    // tokens it keeps (one per draw) are recorded.
    for ((seq, &n), drawn) in run.running.iter_mut().zip(running_rows).zip(draws) {
        for r in 0..n {
            let row = at.next().expect("a row per running position");
            if r < drawn.len() {
                seq.routes.extend(row);
            }
        }
    }
    for unit in admitted.iter_mut() {
        let lead = &mut unit[0];
        lead.routes.clear();
        for _ in 0..lead.tokens.len() {
            lead.routes.extend(at.next().expect("a row per prompt position"));
        }
    }
    if let (Some((unit, _)), Some(c)) = (run.prefilling.as_mut(), chunk) {
        let lead = &mut unit[0];
        if c.start == 0 {
            lead.routes.clear();
        }
        for row in at {
            lead.routes.extend(row);
        }
    }
}

/// Before each step of a call: given whether nothing is left to generate, the groups to add
/// (`None` then ends the call), and the indices of groups to abort pushed onto the list.
type Intake<'a> = dyn FnMut(bool, &mut Vec<usize>) -> Option<Vec<Vec<Sample>>> + 'a;

/// A request to a serving engine ([`Engine::serve`]): one prompt's samples, how to sample
/// them, and where they go back.
pub struct Request {
    /// The samples to generate, as [`Rollout::generate`] takes them; the engine numbers them
    /// (their `index`, which keys their draws) in the order requests arrive.
    pub group: Vec<Sample>,
    pub params: SamplingParams,
    /// Called once with the samples, final, or the reason they could not be.
    pub reply: Reply,
    /// The caller's name for the request (SGLang's `rid`), by which [`Job::Abort`] finds it.
    pub rid: Option<String>,
    /// The key of the first sample's draws (the next ones' follow), in place of the arrival
    /// count: requests keyed by what they are for draw the same tokens in whatever order
    /// they arrive. Keys must not repeat during one serving call.
    pub key: Option<usize>,
}

/// Where a request's result goes.
pub type Reply = Box<dyn FnOnce(crate::Result<Vec<Sample>>) + Send>;

/// What a serving engine is asked ([`Engine::serve`]).
pub enum Job {
    Generate(Request),
    /// New weights from an HF checkpoint directory (a trainer's weight sync): taken once the
    /// requests before it are answered, and the samples after it carry the next policy
    /// version, which the reply gets.
    LoadWeights {
        dir: std::path::PathBuf,
        reply: Box<dyn FnOnce(crate::Result<u64>) + Send>,
    },
    /// Ends the request named `rid`, or every request when `None` (SGLang's `/abort_request`
    /// and its `abort_all`): running, its samples stop where they are, `Aborted`, their blocks
    /// freed, and go back with the tokens and logprobs generated so far; still queued, they go
    /// back `Aborted` with none. A name no request has (one already answered) is ignored.
    Abort {
        rid: Option<String>,
    },
    /// Ends [`Engine::serve`] (or [`Lent::serve`]) once the jobs before it are answered; the
    /// channel stays open for a later call (a rollout served to a generate function).
    Stop,
}

/// The requests of a serving call with the running ones' sampling parameters, numbered, with
/// their reply channels appended to `replies` (a group's position in the call).
fn take_requests(
    queue: &mut VecDeque<Job>,
    params: &SamplingParams,
    next_index: &mut usize,
    (replies, rids): (&std::cell::RefCell<Vec<Option<Reply>>>, &mut Vec<Option<String>>),
) -> Vec<Vec<Sample>> {
    // (Not past new weights or a stop: what comes after them waits for them.)
    let before = queue.iter().position(|j| matches!(j, Job::LoadWeights { .. } | Job::Stop));
    let rest = queue.split_off(before.unwrap_or(queue.len()));
    let mut same = Vec::new();
    for job in std::mem::take(queue) {
        match job {
            Job::Generate(r) if r.params == *params => same.push(r),
            other => queue.push_back(other),
        }
    }
    queue.extend(rest);
    same.into_iter()
        .map(|r| {
            replies.borrow_mut().push(Some(r.reply));
            rids.push(r.rid);
            let mut group = r.group;
            for (j, s) in group.iter_mut().enumerate() {
                s.index = match r.key {
                    Some(key) => key + j,
                    None => std::mem::replace(next_index, *next_index + 1),
                };
            }
            group
        })
        .collect()
}

/// Answers the queued requests named `rid` (every one when `None`) with their samples
/// `Aborted` and ungenerated.
fn abort_queued(queue: &mut VecDeque<Job>, rid: Option<&str>) {
    for job in std::mem::take(queue) {
        match job {
            Job::Generate(r) if rid.is_none() || r.rid.as_deref() == rid => {
                let aborted = |s| Sample { status: Status::Aborted, ..s };
                (r.reply)(Ok(r.group.into_iter().map(aborted).collect()));
            }
            other => queue.push_back(other),
        }
    }
}

impl Engine {
    /// Serves `requests` until every sender is dropped: a request with the sampling
    /// parameters of the running ones joins them at the next step (continuous batching), the
    /// others wait until those finish. Each request's samples go back on its channel as soon
    /// as they are all final, as [`Engine::generate`] returns them; a request the engine
    /// refuses (bad sampling parameters) gets the error, and an engine failure is sent to
    /// every request waiting and returned. New weights ([`Job::LoadWeights`]) are taken in
    /// their place in the order.
    pub fn serve(
        &mut self,
        model: &mut DeviceModel,
        requests: &std::sync::mpsc::Receiver<Job>,
    ) -> crate::Result<()> {
        self.serve_jobs((Served::Owned(model), None), requests)
    }

    /// [`Engine::serve`] over `model` held as it is lent or owned (only an owned one loads
    /// weights), with `draft` speculating.
    fn serve_jobs(
        &mut self,
        (mut model, draft): (Served<'_>, Option<&DeviceModel>),
        requests: &std::sync::mpsc::Receiver<Job>,
    ) -> crate::Result<()> {
        let mut queue: VecDeque<Job> = VecDeque::new();
        let mut next_index = 0;
        loop {
            if queue.is_empty() {
                match requests.recv() {
                    Ok(r) => queue.push_back(r),
                    Err(_) => return Ok(()),
                }
            }
            let params = match queue.pop_front().expect("a job is queued") {
                Job::LoadWeights { dir, reply } => {
                    reply(match &mut model {
                        Served::Owned(m) => self.load_weights(m, &dir),
                        Served::Lent(_) => Err(crate::Error::Invalid(
                            "this engine's weights are the trainer's: they change between \
                             rollouts, not through the server"
                                .into(),
                        )),
                    });
                    continue;
                }
                Job::Abort { rid } => {
                    abort_queued(&mut queue, rid.as_deref());
                    continue;
                }
                Job::Stop => return Ok(()),
                Job::Generate(r) => {
                    let params = r.params.clone();
                    queue.push_front(Job::Generate(r));
                    params
                }
            };
            if let Err(e) = check_params(&params) {
                if let Some(Job::Generate(refused)) = queue.pop_front() {
                    (refused.reply)(Err(e));
                }
                continue;
            }
            let eos = if params.ignore_eos { Vec::new() } else { self.eos_ids() };
            let replies = std::cell::RefCell::new(Vec::new());
            // The running groups' request names, by group.
            let mut rids = Vec::new();
            let first = take_requests(&mut queue, &params, &mut next_index, (&replies, &mut rids));
            let served = Run::new(self, first, &params, &eos).and_then(|run| {
                let mut done = |p: Progress<'_>| {
                    for (g, samples) in p.groups_done {
                        let reply = replies.borrow_mut()[g].take();
                        if let Some(reply) = reply {
                            reply(Ok(samples.to_vec()));
                        }
                    }
                    Flow::Continue
                };
                let mut intake = |_idle: bool, aborts: &mut Vec<usize>| {
                    for job in requests.try_iter() {
                        match job {
                            Job::Abort { rid } => {
                                let hit = |r: &Option<String>| rid.is_none() || *r == rid;
                                aborts.extend((0..rids.len()).filter(|&g| hit(&rids[g])));
                                abort_queued(&mut queue, rid.as_deref());
                            }
                            other => queue.push_back(other),
                        }
                    }
                    let taken = (&replies, &mut rids);
                    let groups = take_requests(&mut queue, &params, &mut next_index, taken);
                    (!groups.is_empty()).then_some(groups)
                };
                self.drive((model.get(), draft), run, (&params, &eos), &mut done, &mut intake)
            });
            if let Err(e) = served {
                let message = e.to_string();
                let fail = || crate::Error::Invalid(message.clone());
                for reply in replies.into_inner().into_iter().flatten() {
                    reply(Err(fail()));
                }
                for job in queue.drain(..) {
                    match job {
                        Job::Generate(r) => (r.reply)(Err(fail())),
                        Job::LoadWeights { reply, .. } => reply(Err(fail())),
                        Job::Abort { .. } | Job::Stop => {}
                    }
                }
                return Err(e);
            }
        }
    }

    /// `dir`'s weights into `model` (checked against its config); the new policy version.
    fn load_weights(
        &mut self,
        model: &mut DeviceModel,
        dir: &std::path::Path,
    ) -> crate::Result<u64> {
        let weights = miles_model::Weights::load(dir, &model.config).map_err(model_error)?;
        model.set_weights(&weights).map_err(model_error)?;
        self.weights_updated();
        Ok(self.weight_version)
    }
}

/// The state of one `generate` call.
struct Run {
    out: Vec<Vec<Sample>>,
    waiting: VecDeque<Unit>,
    running: Vec<Seq>,
    /// A prompt longer than the chunk size being prefilled, and how many tokens are done.
    prefilling: Option<(Unit, usize)>,
    blocks: BlockAllocator,
    total: usize,
    remaining: usize,
    generated: usize,
    /// Per group, its samples still generating; the groups completed since the last report.
    left: Vec<usize>,
    done_now: Vec<usize>,
    /// The indices of the call's samples (each keys its draws).
    seen: std::collections::HashSet<usize>,
}

impl Run {
    fn new(
        engine: &mut Engine,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        eos: &[u32],
    ) -> crate::Result<Run> {
        let mut run = Run {
            out: Vec::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefilling: None,
            blocks: BlockAllocator::new(engine.policy.num_blocks()),
            total: 0,
            remaining: 0,
            generated: 0,
            left: Vec::new(),
            done_now: Vec::new(),
            seen: std::collections::HashSet::new(),
        };
        run.add(engine, groups, params, eos)?;
        Ok(run)
    }

    /// Takes `groups` in after those it has (their indices in the call's output follow);
    /// refused whole when a sample's index is another's of the call.
    fn add(
        &mut self,
        engine: &mut Engine,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        eos: &[u32],
    ) -> crate::Result<()> {
        let run = self;
        let capacity = engine.policy.num_blocks() * KEY_BLOCK;
        // A sample's draws are keyed by its index: two samples sharing one would be twins.
        let mut fresh = std::collections::HashSet::new();
        let taken = |s: &&Sample| run.seen.contains(&s.index) || !fresh.insert(s.index);
        if let Some(s) = groups.iter().flatten().find(taken) {
            return Err(crate::Error::Invalid(format!(
                "two samples have index {}: the rollout RNG is keyed by Sample.index, so give \
                 every sample of a batch its own",
                s.index
            )));
        }
        run.seen.extend(fresh);
        run.total += groups.iter().map(Vec::len).sum::<usize>();
        let first = run.out.len();
        for (g, group) in groups.into_iter().enumerate() {
            let g = first + g;
            let before = run.remaining;
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
                            routes: Vec::new(),
                            blocks: Vec::new(),
                            admitted: 0,
                            feed: None,
                            spec: SpecCounts::default(),
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
            let queued = run.remaining - before;
            if queued == 0 {
                run.done_now.push(g);
            }
            run.left.push(queued);
        }
        Ok(())
    }

    /// The progress after a step; hands over the groups completed since the last one.
    fn progress(&mut self, preemptions: usize) -> Progress<'_> {
        let done = std::mem::take(&mut self.done_now);
        Progress {
            finished: self.total - self.remaining,
            total: self.total,
            generated_tokens: self.generated,
            preemptions,
            running: self.running.len(),
            blocks_used: self.blocks.num_used(),
            total_blocks: self.blocks.num_used() + self.blocks.num_free(),
            groups_done: done.into_iter().map(|g| (g, self.out[g].as_slice())).collect(),
        }
    }

    /// Ends the sequences of `groups` still waiting, prefilling or running as `Aborted`, as
    /// [`Self::abort`] does for all; each group is then done. Returns how many.
    fn abort_groups(&mut self, engine: &Engine, groups: &[usize]) -> usize {
        let hit = |seq: &Seq| groups.contains(&seq.slot.0);
        let (mut ended, kept): (Vec<Seq>, Vec<Seq>) =
            std::mem::take(&mut self.running).into_iter().partition(hit);
        self.running = kept;
        if self.prefilling.as_ref().is_some_and(|(unit, _)| unit.iter().any(hit)) {
            ended.extend(self.prefilling.take().into_iter().flat_map(|(unit, _)| unit));
        }
        for unit in std::mem::take(&mut self.waiting) {
            let (gone, kept): (Vec<Seq>, Vec<Seq>) = unit.into_iter().partition(hit);
            ended.extend(gone);
            if !kept.is_empty() {
                self.waiting.push_back(kept);
            }
        }
        let aborted = ended.len();
        for seq in ended {
            let (g, m) = self.retire(&seq);
            let s = std::mem::take(&mut self.out[g][m]);
            self.out[g][m] = engine.finish(s, seq, Status::Aborted);
        }
        aborted
    }

    /// A sequence that ends: its blocks freed, counted out of its group (done when it was the
    /// group's last). Returns its slot.
    fn retire(&mut self, seq: &Seq) -> (usize, usize) {
        self.blocks.release(&seq.blocks);
        self.remaining -= 1;
        let (g, _) = seq.slot;
        self.left[g] -= 1;
        if self.left[g] == 0 {
            self.done_now.push(g);
        }
        seq.slot
    }

    /// Ends every sequence still waiting, prefilling or running as `Aborted`: its blocks
    /// freed, its sample holding the tokens and logprobs it generated (none for one not yet
    /// admitted). Returns how many.
    fn abort(&mut self, engine: &Engine) -> usize {
        let mut seqs = std::mem::take(&mut self.running);
        seqs.extend(self.prefilling.take().into_iter().flat_map(|(unit, _)| unit));
        seqs.extend(self.waiting.drain(..).flatten());
        let aborted = seqs.len();
        for seq in seqs {
            self.blocks.release(&seq.blocks);
            let (g, m) = seq.slot;
            let s = std::mem::take(&mut self.out[g][m]);
            self.out[g][m] = engine.finish(s, seq, Status::Aborted);
        }
        self.remaining = 0;
        aborted
    }

    /// Appends a step's draws in order, until the sequence finishes.
    fn advance_by(
        &mut self,
        engine: &Engine,
        seq: Seq,
        draws: &[Option<Draw>],
        eos: &[u32],
        params: &SamplingParams,
    ) -> Option<Seq> {
        let mut seq = Some(seq);
        for &d in draws {
            seq = self.advance(engine, seq?, d, eos, params);
        }
        seq
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
        let (g, m) = self.retire(&seq);
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
        // A finished response (a group's member done before the rest of its group was
        // aborted) stays as it is.
        let finished = matches!(s.status, Status::Completed | Status::Truncated);
        if finished && s.response_length > 0 && !s.tokens.is_empty() {
            return Ok(None);
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
            s.weight_versions.clear();
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
        if let Some(&bad) =
            s.tokens.iter().find(|&&t| t as usize >= self.policy.config().vocab_size)
        {
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
        // Each token's policy version: a continued response's earlier ones as they were.
        let mut versions = s.token_versions();
        versions.resize(response.len(), self.weight_version);
        s.weight_versions = match versions.iter().all(|&v| v == self.weight_version) {
            true => Vec::new(),
            false => versions,
        };
        s.response = match &self.tokenizer {
            Some(tok) => tok.decode(response, true).unwrap_or_default(),
            None => String::new(),
        };
        s.response_length = response.len();
        // A continued response keeps the mask of its earlier part (tool output stays masked).
        let earlier = s.response_length.min(s.loss_mask.len());
        s.loss_mask.truncate(earlier);
        s.loss_mask.resize(response.len(), 1);
        s.rollout_routed_experts = self.routed_experts(&seq);
        debug_assert!(
            status == Status::Aborted
                || self.policy.config().moe.is_none()
                || s.rollout_routed_experts.is_some(),
            "a finished sequence of a mixture of experts has every position's routes"
        );
        if self.policy.has_draft() {
            seq.spec.write(&mut s.metadata);
        }
        s.tokens = seq.tokens;
        s.rollout_log_probs = seq.logprobs;
        s.status = status;
        s.weight_version = self.weight_version;
        s
    }
}

impl Engine {
    /// A finished sequence's routing record: every position but the last (the engine never
    /// runs its newest token), `None` for a dense model.
    fn routed_experts(&self, seq: &Seq) -> Option<RoutedExperts> {
        let c = self.policy.config();
        let moe = c.moe.as_ref()?;
        let layers = (0..c.num_hidden_layers).filter(|&l| moe.is_sparse(l)).count();
        // A speculative step may have run positions past the token the sequence stopped at.
        let want = (seq.tokens.len() - 1) * layers * moe.num_experts_per_tok;
        // (An aborted sequence not prefilled again yet has none: its continuation's prefill
        // records them all.)
        (seq.routes.len() >= want).then(|| RoutedExperts {
            num_layers: layers,
            top_k: moe.num_experts_per_tok,
            ids: seq.routes[..want].to_vec(),
        })
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

/// The model a serving engine runs: its own (weights load through the server) or lent.
enum Served<'a> {
    Owned(&'a mut DeviceModel),
    Lent(&'a DeviceModel),
}

impl Served<'_> {
    fn get(&self) -> &DeviceModel {
        match self {
            Served::Owned(m) => m,
            Served::Lent(m) => m,
        }
    }
}

impl Lent<'_> {
    /// The policy version the samples generated now carry.
    pub fn weight_version(&self) -> u64 {
        self.engine.weight_version
    }

    /// Serves `requests` ([`Engine::serve`]) with the lent model (and draft) until a
    /// [`Job::Stop`]; a request to load weights is refused (they are the trainer's).
    pub fn serve(&mut self, requests: &std::sync::mpsc::Receiver<Job>) -> crate::Result<()> {
        self.engine.serve_jobs((Served::Lent(self.model), self.draft), requests)
    }
}

/// An [`Engine`] with its model lent ([`Engine::lend`]).
pub struct Lent<'a> {
    engine: &'a mut Engine,
    model: &'a DeviceModel,
    draft: Option<&'a DeviceModel>,
}

impl Rollout for Lent<'_> {
    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        self.engine
            .generate_speculative(self.model, self.draft, groups, params, &mut |_| Flow::Continue)
    }

    fn generate_until(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        on_group: &mut dyn FnMut(usize, &[Sample]) -> Flow,
    ) -> crate::Result<Vec<Vec<Sample>>> {
        // Every group a step completed is handed over, also after one of them answered Abort.
        self.engine.generate_speculative(self.model, self.draft, groups, params, &mut |p| {
            let answers: Vec<Flow> =
                p.groups_done.into_iter().map(|(g, s)| on_group(g, s)).collect();
            match answers.contains(&Flow::Abort) {
                true => Flow::Abort,
                false => Flow::Continue,
            }
        })
    }

    fn set_weight_version(&mut self, version: u64) {
        self.engine.weight_version = version;
    }
}
