//! Speculative decoding (EAGLE's chain drafting with an MTP draft, as SGLang runs it with
//! `--speculative-eagle-topk 1`): each step the draft proposes up to `k` tokens per running
//! sequence, the policy runs its newest token and the k drafts in one forward over the paged
//! cache, and [`ops::speculative_verify`] (the `eagle-spec` plugin's rule, on the device)
//! keeps a prefix of the drafts and draws one token of the policy's own, so a sequence
//! advances by 1 to k + 1 tokens. Logits and drafts stay on the device: the host reads the
//! kept tokens and their logprobs once per step.
//!
//! - The draft at position t reads the policy's final-normed state there and the token at
//!   t + 1, and guesses the token at t + 2; its keys and values go to a cache of its own under
//!   the sequence's block table. A proposal first feeds it the policy's states it has not seen
//!   (the accepted positions of the last verification, or the prompt after a prefill), then
//!   its own states for the chain; cached entries past a sequence's newest position are never
//!   read before they are written again, so rejected drafts need no rollback.
//! - Exact sampling: drafts are drawn from the draft's distribution at the run's temperature,
//!   top-k and top-p, and the verification keeps or replaces them so that every token is
//!   distributed as the policy's (greedy decoding gives exactly the plain tokens). Uniforms
//!   are counter-based, keyed by (seed, sample, response position) in three streams: the
//!   draft's draws, the acceptance tests and the policy's draws (the plain sampler's stream).
//! - Exact logprobs: a kept token's logprob is taken from the verification forward's row,
//!   through the same batch-invariant kernels and [`ops::logprob_rows`] as a plain step.

use std::sync::Arc;
use std::time::Instant;

use miles_core::{SamplingParams, Speculator};
use miles_model::{DeviceModel, SpecRows, StepRow};
use miles_tensor::Tensor;
use miles_tensor::ops::{self, DraftChain};
use serde_json::Value;

use super::{Engine, Seq, StepOut, Unit};
use crate::policy::model_error;
use crate::sampler::{Draw, uniform};

/// Seeds of the draft's draws and of the acceptance tests (the policy's draws use the run's
/// seed itself, as plain decoding does).
const DRAFT_STREAM: u64 = 0x6472_6166_745f_7371;
const ACCEPT_STREAM: u64 = 0x6163_6365_7074_5f71;

/// What a sequence's draft has not seen yet: the policy's final-normed states at positions
/// `from` up to its newest token's (exclusive): rows `rows` of a step's states, which the
/// step's sequences share (one gather feeds them all).
pub(crate) struct DraftFeed {
    from: usize,
    states: Arc<Tensor>,
    rows: Vec<u32>,
}

/// A sequence's speculative counts (SGLang's `spec_verify_ct` in `meta_info`, and the draft
/// tokens proposed and kept).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecCounts {
    /// Verifications that checked at least one draft token.
    pub verifies: usize,
    pub drafted: usize,
    pub accepted: usize,
}

impl SpecCounts {
    /// Adds `c` to these and to the engine's totals.
    pub(super) fn add(&mut self, c: SpecCounts, total: &mut SpecCounts) {
        for t in [self, total] {
            t.verifies += c.verifies;
            t.drafted += c.drafted;
            t.accepted += c.accepted;
        }
    }

    /// Into a sample's metadata, under SGLang's and miles' names.
    pub(super) fn write(&self, metadata: &mut Value) {
        if !metadata.is_object() {
            *metadata = serde_json::json!({});
        }
        metadata["spec_verify_ct"] = self.verifies.into();
        metadata["spec_draft_token_num"] = self.drafted.into();
        metadata["spec_accept_token_num"] = self.accepted.into();
    }
}

/// What a step leaves a sequence: its draft's next feed, and the step's counts.
pub(super) struct Fed {
    pub(super) feed: Option<DraftFeed>,
    pub(super) counts: SpecCounts,
}

