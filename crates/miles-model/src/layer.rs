//! One decoder layer, forward and backward, written once over a [`Backend`]: the CPU model runs
//! it on f32 slices with the batch-invariant packed linears, the device model on tensors. Only
//! the primitives differ between devices, never the steps of the layer or their order.

use crate::moe::{BalanceStats, ExpertMatrix, MoeActivations, Routing, moe_backward, moe_forward};
use crate::{ModelConfig, Result};

/// A layer's linears. Forward outputs come split into their parts: `[q, k, v]`, `[o]`,
/// `[gate, up]`, `[down]`; a sparse layer's router gives `[logits]` and its experts
/// `[gate, up]` and `[down]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Linear {
    Qkv,
    O,
    GateUp,
    Down,
    Router,
    ExpertGateUp(usize),
    ExpertDown(usize),
}

/// A layer's RMSNorms; `Q` and `K` (Qwen3) normalize each head of the queries and keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Norm {
    Input,
    Post,
    Q,
    K,
}

/// The forward primitives of one device. `Act` is an activation `[tokens × width]`.
pub(crate) trait Backend {
    type Act;
    /// `(y, rstd)` of the layer's norm over `x`.
    fn rmsnorm(&self, layer: usize, norm: Norm, x: &Self::Act) -> Result<(Self::Act, Self::Act)>;
    /// `x·Wᵀ` for each part of the linear.
    fn linear(&self, layer: usize, linear: Linear, x: &Self::Act) -> Result<Vec<Self::Act>>;
    /// Rotates `heads` heads of every token by its position (`inverse`: the backward).
    fn rope(&self, x: Self::Act, heads: usize, inverse: bool) -> Result<Self::Act>;
    fn swiglu(&self, gate: &Self::Act, up: &Self::Act) -> Result<Self::Act>;
    fn add(&self, a: &Self::Act, b: &Self::Act) -> Result<Self::Act>;

    /// The values of `x` on the host (a sparse layer's router logits).
    fn to_host(&self, x: &Self::Act) -> Result<Vec<f32>>;
    /// `[values / width × width]` from host values.
    fn upload(&self, values: Vec<f32>, width: usize) -> Result<Self::Act>;
    /// Rows `rows` of `x` (rows of `width`), row `i` times `scales[i]` when given.
    fn gather_rows(
        &self,
        x: &Self::Act,
        width: usize,
        rows: &[u32],
        scales: Option<&[f32]>,
    ) -> Result<Self::Act>;
    /// `out[t] = Σ_k weights[t·k_n + k] · parts[p][r]` with `(p, r) = picks[t·k_n + k]`, summed
    /// in rank order `k = 0, 1, …` (`k_n` picks per row, rows of `width`): each token's
    /// experts combined.
    fn sum_rows(
        &self,
        parts: &[&Self::Act],
        width: usize,
        picks: &[(u32, u32)],
        weights: &[f32],
        k_n: usize,
    ) -> Result<Self::Act>;
    /// Per pick `t·k_n + k`, the dot product of row `t` of `a` with the picked row of `parts`.
    fn row_dots(
        &self,
        a: &Self::Act,
        parts: &[&Self::Act],
        width: usize,
        picks: &[(u32, u32)],
        k_n: usize,
    ) -> Result<Vec<f32>>;

    /// Whether the sparse layers run every expert at once ([`Backend::experts_product`] over
    /// the picks sorted by expert) rather than one expert at a time.
    fn grouped_experts(&self) -> bool {
        false
    }
    /// Each expert's `matrix` over its sorted rows (`offsets[e]..offsets[e + 1]`): `x[row]·Wᵀ`,
    /// or `x[row]·W` with `input_grad`, the rows of `x` through `rows` when given.
    fn experts_product(
        &self,
        _layer: usize,
        _matrix: ExpertMatrix,
        _x: &Self::Act,
        _rows: Option<&[u32]>,
        _offsets: &[u32],
        _input_grad: bool,
    ) -> Result<Self::Act> {
        Err(crate::Error::Invalid("internal: this backend has no grouped expert products".into()))
    }
    /// `out[t] = Σ_j weights[t·k + j] · y[picks[t·k + j]]` in rank order (rows of `width`).
    fn pick_rows(
        &self,
        y: &Self::Act,
        width: usize,
        picks: &[u32],
        weights: &[f32],
        k: usize,
    ) -> Result<Self::Act> {
        let parts: Vec<(u32, u32)> = picks.iter().map(|&r| (0, r)).collect();
        self.sum_rows(&[y], width, &parts, weights, k)
    }
    /// Per pick `t·k + j`, the dot product of row `t` of `a` with row `picks[t·k + j]` of `y`.
    fn pick_dots(
        &self,
        a: &Self::Act,
        y: &Self::Act,
        width: usize,
        picks: &[u32],
        k: usize,
    ) -> Result<Vec<f32>> {
        let parts: Vec<(u32, u32)> = picks.iter().map(|&r| (0, r)).collect();
        self.row_dots(a, &[y], width, &parts, k)
    }

