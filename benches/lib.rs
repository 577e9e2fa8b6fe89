//! Inputs shared by the benchmarks: seeded pseudo-random data, never zeros.

/// SplitMix64: a tiny seeded generator, so benchmark inputs are the same on every run.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
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
}

/// Per-token logprobs of a batch as a trainer and a rollout engine would report them: rollout
/// logprobs in [-8, 0), train logprobs off by a small mismatch, about 10% of tokens masked.
pub struct LogprobBatch {
    pub train: Vec<f32>,
    pub rollout: Vec<f32>,
    pub mask: Vec<u8>,
    pub lengths: Vec<usize>,
}

impl LogprobBatch {
    pub fn new(sequences: usize, tokens_per_sequence: usize, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let n = sequences * tokens_per_sequence;
        let rollout: Vec<f32> = (0..n).map(|_| rng.uniform(-8.0, 0.0)).collect();
        let train = rollout.iter().map(|r| r + rng.uniform(-0.3, 0.3)).collect();
        let mask = (0..n).map(|_| u8::from(rng.uniform(0.0, 1.0) > 0.1)).collect();
        LogprobBatch { train, rollout, mask, lengths: vec![tokens_per_sequence; sequences] }
    }
}
