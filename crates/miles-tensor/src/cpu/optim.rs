//! AdamW with f32 master weights, and global-norm gradient clipping.

use rayon::prelude::*;

use crate::{Result, ensure};

/// AdamW hyper-parameters, PyTorch's semantics: decoupled weight decay applied to the weights
/// before the Adam update, bias-corrected moments.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamW {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

impl AdamW {
    /// `(lr / (1 − β1^t), sqrt(1 − β2^t), 1 − lr·weight_decay)` of step `t`, in f64 and then
    /// rounded once: every device updates with these same constants.
    pub fn step_constants(&self, step: u64) -> (f32, f32, f32) {
        let bc1 = 1.0 - f64::from(self.beta1).powf(step as f64);
        let bc2 = 1.0 - f64::from(self.beta2).powf(step as f64);
        let step_size = (f64::from(self.lr) / bc1) as f32;
        (step_size, bc2.sqrt() as f32, 1.0 - self.lr * self.weight_decay)
    }

    /// One update of `param` with `grad`; `m` and `v` are its moments; `step` counts from 1.
    pub fn step(
        &self,
        param: &mut [f32],
        grad: &[f32],
        m: &mut [f32],
        v: &mut [f32],
        step: u64,
    ) -> Result<()> {
        let n = param.len();
        ensure(grad.len() == n && m.len() == n && v.len() == n && step >= 1, "adamw", || {
            format!("param {n} grad {} m {} v {} step {step}", grad.len(), m.len(), v.len())
        })?;
        let AdamW { beta1, beta2, eps, .. } = *self;
        let (step_size, bc2_sqrt, decay) = self.step_constants(step);
        const C: usize = 16_384;
        param
            .par_chunks_mut(C)
            .zip(grad.par_chunks(C))
            .zip(m.par_chunks_mut(C).zip(v.par_chunks_mut(C)))
            .for_each(|((p, g), (m, v))| {
                for i in 0..p.len() {
                    m[i] = beta1 * m[i] + (1.0 - beta1) * g[i];
                    v[i] = beta2 * v[i] + (1.0 - beta2) * g[i] * g[i];
                    let denom = v[i].sqrt() / bc2_sqrt + eps;
                    p[i] = p[i] * decay - step_size * m[i] / denom;
                }
            });
        Ok(())
    }
}

/// The 16 random bits that round element `i` of the tensor keyed `key` at optimizer step
/// `step` (SplitMix64's finalizer over the three): a counter, not a stream, so every device
/// draws the same bits for the same element and a resumed run the same as a straight one.
pub fn rounding_bits(key: u64, step: u64, i: u64) -> u32 {
    let mut z = key.wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ step.wrapping_mul(0xBF58_476D_1CE4_E5B9)
        ^ i.wrapping_mul(0x94D0_49BB_1331_11EB);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    ((z ^ (z >> 31)) & 0xffff) as u32
}

/// `x` rounded to a bf16 value stochastically with the random bits `r` (< 2¹⁶): away from zero
/// with probability equal to the share of a bf16 step that truncation would drop, so the
/// rounding is unbiased and updates smaller than a step still move the weight on average.
/// Not-finite values round to nearest.
pub fn round_bf16_stochastic(x: f32, r: u32) -> half::bf16 {
    if !x.is_finite() {
        return half::bf16::from_f32(x);
    }
    half::bf16::from_bits((x.to_bits().wrapping_add(r & 0xffff) >> 16) as u16)
}

/// The L2 norm of all gradients together, summed tensor by tensor in order (in f64).
pub fn global_norm(grads: &[&[f32]]) -> f64 {
    grads.iter().map(|g| sum_squares(g)).sum::<f64>().sqrt()
}

/// Σ x² in f64, in index order: one tensor's share of [`global_norm`]'s square.
pub fn sum_squares(g: &[f32]) -> f64 {
    g.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>()
}

