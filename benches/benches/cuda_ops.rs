//! Every CUDA op at the sizes of a Qwen3-0.6B training step (32 sequences × 512 tokens, bf16),
//! timed with CUDA events around the launches. Throughput is FLOP/s for the products and
//! attention ("elements" = FLOP) and bytes moved for the rest, to set beside the H200's
//! measured ceilings (bf16 GEMM ≈ 790 TFLOP/s, copy ≈ 4.3 TB/s). Needs a GPU:
//!   cargo bench -p miles-benches --features cuda --bench cuda_ops

use std::time::Duration;

use criterion::measurement::WallTime;
use criterion::{BenchmarkGroup, Criterion, Throughput, criterion_group, criterion_main};
use miles_tensor::cpu::{AdamW, AttentionShape, Transpose};
use miles_tensor::ops::{self, AdamWTensors};
use miles_tensor::rng::Rng;
use miles_tensor::{DType, Device, GemmRoute, Tensor, set_gemm_route};

const DEVICE: Device = Device::Cuda(0);
const SEQS: usize = 32;
const SEQ_LEN: usize = 512;
const TOKENS: usize = SEQS * SEQ_LEN;
const HIDDEN: usize = 1024;
const INTER: usize = 3072;
const VOCAB: usize = 151_936;
const HEAD_ROWS: usize = 1024;
/// Qwen3-0.6B's attention.
fn shape() -> AttentionShape {
    AttentionShape::new(16, 8, 128)
}

fn random(rng: &mut Rng, shape: &[usize], scale: f32, dtype: DType) -> Tensor {
    let data = rng.vec(shape.iter().product(), scale);
    Tensor::from_f32(shape, data, &DEVICE).and_then(|t| t.to_dtype(dtype)).expect("on the GPU")
}

/// Times `f` with CUDA events, criterion choosing the iteration counts.
fn on_device(g: &mut BenchmarkGroup<WallTime>, name: &str, mut f: impl FnMut()) {
    g.bench_function(name, |b| {
        b.iter_custom(|iters| {
            DEVICE
                .time(iters, || {
                    f();
                    Ok(())
                })
                .expect("timed on the GPU")
        })
    });
}

fn group<'a>(c: &'a mut Criterion, name: &str) -> BenchmarkGroup<'a, WallTime> {
    let mut g = c.benchmark_group(name);
    g.sample_size(10).warm_up_time(Duration::from_millis(300));
    g.measurement_time(Duration::from_secs(1));
    g
}

fn matmul(c: &mut Criterion) {
    let mut rng = Rng::new(1);
    let x = random(&mut rng, &[TOKENS, HIDDEN], 1.0, DType::BF16);
    let w = random(&mut rng, &[INTER, HIDDEN], 0.02, DType::BF16);
    let dy = random(&mut rng, &[TOKENS, INTER], 1.0, DType::BF16);
    let mut dw = Tensor::zeros(&[INTER, HIDDEN], DType::F32, &DEVICE).expect("on the GPU");
    let head_x = random(&mut rng, &[HEAD_ROWS, HIDDEN], 1.0, DType::BF16);
    let head_w = random(&mut rng, &[VOCAB, HIDDEN], 0.02, DType::BF16);
    for (route, label) in [(GemmRoute::Invariant, "invariant"), (GemmRoute::Cublas, "cublas")] {
        set_gemm_route(route);
        let mut g = group(c, &format!("matmul_bf16_{label}"));
        g.throughput(Throughput::Elements((2 * TOKENS * HIDDEN * INTER) as u64));
        on_device(&mut g, "x_wT_16384x1024x3072", || {
            ops::matmul(&x, Transpose::No, &w, Transpose::Yes).expect("matmul");
        });
        on_device(&mut g, "dy_w_16384x3072x1024", || {
            ops::matmul(&dy, Transpose::No, &w, Transpose::No).expect("matmul");
        });
        on_device(&mut g, "dw_acc_dyT_x_3072x16384x1024", || {
            ops::matmul_acc(&mut dw, &dy, Transpose::Yes, &x, Transpose::No).expect("matmul");
        });
        g.throughput(Throughput::Elements((2 * HEAD_ROWS * HIDDEN * VOCAB) as u64));
        on_device(&mut g, "lm_head_f32_out_1024x1024x151936", || {
            ops::matmul_f32_out(&head_x, Transpose::No, &head_w, Transpose::Yes).expect("matmul");
        });
        g.finish();
    }
    set_gemm_route(GemmRoute::Invariant);
}

