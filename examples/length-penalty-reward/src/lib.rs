//! A reward plugin for `miles --custom-rm-path`: 1 when the response contains the label, minus a
//! penalty per character beyond a target length (long-winded answers cost). The template for
//! writing your own: implement `RewardPlugin`, call `export_reward_plugin!`, build the cdylib.
//!
//! Configuration (`--custom-rm-config`), all optional:
//! `{"target_chars": 200, "penalty_per_char": 0.002, "max_penalty": 1.0}`.

use miles_plugin_abi::{PluginReward, PluginSample, RewardPlugin, export_reward_plugin};
use serde::Deserialize;

#[derive(Debug, Deserialize)]
#[serde(default, deny_unknown_fields)]
struct LengthPenalty {
    target_chars: usize,
    penalty_per_char: f64,
    max_penalty: f64,
}

impl Default for LengthPenalty {
    fn default() -> Self {
        LengthPenalty { target_chars: 200, penalty_per_char: 0.002, max_penalty: 1.0 }
    }
}

impl RewardPlugin for LengthPenalty {
    fn new(config: serde_json::Value) -> Result<Self, String> {
        let plugin: LengthPenalty = if config.is_null() {
            LengthPenalty::default()
        } else {
            serde_json::from_value(config).map_err(|e| format!("length_penalty config: {e}"))?
        };
        if plugin.penalty_per_char < 0.0 || plugin.max_penalty < 0.0 {
            return Err("length_penalty config: penalties must be >= 0".into());
        }
        Ok(plugin)
    }

    fn score(&mut self, sample: &PluginSample) -> Result<PluginReward, String> {
        let label = sample.label.as_deref().map(str::trim).filter(|l| !l.is_empty());
        let label = label.ok_or("sample has no label to look for in the response")?;
        let correct = if sample.response.contains(label) { 1.0 } else { 0.0 };
        let excess = sample.response.chars().count().saturating_sub(self.target_chars);
        let penalty = (excess as f64 * self.penalty_per_char).min(self.max_penalty);
        Ok(PluginReward::Scalar(correct - penalty))
    }
}

export_reward_plugin!(LengthPenalty, "length_penalty");

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(response: &str, label: Option<&str>) -> PluginSample {
        PluginSample {
            response: response.into(),
            label: label.map(Into::into),
            ..Default::default()
        }
    }

    #[test]
    fn rewards_the_label_and_penalizes_length() {
        let config = serde_json::json!({"target_chars": 10, "penalty_per_char": 0.1});
        let mut p = LengthPenalty::new(config).unwrap();
        assert_eq!(p.score(&sample("it is 42", Some("42"))).unwrap(), PluginReward::Scalar(1.0));
        let long = "the answer, after much thought, is 42"; // 37 chars: 27 over
        let PluginReward::Scalar(v) = p.score(&sample(long, Some("42"))).unwrap() else {
            panic!("scalar expected")
        };
        assert!((v - 0.0).abs() < 1e-9, "{v}"); // penalty capped at max_penalty 1.0
        assert_eq!(p.score(&sample("41", Some("42"))).unwrap(), PluginReward::Scalar(0.0));
        assert!(p.score(&sample("41", None)).is_err());
        assert!(LengthPenalty::new(serde_json::json!({"target": 3})).is_err());
    }
}