/// Refuses a draft that cannot propose for `model`, or an engine without a scheme.
pub(super) fn check_draft(
    model: &DeviceModel,
    draft: &DeviceModel,
    speculator: Option<&dyn Speculator>,
) -> crate::Result<()> {
    if speculator.is_none_or(|s| s.num_steps() == 0) {
        return Err(crate::Error::config(
            "sglang-speculative-algorithm",
            "a speculative engine needs its scheme (EngineConfig::speculator, the eagle-spec \
             plugin) proposing at least one token",
        ));
    }
    let (p, d) = (&model.config, &draft.config);
    if !d.mtp_input {
        return Err(crate::Error::Invalid(
            "rollout engine: the draft is not an MTP draft (miles_model::draft::draft_config)"
                .into(),
        ));
    }
    if d.hidden_size != p.hidden_size || d.vocab_size != p.vocab_size {
        return Err(crate::Error::Invalid(format!(
            "rollout engine: the draft has hidden size {} and vocabulary {}, the policy {} and \
             {}: a draft reads the policy's states and proposes its tokens",
            d.hidden_size, d.vocab_size, p.hidden_size, p.vocab_size
        )));
    }
    Ok(())
}

impl Engine {
    /// Draft tokens verified after `seq`'s newest token this step: the configured count,
    /// fewer near its length limit (the step keeps at most drafts + 1 tokens), none without a
    /// draft or before its prefill fed one.
    pub(super) fn lookahead(&self, seq: &Seq, params: &SamplingParams) -> usize {
        if !self.policy.has_draft() || seq.feed.is_none() {
            return 0;
        }
        let left = params.max_new_tokens.saturating_sub(seq.response_len() + 1);
        self.config.speculator.as_ref().map_or(0, |s| s.num_steps()).min(left)
    }

