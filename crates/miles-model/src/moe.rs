//! The sparse MLP of a Qwen3-MoE layer, over any [`Backend`]: the router's softmax and top-k
//! on the host (a few numbers per token), each expert's SwiGLU over the rows routed to it, and
//! each token's experts summed in rank order, so a token's output depends only on its own row.
//!
//! As transformers computes it: `p = softmax(x·W_routerᵀ)` in f32, the top-k experts by
//! probability (ties to the lower index), gate weights `p[e_k]`, divided by their sum with
//! `norm_topk_prob`; `out = Σ_k w_k · expert_{e_k}(x)`. With replay (Rollout Routing Replay) the
//! experts are given and the gate weights are the current probabilities at them, renormalized
//! the same way, so the router still gets gradients. The load-balancing loss is transformers'
//! `load_balancing_loss_func` over the sparse layers' tokens taken together:
//! `E/N² · Σ_e c_e · Σ_n p_ne`, with `c_e` the number of top-k picks of expert `e` (by each
//! token's own top-k) and `N` the rows of all sparse layers.
//!
//! DeepSeek-V3 ([`crate::Routing::GroupedSigmoid`]) scores each expert by `s = sigmoid(logit)`
//! and chooses by `s + bias` (`e_score_correction_bias`, which balances the load without a
//! loss): the `topk_group` groups whose two best such scores sum highest, then the top-k of
//! their experts; the gate weights are the chosen `s`, divided by their sum (+1e-20) with
//! `norm_topk_prob`, times `routed_scaling_factor`. The bias steers the choice only.

use rayon::prelude::*;

use crate::backend::{Backend, BackwardBackend, Linear, take};
use crate::config::{MoeConfig, Routing as Scoring};
use crate::{Error, ModelConfig, PackedBatch, Result};

/// One sparse layer's routing of `tokens` rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub top_k: usize,
    pub num_experts: usize,
    /// Each token's experts in rank order, `[tokens × top_k]`.
    pub experts: Vec<u32>,
    /// Their gate weights, `[tokens × top_k]`.
    pub weights: Vec<f32>,
    /// The router's softmax (DeepSeek: its sigmoid scores), `[tokens × num_experts]`.
    pub probs: Vec<f32>,
    /// Each token's own top-k (the experts when nothing is replayed), for the balance loss.
    pub own: Vec<u32>,
}

impl Routing {
    pub fn tokens(&self) -> usize {
        self.experts.len() / self.top_k.max(1)
    }
}

/// The softmax of one row of logits in f32, summed in index order.
fn softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exps: Vec<f32> = logits.iter().map(|&l| (l - max).exp()).collect();
    let sum: f32 = exps.iter().sum();
    exps.iter().map(|&e| e / sum).collect()
}

/// The `k` largest of `p` by value, ties to the lower index, in rank order (a selection, then
/// a sort of the `k`: the order is total, so the first `k` of a full sort).
fn top_k(p: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..p.len() as u32).collect();
    let order = |a: &u32, b: &u32| p[*b as usize].total_cmp(&p[*a as usize]).then(a.cmp(b));
    if k > 0 && k < idx.len() {
        idx.select_nth_unstable_by(k - 1, order);
    }
    idx.truncate(k);
    idx.sort_by(order);
    idx
}

