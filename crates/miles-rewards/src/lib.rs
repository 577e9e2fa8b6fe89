//! Built-in rewards, each registered with the core registry under its `--rm-type` name.
//! [`BUILTIN`] names every registration so the driver can keep this crate linked.
//!
//! | `--rm-type`   | reward                                                                    |
//! |---------------|---------------------------------------------------------------------------|
//! | `exact_match` | 1 if the trimmed response equals the trimmed label, else 0                |
//! | `math`        | 1 if the final answer (last `\boxed{}`/`\fbox{}`, else after the last `####`, else the last number) equals the label's answer after normalization, numbers compared as exact rationals (`0.5` = `1/2` = `\frac{1}{2}`), else 0 |
//! | `dapo`        | DAPO-Math: +1 if the last `Answer:` line of the response's last 300 characters, normalized as DAPO does, equals the integer label, else −1 |
//! | `deepscaler`  | DeepScaleR: 1 if the last `\boxed{}` after the last `</think>` matches the label (Hendrycks MATH normalization, or exact numeric equality), else 0; no `</think>` scores 0 |
//! | `f1`          | token-level F1 in [0, 1] between response and label after SQuAD normalization (case, punctuation, articles) |
//! | `remote_rm`   | the number an HTTP reward server answers to a JSON POST of `{prompt, response, label, metadata}` (config `url`, `timeout_secs`, `max_retries`, `backoff_ms`, `group`, `concurrency`) |
//!
//! Every reward except `remote_rm` compares against the sample's label, and a sample without
//! one is a per-sample [`miles_core::RewardError`] naming the reward.
//!
//! [`PythonReward`] (`--custom-rm-path FILE.py:FUNCTION`) runs a Python function in a worker
//! process; it is created by the driver, not registered (see [`python`] for its protocol).

mod dapo;
mod deepscaler;
mod exact_match;
mod f1;
mod http;
mod latex;
mod math;
pub mod python;
mod remote_rm;

pub use dapo::{Dapo, normalize_final_answer};
pub use deepscaler::DeepScaler;
pub use exact_match::ExactMatch;
pub use f1::{TokenF1, f1_score};
pub use latex::{Rational, last_boxed, parse_number};
pub use math::{MathAnswer, answers_match, normalize_answer};
pub use python::generate::{Generated, PythonGenerate};
pub use python::{PythonReward, PythonRewardConfig, python_spec};
pub use remote_rm::{RemoteRm, RemoteRmConfig};

use miles_core::{Reward, RewardError, RewardValue, Sample};

/// Samples per reward call when samples are independent (plugins receive them as one batch).
const BATCH: usize = 256;

/// Scores `samples` in order, one result each: whole prompt groups (consecutive samples of one
/// `group_index`) per call with `by_group` (`--group-rm`), else batches of independent samples.
/// A batch whose every sample fails is usually one sample breaking the call (a plugin panic),
/// so those samples are scored again one by one and only the culprit is marked failed.
pub fn score_all(
    reward: &dyn Reward,
    samples: &[Sample],
    by_group: bool,
) -> Vec<Result<RewardValue, RewardError>> {
    let mut results = Vec::with_capacity(samples.len());
    if by_group {
        for group in samples.chunk_by(|a, b| a.group_index == b.group_index) {
            results.extend(reward.score_group(group));
        }
    } else {
        for batch in samples.chunks(BATCH) {
            let scored = reward.score_group(batch);
            if batch.len() > 1 && scored.iter().all(Result::is_err) {
                results.extend(batch.iter().map(|s| reward.score(s)));
            } else {
                results.extend(scored);
            }
        }
    }
    results
}

/// Every reward this crate registers.
pub static BUILTIN: &[&miles_core::Plugin] = &[
    &exact_match::PLUGIN,
    &math::PLUGIN,
    &dapo::PLUGIN,
    &deepscaler::PLUGIN,
    &f1::PLUGIN,
    &remote_rm::PLUGIN,
];

/// The sample's label, or an error saying that `reward` needs one.
pub(crate) fn require_label<'a>(sample: &'a Sample, reward: &str) -> Result<&'a str, RewardError> {
    sample.label.as_deref().ok_or_else(|| {
        RewardError::new(format!(
            "sample {} has no label: {reward} compares the response with the reference answer \
             in the `label` field",
            sample.index
        ))
    })
}

#[cfg(test)]
mod tests {
    use miles_core::registry;

    use super::*;

    #[test]
    fn every_builtin_is_registered_under_its_name() {
        let names: Vec<&str> = BUILTIN.iter().map(|p| p.name).collect();
        assert_eq!(names, ["exact_match", "math", "dapo", "deepscaler", "f1", "remote_rm"]);
        for plugin in BUILTIN {
            let found = registry::find(miles_core::PluginKind::Reward, plugin.name).unwrap();
            assert!(std::ptr::eq(found, *plugin), "{}", plugin.name);
        }
        for name in ["exact_match", "math", "dapo", "deepscaler", "f1"] {
            assert!(registry::create_reward(name, &serde_json::Value::Null).is_ok(), "{name}");
        }
        let err = registry::create_reward("remote_rm", &serde_json::Value::Null).err().unwrap();
        assert!(err.to_string().starts_with("--rm-url:"), "{err}");
    }

    /// The answer parsers slice strings by byte offsets; pieces of LaTeX, multi-byte
    /// characters and unbalanced braces glued at random must never make them panic.
    #[test]
    fn rule_rewards_never_panic_on_fragments_of_latex_and_unicode() {
        const PIECES: [&str; 34] = [
            "\\boxed{",
            "\\fbox{",
            "\\boxed",
            "}",
            "{",
            "\\frac",
            "\\dfrac",
            "\\sqrt",
            "\\text{",
            "\\text{ ",
            "####",
            "Answer:",
            "answer",
            ":",
            "</think>",
            "###Response",
            "$",
            "\\$",
            "%",
            "-",
            "−",
            "é",
            "½",
            "中",
            "1",
            "23",
            ",000",
            ".",
            "/",
            "=",
            " ",
            "\n",
            "\\",
            "^\\circ",
        ];
        let rewards: Vec<Box<dyn miles_core::Reward>> = ["math", "dapo", "deepscaler", "f1"]
            .iter()
            .map(|name| registry::create_reward(name, &serde_json::Value::Null).unwrap())
            .chain([
                Box::new(Dapo { strict_box: true }) as Box<dyn miles_core::Reward>,
                Box::new(DeepScaler { require_think: false }),
            ])
            .collect();
        let mut state: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            (state >> 33) as usize
        };
        for _ in 0..1500 {
            let mut text =
                |n: usize| (0..n).map(|_| PIECES[next() % PIECES.len()]).collect::<String>();
            let (response, label) = (text(12), text(4));
            let sample = Sample { response, label: Some(label), ..Default::default() };
            for reward in &rewards {
                let value = reward.score(&sample).unwrap();
                let v = value.scalar(None).unwrap();
                assert!((-1.0..=1.0).contains(&v), "{v} for {sample:?}");
            }
        }
    }
}
