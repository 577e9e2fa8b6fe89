//! The policy loss (PPO clip with clip-high and dual clip, GSPO's sequence ratio, CISPO,
//! off-policy sequence masking, off-policy correction weights, KL and entropy terms) and the
//! SFT loss, over per-token slices packed by `response_lengths`. Each returns the loss, its
//! exact gradient with respect to every token's `logp` and `entropy` (what the model's fused
//! logprob backward takes), and slime's metrics. `tests/fixtures/slime` holds all of it to
//! slime's own `policy_loss_function`.
//!
//! Per kept token, with ratio ρ = exp(logp − old_logp) and advantage A:
//!
//! - PPO: pg1 = −A·ρ, pg2 = −A·clamp(ρ, 1 − eps_clip, 1 + eps_clip_high), pg = max(pg1, pg2);
//!   the token counts as clipped when pg2 > pg1 (then pg does not depend on ρ);
//! - dual clip (`eps_clip_c = Some(c)`, c > 1): for A < 0, pg = min(pg, −A·c). As in slime,
//!   `pg_clipfrac` counts only the clip-range clip, not the dual clip;
//! - GSPO: ρ = exp(s) for every token of a sequence, s the mean of logp − old_logp over the
//!   sequence's loss-mask tokens; `ppo_kl` is then −s per token;
//! - CISPO: pg = −sg(clamp(ρ, 1 − eps_clip, 1 + eps_clip_high))·A·logp: the clipped ratio is a
//!   constant and the gradient flows through logp, so clipped tokens still learn; a token
//!   counts as clipped when the clamp moved ρ;
//! - OPSM (`opsm_delta = Some(δ)`): in a sequence whose mean old − new log-ratio over its
//!   loss-mask tokens exceeds δ, the tokens with A < 0 get pg = 0. `opsm_clipfrac` sums, per
//!   sequence, its tokens with A < 0 (all of them, as slime counts) over its loss-mask count,
//!   with slime's normalizer (the sequences, or the tokens in per-token mode);
//! - the correction weight multiplies pg (a constant: no gradient through it);
//! - KL to the reference (`use_kl_loss`): k1 = logp − ref, k2 = ½(logp − ref)², k3 =
//!   exp(ref − logp) − (ref − logp) − 1; with `use_unbiased_kl` the estimate is multiplied by
//!   the token's ρ (gradient through both); `low_var_kl` is k3 (times ρ) clamped to
//!   [−10, 10] (zero gradient where the clamp binds).
//!
//! loss = agg(w·pg) − entropy_coef·agg(entropy) + kl_loss_coef·agg(kl), where agg is:
//!
//! - by default the mean over sequences of each sequence's token sum divided by its number of
//!   loss-mask tokens (slime's sum of sample means, divided by the number of sequences);
//! - with `per_token_loss` (`--calculate-per-token-loss`) the token sum divided by the batch's
//!   token count.
//!
//! Denominators follow slime exactly: a sequence with no loss-mask token divides by 1 (its sum
//! is 0) and still counts as a sequence, and in per-token mode it adds 1 to the token count.
//! The correction mask decides which tokens enter the numerators: as in slime, the reducer
//! rebuilt with the correction's mask serves pg, clipfrac, ppo_kl, entropy and KL alike, while
//! every denominator keeps the loss mask, so a dropped token does not rescale the others. A
//! token is kept when both masks keep it (a correction can only drop tokens). `ois` (the mean
//! ratio) is taken over the loss mask alone, as slime reports it.
//!
//! Arithmetic is f64 throughout; gradients are rounded to f32 at the end. Values at tokens
//! outside the loss mask are never read, so garbage (even NaN) there cannot leak in. A
//! non-finite value at a kept token yields a non-finite loss, which the caller detects and
//! skips; nothing panics. An entropy or KL term whose coefficient is 0 stays out of the loss
//! (its metric is still computed), so a NaN there does not poison the loss (miles does the
//! same). Unlike miles, log-ratios are not clamped to ±20: the gradient stays exact and f64
//! does not overflow before |log ratio| ≈ 709.
//!
//! The loss covers the given batch; a trainer that splits a step into micro-batches scales each
//! micro-batch's loss and gradients by its share of the step's sequences (or tokens).

