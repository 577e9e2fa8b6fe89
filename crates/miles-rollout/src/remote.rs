//! External engines as a [`Rollout`] (`--rollout-backend sglang --rollout-url URL[,URL…]`):
//! each sample is one SGLang `POST /generate` of its prompt's token ids, spread over the
//! servers round robin, many at once; a weight sync is `POST /update_weights_from_disk` of a
//! directory the trainer wrote. `miles serve` (the `miles-server` crate) speaks the same
//! contract, so it stands in for SGLang in the tests.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::time::Duration;

use miles_core::{Error, Result, Rollout, Sample, SamplingParams, Status};
use serde_json::{Value, json};

/// Requests in flight at once over all servers, unless told otherwise.
const IN_FLIGHT: usize = 64;
/// Tries of a request that failed to connect or got a 5xx, with a growing pause between.
const TRIES: usize = 4;

/// SGLang servers, by `host:port`.
pub struct Remote {
    servers: Vec<String>,
    timeout: Duration,
    version: u64,
    /// Requests in flight at once over all servers.
    in_flight: usize,
}

impl Remote {
    /// `urls` (`http://host:port`, comma-separated in the flag); each must answer `/health`.
    pub fn connect(urls: &[String], timeout: Duration) -> Result<Remote> {
        let mut servers = Vec::new();
        for url in urls {
            let server = url.trim().trim_end_matches('/');
            let Some(host) = server.strip_prefix("http://") else {
                return Err(Error::config(
                    "rollout-url",
                    format!("{url}: an http://host:port address (https is not spoken)"),
                ));
            };
            let (status, _) = call(host, "GET", "/health", None, Duration::from_secs(30))
                .map_err(|e| Error::config("rollout-url", format!("{url}: {e}")))?;
            if status != 200 {
                return Err(Error::config(
                    "rollout-url",
                    format!("{url}/health answered {status}"),
                ));
            }
            servers.push(host.to_string());
        }
        if servers.is_empty() {
            return Err(Error::config("rollout-url", "give the servers' addresses"));
        }
        Ok(Remote { servers, timeout, version: 0, in_flight: IN_FLIGHT })
    }

    /// At most `n` requests in flight at once (a thread each; default 64).
    pub fn with_in_flight(mut self, n: usize) -> Remote {
        self.in_flight = n.max(1);
        self
    }

    /// Every server loads the HF checkpoint directory `dir` (which they must be able to read).
    pub fn load_weights(&self, dir: &std::path::Path) -> Result<()> {
        let body = json!({"model_path": dir.display().to_string()}).to_string();
        for host in &self.servers {
            let (status, answer) =
                call(host, "POST", "/update_weights_from_disk", Some(&body), self.timeout)
                    .map_err(|e| Error::Invalid(format!("weight sync with http://{host}: {e}")))?;
            if status != 200 {
                let text = String::from_utf8_lossy(&answer);
                return Err(Error::Invalid(format!(
                    "weight sync with http://{host}: {status} {text}"
                )));
            }
        }
        Ok(())
    }

    /// One sample from the server `host`: its response, or why it failed.
    fn generate_one(&self, host: &str, mut s: Sample, params: &SamplingParams) -> Sample {
        let request = json!({
            "input_ids": s.tokens,
            "sampling_params": {
                "temperature": params.temperature,
                "top_p": params.top_p,
                "top_k": if params.top_k == 0 { -1 } else { params.top_k as i64 },
                "max_new_tokens": params.max_new_tokens,
                "stop": params.stop,
                "stop_token_ids": params.stop_token_ids,
                "ignore_eos": params.ignore_eos,
            },
            "return_logprob": true,
        })
        .to_string();
        let answer = retried(|| call(host, "POST", "/generate", Some(&request), self.timeout))
            .and_then(|(status, body)| {
                let v: Value = serde_json::from_slice(&body)
                    .map_err(|e| format!("{status}: not JSON ({e})"))?;
                if status != 200 {
                    let message = v["error"]["message"].as_str().unwrap_or("no message");
                    return Err(format!("{status}: {message}"));
                }
                Ok(v)
            });
        let parsed = answer.and_then(|v| read_answer(&v));
        match parsed {
            Ok(out) => {
                s.tokens.extend(&out.tokens);
                s.response_length = out.tokens.len();
                s.loss_mask = vec![1; out.tokens.len()];
                s.rollout_log_probs = out.logprobs;
                s.response = out.text;
                s.status = out.status;
                // (The loop's count of syncs, not the server's own.)
                s.weight_version = self.version;
            }
            Err(why) => {
                s.status = Status::Failed;
                if !s.metadata.is_object() {
                    s.metadata = json!({});
                }
                s.metadata["rollout_error"] = format!("http://{host}/generate: {why}").into();
            }
        }
        s
    }
}

/// What a `/generate` answer says of one sample.
struct Answer {
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    text: String,
    status: Status,
}

