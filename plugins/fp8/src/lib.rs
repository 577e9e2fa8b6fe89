//! The `fp8` plugin: FP8 E4M3 weights with one f32 scale per 128 × 128 block, as miles and
//! DeepSeek-V3 store them (`<name>.weight_scale_inv` holds the dequantization multiplier
//! s = amax / 448: w ≈ q · s). This crate is the format's `Quantizer` over the exact CPU codec
//! of `miles_tensor::cpu` (round to nearest even, saturation at ±448, subnormals), the
//! reference every FP8 kernel is held to, and the rule of which weights miles quantizes.
//! Configuration: `{"fmt": "e4m3", "weight_block_size": [128, 128]}` (both the default).

use miles_core::{
    Error, Factory, Plugin, PluginConfig, QuantFormat, Quantized, Quantizer, Registration, Result,
    WeightView,
};
use miles_tensor::cpu::{FP8_BLOCK, dequantize_blocks, quantize_blocks};
use serde::Deserialize;

pub static PLUGIN: Plugin = Plugin {
    name: "fp8",
    version: env!("CARGO_PKG_VERSION"),
    description: "FP8 E4M3 weights in 128×128 blocks with f32 scales (DeepSeek-V3's format)",
    factory: Factory::Quantizer(|config| Ok(Box::new(Fp8::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// The blockwise E4M3 quantizer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fp8;

/// The plugin's settings, as miles and HF's `quantization_config` name them.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    #[serde(default = "e4m3")]
    fmt: String,
    #[serde(default = "blocks")]
    weight_block_size: [usize; 2],
}

fn e4m3() -> String {
    "e4m3".into()
}

fn blocks() -> [usize; 2] {
    [FP8_BLOCK, FP8_BLOCK]
}

impl Fp8 {
    /// Reads `{"fmt", "weight_block_size"}` (null: the defaults); anything but E4M3 in 128 × 128
    /// blocks is refused naming the field (E5M2 and other block sizes are not implemented).
    pub fn from_config(config: &PluginConfig) -> Result<Self> {
        let err = |m: String| Error::Plugin(format!("fp8: {m}"));
        let settings: Settings = match config {
            serde_json::Value::Null => return Ok(Fp8),
            c => Settings::deserialize(c).map_err(|e| err(e.to_string()))?,
        };
        if !matches!(settings.fmt.as_str(), "e4m3" | "float8_e4m3fn") {
            return Err(err(format!("fmt \"{}\" is not supported: use \"e4m3\"", settings.fmt)));
        }
        if settings.weight_block_size != blocks() {
            return Err(err(format!(
                "weight_block_size {:?} is not supported: blocks are [128, 128]",
                settings.weight_block_size
            )));
        }
        Ok(Fp8)
    }
}

/// Whether miles quantizes the weight `name`: the shared rule of the low-precision plugins.
pub use miles_core::quantizer::quantizes;

impl Quantizer for Fp8 {
    fn format(&self) -> QuantFormat {
        QuantFormat { name: "fp8_e4m3".into(), bits: 8, block: [FP8_BLOCK, FP8_BLOCK] }
    }

    fn quantize(&self, weight: &WeightView<'_>) -> Result<Quantized> {
        let &[rows, cols] = weight.shape else {
            return Err(Error::Invalid(format!(
                "fp8 quantizes matrices; {} has shape {:?}",
                weight.name, weight.shape
            )));
        };
        if weight.data.len() != rows * cols {
            return Err(Error::Invalid(format!(
                "{}: {} values for shape [{rows}, {cols}]",
                weight.name,
                weight.data.len()
            )));
        }
        let (data, scales) = quantize_blocks(weight.data, rows, cols);
        Ok(Quantized { format: self.format(), shape: vec![rows, cols], data, scales })
    }

    fn dequantize(&self, q: &Quantized) -> Result<Vec<f32>> {
        let (rows, cols) = match q.shape[..] {
            [rows, cols] => (rows, cols),
            _ => return Err(Error::Invalid(format!("fp8: shape {:?} is not a matrix", q.shape))),
        };
        let blocks = rows.div_ceil(FP8_BLOCK) * cols.div_ceil(FP8_BLOCK);
        if q.format != self.format() || q.data.len() != rows * cols || q.scales.len() != blocks {
            return Err(Error::Invalid(format!(
                "fp8: {} codes and {} scales for a [{rows}, {cols}] matrix in {:?}: expected {} \
                 and {blocks} in fp8_e4m3 128×128",
                q.data.len(),
                q.scales.len(),
                q.format.name,
                rows * cols
            )));
        }
        Ok(dequantize_blocks(&q.data, &q.scales, rows, cols))
    }

    fn supports_fake_quant(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_tensor::rng::Rng;

    #[test]
    fn a_round_trip_keeps_every_block_within_its_step() {
        let q = Fp8::from_config(&serde_json::json!({"fmt": "e4m3"})).unwrap();
        let mut rng = Rng::new(3);
        let data: Vec<f32> = (0..200 * 130).map(|_| 0.02 * rng.normal()).collect();
        let view = WeightView {
            name: "model.layers.0.mlp.up_proj.weight",
            shape: &[200, 130],
            data: &data,
        };
        let packed = q.quantize(&view).unwrap();
        assert_eq!((packed.data.len(), packed.scales.len()), (200 * 130, 4));
        let back = q.dequantize(&packed).unwrap();
        for (x, y) in data.iter().zip(&back) {
            assert!((x - y).abs() <= x.abs() / 16.0 + 1e-4, "{x} → {y}");
        }
        assert_eq!(q.fake_quantize(&view).unwrap(), back);
    }

    #[test]
    fn bad_settings_and_shapes_name_what_is_wrong() {
        let err = |c: serde_json::Value| Fp8::from_config(&c).unwrap_err().to_string();
        assert!(err(serde_json::json!({"fmt": "e5m2"})).contains("fmt \"e5m2\" is not supported"));
        let e = err(serde_json::json!({"weight_block_size": [64, 64]}));
        assert!(e.contains("weight_block_size [64, 64] is not supported"), "{e}");
        let e = err(serde_json::json!({"recipe": 1}));
        assert!(e.contains("unknown field `recipe`, expected `fmt` or `weight_block_size`"), "{e}");
        let q = Fp8;
        let view = WeightView { name: "model.norm.weight", shape: &[4], data: &[1.0; 4] };
        let e = q.quantize(&view).unwrap_err().to_string();
        assert!(e.contains("model.norm.weight has shape [4]"), "{e}");
        let mut packed =
            q.quantize(&WeightView { name: "w", shape: &[2, 2], data: &[1.0; 4] }).unwrap();
        packed.scales.push(1.0);
        assert!(q.dequantize(&packed).unwrap_err().to_string().contains("2 scales"));
    }

    #[test]
    fn miles_quantizes_the_projections_and_experts_only() {
        for name in [
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.3.self_attn.o_proj.weight",
            "model.layers.1.mlp.down_proj.weight",
            "model.layers.2.mlp.experts.7.gate_proj.weight",
        ] {
            assert!(quantizes(name), "{name}");
        }
        for name in [
            "model.embed_tokens.weight",
            "lm_head.weight",
            "model.norm.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.self_attn.q_norm.weight",
            "model.layers.2.mlp.gate.weight",
        ] {
            assert!(!quantizes(name), "{name}");
        }
    }
}
