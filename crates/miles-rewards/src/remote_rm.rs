//! `remote_rm`: asks an HTTP reward server (a reward model, a sandbox, a judge) for each
//! sample's reward, the way slime's `--rm-type remote_rm` does.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use miles_core::{
    Error, Factory, Plugin, PluginConfig, Registration, Reward, RewardError, RewardValue, Sample,
};
use serde_json::{Map, Value, json};

use crate::http::{self, Endpoint, Failure};

pub static PLUGIN: Plugin = Plugin {
    name: "remote_rm",
    version: env!("CARGO_PKG_VERSION"),
    description: "POSTs {prompt, response, label, metadata} as JSON to an HTTP reward server \
                  (config `url`) and uses the number it answers; retries with backoff",
    factory: Factory::Reward(|config| Ok(Box::new(RemoteRm::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// Configuration of [`RemoteRm`], read from the plugin config JSON.
#[derive(Debug, Clone, PartialEq)]
pub struct RemoteRmConfig {
    /// `http://host[:port]/path` of the reward server (`--rm-url`).
    pub url: String,
    /// Bound on one attempt: connecting, sending and reading the answer.
    pub timeout: Duration,
    /// Attempts after the first one, for connection errors, timeouts, 5xx and 429.
    pub max_retries: u32,
    /// Wait before the first retry; doubles for each further one (capped at 30 s).
    pub backoff: Duration,
    /// Send a whole group in one POST as a JSON list (`--group-rm`).
    pub group: bool,
    /// Requests in flight at once when a batch of independent samples is scored.
    pub concurrency: usize,
}

/// The config keys [`RemoteRmConfig::from_json`] accepts.
pub const CONFIG_KEYS: [&str; 6] =
    ["url", "timeout_secs", "max_retries", "backoff_ms", "group", "concurrency"];

/// Longest wait between two attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

impl RemoteRmConfig {
    pub fn from_json(config: &PluginConfig) -> miles_core::Result<RemoteRmConfig> {
        let empty = Map::new();
        let object = match config {
            Value::Null => &empty,
            Value::Object(map) => map,
            other => {
                return Err(Error::config(
                    "custom-rm-config",
                    format!("remote_rm: the config must be a JSON object, got {other}"),
                ));
            }
        };
        if let Some(unknown) = object.keys().find(|k| !CONFIG_KEYS.contains(&k.as_str())) {
            return Err(Error::config(
                "custom-rm-config",
                format!("remote_rm: unknown key '{unknown}'; known: {}", CONFIG_KEYS.join(", ")),
            ));
        }
        let bad = |key: &str, want: &str, got: &Value| {
            Error::config("custom-rm-config", format!("remote_rm: {key} must be {want}, got {got}"))
        };
        let url = match object.get("url") {
            Some(Value::String(url)) if !url.trim().is_empty() => url.trim().to_string(),
            None | Some(Value::Null) | Some(Value::String(_)) => {
                return Err(Error::config(
                    "rm-url",
                    "remote_rm needs the reward server's URL: set --rm-url http://host:port/path \
                     (config key `url`)",
                ));
            }
            Some(other) => return Err(bad("url", "a string", other)),
        };
        Endpoint::parse(&url).map_err(|message| Error::config("rm-url", message))?;
        let timeout_secs = match object.get("timeout_secs") {
            None | Some(Value::Null) => 30.0,
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite() && *t > 0.0 && *t <= 86_400.0)
                .ok_or_else(|| bad("timeout_secs", "a number of seconds in (0, 86400]", v))?,
        };
        let count = |key: &str, default: u64, max: u64| match object.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_u64()
                .filter(|n| *n <= max)
                .ok_or_else(|| bad(key, &format!("an integer in 0..={max}"), v)),
        };
        let max_retries = count("max_retries", 3, 100)? as u32;
        let backoff_ms = count("backoff_ms", 200, 60_000)?;
        let concurrency = count("concurrency", 16, 1024)?.max(1) as usize;
        let group = match object.get("group") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(other) => {
                return Err(Error::config(
                    "group-rm",
                    format!("remote_rm: group must be true or false, got {other}"),
                ));
            }
        };
        Ok(RemoteRmConfig {
            url,
            timeout: Duration::from_secs_f64(timeout_secs),
            max_retries,
            backoff: Duration::from_millis(backoff_ms),
            group,
            concurrency,
        })
    }
}

/// A reward computed by a remote server.
///
/// Each sample is sent as `{"prompt", "response", "label", "metadata"}` (prompt as text or
/// chat messages, label `null` when absent). In group mode one POST carries a JSON list of
/// those and the answer must be a list of the same length. Each answer is a number, an object
/// `{"reward": number}` (other fields ignored), or an object whose values are all numbers (a
/// named reward). A request that still fails after its retries fails its samples, never the run.
#[derive(Debug)]
pub struct RemoteRm {
    config: RemoteRmConfig,
    endpoint: Endpoint,
}

impl RemoteRm {
    pub fn from_config(config: &PluginConfig) -> miles_core::Result<RemoteRm> {
        RemoteRm::new(RemoteRmConfig::from_json(config)?)
    }

    pub fn new(config: RemoteRmConfig) -> miles_core::Result<RemoteRm> {
        let endpoint = Endpoint::parse(&config.url).map_err(|m| Error::config("rm-url", m))?;
        Ok(RemoteRm { config, endpoint })
    }

    pub fn config(&self) -> &RemoteRmConfig {
        &self.config
    }

    /// POSTs `payload` with retries; the parsed JSON answer, or why every attempt failed.
    fn request(&self, payload: &Value) -> Result<Value, RewardError> {
        let body = serde_json::to_vec(payload)
            .map_err(|e| self.error(format!("cannot encode the request: {e}")))?;
        let attempts = self.config.max_retries + 1;
        let mut wait = self.config.backoff;
        let mut last = String::new();
        for attempt in 1..=attempts {
            if attempt > 1 {
                std::thread::sleep(wait);
                wait = (wait * 2).min(MAX_BACKOFF);
            }
            match http::post_json(&self.endpoint, &body, self.config.timeout) {
                Ok(response) => {
                    return serde_json::from_slice(&response.body).map_err(|e| {
                        self.error(format!(
                            "the answer is not JSON ({e}): '{}'",
                            http::snippet(&response.body)
                        ))
                    });
                }
                Err(Failure::Transient(message)) => last = message,
                Err(Failure::Permanent(message)) => {
                    let tries = if attempt == 1 {
                        "1 attempt".to_string()
                    } else {
                        format!("{attempt} attempts")
                    };
                    return Err(
                        self.error(format!("{tries} failed (not retried); last: {message}"))
                    );
                }
            }
        }
        let tries =
            if attempts == 1 { "1 attempt".to_string() } else { format!("{attempts} attempts") };
        Err(self.error(format!("{tries} failed; last: {last}")))
    }

    fn error(&self, message: String) -> RewardError {
        RewardError::new(format!("remote_rm {}: {message}", self.config.url))
    }

    fn score_one(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        let answer = self.request(&payload(sample))?;
        reward_from_answer(&answer).map_err(|m| self.error(m))
    }

    fn score_as_group(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        let all_failed = |e: RewardError| samples.iter().map(|_| Err(e.clone())).collect();
        let list = Value::Array(samples.iter().map(payload).collect());
        let answer = match self.request(&list) {
            Ok(answer) => answer,
            Err(e) => return all_failed(e),
        };
        match answer {
            Value::Array(items) if items.len() == samples.len() => items
                .iter()
                .map(|item| reward_from_answer(item).map_err(|m| self.error(m)))
                .collect(),
            Value::Array(items) => all_failed(self.error(format!(
                "a group of {} samples was answered with {} rewards",
                samples.len(),
                items.len()
            ))),
            other => all_failed(self.error(format!(
                "in group mode the answer must be a JSON list of rewards, got '{}'",
                http::snippet(other.to_string().as_bytes())
            ))),
        }
    }

    /// Scores independent samples with up to `concurrency` requests in flight.
    fn score_concurrently(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        let workers = self.config.concurrency.min(samples.len());
        if workers <= 1 {
            return samples.iter().map(|s| self.score_one(s)).collect();
        }
        let next = AtomicUsize::new(0);
        let results: Mutex<Vec<Option<Result<RewardValue, RewardError>>>> =
            Mutex::new(vec![None; samples.len()]);
        std::thread::scope(|scope| {
            for _ in 0..workers {
                scope.spawn(|| {
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(sample) = samples.get(i) else { break };
                        let result = self.score_one(sample);
                        results.lock().unwrap_or_else(|p| p.into_inner())[i] = Some(result);
                    }
                });
            }
        });
        results
            .into_inner()
            .unwrap_or_else(|p| p.into_inner())
            .into_iter()
            .map(|r| r.unwrap_or_else(|| Err(self.error("the sample was not scored".into()))))
            .collect()
    }
}

