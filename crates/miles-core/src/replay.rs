//! Rollout Routing Replay (R3) for mixture-of-experts policies: which experts the trainer's
//! forwards use, given the experts the rollout engine recorded for a sample.

use crate::{Result, RoutedExperts};

/// The trainer-side half of R3: for a sample of `tokens` positions and its rollout record
/// ([`RoutedExperts`]: every position but the last, each sparse layer's top-k), the experts
/// each position's forward uses, `[tokens × layers × top_k]`, [`ROUTER_CHOOSES`] where the
/// router picks for itself. The gate weights stay the current router's probabilities at the
/// chosen experts, so the router still learns.
pub trait RoutingReplay: Send + Sync {
    fn replay(&self, record: &RoutedExperts, tokens: usize) -> Result<Vec<u32>>;
}

/// A position left to the router (`miles_model::moe::OWN_CHOICE`).
pub const ROUTER_CHOOSES: u32 = u32::MAX;
