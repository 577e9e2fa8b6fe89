//! RMSNorm and its fused forms (residual add + norm, Qwen3's q/k norms + RoPE), with the
//! backward.

use super::{add, dtype_is, floats_only, host_f32, host_out, host_tensor, rope, same_device};
use crate::cpu;
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::{bf16_data, device_data};

/// Rows and hidden size of `x [… × k·hidden]` normalized with `w [hidden]`: each group of
/// `hidden` elements of the last dimension is a row (k > 1 normalizes every head of q or k).
fn rmsnorm_rows(op: &'static str, x: &Tensor, w: &Tensor) -> Result<(usize, usize)> {
    ensure(w.shape.len() == 1 && !x.shape.is_empty(), op, || {
        format!("x {:?} must be [… × hidden], w {:?} must be [hidden]", x.shape, w.shape)
    })?;
    let hidden = w.shape[0];
    ensure(hidden > 0 && x.shape[x.shape.len() - 1].is_multiple_of(hidden), op, || {
        format!(
            "x {:?} and w {:?}: the last size must be a multiple of w's, not 0",
            x.shape, w.shape
        )
    })?;
    Ok((x.len() / hidden, hidden))
}

/// The shape of rstd: x's without its last dimension, and the heads per row when there are several.
fn rstd_shape(x: &Tensor, hidden: usize) -> Vec<usize> {
    let (last, lead) = x.shape.split_last().expect("rmsnorm_rows checked x is not 0-D");
    let mut shape = lead.to_vec();
    if *last != hidden {
        shape.push(last / hidden);
    }
    shape
}

