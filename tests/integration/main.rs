//! The one integration-test binary of miles-rs.

mod binary;
mod dynamic_plugins;
mod gguf;
mod hf_parity;
mod model_cli;
mod registry;
mod reward_cmd;
mod rollout;
mod serve;
mod slime_conformance;
#[cfg(feature = "eagle-spec")]
mod speculative;
mod train;
