//! A speculative decode step as one CUDA graph. Its parts are the captured steps of
//! [`crate::decode`] (the draft's first round over each sequence's feed, its later rounds, the
//! policy's verifying forward) and what runs between them, captured too: the draft's LM head
//! and sampler each round, the policy's head over every verified row, the verification
//! ([`ops::speculative_verify_tables`]) and the kept tokens' logprobs. Every input is known
//! when the step starts (the rows, the counter-based uniforms), so the host loads them all,
//! launches once and reads the kept tokens back, where the eager step queues some 80
//! operations, each waited for at small batches. The kernels are the eager step's on the same
//! rows, and each row's bits do not depend on its batch, so the tokens and logprobs are the
//! eager step's too.
//!
//! Rows are laid out for a batch bucket of `b` sequences (padding on the cache's scratch
//! block): the draft's feed `k + 1` rows per sequence, sequence-major; each later round `b`
//! rows; the verification `k + 1` rows per sequence, round-major (row `j · b + c`).

use miles_tensor::Tensor;
#[cfg(feature = "cuda")]
use miles_tensor::ops::{self, ChainTables, DraftChain};
#[cfg(feature = "cuda")]
use miles_tensor::{DType, Device};

#[cfg(feature = "cuda")]
use crate::decode::{DecodeGraph, Outputs, bucket, replay_time};
use crate::{DeviceModel, Error, KvCache, Result, SampleParams, StepRow};

/// One speculative step's rows for its `n` sequences, each proposing `k` drafts, as the
/// engine lays them out (sequence `c`'s rows `n` apart where a part is round-major).
pub struct SpecRows<'a> {
    /// The draft's first round: `k + 1` rows per sequence, its feed (the positions whose
    /// policy states its draft has not read, ending at its newest token's) then padding.
    pub feed: &'a [StepRow<'a>],
    /// The policy's states the feed rows read, `[feed rows × hidden]`.
    pub feed_states: &'a Tensor,
    /// Each sequence's newest token's row in `feed`: where its chain starts.
    pub from: &'a [u32],
    /// The draft's later rounds 1..k, `n` rows each, round-major (their tokens are the
    /// previous round's draws, on the device).
    pub chain: &'a [StepRow<'a>],
    /// The verification, `k + 1` rows per sequence, round-major: each sequence's newest token
    /// (its row's token), then its drafts (the draws).
    pub verify: &'a [StepRow<'a>],
    /// The draft's draws' uniforms, round-major (`k · n`).
    pub draft_uniforms: &'a [f64],
    /// Each sequence's (accept, draw) uniforms per verified position (`k + 1` pairs).
    pub verify_uniforms: &'a [Vec<(f64, f64)>],
}

/// What a captured speculative step gives each sequence.
pub struct SpecOut {
    /// The verification's final-normed states, row `j · stride + c` for sequence c's
    /// position j after its newest token (padding rows included).
    pub states: Tensor,
    pub stride: usize,
    /// Per sequence: its kept drafts then the policy's own token, with their logprobs (empty
    /// where the policy's row has no mass).
    pub kept: Vec<Vec<(u32, f32)>>,
    /// Per sequence: the drafts its chain offered (its draws before the first with no mass).
    pub drafted: Vec<usize>,
    /// Host seconds loading the inputs, then replaying (or capturing) and reading back.
    pub seconds: (f64, f64),
}

/// The captured speculative steps of one draft length and sampling configuration, over one
/// policy's and one draft's compute copies.
pub struct SpecGraphs {
    params: SampleParams,
    k: usize,
    /// The policy's and the draft's [`DeviceModel::buffers_id`] the graphs read.
    #[cfg(feature = "cuda")]
    of: (u64, u64),
    #[cfg(feature = "cuda")]
    stride: usize,
    #[cfg(feature = "cuda")]
    graphs: Vec<SpecGraph>,
    captures: usize,
    /// Why the last capture that failed did (its steps run the body eagerly).
    failed: Option<String>,
}

impl SpecGraphs {
    /// Steps proposing `k` (at least 1) drafts per sequence, drawing with `params`.
    pub fn new(params: SampleParams, k: usize) -> Self {
        SpecGraphs {
            params,
            k,
            #[cfg(feature = "cuda")]
            of: (0, 0),
            #[cfg(feature = "cuda")]
            stride: 0,
            #[cfg(feature = "cuda")]
            graphs: Vec::new(),
            captures: 0,
            failed: None,
        }
    }

