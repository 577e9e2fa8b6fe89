//! The batch-invariant linear forward (`cpu::linear_forward`) beside gemm (`cpu::matmul` with
//! `Wᵀ`) at the shapes of SmolLM2-135M: decode (1–8 rows, the weight read is the cost) to
//! prefill (64–1024 rows, compute bound), and the LM head. Throughput is in FLOP (2 per
//! multiply-add), so criterion's "elem/s" reads as FLOP/s.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use miles_tensor::cpu::{self, PackedLinear, Transpose};
use miles_tensor::rng::Rng;
use std::time::Duration;

const HIDDEN: usize = 576;
const INTER: usize = 1536;
const VOCAB: usize = 49_152;

fn bench_shape(c: &mut Criterion, rows: usize, d_in: usize, d_out: usize) {
    let mut rng = Rng::new((rows * 31 + d_in * 7 + d_out) as u64);
    let x = rng.vec(rows * d_in, 1.0);
    let w = rng.vec(d_out * d_in, 0.02);
    let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
    let mut y = vec![0.0; rows * d_out];
    let mut g = c.benchmark_group(format!("linear_{rows}x{d_in}to{d_out}"));
    g.throughput(Throughput::Elements((2 * rows * d_in * d_out) as u64));
    g.bench_function("linear_forward", |b| {
        b.iter(|| cpu::linear_forward(&mut y, &x, &packed).unwrap())
    });
    g.bench_function("gemm", |b| {
        b.iter(|| {
            cpu::matmul(&mut y, &x, Transpose::No, &w, Transpose::Yes, rows, d_in, d_out, false)
                .unwrap()
        })
    });
    g.finish();
}

fn layers(c: &mut Criterion) {
    for (d_in, d_out) in [(HIDDEN, INTER), (INTER, HIDDEN), (HIDDEN, HIDDEN)] {
        for rows in [1, 8, 64, 1024] {
            bench_shape(c, rows, d_in, d_out);
        }
    }
}

fn lm_head(c: &mut Criterion) {
    for rows in [1, 16, 256] {
        bench_shape(c, rows, HIDDEN, VOCAB);
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3));
    targets = layers, lm_head
}
criterion_main!(benches);
