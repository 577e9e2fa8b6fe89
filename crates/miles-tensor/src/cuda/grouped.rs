//! The experts' grouped products of `kernels/grouped_gemm.cu`. Shapes were checked by
//! [`crate::ops::grouped_matmul`] and [`crate::ops::grouped_matmul_wgrad`]; these build the tile
//! tables and the experts' pointer tables and launch.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, DevicePtr, DevicePtrMut, LaunchConfig};

use super::{Buffer, DeviceData, Gpu, driver_error};
use crate::{Error, Result};

// The kernels' tile shape and shared-memory row padding (grouped_gemm.cu).
const BM: usize = 128;
const BN: usize = 128;
const BK: usize = 32;
const SKEW: usize = 8;
const THREADS: u32 = 256;

fn bf16_only(op: &'static str) -> Error {
    Error::DType { op, message: "the grouped products on CUDA run in bf16 (f32 gradients)".into() }
}

pub(crate) fn upload<T: cudarc::driver::DeviceRepr>(gpu: &Gpu, v: &[T]) -> Result<CudaSlice<T>> {
    gpu.stream().clone_htod(v).map_err(|e| driver_error("copy to device", e))
}

/// The gather table (or a placeholder the kernel does not read) and its flag.
pub(crate) fn rows_table(gpu: &Gpu, rows: Option<&[u32]>) -> Result<(CudaSlice<i32>, i32)> {
    match rows {
        Some(r) => Ok((upload(gpu, &r.iter().map(|&x| x as i32).collect::<Vec<_>>())?, 1)),
        None => Ok((upload(gpu, &[0i32])?, 0)),
    }
}

/// `(expert, first row, end row)` per piece of at most `rows` rows of each expert's run.
pub(crate) fn pieces(offsets: &[u32], rows: usize) -> Vec<i32> {
    let mut out = Vec::new();
    for (e, w) in offsets.windows(2).enumerate() {
        let (mut at, end) = (w[0] as usize, w[1] as usize);
        while at < end {
            let to = at.saturating_add(rows).min(end);
            out.extend([e as i32, at as i32, to as i32]);
            at = to;
        }
    }
    out
}

pub(crate) fn grid_dim(what: &str, n: usize) -> Result<u32> {
    u32::try_from(n).ok().filter(|&n| n <= 65_535).ok_or_else(|| Error::Shape {
        op: "grouped_matmul",
        message: format!("{n} {what}: at most 65535"),
    })
}

/// `out[s] = x[row(s)]·W_eᵀ` (`nt`, W_e `[n × k]`) or `x[row(s)]·W_e` (W_e `[k × n]`) for the
/// rows s of each expert e; `[offsets[E] × n]` bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn grouped_rows(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    rows: Option<&[u32]>,
    offsets: &[u32],
    weights: &[&DeviceData],
    n: usize,
    k: usize,
    nt: bool,
) -> Result<Buffer> {
    const OP: &str = "grouped_matmul";
    let DeviceData::BF16(x) = x else { return Err(bf16_only(OP)) };
    let stream = gpu.stream().clone();
    let mut ptrs = Vec::with_capacity(weights.len());
    let mut guards = Vec::with_capacity(weights.len());
    for w in weights {
        let DeviceData::BF16(w) = w else { return Err(bf16_only(OP)) };
        let (p, guard) = w.device_ptr(&stream);
        ptrs.push(p);
        guards.push(guard);
    }
    let total = *offsets.last().unwrap_or(&0) as usize;
    let mut out = gpu.alloc::<u16>((total * n).max(1))?;
    let aligned = k.is_multiple_of(8)
        && ptrs.iter().all(|p| p % 16 == 0)
        && x.device_ptr(&stream).0 % 16 == 0;
    let busy = offsets.windows(2).filter(|w| w[1] > w[0]).count();
    if nt && aligned && n > 0 && total <= SMALL_ROWS * busy {
        let tiles = pieces(offsets, SMALL_ROWS);
        let table = upload(gpu, &ptrs)?;
        let tiles_dev = upload(gpu, &tiles)?;
        let rows = rows_table(gpu, rows)?;
        small_rows(gpu, &mut out, x, (&rows.0, rows.1), &table, &tiles_dev, n, k)?;
        drop(guards);
        return Ok(Buffer { gpu: gpu.clone(), data: DeviceData::BF16(out) });
    }
    let tiles = pieces(offsets, BM);
    if !tiles.is_empty() && n > 0 {
        let table = upload(gpu, &ptrs)?;
        let tiles_dev = upload(gpu, &tiles)?;
        let (rows_dev, use_rows) = rows_table(gpu, rows)?;
        let (a, b) = ((BM * (BK + SKEW)), if nt { BN * (BK + SKEW) } else { BK * (BN + SKEW) });
        let cfg = LaunchConfig {
            grid_dim: (
                grid_dim("column tiles", n.div_ceil(BN))?,
                grid_dim("row tiles", tiles.len() / 3)?,
                1,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (2 * (a + b) * 2) as u32,
        };
        let (n_i, k_i) = (n as i32, k as i32);
        let vec_a = i32::from(k.is_multiple_of(8));
        let vec_b = i32::from(if nt { k } else { n }.is_multiple_of(8));
        let kernel = if nt { "grouped_rows_nt_bf16" } else { "grouped_rows_nn_bf16" };
        launch!(
            gpu,
            "grouped_gemm",
            kernel,
            cfg,
            &mut out,
            x,
            &rows_dev,
            &use_rows,
            &table,
            &tiles_dev,
            &n_i,
            &k_i,
            &vec_a,
            &vec_b
        )?;
    }
    drop(guards);
    Ok(Buffer { gpu: gpu.clone(), data: DeviceData::BF16(out) })
}

/// The rows of a piece of `kernels/rows_gemm.cu`'s `grouped_rows_m16_n64`, its columns a
/// block and its stages (shared memory: stages × (16 + 64) rows of BK + SKEW).
const SMALL_ROWS: usize = 16;
const SMALL_COLS: usize = 64;
const SMALL_STAGES: usize = 16;

/// [`grouped_rows`]'s decode-sized form (`nt`, 16-byte rows): experts whose runs average at
/// most 16 rows, where the 128-row tiles would spend most of their products on empty rows.
/// Each row gets the same bits (the same k order).
#[allow(clippy::too_many_arguments)]
fn small_rows(
    gpu: &Gpu,
    out: &mut CudaSlice<u16>,
    x: &CudaSlice<u16>,
    (rows, use_rows): (&CudaSlice<i32>, i32),
    table: &CudaSlice<u64>,
    tiles: &CudaSlice<i32>,
    n: usize,
    k: usize,
) -> Result<()> {
    const KERNEL: &str = "grouped_rows_m16_n64";
    let bytes = (SMALL_STAGES * (SMALL_ROWS + SMALL_COLS) * (BK + SKEW) * 2) as u32;
    // Over 48 KiB of shared memory is asked for explicitly.
    gpu.function("rows_gemm", KERNEL)?
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| driver_error(KERNEL, e))?;
    let cfg = LaunchConfig {
        grid_dim: (
            grid_dim("column tiles", n.div_ceil(SMALL_COLS))?,
            grid_dim("pieces", tiles.len() / 3)?,
            1,
        ),
        block_dim: (32, 1, 1),
        shared_mem_bytes: bytes,
    };
    let (n, k) = (n as i32, k as i32);
    launch!(gpu, "rows_gemm", KERNEL, cfg, out, x, rows, &use_rows, table, tiles, &n, &k)
}

