//! Advantage estimators: GRPO, GSPO, CISPO, REINFORCE++, REINFORCE++-baseline and RLOO, each a
//! [`miles_core::Advantage`] registered under its `--advantage-estimator` name.
//! `tests/fixtures/slime` holds them to slime's own reward post-processing and
//! `compute_advantages_and_returns`.
//!
//! The input is the batch as groups (one group per prompt, one [`SequenceScore`] per sample);
//! the output is one advantage per response token, `[group][sample][token]`. What each
//! estimator computes, with r the sample's scalar reward and m_t its loss mask:
//!
//! - `grpo`: A = (r − mean_g) / (std_g + 1e-6), std_g the unbiased (n − 1) standard deviation
//!   of the group's rewards, the same A on every token; with `std_normalization` off
//!   (`--disable-grpo-std-normalization`, Dr.GRPO) A = r − mean_g. A group of one sample has
//!   A = 0 in both modes: its reward is its own baseline (slime switches the std division off
//!   when `--n-samples-per-prompt` is 1, which gives the same 0; an unbiased std of one value
//!   would be NaN).
//!   With `rewards_normalization` off (`--disable-rewards-normalization`) A = r.
//! - `gspo`, `cispo`: the GRPO advantages; they differ in the loss (a sequence-level ratio,
//!   CISPO's surrogate: `loss::Objective`).
//! - `reinforce_plus_plus`: token rewards −kl_coef·kl_t on the kept tokens plus r on the last
//!   kept token, discounted returns G_t = Σ_{s≥t} γ^{s−t} r_s over every response position
//!   (masked positions earn nothing but still count as a step of discount), then whitened over
//!   the whole batch. A sample with no kept token gets zeros (slime asserts instead; such a
//!   sample, e.g. one a multi-turn rollout masked out entirely, has nothing to train, and one
//!   such sample should not stop a run).
//! - `reinforce_plus_plus_baseline`: (r − mean_g) − kl_coef·kl_t on every token (r − kl_coef·kl_t
//!   without rewards normalization), then whitened over the whole batch.
//!
//! kl_t is the KL between the old and the reference policy at each token by `--kl-loss-type`'s
//! estimator (the trainer computes it; `batch::compute_advantages`).
//! - `rloo`: A = r − mean of the *other* samples of the group = n/(n − 1)·(r − mean_g); 0 for
//!   a group of one.
//!
//! Whitening ([`normalize_advantages`], slime's `--normalize-advantages`) subtracts the mean
//! and divides by sqrt(var + 1e-8) with mean and unbiased variance over the kept tokens of the
//! whole batch. slime requires `--normalize-advantages` for both REINFORCE++ variants and
//! whitens there; here they whiten themselves, and `--normalize-advantages` adds no second
//! pass (which would not be a no-op: it drops the 1e-8 and blows a batch of equal rewards up
//! to unit variance). A batch with no kept
//! token at all whitens to zeros (slime raises): the step then has a zero loss and moves
//! nothing.
//!
//! Tokens outside the loss mask get advantage 0 (slime leaves there whatever the broadcast or
//! the whitening produced; the loss never reads those values, and zeros keep dumps and
//! metrics unambiguous). `returns` is `None`: these estimators have no critic to train.
//! Statistics are accumulated in f64.

use miles_core::config::RunConfig;
use miles_core::{
    Advantage, AdvantageOutput, Error, Factory, Plugin, Registration, Result, SequenceScore,
};
use serde::{Deserialize, Serialize};

/// Added to the group std before dividing (slime's constant).
const GRPO_STD_EPSILON: f64 = 1e-6;
/// Added to the batch variance before the square root when whitening (slime's constant).
const WHITEN_EPSILON: f64 = 1e-8;

/// The estimators' shared configuration; each estimator reads the keys it uses and ignores the
/// others (slime's GRPO likewise ignores `--kl-coef`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdvantageConfig {
    /// GRPO/GSPO/CISPO: divide by the group std (off: Dr.GRPO).
    pub std_normalization: bool,
    /// GRPO/GSPO/CISPO/REINFORCE++-baseline: normalize rewards within their group at all
    /// (off: `--disable-rewards-normalization`).
    pub rewards_normalization: bool,
    /// REINFORCE++: discount factor in [0, 1].
    pub gamma: f32,
    /// REINFORCE++ and REINFORCE++-baseline: weight of the per-token KL penalty (`--kl-coef`).
    pub kl_coef: f32,
}