/// DeepSeek's choice by `choice` (scores plus bias): the top-k experts of the `kept` of
/// `groups` groups ranked by the sum of their two best, ties to the lower index.
fn grouped_top_k(choice: &[f32], groups: usize, kept: usize, k: usize) -> Vec<u32> {
    if kept >= groups {
        return top_k(choice, k);
    }
    let per = choice.len() / groups;
    let sums: Vec<f32> =
        choice.chunks(per).map(|g| top_k(g, 2).iter().map(|&i| g[i as usize]).sum()).collect();
    let keep = top_k(&sums, kept);
    let masked: Vec<f32> = (0..choice.len())
        .map(|i| if keep.contains(&((i / per) as u32)) { choice[i] } else { f32::NEG_INFINITY })
        .collect();
    top_k(&masked, k)
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The replay entry of a token without a record: it takes its own top-k.
pub const OWN_CHOICE: u32 = u32::MAX;

/// Routes `logits` `[tokens × num_experts]` (DeepSeek's: with the layer's correction `bias`);
/// `replay` gives the experts (`[tokens × top_k]`) instead of the top-k, a token whose entries
/// are [`OWN_CHOICE`] routing itself.
pub fn route(
    logits: &[f32],
    bias: Option<&[f32]>,
    m: &MoeConfig,
    replay: Option<&[u32]>,
) -> Result<Routing> {
    let (e, k) = (m.num_experts, m.num_experts_per_tok);
    let tokens = logits.len() / e;
    let grouped = match m.routing {
        Scoring::Softmax => None,
        Scoring::GroupedSigmoid { n_group, topk_group, scaling } => {
            let bias = bias.filter(|b| b.len() == e).ok_or_else(|| {
                Error::Invalid(format!(
                    "routing: a DeepSeek router needs its e_score_correction_bias of {e} experts"
                ))
            })?;
            Some((bias, n_group, topk_group, scaling))
        }
    };
    if let Some(r) = replay {
        if r.len() != tokens * k {
            return Err(Error::Invalid(format!(
                "routing replay: {} experts for {tokens} tokens × top-{k}",
                r.len()
            )));
        }
        if let Some(bad) = r.iter().find(|&&x| x as usize >= e && x != OWN_CHOICE) {
            return Err(Error::Invalid(format!(
                "routing replay: expert {bad} of a layer with {e} experts"
            )));
        }
    }
    let mut routing = Routing {
        top_k: k,
        num_experts: e,
        experts: vec![0; tokens * k],
        weights: vec![0.0; tokens * k],
        probs: vec![0.0; tokens * e],
        own: vec![0; tokens * k],
    };
    // Each token on its own (a training batch has thousands): in parallel, the same bits.
    const TOKENS_PER_TASK: usize = 64;
    routing
        .probs
        .par_chunks_mut(TOKENS_PER_TASK * e)
        .zip(routing.experts.par_chunks_mut(TOKENS_PER_TASK * k))
        .zip(routing.weights.par_chunks_mut(TOKENS_PER_TASK * k))
        .zip(routing.own.par_chunks_mut(TOKENS_PER_TASK * k))
        .enumerate()
        .for_each(|(task, (((probs, experts), weights), own))| {
            for (i, p_out) in probs.chunks_mut(e).enumerate() {
                let t = task * TOKENS_PER_TASK + i;
                let row = &logits[t * e..(t + 1) * e];
                let (p, mine) = match grouped {
                    None => {
                        let p = softmax(row);
                        let mine = top_k(&p, k);
                        (p, mine)
                    }
                    Some((bias, groups, kept, _)) => {
                        let s: Vec<f32> = row.iter().map(|&l| sigmoid(l)).collect();
                        let choice: Vec<f32> = s.iter().zip(bias).map(|(s, b)| s + b).collect();
                        let mine = grouped_top_k(&choice, groups, kept, k);
                        (s, mine)
                    }
                };
                let chosen = match replay.map(|r| &r[t * k..(t + 1) * k]) {
                    Some(given) if given[0] != OWN_CHOICE => given,
                    _ => &mine[..],
                };
                let w = &mut weights[i * k..(i + 1) * k];
                for (w, &x) in w.iter_mut().zip(chosen) {
                    *w = p[x as usize];
                }
                match grouped {
                    None if m.norm_topk_prob => {
                        let sum: f32 = w.iter().sum();
                        w.iter_mut().for_each(|v| *v /= sum);
                    }
                    None => {}
                    Some((.., scaling)) => {
                        if m.norm_topk_prob {
                            let sum = w.iter().sum::<f32>() + 1e-20;
                            w.iter_mut().for_each(|v| *v /= sum);
                        }
                        w.iter_mut().for_each(|v| *v *= scaling);
                    }
                }
                experts[i * k..(i + 1) * k].copy_from_slice(chosen);
                own[i * k..(i + 1) * k].copy_from_slice(&mine);
                p_out.copy_from_slice(&p);
            }
        });
    Ok(routing)
}

/// How a layer's expert choices compare with the rollout's record, over the tokens that have
/// one: tokens whose own top-k set differs from the record (what R3 guards against), and
/// whose experts used (replayed or own) differ.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RoutingMismatch {
    pub compared: usize,
    pub own_differs: usize,
    pub used_differs: usize,
}

impl RoutingMismatch {
    /// Adds `r`'s tokens against `record` (`[tokens × top_k]`, [`OWN_CHOICE`] where missing).
    pub fn add(&mut self, r: &Routing, record: &[u32]) {
        let k = r.top_k;
        let set = |x: &[u32]| {
            let mut v = x.to_vec();
            v.sort_unstable();
            v
        };
        for t in 0..r.tokens() {
            let rec = &record[t * k..(t + 1) * k];
            if rec[0] == OWN_CHOICE {
                continue;
            }
            let rec = set(rec);
            self.compared += 1;
            self.own_differs += usize::from(set(&r.own[t * k..(t + 1) * k]) != rec);
            self.used_differs += usize::from(set(&r.experts[t * k..(t + 1) * k]) != rec);
        }
    }