/// The W4A16 product (`ops::int4_linear`, INT4 QAT's packed weights in groups of 128) beside
/// the bf16 product of the same shape: a Qwen3-8B layer's decode products (q/o 4096 × 4096,
/// gate and up stacked 4096 → 24576, down 12288 → 4096) at 1, 16 and 64 rows.
fn int4(c: &mut Criterion) {
    let mut rng = Rng::new(6);
    for (k, n) in [(4096, 4096), (4096, 24576), (12288, 4096)] {
        let w = random(&mut rng, &[n, k], 0.02, DType::F32);
        let packed = ops::Int4Matrix::quantize(&w, 128).expect("packed");
        let w = w.to_dtype(DType::BF16).expect("bf16");
        for rows in [1, 16, 64] {
            let x = random(&mut rng, &[rows, k], 1.0, DType::BF16);
            let mut g = group(c, &format!("int4_vs_bf16_{rows}x{k}x{n}"));
            g.throughput(Throughput::Bytes((n * k / 2) as u64));
            on_device(&mut g, "int4_linear", || {
                ops::int4_linear(&x, &packed).expect("int4_linear");
            });
            on_device(&mut g, "bf16_matmul", || {
                ops::matmul(&x, Transpose::No, &w, Transpose::Yes).expect("matmul");
            });
            g.finish();
        }
    }
}

/// The FP8 blockwise product (`ops::fp8_linear`: the activations' per-token quantization
/// included) beside the bf16 product of the same shape: issue 28's train shape
/// (16384 × 4096 × 12288) and a Qwen3-8B MLP's decode shapes (1 and 64 rows).
fn fp8(c: &mut Criterion) {
    let mut rng = Rng::new(5);
    let (k, n) = (4096, 12288);
    let w = random(&mut rng, &[n, k], 0.02, DType::BF16);
    let q = ops::Fp8Matrix::quantize(&w).expect("quantized");
    for rows in [16384, 64, 1] {
        let x = random(&mut rng, &[rows, k], 1.0, DType::BF16);
        let mut g = group(c, &format!("fp8_vs_bf16_{rows}x{k}x{n}"));
        g.throughput(Throughput::Elements((2 * rows * k * n) as u64));
        on_device(&mut g, "fp8_linear", || {
            ops::fp8_linear(&x, &q).expect("fp8_linear");
        });
        on_device(&mut g, "bf16_matmul", || {
            ops::matmul(&x, Transpose::No, &w, Transpose::Yes).expect("matmul");
        });
        g.finish();
    }
    let mut g = group(c, &format!("fp8_quantize_{n}x{k}"));
    g.throughput(Throughput::Bytes((n * k * 2) as u64));
    let mut q = q;
    on_device(&mut g, "requantize_bf16_weight", || q.requantize(&w).expect("quantized"));
    g.finish();
}

