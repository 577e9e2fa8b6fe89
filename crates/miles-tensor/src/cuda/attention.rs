//! Varlen causal GQA attention: the forward (output and log-sum-exp) and the backward (dq, dk,
//! dv). bf16 at head sizes that are multiples of 16 up to 256 runs on the tensor cores
//! (`kernels/attention_mma.cu`); f32 and other head sizes on `kernels/attention.cu`. Shapes
//! were checked by [`crate::ops`].

use std::sync::Arc;

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Buffer, DeviceData, Float, Gpu, driver_error};
use crate::cpu::attention::{QUERY_BLOCK, tiles};
use crate::cpu::{AttentionShape, PagedLayout, PagedRows, Scores};
use crate::{Error, Result};

/// Threads per block of the tile kernels (8 warps; 4 for the tensor-core ones), and the
/// kernels' own constants.
const THREADS: u32 = 256;
const MMA_THREADS: u32 = 128;
/// Query rows per step of the tensor-core dk/dv kernel, and the padding of its shared rows.
const MMA_QUERY_CHUNK: usize = 32;
const MMA_SKEW: usize = 8;
const KEY_BLOCK: usize = crate::cpu::KEY_BLOCK;
const WARPS: usize = 8;
const PAIRS: usize = 16;
/// The tile kernels keep two groups of 4 consecutive dimensions per lane (so head_dim is a
/// multiple of 4 up to 256).
pub(crate) const MAX_HEAD_DIM: usize = 256;
/// Padding of a key row in shared memory (floats).
const PAD: usize = 4;

/// The kernels' `(scale, cap, window)` arguments: a cap or window of 0 is none.
fn scoring(s: &Scores) -> (f32, f32, i32) {
    let window = s.window.map_or(0, |w| w.min(i32::MAX as usize) as i32);
    (s.scale, s.softcap.unwrap_or(0.0), window)
}

/// `[sequence start, sequence end, tile start]` per tile of `block` rows, on the device.
fn tile_table(gpu: &Gpu, cu_seqlens: &[usize], block: usize) -> Result<(CudaSlice<i32>, u32)> {
    let list = tiles(cu_seqlens, block);
    let flat: Vec<i32> =
        list.iter().flat_map(|&(a, b, s, _)| [a as i32, b as i32, s as i32]).collect();
    let table = gpu.stream().clone_htod(&flat).map_err(|e| driver_error("copy to device", e))?;
    Ok((table, list.len() as u32))
}

/// The tensor-core kernels' name suffix for this head size, if they cover it.
/// `prefix_d{D}`: the tensor-core kernel of head size `D`, for every `D` that
/// `kernels/attention_mma.cu` instantiates (the multiples of 16 up to 256).
macro_rules! by_head_dim {
    ($d:expr, $prefix:literal) => {
        match $d {
            16 => Some(concat!($prefix, "_d16")),
            32 => Some(concat!($prefix, "_d32")),
            48 => Some(concat!($prefix, "_d48")),
            64 => Some(concat!($prefix, "_d64")),
            80 => Some(concat!($prefix, "_d80")),
            96 => Some(concat!($prefix, "_d96")),
            112 => Some(concat!($prefix, "_d112")),
            128 => Some(concat!($prefix, "_d128")),
            144 => Some(concat!($prefix, "_d144")),
            160 => Some(concat!($prefix, "_d160")),
            176 => Some(concat!($prefix, "_d176")),
            192 => Some(concat!($prefix, "_d192")),
            208 => Some(concat!($prefix, "_d208")),
            224 => Some(concat!($prefix, "_d224")),
            240 => Some(concat!($prefix, "_d240")),
            256 => Some(concat!($prefix, "_d256")),
            _ => None,
        }
    };
}

/// Whether the tensor-core kernels take head size `d`.
pub(crate) fn mma_head_dim(d: usize) -> bool {
    by_head_dim!(d, "").is_some()
}

/// Bytes of shared memory of `rows` padded bf16 rows of the tensor-core kernels.
fn mma_rows_bytes(rows: usize, d: usize) -> usize {
    rows * (d + MMA_SKEW) * 2
}