    /// One speculative step: the draft proposes for every running sequence, then one forward
    /// of the policy over the running sequences' newest tokens and drafts, the admitted
    /// prompts and the chunk verifies and draws; the draft is fed the prompts' states.
    ///
    /// The drafts stay on the device from the draft's sampler to the verification: the
    /// step's rows are laid out round by round (row `j · n + c` is running sequence c's
    /// position j after its newest token; padding where it proposes fewer), so each round's
    /// draws are the next rows' tokens as they are, and the host reads the verified tokens
    /// and their logprobs once, at the end.
    pub(super) fn spec_step(
        &mut self,
        (model, draft): (&DeviceModel, &DeviceModel),
        running: &[Seq],
        admitted: &[Unit],
        chunk: Option<(&Unit, std::ops::Range<usize>)>,
        params: &SamplingParams,
    ) -> crate::Result<StepOut> {
        let started = Instant::now();
        let n = running.len();
        let ks: Vec<usize> = running.iter().map(|s| self.lookahead(s, params)).collect();
        let drafts_only = admitted.is_empty() && chunk.is_none();
        if drafts_only
            && self.config.spec_step_graphs
            && !self.config.spec_phase_sync
            && let Some(out) = self.captured_step((model, draft), running, &ks, params)?
        {
            return Ok(out);
        }
        let rounds = ks.iter().copied().max().unwrap_or(0);
        let scratch = [self.policy.scratch_block()];
        let pad = StepRow { token: 0, position: 0, blocks: &scratch };
        let proposed = self.propose(draft, running, &ks, pad, params)?;
        let mut rows: Vec<StepRow> = Vec::new();
        for j in 0..=rounds {
            for (seq, &k) in running.iter().zip(&ks) {
                let p = seq.tokens.len() - 1;
                let row = StepRow { token: seq.tokens[p], position: p + j, blocks: &seq.blocks };
                rows.push(if j <= k { row } else { pad });
            }
        }
        let verified = rows.len();
        // The verified rows' tokens: the newest ones, then each round's draws.
        let device = model.device();
        let ids = if n > 0 {
            let newest = running.iter().map(|s| s.tokens[s.tokens.len() - 1] as i32).collect();
            let newest = Tensor::from_i32(&[n, 1], newest, &device).map_err(tensor_error)?;
            let parts: Vec<&Tensor> =
                std::iter::once(&newest).chain(proposed.iter().map(|(d, _)| d)).collect();
            Some(ops::concat_rows(&parts).map_err(tensor_error)?)
        } else {
            None
        };
        // The prompts: (rows' start, their unit, the positions run).
        let mut prompts: Vec<(usize, &Unit, std::ops::Range<usize>)> = Vec::new();
        for unit in admitted {
            prompts.push((rows.len(), unit, 0..unit[0].tokens.len()));
            let lead = &unit[0];
            for (p, &token) in lead.tokens.iter().enumerate() {
                rows.push(StepRow { token, position: p, blocks: &lead.blocks });
            }
        }
        if let Some((unit, range)) = chunk.clone() {
            prompts.push((rows.len(), unit, range.clone()));
            let lead = &unit[0];
            for p in range {
                rows.push(StepRow { token: lead.tokens[p], position: p, blocks: &lead.blocks });
            }
        }
        let phase_sync = self.config.spec_phase_sync;
        let sync = || match phase_sync {
            true => model.device().synchronize().map_err(tensor_error),
            false => Ok(()),
        };
        sync()?;
        let proposed_at = Instant::now();
        let (hidden, routes) = self.policy.verify_step(model, &rows, ids.as_ref(), drafts_only)?;
        sync()?;
        let forward_at = Instant::now();
        let routes = chain_order(routes, &ks, verified, rows.len());
        let mut draws = Vec::new();
        let mut feeds = Vec::new();
        let t = params.temperature;
        let hidden = Arc::new(hidden);
        if let Some(ids) = &ids {
            let all: Vec<u32> = (0..verified as u32).collect();
            let logits = model.logits(&hidden, &all).map_err(model_error)?;
            let chains = chains(running, &ks, params);
            // Without drafts no draft row is read: the policy's rows stand in for the table.
            let q = match &proposed[..] {
                [] => None,
                rounds => {
                    let all: Vec<&Tensor> = rounds.iter().map(|(_, q)| q).collect();
                    Some(ops::concat_rows(&all).map_err(tensor_error)?)
                }
            };
            let how = (t, params.top_k, params.top_p);
            let out = ops::speculative_verify(
                &logits,
                q.as_ref().unwrap_or(&logits),
                ids,
                &chains,
                (n, n),
                how,
            )
            .map_err(tensor_error)?;
            let (logp, _) = ops::logprob_rows_ids(&logits, &out.tokens, t).map_err(tensor_error)?;
            sync()?;
            let verify_at = Instant::now();
            // The step's one wait for the device.
            let kept = out.to_host(&chains, n).map_err(tensor_error)?;
            let logp = logp.to_vec_f32().map_err(tensor_error)?;
            let ids = ids.to_vec_i32().map_err(tensor_error)?;
            for (c, (seq, tokens)) in running.iter().zip(kept).enumerate() {
                let drafted = (1..=ks[c]).take_while(|j| ids[c + j * n] >= 0).count();
                let kept = tokens.iter().enumerate().map(|(j, &t)| (t, logp[c + j * n])).collect();
                let (drawn, fed) = after_verification(seq, (c, n), kept, drafted, &hidden);
                feeds.push(fed);
                draws.push(drawn);
            }
            if drafts_only {
                let p = &mut self.stats.spec_phases;
                p.steps += 1;
                p.propose += (proposed_at - started).as_secs_f64();
                p.forward += (forward_at - proposed_at).as_secs_f64();
                p.verify += (verify_at - forward_at).as_secs_f64();
                p.wait += verify_at.elapsed().as_secs_f64();
            }
        }
        // The prompts: their members draw from the last prompt row, and the draft reads the
        // prompt's states (the lead's blocks; members copy its partial block).
        let mut draft_rows: Vec<StepRow> = Vec::new();
        let mut draft_states: Vec<u32> = Vec::new();
        for &(start, unit, ref range) in &prompts {
            let lead = &unit[0];
            let len = lead.tokens.len();
            for p in range.start..range.end.min(len - 1) {
                let token = lead.tokens[p + 1];
                draft_rows.push(StepRow { token, position: p, blocks: &lead.blocks });
                draft_states.push((start + p - range.start) as u32);
            }
            if range.end < len {
                draws.push(Vec::new());
                continue;
            }
            let last = (start + range.len() - 1) as u32;
            let u: Vec<f64> =
                unit.iter().map(|s| uniform(params.seed, s.key, s.response_len() as u64)).collect();
            let drawn = model
                .sample(&hidden, &vec![last; unit.len()], sample_params(params), &u)
                .map_err(model_error)?;
            draws.push(
                drawn
                    .into_iter()
                    .map(|d| d.map(|(token, logprob)| Draw { token, logprob }))
                    .collect(),
            );
            for _ in unit {
                let feed = DraftFeed { from: len - 1, states: hidden.clone(), rows: vec![last] };
                feeds.push(Fed { feed: Some(feed), counts: SpecCounts::default() });
            }
        }
        if !draft_rows.is_empty() {
            let states = ops::gather_rows(&hidden, &draft_states).map_err(tensor_error)?;
            self.policy.draft_step(draft, &draft_rows, (&states, None), false)?;
        }
        let running_rows = ks.iter().map(|k| k + 1).collect();
        Ok(StepOut { draws, routes, running_rows, feeds })
    }

