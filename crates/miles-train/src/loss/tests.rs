use super::*;

/// An owned batch to borrow a `LossInput` from.
#[derive(Debug, Clone, Default)]
struct Batch {
    logp: Vec<f32>,
    old_logp: Vec<f32>,
    ref_logp: Option<Vec<f32>>,
    entropy: Vec<f32>,
    advantages: Vec<f32>,
    loss_mask: Vec<u8>,
    response_lengths: Vec<usize>,
    correction_weights: Option<Vec<f32>>,
    correction_mask: Option<Vec<u8>>,
}

impl Batch {
    /// One sequence per call of `ratios`: logp = ln ρ, old = 0.
    fn from_ratios(ratios: &[f64], advantages: &[f32]) -> Batch {
        let n = ratios.len();
        Batch {
            logp: ratios.iter().map(|r| r.ln() as f32).collect(),
            old_logp: vec![0.0; n],
            entropy: vec![0.0; n],
            advantages: advantages.to_vec(),
            loss_mask: vec![1; n],
            response_lengths: vec![n],
            ..Batch::default()
        }
    }

    fn input(&self) -> LossInput<'_> {
        LossInput {
            logp: &self.logp,
            old_logp: &self.old_logp,
            ref_logp: self.ref_logp.as_deref(),
            entropy: &self.entropy,
            advantages: &self.advantages,
            loss_mask: &self.loss_mask,
            response_lengths: &self.response_lengths,
            correction_weights: self.correction_weights.as_deref(),
            correction_mask: self.correction_mask.as_deref(),
        }
    }
}

fn near(actual: f64, expected: f64) {
    assert!((actual - expected).abs() < 1e-5, "{actual} vs {expected}");
}

fn close(actual: &[f32], expected: &[f64]) {
    assert_eq!(actual.len(), expected.len(), "{actual:?} vs {expected:?}");
    for (a, e) in actual.iter().zip(expected) {
        assert!((f64::from(*a) - e).abs() < 1e-5, "{actual:?} vs {expected:?}");
    }
}

fn per_token() -> PolicyLossConfig {
    PolicyLossConfig { per_token_loss: true, ..PolicyLossConfig::default() }
}

#[test]
fn ppo_clips_both_sides_with_an_asymmetric_high_bound() {
    // eps_clip 0.2, eps_clip_high 0.28: ρ is clamped into [0.8, 1.28]. Token mean over 5.
    //   ρ 1.5,  A +1: pg1 −1.5,  pg2 −1.28 → −1.28, clipped, no gradient;
    //   ρ 0.5,  A −1: pg1 0.5,   pg2 0.8   → 0.8,   clipped, no gradient;
    //   ρ 0.5,  A +1: pg1 −0.5,  pg2 −0.8  → −0.5,  ∂/∂logp = −Aρ/5 = −0.1;
    //   ρ 1.25, A +1: inside [0.8, 1.28] (clipped with a symmetric 0.2) → −1.25, −0.25;
    //   ρ 1.25, A −1: pg1 1.25 = pg2 → 1.25, ∂/∂logp = +0.25.
    // pg_loss = (−1.28 + 0.8 − 0.5 − 1.25 + 1.25)/5 = −0.196, clipfrac 2/5,
    // ppo_kl = −(ln 1.5 + 2 ln 0.5 + 2 ln 1.25)/5.
    let batch = Batch::from_ratios(&[1.5, 0.5, 0.5, 1.25, 1.25], &[1.0, -1.0, 1.0, 1.0, -1.0]);
    let cfg = PolicyLossConfig { eps_clip_high: 0.28, ..per_token() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.loss, -0.196);
    near(out.metrics.pg_loss, -0.196);
    near(out.metrics.pg_clipfrac, 0.4);
    let log_sum = 1.5f64.ln() + 2.0 * 0.5f64.ln() + 2.0 * 1.25f64.ln();
    near(out.metrics.ppo_kl, -log_sum / 5.0);
    close(&out.d_logp, &[0.0, 0.0, -0.1, -0.25, 0.25]);
    assert_eq!(out.metrics.kl_loss, 0.0);

    // Symmetric clip: the fourth token is clipped too (−1.2, no gradient).
    let out = policy_loss(&per_token(), &batch.input()).unwrap();
    near(out.metrics.pg_loss, (-1.2 + 0.8 - 0.5 - 1.2 + 1.25) / 5.0);
    near(out.metrics.pg_clipfrac, 0.6);
    close(&out.d_logp, &[0.0, 0.0, -0.1, 0.0, 0.25]);
}

