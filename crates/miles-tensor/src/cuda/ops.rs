//! The CUDA ops: matrix products through cuBLAS, RMSNorm through `kernels/rmsnorm.cu`. Shapes
//! and dtypes were checked by [`crate::ops`]; these check only what the device needs.

use std::ffi::c_void;
use std::sync::Arc;

use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, DeviceRepr, LaunchConfig};

use super::{Buffer, DeviceData, Gpu, driver_error};
use crate::cpu::Transpose;
use crate::{Error, Result};

fn to_i32(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Device(format!("{what} = {v} is too large for CUDA")))
}

/// Row-major `c[m×n] = op(a)·op(b)`, f32 accumulation, output in the inputs' dtype, or in f32
/// with `f32_out` (the LM head's logits are never rounded to bf16). f32 runs in real f32
/// (pedantic compute type: no TF32), bf16 on the tensor cores.
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul(
    gpu: &Arc<Gpu>,
    a: &DeviceData,
    ta: Transpose,
    b: &DeviceData,
    tb: Transpose,
    m: usize,
    k: usize,
    n: usize,
    f32_out: bool,
) -> Result<Buffer> {
    let (mi, ki, ni) = (to_i32(m, "m")?, to_i32(k, "k")?, to_i32(n, "n")?);
    let (f32_t, bf16_t) = (cudaDataType::CUDA_R_32F, cudaDataType::CUDA_R_16BF);
    let data = match (a, b, f32_out) {
        (DeviceData::F32(a), DeviceData::F32(b), _) => {
            let mut c = gpu.alloc::<f32>(m * n)?;
            gemm(gpu, a, ta, b, tb, &mut c, (mi, ki, ni), (f32_t, f32_t), 0.0)?;
            DeviceData::F32(c)
        }
        (DeviceData::BF16(a), DeviceData::BF16(b), false) => {
            let mut c = gpu.alloc::<u16>(m * n)?;
            gemm(gpu, a, ta, b, tb, &mut c, (mi, ki, ni), (bf16_t, bf16_t), 0.0)?;
            DeviceData::BF16(c)
        }
        (DeviceData::BF16(a), DeviceData::BF16(b), true) => {
            let mut c = gpu.alloc::<f32>(m * n)?;
            gemm(gpu, a, ta, b, tb, &mut c, (mi, ki, ni), (bf16_t, f32_t), 0.0)?;
            DeviceData::F32(c)
        }
        _ => return Err(Error::DType { op: "matmul", message: "operands differ in dtype".into() }),
    };
    Ok(Buffer { gpu: gpu.clone(), data })
}

/// `c += op(a)·op(b)` in place: `c` f32 (any float operands) or bf16 (bf16 operands).
#[allow(clippy::too_many_arguments)]
pub(crate) fn matmul_into(
    gpu: &Arc<Gpu>,
    c: &mut DeviceData,
    a: &DeviceData,
    ta: Transpose,
    b: &DeviceData,
    tb: Transpose,
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    let dims = (to_i32(m, "m")?, to_i32(k, "k")?, to_i32(n, "n")?);
    let (f32_t, bf16_t) = (cudaDataType::CUDA_R_32F, cudaDataType::CUDA_R_16BF);
    match (a, b, c) {
        (DeviceData::F32(a), DeviceData::F32(b), DeviceData::F32(c)) => {
            gemm(gpu, a, ta, b, tb, c, dims, (f32_t, f32_t), 1.0)
        }
        (DeviceData::BF16(a), DeviceData::BF16(b), DeviceData::F32(c)) => {
            gemm(gpu, a, ta, b, tb, c, dims, (bf16_t, f32_t), 1.0)
        }
        (DeviceData::BF16(a), DeviceData::BF16(b), DeviceData::BF16(c)) => {
            gemm(gpu, a, ta, b, tb, c, dims, (bf16_t, bf16_t), 1.0)
        }
        _ => Err(Error::DType {
            op: "matmul_acc",
            message: "operands differ in dtype, or c is bf16 for f32 operands".into(),
        }),
    }
}

