//! Parity with HF transformers, the judge of model numerics: tiny random Qwen3 (tied head) and
//! Llama (untied) checkpoints written by transformers 5.17, with its logprobs, entropies and
//! gradients (`tests/fixtures/make_hf_parity.py` made them).

use std::path::PathBuf;

use miles_model::weights::{TensorFiles, tensor_spec};
use miles_model::{Model, ModelConfig, PackedBatch, Weights};

fn fixture(name: &str) -> PathBuf {
    miles_tests::workspace_root().join("tests/fixtures/hf").join(name)
}

struct Reference {
    batch: PackedBatch,
    temperature: f32,
    advantages: Vec<f32>,
    entropy_coefs: Vec<f32>,
    logp: Vec<f32>,
    entropy: Vec<f32>,
    files: TensorFiles,
}

fn reference(name: &str) -> Reference {
    let dir = fixture(name);
    let files = TensorFiles::single(&dir.join("reference.safetensors")).unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let ids = files.i32("input_ids").unwrap().1;
    let cu = files.i32("cu_seqlens").unwrap().1;
    let prompts = files.i32("prompt_lens").unwrap().1;
    let sequences: Vec<(Vec<u32>, usize)> = cu
        .windows(2)
        .zip(&prompts)
        .map(|(w, &p)| {
            (ids[w[0] as usize..w[1] as usize].iter().map(|&t| t as u32).collect(), p as usize)
        })
        .collect();
    let vector = |n: &str| {
        let shape = files.shape(n).unwrap();
        files.f32(n, &shape).unwrap()
    };
    Reference {
        batch: PackedBatch::new(&sequences).unwrap(),
        temperature: json["temperature"].as_f64().unwrap() as f32,
        advantages: vector("advantages"),
        entropy_coefs: vector("entropy_coefs"),
        logp: vector("logp"),
        entropy: vector("entropy"),
        files,
    }
}

fn load(name: &str) -> Model {
    let dir = fixture(name);
    let config = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let weights = Weights::load(&dir, &config).unwrap();
    Model::new(config, weights)
}

fn check(name: &str) {
    let model = load(name);
    let r = reference(name);
    let fwd = model.forward(&r.batch, r.temperature).unwrap();
    assert_eq!(fwd.logp.len(), r.logp.len());
    for (k, ((a, b), (c, d))) in
        fwd.logp.iter().zip(&r.logp).zip(fwd.entropy.iter().zip(&r.entropy)).enumerate()
    {
        assert!((a - b).abs() < 1e-4, "{name}: logp[{k}] {a} vs transformers {b}");
        assert!((c - d).abs() < 1e-4, "{name}: entropy[{k}] {c} vs transformers {d}");
    }
    let mut grads = Weights::zeros(&model.config);
    model.backward(&fwd, &r.batch, &r.advantages, &r.entropy_coefs, &mut grads).unwrap();
    let spec = tensor_spec(&model.config);
    for ((tensor, shape), ours) in spec.iter().zip(grads.tensors(model.config.architecture)) {
        let theirs = r.files.f32(&format!("grad.{tensor}"), shape).unwrap();
        let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
        let diff: Vec<f32> = ours.iter().zip(&theirs).map(|(a, b)| a - b).collect();
        let rel = norm(&diff) / norm(&theirs).max(1e-12);
        assert!(
            rel < 1e-3,
            "{name}: gradient of {tensor} differs from transformers by {rel:.2e} (relative L2)"
        );
        for (a, b) in ours.iter().zip(&theirs) {
            assert!(
                (a - b).abs() <= 1e-3 * b.abs() + 1e-5,
                "{name}: {tensor}: {a} vs transformers {b}"
            );
        }
    }
}

#[test]
fn qwen3_with_a_tied_head_matches_transformers() {
    check("qwen3");
}

#[test]
fn llama_with_an_untied_head_matches_transformers() {
    check("llama");
}

#[test]
fn the_fixture_config_uses_rope_parameters() {
    // transformers 5.17 writes rope_parameters, not rope_theta: both must be read.
    let c = ModelConfig::from_file(&fixture("qwen3").join("config.json")).unwrap();
    assert_eq!((c.rope_theta, c.tie_word_embeddings, c.head_dim), (1e6, true, 16));
    let c = ModelConfig::from_file(&fixture("llama").join("config.json")).unwrap();
    assert_eq!((c.rope_theta, c.tie_word_embeddings), (1e4, false));
}