/// A Qwen3-30B-A3B sparse layer's expert products (8 × 512 tokens, top-8 of 128 experts,
/// hidden 2048, expert width 768): each matrix over every expert in one grouped launch, beside
/// one pinned product per expert (the rows already gathered), as the f32 route still runs.
fn grouped(c: &mut Criterion) {
    const EXPERTS: usize = 128;
    const PICKS: usize = 4096 * 8;
    const H: usize = 2048;
    const I: usize = 768;
    let mut rng = Rng::new(6);
    let mut counts = vec![0u32; EXPERTS];
    for _ in 0..PICKS {
        counts[rng.below(EXPERTS)] += 1;
    }
    let mut offsets = vec![0u32];
    for n in &counts {
        offsets.push(offsets.last().unwrap() + n);
    }
    let tokens: Vec<u32> = (0..PICKS).map(|_| rng.below(4096) as u32).collect();
    let x = random(&mut rng, &[4096, H], 1.0, DType::BF16);
    let dy = random(&mut rng, &[PICKS, I], 1.0, DType::BF16);
    let gates: Vec<Tensor> =
        (0..EXPERTS).map(|_| random(&mut rng, &[I, H], 0.02, DType::BF16)).collect();
    let gates: Vec<&Tensor> = gates.iter().collect();
    let mut dws: Vec<Tensor> = (0..EXPERTS)
        .map(|_| Tensor::zeros(&[I, H], DType::F32, &DEVICE).expect("on the GPU"))
        .collect();
    let per_expert: Vec<Tensor> =
        counts.iter().map(|&n| random(&mut rng, &[n as usize, H], 1.0, DType::BF16)).collect();
    let mut g = group(c, "grouped_experts_bf16");
    g.throughput(Throughput::Elements((2 * PICKS * H * I) as u64));
    on_device(&mut g, "x_wT_gathered_32768x2048x768", || {
        ops::grouped_matmul(&x, Some(&tokens), &offsets, &gates, Transpose::Yes).expect("grouped");
    });
    on_device(&mut g, "dy_w_32768x768x2048", || {
        ops::grouped_matmul(&dy, None, &offsets, &gates, Transpose::No).expect("grouped");
    });
    on_device(&mut g, "dw_acc_768x32768x2048", || {
        let mut refs: Vec<&mut Tensor> = dws.iter_mut().collect();
        ops::grouped_matmul_wgrad(&mut refs, &dy, &x, Some(&tokens), &offsets).expect("grouped");
    });
    on_device(&mut g, "per_expert_x_wT_128_products", || {
        for (xe, w) in per_expert.iter().zip(&gates) {
            ops::matmul(xe, Transpose::No, w, Transpose::Yes).expect("matmul");
        }
    });
    g.finish();
}

fn attention(c: &mut Criterion) {
    let mut rng = Rng::new(2);
    let AttentionShape { q_heads, kv_heads, head_dim: d, .. } = shape();
    let cu: Vec<usize> = (0..=SEQS).map(|i| i * SEQ_LEN).collect();
    // Causal: each sequence's L(L+1)/2 query-key pairs, 2 products of 2·d FLOP each.
    let pairs = SEQS * SEQ_LEN * (SEQ_LEN + 1) / 2;
    let fwd_flop = (4 * pairs * d * q_heads) as u64;
    for dtype in [DType::BF16, DType::F32] {
        let q = random(&mut rng, &[TOKENS, q_heads * d], 1.0, dtype);
        let k = random(&mut rng, &[TOKENS, kv_heads * d], 1.0, dtype);
        let v = random(&mut rng, &[TOKENS, kv_heads * d], 1.0, dtype);
        let d_out = random(&mut rng, &[TOKENS, q_heads * d], 1.0, dtype);
        let mut g = group(c, &format!("attention_{dtype}_32x512_h16_kv8_d128"));
        g.throughput(Throughput::Elements(fwd_flop));
        on_device(&mut g, "forward", || {
            ops::attention_forward(&q, &k, &v, &cu, shape()).expect("attention");
        });
        let (out, lse) = ops::attention_forward(&q, &k, &v, &cu, shape()).expect("attention");
        // The backward's five products against the forward's two.
        g.throughput(Throughput::Elements(fwd_flop * 5 / 2));
        on_device(&mut g, "backward", || {
            ops::attention_backward(&d_out, &q, &k, &v, &out, &lse, &cu, shape())
                .expect("backward");
        });
        g.finish();
    }
}