/// cuBLAS is column-major: row-major `c = op(a)·op(b)` is column-major `cᵀ = op(b)ᵀ·op(a)ᵀ`, and
/// a row-major matrix is its column-major transpose, so b goes first and the flags carry over.
/// `dtype` is (a and b's, c's); `beta` 0 overwrites c, 1 adds to it.
#[allow(clippy::too_many_arguments)]
fn gemm<T: DeviceRepr, C: DeviceRepr>(
    gpu: &Gpu,
    a: &CudaSlice<T>,
    ta: Transpose,
    b: &CudaSlice<T>,
    tb: Transpose,
    c: &mut CudaSlice<C>,
    (m, k, n): (i32, i32, i32),
    (dtype, c_dtype): (cudaDataType, cudaDataType),
    beta: f32,
) -> Result<()> {
    if m == 0 || n == 0 {
        return Ok(());
    }
    let stream = gpu.stream();
    if k == 0 {
        return if beta == 0.0 { stream.memset_zeros_bytes(c) } else { Ok(()) };
    }
    let op = |t| match t {
        Transpose::No => cublasOperation_t::CUBLAS_OP_N,
        Transpose::Yes => cublasOperation_t::CUBLAS_OP_T,
    };
    let ldb = if tb == Transpose::No { n } else { k };
    let lda = if ta == Transpose::No { k } else { m };
    let compute = match dtype {
        cudaDataType::CUDA_R_32F => cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC,
        _ => cublasComputeType_t::CUBLAS_COMPUTE_32F,
    };
    if crate::gemm_route() == crate::GemmRoute::Invariant {
        let lt = gpu.lt()?;
        stream.context().bind_to_thread().map_err(|e| driver_error("bind context", e))?;
        let (a_ptr, _a_sync) = a.device_ptr(stream);
        let (b_ptr, _b_sync) = b.device_ptr(stream);
        let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
        return lt.matmul(
            gpu,
            stream.cu_stream() as _,
            (a_ptr as *const c_void, ta),
            (b_ptr as *const c_void, tb),
            c_ptr as *mut c_void,
            (m, k, n),
            (dtype == cudaDataType::CUDA_R_32F, c_dtype == cudaDataType::CUDA_R_32F),
            beta != 0.0,
        );
    }
    let alpha = 1.0f32;
    let blas = gpu.blas()?;
    let handle = *blas.handle();
    stream.context().bind_to_thread().map_err(|e| driver_error("bind context", e))?;
    let (a_ptr, _a_sync) = a.device_ptr(stream);
    let (b_ptr, _b_sync) = b.device_ptr(stream);
    let (c_ptr, _c_sync) = c.device_ptr_mut(stream);
    // SAFETY: the handle is locked for the call; a, b, c hold m·k, k·n and m·n elements of
    // `dtype` (checked by the op), which the leading dimensions above address exactly.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            handle,
            op(tb),
            op(ta),
            n,
            m,
            k,
            (&alpha as *const f32).cast::<c_void>(),
            b_ptr as *const c_void,
            dtype,
            ldb,
            a_ptr as *const c_void,
            dtype,
            lda,
            (&beta as *const f32).cast::<c_void>(),
            c_ptr as *mut c_void,
            c_dtype,
            n,
            compute,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::Device(format!("cuBLAS gemm ({m}×{k}·{k}×{n}): {e}")))
}

trait MemsetBytes {
    fn memset_zeros_bytes<T: DeviceRepr>(&self, c: &mut CudaSlice<T>) -> Result<()>;
}

