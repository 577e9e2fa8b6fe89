//! Tensors as checkpoint files hold them, where that differs from the layout in memory
//! ([`tensor_spec`]). GLM-4's and DeepSeek-V3's do:
//!
//! - its MLP's gate and up are one tensor, `mlp.gate_up_proj` (gate's rows first);
//! - its norms are named for where they sit: `post_self_attn_layernorm` (after attention),
//!   `post_attention_layernorm` (before the MLP), `post_mlp_layernorm`, which memory holds
//!   under Gemma's names for the same places;
//! - its rotary turns the interleaved pairs (2j, 2j + 1) of a head's first `rotary_dim`
//!   dimensions, where the model (every kernel) turns the pairs (j, j + head_dim/2). Scores
//!   are the same under any order of a head's dimensions applied to q and k alike, so memory
//!   holds q_proj's and k_proj's rows (and biases) of each head reordered: the attention is
//!   GLM's, and the files round-trip bit for bit.
//!
//! DeepSeek-V3's heads are a non-rotary part then a rotary one whose pairs are interleaved
//! (or halves, without `rope_interleave`); memory holds each query head as a head with a
//! partial rotary (the rotary's pairs at (j, j + d/2), the non-rotary dimensions in the rest of
//! both halves, GLM's layout), so the rows of `q_proj` (`q_b_proj`) are reordered per head,
//! and the shared rotary key's rows of `kv_a_proj_with_mqa` are put in halves.
//!
//! Every reader and writer of model-shaped tensors (HF checkpoints, our checkpoints' weights
//! and optimizer moments, HF exports, the parity fixtures' gradients) goes through here.

use std::borrow::Cow;

use crate::weights::{Weights, tensor_spec};
use crate::{Architecture, Error, ModelConfig};

/// A tensor as written: file name, shape, values.
pub type FileTensor<'a> = (String, Vec<usize>, Cow<'a, [f32]>);

/// The tensors of `w` as the files of a `c` model hold them.
pub fn file_tensors<'a>(c: &ModelConfig, w: &'a Weights) -> Vec<FileTensor<'a>> {
    let glm = c.architecture == Architecture::Glm4;
    let mut tensors = tensor_spec(c).into_iter().zip(w.tensors()).peekable();
    let mut out: Vec<FileTensor<'a>> = Vec::new();
    while let Some(((name, shape), data)) = tensors.next() {
        let (layer, rest) = split(&name);
        if let Some((d, order)) = row_order(c, rest) {
            let rows = reorder(data, shape[0], d, &order, true);
            out.push((name, shape, Cow::Owned(rows)));
        } else if !glm {
            out.push((name, shape, Cow::Borrowed(data)));
        } else if rest == "mlp.gate_proj.weight" {
            // (tensor_spec lists up_proj right after gate_proj.)
            let (_, up) = tensors.next().expect("up_proj follows gate_proj");
            let fused = [&data[..], &up[..]].concat();
            let name = format!("{layer}mlp.gate_up_proj.weight");
            out.push((name, vec![2 * shape[0], shape[1]], Cow::Owned(fused)));
        } else {
            out.push((glm_name(layer, rest).unwrap_or(name), shape, Cow::Borrowed(data)));
        }
    }
    out
}

/// The file name of memory tensor `name` (gate and up: their fused tensor).
pub fn file_name(c: &ModelConfig, name: &str) -> String {
    if c.architecture != Architecture::Glm4 {
        return name.to_string();
    }
    let (layer, rest) = split(name);
    match rest {
        "mlp.gate_proj.weight" | "mlp.up_proj.weight" => format!("{layer}mlp.gate_up_proj.weight"),
        _ => glm_name(layer, rest).unwrap_or_else(|| name.to_string()),
    }
}