fn rowwise(c: &mut Criterion) {
    let mut rng = Rng::new(3);
    let mut g = group(c, "rowwise_bf16_16384x1024");
    let x = random(&mut rng, &[TOKENS, HIDDEN], 1.0, DType::BF16);
    let w = random(&mut rng, &[HIDDEN], 1.0, DType::F32);
    let bytes = (TOKENS * HIDDEN * 2) as u64;
    // Read x, write y.
    g.throughput(Throughput::Bytes(2 * bytes));
    on_device(&mut g, "rmsnorm_forward", || {
        ops::rmsnorm_forward(&x, &w, 1e-6).expect("rmsnorm");
    });
    let (y, rstd) = ops::rmsnorm_forward(&x, &w, 1e-6).expect("rmsnorm");
    // Read dy and x, write dx.
    g.throughput(Throughput::Bytes(3 * bytes));
    on_device(&mut g, "rmsnorm_backward", || {
        ops::rmsnorm_backward(&y, &x, &w, &rstd).expect("rmsnorm");
    });
    on_device(&mut g, "add", || {
        ops::add(&x, &y).expect("add");
    });
    let ids: Vec<u32> = (0..TOKENS).map(|_| rng.below(VOCAB) as u32).collect();
    let table = random(&mut rng, &[VOCAB, HIDDEN], 0.02, DType::BF16);
    g.throughput(Throughput::Bytes(2 * bytes));
    on_device(&mut g, "embedding_forward", || {
        ops::embedding_forward(&table, &ids).expect("embedding");
    });
    // Read a and b, write the sum and y.
    g.throughput(Throughput::Bytes(4 * bytes));
    on_device(&mut g, "add_rmsnorm", || {
        ops::add_rmsnorm(&x, &y, &w, 1e-6).expect("add_rmsnorm");
    });
    // Read the rows' gradients, write the touched table rows (f32).
    g.throughput(Throughput::Bytes(3 * bytes));
    on_device(&mut g, "embedding_backward", || {
        ops::embedding_backward(&x, &ids, VOCAB).expect("embedding_backward");
    });
    let rows: Vec<u32> = (0..TOKENS as u32).rev().step_by(2).collect();
    g.throughput(Throughput::Bytes(bytes));
    on_device(&mut g, "gather_rows_half", || {
        ops::gather_rows(&x, &rows).expect("gather");
    });
    let half = ops::gather_rows(&x, &rows).expect("gather");
    let mut dst = random(&mut rng, &[TOKENS, HIDDEN], 1.0, DType::BF16);
    on_device(&mut g, "scatter_rows_half", || {
        ops::scatter_rows(&mut dst, &half, &rows).expect("scatter");
    });
    g.throughput(Throughput::Bytes(2 * bytes));
    on_device(&mut g, "concat_rows", || {
        ops::concat_rows(&[&half, &half]).expect("concat");
    });
    on_device(&mut g, "copy_rows_within_half", || {
        ops::copy_rows_within(&mut dst, 0, TOKENS / 2, TOKENS / 2).expect("copy");
    });
    let picks: Vec<u32> = (0..2 * TOKENS as u32).map(|i| (i * 7919) % TOKENS as u32).collect();
    let weights = rng.vec(2 * TOKENS, 0.5);
    // Two rows read and one written per token (a top-2 combine).
    g.throughput(Throughput::Bytes(3 * bytes));
    on_device(&mut g, "pick_rows_sum_k2", || {
        ops::pick_rows_sum(&x, &picks, &weights, 2).expect("pick_rows_sum");
    });
    on_device(&mut g, "pick_row_dots_k2", || {
        ops::pick_row_dots(&x, &y, &picks, 2).expect("pick_row_dots");
    });
    let x32 = random(&mut rng, &[TOKENS, HIDDEN], 1.0, DType::F32);
    // Read f32, write bf16.
    g.throughput(Throughput::Bytes(3 * bytes));
    on_device(&mut g, "convert_f32_to_bf16", || {
        x32.to_dtype(DType::BF16).expect("convert");
    });
    g.finish();

    let mut g = group(c, "rope_bf16_16384x16x128");
    let q = random(&mut rng, &[TOKENS, shape().q_heads, shape().head_dim], 1.0, DType::BF16);
    let cos = random(&mut rng, &[TOKENS, shape().head_dim / 2], 1.0, DType::F32);
    let sin = random(&mut rng, &[TOKENS, shape().head_dim / 2], 1.0, DType::F32);
    g.throughput(Throughput::Bytes(
        (2 * TOKENS * HIDDEN * 2 * 2 + 2 * TOKENS * shape().head_dim / 2 * 4) as u64,
    ));
    on_device(&mut g, "forward", || {
        ops::rope(&q, &cos, &sin, false).expect("rope");
    });
    // Qwen3's q/k norms and both rotations in one launch (8 kv heads of k beside 16 of q).
    let q2 = random(&mut rng, &[TOKENS, shape().q_heads * shape().head_dim], 1.0, DType::BF16);
    let k = random(&mut rng, &[TOKENS, shape().kv_heads * shape().head_dim], 1.0, DType::BF16);
    let qw = random(&mut rng, &[shape().head_dim], 1.0, DType::F32);
    let kw = random(&mut rng, &[shape().head_dim], 1.0, DType::F32);
    on_device(&mut g, "qk_norm_rope", || {
        ops::qk_norm_rope(&q2, &k, &qw, &kw, 1e-6, &cos, &sin).expect("qk_norm_rope");
    });
    g.finish();

    let mut g = group(c, "swiglu_bf16_16384x3072");
    let gate = random(&mut rng, &[TOKENS, INTER], 1.0, DType::BF16);
    let up = random(&mut rng, &[TOKENS, INTER], 1.0, DType::BF16);
    let n = (TOKENS * INTER * 2) as u64;
    g.throughput(Throughput::Bytes(3 * n));
    on_device(&mut g, "forward", || {
        ops::swiglu_forward(&gate, &up).expect("swiglu");
    });
    // Read dh, gate, up; write d_gate, d_up.
    g.throughput(Throughput::Bytes(5 * n));
    on_device(&mut g, "backward", || {
        ops::swiglu_backward(&up, &gate, &up).expect("swiglu");
    });
    g.finish();
}

