//! Parity with HF transformers, the judge of model numerics: tiny random Qwen3 (tied head) and
//! Llama (untied) checkpoints written by transformers 5.17, with its logprobs, entropies and
//! gradients (`tests/fixtures/make_hf_parity.py` made them).

use std::path::PathBuf;

use miles_model::testing::HfReference;
use miles_model::{DeviceModel, ModelConfig, Weights};
use miles_tensor::{DType, Device};

fn fixture(name: &str) -> PathBuf {
    miles_tests::workspace_root().join("tests/fixtures/hf").join(name)
}

/// The CPU model, and the device model's code on the CPU's tensors (in f32), against the
/// fixture (the device bundle runs the device model against it on the GPU).
fn check(name: &str) {
    let r = HfReference::load(&fixture(name)).unwrap();
    let model = &r.model;
    let fwd = model.forward(&r.batch, r.temperature).unwrap();
    let mut grads = Weights::zeros(&model.config);
    model.backward(&fwd, &r.batch, &r.advantages, &r.entropy_coefs, &mut grads).unwrap();
    r.assert_matches(name, &fwd.logp, &fwd.entropy, &grads);
    let mut dm = DeviceModel::new(model, &Device::Cpu, DType::F32).unwrap();
    let f = dm.forward(&r.batch, r.temperature).unwrap();
    let (logp, entropy) = (f.logp.clone(), f.entropy.clone());
    dm.backward(&f, &r.batch, &r.advantages, &r.entropy_coefs).unwrap();
    r.assert_matches(
        &format!("{name} (device model on the CPU)"),
        &logp,
        &entropy,
        &dm.grads_to_host().unwrap(),
    );
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
