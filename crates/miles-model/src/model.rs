//! The decoder stack: forward with saved activations, and the explicit backward.

use miles_tensor::cpu::{
    self, AttentionShape, PackedLinear, Transpose, attend_row, attention_backward,
    attention_forward, embedding_backward, embedding_forward, linear_forward, logprob_backward,
    logprob_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, rope_tables,
    swiglu_backward, swiglu_forward,
};
use rayon::prelude::*;

use crate::backend::{Backend, BackwardBackend, Linear, Norm};
use crate::kv::{BlockId, KvCache};
use crate::layer::{LayerActivations, layer_backward, layer_forward};
use crate::moe::{SparseLayers, SparseOutputs};
use crate::{Error, ModelConfig, Result, Weights};

/// Sequences packed back to back without padding. Sequence `s` is
/// `tokens[cu_seqlens[s]..cu_seqlens[s + 1]]`, of which the first `prompt_lens[s]` are the
/// prompt; the rest is the response whose logprobs the model reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    pub tokens: Vec<u32>,
    pub cu_seqlens: Vec<usize>,
    pub prompt_lens: Vec<usize>,
    /// The experts the rollout engine routed the tokens to (Qwen3-MoE).
    pub routed: Option<RoutedBatch>,
}

/// The experts a rollout routed each token of a packed batch to, in the sparse layers in
/// order: `ids[(token · layers + layer) · top_k + k]`, [`crate::moe::OWN_CHOICE`] for a token
/// without a record (each sequence's last, never run by the engine). The forward compares its
/// own choices with them (`Forward::routing_mismatch`) and uses `replay`, in the same layout,
/// when given (Rollout Routing Replay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedBatch {
    pub layers: usize,
    pub top_k: usize,
    pub ids: Vec<u32>,
    pub replay: Option<Vec<u32>>,
}

impl RoutedBatch {
    /// Sparse layer `layer`'s experts of `table` (`[tokens × layers × top_k]`), `[tokens ×
    /// top_k]`.
    pub(crate) fn layer(&self, table: &[u32], layer: usize) -> Vec<u32> {
        table
            .chunks(self.layers * self.top_k)
            .flat_map(|row| &row[layer * self.top_k..(layer + 1) * self.top_k])
            .copied()
            .collect()
    }
}

impl PackedBatch {
    /// Packs `(tokens, prompt_len)` pairs; each needs a prompt of at least one token.
    pub fn new(sequences: &[(Vec<u32>, usize)]) -> Result<Self> {
        let mut batch = PackedBatch {
            tokens: Vec::new(),
            cu_seqlens: vec![0],
            prompt_lens: Vec::new(),
            routed: None,
        };
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

    pub(crate) fn validate(&self, vocab: usize) -> Result<()> {
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
        if let Some(r) = &self.routed
            && (r.ids.len() != self.tokens.len() * r.layers * r.top_k
                || r.replay.as_ref().is_some_and(|p| p.len() != r.ids.len()))
        {
            return Err(Error::Invalid(format!(
                "packed batch: {} routed experts for {} tokens × {} sparse layers × top-{}",
                r.ids.len(),
                self.tokens.len(),
                r.layers,
                r.top_k
            )));
        }
        Ok(())
    }
}

/// Errors unless `temperature` is a positive number.
pub(crate) fn check_temperature(temperature: f32) -> Result<()> {
    if temperature.is_nan() || temperature <= 0.0 {
        return Err(Error::Invalid(format!("temperature {temperature} must be > 0")));
    }
    Ok(())
}

/// Errors unless a backward gets one logp and one entropy gradient per response token.
pub(crate) fn check_output_grads(d_logp: &[f32], d_entropy: &[f32], tokens: usize) -> Result<()> {
    if d_logp.len() != tokens || d_entropy.len() != tokens {
        return Err(Error::Invalid(format!(
            "backward: {} logp gradients and {} entropy gradients for {tokens} response tokens",
            d_logp.len(),
            d_entropy.len(),
        )));
    }
    Ok(())
}

/// A model's configuration and f32 weights on the host: what checkpoints, presets and GGUF
/// conversion produce and [`crate::DeviceModel::new`] takes. Its own forward and backward, on
/// f32 slices through the CPU kernels, are the oracle the device model is tested against (bit
/// for bit on the CPU in f32); the runs use the device model.
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
}