    pub fn merge(&mut self, o: &RoutingMismatch) {
        self.compared += o.compared;
        self.own_differs += o.own_differs;
        self.used_differs += o.used_differs;
    }
}

/// Each sparse layer's experts (`[rows × top_k]` each) as `[rows × layers × top_k]`, the
/// layout of `Sample::rollout_routed_experts`.
pub(crate) fn interleave(per_layer: &[&[u32]], top_k: usize) -> Vec<u16> {
    let rows = per_layer.first().map_or(0, |l| l.len() / top_k.max(1));
    let mut ids = Vec::with_capacity(rows * per_layer.len() * top_k);
    for r in 0..rows {
        for layer in per_layer {
            ids.extend(layer[r * top_k..(r + 1) * top_k].iter().map(|&e| e as u16));
        }
    }
    ids
}

/// What a forward reports of its sparse layers, and what its backward needs of them.
#[derive(Debug, Clone, Default)]
pub struct SparseOutputs {
    /// The load-balancing loss (transformers' `load_balancing_loss_func`: top-k when
    /// balanced), whatever its weight in the loss; `None` for a dense model and for
    /// DeepSeek's routing (balanced by its bias).
    pub router_aux_loss: Option<f64>,
    /// Against the batch's routed experts, when it has them.
    pub routing_mismatch: Option<RoutingMismatch>,
    /// Scales the load-balancing loss's gradient in the backward (a micro-batch's share of its
    /// step, as the loss it reports is weighted); 1 unless set.
    pub aux_weight: f32,
    balance: BalanceStats,
}

impl SparseOutputs {
    /// The backward's balance-loss term for `c`: its weight and statistics, when it has one.
    pub(crate) fn balance(&self, c: &ModelConfig) -> Option<(f32, &BalanceStats)> {
        let coef = c.moe.as_ref().map_or(0.0, |m| m.router_aux_loss_coef) * self.aux_weight;
        (coef > 0.0).then_some((coef, &self.balance))
    }
}

/// A training forward's bookkeeping of its sparse layers: the replay and the record of each
/// from the batch ([`crate::RoutedBatch`]), and the balance statistics and mismatch counts.
pub(crate) struct SparseLayers<'a> {
    batch: &'a PackedBatch,
    seen: usize,
    record: Option<Vec<u32>>,
    pub balance: BalanceStats,
    pub mismatch: Option<RoutingMismatch>,
}

impl<'a> SparseLayers<'a> {
    pub fn new(batch: &'a PackedBatch) -> Self {
        let mismatch = batch.routed.as_ref().map(|_| RoutingMismatch::default());
        SparseLayers { batch, seen: 0, record: None, balance: BalanceStats::default(), mismatch }
    }

    /// Before decoder layer `layer`: the experts to replay there, if any.
    pub fn replay(&mut self, c: &ModelConfig, layer: usize) -> Result<Option<Vec<u32>>> {
        self.record = None;
        let Some(r) = self.batch.routed.as_ref().filter(|_| c.is_sparse_layer(layer)) else {
            return Ok(None);
        };
        if self.seen >= r.layers {
            return Err(Error::Invalid(format!(
                "packed batch: routed experts for {} sparse layers, the model has more",
                r.layers
            )));
        }
        self.record = Some(r.layer(&r.ids, self.seen));
        Ok(r.replay.as_ref().map(|p| r.layer(p, self.seen)))
    }

    /// What the forward reports, after its layers.
    pub fn finish(self, c: &ModelConfig) -> SparseOutputs {
        SparseOutputs {
            // (DeepSeek balances by its bias, without this loss.)
            router_aux_loss: (c.moe.as_ref())
                .filter(|m| m.routing == Scoring::Softmax)
                .map(|_| self.balance.loss()),
            routing_mismatch: self.mismatch,
            aux_weight: 1.0,
            balance: self.balance,
        }
    }

    /// After the layer: its routing into the statistics.
    pub fn after(&mut self, routing: Option<&Routing>) {
        if let Some(r) = routing {
            self.balance.add(r);
            self.seen += 1;
            if let (Some(m), Some(ids)) = (self.mismatch.as_mut(), &self.record) {
                m.add(r, ids);
            }
        }
    }
}

/// The rows one expert ran: which picks (`token · top_k + rank`) they are, and the
/// activations its backward needs.
pub(crate) struct ExpertRun<A> {
    expert: usize,
    picks: Vec<u32>,
    x: A,
    gate: A,
    up: A,
    act: A,
    y: A,
}

