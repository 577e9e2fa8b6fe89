use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::Sample;

/// A reward: one number, or several named ones (accuracy, format, length…) of which the run
/// trains on one (`--reward-key`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum RewardValue {
    Scalar(f64),
    Named(BTreeMap<String, f64>),
}

impl RewardValue {
    /// The number to train on: the scalar itself, or the entry `key` of a named reward.
    pub fn scalar(&self, key: Option<&str>) -> Result<f64, RewardError> {
        match (self, key) {
            (RewardValue::Scalar(v), _) => Ok(*v),
            (RewardValue::Named(map), Some(k)) => map.get(k).copied().ok_or_else(|| {
                let keys: Vec<&str> = map.keys().map(String::as_str).collect();
                RewardError::new(format!(
                    "reward has no key '{k}' (it has: {}); set --reward-key to one of those",
                    keys.join(", ")
                ))
            }),
            (RewardValue::Named(map), None) => Err(RewardError::new(format!(
                "the reward is a map ({}), so --reward-key must say which entry to train on",
                map.keys().cloned().collect::<Vec<_>>().join(", ")
            ))),
        }
    }
}

/// Why one sample could not be scored. The sample is marked `Failed` and counted; a run never
/// stops for it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct RewardError(pub String);

impl RewardError {
    pub fn new(message: impl Into<String>) -> Self {
        RewardError(message.into())
    }
}

/// Scores responses. Implementations are shared across rollout workers, hence `Sync`.
pub trait Reward: Send + Sync {
    /// Scores one sample.
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError>;

    /// Scores samples that belong together: one prompt's group, or a batch handed to a plugin or
    /// a remote reward model in one call. Returns one result per sample, in order. Group rewards
    /// (`--group-rm`, pairwise judges) override this; the default scores each sample alone.
    fn score_group(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        samples.iter().map(|s| self.score(s)).collect()
    }

    /// Why this reward can score nothing more (a worker process that failed again and again),
    /// so the run stops with that error instead of going on with every sample failed. `None`
    /// while it works.
    fn fatal(&self) -> Option<String> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_and_named_rewards_pick_the_training_number() {
        assert_eq!(RewardValue::Scalar(0.5).scalar(None).unwrap(), 0.5);
        let named = RewardValue::Named(BTreeMap::from([("acc".into(), 1.0)]));
        assert_eq!(named.scalar(Some("acc")).unwrap(), 1.0);
        let err = named.scalar(Some("fmt")).unwrap_err().to_string();
        assert!(err.contains("no key 'fmt'") && err.contains("acc"), "{err}");
        assert!(named.scalar(None).unwrap_err().to_string().contains("--reward-key"));
    }

    #[test]
    fn reward_values_serialize_as_plain_json() {
        assert_eq!(serde_json::to_string(&RewardValue::Scalar(1.0)).unwrap(), "1.0");
        let v: RewardValue = serde_json::from_str(r#"{"a": 1, "b": 0.5}"#).unwrap();
        assert_eq!(v.scalar(Some("b")).unwrap(), 0.5);
    }
}
