//! Python generate functions: `--custom-generate-function-path FILE.py:FUNCTION` runs slime's
//! contract in the same long-lived worker as Python rewards ([`super`]; its restarts,
//! bisection and timeouts, `[generate FILE:FUNCTION]` on forwarded stderr):
//!
//! ```python
//! async def generate(args, sample, sampling_params) -> Sample: ...
//! ```
//!
//! `args.sglang_router_ip` and `args.sglang_router_port` name the rollout engine's HTTP
//! server (SGLang's `/generate`, `/tokenize`, `/detokenize`, `miles_server`), with the run's
//! rollout flags beside them (`args.rollout_max_response_len`, …). `sample` is a dict that also
//! reads as an object: `prompt`, `tokens` (the prompt's ids, the chat template applied as the
//! run applies it), `label`, `metadata`, `index`, `group_index`, `status`; `sampling_params`
//! SGLang's (`temperature`, `top_p`, `top_k`, `max_new_tokens`, `stop`), a fresh copy per call.
//! The function returns the sample (or a list of one) with `tokens` (prompt and response ids),
//! `response_length`, `response`, and optionally `loss_mask` (0 for tokens not to train on:
//! tool output), `rollout_log_probs`, `status` and `metadata`. Where slime is not installed,
//! the worker provides `slime.utils.types.Sample` and `slime.utils.http_utils.post`, so
//! slime's generate functions import unchanged. The samples of a batch run concurrently on
//! one event loop.
//!
//! # Protocol (besides the reward's)
//!
//! ```text
//! miles → worker   {"args": {…}, "mode": "generate"}
//! miles → worker   {"id": 3, "group": false, "sampling_params": {…}, "samples": [{…, "tokens": […]}]}
//! worker → miles   {"id": 3, "results": [{"sample": {"tokens": […], "response_length": 7,
//!                   "response": "…", "loss_mask": […], "rollout_log_probs": […],
//!                   "status": "completed", "metadata": {…}}}, {"error": "…"}]}
//! ```
//!
//! What the trainer then checks (that every trained token is the engine's, with the engine's
//! logprob) is `miles_train`'s: this module only runs the function and reads what it returns.

use std::path::PathBuf;

use miles_core::{Sample, Status};
use serde_json::{Value, json};

use super::{PythonRewardConfig, PythonWorker, Role, sample_payload};

/// A generate function in a worker process; see the module documentation.
#[derive(Debug)]
pub struct PythonGenerate(PythonWorker);

/// What a generate function returned for one sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// Prompt and response ids.
    pub tokens: Vec<u32>,
    pub response_length: usize,
    pub response: String,
    /// Per response token, 1 to train on it; `None`: all trained.
    pub loss_mask: Option<Vec<u8>>,
    /// Per response token; `None`: the engine's are taken.
    pub rollout_log_probs: Option<Vec<f32>>,
    pub status: Status,
    /// `None`: the sample's own stay.
    pub metadata: Option<Value>,
}

impl PythonGenerate {
    /// Starts the worker and imports the function (errors name the flag, file and function).
    pub fn start(
        file: impl Into<PathBuf>,
        function: &str,
        python: Option<PathBuf>,
        config: PythonRewardConfig,
    ) -> miles_core::Result<PythonGenerate> {
        PythonWorker::start(Role::Generate, file.into(), function, python, config)
            .map(PythonGenerate)
    }

    /// `FILE:FUNCTION`.
    pub fn label(&self) -> &str {
        self.0.label()
    }

    /// Runs the function on every sample (concurrently when it is `async`) with SGLang's
    /// `sampling_params`: per sample, what it returned or why it failed.
    pub fn generate(
        &self,
        samples: &[Sample],
        sampling_params: &Value,
    ) -> Vec<Result<Generated, String>> {
        let items = samples
            .iter()
            .map(|s| {
                let mut payload = sample_payload(s);
                payload["tokens"] = json!(s.tokens);
                payload["loss_mask"] = json!([]);
                payload["rollout_log_probs"] = json!([]);
                payload
            })
            .collect();
        let extra = json!({"sampling_params": sampling_params});
        let label = self.label().to_string();
        self.0
            .run(items, false, &extra)
            .into_iter()
            .map(|r| r.and_then(|item| decode_generated(&label, &item)))
            .collect()
    }

