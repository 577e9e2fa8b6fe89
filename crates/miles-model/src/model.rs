//! The decoder stack: forward with saved activations, and the explicit backward.

use miles_tensor::cpu::{
    self, AttentionShape, PackedLinear, Transpose, attend_row, attention_backward,
    attention_forward, embedding_backward, embedding_forward, linear_forward, logprob_backward,
    logprob_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, rope_tables,
    swiglu_backward, swiglu_forward,
};
use rayon::prelude::*;

use crate::kv::{BlockId, KvCache};
use crate::weights::LayerWeights;
use crate::{Error, ModelConfig, Result, Weights};

/// Sequences packed back to back without padding. Sequence `s` is
/// `tokens[cu_seqlens[s]..cu_seqlens[s + 1]]`, of which the first `prompt_lens[s]` are the
/// prompt; the rest is the response whose logprobs the model reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    pub tokens: Vec<u32>,
    pub cu_seqlens: Vec<usize>,
    pub prompt_lens: Vec<usize>,
}

impl PackedBatch {
    /// Packs `(tokens, prompt_len)` pairs; each needs a prompt of at least one token.
    pub fn new(sequences: &[(Vec<u32>, usize)]) -> Result<Self> {
        let mut batch =
            PackedBatch { tokens: Vec::new(), cu_seqlens: vec![0], prompt_lens: Vec::new() };
        for (s, (tokens, prompt_len)) in sequences.iter().enumerate() {
            if *prompt_len == 0 || *prompt_len > tokens.len() {
                return Err(Error::Invalid(format!(
                    "sequence {s}: prompt length {prompt_len} must be in 1..={} (its token count)",
                    tokens.len()
                )));
            }
            batch.tokens.extend(tokens);
            batch.cu_seqlens.push(batch.tokens.len());
            batch.prompt_lens.push(*prompt_len);
        }
        Ok(batch)
    }

    pub fn num_sequences(&self) -> usize {
        self.prompt_lens.len()
    }

    /// Position of each token within its sequence.
    pub fn positions(&self) -> Vec<u32> {
        let mut pos = Vec::with_capacity(self.tokens.len());
        for w in self.cu_seqlens.windows(2) {
            pos.extend(0..(w[1] - w[0]) as u32);
        }
        pos
    }

    /// Response tokens per sequence.
    pub fn response_lengths(&self) -> Vec<usize> {
        self.cu_seqlens.windows(2).zip(&self.prompt_lens).map(|(w, p)| w[1] - w[0] - p).collect()
    }

    /// The rows whose hidden state predicts a response token, and those tokens.
    pub fn response_rows(&self) -> (Vec<usize>, Vec<u32>) {
        let (mut rows, mut targets) = (Vec::new(), Vec::new());
        for (w, &p) in self.cu_seqlens.windows(2).zip(&self.prompt_lens) {
            for i in w[0] + p..w[1] {
                rows.push(i - 1);
                targets.push(self.tokens[i]);
            }
        }
        (rows, targets)
    }

    fn validate(&self, vocab: usize) -> Result<()> {
        let ok = self.cu_seqlens.first() == Some(&0)
            && self.cu_seqlens.last() == Some(&self.tokens.len())
            && self.cu_seqlens.len() == self.prompt_lens.len() + 1
            && self
                .cu_seqlens
                .windows(2)
                .zip(&self.prompt_lens)
                .all(|(w, &p)| p >= 1 && w[0] + p <= w[1]);
        if !ok {
            return Err(Error::Invalid(format!(
                "packed batch: cu_seqlens {:?} and prompt_lens {:?} do not describe {} tokens",
                self.cu_seqlens,
                self.prompt_lens,
                self.tokens.len()
            )));
        }
        if let Some(&bad) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        Ok(())
    }
}

/// A model: its configuration and f32 weights.
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
}