#[test]
fn dual_clip_bounds_negative_advantages() {
    // slime's own case: ρ [2, 2, 0.5], A [2, −2, 2], eps 0.2, c 1.5 → per-token losses
    // [−2.4, 3.0, −1.0]: the second is max(4, 2.4) = 4 capped at −A·c = 3.
    // Gradients (token mean over 3): clipped, dual-clipped (constant), −Aρ/3 = −1/3.
    // clipfrac counts only the first (pg2 −2.4 > pg1 −4), as slime does.
    let batch = Batch::from_ratios(&[2.0, 2.0, 0.5], &[2.0, -2.0, 2.0]);
    let cfg = PolicyLossConfig { eps_clip_c: Some(1.5), ..per_token() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.loss, (-2.4 + 3.0 - 1.0) / 3.0);
    near(out.metrics.pg_clipfrac, 1.0 / 3.0);
    close(&out.d_logp, &[0.0, 0.0, -1.0 / 3.0]);
    // Without the dual clip the second token is 4 with gradient −Aρ/3 = 4/3.
    let out = policy_loss(&per_token(), &batch.input()).unwrap();
    near(out.loss, (-2.4 + 4.0 - 1.0) / 3.0);
    close(&out.d_logp, &[0.0, 4.0 / 3.0, -1.0 / 3.0]);
    // c above the ratio: the cap −A·c = 6 does not bind.
    let cfg = PolicyLossConfig { eps_clip_c: Some(3.0), ..per_token() };
    close(&policy_loss(&cfg, &batch.input()).unwrap().d_logp, &[0.0, 4.0 / 3.0, -1.0 / 3.0]);
}

#[test]
fn kl_estimators_values_and_gradients() {
    // logp −1, ref −1.5: log ratio 0.5.
    //   k1 = 0.5, ∂ = 1;  k2 = 0.125, ∂ = 0.5;
    //   k3: x = ref − logp = −0.5, e^x − x − 1 = 0.606531 − 0.5 = 0.106531,
    //   ∂ = 1 − e^x = 0.393469; low_var_kl the same (inside the clamp).
    let e = (-0.5f64).exp();
    let cases = [
        (KlLossType::K1, 0.5, 1.0),
        (KlLossType::K2, 0.125, 0.5),
        (KlLossType::K3, e - 0.5, 1.0 - e),
        (KlLossType::LowVarKl, e - 0.5, 1.0 - e),
    ];
    for (kind, value, grad) in cases {
        let (v, g) = approx_kl(kind, -1.0, -1.5);
        near(f64::from(v), value);
        near(f64::from(g), grad);
    }
    // logp −5, ref −1: x = 4, k3 = e⁴ − 5 = 49.598, ∂ = 1 − e⁴ = −53.598; low_var_kl
    // clamps to 10 with no gradient.
    let (v, g) = approx_kl(KlLossType::K3, -5.0, -1.0);
    assert!((f64::from(v) - (4f64.exp() - 5.0)).abs() < 1e-4, "{v}");
    assert!((f64::from(g) - (1.0 - 4f64.exp())).abs() < 1e-4, "{g}");
    assert_eq!(approx_kl(KlLossType::LowVarKl, -5.0, -1.0), (10.0, 0.0));
    // Same log-probs: every estimator is 0.
    for kind in [KlLossType::K1, KlLossType::K2, KlLossType::K3, KlLossType::LowVarKl] {
        assert_eq!(approx_kl(kind, -2.0, -2.0).0, 0.0);
    }
}