fn read_answer(v: &Value) -> std::result::Result<Answer, String> {
    let meta = &v["meta_info"];
    let pairs = meta["output_token_logprobs"]
        .as_array()
        .ok_or("the answer has no meta_info.output_token_logprobs")?;
    let mut tokens = Vec::with_capacity(pairs.len());
    let mut logprobs = Vec::with_capacity(pairs.len());
    for p in pairs {
        let (Some(lp), Some(t)) = (p[0].as_f64(), p[1].as_u64()) else {
            return Err(format!("output_token_logprobs: [logprob, token id, …], not {p}"));
        };
        logprobs.push(lp as f32);
        tokens.push(t as u32);
    }
    let status = match meta["finish_reason"]["type"].as_str() {
        Some("stop") => Status::Completed,
        Some("length") => Status::Truncated,
        Some("abort") => Status::Aborted,
        other => return Err(format!("finish_reason.type: stop, length or abort, not {other:?}")),
    };
    let text = v["text"].as_str().unwrap_or_default().to_string();
    Ok(Answer { tokens, logprobs, text, status })
}

impl Rollout for Remote {
    fn generate(
        &mut self,
        groups: Vec<Vec<Sample>>,
        params: &SamplingParams,
    ) -> Result<Vec<Vec<Sample>>> {
        let sizes: Vec<usize> = groups.iter().map(Vec::len).collect();
        let samples: Vec<Sample> = groups.into_iter().flatten().collect();
        let mut done: Vec<Sample> = Vec::with_capacity(samples.len());
        let mut next = 0;
        for chunk in samples.chunks(self.in_flight) {
            let this = &*self;
            let answers: Vec<Sample> = std::thread::scope(|scope| {
                let jobs: Vec<_> = chunk
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        let host = &this.servers[(next + i) % this.servers.len()];
                        let s = s.clone();
                        scope.spawn(move || this.generate_one(host, s, params))
                    })
                    .collect();
                jobs.into_iter().map(|j| j.join().expect("a request thread")).collect()
            });
            next += chunk.len();
            done.extend(answers);
        }
        let mut out = Vec::with_capacity(sizes.len());
        let mut rest = done.into_iter();
        for n in sizes {
            out.push(rest.by_ref().take(n).collect());
        }
        Ok(out)
    }

    fn set_weight_version(&mut self, version: u64) {
        self.version = version;
    }
}

/// `f` again after a failure to connect or a 5xx answer, pausing 0.5 s, 1 s, 2 s.
fn retried(
    mut f: impl FnMut() -> std::io::Result<(u16, Vec<u8>)>,
) -> std::result::Result<(u16, Vec<u8>), String> {
    let mut pause = Duration::from_millis(500);
    for attempt in 1..=TRIES {
        match f() {
            Ok((status, body)) if status < 500 || attempt == TRIES => return Ok((status, body)),
            Err(e) if attempt == TRIES => return Err(format!("{e} (after {TRIES} tries)")),
            _ => {}
        }
        std::thread::sleep(pause);
        pause *= 2;
    }
    unreachable!("the last try returns")
}

/// One HTTP/1.1 request to `host` (`host:port`); the status and the body.
fn call(
    host: &str,
    method: &str,
    path: &str,
    body: Option<&str>,
    timeout: Duration,
) -> std::io::Result<(u16, Vec<u8>)> {
    let addr = host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("{host}: no address")))?;
    let mut stream = TcpStream::connect_timeout(&addr, timeout.min(Duration::from_secs(30)))?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    let body = body.unwrap_or_default();
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes())?;
    stream.write_all(body.as_bytes())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let bad = |what: &str| std::io::Error::other(format!("{host}{path}: {what}"));
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n").ok_or_else(|| bad("no header"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad("no status"))?;
    let body = raw[split + 4..].to_vec();
    if head.contains("transfer-encoding: chunked") {
        return Ok((status, unchunk(&body).ok_or_else(|| bad("a broken chunked body"))?));
    }
    Ok((status, body))
}

/// A chunked body's bytes.
fn unchunk(mut body: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::new();
    loop {
        let line = body.windows(2).position(|w| w == b"\r\n")?;
        let size = std::str::from_utf8(&body[..line]).ok()?.split(';').next()?.trim();
        let size = usize::from_str_radix(size, 16).ok()?;
        body = &body[line + 2..];
        if size == 0 {
            return Some(out);
        }
        out.extend_from_slice(body.get(..size)?);
        body = body.get(size + 2..)?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_and_chunked_bodies_read_as_sglang_writes_them() {
        let v = json!({"text": "hi", "output_ids": [5, 6], "meta_info": {
            "finish_reason": {"type": "length", "length": 2},
            "output_token_logprobs": [[-0.5, 5, null], [-1.25, 6, null]], "weight_version": 3}});
        let a = read_answer(&v).unwrap();
        assert_eq!(
            (a.tokens, a.logprobs, a.status),
            (vec![5, 6], vec![-0.5, -1.25], Status::Truncated)
        );
        let e = read_answer(&json!({"meta_info": {}})).err().unwrap();
        assert!(e.contains("output_token_logprobs"), "{e}");
        assert_eq!(unchunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n").unwrap(), b"abcde");
        assert!(unchunk(b"zz\r\n").is_none());
    }
}
