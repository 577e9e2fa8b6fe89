//! The primitives a decoder layer is written over ([`Backend`], implemented by the model over
//! tensors of any device), so [`crate::layer`] and [`crate::moe`] hold the steps of a layer once
//! and depend only on this file, not on each other.

use crate::mla::Arrange;
use crate::moe::ExpertMatrix;
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
    /// DeepSeek's shared experts' `[gate, up]` and `[down]`.
    SharedGateUp,
    SharedDown,
    /// DeepSeek's latent attention: `q_proj` alone (no q_lora), `q_a_proj`, `q_b_proj`,
    /// `kv_a_proj_with_mqa`, `kv_b_proj` (one part each).
    Q,
    QA,
    QB,
    KvA,
    KvB,
}

/// A layer's RMSNorms: `Input` before the attention, `Post` before the MLP; `Q` and `K`
/// (Qwen3, Gemma 3) normalize each head of the queries and keys; `AttnOut` and `MlpOut`
/// (Gemma) normalize the attention's and the MLP's outputs before their residual adds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Norm {
    Input,
    Post,
    Q,
    K,
    AttnOut,
    MlpOut,
    /// DeepSeek's norms of the low-rank query and of the compressed keys and values.
    QA,
    KvA,
}

/// The forward primitives of one device. `Act` is an activation `[tokens × width]`.
pub(crate) trait Backend {
    type Act;
    /// `(y, rstd)` of the layer's norm over `x`.
    fn rmsnorm(&self, layer: usize, norm: Norm, x: &Self::Act) -> Result<(Self::Act, Self::Act)>;
    /// `x·Wᵀ` for each part of the linear.
    fn linear(&self, layer: usize, linear: Linear, x: &Self::Act) -> Result<Vec<Self::Act>>;
    /// Rotates `heads` heads of every token by its position, with layer `layer`'s rotary
    /// (`inverse`: the backward).
    fn rope(&self, layer: usize, x: Self::Act, heads: usize, inverse: bool) -> Result<Self::Act>;
    /// Runs `f` as a named stage of the forward, timed on devices that keep a
    /// [`crate::stage_clock`].
    fn stage<T>(&self, _name: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        f()
    }
    /// The gated MLP's `act(gate) · up` (SwiGLU, or Gemma's GeGLU).
    fn glu(&self, gate: &Self::Act, up: &Self::Act) -> Result<Self::Act>;
    fn add(&self, a: &Self::Act, b: &Self::Act) -> Result<Self::Act>;

    /// The columns of `parts` arranged by the model's latent-attention map `which`
    /// ([`miles_tensor::ops::gather_columns`]).
    fn gather_columns(&self, _which: Arrange, _parts: &[&Self::Act]) -> Result<Self::Act> {
        Err(crate::Error::Invalid("internal: this backend has no latent attention".into()))
    }
    /// The adjoint of [`Backend::gather_columns`]: d(loss)/d(each part).
    fn scatter_columns(&self, _which: Arrange, _dy: &Self::Act) -> Result<Vec<Self::Act>> {
        Err(crate::Error::Invalid("internal: this backend has no latent attention".into()))
    }
    /// A DeepSeek router's `e_score_correction_bias` on the host; `None` for others.
    fn router_bias(&self, _layer: usize) -> Result<Option<Vec<f32>>> {
        Ok(None)
    }
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
        let q = self.rope(layer, q, c.num_attention_heads, false)?;
        let k = self.rope(layer, k, c.num_key_value_heads, false)?;
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
    fn glu_backward(
        &self,
        dh: &Self::Act,
        gate: &Self::Act,
        up: &Self::Act,
    ) -> Result<(Self::Act, Self::Act)>;
    /// `(dq, dk, dv)` of layer `layer`'s causal attention whose forward gave `out` and `lse`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        layer: usize,
        d_out: &Self::Act,
        q: &Self::Act,
        k: &Self::Act,
        v: &Self::Act,
        out: &Self::Act,
        lse: &Self::Act,
    ) -> Result<(Self::Act, Self::Act, Self::Act)>;
}

/// `(layer, q, k, v, kva) → (attention output, log-sum-exp)`: where the training forward and
/// the incremental step differ. `kva` is a latent attention's `kv_a` output of the rows (what
/// its step's cache keeps), `None` for other attentions.
pub(crate) type AttentionFn<'a, A> =
    dyn FnMut(usize, &A, &A, &A, Option<&A>) -> Result<(A, A)> + 'a;

/// A linear's `N` parts, as [`Backend::linear`] returns them.
pub(crate) fn take<const N: usize, A>(parts: Vec<A>) -> [A; N] {
    parts.try_into().unwrap_or_else(|_| unreachable!("a backend returned the wrong part count"))
}
