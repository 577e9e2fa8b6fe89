//! Speculative decoding (EAGLE's chain drafting with an MTP draft, as SGLang runs it with
//! `--speculative-eagle-topk 1`): each step the draft proposes up to `k` tokens per running
//! sequence, the policy runs its newest token and the k drafts in one forward over the paged
//! cache, and the speculator (the `eagle-spec` plugin) keeps a prefix of the drafts and draws one token of the
//! policy's own, so a sequence advances by 1 to k + 1 tokens.
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

use miles_core::{SamplingParams, Speculator};
use miles_model::{DeviceModel, StepRow};
use miles_tensor::cpu::{draw, kept_masses};
use miles_tensor::{Tensor, ops};
use rayon::prelude::*;
use serde_json::Value;

use super::{Engine, Seq, StepOut, Unit};
use crate::policy::model_error;
use crate::sampler::{Draw, uniform};

/// Seeds of the draft's draws and of the acceptance tests (the policy's draws use the run's
/// seed itself, as plain decoding does).
const DRAFT_STREAM: u64 = 0x6472_6166_745f_7371;
const ACCEPT_STREAM: u64 = 0x6163_6365_7074_5f71;

/// What a sequence's draft has not seen yet: the policy's final-normed states at positions
/// `from` up to its newest token's (exclusive), `[rows × hidden]`.
pub(crate) struct DraftFeed {
    from: usize,
    states: Tensor,
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

/// A sequence's proposal: the draft tokens and the masses each was drawn from.
#[derive(Clone, Default)]
struct Proposal {
    tokens: Vec<u32>,
    masses: Vec<Vec<u64>>,
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
    pub(super) fn spec_step(
        &mut self,
        (model, draft): (&DeviceModel, &DeviceModel),
        running: &[Seq],
        admitted: &[Unit],
        chunk: Option<(&Unit, std::ops::Range<usize>)>,
        params: &SamplingParams,
    ) -> crate::Result<StepOut> {
        let ks: Vec<usize> = running.iter().map(|s| self.lookahead(s, params)).collect();
        let proposals = self.propose(draft, running, &ks, params)?;
        let mut rows: Vec<StepRow> = Vec::new();
        let mut running_rows = Vec::with_capacity(running.len());
        for (seq, prop) in running.iter().zip(&proposals) {
            let p = seq.tokens.len() - 1;
            rows.push(StepRow { token: seq.tokens[p], position: p, blocks: &seq.blocks });
            for (j, &token) in prop.tokens.iter().enumerate() {
                rows.push(StepRow { token, position: p + 1 + j, blocks: &seq.blocks });
            }
            running_rows.push(prop.tokens.len() + 1);
        }
        let verified = rows.len();
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
        let (hidden, routes) = self.policy.verify_step(model, &rows)?;
        let mut draws = Vec::new();
        let mut feeds = Vec::new();
        let t = params.temperature;
        if verified > 0 {
            let all: Vec<u32> = (0..verified as u32).collect();
            let logits = model.logits(&hidden, &all).map_err(model_error)?;
            let host = logits.to_vec_f32().map_err(|e| model_error(e.into()))?;
            let vocab = model.config.vocab_size;
            let mut masses = host_masses(&host, vocab, params).into_iter();
            let mut targets = vec![0u32; verified];
            let mut kept = Vec::with_capacity(running.len());
            let mut row = 0;
            for (seq, prop) in running.iter().zip(&proposals) {
                let n = prop.tokens.len() + 1;
                let speculator = self.config.speculator.as_deref().expect("checked at build");
                let rows = masses.by_ref().take(n).collect();
                let tokens = verify(speculator, seq, prop, rows, params)?;
                targets[row..row + tokens.len()].copy_from_slice(&tokens);
                kept.push(tokens);
                row += n;
            }
            let logp = ops::logprob_rows(&logits, &targets, t)
                .and_then(|(lp, _)| lp.to_vec_f32())
                .map_err(|e| model_error(e.into()))?;
            let mut row = 0;
            for ((seq, prop), tokens) in running.iter().zip(&proposals).zip(kept) {
                let drafted = prop.tokens.len();
                let accepted = tokens.len().saturating_sub(1).min(drafted);
                let mut drawn: Vec<Option<Draw>> = tokens
                    .iter()
                    .enumerate()
                    .map(|(j, &token)| Some(Draw { token, logprob: logp[row + j] }))
                    .collect();
                if tokens.is_empty() {
                    drawn.push(None);
                }
                // Its draft next reads the policy's states at the positions kept.
                let p = seq.tokens.len() - 1;
                let rows: Vec<u32> = (row..row + tokens.len().max(1)).map(|r| r as u32).collect();
                let states = ops::gather_rows(&hidden, &rows).map_err(|e| model_error(e.into()))?;
                let counts = SpecCounts { verifies: usize::from(drafted > 0), drafted, accepted };
                feeds.push(Fed { feed: Some(DraftFeed { from: p, states }), counts });
                draws.push(drawn);
                row += drafted + 1;
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
                let states =
                    ops::gather_rows(&hidden, &[last]).map_err(|e| model_error(e.into()))?;
                let feed = Some(DraftFeed { from: len - 1, states });
                feeds.push(Fed { feed, counts: SpecCounts::default() });
            }
        }
        if !draft_rows.is_empty() {
            let states =
                ops::gather_rows(&hidden, &draft_states).map_err(|e| model_error(e.into()))?;
            self.policy.draft_step(draft, &draft_rows, &states)?;
        }
        Ok(StepOut { draws, routes, running_rows, feeds })
    }

