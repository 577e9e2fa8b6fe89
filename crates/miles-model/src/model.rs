//! What a model is on the host: its configuration and f32 weights ([`Model`]), and the inputs
//! of its forward ([`PackedBatch`], [`RoutedBatch`]) and of the engine's incremental steps
//! ([`StepRow`]). The computing model is [`crate::DeviceModel`], on any device.

use crate::kv::BlockId;
use crate::{Error, ModelConfig, Result, Weights};

/// Sequences packed back to back without padding. Sequence `s` is
/// `tokens[cu_seqlens[s]..cu_seqlens[s + 1]]`, of which the first `prompt_lens[s]` are the
/// prompt; the rest is the response whose logprobs the model reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedBatch {
    pub tokens: Vec<u32>,
    pub cu_seqlens: Vec<usize>,
    pub prompt_lens: Vec<usize>,
    /// The experts the rollout engine routed the tokens to (Qwen3-MoE).
    pub routed: Option<RoutedBatch>,
}

/// The experts a rollout routed each token of a packed batch to, in the sparse layers in
/// order: `ids[(token · layers + layer) · top_k + k]`, [`crate::moe::OWN_CHOICE`] for a token
/// without a record (each sequence's last, never run by the engine). The forward compares its
/// own choices with them (`Forward::routing_mismatch`) and uses `replay`, in the same layout,
/// when given (Rollout Routing Replay).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedBatch {
    pub layers: usize,
    pub top_k: usize,
    pub ids: Vec<u32>,
    pub replay: Option<Vec<u32>>,
}

impl RoutedBatch {
    /// Sparse layer `layer`'s experts of `table` (`[tokens × layers × top_k]`), `[tokens ×
    /// top_k]`.
    pub(crate) fn layer(&self, table: &[u32], layer: usize) -> Vec<u32> {
        table
            .chunks(self.layers * self.top_k)
            .flat_map(|row| &row[layer * self.top_k..(layer + 1) * self.top_k])
            .copied()
            .collect()
    }
}

impl PackedBatch {
    /// Packs `(tokens, prompt_len)` pairs; each needs a prompt of at least one token.
    pub fn new(sequences: &[(Vec<u32>, usize)]) -> Result<Self> {
        let mut batch = PackedBatch {
            tokens: Vec::new(),
            cu_seqlens: vec![0],
            prompt_lens: Vec::new(),
            routed: None,
        };
        for (s, (tokens, prompt_len)) in sequences.iter().enumerate() {
            if *prompt_len == 0 || *prompt_len > tokens.len() {
                return Err(Error::Invalid(format!(
                    "sequence {s}: prompt length {prompt_len} must be in 1..={} (its token count)",
                    tokens.len()
                )));
            }
            batch.tokens.extend(tokens);
            batch.cu_seqlens.push(batch.tokens.len());
            batch.prompt_lens.push(*prompt_len);
        }
        Ok(batch)
    }

    pub fn num_sequences(&self) -> usize {
        self.prompt_lens.len()
    }

    /// Position of each token within its sequence.
    pub fn positions(&self) -> Vec<u32> {
        let mut pos = Vec::with_capacity(self.tokens.len());
        for w in self.cu_seqlens.windows(2) {
            pos.extend(0..(w[1] - w[0]) as u32);
        }
        pos
    }

    /// Response tokens per sequence.
    pub fn response_lengths(&self) -> Vec<usize> {
        self.cu_seqlens.windows(2).zip(&self.prompt_lens).map(|(w, p)| w[1] - w[0] - p).collect()
    }

    /// The rows whose hidden state predicts a response token, and those tokens.
    pub fn response_rows(&self) -> (Vec<usize>, Vec<u32>) {
        let (mut rows, mut targets) = (Vec::new(), Vec::new());
        for (w, &p) in self.cu_seqlens.windows(2).zip(&self.prompt_lens) {
            for i in w[0] + p..w[1] {
                rows.push(i - 1);
                targets.push(self.tokens[i]);
            }
        }
        (rows, targets)
    }

    pub(crate) fn validate(&self, vocab: usize) -> Result<()> {
        let ok = self.cu_seqlens.first() == Some(&0)
            && self.cu_seqlens.last() == Some(&self.tokens.len())
            && self.cu_seqlens.len() == self.prompt_lens.len() + 1
            && self
                .cu_seqlens
                .windows(2)
                .zip(&self.prompt_lens)
                .all(|(w, &p)| p >= 1 && w[0] + p <= w[1]);
        if !ok {
            return Err(Error::Invalid(format!(
                "packed batch: cu_seqlens {:?} and prompt_lens {:?} do not describe {} tokens",
                self.cu_seqlens,
                self.prompt_lens,
                self.tokens.len()
            )));
        }
        if let Some(&bad) = self.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::Invalid(format!(
                "token id {bad} is outside the vocabulary of {vocab}"
            )));
        }
        if let Some(r) = &self.routed
            && (r.ids.len() != self.tokens.len() * r.layers * r.top_k
                || r.replay.as_ref().is_some_and(|p| p.len() != r.ids.len()))
        {
            return Err(Error::Invalid(format!(
                "packed batch: {} routed experts for {} tokens × {} sparse layers × top-{}",
                r.ids.len(),
                self.tokens.len(),
                r.layers,
                r.top_k
            )));
        }
        Ok(())
    }
}

