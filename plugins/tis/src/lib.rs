//! TIS/MIS: importance weights that correct the policy gradient for the gap between the
//! distribution the rollout engine sampled from and the one the trainer computes. The plugin
//! computes what slime's `vanilla_tis_function`, `icepop_function` and MIS
//! (`examples/train_infer_mismatch_helper/mis.py`) compute; `tests/fixtures/slime` holds it to
//! them.
//!
//! Per sequence, with log r_t = logp_train − logp_rollout and m_t its loss mask, the log-ratio
//! at a level is log r_t (`token`), Σ_m log r (`sequence`) or Σ_m log r / max(Σ m, 1)
//! (`geometric`), clamped to ±20 before exp() (MIS's safety bound: one wild token cannot make
//! a weight inf or NaN; slime's vanilla TIS has no such clamp, which changes only ratios beyond
//! e^±20; the vanilla metrics `tis` and `tis_abs` take the raw ratio, as slime's do).
//! With w the ratio at `level` and [lower, upper] the bounds:
//!
//! - `truncate`: w ← clamp(w, lower, upper); lower defaults to 0 (classic one-sided TIS;
//!   slime's `--tis-clip-low`);
//! - `clip`: the same clamp, lower defaulting to 1/upper (MIS's default);
//! - `mask`: w is kept, and tokens with w outside the bounds leave the loss (MIS);
//! - `icepop`: w ← 0 outside the bounds, the token stays in the loss (slime's icepop),
//!   lower defaulting to 0.
//!
//! Rejection sampling (`use_rs`, MIS) then drops the tokens whose ratio at `rs_level` is
//! outside [rs_lower, rs_upper] (defaults: the TIS lower bound as clip/mask resolve it, and
//! upper), and the veto drops a whole sequence where any kept token has r_t below
//! `rs_veto_threshold`. Neither changes a weight: a dropped token leaves the loss's
//! numerator only.
//!
//! `batch_normalize` divides every weight by the mean weight over the input loss mask: the
//! token mean at the `token` level, the mean of per-sequence means at `sequence`; rejected
//! and vetoed tokens count with their weights, as in MIS, and a mean ≤ 1e-8 leaves the
//! weights alone. `geometric` has no batch normalization (slime refuses it too).
//!
//! Metrics come as each sequence's sum over its loss-mask tokens, under slime's names; the
//! trainer aggregates them like the loss (slime's `sum_of_sample_mean`): at the token level,
//! vanilla TIS's `tis` (r_t), `tis_abs` (|r_t − 1|) and `tis_clipfrac` (the weight is not r_t),
//! and always MIS's `mis_*` set (perplexities
//! and KL between the two engines, the fractions each bound hit, the weights before and after
//! the bounds and after batch normalization). Weights are constants of the loss: no gradient
//! flows through them.

use std::collections::BTreeMap;

use miles_core::config::{TisLevel, TisMode};
use miles_core::{
    Correction, CorrectionInput, CorrectionOutput, Error, Factory, Plugin, Registration, Result,
};
use serde::Deserialize;

/// exp() of log-ratios beyond this is clamped (MIS's `SAFETY_BOUND`).
const LOG_RATIO_SAFETY_BOUND: f64 = 20.0;
/// Batch normalization is skipped when the mean weight is not above this (MIS's).
const BATCH_NORM_MIN_MEAN: f64 = 1e-8;

