use super::*;

/// Rollout logprobs all zero, so train logprob ln(r) gives ratio r exactly.
fn run(config: TisConfig, ratios: &[f64], mask: &[u8], lens: &[usize]) -> CorrectionOutput {
    let train: Vec<f32> = ratios.iter().map(|r| r.ln() as f32).collect();
    let rollout = vec![0f32; ratios.len()];
    let input = CorrectionInput {
        train_log_probs: &train,
        rollout_log_probs: &rollout,
        loss_mask: mask,
        response_lengths: lens,
    };
    Tis::new(config).unwrap().correct(&input).unwrap()
}

fn close(a: &[f32], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((f64::from(*x) - y).abs() < 1e-5, "{a:?} vs {b:?}");
    }
}

/// The ratios are given through f32 logprobs, so they are exact to about 1e-7.
fn near(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6), "{a:?} vs {b:?}");
}

fn metric<'a>(out: &'a CorrectionOutput, name: &str) -> &'a [f64] {
    out.metrics.get(name).unwrap_or_else(|| panic!("no metric {name}: {:?}", out.metrics.keys()))
}

fn config(mode: TisMode) -> TisConfig {
    TisConfig { mode, ..TisConfig::default() }
}

#[test]
fn truncate_caps_at_the_upper_bound_and_the_optional_lower_one() {
    let out = run(TisConfig::default(), &[0.5, 1.5, 3.0], &[1, 1, 1], &[3]);
    close(&out.weights, &[0.5, 1.5, 2.0]);
    assert_eq!(out.loss_mask, vec![1, 1, 1]);
    // Metrics are per-sequence sums over the loss mask: one of three tokens hit the bound.
    assert_eq!(metric(&out, "mis_tis_truncate_fraction"), &[1.0]);
    assert_eq!(metric(&out, "tis_clipfrac"), &[1.0]);
    // slime's --tis-clip-low: vanilla TIS clamps into [low, high].
    let two_sided = TisConfig { lower: Some(0.8), ..TisConfig::default() };
    let out = run(two_sided, &[0.5, 1.5, 3.0], &[1, 1, 1], &[3]);
    close(&out.weights, &[0.8, 1.5, 2.0]);
    assert_eq!(metric(&out, "tis_clipfrac"), &[2.0]);
}

/// Regression: `clip` used to zero the weights outside the bounds (icepop's behaviour) where
/// the documentation and slime's MIS clamp them.
#[test]
fn clip_clamps_into_the_bounds_and_keeps_every_token() {
    let out = run(
        TisConfig { lower: Some(0.6), ..config(TisMode::Clip) },
        &[0.5, 1.5, 3.0],
        &[1, 1, 1],
        &[3],
    );
    close(&out.weights, &[0.6, 1.5, 2.0]);
    assert_eq!(out.loss_mask, vec![1, 1, 1]);
    assert_eq!(metric(&out, "mis_tis_clip_fraction_low"), &[1.0]);
    assert_eq!(metric(&out, "mis_tis_clip_fraction_high"), &[1.0]);
}

#[test]
fn icepop_zeroes_weights_outside_the_bounds_but_keeps_the_tokens() {
    let out = run(
        TisConfig { lower: Some(0.6), ..config(TisMode::Icepop) },
        &[0.5, 1.5, 3.0],
        &[1, 1, 1],
        &[3],
    );
    close(&out.weights, &[0.0, 1.5, 0.0]);
    assert_eq!(out.loss_mask, vec![1, 1, 1]);
    assert_eq!(metric(&out, "tis_clipfrac"), &[2.0]);
}

#[test]
fn clip_and_mask_default_the_lower_bound_to_one_over_upper() {
    // Upper 2 → lower 0.5: 0.4 is clamped (clip) or dropped (mask); truncate keeps 0.4.
    let out = run(config(TisMode::Clip), &[0.4, 1.0], &[1, 1], &[2]);
    close(&out.weights, &[0.5, 1.0]);
    let out = run(config(TisMode::Mask), &[0.4, 1.0], &[1, 1], &[2]);
    assert_eq!(out.loss_mask, vec![0, 1]);
    close(&run(TisConfig::default(), &[0.4, 1.0], &[1, 1], &[2]).weights, &[0.4, 1.0]);
}

