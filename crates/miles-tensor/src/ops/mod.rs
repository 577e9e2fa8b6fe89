//! Ops on [`Tensor`]s, dispatched on their device. The CPU goes through the [`crate::cpu`]
//! reference (bf16 by way of f32); CUDA through cuBLAS and `kernels/*.cu`. Every op returns
//! new tensors on its operands' device; mixing devices is an error.

use half::bf16;

use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor};

mod attention;
mod columns;
mod elementwise;
mod fp8;
mod grouped;
mod int4;
mod logprob;
mod matmul;
mod norm;
mod optim;
mod sample;

pub use attention::{
    PagedPlan, attention_backward, attention_forward, paged_attention, paged_attention_runs,
    paged_kv_write, qkv_rope_kv_write,
};
pub use columns::{ColumnMap, gather_columns, scatter_columns};
pub use elementwise::{
    add, add_bias, column_sums_acc, concat_rows, copy_rows_within, embedding_backward,
    embedding_backward_acc, embedding_forward, embedding_forward_ids, gather_rows, glu_backward,
    glu_forward, pick_row_dots, pick_rows_sum, rope, scale, scatter_rows, softcap,
    softcap_backward, split_columns, swiglu_backward, swiglu_forward, swiglu_stacked,
};
pub use fp8::{
    Fp8Matrix, fp8_grouped_linear, fp8_grouped_supported, fp8_linear, fp8_linear_many,
    fp8_quantize_rows, fp8_supported,
};
pub use grouped::{grouped_matmul, grouped_matmul_wgrad};
pub use int4::{INT4_ROWS_MAX, Int4Matrix, fake_quantize_int4, int4_grouped_linear, int4_linear};
pub use logprob::{logprob_rows, logprob_rows_backward, logprob_rows_ids};
pub use matmul::{linear_packed, matmul, matmul_acc, matmul_f32_out, pack_linear};
pub use norm::{
    add_rmsnorm, qk_norm_rope, rmsnorm_backward, rmsnorm_backward_acc, rmsnorm_forward,
};
pub use optim::{AdamWTensors, adamw_multi, adamw_step, sum_squares, sum_squares_multi};
pub use sample::{
    ChainTables, DraftChain, Verified, sample_rows, sample_rows_ids, speculative_verify,
    speculative_verify_tables, uniform_bits,
};

/// A host buffer of `n` f32 for an op to overwrite (NaN in debug builds: see POISON_OUTPUTS).
fn host_out(n: usize) -> Vec<f32> {
    vec![if crate::poison_outputs() { f32::NAN } else { 0.0 }; n]
}

fn same_device(op: &'static str, tensors: &[&Tensor]) -> Result<Device> {
    let device = tensors[0].device();
    if let Some(other) = tensors.iter().find(|t| t.device() != device) {
        return Err(Error::Device(format!(
            "{op}: operands on different devices ({device} and {})",
            other.device()
        )));
    }
    Ok(device)
}

/// The float ops take f32 or bf16 operands; i32 and FP8 tensors are refused up front.
fn floats_only(op: &'static str, tensors: &[&Tensor]) -> Result<()> {
    match tensors.iter().find(|t| matches!(t.dtype(), DType::I32 | DType::F8E4M3)) {
        Some(t) => Err(Error::DType {
            op,
            message: format!("operands must be f32 or bf16, one is {}", t.dtype()),
        }),
        None => Ok(()),
    }
}

fn dtype_is(op: &'static str, what: &str, t: &Tensor, want: DType) -> Result<()> {
    if t.dtype() == want {
        Ok(())
    } else {
        Err(Error::DType { op, message: format!("{what} is {}, must be {want}", t.dtype()) })
    }
}

/// f32 storage of the result of a CPU op, stored back as `dtype`.
fn host_tensor(shape: Vec<usize>, data: Vec<f32>, dtype: DType) -> Tensor {
    let storage = match dtype {
        DType::F32 => Storage::F32(data),
        DType::BF16 => Storage::BF16(data.into_iter().map(bf16::from_f32).collect()),
        DType::I32 | DType::F8E4M3 => unreachable!("float ops refuse these (floats_only)"),
    };
    Tensor { shape, storage }
}