fn logprob(c: &mut Criterion) {
    let mut rng = Rng::new(4);
    let mut g = group(c, "logprob_f32_1024x151936");
    let logits = random(&mut rng, &[HEAD_ROWS, VOCAB], 3.0, DType::F32);
    let targets: Vec<u32> = (0..HEAD_ROWS).map(|_| rng.below(VOCAB) as u32).collect();
    let n = (HEAD_ROWS * VOCAB * 4) as u64;
    g.throughput(Throughput::Bytes(n));
    on_device(&mut g, "rows", || {
        ops::logprob_rows(&logits, &targets, 0.8).expect("logprob");
    });
    let dl = random(&mut rng, &[HEAD_ROWS], 1.0, DType::F32);
    let de = random(&mut rng, &[HEAD_ROWS], 1.0, DType::F32);
    // Two passes over the logits (statistics, then the gradient), bf16 gradients written.
    g.throughput(Throughput::Bytes(2 * n + n / 2));
    on_device(&mut g, "rows_backward_bf16_out", || {
        ops::logprob_rows_backward(&logits, &targets, 0.8, &dl, &de, DType::BF16).expect("logprob");
    });
    g.finish();
}

fn sample(c: &mut Criterion) {
    let mut rng = Rng::new(6);
    let rows = 64;
    let mut g = group(c, "sample_f32_64x151936");
    let logits = random(&mut rng, &[rows, VOCAB], 3.0, DType::F32);
    let uniforms: Vec<f64> = (0..rows).map(|r| (r as f64 + 0.5) / rows as f64).collect();
    g.throughput(Throughput::Bytes((rows * VOCAB * 4) as u64));
    for (name, top_k, top_p) in [("full", 0, 1.0), ("top_k_20", 20, 1.0), ("top_p_0.9", 0, 0.9)] {
        on_device(&mut g, name, || {
            ops::sample_rows(&logits, 1.0, top_k, top_p, &uniforms).expect("sample");
        });
    }
    g.finish();
}

fn optimizer(c: &mut Criterion) {
    let mut rng = Rng::new(5);
    // 100 tensors of a Qwen3-0.6B layer's sizes: 1M to 3M elements each.
    let sizes: Vec<usize> =
        (0..100).map(|i| [HIDDEN * HIDDEN, 2 * HIDDEN * HIDDEN, INTER * HIDDEN][i % 3]).collect();
    let total: usize = sizes.iter().sum();
    let make = |rng: &mut Rng, scale| -> Vec<Tensor> {
        sizes.iter().map(|&n| random(rng, &[n], scale, DType::F32)).collect()
    };
    let (mut p, g_) = (make(&mut rng, 0.02), make(&mut rng, 1e-3));
    let (mut m, mut v) = (make(&mut rng, 1e-3), make(&mut rng, 1e-6));
    let mut copies: Vec<Tensor> =
        p.iter().map(|t| t.to_dtype(DType::BF16).expect("bf16")).collect();
    let hyper = AdamW { lr: 1e-5, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.01 };
    let mut g = group(c, "optimizer_f32_100_tensors");
    // Read p, m, v, g; write p, m, v and the bf16 copy.
    g.throughput(Throughput::Bytes((total * (7 * 4 + 2)) as u64));
    on_device(&mut g, "adamw_multi", || {
        let mut parts: Vec<AdamWTensors> = p
            .iter_mut()
            .zip(&mut m)
            .zip(&mut v)
            .zip(&g_)
            .zip(&mut copies)
            .map(|((((param, m), v), grad), copy)| AdamWTensors {
                param,
                m,
                v,
                grad,
                copy: Some(copy),
                rounding_key: None,
            })
            .collect();
        ops::adamw_multi(&hyper, 3, 1.0, &mut parts).expect("adamw");
    });
    let grads: Vec<&Tensor> = g_.iter().collect();
    g.throughput(Throughput::Bytes((total * 4) as u64));
    on_device(&mut g, "sum_squares_multi", || {
        ops::sum_squares_multi(&grads).expect("norm");
    });
    g.finish();
}