/// `G_e += a[seg e]ᵀ · b[row(seg e)]` into each expert's f32 gradient `[m × n]`.
pub(crate) fn grouped_wgrad(
    gpu: &Arc<Gpu>,
    grads: &mut [&mut DeviceData],
    a: &DeviceData,
    b: &DeviceData,
    rows: Option<&[u32]>,
    offsets: &[u32],
    (m, n): (usize, usize),
) -> Result<()> {
    const OP: &str = "grouped_matmul_wgrad";
    let (DeviceData::BF16(a), DeviceData::BF16(b)) = (a, b) else { return Err(bf16_only(OP)) };
    let stream = gpu.stream().clone();
    let mut ptrs = Vec::with_capacity(grads.len());
    let mut guards = Vec::with_capacity(grads.len());
    for g in grads.iter_mut() {
        let DeviceData::F32(g) = g else { return Err(bf16_only(OP)) };
        let (p, guard) = g.device_ptr_mut(&stream);
        ptrs.push(p);
        guards.push(guard);
    }
    // Each expert with rows, whole.
    let segs = pieces(offsets, usize::MAX);
    if !segs.is_empty() && m > 0 && n > 0 {
        let table = upload(gpu, &ptrs)?;
        let segs_dev = upload(gpu, &segs)?;
        let (rows_dev, use_rows) = rows_table(gpu, rows)?;
        let cfg = LaunchConfig {
            grid_dim: (
                grid_dim("column tiles", n.div_ceil(BN))?,
                grid_dim("row tiles", m.div_ceil(BM))?,
                grid_dim("experts", segs.len() / 3)?,
            ),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: (2 * (BK * (BM + SKEW) + BK * (BN + SKEW)) * 2) as u32,
        };
        let (m_i, n_i) = (m as i32, n as i32);
        let (vec_a, vec_b) = (i32::from(m.is_multiple_of(8)), i32::from(n.is_multiple_of(8)));
        launch!(
            gpu,
            "grouped_gemm",
            "grouped_wgrad_bf16",
            cfg,
            &table,
            a,
            b,
            &rows_dev,
            &use_rows,
            &segs_dev,
            &m_i,
            &n_i,
            &vec_a,
            &vec_b
        )?;
    }
    drop(guards);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::pieces;

    #[test]
    fn pieces_cut_each_expert_into_tiles() {
        assert_eq!(pieces(&[0, 3, 3, 8], 4), [0, 0, 3, 2, 3, 7, 2, 7, 8]);
        assert!(pieces(&[0, 0], 4).is_empty());
        assert_eq!(pieces(&[0, 5, 9], usize::MAX), [0, 0, 5, 1, 5, 9]);
    }
}
