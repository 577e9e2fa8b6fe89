//! TIS/MIS: importance weights that correct the policy gradient for the gap between the
//! distribution the rollout engine sampled from and the one the trainer computes.
//!
//! With r = exp(logp_train − logp_rollout) per token, a weight covers one token (`token`), a
//! whole sequence with r_seq = exp(Σ log r) (`sequence`), or the geometric mean
//! exp(mean log r) (`geometric`); sums and means run over the tokens the loss mask keeps. Then:
//!
//! - `truncate`: w = clamp(r, lower, upper) (classic TIS; lower 0 makes it one-sided);
//! - `clip`: w = r inside [lower, upper] and 0 outside; the token keeps its place in the loss
//!   mask (KL and entropy terms still see it);
//! - `mask` (MIS): w = r inside, and tokens (or sequences) outside leave the loss mask; the
//!   loss keeps the input mask's denominators, so dropping tokens does not rescale the rest.
//!
//! The veto drops a whole sequence whose any kept token has r below `veto_threshold`.
//! `batch_normalize` rescales the surviving weights to mean 1 (over tokens, or over sequences
//! for the sequence levels). Weights are constants of the loss: no gradient flows through them.

use std::collections::BTreeMap;

use miles_core::config::{TisLevel, TisMode};
use miles_core::{
    Correction, CorrectionInput, CorrectionOutput, Error, Factory, Plugin, Registration, Result,
};
use serde::Deserialize;

/// exp() of log-ratios beyond this is clamped, so one wild token cannot produce inf or NaN.
const LOG_RATIO_SAFETY_BOUND: f64 = 20.0;

