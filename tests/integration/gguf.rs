//! `miles convert gguf`: tiny llama/qwen2/qwen3 GGUFs written by
//! `tests/fixtures/make_gguf_fixture.py`
//! (gguf-py for the tensors, HF `tokenizers` for token ids) converted end to end; corrupt and
//! truncated files; and, when `MILES_SMOLLM2_GGUF` names it, the real SmolLM2-135M-Instruct.

use std::path::{Path, PathBuf};
use std::time::Instant;

use miles_core::{Sample, SamplingParams, Status};
use miles_model::testing::on_cpu;
use miles_model::weights::TensorFiles;
use miles_model::{Architecture, Model, ModelConfig, PackedBatch, Tokenizer, Weights};
use miles_rollout::{Engine, EngineConfig};
use miles_tests::{miles, scratch, workspace_root};
use serde_json::{Value, json};

fn fixture(name: &str) -> PathBuf {
    workspace_root().join("tests/fixtures/gguf").join(name)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(fixture(&format!("{name}.ref.json"))).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn convert(src: &Path, out: &Path, extra: &[&str]) -> Result<String, String> {
    let mut args = vec!["convert", "gguf", src.to_str().unwrap(), "--out", out.to_str().unwrap()];
    args.extend(extra);
    miles(&args)
}

/// `got` equals `want` to `rel` of the tensor's mean magnitude (0 for the f32 output: the same
/// f32 operations as gguf-py, so the same bits).
fn close(got: f64, want: f64, scale: f64, rel: f64) -> bool {
    (got - want).abs() <= rel * scale + 1e-12
}

/// Config, every tensor (shape, sum, |sum|, sampled values) and the token ids of the test
/// strings, against the fixture's reference. `rel` is the tolerance of stored values.
fn check_checkpoint(dir: &Path, r: &Value, rel: f64) -> ModelConfig {
    let c = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let rc = &r["config"];
    let arch = match rc["architecture"].as_str().unwrap() {
        "llama" => Architecture::Llama,
        "qwen2" => Architecture::Qwen2,
        _ => Architecture::Qwen3,
    };
    assert_eq!(c.architecture, arch);
    let fields = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("num_key_value_heads", c.num_key_value_heads),
        ("head_dim", c.head_dim),
        ("max_position_embeddings", c.max_position_embeddings),
    ];
    for (key, ours) in fields {
        assert_eq!(ours as u64, rc[key].as_u64().unwrap(), "config {key}");
    }
    assert_eq!(c.rms_norm_eps, rc["rms_norm_eps"].as_f64().unwrap() as f32);
    assert_eq!(c.rope_theta, rc["rope_theta"].as_f64().unwrap() as f32);
    assert_eq!(json!(c.tie_word_embeddings), rc["tie_word_embeddings"]);
    assert_eq!(c.bos_token_id, Some(rc["bos_token_id"].as_u64().unwrap() as u32));
    assert_eq!(c.eos_token_ids, vec![rc["eos_token_id"].as_u64().unwrap() as u32]);

    let files = TensorFiles::open(dir).unwrap();
    let tensors = r["tensors"].as_object().unwrap();
    let mut want: Vec<&str> = tensors.keys().map(String::as_str).collect();
    want.sort();
    assert_eq!(files.names(), want);
    for (name, t) in tensors {
        let shape: Vec<usize> =
            t["shape"].as_array().unwrap().iter().map(|d| d.as_u64().unwrap() as usize).collect();
        let data = files.f32(name, &shape).unwrap();
        let sum: f64 = data.iter().map(|&v| f64::from(v)).sum();
        let abs_sum: f64 = data.iter().map(|&v| f64::from(v).abs()).sum();
        let mean_abs = abs_sum / data.len() as f64;
        let (want_sum, want_abs) = (t["sum"].as_f64().unwrap(), t["abs_sum"].as_f64().unwrap());
        assert!(
            close(abs_sum, want_abs, want_abs, rel.max(1e-9)),
            "{name}: |sum| {abs_sum} vs {want_abs}"
        );
        assert!(close(sum, want_sum, want_abs, rel.max(1e-9)), "{name}: sum {sum} vs {want_sum}");
        for s in t["samples"].as_array().unwrap() {
            let (i, v) = (s[0].as_u64().unwrap() as usize, s[1].as_f64().unwrap());
            let got = f64::from(data[i]);
            assert!(
                close(got, v, v.abs().max(mean_abs), rel),
                "{name}[{i}] = {got}, reference {v}"
            );
        }
    }

    let tok = Tokenizer::load(dir).unwrap();
    for case in r["tokens"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want: Vec<u32> =
            case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(ids, want, "token ids of {text:?}");
        assert_eq!(tok.decode(&ids, false).unwrap(), case["decoded"].as_str().unwrap());
    }
    c
}

