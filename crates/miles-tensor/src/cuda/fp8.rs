//! The FP8 kernels of `kernels/fp8.cu`: blockwise quantization of weights, per-token group
//! quantization of activations, and the blockwise-scaled product. Shapes were checked by
//! [`crate::ops::Fp8Matrix`] and [`crate::ops::fp8_linear`].

use cudarc::driver::sys::CUfunction_attribute_enum;
use cudarc::driver::{CudaSlice, LaunchConfig};

use std::sync::Arc;

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

/// How a tile of `fp8_gemm_*` (fp8.cu) is fed.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Feed {
    /// mma.sync from padded rows loaded by cp.async (any GPU from sm_89).
    MmaSync,
    /// wgmma from swizzled, 1024-aligned tiles loaded by cp.async (Hopper).
    Wgmma,
    /// wgmma from tiles loaded by TMA, a producer warpgroup beside two consumers, a
    /// one-dimensional grid walked in groups of row tiles (Hopper).
    Tma,
    /// wgmma with the operands swapped (64 weight rows against the tile's few rows of x),
    /// loaded by TMA; one block per 64 weight rows (Hopper, decode-sized products).
    Swap,
}

/// A tile shape of `fp8_gemm_*` (fp8.cu).
struct Tile {
    /// The kernels writing f32 and bf16.
    kernels: [&'static str; 2],
    rows: usize,
    cols: usize,
    threads: u32,
    stages: usize,
    feed: Feed,
}

const fn tile(
    kernels: [&'static str; 2],
    (rows, cols): (usize, usize),
    threads: u32,
    stages: usize,
    feed: Feed,
) -> Tile {
    Tile { kernels, rows, cols, threads, stages, feed }
}

const BIG: Tile =
    tile(["fp8_gemm_f32_big", "fp8_gemm_bf16_big"], (128, 128), 256, 3, Feed::MmaSync);
const M64: Tile = tile(["fp8_gemm_f32_m64", "fp8_gemm_bf16_m64"], (64, 64), 128, 6, Feed::MmaSync);
const M16: Tile = tile(["fp8_gemm_f32_m16", "fp8_gemm_bf16_m16"], (16, 64), 128, 8, Feed::MmaSync);
const WG_MID: Tile =
    tile(["fp8_gemm_f32_wg_mid", "fp8_gemm_bf16_wg_mid"], (128, 64), 256, 5, Feed::Wgmma);
/// The grouped product's tile (`fp8_grouped_*`, wg_mid's shape).
const GROUPED: Tile = tile(["fp8_grouped_f32", "fp8_grouped_bf16"], (128, 64), 256, 5, Feed::Wgmma);
const TMA: Tile = tile(["fp8_gemm_f32_tma", "fp8_gemm_bf16_tma"], (128, 128), 384, 6, Feed::Tma);
const SWAP8: Tile =
    tile(["fp8_gemm_f32_swap8", "fp8_gemm_bf16_swap8"], (8, 64), 160, 16, Feed::Swap);
const SWAP16: Tile =
    tile(["fp8_gemm_f32_swap16", "fp8_gemm_bf16_swap16"], (16, 64), 160, 16, Feed::Swap);
const SWAP32: Tile =
    tile(["fp8_gemm_f32_swap32", "fp8_gemm_bf16_swap32"], (32, 64), 160, 10, Feed::Swap);
const SWAP64: Tile =
    tile(["fp8_gemm_f32_swap64", "fp8_gemm_bf16_swap64"], (64, 64), 160, 6, Feed::Swap);

impl Tile {
    /// The kernel writing `out` (f32 or bf16).
    fn kernel(&self, out: DType) -> Result<&'static str> {
        match out {
            DType::F32 => Ok(self.kernels[0]),
            DType::BF16 => Ok(self.kernels[1]),
            other => Err(Error::DType {
                op: "fp8_linear",
                message: format!("writes f32 or bf16, not {other}"),
            }),
        }
    }

    /// Dynamic shared memory: the stages' tiles (with 1024 bytes to align wgmma's, and the TMA
    /// pipeline's two barriers a stage).
    fn shared_bytes(&self) -> usize {
        let tiles = self.stages * (self.rows + self.cols);
        match self.feed {
            Feed::MmaSync => tiles * ROW_BYTES,
            Feed::Wgmma => tiles * BLOCK + 1024,
            Feed::Tma | Feed::Swap => tiles * BLOCK + 1024 + self.stages * 16,
        }
    }

    /// The tile for `m` rows: on Hopper (compute capability 9.0, where fp8.cu is built for
    /// sm_90a) wgmma's: swapped up to 64 rows (decode), the TMA-fed one past 1024 rows;
    /// elsewhere mma.sync's, narrow ones for decode-sized products. The tiles of one family
    /// give a row the same bits (fp8.cu), so within it the choice is free.
    fn for_rows(m: usize, hopper: bool) -> &'static Tile {
        match (hopper, m) {
            (true, 0..=8) => &SWAP8,
            (true, 9..=16) => &SWAP16,
            (true, 17..=32) => &SWAP32,
            (true, 33..=64) => &SWAP64,
            (true, 65..=1024) => &WG_MID,
            (true, _) => &TMA,
            (false, 0..=16) => &M16,
            (false, 17..=64) => &M64,
            (false, _) => &BIG,
        }
    }

