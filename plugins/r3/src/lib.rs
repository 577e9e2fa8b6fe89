//! Rollout Routing Replay (R3), as miles runs it for MoE RL: each training forward of a
//! sample uses, in every sparse layer, the experts the rollout engine routed each position to
//! (`Sample::rollout_routed_experts`), so small numeric differences between rollout and
//! training cannot send a token to other experts. The gate weights stay the current router's
//! probabilities at those experts (renormalized as the model's `norm_topk_prob` says), so the
//! router keeps learning. The sample's last position, never run by the engine, routes itself
//! (it predicts no token). Enabled by `--use-rollout-routing-replay`; the trainer reports
//! `train/routed_experts_mismatch` (its own choices against the record) and
//! `train/replayed_experts_mismatch` (the experts it used: 0 with R3).

use miles_core::{
    Error, Factory, Plugin, PluginConfig, ROUTER_CHOOSES, Registration, Result, RoutedExperts,
    RoutingReplay,
};

pub static PLUGIN: Plugin = Plugin {
    name: "r3",
    version: env!("CARGO_PKG_VERSION"),
    description: "Rollout Routing Replay: MoE training uses the experts the rollout routed to",
    factory: Factory::Replay(|config| Ok(Box::new(R3::from_config(config)?))),
};
miles_core::inventory::submit! { Registration(&PLUGIN) }

/// The replay: every recorded position takes its recorded experts.
#[derive(Debug, Clone, Copy, Default)]
pub struct R3;

impl R3 {
    /// R3 has no settings: its configuration is `{}` (or null).
    pub fn from_config(config: &PluginConfig) -> Result<Self> {
        match config {
            serde_json::Value::Null => Ok(R3),
            serde_json::Value::Object(o) if o.is_empty() => Ok(R3),
            other => Err(Error::Plugin(format!("r3 takes no settings, got {other}"))),
        }
    }
}

impl RoutingReplay for R3 {
    fn replay(&self, record: &RoutedExperts, tokens: usize) -> Result<Vec<u32>> {
        let recorded = record.num_tokens()?;
        if recorded > tokens {
            return Err(Error::Invalid(format!(
                "routed experts for {recorded} positions of a sample of {tokens} tokens"
            )));
        }
        let row = record.num_layers * record.top_k;
        let mut out: Vec<u32> = record.ids.iter().map(|&e| u32::from(e)).collect();
        out.resize(tokens * row, ROUTER_CHOOSES);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recorded_positions_replay_and_the_rest_route_themselves() {
        let record = RoutedExperts { num_layers: 2, top_k: 2, ids: vec![1, 3, 0, 2, 7, 4, 5, 6] };
        let got = R3.replay(&record, 3).unwrap();
        assert_eq!(&got[..8], &[1, 3, 0, 2, 7, 4, 5, 6]);
        assert_eq!(&got[8..], &[ROUTER_CHOOSES; 4]);
        assert!(R3.replay(&record, 1).unwrap_err().to_string().contains("2 positions"));
        let ragged = RoutedExperts { ids: vec![1, 2, 3], ..record };
        assert!(R3.replay(&ragged, 3).is_err());
        assert!(R3::from_config(&serde_json::json!({"x": 1})).is_err());
        assert!(R3::from_config(&serde_json::json!({})).is_ok());
    }
}