    /// The step through one captured graph ([`DeviceModel::spec_step`]) where the policy's
    /// steps are captured and every running sequence proposes the full `k` drafts (no prompt
    /// beside them): `None` otherwise, for the eager step.
    fn captured_step(
        &mut self,
        (model, draft): (&DeviceModel, &DeviceModel),
        running: &[Seq],
        ks: &[usize],
        params: &SamplingParams,
    ) -> crate::Result<Option<StepOut>> {
        let started = Instant::now();
        let (n, k) = (running.len(), ks.first().copied().unwrap_or(0));
        if n == 0 || k == 0 || ks.iter().any(|&x| x != k) || !self.policy.captures(model) {
            return Ok(None);
        }
        let scratch = [self.policy.scratch_block()];
        let pad = StepRow { token: 0, position: 0, blocks: &scratch };
        let Some(Feeds { rows: feed, states: feed_states, from }) =
            feeds(running, ks, Some((pad, k + 1)))?
        else {
            return Ok(None);
        };
        let newest = |s: &Seq| s.tokens.len() - 1;
        let chain: Vec<StepRow> = (1..k)
            .flat_map(|r| running.iter().map(move |s| (r, s)))
            .map(|(r, s)| StepRow { token: 0, position: newest(s) + r - 1, blocks: &s.blocks })
            .collect();
        let verify: Vec<StepRow> = (0..=k)
            .flat_map(|j| running.iter().map(move |s| (j, s)))
            .map(|(j, s)| {
                let token = if j == 0 { s.tokens[newest(s)] } else { 0 };
                StepRow { token, position: newest(s) + j, blocks: &s.blocks }
            })
            .collect();
        let draft_uniforms: Vec<f64> = (0..k)
            .flat_map(|r| running.iter().map(move |s| (r, s)))
            .map(|(r, s)| uniform(params.seed ^ DRAFT_STREAM, s.key, (s.response_len() + r) as u64))
            .collect();
        let verify_uniforms: Vec<Vec<(f64, f64)>> =
            chains(running, ks, params).into_iter().map(|c| c.uniforms).collect();
        let rows = SpecRows {
            feed: &feed,
            feed_states: &feed_states,
            from: &from,
            chain: &chain,
            verify: &verify,
            draft_uniforms: &draft_uniforms,
            verify_uniforms: &verify_uniforms,
        };
        let prepared = Instant::now();
        let Some(out) = self.policy.spec_step(model, draft, rows, params, k)? else {
            return Ok(None);
        };
        let replayed = Instant::now();
        let states = Arc::new(out.states);
        let (mut draws, mut fed) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for (c, (seq, kept)) in running.iter().zip(out.kept).enumerate() {
            let (drawn, f) =
                after_verification(seq, (c, out.stride), kept, out.drafted[c], &states);
            draws.push(drawn);
            fed.push(f);
        }
        let phases = &mut self.stats.spec_phases;
        phases.captured += 1;
        phases.captured_prepare += (prepared - started).as_secs_f64();
        phases.captured_load += out.seconds.0;
        phases.captured_replay += out.seconds.1;
        phases.captured_after += replayed.elapsed().as_secs_f64();
        if let Some(g) = &self.policy.spec_graphs {
            (phases.captures, phases.capture_failed) = (g.captures(), g.failed().is_some());
        }
        let running_rows = ks.iter().map(|k| k + 1).collect();
        Ok(Some(StepOut { draws, routes: Vec::new(), running_rows, feeds: fed }))
    }