/// The launch shape over `(tiles, heads)` with `bytes` of dynamic shared memory, raising the
/// kernel's shared-memory limit when it needs more than the default 48 KiB.
fn launch_with(
    gpu: &Gpu,
    module: &'static str,
    module_kernel: &'static str,
    (tiles, heads): (u32, usize),
    threads: u32,
    bytes: usize,
) -> Result<LaunchConfig> {
    let bytes = bytes as u32;
    let f = gpu.function(module, module_kernel)?;
    f.set_attribute(
        CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        bytes as i32,
    )
    .map_err(|e| driver_error(module_kernel, e))?;
    Ok(LaunchConfig {
        grid_dim: (tiles, heads as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: bytes,
    })
}

/// A pass of the varlen attention.
#[derive(Clone, Copy)]
enum Pass {
    Forward,
    Dq,
    Dkdv,
}

/// `(module, kernel, launch)` of a pass over the `(tiles, heads)` grid: the tensor-core kernel
/// for bf16 at the head sizes it is built for, else the tile kernel. Both take the same
/// arguments.
fn pass_launch(
    gpu: &Gpu,
    f: Float,
    pass: Pass,
    d: usize,
    (tiles, heads): (u32, usize),
) -> Result<(&'static str, &'static str, LaunchConfig)> {
    let mma = match pass {
        Pass::Forward => by_head_dim!(d, "attention_mma_forward"),
        Pass::Dq => by_head_dim!(d, "attention_mma_dq"),
        Pass::Dkdv => by_head_dim!(d, "attention_mma_dkdv"),
    };
    if let (Float::BF16, Some(name)) = (f, mma) {
        // Shared rows: the queries (and dO), and two buffers of a key block's keys and values;
        // for dk/dv the block's keys and values, and two buffers of a query chunk's queries,
        // dO, lse and delta.
        let (rows, extra) = match pass {
            Pass::Forward => (QUERY_BLOCK + 4 * KEY_BLOCK, 0),
            Pass::Dq => (2 * QUERY_BLOCK + 4 * KEY_BLOCK, 0),
            Pass::Dkdv => (2 * KEY_BLOCK + 4 * MMA_QUERY_CHUNK, 4 * MMA_QUERY_CHUNK * 4),
        };
        let bytes = mma_rows_bytes(rows, d) + extra;
        let cfg = launch_with(gpu, "attention_mma", name, (tiles, heads), MMA_THREADS, bytes)?;
        return Ok(("attention_mma", name, cfg));
    }
    let (name, floats) = match pass {
        Pass::Forward => {
            (kernel!(f, "attention_forward"), KEY_BLOCK * (d + PAD) + KEY_BLOCK * d + WARPS * d)
        }
        Pass::Dq => (kernel!(f, "attention_dq"), 2 * KEY_BLOCK * (d + PAD) + WARPS * 2 * d),
        Pass::Dkdv => (
            kernel!(f, "attention_dkdv"),
            2 * KEY_BLOCK * (d + PAD) + 2 * PAIRS * d + 2 * PAIRS * KEY_BLOCK,
        ),
    };
    let cfg = launch_with(gpu, "attention", name, (tiles, heads), THREADS, floats * 4)?;
    Ok(("attention", name, cfg))
}

/// `(out, lse)`: out like q, lse `[tokens × q_heads]` f32.
pub(crate) fn attention_forward(
    gpu: &Arc<Gpu>,
    q: &DeviceData,
    k: &DeviceData,
    v: &DeviceData,
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<(Buffer, Buffer)> {
    let AttentionShape { q_heads, kv_heads, head_dim: d, scores } = shape;
    let tokens = *cu_seqlens.last().unwrap_or(&0);
    let mut lse = gpu.alloc::<f32>(tokens * q_heads)?;
    let (table, n) = tile_table(gpu, cu_seqlens, QUERY_BLOCK)?;
    let (qh, kvh, di) = (q_heads as i32, kv_heads as i32, d as i32);
    let (scale, cap, window) = scoring(&scores);
    let out = per_float!("attention", (q, k, v), |T, f| {
        let mut out = gpu.alloc::<T>(q.len())?;
        if n > 0 {
            let (module, name, cfg) = pass_launch(gpu, f, Pass::Forward, d, (n, q_heads))?;
            launch!(
                gpu, module, name, cfg, &mut out, &mut lse, q, k, v, &table, &qh, &kvh, &di,
                &scale, &cap, &window
            )?;
        }
        DeviceData::from(out)
    });
    let wrap = |data| Buffer { gpu: gpu.clone(), data };
    Ok((wrap(out), wrap(DeviceData::F32(lse))))
}

/// `(dq, dk, dv)` of [`attention_forward`] from `d_out` and the forward's `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention_backward(
    gpu: &Arc<Gpu>,
    d_out: &DeviceData,
    q: &DeviceData,
    k: &DeviceData,
    v: &DeviceData,
    out: &DeviceData,
    lse: &CudaSlice<f32>,
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<(Buffer, Buffer, Buffer)> {
    let AttentionShape { q_heads, kv_heads, head_dim: d, scores } = shape;
    let tokens = *cu_seqlens.last().unwrap_or(&0);
    let rows = tokens * q_heads;
    let mut delta = gpu.alloc::<f32>(rows)?;
    let (q_table, nq) = tile_table(gpu, cu_seqlens, QUERY_BLOCK)?;
    let (k_table, nk) = tile_table(gpu, cu_seqlens, KEY_BLOCK)?;
    let (qh, kvh, di) = (q_heads as i32, kv_heads as i32, d as i32);
    let (scale, cap, window) = scoring(&scores);
    let rows_l = rows as i64;
    // One warp per (token, head) row for delta.
    let delta_cfg = LaunchConfig {
        grid_dim: (rows.div_ceil(8).clamp(1, 132 * 32) as u32, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let (dq, dk, dv) = per_float!("attention_backward", (d_out, q, k, v, out), |T, f| {
        let (mut dq, mut dk, mut dv) =
            (gpu.alloc::<T>(q.len())?, gpu.alloc::<T>(k.len())?, gpu.alloc::<T>(v.len())?);
        if rows > 0 {
            let name = kernel!(f, "attention_delta");
            launch!(gpu, "attention", name, delta_cfg, &mut delta, d_out, out, &rows_l, &di)?;
            let (module, name, cfg) = pass_launch(gpu, f, Pass::Dq, d, (nq, q_heads))?;
            launch!(
                gpu, module, name, cfg, &mut dq, d_out, q, k, v, lse, &delta, &q_table, &qh, &kvh,
                &di, &scale, &cap, &window
            )?;
            let (module, name, cfg) = pass_launch(gpu, f, Pass::Dkdv, d, (nk, kv_heads))?;
            launch!(
                gpu, module, name, cfg, &mut dk, &mut dv, d_out, q, k, v, lse, &delta, &k_table,
                &qh, &kvh, &di, &scale, &cap, &window
            )?;
        }
        (DeviceData::from(dq), DeviceData::from(dk), DeviceData::from(dv))
    });
    let wrap = |data| Buffer { gpu: gpu.clone(), data };
    Ok((wrap(dq), wrap(dk), wrap(dv)))
}

/// A paged step's tiles, block tables and write slots on the device.
pub(crate) struct PagedPlanDevice {
    /// [first query row, rows, position of the first, table offset] per tile.
    tiles: CudaSlice<i32>,
    count: u32,
    tables: CudaSlice<i32>,
    /// [block, slot] per row.
    slots: CudaSlice<i32>,
    rows: u32,
    /// (stride, scratch block) of a fixed-capacity decode plan.
    decode: Option<(usize, u32)>,
    /// Every tile is one query row (a decode step): the one-warp decode kernel applies.
    single_rows: bool,
}

/// Cuts each sequence's rows into tiles of at most a query block, at multiples of the block in
/// position, and uploads them with the block tables and each row's (block, slot).
pub(crate) fn paged_plan(gpu: &Arc<Gpu>, seqs: &[PagedRows]) -> Result<PagedPlanDevice> {
    let (mut tiles, mut tables, mut slots) = (Vec::new(), Vec::new(), Vec::new());
    let mut row = 0;
    for s in seqs {
        let offset = tables.len() as i32;
        tables.extend(s.table.iter().map(|&b| b as i32));
        let mut p = s.pos0;
        while p < s.pos0 + s.n {
            let end = (p / QUERY_BLOCK + 1) * QUERY_BLOCK;
            let n = end.min(s.pos0 + s.n) - p;
            tiles.extend([(row + p - s.pos0) as i32, n as i32, p as i32, offset]);
            p += n;
        }
        for p in s.pos0..s.pos0 + s.n {
            slots.extend([s.table[p / KEY_BLOCK] as i32, (p % KEY_BLOCK) as i32]);
        }
        row += s.n;
    }
    // Never empty: a zero-length upload is refused.
    let upload = |mut v: Vec<i32>| {
        if v.is_empty() {
            v.push(0);
        }
        gpu.stream().clone_htod(&v).map_err(|e| driver_error("copy to device", e))
    };
    let single_rows = tiles.chunks(4).all(|t| t[1] == 1);
    Ok(PagedPlanDevice {
        single_rows,
        count: (tiles.len() / 4) as u32,
        tiles: upload(tiles)?,
        tables: upload(tables)?,
        slots: upload(slots)?,
        rows: row as u32,
        decode: None,
    })
}

/// Buffers for `rows` decode rows, tables of `stride` blocks, one more table entry holding
/// the scratch block; every row starts as padding.
pub(crate) fn paged_decode_plan(
    gpu: &Arc<Gpu>,
    rows: usize,
    stride: usize,
    scratch: u32,
) -> Result<PagedPlanDevice> {
    let pad = (rows * stride) as i32;
    let tiles: Vec<i32> = (0..rows as i32).flat_map(|r| [r, 1, 0, pad]).collect();
    let mut tables = vec![0i32; rows * stride + 1];
    tables[rows * stride] = scratch as i32;
    let slots: Vec<i32> = (0..rows).flat_map(|_| [scratch as i32, 0]).collect();
    let upload =
        |v: &[i32]| gpu.stream().clone_htod(v).map_err(|e| driver_error("copy to device", e));
    Ok(PagedPlanDevice {
        tiles: upload(&tiles)?,
        count: rows as u32,
        tables: upload(&tables)?,
        slots: upload(&slots)?,
        rows: rows as u32,
        decode: Some((stride, scratch)),
        single_rows: true,
    })
}

/// Writes one step's decode rows into a decode plan's buffers (in place; checked by the op).
pub(crate) fn load_decode_plan(plan: &mut PagedPlanDevice, seqs: &[PagedRows]) -> Result<()> {
    let (stride, scratch) = plan.decode.expect("a decode plan (checked by the op)");
    let rows = plan.rows as usize;
    let pad = (rows * stride) as i32;
    let mut tiles = Vec::with_capacity(rows * 4);
    let mut tables = vec![0i32; seqs.len() * stride];
    let mut slots = Vec::with_capacity(rows * 2);
    for (r, s) in seqs.iter().enumerate() {
        tiles.extend([r as i32, 1, s.pos0 as i32, (r * stride) as i32]);
        for (b, &id) in s.table.iter().enumerate() {
            tables[r * stride + b] = id as i32;
        }
        slots.extend([s.table[s.pos0 / KEY_BLOCK] as i32, (s.pos0 % KEY_BLOCK) as i32]);
    }
    for r in seqs.len()..rows {
        tiles.extend([r as i32, 1, 0, pad]);
        slots.extend([scratch as i32, 0]);
    }
    let stream = plan.tiles.stream().clone();
    let err = |e| driver_error("copy to device", e);
    stream.memcpy_htod(&tiles, &mut plan.tiles).map_err(err)?;
    stream.memcpy_htod(&slots, &mut plan.slots).map_err(err)?;
    if !tables.is_empty() {
        let mut view = plan.tables.slice_mut(..tables.len());
        stream.memcpy_htod(&tables, &mut view).map_err(err)?;
    }
    Ok(())
}

impl PagedPlanDevice {
    /// [block, slot] per row, for kernels that write the cache.
    pub(crate) fn slots(&self) -> &CudaSlice<i32> {
        &self.slots
    }
}

/// [`crate::ops::paged_kv_write`]: one block per (row, kv head).
pub(crate) fn paged_kv_write(
    gpu: &Arc<Gpu>,
    cache: &mut DeviceData,
    k: &DeviceData,
    v: &DeviceData,
    plan: &PagedPlanDevice,
    layer: usize,
    layout: PagedLayout,
) -> Result<()> {
    if plan.rows == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (plan.rows, layout.kv_heads as u32, 1),
        block_dim: (layout.head_dim.min(128) as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (layer, layers) = (layer as i32, layout.layers as i32);
    let (kvh, d) = (layout.kv_heads as i32, layout.head_dim as i32);
    per_float!("paged_kv_write", (cache, k, v), |T, f| {
        let name = kernel!(f, "paged_kv_write");
        launch!(gpu, "paged", name, cfg, cache, k, v, &plan.slots, &layer, &layers, &kvh, &d)
    })
}

/// `(out, lse)` of [`crate::ops::paged_attention`]: bf16 at the tensor-core head sizes only.
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_attention(
    gpu: &Arc<Gpu>,
    q: &DeviceData,
    cache: &DeviceData,
    layer: usize,
    plan: &PagedPlanDevice,
    q_heads: usize,
    layout: PagedLayout,
    scores: &Scores,
) -> Result<(Buffer, Buffer)> {
    let d = layout.head_dim;
    let (DeviceData::BF16(q), DeviceData::BF16(cache), true) = (q, cache, mma_head_dim(d)) else {
        return Err(Error::DType {
            op: "paged_attention",
            message: format!(
                "the paged attention on CUDA runs in bf16 at head sizes that are multiples of 16 \
                 up to 256, not {} at {d}",
                if matches!(q, DeviceData::F32(_)) { "f32" } else { "this dtype" }
            ),
        });
    };
    let mut out = gpu.alloc::<u16>(q.len())?;
    let mut lse = gpu.alloc::<f32>(plan.rows as usize * q_heads)?;
    if plan.count > 0 {
        // A decode step takes one warp per (row, kv head) with the group's heads as its rows.
        let decode = plan.single_rows && q_heads / layout.kv_heads <= 16;
        let cfg = if decode {
            let name = by_head_dim!(d, "attention_decode_paged").expect("checked above");
            let bytes = mma_rows_bytes(16 + 4 * KEY_BLOCK, d);
            (
                name,
                launch_with(gpu, "attention_mma", name, (plan.count, layout.kv_heads), 32, bytes)?,
            )
        } else {
            let name = by_head_dim!(d, "attention_mma_paged").expect("checked above");
            let bytes = mma_rows_bytes(QUERY_BLOCK + 4 * KEY_BLOCK, d);
            (
                name,
                launch_with(gpu, "attention_mma", name, (plan.count, q_heads), MMA_THREADS, bytes)?,
            )
        };
        let (name, cfg) = cfg;
        let (layer, layers) = (layer as i32, layout.layers as i32);
        let (qh, kvh) = (q_heads as i32, layout.kv_heads as i32);
        let (scale, cap, window) = scoring(scores);
        launch!(
            gpu,
            "attention_mma",
            name,
            cfg,
            &mut out,
            &mut lse,
            q,
            cache,
            &plan.tiles,
            &plan.tables,
            &layer,
            &layers,
            &qh,
            &kvh,
            &scale,
            &cap,
            &window
        )?;
    }
    let wrap = |data| Buffer { gpu: gpu.clone(), data };
    Ok((wrap(DeviceData::BF16(out)), wrap(DeviceData::F32(lse))))
}