#[test]
fn kl_loss_enters_the_loss_with_its_coefficient() {
    // Two tokens, A = 0 (pg = 0), logp [−1, −2], ref [−1.5, −2]: k2 = [0.125, 0],
    // token mean 0.0625; loss = 0.2 · 0.0625 = 0.0125; ∂/∂logp = 0.2 · [0.5, 0] / 2.
    let mut batch = Batch::from_ratios(&[1.0, 1.0], &[0.0, 0.0]);
    batch.logp = vec![-1.0, -2.0];
    batch.old_logp = batch.logp.clone();
    batch.ref_logp = Some(vec![-1.5, -2.0]);
    let cfg = PolicyLossConfig {
        use_kl_loss: true,
        kl_loss_coef: 0.2,
        kl_loss_type: KlLossType::K2,
        ..per_token()
    };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.kl_loss, 0.0625);
    near(out.loss, 0.0125);
    close(&out.d_logp, &[0.05, 0.0]);
    // Without a reference the KL loss is refused.
    batch.ref_logp = None;
    let err = policy_loss(&cfg, &batch.input()).unwrap_err();
    assert!(err.to_string().contains("--use-kl-loss"), "{err}");
}

/// Sequences of 3, 1 and 2 tokens; the middle one fully masked.
fn uneven() -> Batch {
    Batch {
        logp: vec![-1.0, -2.0, -9.0, -5.0, -3.0, -4.0],
        old_logp: vec![-1.0, -2.0, -9.0, -5.0, -3.0, -4.0],
        entropy: vec![1.0, 2.0, 9.0, 5.0, 3.0, 4.0],
        advantages: vec![0.0; 6],
        loss_mask: vec![1, 1, 0, 0, 1, 1],
        response_lengths: vec![3, 1, 2],
        ..Batch::default()
    }
}

#[test]
fn sequence_mean_and_token_mean_on_uneven_sequences() {
    // Entropy [1, 2, (9) | (5) | 3, 4] with coefficient 0.1 and A = 0.
    // Sequence mean: (1+2)/2 = 1.5, the fully masked sequence 0 (still counted),
    //   (3+4)/2 = 3.5 → (1.5 + 0 + 3.5)/3 = 5/3; ∂/∂entropy = −0.1/(2·3) on kept tokens.
    // Token mean: (1+2+3+4)/(2 + 1 + 2) = 2 (slime counts the empty sequence as one
    //   token); ∂/∂entropy = −0.1/5.
    let batch = uneven();
    let cfg = PolicyLossConfig { entropy_coef: 0.1, ..PolicyLossConfig::default() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.entropy_loss, 5.0 / 3.0);
    near(out.loss, -0.1 * 5.0 / 3.0);
    let s = -0.1 / 6.0;
    close(&out.d_entropy, &[s, s, 0.0, 0.0, s, s]);
    close(&out.d_logp, &[0.0; 6]);

    let cfg = PolicyLossConfig { per_token_loss: true, ..cfg };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.entropy_loss, 2.0);
    near(out.loss, -0.2);
    let s = -0.1 / 5.0;
    close(&out.d_entropy, &[s, s, 0.0, 0.0, s, s]);

    // The metric is computed with a zero coefficient, but the term stays out of the loss.
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    near(out.metrics.entropy_loss, 5.0 / 3.0);
    assert_eq!(out.loss, 0.0);
    assert!(out.d_entropy.iter().all(|&d| d == 0.0));
}

#[test]
fn pg_loss_aggregates_per_sequence() {
    // ρ = 1 everywhere, so pg = −A. A [1, 1, (·) | (·) | −2, 4]:
    // sequence mean: (−(1+1)/2 + 0 − (−2+4)/2)/3 = −2/3; ∂/∂logp = −A/(count·3);
    // token mean: −(1 + 1 − 2 + 4)/5 = −0.8; ∂/∂logp = −A/5.
    let mut batch = uneven();
    batch.advantages = vec![1.0, 1.0, 7.0, 7.0, -2.0, 4.0];
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    near(out.loss, -2.0 / 3.0);
    close(&out.d_logp, &[-1.0 / 6.0, -1.0 / 6.0, 0.0, 0.0, 2.0 / 6.0, -4.0 / 6.0]);
    let out = policy_loss(&per_token(), &batch.input()).unwrap();
    near(out.loss, -0.8);
    close(&out.d_logp, &[-0.2, -0.2, 0.0, 0.0, 0.4, -0.8]);
}

