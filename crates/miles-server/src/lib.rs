//! The embedded engine's HTTP face (`miles serve`): SGLang's native API over the engine's
//! continuous batching ([`miles_rollout::Engine::serve`]), so a client's tokens and logprobs
//! are the ones the trainer's own rollouts would get, bit for bit.
//!
//! - `POST /generate`: `input_ids` (a list, or a list of lists) or `text` (a string or a list),
//!   `sampling_params` (`temperature`, `top_p`, `top_k` (-1: off), `max_new_tokens`, `stop`,
//!   `stop_token_ids`, `ignore_eos`, `n`), `return_logprob`; answers `text`, `output_ids` and
//!   `meta_info` (`id`, `finish_reason` as SGLang's: `stop` with `matched`, `length`, `abort`,
//!   `prompt_tokens`, `completion_tokens`, `weight_version`, and with `return_logprob`
//!   `output_token_logprobs` as `[logprob, token id, null]`), one object per prompt and sample,
//!   a list when the request is a batch or `n` > 1.
//! - `POST /update_weights_from_disk` (`{"model_path": DIR}`, an HF checkpoint directory): a
//!   trainer's weight sync, taken after the requests before it; answers `success`, `message`
//!   and the new `weight_version`.
//! - `POST /v1/completions`, `POST /v1/chat/completions`: OpenAI's, where they map
//!   ([`openai`]).
//! - `POST /tokenize` (`prompt`: a string or a list, `add_special_tokens`, default true): the
//!   model's token ids (`tokens`, `count`), as SGLang answers them; `POST /detokenize`
//!   (`tokens`: ids or a list of lists, `skip_special_tokens`, default true): `text`. A
//!   multi-turn client tokenizes its tool outputs with the tokenizer the engine uses.
//! - `GET /health`, `GET /get_model_info`.
//!
//! A malformed request is answered 400 with `{"error": {"message": …}}` naming the field; the
//! server goes on.

use std::sync::Arc;
use std::sync::mpsc::Sender;

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use miles_core::{Prompt, Sample, SamplingParams, Status};
use miles_rollout::{Job, Request};
use serde_json::{Value, json};

mod openai;

/// What the handlers share: the engine's request channel and what `/get_model_info` says.
struct Shared {
    engine: Sender<Job>,
    /// For OpenAI's API: chat templates and token strings.
    tokenizer: Option<miles_model::Tokenizer>,
    model_path: String,
    /// The seed of every request's draws (a request's samples are numbered by arrival).
    seed: u64,
}

/// The router over an engine serving `engine`'s requests.
pub fn router(
    engine: Sender<Job>,
    tokenizer: Option<miles_model::Tokenizer>,
    model_path: String,
    seed: u64,
) -> Router {
    let shared = Arc::new(Shared { engine, tokenizer, model_path, seed });
    Router::new()
        .route("/generate", post(generate))
        .route("/v1/completions", post(openai::completions))
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/update_weights_from_disk", post(update_weights))
        .route("/abort_request", post(abort_request))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/get_model_info", get(model_info))
        .with_state(shared)
}

/// Serves `router` on `listener` until the process ends, on a runtime of its own.
pub fn serve_blocking(listener: std::net::TcpListener, router: Router) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_io().build()?;
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::from_std(listener)?;
        axum::serve(listener, router).await
    })
}

async fn model_info(State(shared): State<Arc<Shared>>) -> Response {
    axum::Json(json!({"model_path": shared.model_path, "is_generation": true})).into_response()
}