#[test]
fn mask_mode_drops_tokens_but_keeps_their_weights() {
    let cfg = TisConfig { lower: Some(0.6), ..config(TisMode::Mask) };
    let out = run(cfg, &[0.5, 1.5, 3.0, 1.0], &[1, 1, 1, 0], &[4]);
    // As in MIS: weights stay the raw ratios (0 off the loss mask); the mask drops them.
    close(&out.weights, &[0.5, 1.5, 3.0, 0.0]);
    assert_eq!(out.loss_mask, vec![0, 1, 0, 0]);
    assert_eq!(metric(&out, "mis_tis_mask_fraction_low"), &[1.0]);
}

#[test]
fn sequence_level_multiplies_the_kept_token_ratios() {
    let cfg = TisConfig { level: TisLevel::Sequence, ..TisConfig::default() };
    // Sequence A: 2 × 0.75 = 1.5 (the masked-out 100 does not count); sequence B: 3 → 2.
    let out = run(cfg, &[2.0, 0.75, 100.0, 3.0], &[1, 1, 0, 1], &[3, 1]);
    close(&out.weights, &[1.5, 1.5, 0.0, 2.0]);
}

#[test]
fn geometric_level_takes_the_mean_log_ratio() {
    let cfg = TisConfig { level: TisLevel::Geometric, upper: 5.0, ..TisConfig::default() };
    // exp((ln 4 + ln 1) / 2) = 2; exp((ln 8 + ln 0.5 + ln 2) / 3) = 2.
    let out = run(cfg, &[4.0, 1.0, 8.0, 0.5, 2.0], &[1, 1, 1, 1, 1], &[2, 3]);
    close(&out.weights, &[2.0; 5]);
    let cfg = TisConfig { mode: TisMode::Mask, upper: 1.5, ..cfg };
    let out = run(cfg, &[4.0, 1.0, 1.0], &[1, 1, 1], &[2, 1]);
    assert_eq!(out.loss_mask, vec![0, 0, 1]);
}

#[test]
fn rejection_sampling_uses_its_own_level_and_bounds() {
    // Token-level truncation, sequence-level rejection in [0.5, 2]: sequence A's product
    // 3 × 1 = 3 is rejected as a whole, B's 1.2 is kept. Weights are untouched.
    let cfg = TisConfig {
        use_rs: true,
        rs_level: TisLevel::Sequence,
        upper: 4.0,
        rs_upper: Some(2.0),
        rs_lower: Some(0.5),
        ..TisConfig::default()
    };
    let out = run(cfg, &[3.0, 1.0, 1.2], &[1, 1, 1], &[2, 1]);
    assert_eq!(out.loss_mask, vec![0, 0, 1]);
    close(&out.weights, &[3.0, 1.0, 1.2]);
    assert_eq!(metric(&out, "mis_rs_mask_fraction_high"), &[2.0, 0.0]);
}

#[test]
fn veto_drops_the_whole_sequence_and_needs_rejection_sampling() {
    let cfg = TisConfig {
        use_rs: true,
        rs_veto_threshold: Some(0.1),
        upper: 20.0,
        rs_lower: Some(0.0),
        ..TisConfig::default()
    };
    // The 0.05 token vetoes sequence A; the 0.01 in B is off the loss mask, so B survives.
    let out = run(cfg, &[1.0, 0.05, 1.2, 0.01, 1.1], &[1, 1, 1, 0, 1], &[3, 2]);
    assert_eq!(out.loss_mask, vec![0, 0, 0, 0, 1]);
    assert_eq!(metric(&out, "mis_rs_catastrophic_seq_fraction"), &[3.0, 0.0]);
    assert_eq!(metric(&out, "mis_rs_catastrophic_token_fraction"), &[1.0, 0.0]);
    // Without --use-rs the threshold does nothing (the run configuration refuses that pair).
    let out = run(TisConfig { use_rs: false, ..cfg }, &[1.0, 0.05], &[1, 1], &[2]);
    assert_eq!(out.loss_mask, vec![1, 1]);
}