#[test]
fn correction_weights_scale_pg_and_the_mask_keeps_denominators() {
    // One sequence of 4, ρ = 1, A = 1 (pg = −1), weights [2, 5, 0.5, 1], correction mask
    // [1, 0, 1, 1]: pg numerator 2·(−1) + 0.5·(−1) + 1·(−1) = −3.5 over the loss mask's
    // 4 tokens → −0.875; ∂/∂logp = −A·ρ·w/4 = [−0.5, 0, −0.125, −0.25].
    // Entropy [1, 1, 1, 1]: the dropped token leaves the numerator only → 3/4.
    let mut batch = Batch::from_ratios(&[1.0; 4], &[1.0; 4]);
    batch.entropy = vec![1.0; 4];
    batch.correction_weights = Some(vec![2.0, 5.0, 0.5, 1.0]);
    batch.correction_mask = Some(vec![1, 0, 1, 1]);
    let cfg = PolicyLossConfig { entropy_coef: 0.01, ..PolicyLossConfig::default() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.pg_loss, -0.875);
    near(out.metrics.entropy_loss, 0.75);
    near(out.loss, -0.875 - 0.01 * 0.75);
    close(&out.d_logp, &[-0.5, 0.0, -0.125, -0.25]);
    close(&out.d_entropy, &[-0.0025, 0.0, -0.0025, -0.0025]);
    // Weights alone: every token counts, the second with weight 5.
    batch.correction_mask = None;
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.pg_loss, -(2.0 + 5.0 + 0.5 + 1.0) / 4.0);
    // A correction cannot add a token the loss mask drops.
    batch.loss_mask = vec![1, 1, 0, 1];
    batch.correction_mask = Some(vec![1, 1, 1, 1]);
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.metrics.pg_loss, -(2.0 + 5.0 + 1.0) / 3.0);
}