impl Default for AdvantageConfig {
    fn default() -> Self {
        AdvantageConfig {
            std_normalization: true,
            rewards_normalization: true,
            gamma: 1.0,
            kl_coef: 0.0,
        }
    }
}

impl AdvantageConfig {
    /// From the flags: `--disable-grpo-std-normalization`, `--disable-rewards-normalization`,
    /// `--gamma`, `--kl-coef`.
    pub fn from_run_config(run: &RunConfig) -> Self {
        AdvantageConfig {
            std_normalization: !run.disable_grpo_std_normalization,
            rewards_normalization: !run.disable_rewards_normalization,
            gamma: run.gamma,
            kl_coef: run.kl_coef,
        }
    }

    /// Parses a plugin configuration; `null` means the defaults, an unknown key is an error
    /// naming it.
    pub fn from_json(config: &serde_json::Value) -> Result<Self> {
        let parsed = if config.is_null() {
            AdvantageConfig::default()
        } else {
            AdvantageConfig::deserialize(config)
                .map_err(|e| Error::Plugin(format!("advantage estimator configuration: {e}")))?
        };
        parsed.validate()?;
        Ok(parsed)
    }

    /// The plugin configuration for these settings.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "std_normalization": self.std_normalization,
            "rewards_normalization": self.rewards_normalization,
            "gamma": self.gamma,
            "kl_coef": self.kl_coef,
        })
    }

    /// Range checks; written so that NaN fails them.
    pub fn validate(&self) -> Result<()> {
        let gamma_ok = (0.0..=1.0).contains(&self.gamma);
        if !gamma_ok {
            return Err(Error::config("gamma", format!("{} is outside [0, 1]", self.gamma)));
        }
        let kl_ok = self.kl_coef.is_finite() && self.kl_coef >= 0.0;
        if !kl_ok {
            return Err(Error::config(
                "kl-coef",
                format!("{} must be finite and >= 0", self.kl_coef),
            ));
        }
        Ok(())
    }
}

/// GRPO: group-normalized rewards broadcast to every kept token; GSPO and CISPO use it too
/// (their difference lives in the loss).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grpo {
    pub std_normalization: bool,
    pub rewards_normalization: bool,
}

/// REINFORCE++: KL-shaped token rewards, discounted returns, batch whitening.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReinforcePlusPlus {
    pub gamma: f32,
    pub kl_coef: f32,
}

/// REINFORCE++-baseline: reward minus the group mean, KL-shaped per token, batch whitening.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReinforcePlusPlusBaseline {
    pub kl_coef: f32,
    pub rewards_normalization: bool,
}

/// RLOO: reward minus the mean reward of the other samples of the group.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Rloo;

impl Advantage for Grpo {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        validate(groups)?;
        if !self.rewards_normalization {
            return Ok(per_sample(groups, <[f64]>::to_vec));
        }
        Ok(per_sample(groups, |rewards| group_normalized(rewards, self.std_normalization)))
    }
}

impl Advantage for Rloo {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        validate(groups)?;
        Ok(per_sample(groups, leave_one_out))
    }
}

impl Advantage for ReinforcePlusPlus {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        whitened(self, groups)
    }

    fn whitens_batch(&self) -> bool {
        true
    }

    fn compute_unwhitened(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        validate(groups)?;
        let (gamma, kl_coef) = (f64::from(self.gamma), f64::from(self.kl_coef));
        let mut advantages = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let mut out = Vec::with_capacity(group.len());
            for (s, score) in group.iter().enumerate() {
                let kl = shaping_kl(score, kl_coef, g, s)?;
                let mask = score.loss_mask;
                // Token rewards: the KL penalty on kept tokens, the reward on the last kept one
                // (a sample with no kept token gets no reward: nothing of it is trained).
                let mut token_rewards: Vec<f64> = (0..mask.len())
                    .map(|t| match kl {
                        Some(kl) if mask[t] != 0 => -kl_coef * f64::from(kl[t]),
                        _ => 0.0,
                    })
                    .collect();
                if let Some(last) = mask.iter().rposition(|&m| m != 0) {
                    token_rewards[last] += f64::from(score.reward);
                }
                let mut returns = vec![0f32; mask.len()];
                let mut running = 0f64;
                for t in (0..mask.len()).rev() {
                    running = token_rewards[t] + gamma * running;
                    returns[t] = running as f32;
                }
                out.push(returns);
            }
            advantages.push(out);
        }
        Ok(AdvantageOutput { advantages, returns: None })
    }
}