/// Errors unless `temperature` is a positive number.
pub(crate) fn check_temperature(temperature: f32) -> Result<()> {
    if temperature.is_nan() || temperature <= 0.0 {
        return Err(Error::Invalid(format!("temperature {temperature} must be > 0")));
    }
    Ok(())
}

/// Errors unless a backward gets one logp and one entropy gradient per response token.
pub(crate) fn check_output_grads(d_logp: &[f32], d_entropy: &[f32], tokens: usize) -> Result<()> {
    if d_logp.len() != tokens || d_entropy.len() != tokens {
        return Err(Error::Invalid(format!(
            "backward: {} logp gradients and {} entropy gradients for {tokens} response tokens",
            d_logp.len(),
            d_entropy.len(),
        )));
    }
    Ok(())
}

/// A model's configuration and f32 weights on the host: what checkpoints, presets and GGUF
/// conversion produce and [`crate::DeviceModel::new`] places on a device to compute.
#[derive(Debug, Clone)]
pub struct Model {
    pub config: ModelConfig,
    pub weights: Weights,
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights) -> Self {
        Model { config, weights }
    }
}

/// One token of an incremental forward: its id, its position in its sequence and the
/// sequence's block table, which must cover `position`.
#[derive(Debug, Clone, Copy)]
pub struct StepRow<'a> {
    pub token: u32,
    pub position: usize,
    pub blocks: &'a [BlockId],
}