    /// `(a + b, y, rstd)` with `(y, rstd)` the layer's `norm` of `a + b`: a residual add and the
    /// norm after it. A backend may fuse them, keeping their bits.
    fn add_rmsnorm(
        &self,
        layer: usize,
        norm: Norm,
        a: &Self::Act,
        b: &Self::Act,
    ) -> Result<(Self::Act, Self::Act, Self::Act)> {
        let sum = self.add(a, b)?;
        let (y, rstd) = self.rmsnorm(layer, norm, &sum)?;
        Ok((sum, y, rstd))
    }

    /// The queries and keys as attention takes them: each head normalized (models with q/k
    /// norms), then rotated; with the norms also what their backward needs, `[q, q_rstd, k,
    /// k_rstd]`. A backend may fuse these steps, keeping their bits.
    #[allow(clippy::type_complexity)]
    fn qk_norm_rope(
        &self,
        c: &ModelConfig,
        layer: usize,
        q: Self::Act,
        k: Self::Act,
    ) -> Result<(Self::Act, Self::Act, Option<[Self::Act; 4]>)> {
        let (q, k, qk_norm) = if c.architecture.has_qk_norm() {
            let (qn, q_rstd) = self.rmsnorm(layer, Norm::Q, &q)?;
            let (kn, k_rstd) = self.rmsnorm(layer, Norm::K, &k)?;
            (qn, kn, Some([q, q_rstd, k, k_rstd]))
        } else {
            (q, k, None)
        };
        let q = self.rope(q, c.num_attention_heads, false)?;
        let k = self.rope(k, c.num_key_value_heads, false)?;
        Ok((q, k, qk_norm))
    }
}

/// The backward primitives: the weight gradients accumulate inside the backend.
pub(crate) trait BackwardBackend: Backend {
    /// `dx` of the layer's norm; adds `dw` into the norm's gradient.
    fn rmsnorm_backward(
        &mut self,
        layer: usize,
        norm: Norm,
        dy: &Self::Act,
        x: &Self::Act,
        rstd: &Self::Act,
    ) -> Result<Self::Act>;
    /// `dx = Σ_p dy_p·W_p` over the linear's parts, adding `dy_pᵀ·x` into each part's gradient.
    fn linear_backward(
        &mut self,
        layer: usize,
        linear: Linear,
        dys: &[&Self::Act],
        x: &Self::Act,
    ) -> Result<Self::Act>;
    /// Adds each expert's `matrix` gradient: `dy[seg]ᵀ · x[rows[seg]]` over its sorted rows.
    fn experts_wgrad(
        &mut self,
        _layer: usize,
        _matrix: ExpertMatrix,
        _dy: &Self::Act,
        _x: &Self::Act,
        _rows: Option<&[u32]>,
        _offsets: &[u32],
    ) -> Result<()> {
        Err(crate::Error::Invalid("internal: this backend has no grouped expert products".into()))
    }
    fn swiglu_backward(
        &self,
        dh: &Self::Act,
        gate: &Self::Act,
        up: &Self::Act,
    ) -> Result<(Self::Act, Self::Act)>;
    /// `(dq, dk, dv)` of the causal attention whose forward gave `out` and `lse`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        d_out: &Self::Act,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        out: &Self::Act,
        lse: &Self::Act,
    ) -> Result<(Self::Act, Self::Act, Self::Act)>;
}

