//! One decoder layer, forward and backward, written once over a [`Backend`] (the model runs it
//! on tensors of any device). Only the primitives differ between devices, never the steps of
//! the layer or their order.

use crate::backend::{AttentionFn, Backend, BackwardBackend, Linear, Norm, take};
use crate::mla::{MlaActivations, MlaForward, mla_backward, mla_forward};
use crate::moe::{BalanceStats, MoeActivations, Routing, moe_backward, moe_forward};
use crate::{ModelConfig, Result};

/// What a layer's MLP keeps for its backward.
pub(crate) enum MlpActivations<A> {
    Dense {
        gate: A,
        up: A,
        act: A,
    },
    /// The routed experts', and DeepSeek's shared experts' `[gate, up, act]`.
    Sparse(Box<MoeActivations<A>>, Option<[A; 3]>),
}

/// What one layer's forward keeps for its backward. `q_pre`, `k_pre` and their `rstd` exist
/// with q/k norms only.
pub(crate) struct LayerActivations<A> {
    pub x_in: A,
    pub n1: A,
    pub rstd1: A,
    pub qk_norm: Option<[A; 4]>,
    pub q: A,
    pub k: A,
    pub v: A,
    pub attn: A,
    pub lse: A,
    pub x_mid: A,
    pub n2: A,
    pub rstd2: A,
    pub mlp: MlpActivations<A>,
    /// Gemma's (and GLM-4's) outputs of the attention and the MLP before their norms, with those norms'
    /// rstd: `[o, o_rstd, m, m_rstd]`.
    pub sandwich: Option<[A; 4]>,
    /// DeepSeek's latent attention (then `attn` is `o_proj`'s input, the trimmed output, and
    /// `v` the padded values).
    pub mla: Option<Box<MlaActivations<A>>>,
}

/// The experts each token was routed to in the sparse layers of a forward, `[tokens × sparse
/// layers × top_k]` (the layout of `Sample::rollout_routed_experts`); `None` for a dense model.
pub(crate) fn routed_experts<A>(layers: &[LayerActivations<A>]) -> Option<Vec<u16>> {
    let per_layer: Vec<&Routing> = layers.iter().filter_map(|a| a.routing()).collect();
    let k = per_layer.first()?.top_k;
    let experts: Vec<&[u32]> = per_layer.iter().map(|r| &r.experts[..]).collect();
    Some(crate::moe::interleave(&experts, k))
}

impl<A> LayerActivations<A> {
    /// The routing of a sparse layer.
    pub fn routing(&self) -> Option<&Routing> {
        match &self.mlp {
            MlpActivations::Sparse(m, _) => Some(&m.routing),
            MlpActivations::Dense { .. } => None,
        }
    }
}

/// One decoder layer on `x`: `x + attn(norm(x))`, then `+ mlp(norm(·))`, the MLP a sparse
/// one in the sparse layers of a Qwen3-MoE model (`replay`: its experts per token, given).
pub(crate) fn layer_forward<B: Backend>(
    b: &B,
    c: &ModelConfig,
    layer: usize,
    x: B::Act,
    attention: &mut AttentionFn<B::Act>,
    replay: Option<&[u32]>,
) -> Result<(B::Act, LayerActivations<B::Act>)> {
    let (n1, rstd1) = b.rmsnorm(layer, Norm::Input, &x)?;
    let (q, k, v, attn, lse, qk_norm, mla) = b.stage("attention block", || match &c.mla {
        Some(m) => {
            let MlaForward { q, k, v, out, lse, acts } =
                mla_forward(b, c, m, layer, &n1, attention)?;
            Ok((q, k, v, out, lse, None, Some(Box::new(acts))))
        }
        None => {
            let [q, k, v] = take(b.linear(layer, Linear::Qkv, &n1)?);
            let (q, k, qk_norm) = b.qk_norm_rope(c, layer, q, k)?;
            let (attn, lse) = attention(layer, &q, &k, &v, None)?;
            Ok((q, k, v, attn, lse, qk_norm, None))
        }
    })?;
    let [o] = take(b.linear(layer, Linear::O, &attn)?);
    let sandwich = c.sandwich_norms();
    let (o, o_kept) = if sandwich {
        let (on, rstd) = b.rmsnorm(layer, Norm::AttnOut, &o)?;
        (on, Some((o, rstd)))
    } else {
        (o, None)
    };
    let (x_mid, n2, rstd2) = b.add_rmsnorm(layer, Norm::Post, &x, &o)?;
    let (m, mlp) = match &c.moe {
        Some(moe) if moe.is_sparse(layer) => {
            let (m, a) = b.stage("mlp: routed experts", || {
                moe_forward(b, moe, layer, &n2, c.hidden_size, replay)
            })?;
            if moe.shared_experts == 0 {
                (m, MlpActivations::Sparse(Box::new(a), None))
            } else {
                // (transformers adds the shared experts' output to the routed ones'.)
                b.stage("mlp: shared experts", || {
                    let [gate, up] = take(b.linear(layer, Linear::SharedGateUp, &n2)?);
                    let act = b.glu(&gate, &up)?;
                    let [shared] = take(b.linear(layer, Linear::SharedDown, &act)?);
                    let m = b.add(&m, &shared)?;
                    Ok((m, MlpActivations::Sparse(Box::new(a), Some([gate, up, act]))))
                })?
            }
        }
        _ => b.stage("mlp: dense", || {
            let [gate, up] = take(b.linear(layer, Linear::GateUp, &n2)?);
            let act = b.glu(&gate, &up)?;
            let [m] = take(b.linear(layer, Linear::Down, &act)?);
            Ok((m, MlpActivations::Dense { gate, up, act }))
        })?,
    };
    let (m, sandwich) = match o_kept {
        Some((o, o_rstd)) => {
            let (mn, m_rstd) = b.rmsnorm(layer, Norm::MlpOut, &m)?;
            (mn, Some([o, o_rstd, m, m_rstd]))
        }
        None => (m, None),
    };
    let x_out = b.add(&x_mid, &m)?;
    let a = LayerActivations {
        x_in: x,
        n1,
        rstd1,
        qk_norm,
        q,
        k,
        v,
        attn,
        lse,
        x_mid,
        n2,
        rstd2,
        mlp,
        sandwich,
        mla,
    };
    Ok((x_out, a))
}