#[test]
fn gspo_uses_one_ratio_per_sequence() {
    // Sequences [2, 1]; logp − old = [0.2, 0.4 | −0.1]; eps 0.2; sequence mean.
    // Sequence 0: s = 0.3, ρ = e^0.3 = 1.349859; A = −1: pg1 1.349859 > pg2 1.2 →
    //   1.349859 per token (not clipped). Sequence 1: ρ = e^−0.1 = 0.904837, A = +1 →
    //   −0.904837. Loss = (1.349859 − 0.904837)/2; ppo_kl = (−0.3 + 0.1)/2 = −0.1.
    // Gradients: sequence 0 has ∂loss/∂ρ = Σ_t (1/(2·2))·1 = 0.5, and ∂ρ/∂logp_j = ρ/2,
    //   so 0.5·1.349859/2 = 0.337465 on both tokens; sequence 1: −(1/2)·0.904837.
    let batch = Batch {
        logp: vec![-1.0, -1.0, -2.0],
        old_logp: vec![-1.2, -1.4, -1.9],
        entropy: vec![0.0; 3],
        advantages: vec![-1.0, -1.0, 1.0],
        loss_mask: vec![1, 1, 1],
        response_lengths: vec![2, 1],
        ..Batch::default()
    };
    let cfg = PolicyLossConfig { objective: Objective::Gspo, ..PolicyLossConfig::default() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    let (r0, r1) = (0.3f64.exp(), (-0.1f64).exp());
    near(out.loss, (r0 - r1) / 2.0);
    near(out.metrics.ppo_kl, -0.1);
    near(out.metrics.pg_clipfrac, 0.0);
    close(&out.d_logp, &[0.25 * r0, 0.25 * r0, -0.5 * r1]);

    // A = +1 on sequence 0: ρ 1.35 > 1.2 is clipped for the whole sequence.
    let batch = Batch { advantages: vec![1.0, 1.0, 1.0], ..batch };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    near(out.loss, (-1.2 - r1) / 2.0);
    near(out.metrics.pg_clipfrac, 0.5);
    close(&out.d_logp, &[0.0, 0.0, -0.5 * r1]);
    // Token ratios instead: e^0.2 = 1.2214 is clipped, e^0.4 too, so only sequence 1 moves.
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    near(out.metrics.pg_clipfrac, 0.5);
}

#[test]
fn gspo_sequence_ratio_ignores_masked_tokens() {
    // The masked token's log ratio (5.0) stays out of s; s = (0.2 + 0.0)/2 = 0.1.
    // Its logp gets no gradient.
    let batch = Batch {
        logp: vec![-1.0, 4.0, -1.0],
        old_logp: vec![-1.2, -1.0, -1.0],
        entropy: vec![0.0; 3],
        advantages: vec![1.0; 3],
        loss_mask: vec![1, 0, 1],
        response_lengths: vec![3],
        ..Batch::default()
    };
    let cfg = PolicyLossConfig { objective: Objective::Gspo, ..PolicyLossConfig::default() };
    let out = policy_loss(&cfg, &batch.input()).unwrap();
    let r = 0.1f64.exp();
    near(out.loss, -r);
    // ∂loss/∂ρ = 2·(−1/2) = −1, ∂ρ/∂logp_j = ρ/2.
    close(&out.d_logp, &[-r / 2.0, 0.0, -r / 2.0]);
}

#[test]
fn sft_loss_is_the_negative_mean_logprob() {
    // logp [−1, −2, (−9) | (−5) | −3, −4]: sequence mean (1.5 + 0 + 3.5)/3 = 5/3,
    // token mean 10/5 = 2; ∂/∂logp = −scale.
    let batch = uneven();
    let out = sft_loss(&SftLossConfig::default(), &batch.input()).unwrap();
    near(out.loss, 5.0 / 3.0);
    let s = -1.0 / 6.0;
    close(&out.d_logp, &[s, s, 0.0, 0.0, s, s]);
    assert!(out.d_entropy.iter().all(|&d| d == 0.0));
    let out = sft_loss(&SftLossConfig { per_token_loss: true }, &batch.input()).unwrap();
    near(out.loss, 2.0);
    close(&out.d_logp, &[-0.2, -0.2, 0.0, 0.0, -0.2, -0.2]);
    // Only logp, the mask and the lengths are read.
    let input = LossInput { old_logp: &[], entropy: &[], advantages: &[], ..batch.input() };
    near(sft_loss(&SftLossConfig::default(), &input).unwrap().loss, 5.0 / 3.0);
}

#[test]
fn non_finite_values_propagate_only_from_kept_tokens() {
    let mut batch = uneven();
    batch.advantages = vec![1.0; 6];
    // Garbage at masked positions never reaches the loss.
    batch.logp[2] = f32::NAN;
    batch.entropy[3] = f32::INFINITY;
    batch.advantages[2] = f32::NAN;
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    assert!(out.loss.is_finite() && out.d_logp.iter().all(|d| d.is_finite()), "{out:?}");
    // At a kept token it makes the loss NaN (the caller skips the step), never a panic.
    batch.logp[0] = f32::NAN;
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    assert!(out.loss.is_nan());
    let out = policy_loss(
        &PolicyLossConfig { objective: Objective::Gspo, ..per_token() },
        &batch.input(),
    )
    .unwrap();
    assert!(out.loss.is_nan());
    // A huge log ratio overflows to inf, not a panic.
    let mut batch = uneven();
    batch.advantages = vec![-1.0; 6];
    batch.logp[0] = 1e30;
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    assert!(!out.loss.is_finite());
    // With A > 0 the same token is clipped: a finite loss and a zero gradient (not 0·∞).
    batch.advantages = vec![1.0; 6];
    for objective in [Objective::Ppo, Objective::Gspo] {
        let cfg = PolicyLossConfig { objective, ..PolicyLossConfig::default() };
        let out = policy_loss(&cfg, &batch.input()).unwrap();
        assert!(out.loss.is_finite(), "{out:?}");
        assert_eq!(out.d_logp[0], 0.0, "{out:?}");
    }
    // A NaN entropy with a zero coefficient stays a metric.
    let mut batch = uneven();
    batch.entropy[0] = f32::NAN;
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    assert!(out.loss.is_finite() && out.metrics.entropy_loss.is_nan());
}

#[test]
fn empty_batches_have_zero_loss() {
    let batch = Batch::default();
    let out = policy_loss(&PolicyLossConfig::default(), &batch.input()).unwrap();
    assert_eq!((out.loss, out.d_logp.len()), (0.0, 0));
    let out = sft_loss(&SftLossConfig { per_token_loss: true }, &batch.input()).unwrap();
    assert_eq!(out.loss, 0.0);
}

#[test]
fn length_mismatches_and_bad_settings_are_errors() {
    let batch = uneven();
    let short = [0f32; 5];
    let bad = LossInput { advantages: &short, ..batch.input() };
    let err = policy_loss(&PolicyLossConfig::default(), &bad).unwrap_err().to_string();
    assert!(err.contains("advantages has 5 entries but response lengths sum to 6"), "{err}");
    let bad = LossInput { correction_mask: Some(&[1, 1]), ..batch.input() };
    let err = policy_loss(&PolicyLossConfig::default(), &bad).unwrap_err().to_string();
    assert!(err.contains("correction_mask has 2"), "{err}");
    let bad = LossInput { ref_logp: Some(&short), ..batch.input() };
    assert!(policy_loss(&PolicyLossConfig::default(), &bad).is_err());
    let bad = LossInput { response_lengths: &[3, 1, 1], ..batch.input() };
    assert!(policy_loss(&PolicyLossConfig::default(), &bad).is_err());
    assert!(sft_loss(&SftLossConfig::default(), &bad).is_err());

    let bad_cfg =
        |cfg: PolicyLossConfig| policy_loss(&cfg, &batch.input()).unwrap_err().to_string();
    let d = PolicyLossConfig::default;
    assert!(bad_cfg(PolicyLossConfig { eps_clip_c: Some(1.0), ..d() }).starts_with("--eps-clip-c"));
    assert!(bad_cfg(PolicyLossConfig { eps_clip: f32::NAN, ..d() }).starts_with("--eps-clip:"));
    assert!(
        bad_cfg(PolicyLossConfig { eps_clip_high: -0.1, ..d() }).starts_with("--eps-clip-high")
    );
    assert!(
        bad_cfg(PolicyLossConfig { entropy_coef: f32::INFINITY, ..d() })
            .starts_with("--entropy-coef")
    );
}

#[test]
fn run_config_maps_to_the_loss_settings() {
    let run = RunConfig {
        eps_clip: 0.1,
        eps_clip_high: None,
        advantage_estimator: AdvantageEstimator::Gspo,
        calculate_per_token_loss: true,
        ..RunConfig::default()
    };
    let cfg = PolicyLossConfig::from_run_config(&run);
    assert_eq!((cfg.eps_clip, cfg.eps_clip_high), (0.1, 0.1));
    assert!(cfg.objective == Objective::Gspo && cfg.per_token_loss);
    let run = RunConfig { advantage_estimator: AdvantageEstimator::Cispo, use_opsm: true, ..run };
    let cfg = PolicyLossConfig::from_run_config(&run);
    assert_eq!((cfg.objective, cfg.opsm_delta), (Objective::Cispo, Some(1e-4)));
    let run = RunConfig { eps_clip_high: Some(0.28), ..RunConfig::default() };
    let cfg = PolicyLossConfig::from_run_config(&run);
    assert_eq!(cfg, PolicyLossConfig { eps_clip_high: 0.28, ..PolicyLossConfig::default() });
    assert!(SftLossConfig::from_run_config(&RunConfig::default()) == SftLossConfig::default());
    let names = |c, o| -> Vec<&str> {
        LossMetrics::default().named(c, o).iter().map(|(n, _)| *n).collect()
    };
    assert!(names(false, false).contains(&"train/pg_clipfrac"));
    assert!(!names(false, false).contains(&"train/ois"));
    assert!(names(true, true).ends_with(&["train/ois", "train/opsm_clipfrac"]));
}

/// splitmix64: deterministic test inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        (z ^ (z >> 31)) as f64 / u64::MAX as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f32 {
        (lo + (hi - lo) * self.next()) as f32
    }
}

