//! The vocabulary every other crate of miles-rs shares: what a sample is, the plugin traits that
//! one RL step runs through, the registry that plugin crates add themselves to, and the run
//! configuration. Nothing here computes: tensors and kernels live in `miles-tensor`.
//!
//! One RL step, as data flows (see `docs/ARCHITECTURE.md`):
//! prompts → [`Rollout`] → [`Reward`] → filters → [`Advantage`] → trainer (loss, [`Correction`],
//! [`RoutingReplay`] for MoE, optimizer) → weight sync ([`Quantizer`] for low-precision rollout)
//! → back to [`Rollout`].

mod advantage;
pub mod config;
mod correction;
mod error;
pub mod quantizer;
pub mod registry;
mod replay;
mod reward;
mod rollout;
mod sample;
mod speculate;

pub use advantage::{Advantage, AdvantageOutput, SequenceScore};
pub use correction::{Correction, CorrectionInput, CorrectionOutput};
pub use error::{Error, Result};
pub use quantizer::{QuantFormat, Quantized, Quantizer, WeightView};
pub use registry::{Factory, Plugin, PluginConfig, PluginKind, Registration};
pub use replay::{ROUTER_CHOOSES, RoutingReplay};
pub use reward::{Reward, RewardError, RewardValue};
pub use rollout::{Flow, Rollout, SamplingParams};
pub use sample::{Message, Prompt, RoutedExperts, Sample, Status};
pub use speculate::Speculator;

/// Re-exported so plugin crates register with the same `inventory` this crate collects from.
pub use inventory;