use miles_core::config::{AdvantageEstimator, KlLossType, RunConfig};
use miles_core::{Error, Result};

/// slime clamps `low_var_kl` into [−10, 10] for numerical stability.
const LOW_VAR_KL_BOUND: f64 = 10.0;

/// Which surrogate the policy loss uses, from `--advantage-estimator`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Objective {
    /// PPO's clipped surrogate on token ratios (GRPO, REINFORCE++, RLOO, …).
    #[default]
    Ppo,
    /// PPO's clipped surrogate on one sequence-level ratio.
    Gspo,
    /// CISPO: the clipped ratio as a constant weight of −A·logp.
    Cispo,
}

/// The policy loss's settings, slime's flags of the same names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PolicyLossConfig {
    pub objective: Objective,
    pub eps_clip: f32,
    pub eps_clip_high: f32,
    /// Dual-clip constant (> 1), off when `None`.
    pub eps_clip_c: Option<f32>,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f32,
    pub kl_loss_type: KlLossType,
    /// `--use-unbiased-kl`: the KL estimate times the importance ratio ρ.
    pub use_unbiased_kl: bool,
    pub entropy_coef: f32,
    /// `--calculate-per-token-loss`: token mean over the batch instead of the mean of
    /// per-sequence token means.
    pub per_token_loss: bool,
    /// `--use-opsm --opsm-delta δ`: off-policy sequence masking.
    pub opsm_delta: Option<f32>,
}

impl Default for PolicyLossConfig {
    /// slime's defaults.
    fn default() -> Self {
        PolicyLossConfig {
            objective: Objective::Ppo,
            eps_clip: 0.2,
            eps_clip_high: 0.2,
            eps_clip_c: None,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            kl_loss_type: KlLossType::K1,
            use_unbiased_kl: false,
            entropy_coef: 0.0,
            per_token_loss: false,
            opsm_delta: None,
        }
    }
}

impl PolicyLossConfig {
    /// From the flags; `--eps-clip-high` defaults to `--eps-clip`, and the objective follows
    /// `--advantage-estimator`.
    pub fn from_run_config(run: &RunConfig) -> Self {
        PolicyLossConfig {
            objective: match run.advantage_estimator {
                AdvantageEstimator::Gspo => Objective::Gspo,
                AdvantageEstimator::Cispo => Objective::Cispo,
                _ => Objective::Ppo,
            },
            eps_clip: run.eps_clip,
            eps_clip_high: run.eps_clip_high.unwrap_or(run.eps_clip),
            eps_clip_c: run.eps_clip_c,
            use_kl_loss: run.use_kl_loss,
            kl_loss_coef: run.kl_loss_coef,
            kl_loss_type: run.kl_loss_type,
            use_unbiased_kl: run.use_unbiased_kl,
            entropy_coef: run.entropy_coef,
            per_token_loss: run.calculate_per_token_loss,
            opsm_delta: run.use_opsm.then_some(run.opsm_delta),
        }
    }

    /// Range checks, each naming its flag; written so that NaN fails them.
    pub fn validate(&self) -> Result<()> {
        let non_negative = |v: f32| v.is_finite() && v >= 0.0;
        if !non_negative(self.eps_clip) {
            return Err(Error::config("eps-clip", format!("{} must be >= 0", self.eps_clip)));
        }
        if !non_negative(self.eps_clip_high) {
            let v = self.eps_clip_high;
            return Err(Error::config("eps-clip-high", format!("{v} must be >= 0")));
        }
        if let Some(c) = self.eps_clip_c {
            let ok = c.is_finite() && c > 1.0;
            if !ok {
                return Err(Error::config(
                    "eps-clip-c",
                    format!("{c} must be > 1 (dual clip bounds the loss by -A·c)"),
                ));
            }
        }
        let finite = [
            ("kl-loss-coef", self.kl_loss_coef),
            ("entropy-coef", self.entropy_coef),
            ("opsm-delta", self.opsm_delta.unwrap_or(0.0)),
        ];
        if let Some((flag, v)) = finite.into_iter().find(|(_, v)| !v.is_finite()) {
            return Err(Error::config(flag, format!("{v} is not finite")));
        }
        Ok(())
    }
}

/// The SFT loss's one setting.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SftLossConfig {
    /// `--calculate-per-token-loss`, as for the policy loss.
    pub per_token_loss: bool,
}