/// What a sparse layer's forward keeps for its backward.
pub(crate) struct MoeActivations<A> {
    pub routing: Routing,
    experts: ExpertActs<A>,
}

/// The experts' activations, as the backend ran them.
enum ExpertActs<A> {
    /// One expert at a time (the CPU, and f32 on a GPU).
    PerExpert {
        runs: Vec<ExpertRun<A>>,
        /// Per pick, (run, row in that run).
        slots: Vec<(u32, u32)>,
    },
    /// Every expert at once over the picks sorted by expert ([`Backend::grouped_experts`]).
    Grouped { order: ExpertOrder, gate: A, up: A, act: A, y: A },
}

/// One of an expert's three matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ExpertMatrix {
    Gate,
    Up,
    Down,
}

/// A layer's picks sorted by expert (stable: in pick order within an expert), as the grouped
/// products take them.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ExpertOrder {
    /// Expert `e` owns sorted rows `offsets[e]..offsets[e + 1]`.
    pub offsets: Vec<u32>,
    /// Per sorted row, its pick (`token · top_k + rank`).
    pub picks: Vec<u32>,
    /// Per sorted row, its token.
    pub tokens: Vec<u32>,
    /// Per pick, its sorted row.
    pub rows_of_picks: Vec<u32>,
}

impl ExpertOrder {
    pub fn new(r: &Routing) -> ExpertOrder {
        let mut offsets = vec![0u32; r.num_experts + 1];
        for &e in &r.experts {
            offsets[e as usize + 1] += 1;
        }
        for e in 0..r.num_experts {
            offsets[e + 1] += offsets[e];
        }
        let mut next = offsets.clone();
        let mut picks = vec![0u32; r.experts.len()];
        let mut rows_of_picks = vec![0u32; r.experts.len()];
        for (pick, &e) in r.experts.iter().enumerate() {
            let row = &mut next[e as usize];
            picks[*row as usize] = pick as u32;
            rows_of_picks[pick] = *row;
            *row += 1;
        }
        let k = r.top_k.max(1) as u32;
        let tokens = picks.iter().map(|&p| p / k).collect();
        ExpertOrder { offsets, picks, tokens, rows_of_picks }
    }
}

/// The sparse MLP on `x` `[tokens × hidden]` of `layer`.
pub(crate) fn moe_forward<B: Backend>(
    b: &B,
    m: &MoeConfig,
    layer: usize,
    x: &B::Act,
    hidden: usize,
    replay: Option<&[u32]>,
) -> Result<(B::Act, MoeActivations<B::Act>)> {
    let routing = b.stage("moe: route (host)", || {
        let [logits] = take(b.linear(layer, Linear::Router, x)?);
        let bias = b.router_bias(layer)?;
        route(&b.to_host(&logits)?, bias.as_deref(), m, replay)
    })?;
    let k = m.num_experts_per_tok;
    if b.grouped_experts() {
        let order = ExpertOrder::new(&routing);
        let offsets = &order.offsets;
        let product = |which, x, rows| b.experts_product(layer, which, x, rows, offsets, false);
        let gate = product(ExpertMatrix::Gate, x, Some(&order.tokens))?;
        let up = product(ExpertMatrix::Up, x, Some(&order.tokens))?;
        let act = b.glu(&gate, &up)?;
        let y = product(ExpertMatrix::Down, &act, None)?;
        let out = b.pick_rows(&y, hidden, &order.rows_of_picks, &routing.weights, k)?;
        let experts = ExpertActs::Grouped { order, gate, up, act, y };
        return Ok((out, MoeActivations { routing, experts }));
    }
    let mut by_expert: Vec<Vec<u32>> = vec![Vec::new(); m.num_experts];
    for (pick, &e) in routing.experts.iter().enumerate() {
        by_expert[e as usize].push(pick as u32);
    }
    let mut runs = Vec::new();
    let mut slots = vec![(0, 0); routing.experts.len()];
    for (expert, picks) in by_expert.into_iter().enumerate().filter(|(_, p)| !p.is_empty()) {
        let rows: Vec<u32> = picks.iter().map(|&p| p / k as u32).collect();
        let xe = b.gather_rows(x, hidden, &rows, None)?;
        let [gate, up] = take(b.linear(layer, Linear::ExpertGateUp(expert), &xe)?);
        let act = b.glu(&gate, &up)?;
        let [y] = take(b.linear(layer, Linear::ExpertDown(expert), &act)?);
        for (r, &p) in picks.iter().enumerate() {
            slots[p as usize] = (runs.len() as u32, r as u32);
        }
        runs.push(ExpertRun { expert, picks, x: xe, gate, up, act, y });
    }
    let ys: Vec<&B::Act> = runs.iter().map(|r| &r.y).collect();
    let out = b.sum_rows(&ys, hidden, &slots, &routing.weights, k)?;
    Ok((out, MoeActivations { routing, experts: ExpertActs::PerExpert { runs, slots } }))
}

