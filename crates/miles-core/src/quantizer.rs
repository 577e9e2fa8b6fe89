use serde::{Deserialize, Serialize};

use crate::Result;

/// A weight matrix as the host sees it: row-major f32 with its HF tensor name.
#[derive(Debug, Clone, Copy)]
pub struct WeightView<'a> {
    pub name: &'a str,
    pub shape: &'a [usize],
    pub data: &'a [f32],
}

/// The storage layout a quantizer produces. Device kernels in `miles-tensor` dispatch on this
/// description, so a rollout engine on the GPU quantizes in place with the same rules the host
/// reference below defines.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantFormat {
    /// A short identifier, e.g. `fp8_e4m3` or `int4_packed`.
    pub name: String,
    /// Bits per stored element.
    pub bits: u32,
    /// Elements sharing one scale, as `[rows, cols]` of a block (e.g. `[128, 128]` for
    /// DeepSeek-style FP8, `[1, 128]` for per-group INT4).
    pub block: [usize; 2],
}

/// A quantized weight: packed elements plus one f32 scale per block (row-major over blocks).
#[derive(Debug, Clone, PartialEq)]
pub struct Quantized {
    pub format: QuantFormat,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

/// Whether miles quantizes the weight `name` (an HF tensor name): the attention projections,
/// the MLP and every expert; not the embeddings, the norms, the LM head or a MoE router.
pub fn quantizes(name: &str) -> bool {
    let Some(stem) = name.strip_suffix(".weight") else { return false };
    let linear = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    stem.starts_with("model.layers.") && linear.iter().any(|l| stem.ends_with(l))
}

/// Maps weights to a low-precision form and back, for low-precision rollout (weight sync) and
/// quantization-aware training.
///
/// The methods here are the host reference that defines the numerics; GPU paths implement the
/// same `format()` and are tested against them.
pub trait Quantizer: Send + Sync {
    fn format(&self) -> QuantFormat;
    fn quantize(&self, weight: &WeightView<'_>) -> Result<Quantized>;
    fn dequantize(&self, q: &Quantized) -> Result<Vec<f32>>;
    /// Whether training may run the forward on `dequantize(quantize(w))` and pass the gradient
    /// straight through to `w` (QAT). Formats without a stable round trip say no.
    fn supports_fake_quant(&self) -> bool;
    /// The forward weights of fake quantization: quantize then dequantize.
    fn fake_quantize(&self, weight: &WeightView<'_>) -> Result<Vec<f32>> {
        self.dequantize(&self.quantize(weight)?)
    }
}
