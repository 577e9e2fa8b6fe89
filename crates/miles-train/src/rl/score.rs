//! Step 2: rewards, one result per sample; a failed reward marks its sample failed.

use miles_core::config::RunConfig;
use miles_core::{Reward, Sample, Status};
use serde_json::json;

/// The reward of a run that scores nothing (SFT without eval); never called.
pub(super) struct Unscored;

impl Reward for Unscored {
    fn score(&self, _: &Sample) -> Result<miles_core::RewardValue, miles_core::RewardError> {
        Err(miles_core::RewardError::new("this run has no reward (set --rm-type)"))
    }
}

/// Scores every sample in place: `reward` set, or status failed with the reason in metadata.
/// Returns the scalar reward per sample (`None` for failures) and the failure count.
pub(super) fn score(
    reward: &dyn Reward,
    samples: &mut [Sample],
    cfg: &RunConfig,
) -> (Vec<Option<f32>>, usize) {
    let results = miles_rewards::score_all(reward, samples, cfg.group_rm);
    let mut failures = 0;
    let scalars = samples
        .iter_mut()
        .zip(results)
        .map(|(s, r)| {
            if s.status == Status::Failed {
                failures += 1;
                return None;
            }
            let value = r.and_then(|v| {
                let x = v.scalar(cfg.reward_key.as_deref())?;
                s.reward = Some(v);
                if x.is_finite() {
                    Ok(x as f32)
                } else {
                    Err(miles_core::RewardError::new(format!("the reward is {x}")))
                }
            });
            match value {
                Ok(x) => Some(x),
                Err(e) => {
                    failures += 1;
                    s.status = Status::Failed;
                    if !s.metadata.is_object() {
                        s.metadata = json!({});
                    }
                    s.metadata["reward_error"] = e.to_string().into();
                    None
                }
            }
        })
        .collect();
    (scalars, failures)
}

/// Why a sample failed, from its metadata (the engine's or the reward's reason).
pub(super) fn failure_reason(s: &Sample) -> Option<String> {
    if s.status != Status::Failed {
        return None;
    }
    let m = &s.metadata;
    let reason = m.get("reward_error").or_else(|| m.get("rollout_error"))?;
    Some(reason.as_str().map_or_else(|| reason.to_string(), String::from))
}

/// Scores a generation's groups in one call (so a reward server sees the whole batch); the
/// samples come back flat, in group order, with their rewards. A reward that can score no more
/// ([`Reward::fatal`]) stops the run.
pub(super) fn score_groups(
    reward: &dyn Reward,
    groups: Vec<Vec<Sample>>,
    cfg: &RunConfig,
) -> anyhow::Result<(Vec<Sample>, Vec<Option<f32>>, usize)> {
    let mut flat: Vec<Sample> = groups.into_iter().flatten().collect();
    let (rewards, failed) = score(reward, &mut flat, cfg);
    if let Some(why) = reward.fatal() {
        anyhow::bail!("the reward stopped working: {why}");
    }
    Ok((flat, rewards, failed))
}