/// The factor to multiply gradients by so their global norm is at most `max_norm`
/// (Megatron's `max_norm / (norm + 1e-6)`, capped at 1); 1 when clipping is off (`max_norm` 0).
pub fn clip_scale(norm: f64, max_norm: f64) -> f32 {
    if max_norm <= 0.0 {
        return 1.0;
    }
    (max_norm / (norm + 1e-6)).min(1.0) as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adamw_matches_hand_computed_steps() {
        let opt = AdamW { lr: 0.1, beta1: 0.9, beta2: 0.99, eps: 1e-8, weight_decay: 0.5 };
        let (mut p, mut m, mut v) = (vec![1.0f32, -2.0], vec![0.0; 2], vec![0.0; 2]);
        opt.step(&mut p, &[0.5, -1.0], &mut m, &mut v, 1).unwrap();
        // Step 1: m̂ = g, v̂ = g², so the update is lr·sign(g); decay multiplies by 1 − 0.05.
        assert!((p[0] - (0.95 - 0.1)).abs() < 1e-6, "{p:?}");
        assert!((p[1] - (-1.9 + 0.1)).abs() < 1e-6, "{p:?}");
        opt.step(&mut p, &[0.5, 0.0], &mut m, &mut v, 2).unwrap();
        // Step 2, first weight: m = 0.095, v = 0.0049975; m̂ = 0.5, v̂ = 0.25.
        let want = 0.85 * 0.95 - 0.1 * 0.5 / (0.25f32.sqrt() + 1e-8);
        assert!((p[0] - want).abs() < 1e-6, "{} vs {want}", p[0]);
        // Second weight: m = 0.9·(−0.1) = −0.09 → m̂ = −0.09/0.19; v = 0.99·0.01 → v̂ = 0.0099/0.0199.
        let want = -1.8 * 0.95 + 0.1 * (0.09 / 0.19) / ((0.0099f32 / 0.0199).sqrt() + 1e-8);
        assert!((p[1] - want).abs() < 1e-5, "{} vs {want}", p[1]);
        assert!(opt.step(&mut p, &[0.0], &mut m, &mut v, 3).is_err());
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let norm = global_norm(&[&[3.0], &[4.0, 0.0]]);
        assert_eq!(norm, 5.0);
        assert!((f64::from(clip_scale(norm, 1.0)) - 1.0 / (5.0 + 1e-6)).abs() < 1e-7);
        assert_eq!(clip_scale(norm, 10.0), 1.0);
        assert_eq!(clip_scale(norm, 0.0), 1.0);
    }
}

#[cfg(test)]
mod rounding_tests {
    use super::*;

    /// Unbiased: the mean of many roundings of one value is the value; each rounding is one
    /// of its two bf16 neighbours; bf16 values and not-finite ones stay as they are.
    #[test]
    fn stochastic_rounding_is_unbiased_between_neighbours() {
        for x in [1.0f32 + 1.0 / 1024.0, -3.3071, 1e-3, 7.25e5] {
            let down = half::bf16::from_bits((x.to_bits() >> 16) as u16).to_f32();
            let up = half::bf16::from_bits(((x.to_bits() >> 16) + 1) as u16).to_f32();
            let n = 20_000u64;
            let mut sum = 0.0f64;
            for i in 0..n {
                let y = round_bf16_stochastic(x, rounding_bits(7, 3, i)).to_f32();
                assert!(y == down || y == up, "{x}: {y} outside {down}..{up}");
                sum += f64::from(y);
            }
            let step = f64::from((up - down).abs());
            let err = (sum / n as f64 - f64::from(x)).abs() / step;
            assert!(err < 0.02, "{x}: mean off by {err} of a step");
        }
        for x in [1.0f32, -2.5, 0.0, f32::INFINITY] {
            assert_eq!(round_bf16_stochastic(x, 0xffff).to_f32(), x);
        }
        assert!(round_bf16_stochastic(f32::NAN, 5).is_nan());
        assert_ne!(rounding_bits(1, 2, 3), rounding_bits(1, 2, 4));
        assert_ne!(rounding_bits(1, 2, 3), rounding_bits(1, 3, 3));
    }
}