/// The converted model runs: finite logprobs of a short response.
fn check_runs(dir: &Path, c: &ModelConfig) {
    let weights = Weights::load(dir, c).unwrap();
    let model = Model::new(c.clone(), weights);
    let batch = PackedBatch::new(&[(vec![1, 40, 50, 60, 70], 2)]).unwrap();
    let (logp, entropy) = on_cpu(&model).logprobs(&batch, 1.0).unwrap();
    assert_eq!(logp.len(), 3);
    assert!(logp.iter().chain(&entropy).all(|v| v.is_finite()), "{logp:?} {entropy:?}");
}

#[test]
fn tiny_llama_gguf_converts_with_unpermuted_qk_and_hf_token_ids() {
    let dir = scratch("gguf_tiny_llama");
    let report = convert(&fixture("tiny-llama.gguf"), &dir, &[]).unwrap();
    assert!(report.contains("GGUF v3"), "{report}");
    assert!(
        report.contains("BF16 3, F16 4, F32 7, Q4_0 3, Q4_1 6, Q4_K 1, Q5_K 1, Q6_K 1, Q8_0 4"),
        "{report}"
    );
    assert!(
        report.contains("llama: 3 layers, hidden 32, 4 heads (2 kv, dim 8), vocab 401"),
        "{report}"
    );
    assert!(report.contains("separate head, float32"), "{report}");
    // The reference q_proj/k_proj are numpy's inverse of convert_hf_to_gguf.py's permute of
    // what the file stores: sampled values at their HF rows prove the rows were un-permuted.
    let c = check_checkpoint(&dir, &reference("tiny-llama"), 0.0);
    assert!(!c.tie_word_embeddings);
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json")).unwrap())
            .unwrap();
    assert_eq!(config["add_bos_token"], json!(true));
    assert_eq!(
        (config["bos_token"].as_str(), config["eos_token"].as_str()),
        (Some("<|im_start|>"), Some("<|im_end|>"))
    );
    let tok = Tokenizer::load(&dir).unwrap();
    let text = tok.apply_chat_template(&json!([{"role": "user", "content": "Hi"}]), true).unwrap();
    assert_eq!(text, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    check_runs(&dir, &c);
}

#[test]
fn tiny_qwen3_gguf_converts_tied_with_qk_norms_and_no_permutation() {
    let dir = scratch("gguf_tiny_qwen3");
    let report = convert(&fixture("tiny-qwen3.gguf"), &dir, &[]).unwrap();
    assert!(report.contains("qwen3: 1 layers, hidden 32, 4 heads (2 kv, dim 16)"), "{report}");
    assert!(report.contains("tied head"), "{report}");
    let c = check_checkpoint(&dir, &reference("tiny-qwen3"), 0.0);
    assert!(c.tie_word_embeddings);
    check_runs(&dir, &c);
}

#[test]
fn tiny_qwen2_gguf_converts_with_q_k_v_biases() {
    let dir = scratch("gguf_tiny_qwen2");
    let report = convert(&fixture("tiny-qwen2.gguf"), &dir, &[]).unwrap();
    assert!(report.contains("qwen2: 2 layers, hidden 32, 4 heads (2 kv, dim 8)"), "{report}");
    let c = check_checkpoint(&dir, &reference("tiny-qwen2"), 0.0);
    assert!(c.tie_word_embeddings && c.bias.qkv && !c.bias.o);
    check_runs(&dir, &c);
}

#[test]
fn dtype_bf16_stores_bfloat16() {
    let dir = scratch("gguf_bf16");
    let report = convert(&fixture("tiny-qwen3.gguf"), &dir, &["--dtype", "bf16"]).unwrap();
    assert!(report.contains("bfloat16"), "{report}");
    let config: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    // bf16 keeps 8 bits of mantissa: relative error at most 2^-9.
    check_checkpoint(&dir, &reference("tiny-qwen3"), 1.0 / 256.0);
}

/// Writes `bytes` as a GGUF, converts it, and returns the error.
fn convert_err(name: &str, bytes: &[u8]) -> String {
    let dir = scratch(&format!("gguf_corrupt_{name}"));
    let src = dir.join(format!("{name}.gguf"));
    std::fs::write(&src, bytes).unwrap();
    let err = convert(&src, &dir.join("out"), &[]).unwrap_err();
    assert!(err.contains(&format!("{name}.gguf")), "the error names the file: {err}");
    err
}

fn find(haystack: &[u8], needle: &[u8]) -> usize {
    haystack.windows(needle.len()).position(|w| w == needle).expect("needle in the fixture")
}

#[test]
fn corrupt_and_truncated_ggufs_are_clear_errors() {
    let good = std::fs::read(fixture("tiny-llama.gguf")).unwrap();
    let mut bad = good.clone();
    bad[0] = b'X';
    assert!(
        convert_err("magic", &bad).contains("at byte 0: not a GGUF file: the magic is \"XGUF\"")
    );
    for (version, text) in [
        (1u32, "GGUF version 1 is not supported (only versions 2 and 3)"),
        (4, "GGUF version 4 is not supported"),
    ] {
        let mut bad = good.clone();
        bad[4..8].copy_from_slice(&version.to_le_bytes());
        let err = convert_err(&format!("version{version}"), &bad);
        assert!(err.contains(text), "{err}");
    }
    // Cut inside each part of the file: header, metadata (the token list), tensor infos, data.
    let tokens = find(&good, b"tokenizer.ggml.tokens");
    let infos = find(&good, b"\x11\0\0\0\0\0\0\0token_embd.weight");
    let cuts = [
        (2, "not a GGUF file: it is 2 bytes"),
        (14, "truncated file: the tensor count needs 8 bytes but the file ends at byte 14"),
        (tokens + 600, "the file is corrupt or truncated"),
        (infos + 12, "string length 17 runs past the end of the file"),
        (infos + 30, "truncated file: the dimensions of tensor 'token_embd.weight'"),
        (good.len() - 100, "run past the end of the file"),
    ];
    for (k, (at, text)) in cuts.into_iter().enumerate() {
        let err = convert_err(&format!("cut{k}"), &good[..at]);
        assert!(err.contains(text), "cut at {at}: {err}");
    }
    let err = convert_err("cut-data", &good[..good.len() - 100]);
    assert!(
        err.contains("tensor 'output.weight'") && err.contains("the file is truncated"),
        "{err}"
    );
    // An architecture this converter does not know (same length, so the file stays valid).
    let mut bad = good.clone();
    let at = find(&good, b"\x05\0\0\0\0\0\0\0llama") + 8;
    bad[at..at + 5].copy_from_slice(b"gemma");
    let err = convert_err("arch", &bad);
    assert!(
        err.contains("architecture 'gemma' is not supported; supported: llama, qwen2, qwen3"),
        "{err}"
    );
}

/// Found by fuzzing (fuzz/regressions/gguf): metadata that describes a far larger model than
/// the file's tensors hold made the weights (tens of GB) before any tensor was checked and the
/// allocation aborted, or named millions of layers' tensors for minutes. The layer count and
/// the tensors are now checked against the metadata first.
#[test]
fn metadata_larger_than_the_tensors_is_an_error_before_any_allocation() {
    let mut bad = std::fs::read(fixture("tiny-qwen3.gguf")).unwrap();
    let key = b"qwen3.block_count";
    let at = find(&bad, key) + key.len();
    assert_eq!(bad[at..at + 4], 4u32.to_le_bytes(), "a u32 value");
    bad[at + 4..at + 8].copy_from_slice(&10_000_000u32.to_le_bytes());
    let err = convert_err("huge_block_count", &bad);
    assert!(err.contains("metadata says 10000000 layers (block_count) but its tensors hold 1"));
    // Found next: metadata of much larger tensors than the file holds (with the layer count
    // right) made those weights before checking them; they are checked first now.
    let mut bad = std::fs::read(fixture("tiny-qwen3.gguf")).unwrap();
    let key = b"qwen3.feed_forward_length";
    let at = find(&bad, key) + key.len();
    assert_eq!(bad[at..at + 4], 4u32.to_le_bytes(), "a u32 value");
    bad[at + 4..at + 8].copy_from_slice(&(1u32 << 30).to_le_bytes());
    let err = convert_err("huge_ffn", &bad);
    assert!(err.contains("do not match model.layers.0.mlp.gate_proj.weight"), "{err}");
}

#[test]
fn missing_source_is_named() {
    let dir = scratch("gguf_missing");
    let err = convert(&dir.join("nope.gguf"), &dir.join("out"), &[]).unwrap_err();
    assert!(err.contains("nope.gguf: No such file"), "{err}");
}

/// Text that exercises the byte-level BPE: accents, CJK, emoji, whitespace runs (also before a
/// digit, where llama.cpp's `smollm` split and SmolLM2's tokenizer.json differ), digits, code,
/// and the chat special tokens.
/// The real SmolLM2-135M-Instruct (Q4_1) from `cargo xtask fetch-smollm2`, converted and run.
#[test]
fn smollm2_gguf_converts_and_knows_the_capital_of_france() {
    let Some(src) = std::env::var_os("MILES_SMOLLM2_GGUF") else {
        eprintln!(
            "skipped: set MILES_SMOLLM2_GGUF to SmolLM2-135M-Instruct.Q4_1.gguf (`cargo xtask fetch-smollm2` fetches it)"
        );
        return;
    };
    let src = PathBuf::from(src);
    assert!(src.is_file(), "MILES_SMOLLM2_GGUF={} is not a file", src.display());
    let dir = scratch("gguf_smollm2");
    let start = Instant::now();
    let report = convert(&src, &dir, &[]).unwrap();
    eprintln!("{report}conversion took {:.2} s", start.elapsed().as_secs_f64());

    let c = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    assert_eq!(c.architecture, Architecture::Llama);
    assert_eq!(
        (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads),
        (30, 576, 9, 3)
    );
    assert_eq!((c.vocab_size, c.head_dim, c.intermediate_size), (49152, 64, 1536));
    assert!(c.tie_word_embeddings);
    assert_eq!((c.bos_token_id, c.eos_token_ids.as_slice()), (Some(1), &[2][..]));
    assert_eq!(c.num_parameters(), 134_515_008);

    // Token ids of SmolLM2's own tokenizer.json (HF's Python tokenizers), recorded by
    // tests/fixtures/make_smollm2_token_ids.py: Unicode, whitespace runs, digits, code, specials.
    let ours = Tokenizer::load(&dir).unwrap();
    let want: Value = serde_json::from_str(
        &std::fs::read_to_string(workspace_root().join("tests/fixtures/smollm2/token_ids.json"))
            .unwrap(),
    )
    .unwrap();
    assert_eq!(ours.vocab_size() as u64, want["vocab_size"].as_u64().unwrap());
    for (special, id) in want["specials"].as_object().unwrap() {
        assert_eq!(ours.token_to_id(special).map(u64::from), id.as_u64(), "{special}");
    }
    for e in want["encodings"].as_array().unwrap() {
        let text = e["text"].as_str().unwrap();
        let ids = ours.encode(text, e["add_special_tokens"].as_bool().unwrap()).unwrap();
        let expected: Vec<u32> = serde_json::from_value(e["ids"].clone()).unwrap();
        assert_eq!(ids, expected, "token ids of {text:?}");
        assert_eq!(ours.decode(&ids, false).unwrap(), text, "decoding {ids:?}");
    }

    let start = Instant::now();
    let model = Model::new(c.clone(), Weights::load(&dir, &c).unwrap());
    let question = json!([{"role": "user", "content": "What is the capital of France?"}]);
    let prompt = ours.apply_chat_template(&question, true).unwrap();
    assert_eq!(
        prompt,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging \
         Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    let prompt = ours.encode(&prompt, false).unwrap();
    // " Paris" straight after "assistant\n" is an unlikely start (a space after a newline, about
    // -9.8 for the converted model); the model's own answer opens "The capital of France is".
    let lead = "The capital of France is";
    let answers = [" Paris.", " London."];
    let lead_len = ours.encode(lead, false).unwrap().len();
    let sequences: Vec<(Vec<u32>, usize)> = answers
        .iter()
        .map(|a| {
            let mut tokens = prompt.clone();
            tokens.extend(ours.encode(&format!("{lead}{a}"), false).unwrap());
            (tokens, prompt.len())
        })
        .collect();
    let batch = PackedBatch::new(&sequences).unwrap();
    let (logp, _) = on_cpu(&model).logprobs(&batch, 1.0).unwrap();
    let (mut means, mut answer_logp) = (Vec::new(), Vec::new());
    let mut offset = 0;
    for n in batch.response_lengths() {
        let response = &logp[offset..offset + n];
        means.push(response.iter().sum::<f32>() / n as f32);
        answer_logp.push(response[lead_len]);
        offset += n;
    }
    eprintln!(
        "{answers:?} after {lead:?}: answer-token logprob {answer_logp:?}, mean per response token {means:?} ({} prompt tokens, {:.2} s)",
        prompt.len(),
        start.elapsed().as_secs_f64()
    );
    assert!(
        answer_logp[0] > answer_logp[1] + 2.0,
        "' Paris' {} should clearly beat ' London' {}",
        answer_logp[0],
        answer_logp[1]
    );
    assert!(
        answer_logp[0] > -3.0 && means[0] > -3.0,
        "' Paris': {} ({} per token)",
        answer_logp[0],
        means[0]
    );
    assert!(means[0] > means[1], "the right answer is the likelier response: {means:?}");

    // Greedy decoding through the rollout engine answers with Paris, and its logprobs are the
    // scorer's, bit for bit.
    let start = Instant::now();
    let dm = on_cpu(&model);
    let mut engine = Engine::new(&dm, Some(ours), EngineConfig::default()).unwrap();
    let params = SamplingParams { top_k: 1, max_new_tokens: 16, ..SamplingParams::default() };
    let sample = Sample { tokens: prompt.clone(), ..Sample::default() };
    let out = engine.generate(&dm, vec![vec![sample]], &params).unwrap().remove(0).remove(0);
    eprintln!("greedy answer {:?} in {:.2} s", out.response, start.elapsed().as_secs_f64());
    assert!(out.response.contains("Paris"), "{:?}", out.response);
    assert_eq!(out.status, Status::Completed, "stops at <|im_end|>");
    let batch = PackedBatch::new(&[(out.tokens.clone(), prompt.len())]).unwrap();
    assert_eq!(dm.logprobs(&batch, 1.0).unwrap().0, out.rollout_log_probs);

    // `miles generate` on two GSM8K questions (from ../shared/data/gsm8k, MIT) writes samples.
    let questions = workspace_root().join("tests/fixtures/smollm2/gsm8k-test-2.jsonl");
    let samples = dir.join("gsm8k-samples.jsonl");
    let report = miles(&[
        "generate",
        "--hf-checkpoint",
        dir.to_str().unwrap(),
        "--prompt-data",
        questions.to_str().unwrap(),
        "--input-key",
        "question",
        "--label-key",
        "answer",
        "--apply-chat-template",
        "--n-samples-per-prompt",
        "2",
        "--rollout-max-response-len",
        "24",
        "--rollout-temperature",
        "0.7",
        "--output",
        samples.to_str().unwrap(),
    ])
    .unwrap();
    eprintln!("{report}");
    let lines = std::fs::read_to_string(&samples).unwrap();
    let samples: Vec<Sample> = lines.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(samples.len(), 4);
    for s in &samples {
        assert!(matches!(s.status, Status::Completed | Status::Truncated), "{s:?}");
        assert_eq!(s.rollout_log_probs.len(), s.response_length);
        assert!(!s.response.is_empty() && s.label.as_deref().is_some_and(|l| l.contains("####")));
    }
}
