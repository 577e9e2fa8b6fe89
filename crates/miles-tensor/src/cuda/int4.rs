//! INT4 weights of `kernels/int4.cu` (miles' QAT recipe): fake quantization, packing, and the
//! W4A16 products, checked by [`crate::ops::fake_quantize_int4`] and `ops::int4`'s tests.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, LaunchConfig};

use super::grouped::{grid_dim, pieces, rows_table, upload};
use super::{DeviceData, Gpu};
use crate::Result;

/// Warps (groups) per block of threads.
const GROUPS_PER_BLOCK: usize = 8;

/// The launch of a kernel that gives each of `groups` groups a warp, and the count as the
/// kernels take it; None for no group.
fn warp_per_group(groups: usize) -> Option<(LaunchConfig, i64)> {
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(GROUPS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * GROUPS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    (groups > 0).then_some((cfg, groups as i64))
}

/// `out` (f32 or bf16, `w`'s length) = the fake-quantized `w`, groups of `group` consecutive
/// weights.
pub(crate) fn fake_quantize(
    gpu: &Gpu,
    w: &CudaSlice<f32>,
    out: &mut DeviceData,
    group: usize,
) -> Result<()> {
    let Some((cfg, groups)) = warp_per_group(w.len() / group) else { return Ok(()) };
    let group = group as i32;
    per_float!("fake_quantize_int4", (out), |T, f| {
        launch!(gpu, "int4", kernel!(f, "int4_fake_quantize"), cfg, out, w, &group, &groups)
    })
}

/// `out` (f32 or bf16, eight values a word) = the values q · s of the packed `words` with the
/// `scales` of their groups of `group`.
pub(crate) fn dequantize(
    gpu: &Gpu,
    (words, scales): (&CudaSlice<i32>, &CudaSlice<f32>),
    out: &mut DeviceData,
    group: usize,
) -> Result<()> {
    let count = words.len();
    if count == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (count.div_ceil(256) as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (group, count) = (group as i32, count as i64);
    per_float!("Int4Matrix::dequantize", (out), |T, f| {
        launch!(gpu, "int4", kernel!(f, "int4_dequantize"), cfg, out, words, scales, &group, &count)
    })
}

/// `words` (`[rows × cols/8]`) and `scales` (`[rows × cols/group]`) of the f32 weight `w`:
/// compressed-tensors' packed levels and miles' scales.
pub(crate) fn quantize_pack(
    gpu: &Gpu,
    w: &CudaSlice<f32>,
    words: &mut CudaSlice<i32>,
    scales: &mut CudaSlice<f32>,
    group: usize,
) -> Result<()> {
    let Some((cfg, groups)) = warp_per_group(w.len() / group) else { return Ok(()) };
    let group = group as i32;
    launch!(gpu, "int4", "int4_quantize_pack", cfg, words, scales, w, &group, &groups)
}

/// int4.cu's rows products: (kernel, row tiles of 16, warps of 16 columns, stages).
const ROWS_INSTANCES: [(&str, u32, u32, u32); 6] = [
    ("int4_rows_gemm_m16_w1", 1, 1, 16),
    ("int4_rows_gemm_m16_w2", 1, 2, 16),
    ("int4_rows_gemm_m16_w4", 1, 4, 12),
    ("int4_rows_gemm_m64_w1", 4, 1, 6),
    ("int4_rows_gemm_m64_w2", 4, 2, 6),
    ("int4_rows_gemm_m64_w4", 4, 4, 6),
];

/// `c [m × n] = a [m × k] · wᵀ` (bf16) for `m` ≤ 64 rows, `w` packed (`words`,
/// `scales` in groups of `group`): `kernels/int4.cu`'s W4A16 product. `k` and `group`
/// multiples of 32, `group` dividing `k`.
pub(crate) fn rows_gemm(
    gpu: &Gpu,
    a: &CudaSlice<u16>,
    (words, scales): (&CudaSlice<i32>, &CudaSlice<f32>),
    (m, n, k): (usize, usize, usize),
    group: usize,
) -> Result<CudaSlice<u16>> {
    let mut c = gpu.alloc::<u16>(m * n)?;
    if m == 0 || n == 0 {
        return Ok(c);
    }
    // The row tiles by the rows, then the most warps (16 columns each, sharing the block's A
    // stages: fewer reads of A) that still give every SM a block.
    let tiles = if m <= 16 { 1 } else { 4 };
    let sms = super::fp8::sm_count(gpu)? as usize;
    let warps = [4, 2].into_iter().find(|&w| n.div_ceil(16 * w as usize) >= sms).unwrap_or(1);
    let &(kernel, _, _, stages) = ROWS_INSTANCES
        .iter()
        .find(|i| (i.1, i.2) == (tiles, warps))
        .expect("an instance for every row tile count and warp count");
    let cfg = rows_launch(gpu, kernel, (tiles, warps, stages), (n as u32).div_ceil(16 * warps), 1)?;
    let (m, n, k, group) = (m as i32, n as i32, k as i32, group as i32);
    launch!(gpu, "int4", kernel, cfg, &mut c, a, words, scales, &m, &n, &k, &group)?;
    Ok(c)
}

/// The launch of one of int4.cu's rows products (`tiles` of 16 rows, `warps` of 16 columns:
/// a warp for each pair; `stages` of 64 inputs in flight) over a grid of `blocks`, its shared
/// memory allowed.
fn rows_launch(
    gpu: &Gpu,
    kernel: &'static str,
    (tiles, warps, stages): (u32, u32, u32),
    blocks_x: u32,
    blocks_y: u32,
) -> Result<LaunchConfig> {
    const BK: u32 = 64;
    let (ld, wld, scales) = (BK + 8, BK / 8 + 4, BK / 32);
    let bn = 16 * warps;
    let bytes = stages * (16 * tiles * ld * 2 + bn * wld * 4 + bn * scales * 4);
    gpu.function("int4", kernel)?
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| super::driver_error(kernel, e))?;
    Ok(LaunchConfig {
        grid_dim: (blocks_x, blocks_y, 1),
        block_dim: (32 * tiles * warps, 1, 1),
        shared_mem_bytes: bytes,
    })
}

/// `out[s] = x[row(s)] · W_eᵀ` (bf16 `[offsets[E] × n]`) for the rows s of each expert e,
/// `W_e` packed (`experts[e]`: words, scales in groups of `group`), `row(s)` through `rows`
/// or s: `kernels/int4.cu`'s grouped W4A16 product. `k` and `group` multiples of 32, `group`
/// dividing `k`.
pub(crate) fn grouped_rows_gemm(
    gpu: &Arc<Gpu>,
    x: &CudaSlice<u16>,
    (rows, offsets): (Option<&[u32]>, &[u32]),
    experts: &[(&CudaSlice<i32>, &CudaSlice<f32>)],
    (n, k): (usize, usize),
    group: usize,
) -> Result<CudaSlice<u16>> {
    let total = *offsets.last().unwrap_or(&0) as usize;
    let mut out = gpu.alloc::<u16>((total * n).max(1))?;
    let tiles = pieces(offsets, 64);
    if tiles.is_empty() || n == 0 {
        return Ok(out);
    }
    let stream = gpu.stream().clone();
    let (mut words, mut scales, mut guards) = (Vec::new(), Vec::new(), Vec::new());
    for (w, s) in experts {
        let ((pw, gw), (ps, gs)) = (w.device_ptr(&stream), s.device_ptr(&stream));
        words.push(pw);
        scales.push(ps);
        guards.push((gw, gs));
    }
    let (words, scales) = (upload(gpu, &words)?, upload(gpu, &scales)?);
    let tiles_dev = upload(gpu, &tiles)?;
    let (rows_dev, use_rows) = rows_table(gpu, rows)?;
    let bn = if n >= 64 * 264 { 64 } else { 16 };
    let kernel = if bn == 64 { "int4_grouped_rows_n64" } else { "int4_grouped_rows_n16" };
    let (bx, by) = (
        grid_dim("column blocks", n.div_ceil(bn as usize))?,
        grid_dim("row tiles", tiles.len() / 3)?,
    );
    let cfg = rows_launch(gpu, kernel, (4, bn / 16, 6), bx, by)?;
    let (n, k, group) = (n as i32, k as i32, group as i32);
    launch!(
        gpu, "int4", kernel, cfg, &mut out, x, &rows_dev, &use_rows, &words, &scales, &tiles_dev,
        &n, &k, &group
    )?;
    drop(guards);
    Ok(out)
}