    /// Why the function can run no more (it failed more than `max_restarts` times in a row).
    pub fn fatal(&self) -> Option<String> {
        self.0.stopped()
    }
}

/// One result of the worker's answer: `{"sample": {…}}` or `{"error": message}`.
fn decode_generated(label: &str, item: &Value) -> Result<Generated, String> {
    let bad = |what: String| format!("python generate function {label}: {what}");
    let sample = match (item.get("sample"), item.get("error")) {
        (Some(Value::Object(sample)), _) => sample,
        (_, Some(Value::String(message))) => return Err(message.clone()),
        _ => return Err(bad(format!("the worker answered {item}, not a sample"))),
    };
    let ids = |key: &str| -> Result<Vec<u64>, String> {
        match sample.get(key) {
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| v.as_u64().ok_or_else(|| bad(format!("{key}: {v} is not an id"))))
                .collect(),
            other => Err(bad(format!("{key}: {other:?} is not a list"))),
        }
    };
    let tokens: Vec<u32> = ids("tokens")?
        .into_iter()
        .map(|t| u32::try_from(t).map_err(|_| bad(format!("tokens: {t} is not a token id"))))
        .collect::<Result<_, _>>()?;
    let response_length = sample
        .get("response_length")
        .and_then(Value::as_u64)
        .map(|n| n as usize)
        .filter(|&n| n <= tokens.len())
        .ok_or_else(|| bad(format!("response_length is not a count ≤ {}", tokens.len())))?;
    let per_token = |key: &str| -> Result<Option<Vec<f64>>, String> {
        let Some(v) = sample.get(key) else { return Ok(None) };
        let items = v.as_array().ok_or_else(|| bad(format!("{key}: not a list")))?;
        if items.len() != response_length {
            return Err(bad(format!(
                "{} {key} for a response of {response_length} tokens",
                items.len()
            )));
        }
        let values: Option<Vec<f64>> = items.iter().map(Value::as_f64).collect();
        values.map(Some).ok_or_else(|| bad(format!("{key}: not all numbers")))
    };
    let loss_mask = per_token("loss_mask")?
        .map(|m| {
            m.into_iter()
                .map(|x| match x {
                    0.0 => Ok(0),
                    1.0 => Ok(1),
                    _ => Err(bad(format!("loss_mask: {x} is not 0 or 1"))),
                })
                .collect::<Result<Vec<u8>, _>>()
        })
        .transpose()?;
    let rollout_log_probs =
        per_token("rollout_log_probs")?.map(|l| l.into_iter().map(|x| x as f32).collect());
    let status = match sample.get("status") {
        None => Status::Completed,
        Some(v) => serde_json::from_value(v.clone())
            .map_err(|_| bad(format!("status {v} is not a sample status")))?,
    };
    let response = match sample.get("response") {
        None => String::new(),
        Some(Value::String(r)) => r.clone(),
        Some(other) => return Err(bad(format!("response: {other} is not text"))),
    };
    Ok(Generated {
        tokens,
        response_length,
        response,
        loss_mask,
        rollout_log_probs,
        status,
        metadata: sample.get("metadata").cloned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FUNCTIONS: &str = r#"
import asyncio
from slime.utils.types import Sample

async def generate(args, sample, sampling_params):
    await asyncio.sleep(0.01)
    if sample.index == 2:
        raise ValueError("the tool is down")
    sample.tokens = sample.tokens + [5, 6, 7]
    sample.response_length = 3
    sample.response = "x<tool>y"
    sample.loss_mask = [1, 0, 1]
    sample.status = Sample.Status.TRUNCATED
    sample.metadata = {"max": sampling_params["max_new_tokens"], "port": args.sglang_router_port}
    sampling_params["max_new_tokens"] = 0  # a copy: the next sample's stays
    return [sample]

def bad_length(args, sample, sampling_params):
    sample.tokens = sample.tokens + [1]
    sample.rollout_log_probs = [0.5, 0.5]
    return sample

def two_arguments(args, sample):
    return sample
"#;

    /// slime's contract in the worker: the slime import provided, samples concurrent, a
    /// failure per sample, a copy of the sampling parameters per call; bad returns and
    /// signatures named.
    #[test]
    fn generate_functions_run_as_slime_calls_them() {
        if std::process::Command::new("python3").arg("--version").output().is_err() {
            eprintln!("skipped: no python3 on PATH");
            return;
        }
        let dir = std::env::temp_dir().join(format!("miles-generate-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("gen.py");
        std::fs::write(&file, FUNCTIONS).unwrap();
        let config = PythonRewardConfig::from_json(&json!({"sglang_router_port": 31000})).unwrap();
        let g = PythonGenerate::start(&file, "generate", None, config.clone()).unwrap();
        let samples: Vec<Sample> =
            (0..4).map(|index| Sample { index, tokens: vec![1, 2], ..Sample::default() }).collect();
        let out = g.generate(&samples, &json!({"max_new_tokens": 9, "temperature": 1.0}));
        assert_eq!(out.len(), 4);
        for (i, r) in out.iter().enumerate() {
            if i == 2 {
                assert_eq!(r.as_ref().unwrap_err(), "ValueError: the tool is down");
                continue;
            }
            let r = r.as_ref().unwrap();
            assert_eq!((r.tokens.as_slice(), r.response_length), (&[1u32, 2, 5, 6, 7][..], 3));
            assert_eq!(r.loss_mask.as_deref(), Some(&[1u8, 0, 1][..]));
            assert_eq!((r.status, r.rollout_log_probs.as_ref()), (Status::Truncated, None));
            assert_eq!(r.metadata, Some(json!({"max": 9, "port": 31000})));
        }
        let bad = PythonGenerate::start(&file, "bad_length", None, config.clone()).unwrap();
        let e = bad.generate(&samples[..1], &json!({})).remove(0).unwrap_err();
        assert!(e.contains("2 rollout_log_probs for a response of 1 tokens"), "{e}");
        let e = PythonGenerate::start(&file, "two_arguments", None, config).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("--custom-generate-function-path") && e.contains("sampling_params"),
            "{e}"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn worker_answers_read_as_samples_and_bad_ones_are_named() {
        let item = json!({"sample": {"tokens": [1, 2, 3, 4], "response_length": 2,
            "response": "ab", "loss_mask": [1, 0], "rollout_log_probs": [-0.5, -1.25],
            "status": "truncated", "metadata": {"turns": 2}}});
        let g = decode_generated("f.py:g", &item).unwrap();
        assert_eq!(g.tokens, [1, 2, 3, 4]);
        assert_eq!((g.response_length, g.response.as_str()), (2, "ab"));
        assert_eq!(g.loss_mask.as_deref(), Some(&[1u8, 0][..]));
        assert_eq!(g.rollout_log_probs.as_deref(), Some(&[-0.5f32, -1.25][..]));
        assert_eq!((g.status, g.metadata), (Status::Truncated, Some(json!({"turns": 2}))));
        let plain =
            decode_generated("f", &json!({"sample": {"tokens": [7], "response_length": 1}}));
        let plain = plain.unwrap();
        assert_eq!(
            (plain.loss_mask, plain.rollout_log_probs, plain.status),
            (None, None, Status::Completed)
        );
        assert_eq!(
            decode_generated("f", &json!({"error": "ValueError: x"})).unwrap_err(),
            "ValueError: x"
        );
        for (bad, says) in [
            (json!({"sample": {"tokens": [1], "response_length": 2}}), "response_length"),
            (json!({"sample": {"tokens": [-1], "response_length": 0}}), "is not an id"),
            (
                json!({"sample": {"tokens": [4_294_967_296u64], "response_length": 0}}),
                "not a token id",
            ),
            (
                json!({"sample": {"tokens": [1, 2], "response_length": 1, "loss_mask": [2]}}),
                "not 0 or 1",
            ),
            (
                json!({"sample": {"tokens": [1], "response_length": 1, "loss_mask": [1, 1]}}),
                "2 loss_mask",
            ),
            (json!({"sample": {"tokens": [1], "response_length": 1, "status": "done"}}), "status"),
            (json!({"result": 1}), "not a sample"),
        ] {
            let e = decode_generated("f.py:g", &bad).unwrap_err();
            assert!(e.contains(says), "{e}");
        }
    }
}