/// Weights of a `c` model from its files: `read(file name, shape)` gives a file tensor as f32
/// (checked against the shape; its errors name the file's tensor).
pub fn weights_from_files<E: From<Error>>(
    c: &ModelConfig,
    mut read: impl FnMut(&str, &[usize]) -> std::result::Result<Vec<f32>, E>,
) -> std::result::Result<Weights, E> {
    let glm = c.architecture == Architecture::Glm4;
    // The up half of the last gate_up_proj read, for the up_proj after it.
    let mut up: Option<Vec<f32>> = None;
    Weights::build(c, |name, shape| {
        let (layer, rest) = split(name);
        if let Some((d, order)) = row_order(c, rest) {
            return Ok(reorder(&read(name, shape)?, shape[0], d, &order, false));
        }
        if !glm {
            return read(name, shape);
        }
        match rest {
            "mlp.gate_proj.weight" => {
                let mut gate =
                    read(&format!("{layer}mlp.gate_up_proj.weight"), &[2 * shape[0], shape[1]])?;
                up = Some(gate.split_off(gate.len() / 2));
                Ok(gate)
            }
            "mlp.up_proj.weight" => up.take().ok_or_else(|| {
                Error::Invalid(format!("internal: {name} read before its gate_proj")).into()
            }),
            _ => read(&glm_name(layer, rest).unwrap_or_else(|| name.to_string()), shape),
        }
    })
}

/// `model.layers.N.` and the rest of a layer's tensor name; ("", name) outside the layers.
fn split(name: &str) -> (&str, &str) {
    let Some(rest) = name.strip_prefix("model.layers.") else { return ("", name) };
    match rest.find('.') {
        Some(k) => name.split_at("model.layers.".len() + k + 1),
        None => ("", name),
    }
}

/// GLM-4's name for a layer norm memory holds under Gemma's.
fn glm_name(layer: &str, rest: &str) -> Option<String> {
    let file = match rest {
        "post_attention_layernorm.weight" => "post_self_attn_layernorm.weight",
        "pre_feedforward_layernorm.weight" => "post_attention_layernorm.weight",
        "post_feedforward_layernorm.weight" => "post_mlp_layernorm.weight",
        _ => return None,
    };
    Some(format!("{layer}{file}"))
}

/// A layer's tensor `rest` (`rows` rows) of a `c` model in the files' row order (`to_file`)
/// or in memory's: the rows a draft's MTP layer reorders as the model's layers do.
pub(crate) fn layer_rows<'a>(
    c: &ModelConfig,
    rest: &str,
    data: &'a [f32],
    rows: usize,
    to_file: bool,
) -> Cow<'a, [f32]> {
    match row_order(c, rest) {
        Some((d, order)) => Cow::Owned(reorder(data, rows, d, &order, to_file)),
        None => Cow::Borrowed(data),
    }
}

/// How memory orders the rows of a layer's tensor `rest` against the file, where it does:
/// in blocks of `d` rows, memory's row `j` of a block is the file's `order[j]`.
fn row_order(c: &ModelConfig, rest: &str) -> Option<(usize, Vec<usize>)> {
    match (c.architecture, &c.mla, rest) {
        (
            Architecture::Glm4,
            _,
            "self_attn.q_proj.weight"
            | "self_attn.q_proj.bias"
            | "self_attn.k_proj.weight"
            | "self_attn.k_proj.bias",
        ) => Some((c.head_dim, glm_order(c))),
        (_, Some(_), "self_attn.q_proj.weight" | "self_attn.q_b_proj.weight") => {
            Some((c.head_dim, mla_query_order(c)))
        }
        (_, Some(m), "self_attn.kv_a_proj_with_mqa.weight") if m.rope_interleave => {
            let pairs = m.qk_rope_head_dim / 2;
            let halves = (0..pairs).map(|j| 2 * j).chain((0..pairs).map(|j| 2 * j + 1));
            let order = (0..m.kv_lora_rank).chain(halves.map(|j| m.kv_lora_rank + j)).collect();
            Some((m.kv_lora_rank + m.qk_rope_head_dim, order))
        }
        _ => None,
    }
}