/// `(q, k, v) → (attention output, log-sum-exp)`: where the training forward and the
/// incremental step differ.
pub(crate) type AttentionFn<'a, A> = dyn FnMut(&A, &A, &A) -> Result<(A, A)> + 'a;

/// What a layer's MLP keeps for its backward.
pub(crate) enum MlpActivations<A> {
    Dense { gate: A, up: A, act: A },
    Sparse(Box<MoeActivations<A>>),
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
}

impl<A> LayerActivations<A> {
    /// The routing of a sparse layer.
    pub fn routing(&self) -> Option<&Routing> {
        match &self.mlp {
            MlpActivations::Sparse(m) => Some(&m.routing),
            MlpActivations::Dense { .. } => None,
        }
    }
}

pub(crate) fn take<const N: usize, A>(parts: Vec<A>) -> [A; N] {
    parts.try_into().unwrap_or_else(|_| unreachable!("a backend returned the wrong part count"))
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
    let [q, k, v] = take(b.linear(layer, Linear::Qkv, &n1)?);
    let (q, k, qk_norm) = b.qk_norm_rope(c, layer, q, k)?;
    let (attn, lse) = attention(&q, &k, &v)?;
    let [o] = take(b.linear(layer, Linear::O, &attn)?);
    let (x_mid, n2, rstd2) = b.add_rmsnorm(layer, Norm::Post, &x, &o)?;
    let (m, mlp) = match &c.moe {
        Some(moe) if moe.is_sparse(layer) => {
            let (m, a) = moe_forward(b, moe, layer, &n2, c.hidden_size, replay)?;
            (m, MlpActivations::Sparse(Box::new(a)))
        }
        _ => {
            let [gate, up] = take(b.linear(layer, Linear::GateUp, &n2)?);
            let act = b.swiglu(&gate, &up)?;
            let [m] = take(b.linear(layer, Linear::Down, &act)?);
            (m, MlpActivations::Dense { gate, up, act })
        }
    };
    let x_out = b.add(&x_mid, &m)?;
    let a =
        LayerActivations { x_in: x, n1, rstd1, qk_norm, q, k, v, attn, lse, x_mid, n2, rstd2, mlp };
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
    // MLP: x_out = x_mid + down(swiglu(gate(n2), up(n2))), or the experts' sum.
    let d_n2 = match (&a.mlp, &c.moe) {
        (MlpActivations::Dense { gate, up, act }, _) => {
            let d_act = b.linear_backward(layer, Linear::Down, &[&dx], act)?;
            let (d_gate, d_up) = b.swiglu_backward(&d_act, gate, up)?;
            drop(d_act);
            b.linear_backward(layer, Linear::GateUp, &[&d_gate, &d_up], &a.n2)?
        }
        (MlpActivations::Sparse(m), Some(moe)) => {
            moe_backward(b, moe, layer, m, &a.n2, c.hidden_size, &dx, balance)?
        }
        (MlpActivations::Sparse(_), None) => {
            return Err(crate::Error::Invalid("internal: experts without a MoE config".into()));
        }
    };
    let d = b.rmsnorm_backward(layer, Norm::Post, &d_n2, &a.x_mid, &a.rstd2)?;
    let dx = b.add(&dx, &d)?;

    // Attention: x_mid = x_in + o(attn(rope(norm(q(n1))), rope(norm(k(n1))), v(n1))).
    let d_attn = b.linear_backward(layer, Linear::O, &[&dx], &a.attn)?;
    let (dq, dk, dv) = b.attention_backward(&d_attn, &a.q, &a.k, &a.v, &a.attn, &a.lse)?;
    let mut dq = b.rope(dq, nq, true)?;
    let mut dk = b.rope(dk, nkv, true)?;
    if let Some([q_pre, q_rstd, k_pre, k_rstd]) = &a.qk_norm {
        dq = b.rmsnorm_backward(layer, Norm::Q, &dq, q_pre, q_rstd)?;
        dk = b.rmsnorm_backward(layer, Norm::K, &dk, k_pre, k_rstd)?;
    }
    let d_n1 = b.linear_backward(layer, Linear::Qkv, &[&dq, &dk, &dv], &a.n1)?;
    let d = b.rmsnorm_backward(layer, Norm::Input, &d_n1, &a.x_in, &a.rstd1)?;
    b.add(&dx, &d)
}
