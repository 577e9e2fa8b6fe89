//! Every CPU op at the sizes of a SmolLM2-135M training step (4 sequences × 256 tokens): the
//! reference implementations that the CUDA kernels are checked against, timed.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use miles_tensor::cpu::{self, AdamW, AttentionShape, Transpose};
use miles_tensor::rng::Rng;

const TOKENS: usize = 1024;
const HIDDEN: usize = 576;
const INTER: usize = 1536;
const VOCAB: usize = 49_152;

fn matmul(c: &mut Criterion) {
    let mut rng = Rng::new(1);
    let mut g = c.benchmark_group("matmul");
    // The MLP's up projection forward, and the weight gradient of the same layer.
    let (m, k, n) = (TOKENS, HIDDEN, INTER);
    let (x, w) = (rng.vec(m * k, 1.0), rng.vec(n * k, 0.02));
    let mut y = vec![0.0; m * n];
    g.throughput(Throughput::Elements((2 * m * k * n) as u64));
    g.bench_function("x_wT_1024x576x1536", |b| {
        b.iter(|| {
            cpu::matmul(&mut y, &x, Transpose::No, &w, Transpose::Yes, m, k, n, false).unwrap()
        })
    });
    let dy = rng.vec(m * n, 1.0);
    let mut dw = vec![0.0; n * k];
    g.bench_function("dyT_x_1536x1024x576", |b| {
        b.iter(|| {
            cpu::matmul(&mut dw, &dy, Transpose::Yes, &x, Transpose::No, n, m, k, true).unwrap()
        })
    });
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut rng = Rng::new(2);
    let s = AttentionShape::new(9, 3, 64);
    let cu: Vec<usize> = (0..=4).map(|i| i * 256).collect();
    let q = rng.vec(TOKENS * 9 * 64, 1.0);
    let (k, v) = (rng.vec(TOKENS * 3 * 64, 1.0), rng.vec(TOKENS * 3 * 64, 1.0));
    let mut out = vec![0.0; q.len()];
    let mut lse = vec![0.0; TOKENS * 9];
    let mut g = c.benchmark_group("attention_4x256_h9_kv3_d64");
    g.bench_function("forward", |b| {
        b.iter(|| cpu::attention_forward(&mut out, &mut lse, &q, &k, &v, &cu, s).unwrap())
    });
    let d_out = rng.vec(q.len(), 1.0);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    g.bench_function("backward", |b| {
        b.iter(|| {
            cpu::attention_backward(
                &mut dq, &mut dk, &mut dv, &d_out, &q, &k, &v, &out, &lse, &cu, s,
            )
            .unwrap()
        })
    });
    g.finish();
}

fn rowwise(c: &mut Criterion) {
    let mut rng = Rng::new(3);
    let mut g = c.benchmark_group("rowwise_1024x576");
    let x = rng.vec(TOKENS * HIDDEN, 1.0);
    let w = rng.vec(HIDDEN, 1.0);
    let (mut y, mut rstd) = (vec![0.0; x.len()], vec![0.0; TOKENS]);
    g.throughput(Throughput::Elements(x.len() as u64));
    g.bench_function("rmsnorm_forward", |b| {
        b.iter(|| cpu::rmsnorm_forward(&mut y, &mut rstd, &x, &w, 1e-5).unwrap())
    });
    let (mut dx, mut dw) = (vec![0.0; x.len()], vec![0.0; HIDDEN]);
    g.bench_function("rmsnorm_backward", |b| {
        b.iter(|| cpu::rmsnorm_backward(&mut dx, &mut dw, &y, &x, &w, &rstd).unwrap())
    });
    let positions: Vec<u32> = (0..TOKENS as u32).map(|t| t % 256).collect();
    let (cos, sin) = cpu::rope_tables(&positions, &cpu::rope_inv_freq(64, 1e5), 1.0);
    let mut qv = rng.vec(TOKENS * 9 * 64, 1.0);
    g.bench_function("rope_forward_h9_d64", |b| {
        b.iter(|| cpu::rope_forward(&mut qv, &cos, &sin, 9, 64).unwrap())
    });
    g.bench_function("rope_backward_h9_d64", |b| {
        b.iter(|| cpu::rope_backward(&mut qv, &cos, &sin, 9, 64).unwrap())
    });
    let gate = rng.vec(TOKENS * INTER, 1.0);
    let up = rng.vec(TOKENS * INTER, 1.0);
    let mut h = vec![0.0; gate.len()];
    g.bench_function("swiglu_forward_x1536", |b| {
        b.iter(|| cpu::swiglu_forward(&mut h, &gate, &up).unwrap())
    });
    let (mut d_gate, mut d_up) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
    g.bench_function("swiglu_backward_x1536", |b| {
        b.iter(|| cpu::swiglu_backward(&mut d_gate, &mut d_up, &h, &gate, &up).unwrap())
    });
    let table = rng.vec(VOCAB * HIDDEN, 0.02);
    let ids: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB) as u32).collect();
    g.bench_function("embedding_forward", |b| {
        b.iter(|| cpu::embedding_forward(&mut y, &table, &ids, HIDDEN).unwrap())
    });
    let mut d_table = vec![0.0; table.len()];
    g.bench_function("embedding_backward", |b| {
        b.iter(|| cpu::embedding_backward(&mut d_table, &y, &ids, HIDDEN).unwrap())
    });
    g.finish();
}

fn head_and_optimizer(c: &mut Criterion) {
    let mut rng = Rng::new(4);
    let rows = 255;
    let hidden = rng.vec(rows * HIDDEN, 1.0);
    let weight = rng.vec(VOCAB * HIDDEN, 0.02);
    let targets: Vec<u32> = (0..rows).map(|_| rng.below(VOCAB) as u32).collect();
    let (mut lp, mut ent) = (vec![0.0; rows], vec![0.0; rows]);
    let head = cpu::PackedLinear::new(&weight, VOCAB, HIDDEN).unwrap();
    let mut g = c.benchmark_group("logprob_255_rows_vocab_49152");
    g.sample_size(10);
    g.bench_function("forward", |b| {
        b.iter(|| cpu::logprob_forward(&mut lp, &mut ent, &hidden, &head, &targets, 1.0).unwrap())
    });
    let (d_lp, d_ent) = (rng.vec(rows, 1.0), rng.vec(rows, 1.0));
    let (mut dh, mut dw) = (vec![0.0; hidden.len()], vec![0.0; weight.len()]);
    g.bench_function("backward", |b| {
        b.iter(|| {
            cpu::logprob_backward(&mut dh, &mut dw, &d_lp, &d_ent, &hidden, &weight, &targets, 1.0)
                .unwrap()
        })
    });
    g.finish();

    let n = 1 << 20;
    let (mut p, grad) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
    let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
    let opt = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01 };
    let mut g = c.benchmark_group("adamw");
    g.throughput(Throughput::Elements(n as u64));
    g.bench_function("1M_params", |b| {
        b.iter(|| opt.step(&mut p, &grad, &mut m, &mut v, 3).unwrap())
    });
    g.finish();
}

criterion_group!(benches, matmul, attention, rowwise, head_and_optimizer);
criterion_main!(benches);
