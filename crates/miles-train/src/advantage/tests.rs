use super::*;
use miles_core::registry::create_advantage;
use serde_json::json;

fn score<'a>(reward: f32, mask: &'a [u8]) -> SequenceScore<'a> {
    SequenceScore { reward, loss_mask: mask, kl: None, values: None }
}

fn with_kl<'a>(reward: f32, mask: &'a [u8], kl: &'a [f32]) -> SequenceScore<'a> {
    SequenceScore { reward, loss_mask: mask, kl: Some(kl), values: None }
}

fn close(actual: &[f32], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((f64::from(*a) - e).abs() < 1e-4, "{actual:?} vs {expected:?}");
    }
}

/// Mean and unbiased std of the kept tokens of a whole output.
fn kept_stats(out: &AdvantageOutput, groups: &[Vec<SequenceScore<'_>>]) -> (f64, f64) {
    let kept: Vec<f64> = out
        .advantages
        .iter()
        .zip(groups)
        .flat_map(|(a, g)| a.iter().zip(g))
        .flat_map(|(a, s)| a.iter().zip(s.loss_mask).filter(|(_, m)| **m != 0))
        .map(|(a, _)| f64::from(*a))
        .collect();
    let n = kept.len() as f64;
    let mean = kept.iter().sum::<f64>() / n;
    let var = kept.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, var.sqrt())
}

#[test]
fn grpo_divides_by_the_unbiased_group_std() {
    // Rewards [1, 0, 0, 1]: mean 0.5, deviations ±0.5, unbiased variance 4·0.25/3 = 1/3,
    // std 0.57735, A = ±0.5 / (0.57735 + 1e-6) = ±0.86602.
    let m = [1u8, 1, 0];
    let group = vec![score(1.0, &m), score(0.0, &m), score(0.0, &m), score(1.0, &m)];
    let out =
        Grpo { std_normalization: true, rewards_normalization: true }.compute(&[group]).unwrap();
    let a = 0.5 / (1.0f64 / 3.0).sqrt();
    close(&out.advantages[0][0], &[a, a, 0.0]);
    close(&out.advantages[0][1], &[-a, -a, 0.0]);
    close(&out.advantages[0][3], &[a, a, 0.0]);
    assert!(out.returns.is_none());
}

#[test]
fn dr_grpo_only_subtracts_the_mean() {
    // Rewards [3, 1, 2]: mean 2, A = [1, -1, 0]; a second group [5, 7] is normalized
    // on its own: mean 6, A = [-1, 1].
    let m = [1u8, 1];
    let groups = vec![
        vec![score(3.0, &m), score(1.0, &m), score(2.0, &m)],
        vec![score(5.0, &m), score(7.0, &m)],
    ];
    let out =
        Grpo { std_normalization: false, rewards_normalization: true }.compute(&groups).unwrap();
    close(&out.advantages[0][0], &[1.0, 1.0]);
    close(&out.advantages[0][1], &[-1.0, -1.0]);
    close(&out.advantages[0][2], &[0.0, 0.0]);
    close(&out.advantages[1][0], &[-1.0, -1.0]);
    close(&out.advantages[1][1], &[1.0, 1.0]);
}

#[test]
fn a_group_of_one_has_zero_advantage() {
    let m = [1u8, 1, 1];
    for std_normalization in [true, false] {
        let out = Grpo { std_normalization, rewards_normalization: true }
            .compute(&[vec![score(0.7, &m)]])
            .unwrap();
        close(&out.advantages[0][0], &[0.0, 0.0, 0.0]);
    }
    let out = Rloo.compute(&[vec![score(0.7, &m)]]).unwrap();
    close(&out.advantages[0][0], &[0.0, 0.0, 0.0]);
    // Equal rewards: std 0, so 0 / (0 + 1e-6) = 0, not NaN.
    let out = Grpo { std_normalization: true, rewards_normalization: true }
        .compute(&[vec![score(1.0, &m), score(1.0, &m)]])
        .unwrap();
    close(&out.advantages[0][1], &[0.0, 0.0, 0.0]);
}

#[test]
fn gspo_and_cispo_advantages_are_grpo_advantages() {
    let m = [1u8, 0, 1];
    let groups = vec![vec![score(0.2, &m), score(0.9, &m), score(0.4, &m)]];
    for std_normalization in [true, false] {
        let config = AdvantageConfig { std_normalization, ..AdvantageConfig::default() };
        let grpo = Grpo::from(config).compute(&groups).unwrap();
        for name in ["gspo", "cispo"] {
            let estimator = create_advantage(name, &config.to_json()).unwrap();
            assert_eq!(estimator.compute(&groups).unwrap(), grpo, "{name}");
        }
    }
}

