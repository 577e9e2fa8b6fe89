//! `miles serve`: SGLang's /generate over the embedded engine, from outside the process.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};

use miles_model::{DeviceModel, PackedBatch};
use miles_tensor::{DType, Device};
use serde_json::{Value, json};

/// A `miles serve` child, killed when dropped.
struct Server {
    child: Child,
    addr: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Server {
    fn start(ckpt: &str) -> Server {
        let mut child = Command::new(miles_tests::miles_binary())
            .args(["serve", "--hf-checkpoint", ckpt, "--port", "0", "--rollout-max-running", "16"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
        let addr = line.split("http://").nth(1).and_then(|a| a.split_whitespace().next());
        let addr = addr.unwrap_or_else(|| panic!("no address in {line:?}")).to_string();
        Server { child, addr }
    }

    /// (status, body) of a request with `body` (a POST) or without (a GET).
    fn call(&self, path: &str, body: Option<&[u8]>) -> (u16, Vec<u8>) {
        let mut s = TcpStream::connect(&self.addr).unwrap();
        let head = match body {
            Some(b) => format!(
                "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nConnection: close\r\n\r\n",
                b.len()
            ),
            None => format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"),
        };
        s.write_all(head.as_bytes()).unwrap();
        s.write_all(body.unwrap_or_default()).unwrap();
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).unwrap();
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n").expect("a response head");
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        (status, raw[split + 4..].to_vec())
    }

    fn generate(&self, request: &Value) -> (u16, Value) {
        let (status, body) = self.call("/generate", Some(request.to_string().as_bytes()));
        (status, serde_json::from_slice(&body).unwrap_or(Value::Null))
    }
}

/// Many clients at once get answers whose logprobs the trainer's scorer reproduces bit for
/// bit; text prompts, batches and `n` answer as SGLang does; malformed requests get a 400
/// naming the field and the server goes on serving.
#[test]
fn serve_answers_sglang_generate_with_the_trainers_logprobs() {
    let dir = miles_tests::scratch("serve_generate");
    let ckpt = dir.join("ckpt").display().to_string();
    miles_tests::miles(&["init-model", "--preset", "tiny", "--out", &ckpt, "--seed", "3"]).unwrap();
    let server = Server::start(&ckpt);
    assert_eq!(server.call("/health", None).0, 200);
    let params = json!({"temperature": 0.8, "top_p": 0.95, "max_new_tokens": 12});
    let answers: Vec<(Vec<u32>, Value)> = std::thread::scope(|scope| {
        let jobs: Vec<_> = (0..24u32)
            .map(|i| {
                let server = &server;
                let params = params.clone();
                scope.spawn(move || {
                    let prompt: Vec<u32> = (0..3 + i % 7).map(|t| (t * 31 + i * 7) % 200).collect();
                    let request =
                        json!({"input_ids": prompt, "sampling_params": params, "return_logprob": true});
                    let (status, body) = server.generate(&request);
                    assert_eq!(status, 200, "{body}");
                    (prompt, body)
                })
            })
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    let model = miles_cli_model(&ckpt);
    for (prompt, body) in &answers {
        let meta = &body["meta_info"];
        let output: Vec<u32> = body["output_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        assert_eq!(meta["completion_tokens"], output.len());
        assert_eq!(meta["prompt_tokens"], prompt.len());
        let reason = meta["finish_reason"]["type"].as_str().unwrap();
        assert!(reason == "stop" || (reason == "length" && output.len() == 12), "{body}");
        let pairs = meta["output_token_logprobs"].as_array().unwrap();
        let logprobs: Vec<f32> = pairs.iter().map(|p| p[0].as_f64().unwrap() as f32).collect();
        let ids: Vec<u32> = pairs.iter().map(|p| p[1].as_u64().unwrap() as u32).collect();
        assert_eq!(ids, output);
        let tokens: Vec<u32> = prompt.iter().chain(&output).copied().collect();
        let batch = PackedBatch::new(&[(tokens, prompt.len())]).unwrap();
        assert_eq!(model.logprobs(&batch, 0.8).unwrap().0, logprobs, "{body}");
    }
    // A batch of texts, two samples each: four answers.
    let (status, body) = server.generate(&json!({"text": ["Hello", "What is 2 + 3?"],
        "sampling_params": {"n": 2, "max_new_tokens": 4}}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body.as_array().map(Vec::len), Some(4), "{body}");
    assert!(body[0]["text"].is_string(), "{body}");
    // Malformed requests, each named; the server still serves after them.
    for (bad, says) in [
        (&b"{not json"[..], "not JSON"),
        (br#"{"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}"#, "temperature"),
        (br#"{"input_ids": [1, 2], "sampling_params": {"temperature": -1}}"#, "temperature"),
        (br#"{"input_ids": [1, 999999]}"#, "outside the model's vocabulary"),
    ] {
        let (status, body) = server.call("/generate", Some(bad));
        let text = String::from_utf8_lossy(&body);
        assert!(status == 400 && text.contains(says), "{status} {text}");
    }
    let (status, body) = server.generate(&json!({"input_ids": [5, 6, 7]}));
    assert_eq!(status, 200, "{body}");

    // OpenAI's completions and chat completions, where they map.
    let post = |path: &str, request: Value| {
        let (status, body) = server.call(path, Some(request.to_string().as_bytes()));
        (status, serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null))
    };
    let (status, body) = post(
        "/v1/completions",
        json!({"model": "x", "prompt": "Hello", "max_tokens": 5, "n": 2, "logprobs": 1}),
    );
    assert_eq!(status, 200, "{body}");
    let choices = body["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 2, "{body}");
    let mut completion = 0;
    for c in choices {
        let lp = &c["logprobs"];
        let n = lp["token_logprobs"].as_array().unwrap().len();
        assert_eq!(lp["tokens"].as_array().unwrap().len(), n, "{body}");
        assert!(c["finish_reason"] == "stop" || (c["finish_reason"] == "length" && n == 5));
        completion += n;
    }
    assert_eq!(body["usage"]["completion_tokens"], completion, "{body}");
    let chat = json!({"messages": [{"role": "user", "content": "What is 2 + 3?"}],
                      "max_tokens": 6, "logprobs": true});
    let (status, body) = post("/v1/chat/completions", chat);
    assert_eq!(status, 200, "{body}");
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant", "{body}");
    assert!(choice["message"]["content"].is_string(), "{body}");
    let tokens = choice["logprobs"]["content"].as_array().unwrap();
    assert_eq!(body["usage"]["completion_tokens"], tokens.len(), "{body}");
    for (request, says) in [
        (json!({"prompt": "a", "stream": true}), "stream"),
        (json!({"prompt": "a", "best_of": 2}), "best_of"),
        (json!({"prompt": "a", "frequency_penalty": 0.5}), "penalties"),
    ] {
        let (status, body) = post("/v1/completions", request);
        assert!(status == 400 && body.to_string().contains(says), "{status} {body}");
    }

    // The engine's tokenizer for a multi-turn client's tool outputs, there and back.
    let (status, body) = post("/tokenize", json!({"prompt": "Tool: 2 + 3 = 5"}));
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["count"], body["tokens"].as_array().unwrap().len(), "{body}");
    let (status, back) = post("/detokenize", json!({"tokens": body["tokens"]}));
    assert_eq!((status, &back["text"]), (200, &json!("Tool: 2 + 3 = 5")), "{back}");
}

/// The checkpoint's model on the CPU, as the trainer's scorer holds it.
fn miles_cli_model(ckpt: &str) -> DeviceModel {
    let dir = std::path::Path::new(ckpt);
    let config = miles_model::ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = miles_model::Weights::load(dir, &config).unwrap();
    DeviceModel::new(&miles_model::Model::new(config, weights), &Device::Cpu, DType::F32).unwrap()
}

/// `--rollout-backend sglang` against `miles serve` standing in for SGLang: the loop's samples
/// come from the server, the policy's weights go to it from disk after every step (so its
/// logprobs stay the trainer's bit for bit: the gap is 0 at every iteration), and TIS, on by
/// default there, reports its metrics.
#[test]
fn a_run_rolls_out_on_external_servers_synced_after_every_step() {
    let dir = miles_tests::scratch("serve_external_backend");
    let ckpt = dir.join("ckpt").display().to_string();
    miles_tests::miles(&["init-model", "--preset", "tiny", "--out", &ckpt, "--seed", "4"]).unwrap();
    let data = dir.join("prompts.jsonl");
    let lines: String = (0..12)
        .map(|i| {
            format!("{{\"input\": \"{}+{}=\", \"label\": \"{}\"}}\n", i % 10, i / 3, i % 10 + i / 3)
        })
        .collect();
    std::fs::write(&data, lines).unwrap();
    let server = Server::start(&ckpt);
    let run = dir.join("run");
    let out = Command::new(miles_tests::miles_binary())
        .args(["train", "--hf-checkpoint", &ckpt, "--prompt-data", data.to_str().unwrap()])
        .args(["--rm-type", "exact_match", "--label-key", "label", "--rollout-backend", "sglang"])
        // (An entropy term moves the weights whatever the rewards: each step is a new policy.)
        .args(["--entropy-coef", "0.01"])
        .args(["--rollout-url", &format!("http://{}", server.addr), "--num-rollout", "3"])
        .args(["--rollout-batch-size", "4", "--n-samples-per-prompt", "2", "--lr", "1e-2"])
        .args(["--rollout-max-response-len", "4", "--run-dir", run.to_str().unwrap()])
        .output()
        .unwrap();
    let text =
        format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "{text}");
    assert!(text.contains("--use-tis is on"), "{text}");
    let records: Vec<Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .filter(|r: &Value| r.get("rollout/raw_reward").is_some())
        .collect();
    assert_eq!(records.len(), 3);
    for r in &records {
        assert_eq!(r["train/train_rollout_logprob_abs_diff"], 0.0, "{r}");
        assert!(
            r["train/tis"].is_number() && r["perf/update_weights_time"].as_f64().unwrap() > 0.0,
            "{r}"
        );
    }
    // The weights really moved at every step, and the server took each new version.
    assert!(records.iter().all(|r| r["train/grad_norm"].as_f64().unwrap() > 0.0));
}
