//! `f1`: token-level F1 between the response and the label, the SQuAD/HotpotQA answer metric
//! as slime's reward hub computes it.

use std::collections::HashMap;

use miles_core::{Factory, Plugin, Registration, Reward, RewardError, RewardValue, Sample};

pub static PLUGIN: Plugin = Plugin {
    name: "f1",
    version: env!("CARGO_PKG_VERSION"),
    description: "token-level F1 in [0, 1] between response and label after SQuAD-style \
                  normalization (case, punctuation, articles)",
    factory: Factory::Reward(|_config| Ok(Box::new(TokenF1))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// Token F1 of the response against the label, in [0, 1]; see [`f1_score`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TokenF1;

impl Reward for TokenF1 {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let label = crate::require_label(sample, "f1")?;
        Ok(RewardValue::Scalar(f1_score(&sample.response, label)))
    }
}

/// Python's `string.punctuation` plus the typographic quotes slime adds.
fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation() || matches!(c, '‘' | '’' | '´' | '`')
}

/// SQuAD answer normalization as slime writes it: `_` → space, lowercase, punctuation → space,
/// the words `a`/`an`/`the` → space, then the whitespace-separated tokens.
pub fn normalize_tokens(text: &str) -> Vec<String> {
    let spaced: String = text
        .replace('_', " ")
        .to_lowercase()
        .chars()
        .map(|c| if is_punctuation(c) { ' ' } else { c })
        .collect();
    // Articles go by whole words, a word being a run of letters, digits and underscores.
    let mut out = String::with_capacity(spaced.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if matches!(word.as_str(), "a" | "an" | "the") {
            out.push(' ');
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in spaced.chars() {
        if c.is_alphanumeric() || c == '_' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out.split_whitespace().map(str::to_string).collect()
}

/// slime reads Python booleans written as text as yes/no answers.
fn as_yes_no(s: &str) -> &str {
    match s {
        "True" => "yes",
        "False" => "no",
        other => other,
    }
}

/// Token-level F1 of `prediction` against `truth`: 2PR/(P+R) over the multiset of shared
/// normalized tokens. `True`/`False` read as `yes`/`no`; when either side normalizes to `yes`,
/// `no` or `noanswer` the other must normalize to the same text, else the score is 0. No shared
/// token (an empty side included) scores 0.
pub fn f1_score(prediction: &str, truth: &str) -> f64 {
    let predicted = normalize_tokens(as_yes_no(prediction));
    let reference = normalize_tokens(as_yes_no(truth));
    let is_special = |tokens: &[String]| matches!(tokens, [t] if ["yes", "no", "noanswer"].contains(&t.as_str()));
    if (is_special(&predicted) || is_special(&reference)) && predicted != reference {
        return 0.0;
    }
    let mut counts: HashMap<&str, usize> = HashMap::new();
    for token in &reference {
        *counts.entry(token).or_default() += 1;
    }
    let mut shared = 0usize;
    for token in &predicted {
        if let Some(n) = counts.get_mut(token.as_str()).filter(|n| **n > 0) {
            *n -= 1;
            shared += 1;
        }
    }
    if shared == 0 {
        return 0.0;
    }
    let precision = shared as f64 / predicted.len() as f64;
    let recall = shared as f64 / reference.len() as f64;
    2.0 * precision * recall / (precision + recall)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-12
    }

    #[test]
    fn normalization_drops_case_punctuation_and_articles() {
        assert_eq!(
            normalize_tokens("The  Eiffel-Tower, in Paris!"),
            ["eiffel", "tower", "in", "paris"]
        );
        assert_eq!(normalize_tokens("an apple a day"), ["apple", "day"]);
        assert_eq!(normalize_tokens("theatre another"), ["theatre", "another"]);
        assert_eq!(normalize_tokens("new_york ‘quoted’"), ["new", "york", "quoted"]);
        assert!(normalize_tokens(" the ... a ").is_empty());
    }

    #[test]
    fn f1_matches_hand_computed_values() {
        assert!(close(f1_score("Paris", "paris."), 1.0));
        // P = 1/3, R = 1: F1 = 2·(1/3)/(4/3) = 0.5.
        assert!(close(f1_score("it is Paris", "Paris"), 0.5));
        // Shared {barack, obama}: P = 2/2, R = 2/3 → 0.8.
        assert!(close(f1_score("Barack Obama", "Barack Hussein Obama"), 0.8));
        // Repeated tokens count once per occurrence in the label: shared 1, P = 1/3, R = 1.
        assert!(close(f1_score("cat cat cat", "cat"), 0.5));
        assert_eq!(f1_score("dog", "cat"), 0.0);
        assert_eq!(f1_score("", "cat"), 0.0);
        assert_eq!(f1_score("the", "a"), 0.0);
    }

    #[test]
    fn yes_no_answers_must_match_exactly() {
        assert_eq!(f1_score("yes", "yes."), 1.0);
        assert_eq!(f1_score("True", "yes"), 1.0);
        assert_eq!(f1_score("False", "yes"), 0.0);
        assert_eq!(f1_score("yes", "yes it is"), 0.0);
        assert_eq!(f1_score("no answer", "noanswer"), 0.0);
    }

    #[test]
    fn scores_through_the_reward_and_needs_a_label() {
        let sample = Sample {
            response: "Barack Obama".into(),
            label: Some("Obama".into()),
            ..Default::default()
        };
        let RewardValue::Scalar(v) = TokenF1.score(&sample).unwrap() else { panic!("not scalar") };
        assert!(close(v, 2.0 / 3.0));
        let err = TokenF1.score(&Sample::default()).unwrap_err().to_string();
        assert!(err.contains("f1") && err.contains("no label"), "{err}");
    }
}