impl Advantage for ReinforcePlusPlusBaseline {
    fn compute(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        whitened(self, groups)
    }

    fn whitens_batch(&self) -> bool {
        true
    }

    fn compute_unwhitened(&self, groups: &[Vec<SequenceScore<'_>>]) -> Result<AdvantageOutput> {
        validate(groups)?;
        let kl_coef = f64::from(self.kl_coef);
        let mut advantages = Vec::with_capacity(groups.len());
        for (g, group) in groups.iter().enumerate() {
            let rewards: Vec<f64> = group.iter().map(|s| f64::from(s.reward)).collect();
            let mean = if self.rewards_normalization { mean(&rewards) } else { 0.0 };
            let mut out = Vec::with_capacity(group.len());
            for (s, score) in group.iter().enumerate() {
                let kl = shaping_kl(score, kl_coef, g, s)?;
                let centered = rewards[s] - mean;
                let tokens = (0..score.loss_mask.len())
                    .map(|t| {
                        let penalty = kl.map_or(0.0, |kl| kl_coef * f64::from(kl[t]));
                        (centered - penalty) as f32
                    })
                    .collect();
                out.push(tokens);
            }
            advantages.push(out);
        }
        Ok(AdvantageOutput { advantages, returns: None })
    }
}

/// Whitens `advantages` in place over the tokens `mask` keeps: mean 0 and (unbiased) std 1 up
/// to the 1e-8 added to the variance; tokens outside the mask are set to 0. With no kept token
/// everything is 0; with one, that token becomes 0 (its deviation from its own mean).
pub fn normalize_advantages(advantages: &mut [f32], mask: &[u8]) -> Result<()> {
    if advantages.len() != mask.len() {
        return Err(Error::Invalid(format!(
            "normalize_advantages: {} advantages but {} mask entries",
            advantages.len(),
            mask.len()
        )));
    }
    let stats = MaskedStats::of(std::iter::once((&*advantages, mask)));
    stats.apply(advantages, mask);
    Ok(())
}

/// Mean and whitening scale of the kept tokens of a batch.
pub(crate) struct MaskedStats {
    mean: f64,
    /// 1 / sqrt(var + ε).
    scale: f64,
}

impl MaskedStats {
    fn of<'a>(rows: impl Iterator<Item = (&'a [f32], &'a [u8])> + Clone) -> Self {
        let local: Result<Self, std::convert::Infallible> = Self::over(rows, &mut |_| Ok(()));
        local.unwrap_or_else(|never| match never {})
    }

    /// Two passes in f64 (slime uses E[x²] − E[x]² in f32; the same quantity, less rounding).
    /// `sum` turns this part's sums into the whole batch's (several processes: a sum over the
    /// ranks; one process: nothing to add).
    pub(crate) fn over<'a, E>(
        rows: impl Iterator<Item = (&'a [f32], &'a [u8])> + Clone,
        sum: &mut dyn FnMut(&mut [f64]) -> std::result::Result<(), E>,
    ) -> std::result::Result<Self, E> {
        let kept = |rows: &mut dyn Iterator<Item = (&'a [f32], &'a [u8])>,
                    f: &dyn Fn(f64) -> f64| {
            rows.flat_map(|(x, m)| x.iter().zip(m).filter(|(_, m)| **m != 0))
                .map(|(x, _)| f(f64::from(*x)))
                .fold((0.0, 0.0), |(s, n), x| (s + x, n + 1.0))
        };
        let (total, n) = kept(&mut rows.clone(), &|x| x);
        let mut first = [total, n];
        sum(&mut first)?;
        let [total, n] = first;
        if n == 0.0 {
            return Ok(MaskedStats { mean: 0.0, scale: 0.0 });
        }
        let mean = total / n;
        let mut squares = [kept(&mut rows.clone(), &|x| (x - mean) * (x - mean)).0];
        sum(&mut squares)?;
        // Bessel's correction from two tokens on; one token has variance 0.
        let var = if n >= 2.0 { squares[0] / (n - 1.0) } else { 0.0 };
        Ok(MaskedStats { mean, scale: 1.0 / (var + WHITEN_EPSILON).sqrt() })
    }

    pub(crate) fn apply(&self, values: &mut [f32], mask: &[u8]) {
        for (x, &m) in values.iter_mut().zip(mask) {
            *x = if m != 0 { ((f64::from(*x) - self.mean) * self.scale) as f32 } else { 0.0 };
        }
    }
}