impl SftLossConfig {
    pub fn from_run_config(run: &RunConfig) -> Self {
        SftLossConfig { per_token_loss: run.calculate_per_token_loss }
    }
}

/// One batch of response tokens, the sequences back to back; every per-token slice has
/// Σ `response_lengths` entries.
#[derive(Debug, Clone, Copy)]
pub struct LossInput<'a> {
    /// log p(token) under the policy being trained (the values the gradient is taken at).
    pub logp: &'a [f32],
    /// log p(token) under the policy that the ratio is taken against.
    pub old_logp: &'a [f32],
    /// log p(token) under the reference model; required by `use_kl_loss`.
    pub ref_logp: Option<&'a [f32]>,
    pub entropy: &'a [f32],
    pub advantages: &'a [f32],
    pub loss_mask: &'a [u8],
    pub response_lengths: &'a [usize],
    /// Off-policy correction weights (TIS/MIS), `CorrectionOutput::weights`.
    pub correction_weights: Option<&'a [f32]>,
    /// The correction's numerator mask, `CorrectionOutput::loss_mask`.
    pub correction_mask: Option<&'a [u8]>,
}

/// slime's `train/*` metrics of one batch, each aggregated like the loss.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct LossMetrics {
    pub pg_loss: f64,
    pub pg_clipfrac: f64,
    /// agg(old_logp − logp).
    pub ppo_kl: f64,
    /// agg(kl) when `use_kl_loss`, else 0.
    pub kl_loss: f64,
    /// agg(entropy).
    pub entropy_loss: f64,
    /// agg(ρ) over the loss mask, before any correction mask (slime reports it with TIS).
    pub ois: f64,
    /// The OPSM-masked fraction (0 without OPSM).
    pub opsm_clipfrac: f64,
}

impl LossMetrics {
    /// The metrics under slime's names; `ois` and `opsm_clipfrac` where slime reports them
    /// (with a correction, with OPSM).
    pub fn named(&self, corrected: bool, opsm: bool) -> Vec<(&'static str, f64)> {
        let mut out = vec![
            ("train/pg_loss", self.pg_loss),
            ("train/pg_clipfrac", self.pg_clipfrac),
            ("train/ppo_kl", self.ppo_kl),
            ("train/kl_loss", self.kl_loss),
            ("train/entropy_loss", self.entropy_loss),
        ];
        if corrected {
            out.push(("train/ois", self.ois));
        }
        if opsm {
            out.push(("train/opsm_clipfrac", self.opsm_clipfrac));
        }
        out
    }