impl MemsetBytes for Arc<cudarc::driver::CudaStream> {
    fn memset_zeros_bytes<T: DeviceRepr>(&self, c: &mut CudaSlice<T>) -> Result<()> {
        let bytes = cudarc::driver::DeviceSlice::num_bytes(c);
        let (ptr, _sync) = c.device_ptr_mut(self);
        // SAFETY: `ptr` addresses the `bytes` bytes of `c`.
        unsafe { cudarc::driver::result::memset_d8_async(ptr, 0, bytes, self.cu_stream()) }
            .map_err(|e| driver_error("memset", e))
    }
}

/// Threads per row for `hidden` elements loaded `vec` at a time: whole warps, at most 256. A
/// function of `hidden` alone, so a row's reduction order does not depend on the batch.
fn row_threads(hidden: usize, vec: usize) -> u32 {
    (hidden.div_ceil(vec).div_ceil(32) * 32).clamp(32, 256) as u32
}

fn vec_width(hidden: usize) -> usize {
    if hidden.is_multiple_of(4) { 4 } else { 1 }
}

/// The vector width and launch of the row kernels: one block per row.
fn row_launch(rows: usize, hidden: usize) -> (usize, LaunchConfig) {
    let vec = vec_width(hidden);
    let block_dim = (row_threads(hidden, vec), 1, 1);
    (vec, LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim, shared_mem_bytes: 0 })
}

fn f32_of<'a>(d: &'a DeviceData, what: &str) -> Result<&'a CudaSlice<f32>> {
    match d {
        DeviceData::F32(s) => Ok(s),
        other => Err(Error::DType {
            op: "rmsnorm",
            message: format!("{what} must be f32, is {}", other.dtype()),
        }),
    }
}

/// `[a + b, y, rstd]` of [`crate::ops::add_rmsnorm`]: one block per row, rmsnorm's launch.
pub(crate) fn add_rmsnorm(
    gpu: &Arc<Gpu>,
    (a, b): (&DeviceData, &DeviceData),
    w: &DeviceData,
    rows: usize,
    hidden: usize,
    eps: f32,
) -> Result<[Buffer; 3]> {
    let w = f32_of(w, "w")?;
    let hidden_i = to_i32(hidden, "hidden")?;
    to_i32(rows, "rows")?;
    let (vec, cfg) = row_launch(rows, hidden);
    let mut rstd = gpu.alloc::<f32>(rows)?;
    let (sum, y) = per_float!("add_rmsnorm", (a, b), |T, f| {
        let (mut sum, mut y) = (gpu.alloc::<T>(rows * hidden)?, gpu.alloc::<T>(rows * hidden)?);
        if rows > 0 {
            let k = if vec == 4 {
                kernel!(f, "add_rmsnorm", "_v4")
            } else {
                kernel!(f, "add_rmsnorm", "_v1")
            };
            launch!(gpu, "rmsnorm", k, cfg, &mut sum, &mut y, &mut rstd, a, b, w, &hidden_i, &eps)?;
        }
        (DeviceData::from(sum), DeviceData::from(y))
    });
    let wrap = |data| Buffer { gpu: gpu.clone(), data };
    Ok([wrap(sum), wrap(y), wrap(DeviceData::F32(rstd))])
}

