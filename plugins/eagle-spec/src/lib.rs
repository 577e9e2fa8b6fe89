//! Speculative rollouts as SGLang's EAGLE runs them with a one-layer MTP draft (DeepSeek-V3's
//! NextN, MiMo's MTP) and `--speculative-eagle-topk 1`: a chain of `num_steps` draft tokens per
//! sequence, verified by one forward of the policy. The rule of what a verification keeps is
//! speculative sampling's (Leviathan et al., Chen et al.) on the integer masses the engine's
//! sampler draws from ([`miles_tensor::cpu::verify_chain`]): each draft is kept with
//! probability min(1, P/Q), the first rejected one replaced by a draw from max(0, P − Q), and a
//! fully kept chain followed by a draw from the policy, so every token is distributed as the
//! policy's own draw at the run's temperature, top-k and top-p.
//!
//! Settings, SGLang's flags without `--sglang-speculative-`: `algorithm` (`EAGLE`, or its alias
//! `NEXTN`), `num_steps`, `eagle_topk` (1: tree drafting is not implemented) and
//! `num_draft_tokens` (num_steps + 1 for a chain).

use miles_core::{Error, Factory, Plugin, PluginConfig, Registration, Result, Speculator};
use miles_tensor::cpu::{StepUniforms, verify_chain};
use serde::Deserialize;