/// Regression: batch normalization used to average only the tokens that survived mask mode
/// and the veto; MIS averages over the input loss mask, rejected tokens included.
#[test]
fn batch_normalization_averages_over_the_input_loss_mask() {
    let cfg = TisConfig { batch_normalize: true, upper: 10.0, ..TisConfig::default() };
    let out = run(cfg, &[1.0, 2.0, 5.0], &[1, 1, 0], &[3]);
    close(&out.weights, &[2.0 / 3.0, 4.0 / 3.0, 0.0]);
    near(metric(&out, "mis_batch_norm_factor"), &[3.0]);
    // Mask mode with [0.5, 2]: 4 is rejected but its weight still enters the mean (1+4+1)/3.
    let cfg = TisConfig { mode: TisMode::Mask, upper: 2.0, ..cfg };
    let out = run(cfg, &[1.0, 4.0, 1.0], &[1, 1, 1], &[3]);
    assert_eq!(out.loss_mask, vec![1, 0, 1]);
    close(&out.weights, &[0.5, 2.0, 0.5]);
    // Sequence level: each sequence counts once, whatever its length.
    let cfg = TisConfig { level: TisLevel::Sequence, mode: TisMode::Truncate, upper: 10.0, ..cfg };
    let out = run(cfg, &[1.0, 1.0, 1.0, 3.0], &[1, 1, 1, 1], &[3, 1]);
    close(&out.weights, &[0.5, 0.5, 0.5, 1.5]);
}

/// A batch spread over two processes normalizes by the whole batch's mean: each part, whose
/// sum and count go through the hook (here: the other part's added), gets the weights and the
/// factor of the whole batch at both levels.
#[test]
fn batch_normalization_over_parts_is_the_whole_batchs() {
    let ratios: [f64; 8] = [1.0, 2.0, 5.0, 0.5, 3.0, 1.5, 4.0, 0.25];
    let mask = [1, 1, 0, 1, 1, 1, 1, 1];
    let lens = [3, 2, 3];
    let split = 5; // the first two sequences | the third
    for level in [TisLevel::Token, TisLevel::Sequence] {
        let cfg = TisConfig { batch_normalize: true, upper: 10.0, level, ..TisConfig::default() };
        let tis = Tis::new(cfg).unwrap();
        let train: Vec<f32> = ratios.iter().map(|r| r.ln() as f32).collect();
        let rollout = vec![0f32; ratios.len()];
        let input = |r: std::ops::Range<usize>, lens: &'static [usize]| CorrectionInput {
            train_log_probs: &train[r.clone()],
            rollout_log_probs: &rollout[r.clone()],
            loss_mask: &mask[r],
            response_lengths: lens,
        };
        let (a, b) = (input(0..split, &[3, 2]), input(split..8, &[3]));
        // Each part's own sums (the hook sees them once), then each part with the other's.
        let own = |part: &CorrectionInput<'_>| {
            let mut seen = Vec::new();
            tis.correct_part(part, &mut |s| {
                seen = s.to_vec();
                Ok(())
            })
            .unwrap();
            seen
        };
        let (sums_a, sums_b) = (own(&a), own(&b));
        let with = |part: &CorrectionInput<'_>, other: &[f64]| {
            tis.correct_part(part, &mut |s| {
                s.iter_mut().zip(other).for_each(|(x, y)| *x += y);
                Ok(())
            })
            .unwrap()
        };
        let (out_a, out_b) = (with(&a, &sums_b), with(&b, &sums_a));
        let whole = run(cfg, &ratios, &mask, &lens);
        let parts: Vec<f32> = [out_a.weights.clone(), out_b.weights.clone()].concat();
        assert_eq!(parts, whole.weights, "{level:?}");
        let factor = metric(&whole, "mis_batch_norm_factor");
        let factors =
            [metric(&out_a, "mis_batch_norm_factor"), metric(&out_b, "mis_batch_norm_factor")];
        assert_eq!(factors.concat(), factor, "{level:?}");
        assert!(factor[0] > 1.2, "the factor is not 1 here: {factor:?}");
    }
}

#[test]
fn mismatch_metrics_describe_the_two_engines() {
    // One sequence, ln r = [ln 2, 0]; each metric is its sum over the two tokens, a
    // per-sequence value counting twice.
    let out = run(TisConfig::default(), &[2.0, 1.0], &[1, 1], &[2]);
    let ln2 = 2f64.ln();
    near(metric(&out, "mis_kl"), &[-ln2]);
    near(metric(&out, "mis_k3_kl"), &[1.0 - ln2]);
    near(metric(&out, "mis_training_log_ppl"), &[-ln2]);
    near(metric(&out, "mis_rollout_log_ppl"), &[0.0]);
    near(metric(&out, "mis_chi2_token"), &[2.0 * 1.5]);
    near(metric(&out, "mis_chi2_seq"), &[2.0 * 3.0]);
    near(metric(&out, "mis_is_ratio_max_final"), &[2.0 * 2.0]);
    near(metric(&out, "tis"), &[3.0]);
    // Tokens off the loss mask count for nothing, even a wild one.
    let out = run(TisConfig::default(), &[2.0, 1e30], &[1, 0], &[2]);
    near(metric(&out, "tis"), &[2.0]);
    // A fully masked sequence contributes 0 to every metric.
    let out = run(TisConfig::default(), &[2.0, 3.0], &[1, 0], &[1, 1]);
    assert!(out.metrics.values().all(|v| v.len() == 2 && v[1] == 0.0), "{:?}", out.metrics);
}

