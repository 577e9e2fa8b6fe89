//! Parity with HF transformers, the judge of model numerics: tiny random Qwen3 (tied head),
//! Llama (untied) and Qwen3-MoE checkpoints written by transformers 5.17, and Qwen2 (q/k/v
//! biases), Llama 3.1 (llama3 rope, attention and MLP biases), Qwen3 with yarn rope and Gemma 3
//! (text) written by transformers 5.25, with their logprobs, entropies and gradients
//! (`tests/fixtures/make_hf_parity.py` and `make_hf_moe_parity.py` made them).

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
fn qwen2_with_q_k_v_biases_matches_transformers() {
    check("qwen2");
}

#[test]
fn llama31_with_llama3_rope_and_biases_matches_transformers() {
    check("llama31");
}

#[test]
fn qwen3_with_yarn_rope_and_attention_biases_matches_transformers() {
    check("qwen3_yarn");
}

#[test]
fn gemma3_with_sliding_windows_and_sandwich_norms_matches_transformers() {
    check("gemma3");
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

/// A safetensors header, as JSON.
type Header = serde_json::Map<String, serde_json::Value>;

/// Writes `dir/model.safetensors`: `src`'s with its header edited by `edit` (the data as is).
fn rewrite_header(src: &std::path::Path, dir: &std::path::Path, edit: &dyn Fn(&mut Header)) {
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let mut header: Header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    edit(&mut header);
    let mut text = serde_json::to_vec(&header).unwrap();
    text.resize(text.len().next_multiple_of(8), b' ');
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(&bytes[8 + n..]);
    std::fs::write(dir.join("model.safetensors"), out).unwrap();
}

/// A compressed-tensors `pack-quantized` INT4 checkpoint (`tests/fixtures/int4/qwen3`, the tiny
/// Qwen3 quantized in groups of 32 by `make_int4_checkpoint.py` with numpy) loads dequantized:
/// every projection is miles' fake quantization of the f32 weight bit for bit (two
/// implementations of the recipe and the packing agree), the rest as stored. A scale that does
/// not tile the row, packed words of another dtype, a missing shape, or a scheme other than
/// symmetric INT4 groups are errors naming the tensor or field.
#[test]
fn an_int4_checkpoint_loads_dequantized_with_the_codecs_bits() {
    use miles_tensor::cpu::fake_quantize_int4;
    let int4 = miles_tests::workspace_root().join("tests/fixtures/int4/qwen3");
    let config = ModelConfig::from_file(&int4.join("config.json")).unwrap();
    let loaded = miles_model::Weights::load(&int4, &config).unwrap();
    let original = miles_model::Weights::load(&fixture("qwen3"), &config).unwrap();
    let spec = miles_model::weights::tensor_spec(&config);
    let pairs = loaded.tensors().into_iter().zip(original.tensors());
    let mut quantized = 0;
    for ((name, shape), (got, f32s)) in spec.iter().zip(pairs) {
        if name.starts_with("model.layers.") && name.ends_with("_proj.weight") {
            assert_eq!(*got, fake_quantize_int4(f32s, shape[1], 32).unwrap(), "{name}");
            assert_ne!(got, f32s, "{name} was quantized");
            quantized += 1;
        } else {
            assert_eq!(got, f32s, "{name}");
        }
    }
    assert_eq!(quantized, 14);

    // Copies with one thing changed: a header entry, or the config's scheme.
    let dir = miles_tests::scratch("int4_bad_tensors");
    let rewrite = |edit: &dyn Fn(&mut Header)| {
        rewrite_header(&int4, &dir, edit);
        miles_model::Weights::load(&dir, &config).unwrap_err().to_string()
    };
    let w = "model.layers.0.mlp.down_proj.weight";
    // The scale's 256 values as [128, 2]: not one row of scales per weight row.
    let e = rewrite(&|h| h[&format!("{w}_scale")]["shape"] = serde_json::json!([128, 2]));
    assert!(e.contains(&format!("{w}_scale")) && e.contains("groups divide the row"), "{e}");
    let e = rewrite(&|h| h[&format!("{w}_packed")]["dtype"] = "F32".into());
    assert!(e.contains(&format!("{w}_packed")) && e.contains("expected I32"), "{e}");
    let e = rewrite(&|h| {
        let v = h.remove(&format!("{w}_shape")).unwrap();
        h.insert("moved".into(), v);
    });
    assert!(e.contains(&format!("tensor '{w}_shape': missing")), "{e}");
    let mut c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(int4.join("config.json")).unwrap()).unwrap();
    c["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"] = 8.into();
    std::fs::write(dir.join("config.json"), c.to_string()).unwrap();
    let e = ModelConfig::from_file(&dir.join("config.json")).unwrap_err().to_string();
    assert!(e.contains("config_groups.group_0.weights.num_bits 8 is not supported"), "{e}");
}