/// For DeepSeek-V3: the file's dimension that memory dimension j of a query head holds. The
/// file's head is `qk_nope_head_dim` dimensions then the rotary's (pairs (2j, 2j + 1), or
/// (j, j + r/2) without `rope_interleave`); memory puts pair j at (j, j + d/2) and the
/// non-rotary dimensions in order in the rest of both halves, as [`glm_order`] does.
pub(crate) fn mla_query_order(c: &ModelConfig) -> Vec<usize> {
    let m = c.mla.as_ref().expect("a latent-attention model");
    let (half, turned, nope) = (c.head_dim / 2, m.qk_rope_head_dim / 2, m.qk_nope_head_dim);
    let pass = half - turned;
    let pair = |j: usize, second: bool| match (m.rope_interleave, second) {
        (true, false) => nope + 2 * j,
        (true, true) => nope + 2 * j + 1,
        (false, false) => nope + j,
        (false, true) => nope + turned + j,
    };
    let first = (0..turned).map(|j| pair(j, false)).chain(0..pass);
    let second = (0..turned).map(|j| pair(j, true)).chain(pass..nope);
    first.chain(second).collect()
}

/// For GLM-4: the file's dimension that memory dimension j of a head holds. The rotary's
/// pair (2j, 2j + 1) goes to (j, j + d/2); the dimensions it does not turn fill the rest of
/// both halves in order (pairs with cos 1 and sin 0).
fn glm_order(c: &ModelConfig) -> Vec<usize> {
    let (half, turned) = (c.head_dim / 2, c.rotary_dim / 2);
    let pass = half - turned;
    let first = (0..turned).map(|j| 2 * j).chain((0..pass).map(|j| 2 * turned + j));
    let second = (0..turned).map(|j| 2 * j + 1).chain((0..pass).map(|j| 2 * turned + pass + j));
    first.chain(second).collect()
}