    /// The draft's chains, round by round: up to `ks[c]` tokens for running sequence c, each
    /// drawn from the draft's distribution, as `[n × 1]` i32 draws (-1 where the draft's
    /// logits have no mass; rows past a sequence's count are padding) beside the draft's
    /// logits `[n × vocab]` they were drawn from; all on the device, nothing read back.
    fn propose(
        &mut self,
        draft: &DeviceModel,
        running: &[Seq],
        ks: &[usize],
        pad: StepRow,
        params: &SamplingParams,
    ) -> crate::Result<Vec<(Tensor, Tensor)>> {
        let rounds = ks.iter().copied().max().unwrap_or(0);
        if rounds == 0 {
            return Ok(Vec::new());
        }
        let Some(Feeds { rows, states: x, mut from }) = feeds(running, ks, None)? else {
            unreachable!("unpadded feeds always fit")
        };
        let mut h = self.policy.draft_step(draft, &rows, (&x, None), true)?;
        let (device, n) = (draft.device(), running.len());
        let mut out = Vec::with_capacity(rounds);
        for j in 0..rounds {
            let logits = draft.logits(&h, &from).map_err(model_error)?;
            let u: Vec<f64> = running
                .iter()
                .map(|s| uniform(params.seed ^ DRAFT_STREAM, s.key, (s.response_len() + j) as u64))
                .collect();
            let bits = ops::uniform_bits(&u, &device).map_err(tensor_error)?;
            let (t, k, p) = (params.temperature, params.top_k, params.top_p);
            let drawn = ops::sample_rows_ids(&logits, t, k, p, &bits)
                .and_then(|d| d.reshape(&[n, 1]))
                .map_err(tensor_error)?;
            if j + 1 < rounds {
                // The chain's next round: each drafted token at the position after the last,
                // fed the draft's own state there.
                let rows: Vec<StepRow> = running
                    .iter()
                    .zip(ks)
                    .map(|(seq, &k)| match k > j + 1 {
                        true => StepRow {
                            token: 0,
                            position: seq.tokens.len() - 1 + j,
                            blocks: &seq.blocks,
                        },
                        false => pad,
                    })
                    .collect();
                let x = ops::gather_rows(&h, &from).map_err(tensor_error)?;
                h = self.policy.draft_step(draft, &rows, (&x, Some(&drawn)), true)?;
                from = (0..n as u32).collect();
            }
            out.push((drawn, logits));
        }
        Ok(out)
    }
}

/// The first draft round of a step.
struct Feeds<'s> {
    rows: Vec<StepRow<'s>>,
    /// The policy's states the rows read.
    states: Tensor,
    /// Each sequence's newest token's row (0 for one not proposing).
    from: Vec<u32>,
}

/// The first draft round's rows for every proposing sequence (`ks[c] > 0`): the positions
/// whose states its draft has not read, ending at its newest token's, with those states
/// (gathered from the steps that made them). With `pad` (a padding row, a width) each
/// sequence's rows are padded to that width (`None` when one has more).
fn feeds<'s>(
    running: &'s [Seq],
    ks: &[usize],
    pad: Option<(StepRow<'s>, usize)>,
) -> crate::Result<Option<Feeds<'s>>> {
    let mut rows: Vec<StepRow> = Vec::new();
    // The distinct step tensors the feeds are rows of, and the rows picked.
    let mut sources: Vec<&Arc<Tensor>> = Vec::new();
    let mut offsets: Vec<u32> = Vec::new();
    let mut picks: Vec<u32> = Vec::new();
    let mut from = vec![0u32; running.len()];
    for (c, seq) in running.iter().enumerate().filter(|&(c, _)| ks[c] > 0) {
        let feed = seq.feed.as_ref().expect("a proposing sequence has a feed");
        let p = seq.tokens.len() - 1;
        if pad.is_some_and(|(_, width)| p - feed.from > width) {
            return Ok(None);
        }
        for t in feed.from..p {
            rows.push(StepRow { token: seq.tokens[t + 1], position: t, blocks: &seq.blocks });
        }
        let source = match sources.iter().position(|s| Arc::ptr_eq(s, &feed.states)) {
            Some(s) => s,
            None => {
                let rows_before = offsets.last().map_or(0, |&o| o)
                    + sources.last().map_or(0, |s| s.shape()[0] as u32);
                sources.push(&feed.states);
                offsets.push(rows_before);
                sources.len() - 1
            }
        };
        picks.extend(feed.rows.iter().map(|r| offsets[source] + r));
        from[c] = (rows.len() - 1) as u32;
        if let Some((pad, width)) = pad {
            while !rows.len().is_multiple_of(width) {
                rows.push(pad);
                picks.push(0);
            }
        }
    }
    let x = match sources[..] {
        [one] => ops::gather_rows(one, &picks),
        _ => ops::concat_rows(&sources.iter().map(|s| s.as_ref()).collect::<Vec<_>>())
            .and_then(|all| ops::gather_rows(&all, &picks)),
    }
    .map_err(tensor_error)?;
    Ok(Some(Feeds { rows, states: x, from }))
}

