//! Drawing the next token: temperature, top-k and top-p, with a counter-based random number
//! per (seed, sample, step) so a sample's tokens never depend on its batch-mates, the batch
//! order or a preemption.

use std::cmp::Ordering;

/// A drawn token and its log-probability under the tempered distribution before any top-k /
/// top-p truncation, the number the trainer recomputes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Draw {
    pub token: u32,
    pub logprob: f32,
}

/// SplitMix64's finalizer: a bijective mix of 64 bits.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A uniform number in [0, 1) that is a pure function of its three arguments.
pub fn uniform(seed: u64, sample: u64, step: u64) -> f64 {
    let h = mix(mix(mix(seed) ^ sample) ^ step);
    (h >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// Higher logit first; ties by lower token id (a total order, so sorting is deterministic).
fn by_logit(a: &(f32, u32), b: &(f32, u32)) -> Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

/// The first candidate whose running probability mass passes `target`, scanning in order; the
/// last candidate with mass when rounding leaves the total just short of it.
fn inverse_cdf(candidates: impl Iterator<Item = (u32, f64)>, target: f64) -> Option<u32> {
    let mut cum = 0.0;
    let mut last = None;
    for (token, p) in candidates {
        if p <= 0.0 {
            continue;
        }
        cum += p;
        last = Some(token);
        if cum > target {
            break;
        }
    }
    last
}

/// Draws from `z`, the logits already divided by the temperature, and `lse`, their log-sum-exp
/// from [`miles_tensor::cpu::tempered_log_softmax`] (a NaN logit makes it NaN). `top_k == 0`
/// and `top_p >= 1` disable truncation; top-k applies first, then top-p on the renormalized
/// remainder (SGLang's order). `None` when the logits are not finite.
pub fn sample(z: &[f32], lse: f32, top_k: usize, top_p: f32, u: f64) -> Option<Draw> {
    if !lse.is_finite() {
        return None;
    }
    let prob = |x: f32| f64::from((x - lse).exp());
    let token = if (top_k == 0 || top_k >= z.len()) && top_p >= 1.0 {
        // The full distribution sums to 1 (to rounding): one pass, stopping at the draw.
        inverse_cdf(z.iter().enumerate().map(|(i, &x)| (i as u32, prob(x))), u)?
    } else {
        let mut cand: Vec<(f32, u32)> = z.iter().enumerate().map(|(i, &x)| (x, i as u32)).collect();
        if top_k > 0 && top_k < cand.len() {
            cand.select_nth_unstable_by(top_k - 1, by_logit);
            cand.truncate(top_k);
        }
        cand.sort_unstable_by(by_logit);
        let probs: Vec<f64> = cand.iter().map(|&(x, _)| prob(x)).collect();
        let total: f64 = probs.iter().sum();
        // Keep a token while the mass before it is within top_p (the first always stays).
        let mut keep = 0;
        let mut before = 0.0;
        while keep < cand.len() && (keep == 0 || before <= f64::from(top_p) * total) {
            before += probs[keep];
            keep += 1;
        }
        let kept = cand[..keep].iter().zip(&probs).map(|(&(_, t), &p)| (t, p));
        inverse_cdf(kept, u * before)?
    };
    Some(Draw { token, logprob: z[token as usize] - lse })
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_tensor::cpu::tempered_log_softmax;

    fn tempered(logits: &[f32], t: f32) -> (Vec<f32>, f32) {
        let mut z = logits.to_vec();
        let lse = tempered_log_softmax(&mut z, t);
        (z, lse)
    }

    #[test]
    fn uniform_is_a_pure_function_and_spread_out() {
        assert_eq!(uniform(1, 2, 3), uniform(1, 2, 3));
        assert_ne!(uniform(1, 2, 3), uniform(1, 3, 2));
        let draws: Vec<f64> = (0..10_000).map(|s| uniform(7, s, 0)).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        let mean = draws.iter().sum::<f64>() / draws.len() as f64;
        assert!((mean - 0.5).abs() < 0.02, "{mean}");
        let low = draws.iter().filter(|&&u| u < 0.1).count();
        assert!((800..1200).contains(&low), "{low}");
    }

    #[test]
    fn frequencies_follow_the_tempered_distribution() {
        let logits = [1.0f32, 2.0, 0.5, -1.0];
        let (z, lse) = tempered(&logits, 0.8);
        let mut counts = [0usize; 4];
        let n = 40_000;
        for s in 0..n {
            let d = sample(&z, lse, 0, 1.0, uniform(3, s, 0)).unwrap();
            assert_eq!(d.logprob, z[d.token as usize] - lse);
            counts[d.token as usize] += 1;
        }
        for (i, c) in counts.iter().enumerate() {
            let p = f64::from(z[i] - lse).exp();
            let f = *c as f64 / n as f64;
            assert!((f - p).abs() < 0.01, "token {i}: {f} vs {p}");
        }
    }

    #[test]
    fn top_k_and_top_p_truncate_but_logprobs_stay_untruncated() {
        let logits = [3.0f32, 2.9, 0.0, 2.0, -5.0];
        let (z, lse) = tempered(&logits, 1.0);
        // Greedy is top-k 1.
        for s in 0..50 {
            let d = sample(&z, lse, 1, 1.0, uniform(0, s, 0)).unwrap();
            assert_eq!(d.token, 0);
            assert_eq!(d.logprob, z[0] - lse);
            assert!(d.logprob < 0.0);
        }
        let seen = |k, p| {
            let mut s: Vec<u32> =
                (0..2000).map(|i| sample(&z, lse, k, p, uniform(1, i, 0)).unwrap().token).collect();
            s.sort();
            s.dedup();
            s
        };
        assert_eq!(seen(2, 1.0), vec![0, 1]);
        // p(0) ≈ 0.45, p(1) ≈ 0.41: top-p 0.5 keeps the first two (mass before token 1 is 0.45).
        assert_eq!(seen(0, 0.5), vec![0, 1]);
        assert_eq!(seen(0, 0.3), vec![0]);
        assert_eq!(seen(3, 0.999), vec![0, 1, 3]);
    }

    #[test]
    fn ties_and_bad_logits() {
        let (z, lse) = tempered(&[1.0, 1.0, 1.0], 1.0);
        assert_eq!(sample(&z, lse, 1, 1.0, 0.99).unwrap().token, 0);
        let (z, lse) = tempered(&[0.0, f32::NAN], 1.0);
        assert!(sample(&z, lse, 0, 1.0, 0.5).is_none());
        assert!(sample(&z, lse, 3, 0.9, 0.5).is_none());
        assert!(sample(&[0.0, 1.0], f32::INFINITY, 0, 1.0, 0.5).is_none());
    }
}