    /// Why the last capture that failed did, if one did.
    pub fn failed(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// Graphs captured so far, those dropped for new block-table widths or weights included.
    pub fn captures(&self) -> usize {
        self.captures
    }

    pub fn params(&self) -> SampleParams {
        self.params
    }

    /// Drafts per sequence a step proposes.
    pub fn drafts(&self) -> usize {
        self.k
    }

    /// Captured steps so far (one per batch bucket).
    pub fn len(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.graphs.len();
        #[cfg(not(feature = "cuda"))]
        0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device time of one replay of each captured step, `(sequences, seconds)`, over `iters`
    /// back-to-back replays of its last inputs (the cache entries it writes are rewritten with
    /// the same values). For benchmarks.
    pub fn replay_seconds(&self, iters: u64) -> Result<Vec<(usize, f64)>> {
        #[cfg(feature = "cuda")]
        return self
            .graphs
            .iter()
            .filter_map(|g| g.graph.as_ref().map(|graph| (g, graph)))
            .map(|(g, graph)| Ok((g.seqs, replay_time(graph, &g.from.device(), iters)?)))
            .collect();
        #[cfg(not(feature = "cuda"))]
        {
            let _ = iters;
            Ok(Vec::new())
        }
    }
}

/// One bucket's graph and the buffers it reads and writes.
#[cfg(feature = "cuda")]
struct SpecGraph {
    seqs: usize,
    /// `None` when capture failed (the bucket's later steps are the caller's).
    graph: Option<miles_tensor::Graph>,
    feed: DecodeGraph,
    /// Each sequence's newest token's row in the feed (i32 `[b]`).
    from: Tensor,
    rounds: Vec<DecodeGraph>,
    /// Each round's draws' uniforms as f64 bits (i32 `[b × 2]`).
    uniforms: Vec<Tensor>,
    /// Each sequence's newest token (i32 `[b × 1]`): the verification's first rows.
    newest: Tensor,
    verify: DecodeGraph,
    tables: ChainTables,
    counts: Tensor,
    tokens: Tensor,
    logp: Tensor,
}

impl DeviceModel {
    /// Whether this model's steps can be captured ([`Self::spec_step`]): bf16 on CUDA.
    pub fn captures_steps(&self) -> bool {
        #[cfg(feature = "cuda")]
        return matches!(self.device(), Device::Cuda(_)) && self.dtype() == DType::BF16;
        #[cfg(not(feature = "cuda"))]
        false
    }

    /// One speculative step of this policy with `draft` through a captured graph (captured
    /// the first time a batch bucket comes): the draft's `k` rounds, the verifying forward
    /// (keys and values into `kv` and the draft's into `draft_kv`), the verification and the
    /// kept tokens' logprobs, with the eager step's bits. Only where
    /// [`Self::captures_steps`], for dense models; `None` (nothing run) for a batch bucket
    /// whose capture failed ([`SpecGraphs::failed`]): the caller's eager step serves it.
    pub fn spec_step(
        &self,
        draft: &DeviceModel,
        graphs: &mut SpecGraphs,
        rows: SpecRows,
        (kv, draft_kv): (&mut KvCache, &mut KvCache),
    ) -> Result<Option<SpecOut>> {
        let (n, k) = (rows.from.len(), graphs.k);
        let laid_out = k > 0
            && rows.feed.len() == n * (k + 1)
            && rows.feed_states.shape().first() == Some(&rows.feed.len())
            && rows.chain.len() == (k - 1) * n
            && rows.verify.len() == (k + 1) * n
            && rows.draft_uniforms.len() == k * n
            && rows.verify_uniforms.len() == n
            && rows.verify_uniforms.iter().all(|u| u.len() == k + 1)
            && rows.from.iter().enumerate().all(|(c, &f)| (f as usize) / (k + 1) == c);
        if !laid_out {
            return Err(Error::Invalid(format!(
                "spec_step: {n} sequences proposing {k} drafts with {} feed rows, {} chain \
                 rows, {} verified rows, {} draft uniforms",
                rows.feed.len(),
                rows.chain.len(),
                rows.verify.len(),
                rows.draft_uniforms.len()
            )));
        }
        if !(self.captures_steps() && draft.captures_steps()) || self.config.moe.is_some() {
            return Err(Error::Invalid(
                "spec_step: captured steps run on CUDA in bf16, for dense models".into(),
            ));
        }
        self.check_step_tokens(rows.verify)?;
        draft.check_step_tokens(rows.feed)?;
        #[cfg(feature = "cuda")]
        {
            let of = (self.buffers_id(), draft.buffers_id());
            if graphs.of != of {
                graphs.graphs.clear();
                graphs.of = of;
            }
            self.spec_replay(draft, graphs, &rows, (kv, draft_kv))
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (kv, draft_kv);
            unreachable!("captures_steps is false without CUDA")
        }
    }

    #[cfg(feature = "cuda")]
    fn spec_replay(
        &self,
        draft: &DeviceModel,
        graphs: &mut SpecGraphs,
        rows: &SpecRows,
        (kv, draft_kv): (&mut KvCache, &mut KvCache),
    ) -> Result<Option<SpecOut>> {
        let (n, k, params) = (rows.from.len(), graphs.k, graphs.params);
        let widest = [rows.feed, rows.chain, rows.verify]
            .iter()
            .flat_map(|part| part.iter().map(|r| r.blocks.len()))
            .max()
            .unwrap_or(1);
        if widest > graphs.stride {
            graphs.stride = widest.next_power_of_two().max(8);
            graphs.graphs.clear();
        }
        let b = bucket(n);
        let started = std::time::Instant::now();
        let mut loaded = started;
        let index = match graphs.graphs.iter().position(|g| g.seqs == b) {
            // A bucket whose capture failed: the eager step, whose parts replay graphs of
            // their own, is faster than this body run eagerly.
            Some(i) if graphs.graphs[i].graph.is_none() => return Ok(None),
            Some(i) => {
                let g = &mut graphs.graphs[i];
                self.load_spec(draft, g, rows, kv)?;
                loaded = std::time::Instant::now();
                g.graph.as_ref().expect("a captured bucket").launch()?;
                i
            }
            None => {
                let stride = graphs.stride;
                graphs.captures += 1;
                let mut g = self.spec_buffers(draft, b, k, stride, (&*kv, &*draft_kv))?;
                self.load_spec(draft, &mut g, rows, kv)?;
                // This step's result, the kernels loaded and the GEMM algorithms pinned; then
                // the same body captured.
                spec_body((self, draft), &mut g, params, (&mut *kv, &mut *draft_kv))?;
                let body = || {
                    spec_body((self, draft), &mut g, params, (kv, draft_kv)).map_err(|e| match e {
                        Error::Op(e) => e,
                        other => miles_tensor::Error::Device(other.to_string()),
                    })
                };
                g.graph = match self.device().capture(body) {
                    Ok(graph) => Some(graph),
                    Err(e) => {
                        eprintln!(
                            "warning: speculative steps of {b} sequences run eagerly: \
                             capturing a CUDA graph failed: {e}"
                        );
                        graphs.failed = Some(format!("{b} sequences: {e}"));
                        None
                    }
                };
                graphs.graphs.push(g);
                graphs.graphs.len() - 1
            }
        };
        let g = &graphs.graphs[index];
        let counts = g.counts.to_vec_i32()?;
        let (tokens, logp, ids) =
            (g.tokens.to_vec_i32()?, g.logp.to_vec_f32()?, g.verify.ids.to_vec_i32()?);
        let kept = (0..n)
            .map(|c| {
                let rows = (0..counts[c].max(0) as usize).map(|j| c + j * b);
                rows.map(|r| (tokens[r] as u32, logp[r])).collect()
            })
            .collect();
        let drafted = (0..n).map(|c| (1..=k).take_while(|j| ids[c + j * b] >= 0).count()).collect();
        let Outputs::States(states) = &g.verify.out else { unreachable!("state buffers") };
        let seconds = ((loaded - started).as_secs_f64(), loaded.elapsed().as_secs_f64());
        Ok(Some(SpecOut { states: states.try_clone()?, stride: b, kept, drafted, seconds }))
    }

    /// The buffers of bucket `b`'s step with `k` drafts, block tables `stride` wide.
    #[cfg(feature = "cuda")]
    fn spec_buffers(
        &self,
        draft: &DeviceModel,
        b: usize,
        k: usize,
        stride: usize,
        (kv, draft_kv): (&KvCache, &KvCache),
    ) -> Result<SpecGraph> {
        let device = self.device();
        let i32s = |shape: &[usize]| Tensor::zeros(shape, DType::I32, &device);
        let rounds = (1..k)
            .map(|_| draft.graph_buffers(b, stride, None, true, draft_kv))
            .collect::<Result<_>>()?;
        Ok(SpecGraph {
            seqs: b,
            graph: None,
            feed: draft.graph_buffers(b * (k + 1), stride, None, true, draft_kv)?,
            from: i32s(&[b])?,
            rounds,
            uniforms: (0..k).map(|_| i32s(&[b, 2])).collect::<miles_tensor::Result<_>>()?,
            newest: i32s(&[b, 1])?,
            verify: self.graph_buffers(b * (k + 1), stride, None, false, kv)?,
            tables: ChainTables::new(b, k, (b, b), &device)?,
            counts: i32s(&[b])?,
            tokens: i32s(&[b * (k + 1)])?,
            logp: Tensor::zeros(&[b * (k + 1)], DType::F32, &device)?,
        })
    }

    /// Writes a step's inputs into bucket `g`'s buffers, from `n` sequences' layout to `b`'s.
    #[cfg(feature = "cuda")]
    fn load_spec(
        &self,
        draft: &DeviceModel,
        g: &mut SpecGraph,
        rows: &SpecRows,
        kv: &KvCache,
    ) -> Result<()> {
        let (n, b, k) = (rows.from.len(), g.seqs, g.uniforms.len());
        let cpu = Device::Cpu;
        draft.load_rows(&mut g.feed, rows.feed)?;
        let mut picks: Vec<u32> = (0..rows.feed.len() as u32).collect();
        picks.resize(g.feed.rows, 0);
        let states = ops::gather_rows(rows.feed_states, &picks)?;
        g.feed.states_in.as_mut().expect("a draft's step").copy_from(&states)?;
        let mut from: Vec<i32> = rows.from.iter().map(|&f| f as i32).collect();
        from.resize(b, 0);
        g.from.copy_from(&Tensor::from_i32(&[b], from, &cpu)?)?;
        for (r, round) in g.rounds.iter_mut().enumerate() {
            draft.load_rows(round, &rows.chain[r * n..(r + 1) * n])?;
        }
        for (r, u) in g.uniforms.iter_mut().enumerate() {
            let mut round = rows.draft_uniforms[r * n..(r + 1) * n].to_vec();
            round.resize(b, 0.0);
            u.copy_from(&ops::uniform_bits(&round, &cpu)?)?;
        }
        let mut newest: Vec<i32> = rows.verify[..n].iter().map(|r| r.token as i32).collect();
        newest.resize(b, 0);
        g.newest.copy_from(&Tensor::from_i32(&[b, 1], newest, &cpu)?)?;
        let scratch = [kv.scratch_block()];
        let pad = StepRow { token: 0, position: 0, blocks: &scratch };
        let verify: Vec<StepRow> = (0..=k)
            .flat_map(|j| (0..b).map(move |c| (j, c)))
            .map(|(j, c)| if c < n { rows.verify[j * n + c] } else { pad })
            .collect();
        self.load_rows(&mut g.verify, &verify)?;
        let chains: Vec<DraftChain> = (0..b)
            .map(|c| match rows.verify_uniforms.get(c) {
                Some(u) => DraftChain { p_row: c, q_row: c, len: k, uniforms: u.clone() },
                None => DraftChain { p_row: c, q_row: c, len: 0, uniforms: vec![(0.0, 0.0)] },
            })
            .collect();
        g.tables.load(&chains)?;
        Ok(())
    }
}

/// The step on `g`'s buffers: what is captured.
#[cfg(feature = "cuda")]
fn spec_body(
    (model, draft): (&DeviceModel, &DeviceModel),
    g: &mut SpecGraph,
    params: SampleParams,
    (kv, draft_kv): (&mut KvCache, &mut KvCache),
) -> Result<()> {
    let (b, k) = (g.seqs, g.uniforms.len());
    let (t, top_k, top_p) = (params.temperature, params.top_k, params.top_p);
    draft.decode_body(&mut g.feed, draft_kv)?;
    let Outputs::States(fed) = &g.feed.out else { unreachable!("state buffers") };
    let mut h = ops::embedding_forward_ids(fed, &g.from)?;
    let (mut q, mut draws) = (Vec::with_capacity(k), Vec::with_capacity(k));
    for r in 0..k {
        let logits = draft.head_rows(&h)?;
        let drawn =
            ops::sample_rows_ids(&logits, t, top_k, top_p, &g.uniforms[r])?.reshape(&[b, 1])?;
        if let Some(next) = g.rounds.get_mut(r) {
            next.states_in.as_mut().expect("a draft's step").copy_from(&h)?;
            next.ids.copy_from(&drawn)?;
            draft.decode_body(next, draft_kv)?;
            let Outputs::States(states) = &next.out else { unreachable!("state buffers") };
            h = states.try_clone()?;
        }
        q.push(logits);
        draws.push(drawn);
    }
    let ids: Vec<&Tensor> = std::iter::once(&g.newest).chain(&draws).collect();
    g.verify.ids.copy_from(&ops::concat_rows(&ids)?)?;
    model.decode_body(&mut g.verify, kv)?;
    let Outputs::States(states) = &g.verify.out else { unreachable!("state buffers") };
    let p = model.head_rows(states)?;
    let q = ops::concat_rows(&q.iter().collect::<Vec<_>>())?;
    let how = (t, top_k, top_p);
    let verified = ops::speculative_verify_tables(&p, &q, &g.verify.ids, &g.tables, how)?;
    g.counts.copy_from(&verified.counts)?;
    g.tokens.copy_from(&verified.tokens)?;
    g.logp.copy_from(&ops::logprob_rows_ids(&p, &verified.tokens, t)?.0)?;
    Ok(())
}