#[test]
fn without_rewards_normalization_the_raw_reward_is_the_advantage() {
    // slime's --disable-rewards-normalization: GRPO broadcasts r; REINFORCE++-baseline
    // skips the group mean (then whitens over the batch as always).
    let m = [1u8, 0, 1];
    let groups = vec![vec![score(0.2, &m), score(0.9, &m)], vec![score(0.4, &m)]];
    let out =
        Grpo { std_normalization: true, rewards_normalization: false }.compute(&groups).unwrap();
    close(&out.advantages[0][1], &[0.9, 0.0, 0.9]);
    close(&out.advantages[1][0], &[0.4, 0.0, 0.4]);
    let raw = ReinforcePlusPlusBaseline { kl_coef: 0.0, rewards_normalization: false };
    let out = raw.compute(&groups).unwrap();
    // Whitened raw rewards [0.2, 0.9, 0.4] (each on two tokens): mean 0.5.
    assert!(out.advantages[0][0][0] < 0.0 && out.advantages[0][1][0] > 0.0);
    assert!(out.advantages[1][0][0] < 0.0, "{out:?}");
}

#[test]
fn rloo_subtracts_the_mean_of_the_others() {
    // Rewards [1, 0, 0, 1]: sample 0 → 1 − (0+0+1)/3 = 2/3, sample 1 → 0 − 2/3 = −2/3;
    // equivalently 4/3 · (r − 0.5) = ±2/3.
    let m = [1u8, 1];
    let group = vec![score(1.0, &m), score(0.0, &m), score(0.0, &m), score(1.0, &m)];
    let out = Rloo.compute(&[group]).unwrap();
    close(&out.advantages[0][0], &[2.0 / 3.0, 2.0 / 3.0]);
    close(&out.advantages[0][1], &[-2.0 / 3.0, -2.0 / 3.0]);
    // [3, 0]: 3 − 0 = 3 and 0 − 3 = −3.
    let out = Rloo.compute(&[vec![score(3.0, &m), score(0.0, &m)]]).unwrap();
    close(&out.advantages[0][0], &[3.0, 3.0]);
    close(&out.advantages[0][1], &[-3.0, -3.0]);
}

#[test]
fn reinforce_plus_plus_discounts_kl_shaped_rewards_then_whitens() {
    // γ = 0.5, kl_coef = 0.1.
    // Sample A: mask [1, 1, 1, 0], kl [1, 2, 3, 9], reward 1.
    //   token rewards: [−0.1, −0.2, −0.3 + 1, 0] = [−0.1, −0.2, 0.7, 0] (the masked kl 9
    //   earns nothing); returns G3 = 0, G2 = 0.7, G1 = −0.2 + 0.35 = 0.15,
    //   G0 = −0.1 + 0.075 = −0.025.
    // Sample B: mask [0, 1, 1], kl [0, 0, 0], reward 0 → returns all 0.
    // Kept values: [−0.025, 0.15, 0.7, 0, 0]: mean 0.165, squared deviations
    //   0.0361 + 0.000225 + 0.286225 + 0.027225 + 0.027225 = 0.377, var 0.377/4 = 0.09425,
    //   std 0.307002.
    let (ma, ka) = ([1u8, 1, 1, 0], [1f32, 2.0, 3.0, 9.0]);
    let (mb, kb) = ([0u8, 1, 1], [0f32, 0.0, 0.0]);
    let groups = vec![vec![with_kl(1.0, &ma, &ka)], vec![with_kl(0.0, &mb, &kb)]];
    let rpp = ReinforcePlusPlus { gamma: 0.5, kl_coef: 0.1 };
    let out = rpp.compute(&groups).unwrap();
    let (mean, std) = (0.165, 0.09425f64.sqrt());
    let w = |x: f64| (x - mean) / std;
    close(&out.advantages[0][0], &[w(-0.025), w(0.15), w(0.7), 0.0]);
    close(&out.advantages[1][0], &[0.0, w(0.0), w(0.0)]);
    let (mean, std) = kept_stats(&out, &groups);
    assert!(mean.abs() < 1e-6 && (std - 1.0).abs() < 1e-6, "{mean} {std}");

    // γ = 1 and no KL: every position up to the last kept token carries the reward.
    let m = [1u8, 0, 1, 0];
    let groups = vec![vec![score(2.0, &m), score(0.0, &m)]];
    let out = ReinforcePlusPlus { gamma: 1.0, kl_coef: 0.0 }.compute(&groups).unwrap();
    // Kept values [2, 2, 0, 0]: mean 1, unbiased std sqrt(4/3).
    let a = 1.0 / (4.0f64 / 3.0).sqrt();
    close(&out.advantages[0][0], &[a, 0.0, a, 0.0]);
    close(&out.advantages[0][1], &[-a, 0.0, -a, 0.0]);
}

