//! Ops on [`Tensor`]s, dispatched on their device. The CPU goes through the [`crate::cpu`]
//! reference (bf16 by way of f32); CUDA through cuBLAS and `kernels/*.cu`. Every op returns
//! new tensors on its operands' device; mixing devices is an error.

use half::bf16;

use crate::cpu::{self, Transpose};
use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor, ensure};

mod attention;
mod elementwise;
mod grouped;
mod logprob;
mod optim;
mod sample;

pub use attention::{
    PagedPlan, attention_backward, attention_forward, paged_attention, paged_attention_runs,
    paged_kv_write, qkv_rope_kv_write,
};
pub use elementwise::{
    add, concat_rows, embedding_backward, embedding_backward_acc, embedding_forward,
    embedding_forward_ids, gather_rows, pick_row_dots, pick_rows_sum, rope, scatter_rows,
    split_columns, swiglu_backward, swiglu_forward, swiglu_stacked,
};
pub use grouped::{grouped_matmul, grouped_matmul_wgrad};
pub use logprob::{logprob_rows, logprob_rows_backward, logprob_rows_ids};
pub use optim::{AdamWTensors, adamw_multi, adamw_step, sum_squares, sum_squares_multi};
pub use sample::{sample_rows, sample_rows_ids};

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

/// The float ops take f32 or bf16 operands; i32 tensors are refused up front.
fn floats_only(op: &'static str, tensors: &[&Tensor]) -> Result<()> {
    match tensors.iter().find(|t| t.dtype() == DType::I32) {
        Some(_) => {
            Err(Error::DType { op, message: "operands must be f32 or bf16, one is i32".into() })
        }
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
        DType::I32 => unreachable!("float ops refuse i32 operands (floats_only)"),
    };
    Tensor { shape, storage }
}

/// The f32 elements of a host tensor (borrowed when f32 already).
fn host_f32(t: &Tensor) -> std::borrow::Cow<'_, [f32]> {
    match &t.storage {
        Storage::F32(v) => std::borrow::Cow::Borrowed(v),
        Storage::BF16(v) => std::borrow::Cow::Owned(v.iter().map(|x| x.to_f32()).collect()),
        Storage::I32(_) => unreachable!("float ops refuse i32 operands (floats_only)"),
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

#[cfg(feature = "cuda")]
fn bf16_data(t: &Tensor) -> &cudarc::driver::CudaSlice<u16> {
    match device_data(t) {
        crate::cuda::DeviceData::BF16(s) => s,
        _ => unreachable!("the caller checked the dtype"),
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
    const OP: &str = "rmsnorm_backward";
    let device = same_device(OP, &[dy, x, w, rstd])?;
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
            let mut dw = vec![0.0; hidden]; // cpu::rmsnorm_backward adds into dw
            let (dy_h, x_h) = (host_f32(dy), host_f32(x));
            cpu::rmsnorm_backward(&mut dx, &mut dw, &dy_h, &x_h, &host_f32(w), &host_f32(rstd))?;
            Ok((
                host_tensor(x.shape.clone(), dx, x.dtype()),
                host_tensor(vec![hidden], dw, DType::F32),
            ))
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
            Ok((
                Tensor { shape: x.shape.clone(), storage: Storage::Cuda(dx) },
                Tensor { shape: vec![hidden], storage: Storage::Cuda(dw) },
            ))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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

    pub(super) fn tensor(shape: &[usize], data: &[f32], dtype: DType, device: &Device) -> Tensor {
        Tensor::from_f32(shape, data.to_vec(), &Device::Cpu)
            .and_then(|t| t.to_dtype(dtype))
            .and_then(|t| t.to_device(device))
            .unwrap()
    }

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
                    let (cos, sin) = cpu::rope_tables(&positions, d, 1e6);
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

    /// The reference output as the op stores it (bf16 outputs are rounded once).
    pub(super) fn round_out(v: &[f32], dtype: DType) -> Vec<f32> {
        match dtype {
            DType::F32 => v.to_vec(),
            _ => round_bf16(v),
        }
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
            let (cos, sin) = cpu::rope_tables(&positions, head_dim, 1_000_000.0);
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
