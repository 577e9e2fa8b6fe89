//! Parity with HF transformers, the judge of model numerics: tiny random Qwen3 (tied head),
//! Llama (untied) and Qwen3-MoE checkpoints written by transformers 5.17, with its logprobs,
//! entropies and gradients (`tests/fixtures/make_hf_parity.py` and `make_hf_moe_parity.py`
//! made them).

use std::path::PathBuf;

use miles_model::ModelConfig;
use miles_model::testing::{HfReference, on_cpu};

fn fixture(name: &str) -> PathBuf {
    miles_tests::workspace_root().join("tests/fixtures/hf").join(name)
}

/// The model on the CPU in f32 against the fixture (the device bundle runs it on the GPU).
fn check(name: &str) {
    let r = HfReference::load(&fixture(name)).unwrap();
    let mut dm = on_cpu(&r.model);
    let f = dm.forward(&r.batch, r.temperature).unwrap();
    dm.backward(&f, &r.batch, &r.advantages, &r.entropy_coefs).unwrap();
    r.assert_matches(name, &f.logp, &f.entropy, &dm.grads_to_host().unwrap());
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

/// Qwen3-MoE (layer 0 sparse: 8 experts, top-2, norm_topk_prob; layer 1 dense) against
/// transformers 5.17's `Qwen3MoeForCausalLM`, with the load-balancing loss in the probed loss
/// (`output_router_logits`, coefficient 0.02): logprobs, entropies, every gradient (router and
/// experts included), the loss's value and the experts chosen, on the model on the CPU in f32
/// (`make_hf_moe_parity.py` wrote the fixture, with transformers' `num_local_experts` for
/// `num_experts`).
#[test]
fn qwen3_moe_matches_transformers() {
    check("qwen3_moe");
    let r = HfReference::load(&fixture("qwen3_moe")).unwrap();
    let json: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("qwen3_moe").join("reference.json")).unwrap(),
    )
    .unwrap();
    let moe = r.model.config.moe.as_ref().unwrap();
    assert_eq!((moe.num_experts, moe.num_experts_per_tok, moe.router_aux_loss_coef), (8, 2, 0.02));
    let fwd = on_cpu(&r.model).forward(&r.batch, r.temperature).unwrap();
    let aux = fwd.sparse.router_aux_loss.unwrap();
    let theirs = json["router_aux_loss"].as_f64().unwrap();
    assert!((aux - theirs).abs() < 1e-5, "aux {aux} vs transformers {theirs}");
    // The experts: transformers' per token (sequence by sequence) against ours, packed.
    let ours = fwd.routed_experts().unwrap();
    let theirs: Vec<u16> = json["experts"][0]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|t| t.as_array().unwrap().iter().map(|e| e.as_u64().unwrap() as u16))
        .collect();
    assert_eq!(ours, theirs);
}