#[test]
fn extreme_log_ratios_stay_finite() {
    let train = [200.0f32, -200.0];
    let rollout = [0.0f32, 0.0];
    let input = CorrectionInput {
        train_log_probs: &train,
        rollout_log_probs: &rollout,
        loss_mask: &[1, 1],
        response_lengths: &[2],
    };
    for level in [TisLevel::Token, TisLevel::Sequence] {
        for mode in [TisMode::Truncate, TisMode::Clip, TisMode::Mask, TisMode::Icepop] {
            let tis = Tis::new(TisConfig { mode, level, ..TisConfig::default() }).unwrap();
            let out = tis.correct(&input).unwrap();
            assert!(out.weights.iter().all(|w| w.is_finite()), "{mode:?}");
        }
    }
    let out = Tis::new(TisConfig::default()).unwrap().correct(&input).unwrap();
    close(&out.weights, &[2.0, (-20f64).exp()]);
    // The metrics stay finite too (f64 holds e^200).
    assert!(out.metrics.values().flatten().all(|m| m.is_finite()), "{:?}", out.metrics);
}

#[test]
fn nan_ratios_are_out_of_bounds_and_nan_off_the_mask_stays_out() {
    let input = CorrectionInput {
        train_log_probs: &[f32::NAN, 0.0, f32::NAN],
        rollout_log_probs: &[0.0, 0.0, 0.0],
        loss_mask: &[1, 1, 0],
        response_lengths: &[3],
    };
    let correct = |mode| Tis::new(config(mode)).unwrap().correct(&input).unwrap();
    // As slime's `where((r >= lo) & (r <= hi), r, 0)`: icepop gives 0, mask drops the token.
    assert_eq!(correct(TisMode::Icepop).weights, vec![0.0, 1.0, 0.0]);
    assert_eq!(correct(TisMode::Mask).loss_mask, vec![0, 1, 0]);
    // Off the loss mask the weight is 0 whatever the ratio.
    assert_eq!(correct(TisMode::Truncate).weights[2], 0.0);
}

#[test]
fn bad_input_and_configuration_are_errors() {
    let input = CorrectionInput {
        train_log_probs: &[0.0, 0.0],
        rollout_log_probs: &[0.0],
        loss_mask: &[1, 1],
        response_lengths: &[2],
    };
    assert!(Tis::new(TisConfig::default()).unwrap().correct(&input).is_err());
    let err = Tis::new(TisConfig { lower: Some(3.0), ..TisConfig::default() }).unwrap_err();
    assert!(err.to_string().starts_with("--tis-clip-low"), "{err}");
    let geometric =
        TisConfig { level: TisLevel::Geometric, batch_normalize: true, ..TisConfig::default() };
    let err = Tis::new(geometric).unwrap_err();
    assert!(err.to_string().starts_with("--tis-batch-normalize"), "{err}");
    let err = Tis::new(TisConfig { rs_upper: Some(0.1), ..TisConfig::default() }).unwrap_err();
    assert!(err.to_string().starts_with("--rs-upper-bound"), "{err}");
    // A defaulted lower bound (1/upper) above the upper one: the flag to change is --tis-clip.
    let err = Tis::new(TisConfig { upper: 0.8, ..config(TisMode::Clip) }).unwrap_err();
    assert!(err.to_string().starts_with("--tis-clip: 0.8"), "{err}");
    let err = Tis::from_config(&serde_json::json!({"uper": 2.0})).unwrap_err();
    assert!(err.to_string().contains("uper"), "{err}");
    let config = miles_core::config::RunConfig::default().tis_config();
    assert_eq!(Tis::from_config(&config).unwrap().config, TisConfig::default());
}
