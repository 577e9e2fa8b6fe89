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
//! whole batch. slime requires `--normalize-advantages` for both REINFORCE++ variants; here
//! they whiten themselves, and whitening again is (to 1e-8) a no-op. A batch with no kept
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
mod tests {
    use super::*;
    use miles_core::registry::create_advantage;
    use serde_json::json;

    fn score<'a>(reward: f32, mask: &'a [u8]) -> SequenceScore<'a> {
        SequenceScore { reward, loss_mask: mask, kl: None, values: None }
    }

    fn with_kl<'a>(reward: f32, mask: &'a [u8], kl: &'a [f32]) -> SequenceScore<'a> {
        SequenceScore { reward, loss_mask: mask, kl: Some(kl), values: None }
    }

    fn close(actual: &[f32], expected: &[f64]) {
        assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
        for (a, e) in actual.iter().zip(expected) {
            assert!((f64::from(*a) - e).abs() < 1e-4, "{actual:?} vs {expected:?}");
        }
    }

    /// Mean and unbiased std of the kept tokens of a whole output.
    fn kept_stats(out: &AdvantageOutput, groups: &[Vec<SequenceScore<'_>>]) -> (f64, f64) {
        let kept: Vec<f64> = out
            .advantages
            .iter()
            .zip(groups)
            .flat_map(|(a, g)| a.iter().zip(g))
            .flat_map(|(a, s)| a.iter().zip(s.loss_mask).filter(|(_, m)| **m != 0))
            .map(|(a, _)| f64::from(*a))
            .collect();
        let n = kept.len() as f64;
        let mean = kept.iter().sum::<f64>() / n;
        let var = kept.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
        (mean, var.sqrt())
    }

    #[test]
    fn grpo_divides_by_the_unbiased_group_std() {
        // Rewards [1, 0, 0, 1]: mean 0.5, deviations ±0.5, unbiased variance 4·0.25/3 = 1/3,
        // std 0.57735, A = ±0.5 / (0.57735 + 1e-6) = ±0.86602.
        let m = [1u8, 1, 0];
        let group = vec![score(1.0, &m), score(0.0, &m), score(0.0, &m), score(1.0, &m)];
        let out = Grpo { std_normalization: true, rewards_normalization: true }
            .compute(&[group])
            .unwrap();
        let a = 0.5 / (1.0f64 / 3.0).sqrt();
        close(&out.advantages[0][0], &[a, a, 0.0]);
        close(&out.advantages[0][1], &[-a, -a, 0.0]);
        close(&out.advantages[0][3], &[a, a, 0.0]);
        assert!(out.returns.is_none());
    }

    #[test]
    fn dr_grpo_only_subtracts_the_mean() {
        // Rewards [3, 1, 2]: mean 2, A = [1, -1, 0]; a second group [5, 7] is normalized
        // on its own: mean 6, A = [-1, 1].
        let m = [1u8, 1];
        let groups = vec![
            vec![score(3.0, &m), score(1.0, &m), score(2.0, &m)],
            vec![score(5.0, &m), score(7.0, &m)],
        ];
        let out = Grpo { std_normalization: false, rewards_normalization: true }
            .compute(&groups)
            .unwrap();
        close(&out.advantages[0][0], &[1.0, 1.0]);
        close(&out.advantages[0][1], &[-1.0, -1.0]);
        close(&out.advantages[0][2], &[0.0, 0.0]);
        close(&out.advantages[1][0], &[-1.0, -1.0]);
        close(&out.advantages[1][1], &[1.0, 1.0]);
    }

    #[test]
    fn a_group_of_one_has_zero_advantage() {
        let m = [1u8, 1, 1];
        for std_normalization in [true, false] {
            let out = Grpo { std_normalization, rewards_normalization: true }
                .compute(&[vec![score(0.7, &m)]])
                .unwrap();
            close(&out.advantages[0][0], &[0.0, 0.0, 0.0]);
        }
        let out = Rloo.compute(&[vec![score(0.7, &m)]]).unwrap();
        close(&out.advantages[0][0], &[0.0, 0.0, 0.0]);
        // Equal rewards: std 0, so 0 / (0 + 1e-6) = 0, not NaN.
        let out = Grpo { std_normalization: true, rewards_normalization: true }
            .compute(&[vec![score(1.0, &m), score(1.0, &m)]])
            .unwrap();
        close(&out.advantages[0][1], &[0.0, 0.0, 0.0]);
    }

    #[test]
    fn gspo_and_cispo_advantages_are_grpo_advantages() {
        let m = [1u8, 0, 1];
        let groups = vec![vec![score(0.2, &m), score(0.9, &m), score(0.4, &m)]];
        for std_normalization in [true, false] {
            let config = AdvantageConfig { std_normalization, ..AdvantageConfig::default() };
            let grpo = Grpo::from(config).compute(&groups).unwrap();
            for name in ["gspo", "cispo"] {
                let estimator = create_advantage(name, &config.to_json()).unwrap();
                assert_eq!(estimator.compute(&groups).unwrap(), grpo, "{name}");
            }
        }
    }

    #[test]
    fn without_rewards_normalization_the_raw_reward_is_the_advantage() {
        // slime's --disable-rewards-normalization: GRPO broadcasts r; REINFORCE++-baseline
        // skips the group mean (then whitens over the batch as always).
        let m = [1u8, 0, 1];
        let groups = vec![vec![score(0.2, &m), score(0.9, &m)], vec![score(0.4, &m)]];
        let out = Grpo { std_normalization: true, rewards_normalization: false }
            .compute(&groups)
            .unwrap();
        close(&out.advantages[0][1], &[0.9, 0.0, 0.9]);
        close(&out.advantages[1][0], &[0.4, 0.0, 0.4]);
        let raw = ReinforcePlusPlusBaseline { kl_coef: 0.0, rewards_normalization: false };
        let out = raw.compute(&groups).unwrap();
        // Whitened raw rewards [0.2, 0.9, 0.4] (each on two tokens): mean 0.5.
        assert!(out.advantages[0][0][0] < 0.0 && out.advantages[0][1][0] > 0.0);
        assert!(out.advantages[1][0][0] < 0.0, "{out:?}");
    }

    #[test]
    fn rloo_subtracts_the_mean_of_the_others() {
        // Rewards [1, 0, 0, 1]: sample 0 → 1 − (0+0+1)/3 = 2/3, sample 1 → 0 − 2/3 = −2/3;
        // equivalently 4/3 · (r − 0.5) = ±2/3.
        let m = [1u8, 1];
        let group = vec![score(1.0, &m), score(0.0, &m), score(0.0, &m), score(1.0, &m)];
        let out = Rloo.compute(&[group]).unwrap();
        close(&out.advantages[0][0], &[2.0 / 3.0, 2.0 / 3.0]);
        close(&out.advantages[0][1], &[-2.0 / 3.0, -2.0 / 3.0]);
        // [3, 0]: 3 − 0 = 3 and 0 − 3 = −3.
        let out = Rloo.compute(&[vec![score(3.0, &m), score(0.0, &m)]]).unwrap();
        close(&out.advantages[0][0], &[3.0, 3.0]);
        close(&out.advantages[0][1], &[-3.0, -3.0]);
    }

    #[test]
    fn reinforce_plus_plus_discounts_kl_shaped_rewards_then_whitens() {
        // γ = 0.5, kl_coef = 0.1.
        // Sample A: mask [1, 1, 1, 0], kl [1, 2, 3, 9], reward 1.
        //   token rewards: [−0.1, −0.2, −0.3 + 1, 0] = [−0.1, −0.2, 0.7, 0] (the masked kl 9
        //   earns nothing); returns G3 = 0, G2 = 0.7, G1 = −0.2 + 0.35 = 0.15,
        //   G0 = −0.1 + 0.075 = −0.025.
        // Sample B: mask [0, 1, 1], kl [0, 0, 0], reward 0 → returns all 0.
        // Kept values: [−0.025, 0.15, 0.7, 0, 0]: mean 0.165, squared deviations
        //   0.0361 + 0.000225 + 0.286225 + 0.027225 + 0.027225 = 0.377, var 0.377/4 = 0.09425,
        //   std 0.307002.
        let (ma, ka) = ([1u8, 1, 1, 0], [1f32, 2.0, 3.0, 9.0]);
        let (mb, kb) = ([0u8, 1, 1], [0f32, 0.0, 0.0]);
        let groups = vec![vec![with_kl(1.0, &ma, &ka)], vec![with_kl(0.0, &mb, &kb)]];
        let rpp = ReinforcePlusPlus { gamma: 0.5, kl_coef: 0.1 };
        let out = rpp.compute(&groups).unwrap();
        let (mean, std) = (0.165, 0.09425f64.sqrt());
        let w = |x: f64| (x - mean) / std;
        close(&out.advantages[0][0], &[w(-0.025), w(0.15), w(0.7), 0.0]);
        close(&out.advantages[1][0], &[0.0, w(0.0), w(0.0)]);
        let (mean, std) = kept_stats(&out, &groups);
        assert!(mean.abs() < 1e-6 && (std - 1.0).abs() < 1e-6, "{mean} {std}");

        // γ = 1 and no KL: every position up to the last kept token carries the reward.
        let m = [1u8, 0, 1, 0];
        let groups = vec![vec![score(2.0, &m), score(0.0, &m)]];
        let out = ReinforcePlusPlus { gamma: 1.0, kl_coef: 0.0 }.compute(&groups).unwrap();
        // Kept values [2, 2, 0, 0]: mean 1, unbiased std sqrt(4/3).
        let a = 1.0 / (4.0f64 / 3.0).sqrt();
        close(&out.advantages[0][0], &[a, 0.0, a, 0.0]);
        close(&out.advantages[0][1], &[-a, 0.0, -a, 0.0]);
    }

    #[test]
    fn reinforce_plus_plus_baseline_centers_per_group_then_whitens() {
        // kl_coef = 0.5. Group rewards [1, 0]: mean 0.5, centered [0.5, −0.5].
        // Sample 0: kl [0.2, 0.4] → [0.5 − 0.1, 0.5 − 0.2] = [0.4, 0.3].
        // Sample 1: kl [0, 0.2], mask [1, 0] → [−0.5, masked].
        // Kept values [0.4, 0.3, −0.5]: mean 0.2/3 = 0.066667, squared deviations
        //   0.111111 + 0.054444 + 0.321111 = 0.486667, var 0.243333, std 0.493288.
        let (m0, k0) = ([1u8, 1], [0.2f32, 0.4]);
        let (m1, k1) = ([1u8, 0], [0f32, 0.2]);
        let groups = vec![vec![with_kl(1.0, &m0, &k0), with_kl(0.0, &m1, &k1)]];
        let out = ReinforcePlusPlusBaseline { kl_coef: 0.5, rewards_normalization: true }
            .compute(&groups)
            .unwrap();
        let (mean, std) = (0.2 / 3.0, (0.486_666_666_7f64 / 2.0).sqrt());
        let w = |x: f64| (x - mean) / std;
        close(&out.advantages[0][0], &[w(0.4), w(0.3)]);
        close(&out.advantages[0][1], &[w(-0.5), 0.0]);
    }

    #[test]
    fn whitening_is_masked_and_safe_for_tiny_batches() {
        // Kept [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4)/2 = 4, std 2 → [−1, 0, 1].
        let mut a = [1.0f32, 100.0, 3.0, 5.0];
        normalize_advantages(&mut a, &[1, 0, 1, 1]).unwrap();
        close(&a, &[-1.0, 0.0, 0.0, 1.0]);
        // One kept token: variance 0, so it becomes 0 (no division by zero).
        let mut a = [7.0f32, 2.0];
        normalize_advantages(&mut a, &[0, 1]).unwrap();
        assert_eq!(a, [0.0, 0.0]);
        // No kept token.
        let mut a = [7.0f32, 2.0];
        normalize_advantages(&mut a, &[0, 0]).unwrap();
        assert_eq!(a, [0.0, 0.0]);
        let mut empty: [f32; 0] = [];
        normalize_advantages(&mut empty, &[]).unwrap();
        // Whitening twice changes nothing beyond the ε.
        let mut a = [0.3f32, -1.2, 2.5, 0.0];
        normalize_advantages(&mut a, &[1, 1, 1, 1]).unwrap();
        let once = a;
        normalize_advantages(&mut a, &[1, 1, 1, 1]).unwrap();
        close(&a, &once.map(f64::from));
        assert!(normalize_advantages(&mut a, &[1, 1]).is_err());
    }

    #[test]
    fn mismatched_lengths_and_missing_kl_are_errors() {
        let m = [1u8, 1, 1];
        let short = [0f32, 0.0];
        let bad_kl = SequenceScore { reward: 1.0, loss_mask: &m, kl: Some(&short), values: None };
        let err = Grpo { std_normalization: true, rewards_normalization: true }
            .compute(&[vec![bad_kl]])
            .unwrap_err();
        assert!(err.to_string().contains("2 kl entries but a loss mask of 3"), "{err}");
        let bad_values =
            SequenceScore { reward: 1.0, loss_mask: &m, kl: None, values: Some(&short) };
        let err = Rloo.compute(&[vec![score(0.0, &m), bad_values]]).unwrap_err();
        assert!(err.to_string().contains("group 0 sample 1 has 2 values"), "{err}");

        let rpp = ReinforcePlusPlus { gamma: 1.0, kl_coef: 0.1 };
        let err = rpp.compute(&[vec![score(1.0, &m)]]).unwrap_err();
        assert!(err.to_string().contains("no per-token KL"), "{err}");
        let baseline = ReinforcePlusPlusBaseline { kl_coef: 0.1, rewards_normalization: true };
        assert!(baseline.compute(&[vec![score(1.0, &m)]]).is_err());
        // With kl_coef 0 the KL is not needed.
        ReinforcePlusPlusBaseline { kl_coef: 0.0, rewards_normalization: true }
            .compute(&[vec![score(1.0, &m)]])
            .unwrap();

        let err = Rloo.compute(&[vec![score(f32::NAN, &m)]]).unwrap_err();
        assert!(err.to_string().contains("reward NaN"), "{err}");
    }

    #[test]
    fn empty_batches_and_fully_masked_samples() {
        for plugin in BUILTIN {
            let Factory::Advantage(make) = plugin.factory else { panic!("{plugin:?}") };
            let estimator = make(&serde_json::Value::Null).unwrap();
            assert!(estimator.compute(&[]).unwrap().advantages.is_empty());
            let out = estimator.compute(&[vec![]]).unwrap();
            assert_eq!(out.advantages, vec![Vec::<Vec<f32>>::new()]);
            // A fully masked sample (slime's removed samples) gets zeros, whatever its reward.
            let (m, live) = ([0u8, 0], [1u8, 1]);
            let out = estimator.compute(&[vec![score(5.0, &m), score(1.0, &live)]]).unwrap();
            assert_eq!(out.advantages[0][0], vec![0.0, 0.0], "{plugin:?}");
        }
    }

    #[test]
    fn estimators_are_registered_under_their_flag_names() {
        let names: Vec<&str> = BUILTIN.iter().map(|p| p.name).collect();
        assert_eq!(
            names,
            [
                "grpo",
                "gspo",
                "cispo",
                "reinforce_plus_plus",
                "reinforce_plus_plus_baseline",
                "rloo"
            ]
        );
        let m = [1u8];
        let groups = vec![vec![score(1.0, &m), score(0.0, &m)]];
        for name in names {
            let plugin = miles_core::registry::find(miles_core::PluginKind::Advantage, name)
                .unwrap_or_else(|e| panic!("{e}"));
            assert!(std::ptr::eq(plugin, *BUILTIN.iter().find(|p| p.name == name).unwrap()));
            let estimator = create_advantage(name, &json!({})).unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(estimator.compute(&groups).unwrap().advantages[0].len(), 2);
        }
        // Configuration reaches the estimator: Dr.GRPO gives ±0.5, GRPO ±0.7071.
        let dr = create_advantage("grpo", &json!({"std_normalization": false})).ok().unwrap();
        close(&dr.compute(&groups).unwrap().advantages[0][0], &[0.5]);
        let grpo = create_advantage("grpo", &serde_json::Value::Null).ok().unwrap();
        close(&grpo.compute(&groups).unwrap().advantages[0][0], &[0.5 / 0.5f64.sqrt()]);
    }

    #[test]
    fn bad_configuration_is_refused() {
        let err = create_advantage("grpo", &json!({"std_normalisation": false})).err().unwrap();
        assert!(err.to_string().contains("std_normalisation"), "{err}");
        let err = create_advantage("rloo", &json!({"gama": 0.9})).err().unwrap();
        assert!(err.to_string().contains("gama"), "{err}");
        let err = create_advantage("reinforce_plus_plus", &json!({"gamma": 1.5})).err().unwrap();
        assert!(err.to_string().starts_with("--gamma"), "{err}");
        let err = create_advantage("reinforce_plus_plus_baseline", &json!({"kl_coef": -1.0}))
            .err()
            .unwrap();
        assert!(err.to_string().starts_with("--kl-coef"), "{err}");
        let err = create_advantage("gspo", &json!({"gamma": "high"})).err().unwrap();
        assert!(err.to_string().contains("gamma") || err.to_string().contains("string"), "{err}");
    }

    #[test]
    fn run_config_maps_to_the_plugin_configuration() {
        let run = RunConfig {
            disable_grpo_std_normalization: true,
            gamma: 0.9,
            kl_coef: 0.05,
            ..RunConfig::default()
        };
        let c = AdvantageConfig::from_run_config(&run);
        let expected = AdvantageConfig {
            std_normalization: false,
            gamma: 0.9,
            kl_coef: 0.05,
            ..AdvantageConfig::default()
        };
        assert_eq!(c, expected);
        let run = RunConfig { disable_rewards_normalization: true, ..run };
        assert!(!AdvantageConfig::from_run_config(&run).rewards_normalization);
        assert_eq!(AdvantageConfig::from_json(&c.to_json()).unwrap(), c);
        let defaults = AdvantageConfig::from_run_config(&RunConfig::default());
        assert_eq!(defaults, AdvantageConfig::default());
    }
}