/// The balance loss's statistics over the sparse layers seen so far.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct BalanceStats {
    /// Top-k picks per expert (`c_e`).
    pub counts: Vec<f64>,
    /// Σ over rows of each expert's probability.
    pub prob_sums: Vec<f64>,
    /// Rows of all sparse layers (`N`).
    pub rows: usize,
}

impl BalanceStats {
    pub fn add(&mut self, r: &Routing) {
        if self.counts.is_empty() {
            self.counts = vec![0.0; r.num_experts];
            self.prob_sums = vec![0.0; r.num_experts];
        }
        for &e in &r.own {
            self.counts[e as usize] += 1.0;
        }
        for row in r.probs.chunks(r.num_experts) {
            for (s, &p) in self.prob_sums.iter_mut().zip(row) {
                *s += f64::from(p);
            }
        }
        self.rows += r.tokens();
    }

    /// transformers' `load_balancing_loss_func` (top-k when perfectly balanced).
    pub fn loss(&self) -> f64 {
        let n = self.rows.max(1) as f64;
        let e = self.counts.len() as f64;
        e / (n * n) * self.counts.iter().zip(&self.prob_sums).map(|(c, s)| c * s).sum::<f64>()
    }

    /// `coef · d loss / d p_ne` for every row's expert `e`.
    fn prob_grads(&self, coef: f32) -> Vec<f32> {
        let n = self.rows.max(1) as f64;
        let scale = f64::from(coef) * self.counts.len() as f64 / (n * n);
        self.counts.iter().map(|c| (scale * c) as f32).collect()
    }
}

/// The sparse MLP's backward: `d_out` to d(loss)/d`x`, adding the experts' and the router's
/// weight gradients into the backend's; with `balance` `(coef, stats)` the balance loss's
/// gradient too.
#[allow(clippy::too_many_arguments)]
pub(crate) fn moe_backward<B: BackwardBackend>(
    b: &mut B,
    m: &MoeConfig,
    layer: usize,
    a: &MoeActivations<B::Act>,
    x: &B::Act,
    hidden: usize,
    d_out: &B::Act,
    balance: Option<(f32, &BalanceStats)>,
) -> Result<B::Act> {
    let r = &a.routing;
    let (d_weights, d_x) = match &a.experts {
        ExpertActs::PerExpert { runs, slots } => {
            per_expert_backward(b, layer, r, runs, slots, hidden, d_out)?
        }
        ExpertActs::Grouped { order, gate, up, act, y } => {
            let k = r.top_k;
            let offsets = &order.offsets;
            let d_weights = b.pick_dots(d_out, y, hidden, &order.rows_of_picks, k)?;
            let scales: Vec<f32> = order.picks.iter().map(|&p| r.weights[p as usize]).collect();
            let d_y = b.pick_rows(d_out, hidden, &order.tokens, &scales, 1)?;
            let d_act = b.experts_product(layer, ExpertMatrix::Down, &d_y, None, offsets, true)?;
            b.experts_wgrad(layer, ExpertMatrix::Down, &d_y, act, None, offsets)?;
            drop(d_y);
            let (d_gate, d_up) = b.glu_backward(&d_act, gate, up)?;
            drop(d_act);
            let tokens = Some(order.tokens.as_slice());
            b.experts_wgrad(layer, ExpertMatrix::Gate, &d_gate, x, tokens, offsets)?;
            b.experts_wgrad(layer, ExpertMatrix::Up, &d_up, x, tokens, offsets)?;
            let d_xg =
                b.experts_product(layer, ExpertMatrix::Gate, &d_gate, None, offsets, true)?;
            let d_xu = b.experts_product(layer, ExpertMatrix::Up, &d_up, None, offsets, true)?;
            let d_xp = b.add(&d_xg, &d_xu)?;
            let ones = vec![1.0; r.experts.len()];
            (d_weights, b.pick_rows(&d_xp, hidden, &order.rows_of_picks, &ones, k)?)
        }
    };
    let d_logits = router_backward(r, &d_weights, m, balance);
    let d_logits = b.upload(d_logits, r.num_experts)?;
    let d_x_router = b.linear_backward(layer, Linear::Router, &[&d_logits], x)?;
    b.add(&d_x, &d_x_router)
}

