use miles_core::{Factory, Plugin, Registration, Reward, RewardError, RewardValue, Sample};

pub static PLUGIN: Plugin = Plugin {
    name: "exact_match",
    version: env!("CARGO_PKG_VERSION"),
    description: "1 if the response equals the label (surrounding whitespace ignored), else 0",
    factory: Factory::Reward(|_config| Ok(Box::new(ExactMatch))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// 1.0 when the trimmed response equals the trimmed label, 0.0 otherwise. A sample without a
/// label cannot be scored and says so.
#[derive(Debug, Clone, Copy, Default)]
pub struct ExactMatch;

impl Reward for ExactMatch {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let label = sample.label.as_deref().ok_or_else(|| {
            RewardError::new("sample has no label: exact_match compares the response to it")
        })?;
        let hit = sample.response.trim() == label.trim();
        Ok(RewardValue::Scalar(if hit { 1.0 } else { 0.0 }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn score(response: &str, label: Option<&str>) -> Result<RewardValue, RewardError> {
        let sample = Sample {
            response: response.into(),
            label: label.map(Into::into),
            ..Default::default()
        };
        ExactMatch.score(&sample)
    }

    #[test]
    fn compares_trimmed_text() {
        assert_eq!(score(" Paris\n", Some("Paris")).unwrap(), RewardValue::Scalar(1.0));
        assert_eq!(score("paris", Some("Paris")).unwrap(), RewardValue::Scalar(0.0));
        assert_eq!(score("42", Some("42 ")).unwrap(), RewardValue::Scalar(1.0));
    }

    #[test]
    fn missing_label_is_a_per_sample_error() {
        assert!(score("x", None).unwrap_err().to_string().contains("no label"));
    }
}