/// RMSNorm over the last dimension: `(y, rstd)` with `y = w · x · rstd`, `rstd = 1/√(mean(x²) +
/// eps)` per row. `x` is f32 or bf16 (y has its dtype), `w` f32; `rstd` is f32, shaped like x
/// without its last dimension. Arithmetic is f32.
pub fn rmsnorm_forward(x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
    let device = same_device("rmsnorm", &[x, w])?;
    floats_only("rmsnorm", &[x, w])?;
    let (rows, hidden) = rmsnorm_rows("rmsnorm", x, w)?;
    dtype_is("rmsnorm", "w", w, DType::F32)?;
    let rstd_shape = rstd_shape(x, hidden);
    match device {
        Device::Cpu => {
            let (mut y, mut rstd) = (host_out(rows * hidden), host_out(rows));
            cpu::rmsnorm_forward(&mut y, &mut rstd, &host_f32(x), &host_f32(w), eps)?;
            Ok((
                host_tensor(x.shape.clone(), y, x.dtype()),
                host_tensor(rstd_shape, rstd, DType::F32),
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &x.storage else { unreachable!("x is on a device") };
            let (y, rstd) = crate::cuda::rmsnorm_forward(
                &buffer.gpu,
                device_data(x),
                device_data(w),
                rows,
                hidden,
                eps,
            )?;
            Ok((
                Tensor { shape: x.shape.clone(), storage: Storage::Cuda(y) },
                Tensor { shape: rstd_shape, storage: Storage::Cuda(rstd) },
            ))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// A residual add and the norm after it: `[a + b, y, rstd]` with `(y, rstd)` =
/// [`rmsnorm_forward`]`(a + b, w, eps)`. On CUDA one launch, with the bits of [`add`] then
/// [`rmsnorm_forward`] (tested).
pub fn add_rmsnorm(a: &Tensor, b: &Tensor, w: &Tensor, eps: f32) -> Result<[Tensor; 3]> {
    const OP: &str = "add_rmsnorm";
    let device = same_device(OP, &[a, b, w])?;
    floats_only(OP, &[a, b, w])?;
    ensure(a.shape == b.shape && a.dtype() == b.dtype(), OP, || {
        format!(
            "a {:?} {} and b {:?} {} must share a shape and a dtype",
            a.shape,
            a.dtype(),
            b.shape,
            b.dtype()
        )
    })?;
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let (rows, hidden) = rmsnorm_rows(OP, a, w)?;
    dtype_is(OP, "w", w, DType::F32)?;
    match device {
        Device::Cpu => {
            let sum = add(a, b)?;
            let (y, rstd) = rmsnorm_forward(&sum, w, eps)?;
            Ok([sum, y, rstd])
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &a.storage else { unreachable!("a is on a device") };
            let [sum, y, rstd] = crate::cuda::add_rmsnorm(
                &buffer.gpu,
                (device_data(a), device_data(b)),
                device_data(w),
                rows,
                hidden,
                eps,
            )?;
            let t = |shape: Vec<usize>, b| Tensor { shape, storage: Storage::Cuda(b) };
            Ok([t(a.shape.clone(), sum), t(a.shape.clone(), y), t(rstd_shape(a, hidden), rstd)])
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// Qwen3's attention inputs: `rope(rmsnorm(q, q_w))` and `rope(rmsnorm(k, k_w))`, each head
/// normalized on its own (`q` `[tokens × q_heads·d]`, `k` `[tokens × kv_heads·d]`, `d` the
/// weights' length), with the norms' rstd: `[q, q_rstd, k, k_rstd]` as [`rmsnorm_forward`] and
/// [`rope`] give them. In bf16 on CUDA one launch computes all four with those ops' bits (tested);
/// elsewhere it is those ops.
#[allow(clippy::too_many_arguments)]
pub fn qk_norm_rope(
    q: &Tensor,
    k: &Tensor,
    q_w: &Tensor,
    k_w: &Tensor,
    eps: f32,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<[Tensor; 4]> {
    const OP: &str = "qk_norm_rope";
    let device = same_device(OP, &[q, k, q_w, k_w, cos, sin])?;
    let d = q_w.shape.first().copied().unwrap_or(0);
    ensure(
        q.shape.len() == 2
            && k.shape.len() == 2
            && q.shape[0] == k.shape[0]
            && q_w.shape == [d]
            && k_w.shape == [d]
            && d.is_multiple_of(2)
            && d > 0
            && q.shape[1].is_multiple_of(d)
            && k.shape[1].is_multiple_of(d),
        OP,
        || {
            format!(
                "q {:?} and k {:?} must be [tokens × heads·d] with q_w {:?} and k_w {:?} both [d], d even",
                q.shape, k.shape, q_w.shape, k_w.shape
            )
        },
    )?;
    let (tokens, q_heads, kv_heads) = (q.shape[0], q.shape[1] / d, k.shape[1] / d);
    let fused = cfg!(feature = "cuda")
        && device != Device::Cpu
        && q.dtype() == DType::BF16
        && k.dtype() == DType::BF16
        && d.is_multiple_of(4)
        && d <= 1024;
    if !fused {
        let one = |x: &Tensor, w: &Tensor, heads: usize| -> Result<(Tensor, Tensor)> {
            let (n, rstd) = rmsnorm_forward(x, w, eps)?;
            let r = rope(&n.reshape(&[tokens, heads, d])?, cos, sin, false)?;
            Ok((r.reshape(&x.shape)?, rstd))
        };
        let (qo, q_rstd) = one(q, q_w, q_heads)?;
        let (ko, k_rstd) = one(k, k_w, kv_heads)?;
        return Ok([qo, q_rstd, ko, k_rstd]);
    }
    #[cfg(feature = "cuda")]
    {
        let table = [tokens, d / 2];
        ensure(cos.shape == table && sin.shape == table, OP, || {
            format!("cos {:?} and sin {:?} must be {table:?}", cos.shape, sin.shape)
        })?;
        let Storage::Cuda(buffer) = &q.storage else { unreachable!("q is on a device") };
        let [qo, q_rstd, ko, k_rstd] = crate::cuda::qk_norm_rope(
            &buffer.gpu,
            (bf16_data(q), bf16_data(k)),
            (device_data(q_w), device_data(k_w)),
            (device_data(cos), device_data(sin)),
            tokens,
            (q_heads, kv_heads, d),
            eps,
        )?;
        let t = |shape: Vec<usize>, b| Tensor { shape, storage: Storage::Cuda(b) };
        Ok([
            t(q.shape.clone(), qo),
            t(rstd_shape(q, d), q_rstd),
            t(k.shape.clone(), ko),
            t(rstd_shape(k, d), k_rstd),
        ])
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("fused only with the cuda feature")
}

/// Gradients of [`rmsnorm_forward`]: `(dx, dw)` from `dy` and the forward's `x`, `w` and
/// `rstd`. `dy` and `x` share a dtype (f32 or bf16, dx has it too); `w`, `rstd` and `dw` are f32.
/// `dw` is a fresh sum over the rows, reduced in a fixed order.
pub fn rmsnorm_backward(
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
) -> Result<(Tensor, Tensor)> {
    let mut dw = Tensor::zeros(w.shape(), DType::F32, &w.device())?;
    let dx = rmsnorm_backward_acc(&mut dw, dy, x, w, rstd)?;
    Ok((dx, dw))
}

/// [`rmsnorm_backward`] adding `dw` into `acc` (a gradient summed over micro-batches) and
/// returning `dx`. On the CPU the per-chunk partial sums go straight into `acc`, in chunk
/// order, as `cpu::rmsnorm_backward` adds them.
pub fn rmsnorm_backward_acc(
    acc: &mut Tensor,
    dy: &Tensor,
    x: &Tensor,
    w: &Tensor,
    rstd: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "rmsnorm_backward";
    let device = same_device(OP, &[acc, dy, x, w, rstd])?;
    dtype_is(OP, "acc", acc, DType::F32)?;
    ensure(acc.shape == w.shape, OP, || {
        format!("acc {:?} must be shaped like w {:?}", acc.shape, w.shape)
    })?;
    floats_only(OP, &[dy, x, w, rstd])?;
    let (rows, hidden) = rmsnorm_rows(OP, x, w)?;
    ensure(dy.shape == x.shape && rstd.len() == rows, OP, || {
        format!("dy {:?}, x {:?}, rstd {:?}", dy.shape, x.shape, rstd.shape)
    })?;
    dtype_is(OP, "w", w, DType::F32)?;
    dtype_is(OP, "rstd", rstd, DType::F32)?;
    dtype_is(OP, "dy", dy, x.dtype())?;
    match device {
        Device::Cpu => {
            let mut dx = host_out(rows * hidden);
            let (dy_h, x_h) = (host_f32(dy), host_f32(x));
            let Storage::F32(dw) = &mut acc.storage else { unreachable!("acc is f32 on the host") };
            cpu::rmsnorm_backward(&mut dx, dw, &dy_h, &x_h, &host_f32(w), &host_f32(rstd))?;
            Ok(host_tensor(x.shape.clone(), dx, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &x.storage else { unreachable!("x is on a device") };
            let (dx, dw) = crate::cuda::rmsnorm_backward(
                &buffer.gpu,
                device_data(dy),
                device_data(x),
                device_data(w),
                device_data(rstd),
                rows,
                hidden,
            )?;
            let dw = Tensor { shape: vec![hidden], storage: Storage::Cuda(dw) };
            *acc = add(acc, &dw)?;
            Ok(Tensor { shape: x.shape.clone(), storage: Storage::Cuda(dx) })
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

    /// The fused residual add and norm give the bits of add then rmsnorm_forward.
    #[test]
    fn add_rmsnorm_has_the_bits_of_add_then_rmsnorm() {
        let mut rng = Rng::new(32);
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                for &(rows, hidden) in &[(1, 1024), (37, 576), (5, 1001), (64, 4096)] {
                    let t = |v: Vec<f32>, dtype| tensor(&[rows, hidden], &v, dtype, &device);
                    let (a, b) = (
                        t(rng.vec(rows * hidden, 2.0), dtype),
                        t(rng.vec(rows * hidden, 0.5), dtype),
                    );
                    let w: Vec<f32> = rng.vec(hidden, 0.3).iter().map(|v| 1.0 + v).collect();
                    let w = tensor(&[hidden], &w, DType::F32, &device);
                    let got = add_rmsnorm(&a, &b, &w, 1e-6).unwrap();
                    let sum = add(&a, &b).unwrap();
                    let (y, rstd) = rmsnorm_forward(&sum, &w, 1e-6).unwrap();
                    let bits = |t: &Tensor| {
                        t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                    };
                    for (name, g, want) in
                        [("sum", &got[0], &sum), ("y", &got[1], &y), ("rstd", &got[2], &rstd)]
                    {
                        let what = format!("{device} {dtype} {rows}×{hidden} {name}");
                        assert_eq!((g.shape(), g.dtype()), (want.shape(), want.dtype()), "{what}");
                        assert!(bits(g) == bits(want), "{what}: not the separate ops' bits");
                    }
                }
            }
        }
    }

    /// The fused q/k norms and rotary embedding give the bits of rmsnorm_forward then rope on
    /// every device and dtype (on CUDA bf16, its own kernel), at head sizes 64 and 128, GQA.
    #[test]
    fn qk_norm_rope_has_the_bits_of_the_separate_ops() {
        let mut rng = Rng::new(31);
        let eps = 1e-6;
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                for &(tokens, q_heads, kv_heads, d) in
                    &[(1, 2, 1, 128), (37, 16, 8, 128), (5, 9, 3, 64)]
                {
                    let positions: Vec<u32> = (0..tokens as u32).map(|p| p * 7 % 300).collect();
                    let (cos, sin) = cpu::rope_tables(&positions, &cpu::rope_inv_freq(d, 1e6), 1.0);
                    let table = |v: Vec<f32>| tensor(&[tokens, d / 2], &v, DType::F32, &device);
                    let (cos, sin) = (table(cos), table(sin));
                    let q = tensor(
                        &[tokens, q_heads * d],
                        &rng.vec(tokens * q_heads * d, 2.0),
                        dtype,
                        &device,
                    );
                    let k = tensor(
                        &[tokens, kv_heads * d],
                        &rng.vec(tokens * kv_heads * d, 2.0),
                        dtype,
                        &device,
                    );
                    let w = |rng: &mut Rng| {
                        let v: Vec<f32> = rng.vec(d, 0.5).iter().map(|x| 1.0 + x).collect();
                        tensor(&[d], &v, DType::F32, &device)
                    };
                    let (q_w, k_w) = (w(&mut rng), w(&mut rng));
                    let got = qk_norm_rope(&q, &k, &q_w, &k_w, eps, &cos, &sin).unwrap();
                    let apart = |x: &Tensor, w: &Tensor, heads: usize| {
                        let (n, rstd) = rmsnorm_forward(x, w, eps).unwrap();
                        let r = rope(&n.reshape(&[tokens, heads, d]).unwrap(), &cos, &sin, false);
                        [r.unwrap().reshape(x.shape()).unwrap(), rstd]
                    };
                    let [qa, qr] = apart(&q, &q_w, q_heads);
                    let [ka, kr] = apart(&k, &k_w, kv_heads);
                    for (name, g, want) in [
                        ("q", &got[0], qa),
                        ("q rstd", &got[1], qr),
                        ("k", &got[2], ka),
                        ("k rstd", &got[3], kr),
                    ] {
                        let what =
                            format!("{device} {dtype} {tokens}×{q_heads}/{kv_heads}×{d} {name}");
                        assert_eq!((g.shape(), g.dtype()), (want.shape(), want.dtype()), "{what}");
                        let bits = |t: &Tensor| {
                            t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                        };
                        assert!(bits(g) == bits(&want), "{what}: not the separate ops' bits");
                    }
                }
            }
        }
    }

    #[test]
    fn rmsnorm_matches_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(22);
        let eps = 1e-6;
        for device in devices() {
            let mut worst = [[0f64; 4]; 2]; // [dtype][y, rstd, dx, dw]
            for &rows in &[1, 7, 333] {
                for &hidden in &[64, 576, 1000, 1001, 4096] {
                    let x = rng.vec(rows * hidden, 1.0);
                    let w: Vec<f32> = rng.vec(hidden, 0.3).iter().map(|v| 1.0 + v).collect();
                    let dy = rng.vec(rows * hidden, 1.0);
                    for (slot, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
                        let (xr, dyr) = match dtype {
                            DType::F32 => (x.clone(), dy.clone()),
                            _ => (round_bf16(&x), round_bf16(&dy)),
                        };
                        // The reference, in f32 on the (rounded) inputs.
                        let (mut y, mut rstd) = (vec![0.0; rows * hidden], vec![0.0; rows]);
                        cpu::rmsnorm_forward(&mut y, &mut rstd, &xr, &w, eps).unwrap();
                        let (mut dx, mut dw) = (vec![0.0; rows * hidden], vec![0.0; hidden]);
                        cpu::rmsnorm_backward(&mut dx, &mut dw, &dyr, &xr, &w, &rstd).unwrap();

                        let shape = [rows, hidden];
                        let xt = tensor(&shape, &x, dtype, &device);
                        let wt = tensor(&[hidden], &w, DType::F32, &device);
                        let dyt = tensor(&shape, &dy, dtype, &device);
                        let (yt, rt) = rmsnorm_forward(&xt, &wt, eps).unwrap();
                        assert_eq!((yt.shape(), rt.shape()), (&shape[..], &[rows][..]));
                        // Backward from the reference rstd, so the two passes are checked apart.
                        let rref = tensor(&[rows], &rstd, DType::F32, &device);
                        let (dxt, dwt) = rmsnorm_backward(&dyt, &xt, &wt, &rref).unwrap();
                        assert_eq!((dxt.dtype(), dwt.dtype()), (dtype, DType::F32));

                        let what =
                            |name: &str| format!("{device} {dtype} rmsnorm {name} {rows}×{hidden}");
                        // f32: 1e-5. bf16 outputs are rounded once (2⁻⁸ relative); dw sums f32.
                        let (tol_out, tol_f32) =
                            if dtype == DType::F32 { (1e-5, 1e-5) } else { (1e-2, 1e-5) };
                        let checks = [
                            (
                                max_rel_err(
                                    &what("y"),
                                    &yt.to_vec_f32().unwrap(),
                                    &round_out(&y, dtype),
                                ),
                                tol_out,
                            ),
                            (max_rel_err(&what("rstd"), &rt.to_vec_f32().unwrap(), &rstd), tol_f32),
                            (
                                max_rel_err(
                                    &what("dx"),
                                    &dxt.to_vec_f32().unwrap(),
                                    &round_out(&dx, dtype),
                                ),
                                tol_out,
                            ),
                            (max_rel_err(&what("dw"), &dwt.to_vec_f32().unwrap(), &dw), tol_f32),
                        ];
                        for (i, (err, tol)) in checks.into_iter().enumerate() {
                            let name = ["y", "rstd", "dx", "dw"][i];
                            assert!(
                                err <= tol,
                                "{}: max relative error {err:.3e} > {tol:e}",
                                what(name)
                            );
                            worst[slot][i] = worst[slot][i].max(err);
                        }
                    }
                }
            }
            for (slot, dtype) in ["f32", "bf16"].into_iter().enumerate() {
                let [y, r, dx, dw] = worst[slot];
                println!(
                    "{device}: rmsnorm {dtype} max relative error y {y:.3e} rstd {r:.3e} dx {dx:.3e} dw {dw:.3e}"
                );
            }
        }
    }
}
