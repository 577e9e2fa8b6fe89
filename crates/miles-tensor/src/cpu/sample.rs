//! Token sampling from raw f32 logits: temperature, then top-k, then top-p (SGLang's order),
//! then one draw from a given uniform. Probabilities are integer masses, so every sum is exact
//! in any order, and the mass of a logit is computed from IEEE additions and products alone
//! (no library `exp`, whose last bits differ between machines): `kernels/sample.cu` returns the
//! same token for the same row and uniform.

use rayon::prelude::*;

use crate::{Result, ensure};

/// Fixed-point bits of a token's probability mass relative to the row's maximum.
pub const MASS_BITS: u32 = 40;

/// Below this `z − max`, `exp · 2^MASS_BITS < 1`: the mass is 0 (and -inf needs no exp).
const MASS_CUTOFF: f32 = -28.0;

// exp by Cody-Waite reduction, exp(d) = 2^k · exp(r) with |r| ≤ ln2/2, and a degree-7 Taylor
// polynomial in r; f32 constants by their bits (kernels/sample.cu uses the same bits).
const LOG2E: f32 = f32::from_bits(0x3fb8_aa3b);
const LN2_HI: f32 = f32::from_bits(0x3f31_7200); // 0.693145751953125: k·LN2_HI is exact
const LN2_LO: f32 = f32::from_bits(0x35bf_be8e);
/// 1/n! for n = 7 down to 2.
const TAYLOR: [f32; 6] = [
    f32::from_bits(0x3950_0d01),
    f32::from_bits(0x3ab6_0b61),
    f32::from_bits(0x3c08_8889),
    f32::from_bits(0x3d2a_aaab),
    f32::from_bits(0x3e2a_aaab),
    0.5,
];

/// `floor(exp(d) · 2^MASS_BITS)` for `d = z − max ≤ 0`: within a few f32 ulps of the true
/// exp, and the same bits on the device (f32 products and sums rounded one by one, never fused).
pub fn sample_mass(d: f32) -> u64 {
    if d < MASS_CUTOFF {
        return 0;
    }
    let k = (d * LOG2E + 0.5).floor(); // in [-40, 0]
    let r = (d - k * LN2_HI) - k * LN2_LO;
    let mut p = TAYLOR[0];
    for c in &TAYLOR[1..] {
        p = p * r + c;
    }
    p = p * r + 1.0;
    p = p * r + 1.0;
    // floor(p · 2^(k + MASS_BITS)), p in [0.7, 1.42]: p's 24-bit significand shifted.
    let b = p.to_bits();
    let significand = u64::from((b & 0x7f_ffff) | 0x80_0000);
    let shift = (b >> 23) as i32 - 150 + k as i32 + MASS_BITS as i32;
    if shift >= 0 { significand << shift } else { significand >> -shift }
}

/// A total order on tempered logits: larger is better ranked (larger z, then the lower id).
/// -0.0 counts as +0.0, as in a float comparison.
fn rank_key(z: f32, id: usize) -> u64 {
    let b = if z == 0.0 { 0 } else { z.to_bits() };
    let ordered = if b & 0x8000_0000 != 0 { !b } else { b | 0x8000_0000 };
    (u64::from(ordered) << 32) | u64::from(u32::MAX - id as u32)
}

/// One draw from row `logits` (raw f32 logits) at `temperature`, keeping the `top_k` best
/// tokens (0: all), then the best of those while the mass ranked before a token is at most
/// `top_p` of theirs; `u` in [0, 1). None when a tempered logit is NaN or +inf or all are
/// -inf. A token of mass 0 (-inf, or far below the best) is never drawn.
pub fn sample_row(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    u: f64,
) -> Option<u32> {
    draw(&kept_masses(logits, temperature, top_k, top_p)?, u)
}

