//! OpenAI's `/v1/completions` and `/v1/chat/completions` where they map onto the engine:
//! prompts as text, token ids or chat messages (through the checkpoint's chat template),
//! `max_tokens`, `temperature`, `top_p`, `n`, `stop`, `logprobs`; `top_k` and `ignore_eos`
//! as vLLM and SGLang take them. Streaming, penalties, `echo` and alternatives per token
//! (`top_logprobs`) are refused by name.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use miles_core::{Prompt, Sample, SamplingParams, Status};
use serde_json::{Map, Value, json};

use super::{Shared, bad_request, submit};

/// The sampling fields both endpoints share; `max_keys` names their length limit.
fn sampling(
    map: &Map<String, Value>,
    seed: u64,
    max_keys: &[&str],
) -> Result<(SamplingParams, usize), String> {
    // (OpenAI's completions default to 16 tokens; chat to the model's limit.)
    let mut p = SamplingParams { max_new_tokens: 16, seed, ..SamplingParams::default() };
    let mut n = 1;
    for (key, value) in map {
        let number = || value.as_f64().ok_or_else(|| format!("{key}: a number"));
        match key.as_str() {
            k if max_keys.contains(&k) => {
                p.max_new_tokens = value.as_u64().ok_or(format!("{k}: a count"))? as usize
            }
            "temperature" => p.temperature = number()? as f32,
            "top_p" => p.top_p = number()? as f32,
            "top_k" => {
                p.top_k = usize::try_from(value.as_i64().ok_or("top_k: an integer")?).unwrap_or(0)
            }
            "n" => n = super::count_of_samples(value, "n")?,
            "ignore_eos" => p.ignore_eos = value.as_bool().ok_or("ignore_eos: a boolean")?,
            "stop" => {
                p.stop = match value {
                    Value::Null => Vec::new(),
                    Value::String(s) => vec![s.clone()],
                    Value::Array(l) => l
                        .iter()
                        .map(|s| s.as_str().map(String::from))
                        .collect::<Option<_>>()
                        .ok_or("stop: a string or a list of strings")?,
                    _ => return Err("stop: a string or a list of strings".into()),
                }
            }
            "stream" if value == &Value::Bool(true) => {
                return Err("stream: streamed answers are not served; leave it out".into());
            }
            "presence_penalty" | "frequency_penalty" if value.as_f64().unwrap_or(0.0) != 0.0 => {
                return Err(format!("{key}: penalties are not applied here (0 or leave it out)"));
            }
            "top_logprobs" if value.as_u64().unwrap_or(0) != 0 => {
                return Err("top_logprobs: only the chosen tokens' logprobs are given (0)".into());
            }
            // Accepted and meaning nothing here: the draws are keyed by the server's seed.
            "model" | "user" | "seed" | "stream" | "presence_penalty" | "frequency_penalty"
            | "top_logprobs" | "logprobs" | "prompt" | "messages" | "echo" => {}
            other => return Err(format!("{other}: not a field this server takes")),
        }
    }
    Ok((p, n))
}

/// One token's text, as the API lists it.
fn token_text(shared: &Shared, id: u32) -> String {
    shared.tokenizer.as_ref().and_then(|t| t.decode(&[id], false).ok()).unwrap_or_default()
}

fn finish_reason(s: &Sample) -> &'static str {
    match s.status {
        Status::Truncated => "length",
        _ => "stop",
    }
}

fn usage(samples: &[Sample], prompts: usize, n: usize) -> Value {
    let completion: usize = samples.iter().map(|s| s.response_length).sum();
    // (Each prompt counted once, as OpenAI does for n > 1.)
    let prompt: usize = samples
        .iter()
        .step_by(n.max(1))
        .take(prompts)
        .map(|s| s.tokens.len() - s.response_length)
        .sum();
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
           "total_tokens": prompt + completion})
}

fn created() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn object(body: &[u8]) -> Result<Map<String, Value>, String> {
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Ok(map),
        Ok(_) => Err("the body is a JSON object".into()),
        Err(e) => Err(format!("the body is not JSON: {e}")),
    }
}

/// `prompt`: text, a list of texts, token ids, or a list of those.
fn completion_prompts(v: Option<&Value>) -> Result<Vec<Sample>, String> {
    let text = |t: &str| Sample { prompt: Prompt::Text(t.into()), ..Sample::default() };
    let ids = |v: &Value| -> Option<Sample> {
        let tokens: Option<Vec<u32>> =
            v.as_array()?.iter().map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok())).collect();
        Some(Sample { tokens: tokens?, ..Sample::default() })
    };
    match v {
        Some(Value::String(s)) => Ok(vec![text(s)]),
        Some(Value::Array(items)) if items.iter().all(Value::is_string) => {
            Ok(items.iter().map(|s| text(s.as_str().expect("checked"))).collect())
        }
        Some(v @ Value::Array(items)) if items.iter().all(Value::is_u64) => {
            Ok(vec![ids(v).ok_or("prompt: token ids below 2^32")?])
        }
        Some(Value::Array(items)) => items
            .iter()
            .map(ids)
            .collect::<Option<_>>()
            .ok_or_else(|| "prompt: text, token ids, or a list of either".into()),
        _ => Err("prompt: text, token ids, or a list of either".into()),
    }
}

