//! DeepSeek's multi-head latent attention, over any [`Backend`], as ordinary multi-head
//! attention: each token's queries come from `q_proj` (or `q_a_proj`, its norm and
//! `q_b_proj`); its keys and values from one compressed vector (`kv_a_proj_with_mqa`'s first
//! `kv_lora_rank` columns, normed, through `kv_b_proj`: each head's non-rotary key and its
//! value) and one rotary key shared by every head (the last `qk_rope_head_dim` columns).
//!
//! Memory holds each query head in a partial rotary's layout (`file_layout`: the rotary's
//! pairs at (j, j + d/2), the non-rotary dimensions in the rest), and [`MlaMaps::keys`]
//! assembles each head's key in the same layout, so the rotary, the scores and their scale
//! are those of any model with a partial rotary. The values are padded to the key's width
//! (zero columns, whose outputs are zero) and the outputs trimmed back before `o_proj`.

use miles_tensor::{Device, ops::ColumnMap};

use crate::backend::{AttentionFn, Backend, BackwardBackend, Linear, Norm, take};
use crate::{MlaConfig, ModelConfig, Result};

/// A latent-attention model's column arrangements, kept on its device.
#[derive(Debug)]
pub(crate) struct MlaMaps {
    /// `kv_a`'s compressed part (its first `kv_lora_rank` columns).
    pub latent: ColumnMap,
    /// Each head's key `[heads × d]` from `kv_b`'s output and `kv_a`'s rotary columns.
    pub keys: ColumnMap,
    /// Each head's value, padded to `d`, from `kv_b`'s output.
    pub values: ColumnMap,
    /// Each head's first `v_head_dim` output columns.
    pub outputs: ColumnMap,
}

/// Which arrangement of [`MlaMaps`] an op uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arrange {
    Latent,
    Keys,
    Values,
    Outputs,
}

impl MlaMaps {
    pub fn new(c: &ModelConfig, m: &MlaConfig, device: &Device) -> Result<Self> {
        let (heads, d) = (c.num_attention_heads, c.head_dim);
        let (nope, v) = (m.qk_nope_head_dim, m.v_head_dim);
        let (half, turned) = (d / 2, m.qk_rope_head_dim / 2);
        let kv = heads * (nope + v);
        let kva = m.kv_lora_rank + m.qk_rope_head_dim;
        let latent: Vec<i32> = (0..m.kv_lora_rank as i32).collect();
        // A key head's memory dimension p: the rotary's pair j at (j, j + d/2) (kv_a's rotary
        // columns, in halves), the non-rotary dimensions in order in the rest.
        let key = |h: usize, p: usize| -> i32 {
            let (first, second) = (p < turned, (half..half + turned).contains(&p));
            let source = match (first, second) {
                (true, _) => kv + m.kv_lora_rank + p,
                (_, true) => kv + m.kv_lora_rank + turned + (p - half),
                _ if p < half => h * (nope + v) + (p - turned),
                _ => h * (nope + v) + (half - turned) + (p - half - turned),
            };
            source as i32
        };
        let keys: Vec<i32> = (0..heads).flat_map(|h| (0..d).map(move |p| key(h, p))).collect();
        let values: Vec<i32> = (0..heads)
            .flat_map(|h| {
                (0..d).map(move |p| if p < v { (h * (nope + v) + nope + p) as i32 } else { -1 })
            })
            .collect();
        let outputs: Vec<i32> =
            (0..heads).flat_map(|h| (0..v).map(move |p| (h * d + p) as i32)).collect();
        Ok(MlaMaps {
            latent: ColumnMap::new(&latent, &[kva], device)?,
            keys: ColumnMap::new(&keys, &[kv, kva], device)?,
            values: ColumnMap::new(&values, &[kv], device)?,
            outputs: ColumnMap::new(&outputs, &[heads * d], device)?,
        })
    }

    pub fn get(&self, which: Arrange) -> &ColumnMap {
        match which {
            Arrange::Latent => &self.latent,
            Arrange::Keys => &self.keys,
            Arrange::Values => &self.values,
            Arrange::Outputs => &self.outputs,
        }
    }
}

/// What the latent attention keeps for its backward beside the layer's (rotated) q and k,
/// padded values and log-sum-exp.
pub(crate) struct MlaActivations<A> {
    /// With q_lora: `q_a`'s output, its norm's rstd and output.
    pub q_a: Option<[A; 3]>,
    /// The compressed part of `kv_a`'s output, its norm's rstd and output.
    pub latent: [A; 3],
    /// The attention's output before trimming (each head `d` wide).
    pub padded: A,
}

/// The attention's results: rotated q and k, padded v, the trimmed output (`o_proj`'s input)
/// and the log-sum-exp, with what the backward needs beside them.
pub(crate) struct MlaForward<A> {
    pub q: A,
    pub k: A,
    pub v: A,
    pub out: A,
    pub lse: A,
    pub acts: MlaActivations<A>,
}