/// A decode step's fused kernels against the launches they replace, at the SmolLM2-135M shape
/// (9 query and 3 kv heads of 64, inter 1536) for 64 sequences at position 192.
fn decode(c: &mut Criterion) {
    use miles_tensor::cpu::{PagedLayout, PagedRows};
    let mut rng = Rng::new(8);
    let (rows, q_heads, kv_heads, d, inter) = (64usize, 9usize, 3usize, 64usize, 1536usize);
    let mut g = group(c, "decode_smollm2_64rows");
    let gu = random(&mut rng, &[rows, 2 * inter], 1.0, DType::BF16);
    on_device(&mut g, "swiglu_stacked", || {
        ops::swiglu_stacked(&gu).expect("swiglu_stacked");
    });
    on_device(&mut g, "split_then_swiglu", || {
        let p = ops::split_columns(&gu, &[inter, inter]).expect("split");
        ops::swiglu_forward(&p[0], &p[1]).expect("swiglu");
    });
    let layout = PagedLayout { blocks: 4 * rows + 1, layers: 30, kv_heads, head_dim: d };
    let tables: Vec<Vec<u32>> = (0..rows as u32).map(|s| (4 * s..4 * s + 4).collect()).collect();
    let seqs: Vec<PagedRows> =
        tables.iter().map(|t| PagedRows { n: 1, pos0: 192, table: t }).collect();
    let plan = ops::PagedPlan::new(&seqs, layout, &DEVICE).expect("plan");
    let mut cache = Tensor::zeros(&[layout.rows(), d], DType::BF16, &DEVICE).expect("cache");
    let qkv = random(&mut rng, &[rows, (q_heads + 2 * kv_heads) * d], 1.0, DType::BF16);
    let cos = random(&mut rng, &[rows, d / 2], 1.0, DType::F32);
    let sin = random(&mut rng, &[rows, d / 2], 1.0, DType::F32);
    on_device(&mut g, "qkv_rope_kv_write", || {
        ops::qkv_rope_kv_write(&qkv, None, 1e-5, &cos, &sin, &mut cache, 7, &plan, q_heads)
            .expect("qkv_rope_kv_write");
    });
    on_device(&mut g, "split_rope_rope_kv_write", || {
        let widths = [q_heads * d, kv_heads * d, kv_heads * d];
        let mut p = ops::split_columns(&qkv, &widths).expect("split").into_iter();
        let mut turn = |heads: usize| {
            let x = p.next().expect("a part").reshape(&[rows, heads, d]).expect("heads");
            ops::rope(&x, &cos, &sin, false).expect("rope").reshape(&[rows, heads * d])
        };
        let (_q, k) = (turn(q_heads), turn(kv_heads).expect("k"));
        let v = p.next().expect("v");
        ops::paged_kv_write(&mut cache, &k, &v, 7, &plan).expect("kv write");
    });
    let q = random(&mut rng, &[rows, q_heads * d], 1.0, DType::BF16);
    // Each sequence's 193 cached keys and values, read once per kv head.
    g.throughput(Throughput::Bytes((rows * 193 * kv_heads * d * 2 * 2) as u64));
    on_device(&mut g, "paged_attention", || {
        ops::paged_attention(&q, &cache, 7, &plan, q_heads, &shape().scores)
            .expect("paged attention");
    });
    g.finish();
}

criterion_group!(
    benches, matmul, fp8, int4, grouped, attention, rowwise, logprob, sample, optimizer, decode
);
criterion_main!(benches);