/// The tiny DeepSeek-V3 as an FP8 checkpoint (`make_fp8_checkpoint.py deepseek_v3`: its latent
/// attention's projections and routed and shared experts in E4M3 blocks; routers, correction
/// biases, embeddings and norms F32) loads dequantized: in the files' layout (before memory
/// reorders the query heads), every matrix is q · s with miles-rs' own codec's codes and scales.
#[test]
fn a_deepseek_v3_fp8_checkpoint_loads_dequantized_with_the_codecs_bits() {
    use miles_model::file_layout::file_tensors;
    use miles_tensor::cpu::{dequantize_blocks, quantize_blocks};
    let fp8 = miles_tests::workspace_root().join("tests/fixtures/fp8/deepseek_v3");
    let config = ModelConfig::from_file(&fp8.join("config.json")).unwrap();
    let loaded = miles_model::Weights::load(&fp8, &config).unwrap();
    let original = miles_model::Weights::load(&fixture("deepseek_v3"), &config).unwrap();
    let (got, want) = (file_tensors(&config, &loaded), file_tensors(&config, &original));
    let mut quantized = 0;
    for ((name, shape, got), (_, _, f32s)) in got.iter().zip(&want) {
        let stem = name.trim_end_matches(".weight");
        if name.starts_with("model.layers.") && (stem.ends_with("_proj") || stem.ends_with("_mqa"))
        {
            let (codes, scales) = quantize_blocks(f32s, shape[0], shape[1]);
            let want = dequantize_blocks(&codes, &scales, shape[0], shape[1]);
            assert_eq!(got[..], want[..], "{name}");
            quantized += 1;
        } else {
            assert_eq!(got, f32s, "{name}");
        }
    }
    assert_eq!(quantized, 69);
}

/// An FP8 checkpoint as DeepSeek-V3 and Qwen3 release them (`tests/fixtures/fp8/qwen3`, the
/// tiny Qwen3 above quantized by `make_fp8_checkpoint.py` with numpy and ml_dtypes) loads
/// dequantized: every matrix is q · s with the very codes and scales miles-rs' own codec gives
/// the f32 weights (two implementations of DeepGEMM's blockwise recipe agree bit for bit), the
/// rest as stored. A scale of the wrong shape, or none, names the tensor.
#[test]
fn an_fp8_checkpoint_loads_dequantized_with_the_codecs_bits() {
    use miles_tensor::cpu::{dequantize_blocks, quantize_blocks};
    let fp8 = miles_tests::workspace_root().join("tests/fixtures/fp8/qwen3");
    let config = ModelConfig::from_file(&fp8.join("config.json")).unwrap();
    let loaded = miles_model::Weights::load(&fp8, &config).unwrap();
    let original = miles_model::Weights::load(&fixture("qwen3"), &config).unwrap();
    let spec = miles_model::weights::tensor_spec(&config);
    let pairs = loaded.tensors().into_iter().zip(original.tensors());
    let mut quantized = 0;
    for ((name, shape), (got, f32s)) in spec.iter().zip(pairs) {
        let projection = name.starts_with("model.layers.") && name.ends_with("_proj.weight");
        if projection {
            let (codes, scales) = quantize_blocks(f32s, shape[0], shape[1]);
            assert_eq!(*got, dequantize_blocks(&codes, &scales, shape[0], shape[1]), "{name}");
            assert_ne!(got, f32s, "{name} was quantized");
            quantized += 1;
        } else {
            assert_eq!(got, f32s, "{name}");
        }
    }
    assert_eq!(quantized, 14);

    // The header of a copy rewritten: one scale's shape, then its name.
    let dir = miles_tests::scratch("fp8_bad_scales");
    let scale = "model.layers.0.self_attn.q_proj.weight_scale_inv";
    let rewrite = |edit: &dyn Fn(&mut Header)| {
        rewrite_header(&fp8, &dir, edit);
        miles_model::Weights::load(&dir, &config).unwrap_err().to_string()
    };
    let e = rewrite(&|h| h[scale]["shape"] = serde_json::json!([1]));
    assert!(e.contains(&format!("tensor '{scale}': shape [1], expected [1, 1]")), "{e}");
    let e = rewrite(&|h| {
        let v = h.remove(scale).unwrap();
        h.insert(format!("{scale}_moved"), v);
    });
    assert!(e.contains(&format!("tensor '{scale}': missing from the checkpoint")), "{e}");
}