impl Reward for RemoteRm {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        if self.config.group {
            // A group server expects lists, even of one.
            let mut results = self.score_as_group(std::slice::from_ref(sample));
            return results.pop().unwrap_or_else(|| Err(self.error("no answer".into())));
        }
        self.score_one(sample)
    }

    fn score_group(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        if samples.is_empty() {
            return Vec::new();
        }
        if self.config.group {
            self.score_as_group(samples)
        } else {
            self.score_concurrently(samples)
        }
    }
}

/// What the server receives for one sample (slime's remote reward payload plus metadata).
pub fn payload(sample: &Sample) -> Value {
    json!({
        "prompt": sample.prompt,
        "response": sample.response,
        "label": sample.label,
        "metadata": sample.metadata,
    })
}

/// Reads one answer: a number, `{"reward": number, …}`, or an object of named numbers.
pub fn reward_from_answer(answer: &Value) -> Result<RewardValue, String> {
    let shape = "expected a number, {\"reward\": number} or an object of named numbers";
    match answer {
        Value::Number(n) => n
            .as_f64()
            .map(RewardValue::Scalar)
            .ok_or_else(|| format!("the answer {n} is not a usable number")),
        Value::Object(map) => {
            if let Some(reward) = map.get("reward") {
                return reward.as_f64().map(RewardValue::Scalar).ok_or_else(|| {
                    format!("the answer's \"reward\" is {reward}, not a number; {shape}")
                });
            }
            if map.is_empty() {
                return Err(format!("the answer is an empty object; {shape}"));
            }
            let mut named = BTreeMap::new();
            for (key, value) in map {
                let Some(v) = value.as_f64() else {
                    return Err(format!(
                        "the answer's \"{key}\" is {value}, not a number; {shape}"
                    ));
                };
                named.insert(key.clone(), v);
            }
            Ok(RewardValue::Named(named))
        }
        other => Err(format!(
            "the answer '{}' is not a reward; {shape}",
            http::snippet(other.to_string().as_bytes())
        )),
    }
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::sync::mpsc;
    use std::thread;
    use std::time::Instant;

    use miles_core::{Message, Prompt};

    use super::*;

    /// One request as the test server saw it.
    #[derive(Debug)]
    struct Seen {
        request_line: String,
        headers: Vec<String>,
        body: Value,
    }

    fn read_request(stream: &mut TcpStream) -> Seen {
        let mut reader = BufReader::new(stream);
        let mut request_line = String::new();
        reader.read_line(&mut request_line).unwrap();
        let mut headers = Vec::new();
        let mut length = 0;
        loop {
            let mut line = String::new();
            reader.read_line(&mut line).unwrap();
            let line = line.trim_end().to_string();
            if line.is_empty() {
                break;
            }
            if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                length = v.trim().parse().unwrap();
            }
            headers.push(line);
        }
        let mut body = vec![0; length];
        reader.read_exact(&mut body).unwrap();
        Seen {
            request_line: request_line.trim_end().to_string(),
            headers,
            body: serde_json::from_slice(&body).unwrap(),
        }
    }

    fn http_answer(status: &str, body: &str) -> String {
        format!(
            "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    }

    /// A server that answers its connections, in order, with `answers` (raw HTTP), then stops.
    /// The requests it saw come back through the channel.
    fn serve(answers: Vec<String>) -> (String, mpsc::Receiver<Seen>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            for answer in answers {
                let (mut stream, _) = listener.accept().unwrap();
                let seen = read_request(&mut stream);
                let _ = tx.send(seen);
                stream.write_all(answer.as_bytes()).unwrap();
            }
        });
        (url, rx)
    }

    fn reward(url: &str, extra: Value) -> RemoteRm {
        let mut config = json!({"url": url, "timeout_secs": 2.0, "backoff_ms": 1});
        config.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        RemoteRm::from_config(&config).unwrap()
    }

    fn sample(response: &str) -> Sample {
        Sample {
            prompt: Prompt::Text("1+1?".into()),
            response: response.into(),
            label: Some("2".into()),
            metadata: json!({"source": "unit"}),
            ..Default::default()
        }
    }

    #[test]
    fn config_defaults_and_errors() {
        let c = RemoteRmConfig::from_json(&json!({"url": "http://h:1/x"})).unwrap();
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(
            (c.max_retries, c.backoff, c.group, c.concurrency),
            (3, Duration::from_millis(200), false, 16)
        );
        let err = RemoteRm::from_config(&Value::Null).unwrap_err().to_string();
        assert!(err.starts_with("--rm-url:") && err.contains("URL"), "{err}");
        let err = RemoteRm::from_config(&json!({"url": ""})).unwrap_err().to_string();
        assert!(err.starts_with("--rm-url:"), "{err}");
        let err = RemoteRm::from_config(&json!({"url": "https://rm/x"})).unwrap_err().to_string();
        assert!(err.starts_with("--rm-url:") && err.contains("plain-HTTP"), "{err}");
        let err = RemoteRm::from_config(&json!({"url": "http://h/", "timeout": 1})).unwrap_err();
        assert!(err.to_string().contains("unknown key 'timeout'"), "{err}");
        let err =
            RemoteRm::from_config(&json!({"url": "http://h/", "timeout_secs": 0})).unwrap_err();
        assert!(err.to_string().contains("timeout_secs"), "{err}");
        let err =
            RemoteRm::from_config(&json!({"url": "http://h/", "max_retries": -1})).unwrap_err();
        assert!(err.to_string().contains("max_retries"), "{err}");
        let err = RemoteRm::from_config(&json!({"url": "http://h/", "group": "yes"})).unwrap_err();
        assert!(err.to_string().starts_with("--group-rm:"), "{err}");
        assert!(RemoteRm::from_config(&json!(["http://h/"])).is_err());
    }

    #[test]
    fn answers_decode_as_scalar_or_named_rewards() {
        assert_eq!(reward_from_answer(&json!(0.5)), Ok(RewardValue::Scalar(0.5)));
        assert_eq!(
            reward_from_answer(&json!({"reward": 1, "pred": "2"})),
            Ok(RewardValue::Scalar(1.0))
        );
        let named =
            RewardValue::Named(BTreeMap::from([("acc".into(), 1.0), ("format".into(), 0.5)]));
        assert_eq!(reward_from_answer(&json!({"acc": 1, "format": 0.5})), Ok(named));
        for bad in [
            json!("1"),
            json!(true),
            json!({}),
            json!({"reward": "x"}),
            json!({"acc": null}),
            json!([1]),
        ] {
            assert!(reward_from_answer(&bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_number_answer_is_the_reward_and_the_request_is_slimes_payload() {
        let (url, seen) = serve(vec![http_answer("200 OK", "0.75")]);
        let mut s = sample("2");
        s.prompt = Prompt::Messages(vec![Message { role: "user".into(), content: "1+1?".into() }]);
        assert_eq!(reward(&url, json!({})).score(&s), Ok(RewardValue::Scalar(0.75)));
        let seen = seen.recv().unwrap();
        assert_eq!(seen.request_line, "POST /score HTTP/1.1");
        let has = |h: &str| seen.headers.iter().any(|x| x.eq_ignore_ascii_case(h));
        assert!(
            has("Content-Type: application/json") && has("Connection: close"),
            "{:?}",
            seen.headers
        );
        assert_eq!(
            seen.body,
            json!({"prompt": [{"role": "user", "content": "1+1?"}], "response": "2", "label": "2",
                   "metadata": {"source": "unit"}})
        );
    }

    #[test]
    fn reward_objects_and_named_rewards_are_understood() {
        let (url, _seen) = serve(vec![
            http_answer("200 OK", r#"{"reward": 1.0}"#),
            http_answer("200 OK", r#"{"acc": 1, "len": -0.25}"#),
        ]);
        let rm = reward(&url, json!({}));
        assert_eq!(rm.score(&sample("2")), Ok(RewardValue::Scalar(1.0)));
        let named =
            RewardValue::Named(BTreeMap::from([("acc".into(), 1.0), ("len".into(), -0.25)]));
        assert_eq!(rm.score(&sample("2")), Ok(named));
    }

    #[test]
    fn chunked_and_read_to_eof_bodies_are_read() {
        let chunked = "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                       4;ext=1\r\n{\"re\r\n9\r\nward\": 3}\r\n0\r\n\r\n"
            .to_string();
        let until_close = "HTTP/1.0 200 OK\r\n\r\n-1".to_string();
        let interim = format!("HTTP/1.1 100 Continue\r\n\r\n{}", http_answer("200 OK", "2"));
        let (url, _seen) = serve(vec![chunked, until_close, interim]);
        let rm = reward(&url, json!({}));
        assert_eq!(rm.score(&sample("a")), Ok(RewardValue::Scalar(3.0)));
        assert_eq!(rm.score(&sample("b")), Ok(RewardValue::Scalar(-1.0)));
        assert_eq!(rm.score(&sample("c")), Ok(RewardValue::Scalar(2.0)));
    }

    #[test]
    fn a_server_error_is_retried_and_the_retry_counts() {
        let (url, seen) = serve(vec![
            http_answer("500 Internal Server Error", "busy"),
            http_answer("429 Too Many Requests", ""),
            http_answer("200 OK", "1"),
        ]);
        assert_eq!(reward(&url, json!({})).score(&sample("2")), Ok(RewardValue::Scalar(1.0)));
        assert_eq!(seen.iter().count(), 3);
    }

    #[test]
    fn retries_run_out_with_an_error_naming_url_attempts_and_cause() {
        let (url, seen) = serve(vec![
            http_answer("503 Service Unavailable", "down"),
            http_answer("503 Service Unavailable", "still down"),
        ]);
        let err = reward(&url, json!({"max_retries": 1})).score(&sample("2")).unwrap_err().0;
        assert_eq!(
            err,
            format!(
                "remote_rm {url}: 2 attempts failed; last: HTTP 503 Service Unavailable: still down"
            )
        );
        assert_eq!(seen.iter().count(), 2);
    }

    #[test]
    fn a_client_error_is_not_retried() {
        let (url, seen) = serve(vec![http_answer("400 Bad Request", "no label field")]);
        let err = reward(&url, json!({})).score(&sample("2")).unwrap_err().0;
        assert!(
            err.contains(&url)
                && err.contains("1 attempt failed")
                && err.contains("400 Bad Request: no label field"),
            "{err}"
        );
        assert_eq!(seen.iter().count(), 1);
    }

    #[test]
    fn a_server_that_never_answers_times_out_in_bounded_time() {
        // Connections complete in the kernel's backlog, but nothing ever reads or answers.
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        let rm = reward(&url, json!({"timeout_secs": 0.2, "max_retries": 1}));
        let started = Instant::now();
        let err = rm.score(&sample("2")).unwrap_err().0;
        let elapsed = started.elapsed();
        assert!(err.contains("2 attempts failed; last: no answer within 0.2s"), "{err}");
        assert!(
            elapsed >= Duration::from_millis(400) && elapsed < Duration::from_millis(1500),
            "{elapsed:?}"
        );
        drop(listener);
    }

    #[test]
    fn an_unreachable_port_is_connection_refused() {
        let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let url = format!("http://127.0.0.1:{port}/score");
        let err = reward(&url, json!({})).score(&sample("2")).unwrap_err().0;
        assert_eq!(err, format!("remote_rm {url}: 4 attempts failed; last: connection refused"));
    }

    #[test]
    fn a_malformed_answer_fails_the_sample() {
        let (url, _seen) =
            serve(vec![http_answer("200 OK", "{\"reward\": "), http_answer("200 OK", "\"good\"")]);
        let rm = reward(&url, json!({}));
        let err = rm.score(&sample("2")).unwrap_err().0;
        assert!(err.starts_with(&format!("remote_rm {url}: the answer is not JSON")), "{err}");
        let err = rm.score(&sample("2")).unwrap_err().0;
        assert!(err.contains("not a reward"), "{err}");
    }

    #[test]
    fn group_mode_sends_one_list_and_reads_one_list() {
        let (url, seen) = serve(vec![
            http_answer("200 OK", r#"[1, {"reward": 0}, {"acc": 0.5}, "bad"]"#),
            http_answer("200 OK", "[1]"),
        ]);
        let rm = reward(&url, json!({"group": true}));
        let samples = [sample("a"), sample("b"), sample("c"), sample("d")];
        let results = rm.score_group(&samples);
        assert_eq!(results[0], Ok(RewardValue::Scalar(1.0)));
        assert_eq!(results[1], Ok(RewardValue::Scalar(0.0)));
        assert_eq!(results[2], Ok(RewardValue::Named(BTreeMap::from([("acc".into(), 0.5)]))));
        assert!(results[3].as_ref().unwrap_err().0.contains("not a reward"));
        let body = seen.recv().unwrap().body;
        let responses: Vec<&str> =
            body.as_array().unwrap().iter().map(|p| p["response"].as_str().unwrap()).collect();
        assert_eq!(responses, ["a", "b", "c", "d"]);
        // One sample in group mode still goes out as a list.
        assert_eq!(rm.score(&sample("e")), Ok(RewardValue::Scalar(1.0)));
        assert!(seen.recv().unwrap().body.is_array());
    }

    #[test]
    fn a_group_answer_of_the_wrong_length_fails_every_sample() {
        let (url, _seen) = serve(vec![http_answer("200 OK", "[1, 0]"), http_answer("200 OK", "1")]);
        let rm = reward(&url, json!({"group": true}));
        let results = rm.score_group(&[sample("a"), sample("b"), sample("c")]);
        for r in &results {
            let err = &r.as_ref().unwrap_err().0;
            assert!(err.contains("a group of 3 samples was answered with 2 rewards"), "{err}");
        }
        let results = rm.score_group(&[sample("a"), sample("b")]);
        assert!(results.iter().all(|r| r.as_ref().unwrap_err().0.contains("must be a JSON list")));
    }

    #[test]
    fn independent_samples_are_scored_concurrently_in_order() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/score", listener.local_addr().unwrap());
        // Answers each request with the length of its response text, so order can be checked.
        thread::spawn(move || {
            for _ in 0..6 {
                let (mut stream, _) = listener.accept().unwrap();
                thread::spawn(move || {
                    let seen = read_request(&mut stream);
                    let n = seen.body["response"].as_str().unwrap().len();
                    stream.write_all(http_answer("200 OK", &n.to_string()).as_bytes()).unwrap();
                });
            }
        });
        let rm = reward(&url, json!({"concurrency": 3}));
        let samples: Vec<Sample> = (1..=6).map(|n| sample(&"x".repeat(n))).collect();
        let rewards: Vec<f64> = rm
            .score_group(&samples)
            .into_iter()
            .map(|r| match r.unwrap() {
                RewardValue::Scalar(v) => v,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(rewards, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    }
}
