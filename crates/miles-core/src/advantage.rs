use crate::Result;

/// What an advantage estimator sees of one scored sample.
#[derive(Debug, Clone, Copy)]
pub struct SequenceScore<'a> {
    /// The scalar reward the run trains on.
    pub reward: f32,
    /// One entry per response token (1 = trained on).
    pub loss_mask: &'a [u8],
    /// Per-token KL(policy ‖ reference) for reward shaping (`--kl-coef`), when computed.
    pub kl: Option<&'a [f32]>,
    /// Per-token value estimates of a critic (PPO/GAE), when there is one.
    pub values: Option<&'a [f32]>,
}

/// Per-token advantages (and, for estimators with a critic, returns), shaped like the input:
/// `[group][sample][response token]`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdvantageOutput {
    pub advantages: Vec<Vec<Vec<f32>>>,
    pub returns: Option<Vec<Vec<Vec<f32>>>>,
}

/// Turns a batch of scored groups into per-token advantages: GRPO, GSPO, REINFORCE++, RLOO,
/// PPO/GAE… Group-relative estimators use the group structure; the others may ignore it.
pub trait Advantage: Send + Sync {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput>;

    /// Whether [`Advantage::compute`] ends by whitening the advantages over every sample it is
    /// given (REINFORCE++). A trainer whose batch is spread over several processes then calls
    /// [`Advantage::compute_unwhitened`] on its part and whitens over the whole batch itself.
    fn whitens_batch(&self) -> bool {
        false
    }

    /// [`Advantage::compute`] without its last batch whitening (the same for the others).
    fn compute_unwhitened(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        self.compute(groups)
    }
}
