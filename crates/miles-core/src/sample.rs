use serde::{Deserialize, Deserializer, Serialize};

use crate::RewardValue;

/// One chat message, as in HF chat templates.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// A prompt is either plain text or a list of chat messages (to go through the chat template).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Messages(Vec<Message>),
}

impl Default for Prompt {
    fn default() -> Self {
        Prompt::Text(String::new())
    }
}

/// Where a sample is in its life. `Truncated` means the response hit the length limit;
/// `Aborted` means generation was stopped early (a partial rollout, resumed later); `Failed`
/// means something (the engine, the reward) could not finish it and it must not be trained on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    #[default]
    Pending,
    Completed,
    Truncated,
    Aborted,
    Failed,
}

/// The experts the rollout engine routed each response token to (Rollout Routing Replay):
/// `ids[(token * num_layers + layer) * top_k + k]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoutedExperts {
    pub num_layers: usize,
    pub top_k: usize,
    pub ids: Vec<u16>,
}

impl RoutedExperts {
    /// Tokens covered; errors if `ids` is not a whole number of [layers × top_k] rows.
    pub fn num_tokens(&self) -> crate::Result<usize> {
        let row = self.num_layers * self.top_k;
        if row == 0 || !self.ids.len().is_multiple_of(row) {
            return Err(crate::Error::Invalid(format!(
                "routed experts: {} ids is not a multiple of num_layers {} × top_k {}",
                self.ids.len(),
                self.num_layers,
                self.top_k
            )));
        }
        Ok(self.ids.len() / row)
    }
}

/// One prompt's one response, from the data source through rollout, reward and training.
/// Field names follow slime's `Sample` so JSONL written by either reads in the other.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Sample {
    /// Which prompt group (one prompt, `n_samples_per_prompt` responses) this belongs to.
    pub group_index: usize,
    /// Position in the whole rollout batch.
    pub index: usize,
    pub prompt: Prompt,
    /// Prompt ids followed by response ids.
    pub tokens: Vec<u32>,
    pub response: String,
    /// Number of response tokens at the end of `tokens`.
    pub response_length: usize,
    #[serde(deserialize_with = "label_from_any", skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward: Option<RewardValue>,
    /// One entry per response token: 1 trains on the token, 0 skips it (tool output, say).
    pub loss_mask: Vec<u8>,
    pub status: Status,
    pub metadata: serde_json::Value,
    /// log p(token) under the rollout engine's sampling distribution, per response token.
    pub rollout_log_probs: Vec<f32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout_routed_experts: Option<RoutedExperts>,
    /// The policy version that generated the response (grows with every weight sync); of a
    /// response continued over several versions (partial rollout), the newest.
    pub weight_version: u64,
    /// Per response token, the policy version that generated it, when they are not all
    /// `weight_version` (a response continued after a weight sync); empty otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub weight_versions: Vec<u64>,
}

impl Sample {
    /// The policy version that generated each response token.
    pub fn token_versions(&self) -> Vec<u64> {
        let mut v = self.weight_versions.clone();
        v.resize(self.response_length, self.weight_version);
        v
    }

    /// Prompt tokens, i.e. `tokens` before the response. Errors if `response_length` overruns.
    pub fn prompt_length(&self) -> crate::Result<usize> {
        self.tokens.len().checked_sub(self.response_length).ok_or_else(|| {
            crate::Error::Invalid(format!(
                "sample {}: response_length {} exceeds its {} tokens",
                self.index,
                self.response_length,
                self.tokens.len()
            ))
        })
    }
}

/// Labels in datasets are usually strings, but numeric answers are common (GSM8K-style
/// `"answer": 42`); keep them as their JSON text instead of refusing the line.
fn label_from_any<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    use serde::de::Error;
    match serde_json::Value::deserialize(d)? {
        serde_json::Value::Null => Ok(None),
        serde_json::Value::String(s) => Ok(Some(s)),
        v @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => Ok(Some(v.to_string())),
        other => Err(D::Error::custom(format!(
            "label must be a string, number or boolean, found {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn full_sample() -> Sample {
        Sample {
            group_index: 3,
            index: 13,
            prompt: Prompt::Messages(vec![
                Message { role: "system".into(), content: "Be brief.".into() },
                Message { role: "user".into(), content: "1+1?".into() },
            ]),
            tokens: vec![5, 6, 7, 8, 9],
            response: "2".into(),
            response_length: 2,
            label: Some("2".into()),
            reward: Some(RewardValue::Named(BTreeMap::from([
                ("acc".to_string(), 1.0),
                ("format".to_string(), 0.5),
            ]))),
            loss_mask: vec![1, 0],
            status: Status::Truncated,
            metadata: serde_json::json!({"source": "unit", "k": [1, 2]}),
            rollout_log_probs: vec![-0.25, -1.5],
            rollout_routed_experts: Some(RoutedExperts {
                num_layers: 2,
                top_k: 2,
                ids: vec![0, 1, 2, 3, 4, 5, 6, 7],
            }),
            weight_version: 7,
            weight_versions: vec![6, 7],
        }
    }

    #[test]
    fn sample_round_trips_through_json() {
        let s = full_sample();
        let text = serde_json::to_string(&s).unwrap();
        let back: Sample = serde_json::from_str(&text).unwrap();
        assert_eq!(back, s);
        assert_eq!(back.prompt_length().unwrap(), 3);
        assert_eq!(back.rollout_routed_experts.unwrap().num_tokens().unwrap(), 2);
    }

    #[test]
    fn minimal_line_fills_defaults_and_accepts_numeric_labels() {
        let s: Sample =
            serde_json::from_str(r#"{"prompt": "2+2?", "response": "4", "label": 4}"#).unwrap();
        assert_eq!(s.prompt, Prompt::Text("2+2?".into()));
        assert_eq!(s.label.as_deref(), Some("4"));
        assert_eq!(s.status, Status::Pending);
        assert!(s.reward.is_none());
        let bad = serde_json::from_str::<Sample>(r#"{"label": [1]}"#).unwrap_err();
        assert!(bad.to_string().contains("label must be"), "{bad}");
    }

    #[test]
    fn status_uses_snake_case_names() {
        assert_eq!(serde_json::to_string(&Status::Truncated).unwrap(), "\"truncated\"");
        assert!(serde_json::from_str::<Status>("\"done\"").is_err());
    }

    #[test]
    fn overlong_response_length_is_an_error() {
        let s = Sample { tokens: vec![1], response_length: 2, ..Default::default() };
        assert!(s.prompt_length().is_err());
        let r = RoutedExperts { num_layers: 2, top_k: 2, ids: vec![0; 6] };
        assert!(r.num_tokens().is_err());
    }
}