/// A 400 answer naming what is wrong.
fn bad_request(message: impl Into<String>) -> Response {
    let body = json!({"error": {"message": message.into()}});
    (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
}

/// `n` samples of each prompt from the engine, in order; the first failure as a 400.
/// Sends each prompt's `n` samples to the engine as one request (named by `rids`, one per
/// prompt, when given) and waits for them all.
async fn submit(
    shared: &Shared,
    prompts: Vec<Sample>,
    (params, n): (&SamplingParams, usize),
    rids: &[Option<String>],
) -> Result<Vec<Sample>, Response> {
    let mut waiting = Vec::with_capacity(prompts.len());
    for (i, prompt) in prompts.into_iter().enumerate() {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let reply = Box::new(move |r| {
            let _ = tx.send(r);
        });
        let rid = rids.get(i).cloned().flatten();
        let request =
            Request { group: vec![prompt; n], params: params.clone(), reply, rid, key: None };
        if shared.engine.send(Job::Generate(request)).is_err() {
            return Err(stopped());
        }
        waiting.push(rx);
    }
    let mut out = Vec::new();
    for rx in waiting {
        match rx.await {
            Ok(Ok(samples)) => {
                if let Some(s) = samples.iter().find(|s| s.status == Status::Failed) {
                    let why = s.metadata.get("rollout_error").and_then(Value::as_str);
                    return Err(bad_request(why.unwrap_or("the engine could not generate it")));
                }
                out.extend(samples);
            }
            Ok(Err(e)) => return Err(bad_request(e.to_string())),
            Err(_) => return Err(bad_request("the engine dropped the request")),
        }
    }
    Ok(out)
}

async fn generate(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let parsed = match parse_generate(&body, shared.seed) {
        Ok(p) => p,
        Err(message) => return bad_request(message),
    };
    let sampling = (&parsed.params, parsed.n);
    let samples = match submit(&shared, parsed.prompts, sampling, &parsed.rids).await {
        Ok(samples) => samples,
        Err(response) => return response,
    };
    let mut answers: Vec<Value> = samples.iter().map(|s| answer(s, parsed.logprobs)).collect();
    let body = match (parsed.batch, answers.len()) {
        (false, 1) => answers.remove(0),
        _ => Value::Array(answers),
    };
    axum::Json(body).into_response()
}

fn stopped() -> Response {
    let body = json!({"error": {"message": "the engine has stopped"}});
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(body)).into_response()
}

async fn update_weights(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => return bad_request(format!("the body is not JSON: {e}")),
    };
    let Some(dir) = v.get("model_path").and_then(Value::as_str) else {
        return bad_request("model_path: the HF checkpoint directory to load");
    };
    let (tx, rx) = tokio::sync::oneshot::channel();
    let reply = Box::new(move |r| {
        let _ = tx.send(r);
    });
    let job = Job::LoadWeights { dir: dir.into(), reply };
    if shared.engine.send(job).is_err() {
        return stopped();
    }
    let answer = match rx.await {
        Ok(Ok(version)) => json!({"success": true, "message": "loaded", "weight_version": version}),
        Ok(Err(e)) => json!({"success": false, "message": format!("model_path {dir}: {e}")}),
        Err(_) => json!({"success": false, "message": "the engine dropped the request"}),
    };
    let status = if answer["success"] == true { StatusCode::OK } else { StatusCode::BAD_REQUEST };
    (status, axum::Json(answer)).into_response()
}

/// SGLang's `/abort_request`: `{"rid": NAME}` ends the `/generate` request of that `rid`,
/// `{"abort_all": true}` every request; each answers with what it generated so far
/// (`finish_reason` `abort`).
async fn abort_request(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let rid = match serde_json::from_slice::<Value>(&body) {
        Ok(v) => match (v.get("rid"), v.get("abort_all")) {
            (_, Some(Value::Bool(true))) => None,
            (Some(Value::String(rid)), _) => Some(rid.clone()),
            _ => return bad_request("rid: the name a /generate request was given (or abort_all)"),
        },
        Err(e) => return bad_request(format!("the body is not JSON: {e}")),
    };
    if shared.engine.send(Job::Abort { rid }).is_err() {
        return stopped();
    }
    StatusCode::OK.into_response()
}

/// SGLang's `/tokenize`.
async fn tokenize(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    match shared.tokenizer.as_ref().ok_or_else(no_tokenizer).and_then(|t| tokenize_body(t, &body)) {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(message) => bad_request(message),
    }
}

/// SGLang's `/detokenize`.
async fn detokenize(State(shared): State<Arc<Shared>>, body: Bytes) -> Response {
    let tokenizer = shared.tokenizer.as_ref().ok_or_else(no_tokenizer);
    match tokenizer.and_then(|t| detokenize_body(t, &body)) {
        Ok(answer) => axum::Json(answer).into_response(),
        Err(message) => bad_request(message),
    }
}

fn no_tokenizer() -> String {
    "this server has no tokenizer (the checkpoint's tokenizer.json)".into()
}

