use miles_core::PluginKind;
use miles_core::registry::{self, find};

/// The driver's anchor list and the registry agree: every linked plugin is registered.
#[test]
fn linked_plugins_are_all_registered() {
    for p in miles_cli::linked::plugins() {
        let found = find(p.kind(), p.name).unwrap();
        assert!(std::ptr::eq(found, p), "{p:?}");
    }
    assert!(find(PluginKind::Reward, "exact_match").is_ok());
}

#[cfg(feature = "tis")]
#[test]
fn tis_is_registered_when_its_feature_is_on() {
    miles_cli::linked::plugins();
    assert!(miles_cli::linked::FEATURES.contains(&"tis"));
    let tis = find(PluginKind::Correction, "tis").unwrap();
    assert_eq!(tis.version, env!("CARGO_PKG_VERSION"));
    // Built through the registry from the run configuration's --tis-* keys, it corrects.
    let config = miles_core::config::RunConfig::default().tis_config();
    let tis = registry::create_correction("tis", &config).unwrap();
    let out = tis
        .correct(&miles_core::CorrectionInput {
            train_log_probs: &[0.0, 3.0f32.ln()],
            rollout_log_probs: &[0.0, 0.0],
            loss_mask: &[1, 1],
            response_lengths: &[2],
        })
        .unwrap();
    assert_eq!(out.weights, vec![1.0, 2.0]);
}

#[cfg(not(feature = "tis"))]
#[test]
fn tis_is_absent_when_its_feature_is_off() {
    miles_cli::linked::plugins();
    let err = find(PluginKind::Correction, "tis").unwrap_err().to_string();
    assert!(err.contains("cargo xtask build --features"), "{err}");
}

#[cfg(feature = "r3")]
#[test]
fn r3_is_registered_when_its_feature_is_on() {
    miles_cli::linked::plugins();
    assert!(miles_cli::linked::FEATURES.contains(&"r3"));
    assert_eq!(find(PluginKind::Replay, "r3").unwrap().kind().as_str(), "replay");
    let r3 = registry::create_replay("r3", &serde_json::json!({})).unwrap();
    let record = miles_core::RoutedExperts { num_layers: 1, top_k: 2, ids: vec![3, 1] };
    assert_eq!(r3.replay(&record, 2).unwrap(), vec![3, 1, miles_core::ROUTER_CHOOSES, u32::MAX]);
    let err = registry::create_replay("r3", &serde_json::json!({"level": 2})).err().unwrap();
    assert!(err.to_string().contains("r3 takes no settings"), "{err}");
}

#[cfg(not(feature = "r3"))]
#[test]
fn r3_is_absent_when_its_feature_is_off() {
    miles_cli::linked::plugins();
    let err = find(PluginKind::Replay, "r3").unwrap_err().to_string();
    assert!(err.contains("cargo xtask build --features"), "{err}");
}
