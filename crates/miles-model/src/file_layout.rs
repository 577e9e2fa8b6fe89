//! Tensors as checkpoint files hold them, where that differs from the layout in memory
//! ([`tensor_spec`]). Only GLM-4's does:
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
//! Every reader and writer of model-shaped tensors (HF checkpoints, our checkpoints' weights
//! and optimizer moments, HF exports, the parity fixtures' gradients) goes through here.

use std::borrow::Cow;

use crate::weights::{Weights, tensor_spec};
use crate::{Architecture, Error, ModelConfig};

/// A tensor as written: file name, shape, values.
pub type FileTensor<'a> = (String, Vec<usize>, Cow<'a, [f32]>);

/// The tensors of `w` as the files of a `c` model hold them.
pub fn file_tensors<'a>(c: &ModelConfig, w: &'a Weights) -> Vec<FileTensor<'a>> {
    let order = glm_order(c);
    let mut tensors = tensor_spec(c).into_iter().zip(w.tensors()).peekable();
    let mut out: Vec<FileTensor<'a>> = Vec::new();
    while let Some(((name, shape), data)) = tensors.next() {
        let Some(order) = &order else {
            out.push((name, shape, Cow::Borrowed(data)));
            continue;
        };
        let (layer, rest) = split(&name);
        if rest == "mlp.gate_proj.weight" {
            // (tensor_spec lists up_proj right after gate_proj.)
            let (_, up) = tensors.next().expect("up_proj follows gate_proj");
            let fused = [&data[..], &up[..]].concat();
            let name = format!("{layer}mlp.gate_up_proj.weight");
            out.push((name, vec![2 * shape[0], shape[1]], Cow::Owned(fused)));
        } else if turned(rest) {
            let rows = reorder(data, shape[0], c.head_dim, order, true);
            out.push((name, shape, Cow::Owned(rows)));
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
    let Some(order) = glm_order(c) else { return Weights::build(c, read) };
    // The up half of the last gate_up_proj read, for the up_proj after it.
    let mut up: Option<Vec<f32>> = None;
    Weights::build(c, |name, shape| {
        let (layer, rest) = split(name);
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
            _ if turned(rest) => {
                Ok(reorder(&read(name, shape)?, shape[0], c.head_dim, &order, false))
            }
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

/// Whether the tensor's rows are q or k head dimensions (reordered for the rotary).
fn turned(rest: &str) -> bool {
    matches!(
        rest,
        "self_attn.q_proj.weight"
            | "self_attn.q_proj.bias"
            | "self_attn.k_proj.weight"
            | "self_attn.k_proj.bias"
    )
}

/// For GLM-4: the file's dimension that memory dimension j of a head holds. The rotary's
/// pair (2j, 2j + 1) goes to (j, j + d/2); the dimensions it does not turn fill the rest of
/// both halves in order (pairs with cos 1 and sin 0).
fn glm_order(c: &ModelConfig) -> Option<Vec<usize>> {
    if c.architecture != Architecture::Glm4 {
        return None;
    }
    let (half, turned) = (c.head_dim / 2, c.rotary_dim / 2);
    let pass = half - turned;
    let first = (0..turned).map(|j| 2 * j).chain((0..pass).map(|j| 2 * turned + j));
    let second = (0..turned).map(|j| 2 * j + 1).chain((0..pass).map(|j| 2 * turned + pass + j));
    Some(first.chain(second).collect())
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
        let order = glm_order(&c).unwrap();
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
}
