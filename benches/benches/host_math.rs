//! Host-math paths of one RL step: the TIS/MIS correction over a training batch, and the JSON
//! (de)serialization of samples that `miles generate` and `miles reward` stream.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use miles_benches::{LogprobBatch, Rng};
use miles_core::config::{TisLevel, TisMode};
use miles_core::{Correction, CorrectionInput, Prompt, Sample, Status};
use miles_plugin_tis::{Tis, TisConfig};

fn tis(c: &mut Criterion) {
    let mut group = c.benchmark_group("tis_correct");
    // 64×512 is a small GRPO batch; 256×2048 a realistic one (8 prompts × 32 samples).
    for (sequences, len) in [(64, 512), (256, 2048)] {
        let batch = LogprobBatch::new(sequences, len, 7);
        let input = CorrectionInput {
            train_log_probs: &batch.train,
            rollout_log_probs: &batch.rollout,
            loss_mask: &batch.mask,
            response_lengths: &batch.lengths,
        };
        group.throughput(Throughput::Elements((sequences * len) as u64));
        let cases = [
            ("token_truncate", TisLevel::Token, TisMode::Truncate, None),
            ("sequence_mask", TisLevel::Sequence, TisMode::Mask, None),
            ("geometric_clip_rs_veto", TisLevel::Geometric, TisMode::Clip, Some(1e-4)),
        ];
        for (name, level, mode, rs_veto_threshold) in cases {
            let use_rs = rs_veto_threshold.is_some();
            let lower = Some(0.5);
            let config =
                TisConfig { level, mode, use_rs, rs_veto_threshold, lower, ..TisConfig::default() };
            let tis = Tis::new(config).expect("valid config");
            let id = BenchmarkId::new(name, format!("{sequences}x{len}"));
            group.bench_with_input(id, &input, |b, input| b.iter(|| tis.correct(input).unwrap()));
        }
    }
    group.finish();
}

fn sample_json(c: &mut Criterion) {
    let mut rng = Rng::new(11);
    let response_length = 1024;
    let sample = Sample {
        prompt: Prompt::Text("Natalia sold clips to 48 of her friends in April. How many?".into()),
        tokens: (0..1280).map(|_| (rng.next_u64() % 151_936) as u32).collect(),
        response: "step ".repeat(response_length),
        response_length,
        label: Some("72".into()),
        loss_mask: vec![1; response_length],
        status: Status::Completed,
        rollout_log_probs: (0..response_length).map(|_| rng.uniform(-8.0, 0.0)).collect(),
        ..Default::default()
    };
    let line = serde_json::to_string(&sample).unwrap();
    let mut group = c.benchmark_group("sample_json");
    group.throughput(Throughput::Bytes(line.len() as u64));
    group.bench_function("serialize_1k_tokens", |b| {
        b.iter(|| serde_json::to_string(&sample).unwrap())
    });
    group.bench_function("parse_1k_tokens", |b| {
        b.iter(|| serde_json::from_str::<Sample>(&line).unwrap())
    });
    group.finish();
}

criterion_group!(benches, tis, sample_json);
criterion_main!(benches);