/// Sequences of uneven lengths (one empty, one fully masked), ratios well outside the clip
/// range, and reference log-probs far enough to hit the low_var_kl clamp.
fn random_batch(seed: u64) -> Batch {
    let mut rng = Rng(seed);
    let response_lengths = vec![3, 5, 1, 4, 0, 2, 3];
    let n: usize = response_lengths.iter().sum();
    let mut batch = Batch { response_lengths, ..Batch::default() };
    for t in 0..n {
        let logp = rng.uniform(-3.0, -0.1);
        batch.logp.push(logp);
        batch.old_logp.push(logp + rng.uniform(-1.2, 1.2));
        batch.entropy.push(rng.uniform(0.0, 3.0));
        batch.advantages.push(rng.uniform(-2.0, 2.0));
        let fully_masked = (8..9).contains(&t); // the one-token sequence
        batch.loss_mask.push(u8::from(!fully_masked && rng.next() < 0.8));
    }
    batch.ref_logp = Some(batch.logp.iter().map(|l| l + rng.uniform(-1.5, 3.5)).collect());
    batch.correction_weights = Some((0..n).map(|_| rng.uniform(0.0, 2.0)).collect());
    batch.correction_mask = Some((0..n).map(|_| u8::from(rng.next() < 0.85)).collect());
    batch
}

