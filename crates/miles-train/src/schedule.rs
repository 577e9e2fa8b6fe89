//! The learning-rate schedule, as Megatron's `OptimizerParamScheduler` computes it (with
//! `--lr-warmup-init` 0): linear warm-up, then constant, linear or cosine decay to `min_lr`.
//!
//! `step` is the number of optimizer steps already taken, so the first update runs at
//! `at(0)`; like Megatron, that is 0 when there is a warm-up (lr·step/warmup_iters for
//! step ≤ warmup_iters). After the warm-up:
//!
//! - `constant`: `lr` for ever (`min_lr` and `decay_iters` unused);
//! - `linear` / `cosine`: with progress p = (step − warmup_iters)/(decay_iters − warmup_iters),
//!   min_lr + (lr − min_lr)·(1 − p) or min_lr + (lr − min_lr)·½(1 + cos πp);
//! - past `decay_iters`: `min_lr`.
//!
//! `decay_iters` counts from step 0, warm-up included (Megatron's `--lr-decay-iters`). A
//! `decay_iters` at or below `warmup_iters` leaves no decay phase: `min_lr` right after the
//! warm-up.

use miles_core::config::{LrDecayStyle, RunConfig};

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    pub lr: f32,
    pub min_lr: f32,
    pub warmup_iters: usize,
    /// The step at which the decay reaches `min_lr`, counted from 0 (warm-up included).
    pub decay_iters: usize,
    pub style: LrDecayStyle,
}

impl LrSchedule {
    /// From `--lr`, `--min-lr`, `--lr-warmup-iters` and `--lr-decay-style`; the decay runs to
    /// `total_steps`, the number of optimizer steps of the run (Megatron's default for
    /// `--lr-decay-iters` is the training length).
    pub fn from_run_config(run: &RunConfig, total_steps: usize) -> Self {
        LrSchedule {
            lr: run.lr,
            min_lr: run.min_lr,
            warmup_iters: run.lr_warmup_iters,
            decay_iters: run.lr_decay_iters.unwrap_or(total_steps),
            style: run.lr_decay_style,
        }
    }

    /// The learning rate of the update that follows `step` optimizer steps.
    pub fn at(&self, step: usize) -> f32 {
        let (lr, min_lr) = (f64::from(self.lr), f64::from(self.min_lr));
        if self.warmup_iters > 0 && step <= self.warmup_iters {
            return (lr * step as f64 / self.warmup_iters as f64) as f32;
        }
        if self.style == LrDecayStyle::Constant {
            return self.lr;
        }
        if step > self.decay_iters {
            return self.min_lr;
        }
        // Here warmup_iters ≤ step ≤ decay_iters; the span is 0 only without a warm-up at
        // step 0 of a schedule that decays nothing, which starts at lr.
        let span = self.decay_iters - self.warmup_iters;
        let progress =
            if span == 0 { 0.0 } else { (step - self.warmup_iters) as f64 / span as f64 };
        let coefficient = match self.style {
            LrDecayStyle::Linear => 1.0 - progress,
            LrDecayStyle::Cosine => 0.5 * ((std::f64::consts::PI * progress).cos() + 1.0),
            LrDecayStyle::Constant => 1.0,
        };
        (min_lr + coefficient * (lr - min_lr)) as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(style: LrDecayStyle) -> LrSchedule {
        // Warm-up over 4 steps to 1e-3, decay to 1e-4 by step 14 (a 10-step decay phase).
        LrSchedule { lr: 1e-3, min_lr: 1e-4, warmup_iters: 4, decay_iters: 14, style }
    }

    fn near(actual: f32, expected: f64) {
        assert!((f64::from(actual) - expected).abs() < 1e-9, "{actual} vs {expected}");
    }

    #[test]
    fn warm_up_is_linear_from_zero() {
        for style in [LrDecayStyle::Constant, LrDecayStyle::Linear, LrDecayStyle::Cosine] {
            let s = schedule(style);
            // lr·step/4: 0, 2.5e-4, 5e-4, 7.5e-4, 1e-3.
            for (step, expected) in [(0, 0.0), (1, 2.5e-4), (2, 5e-4), (3, 7.5e-4), (4, 1e-3)] {
                near(s.at(step), expected);
            }
        }
        // No warm-up: the first update already runs at lr.
        let s = LrSchedule { warmup_iters: 0, ..schedule(LrDecayStyle::Linear) };
        near(s.at(0), 1e-3);
    }

    #[test]
    fn constant_ignores_min_lr_and_the_decay() {
        let s = schedule(LrDecayStyle::Constant);
        for step in [5, 14, 15, 1000] {
            near(s.at(step), 1e-3);
        }
    }

    #[test]
    fn linear_decays_to_min_lr() {
        // Step 9: progress (9 − 4)/10 = 0.5 → 1e-4 + 0.5·9e-4 = 5.5e-4; step 6: 0.2 → 8.2e-4.
        let s = schedule(LrDecayStyle::Linear);
        near(s.at(6), 8.2e-4);
        near(s.at(9), 5.5e-4);
        near(s.at(14), 1e-4);
    }

    #[test]
    fn cosine_decays_to_min_lr() {
        // Step 9: progress 0.5, ½(1 + cos π/2) = 0.5 → 5.5e-4; step 6: progress 0.2,
        // ½(1 + cos 0.2π) = ½(1 + 0.809017) = 0.904508 → 1e-4 + 0.904508·9e-4 = 9.14058e-4.
        let s = schedule(LrDecayStyle::Cosine);
        near(s.at(6), 1e-4 + 0.5 * (1.0 + (0.2 * std::f64::consts::PI).cos()) * 9e-4);
        near(s.at(9), 5.5e-4);
        near(s.at(14), 1e-4);
    }

    #[test]
    fn past_the_end_stays_at_min_lr() {
        for style in [LrDecayStyle::Linear, LrDecayStyle::Cosine] {
            let s = schedule(style);
            for step in [15, 16, 1_000_000] {
                near(s.at(step), 1e-4);
            }
            // No decay phase at all: min_lr straight after the warm-up.
            let s = LrSchedule { decay_iters: 4, ..s };
            near(s.at(4), 1e-3);
            near(s.at(5), 1e-4);
            let s = LrSchedule { warmup_iters: 0, decay_iters: 0, ..s };
            near(s.at(0), 1e-3);
            near(s.at(1), 1e-4);
        }
        // min_lr 0 decays to exactly 0.
        let s = LrSchedule { min_lr: 0.0, ..schedule(LrDecayStyle::Cosine) };
        assert_eq!(s.at(14), 0.0);
        assert_eq!(s.at(20), 0.0);
    }

    #[test]
    fn run_config_maps_to_the_schedule() {
        let run = RunConfig {
            lr: 2e-6,
            min_lr: 1e-7,
            lr_warmup_iters: 3,
            lr_decay_style: LrDecayStyle::Cosine,
            ..RunConfig::default()
        };
        let s = LrSchedule::from_run_config(&run, 100);
        assert_eq!(
            s,
            LrSchedule {
                lr: 2e-6,
                min_lr: 1e-7,
                warmup_iters: 3,
                decay_iters: 100,
                style: LrDecayStyle::Cosine
            }
        );
    }
}