    /// The launch of `kernel` (one of this tile's) over `blocks`, its shared memory allowed.
    fn launch(
        &self,
        gpu: &Gpu,
        kernel: &'static str,
        blocks: (u32, u32, u32),
    ) -> Result<LaunchConfig> {
        let bytes = self.shared_bytes();
        gpu.function("fp8", kernel)?
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| driver_error(kernel, e))?;
        Ok(LaunchConfig {
            grid_dim: blocks,
            block_dim: (self.threads, 1, 1),
            shared_mem_bytes: bytes as u32,
        })
    }

    /// The launch grid: one block a tile, but at most one an SM for the TMA tile, whose
    /// blocks then walk the tiles (its producer loads the next tile while the consumers store).
    fn grid(&self, m: usize, n: usize, sms: u32) -> Result<(u32, u32, u32)> {
        const OP: &str = "fp8_linear";
        let (rows, cols) = (m.div_ceil(self.rows), n.div_ceil(self.cols));
        let tiles = || {
            u32::try_from(rows * cols).map_err(|_| Error::Shape {
                op: OP,
                message: format!("{rows} × {cols} tiles: at most 2^32"),
            })
        };
        Ok(match self.feed {
            Feed::Tma => (tiles()?.min(sms), 1, 1),
            Feed::Swap => (tiles()?, 1, 1),
            _ => (grid(OP, "row tiles", rows)?, grid(OP, "column tiles", cols)?, 1),
        })
    }
}

/// A TMA descriptor of a `[rows × k]` matrix of codes, read as boxes of `box_rows` × 128
/// bytes in the 128-byte swizzle (fp8.cu's `TensorMap`), zeros outside.
#[repr(transparent)]
struct TensorMap(cudarc::driver::sys::CUtensorMap);

// SAFETY: plain bytes, passed by value as a `__grid_constant__` kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for TensorMap {}

impl TensorMap {
    const fn zeroed() -> Self {
        TensorMap(cudarc::driver::sys::CUtensorMap { opaque: [0; 16] })
    }

