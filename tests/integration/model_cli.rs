//! `miles init-model`, `miles score` and `miles bench` end to end, and the errors a broken
//! checkpoint gives.

use std::path::Path;

use miles_tests::{miles, miles_binary, scratch, workspace_root};

fn score_lines(report: &str) -> Vec<serde_json::Value> {
    report.lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

#[test]
fn init_model_then_score_for_every_architecture() {
    for arch in ["qwen3", "llama", "qwen3-moe"] {
        let dir = scratch(&format!("init_model_{arch}"));
        let ckpt = dir.join("ckpt");
        let report = miles(&[
            "init-model",
            "--arch",
            arch,
            "--preset",
            "tiny",
            "--out",
            ckpt.to_str().unwrap(),
            "--seed",
            "3",
        ])
        .unwrap();
        assert!(report.contains(&format!("tiny {}", arch.replace('-', "_"))), "{report}");
        for f in ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"] {
            assert!(ckpt.join(f).exists(), "{f}");
        }
        let input = dir.join("pairs.jsonl");
        std::fs::write(
            &input,
            concat!(
                r#"{"prompt": "12 + 7 = ", "response": "19"}"#, "\n",
                r#"{"prompt": [{"role": "user", "content": "Capital of France?"}], "response": "Paris"}"#, "\n",
            ),
        )
        .unwrap();
        let args = [
            "score",
            "--hf-checkpoint",
            ckpt.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--apply-chat-template",
        ];
        let rows = score_lines(&miles(&args).unwrap());
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0]["response_length"], 2);
        assert_eq!(rows[1]["response_tokens"].as_array().unwrap().len(), 5);
        for row in &rows {
            let lp = row["log_probs"].as_array().unwrap();
            assert!(lp.iter().all(|v| v.as_f64().unwrap() < 0.0), "{row}");
            // A random tiny model is near uniform over 259 tokens: entropy close to ln 259.
            assert!(row["entropy"][0].as_f64().unwrap() > 5.0, "{row}");
        }
        if arch == "qwen3-moe" {
            let config = std::fs::read_to_string(ckpt.join("config.json")).unwrap();
            assert!(
                config.contains("Qwen3MoeForCausalLM") && config.contains("\"num_experts\": 8")
            );
            let weights = std::fs::read(ckpt.join("model.safetensors")).unwrap();
            let header = u64::from_le_bytes(weights[..8].try_into().unwrap()) as usize;
            let names = String::from_utf8_lossy(&weights[8..8 + header]).to_string();
            assert!(names.contains("model.layers.1.mlp.experts.7.down_proj.weight"), "{names}");
            assert!(names.contains("model.layers.0.mlp.gate.weight"), "{names}");
        }
        // The same seed writes the same weights.
        let again = dir.join("again");
        miles(&["init-model", "--arch", arch, "--out", again.to_str().unwrap(), "--seed", "3"])
            .unwrap();
        assert_eq!(
            std::fs::read(ckpt.join("model.safetensors")).unwrap(),
            std::fs::read(again.join("model.safetensors")).unwrap()
        );
    }
}

#[test]
fn score_on_a_transformers_checkpoint_reproduces_its_logprobs() {
    // The fixture has no tokenizer: score exact token ids, as when debugging a rollout.
    let ckpt = workspace_root().join("tests/fixtures/hf/llama");
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ckpt.join("reference.json")).unwrap())
            .unwrap();
    let files =
        miles_model::weights::TensorFiles::single(&ckpt.join("reference.safetensors")).unwrap();
    let ids = files.i32("input_ids").unwrap().1;
    let logp = files.f32("logp", &[15]).unwrap();
    let lens: Vec<usize> = serde_json::from_value(reference["seq_lens"].clone()).unwrap();
    let prompts: Vec<usize> = serde_json::from_value(reference["prompt_lens"].clone()).unwrap();
    let dir = scratch("score_transformers_checkpoint");
    let input = dir.join("tokens.jsonl");
    let mut text = String::new();
    let mut start = 0;
    for (len, prompt) in lens.iter().zip(&prompts) {
        let tokens = &ids[start..start + len];
        text.push_str(
            &serde_json::json!({"tokens": tokens, "response_length": len - prompt}).to_string(),
        );
        text.push('\n');
        start += len;
    }
    std::fs::write(&input, text).unwrap();
    let rows = score_lines(
        &miles(&[
            "score",
            "--hf-checkpoint",
            ckpt.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
            "--rollout-temperature",
            "0.7",
        ])
        .unwrap(),
    );
    let ours: Vec<f64> = rows
        .iter()
        .flat_map(|r| r["log_probs"].as_array().unwrap().iter().map(|v| v.as_f64().unwrap()))
        .collect();
    assert_eq!(ours.len(), logp.len());
    for (a, b) in ours.iter().zip(&logp) {
        assert!((a - f64::from(*b)).abs() < 1e-4, "{a} vs transformers {b}");
    }
}