/// The layer's backward: from d(loss)/d(output) to d(loss)/d(input), adding every weight's
/// gradient into the backend's; `balance` is the load-balancing loss's weight and statistics
/// (sparse layers).
pub(crate) fn layer_backward<B: BackwardBackend>(
    b: &mut B,
    c: &ModelConfig,
    layer: usize,
    a: &LayerActivations<B::Act>,
    dx: B::Act,
    balance: Option<(f32, &BalanceStats)>,
) -> Result<B::Act> {
    let (nq, nkv) = (c.num_attention_heads, c.num_key_value_heads);
    // MLP: x_out = x_mid + down(glu(gate(n2), up(n2))), or the experts' sum, or (Gemma,
    // GLM-4) its norm.
    let d_m = match &a.sandwich {
        Some([_, _, m, m_rstd]) => Some(b.rmsnorm_backward(layer, Norm::MlpOut, &dx, m, m_rstd)?),
        None => None,
    };
    let d_m = d_m.as_ref().unwrap_or(&dx);
    let d_n2 = match (&a.mlp, &c.moe) {
        (MlpActivations::Dense { gate, up, act }, _) => {
            let d_act = b.linear_backward(layer, Linear::Down, &[d_m], act)?;
            let (d_gate, d_up) = b.glu_backward(&d_act, gate, up)?;
            drop(d_act);
            b.linear_backward(layer, Linear::GateUp, &[&d_gate, &d_up], &a.n2)?
        }
        (MlpActivations::Sparse(m, shared), Some(moe)) => {
            let d = moe_backward(b, moe, layer, m, &a.n2, c.hidden_size, d_m, balance)?;
            match shared {
                Some([gate, up, act]) => {
                    let d_act = b.linear_backward(layer, Linear::SharedDown, &[d_m], act)?;
                    let (d_gate, d_up) = b.glu_backward(&d_act, gate, up)?;
                    drop(d_act);
                    let gate_up = Linear::SharedGateUp;
                    let d_shared = b.linear_backward(layer, gate_up, &[&d_gate, &d_up], &a.n2)?;
                    b.add(&d, &d_shared)?
                }
                None => d,
            }
        }
        (MlpActivations::Sparse(..), None) => {
            return Err(crate::Error::Invalid("internal: experts without a MoE config".into()));
        }
    };
    let d = b.rmsnorm_backward(layer, Norm::Post, &d_n2, &a.x_mid, &a.rstd2)?;
    let dx = b.add(&dx, &d)?;

    // Attention: x_mid = x_in + o(attn(rope(norm(q(n1))), rope(norm(k(n1))), v(n1))), the
    // output normed first in Gemma and GLM-4.
    let d_o = match &a.sandwich {
        Some([o, o_rstd, _, _]) => {
            Some(b.rmsnorm_backward(layer, Norm::AttnOut, &dx, o, o_rstd)?)
        }
        None => None,
    };
    let d_attn = b.linear_backward(layer, Linear::O, &[d_o.as_ref().unwrap_or(&dx)], &a.attn)?;
    if let Some(m) = &a.mla {
        let d_n1 = mla_backward(b, c, layer, (&a.q, &a.k, &a.v, &a.lse), m, &a.n1, &d_attn)?;
        let d = b.rmsnorm_backward(layer, Norm::Input, &d_n1, &a.x_in, &a.rstd1)?;
        return b.add(&dx, &d);
    }
    let (dq, dk, dv) = b.attention_backward(layer, &d_attn, &a.q, &a.k, &a.v, &a.attn, &a.lse)?;
    let mut dq = b.rope(layer, dq, nq, true)?;
    let mut dk = b.rope(layer, dk, nkv, true)?;
    if let Some([q_pre, q_rstd, k_pre, k_rstd]) = &a.qk_norm {
        dq = b.rmsnorm_backward(layer, Norm::Q, &dq, q_pre, q_rstd)?;
        dk = b.rmsnorm_backward(layer, Norm::K, &dk, k_pre, k_rstd)?;
    }
    let d_n1 = b.linear_backward(layer, Linear::Qkv, &[&dq, &dk, &dv], &a.n1)?;
    let d = b.rmsnorm_backward(layer, Norm::Input, &d_n1, &a.x_in, &a.rstd1)?;
    b.add(&dx, &d)
}