/// The mean logp − old over the loss mask of the sequence holding token `t`.
fn sequence_mean_log_ratio(batch: &Batch, t: usize) -> f64 {
    let mut start = 0;
    for &len in &batch.response_lengths {
        if (start..start + len).contains(&t) {
            let kept: Vec<usize> =
                (start..start + len).filter(|&j| batch.loss_mask[j] != 0).collect();
            let sum: f64 =
                kept.iter().map(|&j| f64::from(batch.logp[j]) - f64::from(batch.old_logp[j])).sum();
            return sum / kept.len().max(1) as f64;
        }
        start += len;
    }
    unreachable!("token {t} is in no sequence")
}

/// Whether nudging token `t`'s logp could cross a kink of the loss: a clip bound, the
/// dual-clip cap, the low_var_kl clamp (1e-3 in ratio, 1e-2 in KL) or OPSM's threshold
/// (1e-3 in the sequence's mean log-ratio).
fn near_a_kink(cfg: &PolicyLossConfig, batch: &Batch, t: usize) -> bool {
    let token_log_r = f64::from(batch.logp[t]) - f64::from(batch.old_logp[t]);
    let sequence_log_r = sequence_mean_log_ratio(batch, t);
    let log_r = if cfg.objective == Objective::Gspo { sequence_log_r } else { token_log_r };
    let ratio = log_r.exp();
    let mut kinks = vec![1.0 - f64::from(cfg.eps_clip), 1.0 + f64::from(cfg.eps_clip_high)];
    kinks.extend(cfg.eps_clip_c.map(f64::from));
    let near_ratio = kinks.iter().any(|k| (ratio - k).abs() < 1e-3);
    let rho = cfg.use_unbiased_kl.then(|| token_log_r.exp());
    let (logp, r) = (f64::from(batch.logp[t]), f64::from(batch.ref_logp.as_ref().unwrap()[t]));
    let kl = kl_term(KlLossType::K3, logp, r, rho).0;
    let near_clamp = cfg.kl_loss_type == KlLossType::LowVarKl && (kl.abs() - 10.0).abs() < 1e-2;
    let near_opsm = cfg.opsm_delta.is_some_and(|d| (-sequence_log_r - f64::from(d)).abs() < 1e-3);
    near_ratio || near_clamp || near_opsm
}

#[derive(Clone, Copy, PartialEq)]
enum Slot {
    Logp,
    Entropy,
    /// logp and old_logp together: the ratio stays fixed, which is what CISPO's
    /// stop-gradient on the ratio differentiates.
    LogpAtFixedRatio,
}

/// Central difference of the loss in one f32 input, divided by the step actually taken
/// (x ± h rounds in f32; the difference of the rounded values is exact in f64). `None`
/// when a fixed-ratio step rounded the two inputs differently.
fn central_difference(
    batch: &Batch,
    loss: impl Fn(&Batch) -> f64,
    slot: Slot,
    t: usize,
) -> Option<f64> {
    // A power of two, so that a fixed-ratio step is exact away from exponent changes.
    let h = 2f32.powi(-13);
    let nudge = |b: &mut Batch, sign: f32| match slot {
        Slot::Logp => b.logp[t] += sign * h,
        Slot::Entropy => b.entropy[t] += sign * h,
        Slot::LogpAtFixedRatio => {
            b.logp[t] += sign * h;
            b.old_logp[t] += sign * h;
        }
    };
    let (mut plus, mut minus) = (batch.clone(), batch.clone());
    nudge(&mut plus, 1.0);
    nudge(&mut minus, -1.0);
    let (x_plus, x_minus) = match slot {
        Slot::Entropy => (plus.entropy[t], minus.entropy[t]),
        _ => (plus.logp[t], minus.logp[t]),
    };
    let step = f64::from(x_plus) - f64::from(x_minus);
    if slot == Slot::LogpAtFixedRatio
        && f64::from(plus.old_logp[t]) - f64::from(minus.old_logp[t]) != step
    {
        return None;
    }
    Some((loss(&plus) - loss(&minus)) / step)
}