fn copy_checkpoint(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(from.join(f), to.join(f)).unwrap();
    }
}

#[test]
fn broken_checkpoints_name_the_file_and_the_field_or_tensor() {
    let dir = scratch("broken_checkpoints");
    let input = dir.join("t.jsonl");
    std::fs::write(&input, "{\"tokens\": [1, 2, 3], \"response_length\": 1}\n").unwrap();
    let score = |ckpt: &Path| {
        miles(&[
            "score",
            "--hf-checkpoint",
            ckpt.to_str().unwrap(),
            "--input",
            input.to_str().unwrap(),
        ])
        .unwrap_err()
    };
    let good = workspace_root().join("tests/fixtures/hf/qwen3");
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(good.join("config.json")).unwrap()).unwrap();

    let ckpt = dir.join("malformed");
    copy_checkpoint(&good, &ckpt);
    std::fs::write(ckpt.join("config.json"), "{\"architectures\": [").unwrap();
    let err = score(&ckpt);
    assert!(err.contains("malformed/config.json: not valid JSON"), "{err}");

    let ckpt = dir.join("unknown_arch");
    copy_checkpoint(&good, &ckpt);
    let mut c = config.clone();
    c["architectures"] = serde_json::json!(["GPTNeoXForCausalLM"]);
    std::fs::write(ckpt.join("config.json"), c.to_string()).unwrap();
    let err = score(&ckpt);
    assert!(
        err.contains(
            "unknown_arch/config.json: architecture 'GPTNeoXForCausalLM' is not supported"
        ),
        "{err}"
    );

    let ckpt = dir.join("missing_field");
    copy_checkpoint(&good, &ckpt);
    let mut c = config.clone();
    c.as_object_mut().unwrap().remove("num_hidden_layers");
    std::fs::write(ckpt.join("config.json"), c.to_string()).unwrap();
    let err = score(&ckpt);
    assert!(err.contains("missing_field/config.json: missing field 'num_hidden_layers'"), "{err}");

    // More layers than the file holds, up to a billion (which once aborted allocating them),
    // and sizes beyond any model.
    for (name, key, value, want) in [
        (
            "three_layers",
            "num_hidden_layers",
            3,
            "num_hidden_layers is 3, but the checkpoint's tensors hold 2 layers",
        ),
        (
            "many_layers",
            "num_hidden_layers",
            1_000_000,
            "num_hidden_layers is 1000000, but the checkpoint's tensors hold 2 layers",
        ),
        (
            "huge_layers",
            "num_hidden_layers",
            1_000_000_000,
            "its sizes describe about 3.702e13 parameters, more than the 1.8e13 this loader \
             accepts: check num_hidden_layers (1000000000)",
        ),
        (
            "huge_sizes",
            "intermediate_size",
            1u64 << 40,
            "its sizes describe about 4.222e14 parameters, more than the 1.8e13 this loader \
             accepts: check num_hidden_layers (2), hidden_size (64), intermediate_size \
             (1099511627776)",
        ),
    ] {
        let ckpt = dir.join(name);
        copy_checkpoint(&good, &ckpt);
        let mut c = config.clone();
        c[key] = serde_json::json!(value);
        std::fs::write(ckpt.join("config.json"), c.to_string()).unwrap();
        let err = score(&ckpt);
        assert!(err.contains(&format!("{name}/config.json: {want}")), "{err}");
    }
    // More experts than the file holds (a billion once took 72 GB before aborting).
    let moe = workspace_root().join("tests/fixtures/hf/qwen3_moe");
    let ckpt = dir.join("huge_experts");
    copy_checkpoint(&moe, &ckpt);
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(moe.join("config.json")).unwrap()).unwrap();
    c["num_local_experts"] = serde_json::json!(1_000_000_000);
    c["num_experts_per_tok"] = serde_json::json!(2);
    std::fs::write(ckpt.join("config.json"), c.to_string()).unwrap();
    let err = score(&ckpt);
    let want = "huge_experts/config.json: num_experts is 1000000000, but layer 0 of the \
                checkpoint holds 8 experts";
    assert!(err.contains(want), "{err}");

    let ckpt = dir.join("wrong_shape");
    copy_checkpoint(&good, &ckpt);
    let mut c = config.clone();
    c["intermediate_size"] = serde_json::json!(96);
    std::fs::write(ckpt.join("config.json"), c.to_string()).unwrap();
    let err = score(&ckpt);
    assert!(err.contains("wrong_shape/model.safetensors: tensor 'model.layers.0.mlp.gate_proj.weight': shape [128, 64], expected [96, 64]"), "{err}");
}