/// `{"prompt": TEXT | [TEXT…], "add_special_tokens": bool}` → `{"tokens", "count"}`, a list
/// of each for a list of prompts.
fn tokenize_body(tok: &miles_model::Tokenizer, body: &[u8]) -> Result<Value, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let special = match v.get("add_special_tokens") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("add_special_tokens: true or false, not {other}")),
    };
    let encode = |text: &Value| -> Result<Value, String> {
        let text = text.as_str().ok_or("prompt: a string, or a list of strings")?;
        let ids = tok.encode(text, special).map_err(|e| format!("prompt: {e}"))?;
        Ok(json!(ids))
    };
    match v.get("prompt") {
        Some(Value::Array(texts)) => {
            let tokens = texts.iter().map(encode).collect::<Result<Vec<_>, _>>()?;
            let count: Vec<usize> =
                tokens.iter().map(|t| t.as_array().map_or(0, Vec::len)).collect();
            Ok(json!({"tokens": tokens, "count": count}))
        }
        Some(text) => {
            let tokens = encode(text)?;
            Ok(json!({"count": tokens.as_array().map_or(0, Vec::len), "tokens": tokens}))
        }
        None => Err("prompt: the text to tokenize".into()),
    }
}

/// `{"tokens": [ID…] | [[ID…]…], "skip_special_tokens": bool}` → `{"text"}`, a list for lists.
fn detokenize_body(tok: &miles_model::Tokenizer, body: &[u8]) -> Result<Value, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let skip = match v.get("skip_special_tokens") {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("skip_special_tokens: true or false, not {other}")),
    };
    let decode = |ids: &[Value]| -> Result<Value, String> {
        let ids = ids
            .iter()
            .map(|id| match id.as_u64().and_then(|i| u32::try_from(i).ok()) {
                Some(i) if (i as usize) < tok.vocab_size() => Ok(i),
                _ => Err(format!("tokens: {id} is not a token id of this model")),
            })
            .collect::<Result<Vec<u32>, _>>()?;
        tok.decode(&ids, skip).map(Value::String).map_err(|e| format!("tokens: {e}"))
    };
    match v.get("tokens") {
        Some(Value::Array(items)) if items.iter().all(Value::is_array) && !items.is_empty() => {
            let texts = items
                .iter()
                .map(|i| decode(i.as_array().map_or(&[][..], Vec::as_slice)))
                .collect::<Result<Vec<_>, _>>()?;
            Ok(json!({"text": texts}))
        }
        Some(Value::Array(ids)) => Ok(json!({"text": decode(ids)?})),
        _ => Err("tokens: a list of token ids, or a list of such lists".into()),
    }
}

/// A `/generate` request, read.
struct Generate {
    prompts: Vec<Sample>,
    /// Each prompt's `rid`, when given.
    rids: Vec<Option<String>>,
    params: SamplingParams,
    n: usize,
    logprobs: bool,
    /// Whether the answer is a list (a batch of prompts).
    batch: bool,
}

/// Reads a `/generate` body; the error names the field.
fn parse_generate(body: &[u8], seed: u64) -> Result<Generate, String> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| format!("the body is not JSON: {e}"))?;
    let Value::Object(map) = &v else { return Err("the body is a JSON object".into()) };
    let known = ["text", "input_ids", "sampling_params", "return_logprob", "rid", "stream"];
    if let Some(key) = map.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(format!("unknown field '{key}' (this server reads {})", known.join(", ")));
    }
    if map.get("stream").is_some_and(|s| s != &Value::Bool(false)) {
        return Err("stream: streamed answers are not served; leave it out".into());
    }
    let (prompts, batch) = match (map.get("input_ids"), map.get("text")) {
        (Some(_), Some(_)) => return Err("give input_ids or text, not both".into()),
        (Some(ids), None) => prompt_ids(ids)?,
        (None, Some(text)) => prompt_texts(text)?,
        (None, None) => return Err("give input_ids or text".into()),
    };
    let (params, n) = sampling(map.get("sampling_params"), seed)?;
    let logprobs = match map.get("return_logprob") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(other) => return Err(format!("return_logprob: true or false, not {other}")),
    };
    let rids = match map.get("rid") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(rid)) if !batch => vec![Some(rid.clone())],
        Some(Value::Array(list)) if batch && list.len() == prompts.len() => list
            .iter()
            .map(|r| r.as_str().map(|r| Some(r.to_string())))
            .collect::<Option<_>>()
            .ok_or("rid: a name (a string) per prompt")?,
        Some(_) => return Err("rid: a string, or for a batch a list of one per prompt".into()),
    };
    Ok(Generate { prompts, rids, params, n, logprobs, batch })
}