/// The experts' backward one expert at a time: the gate weights' gradients and d`x`.
fn per_expert_backward<B: BackwardBackend>(
    b: &mut B,
    layer: usize,
    r: &Routing,
    runs: &[ExpertRun<B::Act>],
    slots: &[(u32, u32)],
    hidden: usize,
    d_out: &B::Act,
) -> Result<(Vec<f32>, B::Act)> {
    let k = r.top_k;
    let ys: Vec<&B::Act> = runs.iter().map(|run| &run.y).collect();
    let d_weights = b.row_dots(d_out, &ys, hidden, slots, k)?;
    let mut d_xs = Vec::with_capacity(runs.len());
    for run in runs {
        let rows: Vec<u32> = run.picks.iter().map(|&p| p / k as u32).collect();
        let scales: Vec<f32> = run.picks.iter().map(|&p| r.weights[p as usize]).collect();
        let d_y = b.gather_rows(d_out, hidden, &rows, Some(&scales))?;
        let down = Linear::ExpertDown(run.expert);
        let d_act = b.linear_backward(layer, down, &[&d_y], &run.act)?;
        let (d_gate, d_up) = b.glu_backward(&d_act, &run.gate, &run.up)?;
        let gate_up = Linear::ExpertGateUp(run.expert);
        d_xs.push(b.linear_backward(layer, gate_up, &[&d_gate, &d_up], &run.x)?);
    }
    let d_refs: Vec<&B::Act> = d_xs.iter().collect();
    let ones = vec![1.0; r.experts.len()];
    Ok((d_weights, b.sum_rows(&d_refs, hidden, slots, &ones, k)?))
}

/// d(loss)/d(router logits) `[tokens × num_experts]` from the gate weights' gradients, through
/// the renormalization and the softmax (DeepSeek: the scaling, the renormalization and each
/// chosen expert's sigmoid), plus the balance loss's.
fn router_backward(
    r: &Routing,
    d_weights: &[f32],
    m: &MoeConfig,
    balance: Option<(f32, &BalanceStats)>,
) -> Vec<f32> {
    let (e, k, norm) = (r.num_experts, r.top_k, m.norm_topk_prob);
    if let Scoring::GroupedSigmoid { scaling, .. } = m.routing {
        return sigmoid_router_backward(r, d_weights, norm, scaling);
    }
    let extra = balance.map(|(coef, stats)| stats.prob_grads(coef));
    let mut d_logits = vec![0.0f32; r.probs.len()];
    // Token by token, each on its own: in parallel, the same bits.
    d_logits.par_chunks_mut(e).enumerate().for_each(|(t, out)| {
        let p = &r.probs[t * e..(t + 1) * e];
        let chosen = &r.experts[t * k..(t + 1) * k];
        let w = &r.weights[t * k..(t + 1) * k];
        let dw = &d_weights[t * k..(t + 1) * k];
        let mut dp = extra.clone().unwrap_or_else(|| vec![0.0; e]);
        if norm {
            // w = q / Σq: dq_k = (dw_k − Σ_j dw_j·w_j) / Σq.
            let sum: f32 = chosen.iter().map(|&x| p[x as usize]).sum();
            let dot: f32 = dw.iter().zip(w).map(|(a, b)| a * b).sum();
            for (&x, &g) in chosen.iter().zip(dw) {
                dp[x as usize] += (g - dot) / sum;
            }
        } else {
            for (&x, &g) in chosen.iter().zip(dw) {
                dp[x as usize] += g;
            }
        }
        let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for ((o, &pi), &gi) in out.iter_mut().zip(p).zip(&dp) {
            *o = pi * (gi - dot);
        }
    });
    d_logits
}

