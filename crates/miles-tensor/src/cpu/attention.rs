//! Causal attention with grouped-query heads over packed variable-length sequences.
//!
//! Layout: `q` is `[tokens × q_heads × head_dim]`, `k` and `v` are `[tokens × kv_heads ×
//! head_dim]`, sequences packed back to back with `cu_seqlens` (`[0, len0, len0+len1, …]`).
//! Query head `h` reads kv head `h / (q_heads / kv_heads)`. Scores are scaled by
//! `1/sqrt(head_dim)`; each token attends to itself and the earlier tokens of its sequence.
//!
//! The forward streams over keys in blocks with an online softmax and saves only the
//! log-sum-exp per (token, head): memory is linear in sequence length. The backward recomputes
//! probabilities from it, once per query (for dq) and once per key (for dk, dv), so every
//! gradient is a sum in a fixed order, written by one task.

use rayon::prelude::*;

use super::dot;
use crate::{Result, ensure};

/// Keys per block of the online softmax.
const KEY_BLOCK: usize = 64;

/// Shapes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    fn check(
        &self,
        op: &'static str,
        tokens: usize,
        q: usize,
        k: usize,
        v: usize,
        cu: &[usize],
    ) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, head_dim } = *self;
        ensure(kv_heads > 0 && q_heads.is_multiple_of(kv_heads), op, || {
            format!("{q_heads} query heads are not a multiple of {kv_heads} kv heads")
        })?;
        ensure(
            q == tokens * q_heads * head_dim && k == tokens * kv_heads * head_dim && v == k,
            op,
            || {
                format!(
                    "q {q} k {k} v {v} for {tokens} tokens, heads {q_heads}/{kv_heads}, head_dim {head_dim}"
                )
            },
        )?;
        ensure(
            cu.first() == Some(&0)
                && cu.last() == Some(&tokens)
                && cu.windows(2).all(|w| w[0] <= w[1]),
            op,
            || format!("cu_seqlens {cu:?} must rise from 0 to {tokens}"),
        )
    }
}

/// The first token of each token's sequence.
fn sequence_starts(cu_seqlens: &[usize], tokens: usize) -> Vec<usize> {
    let mut starts = vec![0; tokens];
    for w in cu_seqlens.windows(2) {
        starts[w[0]..w[1]].fill(w[0]);
    }
    starts
}

fn sequence_ends(cu_seqlens: &[usize], tokens: usize) -> Vec<usize> {
    let mut ends = vec![0; tokens];
    for w in cu_seqlens.windows(2) {
        ends[w[0]..w[1]].fill(w[1]);
    }
    ends
}

/// Writes `out` `[tokens × q_heads × head_dim]` and `lse` `[tokens × q_heads]`.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, head_dim: d } = shape;
    let tokens = lse.len() / q_heads.max(1);
    shape.check("attention", tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    ensure(out.len() == q.len() && lse.len() == tokens * q_heads, "attention", || {
        format!("out {} lse {} for q {}", out.len(), lse.len(), q.len())
    })?;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let starts = sequence_starts(cu_seqlens, tokens);
    out.par_chunks_mut(q_heads * d).zip(lse.par_chunks_mut(q_heads)).enumerate().for_each(
        |(t, (out_t, lse_t))| {
            let mut scores = [0f32; KEY_BLOCK];
            for h in 0..q_heads {
                let qv = &q[(t * q_heads + h) * d..][..d];
                let kvh = h / group;
                let acc = &mut out_t[h * d..(h + 1) * d];
                acc.fill(0.0);
                let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
                let mut j0 = starts[t];
                while j0 <= t {
                    let j1 = (j0 + KEY_BLOCK).min(t + 1);
                    let mut block_max = f32::NEG_INFINITY;
                    for (s, j) in scores.iter_mut().zip(j0..j1) {
                        *s = scale * dot(qv, &k[(j * kv_heads + kvh) * d..][..d]);
                        block_max = block_max.max(*s);
                    }
                    let new_m = m.max(block_max);
                    let rescale = (m - new_m).exp();
                    l *= rescale;
                    acc.iter_mut().for_each(|a| *a *= rescale);
                    for (s, j) in scores.iter().zip(j0..j1) {
                        let p = (s - new_m).exp();
                        l += p;
                        let vj = &v[(j * kv_heads + kvh) * d..][..d];
                        acc.iter_mut().zip(vj).for_each(|(a, x)| *a += p * x);
                    }
                    m = new_m;
                    j0 = j1;
                }
                acc.iter_mut().for_each(|a| *a /= l);
                lse_t[h] = m + l.ln();
            }
        },
    );
    Ok(())
}