/// Activations of one layer kept for the backward.
struct LayerActivations {
    x_in: Vec<f32>,
    n1: Vec<f32>,
    rstd1: Vec<f32>,
    q_pre: Vec<f32>,
    q_rstd: Vec<f32>,
    k_pre: Vec<f32>,
    k_rstd: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    lse: Vec<f32>,
    x_mid: Vec<f32>,
    n2: Vec<f32>,
    rstd2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

/// The result of a forward: per response token logp and entropy, plus what the backward needs.
pub struct Forward {
    pub logp: Vec<f32>,
    pub entropy: Vec<f32>,
    temperature: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
    layers: Vec<LayerActivations>,
    x_final: Vec<f32>,
    rstd_final: Vec<f32>,
    rows: Vec<usize>,
    targets: Vec<u32>,
    hidden_rows: Vec<f32>,
}

/// The sizes one forward or backward works with.
#[derive(Debug, Clone, Copy)]
struct Dims {
    /// Tokens in the batch.
    t: usize,
    h: usize,
    d: usize,
    nq: usize,
    nkv: usize,
    inter: usize,
    qd: usize,
    kvd: usize,
}

/// The forward linear layers repacked for [`linear_forward`], whose every output is one fixed
/// multiply-add chain: a token's activations have the same bits whatever batch it is in, which
/// is what lets rollout and training logprobs agree exactly. q/k/v and gate/up are fused (a
/// fused output is the same chain as an unfused one). Rebuild after the weights change.
#[derive(Debug, Clone)]
pub struct PackedLinears {
    layers: Vec<PackedLayer>,
    head: PackedLinear,
}

#[derive(Debug, Clone)]
struct PackedLayer {
    qkv: PackedLinear,
    o: PackedLinear,
    gate_up: PackedLinear,
    down: PackedLinear,
}

impl PackedLinears {
    pub fn new(model: &Model) -> Result<Self> {
        let c = &model.config;
        let Dims { h, inter, qd, kvd, .. } = model.dims(0);
        let pack = |parts: &[&[f32]], d_out: usize, d_in: usize| -> Result<PackedLinear> {
            Ok(PackedLinear::new(&parts.concat(), d_out, d_in)?)
        };
        let layers = model
            .weights
            .layers
            .iter()
            .map(|lw| {
                Ok(PackedLayer {
                    qkv: pack(&[&lw.q_proj, &lw.k_proj, &lw.v_proj], qd + 2 * kvd, h)?,
                    o: pack(&[&lw.o_proj], h, qd)?,
                    gate_up: pack(&[&lw.gate_proj, &lw.up_proj], 2 * inter, h)?,
                    down: pack(&[&lw.down_proj], h, inter)?,
                })
            })
            .collect::<Result<_>>()?;
        Ok(PackedLinears { layers, head: pack(&[model.head()], c.vocab_size, h)? })
    }
}

/// `y[rows × out] = x[rows × in] · Wᵀ`.
fn linear(x: &[f32], w: &PackedLinear) -> Result<Vec<f32>> {
    let mut y = vec![0.0; x.len() / w.d_in() * w.d_out()];
    linear_forward(&mut y, x, w)?;
    Ok(y)
}

/// Splits the columns of `y` `[rows × Σ widths]` into one matrix per width.
fn split_columns(y: &[f32], widths: &[usize]) -> Vec<Vec<f32>> {
    let total: usize = widths.iter().sum();
    let rows = y.len() / total.max(1);
    let mut parts: Vec<Vec<f32>> = widths.iter().map(|w| Vec::with_capacity(rows * w)).collect();
    for row in y.chunks(total) {
        let mut at = 0;
        for (part, &w) in parts.iter_mut().zip(widths) {
            part.extend_from_slice(&row[at..at + w]);
            at += w;
        }
    }
    parts
}

/// `(q, k, v) → (attention output, log-sum-exp)`: where the training forward and the
/// incremental step differ.
type AttentionFn<'a> = dyn FnMut(&[f32], &[f32], &[f32]) -> Result<(Vec<f32>, Vec<f32>)> + 'a;

/// One token of an incremental forward: its id, its position in its sequence and the
/// sequence's block table, which must cover `position`.
#[derive(Debug, Clone, Copy)]
pub struct StepRow<'a> {
    pub token: u32,
    pub position: usize,
    pub blocks: &'a [BlockId],
}

/// The backward of [`linear`]: `dx (+)= dy · W`, `dW += dyᵀ · x`.
#[allow(clippy::too_many_arguments)]
fn linear_backward(
    dx: &mut [f32],
    accumulate_dx: bool,
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
) -> Result<()> {
    cpu::matmul(dx, dy, Transpose::No, w, Transpose::No, rows, d_out, d_in, accumulate_dx)?;
    cpu::matmul(dw, dy, Transpose::Yes, x, Transpose::No, d_out, rows, d_in, true)?;
    Ok(())
}

fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Result<(Vec<f32>, Vec<f32>)> {
    let mut y = vec![0.0; x.len()];
    let mut rstd = vec![0.0; x.len() / w.len()];
    rmsnorm_forward(&mut y, &mut rstd, x, w, eps)?;
    Ok((y, rstd))
}

fn add(a: &[f32], b: &[f32]) -> Vec<f32> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights) -> Self {
        Model { config, weights }
    }

    fn dims(&self, tokens: usize) -> Dims {
        let c = &self.config;
        let (d, nq, nkv) = (c.head_dim, c.num_attention_heads, c.num_key_value_heads);
        Dims {
            t: tokens,
            h: c.hidden_size,
            d,
            nq,
            nkv,
            inter: c.intermediate_size,
            qd: nq * d,
            kvd: nkv * d,
        }
    }

    fn attention_shape(&self) -> AttentionShape {
        let c = &self.config;
        AttentionShape {
            q_heads: c.num_attention_heads,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        }
    }

    /// The LM head: its own weight, or the embedding when tied.
    fn head(&self) -> &[f32] {
        self.weights.lm_head.as_deref().unwrap_or(&self.weights.embed)
    }

    /// Per response token logp and entropy at `temperature`, keeping the activations for
    /// [`Model::backward`].
    pub fn forward(&self, batch: &PackedBatch, temperature: f32) -> Result<Forward> {
        self.forward_with(&PackedLinears::new(self)?, batch, temperature)
    }

    /// [`Model::forward`] with linears packed once by the caller (micro-batches of one step).
    pub fn forward_with(
        &self,
        packed: &PackedLinears,
        batch: &PackedBatch,
        temperature: f32,
    ) -> Result<Forward> {
        self.run(packed, batch, temperature, true)
    }

    /// Per response token logp and entropy, without keeping activations (scoring, reference
    /// and old-policy logprobs).
    pub fn logprobs(&self, batch: &PackedBatch, temperature: f32) -> Result<(Vec<f32>, Vec<f32>)> {
        self.logprobs_with(&PackedLinears::new(self)?, batch, temperature)
    }

    /// [`Model::logprobs`] with linears packed once by the caller (many batches, one model).
    pub fn logprobs_with(
        &self,
        packed: &PackedLinears,
        batch: &PackedBatch,
        temperature: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let f = self.run(packed, batch, temperature, false)?;
        Ok((f.logp, f.entropy))
    }

    /// One decoder layer on `x` `[tokens × hidden]`. `attention(q, k, v)` gets the roped
    /// queries and keys and returns the attention output and its log-sum-exp: the training
    /// forward and the incremental step differ only there.
    fn layer_forward(
        &self,
        lw: &LayerWeights,
        pl: &PackedLayer,
        x: Vec<f32>,
        cos: &[f32],
        sin: &[f32],
        attention: &mut AttentionFn,
    ) -> Result<(Vec<f32>, LayerActivations)> {
        let c = &self.config;
        let Dims { d, nq, nkv, inter, qd, kvd, .. } = self.dims(0);
        let eps = c.rms_norm_eps;
        let (n1, rstd1) = rmsnorm(&x, &lw.input_norm, eps)?;
        let [mut q, mut k, v]: [Vec<f32>; 3] =
            split_columns(&linear(&n1, &pl.qkv)?, &[qd, kvd, kvd]).try_into().expect("3 parts");
        let (mut q_pre, mut q_rstd, mut k_pre, mut k_rstd) = Default::default();
        if c.architecture.has_qk_norm() {
            q_pre = q;
            (q, q_rstd) = rmsnorm(&q_pre, &lw.q_norm, eps)?;
            k_pre = k;
            (k, k_rstd) = rmsnorm(&k_pre, &lw.k_norm, eps)?;
        }
        rope_forward(&mut q, cos, sin, nq, d)?;
        rope_forward(&mut k, cos, sin, nkv, d)?;
        let (attn, lse) = attention(&q, &k, &v)?;
        let o = linear(&attn, &pl.o)?;
        let x_mid = add(&x, &o);
        let (n2, rstd2) = rmsnorm(&x_mid, &lw.post_norm, eps)?;
        let [gate, up]: [Vec<f32>; 2] =
            split_columns(&linear(&n2, &pl.gate_up)?, &[inter, inter]).try_into().expect("2 parts");
        let mut act = vec![0.0; gate.len()];
        swiglu_forward(&mut act, &gate, &up)?;
        let m = linear(&act, &pl.down)?;
        let x_out = add(&x_mid, &m);
        let a = LayerActivations {
            x_in: x,
            n1,
            rstd1,
            q_pre,
            q_rstd,
            k_pre,
            k_rstd,
            q,
            k,
            v,
            attn,
            lse,
            x_mid,
            n2,
            rstd2,
            gate,
            up,
            act,
        };
        Ok((x_out, a))
    }

    fn check_packed(&self, packed: &PackedLinears) -> Result<()> {
        let (h, vocab) = (self.config.hidden_size, self.config.vocab_size);
        if packed.layers.len() != self.weights.layers.len()
            || packed.head.d_in() != h
            || packed.head.d_out() != vocab
        {
            return Err(Error::Invalid(
                "packed linears belong to another model; build them with PackedLinears::new".into(),
            ));
        }
        Ok(())
    }

    fn run(
        &self,
        packed: &PackedLinears,
        batch: &PackedBatch,
        temperature: f32,
        keep: bool,
    ) -> Result<Forward> {
        let c = &self.config;
        batch.validate(c.vocab_size)?;
        self.check_packed(packed)?;
        if temperature.is_nan() || temperature <= 0.0 {
            return Err(Error::Invalid(format!("temperature {temperature} must be > 0")));
        }
        let Dims { t, h, .. } = self.dims(batch.tokens.len());
        let (cos, sin) = rope_tables(&batch.positions(), c.head_dim, c.rope_theta);
        let mut x = vec![0.0; t * h];
        embedding_forward(&mut x, &self.weights.embed, &batch.tokens, h)?;
        let shape = self.attention_shape();
        let mut attention = |q: &[f32], k: &[f32], v: &[f32]| {
            let mut attn = vec![0.0; q.len()];
            let mut lse = vec![0.0; t * shape.q_heads];
            attention_forward(&mut attn, &mut lse, q, k, v, &batch.cu_seqlens, shape)?;
            Ok((attn, lse))
        };
        let mut layers = Vec::new();
        for (lw, pl) in self.weights.layers.iter().zip(&packed.layers) {
            let (x_out, a) = self.layer_forward(lw, pl, x, &cos, &sin, &mut attention)?;
            if keep {
                layers.push(a);
            }
            x = x_out;
        }
        let (nf, rstd_final) = rmsnorm(&x, &self.weights.final_norm, c.rms_norm_eps)?;
        let (rows, targets) = batch.response_rows();
        let mut hidden_rows = Vec::with_capacity(rows.len() * h);
        for &r in &rows {
            hidden_rows.extend_from_slice(&nf[r * h..(r + 1) * h]);
        }
        let mut logp = vec![0.0; rows.len()];
        let mut entropy = vec![0.0; rows.len()];
        logprob_forward(
            &mut logp,
            &mut entropy,
            &hidden_rows,
            &packed.head,
            &targets,
            temperature,
        )?;
        Ok(Forward {
            logp,
            entropy,
            temperature,
            cos,
            sin,
            layers,
            x_final: x,
            rstd_final,
            rows,
            targets,
            hidden_rows,
        })
    }

    /// An incremental forward over the paged cache: writes each row's keys and values at its
    /// position, attends over positions `0..=position` of its block table, and returns the
    /// final-normed hidden states `[rows × hidden]`. Rows of one sequence must come in position
    /// order, after every earlier position is cached or in this step. Each row's result has
    /// the same bits as the training forward's for that token.
    pub fn step(
        &self,
        packed: &PackedLinears,
        rows: &[StepRow],
        kv: &mut KvCache,
    ) -> Result<Vec<f32>> {
        let c = &self.config;
        self.check_packed(packed)?;
        for (r, row) in rows.iter().enumerate() {
            if row.token as usize >= c.vocab_size {
                return Err(Error::Invalid(format!(
                    "step row {r}: token id {} is outside the vocabulary of {}",
                    row.token, c.vocab_size
                )));
            }
            let covered = row.blocks.len() * cpu::KEY_BLOCK;
            if row.position >= covered || row.blocks.iter().any(|&b| b as usize >= kv.num_blocks())
            {
                return Err(Error::Invalid(format!(
                    "step row {r}: position {} is not covered by its {} blocks of a {}-block cache",
                    row.position,
                    row.blocks.len(),
                    kv.num_blocks()
                )));
            }
        }
        let Dims { h, d, nq, nkv, qd, kvd, .. } = self.dims(rows.len());
        let positions: Vec<u32> = rows.iter().map(|r| r.position as u32).collect();
        let (cos, sin) = rope_tables(&positions, d, c.rope_theta);
        let tokens: Vec<u32> = rows.iter().map(|r| r.token).collect();
        let mut x = vec![0.0; rows.len() * h];
        embedding_forward(&mut x, &self.weights.embed, &tokens, h)?;
        let group = nq / nkv;
        for (layer, (lw, pl)) in self.weights.layers.iter().zip(&packed.layers).enumerate() {
            let mut attention = |q: &[f32], k: &[f32], v: &[f32]| {
                for (r, row) in rows.iter().enumerate() {
                    let (kr, vr) = (&k[r * kvd..(r + 1) * kvd], &v[r * kvd..(r + 1) * kvd]);
                    kv.write(layer, row.blocks, row.position, kr, vr);
                }
                let kv = &*kv;
                let mut attn = vec![0.0; q.len()];
                let mut lse = vec![0.0; rows.len() * nq];
                // One task per row (all its heads): per-head tasks are too small to schedule.
                attn.par_chunks_mut(qd).zip(lse.par_chunks_mut(nq)).enumerate().for_each(
                    |(r, (out, lse))| {
                        let row = &rows[r];
                        for (head, (out, lse)) in out.chunks_mut(d).zip(lse).enumerate() {
                            let q_row = &q[(r * nq + head) * d..][..d];
                            *lse = attend_row(out, q_row, row.position + 1, d, |b| {
                                kv.block(layer, row.blocks[b], head / group)
                            });
                        }
                    },
                );
                debug_assert_eq!(attn.len(), rows.len() * qd);
                Ok((attn, lse))
            };
            x = self.layer_forward(lw, pl, x, &cos, &sin, &mut attention)?.0;
        }
        Ok(rmsnorm(&x, &self.weights.final_norm, c.rms_norm_eps)?.0)
    }

    /// Logits `[rows × vocab]` of final-normed hidden states, as the scorer computes them.
    pub fn logits(&self, packed: &PackedLinears, hidden: &[f32]) -> Result<Vec<f32>> {
        self.check_packed(packed)?;
        linear(hidden, &packed.head)
    }

    /// Adds into `grads` the gradient of a loss whose derivatives with respect to the response
    /// tokens' logp and entropy are `d_logp` and `d_entropy`. `fwd` must come from
    /// [`Model::forward`] on the same batch.
    pub fn backward(
        &self,
        fwd: &Forward,
        batch: &PackedBatch,
        d_logp: &[f32],
        d_entropy: &[f32],
        grads: &mut Weights,
    ) -> Result<()> {
        let c = &self.config;
        let dims = self.dims(batch.tokens.len());
        let (t, h) = (dims.t, dims.h);
        if fwd.layers.len() != c.num_hidden_layers || fwd.x_final.len() != t * h {
            return Err(Error::Invalid(
                "backward needs the activations of forward() on the same batch".into(),
            ));
        }
        if d_logp.len() != fwd.logp.len() || d_entropy.len() != fwd.logp.len() {
            return Err(Error::Invalid(format!(
                "backward: {} logp gradients and {} entropy gradients for {} response tokens",
                d_logp.len(),
                d_entropy.len(),
                fwd.logp.len()
            )));
        }
        if grads.layers.len() != self.weights.layers.len()
            || grads.lm_head.is_some() != self.weights.lm_head.is_some()
        {
            return Err(Error::Invalid(
                "backward: the gradient buffers are shaped for another model; make them with \
                 Weights::zeros(&model.config)"
                    .into(),
            ));
        }
        // Head and final norm.
        let mut d_rows = vec![0.0; fwd.hidden_rows.len()];
        {
            let d_head = match grads.lm_head.as_mut() {
                Some(head) => head,
                None => &mut grads.embed,
            };
            logprob_backward(
                &mut d_rows,
                d_head,
                d_logp,
                d_entropy,
                &fwd.hidden_rows,
                self.head(),
                &fwd.targets,
                fwd.temperature,
            )?;
        }
        let mut d_nf = vec![0.0; t * h];
        for (k, &r) in fwd.rows.iter().enumerate() {
            d_nf[r * h..(r + 1) * h].copy_from_slice(&d_rows[k * h..(k + 1) * h]);
        }
        let mut dx = vec![0.0; t * h];
        rmsnorm_backward(
            &mut dx,
            &mut grads.final_norm,
            &d_nf,
            &fwd.x_final,
            &self.weights.final_norm,
            &fwd.rstd_final,
        )?;

        let mut scratch = vec![0.0; t * h];
        for ((lw, g), a) in
            self.weights.layers.iter().zip(grads.layers.iter_mut()).zip(&fwd.layers).rev()
        {
            self.layer_backward(lw, g, a, batch, fwd, &mut dx, &mut scratch, dims)?;
        }
        embedding_backward(&mut grads.embed, &dx, &batch.tokens, h)?;
        Ok(())
    }

    /// One layer's backward: `dx` holds d(loss)/d(layer output) and leaves holding
    /// d(loss)/d(layer input).
    #[allow(clippy::too_many_arguments)]
    fn layer_backward(
        &self,
        lw: &LayerWeights,
        g: &mut LayerWeights,
        a: &LayerActivations,
        batch: &PackedBatch,
        fwd: &Forward,
        dx: &mut [f32],
        scratch: &mut [f32],
        dims: Dims,
    ) -> Result<()> {
        let Dims { t, h, d, nq, nkv, inter, qd, kvd } = dims;
        // MLP: x_out = x_mid + down(swiglu(gate(n2), up(n2))).
        let mut d_act = vec![0.0; t * inter];
        linear_backward(
            &mut d_act,
            false,
            &mut g.down_proj,
            dx,
            &a.act,
            &lw.down_proj,
            t,
            inter,
            h,
        )?;
        let (mut d_gate, mut d_up) = (vec![0.0; t * inter], vec![0.0; t * inter]);
        swiglu_backward(&mut d_gate, &mut d_up, &d_act, &a.gate, &a.up)?;
        drop(d_act);
        let mut d_n2 = vec![0.0; t * h];
        linear_backward(
            &mut d_n2,
            false,
            &mut g.gate_proj,
            &d_gate,
            &a.n2,
            &lw.gate_proj,
            t,
            h,
            inter,
        )?;
        linear_backward(&mut d_n2, true, &mut g.up_proj, &d_up, &a.n2, &lw.up_proj, t, h, inter)?;
        rmsnorm_backward(scratch, &mut g.post_norm, &d_n2, &a.x_mid, &lw.post_norm, &a.rstd2)?;
        dx.iter_mut().zip(scratch.iter()).for_each(|(x, s)| *x += s);

        // Attention: x_mid = x_in + o(attn(rope(norm(q(n1))), rope(norm(k(n1))), v(n1))).
        let mut d_attn = vec![0.0; t * qd];
        linear_backward(&mut d_attn, false, &mut g.o_proj, dx, &a.attn, &lw.o_proj, t, qd, h)?;
        let (mut dq, mut dk, mut dv) = (vec![0.0; t * qd], vec![0.0; t * kvd], vec![0.0; t * kvd]);
        attention_backward(
            &mut dq,
            &mut dk,
            &mut dv,
            &d_attn,
            &a.q,
            &a.k,
            &a.v,
            &a.attn,
            &a.lse,
            &batch.cu_seqlens,
            self.attention_shape(),
        )?;
        rope_backward(&mut dq, &fwd.cos, &fwd.sin, nq, d)?;
        rope_backward(&mut dk, &fwd.cos, &fwd.sin, nkv, d)?;
        if self.config.architecture.has_qk_norm() {
            let mut dq_pre = vec![0.0; dq.len()];
            rmsnorm_backward(&mut dq_pre, &mut g.q_norm, &dq, &a.q_pre, &lw.q_norm, &a.q_rstd)?;
            dq = dq_pre;
            let mut dk_pre = vec![0.0; dk.len()];
            rmsnorm_backward(&mut dk_pre, &mut g.k_norm, &dk, &a.k_pre, &lw.k_norm, &a.k_rstd)?;
            dk = dk_pre;
        }
        let mut d_n1 = vec![0.0; t * h];
        linear_backward(&mut d_n1, false, &mut g.q_proj, &dq, &a.n1, &lw.q_proj, t, h, qd)?;
        linear_backward(&mut d_n1, true, &mut g.k_proj, &dk, &a.n1, &lw.k_proj, t, h, kvd)?;
        linear_backward(&mut d_n1, true, &mut g.v_proj, &dv, &a.n1, &lw.v_proj, t, h, kvd)?;
        rmsnorm_backward(scratch, &mut g.input_norm, &d_n1, &a.x_in, &lw.input_norm, &a.rstd1)?;
        dx.iter_mut().zip(scratch.iter()).for_each(|(x, s)| *x += s);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Architecture;
    use miles_tensor::rng::Rng;
    use miles_tensor::testing::{check_gradient, dot};

    fn tiny(architecture: Architecture, tie: bool) -> ModelConfig {
        ModelConfig {
            architecture,
            vocab_size: 11,
            hidden_size: 8,
            intermediate_size: 12,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            tie_word_embeddings: tie,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
        }
    }

    /// Random weights large enough that every path matters, norms away from 1.
    fn model(c: ModelConfig, seed: u64) -> Model {
        let mut w = Weights::random(&c, seed);
        let mut rng = Rng::new(seed + 1);
        for t in w.tensors_mut(c.architecture) {
            for v in t.iter_mut() {
                *v = if *v == 1.0 { 1.0 + 0.3 * rng.normal() } else { 0.4 * rng.normal() };
            }
        }
        Model::new(c, w)
    }

    fn batch() -> PackedBatch {
        PackedBatch::new(&[
            (vec![1, 5, 9, 2, 2, 7], 2),
            (vec![3, 10, 0], 1),
            (vec![4, 4, 8, 6, 1], 3),
        ])
        .unwrap()
    }

    #[test]
    fn gradients_of_every_tensor_match_finite_differences() {
        for (arch, tie) in [(Architecture::Qwen3, true), (Architecture::Llama, false)] {
            let m = model(tiny(arch, tie), 21);
            let b = batch();
            let t = 0.8;
            let fwd = m.forward(&b, t).unwrap();
            let mut rng = Rng::new(3);
            let (ga, gb) = (rng.vec(fwd.logp.len(), 1.0), rng.vec(fwd.logp.len(), 1.0));
            let mut grads = Weights::zeros(&m.config);
            m.backward(&fwd, &b, &ga, &gb, &mut grads).unwrap();
            let spec = crate::weights::tensor_spec(&m.config);
            for (k, (name, _)) in spec.iter().enumerate() {
                let analytic = grads.tensors(arch)[k].clone();
                let mut probe = m.clone();
                let mut x = probe.weights.tensors(arch)[k].clone();
                check_gradient(name, &mut x, &analytic, 12, |x| {
                    *probe.weights.tensors_mut(arch)[k] = x.to_vec();
                    let (lp, ent) = probe.logprobs(&b, t).unwrap();
                    dot(&ga, &lp) + dot(&gb, &ent)
                });
            }
        }
    }

    #[test]
    fn packing_does_not_mix_sequences() {
        let m = model(tiny(Architecture::Qwen3, true), 5);
        let (lp, ent) = m.logprobs(&batch(), 1.0).unwrap();
        let alone = PackedBatch::new(&[(vec![3, 10, 0], 1)]).unwrap();
        let (lp1, ent1) = m.logprobs(&alone, 1.0).unwrap();
        // The second sequence's two response tokens follow the first's four.
        for k in 0..2 {
            assert!((lp[4 + k] - lp1[k]).abs() < 1e-5 && (ent[4 + k] - ent1[k]).abs() < 1e-5);
        }
        assert!(lp.iter().all(|v| *v < 0.0) && ent.iter().all(|v| *v > 0.0));
    }

    #[test]
    fn bad_batches_are_errors() {
        assert!(PackedBatch::new(&[(vec![1, 2], 0)]).is_err());
        assert!(PackedBatch::new(&[(vec![1, 2], 3)]).is_err());
        let m = model(tiny(Architecture::Llama, false), 1);
        let b = PackedBatch::new(&[(vec![1, 99], 1)]).unwrap();
        assert!(m.logprobs(&b, 1.0).unwrap_err().to_string().contains("outside the vocabulary"));
        assert!(m.logprobs(&batch(), 0.0).is_err());
        // Gradient buffers of a tied model for an untied one are refused, not misrouted.
        let fwd = m.forward(&batch(), 1.0).unwrap();
        let mut wrong = Weights::zeros(&tiny(Architecture::Llama, true));
        let n = fwd.logp.len();
        let err = m.backward(&fwd, &batch(), &vec![0.0; n], &vec![0.0; n], &mut wrong).unwrap_err();
        assert!(err.to_string().contains("shaped for another model"), "{err}");
    }
}