    /// `self += share · other`: micro-batches and steps combine by their share.
    pub fn add_scaled(&mut self, other: &LossMetrics, share: f64) {
        self.pg_loss += share * other.pg_loss;
        self.pg_clipfrac += share * other.pg_clipfrac;
        self.ppo_kl += share * other.ppo_kl;
        self.kl_loss += share * other.kl_loss;
        self.entropy_loss += share * other.entropy_loss;
        self.ois += share * other.ois;
        self.opsm_clipfrac += share * other.opsm_clipfrac;
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct LossOutput {
    pub loss: f64,
    /// ∂loss/∂logp per token (0 where the loss does not depend on it).
    pub d_logp: Vec<f32>,
    /// ∂loss/∂entropy per token.
    pub d_entropy: Vec<f32>,
    pub metrics: LossMetrics,
}

/// The KL estimator `kind` at one token and its derivative with respect to `logp`.
pub fn approx_kl(kind: KlLossType, logp: f32, ref_logp: f32) -> (f32, f32) {
    let (value, grad) = kl_term(kind, f64::from(logp), f64::from(ref_logp), None);
    (value as f32, grad as f32)
}

/// The estimator and its derivative in logp; with `ratio = Some(ρ)`, ρ = exp(logp − old), the
/// estimate is ρ·kl (`--use-unbiased-kl`, ∂ρ/∂logp = ρ). low_var_kl's clamp applies last, as
/// in slime.
fn kl_term(kind: KlLossType, logp: f64, ref_logp: f64, ratio: Option<f64>) -> (f64, f64) {
    let log_ratio = logp - ref_logp;
    let (mut value, mut grad) = match kind {
        KlLossType::K1 => (log_ratio, 1.0),
        KlLossType::K2 => (0.5 * log_ratio * log_ratio, log_ratio),
        KlLossType::K3 | KlLossType::LowVarKl => {
            let x = -log_ratio;
            let e = x.exp();
            (e - x - 1.0, 1.0 - e)
        }
    };
    if let Some(rho) = ratio {
        (value, grad) = (rho * value, rho * (value + grad));
    }
    if kind == KlLossType::LowVarKl && value.abs() > LOW_VAR_KL_BOUND {
        (value, grad) = (LOW_VAR_KL_BOUND.copysign(value), 0.0);
    }
    (value, grad)
}

/// The policy loss with its KL and entropy terms; see the module documentation.
pub fn policy_loss(cfg: &PolicyLossConfig, input: &LossInput) -> Result<LossOutput> {
    cfg.validate()?;
    validate(input, true)?;
    let ref_logp = match (cfg.use_kl_loss, input.ref_logp) {
        (true, None) => {
            return Err(Error::Invalid(
                "policy loss: --use-kl-loss needs reference logprobs (ref_logp is missing)".into(),
            ));
        }
        (true, Some(r)) => Some(r),
        (false, _) => None,
    };
    let n = input.logp.len();
    let agg = Aggregation::new(input.loss_mask, input.response_lengths, cfg.per_token_loss);
    let in_numerator =
        |t: usize| input.loss_mask[t] != 0 && input.correction_mask.is_none_or(|m| m[t] != 0);
    let (lo, hi) = (1.0 - f64::from(cfg.eps_clip), 1.0 + f64::from(cfg.eps_clip_high));
    let dual_clip = cfg.eps_clip_c.map(f64::from);
    let entropy_coef = f64::from(cfg.entropy_coef);
    let kl_coef = if ref_logp.is_some() { f64::from(cfg.kl_loss_coef) } else { 0.0 };
    let sequence_ratio = cfg.objective == Objective::Gspo;

    let mut metrics = LossMetrics::default();
    let mut d_logp = vec![0f64; n];
    let mut d_entropy = vec![0f32; n];
    let mut start = 0;
    for &len in input.response_lengths {
        let range = start..start + len;
        start += len;
        let in_loss_mask: Vec<usize> = range.clone().filter(|&t| input.loss_mask[t] != 0).collect();
        let count = in_loss_mask.len().max(1) as f64;
        // The mean logp − old over the loss mask (slime divides by max(count, 1)): GSPO's
        // log-ratio and, negated, OPSM's sequence KL.
        let mean_log_ratio = in_loss_mask.iter().map(|&t| log_ratio(input, t)).sum::<f64>() / count;
        let opsm_drops = cfg.opsm_delta.is_some_and(|d| -mean_log_ratio > f64::from(d));
        if opsm_drops {
            let masked = range.clone().filter(|&t| input.advantages[t] < 0.0).count();
            metrics.opsm_clipfrac += agg.per_sequence * masked as f64 / count;
        }
        // ∂loss/∂ρ summed over the sequence, for the sequence ratio's chain rule.
        let mut d_sequence_ratio = 0f64;
        for &t in &in_loss_mask {
            let c = agg.scale[t];
            let log_r = if sequence_ratio { mean_log_ratio } else { log_ratio(input, t) };
            let ratio = log_r.exp();
            metrics.ois += c * ratio;
            if !in_numerator(t) {
                continue;
            }
            let advantage = f64::from(input.advantages[t]);
            let clip = match cfg.objective {
                Objective::Ppo | Objective::Gspo => ppo_clip(ratio, advantage, lo, hi, dual_clip),
                Objective::Cispo => cispo(ratio, advantage, f64::from(input.logp[t]), lo, hi),
            };
            let weight = input.correction_weights.map_or(1.0, |w| f64::from(w[t]));
            let weight = if opsm_drops && advantage < 0.0 { 0.0 } else { weight };
            metrics.pg_loss += c * weight * clip.loss;
            metrics.pg_clipfrac += if clip.clipped { c } else { 0.0 };
            metrics.ppo_kl += c * -log_r;
            // A token without gradient contributes nothing, even where ρ overflowed (0·∞
            // would be NaN).
            let d_pg = c * weight * clip.d_pg;
            match cfg.objective {
                _ if d_pg == 0.0 => {}
                Objective::Gspo => d_sequence_ratio += d_pg,
                Objective::Ppo => d_logp[t] += d_pg * ratio,
                Objective::Cispo => d_logp[t] += d_pg,
            }

            metrics.entropy_loss += c * f64::from(input.entropy[t]);
            if entropy_coef != 0.0 {
                d_entropy[t] = (-entropy_coef * c) as f32;
            }
            if let Some(ref_logp) = ref_logp {
                // The unbiased estimate weights by the token's own ratio, under GSPO too.
                let rho = cfg.use_unbiased_kl.then(|| log_ratio(input, t).exp());
                let (logp, r) = (f64::from(input.logp[t]), f64::from(ref_logp[t]));
                let (kl, d_kl) = kl_term(cfg.kl_loss_type, logp, r, rho);
                metrics.kl_loss += c * kl;
                if kl_coef != 0.0 {
                    d_logp[t] += kl_coef * c * d_kl;
                }
            }
        }
        if d_sequence_ratio != 0.0 {
            // ρ = exp(Σ_mask (logp − old) / count): ∂ρ/∂logp_j = ρ / count on the mask.
            let d_each = d_sequence_ratio * mean_log_ratio.exp() / count;
            for j in in_loss_mask {
                d_logp[j] += d_each;
            }
        }
    }

    let mut loss = metrics.pg_loss;
    if entropy_coef != 0.0 {
        loss -= entropy_coef * metrics.entropy_loss;
    }
    if kl_coef != 0.0 {
        loss += kl_coef * metrics.kl_loss;
    }
    Ok(LossOutput {
        loss,
        d_logp: d_logp.into_iter().map(|d| d as f32).collect(),
        d_entropy,
        metrics,
    })
}

/// The SFT loss: −agg(logp) over the loss-mask tokens. Reads only `logp`, `loss_mask` and
/// `response_lengths` (the other slices may be empty); the metrics are all 0 (slime reports
/// only the loss).
pub fn sft_loss(cfg: &SftLossConfig, input: &LossInput) -> Result<LossOutput> {
    validate(input, false)?;
    let scale = Aggregation::new(input.loss_mask, input.response_lengths, cfg.per_token_loss).scale;
    let mut loss = 0f64;
    let mut d_logp = vec![0f32; input.logp.len()];
    for (t, &c) in scale.iter().enumerate() {
        if input.loss_mask[t] != 0 {
            loss -= c * f64::from(input.logp[t]);
            d_logp[t] = -c as f32;
        }
    }
    Ok(LossOutput {
        loss,
        d_logp,
        d_entropy: vec![0.0; input.logp.len()],
        metrics: LossMetrics::default(),
    })
}

fn log_ratio(input: &LossInput, t: usize) -> f64 {
    f64::from(input.logp[t]) - f64::from(input.old_logp[t])
}

/// One token's surrogate.
struct Clipped {
    loss: f64,
    /// ∂loss/∂ρ for PPO and GSPO; ∂loss/∂logp for CISPO, whose ratio is a constant.
    d_pg: f64,
    /// The clip range bound.
    clipped: bool,
}

/// clamp(ρ, lo, hi) written out: `f64::clamp` panics on NaN bounds, and a NaN ratio must pass
/// through as NaN.
fn clamp_ratio(ratio: f64, lo: f64, hi: f64) -> f64 {
    if ratio < lo {
        lo
    } else if ratio > hi {
        hi
    } else {
        ratio
    }
}

fn ppo_clip(ratio: f64, advantage: f64, lo: f64, hi: f64, dual_clip: Option<f64>) -> Clipped {
    let pg1 = -advantage * ratio;
    let pg2 = -advantage * clamp_ratio(ratio, lo, hi);
    let clipped = pg2 > pg1;
    // pg2 > pg1 only when the clamp moved ρ, where pg2 is constant in ρ; a NaN pg1 is kept.
    let (mut loss, mut d_pg) = if clipped { (pg2, 0.0) } else { (pg1, -advantage) };
    if let Some(c) = dual_clip.filter(|_| advantage < 0.0) {
        let pg3 = -advantage * c;
        if pg3 < loss {
            (loss, d_pg) = (pg3, 0.0);
        }
    }
    Clipped { loss, d_pg, clipped }
}

/// CISPO's −sg(clamp(ρ))·A·logp.
fn cispo(ratio: f64, advantage: f64, logp: f64, lo: f64, hi: f64) -> Clipped {
    let truncated = clamp_ratio(ratio, lo, hi);
    Clipped {
        loss: -truncated * advantage * logp,
        d_pg: -truncated * advantage,
        clipped: truncated != ratio,
    }
}

/// How a per-token quantity aggregates into a batch figure (slime's reducer and normalizer).
pub struct Aggregation {
    /// Per token: agg(x) = Σ_{t in the loss mask} scale_t·x_t.
    pub scale: Vec<f64>,
    /// The factor of a per-sequence sum (1/sequences, or 1/tokens in per-token mode).
    pub per_sequence: f64,
    /// Each sequence's tokens and the divisor of its sum (its clamped count, or 1 per token).
    sequences: Vec<(std::ops::Range<usize>, f64)>,
}

impl Aggregation {
    pub fn new(loss_mask: &[u8], response_lengths: &[usize], per_token: bool) -> Aggregation {
        let mut start = 0;
        let sequences: Vec<(std::ops::Range<usize>, usize)> = response_lengths
            .iter()
            .map(|&len| {
                let range = start..start + len;
                start += len;
                let count = loss_mask[range.clone()].iter().filter(|&&m| m != 0).count();
                // slime clamps each sequence's count to at least 1, for both denominators.
                (range, count.max(1))
            })
            .collect();
        let token_total: usize = sequences.iter().map(|(_, c)| c).sum();
        let per_sequence =
            1.0 / if per_token { token_total } else { sequences.len() }.max(1) as f64;
        let mut scale = vec![0f64; loss_mask.len()];
        let sequences = sequences
            .into_iter()
            .map(|(range, count)| {
                let divisor = if per_token { 1.0 } else { count as f64 };
                for t in range.clone().filter(|&t| loss_mask[t] != 0) {
                    scale[t] = per_sequence / divisor;
                }
                (range, divisor)
            })
            .collect();
        Aggregation { scale, per_sequence, sequences }
    }

    /// agg(x) over the loss mask the aggregation was built from, summed per sequence first as
    /// slime does (so the mean of ones is exactly 1); values off the mask are not read (they
    /// may be garbage, even NaN).
    pub fn of(&self, x: &[f64]) -> f64 {
        let sums: Vec<f64> = self
            .sequences
            .iter()
            .map(|(range, _)| range.clone().filter(|&t| self.scale[t] != 0.0).map(|t| x[t]).sum())
            .collect();
        self.of_sequence_sums(&sums)
    }

    /// agg(x) from each sequence's sum of x over its loss-mask tokens
    /// (`CorrectionOutput::metrics`).
    pub fn of_sequence_sums(&self, sums: &[f64]) -> f64 {
        let total: f64 = self.sequences.iter().zip(sums).map(|((_, divisor), s)| s / divisor).sum();
        total * self.per_sequence
    }
}

/// Every slice the loss reads must have Σ `response_lengths` entries.
fn validate(input: &LossInput, policy: bool) -> Result<()> {
    let total: usize = input.response_lengths.iter().sum();
    let mut slices: Vec<(&str, usize)> =
        vec![("logp", input.logp.len()), ("loss_mask", input.loss_mask.len())];
    if policy {
        slices.extend([
            ("old_logp", input.old_logp.len()),
            ("entropy", input.entropy.len()),
            ("advantages", input.advantages.len()),
        ]);
        let optional = [
            ("ref_logp", input.ref_logp.map(<[f32]>::len)),
            ("correction_weights", input.correction_weights.map(<[f32]>::len)),
            ("correction_mask", input.correction_mask.map(<[u8]>::len)),
        ];
        slices.extend(optional.into_iter().filter_map(|(name, len)| Some((name, len?))));
    }
    if let Some((name, len)) = slices.iter().find(|(_, len)| *len != total) {
        let all: Vec<String> = slices.iter().map(|(n, l)| format!("{n} {l}")).collect();
        return Err(Error::Invalid(format!(
            "loss input: {name} has {len} entries but response lengths sum to {total} ({})",
            all.join(", ")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests;