/// `input_ids`: one prompt's ids or a list of them.
fn prompt_ids(v: &Value) -> Result<(Vec<Sample>, bool), String> {
    let ids = |v: &Value| -> Result<Vec<u32>, String> {
        let list =
            v.as_array().ok_or_else(|| format!("input_ids: a list of token ids, not {v}"))?;
        list.iter()
            .map(|t| {
                t.as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .ok_or_else(|| format!("input_ids: {t} is not a token id"))
            })
            .collect()
    };
    let sample = |tokens: Vec<u32>| Sample { tokens, ..Sample::default() };
    match v.as_array().and_then(|l| l.first()) {
        Some(Value::Array(_)) => {
            let lists = v.as_array().expect("checked");
            Ok((lists.iter().map(|l| ids(l).map(sample)).collect::<Result<_, _>>()?, true))
        }
        _ => Ok((vec![sample(ids(v)?)], false)),
    }
}

/// `text`: one prompt or a list of them (the engine tokenizes them).
fn prompt_texts(v: &Value) -> Result<(Vec<Sample>, bool), String> {
    let sample =
        |text: &str| Sample { prompt: Prompt::Text(text.to_string()), ..Sample::default() };
    match v {
        Value::String(text) => Ok((vec![sample(text)], false)),
        Value::Array(list) => {
            let texts = list.iter().map(|t| t.as_str().map(sample));
            let samples: Option<Vec<Sample>> = texts.collect();
            Ok((samples.ok_or("text: a string or a list of strings")?, true))
        }
        other => Err(format!("text: a string or a list of strings, not {other}")),
    }
}

/// The most samples one prompt may ask for (`n`): a request for more would hold the memory
/// of that many samples before the engine saw it.
const MAX_N: u64 = 1024;

/// `n`, the samples of each prompt (0 is read as 1), named `key` in errors.
fn count_of_samples(value: &Value, key: &str) -> Result<usize, String> {
    match value.as_u64() {
        Some(n) if n <= MAX_N => Ok(n.max(1) as usize),
        Some(n) => Err(format!("{key}: {n} samples of one prompt; at most {MAX_N}")),
        None => Err(format!("{key}: a count")),
    }
}

/// The fuzzing harness's way in (`fuzz/`): a body read as `/generate`'s, `/v1/completions`',
/// `/v1/chat/completions`', `/tokenize`'s and `/detokenize`'s (with the project's byte-level
/// tokenizer); errors are the expected outcome.
#[doc(hidden)]
pub fn fuzz_request(body: &[u8]) {
    static TOKENIZER: std::sync::OnceLock<miles_model::Tokenizer> = std::sync::OnceLock::new();
    let _ = parse_generate(body, 1);
    let _ = openai::completion_request(body, 1);
    let _ = openai::chat_request(body, 1);
    let tok = TOKENIZER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("miles-fuzz-tokenizer-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary directory");
        miles_model::tokenizer::write_byte_level_tokenizer(&dir).expect("the tokenizer written");
        let tok = miles_model::Tokenizer::load(&dir).expect("the byte-level tokenizer");
        let _ = std::fs::remove_dir_all(&dir);
        tok
    });
    let _ = tokenize_body(tok, body);
    let _ = detokenize_body(tok, body);
}

