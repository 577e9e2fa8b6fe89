use serde::{Deserialize, Serialize};

use crate::{Result, Sample};

/// How the rollout engine samples. Field names follow SGLang's sampling parameters; the driver
/// fills them from the `--rollout-*` flags.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Nucleus sampling; 1.0 disables it.
    pub top_p: f32,
    /// Keep the k most likely tokens; 0 disables it.
    pub top_k: usize,
    pub max_new_tokens: usize,
    /// Generation stops after any of these strings; the string is kept in the response.
    pub stop: Vec<String>,
    /// Generation stops after any of these token ids (in addition to the model's EOS).
    pub stop_token_ids: Vec<u32>,
    /// Keep generating after EOS (benchmarks that need a fixed length).
    pub ignore_eos: bool,
    /// Seed of the per-sample counter-based RNG: a sample's draws depend on (seed, sample
    /// index, position) only, never on its batch-mates. A training loop derives it per rollout
    /// (seed and rollout id) so that successive rollouts do not repeat their draws.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            max_new_tokens: 1024,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            seed: 42,
        }
    }
}

/// Turns prompt groups into responses.
///
/// Input: groups of `Pending` samples (one group per prompt, `n_samples_per_prompt` samples each,
/// `prompt` and `tokens` holding the prompt) or `Aborted` ones to continue (partial rollout).
/// Output: the same groups with `tokens` extended by the response, `response`,
/// `response_length`, `loss_mask`, `rollout_log_probs`, `status` and, for MoE models,
/// `rollout_routed_experts` filled in. Groups keep their order; a sample the engine could not
/// finish comes back `Failed` rather than as an error, which is reserved for the engine itself
/// failing.
pub trait Rollout: Send {
    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Sample>>>;

    /// [`Rollout::generate`], handing each group to `on_group` (its index in `groups`, its
    /// samples) as soon as it is complete. When `on_group` answers [`Flow::Abort`], the engine
    /// stops at once (dynamic sampling has kept enough groups): the groups not complete come
    /// back with their unfinished samples `Aborted`, holding the tokens and logprobs generated
    /// so far (to continue later: partial rollout). An engine that cannot stream reports the
    /// groups after generating them all (this default).
    fn generate_until(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
        on_group: &mut dyn FnMut(usize, &[Sample]) -> Flow,
    ) -> Result<Vec<Vec<Sample>>> {
        let out = self.generate(groups, params)?;
        for (g, group) in out.iter().enumerate() {
            if on_group(g, group) == Flow::Abort {
                break;
            }
        }
        Ok(out)
    }

    /// The policy version that samples generated from now on carry in `weight_version` (the
    /// loop's count of weight syncs).
    fn set_weight_version(&mut self, version: u64);
}

/// A rollout borrowed or boxed rolls out as itself.
macro_rules! forward_rollout {
    ($ty:ty) => {
        impl<R: Rollout + ?Sized> Rollout for $ty {
            fn generate(
                &mut self,
                groups: Vec<Vec<Sample>>,
                params: &SamplingParams,
            ) -> Result<Vec<Vec<Sample>>> {
                (**self).generate(groups, params)
            }

            fn generate_until(
                &mut self,
                groups: Vec<Vec<Sample>>,
                params: &SamplingParams,
                on_group: &mut dyn FnMut(usize, &[Sample]) -> Flow,
            ) -> Result<Vec<Vec<Sample>>> {
                (**self).generate_until(groups, params, on_group)
            }

            fn set_weight_version(&mut self, version: u64) {
                (**self).set_weight_version(version)
            }
        }
    };
}
forward_rollout!(&mut R);
forward_rollout!(Box<R>);

/// A caller's answer to the engine after a step or a completed group.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// Stop generating: the requests still running are aborted (their KV blocks freed).
    Abort,
}
