//! Training: the algorithm layer (advantages, losses, schedules: host math over per-token
//! slices), the optimizer, checkpoints and the RL loop.

pub mod advantage;
pub mod batch;
pub mod checkpoint;
mod dist;
pub mod loss;
mod optimizer;
pub mod rl;
pub mod schedule;

pub use optimizer::{Optimizer, StepStats};
