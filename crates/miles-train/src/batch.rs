//! One rollout's samples as the trainer sees them: flat, per sample its tokens and per response
//! token the loss mask, rollout/old/reference logprobs, advantages and correction weights.

use std::collections::BTreeMap;

use miles_core::config::KlLossType;
use miles_core::{
    Advantage, Correction, CorrectionInput, RoutedExperts, Sample, SequenceScore, Status,
};
use miles_model::moe::OWN_CHOICE;
use miles_model::{PackedBatch, RoutedBatch};

use crate::advantage::MaskedStats;
use crate::loss::{Aggregation, approx_kl};

/// A trainable sample: tokens, where the response starts, and its per-token slices.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
pub struct TrainSample {
    pub group: usize,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    pub reward: f32,
    pub loss_mask: Vec<u8>,
    pub rollout_logp: Vec<f32>,
    pub old_logp: Vec<f32>,
    pub ref_logp: Option<Vec<f32>>,
    pub advantages: Vec<f32>,
    pub correction_weights: Option<Vec<f32>>,
    pub correction_mask: Option<Vec<u8>>,
    /// The experts the rollout routed each position to (mixture of experts), and those the
    /// trainer's forwards use (`[tokens × layers × top_k]`, from the `r3` plugin with
    /// `--use-rollout-routing-replay`).
    pub routed_experts: Option<RoutedExperts>,
    pub replay_experts: Option<Vec<u32>>,
    /// Per response token, the policy version that generated it (older than the trainer's
    /// for the earlier part of a continued response: partial rollout).
    pub versions: Vec<u64>,
}

