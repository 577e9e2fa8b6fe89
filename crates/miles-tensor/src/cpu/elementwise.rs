//! Row-wise ops: embedding, RMSNorm, rotary position embedding, SwiGLU.

use rayon::prelude::*;

use crate::{Result, ensure};

/// Rows per rayon task: enough work per task that scheduling stays in the noise.
fn rows_per_task(width: usize) -> usize {
    (16_384 / width.max(1)).max(1)
}

/// `out[t] = table[ids[t]]`; `table` is `[vocab × hidden]`.
pub fn embedding_forward(out: &mut [f32], table: &[f32], ids: &[u32], hidden: usize) -> Result<()> {
    let vocab = table.len() / hidden.max(1);
    ensure(out.len() == ids.len() * hidden && table.len() == vocab * hidden, "embedding", || {
        format!("out {} for {} ids × hidden {hidden}", out.len(), ids.len())
    })?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(crate::Error::Shape {
            op: "embedding",
            message: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    out.par_chunks_mut(hidden).zip(ids.par_iter()).for_each(|(row, &id)| {
        let id = id as usize;
        row.copy_from_slice(&table[id * hidden..(id + 1) * hidden]);
    });
    Ok(())
}

/// `d_table[ids[t]] += d_out[t]`, tokens in order (so repeated ids sum deterministically).
pub fn embedding_backward(
    d_table: &mut [f32],
    d_out: &[f32],
    ids: &[u32],
    hidden: usize,
) -> Result<()> {
    let vocab = d_table.len() / hidden.max(1);
    ensure(d_out.len() == ids.len() * hidden, "embedding_backward", || {
        format!("d_out {} for {} ids × hidden {hidden}", d_out.len(), ids.len())
    })?;
    if let Some(&bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(crate::Error::Shape {
            op: "embedding_backward",
            message: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    // Serial: O(tokens × hidden) adds are cheap next to any matmul, and the order is fixed.
    for (src, &id) in d_out.chunks(hidden).zip(ids) {
        let dst = &mut d_table[id as usize * hidden..(id as usize + 1) * hidden];
        dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
    }
    Ok(())
}

/// `y = x · rstd · w` per row of `x` `[rows × hidden]`, with `rstd = 1/sqrt(mean(x²) + eps)`
/// saved for the backward.
pub fn rmsnorm_forward(
    y: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    w: &[f32],
    eps: f32,
) -> Result<()> {
    let hidden = w.len();
    ensure(x.len() == y.len() && x.len() == rstd.len() * hidden, "rmsnorm", || {
        format!("x {} y {} rstd {} hidden {hidden}", x.len(), y.len(), rstd.len())
    })?;
    let chunk = rows_per_task(hidden);
    y.par_chunks_mut(chunk * hidden)
        .zip(rstd.par_chunks_mut(chunk))
        .zip(x.par_chunks(chunk * hidden))
        .for_each(|((y, rstd), x)| {
            for ((y, r), x) in y.chunks_mut(hidden).zip(rstd.iter_mut()).zip(x.chunks(hidden)) {
                let ms = super::dot(x, x) / hidden as f32;
                *r = 1.0 / (ms + eps).sqrt();
                for ((y, x), w) in y.iter_mut().zip(x).zip(w) {
                    *y = w * (x * *r);
                }
            }
        });
    Ok(())
}

/// Gradients of [`rmsnorm_forward`]: writes `dx`, adds into `dw`.
pub fn rmsnorm_backward(
    dx: &mut [f32],
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    rstd: &[f32],
) -> Result<()> {
    let hidden = w.len();
    ensure(
        dx.len() == x.len()
            && dy.len() == x.len()
            && dw.len() == hidden
            && x.len() == rstd.len() * hidden,
        "rmsnorm_backward",
        || {
            format!(
                "dx {} dy {} x {} dw {} rstd {}",
                dx.len(),
                dy.len(),
                x.len(),
                dw.len(),
                rstd.len()
            )
        },
    )?;
    let chunk = rows_per_task(hidden);
    // dx row by row; dw as per-chunk partial sums added in chunk order (deterministic).
    let partial: Vec<Vec<f32>> = dx
        .par_chunks_mut(chunk * hidden)
        .zip(dy.par_chunks(chunk * hidden))
        .zip(x.par_chunks(chunk * hidden))
        .zip(rstd.par_chunks(chunk))
        .map(|(((dx, dy), x), rstd)| {
            let mut dw_part = vec![0f32; hidden];
            for (((dx, dy), x), &r) in
                dx.chunks_mut(hidden).zip(dy.chunks(hidden)).zip(x.chunks(hidden)).zip(rstd)
            {
                // dx = r·(w·dy − x̂·mean(w·dy·x̂)), x̂ = x·r.
                let mut dot = 0f32;
                for ((dy, x), w) in dy.iter().zip(x).zip(w) {
                    dot += w * dy * x * r;
                }
                let mean = dot / hidden as f32;
                for (i, dx) in dx.iter_mut().enumerate() {
                    let xhat = x[i] * r;
                    *dx = r * (w[i] * dy[i] - xhat * mean);
                    dw_part[i] += dy[i] * xhat;
                }
            }
            dw_part
        })
        .collect();
    for part in partial {
        dw.iter_mut().zip(part).for_each(|(d, p)| *d += p);
    }
    Ok(())
}

/// Rows a column sum adds in one run: the CUDA kernel spreads these runs over its threads.
pub const COLUMN_SUM_ROWS: usize = 256;

/// `acc[j] += Σ_r x[r·n + j]` (a bias's gradient): each run of [`COLUMN_SUM_ROWS`] rows summed
/// in row order, the runs' sums added in order, then added to `acc` (the CUDA kernel's order).
pub fn column_sums_acc(acc: &mut [f32], x: &[f32]) {
    let n = acc.len();
    let mut total = vec![0.0f32; n];
    for chunk in x.chunks(n * COLUMN_SUM_ROWS) {
        let mut part = vec![0.0f32; n];
        for row in chunk.chunks_exact(n) {
            for (p, v) in part.iter_mut().zip(row) {
                *p += v;
            }
        }
        for (t, p) in total.iter_mut().zip(&part) {
            *t += p;
        }
    }
    for (a, t) in acc.iter_mut().zip(&total) {
        *a += t;
    }
}

/// HF's default rotary inverse frequencies `theta^(−2j/dim)` for `j < dim/2`, in f32 as
/// transformers computes them.
pub fn rope_inv_freq(dim: usize, theta: f32) -> Vec<f32> {
    (0..dim / 2).map(|j| 1.0 / theta.powf((2 * j) as f32 / dim as f32)).collect()
}

/// cos and sin tables `[positions × inv_freq.len()]` of HF's rotary embedding: angle =
/// position · inv_freq[j], its cos and sin times `scale` (YaRN's attention factor, else 1), in
/// f32 as transformers computes them.
pub fn rope_tables(positions: &[u32], inv_freq: &[f32], scale: f32) -> (Vec<f32>, Vec<f32>) {
    let half = inv_freq.len();
    let mut cos = Vec::with_capacity(positions.len() * half);
    let mut sin = Vec::with_capacity(positions.len() * half);
    for &p in positions {
        for f in inv_freq {
            let angle = p as f32 * f;
            cos.push(angle.cos() * scale);
            sin.push(angle.sin() * scale);
        }
    }
    (cos, sin)
}

/// Rotates `x` `[tokens × heads × head_dim]` in place by the rotate-half convention:
/// `(a, b) → (a·cos − b·sin, b·cos + a·sin)` for the two halves of each head.
pub fn rope_forward(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    rope_apply(x, cos, sin, heads, head_dim, 1.0)
}

/// The backward of [`rope_forward`]: the inverse rotation of the gradient, in place.
pub fn rope_backward(
    dx: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    head_dim: usize,
) -> Result<()> {
    rope_apply(dx, cos, sin, heads, head_dim, -1.0)
}

fn rope_apply(
    x: &mut [f32],
    cos: &[f32],
    sin: &[f32],
    heads: usize,
    head_dim: usize,
    sign: f32,
) -> Result<()> {
    let half = head_dim / 2;
    let row = heads * head_dim;
    ensure(
        head_dim.is_multiple_of(2)
            && cos.len() == sin.len()
            && x.len() / row.max(1) * half == cos.len(),
        "rope",
        || format!("x {} heads {heads} head_dim {head_dim} table {}", x.len(), cos.len()),
    )?;
    x.par_chunks_mut(row).enumerate().for_each(|(t, token)| {
        let (c, s) = (&cos[t * half..(t + 1) * half], &sin[t * half..(t + 1) * half]);
        for head in token.chunks_mut(head_dim) {
            let (a, b) = head.split_at_mut(half);
            for j in 0..half {
                let (x0, x1, sj) = (a[j], b[j], sign * s[j]);
                a[j] = x0 * c[j] - x1 * sj;
                b[j] = x1 * c[j] + x0 * sj;
            }
        }
    });
    Ok(())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// The activation of a gated MLP's gate: SiLU (SwiGLU: Llama, Qwen) or the tanh-approximated
/// GELU (GeGLU: Gemma's `gelu_pytorch_tanh`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Gate {
    Silu,
    GeluTanh,
}

/// √(2/π) and the cubic coefficient of the tanh-approximated GELU (PyTorch's kBeta, kKappa).
const GELU_BETA: f32 = 0.797_884_6;
const GELU_KAPPA: f32 = 0.044_715;

impl Gate {
    /// `act(g) · u`.
    fn forward(self, g: f32, u: f32) -> f32 {
        match self {
            Gate::Silu => g * sigmoid(g) * u,
            Gate::GeluTanh => {
                let t = (GELU_BETA * (g + GELU_KAPPA * g * g * g)).tanh();
                0.5 * g * (1.0 + t) * u
            }
        }
    }

    /// `(d_gate, d_up)` of [`Gate::forward`] for the gradient `dh`.
    fn backward(self, dh: f32, g: f32, u: f32) -> (f32, f32) {
        match self {
            Gate::Silu => {
                let s = sigmoid(g);
                (dh * u * s * (1.0 + g * (1.0 - s)), dh * g * s)
            }
            Gate::GeluTanh => {
                let t = (GELU_BETA * (g + GELU_KAPPA * g * g * g)).tanh();
                let act = 0.5 * g * (1.0 + t);
                let slope = 0.5 * (1.0 + t)
                    + 0.5 * g * (1.0 - t * t) * GELU_BETA * (1.0 + 3.0 * GELU_KAPPA * g * g);
                (dh * u * slope, dh * act)
            }
        }
    }
}

/// `h = act(gate) · up`, elementwise.
pub fn glu_forward(h: &mut [f32], gate: &[f32], up: &[f32], act: Gate) -> Result<()> {
    ensure(h.len() == gate.len() && h.len() == up.len(), "glu", || {
        format!("h {} gate {} up {}", h.len(), gate.len(), up.len())
    })?;
    h.par_chunks_mut(16_384).zip(gate.par_chunks(16_384)).zip(up.par_chunks(16_384)).for_each(
        |((h, g), u)| {
            for ((h, g), u) in h.iter_mut().zip(g).zip(u) {
                *h = act.forward(*g, *u);
            }
        },
    );
    Ok(())
}

/// Gradients of [`glu_forward`] with respect to `gate` and `up`.
pub fn glu_backward(
    d_gate: &mut [f32],
    d_up: &mut [f32],
    dh: &[f32],
    gate: &[f32],
    up: &[f32],
    act: Gate,
) -> Result<()> {
    let n = dh.len();
    ensure(
        d_gate.len() == n && d_up.len() == n && gate.len() == n && up.len() == n,
        "glu_backward",
        || {
            format!(
                "dh {n} gate {} up {} d_gate {} d_up {}",
                gate.len(),
                up.len(),
                d_gate.len(),
                d_up.len()
            )
        },
    )?;
    const C: usize = 16_384;
    d_gate
        .par_chunks_mut(C)
        .zip(d_up.par_chunks_mut(C))
        .zip(dh.par_chunks(C))
        .zip(gate.par_chunks(C).zip(up.par_chunks(C)))
        .for_each(|(((dg, du), dh), (g, u))| {
            for i in 0..dh.len() {
                (dg[i], du[i]) = act.backward(dh[i], g[i], u[i]);
            }
        });
    Ok(())
}

/// `h = silu(gate) · up`: [`glu_forward`] with SiLU.
pub fn swiglu_forward(h: &mut [f32], gate: &[f32], up: &[f32]) -> Result<()> {
    glu_forward(h, gate, up, Gate::Silu)
}

/// Gradients of [`swiglu_forward`] with respect to `gate` and `up`.
pub fn swiglu_backward(
    d_gate: &mut [f32],
    d_up: &mut [f32],
    dh: &[f32],
    gate: &[f32],
    up: &[f32],
) -> Result<()> {
    glu_backward(d_gate, d_up, dh, gate, up, Gate::Silu)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Rng, check_gradient, dot};

    #[test]
    fn embedding_gathers_and_scatters_with_repeats() {
        let table: Vec<f32> = (0..12).map(|v| v as f32).collect(); // vocab 4 × hidden 3
        let ids = [2u32, 0, 2];
        let mut out = vec![0.0; 9];
        embedding_forward(&mut out, &table, &ids, 3).unwrap();
        assert_eq!(out, [6., 7., 8., 0., 1., 2., 6., 7., 8.]);
        let mut d_table = vec![0.0; 12];
        embedding_backward(&mut d_table, &[1., 2., 3., 4., 5., 6., 7., 8., 9.], &ids, 3).unwrap();
        assert_eq!(d_table, [4., 5., 6., 0., 0., 0., 8., 10., 12., 0., 0., 0.]);
        assert!(embedding_forward(&mut out, &table, &[4, 0, 0], 3).is_err());
    }

    #[test]
    fn rmsnorm_matches_the_formula_and_its_gradients() {
        let (rows, hidden) = (5, 8);
        let mut rng = Rng::new(2);
        let mut x = rng.vec(rows * hidden, 1.0);
        let mut w: Vec<f32> = rng.vec(hidden, 0.3).iter().map(|v| 1.0 + v).collect();
        let r = rng.vec(rows * hidden, 1.0);
        let eps = 1e-6;
        let forward = |x: &[f32], w: &[f32]| {
            let mut y = vec![0.0; x.len()];
            let mut rstd = vec![0.0; x.len() / w.len()];
            rmsnorm_forward(&mut y, &mut rstd, x, w, eps).unwrap();
            (y, rstd)
        };
        let (y, rstd) = forward(&x, &w);
        let ms: f32 = x[..hidden].iter().map(|v| v * v).sum::<f32>() / hidden as f32;
        assert!((y[1] - x[1] / (ms + eps).sqrt() * w[1]).abs() < 1e-6);

        let mut dx = vec![0.0; x.len()];
        let mut dw = vec![0.0; hidden];
        rmsnorm_backward(&mut dx, &mut dw, &r, &x, &w, &rstd).unwrap();
        let wc = w.clone();
        check_gradient("rmsnorm dx", &mut x, &dx, 64, |x| dot(&r, &forward(x, &wc).0));
        let xc = x.clone();
        check_gradient("rmsnorm dw", &mut w, &dw, 64, |w| dot(&r, &forward(&xc, w).0));
    }

    #[test]
    fn rope_rotates_pairs_and_its_backward_is_the_transpose() {
        let (tokens, heads, head_dim) = (4, 2, 8);
        let positions = [0u32, 1, 2, 7];
        let (cos, sin) = rope_tables(&positions, &rope_inv_freq(head_dim, 10_000.0), 1.0);
        assert_eq!(cos[0], 1.0);
        assert!((sin[4] - 1f32.sin()).abs() < 1e-7); // position 1, frequency 1
        let mut rng = Rng::new(3);
        let x = rng.vec(tokens * heads * head_dim, 1.0);
        let mut y = x.clone();
        rope_forward(&mut y, &cos, &sin, heads, head_dim).unwrap();
        assert_eq!(&y[..16], &x[..16]); // position 0 is the identity
        // A rotation keeps each pair's norm.
        let t = 3 * heads * head_dim;
        let pair = |v: &[f32], j: usize| v[t + j].powi(2) + v[t + j + 4].powi(2);
        assert!((pair(&x, 1) - pair(&y, 1)).abs() < 1e-5);

        let r = rng.vec(x.len(), 1.0);
        let mut dx = r.clone();
        rope_backward(&mut dx, &cos, &sin, heads, head_dim).unwrap();
        let mut xv = x.clone();
        check_gradient("rope", &mut xv, &dx, 64, |x| {
            let mut y = x.to_vec();
            rope_forward(&mut y, &cos, &sin, heads, head_dim).unwrap();
            dot(&r, &y)
        });
    }

    #[test]
    fn gated_mlp_gradients() {
        for act in [Gate::Silu, Gate::GeluTanh] {
            let mut rng = Rng::new(4);
            let n = 40;
            let mut gate = rng.vec(n, 2.0);
            let mut up = rng.vec(n, 1.0);
            let r = rng.vec(n, 1.0);
            let f = |g: &[f32], u: &[f32]| {
                let mut h = vec![0.0; n];
                glu_forward(&mut h, g, u, act).unwrap();
                h
            };
            let h = f(&gate, &up);
            let g = f64::from(gate[0]);
            let want = match act {
                Gate::Silu => g / (1.0 + (-g).exp()),
                // PyTorch's gelu(approximate="tanh").
                Gate::GeluTanh => {
                    let inner = (2.0 / std::f64::consts::PI).sqrt() * (g + 0.044715 * g.powi(3));
                    0.5 * g * (1.0 + inner.tanh())
                }
            };
            assert!((f64::from(h[0]) - want * f64::from(up[0])).abs() < 1e-6, "{act:?}");
            let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
            glu_backward(&mut dg, &mut du, &r, &gate, &up, act).unwrap();
            let uc = up.clone();
            check_gradient("glu d_gate", &mut gate, &dg, n, |g| dot(&r, &f(g, &uc)));
            let gc = gate.clone();
            check_gradient("glu d_up", &mut up, &du, n, |u| dot(&r, &f(&gc, u)));
        }
    }
}
