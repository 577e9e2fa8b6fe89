use std::collections::BTreeMap;

use crate::Result;

/// Per-token inputs of an off-policy correction, packed over the sequences of a batch: the
/// token slices are the response tokens of each sequence, one after the other, and
/// `response_lengths` says where each sequence ends.
#[derive(Debug, Clone, Copy)]
pub struct CorrectionInput<'a> {
    /// log p(token) under the policy being trained (the trainer's old logprobs).
    pub train_log_probs: &'a [f32],
    /// log p(token) under the rollout engine that sampled it.
    pub rollout_log_probs: &'a [f32],
    pub loss_mask: &'a [u8],
    pub response_lengths: &'a [usize],
}

impl CorrectionInput<'_> {
    /// Checks that the slices agree with each other; every implementation calls this first.
    pub fn validate(&self) -> Result<()> {
        let n = self.train_log_probs.len();
        let total: usize = self.response_lengths.iter().sum();
        if self.rollout_log_probs.len() != n || self.loss_mask.len() != n || total != n {
            return Err(crate::Error::Invalid(format!(
                "correction input: {} train logprobs, {} rollout logprobs, {} mask entries and \
                 response lengths summing to {total} must all agree",
                n,
                self.rollout_log_probs.len(),
                self.loss_mask.len()
            )));
        }
        Ok(())
    }
}

/// The result: a weight per token that multiplies the policy-gradient term (constants: they
/// carry no gradient), the mask to apply in the loss numerator (tokens or whole sequences may
/// be dropped; aggregation keeps the input mask's denominators), and metrics by name: for
/// each sequence, in order, the sum of the metric over its input loss-mask tokens (a metric
/// with one value per sequence counts it once per such token). The trainer divides them like
/// the loss (slime's `sum_of_sample_mean`), so no per-token arrays cross the boundary.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CorrectionOutput {
    pub weights: Vec<f32>,
    pub loss_mask: Vec<u8>,
    pub metrics: BTreeMap<String, Vec<f64>>,
}

/// Off-policy correction of the loss for the gap between the rollout engine's distribution and
/// the trainer's: truncated and masked importance sampling (TIS/MIS) and their relatives. The
/// metric names it reports depend on its configuration only, not on the batch (a process
/// without samples in a run over several learns them from a one-token sequence).
pub trait Correction: Send + Sync {
    fn correct(&self, input: &CorrectionInput<'_>) -> Result<CorrectionOutput>;

    /// [`Correction::correct`] on one process's part of a batch spread over several:
    /// `batch_sum` turns sums over this part into sums over the whole batch (in place), for
    /// what a correction takes over the whole batch (TIS's batch normalization). The default,
    /// for corrections that look at each sequence alone, is `correct`.
    fn correct_part(
        &self,
        input: &CorrectionInput<'_>,
        batch_sum: &mut dyn FnMut(&mut [f64]) -> Result<()>,
    ) -> Result<CorrectionOutput> {
        let _ = batch_sum;
        self.correct(input)
    }
}