/// Gradients of [`attention_forward`]: writes `dq`, `dk`, `dv` from `d_out`, using the saved
/// `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    d_out: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, head_dim: d } = shape;
    let tokens = lse.len() / q_heads.max(1);
    shape.check("attention_backward", tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    ensure(
        dq.len() == q.len()
            && dk.len() == k.len()
            && dv.len() == v.len()
            && d_out.len() == q.len()
            && out.len() == q.len(),
        "attention_backward",
        || format!("gradient buffers do not match q {} k {}", q.len(), k.len()),
    )?;
    let group = q_heads / kv_heads;
    let scale = 1.0 / (d as f32).sqrt();
    let starts = sequence_starts(cu_seqlens, tokens);
    let ends = sequence_ends(cu_seqlens, tokens);
    // delta[t, h] = dO·O, the softmax backward's row term.
    let delta: Vec<f32> =
        d_out.par_chunks(d).zip(out.par_chunks(d)).map(|(a, b)| dot(a, b)).collect();

    // dq: one task per query token, keys in order.
    dq.par_chunks_mut(q_heads * d).enumerate().for_each(|(t, dq_t)| {
        dq_t.fill(0.0);
        for h in 0..q_heads {
            let row = t * q_heads + h;
            let (qv, dov) = (&q[row * d..][..d], &d_out[row * d..][..d]);
            let kvh = h / group;
            let dqv = &mut dq_t[h * d..(h + 1) * d];
            for j in starts[t]..=t {
                let (kj, vj) =
                    (&k[(j * kv_heads + kvh) * d..][..d], &v[(j * kv_heads + kvh) * d..][..d]);
                let p = (scale * dot(qv, kj) - lse[row]).exp();
                let ds = p * (dot(dov, vj) - delta[row]);
                dqv.iter_mut().zip(kj).for_each(|(g, x)| *g += scale * ds * x);
            }
        }
    });

    // dk, dv: one task per key token, queries (and the query heads of the group) in order.
    dk.par_chunks_mut(kv_heads * d).zip(dv.par_chunks_mut(kv_heads * d)).enumerate().for_each(
        |(j, (dk_j, dv_j))| {
            dk_j.fill(0.0);
            dv_j.fill(0.0);
            for kvh in 0..kv_heads {
                let (kj, vj) =
                    (&k[(j * kv_heads + kvh) * d..][..d], &v[(j * kv_heads + kvh) * d..][..d]);
                let dkv = &mut dk_j[kvh * d..(kvh + 1) * d];
                let dvv = &mut dv_j[kvh * d..(kvh + 1) * d];
                for i in j..ends[j] {
                    for h in kvh * group..(kvh + 1) * group {
                        let row = i * q_heads + h;
                        let (qv, dov) = (&q[row * d..][..d], &d_out[row * d..][..d]);
                        let p = (scale * dot(qv, kj) - lse[row]).exp();
                        dvv.iter_mut().zip(dov).for_each(|(g, x)| *g += p * x);
                        let ds = p * (dot(dov, vj) - delta[row]);
                        dkv.iter_mut().zip(qv).for_each(|(g, x)| *g += scale * ds * x);
                    }
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Rng, check_gradient, dot as dot64};

    /// Full-matrix softmax attention in f64, one sequence and head at a time.
    fn naive(q: &[f32], k: &[f32], v: &[f32], cu: &[usize], s: AttentionShape) -> Vec<f64> {
        let AttentionShape { q_heads, kv_heads, head_dim: d } = s;
        let mut out = vec![0f64; q.len()];
        let scale = 1.0 / (d as f64).sqrt();
        for w in cu.windows(2) {
            for h in 0..q_heads {
                let g = h / (q_heads / kv_heads);
                for i in w[0]..w[1] {
                    let scores: Vec<f64> = (w[0]..=i)
                        .map(|j| {
                            (0..d)
                                .map(|x| {
                                    f64::from(q[(i * q_heads + h) * d + x])
                                        * f64::from(k[(j * kv_heads + g) * d + x])
                                })
                                .sum::<f64>()
                                * scale
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (j, s) in (w[0]..=i).zip(&scores) {
                        let p = (s - m).exp() / z;
                        for x in 0..d {
                            out[(i * q_heads + h) * d + x] +=
                                p * f64::from(v[(j * kv_heads + g) * d + x]);
                        }
                    }
                }
            }
        }
        out
    }

    fn forward(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cu: &[usize],
        s: AttentionShape,
    ) -> (Vec<f32>, Vec<f32>) {
        let tokens = *cu.last().unwrap();
        let mut out = vec![f32::NAN; q.len()];
        let mut lse = vec![f32::NAN; tokens * s.q_heads];
        attention_forward(&mut out, &mut lse, q, k, v, cu, s).unwrap();
        (out, lse)
    }

    #[test]
    fn matches_full_softmax_attention_on_packed_sequences() {
        let mut rng = Rng::new(5);
        // 150 tokens in one sequence spans several key blocks.
        for (cu, s) in [
            (vec![0, 5, 9, 21], AttentionShape { q_heads: 4, kv_heads: 2, head_dim: 8 }),
            (vec![0, 150, 151], AttentionShape { q_heads: 3, kv_heads: 1, head_dim: 16 }),
        ] {
            let t = *cu.last().unwrap();
            let q = rng.vec(t * s.q_heads * s.head_dim, 1.0);
            let k = rng.vec(t * s.kv_heads * s.head_dim, 1.0);
            let v = rng.vec(t * s.kv_heads * s.head_dim, 1.0);
            let (out, lse) = forward(&q, &k, &v, &cu, s);
            assert!(lse.iter().all(|x| x.is_finite()));
            for (a, b) in out.iter().zip(naive(&q, &k, &v, &cu, s)) {
                assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn a_sequence_ignores_its_neighbours() {
        let s = AttentionShape { q_heads: 2, kv_heads: 1, head_dim: 4 };
        let mut rng = Rng::new(6);
        let (q, mut k, v) = (rng.vec(6 * 8, 1.0), rng.vec(6 * 4, 1.0), rng.vec(6 * 4, 1.0));
        let cu = [0, 3, 6];
        let (before, _) = forward(&q, &k, &v, &cu, s);
        k[4 * 4] += 5.0; // a key of the second sequence
        let (after, _) = forward(&q, &k, &v, &cu, s);
        assert_eq!(&before[..3 * 8], &after[..3 * 8]);
        assert_ne!(&before[3 * 8..], &after[3 * 8..]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let s = AttentionShape { q_heads: 4, kv_heads: 2, head_dim: 4 };
        let cu = [0, 3, 8];
        let t = 8;
        let mut rng = Rng::new(7);
        let mut q = rng.vec(t * 16, 0.7);
        let mut k = rng.vec(t * 8, 0.7);
        let mut v = rng.vec(t * 8, 0.7);
        let r = rng.vec(t * 16, 1.0);
        let (out, lse) = forward(&q, &k, &v, &cu, s);
        let (mut dq, mut dk, mut dv) =
            (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
        attention_backward(&mut dq, &mut dk, &mut dv, &r, &q, &k, &v, &out, &lse, &cu, s).unwrap();
        let (kc, vc) = (k.clone(), v.clone());
        check_gradient("attention dq", &mut q, &dq, 128, |q| {
            dot64(&r, &forward(q, &kc, &vc, &cu, s).0)
        });
        let qc = q.clone();
        check_gradient("attention dk", &mut k, &dk, 64, |k| {
            dot64(&r, &forward(&qc, k, &vc, &cu, s).0)
        });
        let kc = k.clone();
        check_gradient("attention dv", &mut v, &dv, 64, |v| {
            dot64(&r, &forward(&qc, &kc, v, &cu, s).0)
        });
    }

    #[test]
    fn bad_shapes_are_errors() {
        let s = AttentionShape { q_heads: 3, kv_heads: 2, head_dim: 4 };
        let mut out = vec![0.0; 12];
        let mut lse = vec![0.0; 3];
        let err =
            attention_forward(&mut out, &mut lse, &[0.0; 12], &[0.0; 8], &[0.0; 8], &[0, 1], s);
        assert!(err.unwrap_err().to_string().contains("multiple"));
        let s = AttentionShape { q_heads: 2, kv_heads: 1, head_dim: 2 };
        let mut lse = vec![0.0; 6];
        let err =
            attention_forward(&mut out, &mut lse, &[0.0; 12], &[0.0; 6], &[0.0; 6], &[0, 2], s);
        assert!(err.unwrap_err().to_string().contains("cu_seqlens"));
    }
}