/// Layer `layer`'s latent attention of `n1` (the normed input), `attention` running the
/// scores over the assembled heads.
pub(crate) fn mla_forward<B: Backend>(
    b: &B,
    c: &ModelConfig,
    m: &MlaConfig,
    layer: usize,
    n1: &B::Act,
    attention: &mut AttentionFn<B::Act>,
) -> Result<MlaForward<B::Act>> {
    let heads = c.num_attention_heads;
    let (q, q_a) = match m.q_lora_rank {
        Some(_) => {
            let [qa] = take(b.linear(layer, Linear::QA, n1)?);
            let (qa_n, qa_rstd) = b.rmsnorm(layer, Norm::QA, &qa)?;
            let [q] = take(b.linear(layer, Linear::QB, &qa_n)?);
            (q, Some([qa, qa_rstd, qa_n]))
        }
        None => {
            let [q] = take(b.linear(layer, Linear::Q, n1)?);
            (q, None)
        }
    };
    let [kva] = take(b.linear(layer, Linear::KvA, n1)?);
    let KeysValues { k, v, latent } = keys_values(b, layer, &kva)?;
    let q = b.rope(layer, q, heads, false)?;
    let k = b.rope(layer, k, heads, false)?;
    let (padded, lse) = attention(layer, &q, &k, &v, Some(&kva))?;
    let out = b.gather_columns(Arrange::Outputs, &[&padded])?;
    let acts = MlaActivations { q_a, latent, padded };
    Ok(MlaForward { q, k, v, out, lse, acts })
}

/// Each head's key (in the rotary layout, not yet rotated: `b`'s rows' positions rotate it)
/// and padded value from rows of `kv_a`'s output, with the latent's `[c_kv, rstd, normed]`:
/// the same ops in the training forward and in a step expanding a latent cache, so the same
/// bits.
pub(crate) fn keys_values<B: Backend>(
    b: &B,
    layer: usize,
    kva: &B::Act,
) -> Result<KeysValues<B::Act>> {
    let c_kv = b.gather_columns(Arrange::Latent, &[kva])?;
    let (c_kv_n, kv_rstd) = b.rmsnorm(layer, Norm::KvA, &c_kv)?;
    let [kv] = take(b.linear(layer, Linear::KvB, &c_kv_n)?);
    let k = b.gather_columns(Arrange::Keys, &[&kv, kva])?;
    let v = b.gather_columns(Arrange::Values, &[&kv])?;
    Ok(KeysValues { k, v, latent: [c_kv, kv_rstd, c_kv_n] })
}

/// [`keys_values`]' results.
pub(crate) struct KeysValues<A> {
    pub k: A,
    pub v: A,
    pub latent: [A; 3],
}

/// The latent attention's backward from d(loss)/d(trimmed output) to d(loss)/d`n1`, adding
/// its weights' gradients: `q`, `k`, `v` and `lse` as [`mla_forward`] gave them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_backward<B: BackwardBackend>(
    b: &mut B,
    c: &ModelConfig,
    layer: usize,
    (q, k, v, lse): (&B::Act, &B::Act, &B::Act, &B::Act),
    a: &MlaActivations<B::Act>,
    n1: &B::Act,
    d_out: &B::Act,
) -> Result<B::Act> {
    let heads = c.num_attention_heads;
    let [d_padded] = take(b.scatter_columns(Arrange::Outputs, d_out)?);
    let (dq, dk, dv) = b.attention_backward(layer, &d_padded, q, k, v, &a.padded, lse)?;
    drop(d_padded);
    let dq = b.rope(layer, dq, heads, true)?;
    let dk = b.rope(layer, dk, heads, true)?;
    let [d_kv_k, d_kva_k] = take(b.scatter_columns(Arrange::Keys, &dk)?);
    let [d_kv_v] = take(b.scatter_columns(Arrange::Values, &dv)?);
    let d_kv = b.add(&d_kv_k, &d_kv_v)?;
    let [c_kv, kv_rstd, c_kv_n] = &a.latent;
    let d_c_kv_n = b.linear_backward(layer, Linear::KvB, &[&d_kv], c_kv_n)?;
    let d_c_kv = b.rmsnorm_backward(layer, Norm::KvA, &d_c_kv_n, c_kv, kv_rstd)?;
    let [d_kva_latent] = take(b.scatter_columns(Arrange::Latent, &d_c_kv)?);
    let d_kva = b.add(&d_kva_k, &d_kva_latent)?;
    let d_n1 = b.linear_backward(layer, Linear::KvA, &[&d_kva], n1)?;
    let d_n1_q = match &a.q_a {
        Some([qa, qa_rstd, qa_n]) => {
            let d_qa_n = b.linear_backward(layer, Linear::QB, &[&dq], qa_n)?;
            let d_qa = b.rmsnorm_backward(layer, Norm::QA, &d_qa_n, qa, qa_rstd)?;
            b.linear_backward(layer, Linear::QA, &[&d_qa], n1)?
        }
        None => b.linear_backward(layer, Linear::Q, &[&dq], n1)?,
    };
    b.add(&d_n1, &d_n1_q)
}