/// An estimator that whitens last ([`Advantage::whitens_batch`]): its unwhitened advantages,
/// whitened over `groups`.
fn whitened(
    estimator: &dyn Advantage,
    groups: &[Vec<SequenceScore<'_>>],
) -> Result<AdvantageOutput> {
    let mut out = estimator.compute_unwhitened(groups)?;
    whiten_batch(&mut out.advantages, groups);
    Ok(out)
}

/// Whitens every sample's advantages with the statistics of the whole batch.
fn whiten_batch(advantages: &mut [Vec<Vec<f32>>], groups: &[Vec<SequenceScore<'_>>]) {
    let stats = {
        let rows = advantages
            .iter()
            .zip(groups)
            .flat_map(|(a, g)| a.iter().zip(g).map(|(a, s)| (a.as_slice(), s.loss_mask)));
        MaskedStats::of(rows)
    };
    for (group_adv, group) in advantages.iter_mut().zip(groups) {
        for (sample_adv, score) in group_adv.iter_mut().zip(group) {
            stats.apply(sample_adv, score.loss_mask);
        }
    }
}

/// Applies a per-group map from rewards to one advantage per sample and broadcasts each
/// sample's advantage to its kept tokens.
fn per_sample(
    groups: &[Vec<SequenceScore<'_>>],
    advantage_of: impl Fn(&[f64]) -> Vec<f64>,
) -> AdvantageOutput {
    let advantages = groups
        .iter()
        .map(|group| {
            let rewards: Vec<f64> = group.iter().map(|s| f64::from(s.reward)).collect();
            let per_sample = advantage_of(&rewards);
            group.iter().zip(per_sample).map(|(s, a)| broadcast(a as f32, s.loss_mask)).collect()
        })
        .collect();
    AdvantageOutput { advantages, returns: None }
}

fn broadcast(advantage: f32, mask: &[u8]) -> Vec<f32> {
    mask.iter().map(|&m| if m != 0 { advantage } else { 0.0 }).collect()
}

fn mean(values: &[f64]) -> f64 {
    if values.is_empty() { 0.0 } else { values.iter().sum::<f64>() / values.len() as f64 }
}

/// (r − mean) / (unbiased std + ε), or r − mean; 0 for a group of one.
fn group_normalized(rewards: &[f64], std_normalization: bool) -> Vec<f64> {
    let n = rewards.len();
    if n <= 1 {
        return vec![0.0; n];
    }
    let mean = mean(rewards);
    let centered: Vec<f64> = rewards.iter().map(|r| r - mean).collect();
    if !std_normalization {
        return centered;
    }
    let std = (centered.iter().map(|c| c * c).sum::<f64>() / (n as f64 - 1.0)).sqrt();
    centered.iter().map(|c| c / (std + GRPO_STD_EPSILON)).collect()
}

/// r_i − mean of the others = n/(n − 1)·(r_i − mean); 0 for a group of one.
fn leave_one_out(rewards: &[f64]) -> Vec<f64> {
    let n = rewards.len();
    if n <= 1 {
        return vec![0.0; n];
    }
    let mean = mean(rewards);
    let factor = n as f64 / (n as f64 - 1.0);
    rewards.iter().map(|r| factor * (r - mean)).collect()
}

/// The KL the estimator shapes with: `None` when `kl_coef` is 0 (then the KL is not read),
/// an error when a penalty is asked for but the sample has no KL.
fn shaping_kl<'a>(
    score: &SequenceScore<'a>,
    kl_coef: f64,
    group: usize,
    sample: usize,
) -> Result<Option<&'a [f32]>> {
    if kl_coef == 0.0 {
        return Ok(None);
    }
    score.kl.map(Some).ok_or_else(|| {
        Error::Invalid(format!(
            "advantage: group {group} sample {sample} has no per-token KL, but --kl-coef is \
             {kl_coef}: compute reference logprobs or set --kl-coef 0"
        ))
    })
}

/// Every per-token slice must be as long as the sample's loss mask, and every reward finite.
fn validate(groups: &[Vec<SequenceScore<'_>>]) -> Result<()> {
    for (g, group) in groups.iter().enumerate() {
        for (s, score) in group.iter().enumerate() {
            let n = score.loss_mask.len();
            if !score.reward.is_finite() {
                return Err(Error::Invalid(format!(
                    "advantage: group {g} sample {s} has reward {} (the reward function must \
                     return a finite number)",
                    score.reward
                )));
            }
            for (name, slice) in [("kl", score.kl), ("values", score.values)] {
                if let Some(slice) = slice.filter(|x| x.len() != n) {
                    return Err(Error::Invalid(format!(
                        "advantage: group {g} sample {s} has {} {name} entries but a loss mask \
                         of {n} tokens",
                        slice.len()
                    )));
                }
            }
        }
    }
    Ok(())
}

impl From<AdvantageConfig> for Grpo {
    fn from(c: AdvantageConfig) -> Grpo {
        Grpo {
            std_normalization: c.std_normalization,
            rewards_normalization: c.rewards_normalization,
        }
    }
}

pub static GRPO: Plugin = Plugin {
    name: "grpo",
    version: env!("CARGO_PKG_VERSION"),
    description: "GRPO: group-normalized rewards (Dr.GRPO without the std division)",
    factory: Factory::Advantage(|config| {
        Ok(Box::new(Grpo::from(AdvantageConfig::from_json(config)?)))
    }),
};

pub static GSPO: Plugin = Plugin {
    name: "gspo",
    version: env!("CARGO_PKG_VERSION"),
    description: "GSPO: GRPO advantages for the sequence-level-ratio loss",
    factory: Factory::Advantage(|config| {
        Ok(Box::new(Grpo::from(AdvantageConfig::from_json(config)?)))
    }),
};

pub static CISPO: Plugin = Plugin {
    name: "cispo",
    version: env!("CARGO_PKG_VERSION"),
    description: "CISPO: GRPO advantages for the clipped-IS-weight loss (MiniMax-M1)",
    factory: Factory::Advantage(|config| {
        Ok(Box::new(Grpo::from(AdvantageConfig::from_json(config)?)))
    }),
};

pub static REINFORCE_PLUS_PLUS: Plugin = Plugin {
    name: "reinforce_plus_plus",
    version: env!("CARGO_PKG_VERSION"),
    description: "REINFORCE++: KL-shaped discounted returns, whitened over the batch",
    factory: Factory::Advantage(|config| {
        let c = AdvantageConfig::from_json(config)?;
        Ok(Box::new(ReinforcePlusPlus { gamma: c.gamma, kl_coef: c.kl_coef }))
    }),
};

pub static REINFORCE_PLUS_PLUS_BASELINE: Plugin = Plugin {
    name: "reinforce_plus_plus_baseline",
    version: env!("CARGO_PKG_VERSION"),
    description: "REINFORCE++-baseline: reward minus group mean, KL-shaped, whitened",
    factory: Factory::Advantage(|config| {
        let c = AdvantageConfig::from_json(config)?;
        Ok(Box::new(ReinforcePlusPlusBaseline {
            kl_coef: c.kl_coef,
            rewards_normalization: c.rewards_normalization,
        }))
    }),
};

pub static RLOO: Plugin = Plugin {
    name: "rloo",
    version: env!("CARGO_PKG_VERSION"),
    description: "RLOO: reward minus the mean of the other samples of its group",
    factory: Factory::Advantage(|config| {
        AdvantageConfig::from_json(config)?;
        Ok(Box::new(Rloo))
    }),
};

miles_core::inventory::submit! { Registration(&GRPO) }
miles_core::inventory::submit! { Registration(&GSPO) }
miles_core::inventory::submit! { Registration(&CISPO) }
miles_core::inventory::submit! { Registration(&REINFORCE_PLUS_PLUS) }
miles_core::inventory::submit! { Registration(&REINFORCE_PLUS_PLUS_BASELINE) }
miles_core::inventory::submit! { Registration(&RLOO) }

/// The built-in estimators; the driver names this once so the linker keeps the registrations.
pub static BUILTIN: &[&Plugin] =
    &[&GRPO, &GSPO, &CISPO, &REINFORCE_PLUS_PLUS, &REINFORCE_PLUS_PLUS_BASELINE, &RLOO];

#[cfg(test)]
mod tests;