/// SGLang's `sampling_params` as the engine's, and `n`.
fn sampling(v: Option<&Value>, seed: u64) -> Result<(SamplingParams, usize), String> {
    // (SGLang's defaults.)
    let mut p = SamplingParams { max_new_tokens: 128, seed, ..SamplingParams::default() };
    let mut n = 1;
    let Some(v) = v.filter(|v| !v.is_null()) else { return Ok((p, n)) };
    let Value::Object(map) = v else { return Err(format!("sampling_params: an object, not {v}")) };
    // Keys that change nothing here: the response is always detokenized in full.
    let inert = ["skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"];
    for (key, value) in map {
        let number = || value.as_f64().ok_or_else(|| format!("sampling_params.{key}: a number"));
        let count = || value.as_u64().ok_or_else(|| format!("sampling_params.{key}: a count"));
        match key.as_str() {
            "temperature" => p.temperature = number()? as f32,
            "top_p" => p.top_p = number()? as f32,
            "top_k" => {
                let k = value.as_i64().ok_or("sampling_params.top_k: an integer (-1: off)")?;
                p.top_k = usize::try_from(k).unwrap_or(0);
            }
            "max_new_tokens" => p.max_new_tokens = count()? as usize,
            // The draws' seed instead of the server's (requests batch only with the same one).
            "sampling_seed" => p.seed = count()?,
            "n" => n = count_of_samples(value, "sampling_params.n")?,
            "ignore_eos" => {
                p.ignore_eos = value.as_bool().ok_or("sampling_params.ignore_eos: a boolean")?
            }
            "stop" => {
                p.stop = match value {
                    Value::String(s) => vec![s.clone()],
                    Value::Array(l) => l
                        .iter()
                        .map(|s| s.as_str().map(String::from))
                        .collect::<Option<_>>()
                        .ok_or("sampling_params.stop: a string or a list of strings")?,
                    Value::Null => Vec::new(),
                    _ => return Err("sampling_params.stop: a string or a list of strings".into()),
                }
            }
            "stop_token_ids" => {
                let list = value.as_array().ok_or("sampling_params.stop_token_ids: a list")?;
                p.stop_token_ids = list
                    .iter()
                    .map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                    .collect::<Option<_>>()
                    .ok_or("sampling_params.stop_token_ids: token ids")?;
            }
            k if inert.contains(&k) => {}
            other => {
                return Err(format!(
                    "sampling_params.{other}: not a sampling parameter this server takes \
                     (temperature, top_p, top_k, max_new_tokens, stop, stop_token_ids, \
                     ignore_eos, n, sampling_seed)"
                ));
            }
        }
    }
    Ok((p, n))
}

