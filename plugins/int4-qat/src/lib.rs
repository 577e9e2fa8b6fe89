//! The `int4-qat` plugin: INT4 weights in groups of 1 × G inputs with one scale each, as miles'
//! quantization-aware training rounds them (`OPEN_TRAINING_INT4_FAKE_QAT_FLAG`,
//! `OPEN_TRAINING_INT4_GROUP_SIZE`) and compressed-tensors' `pack-quantized` format stores them.
//! This crate is the format's `Quantizer` over the CPU codec of `miles_tensor::cpu`
//! (`quantize_int4`, `pack_int4`), the reference every INT4 kernel is held to, and the rule of
//! which weights it applies to: every quantizable linear layer, or the experts only (miles'
//! choice). Configuration: `{"group_size": 128, "experts_only": false}` (the defaults).

use miles_core::quantizer::quantizes;
use miles_core::{
    Error, Factory, Plugin, PluginConfig, QuantFormat, Quantized, Quantizer, Registration, Result,
    WeightView,
};
use miles_tensor::cpu::{dequantize_int4, pack_int4, quantize_int4, unpack_int4};
use serde::Deserialize;

pub static PLUGIN: Plugin = Plugin {
    name: "int4-qat",
    version: env!("CARGO_PKG_VERSION"),
    description: "INT4 weights in 1×G groups (miles' QAT; compressed-tensors pack-quantized)",
    factory: Factory::Quantizer(|config| Ok(Box::new(Int4Qat::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// Group sizes miles selects (`OPEN_TRAINING_INT4_GROUP_SIZE`).
pub const GROUP_SIZES: [usize; 2] = [32, 128];

/// The symmetric group-wise INT4 quantizer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Int4Qat {
    pub group_size: usize,
    /// Only a mixture of experts' routed experts are quantized (miles' choice), not every
    /// quantizable linear layer.
    pub experts_only: bool,
}

impl Default for Int4Qat {
    fn default() -> Self {
        Int4Qat { group_size: 128, experts_only: false }
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    group_size: Option<usize>,
    #[serde(default)]
    experts_only: bool,
}

impl Int4Qat {
    /// Reads `{"group_size", "experts_only"}` (null: the defaults); a group size miles does not
    /// select is refused naming the field.
    pub fn from_config(config: &PluginConfig) -> Result<Self> {
        let err = |m: String| Error::Plugin(format!("int4-qat: {m}"));
        let settings: Settings = match config {
            serde_json::Value::Null => return Ok(Int4Qat::default()),
            c => Settings::deserialize(c).map_err(|e| err(e.to_string()))?,
        };
        let group_size = settings.group_size.unwrap_or(128);
        if !GROUP_SIZES.contains(&group_size) {
            return Err(err(format!("group_size {group_size} is not supported: use 32 or 128")));
        }
        Ok(Int4Qat { group_size, experts_only: settings.experts_only })
    }

    /// Whether the weight `name` is quantized: a quantizable linear layer's
    /// ([`quantizes`]), and with `experts_only` a routed expert's.
    pub fn applies_to(&self, name: &str) -> bool {
        quantizes(name) && (!self.experts_only || name.contains(".mlp.experts."))
    }
}

impl Quantizer for Int4Qat {
    fn format(&self) -> QuantFormat {
        QuantFormat { name: "int4_packed".into(), bits: 4, block: [1, self.group_size] }
    }

    /// Levels packed as compressed-tensors' `weight_packed` (its int32 words, little-endian
    /// bytes) and one f32 scale per group.
    fn quantize(&self, weight: &WeightView<'_>) -> Result<Quantized> {
        let &[rows, cols] = weight.shape else {
            return Err(Error::Invalid(format!(
                "int4-qat quantizes matrices; {} has shape {:?}",
                weight.name, weight.shape
            )));
        };
        let named = |e: miles_tensor::Error| Error::Invalid(format!("{}: {e}", weight.name));
        if weight.data.len() != rows * cols {
            return Err(Error::Invalid(format!(
                "{}: {} values for shape [{rows}, {cols}]",
                weight.name,
                weight.data.len()
            )));
        }
        let (q, scales) = quantize_int4(weight.data, cols, self.group_size).map_err(named)?;
        let data =
            pack_int4(&q, cols).map_err(named)?.iter().flat_map(|w| w.to_le_bytes()).collect();
        Ok(Quantized { format: self.format(), shape: vec![rows, cols], data, scales })
    }

    fn dequantize(&self, q: &Quantized) -> Result<Vec<f32>> {
        let err = |m: String| Error::Invalid(format!("int4-qat: {m}"));
        let [rows, cols] = q.shape[..] else {
            return Err(err(format!("shape {:?} is not a matrix", q.shape)));
        };
        if q.format != self.format() || !q.data.len().is_multiple_of(4) {
            return Err(err(format!(
                "{} bytes in {:?} groups of {:?}: expected int32 words of int4_packed 1×{}",
                q.data.len(),
                q.format.name,
                q.format.block,
                self.group_size
            )));
        }
        let words: Vec<i32> =
            q.data.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect();
        let levels = unpack_int4(&words, rows, cols).map_err(|e| err(e.to_string()))?;
        dequantize_int4(&levels, &q.scales, self.group_size).map_err(|e| err(e.to_string()))
    }

    fn supports_fake_quant(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_tensor::cpu::fake_quantize_int4;
    use miles_tensor::rng::Rng;

    #[test]
    fn a_round_trip_is_the_fake_quantization() {
        let q = Int4Qat::from_config(&serde_json::json!({"group_size": 32})).unwrap();
        let mut rng = Rng::new(7);
        let data: Vec<f32> = (0..24 * 64).map(|_| 0.02 * rng.normal()).collect();
        let view =
            WeightView { name: "model.layers.0.mlp.up_proj.weight", shape: &[24, 64], data: &data };
        let packed = q.quantize(&view).unwrap();
        // Four bits a weight, one scale per 32.
        assert_eq!((packed.data.len(), packed.scales.len()), (24 * 64 / 2, 24 * 2));
        let back = q.dequantize(&packed).unwrap();
        assert_eq!(back, fake_quantize_int4(&data, 64, 32).unwrap());
        assert_eq!(q.fake_quantize(&view).unwrap(), back);
    }

    #[test]
    fn bad_settings_and_shapes_name_what_is_wrong() {
        let err = |c: serde_json::Value| Int4Qat::from_config(&c).unwrap_err().to_string();
        assert!(err(serde_json::json!({"group_size": 64})).contains("group_size 64"));
        assert!(err(serde_json::json!({"bits": 8})).contains("unknown field `bits`"));
        let q = Int4Qat::default();
        let view = WeightView {
            name: "model.layers.0.mlp.up_proj.weight",
            shape: &[2, 96],
            data: &[0.0; 192],
        };
        let e = q.quantize(&view).unwrap_err().to_string();
        assert!(
            e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("groups of 128"),
            "{e}"
        );
        let good = WeightView { name: "w", shape: &[1, 128], data: &[0.5; 128] };
        let mut packed = q.quantize(&good).unwrap();
        packed.data.truncate(60);
        assert!(q.dequantize(&packed).unwrap_err().to_string().contains("weight_packed holds 15"));
    }

    #[test]
    fn experts_only_keeps_the_dense_layers() {
        let dense = "model.layers.0.mlp.down_proj.weight";
        let expert = "model.layers.1.mlp.experts.3.up_proj.weight";
        let all = Int4Qat::default();
        let experts = Int4Qat { experts_only: true, ..all };
        assert!(all.applies_to(dense) && all.applies_to(expert));
        assert!(!experts.applies_to(dense) && experts.applies_to(expert));
        assert!(!all.applies_to("model.layers.1.mlp.gate.weight"));
        assert!(!all.applies_to("lm_head.weight"));
    }
}