#[test]
fn reinforce_plus_plus_baseline_centers_per_group_then_whitens() {
    // kl_coef = 0.5. Group rewards [1, 0]: mean 0.5, centered [0.5, −0.5].
    // Sample 0: kl [0.2, 0.4] → [0.5 − 0.1, 0.5 − 0.2] = [0.4, 0.3].
    // Sample 1: kl [0, 0.2], mask [1, 0] → [−0.5, masked].
    // Kept values [0.4, 0.3, −0.5]: mean 0.2/3 = 0.066667, squared deviations
    //   0.111111 + 0.054444 + 0.321111 = 0.486667, var 0.243333, std 0.493288.
    let (m0, k0) = ([1u8, 1], [0.2f32, 0.4]);
    let (m1, k1) = ([1u8, 0], [0f32, 0.2]);
    let groups = vec![vec![with_kl(1.0, &m0, &k0), with_kl(0.0, &m1, &k1)]];
    let out = ReinforcePlusPlusBaseline { kl_coef: 0.5, rewards_normalization: true }
        .compute(&groups)
        .unwrap();
    let (mean, std) = (0.2 / 3.0, (0.486_666_666_7f64 / 2.0).sqrt());
    let w = |x: f64| (x - mean) / std;
    close(&out.advantages[0][0], &[w(0.4), w(0.3)]);
    close(&out.advantages[0][1], &[w(-0.5), 0.0]);
}

#[test]
fn whitening_is_masked_and_safe_for_tiny_batches() {
    // Kept [1, 3, 5]: mean 3, unbiased var (4 + 0 + 4)/2 = 4, std 2 → [−1, 0, 1].
    let mut a = [1.0f32, 100.0, 3.0, 5.0];
    normalize_advantages(&mut a, &[1, 0, 1, 1]).unwrap();
    close(&a, &[-1.0, 0.0, 0.0, 1.0]);
    // One kept token: variance 0, so it becomes 0 (no division by zero).
    let mut a = [7.0f32, 2.0];
    normalize_advantages(&mut a, &[0, 1]).unwrap();
    assert_eq!(a, [0.0, 0.0]);
    // No kept token.
    let mut a = [7.0f32, 2.0];
    normalize_advantages(&mut a, &[0, 0]).unwrap();
    assert_eq!(a, [0.0, 0.0]);
    let mut empty: [f32; 0] = [];
    normalize_advantages(&mut empty, &[]).unwrap();
    // Whitening twice changes nothing beyond the ε.
    let mut a = [0.3f32, -1.2, 2.5, 0.0];
    normalize_advantages(&mut a, &[1, 1, 1, 1]).unwrap();
    let once = a;
    normalize_advantages(&mut a, &[1, 1, 1, 1]).unwrap();
    close(&a, &once.map(f64::from));
    assert!(normalize_advantages(&mut a, &[1, 1]).is_err());
}

#[test]
fn mismatched_lengths_and_missing_kl_are_errors() {
    let m = [1u8, 1, 1];
    let short = [0f32, 0.0];
    let bad_kl = SequenceScore { reward: 1.0, loss_mask: &m, kl: Some(&short), values: None };
    let err = Grpo { std_normalization: true, rewards_normalization: true }
        .compute(&[vec![bad_kl]])
        .unwrap_err();
    assert!(err.to_string().contains("2 kl entries but a loss mask of 3"), "{err}");
    let bad_values = SequenceScore { reward: 1.0, loss_mask: &m, kl: None, values: Some(&short) };
    let err = Rloo.compute(&[vec![score(0.0, &m), bad_values]]).unwrap_err();
    assert!(err.to_string().contains("group 0 sample 1 has 2 values"), "{err}");

    let rpp = ReinforcePlusPlus { gamma: 1.0, kl_coef: 0.1 };
    let err = rpp.compute(&[vec![score(1.0, &m)]]).unwrap_err();
    assert!(err.to_string().contains("no per-token KL"), "{err}");
    let baseline = ReinforcePlusPlusBaseline { kl_coef: 0.1, rewards_normalization: true };
    assert!(baseline.compute(&[vec![score(1.0, &m)]]).is_err());
    // With kl_coef 0 the KL is not needed.
    ReinforcePlusPlusBaseline { kl_coef: 0.0, rewards_normalization: true }
        .compute(&[vec![score(1.0, &m)]])
        .unwrap();

    let err = Rloo.compute(&[vec![score(f32::NAN, &m)]]).unwrap_err();
    assert!(err.to_string().contains("reward NaN"), "{err}");
}