impl<'a> StepRow<'a> {
    /// `rows` with their first `ids.len()` tokens replaced by `ids` (a sampler's draws read
    /// back; -1, none, as token 0).
    pub fn with_tokens(rows: &[StepRow<'a>], ids: &[i32]) -> Vec<StepRow<'a>> {
        let mut out = rows.to_vec();
        for (r, &id) in out.iter_mut().zip(ids) {
            r.token = id.max(0) as u32;
        }
        out
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::testing::on_cpu;
    use crate::{Architecture, Biases, RopeScaling};
    use miles_tensor::rng::Rng;
    use miles_tensor::testing::{check_gradient, dot};

    pub(crate) fn tiny(architecture: Architecture, tie: bool) -> ModelConfig {
        ModelConfig {
            architecture,
            vocab_size: 11,
            hidden_size: 8,
            intermediate_size: 12,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 4,
            rotary_dim: 4,
            bias: Biases::default(),
            rms_norm_eps: 1e-6,
            rope_theta: 10_000.0,
            rope_scaling: RopeScaling::None,
            tie_word_embeddings: tie,
            max_position_embeddings: 64,
            bos_token_id: None,
            eos_token_ids: vec![],
            moe: None,
            gemma: None,
            mtp_input: false,
            mla: None,
        }
    }

    /// Random weights large enough that every path matters, norms away from 1.
    pub(crate) fn model(c: ModelConfig, seed: u64) -> Model {
        let mut w = Weights::random(&c, seed);
        let mut rng = Rng::new(seed + 1);
        for t in w.tensors_mut() {
            for v in t.iter_mut() {
                *v = if *v == 1.0 { 1.0 + 0.3 * rng.normal() } else { 0.4 * rng.normal() };
            }
        }
        Model::new(c, w)
    }

    pub(crate) fn batch() -> PackedBatch {
        PackedBatch::new(&[
            (vec![1, 5, 9, 2, 2, 7], 2),
            (vec![3, 10, 0], 1),
            (vec![4, 4, 8, 6, 1], 3),
        ])
        .unwrap()
    }

    #[test]
    fn gradients_of_every_tensor_match_finite_differences() {
        for (arch, tie) in [(Architecture::Qwen3, true), (Architecture::Llama, false)] {
            let m = model(tiny(arch, tie), 21);
            let b = batch();
            let t = 0.8;
            let mut dm = on_cpu(&m);
            let fwd = dm.forward(&b, t).unwrap();
            let mut rng = Rng::new(3);
            let (ga, gb) = (rng.vec(fwd.logp.len(), 1.0), rng.vec(fwd.logp.len(), 1.0));
            dm.backward(&fwd, &b, &ga, &gb).unwrap();
            let grads = dm.grads_to_host().unwrap();
            let spec = crate::weights::tensor_spec(&m.config);
            for (k, (name, _)) in spec.iter().enumerate() {
                let analytic = grads.tensors()[k].clone();
                let mut probe = m.weights.clone();
                let mut x = probe.tensors()[k].clone();
                check_gradient(name, &mut x, &analytic, 12, |x| {
                    *probe.tensors_mut()[k] = x.to_vec();
                    dm.set_weights(&probe).unwrap();
                    let (lp, ent) = dm.logprobs(&b, t).unwrap();
                    dot(&ga, &lp) + dot(&gb, &ent)
                });
            }
        }
    }

    /// A tiny Qwen3-MoE: layer 0 routes over 4 experts (top 2), layer 1 is dense
    /// (`mlp_only_layers`).
    pub(crate) fn tiny_moe(norm_topk_prob: bool, router_aux_loss_coef: f32) -> ModelConfig {
        ModelConfig {
            moe: Some(Box::new(crate::MoeConfig {
                num_experts: 4,
                num_experts_per_tok: 2,
                moe_intermediate_size: 6,
                norm_topk_prob,
                decoder_sparse_step: 1,
                mlp_only_layers: vec![1],
                router_aux_loss_coef,
                routing: crate::Routing::Softmax,
                shared_experts: 0,
            })),
            ..tiny(Architecture::Qwen3Moe, false)
        }
    }

    /// Every tensor of a Qwen3-MoE model (router and experts included) against finite
    /// differences, with and without renormalized top-k weights, with the load-balancing loss
    /// added to the probed scalar when its weight is set, and with replayed experts (R3). The
    /// probes are small enough that no token changes experts.
    #[test]
    fn moe_gradients_of_every_tensor_match_finite_differences() {
        for (norm, coef, replay) in [(true, 0.0, false), (false, 0.7, false), (true, 0.2, true)] {
            let m = model(tiny_moe(norm, coef), 23);
            let mut b = batch();
            if replay {
                // Replayed experts unrelated to the router's own choice (the last token of
                // each sequence routes itself): the router still gets the gate weights'
                // gradient at them.
                let mut rng = Rng::new(9);
                let mut ids = Vec::new();
                for _ in 0..b.tokens.len() {
                    let first = rng.below(4) as u32;
                    ids.extend([first, (first + 1 + rng.below(3) as u32) % 4]);
                }
                for &end in &b.cu_seqlens[1..] {
                    ids[(end - 1) * 2..end * 2].fill(crate::moe::OWN_CHOICE);
                }
                b.routed =
                    Some(RoutedBatch { layers: 1, top_k: 2, ids: ids.clone(), replay: Some(ids) });
            }
            let t = 0.9;
            let mut dm = on_cpu(&m);
            let fwd = dm.forward(&b, t).unwrap();
            let aux = fwd.sparse.router_aux_loss.unwrap();
            assert!((1.0..4.0).contains(&aux), "{aux}");
            let mut rng = Rng::new(4);
            let (ga, gb) = (rng.vec(fwd.logp.len(), 1.0), rng.vec(fwd.logp.len(), 1.0));
            dm.backward(&fwd, &b, &ga, &gb).unwrap();
            let grads = dm.grads_to_host().unwrap();
            let spec = crate::weights::tensor_spec(&m.config);
            assert!(spec.iter().any(|(n, _)| n == "model.layers.0.mlp.experts.3.down_proj.weight"));
            assert!(spec.iter().any(|(n, _)| n == "model.layers.1.mlp.gate_proj.weight"));
            for (k, (name, _)) in spec.iter().enumerate() {
                let analytic = grads.tensors()[k].clone();
                let mut probe = m.weights.clone();
                let mut x = probe.tensors()[k].clone();
                check_gradient(name, &mut x, &analytic, 12, |x| {
                    *probe.tensors_mut()[k] = x.to_vec();
                    dm.set_weights(&probe).unwrap();
                    let f = dm.forward(&b, t).unwrap();
                    let aux = f64::from(coef) * f.sparse.router_aux_loss.unwrap();
                    dot(&ga, &f.logp) + dot(&gb, &f.entropy) + aux
                });
            }
        }
    }

    #[test]
    fn packing_does_not_mix_sequences() {
        let m = on_cpu(&model(tiny(Architecture::Qwen3, true), 5));
        let (lp, ent) = m.logprobs(&batch(), 1.0).unwrap();
        let alone = PackedBatch::new(&[(vec![3, 10, 0], 1)]).unwrap();
        let (lp1, ent1) = m.logprobs(&alone, 1.0).unwrap();
        // The second sequence's two response tokens follow the first's four.
        for k in 0..2 {
            assert!((lp[4 + k] - lp1[k]).abs() < 1e-5 && (ent[4 + k] - ent1[k]).abs() < 1e-5);
        }
        assert!(lp.iter().all(|v| *v < 0.0) && ent.iter().all(|v| *v > 0.0));
    }

    #[test]
    fn bad_batches_are_errors() {
        assert!(PackedBatch::new(&[(vec![1, 2], 0)]).is_err());
        assert!(PackedBatch::new(&[(vec![1, 2], 3)]).is_err());
    }
}