/// [`crate::ops::qk_norm_rope`] on bf16 (dtypes and shapes checked by the op): `[q, q_rstd, k,
/// k_rstd]`, one block per (token, head) of rmsnorm's block size for a row of `d`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qk_norm_rope(
    gpu: &Arc<Gpu>,
    (q, k): (&CudaSlice<u16>, &CudaSlice<u16>),
    (q_w, k_w): (&DeviceData, &DeviceData),
    (cos, sin): (&DeviceData, &DeviceData),
    tokens: usize,
    (q_heads, kv_heads, d): (usize, usize, usize),
    eps: f32,
) -> Result<[Buffer; 4]> {
    let (q_w, k_w) = (f32_of(q_w, "q_w")?, f32_of(k_w, "k_w")?);
    let (cos, sin) = (f32_of(cos, "cos")?, f32_of(sin, "sin")?);
    let (qh, kvh, di) =
        (to_i32(q_heads, "q heads")?, to_i32(kv_heads, "kv heads")?, to_i32(d, "d")?);
    let mut q_out = gpu.alloc::<u16>(tokens * q_heads * d)?;
    let mut k_out = gpu.alloc::<u16>(tokens * kv_heads * d)?;
    let mut q_rstd = gpu.alloc::<f32>(tokens * q_heads)?;
    let mut k_rstd = gpu.alloc::<f32>(tokens * kv_heads)?;
    if tokens > 0 {
        let cfg = LaunchConfig {
            grid_dim: (to_i32(tokens, "tokens")? as u32, (q_heads + kv_heads) as u32, 1),
            block_dim: (row_threads(d, 4), 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        launch!(
            gpu,
            "rmsnorm",
            "qk_norm_rope_bf16",
            cfg,
            &mut q_out,
            &mut q_rstd,
            &mut k_out,
            &mut k_rstd,
            q,
            k,
            q_w,
            k_w,
            cos,
            sin,
            &qh,
            &kvh,
            &di,
            &eps
        )?;
    }
    let wrap = |data| Buffer { gpu: gpu.clone(), data };
    Ok([
        wrap(DeviceData::BF16(q_out)),
        wrap(DeviceData::F32(q_rstd)),
        wrap(DeviceData::BF16(k_out)),
        wrap(DeviceData::F32(k_rstd)),
    ])
}

/// [`crate::ops::qkv_rope_kv_write`]: one block per (token, head); `norms` are the q and k
/// norm weights of models that have them. Writes `cache` and returns the rotated queries.
#[allow(clippy::too_many_arguments)]
pub(crate) fn qkv_rope_kv_write(
    gpu: &Arc<Gpu>,
    qkv: &CudaSlice<u16>,
    norms: Option<(&DeviceData, &DeviceData)>,
    (cos, sin): (&DeviceData, &DeviceData),
    cache: &mut CudaSlice<u16>,
    (slots, layer, layers): (&CudaSlice<i32>, usize, usize),
    tokens: usize,
    (q_heads, kv_heads, d): (usize, usize, usize),
    eps: f32,
) -> Result<Buffer> {
    let (cos, sin) = (f32_of(cos, "cos")?, f32_of(sin, "sin")?);
    let (qh, kvh, di) =
        (to_i32(q_heads, "q heads")?, to_i32(kv_heads, "kv heads")?, to_i32(d, "d")?);
    let (layer, layers) = (to_i32(layer, "layer")?, to_i32(layers, "layers")?);
    let mut q_out = gpu.alloc::<u16>(tokens * q_heads * d)?;
    if tokens > 0 {
        // qk_norm_rope's block size: the norms' reduction, and so their bits, depend on it.
        let cfg = LaunchConfig {
            grid_dim: (to_i32(tokens, "tokens")? as u32, (q_heads + kv_heads) as u32, 1),
            block_dim: (row_threads(d, 4), 1, 1),
            shared_mem_bytes: (d * 4) as u32,
        };
        // Without norms the weight arguments are unused; cos stands in for them.
        let (kernel, q_w, k_w) = match norms {
            Some((q_w, k_w)) => {
                ("qkv_norm_rope_kv_write_bf16", f32_of(q_w, "q_w")?, f32_of(k_w, "k_w")?)
            }
            None => ("qkv_rope_kv_write_bf16", cos, cos),
        };
        launch!(
            gpu, "rmsnorm", kernel, cfg, &mut q_out, cache, qkv, q_w, k_w, cos, sin, slots, &layer,
            &layers, &qh, &kvh, &di, &eps
        )?;
    }
    Ok(Buffer { gpu: gpu.clone(), data: DeviceData::BF16(q_out) })
}

/// `(y, rstd)` of `x [rows × hidden]` (f32 or bf16) and `w [hidden]` (f32).
pub(crate) fn rmsnorm_forward(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    w: &DeviceData,
    rows: usize,
    hidden: usize,
    eps: f32,
) -> Result<(Buffer, Buffer)> {
    let w = f32_of(w, "w")?;
    let hidden_i = to_i32(hidden, "hidden")?;
    to_i32(rows, "rows")?;
    let (vec, cfg) = row_launch(rows, hidden);
    let mut rstd = gpu.alloc::<f32>(rows)?;
    let y = per_float!("rmsnorm", (x), |T, f| {
        let mut y = gpu.alloc::<T>(rows * hidden)?;
        if rows > 0 {
            let k = if vec == 4 {
                kernel!(f, "rmsnorm_forward", "_v4")
            } else {
                kernel!(f, "rmsnorm_forward", "_v1")
            };
            launch!(gpu, "rmsnorm", k, cfg, &mut y, &mut rstd, x, w, &hidden_i, &eps)?;
        }
        DeviceData::from(y)
    });
    Ok((
        Buffer { gpu: gpu.clone(), data: y },
        Buffer { gpu: gpu.clone(), data: DeviceData::F32(rstd) },
    ))
}

/// Most partial dw rows [`rmsnorm_backward`] keeps (one per block); with this many blocks of up
/// to 256 threads the H200's 132 multiprocessors are full.
const MAX_DW_PARTS: usize = 512;

/// `(dx, dw)` of `dy`, `x` (f32 or bf16, `[rows × hidden]`), `w [hidden]`, `rstd [rows]`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn rmsnorm_backward(
    gpu: &Arc<Gpu>,
    dy: &DeviceData,
    x: &DeviceData,
    w: &DeviceData,
    rstd: &DeviceData,
    rows: usize,
    hidden: usize,
) -> Result<(Buffer, Buffer)> {
    let w = f32_of(w, "w")?;
    let rstd = f32_of(rstd, "rstd")?;
    let hidden_i = to_i32(hidden, "hidden")?;
    let rows_i = to_i32(rows, "rows")?;
    let vec = vec_width(hidden);
    let rows_per_block = rows.div_ceil(MAX_DW_PARTS).max(1);
    let parts = rows.div_ceil(rows_per_block);
    let (rpb_i, parts_i) = (to_i32(rows_per_block, "rows per block")?, to_i32(parts, "parts")?);
    let cfg = LaunchConfig {
        grid_dim: (parts as u32, 1, 1),
        block_dim: (row_threads(hidden, vec), 1, 1),
        shared_mem_bytes: 0,
    };
    let mut part = gpu.alloc::<f32>(parts * hidden)?;
    let dx = per_float!("rmsnorm_backward", (dy, x), |T, f| {
        let mut dx = gpu.alloc::<T>(rows * hidden)?;
        if rows > 0 {
            let k = if vec == 4 {
                kernel!(f, "rmsnorm_backward", "_v4")
            } else {
                kernel!(f, "rmsnorm_backward", "_v1")
            };
            launch!(
                gpu, "rmsnorm", k, cfg, &mut dx, &mut part, dy, x, w, rstd, &rows_i, &hidden_i,
                &rpb_i
            )?;
        }
        DeviceData::from(dx)
    });
    let mut dw = gpu.alloc::<f32>(hidden)?;
    if rows == 0 {
        gpu.stream().memset_zeros_bytes(&mut dw)?;
    } else if hidden > 0 {
        let cfg = LaunchConfig {
            grid_dim: (hidden.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        launch!(gpu, "rmsnorm", "rmsnorm_dw_reduce", cfg, &mut dw, &part, &parts_i, &hidden_i)?;
    }
    Ok((
        Buffer { gpu: gpu.clone(), data: dx },
        Buffer { gpu: gpu.clone(), data: DeviceData::F32(dw) },
    ))
}