impl TrainSample {
    pub fn response_len(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Kept tokens, at least 1: the per-sequence denominator of the loss (slime's).
    pub fn denominator(&self) -> usize {
        self.loss_mask.iter().filter(|&&m| m != 0).count().max(1)
    }

    /// From a rolled-out, scored sample; `None` for a sample without a response to learn from.
    pub fn from_sample(s: &Sample, group: usize, reward: f32) -> Option<TrainSample> {
        if s.status == Status::Failed || s.response_length == 0 {
            return None;
        }
        let prompt_len = s.prompt_length().ok()?;
        let mut loss_mask = s.loss_mask.clone();
        loss_mask.resize(s.response_length, 1);
        let mut rollout_logp = s.rollout_log_probs.clone();
        rollout_logp.resize(s.response_length, 0.0);
        Some(TrainSample {
            group,
            tokens: s.tokens.clone(),
            prompt_len,
            reward,
            loss_mask,
            rollout_logp,
            routed_experts: s.rollout_routed_experts.clone(),
            versions: s.token_versions(),
            ..TrainSample::default()
        })
    }
}

/// Packs samples for one forward, with their routed experts when every sample has a record
/// (a position past a record routes itself), and the experts to replay when every sample has
/// them.
pub fn pack(samples: &[TrainSample]) -> miles_model::Result<PackedBatch> {
    let seqs: Vec<(Vec<u32>, usize)> =
        samples.iter().map(|s| (s.tokens.clone(), s.prompt_len)).collect();
    let mut batch = PackedBatch::new(&seqs)?;
    let records: Option<Vec<&RoutedExperts>> =
        samples.iter().map(|s| s.routed_experts.as_ref()).collect();
    if let Some(records) = records.filter(|r| !r.is_empty()) {
        let (layers, top_k) = (records[0].num_layers, records[0].top_k);
        let row = layers * top_k;
        let mut ids = Vec::with_capacity(batch.tokens.len() * row);
        for (s, r) in samples.iter().zip(&records) {
            if (r.num_layers, r.top_k) != (layers, top_k) || row == 0 {
                return Err(miles_model::Error::Invalid(format!(
                    "routed experts of {} layers × top-{} beside {layers} × top-{top_k}",
                    r.num_layers, r.top_k
                )));
            }
            let recorded = (r.ids.len() / row).min(s.tokens.len());
            ids.extend(r.ids[..recorded * row].iter().map(|&e| u32::from(e)));
            ids.resize(ids.len() + (s.tokens.len() - recorded) * row, OWN_CHOICE);
        }
        let replay: Option<Vec<u32>> = samples
            .iter()
            .map(|s| s.replay_experts.as_deref())
            .collect::<Option<Vec<&[u32]>>>()
            .map(|parts| parts.concat());
        if replay.as_ref().is_some_and(|r| r.len() != ids.len()) {
            return Err(miles_model::Error::Invalid(
                "the experts to replay do not cover the packed tokens".into(),
            ));
        }
        batch.routed = Some(RoutedBatch { layers, top_k, ids, replay });
    }
    Ok(batch)
}

/// Each sample's response logprobs as `score` gives them for packed batches of `chunk`
/// samples (any model, any device).
pub fn logprobs_by(
    samples: &[TrainSample],
    chunk: usize,
    mut score: impl FnMut(&PackedBatch) -> miles_model::Result<Vec<f32>>,
) -> miles_model::Result<Vec<Vec<f32>>> {
    let mut out = Vec::with_capacity(samples.len());
    for part in samples.chunks(chunk.max(1)) {
        let logp = score(&pack(part)?)?;
        let mut at = 0;
        for s in part {
            out.push(logp[at..at + s.response_len()].to_vec());
            at += s.response_len();
        }
    }
    Ok(out)
}

/// Runs the estimator over the samples' groups (consecutive samples of one `group`) and stores
/// each sample's per-token advantages, whitened over the batch with `normalize`
/// (`--normalize-advantages`). `shaping_kl` (with `--kl-coef` > 0) hands it the KL between the
/// old and the reference logprobs per token, by `--kl-loss-type`'s estimator, as slime shapes
/// REINFORCE++ rewards. Whitening (the estimator's own, and `normalize`'s) is over the whole
/// batch: `batch_sum` adds the other processes' parts to this one's sums (one process: none).
pub fn compute_advantages(
    estimator: &dyn Advantage,
    samples: &mut [TrainSample],
    shaping_kl: Option<KlLossType>,
    normalize: bool,
    batch_sum: &mut dyn FnMut(&mut [f64]) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let kl: Vec<Option<Vec<f32>>> = samples
        .iter()
        .map(|s| {
            let (kind, r) = (shaping_kl?, s.ref_logp.as_ref()?);
            Some(s.old_logp.iter().zip(r).map(|(&o, &r)| approx_kl(kind, o, r).0).collect())
        })
        .collect();
    let mut groups: Vec<Vec<SequenceScore>> = Vec::new();
    for (i, s) in samples.iter().enumerate() {
        let score = SequenceScore {
            reward: s.reward,
            loss_mask: &s.loss_mask,
            kl: kl[i].as_deref(),
            values: None,
        };
        match groups.last_mut() {
            Some(g) if i > 0 && samples[i - 1].group == s.group => g.push(score),
            _ => groups.push(vec![score]),
        }
    }
    let whitens = estimator.whitens_batch();
    let out = estimator.compute_unwhitened(&groups)?;
    let flat: Vec<Vec<f32>> = out.advantages.into_iter().flatten().collect();
    if flat.len() != samples.len() {
        anyhow::bail!(miles_core::Error::Invalid(format!(
            "the advantage estimator returned {} sequences for {} samples",
            flat.len(),
            samples.len()
        )));
    }
    for (s, a) in samples.iter_mut().zip(flat) {
        if a.len() != s.response_len() {
            anyhow::bail!(miles_core::Error::Invalid(format!(
                "the advantage estimator returned {} advantages for a response of {} tokens",
                a.len(),
                s.response_len()
            )));
        }
        s.advantages = a;
    }
    // One whitening: the estimator's own, or `normalize`'s. slime's REINFORCE++ estimators
    // leave it to --normalize-advantages (which slime requires for them); a second pass is not
    // a no-op: it drops the variance epsilon and blows a batch of (almost) equal rewards up to
    // unit variance.
    if whitens || normalize {
        let rows = samples.iter().map(|s| (s.advantages.as_slice(), s.loss_mask.as_slice()));
        let stats = MaskedStats::over(rows, batch_sum)?;
        for s in samples.iter_mut() {
            stats.apply(&mut s.advantages, &s.loss_mask);
        }
    }
    Ok(())
}

/// How per-token values of the batch aggregate into one figure: like the loss, over the loss
/// masks (`per_token`: `--calculate-per-token-loss`).
pub fn aggregation(samples: &[TrainSample], per_token: bool) -> Aggregation {
    let mask = concat(samples, |s| &s.loss_mask);
    let lengths: Vec<usize> = samples.iter().map(TrainSample::response_len).collect();
    Aggregation::new(&mask, &lengths, per_token)
}

/// What [`aggregation`]'s mean is over: kept tokens (at least one a sequence) per token, else
/// sequences; the weight of these samples' mean in a mean over several processes' samples.
pub fn aggregation_weight(samples: &[TrainSample], per_token: bool) -> f64 {
    if per_token {
        samples.iter().map(TrainSample::denominator).sum::<usize>() as f64
    } else {
        samples.len() as f64
    }
}

/// TIS/MIS: stores each sample's correction weights and numerator mask, from its old
/// (trainer) against its rollout logprobs, and returns the correction's metrics aggregated
/// like the loss.
pub fn apply_correction(
    corr: &dyn Correction,
    samples: &mut [TrainSample],
    per_token: bool,
    batch_sum: &mut dyn FnMut(&mut [f64]) -> miles_core::Result<()>,
) -> miles_core::Result<BTreeMap<String, f64>> {
    let train = concat(samples, |s| &s.old_logp);
    let rollout = concat(samples, |s| &s.rollout_logp);
    let mask = concat(samples, |s| &s.loss_mask);
    let lengths: Vec<usize> = samples.iter().map(TrainSample::response_len).collect();
    let input = CorrectionInput {
        train_log_probs: &train,
        rollout_log_probs: &rollout,
        loss_mask: &mask,
        response_lengths: &lengths,
    };
    let out = corr.correct_part(&input, batch_sum)?;
    let mut at = 0;
    for s in samples.iter_mut() {
        let n = s.response_len();
        s.correction_weights = Some(out.weights[at..at + n].to_vec());
        s.correction_mask = Some(out.loss_mask[at..at + n].to_vec());
        at += n;
    }
    if let Some((name, sums)) = out.metrics.iter().find(|(_, sums)| sums.len() != samples.len()) {
        return Err(miles_core::Error::Invalid(format!(
            "the correction's metric {name} has {} values for {} sequences",
            sums.len(),
            samples.len()
        )));
    }
    let agg = aggregation(samples, per_token);
    Ok(out.metrics.into_iter().map(|(k, sums)| (k, agg.of_sequence_sums(&sums))).collect())
}

/// The names of the metrics `corr` reports, from a one-token sequence of ratio 1 (a
/// correction's names depend on its configuration, not on the batch).
pub fn correction_metric_names(
    corr: &dyn Correction,
) -> miles_core::Result<impl Iterator<Item = String>> {
    let out = corr.correct(&CorrectionInput {
        train_log_probs: &[0.0],
        rollout_log_probs: &[0.0],
        loss_mask: &[1],
        response_lengths: &[1],
    })?;
    Ok(out.metrics.into_keys())
}

/// slime's `train_rollout_logprob_abs_diff`: |trainer − rollout| per token, aggregated like the
/// loss over the tokens the correction kept (as slime's reducer does after TIS).
pub fn rollout_logprob_abs_diff(
    samples: &[TrainSample],
    trainer: &[Vec<f32>],
    per_token: bool,
) -> f64 {
    let diff: Vec<f64> = samples
        .iter()
        .zip(trainer)
        .flat_map(|(s, t)| {
            let kept = s.correction_mask.as_deref();
            t.iter().zip(&s.rollout_logp).enumerate().map(move |(i, (a, b))| {
                if kept.is_some_and(|m| m[i] == 0) { 0.0 } else { f64::from((a - b).abs()) }
            })
        })
        .collect();
    aggregation(samples, per_token).of(&diff)
}

/// With responses from older policies (partial rollout), `record`'s per-staleness logprob
/// gaps: for each number of versions k between a token's policy and the trainer's `version`,
/// `train/train_rollout_logprob_abs_diff/stale_k`, the mean |trainer − rollout| over those
/// tokens (0 exactly for k = 0, the trainer's own tokens); nothing when every token is the
/// trainer's.
pub fn record_gap_by_staleness(
    record: &mut serde_json::Map<String, serde_json::Value>,
    samples: &[TrainSample],
    trainer: &[Vec<f32>],
    version: u64,
) {
    let mut by: std::collections::BTreeMap<u64, (f64, usize)> = Default::default();
    for (s, t) in samples.iter().zip(trainer) {
        for ((a, b), v) in t.iter().zip(&s.rollout_logp).zip(&s.versions) {
            let e = by.entry(version.saturating_sub(*v)).or_default();
            *e = (e.0 + f64::from((a - b).abs()), e.1 + 1);
        }
    }
    if by.keys().all(|&k| k == 0) {
        return;
    }
    for (k, (sum, n)) in by {
        let key = format!("train/train_rollout_logprob_abs_diff/stale_{k}");
        record.insert(key, serde_json::json!(sum / n as f64));
    }
}

/// Concatenates one per-token slice of every sample.
pub fn concat<T: Copy>(samples: &[TrainSample], field: impl Fn(&TrainSample) -> &[T]) -> Vec<T> {
    samples.iter().flat_map(|s| field(s).iter().copied()).collect()
}

/// Splits `n` items into `parts` contiguous ranges of near-equal size (none empty if n ≥ parts).
pub fn split_ranges(n: usize, parts: usize) -> Vec<std::ops::Range<usize>> {
    let parts = parts.clamp(1, n.max(1));
    (0..parts).map(|i| i * n / parts..(i + 1) * n / parts).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    use std::sync::Mutex;

    use miles_core::AdvantageOutput;

    /// An estimator that records the KL it is handed and returns zeros.
    #[derive(Default)]
    struct RecordKl(Mutex<Vec<Option<Vec<f32>>>>);

    impl Advantage for RecordKl {
        fn compute(
            &self,
            groups: &[Vec<SequenceScore<'_>>],
        ) -> miles_core::Result<AdvantageOutput> {
            let mut seen = self.0.lock().unwrap();
            let advantages = groups
                .iter()
                .map(|g| {
                    g.iter()
                        .map(|s| {
                            seen.push(s.kl.map(<[f32]>::to_vec));
                            vec![0.0; s.loss_mask.len()]
                        })
                        .collect()
                })
                .collect();
            Ok(AdvantageOutput { advantages, returns: None })
        }
    }

    /// `len` samples in groups of 4 with varied rewards and loss masks.
    fn scored(len: usize) -> Vec<TrainSample> {
        (0..len)
            .map(|i| {
                let n = 3 + i % 5;
                TrainSample {
                    group: i / 4,
                    tokens: vec![1; 2 + n],
                    prompt_len: 2,
                    reward: ((i * 37) % 11) as f32 * 0.1,
                    loss_mask: (0..n).map(|t| u8::from((t + i) % 4 != 0)).collect(),
                    rollout_logp: vec![-1.0; n],
                    old_logp: vec![-1.0; n],
                    ..TrainSample::default()
                }
            })
            .collect()
    }

    /// Whitening over the batch (REINFORCE++'s own, then `--normalize-advantages`): in one
    /// process the bits of the estimator's `compute` and of whitening the whole batch; over two
    /// processes, whose sums go through the hook, the same figures up to the order of the sums.
    #[test]
    fn batch_whitening_spans_every_process() {
        let rpp = crate::advantage::ReinforcePlusPlusBaseline {
            kl_coef: 0.0,
            rewards_normalization: true,
        };
        let whole = |normalize: bool| {
            let mut samples = scored(16);
            compute_advantages(&rpp, &mut samples, None, normalize, &mut |_| Ok(())).unwrap();
            samples.into_iter().map(|s| s.advantages).collect::<Vec<_>>()
        };
        // One process, no normalize: exactly the estimator's own output.
        let samples = scored(16);
        let scores: Vec<Vec<SequenceScore>> = samples
            .chunks(4)
            .map(|g| {
                g.iter()
                    .map(|s| SequenceScore {
                        reward: s.reward,
                        loss_mask: &s.loss_mask,
                        kl: None,
                        values: None,
                    })
                    .collect()
            })
            .collect();
        let own: Vec<Vec<f32>> = rpp.compute(&scores).unwrap().advantages.concat();
        assert_eq!(whole(false), own);
        // Two processes of 8 samples (2 groups) each; the hook sums rank 0's part then rank 1's.
        for normalize in [false, true] {
            let (to_0, from_1) = std::sync::mpsc::channel::<Vec<f64>>();
            let (to_1, from_0) = std::sync::mpsc::channel::<Vec<f64>>();
            let rank = |r: usize,
                        send: std::sync::mpsc::Sender<Vec<f64>>,
                        recv: std::sync::mpsc::Receiver<Vec<f64>>| {
                move || {
                    let mut part = scored(16).split_off(8 * r);
                    part.truncate(8);
                    let mut hook = |sums: &mut [f64]| {
                        send.send(sums.to_vec())?;
                        let theirs = recv.recv()?;
                        // (Two terms: either order is rank order.)
                        for (s, t) in sums.iter_mut().zip(theirs) {
                            *s += t;
                        }
                        Ok(())
                    };
                    compute_advantages(&rpp, &mut part, None, normalize, &mut hook).unwrap();
                    part.into_iter().map(|s| s.advantages).collect::<Vec<_>>()
                }
            };
            let a = std::thread::spawn(rank(0, to_1, from_1));
            let b = std::thread::spawn(rank(1, to_0, from_0));
            let two = [a.join().unwrap(), b.join().unwrap()].concat();
            let one = whole(normalize);
            for (x, y) in two.iter().flatten().zip(one.iter().flatten()) {
                assert!((x - y).abs() <= 1e-6 * (1.0 + y.abs()), "{x} vs {y}");
            }
            assert!(one.iter().flatten().any(|&x| x.abs() > 0.5), "whitened, not all zeros");
        }
    }

    /// Regression: REINFORCE++ with --normalize-advantages whitened twice, the second pass
    /// dropping slime's variance epsilon: one group of rewards {0, 0.001}, one token each, gives
    /// slime's ±0.700140 (not ±0.707107), with or without the flag.
    #[test]
    fn reinforce_plus_plus_whitens_once_with_normalize_advantages() {
        let rpp = crate::advantage::ReinforcePlusPlus { gamma: 1.0, kl_coef: 0.0 };
        for normalize in [false, true] {
            let mut samples = scored(2);
            for (s, r) in samples.iter_mut().zip([0.0, 0.001]) {
                (s.tokens, s.loss_mask, s.reward) = (vec![1, 1, 1], vec![1], r);
                (s.rollout_logp, s.old_logp) = (vec![-1.0], vec![-1.0]);
            }
            compute_advantages(&rpp, &mut samples, None, normalize, &mut |_| Ok(())).unwrap();
            let a: Vec<f32> = samples.iter().map(|s| s.advantages[0]).collect();
            let slime = 0.0005 / (5e-7f64 + 1e-8).sqrt();
            assert!((f64::from(a[1]) - slime).abs() < 1e-5, "{normalize}: {a:?}");
            assert!((f64::from(a[0]) + slime).abs() < 1e-5, "{normalize}: {a:?}");
        }
    }

    /// Regression: the reward-shaping KL was old − ref (k1) whatever `--kl-loss-type` said;
    /// slime shapes with the chosen estimator.
    #[test]
    fn reward_shaping_kl_follows_the_kl_loss_type() {
        let sample = TrainSample {
            group: 0,
            tokens: vec![1, 2, 3],
            prompt_len: 1,
            reward: 1.0,
            loss_mask: vec![1, 1],
            rollout_logp: vec![-1.0, -2.0],
            old_logp: vec![-1.0, -2.0],
            ref_logp: Some(vec![-1.5, -1.0]),
            ..TrainSample::default()
        };
        for kind in [KlLossType::K1, KlLossType::K2, KlLossType::K3, KlLossType::LowVarKl] {
            let estimator = RecordKl::default();
            let mut samples = vec![sample.clone()];
            compute_advantages(&estimator, &mut samples, Some(kind), false, &mut |_| Ok(()))
                .unwrap();
            let expected: Vec<f32> = [(-1.0, -1.5), (-2.0, -1.0)]
                .iter()
                .map(|&(o, r)| approx_kl(kind, o, r).0)
                .collect();
            assert_eq!(estimator.0.lock().unwrap()[0], Some(expected), "{kind:?}");
        }
        // k3 of old − ref = 0.5: e^−0.5 − 1 + 0.5, not 0.5.
        let estimator = RecordKl::default();
        compute_advantages(
            &estimator,
            &mut [sample.clone()],
            Some(KlLossType::K3),
            false,
            &mut |_| Ok(()),
        )
        .unwrap();
        let k3 = estimator.0.lock().unwrap()[0].clone().unwrap()[0];
        assert!((f64::from(k3) - ((-0.5f64).exp() - 0.5)).abs() < 1e-6, "{k3}");
        // Without --kl-coef the estimator gets no KL.
        let estimator = RecordKl::default();
        compute_advantages(&estimator, &mut [sample], None, false, &mut |_| Ok(())).unwrap();
        assert_eq!(estimator.0.lock().unwrap()[0], None);
    }

    #[test]
    fn split_ranges_cover_everything_once() {
        assert_eq!(split_ranges(10, 3), vec![0..3, 3..6, 6..10]);
        assert_eq!(split_ranges(2, 4), vec![0..1, 1..2]);
        assert_eq!(split_ranges(0, 2), vec![0..0]);
    }
}
