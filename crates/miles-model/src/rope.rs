//! Rotary embeddings' frequency scaling as config.json states it (`rope_parameters`, or the
//! older `rope_scaling`), computed as transformers' `modeling_rope_utils` computes it (in f32
//! where it does), so the cos/sin tables, and the logprobs, match HF's.

use serde_json::{Map, Value, json};

/// How the rotary frequencies are scaled (`rope_type`).
#[derive(Debug, Clone, PartialEq, Default)]
pub enum RopeScaling {
    /// `default`: `theta^(−2j/d)`.
    #[default]
    None,
    /// `linear`: every frequency divided by `factor`.
    Linear { factor: f32 },
    /// `llama3` (Llama 3.1 and later): low frequencies divided by `factor`, high ones kept, a
    /// smooth blend between.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_max_positions: f32 },
    /// `yarn` (Qwen3's long-context configs, DeepSeek-V3): frequencies blended between the
    /// interpolated and the original by a ramp over the dimensions; cos and sin multiplied by
    /// `attention_factor`.
    Yarn {
        factor: f32,
        original_max_positions: f32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

impl RopeScaling {
    /// Reads the scaling from a config's rope dictionary (`None`: no dictionary), whose keys
    /// and messages name `key` (`rope_parameters` or `rope_scaling`); `max_positions` is the
    /// config's `max_position_embeddings`, the default of `original_max_position_embeddings`.
    pub(crate) fn from_json(
        rope: Option<(&str, &Map<String, Value>)>,
        max_positions: usize,
    ) -> Result<Self, String> {
        let Some((key, r)) = rope else { return Ok(RopeScaling::None) };
        let kind = r.get("rope_type").or_else(|| r.get("type")).and_then(Value::as_str);
        let num = |name: &str| -> Result<Option<f32>, String> {
            match r.get(name) {
                None | Some(Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(|x| Some(x as f32))
                    .ok_or_else(|| format!("'{key}.{name}' must be a number, found {v}")),
            }
        };
        let need = |name: &str| {
            num(name)?.ok_or_else(|| format!("'{key}' of rope type {kind:?} needs '{name}'"))
        };
        let original = || -> Result<f32, String> {
            Ok(num("original_max_position_embeddings")?.unwrap_or(max_positions as f32))
        };
        Ok(match kind.unwrap_or("default") {
            "default" => RopeScaling::None,
            "linear" => RopeScaling::Linear { factor: need("factor")? },
            "llama3" => RopeScaling::Llama3 {
                factor: need("factor")?,
                low_freq_factor: need("low_freq_factor")?,
                high_freq_factor: need("high_freq_factor")?,
                original_max_positions: original()?,
            },
            "yarn" => {
                let original_max_positions = original()?;
                // DeepSeek-V3 leaves factor out: the ratio of the two context lengths.
                let factor =
                    num("factor")?.unwrap_or(max_positions as f32 / original_max_positions);
                let attention_factor = match num("attention_factor")? {
                    Some(a) => a,
                    None => match (num("mscale")?, num("mscale_all_dim")?) {
                        (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                            (yarn_mscale(factor, m) / yarn_mscale(factor, all)) as f32
                        }
                        _ => yarn_mscale(factor, 1.0) as f32,
                    },
                };
                let truncate = match r.get("truncate") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => {
                        return Err(format!("'{key}.truncate' must be true or false, found {v}"));
                    }
                };
                RopeScaling::Yarn {
                    factor,
                    original_max_positions,
                    beta_fast: num("beta_fast")?.filter(|&b| b != 0.0).unwrap_or(32.0),
                    beta_slow: num("beta_slow")?.filter(|&b| b != 0.0).unwrap_or(1.0),
                    attention_factor,
                    truncate,
                }
            }
            other => {
                return Err(format!(
                    "'{key}.rope_type' '{other}' is not supported (supported: default, linear, \
                     llama3, yarn)"
                ));
            }
        })
    }

    /// The rope dictionary config.json holds for this scaling and `theta`.
    pub(crate) fn to_json(&self, theta: f32) -> Value {
        let mut v = match *self {
            RopeScaling::None => json!({"rope_type": "default"}),
            RopeScaling::Linear { factor } => json!({"rope_type": "linear", "factor": factor}),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => json!({
                "rope_type": "llama3", "factor": factor, "low_freq_factor": low_freq_factor,
                "high_freq_factor": high_freq_factor,
                "original_max_position_embeddings": original_max_positions as u64,
            }),
            RopeScaling::Yarn {
                factor,
                original_max_positions,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => json!({
                "rope_type": "yarn", "factor": factor,
                "original_max_position_embeddings": original_max_positions as u64,
                "beta_fast": beta_fast, "beta_slow": beta_slow,
                "attention_factor": attention_factor, "truncate": truncate,
            }),
        };
        v["rope_theta"] = json!(theta);
        v
    }

    /// The inverse frequencies of a head of `dim` rotary dimensions and the factor on cos and
    /// sin (YaRN's; 1 otherwise).
    pub fn frequencies(&self, dim: usize, theta: f32) -> (Vec<f32>, f32) {
        let base = miles_tensor::cpu::rope_inv_freq(dim, theta);
        match *self {
            RopeScaling::None => (base, 1.0),
            RopeScaling::Linear { factor } => (base.iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_positions,
            } => {
                let low_wavelen = original_max_positions / low_freq_factor;
                let high_wavelen = original_max_positions / high_freq_factor;
                let scaled = base.iter().map(|&f| {
                    let wavelen = 2.0 * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (original_max_positions / wavelen - low_freq_factor)
                            / (high_freq_factor - low_freq_factor);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                });
                (scaled.collect(), 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_positions,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                // The dimensions whose wavelengths turn fewer than beta_fast and more than
                // beta_slow times over the original context: the ramp between them (f64, as
                // transformers computes it in Python floats).
                let correction = |rotations: f32| {
                    let (d, base, max) =
                        (dim as f64, f64::from(theta), f64::from(original_max_positions));
                    d * (max / (f64::from(rotations) * 2.0 * std::f64::consts::PI)).ln()
                        / (2.0 * base.ln())
                };
                let (mut low, mut high) = (correction(beta_fast), correction(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0) as f32, high.min(dim as f64 - 1.0) as f32);
                if low == high {
                    high += 0.001;
                }
                let blended = base.iter().enumerate().map(|(j, &extrapolated)| {
                    let ramp = ((j as f32 - low) / (high - low)).clamp(0.0, 1.0);
                    let keep = 1.0 - ramp;
                    // 1 / (factor · theta^(2j/d)), from the same power as `extrapolated`.
                    let pos = theta.powf((2 * j) as f32 / dim as f32);
                    let interpolated = 1.0 / (factor * pos);
                    interpolated * (1.0 - keep) + extrapolated * keep
                });
                (blended.collect(), attention_factor)
            }
        }
    }
}

/// YaRN's `0.1 · mscale · ln(scale) + 1` (1 for scales up to 1).
fn yarn_mscale(scale: f32, mscale: f32) -> f64 {
    if scale <= 1.0 { 1.0 } else { 0.1 * f64::from(mscale) * f64::from(scale).ln() + 1.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(v: Value) -> Result<RopeScaling, String> {
        RopeScaling::from_json(Some(("rope_parameters", v.as_object().unwrap())), 4096)
    }

    #[test]
    fn llama3_keeps_high_frequencies_divides_low_ones_and_blends_between() {
        let s = parse(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
        .unwrap();
        let base = miles_tensor::cpu::rope_inv_freq(128, 500_000.0);
        let (f, scale) = s.frequencies(128, 500_000.0);
        assert_eq!(scale, 1.0);
        assert_eq!(f[0], base[0]); // wavelength 2π, far below 8192 / 4
        assert_eq!(f[63], base[63] / 8.0); // longest wavelength, above 8192
        let blended = (0..64).filter(|&j| f[j] != base[j] && f[j] != base[j] / 8.0).count();
        assert!(blended > 0 && f.iter().zip(&base).all(|(a, b)| a <= b && *a >= b / 8.0));
    }

    #[test]
    fn yarn_ramps_from_the_original_to_the_interpolated_frequencies() {
        let s = parse(json!({"rope_type": "yarn", "factor": 4.0,
            "original_max_position_embeddings": 32768}))
        .unwrap();
        let base = miles_tensor::cpu::rope_inv_freq(128, 1e6);
        let (f, scale) = s.frequencies(128, 1e6);
        assert!((scale - (0.1 * 4f32.ln() + 1.0)).abs() < 1e-7);
        assert_eq!(f[0], base[0]);
        assert!((f[63] - base[63] / 4.0).abs() <= 1e-6 * f[63]);
        // DeepSeek's mscale pair: equal, so the factor is 1.
        let s = parse(json!({"rope_type": "yarn", "factor": 40, "mscale": 1.0,
            "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096}))
        .unwrap();
        assert_eq!(s.frequencies(64, 1e4).1, 1.0);
    }

    #[test]
    fn linear_divides_and_unknown_types_are_refused_by_name() {
        let (f, _) = parse(json!({"type": "linear", "factor": 2.0})).unwrap().frequencies(8, 1e4);
        assert_eq!(
            f,
            miles_tensor::cpu::rope_inv_freq(8, 1e4).iter().map(|x| x / 2.0).collect::<Vec<_>>()
        );
        let e = parse(json!({"rope_type": "dynamic", "factor": 2.0})).unwrap_err();
        assert!(e.contains("'rope_parameters.rope_type' 'dynamic' is not supported"), "{e}");
        let e = parse(json!({"rope_type": "llama3", "factor": 8.0})).unwrap_err();
        assert!(e.contains("needs 'low_freq_factor'"), "{e}");
    }

    #[test]
    fn the_written_dictionary_reads_back() {
        for s in [
            RopeScaling::None,
            RopeScaling::Linear { factor: 2.0 },
            parse(json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}))
            .unwrap(),
            parse(json!({"rope_type": "yarn", "factor": 4.0})).unwrap(),
        ] {
            let v = s.to_json(1e4);
            assert_eq!(parse(v).unwrap(), s);
        }
    }
}
