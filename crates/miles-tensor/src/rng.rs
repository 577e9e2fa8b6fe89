//! A seeded generator for weight initialization, tests and benchmarks.

/// SplitMix64: a tiny seeded generator, so initializations and test inputs are the same on every run.
#[derive(Debug, Clone)]
pub struct Rng(u64);

/// SplitMix64's increment: the state after n draws is the seed plus n of these.
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GOLDEN);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }

    /// Approximately standard normal (sum of 4 uniforms, rescaled): cheap and never constant.
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform(-1.0, 1.0)).sum();
        s * (3.0f32 / 4.0).sqrt()
    }

    /// `n` normals times `scale`: the values `n` calls of [`Rng::normal`] give, drawn in
    /// parallel (each chunk starts from the state its first draw would see), so that a model
    /// of billions of parameters initializes in seconds.
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        use rayon::prelude::*;
        const CHUNK: usize = 1 << 16;
        // Four draws a normal.
        let state_after =
            |values: usize| self.0.wrapping_add((4 * values as u64).wrapping_mul(GOLDEN));
        let starts: Vec<u64> = (0..n.div_ceil(CHUNK)).map(|i| state_after(i * CHUNK)).collect();
        let mut out = vec![0.0; n];
        out.par_chunks_mut(CHUNK).zip(starts).for_each(|(chunk, start)| {
            let mut rng = Rng(start);
            chunk.iter_mut().for_each(|v| *v = rng.normal() * scale);
        });
        self.0 = state_after(n);
        out
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

#[cfg(test)]
mod tests {
    use super::Rng;

    #[test]
    fn parallel_vectors_are_the_sequential_draws() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        let n = 3 * (1 << 16) + 5;
        let fast = a.vec(n, 0.5);
        let slow: Vec<f32> = (0..n).map(|_| b.normal() * 0.5).collect();
        assert!(fast.iter().zip(&slow).all(|(x, y)| x.to_bits() == y.to_bits()));
        assert_eq!(a.next_u64(), b.next_u64(), "the state after the vector");
    }
}
