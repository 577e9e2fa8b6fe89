//! The embedded rollout engine: the policy's own forward, in-process, turning prompt groups
//! into responses with the logprobs of the sampled tokens.
//!
//! - [`Engine`]: continuous batching (a finished sequence leaves and a waiting one joins at
//!   the next step) over a paged KV cache whose size the configuration bounds; the samples of
//!   one prompt share its prefill and its full blocks. One scheduler over a [`Policy`]: the KV
//!   cache's storage on the model's device (the CPU or a GPU). The model is lent per call, so
//!   the trainer that owns it steps the very weights the rollouts read;
//!   [`Engine::lend`] gives the [`miles_core::Rollout`] the loop drives.
//! - Sampling draws with temperature, top-k and top-p ([`miles_tensor::cpu::sample_row`], and
//!   its CUDA twin) from a counter-based random number per (seed, sample index, response
//!   position) ([`sampler::uniform`]).
//! - `rollout_log_probs` are log softmax(logits / T) of the drawn tokens, computed by the same
//!   batch-invariant kernels as `DeviceModel::logprobs`: equal to the trainer's bit for bit.

mod blocks;
#[cfg(test)]
mod device_tests;
mod engine;
mod policy;
pub mod remote;
pub mod sampler;

pub use engine::{
    Engine, EngineConfig, EngineStats, Job, Lent, Progress, Reply, Request, SpecPhases,
};
pub(crate) use miles_core::{Error, Result};
pub use policy::{Policy, kv_cache_budget};