/// The f32 elements of a host tensor (borrowed when f32 already).
fn host_f32(t: &Tensor) -> std::borrow::Cow<'_, [f32]> {
    match &t.storage {
        Storage::F32(v) => std::borrow::Cow::Borrowed(v),
        Storage::BF16(v) => std::borrow::Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        Storage::I32(_) | Storage::F8(_) => unreachable!("float ops refuse these (floats_only)"),
        #[cfg(feature = "cuda")]
        Storage::Cuda(_) => unreachable!("host_f32 of a device tensor"),
    }
}

#[cfg(feature = "cuda")]
fn device_data(t: &Tensor) -> &crate::cuda::DeviceData {
    match &t.storage {
        Storage::Cuda(buffer) => &buffer.data,
        _ => unreachable!("device_data of a host tensor"),
    }
}

#[cfg(feature = "cuda")]
fn bf16_data(t: &Tensor) -> &cudarc::driver::CudaSlice<u16> {
    match device_data(t) {
        crate::cuda::DeviceData::BF16(s) => s,
        _ => unreachable!("the caller checked the dtype"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{self, Transpose};
    use crate::rng::Rng;

    /// The CPU, and CUDA device 0 when this build and machine have one.
    pub(super) fn devices() -> Vec<Device> {
        let mut devices = vec![Device::Cpu];
        match Device::Cuda(0).ensure_available() {
            Ok(()) => devices.push(Device::Cuda(0)),
            Err(e) => println!("skipping CUDA: {e}"),
        }
        devices
    }

    /// Largest |got − want| over max |want| (relative to the output's scale), after checking
    /// that every element is finite (the outputs were NaN-poisoned before the op wrote them).
    pub(super) fn max_rel_err(what: &str, got: &[f32], want: &[f32]) -> f64 {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, g) in got.iter().enumerate() {
            assert!(g.is_finite(), "{what}[{i}] = {g}: not written, or not finite");
        }
        let scale = want.iter().fold(0f64, |m, w| m.max(f64::from(*w).abs())).max(1e-30);
        let err = got
            .iter()
            .zip(want)
            .fold(0f64, |m, (g, w)| m.max((f64::from(*g) - f64::from(*w)).abs()));
        err / scale
    }

    pub(super) fn round_bf16(v: &[f32]) -> Vec<f32> {
        v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
    }

    /// The reference output as the op stores it (bf16 outputs are rounded once).
    pub(super) fn round_out(v: &[f32], dtype: DType) -> Vec<f32> {
        match dtype {
            DType::F32 => v.to_vec(),
            _ => round_bf16(v),
        }
    }

    pub(super) fn tensor(shape: &[usize], data: &[f32], dtype: DType, device: &Device) -> Tensor {
        Tensor::from_f32(shape, data.to_vec(), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(device))
            .unwrap()
    }

    #[test]
    fn tensors_round_trip_through_every_device_and_dtype() {
        let mut rng = Rng::new(23);
        let data = rng.vec(1000, 1.0);
        for device in devices() {
            let t = Tensor::from_f32(&[10, 100], data.clone(), &device).unwrap();
            assert_eq!((t.shape(), t.device(), t.dtype()), (&[10, 100][..], device, DType::F32));
            assert_eq!(t.to_vec_f32().unwrap(), data);
            let b = t.to_dtype(DType::BF16).unwrap();
            assert_eq!(b.device(), device);
            assert_eq!(b.to_vec_f32().unwrap(), round_bf16(&data));
            assert_eq!(b.to_dtype(DType::F32).unwrap().to_vec_f32().unwrap(), round_bf16(&data));
            let host = b.to_device(&Device::Cpu).unwrap();
            assert_eq!(host.to_vec_bf16().unwrap(), b.to_vec_bf16().unwrap());
        }
        assert!(Tensor::from_f32(&[3, 4], vec![0.0; 11], &Device::Cpu).is_err());
    }

    /// Host memory the allocator refuses is an error naming the size, not an abort (a KV-cache
    /// budget far past the machine's memory).
    #[test]
    fn a_host_tensor_too_large_to_allocate_is_an_error() {
        for dtype in [DType::F32, DType::BF16, DType::I32] {
            let err = Tensor::zeros(&[1 << 40, 1 << 20], dtype, &Device::Cpu).err().unwrap();
            assert!(err.to_string().contains("cannot allocate"), "{err}");
        }
        assert_eq!(Tensor::zeros(&[0, 5], DType::F32, &Device::Cpu).unwrap().len(), 0);
    }

    #[test]
    fn i32_tensors_round_trip_and_never_mix_with_floats() {
        let mut rng = Rng::new(29);
        let ids: Vec<i32> = (0..777).map(|_| rng.below(151_936) as i32 - 7).collect();
        for device in devices() {
            let t = Tensor::from_i32(&[777], ids.clone(), &device).unwrap();
            assert_eq!((t.dtype(), t.device()), (DType::I32, device));
            assert_eq!(t.to_vec_i32().unwrap(), ids);
            assert_eq!(t.to_device(&Device::Cpu).unwrap().to_vec_i32().unwrap(), ids);
            assert_eq!(t.to_dtype(DType::I32).unwrap().to_vec_i32().unwrap(), ids);
            for err in [t.to_dtype(DType::F32).unwrap_err(), t.to_vec_f32().unwrap_err()] {
                assert!(err.to_string().contains("integers and floats stay apart"), "{err}");
            }
            let f = Tensor::from_f32(&[777], vec![1.0; 777], &device).unwrap();
            assert!(f.to_vec_i32().is_err() && f.to_dtype(DType::I32).is_err());
            let m = Tensor::from_i32(&[1, 777], ids.clone(), &device).unwrap();
            let w = Tensor::from_f32(&[777, 1], vec![1.0; 777], &device).unwrap();
            let err = matmul(&m, Transpose::No, &w, Transpose::No).unwrap_err().to_string();
            assert!(err.contains("one is i32"), "{err}");
        }
    }

    #[test]
    fn mismatched_operands_are_errors() {
        let dev = Device::Cpu;
        let a = Tensor::from_f32(&[2, 3], vec![1.0; 6], &dev).unwrap();
        let b = Tensor::from_f32(&[4, 2], vec![1.0; 8], &dev).unwrap();
        let err = matmul(&a, Transpose::No, &b, Transpose::No).unwrap_err().to_string();
        assert!(err.contains("matmul") && err.contains("inner"), "{err}");
        let bb = b.to_dtype(DType::BF16).unwrap();
        let err = matmul(&a, Transpose::Yes, &bb, Transpose::Yes).unwrap_err().to_string();
        assert!(err.contains("dtype") && err.contains("bf16"), "{err}");
        let w = Tensor::from_f32(&[4], vec![1.0; 4], &dev).unwrap();
        assert!(rmsnorm_forward(&a, &w, 1e-6).unwrap_err().to_string().contains("rmsnorm"));
    }

    /// Times the CUDA ops at sizes several times the L2 (by hand: `--ignored`; debug builds
    /// too, the work is on the device). Poisoning is off meanwhile, so run it alone.
    #[test]
    #[ignore = "timings on a GPU; run with --ignored --test-threads=1"]
    fn cuda_timings() {
        use std::sync::atomic::Ordering;
        use std::time::Instant;
        let device = Device::Cuda(0);
        if let Err(e) = device.ensure_available() {
            println!("skipping CUDA: {e}");
            return;
        }
        crate::POISON_OUTPUTS.store(false, Ordering::Relaxed);
        let mut rng = Rng::new(24);
        let tile = rng.vec(1 << 20, 1.0);
        let big = |n: usize| -> Vec<f32> { tile.iter().copied().cycle().take(n).collect() };
        let time = |reps: usize, f: &mut dyn FnMut()| -> f64 {
            f();
            device.synchronize().unwrap();
            let start = Instant::now();
            for _ in 0..reps {
                f();
            }
            device.synchronize().unwrap();
            start.elapsed().as_secs_f64() / reps as f64
        };
        let (rows, hidden) = (8192, 4096);
        let (x, dy) = (big(rows * hidden), big(rows * hidden + 7)[7..].to_vec());
        let w: Vec<f32> = rng.vec(hidden, 0.3).iter().map(|v| 1.0 + v).collect();
        for dtype in [DType::F32, DType::BF16] {
            let xt = tensor(&[rows, hidden], &x, dtype, &device);
            let dyt = tensor(&[rows, hidden], &dy, dtype, &device);
            let wt = tensor(&[hidden], &w, DType::F32, &device);
            let (_, rstd) = rmsnorm_forward(&xt, &wt, 1e-6).unwrap();
            let fwd = time(20, &mut || drop(rmsnorm_forward(&xt, &wt, 1e-6).unwrap()));
            let bwd = time(20, &mut || drop(rmsnorm_backward(&dyt, &xt, &wt, &rstd).unwrap()));
            let e = (rows * hidden * dtype.size_in_bytes()) as f64;
            println!(
                "{device}: rmsnorm {dtype} {rows}×{hidden}: forward {:.1} µs ({:.0} GB/s: x in, y out), \
                 backward {:.1} µs ({:.0} GB/s: dy, x in, dx out)",
                fwd * 1e6,
                2.0 * e / fwd / 1e9,
                bwd * 1e6,
                3.0 * e / bwd / 1e9
            );
        }
        let n = 4096;
        let (a, b) = (big(n * n), big(n * n + 3)[3..].to_vec());
        for dtype in [DType::F32, DType::BF16] {
            let at = tensor(&[n, n], &a, dtype, &device);
            let bt = tensor(&[n, n], &b, dtype, &device);
            let t =
                time(10, &mut || drop(matmul(&at, Transpose::No, &bt, Transpose::Yes).unwrap()));
            let tflops = 2.0 * (n as f64).powi(3) / t / 1e12;
            println!(
                "{device}: matmul {dtype} {n}×{n}×{n}: {:.2} ms ({tflops:.1} TFLOP/s)",
                t * 1e3
            );
        }
        // The decoder's element-wise ops at a Qwen3-0.6B training shape: 16384 tokens (32×512),
        // hidden 1024, intermediate 3072, 16 heads of 128. Bytes are what each op must move.
        let (tokens, hidden, inter, heads, head_dim) = (16_384, 1024, 3072, 16, 128);
        let gbs = |bytes: f64, t: f64| bytes / t / 1e9;
        for dtype in [DType::F32, DType::BF16] {
            let e = dtype.size_in_bytes() as f64;
            let n = tokens * inter;
            let (g, u) = (
                tensor(&[n], &big(n), dtype, &device),
                tensor(&[n], &big(n + 5)[5..], dtype, &device),
            );
            let f = time(20, &mut || drop(swiglu_forward(&g, &u).unwrap()));
            let b = time(20, &mut || drop(swiglu_backward(&g, &g, &u).unwrap()));
            println!(
                "{device}: swiglu {dtype} {tokens}×{inter}: forward {:.1} µs ({:.0} GB/s), backward {:.1} µs ({:.0} GB/s)",
                f * 1e6,
                gbs(3.0 * e * n as f64, f),
                b * 1e6,
                gbs(5.0 * e * n as f64, b)
            );
            let q =
                tensor(&[tokens, heads, head_dim], &big(tokens * heads * head_dim), dtype, &device);
            let positions: Vec<u32> = (0..tokens as u32).map(|p| p % 512).collect();
            let (cos, sin) = cpu::rope_tables(&positions, &cpu::rope_inv_freq(head_dim, 1e6), 1.0);
            let table = [tokens, head_dim / 2];
            let (ct, st) = (
                tensor(&table, &cos, DType::F32, &device),
                tensor(&table, &sin, DType::F32, &device),
            );
            let r = time(20, &mut || drop(rope(&q, &ct, &st, false).unwrap()));
            let bytes = 2.0 * e * q.len() as f64 + 8.0 * (tokens * head_dim / 2) as f64;
            println!(
                "{device}: rope {dtype} {tokens}×{heads}×{head_dim}: {:.1} µs ({:.0} GB/s)",
                r * 1e6,
                gbs(bytes, r)
            );
            let x = tensor(&[tokens, hidden], &big(tokens * hidden), dtype, &device);
            let a = time(20, &mut || drop(add(&x, &x).unwrap()));
            println!(
                "{device}: add {dtype} {tokens}×{hidden}: {:.1} µs ({:.0} GB/s)",
                a * 1e6,
                gbs(3.0 * e * x.len() as f64, a)
            );
            let vocab = 151_936;
            let table = tensor(&[vocab, hidden], &big(vocab * hidden), dtype, &device);
            let ids: Vec<u32> = (0..tokens).map(|t| (t * 7919 % vocab) as u32).collect();
            let ef = time(20, &mut || drop(embedding_forward(&table, &ids).unwrap()));
            let dy = tensor(&[tokens, hidden], &big(tokens * hidden), dtype, &device);
            let eb = time(5, &mut || drop(embedding_backward(&dy, &ids, vocab).unwrap()));
            println!(
                "{device}: embedding {dtype} {tokens} ids of {vocab}×{hidden}: forward {:.1} µs ({:.0} GB/s), \
                 backward {:.1} µs (zeroes the {:.0} MB f32 table, then sums rows)",
                ef * 1e6,
                gbs(2.0 * e * (tokens * hidden) as f64, ef),
                eb * 1e6,
                (vocab * hidden * 4) as f64 / 1e6
            );
        }
        // AdamW over 0.6B f32 parameters' worth of one tensor slice (64M), and its norm.
        let n = 64 << 20;
        let hyper = cpu::AdamW { lr: 1e-6, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.1 };
        let f = |v: &[f32]| tensor(&[n], v, DType::F32, &device);
        let (mut p, mut m, mut v, gr) =
            (f(&big(n)), f(&vec![0.0; n]), f(&vec![0.0; n]), f(&big(n + 1)[1..]));
        let mut step = 0;
        let t = time(10, &mut || {
            step += 1;
            adamw_step(&hyper, step, 0.5, &mut p, &mut m, &mut v, &gr).unwrap()
        });
        println!(
            "{device}: adamw f32 {n}: {:.1} µs ({:.0} GB/s: 4 read, 3 written)",
            t * 1e6,
            gbs(28.0 * n as f64, t)
        );
        let s = time(10, &mut || {
            sum_squares(&gr).unwrap();
        });
        println!(
            "{device}: sum_squares f32 {n}: {:.1} µs ({:.0} GB/s)",
            s * 1e6,
            gbs(4.0 * n as f64, s)
        );
        // The LM head's row statistics over one chunk of f32 logits (rows × 151936).
        let (rows, vocab) = (64, 151_936);
        let logits = tensor(&[rows, vocab], &big(rows * vocab), DType::F32, &device);
        let targets: Vec<u32> = (0..rows as u32).collect();
        let f = time(20, &mut || drop(logprob_rows(&logits, &targets, 1.0).unwrap()));
        let ones = tensor(&[rows], &vec![1.0; rows], DType::F32, &device);
        let b = time(20, &mut || {
            drop(logprob_rows_backward(&logits, &targets, 1.0, &ones, &ones, DType::F32).unwrap())
        });
        let bytes = (rows * vocab * 4) as f64;
        println!(
            "{device}: logprob_rows {rows}×{vocab}: forward {:.1} µs ({:.0} GB/s, one pass over the logits), \
             backward {:.1} µs ({:.0} GB/s, 2 passes and a write)",
            f * 1e6,
            gbs(3.0 * bytes, f),
            b * 1e6,
            gbs(5.0 * bytes, b)
        );
        crate::POISON_OUTPUTS.store(cfg!(debug_assertions), Ordering::Relaxed);
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn cuda_without_the_feature_is_a_clear_error() {
        let cuda = Device::Cuda(0);
        let err = cuda.ensure_available().unwrap_err().to_string();
        assert!(err.contains("built without CUDA") && err.contains("--features cuda"), "{err}");
        let err = Tensor::from_f32(&[2], vec![1.0, 2.0], &cuda).unwrap_err();
        assert!(matches!(err, Error::Device(_)) && err.to_string().contains("built without CUDA"));
        let t = Tensor::from_f32(&[2], vec![1.0, 2.0], &Device::Cpu).unwrap();
        assert!(t.to_device(&cuda).unwrap_err().to_string().contains("built without CUDA"));
    }

    /// With the feature but without a driver or GPU, asking for one is an error that says so.
    #[cfg(feature = "cuda")]
    #[test]
    fn cuda_without_a_device_is_a_clear_error() {
        match Device::Cuda(0).ensure_available() {
            Ok(()) => println!("cuda:0 present: nothing to check"),
            Err(e) => {
                let e = e.to_string();
                assert!(e.starts_with("no CUDA device: "), "{e}");
            }
        }
        let err = Device::Cuda(1 << 20).ensure_available().unwrap_err().to_string();
        assert!(err.starts_with("no CUDA device: "), "{err}");
    }
}