/// The distribution [`sample_row`] draws from: each token's integer mass (exp of its tempered
/// logit less the row's best, in units of 2^-[`MASS_BITS`]), 0 for the tokens top-k and top-p
/// drop. None when a tempered logit is NaN or +inf or all are -inf.
pub fn kept_masses(logits: &[f32], temperature: f32, top_k: usize, top_p: f32) -> Option<Vec<u64>> {
    let z: Vec<f32> = logits.iter().map(|x| x / temperature).collect();
    if z.iter().any(|v| v.is_nan() || *v == f32::INFINITY) {
        return None;
    }
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        return None;
    }
    let mut w: Vec<u64> = z.iter().map(|&v| sample_mass(v - m)).collect();
    let vocab = z.len();
    let by_k = top_k > 0 && top_k < vocab;
    if by_k || top_p < 1.0 {
        let mut keys: Vec<u64> = z.iter().enumerate().map(|(i, &v)| rank_key(v, i)).collect();
        if by_k {
            keys.select_nth_unstable_by(top_k - 1, |a, b| b.cmp(a));
            keys.truncate(top_k);
        }
        keys.sort_unstable_by(|a, b| b.cmp(a));
        let id = |key: u64| (u32::MAX - key as u32) as usize;
        let mut n = keys.len();
        if top_p < 1.0 {
            let total: u64 = keys.iter().map(|&k| w[id(k)]).sum();
            let p = (f64::from(top_p) * total as f64).floor() as u64;
            let mut before = 0;
            n = keys
                .iter()
                .take_while(|&&k| {
                    let keep = before <= p;
                    before += w[id(k)];
                    keep
                })
                .count();
        }
        // Kept: the rank keys at or above the last kept one.
        let threshold = keys[n - 1];
        for (i, w) in w.iter_mut().enumerate() {
            if rank_key(z[i], i) < threshold {
                *w = 0;
            }
        }
    }
    Some(w)
}

/// The token at `u` in [0, 1) of the distribution of integer masses `w` (the first whose
/// running sum passes floor(u · total)); None when every mass is 0.
pub fn draw(w: &[u64], u: f64) -> Option<u32> {
    let total: u64 = w.iter().sum();
    if total == 0 {
        return None;
    }
    let target = ((u * total as f64).floor() as u64).min(total - 1);
    let mut cum = 0;
    w.iter()
        .position(|&m| {
            cum += m;
            cum > target
        })
        .map(|i| i as u32)
}

/// Checks the sampling parameters: a finite positive temperature, top_p in (0, 1], uniforms
/// in [0, 1).
pub(crate) fn check_sampling(
    op: &'static str,
    temperature: f32,
    top_p: f32,
    uniforms: &[f64],
) -> Result<()> {
    ensure(temperature > 0.0 && temperature.is_finite(), op, || {
        format!("temperature {temperature} must be positive and finite")
    })?;
    ensure(top_p > 0.0 && top_p <= 1.0, op, || format!("top_p {top_p} is outside (0, 1]"))?;
    match uniforms.iter().position(|u| !(0.0..1.0).contains(u)) {
        Some(r) => Err(crate::Error::Shape {
            op,
            message: format!("uniform {} of row {r} is outside [0, 1)", uniforms[r]),
        }),
        None => Ok(()),
    }
}