pub static PLUGIN: Plugin = Plugin {
    name: "eagle-spec",
    version: env!("CARGO_PKG_VERSION"),
    description: "speculative rollouts: an MTP draft proposes, the policy verifies (EAGLE chain)",
    factory: Factory::Speculator(|config| Ok(Box::new(EagleSpec::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// The most draft tokens per verification.
pub const MAX_STEPS: usize = 16;

/// SGLang's default chain: three draft tokens, four verified positions.
pub const DEFAULT_STEPS: usize = 3;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Settings {
    algorithm: Option<String>,
    num_steps: Option<usize>,
    eagle_topk: Option<usize>,
    num_draft_tokens: Option<usize>,
}

/// EAGLE chain drafting of `num_steps` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EagleSpec {
    num_steps: usize,
}

fn flag_error(flag: &str, message: String) -> Error {
    Error::config(&format!("sglang-speculative-{flag}"), message)
}

impl EagleSpec {
    /// From its settings (`{}` for SGLang's defaults); an inconsistent or unsupported one is
    /// an error naming its flag.
    pub fn from_config(config: &PluginConfig) -> Result<Self> {
        let config = if config.is_null() { serde_json::json!({}) } else { config.clone() };
        let s: Settings = serde_json::from_value(config)
            .map_err(|e| Error::Plugin(format!("eagle-spec settings: {e}")))?;
        match s.algorithm.as_deref().map(str::to_ascii_uppercase).as_deref() {
            None | Some("EAGLE" | "NEXTN") => {}
            Some(other) => {
                return Err(flag_error(
                    "algorithm",
                    format!(
                        "{other} is not implemented: EAGLE (or NEXTN) drafts with an MTP layer; \
                         EAGLE3's draft reads several layers' states and is not supported"
                    ),
                ));
            }
        }
        let num_steps = s.num_steps.unwrap_or(DEFAULT_STEPS);
        if !(1..=MAX_STEPS).contains(&num_steps) {
            return Err(flag_error(
                "num-steps",
                format!("{num_steps}: a chain proposes 1 to {MAX_STEPS} tokens"),
            ));
        }
        if let Some(k) = s.eagle_topk.filter(|&k| k != 1) {
            return Err(flag_error(
                "eagle-topk",
                format!("{k}: tree drafting (top-k > 1) is not implemented; give 1 (a chain)"),
            ));
        }
        if let Some(n) = s.num_draft_tokens.filter(|&n| n != num_steps + 1) {
            return Err(flag_error(
                "num-draft-tokens",
                format!(
                    "{n}: a chain of --sglang-speculative-num-steps {num_steps} verifies {} \
                     tokens (its drafts and the position after them)",
                    num_steps + 1
                ),
            ));
        }
        Ok(EagleSpec { num_steps })
    }
}

impl Speculator for EagleSpec {
    fn num_steps(&self) -> usize {
        self.num_steps
    }

    fn verify(
        &self,
        p: &[Vec<u64>],
        q: &[Vec<u64>],
        drafts: &[u32],
        uniforms: &[(f64, f64)],
    ) -> Result<Vec<u32>> {
        let u: Vec<StepUniforms> =
            uniforms.iter().map(|&(accept, draw)| StepUniforms { accept, draw }).collect();
        let verdict = verify_chain(p, q, drafts, &u)
            .map_err(|e| Error::Invalid(format!("speculative verification: {e}")))?;
        Ok(verdict.tokens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn err(config: serde_json::Value) -> String {
        EagleSpec::from_config(&config).unwrap_err().to_string()
    }

    #[test]
    fn settings_default_as_sglang_and_inconsistent_ones_name_their_flag() {
        assert_eq!(EagleSpec::from_config(&json!({})).unwrap().num_steps(), 3);
        let full =
            json!({"algorithm": "NEXTN", "num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6});
        assert_eq!(EagleSpec::from_config(&full).unwrap().num_steps(), 5);
        assert!(err(json!({"algorithm": "EAGLE3"})).contains("sglang-speculative-algorithm"));
        assert!(err(json!({"num_steps": 0})).contains("sglang-speculative-num-steps"));
        assert!(err(json!({"num_steps": 17})).contains("1 to 16"));
        assert!(err(json!({"eagle_topk": 4})).contains("sglang-speculative-eagle-topk"));
        let e = err(json!({"num_steps": 3, "num_draft_tokens": 8}));
        assert!(e.contains("sglang-speculative-num-draft-tokens") && e.contains("4 tokens"), "{e}");
        assert!(err(json!({"steps": 3})).contains("unknown field"));
    }

    /// The rule is the one the engine applies on its device ([`miles_tensor::ops::speculative_verify`]):
    /// the same tokens from the same logits, drafts near and far from the policy's rows.
    #[test]
    fn the_engine_verifies_by_this_rule() {
        use miles_tensor::cpu::kept_masses;
        use miles_tensor::ops::{DraftChain, speculative_verify};
        use miles_tensor::rng::Rng;
        use miles_tensor::{Device, Tensor};
        let (vocab, k, t) = (300, 3, 0.9);
        let spec = EagleSpec::from_config(&json!({"num_steps": k})).unwrap();
        let mut rng = Rng::new(5);
        let (mut differ, mut all_kept) = (false, false);
        for c in 0..40 {
            let p: Vec<f32> = rng.vec((k + 1) * vocab, 2.0);
            let noise = if c % 2 == 0 { 0.2 } else { 2.0 };
            let q: Vec<f32> = p[..k * vocab].iter().map(|x| x + noise * rng.normal()).collect();
            let pm: Vec<Vec<u64>> =
                p.chunks(vocab).map(|r| kept_masses(r, t, 0, 1.0).unwrap()).collect();
            let qm: Vec<Vec<u64>> =
                q.chunks(vocab).map(|r| kept_masses(r, t, 0, 1.0).unwrap()).collect();
            let drafts: Vec<u32> = qm
                .iter()
                .map(|w| miles_tensor::cpu::draw(w, f64::from(rng.uniform(0.0, 1.0))).unwrap())
                .collect();
            let u: Vec<(f64, f64)> = (0..=k)
                .map(|_| (f64::from(rng.uniform(0.0, 1.0)), f64::from(rng.uniform(0.0, 1.0))))
                .collect();
            let want = spec.verify(&pm, &qm, &drafts, &u).unwrap();
            let on = |v: Vec<f32>, rows| Tensor::from_f32(&[rows, vocab], v, &Device::Cpu).unwrap();
            // The drafts are the policy's input tokens at the rows after the first.
            let ids = std::iter::once(0).chain(drafts.iter().map(|&x| x as i32)).collect();
            let ids = Tensor::from_i32(&[k + 1], ids, &Device::Cpu).unwrap();
            let chain = [DraftChain { p_row: 0, q_row: 0, len: k, uniforms: u }];
            let out =
                speculative_verify(&on(p, k + 1), &on(q, k), &ids, &chain, (1, 1), (t, 0, 1.0))
                    .unwrap();
            assert_eq!(out.to_host(&chain, 1).unwrap()[0], want, "chain {c}");
            differ |= want[..want.len() - 1] != drafts[..want.len() - 1] || want.len() < k + 1;
            all_kept |= want.len() == k + 1;
        }
        assert!(differ && all_kept);
    }

    /// Greedy verification keeps the drafts that are the policy's best and replaces the first
    /// that is not by the policy's best.
    #[test]
    fn greedy_verification_keeps_the_policys_best_tokens() {
        let one = |t: usize| -> Vec<u64> { (0..4).map(|i| u64::from(i == t) << 20).collect() };
        let spec = EagleSpec::from_config(&json!({"num_steps": 2})).unwrap();
        let u = [(0.5, 0.5); 3];
        let p = [one(1), one(2), one(3)];
        assert_eq!(spec.verify(&p, &[one(1), one(2)], &[1, 2], &u).unwrap(), [1, 2, 3]);
        assert_eq!(spec.verify(&p, &[one(1), one(0)], &[1, 0], &u).unwrap(), [1, 2]);
        assert_eq!(spec.verify(&p, &[one(3), one(2)], &[3, 2], &u).unwrap(), [1]);
        assert!(spec.verify(&p, &[one(1)], &[1, 2], &u).is_err());
    }
}
