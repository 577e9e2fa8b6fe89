//! The rollout's randomness: a counter-based uniform number per (seed, sample, step), so a
//! sample's tokens never depend on its batch-mates, the batch order or a preemption. The draw
//! itself (temperature, top-k, top-p) is [`miles_tensor::cpu::sample_row`] on the CPU and its
//! CUDA twin on the device: one definition, checked against each other.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