/// `miles bench allreduce` over three host processes (the TCP group): each size's sum is
/// checked, then timed, and rank 0 prints one line per size.
#[test]
fn bench_allreduce_sums_across_processes() {
    let out = std::process::Command::new(miles_binary())
        .args(["bench", "allreduce", "--device", "cpu", "--nproc-per-node", "3"])
        .args(["--sizes-mb", "0.01,0.5", "--iters", "2"])
        .env("RAYON_NUM_THREADS", "1")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let lines: Vec<serde_json::Value> =
        text.lines().filter_map(|l| serde_json::from_str(l).ok()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(lines[1]["bytes"], 4 * 131_072);
    for v in &lines {
        assert_eq!(
            (v["what"].as_str(), v["via"].as_str(), v["ranks"].as_u64()),
            (Some("allreduce"), Some("tcp"), Some(3))
        );
        assert!(v["busbw_gb_s"].as_f64().unwrap() > 0.0, "{v}");
    }
    let err = miles(&["bench", "allreduce", "--device", "cpu", "--nproc-per-node", "1"]);
    assert!(err.unwrap_err().contains("at least 2"));
}

#[test]
fn bench_train_prints_one_json_line() {
    let out = miles(&[
        "bench",
        "train",
        "--preset",
        "tiny",
        "--batch",
        "2",
        "--seq-len",
        "16",
        "--steps",
        "1",
        "--warmup",
        "0",
    ])
    .unwrap();
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["what"], "train_step");
    assert!(v["tokens_per_s"].as_f64().unwrap() > 0.0);
    let err = miles(&["bench", "train", "--device", "cuda"]).unwrap_err();
    assert!(err.contains("--device cuda"), "{err}");
}

/// `miles bench rollout` measures plain, speculative (a random draft: tokens per verification
/// and the step's host phases) and INT4 QAT decode and the rollout served over HTTP, and names
/// a group that does not fit.
#[test]
fn bench_rollout_reports_speculative_and_int4_steps() {
    let run = |more: &[&str]| -> Result<serde_json::Value, String> {
        let mut args = vec!["bench", "rollout", "--preset", "tiny-h64", "--batch", "3"];
        args.extend(["--prompt-len", "8", "--new-tokens", "12"]);
        args.extend(more);
        miles(&args).map(|out| serde_json::from_str(out.trim()).unwrap())
    };
    let plain = run(&[]).unwrap();
    assert_eq!((plain["what"].as_str(), plain["spec_steps"].as_u64()), (Some("rollout"), Some(0)));
    let spec = run(&["--sglang-speculative-num-steps", "3"]).unwrap();
    assert!(spec["spec_tokens_per_verification"].as_f64().unwrap() > 1.0, "{spec}");
    let phases = &spec["spec_phases_ms"];
    assert!(phases["propose"].as_f64().unwrap() > 0.0 && phases["wait"].is_number(), "{spec}");
    let int4 = run(&["--int4-group-size", "32"]).unwrap();
    assert_eq!(int4["int4_group_size"], 32, "{int4}");
    assert!(int4["rollout_weight_gib"].as_f64().unwrap() > 0.0, "{int4}");
    // (Measured on the device's pool: nothing on the CPU.)
    assert_eq!(int4["weights_resident_gib"].as_f64(), Some(0.0), "{int4}");
    let err = run(&["--int4-group-size", "48"]).unwrap_err();
    assert!(err.contains("--int4-group-size") && err.contains("does not divide"), "{err}");
    // The same prompts served over HTTP to concurrent clients: none lost.
    let served = run(&["--serve-clients", "3"]).unwrap();
    let serve = &served["serve"];
    assert_eq!((serve["clients"].as_u64(), serve["lost"].as_u64()), (Some(3), Some(0)), "{served}");
    assert!(serve["tokens_per_s"].as_f64().unwrap() > 0.0, "{served}");
    let err = run(&["--serve-clients", "3", "--sglang-speculative-num-steps", "2"]).unwrap_err();
    assert!(err.contains("--serve-clients"), "{err}");
}
