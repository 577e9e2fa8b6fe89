//! The one integration-test binary of miles-rs.

mod binary;
mod dynamic_plugins;
mod registry;
mod reward_cmd;