    fn codes(
        gpu: &Gpu,
        codes: &CudaSlice<u8>,
        rows: usize,
        k: usize,
        box_rows: usize,
    ) -> Result<Self> {
        use cudarc::driver::sys::CUtensorMapSwizzle as S;
        use cudarc::driver::sys::{
            self, CUtensorMapDataType as D, CUtensorMapFloatOOBfill as Fill,
        };
        use cudarc::driver::sys::{CUtensorMapInterleave as I, CUtensorMapL2promotion as L2};
        let (ptr, _sync) = cudarc::driver::DevicePtr::device_ptr(codes, gpu.stream());
        let dims = [k as u64, rows as u64];
        let strides = [k as u64];
        let boxes = [BLOCK as u32, box_rows as u32];
        let elements = [1u32, 1];
        let mut map = std::mem::MaybeUninit::<sys::CUtensorMap>::zeroed();
        // SAFETY: every pointer is to a live local array of the rank's length; the address is
        // the device allocation's, 256-aligned, and k (the row stride) a multiple of 16.
        let status = unsafe {
            sys::cuTensorMapEncodeTiled(
                map.as_mut_ptr(),
                D::CU_TENSOR_MAP_DATA_TYPE_UINT8,
                2,
                ptr as *mut std::ffi::c_void,
                dims.as_ptr(),
                strides.as_ptr(),
                boxes.as_ptr(),
                elements.as_ptr(),
                I::CU_TENSOR_MAP_INTERLEAVE_NONE,
                S::CU_TENSOR_MAP_SWIZZLE_128B,
                L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                Fill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
            )
        };
        status.result().map_err(|e| driver_error("fp8_linear: cuTensorMapEncodeTiled", e))?;
        // SAFETY: written by the successful call above.
        Ok(TensorMap(unsafe { map.assume_init() }))
    }
}

/// One to three weights of [`gemm_many`] for the swapped tiles (fp8.cu's `Parts`, by value).
#[repr(C, align(128))]
struct Parts {
    w: [TensorMap; 3],
    ws: [u64; 3],
    y: [u64; 3],
    n: [i32; 3],
    count: i32,
}

// SAFETY: plain bytes laid out as fp8.cu's `Parts`, passed by value as a `__grid_constant__`
// kernel parameter.
unsafe impl cudarc::driver::DeviceRepr for Parts {}

/// A quantized weight: codes `[n × k]`, scales, and `n`.
pub(crate) type Weight<'a> = (&'a CudaSlice<u8>, &'a CudaSlice<f32>, usize);