/// The result of a forward: per response token logp and entropy, plus what the backward needs.
pub struct Forward {
    pub logp: Vec<f32>,
    pub entropy: Vec<f32>,
    /// The sparse layers' load-balancing loss and routing mismatch (Qwen3-MoE).
    pub sparse: SparseOutputs,
    temperature: f32,
    cos: Vec<f32>,
    sin: Vec<f32>,
    layers: Vec<LayerActivations<Vec<f32>>>,
    x_final: Vec<f32>,
    rstd_final: Vec<f32>,
    rows: Vec<usize>,
    targets: Vec<u32>,
    hidden_rows: Vec<f32>,
}

impl Forward {
    /// The experts each token was routed to in the sparse layers, `[tokens × sparse layers ×
    /// top_k]` (the layout of `Sample::rollout_routed_experts`); `None` for a dense model.
    pub fn routed_experts(&self) -> Option<Vec<u16>> {
        crate::layer::routed_experts(&self.layers)
    }
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
    mlp: PackedMlp,
}

#[derive(Debug, Clone)]
enum PackedMlp {
    Dense {
        gate_up: PackedLinear,
        down: PackedLinear,
    },
    /// The router, and each expert's gate/up and down.
    Sparse {
        router: PackedLinear,
        experts: Vec<(PackedLinear, PackedLinear)>,
    },
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
                let mlp = match &c.moe {
                    Some(m) if !lw.experts.is_empty() => {
                        let im = m.moe_intermediate_size;
                        PackedMlp::Sparse {
                            router: pack(&[&lw.router], m.num_experts, h)?,
                            experts: lw
                                .experts
                                .iter()
                                .map(|e| {
                                    Ok((
                                        pack(&[&e.gate_proj, &e.up_proj], 2 * im, h)?,
                                        pack(&[&e.down_proj], h, im)?,
                                    ))
                                })
                                .collect::<Result<_>>()?,
                        }
                    }
                    _ => PackedMlp::Dense {
                        gate_up: pack(&[&lw.gate_proj, &lw.up_proj], 2 * inter, h)?,
                        down: pack(&[&lw.down_proj], h, inter)?,
                    },
                };
                Ok(PackedLayer {
                    qkv: pack(&[&lw.q_proj, &lw.k_proj, &lw.v_proj], qd + 2 * kvd, h)?,
                    o: pack(&[&lw.o_proj], h, qd)?,
                    mlp,
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
        check_temperature(temperature)?;
        let Dims { t, h, .. } = self.dims(batch.tokens.len());
        let (cos, sin) = rope_tables(&batch.positions(), c.head_dim, c.rope_theta);
        let mut x = vec![0.0; t * h];
        embedding_forward(&mut x, &self.weights.embed, &batch.tokens, h)?;
        let shape = self.attention_shape();
        let mut attention = |q: &Vec<f32>, k: &Vec<f32>, v: &Vec<f32>| {
            let mut attn = vec![0.0; q.len()];
            let mut lse = vec![0.0; t * shape.q_heads];
            attention_forward(&mut attn, &mut lse, q, k, v, &batch.cu_seqlens, shape)?;
            Ok((attn, lse))
        };
        let cpu = Cpu::new(self, Some(packed), &cos, &sin, &batch.cu_seqlens);
        let mut layers = Vec::new();
        let mut sparse = SparseLayers::new(batch);
        for layer in 0..c.num_hidden_layers {
            let replay = sparse.replay(c, layer)?;
            let (x_out, a) = layer_forward(&cpu, c, layer, x, &mut attention, replay.as_deref())?;
            sparse.after(a.routing());
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
            sparse: sparse.finish(c),
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
        Ok(self.step_routed(packed, rows, kv)?.0)
    }

    /// [`Model::step`], and the experts each row was routed to in the sparse layers:
    /// `[rows × sparse layers × top_k]` (empty for a dense model), the layout of
    /// `Sample::rollout_routed_experts`.
    pub fn step_routed(
        &self,
        packed: &PackedLinears,
        rows: &[StepRow],
        kv: &mut KvCache,
    ) -> Result<(Vec<f32>, Vec<u16>)> {
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
        let cpu = Cpu::new(self, Some(packed), &cos, &sin, &[]);
        let mut per_layer: Vec<Vec<u32>> = Vec::new();
        for layer in 0..c.num_hidden_layers {
            let mut attention = |q: &Vec<f32>, k: &Vec<f32>, v: &Vec<f32>| {
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
            let (out, a) = layer_forward(&cpu, c, layer, x, &mut attention, None)?;
            x = out;
            if let Some(r) = a.routing() {
                per_layer.push(r.experts.clone());
            }
        }
        let hidden = rmsnorm(&x, &self.weights.final_norm, c.rms_norm_eps)?.0;
        let k = c.moe.as_ref().map_or(0, |m| m.num_experts_per_tok);
        let experts: Vec<&[u32]> = per_layer.iter().map(Vec::as_slice).collect();
        let routes = crate::moe::interleave(&experts, k);
        Ok((hidden, routes))
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
        check_output_grads(d_logp, d_entropy, fwd.logp.len())?;
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

        let mut cpu = Cpu::new(self, None, &fwd.cos, &fwd.sin, &batch.cu_seqlens);
        cpu.grads = Some(grads);
        let balance = fwd.sparse.balance(c);
        for (layer, a) in fwd.layers.iter().enumerate().rev() {
            dx = layer_backward(&mut cpu, c, layer, a, dx, balance)?;
        }
        let grads = cpu.grads.take().expect("set above");
        embedding_backward(&mut grads.embed, &dx, &batch.tokens, h)?;
        Ok(())
    }
}

/// The CPU's layer primitives: f32 slices, the packed linears for forward products (so a
/// token's activations do not depend on its batch), the unpacked weights for the backward.
struct Cpu<'a> {
    model: &'a Model,
    packed: Option<&'a PackedLinears>,
    cos: &'a [f32],
    sin: &'a [f32],
    cu_seqlens: &'a [usize],
    grads: Option<&'a mut Weights>,
}

impl<'a> Cpu<'a> {
    fn new(
        model: &'a Model,
        packed: Option<&'a PackedLinears>,
        cos: &'a [f32],
        sin: &'a [f32],
        cu_seqlens: &'a [usize],
    ) -> Self {
        Cpu { model, packed, cos, sin, cu_seqlens, grads: None }
    }

    fn norm_weight(&self, layer: usize, norm: Norm) -> &'a [f32] {
        let lw = &self.model.weights.layers[layer];
        match norm {
            Norm::Input => &lw.input_norm,
            Norm::Post => &lw.post_norm,
            Norm::Q => &lw.q_norm,
            Norm::K => &lw.k_norm,
        }
    }

    /// The linear's parts as `(weight, out width)`; the input width is the same for all.
    fn parts(&self, layer: usize, linear: Linear) -> (Vec<(&'a [f32], usize)>, usize) {
        let lw = &self.model.weights.layers[layer];
        let Dims { h, inter, qd, kvd, .. } = self.model.dims(0);
        let (experts, im) = self
            .model
            .config
            .moe
            .as_ref()
            .map_or((0, 0), |m| (m.num_experts, m.moe_intermediate_size));
        match linear {
            Linear::Qkv => (vec![(&lw.q_proj, qd), (&lw.k_proj, kvd), (&lw.v_proj, kvd)], h),
            Linear::O => (vec![(&lw.o_proj, h)], qd),
            Linear::GateUp => (vec![(&lw.gate_proj, inter), (&lw.up_proj, inter)], h),
            Linear::Down => (vec![(&lw.down_proj, h)], inter),
            Linear::Router => (vec![(&lw.router, experts)], h),
            Linear::ExpertGateUp(e) => {
                let ew = &lw.experts[e];
                (vec![(&ew.gate_proj, im), (&ew.up_proj, im)], h)
            }
            Linear::ExpertDown(e) => (vec![(&lw.experts[e].down_proj, h)], im),
        }
    }
}

fn missing(what: &str) -> Error {
    Error::Invalid(format!("internal: the CPU layer backend was built without {what}"))
}

impl Backend for Cpu<'_> {
    type Act = Vec<f32>;

    fn rmsnorm(&self, layer: usize, norm: Norm, x: &Vec<f32>) -> Result<(Vec<f32>, Vec<f32>)> {
        rmsnorm(x, self.norm_weight(layer, norm), self.model.config.rms_norm_eps)
    }

    fn linear(&self, layer: usize, linear: Linear, x: &Vec<f32>) -> Result<Vec<Vec<f32>>> {
        let pl = &self.packed.ok_or_else(|| missing("packed linears"))?.layers[layer];
        let w = match (linear, &pl.mlp) {
            (Linear::Qkv, _) => &pl.qkv,
            (Linear::O, _) => &pl.o,
            (Linear::GateUp, PackedMlp::Dense { gate_up, .. }) => gate_up,
            (Linear::Down, PackedMlp::Dense { down, .. }) => down,
            (Linear::Router, PackedMlp::Sparse { router, .. }) => router,
            (Linear::ExpertGateUp(e), PackedMlp::Sparse { experts, .. }) => &experts[e].0,
            (Linear::ExpertDown(e), PackedMlp::Sparse { experts, .. }) => &experts[e].1,
            (linear, _) => return Err(missing(&format!("{linear:?} in layer {layer}"))),
        };
        let widths: Vec<usize> = self.parts(layer, linear).0.iter().map(|p| p.1).collect();
        let y = self::linear(x, w)?;
        Ok(if widths.len() == 1 { vec![y] } else { split_columns(&y, &widths) })
    }

    fn rope(&self, mut x: Vec<f32>, heads: usize, inverse: bool) -> Result<Vec<f32>> {
        let d = self.model.config.head_dim;
        if inverse {
            rope_backward(&mut x, self.cos, self.sin, heads, d)?;
        } else {
            rope_forward(&mut x, self.cos, self.sin, heads, d)?;
        }
        Ok(x)
    }

    fn swiglu(&self, gate: &Vec<f32>, up: &Vec<f32>) -> Result<Vec<f32>> {
        let mut act = vec![0.0; gate.len()];
        swiglu_forward(&mut act, gate, up)?;
        Ok(act)
    }

    fn add(&self, a: &Vec<f32>, b: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(add(a, b))
    }

    fn to_host(&self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(x.clone())
    }

    fn upload(&self, values: Vec<f32>, _width: usize) -> Result<Vec<f32>> {
        Ok(values)
    }

    fn gather_rows(
        &self,
        x: &Vec<f32>,
        width: usize,
        rows: &[u32],
        scales: Option<&[f32]>,
    ) -> Result<Vec<f32>> {
        let mut out = Vec::with_capacity(rows.len() * width);
        for (i, &r) in rows.iter().enumerate() {
            let row = &x[r as usize * width..][..width];
            match scales {
                Some(s) => out.extend(row.iter().map(|v| v * s[i])),
                None => out.extend_from_slice(row),
            }
        }
        Ok(out)
    }

    fn sum_rows(
        &self,
        parts: &[&Vec<f32>],
        width: usize,
        picks: &[(u32, u32)],
        weights: &[f32],
        k_n: usize,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0; picks.len() / k_n * width];
        for (t, row) in out.chunks_mut(width).enumerate() {
            for k in 0..k_n {
                let (p, r) = picks[t * k_n + k];
                let w = weights[t * k_n + k];
                let src = &parts[p as usize][r as usize * width..][..width];
                row.iter_mut().zip(src).for_each(|(o, v)| *o += w * v);
            }
        }
        Ok(out)
    }