pub static PLUGIN: Plugin = Plugin {
    name: "tis",
    version: env!("CARGO_PKG_VERSION"),
    description: "truncated/masked importance sampling (token, sequence, geometric)",
    factory: Factory::Correction(|config| Ok(Box::new(Tis::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// The plugin's configuration; the driver builds it from `--tis-*` (`RunConfig::tis_config`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TisConfig {
    pub level: TisLevel,
    pub mode: TisMode,
    pub upper: f32,
    pub lower: f32,
    pub veto_threshold: Option<f32>,
    pub batch_normalize: bool,
}

impl Default for TisConfig {
    fn default() -> Self {
        TisConfig {
            level: TisLevel::Token,
            mode: TisMode::Truncate,
            upper: 2.0,
            lower: 0.0,
            veto_threshold: None,
            batch_normalize: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Tis {
    config: TisConfig,
}

impl Tis {
    pub fn new(config: TisConfig) -> Result<Self> {
        let c = &config;
        // Written so that NaN fails every check.
        let upper_ok = c.upper.is_finite() && c.upper > 0.0;
        if !upper_ok {
            return Err(Error::config("tis-clip", format!("upper bound {} must be > 0", c.upper)));
        }
        let lower_ok = c.lower >= 0.0 && c.lower < c.upper;
        if !lower_ok {
            return Err(Error::config(
                "tis-clip-low",
                format!("lower bound {} must be in [0, upper {})", c.lower, c.upper),
            ));
        }
        if let Some(v) = c.veto_threshold.filter(|v| v.is_nan() || *v <= 0.0) {
            return Err(Error::config("tis-veto-threshold", format!("{v} must be > 0")));
        }
        Ok(Tis { config })
    }

    pub fn from_config(config: &serde_json::Value) -> Result<Self> {
        let config = if config.is_null() {
            TisConfig::default()
        } else {
            TisConfig::deserialize(config)
                .map_err(|e| Error::Plugin(format!("tis plugin configuration: {e}")))?
        };
        Tis::new(config)
    }
}

/// Running totals for the metrics; every fraction is over the tokens the input mask keeps.
#[derive(Default)]
struct Tally {
    valid_tokens: f64,
    raw_ratio_sum: f64,
    out_of_bounds: f64,
    dropped: f64,
    vetoed_sequences: f64,
}

impl Correction for Tis {
    fn correct(&self, input: &CorrectionInput<'_>) -> Result<CorrectionOutput> {
        input.validate()?;
        let c = &self.config;
        let (lower, upper) = (f64::from(c.lower), f64::from(c.upper));
        let n = input.train_log_probs.len();
        let mut weights = vec![0f32; n];
        let mut mask = input.loss_mask.to_vec();
        let mut tally = Tally::default();
        // Weights of surviving units (tokens, or sequences at the sequence levels) for the
        // batch normalization.
        let (mut kept_sum, mut kept_count) = (0f64, 0f64);

        let mut start = 0;
        for &len in input.response_lengths {
            let range = start..start + len;
            start += len;
            let log_r = |i: usize| {
                f64::from(input.train_log_probs[i]) - f64::from(input.rollout_log_probs[i])
            };
            let kept: Vec<usize> = range.clone().filter(|&i| input.loss_mask[i] != 0).collect();
            tally.valid_tokens += kept.len() as f64;

            let vetoed = c.veto_threshold.is_some_and(|v| {
                let log_v = f64::from(v).ln();
                kept.iter().any(|&i| log_r(i) < log_v)
            });
            if vetoed {
                tally.vetoed_sequences += 1.0;
                tally.dropped += kept.len() as f64;
                for &i in &kept {
                    tally.raw_ratio_sum += ratio(log_r(i));
                    mask[i] = 0;
                }
                continue;
            }

            // The ratio each kept token's weight starts from.
            let seq_log_r = match c.level {
                TisLevel::Token => None,
                TisLevel::Sequence => Some(kept.iter().map(|&i| log_r(i)).sum::<f64>()),
                TisLevel::Geometric if kept.is_empty() => Some(0.0),
                TisLevel::Geometric => {
                    Some(kept.iter().map(|&i| log_r(i)).sum::<f64>() / kept.len() as f64)
                }
            };
            let mut any_kept = false;
            for &i in &kept {
                let r = ratio(seq_log_r.unwrap_or_else(|| log_r(i)));
                tally.raw_ratio_sum += r;
                let inside = (lower..=upper).contains(&r);
                if !inside {
                    tally.out_of_bounds += 1.0;
                }
                let w = match c.mode {
                    TisMode::Truncate => r.clamp(lower, upper),
                    TisMode::Clip | TisMode::Mask if inside => r,
                    TisMode::Clip => 0.0,
                    TisMode::Mask => {
                        mask[i] = 0;
                        tally.dropped += 1.0;
                        0.0
                    }
                };
                weights[i] = w as f32;
                if mask[i] != 0 {
                    any_kept = true;
                    if c.level == TisLevel::Token {
                        kept_sum += w;
                        kept_count += 1.0;
                    }
                }
            }
            if c.level != TisLevel::Token && any_kept {
                // Every kept token of the sequence carries the same weight.
                kept_sum += f64::from(weights[kept[0]]);
                kept_count += 1.0;
            }
        }

        if c.batch_normalize && kept_sum > 0.0 {
            let mean = kept_sum / kept_count;
            for (w, &m) in weights.iter_mut().zip(&mask) {
                *w = if m != 0 { (f64::from(*w) / mean) as f32 } else { 0.0 };
            }
        }

        let per_token =
            |x: f64| if tally.valid_tokens > 0.0 { x / tally.valid_tokens } else { 0.0 };
        let final_kept: Vec<f64> = weights
            .iter()
            .zip(&mask)
            .filter(|&(_, &m)| m != 0)
            .map(|(&w, _)| f64::from(w))
            .collect();
        let weight_mean = if final_kept.is_empty() {
            0.0
        } else {
            final_kept.iter().sum::<f64>() / final_kept.len() as f64
        };
        let metrics = BTreeMap::from([
            ("tis_raw_ratio_mean".to_string(), per_token(tally.raw_ratio_sum)),
            ("tis_weight_mean".to_string(), weight_mean),
            ("tis_clip_fraction".to_string(), per_token(tally.out_of_bounds)),
            ("tis_masked_fraction".to_string(), per_token(tally.dropped)),
            ("tis_veto_count".to_string(), tally.vetoed_sequences),
        ]);
        Ok(CorrectionOutput { weights, loss_mask: mask, metrics })
    }
}

fn ratio(log_r: f64) -> f64 {
    log_r.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND).exp()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rollout logprobs all zero, so train logprob ln(r) gives ratio r exactly.
    fn run(config: TisConfig, ratios: &[f64], mask: &[u8], lens: &[usize]) -> CorrectionOutput {
        let train: Vec<f32> = ratios.iter().map(|r| r.ln() as f32).collect();
        let rollout = vec![0f32; ratios.len()];
        let input = CorrectionInput {
            train_log_probs: &train,
            rollout_log_probs: &rollout,
            loss_mask: mask,
            response_lengths: lens,
        };
        Tis::new(config).unwrap().correct(&input).unwrap()
    }

    fn close(a: &[f32], b: &[f64]) {
        assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
        for (x, y) in a.iter().zip(b) {
            assert!((f64::from(*x) - y).abs() < 1e-5, "{a:?} vs {b:?}");
        }
    }

    fn metric(out: &CorrectionOutput, name: &str) -> f64 {
        out.metrics[name]
    }

    #[test]
    fn token_truncate_clamps_into_the_bounds() {
        let out = run(TisConfig::default(), &[0.5, 1.5, 3.0], &[1, 1, 1], &[3]);
        close(&out.weights, &[0.5, 1.5, 2.0]);
        assert_eq!(out.loss_mask, vec![1, 1, 1]);
        assert!((metric(&out, "tis_clip_fraction") - 1.0 / 3.0).abs() < 1e-9);
        assert!((metric(&out, "tis_raw_ratio_mean") - 5.0 / 3.0).abs() < 1e-6);
        assert!((metric(&out, "tis_weight_mean") - 4.0 / 3.0).abs() < 1e-6);

        let two_sided = TisConfig { lower: 0.8, ..TisConfig::default() };
        let out = run(two_sided, &[0.5, 1.5, 3.0], &[1, 1, 1], &[3]);
        close(&out.weights, &[0.8, 1.5, 2.0]);
        assert!((metric(&out, "tis_clip_fraction") - 2.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn clip_zeroes_weights_but_keeps_the_mask() {
        let config = TisConfig { mode: TisMode::Clip, lower: 0.6, ..TisConfig::default() };
        let out = run(config, &[0.5, 1.5, 3.0], &[1, 1, 1], &[3]);
        close(&out.weights, &[0.0, 1.5, 0.0]);
        assert_eq!(out.loss_mask, vec![1, 1, 1]);
        assert_eq!(metric(&out, "tis_masked_fraction"), 0.0);
    }

    #[test]
    fn mask_mode_drops_tokens_outside_the_bounds() {
        let config = TisConfig { mode: TisMode::Mask, lower: 0.6, ..TisConfig::default() };
        let out = run(config, &[0.5, 1.5, 3.0, 1.0], &[1, 1, 1, 0], &[4]);
        close(&out.weights, &[0.0, 1.5, 0.0, 0.0]);
        assert_eq!(out.loss_mask, vec![0, 1, 0, 0]);
        assert!((metric(&out, "tis_masked_fraction") - 2.0 / 3.0).abs() < 1e-9);
        assert!((metric(&out, "tis_weight_mean") - 1.5).abs() < 1e-6);
    }

    #[test]
    fn sequence_level_multiplies_the_kept_token_ratios() {
        let config = TisConfig { level: TisLevel::Sequence, ..TisConfig::default() };
        // Sequence A: 2 × 0.75 = 1.5 (the masked-out 100 does not count); sequence B: 3 → 2.
        let out = run(config, &[2.0, 0.75, 100.0, 3.0], &[1, 1, 0, 1], &[3, 1]);
        close(&out.weights, &[1.5, 1.5, 0.0, 2.0]);
        assert!((metric(&out, "tis_clip_fraction") - 1.0 / 3.0).abs() < 1e-9);
    }

    #[test]
    fn geometric_level_takes_the_mean_log_ratio() {
        let config = TisConfig { level: TisLevel::Geometric, upper: 5.0, ..TisConfig::default() };
        // exp((ln 4 + ln 1) / 2) = 2; exp((ln 8 + ln 0.5 + ln 2) / 3) = 2.
        let out = run(config, &[4.0, 1.0, 8.0, 0.5, 2.0], &[1, 1, 1, 1, 1], &[2, 3]);
        close(&out.weights, &[2.0, 2.0, 2.0, 2.0, 2.0]);
        let config = TisConfig { level: TisLevel::Geometric, mode: TisMode::Mask, ..config };
        let out = run(TisConfig { upper: 1.5, ..config }, &[4.0, 1.0, 1.0], &[1, 1, 1], &[2, 1]);
        assert_eq!(out.loss_mask, vec![0, 0, 1]);
        close(&out.weights, &[0.0, 0.0, 1.0]);
    }

    #[test]
    fn veto_drops_the_whole_sequence() {
        let config = TisConfig { veto_threshold: Some(0.1), ..TisConfig::default() };
        // The 0.05 token vetoes sequence A; the 0.01 in B is masked out, so B survives.
        let out = run(config, &[1.0, 0.05, 1.2, 0.01, 1.1], &[1, 1, 1, 0, 1], &[3, 2]);
        assert_eq!(out.loss_mask, vec![0, 0, 0, 0, 1]);
        close(&out.weights, &[0.0, 0.0, 0.0, 0.0, 1.1]);
        assert_eq!(metric(&out, "tis_veto_count"), 1.0);
        assert!((metric(&out, "tis_masked_fraction") - 3.0 / 4.0).abs() < 1e-9);
    }

    #[test]
    fn batch_normalization_gives_mean_one() {
        let config = TisConfig { batch_normalize: true, upper: 10.0, ..TisConfig::default() };
        let out = run(config, &[1.0, 2.0, 5.0], &[1, 1, 0], &[3]);
        close(&out.weights, &[2.0 / 3.0, 4.0 / 3.0, 0.0]);
        assert!((metric(&out, "tis_weight_mean") - 1.0).abs() < 1e-6);
        // Sequence level: each sequence counts once, whatever its length.
        let config = TisConfig { level: TisLevel::Sequence, ..config };
        let out = run(config, &[1.0, 1.0, 1.0, 3.0], &[1, 1, 1, 1], &[3, 1]);
        close(&out.weights, &[0.5, 0.5, 0.5, 1.5]);
    }

    #[test]
    fn extreme_log_ratios_stay_finite() {
        let train = [200.0f32, -200.0];
        let rollout = [0.0f32, 0.0];
        let input = CorrectionInput {
            train_log_probs: &train,
            rollout_log_probs: &rollout,
            loss_mask: &[1, 1],
            response_lengths: &[2],
        };
        let level = TisLevel::Sequence;
        for mode in [TisMode::Truncate, TisMode::Clip, TisMode::Mask] {
            let tis = Tis::new(TisConfig { mode, level, ..TisConfig::default() }).unwrap();
            let out = tis.correct(&input).unwrap();
            assert!(out.weights.iter().all(|w| w.is_finite()));
            assert!(out.metrics.values().all(|m| m.is_finite()), "{:?}", out.metrics);
        }
        let out = Tis::new(TisConfig::default()).unwrap().correct(&input).unwrap();
        close(&out.weights, &[2.0, (-20f64).exp()]);
    }

    #[test]
    fn bad_input_and_configuration_are_errors() {
        let input = CorrectionInput {
            train_log_probs: &[0.0, 0.0],
            rollout_log_probs: &[0.0],
            loss_mask: &[1, 1],
            response_lengths: &[2],
        };
        assert!(Tis::new(TisConfig::default()).unwrap().correct(&input).is_err());
        let err = Tis::new(TisConfig { lower: 3.0, ..TisConfig::default() }).unwrap_err();
        assert!(err.to_string().starts_with("--tis-clip-low"), "{err}");
        let err = Tis::from_config(&serde_json::json!({"uper": 2.0})).unwrap_err();
        assert!(err.to_string().contains("uper"), "{err}");
        let config = miles_core::config::RunConfig::default().tis_config();
        assert_eq!(Tis::from_config(&config).unwrap().config, TisConfig::default());
    }
}