/// What a verification leaves running sequence `seq` (its rows `c`, `stride` apart in the
/// step's `states`): the kept tokens with their logprobs as draws (one `None` when its row had
/// no mass), its draft's next feed (the states at the positions kept) and its counts.
fn after_verification(
    seq: &Seq,
    (c, stride): (usize, usize),
    kept: Vec<(u32, f32)>,
    drafted: usize,
    states: &Arc<Tensor>,
) -> (Vec<Option<Draw>>, Fed) {
    let accepted = kept.len().saturating_sub(1).min(drafted);
    let rows = (0..kept.len().max(1)).map(|j| (c + j * stride) as u32).collect();
    let feed = DraftFeed { from: seq.tokens.len() - 1, states: states.clone(), rows };
    let counts = SpecCounts { verifies: usize::from(drafted > 0), drafted, accepted };
    let mut drawn: Vec<Option<Draw>> =
        kept.into_iter().map(|(token, logprob)| Some(Draw { token, logprob })).collect();
    if drawn.is_empty() {
        drawn.push(None);
    }
    (drawn, Fed { feed: Some(feed), counts })
}

/// The verification of each running sequence's proposal: its policy rows and the draft's
/// rows start at its index (round by round, `n` apart), with the uniforms of each position:
/// the acceptance test's in its own stream, the draw's the plain sampler's.
fn chains(running: &[Seq], ks: &[usize], params: &SamplingParams) -> Vec<DraftChain> {
    running
        .iter()
        .zip(ks)
        .enumerate()
        .map(|(c, (seq, &k))| {
            let r0 = seq.response_len() as u64;
            let uniforms = (0..=k as u64)
                .map(|i| {
                    let accept = uniform(params.seed ^ ACCEPT_STREAM, seq.key, r0 + i);
                    (accept, uniform(params.seed, seq.key, r0 + i))
                })
                .collect();
            DraftChain { p_row: c, q_row: c, len: k, uniforms }
        })
        .collect()
}

/// A mixture of experts' routes of a speculative step (`[rows × width]`) from its row order
/// (round by round, with padding) to the scheduler's: each running sequence's rows (its
/// newest token's, then its drafts'), then the prompts' rows; padding dropped.
fn chain_order(routes: Vec<u16>, ks: &[usize], verified: usize, rows: usize) -> Vec<u16> {
    if routes.is_empty() {
        return routes;
    }
    let (n, width) = (ks.len(), routes.len() / rows);
    let row = |r: usize| &routes[r * width..(r + 1) * width];
    let mut out = Vec::with_capacity(routes.len());
    for (c, &k) in ks.iter().enumerate() {
        (0..=k).for_each(|j| out.extend_from_slice(row(c + j * n)));
    }
    (verified..rows).for_each(|r| out.extend_from_slice(row(r)));
    out
}

fn tensor_error(e: miles_tensor::Error) -> crate::Error {
    model_error(e.into())
}

fn sample_params(p: &SamplingParams) -> miles_model::SampleParams {
    miles_model::SampleParams { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p }
}
