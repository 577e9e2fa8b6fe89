//! The per-epoch order of a shuffled data source: a Fisher–Yates shuffle driven by splitmix64,
//! seeded from (seed, epoch) alone. Everything is integer arithmetic on u64, so the order is the
//! same on every platform and after any resume, and it must never change between versions:
//! `the_order_is_pinned` guards it.

/// Sebastiano Vigna's splitmix64: tiny, fast, and good enough to shuffle prompts.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix64(self.0)
    }

    /// Uniform in `0..bound` (`bound > 0`), without modulo bias: Lemire's multiply-and-reject.
    fn below(&mut self, bound: u64) -> u64 {
        let mut wide = u128::from(self.next_u64()) * u128::from(bound);
        if (wide as u64) < bound {
            let threshold = bound.wrapping_neg() % bound;
            while (wide as u64) < threshold {
                wide = u128::from(self.next_u64()) * u128::from(bound);
            }
        }
        (wide >> 64) as u64
    }
}

/// splitmix64's output function, a bijection on u64.
fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The row order of `epoch`: `0..len` shuffled by (seed, epoch). Each epoch starts again from
/// `0..len`, so an epoch's order never depends on the epochs before it.
pub(crate) fn permutation(len: usize, seed: u64, epoch: u64) -> Vec<usize> {
    // Mixing the seed first keeps (seed, epoch) and (seed + 1, epoch - 1) apart.
    let mut rng = SplitMix64(mix64(seed) ^ epoch);
    let mut order: Vec<usize> = (0..len).collect();
    for i in (1..len).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        order.swap(i, j);
    }
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_order_is_pinned() {
        // Changing these numbers changes what every resumed run draws: don't.
        assert_eq!(permutation(10, 42, 0), [2, 3, 6, 4, 7, 9, 0, 8, 1, 5]);
        assert_eq!(permutation(10, 42, 1), [8, 1, 9, 4, 3, 5, 0, 6, 7, 2]);
        assert_eq!(SplitMix64(0).next_u64(), 0xE220_A839_7B1D_CDAF, "splitmix64 reference value");
    }

    #[test]
    fn below_stays_below_and_covers_the_range() {
        let mut rng = SplitMix64(7);
        let mut seen = [0usize; 3];
        for _ in 0..3000 {
            seen[rng.below(3) as usize] += 1;
        }
        assert!(seen.iter().all(|&n| (900..1100).contains(&n)), "{seen:?}");
        assert_eq!(rng.below(1), 0);
    }

    #[test]
    fn tiny_lengths() {
        assert!(permutation(0, 1, 0).is_empty());
        assert_eq!(permutation(1, 1, 5), [0]);
    }
}
