//! Training: the optimizer over a model's weights (this round), then losses, schedules,
//! checkpoints and the loop.

mod optimizer;

pub use optimizer::{Optimizer, StepStats};