#[test]
fn empty_batches_and_fully_masked_samples() {
    for plugin in BUILTIN {
        let Factory::Advantage(make) = plugin.factory else { panic!("{plugin:?}") };
        let estimator = make(&serde_json::Value::Null).unwrap();
        assert!(estimator.compute(&[]).unwrap().advantages.is_empty());
        let out = estimator.compute(&[vec![]]).unwrap();
        assert_eq!(out.advantages, vec![Vec::<Vec<f32>>::new()]);
        // A fully masked sample (slime's removed samples) gets zeros, whatever its reward.
        let (m, live) = ([0u8, 0], [1u8, 1]);
        let out = estimator.compute(&[vec![score(5.0, &m), score(1.0, &live)]]).unwrap();
        assert_eq!(out.advantages[0][0], vec![0.0, 0.0], "{plugin:?}");
    }
}

#[test]
fn estimators_are_registered_under_their_flag_names() {
    let names: Vec<&str> = BUILTIN.iter().map(|p| p.name).collect();
    assert_eq!(
        names,
        ["grpo", "gspo", "cispo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "rloo"]
    );
    let m = [1u8];
    let groups = vec![vec![score(1.0, &m), score(0.0, &m)]];
    for name in names {
        let plugin = miles_core::registry::find(miles_core::PluginKind::Advantage, name)
            .unwrap_or_else(|e| panic!("{e}"));
        assert!(std::ptr::eq(plugin, *BUILTIN.iter().find(|p| p.name == name).unwrap()));
        let estimator = create_advantage(name, &json!({})).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(estimator.compute(&groups).unwrap().advantages[0].len(), 2);
    }
    // Configuration reaches the estimator: Dr.GRPO gives ±0.5, GRPO ±0.7071.
    let dr = create_advantage("grpo", &json!({"std_normalization": false})).ok().unwrap();
    close(&dr.compute(&groups).unwrap().advantages[0][0], &[0.5]);
    let grpo = create_advantage("grpo", &serde_json::Value::Null).ok().unwrap();
    close(&grpo.compute(&groups).unwrap().advantages[0][0], &[0.5 / 0.5f64.sqrt()]);
}

#[test]
fn bad_configuration_is_refused() {
    let err = create_advantage("grpo", &json!({"std_normalisation": false})).err().unwrap();
    assert!(err.to_string().contains("std_normalisation"), "{err}");
    let err = create_advantage("rloo", &json!({"gama": 0.9})).err().unwrap();
    assert!(err.to_string().contains("gama"), "{err}");
    let err = create_advantage("reinforce_plus_plus", &json!({"gamma": 1.5})).err().unwrap();
    assert!(err.to_string().starts_with("--gamma"), "{err}");
    let err =
        create_advantage("reinforce_plus_plus_baseline", &json!({"kl_coef": -1.0})).err().unwrap();
    assert!(err.to_string().starts_with("--kl-coef"), "{err}");
    let err = create_advantage("gspo", &json!({"gamma": "high"})).err().unwrap();
    assert!(err.to_string().contains("gamma") || err.to_string().contains("string"), "{err}");
}

#[test]
fn run_config_maps_to_the_plugin_configuration() {
    let run = RunConfig {
        disable_grpo_std_normalization: true,
        gamma: 0.9,
        kl_coef: 0.05,
        ..RunConfig::default()
    };
    let c = AdvantageConfig::from_run_config(&run);
    let expected = AdvantageConfig {
        std_normalization: false,
        gamma: 0.9,
        kl_coef: 0.05,
        ..AdvantageConfig::default()
    };
    assert_eq!(c, expected);
    let run = RunConfig { disable_rewards_normalization: true, ..run };
    assert!(!AdvantageConfig::from_run_config(&run).rewards_normalization);
    assert_eq!(AdvantageConfig::from_json(&c.to_json()).unwrap(), c);
    let defaults = AdvantageConfig::from_run_config(&RunConfig::default());
    assert_eq!(defaults, AdvantageConfig::default());
}