/// One sample as SGLang answers it.
fn answer(s: &Sample, logprobs: bool) -> Value {
    let prompt = s.tokens.len() - s.response_length;
    let output = &s.tokens[prompt..];
    let finish = match s.status {
        Status::Completed => json!({"type": "stop", "matched": output.last()}),
        Status::Truncated => json!({"type": "length", "length": output.len()}),
        _ => json!({"type": "abort"}),
    };
    let mut meta = json!({
        "id": s.index.to_string(),
        "finish_reason": finish,
        "prompt_tokens": prompt,
        "completion_tokens": output.len(),
        "weight_version": s.weight_version,
    });
    if logprobs {
        let pairs: Vec<Value> =
            s.rollout_log_probs.iter().zip(output).map(|(lp, t)| json!([lp, t, null])).collect();
        meta["output_token_logprobs"] = Value::Array(pairs);
    }
    json!({"text": s.response, "output_ids": output, "meta_info": meta})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_read_as_sglang_sends_them_and_bad_ones_are_named() {
        let body = br#"{"input_ids": [1, 2, 3], "return_logprob": true,
            "sampling_params": {"temperature": 0.7, "top_k": -1, "max_new_tokens": 9,
            "stop": "x", "n": 2, "skip_special_tokens": false}}"#;
        let g = parse_generate(body, 5).unwrap();
        assert_eq!((g.prompts.len(), g.n, g.logprobs, g.batch), (1, 2, true, false));
        assert_eq!(g.prompts[0].tokens, [1, 2, 3]);
        let p = &g.params;
        assert_eq!((p.temperature, p.top_k, p.max_new_tokens, p.seed), (0.7, 0, 9, 5));
        assert_eq!(p.stop, ["x"]);
        let g = parse_generate(br#"{"text": ["a", "b"]}"#, 0).unwrap();
        assert_eq!((g.prompts.len(), g.batch, g.params.max_new_tokens), (2, true, 128));
        assert!(g.rids.is_empty());
        let g = parse_generate(br#"{"text": "a", "sampling_params": {"sampling_seed": 9}}"#, 3);
        assert_eq!(g.unwrap().params.seed, 9);
        let g = parse_generate(br#"{"text": "a", "rid": "r1"}"#, 0).unwrap();
        assert_eq!(g.rids, [Some("r1".to_string())]);
        let g = parse_generate(br#"{"input_ids": [[1], [2]], "rid": ["a", "b"]}"#, 0).unwrap();
        assert_eq!(g.rids, [Some("a".to_string()), Some("b".to_string())]);
        for (bad, says) in [
            (&b"{oops"[..], "not JSON"),
            (br#"{"input_ids": [1], "text": "a"}"#, "not both"),
            (br#"{"input_ids": [1, -2]}"#, "input_ids: -2"),
            (br#"{"input_ids": [1], "sampling_params": {"top_q": 1}}"#, "sampling_params.top_q"),
            (br#"{"input_ids": [1], "foo": 1}"#, "unknown field 'foo'"),
            (br#"{"input_ids": [1], "stream": true}"#, "stream"),
            (br#"{}"#, "give input_ids or text"),
            (br#"{"input_ids": [1], "sampling_params": {"n": 1025}}"#, "at most 1024"),
            (br#"{"input_ids": [4294967296]}"#, "4294967296 is not a token id"),
            (br#"{"text": ["a", "b"], "rid": "one"}"#, "rid: a string, or for a batch a list"),
            (br#"{"text": ["a", "b"], "rid": ["a", 2]}"#, "rid: a name (a string) per prompt"),
        ] {
            let e = parse_generate(bad, 0).err().unwrap();
            assert!(e.contains(says), "{e}");
        }
    }

    #[test]
    fn tokenize_and_detokenize_answer_as_sglang_and_name_bad_fields() {
        let dir = std::env::temp_dir().join(format!("miles-server-tok-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        miles_model::tokenizer::write_byte_level_tokenizer(&dir).unwrap();
        let tok = miles_model::Tokenizer::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let one = tokenize_body(&tok, br#"{"prompt": "2+3=5"}"#).unwrap();
        let ids = tok.encode("2+3=5", true).unwrap();
        assert_eq!(one, json!({"tokens": ids, "count": ids.len()}));
        let two = tokenize_body(&tok, br#"{"prompt": ["a", "bc"], "add_special_tokens": false}"#);
        let two = two.unwrap();
        assert_eq!(two["count"], json!([1, 2]));
        let back = detokenize_body(&tok, json!({"tokens": ids}).to_string().as_bytes()).unwrap();
        assert_eq!(back, json!({"text": "2+3=5"}));
        let lists = json!({"tokens": two["tokens"]}).to_string();
        assert_eq!(detokenize_body(&tok, lists.as_bytes()).unwrap(), json!({"text": ["a", "bc"]}));
        for (bad, says) in [
            (&br#"{"prompt": 3}"#[..], "prompt: a string"),
            (br#"{}"#, "prompt: the text"),
            (br#"{"prompt": "a", "add_special_tokens": 1}"#, "add_special_tokens"),
            (b"[", "not JSON"),
        ] {
            assert!(tokenize_body(&tok, bad).unwrap_err().contains(says), "{says}");
        }
        for (bad, says) in [
            (&br#"{"tokens": [-1]}"#[..], "tokens: -1 is not a token id"),
            (br#"{"tokens": [99999999]}"#, "99999999 is not a token id"),
            (br#"{"tokens": "abc"}"#, "a list of token ids"),
        ] {
            assert!(detokenize_body(&tok, bad).unwrap_err().contains(says), "{says}");
        }
    }

    /// Found by reading for the fuzzing harness: a huge `n` was a vector of that many
    /// samples before the engine saw it (an abort on allocation), and token ids past u32
    /// wrapped around in `/v1/completions`.
    #[test]
    fn openai_requests_refuse_huge_counts_and_ids_past_the_vocabulary_type() {
        let (prompts, _, n, logprobs) =
            openai::completion_request(br#"{"prompt": [[1, 2]], "n": 3, "logprobs": 0}"#, 0)
                .unwrap();
        assert_eq!((prompts[0].tokens.as_slice(), n, logprobs), (&[1u32, 2][..], 3, true));
        let e = openai::completion_request(br#"{"prompt": [4294967297]}"#, 0).err().unwrap();
        assert!(e.contains("prompt:"), "{e}");
        let e = openai::completion_request(br#"{"prompt": "a", "n": 100000000000}"#, 0);
        assert!(e.err().unwrap().contains("n: 100000000000 samples of one prompt"));
        let e = openai::chat_request(br#"{"messages": "hi"}"#, 0).err().unwrap();
        assert!(e.contains("messages: a list"), "{e}");
        let (_, params, _, _) = openai::chat_request(br#"{"messages": []}"#, 0).unwrap();
        assert_eq!(params.max_new_tokens, 1024);
    }
}