/// [`sample_row`] over the rows of `logits` `[rows × vocab]`, one uniform per row.
pub fn sample_rows(
    logits: &[f32],
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniforms: &[f64],
) -> Result<Vec<Option<u32>>> {
    let rows = uniforms.len();
    let vocab = logits.len() / rows.max(1);
    ensure(logits.len() == rows * vocab && (rows == 0 || vocab > 0), "sample_rows", || {
        format!("logits {} for {rows} rows", logits.len())
    })?;
    check_sampling("sample_rows", temperature, top_p, uniforms)?;
    if rows == 0 {
        return Ok(Vec::new());
    }
    Ok(logits
        .par_chunks(vocab)
        .zip(uniforms.par_iter())
        .map(|(row, &u)| sample_row(row, temperature, top_k, top_p, u))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    const NEG_INF: f32 = f32::NEG_INFINITY;

    /// Uniform in [0, 1) from 53 random bits.
    fn uniform(rng: &mut Rng) -> f64 {
        (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// The tokens drawn at n uniforms spread evenly over [0, 1), the last just below 1.
    fn drawn(logits: &[f32], t: f32, top_k: usize, top_p: f32, n: usize) -> Vec<u32> {
        let mut seen: Vec<u32> = (0..n)
            .map(|j| {
                let u = if j + 1 == n { 1.0 - f64::EPSILON } else { j as f64 / n as f64 };
                sample_row(logits, t, top_k, top_p, u).unwrap()
            })
            .collect();
        seen.sort_unstable();
        seen.dedup();
        seen
    }

    #[test]
    fn masses_follow_exp() {
        assert_eq!(sample_mass(0.0), 1 << MASS_BITS);
        assert_eq!(sample_mass(-0.0), 1 << MASS_BITS);
        assert_eq!(sample_mass(NEG_INF), 0);
        assert_eq!(sample_mass(-30.0), 0);
        let mut rng = Rng::new(71);
        for _ in 0..100_000 {
            let d = rng.uniform(-28.0, 0.0);
            let want = f64::from(d).exp() * (1u64 << MASS_BITS) as f64;
            let got = sample_mass(d) as f64;
            // A few f32 ulps, then the floor.
            assert!((got - want).abs() <= want * 4.0 * f64::from(f32::EPSILON) + 1.0, "{d}");
        }
    }

    #[test]
    fn draws_follow_the_truncated_tempered_distribution() {
        let logits = [1.0, -0.5, 2.0, NEG_INF, 0.3, 2.0, -1.0];
        let t = 0.7;
        let z: Vec<f64> = logits.iter().map(|&x| f64::from(x / t)).collect();
        // (top_k, top_p, the kept ids): ranks are 2, 5 (tied, lower id first), 0, 4, 1, 6, 3.
        for (top_k, top_p, kept) in [
            (0, 1.0, &[0, 1, 2, 3, 4, 5, 6][..]),
            (3, 1.0, &[0, 2, 5]),
            (0, 0.9, &[0, 2, 5]),
            (4, 0.97, &[0, 2, 4, 5]),
        ] {
            let p: Vec<f64> = (0..z.len())
                .map(|i| if kept.contains(&i) { (z[i] - z[2]).exp() } else { 0.0 })
                .collect();
            let sum: f64 = p.iter().sum();
            let n = 200_000;
            let mut count = vec![0usize; z.len()];
            let mut rng = Rng::new(72);
            for _ in 0..n {
                count[sample_row(&logits, t, top_k, top_p, uniform(&mut rng)).unwrap() as usize] +=
                    1;
            }
            for (i, &c) in count.iter().enumerate() {
                let (want, got) = (p[i] / sum, c as f64 / n as f64);
                let sigma = (want * (1.0 - want) / n as f64).sqrt();
                assert!(
                    (got - want).abs() <= 5.0 * sigma + 1e-9,
                    "top_k {top_k} top_p {top_p} token {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn top_k_and_top_p_keep_the_best_tokens() {
        // Masses ∝ 1, 0.905, 0.050, 0.368, 0.0003; rank order 0, 1, 3, 2, 4.
        let logits = [3.0, 2.9, 0.0, 2.0, -5.0];
        for (top_k, top_p, kept) in [
            (0, 1.0, &[0, 1, 2, 3, 4][..]),
            (5, 1.0, &[0, 1, 2, 3, 4]),
            (1, 1.0, &[0]),
            (2, 1.0, &[0, 1]),
            (3, 1.0, &[0, 1, 3]),
            (0, 0.3, &[0]),
            (0, 0.5, &[0, 1]),
            (0, 0.85, &[0, 1, 3]),
            (0, 0.95, &[0, 1, 3]),
            (0, 0.98, &[0, 1, 2, 3]),
            (2, 0.5, &[0]),
            (3, 0.6, &[0, 1]),
            (4, 0.99, &[0, 1, 2, 3]),
        ] {
            assert_eq!(
                drawn(&logits, 1.0, top_k, top_p, 4000),
                kept,
                "top_k {top_k} top_p {top_p}"
            );
        }
    }

    #[test]
    fn greedy_is_the_argmax_with_ties_to_the_lower_id() {
        for u in [0.0, 0.5, 1.0 - f64::EPSILON] {
            assert_eq!(sample_row(&[1.0, 3.0, -2.0, 3.0], 1.0, 1, 1.0, u), Some(1));
            assert_eq!(sample_row(&[1.0, 3.0, -2.0, 3.0], 0.5, 0, 1e-6, u), Some(1));
            assert_eq!(sample_row(&[-1.0, -0.0, 0.0], 1.0, 1, 1.0, u), Some(1));
            assert_eq!(sample_row(&[-1.0, 0.0, -0.0], 1.0, 1, 1.0, u), Some(1));
        }
        // The draw walks the kept tokens in id order: u = 0 takes the first.
        assert_eq!(sample_row(&[1.0, 3.0, -2.0, 3.0], 1.0, 0, 1.0, 0.0), Some(0));
        assert_eq!(sample_row(&[1.0, 3.0, -2.0, 3.0], 1.0, 2, 1.0, 0.0), Some(1));
        assert_eq!(sample_row(&[1.0, 3.0, -2.0, 3.0], 1.0, 2, 1.0, 0.999), Some(3));
    }

    #[test]
    fn bad_rows_give_none_and_tokens_of_no_mass_are_never_drawn() {
        for row in [&[1.0, f32::NAN][..], &[1.0, f32::INFINITY], &[NEG_INF, NEG_INF]] {
            assert_eq!(sample_row(row, 1.0, 0, 1.0, 0.5), None, "{row:?}");
            assert_eq!(sample_row(row, 1.0, 1, 0.5, 0.5), None, "{row:?}");
        }
        // Finite logits whose tempered value overflows to +inf.
        assert_eq!(sample_row(&[3e38, 1.0], 0.5, 0, 1.0, 0.5), None);
        let row = [NEG_INF, 0.0, NEG_INF, 1.0, -60.0, NEG_INF];
        for (top_k, top_p) in [(0, 1.0), (5, 1.0), (6, 0.99), (4, 1.0)] {
            assert_eq!(drawn(&row, 1.0, top_k, top_p, 10_000), [1, 3], "top_k {top_k}");
        }
        assert_eq!(drawn(&[NEG_INF, 2.0, NEG_INF], 1.0, 0, 1.0, 100), [1]);
    }

    #[test]
    fn rows_are_sampled_alone_and_bad_parameters_are_errors() {
        let mut rng = Rng::new(73);
        let (rows, vocab) = (9, 300);
        let logits = rng.vec(rows * vocab, 3.0);
        let uniforms: Vec<f64> = (0..rows).map(|_| uniform(&mut rng)).collect();
        let got = sample_rows(&logits, 0.8, 10, 0.9, &uniforms).unwrap();
        for (r, (row, &u)) in logits.chunks(vocab).zip(&uniforms).enumerate() {
            assert_eq!(got[r], sample_row(row, 0.8, 10, 0.9, u), "row {r}");
        }
        assert_eq!(sample_rows(&[], 1.0, 0, 1.0, &[]).unwrap(), []);
        let ok = |t: f32, p: f32, u: f64| sample_rows(&[0.0; 4], t, 0, p, &[u, 0.5]).is_ok();
        assert!(ok(1.0, 1.0, 0.0));
        for (t, p, u) in [
            (0.0, 1.0, 0.5),
            (f32::NAN, 1.0, 0.5),
            (f32::INFINITY, 1.0, 0.5),
            (1.0, 0.0, 0.5),
            (1.0, 1.5, 0.5),
            (1.0, f32::NAN, 0.5),
            (1.0, 1.0, 1.0),
            (1.0, 1.0, -0.1),
            (1.0, 1.0, f64::NAN),
        ] {
            assert!(!ok(t, p, u), "temperature {t} top_p {p} uniform {u}");
        }
        assert!(sample_rows(&[0.0; 5], 1.0, 0, 1.0, &[0.5, 0.5]).is_err());
    }
}
