//! Matrix products: the plain, f32-output and accumulating forms, through cuBLAS(Lt) on CUDA
//! (one pinned configuration per weight shape, see `cuda::gemm_lt`) and `cpu::matmul` here.

use super::{floats_only, host_f32, host_out, host_tensor, same_device};
use crate::cpu::{self, Transpose};
use crate::{DType, Device, Error, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::device_data;
#[cfg(feature = "cuda")]
use crate::tensor::Storage;

/// `op(a)·op(b)`: `a` is stored `[m×k]` (or `[k×m]` when `ta` is [`Transpose::Yes`]), `b`
/// `[k×n]` (or `[n×k]`); the result is `[m×n]` in the operands' dtype (both f32 or both bf16),
/// accumulated in f32.
pub fn matmul(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Tensor> {
    matmul_to(a, ta, b, tb, false)
}

/// [`matmul`] with an f32 result whatever the operands' dtype: bf16 operands, f32 accumulation
/// and f32 output (the LM head's logits, never rounded to bf16).
pub fn matmul_f32_out(a: &Tensor, ta: Transpose, b: &Tensor, tb: Transpose) -> Result<Tensor> {
    matmul_to(a, ta, b, tb, true)
}

/// `x·Wᵀ` with `W` `[out × in]` packed for the CPU's batch-invariant kernel
/// ([`cpu::linear_forward`]): every output is one fused multiply-add chain over the input in
/// order, so a row's bits do not depend on the rows beside it, and rollout and training agree.
/// `x` is f32 `[rows × in]` on the CPU; the result is `[rows × out]` f32.
pub fn linear_packed(x: &Tensor, w: &cpu::PackedLinear) -> Result<Tensor> {
    const OP: &str = "linear_packed";
    ensure(x.device() == Device::Cpu && x.dtype() == DType::F32, OP, || {
        format!("x must be f32 on the CPU, not {} on {}", x.dtype(), x.device())
    })?;
    ensure(x.shape.len() == 2 && x.shape[1] == w.d_in(), OP, || {
        format!("x {:?} for a weight of input width {}", x.shape, w.d_in())
    })?;
    let rows = x.shape[0];
    let mut y = host_out(rows * w.d_out());
    cpu::linear_forward(&mut y, &host_f32(x), w)?;
    Ok(host_tensor(vec![rows, w.d_out()], y, DType::F32))
}

/// `parts` `[out_i × in]`, f32 on the CPU, stacked by rows and packed for [`linear_packed`]
/// (one weight read without a copy; a stack copied once).
pub fn pack_linear(parts: &[&Tensor]) -> Result<cpu::PackedLinear> {
    const OP: &str = "pack_linear";
    let d_in = parts.first().map_or(0, |p| p.shape.get(1).copied().unwrap_or(0));
    let ok = parts.iter().all(|p| {
        p.device() == Device::Cpu
            && p.dtype() == DType::F32
            && p.shape.len() == 2
            && p.shape[1] == d_in
    });
    ensure(ok && d_in > 0, OP, || {
        let shapes: Vec<_> = parts.iter().map(|p| (p.shape.clone(), p.dtype())).collect();
        format!("parts {shapes:?} must be f32 matrices on the CPU of one input width")
    })?;
    let d_out = parts.iter().map(|p| p.shape[0]).sum();
    match parts {
        [one] => cpu::PackedLinear::new(&host_f32(one), d_out, d_in),
        _ => {
            let mut w = Vec::with_capacity(d_out * d_in);
            parts.iter().for_each(|p| w.extend_from_slice(&host_f32(p)));
            cpu::PackedLinear::new(&w, d_out, d_in)
        }
    }
}

/// `c += op(a)·op(b)` in place, `c` `[m×n]`: f32 for any float operands (weight gradients of
/// bf16 activations accumulate in f32), or the operands' dtype.
pub fn matmul_acc(
    c: &mut Tensor,
    a: &Tensor,
    ta: Transpose,
    b: &Tensor,
    tb: Transpose,
) -> Result<()> {
    let device = same_device("matmul_acc", &[c, a, b])?;
    let (m, k, n) = matmul_dims(a, ta, b, tb)?;
    ensure(
        c.shape == [m, n] && (c.dtype() == DType::F32 || c.dtype() == a.dtype()),
        "matmul_acc",
        || format!("c {:?} {} for a {} product [{m}×{n}]", c.shape, c.dtype(), a.dtype()),
    )?;
    match device {
        Device::Cpu => {
            let mut acc = host_f32(c).into_owned();
            cpu::matmul(&mut acc, &host_f32(a), ta, &host_f32(b), tb, m, k, n, true)?;
            *c = host_tensor(vec![m, n], acc, c.dtype());
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &mut c.storage else { unreachable!("c is on a device") };
            let gpu = buffer.gpu.clone();
            crate::cuda::matmul_into(
                &gpu,
                &mut buffer.data,
                device_data(a),
                ta,
                device_data(b),
                tb,
                m,
                k,
                n,
            )
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `(m, k, n)` of `op(a)·op(b)` for 2-D float operands of one dtype.
fn matmul_dims(
    a: &Tensor,
    ta: Transpose,
    b: &Tensor,
    tb: Transpose,
) -> Result<(usize, usize, usize)> {
    floats_only("matmul", &[a, b])?;
    ensure(a.shape.len() == 2 && b.shape.len() == 2, "matmul", || {
        format!("operands must be 2-D, are {:?} and {:?}", a.shape, b.shape)
    })?;
    let (m, k) = match ta {
        Transpose::No => (a.shape[0], a.shape[1]),
        Transpose::Yes => (a.shape[1], a.shape[0]),
    };
    let (kb, n) = match tb {
        Transpose::No => (b.shape[0], b.shape[1]),
        Transpose::Yes => (b.shape[1], b.shape[0]),
    };
    ensure(k == kb, "matmul", || {
        format!("a {:?} ({ta:?}) and b {:?} ({tb:?}): inner sizes {k} and {kb}", a.shape, b.shape)
    })?;
    if a.dtype() != b.dtype() {
        return Err(Error::DType {
            op: "matmul",
            message: format!("a is {}, b is {}", a.dtype(), b.dtype()),
        });
    }
    Ok((m, k, n))
}

fn matmul_to(
    a: &Tensor,
    ta: Transpose,
    b: &Tensor,
    tb: Transpose,
    f32_out: bool,
) -> Result<Tensor> {
    let device = same_device("matmul", &[a, b])?;
    let (m, k, n) = matmul_dims(a, ta, b, tb)?;
    match device {
        Device::Cpu => {
            let mut c = host_out(m * n);
            cpu::matmul(&mut c, &host_f32(a), ta, &host_f32(b), tb, m, k, n, false)?;
            let dtype = if f32_out { DType::F32 } else { a.dtype() };
            Ok(host_tensor(vec![m, n], c, dtype))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &a.storage else { unreachable!("a is on a device") };
            let c = crate::cuda::matmul(
                &buffer.gpu,
                device_data(a),
                ta,
                device_data(b),
                tb,
                m,
                k,
                n,
                f32_out,
            )?;
            Ok(Tensor { shape: vec![m, n], storage: Storage::Cuda(c) })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, max_rel_err, round_bf16, round_out, tensor};
    use crate::rng::Rng;

    /// On the invariant route a row of `x·Wᵀ` (a linear layer) or `dy·W` (its input gradient)
    /// has the same bits whatever the number of rows beside it.
    #[test]
    fn device_products_are_batch_invariant() {
        let device = Device::Cuda(0);
        if let Err(e) = device.ensure_available() {
            println!("skipping CUDA: {e}");
            return;
        }
        let mut rng = Rng::new(25);
        for &(n, k) in &[(1024usize, 1024usize), (3072, 1024), (1024, 3072), (333, 70)] {
            let (w, x) = (rng.vec(n * k, 0.05), rng.vec(4096 * k, 1.0));
            let dy = rng.vec(4096 * n, 1.0);
            for dtype in [DType::F32, DType::BF16] {
                let wt = tensor(&[n, k], &w, dtype, &device);
                let full = |rows: usize, forward: bool| {
                    let t = if forward {
                        let xt = tensor(&[rows, k], &x[..rows * k], dtype, &device);
                        matmul(&xt, Transpose::No, &wt, Transpose::Yes)
                    } else {
                        let dt = tensor(&[rows, n], &dy[..rows * n], dtype, &device);
                        matmul(&dt, Transpose::No, &wt, Transpose::No)
                    };
                    t.unwrap().to_vec_f32().unwrap()
                };
                for forward in [true, false] {
                    let width = if forward { n } else { k };
                    let all = full(4096, forward);
                    for rows in [1usize, 2, 7, 64, 100, 1000, 4095] {
                        assert!(
                            full(rows, forward) == all[..rows * width],
                            "{dtype} {n}×{k} forward={forward}: {rows} rows differ from 4096"
                        );
                    }
                }
            }
        }
        // The LM head: bf16 operands, f32 logits, a vocabulary of rows (SmolLM2's shape).
        let (n, k) = (49152usize, 576usize);
        let (w, x) = (rng.vec(n * k, 0.05), rng.vec(1024 * k, 1.0));
        let wt = tensor(&[n, k], &w, DType::BF16, &device);
        let head = |from: usize, rows: usize| {
            let xt = tensor(&[rows, k], &x[from * k..(from + rows) * k], DType::BF16, &device);
            matmul_f32_out(&xt, Transpose::No, &wt, Transpose::Yes).unwrap().to_vec_f32().unwrap()
        };
        let all = head(0, 1024);
        // Rows from the start of the batch, and from elsewhere (a token at another place).
        let cases =
            [(0, 1), (0, 2), (0, 8), (0, 64), (0, 137), (0, 1000), (5, 1), (37, 64), (300, 256)];
        for (from, rows) in cases {
            let got = head(from, rows);
            let want = &all[from * n..(from + rows) * n];
            let differ = got.iter().zip(want).filter(|(a, b)| a != b).count();
            assert!(differ == 0, "head {n}×{k}: rows {from}..+{rows}: {differ} logits differ");
        }
    }

    #[test]
    fn matmul_acc_adds_the_product_on_every_device() {
        let mut rng = Rng::new(24);
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                let (m, k, n) = (33, 70, 17);
                let (a, b, c0) = (rng.vec(k * m, 1.0), rng.vec(k * n, 1.0), rng.vec(m * n, 1.0));
                let (ar, br) = (round_out(&a, dtype), round_out(&b, dtype));
                let mut want = c0.clone();
                cpu::matmul(&mut want, &ar, Transpose::Yes, &br, Transpose::No, m, k, n, true)
                    .unwrap();
                let mut c = tensor(&[m, n], &c0, DType::F32, &device);
                let (at, bt) =
                    (tensor(&[k, m], &a, dtype, &device), tensor(&[k, n], &b, dtype, &device));
                matmul_acc(&mut c, &at, Transpose::Yes, &bt, Transpose::No).unwrap();
                let err = max_rel_err("matmul_acc", &c.to_vec_f32().unwrap(), &want);
                assert!(err < 1e-5, "{device} {dtype} matmul_acc: {err:.3e}");
                let mut wrong = tensor(&[n, m], &c0, DType::F32, &device);
                assert!(matmul_acc(&mut wrong, &at, Transpose::Yes, &bt, Transpose::No).is_err());
            }
        }
    }

    #[test]
    fn matmul_matches_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(21);
        for device in devices() {
            let mut worst = [0f64; 2];
            for &(m, k, n) in &[(1, 64, 1), (7, 576, 333), (333, 1000, 64), (64, 4096, 96)] {
                for ta in [Transpose::No, Transpose::Yes] {
                    for tb in [Transpose::No, Transpose::Yes] {
                        let a_shape = if ta == Transpose::No { [m, k] } else { [k, m] };
                        let b_shape = if tb == Transpose::No { [k, n] } else { [n, k] };
                        let a = rng.vec(m * k, 1.0);
                        let b = rng.vec(k * n, 1.0);
                        for (slot, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
                            // The reference: f32 on the (rounded, for bf16) inputs.
                            let (ar, br) = match dtype {
                                DType::F32 => (a.clone(), b.clone()),
                                _ => (round_bf16(&a), round_bf16(&b)),
                            };
                            let mut want = vec![0.0; m * n];
                            cpu::matmul(&mut want, &ar, ta, &br, tb, m, k, n, false).unwrap();
                            let at = tensor(&a_shape, &a, dtype, &device);
                            let bt = tensor(&b_shape, &b, dtype, &device);
                            let c = matmul(&at, ta, &bt, tb).unwrap();
                            assert_eq!(c.shape(), [m, n]);
                            assert_eq!((c.dtype(), c.device()), (dtype, device));
                            // The f32 output of the same product: only the final rounding differs.
                            let c32 = matmul_f32_out(&at, ta, &bt, tb).unwrap();
                            assert_eq!(c32.dtype(), DType::F32);
                            let what32 = format!("{device} {dtype}→f32 matmul {m}×{k}×{n}");
                            let err = max_rel_err(&what32, &c32.to_vec_f32().unwrap(), &want);
                            assert!(err <= 1e-5, "{what32}: max relative error {err:.3e}");
                            let what = format!("{device} {dtype} matmul {m}×{k}×{n} {ta:?}/{tb:?}");
                            let err = max_rel_err(&what, &c.to_vec_f32().unwrap(), &want);
                            let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                            assert!(err <= tol, "{what}: max relative error {err:.3e} > {tol:e}");
                            worst[slot] = worst[slot].max(err);
                        }
                    }
                }
            }
            println!(
                "{device}: matmul max relative error f32 {:.3e}, bf16 {:.3e}",
                worst[0], worst[1]
            );
        }
    }
}
