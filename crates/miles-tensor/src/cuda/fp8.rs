//! The FP8 kernels of `kernels/fp8.cu`: blockwise quantization of weights, per-token group
//! quantization of activations, and the blockwise-scaled product. Shapes were checked by
//! [`crate::ops::Fp8Matrix`] and [`crate::ops::fp8_linear`].

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{DeviceData, Gpu, driver_error};
use crate::{DType, Error, Result};

const BLOCK: usize = 128;
/// Bytes of a shared-memory row of 128 codes (fp8.cu's ROW_BYTES).
const ROW_BYTES: usize = BLOCK + 16;

fn grid(op: &'static str, what: &str, n: usize) -> Result<u32> {
    u32::try_from(n)
        .ok()
        .filter(|&n| n <= 65_535)
        .ok_or_else(|| Error::Shape { op, message: format!("{n} {what}: at most 65535") })
}

fn float_kernel(
    op: &'static str,
    x: &DeviceData,
    f32_name: &'static str,
    bf16_name: &'static str,
) -> Result<&'static str> {
    match x {
        DeviceData::F32(_) => Ok(f32_name),
        DeviceData::BF16(_) => Ok(bf16_name),
        _ => Err(Error::DType { op, message: "FP8 quantizes f32 or bf16 values".into() }),
    }
}

/// Quantizes `w` `[rows × cols]` into `codes` and `scales` (`[⌈rows/128⌉ × ⌈cols/128⌉]`), in
/// place.
pub(crate) fn quantize_blocks(
    gpu: &Gpu,
    w: &DeviceData,
    codes: &mut CudaSlice<u8>,
    scales: &mut CudaSlice<f32>,
    (rows, cols): (usize, usize),
) -> Result<()> {
    const OP: &str = "fp8_quantize_blocks";
    let kernel = float_kernel(OP, w, "fp8_quantize_blocks_f32", "fp8_quantize_blocks_bf16")?;
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (
            grid(OP, "column blocks", cols.div_ceil(BLOCK))?,
            grid(OP, "row blocks", rows.div_ceil(BLOCK))?,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (r, c) = (rows as i32, cols as i32);
    match w {
        DeviceData::F32(w) => launch!(gpu, "fp8", kernel, cfg, codes, scales, w, &r, &c),
        DeviceData::BF16(w) => launch!(gpu, "fp8", kernel, cfg, codes, scales, w, &r, &c),
        _ => unreachable!("float_kernel checked the dtype"),
    }
}

/// `x` `[rows × cols]` quantized per 1 × 128 group of each row: `(codes, scales)`.
pub(crate) fn quantize_rows(
    gpu: &Gpu,
    x: &DeviceData,
    (rows, cols): (usize, usize),
) -> Result<(CudaSlice<u8>, CudaSlice<f32>)> {
    const OP: &str = "fp8_quantize_rows";
    let kernel = float_kernel(OP, x, "fp8_quantize_rows_f32", "fp8_quantize_rows_bf16")?;
    let groups = cols.div_ceil(BLOCK);
    let mut codes = gpu.alloc::<u8>((rows * cols).max(1))?;
    let mut scales = gpu.alloc::<f32>((rows * groups).max(1))?;
    if rows > 0 && cols > 0 {
        let cfg = LaunchConfig {
            grid_dim: (grid(OP, "groups", groups)?, grid(OP, "row octets", rows.div_ceil(8))?, 1),
            block_dim: (32, 8, 1),
            shared_mem_bytes: 0,
        };
        let (r, c) = (rows as i32, cols as i32);
        match x {
            DeviceData::F32(x) => {
                launch!(gpu, "fp8", kernel, cfg, &mut codes, &mut scales, x, &r, &c)?
            }
            DeviceData::BF16(x) => {
                launch!(gpu, "fp8", kernel, cfg, &mut codes, &mut scales, x, &r, &c)?
            }
            _ => unreachable!("float_kernel checked the dtype"),
        }
    }
    Ok((codes, scales))
}

/// A tile shape of `fp8_gemm_*` (fp8.cu): `(suffix, rows, columns, threads, stages)`.
type Tile = (&'static str, usize, usize, u32, usize);
const BIG: Tile = ("big", 128, 128, 256, 3);
const M64: Tile = ("m64", 64, 64, 128, 6);
const M16: Tile = ("m16", 16, 64, 128, 8);

/// The tile for `m` rows: narrow ones for decode-sized products. Any tile gives a row the
/// same bits (fp8.cu), so this choice is free.
fn tile(m: usize) -> Tile {
    match m {
        0..=16 => M16,
        17..=64 => M64,
        _ => BIG,
    }
}

/// `y = x · wᵀ` from quantized operands, `[m × n]` in `out` (f32 or bf16).
#[allow(clippy::too_many_arguments)]
pub(crate) fn gemm(
    gpu: &Gpu,
    (xq, xs): (&CudaSlice<u8>, &CudaSlice<f32>),
    (wq, ws): (&CudaSlice<u8>, &CudaSlice<f32>),
    (m, n, k): (usize, usize, usize),
    out: DType,
) -> Result<DeviceData> {
    const OP: &str = "fp8_linear";
    if !k.is_multiple_of(16) {
        return Err(Error::Shape {
            op: OP,
            message: format!("the input width {k} must be a multiple of 16 on CUDA"),
        });
    }
    let (suffix, bm, bn, threads, stages) = tile(m);
    let kernel: &'static str = match (out, suffix) {
        (DType::F32, "big") => "fp8_gemm_f32_big",
        (DType::F32, "m64") => "fp8_gemm_f32_m64",
        (DType::F32, _) => "fp8_gemm_f32_m16",
        (DType::BF16, "big") => "fp8_gemm_bf16_big",
        (DType::BF16, "m64") => "fp8_gemm_bf16_m64",
        (DType::BF16, _) => "fp8_gemm_bf16_m16",
        (other, _) => {
            return Err(Error::DType {
                op: OP,
                message: format!("writes f32 or bf16, not {other}"),
            });
        }
    };
    let bytes = stages * (bm + bn) * ROW_BYTES;
    let f = gpu.function("fp8", kernel)?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| driver_error(kernel, e))?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid(OP, "row tiles", m.div_ceil(bm))?,
            grid(OP, "column tiles", n.div_ceil(bn))?,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: bytes as u32,
    };
    let (mi, ni, ki) = (m as i32, n as i32, k as i32);
    let len = (m * n).max(1);
    Ok(match out {
        DType::F32 => {
            let mut y = gpu.alloc::<f32>(len)?;
            if m > 0 && n > 0 {
                launch!(gpu, "fp8", kernel, cfg, &mut y, xq, xs, wq, ws, &mi, &ni, &ki)?;
            }
            DeviceData::F32(y)
        }
        _ => {
            let mut y = gpu.alloc::<u16>(len)?;
            if m > 0 && n > 0 {
                launch!(gpu, "fp8", kernel, cfg, &mut y, xq, xs, wq, ws, &mi, &ni, &ki)?;
            }
            DeviceData::BF16(y)
        }
    })
}

/// The device's compute capability, `(major, minor)`.
pub(crate) fn capability(gpu: &Gpu) -> Result<(i32, i32)> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    let ctx = gpu.stream().context();
    let get = |a| ctx.attribute(a).map_err(|e| driver_error("compute capability", e));
    Ok((
        get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
        get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
    ))
}