pub static PLUGIN: Plugin = Plugin {
    name: "tis",
    version: env!("CARGO_PKG_VERSION"),
    description: "truncated/masked importance sampling and rejection sampling (TIS/MIS/icepop)",
    factory: Factory::Correction(|config| Ok(Box::new(Tis::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// The plugin's configuration; the driver builds it from `--tis-*` and `--rs-*`
/// (`RunConfig::tis_config`).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TisConfig {
    pub level: TisLevel,
    pub mode: TisMode,
    pub upper: f32,
    /// Default: 0 for truncate and icepop, 1/upper for clip and mask.
    pub lower: Option<f32>,
    pub batch_normalize: bool,
    pub use_rs: bool,
    pub rs_level: TisLevel,
    pub rs_lower: Option<f32>,
    pub rs_upper: Option<f32>,
    pub rs_veto_threshold: Option<f32>,
}

impl Default for TisConfig {
    fn default() -> Self {
        TisConfig {
            level: TisLevel::Token,
            mode: TisMode::Truncate,
            upper: 2.0,
            lower: None,
            batch_normalize: false,
            use_rs: false,
            rs_level: TisLevel::Token,
            rs_lower: None,
            rs_upper: None,
            rs_veto_threshold: None,
        }
    }
}

/// The bounds with their defaults resolved.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Bounds {
    lower: f64,
    upper: f64,
    rs_lower: f64,
    rs_upper: f64,
    /// ln of the veto threshold.
    log_veto: Option<f64>,
}

#[derive(Debug, Clone)]
pub struct Tis {
    config: TisConfig,
    bounds: Bounds,
}

impl Tis {
    pub fn new(config: TisConfig) -> Result<Self> {
        let c = &config;
        // Written so that NaN fails every check.
        let upper_ok = c.upper.is_finite() && c.upper > 0.0;
        if !upper_ok {
            return Err(Error::config("tis-clip", format!("upper bound {} must be > 0", c.upper)));
        }
        let upper = f64::from(c.upper);
        // MIS's lower bound: given, else 1/upper.
        let mis_lower = c.lower.map_or(1.0 / upper, f64::from);
        let lower = match (c.mode, c.lower) {
            (_, Some(l)) => f64::from(l),
            (TisMode::Truncate | TisMode::Icepop, None) => 0.0,
            (TisMode::Clip | TisMode::Mask, None) => mis_lower,
        };
        let lower_ok = lower >= 0.0 && lower < upper;
        if !lower_ok {
            // Name the flag the user set: a defaulted lower bound comes from --tis-clip.
            let (flag, what) = match c.lower {
                Some(_) => ("tis-clip-low", format!("lower bound {lower}")),
                None => ("tis-clip", format!("{upper} gives the default lower bound 1/{upper}")),
            };
            return Err(Error::config(
                flag,
                format!("{what} must be in [0, upper {upper}); set --tis-clip-low"),
            ));
        }
        let rs_lower = c.rs_lower.map_or(mis_lower, f64::from);
        let rs_upper = c.rs_upper.map_or(upper, f64::from);
        let rs_ok = rs_lower >= 0.0 && rs_lower < rs_upper && rs_upper.is_finite();
        if !rs_ok {
            let flag = match (c.rs_upper, c.rs_lower) {
                (Some(_), _) => "rs-upper-bound",
                (None, Some(_)) => "rs-lower-bound",
                (None, None) => "tis-clip",
            };
            return Err(Error::config(
                flag,
                format!(
                    "rejection bounds [{rs_lower}, {rs_upper}] must satisfy 0 <= lower < upper"
                ),
            ));
        }
        if let Some(v) = c.rs_veto_threshold.filter(|v| v.is_nan() || *v <= 0.0) {
            return Err(Error::config("rs-veto-threshold", format!("{v} must be > 0")));
        }
        if c.batch_normalize && c.level == TisLevel::Geometric {
            return Err(Error::config(
                "tis-batch-normalize",
                "is not defined for --tis-level geometric (slime refuses it too)",
            ));
        }
        let log_veto = c.rs_veto_threshold.filter(|_| c.use_rs).map(|v| f64::from(v).ln());
        Ok(Tis { config, bounds: Bounds { lower, upper, rs_lower, rs_upper, log_veto } })
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

/// Per metric, each sequence's sum over its loss-mask tokens, in sequence order (what
/// `CorrectionOutput::metrics` holds).
#[derive(Default)]
struct Metrics(BTreeMap<&'static str, Vec<f64>>);

impl Metrics {
    /// A per-token metric of one sequence.
    fn tokens(&mut self, name: &'static str, mask: &[u8], values: impl IntoIterator<Item = f64>) {
        self.0.entry(name).or_default().push(masked_sum(values, mask));
    }

    /// A metric with one value per sequence: that value on each of its loss-mask tokens.
    fn sequence(&mut self, name: &'static str, mask: &[u8], value: f64) {
        let kept = mask.iter().filter(|&&m| m != 0).count();
        let sum = if kept == 0 { 0.0 } else { value * kept as f64 };
        self.0.entry(name).or_default().push(sum);
    }
}

/// One sequence of the batch: its logprobs, log r per token and its loss mask.
struct Sequence<'a> {
    train: &'a [f32],
    rollout: &'a [f32],
    log_r: Vec<f64>,
    /// r per token, exp(log r), computed once: several metrics and the token level use it.
    ratio: Vec<f64>,
    mask: &'a [u8],
}

impl<'a> Sequence<'a> {
    /// Every sequence of `input`, in order.
    fn all(input: &CorrectionInput<'a>) -> Vec<Sequence<'a>> {
        let mut start = 0;
        let mut out = Vec::with_capacity(input.response_lengths.len());
        for &len in input.response_lengths {
            let range = start..start + len;
            start += len;
            let (train, rollout) =
                (&input.train_log_probs[range.clone()], &input.rollout_log_probs[range.clone()]);
            let log_r = train.iter().zip(rollout).map(|(t, r)| f64::from(*t) - f64::from(*r));
            out.push(Sequence {
                train,
                rollout,
                ratio: log_r.clone().map(f64::exp).collect(),
                log_r: log_r.collect(),
                mask: &input.loss_mask[range],
            });
        }
        out
    }

    fn len(&self) -> usize {
        self.log_r.len()
    }

    /// Σ_m log r: the sequence's log-ratio.
    fn log_r_sum(&self) -> f64 {
        masked_sum(self.log_r.iter().copied(), self.mask)
    }

    /// The log-ratio of each token at `level`.
    fn log_ratio_at(&self, level: TisLevel) -> Vec<f64> {
        let count = self.mask.iter().filter(|&&m| m != 0).count().max(1);
        match level {
            TisLevel::Token => self.log_r.clone(),
            TisLevel::Sequence => vec![self.log_r_sum(); self.len()],
            TisLevel::Geometric => vec![self.log_r_sum() / count as f64; self.len()],
        }
    }

    /// exp() of the log-ratios at `level`, within the safety bound.
    fn ratios_at(&self, level: TisLevel) -> Vec<f64> {
        match level {
            TisLevel::Token => self.safe_token_ratios().collect(),
            _ => self.log_ratio_at(level).into_iter().map(safe_exp).collect(),
        }
    }

    /// r per token within the safety bound.
    fn safe_token_ratios(&self) -> impl Iterator<Item = f64> + '_ {
        self.log_r
            .iter()
            .zip(&self.ratio)
            .map(|(&x, &r)| if x.abs() <= LOG_RATIO_SAFETY_BOUND { r } else { safe_exp(x) })
    }
}

fn safe_exp(log_r: f64) -> f64 {
    log_r.clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND).exp()
}

fn flag(b: bool) -> f64 {
    if b { 1.0 } else { 0.0 }
}

/// Σ_m x: values off the mask are never read (they may be NaN). Four running sums, so the
/// additions do not wait on each other (a metric pass is otherwise latency-bound).
fn masked_sum(values: impl IntoIterator<Item = f64>, mask: &[u8]) -> f64 {
    let mut sums = [0f64; 4];
    for (i, (v, &m)) in values.into_iter().zip(mask).enumerate() {
        sums[i % 4] += if m != 0 { v } else { 0.0 };
    }
    (sums[0] + sums[1]) + (sums[2] + sums[3])
}

/// Σ_m x / max(Σ m, 1), MIS's `masked_mean`.
fn masked_mean(x: &[f64], mask: &[u8]) -> f64 {
    let count = mask.iter().filter(|&&m| m != 0).count().max(1);
    masked_sum(x.iter().copied(), mask) / count as f64
}

impl Correction for Tis {
    fn correct(&self, input: &CorrectionInput<'_>) -> Result<CorrectionOutput> {
        self.correct_part(input, &mut |_| Ok(()))
    }

    /// Batch normalization's mean is over the whole batch: its sum and count go through
    /// `batch_sum`; everything else is per sequence.
    fn correct_part(
        &self,
        input: &CorrectionInput<'_>,
        batch_sum: &mut dyn FnMut(&mut [f64]) -> Result<()>,
    ) -> Result<CorrectionOutput> {
        input.validate()?;
        let sequences = Sequence::all(input);
        let mut metrics = Metrics::default();
        let mut weights = Vec::with_capacity(sequences.len());
        let mut loss_mask = Vec::with_capacity(input.loss_mask.len());
        for seq in &sequences {
            mismatch_metrics(&mut metrics, seq);
            let (w, mut mask) = self.bounded_weights(seq, &mut metrics);
            if self.config.use_rs {
                self.reject(seq, &mut mask, &mut metrics);
            }
            metrics.tokens("mis_is_ratio_mean_after_tis_rs", seq.mask, w.iter().copied());
            if self.config.level == TisLevel::Token {
                // Vanilla TIS's names (a token-level correction there), on the raw ratios.
                let ratio = &seq.ratio;
                metrics.tokens("tis", seq.mask, ratio.iter().copied());
                metrics.tokens("tis_abs", seq.mask, ratio.iter().map(|r| (r - 1.0).abs()));
                let clipped = w.iter().zip(ratio).map(|(w, r)| flag(w != r));
                metrics.tokens("tis_clipfrac", seq.mask, clipped);
            }
            weights.push(w);
            loss_mask.extend(mask);
        }
        if self.config.batch_normalize {
            let mut sums = batch_sums(self.config.level, &weights, &sequences);
            batch_sum(&mut sums)?;
            let mean = sums[0] / sums[1].max(1.0);
            let factor = if mean > BATCH_NORM_MIN_MEAN { mean } else { 1.0 };
            weights.iter_mut().flatten().for_each(|w| *w /= factor);
            for seq in &sequences {
                metrics.sequence("mis_batch_norm_factor", seq.mask, factor);
            }
        }
        for (w, seq) in weights.iter().zip(&sequences) {
            let kept = || w.iter().zip(seq.mask).filter(|(_, m)| **m != 0).map(|(w, _)| *w);
            let min = kept().reduce(f64::min).unwrap_or(0.0);
            let max = kept().reduce(f64::max).unwrap_or(0.0);
            metrics.sequence("mis_is_ratio_mean_final", seq.mask, masked_mean(w, seq.mask));
            metrics.sequence("mis_is_ratio_min_final", seq.mask, min);
            metrics.sequence("mis_is_ratio_max_final", seq.mask, max);
        }
        Ok(CorrectionOutput {
            weights: weights.into_iter().flatten().map(|w| w as f32).collect(),
            loss_mask,
            metrics: metrics.0.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        })
    }
}

impl Tis {
    /// One sequence's weights by `mode` (0 off the loss mask) and its mask after `mask` mode.
    fn bounded_weights(&self, seq: &Sequence<'_>, metrics: &mut Metrics) -> (Vec<f64>, Vec<u8>) {
        let (mode, b) = (self.config.mode, &self.bounds);
        let before = seq.ratios_at(self.config.level);
        let outside = |w: f64| (w < b.lower, w > b.upper);
        let mut mask = seq.mask.to_vec();
        let mut weights = Vec::with_capacity(seq.len());
        for ((&w, &m), keep) in before.iter().zip(seq.mask).zip(&mut mask) {
            // A NaN ratio is outside, as slime's `(w >= lo) & (w <= hi)` has it.
            let inside = (b.lower..=b.upper).contains(&w);
            let w = match mode {
                TisMode::Truncate | TisMode::Clip => w.clamp(b.lower, b.upper),
                TisMode::Mask => {
                    if !inside {
                        *keep = 0;
                    }
                    w
                }
                TisMode::Icepop if inside => w,
                TisMode::Icepop => 0.0,
            };
            // Selected, not multiplied by the mask: a NaN off the mask must not stay.
            weights.push(if m != 0 { w } else { 0.0 });
        }
        metrics.tokens("mis_tis_weight_before_bound", seq.mask, before.iter().copied());
        let fraction =
            |pick: fn((bool, bool)) -> bool| before.iter().map(move |&w| flag(pick(outside(w))));
        let (low, high) = match mode {
            TisMode::Truncate => (None, Some("mis_tis_truncate_fraction")),
            TisMode::Clip => {
                (Some("mis_tis_clip_fraction_low"), Some("mis_tis_clip_fraction_high"))
            }
            TisMode::Mask => {
                (Some("mis_tis_mask_fraction_low"), Some("mis_tis_mask_fraction_high"))
            }
            TisMode::Icepop => (None, None),
        };
        if let Some(name) = low {
            metrics.tokens(name, seq.mask, fraction(|o| o.0));
        }
        if let Some(name) = high {
            metrics.tokens(name, seq.mask, fraction(|o| o.1));
        }
        metrics.tokens("mis_tis_weight_after_bound", seq.mask, weights.iter().copied());
        (weights, mask)
    }

    /// MIS rejection sampling: drops from `mask` the tokens whose ratio at `rs_level` is out of
    /// the rejection bounds, and the whole sequence when the veto fires.
    fn reject(&self, seq: &Sequence<'_>, mask: &mut [u8], metrics: &mut Metrics) {
        let b = &self.bounds;
        let rs = seq.ratios_at(self.config.rs_level);
        metrics.tokens(
            "mis_rs_mask_fraction_low",
            seq.mask,
            rs.iter().map(|&w| flag(w < b.rs_lower)),
        );
        metrics.tokens(
            "mis_rs_mask_fraction_high",
            seq.mask,
            rs.iter().map(|&w| flag(w > b.rs_upper)),
        );
        for (keep, w) in mask.iter_mut().zip(rs) {
            if !(b.rs_lower..=b.rs_upper).contains(&w) {
                *keep = 0;
            }
        }
        let Some(log_veto) = b.log_veto else { return };
        let catastrophic: Vec<bool> =
            seq.log_r.iter().zip(seq.mask).map(|(&x, &m)| m != 0 && x < log_veto).collect();
        let vetoed = catastrophic.contains(&true);
        metrics.tokens(
            "mis_rs_catastrophic_token_fraction",
            seq.mask,
            catastrophic.iter().map(|&x| flag(x)),
        );
        metrics.sequence("mis_rs_catastrophic_seq_fraction", seq.mask, flag(vetoed));
        if vetoed {
            mask.fill(0);
        }
    }
}

/// The sum and count whose ratio is the mean weight batch normalization divides by, over the
/// input loss mask: the token mean at the token level, the mean of per-sequence means at the
/// sequence level.
fn batch_sums(level: TisLevel, weights: &[Vec<f64>], sequences: &[Sequence<'_>]) -> [f64; 2] {
    match level {
        TisLevel::Token => {
            let kept = |(w, s): (&Vec<f64>, &Sequence<'_>)| masked_sum(w.iter().copied(), s.mask);
            let sum: f64 = weights.iter().zip(sequences).map(kept).sum();
            let count: usize =
                sequences.iter().map(|s| s.mask.iter().filter(|&&m| m != 0).count()).sum();
            [sum, count as f64]
        }
        // `Tis::new` refuses the geometric level.
        TisLevel::Sequence | TisLevel::Geometric => {
            let means: f64 =
                weights.iter().zip(sequences).map(|(w, s)| masked_mean(w, s.mask)).sum();
            [means, sequences.len() as f64]
        }
    }
}

/// MIS's `add_ppl_metrics`: how far apart the two engines are on one sequence.
fn mismatch_metrics(metrics: &mut Metrics, seq: &Sequence<'_>) {
    let train: Vec<f64> = seq.train.iter().map(|&x| f64::from(x)).collect();
    let rollout: Vec<f64> = seq.rollout.iter().map(|&x| f64::from(x)).collect();
    let mean_train = masked_mean(&train, seq.mask);
    let mean_rollout = masked_mean(&rollout, seq.mask);
    metrics.sequence("mis_training_log_ppl", seq.mask, -mean_train);
    metrics.sequence("mis_training_ppl", seq.mask, (-mean_train).exp());
    metrics.sequence("mis_rollout_log_ppl", seq.mask, -mean_rollout);
    metrics.sequence("mis_rollout_ppl", seq.mask, (-mean_rollout).exp());
    metrics.tokens("mis_kl", seq.mask, seq.log_r.iter().map(|x| -x));
    let k3 = seq.log_r.iter().zip(&seq.ratio).map(|(x, r)| r - x - 1.0);
    metrics.tokens("mis_k3_kl", seq.mask, k3);
    let log_ppl_diff = mean_rollout - mean_train;
    metrics.sequence("mis_log_ppl_diff", seq.mask, log_ppl_diff);
    metrics.sequence("mis_log_ppl_abs_diff", seq.mask, log_ppl_diff.abs());
    metrics.sequence("mis_ppl_ratio", seq.mask, log_ppl_diff.exp());
    let rho_squared: Vec<f64> = seq.safe_token_ratios().map(|r| r * r).collect();
    metrics.sequence("mis_chi2_token", seq.mask, masked_mean(&rho_squared, seq.mask) - 1.0);
    let log_seq = seq.log_r_sum().clamp(-LOG_RATIO_SAFETY_BOUND, LOG_RATIO_SAFETY_BOUND);
    metrics.sequence("mis_chi2_seq", seq.mask, (2.0 * log_seq).exp() - 1.0);
}

#[cfg(test)]
mod tests;
