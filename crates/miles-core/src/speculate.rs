//! Speculative rollouts' rule (the `eagle-spec` plugin): how many tokens the draft proposes per
//! verification, and which of them a verification keeps. The engine drafts and verifies on
//! its device; this is the host definition of the keep-or-replace rule it applies.

use crate::Result;

/// A speculative decoding scheme.
pub trait Speculator: Send + Sync + std::fmt::Debug {
    /// Draft tokens proposed per sequence and verification (SGLang's
    /// `--speculative-num-steps`).
    fn num_steps(&self) -> usize;

    /// The tokens one verification keeps: `p` holds the policy's distributions at the k + 1
    /// positions after a sequence's newest token (integer masses, as its sampler draws from
    /// them), `q` the draft's k distributions and `drafts` the k tokens drawn from them;
    /// `uniforms` one (accept, draw) pair in [0, 1) per position. The kept drafts (a prefix)
    /// then one token of the policy's own: distributed exactly as the policy's draws.
    fn verify(
        &self,
        p: &[Vec<u64>],
        q: &[Vec<u64>],
        drafts: &[u32],
        uniforms: &[(f64, f64)],
    ) -> Result<Vec<u32>>;
}
