//! Inputs shared by the benchmarks: seeded pseudo-random data, never zeros.

pub use miles_tensor::rng::Rng;

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