    fn row_dots(
        &self,
        a: &Vec<f32>,
        parts: &[&Vec<f32>],
        width: usize,
        picks: &[(u32, u32)],
        k_n: usize,
    ) -> Result<Vec<f32>> {
        Ok(picks
            .iter()
            .enumerate()
            .map(|(i, &(p, r))| {
                let t = i / k_n;
                let (x, y) =
                    (&a[t * width..][..width], &parts[p as usize][r as usize * width..][..width]);
                x.iter().zip(y).map(|(u, v)| u * v).sum()
            })
            .collect())
    }
}

impl BackwardBackend for Cpu<'_> {
    fn rmsnorm_backward(
        &mut self,
        layer: usize,
        norm: Norm,
        dy: &Vec<f32>,
        x: &Vec<f32>,
        rstd: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let w = self.norm_weight(layer, norm);
        let g = &mut self.grads.as_mut().ok_or_else(|| missing("gradients"))?.layers[layer];
        let dw = match norm {
            Norm::Input => &mut g.input_norm,
            Norm::Post => &mut g.post_norm,
            Norm::Q => &mut g.q_norm,
            Norm::K => &mut g.k_norm,
        };
        let mut dx = vec![0.0; x.len()];
        rmsnorm_backward(&mut dx, dw, dy, x, w, rstd)?;
        Ok(dx)
    }

    fn linear_backward(
        &mut self,
        layer: usize,
        linear: Linear,
        dys: &[&Vec<f32>],
        x: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let (parts, d_in) = self.parts(layer, linear);
        let rows = x.len() / d_in;
        let g = &mut self.grads.as_mut().ok_or_else(|| missing("gradients"))?.layers[layer];
        let mut dws: Vec<&mut Vec<f32>> = match linear {
            Linear::Qkv => vec![&mut g.q_proj, &mut g.k_proj, &mut g.v_proj],
            Linear::O => vec![&mut g.o_proj],
            Linear::GateUp => vec![&mut g.gate_proj, &mut g.up_proj],
            Linear::Down => vec![&mut g.down_proj],
            Linear::Router => vec![&mut g.router],
            Linear::ExpertGateUp(e) => {
                let ge = &mut g.experts[e];
                vec![&mut ge.gate_proj, &mut ge.up_proj]
            }
            Linear::ExpertDown(e) => vec![&mut g.experts[e].down_proj],
        };
        let mut dx = vec![0.0; rows * d_in];
        for (p, ((w, d_out), dy)) in parts.into_iter().zip(dys).enumerate() {
            linear_backward(&mut dx, p > 0, dws[p], dy, x, w, rows, d_in, d_out)?;
        }
        Ok(dx)
    }

    fn swiglu_backward(
        &self,
        dh: &Vec<f32>,
        gate: &Vec<f32>,
        up: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut d_gate, mut d_up) = (vec![0.0; gate.len()], vec![0.0; up.len()]);
        swiglu_backward(&mut d_gate, &mut d_up, dh, gate, up)?;
        Ok((d_gate, d_up))
    }

    fn attention_backward(
        &self,
        d_out: &Vec<f32>,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        out: &Vec<f32>,
        lse: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        attention_backward(
            &mut dq,
            &mut dk,
            &mut dv,
            d_out,
            q,
            k,
            v,
            out,
            lse,
            self.cu_seqlens,
            self.model.attention_shape(),
        )?;
        Ok((dq, dk, dv))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::Architecture;
    use miles_tensor::rng::Rng;
    use miles_tensor::testing::{check_gradient, dot};

    pub(crate) fn tiny(architecture: Architecture, tie: bool) -> ModelConfig {
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
            moe: None,
        }
    }

    /// Random weights large enough that every path matters, norms away from 1.
    pub(crate) fn model(c: ModelConfig, seed: u64) -> Model {
        let mut w = Weights::random(&c, seed);
        let mut rng = Rng::new(seed + 1);
        for t in w.tensors_mut(c.architecture) {
            for v in t.iter_mut() {
                *v = if *v == 1.0 { 1.0 + 0.3 * rng.normal() } else { 0.4 * rng.normal() };
            }
        }
        Model::new(c, w)
    }

    pub(crate) fn batch() -> PackedBatch {
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

    /// A tiny Qwen3-MoE: layer 0 routes over 4 experts (top 2), layer 1 is dense
    /// (`mlp_only_layers`).
    pub(crate) fn tiny_moe(norm_topk_prob: bool, router_aux_loss_coef: f32) -> ModelConfig {
        ModelConfig {
            moe: Some(Box::new(crate::MoeConfig {
                num_experts: 4,
                num_experts_per_tok: 2,
                moe_intermediate_size: 6,
                norm_topk_prob,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![1],
                router_aux_loss_coef,
            })),
            ..tiny(Architecture::Qwen3Moe, false)
        }
    }

    /// Every tensor of a Qwen3-MoE model (router and experts included) against finite
    /// differences, with and without renormalized top-k weights, with the load-balancing loss
    /// added to the probed scalar when its weight is set, and with replayed experts (R3). The
    /// probes are small enough that no token changes experts.
    #[test]
    fn moe_gradients_of_every_tensor_match_finite_differences() {
        for (norm, coef, replay) in [(true, 0.0, false), (false, 0.7, false), (true, 0.2, true)] {
            let m = model(tiny_moe(norm, coef), 23);
            let arch = m.config.architecture;
            let mut b = batch();
            if replay {
                // Replayed experts unrelated to the router's own choice (the last token of
                // each sequence routes itself): the router still gets the gate weights'
                // gradient at them.
                let mut rng = Rng::new(9);
                let mut ids = Vec::new();
                for _ in 0..b.tokens.len() {
                    let first = rng.below(4) as u32;
                    ids.extend([first, (first + 1 + rng.below(3) as u32) % 4]);
                }
                for &end in &b.cu_seqlens[1..] {
                    ids[(end - 1) * 2..end * 2].fill(crate::moe::OWN_CHOICE);
                }
                b.routed =
                    Some(RoutedBatch { layers: 1, top_k: 2, ids: ids.clone(), replay: Some(ids) });
            }
            let t = 0.9;
            let fwd = m.forward(&b, t).unwrap();
            let aux = fwd.sparse.router_aux_loss.unwrap();
            assert!((1.0..4.0).contains(&aux), "{aux}");
            let mut rng = Rng::new(4);
            let (ga, gb) = (rng.vec(fwd.logp.len(), 1.0), rng.vec(fwd.logp.len(), 1.0));
            let mut grads = Weights::zeros(&m.config);
            m.backward(&fwd, &b, &ga, &gb, &mut grads).unwrap();
            let spec = crate::weights::tensor_spec(&m.config);
            assert!(spec.iter().any(|(n, _)| n == "model.layers.0.mlp.experts.3.down_proj.weight"));
            assert!(spec.iter().any(|(n, _)| n == "model.layers.1.mlp.gate_proj.weight"));
            for (k, (name, _)) in spec.iter().enumerate() {
                let analytic = grads.tensors(arch)[k].clone();
                let mut probe = m.clone();
                let mut x = probe.weights.tensors(arch)[k].clone();
                check_gradient(name, &mut x, &analytic, 12, |x| {
                    *probe.weights.tensors_mut(arch)[k] = x.to_vec();
                    let f = probe.forward(&b, t).unwrap();
                    let aux = f64::from(coef) * f.sparse.router_aux_loss.unwrap();
                    dot(&ga, &f.logp) + dot(&gb, &f.entropy) + aux
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