fn assert_gradient(analytic: f32, numeric: f64, what: &str) {
    let a = f64::from(analytic);
    let tolerance = 1e-6 + 1e-5 * numeric.abs();
    assert!((a - numeric).abs() <= tolerance, "{what}: analytic {a} vs numeric {numeric}");
}

/// Every combination of the loss's switches (960), with whether to apply the correction.
fn every_configuration() -> Vec<(PolicyLossConfig, bool)> {
    let kl_settings = [
        None,
        Some(KlLossType::K1),
        Some(KlLossType::K2),
        Some(KlLossType::K3),
        Some(KlLossType::LowVarKl),
    ];
    let mut all = Vec::new();
    for per_token_loss in [false, true] {
        for objective in [Objective::Ppo, Objective::Gspo, Objective::Cispo] {
            for eps_clip_c in [None, Some(2.0)] {
                for kl in kl_settings {
                    for use_unbiased_kl in [false, true] {
                        for opsm_delta in [None, Some(0.1)] {
                            let cfg = PolicyLossConfig {
                                objective,
                                eps_clip: 0.2,
                                eps_clip_high: 0.28,
                                eps_clip_c,
                                use_kl_loss: kl.is_some(),
                                kl_loss_coef: 0.1,
                                kl_loss_type: kl.unwrap_or_default(),
                                use_unbiased_kl,
                                entropy_coef: 0.01,
                                per_token_loss,
                                opsm_delta,
                            };
                            all.extend([(cfg, false), (cfg, true)]);
                        }
                    }
                }
            }
        }
    }
    all
}

#[test]
fn gradients_match_finite_differences_for_every_configuration() {
    let mut checked = 0;
    for seed in [1u64, 2, 3] {
        for (cfg, corrected) in every_configuration() {
            let mut batch = random_batch(seed);
            if !corrected {
                batch.correction_weights = None;
                batch.correction_mask = None;
            }
            let loss = |b: &Batch| policy_loss(&cfg, &b.input()).unwrap().loss;
            let out = policy_loss(&cfg, &batch.input()).unwrap();
            for t in 0..batch.logp.len() {
                let what = format!("{cfg:?} corrected {corrected} seed {seed} token {t}");
                let numeric = central_difference(&batch, loss, Slot::Entropy, t).unwrap();
                assert_gradient(out.d_entropy[t], numeric, &what);
                // CISPO's ratio is a constant of its gradient, so hold it fixed; the
                // unbiased KL's ratio is not, so that pair is checked under PPO and GSPO.
                let slot = match cfg.objective {
                    Objective::Cispo if cfg.use_unbiased_kl => continue,
                    Objective::Cispo => Slot::LogpAtFixedRatio,
                    _ => Slot::Logp,
                };
                if near_a_kink(&cfg, &batch, t) {
                    continue;
                }
                let Some(numeric) = central_difference(&batch, loss, slot, t) else {
                    continue;
                };
                assert_gradient(out.d_logp[t], numeric, &what);
                checked += usize::from(out.d_logp[t] != 0.0);
            }
        }
    }
    // Most tokens carry a gradient; a mistake that zeroed them all would not pass.
    assert!(checked > 10_000, "only {checked} non-zero gradients checked");

    for per_token_loss in [false, true] {
        let batch = random_batch(7);
        let cfg = SftLossConfig { per_token_loss };
        let loss = |b: &Batch| sft_loss(&cfg, &b.input()).unwrap().loss;
        let out = sft_loss(&cfg, &batch.input()).unwrap();
        for t in 0..batch.logp.len() {
            let numeric = central_difference(&batch, loss, Slot::Logp, t).unwrap();
            assert_gradient(out.d_logp[t], numeric, &format!("sft token {t}"));
        }
    }
}