/// [`router_backward`] of DeepSeek's weights `w_k = c · s_k / (Σ_j s_j + ε)` (or `c · s_k`)
/// with `s = sigmoid(logit)`: `ds_i = (c / S) · (dw_i − Σ_k dw_k · w_k / c)`, through the
/// sigmoid's `s (1 − s)`; experts not chosen get none (the bias has no gradient).
fn sigmoid_router_backward(r: &Routing, d_weights: &[f32], norm: bool, scaling: f32) -> Vec<f32> {
    let (e, k) = (r.num_experts, r.top_k);
    let mut d_logits = vec![0.0f32; r.probs.len()];
    d_logits.par_chunks_mut(e).enumerate().for_each(|(t, out)| {
        let s = &r.probs[t * e..(t + 1) * e];
        let chosen = &r.experts[t * k..(t + 1) * k];
        let (w, dw) = (&r.weights[t * k..(t + 1) * k], &d_weights[t * k..(t + 1) * k]);
        let sum = chosen.iter().map(|&x| s[x as usize]).sum::<f32>() + 1e-20;
        let dot: f32 = dw.iter().zip(w).map(|(a, b)| a * b / scaling).sum();
        for (&x, &g) in chosen.iter().zip(dw) {
            let ds = if norm { scaling * (g - dot) / sum } else { scaling * g };
            let si = s[x as usize];
            out[x as usize] += ds * si * (1.0 - si);
        }
    });
    d_logits
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(norm: bool) -> MoeConfig {
        MoeConfig {
            num_experts: 4,
            num_experts_per_tok: 2,
            moe_intermediate_size: 8,
            norm_topk_prob: norm,
            decoder_sparse_step: 1,
            mlp_only_layers: Vec::new(),
            router_aux_loss_coef: 0.0,
            routing: crate::Routing::Softmax,
            shared_experts: 0,
        }
    }

    #[test]
    fn routing_takes_the_top_k_with_ties_to_the_lower_index_and_renormalizes() {
        let logits = [0.0, 2.0, 2.0, 1.0, /* */ 3.0, -1.0, 0.5, 0.5];
        let r = route(&logits, None, &config(true), None).unwrap();
        assert_eq!(r.experts, [1, 2, 0, 2]);
        assert!((r.weights[0] - 0.5).abs() < 1e-7 && (r.weights[1] - 0.5).abs() < 1e-7);
        let p = softmax(&logits[4..]);
        assert!((r.weights[2] - p[0] / (p[0] + p[2])).abs() < 1e-7);
        let raw = route(&logits, None, &config(false), None).unwrap();
        assert_eq!(raw.weights[2], p[0]);
        // Replay keeps the given experts and weighs them by the current probabilities.
        let replay = route(&logits, None, &config(true), Some(&[3, 0, 1, 3])).unwrap();
        assert_eq!((replay.experts.clone(), replay.own.clone()), (vec![3, 0, 1, 3], r.experts));
        let q = softmax(&logits[..4]);
        assert!((replay.weights[0] - q[3] / (q[3] + q[0])).abs() < 1e-7);
        assert!(route(&logits, None, &config(true), Some(&[0, 1])).is_err());
        assert!(route(&logits, None, &config(true), Some(&[0, 1, 2, 4])).is_err());
    }

    /// The picks sorted by expert, stably, with each pick's row and each row's token.
    #[test]
    fn expert_order_sorts_the_picks_stably() {
        let r = route(&[0.0; 12], None, &config(false), Some(&[2, 0, 0, 3, 2, 1])).unwrap();
        let o = ExpertOrder::new(&r);
        assert_eq!(o.offsets, [0, 2, 3, 5, 6]);
        assert_eq!(o.picks, [1, 2, 5, 0, 4, 3]);
        assert_eq!(o.tokens, [0, 1, 2, 0, 2, 1]);
        for (row, &pick) in o.picks.iter().enumerate() {
            assert_eq!(o.rows_of_picks[pick as usize] as usize, row);
        }
        // The selection gives the full sort's top-k, ties to the lower index.
        let p = [0.1, 0.3, 0.3, 0.05, 0.25];
        assert_eq!(top_k(&p, 3), [1, 2, 4]);
        assert_eq!(top_k(&p, 5), [1, 2, 4, 0, 3]);
    }

    #[test]
    fn the_balance_loss_is_top_k_when_balanced() {
        // Uniform probabilities, every expert picked equally often.
        let r = route(&[0.0; 8], None, &config(false), Some(&[0, 1, 2, 3])).unwrap();
        let mut stats = BalanceStats::default();
        let mut even = r.clone();
        even.own = vec![0, 1, 2, 3];
        stats.add(&even);
        assert!((stats.loss() - 2.0).abs() < 1e-12, "{}", stats.loss());
        assert_eq!(stats.rows, 2);
    }

    /// `got` against central differences of `f` at `logits` (steps of 1e-2).
    fn assert_matches_central_differences(
        got: &[f32],
        logits: &[f32],
        f: impl Fn(&[f32]) -> f64,
        what: &str,
    ) {
        for i in 0..logits.len() {
            let h = 1e-2;
            let (mut a, mut b) = (logits.to_vec(), logits.to_vec());
            a[i] += h;
            b[i] -= h;
            let want = (f(&a) - f(&b)) / (2.0 * f64::from(h));
            let err = (f64::from(got[i]) - want).abs();
            assert!(err < 2e-3, "{what} logit {i}: {} vs {want}", got[i]);
        }
    }

    /// The router's backward against finite differences of a scalar of the gate weights and
    /// the balance loss, with and without renormalization.
    #[test]
    fn router_backward_matches_finite_differences() {
        let mut rng = miles_tensor::rng::Rng::new(3);
        for norm in [false, true] {
            let m = config(norm);
            let logits = rng.vec(3 * 4, 1.5);
            let probe = rng.vec(3 * 2, 1.0);
            let coef = 0.3;
            let base = route(&logits, None, &m, None).unwrap();
            // Experts fixed at the base routing (replay), so the function is smooth.
            let f = |l: &[f32]| -> f64 {
                let r = route(l, None, &m, Some(&base.experts)).unwrap();
                let mut stats = BalanceStats::default();
                stats.add(&r);
                // The counts are constants of the routing: use the base's.
                stats.counts = {
                    let mut s = BalanceStats::default();
                    s.add(&base);
                    s.counts
                };
                let gate: f64 = r.weights.iter().zip(&probe).map(|(w, p)| f64::from(w * p)).sum();
                gate + f64::from(coef) * stats.loss()
            };
            let mut stats = BalanceStats::default();
            stats.add(&base);
            let got = router_backward(&base, &probe, &m, Some((coef, &stats)));
            assert_matches_central_differences(&got, &logits, f, &format!("norm {norm}"));
        }
    }

    /// DeepSeek's router of 8 experts in 4 groups, 2 kept, 2 experts a token.
    fn deepseek(norm: bool) -> MoeConfig {
        MoeConfig {
            num_experts: 8,
            routing: crate::Routing::GroupedSigmoid { n_group: 4, topk_group: 2, scaling: 2.5 },
            ..config(norm)
        }
    }

    /// The choice ranks scores plus bias within the best groups (by their two best); the
    /// weights are the bare scores, renormalized and scaled.
    #[test]
    fn deepseek_routing_chooses_by_biased_scores_within_the_best_groups() {
        let logit = |s: f32| (s / (1.0 - s)).ln();
        // Scores per group: (0.9, 0.1) (0.6, 0.55) (0.7, 0.2) (0.5, 0.45). Without a bias
        // groups 1 (1.15) and 0 (1.0) are kept: experts 0 and 2. A bias of 0.3 on expert 6
        // lifts group 3 to 1.25: groups 3 and 1 are kept, and expert 0, the best score, is
        // left out; the choice is 6 (0.8 biased) and 2, weighed by their bare scores.
        let scores = [0.9, 0.1, 0.6, 0.55, 0.7, 0.2, 0.5, 0.45];
        let logits: Vec<f32> = scores.iter().map(|&s| logit(s)).collect();
        let plain = route(&logits, Some(&[0.0; 8]), &deepseek(true), None).unwrap();
        assert_eq!(plain.experts, [0, 2]);
        let mut bias = [0.0f32; 8];
        bias[6] = 0.3;
        let r = route(&logits, Some(&bias), &deepseek(true), None).unwrap();
        assert_eq!(r.experts, [6, 2]);
        let (s6, s2) = (sigmoid(logits[6]), sigmoid(logits[2]));
        let sum = s6 + s2 + 1e-20;
        assert_eq!(r.weights, [s6 / sum * 2.5, s2 / sum * 2.5]);
        let raw = route(&logits, Some(&bias), &deepseek(false), None).unwrap();
        assert_eq!(raw.weights, [s6 * 2.5, s2 * 2.5]);
        let e = route(&logits, None, &deepseek(true), None).unwrap_err().to_string();
        assert!(e.contains("e_score_correction_bias"), "{e}");
    }

    /// The sigmoid router's backward against finite differences, the choice fixed.
    #[test]
    fn deepseek_router_backward_matches_finite_differences() {
        let mut rng = miles_tensor::rng::Rng::new(5);
        let bias = rng.vec(8, 0.1);
        for norm in [false, true] {
            let m = deepseek(norm);
            let logits = rng.vec(3 * 8, 1.5);
            let probe = rng.vec(3 * 2, 1.0);
            let base = route(&logits, Some(&bias), &m, None).unwrap();
            let f = |l: &[f32]| -> f64 {
                let r = route(l, Some(&bias), &m, Some(&base.experts)).unwrap();
                r.weights.iter().zip(&probe).map(|(w, p)| f64::from(w * p)).sum()
            };
            let got = router_backward(&base, &probe, &m, None);
            assert_matches_central_differences(&got, &logits, f, &format!("norm {norm}"));
        }
    }
}