/// One launch of a swapped tile over one to three weights (with their outputs) of x.
fn swapped(
    gpu: &Gpu,
    (tile, kernel): (&Tile, &'static str),
    (xq, xs): (&CudaSlice<u8>, &CudaSlice<f32>),
    weights: Vec<(&Weight, &mut DeviceData)>,
    (m, k): (usize, usize),
) -> Result<()> {
    use cudarc::driver::{DevicePtr, DevicePtrMut};
    let stream = gpu.stream().clone();
    let mut parts = Parts {
        w: [const { TensorMap::zeroed() }; 3],
        ws: [0; 3],
        y: [0; 3],
        n: [0; 3],
        count: weights.len() as i32,
    };
    let (mut ws_guards, mut y_guards) = (Vec::new(), Vec::new());
    let mut tiles = 0;
    for (slot, (&(wq, ws, n), y)) in weights.into_iter().enumerate() {
        parts.w[slot] = TensorMap::codes(gpu, wq, n, k, tile.cols)?;
        let (ws_ptr, g) = ws.device_ptr(&stream);
        ws_guards.push(g);
        let (y_ptr, g) = match y {
            DeviceData::F32(y) => y.device_ptr_mut(&stream),
            DeviceData::BF16(y) => y.device_ptr_mut(&stream),
            _ => unreachable!("gemm_many allocates f32 or bf16"),
        };
        y_guards.push(g);
        parts.ws[slot] = ws_ptr;
        parts.y[slot] = y_ptr;
        parts.n[slot] = n as i32;
        tiles += n.div_ceil(tile.cols);
    }
    let cfg = tile.launch(gpu, kernel, (grid("fp8_linear", "column tiles", tiles)?, 1, 1))?;
    let xmap = TensorMap::codes(gpu, xq, m, k, tile.rows)?;
    let (mi, ki) = (m as i32, k as i32);
    launch!(gpu, "fp8", kernel, cfg, &parts, &xmap, xs, &mi, &ki)?;
    drop((ws_guards, y_guards));
    Ok(())
}

/// `y = x · wᵀ` for each weight `w` (`[n × k]` codes with their scales) from one quantized x
/// `[m × k]`, each `[m × n]` in `out` (f32 or bf16). Decode-sized products on Hopper run in one
/// launch (the swapped tiles walk every weight's column tiles), others one launch a weight;
/// either way each output has its own product's bits.
pub(crate) fn gemm_many(
    gpu: &Gpu,
    (xq, xs): (&CudaSlice<u8>, &CudaSlice<f32>),
    weights: &[Weight],
    (m, k): (usize, usize),
    out: DType,
) -> Result<Vec<DeviceData>> {
    const OP: &str = "fp8_linear";
    if !k.is_multiple_of(16) {
        return Err(Error::Shape {
            op: OP,
            message: format!("the input width {k} must be a multiple of 16 on CUDA"),
        });
    }
    let facts = facts(gpu)?;
    let tile = Tile::for_rows(m, facts.capability == (9, 0));
    let kernel = tile.kernel(out)?;
    let mut ys = weights
        .iter()
        .map(|&(_, _, n)| {
            let len = (m * n).max(1);
            Ok(match out {
                DType::F32 => DeviceData::F32(gpu.alloc::<f32>(len)?),
                _ => DeviceData::BF16(gpu.alloc::<u16>(len)?),
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if m == 0 {
        return Ok(ys);
    }
    if tile.feed == Feed::Swap {
        for (chunk, ys) in weights.chunks(3).zip(ys.chunks_mut(3)) {
            let live: Vec<_> = chunk.iter().zip(ys.iter_mut()).filter(|(w, _)| w.2 > 0).collect();
            if !live.is_empty() {
                swapped(gpu, (tile, kernel), (xq, xs), live, (m, k))?;
            }
        }
        return Ok(ys);
    }
    let (mi, ki) = (m as i32, k as i32);
    for (&(wq, ws, n), y) in weights.iter().zip(&mut ys) {
        if n == 0 {
            continue;
        }
        let cfg = tile.launch(gpu, kernel, tile.grid(m, n, facts.sms)?)?;
        let ni = n as i32;
        macro_rules! go {
            ($y:expr) => {
                match tile.feed {
                    Feed::Tma => {
                        let xmap = TensorMap::codes(gpu, xq, m, k, tile.rows)?;
                        let wmap = TensorMap::codes(gpu, wq, n, k, tile.cols)?;
                        launch!(gpu, "fp8", kernel, cfg, $y, &xmap, xs, &wmap, ws, &mi, &ni, &ki)
                    }
                    _ => launch!(gpu, "fp8", kernel, cfg, $y, xq, xs, wq, ws, &mi, &ni, &ki),
                }
            };
        }
        match y {
            DeviceData::F32(y) => go!(y)?,
            DeviceData::BF16(y) => go!(y)?,
            _ => unreachable!("allocated as f32 or bf16 above"),
        }
    }
    Ok(ys)
}

/// The experts' products over sorted rows (`ops::fp8_grouped_linear`): `fp8_grouped_*` on
/// pieces of at most 128 rows of one expert, 64 columns a block (the wgmma family, so each row
/// has the dense product's bits); Hopper only.
pub(crate) fn grouped(
    gpu: &Arc<Gpu>,
    (xq, xs): (&CudaSlice<u8>, &CudaSlice<f32>),
    rows: Option<&[u32]>,
    offsets: &[u32],
    experts: &[(&CudaSlice<u8>, &CudaSlice<f32>)],
    (n, k): (usize, usize),
    out: DType,
) -> Result<DeviceData> {
    use super::grouped::{pieces, upload};
    use cudarc::driver::DevicePtr;
    const OP: &str = "fp8_grouped_linear";
    if !k.is_multiple_of(16) || capability(gpu)? != (9, 0) {
        return Err(Error::Shape {
            op: OP,
            message: format!("runs on Hopper (sm_90) with widths a multiple of 16, not {k}"),
        });
    }
    let total = offsets.last().copied().unwrap_or(0) as usize;
    let len = (total * n).max(1);
    let mut y = match out {
        DType::F32 => DeviceData::F32(gpu.alloc::<f32>(len)?),
        DType::BF16 => DeviceData::BF16(gpu.alloc::<u16>(len)?),
        other => {
            return Err(Error::DType {
                op: OP,
                message: format!("writes f32 or bf16, not {other}"),
            });
        }
    };
    let tiles = pieces(offsets, GROUPED.rows);
    if tiles.is_empty() || n == 0 {
        return Ok(y);
    }
    let stream = gpu.stream().clone();
    let (mut codes, mut scales, mut guards) = (Vec::new(), Vec::new(), Vec::new());
    for (wq, ws) in experts {
        let (c, gc) = wq.device_ptr(&stream);
        let (s, gs) = ws.device_ptr(&stream);
        codes.push(c);
        scales.push(s);
        guards.push((gc, gs));
    }
    let (codes, scales) = (upload(gpu, &codes)?, upload(gpu, &scales)?);
    let pieces_dev = upload(gpu, &tiles)?;
    // The gather's address, or null: x's own rows (fp8.cu's `Rows`).
    let gather_rows = match rows {
        Some(r) => Some(upload(gpu, &r.iter().map(|&x| x as i32).collect::<Vec<_>>())?),
        None => None,
    };
    let (gather, gather_guard) = match &gather_rows {
        Some(g) => {
            let (p, guard) = g.device_ptr(&stream);
            (p, Some(guard))
        }
        None => (0, None),
    };
    let kernel = GROUPED.kernel(out)?;
    let blocks = (
        grid(OP, "column tiles", n.div_ceil(GROUPED.cols))?,
        grid(OP, "row pieces", tiles.len() / 3)?,
        1,
    );
    let cfg = GROUPED.launch(gpu, kernel, blocks)?;
    let (ni, ki) = (n as i32, k as i32);
    macro_rules! go {
        ($y:expr) => {
            launch!(
                gpu,
                "fp8",
                kernel,
                cfg,
                $y,
                xq,
                xs,
                &gather,
                &pieces_dev,
                &codes,
                &scales,
                &ni,
                &ki
            )
        };
    }
    match &mut y {
        DeviceData::F32(y) => go!(y)?,
        DeviceData::BF16(y) => go!(y)?,
        _ => unreachable!("allocated as f32 or bf16 above"),
    }
    drop((guards, gather_guard));
    Ok(y)
}

/// What the kernels' choice depends on: the compute capability `(major, minor)` and the
/// number of SMs (a persistent grid's size).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Facts {
    pub capability: (i32, i32),
    pub sms: u32,
}

/// The device's [`Facts`] (asked once).
fn facts(gpu: &Gpu) -> Result<Facts> {
    use cudarc::driver::sys::CUdevice_attribute as A;
    if let Some(&f) = gpu.facts.get() {
        return Ok(f);
    }
    let ctx = gpu.stream().context();
    let get = |a| ctx.attribute(a).map_err(|e| driver_error("device attributes", e));
    let f = Facts {
        capability: (
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
            get(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
        ),
        sms: get(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(1) as u32,
    };
    Ok(*gpu.facts.get_or_init(|| f))
}

/// The device's count of streaming multiprocessors.
pub(crate) fn sm_count(gpu: &Gpu) -> Result<u32> {
    Ok(facts(gpu)?.sms)
}

/// The device's compute capability, `(major, minor)`.
pub(crate) fn capability(gpu: &Gpu) -> Result<(i32, i32)> {
    Ok(facts(gpu)?.capability)
}