/// A `/v1/completions` body: the prompts, their sampling, `n` and whether logprobs are asked.
pub(super) fn completion_request(
    body: &[u8],
    seed: u64,
) -> Result<(Vec<Sample>, SamplingParams, usize, bool), String> {
    let map = object(body)?;
    if map.get("echo").is_some_and(|e| e == &Value::Bool(true)) {
        return Err("echo: the prompt is not repeated here; leave it out".into());
    }
    let prompts = completion_prompts(map.get("prompt"))?;
    let (params, n) = sampling(&map, seed, &["max_tokens"])?;
    let logprobs = map.get("logprobs").is_some_and(|l| !l.is_null() && l != &json!(false));
    Ok((prompts, params, n, logprobs))
}

/// A `/v1/chat/completions` body: the messages (a list, for the template), their sampling,
/// `n` and whether logprobs are asked.
pub(super) fn chat_request(
    body: &[u8],
    seed: u64,
) -> Result<(Value, SamplingParams, usize, bool), String> {
    let mut map = object(body)?;
    let keys = ["max_tokens", "max_completion_tokens"];
    let (mut params, n) = sampling(&map, seed, &keys)?;
    if !keys.iter().any(|k| map.contains_key(*k)) {
        params.max_new_tokens = 1024;
    }
    let logprobs = map.get("logprobs").is_some_and(|l| l == &Value::Bool(true));
    let messages = map.remove("messages").filter(Value::is_array).ok_or("messages: a list")?;
    Ok((messages, params, n, logprobs))
}

pub(super) async fn completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let (prompts, params, n, logprobs) = match completion_request(&body, shared.seed) {
        Ok(p) => p,
        Err(message) => return bad_request(message),
    };
    let count = prompts.len();
    let samples = match submit(&shared, prompts, (&params, n), &[]).await {
        Ok(samples) => samples,
        Err(response) => return response,
    };
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let output = &s.tokens[s.tokens.len() - s.response_length..];
            let lp = logprobs.then(|| {
                let tokens: Vec<String> = output.iter().map(|&t| token_text(&shared, t)).collect();
                json!({"tokens": tokens, "token_logprobs": s.rollout_log_probs,
                       "top_logprobs": null, "text_offset": []})
            });
            json!({"index": i, "text": s.response, "logprobs": lp,
                   "finish_reason": finish_reason(s)})
        })
        .collect();
    axum::Json(json!({
        "id": format!("cmpl-{}", samples.first().map_or(0, |s| s.index)),
        "object": "text_completion",
        "created": created(),
        "model": shared.model_path,
        "choices": choices,
        "usage": usage(&samples, count, n),
    }))
    .into_response()
}

pub(super) async fn chat_completions(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let parsed = chat_request(&body, shared.seed).and_then(|(messages, params, n, logprobs)| {
        let tok = shared.tokenizer.as_ref().ok_or("the server has no tokenizer")?;
        if !tok.has_chat_template() {
            return Err("messages: the checkpoint's tokenizer has no chat template".into());
        }
        let tokens = tok.encode_prompt(&messages, true).map_err(|e| format!("messages: {e}"))?;
        Ok((Sample { tokens, ..Sample::default() }, params, n, logprobs))
    });
    let (prompt, params, n, logprobs) = match parsed {
        Ok(p) => p,
        Err(message) => return bad_request(message),
    };
    let samples = match submit(&shared, vec![prompt], (&params, n), &[]).await {
        Ok(samples) => samples,
        Err(response) => return response,
    };
    let choices: Vec<Value> = samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let output = &s.tokens[s.tokens.len() - s.response_length..];
            let lp = logprobs.then(|| {
                let content: Vec<Value> = output
                    .iter()
                    .zip(&s.rollout_log_probs)
                    .map(|(&t, lp)| {
                        let text = token_text(&shared, t);
                        json!({"token": text, "logprob": lp, "bytes": text.as_bytes(),
                               "top_logprobs": []})
                    })
                    .collect();
                json!({"content": content})
            });
            json!({"index": i, "message": {"role": "assistant", "content": s.response},
                   "logprobs": lp, "finish_reason": finish_reason(s)})
        })
        .collect();
    axum::Json(json!({
        "id": format!("chatcmpl-{}", samples.first().map_or(0, |s| s.index)),
        "object": "chat.completion",
        "created": created(),
        "model": shared.model_path,
        "choices": choices,
        "usage": usage(&samples, 1, n),
    }))
    .into_response()
}