/// `data`'s `rows` rows (heads of `d` rows each) reordered by `order`: to the file's order
/// (`to_file`) or from it.
fn reorder(data: &[f32], rows: usize, d: usize, order: &[usize], to_file: bool) -> Vec<f32> {
    let cols = data.len() / rows;
    let mut out = vec![0.0; data.len()];
    for head in 0..rows / d {
        for (j, &file) in order.iter().enumerate() {
            let (mem, file) = ((head * d + j) * cols, (head * d + file) * cols);
            let (to, from) = if to_file { (file, mem) } else { (mem, file) };
            out[to..to + cols].copy_from_slice(&data[from..from + cols]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::preset;

    #[test]
    fn glm_order_is_a_permutation_pairing_the_interleaved_dimensions() {
        let c = preset("glm4-9b", None).unwrap();
        let order = glm_order(&c);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..128).collect::<Vec<_>>());
        // Rotary pair j: file dimensions (2j, 2j + 1) at (j, j + 64); the rest pass.
        assert_eq!((order[0], order[64], order[31], order[95]), (0, 1, 62, 63));
        assert_eq!((order[32], order[96], order[63], order[127]), (64, 96, 95, 127));
    }

    #[test]
    fn glm_files_fuse_gate_up_rename_norms_and_round_trip_bit_for_bit() {
        let c = preset("tiny", Some(Architecture::Glm4)).unwrap();
        let w = Weights::random(&c, 7);
        let files = file_tensors(&c, &w);
        let names: Vec<&str> = files.iter().map(|t| t.0.as_str()).collect();
        for want in [
            "model.layers.0.mlp.gate_up_proj.weight",
            "model.layers.1.post_self_attn_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.layers.1.post_mlp_layernorm.weight",
            "model.layers.0.self_attn.q_proj.bias",
        ] {
            assert!(names.contains(&want), "{want} missing from {names:?}");
        }
        assert!(!names.iter().any(|n| n.contains("gate_proj") || n.contains("feedforward")));
        let fused = files.iter().find(|t| t.0 == "model.layers.0.mlp.gate_up_proj.weight").unwrap();
        assert_eq!(fused.1, vec![2 * c.intermediate_size, c.hidden_size]);
        assert_eq!(&fused.2[..w.layers[0].gate_proj.len()], &w.layers[0].gate_proj[..]);
        // q's rows in the file's order differ from memory's, and read back exactly.
        let q = files.iter().find(|t| t.0 == "model.layers.0.self_attn.q_proj.weight").unwrap();
        assert_ne!(&q.2[..], &w.layers[0].q_proj[..]);
        let back = weights_from_files(&c, |name, shape| {
            let t = files.iter().find(|t| t.0 == name).expect(name);
            assert_eq!(t.1, shape, "{name}");
            Ok::<_, Error>(t.2.to_vec())
        })
        .unwrap();
        assert_eq!(back, w);
        assert_eq!(
            file_name(&c, "model.layers.3.mlp.up_proj.weight"),
            "model.layers.3.mlp.gate_up_proj.weight"
        );
        let qwen = preset("tiny", None).unwrap();
        assert_eq!(
            file_name(&qwen, "model.layers.3.mlp.up_proj.weight"),
            "model.layers.3.mlp.up_proj.weight"
        );
    }

    /// Memory's query head of the q_lora fixture (halves) and of a DeepSeek-V3-sized one
    /// (interleaved): the rotary's pairs at (j, j + d/2), the rest in order.
    #[test]
    fn mla_query_order_pairs_the_rotary_dimensions_and_keeps_the_rest_in_order() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf");
        let c = ModelConfig::from_file(&dir.join("deepseek_v3/config.json")).unwrap();
        // nope 16, rope 8 interleaved, d 24: pairs (16, 17) .. (22, 23) at (0, 12) .. (3, 15).
        let order = mla_query_order(&c);
        assert_eq!(&order[..4], [16, 18, 20, 22]);
        assert_eq!(&order[4..12], [0, 1, 2, 3, 4, 5, 6, 7]);
        assert_eq!(&order[12..16], [17, 19, 21, 23]);
        assert_eq!(&order[16..], [8, 9, 10, 11, 12, 13, 14, 15]);
        let c = ModelConfig::from_file(&dir.join("deepseek_v3_q_lora/config.json")).unwrap();
        let order = mla_query_order(&c);
        assert_eq!((&order[..4], &order[12..16]), (&[16, 17, 18, 19][..], &[20, 21, 22, 23][..]));
    }

    /// The fixtures' files load into memory's layout and are written back bit for bit.
    #[test]
    fn deepseek_files_round_trip_bit_for_bit() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/hf");
        for name in ["deepseek_v3", "deepseek_v3_q_lora"] {
            let c = ModelConfig::from_file(&dir.join(name).join("config.json")).unwrap();
            let w = Weights::load(&dir.join(name), &c).unwrap();
            let files = crate::weights::TensorFiles::open(&dir.join(name)).unwrap();
            let written = file_tensors(&c, &w);
            assert_eq!(written.len(), files.names().len(), "{name}");
            for (file, shape, data) in &written {
                assert_eq!(files.f32(file, shape).unwrap(), data.to_vec(), "{name}: {file}");
            }
            let q = if name == "deepseek_v3" { "q_proj" } else { "q_b_proj" };
            let q = format!("model.layers.0.self_attn.{q}.weight");
            let mem = &w.layers[0];
            let mem_q = if name == "deepseek_v3" { &mem.q_proj } else { &mem.q_b_proj };
            let file_q = &written.iter().find(|t| t.0 == q).unwrap().2;
            assert_ne!(&file_q[..], &mem_q[..], "{name}: the query heads are reordered");
        }
    }
}