    /// The draft's chains: up to `ks[i]` tokens for running sequence i, each drawn from the
    /// draft's distribution; shorter where the draft's logits are not finite.
    fn propose(
        &mut self,
        draft: &DeviceModel,
        running: &[Seq],
        ks: &[usize],
        params: &SamplingParams,
    ) -> crate::Result<Vec<Proposal>> {
        let mut out: Vec<Proposal> = vec![Proposal::default(); running.len()];
        // The first round feeds each proposing sequence the states its draft has not seen,
        // ending at its newest token's row.
        let mut active: Vec<usize> = (0..running.len()).filter(|&i| ks[i] > 0).collect();
        if active.is_empty() {
            return Ok(out);
        }
        let mut rows: Vec<StepRow> = Vec::new();
        let mut states: Vec<&Tensor> = Vec::new();
        let mut last: Vec<u32> = Vec::new();
        for &i in &active {
            let seq = &running[i];
            let feed = seq.feed.as_ref().expect("a proposing sequence has a feed");
            let p = seq.tokens.len() - 1;
            for t in feed.from..p {
                rows.push(StepRow { token: seq.tokens[t + 1], position: t, blocks: &seq.blocks });
            }
            states.push(&feed.states);
            last.push((rows.len() - 1) as u32);
        }
        let x = ops::concat_rows(&states).map_err(|e| model_error(e.into()))?;
        let mut h = self.policy.draft_step(draft, &rows, &x)?;
        let vocab = draft.config.vocab_size;
        for j in 0.. {
            let logits = draft.logits(&h, &last).map_err(model_error)?;
            let host = logits.to_vec_f32().map_err(|e| model_error(e.into()))?;
            let masses = host_masses(&host, vocab, params);
            let mut next = Vec::new();
            let mut from = Vec::new();
            for ((a, &i), q) in active.iter().enumerate().zip(masses) {
                let seq = &running[i];
                let u =
                    uniform(params.seed ^ DRAFT_STREAM, seq.key, (seq.response_len() + j) as u64);
                let Some(q) = q else { continue };
                let Some(token) = draw(&q, u) else { continue };
                out[i].tokens.push(token);
                out[i].masses.push(q);
                if ks[i] > j + 1 {
                    next.push(i);
                    from.push(last[a]);
                }
            }
            if next.is_empty() {
                break;
            }
            // The chain's next round: each drafted token at the position after the last,
            // fed the draft's own state there.
            let rows: Vec<StepRow> = next
                .iter()
                .map(|&i| {
                    let seq = &running[i];
                    let token = *out[i].tokens.last().expect("drafted above");
                    StepRow { token, position: seq.tokens.len() - 1 + j, blocks: &seq.blocks }
                })
                .collect();
            let x = ops::gather_rows(&h, &from).map_err(|e| model_error(e.into()))?;
            h = self.policy.draft_step(draft, &rows, &x)?;
            last = (0..next.len() as u32).collect();
            active = next;
        }
        Ok(out)
    }
}

/// The tokens `seq` keeps from its proposal: the drafts the speculator accepts, then the
/// policy's own; over the leading rows whose masses exist (empty when the first has none:
/// non-finite logits).
fn verify(
    speculator: &dyn Speculator,
    seq: &Seq,
    prop: &Proposal,
    masses: Vec<Option<Vec<u64>>>,
    params: &SamplingParams,
) -> crate::Result<Vec<u32>> {
    let p: Vec<Vec<u64>> = masses.into_iter().map_while(|m| m).collect();
    if p.is_empty() {
        return Ok(Vec::new());
    }
    let k = p.len() - 1;
    let (drafts, q) = (&prop.tokens[..k], &prop.masses[..k]);
    let r0 = seq.response_len() as u64;
    let u: Vec<(f64, f64)> = (0..=k as u64)
        .map(|i| {
            let accept = uniform(params.seed ^ ACCEPT_STREAM, seq.key, r0 + i);
            (accept, uniform(params.seed, seq.key, r0 + i))
        })
        .collect();
    speculator.verify(&p, q, drafts, &u)
}

/// The sampler's masses of each row of host logits `[rows × vocab]` (rows in parallel).
fn host_masses(logits: &[f32], vocab: usize, p: &SamplingParams) -> Vec<Option<Vec<u64>>> {
    logits.par_chunks(vocab).map(|l| kept_masses(l, p.temperature, p.top_k, p.top_p)).collect()
}

fn sample_params(p: &SamplingParams) -> miles_model::SampleParams {
    miles_model::SampleParams { temperature: p.temperature, top_k: p.top_k, top_p: p.top_p }
}
