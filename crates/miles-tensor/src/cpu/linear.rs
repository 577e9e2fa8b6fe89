//! The forward of a linear layer, `y = x·Wᵀ`, computed so that every output element is one
//! fused multiply-add chain over `k = 0..d_in` ascending, starting from `0.0`: the bits of
//! `y[i][j]` depend on row `i` of `x` and row `j` of `W` only, never on how many rows are in the
//! call, which other rows, the thread count or the instruction set. Decode (one row per sequence)
//! and prefill (hundreds of rows) therefore produce the same logits for the same token.
//!
//! [`linear_reference`] is the definition. The fast path vectorizes across output columns: `W`
//! is packed once into panels of 16 outputs, k-major (`panel[k][lane]`, one cache line), the
//! last panel padded with zeros; a micro-kernel broadcasts `x[i][k]`, loads a panel row and
//! fuses it into per-(row, panel) accumulators, so each lane is exactly the scalar chain of its
//! output and no kernel, tile shape or split can reorder it:
//!
//! - tiles: AVX-512 takes all the rows of a decode call (≤ 8) in one tile as wide as 24–28
//!   accumulators allow (1×8 panels … 8×3), so the weights are read once; more rows use 8×3.
//!   AVX2 uses 1×4, 2×3, 3×2 and 6×1 panels (two registers per panel); the portable kernel
//!   (`f32::mul_add`, which the compiler vectorizes) 4 rows × 1 panel.
//! - k blocks: with more rows than one tile, a pass covers only the `k` steps whose panel rows
//!   fit in half of L1, for every row tile of the block; between passes the accumulators wait in
//!   `y`, which changes no bit.
//! - threads: tasks are (≤ 96-row block) × (run of panels), at least 8 per thread, run by
//!   rayon above 2¹⁸ multiply-adds; every output belongs to one task.

use rayon::prelude::*;

use crate::{Result, ensure};

/// Output columns per packed panel: one AVX-512 register, two AVX2 registers.
const PANEL: usize = 16;

/// Products below this many multiply-adds run on the calling thread: spawning costs more.
const PARALLEL_MIN_FMAS: usize = 1 << 18;

/// Rows per task when the call has many rows: the rows of `x` a task reads stay in L2 while it
/// sweeps its panels.
const ROW_BLOCK: usize = 96;

/// Bytes of panel rows per pass when a call has more rows than one micro-tile: the `k` steps of
/// one tile's columns that fit stay in L1 (half of a 48 KiB L1d) while every row tile uses them.
const K_BLOCK_BYTES: usize = 24 << 10;

/// One packed panel row: [`PANEL`] consecutive outputs at one `k`, aligned to a cache line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Lanes([f32; PANEL]);

/// Weights `[d_out × d_in]` (HF Linear layout), repacked once for [`linear_forward`].
#[derive(Clone)]
pub struct PackedLinear {
    d_out: usize,
    d_in: usize,
    /// `d_out.div_ceil(PANEL)` panels of `d_in` rows each: `panels[p * d_in + k].0[l]` is
    /// `w[(p * PANEL + l) * d_in + k]`, zero past `d_out`.
    panels: Vec<Lanes>,
}

impl std::fmt::Debug for PackedLinear {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PackedLinear")
            .field("d_out", &self.d_out)
            .field("d_in", &self.d_in)
            .field("panels", &self.panel_count())
            .finish()
    }
}

impl PackedLinear {
    pub fn new(w: &[f32], d_out: usize, d_in: usize) -> Result<PackedLinear> {
        ensure(d_out > 0 && d_in > 0 && w.len() == d_out * d_in, "linear pack", || {
            format!("w {} for d_out {d_out} d_in {d_in} (both must be at least 1)", w.len())
        })?;
        let panel_count = d_out.div_ceil(PANEL);
        // Each packed row reads 16 rows of `w` side by side (16 sequential streams). Weights are
        // repacked after every optimizer step, so large ones spread the copy over the threads.
        let lanes_at = |i: usize| {
            let (p, k) = (i / d_in, i % d_in);
            Lanes(std::array::from_fn(|l| {
                let j = p * PANEL + l;
                if j < d_out { w[j * d_in + k] } else { 0.0 }
            }))
        };
        let panels: Vec<Lanes> = if w.len() >= PARALLEL_MIN_FMAS {
            (0..panel_count * d_in).into_par_iter().map(lanes_at).collect()
        } else {
            (0..panel_count * d_in).map(lanes_at).collect()
        };
        Ok(PackedLinear { d_out, d_in, panels })
    }

    pub fn d_in(&self) -> usize {
        self.d_in
    }

    pub fn d_out(&self) -> usize {
        self.d_out
    }

    fn panel_count(&self) -> usize {
        self.d_out.div_ceil(PANEL)
    }
}

/// The definition every path must equal bit for bit: `y[i][j]` is the fold over `k = 0..d_in`
/// ascending of `acc = x[i][k].mul_add(w[j][k], acc)` from `acc = 0.0`. `w` is `[d_out × d_in]`.
pub fn linear_reference(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    rows: usize,
    d_in: usize,
    d_out: usize,
) -> Result<()> {
    ensure(
        x.len() == rows * d_in && w.len() == d_out * d_in && y.len() == rows * d_out,
        "linear_reference",
        || {
            format!(
                "x {} w {} y {} for rows {rows} d_in {d_in} d_out {d_out}",
                x.len(),
                w.len(),
                y.len()
            )
        },
    )?;
    for i in 0..rows {
        let xi = &x[i * d_in..][..d_in];
        for j in 0..d_out {
            let wj = &w[j * d_in..][..d_in];
            y[i * d_out + j] = xi.iter().zip(wj).fold(0.0f32, |acc, (&a, &b)| a.mul_add(b, acc));
        }
    }
    Ok(())
}

/// `y[rows × d_out] = x[rows × d_in] · Wᵀ` (overwrites `y`), bit for bit [`linear_reference`].
pub fn linear_forward(y: &mut [f32], x: &[f32], w: &PackedLinear) -> Result<()> {
    forward_with(y, x, w, Isa::detected())
}

/// An instruction set a micro-kernel is written for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Isa {
    /// `f32::mul_add`, any target.
    Portable,
    /// 8-lane FMA (x86-64-v3).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// 16-lane FMA, 32 vector registers.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Isa {
    /// The best one this CPU has, detected once.
    fn detected() -> Isa {
        static DETECTED: std::sync::OnceLock<Isa> = std::sync::OnceLock::new();
        *DETECTED.get_or_init(|| {
            #[cfg(target_arch = "x86_64")]
            {
                if std::is_x86_feature_detected!("avx512f") {
                    return Isa::Avx512;
                }
                if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                    return Isa::Avx2;
                }
            }
            Isa::Portable
        })
    }

    /// Micro-tile (rows, panels) for a call of `rows` rows: few rows take wide tiles (enough
    /// independent chains to hide the FMA latency), many rows the tile that reuses each load most.
    fn tile(self, rows: usize) -> (usize, usize) {
        match self {
            Isa::Portable => (rows.min(4), 1),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => x86::avx2_tile(rows),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => x86::avx512_tile(rows),
        }
    }
}

/// One micro-tile's operands, as raw pointers so tasks can write disjoint parts of `y`.
#[derive(Clone, Copy)]
struct Tile {
    /// `x[row 0][k0]` of the tile; row `r` starts `r * d_in` floats later.
    x: *const f32,
    /// Row `k0` of the tile's panel 0; panel `p` starts `p * d_in` lanes later.
    panels: *const Lanes,
    d_in: usize,
    /// The tile covers `k0..k0 + k_len`.
    k_len: usize,
    /// Whether the chains continue from the values in `y` (`k0 > 0`) rather than from 0.
    resume: bool,
    /// `y[row 0][column 0]` of the tile; rows are `y_stride` apart.
    y: *mut f32,
    y_stride: usize,
    /// Valid lanes of the tile's last panel (`1..=PANEL`); the padding lanes are not stored.
    last_lanes: usize,
}

/// `y` shared between tasks that write disjoint tiles of it.
#[derive(Clone, Copy)]
struct SharedOut(*mut f32);
// SAFETY: tasks write disjoint elements (each (row, column) belongs to exactly one tile).
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// Through a method, so closures capture the whole (Sync) wrapper, not the raw field.
    fn ptr(&self) -> *mut f32 {
        self.0
    }
}

fn forward_with(y: &mut [f32], x: &[f32], w: &PackedLinear, isa: Isa) -> Result<()> {
    let (d_in, d_out) = (w.d_in, w.d_out);
    let rows = x.len() / d_in;
    ensure(x.len().is_multiple_of(d_in) && y.len() == rows * d_out, "linear_forward", || {
        format!("x {} y {} for d_in {d_in} d_out {d_out}", x.len(), y.len())
    })?;
    if rows == 0 {
        return Ok(());
    }
    let (mr, nv) = isa.tile(rows);
    let panel_count = w.panel_count();
    let groups = panel_count.div_ceil(nv);
    let row_block = if rows <= ROW_BLOCK { rows } else { ROW_BLOCK / mr * mr };
    let row_blocks = rows.div_ceil(row_block);
    let threads =
        if rows * d_in * d_out >= PARALLEL_MIN_FMAS { rayon::current_num_threads() } else { 1 };
    // Enough tasks for every thread to stay busy; splitting never changes a chain.
    let col_blocks = if threads == 1 { 1 } else { (8 * threads).div_ceil(row_blocks).min(groups) };
    let groups_per_block = groups.div_ceil(col_blocks);
    let col_blocks = groups.div_ceil(groups_per_block);
    // Many rows reuse each block of panel rows from L1: the chains pause in `y` after `kc`
    // steps and resume there (a store and a load of the f32 accumulator change no bit).
    let kc = if rows > mr { (K_BLOCK_BYTES / (nv * size_of::<Lanes>())).max(16) } else { d_in };
    let out = SharedOut(y.as_mut_ptr());
    let task = |t: usize| {
        let (rb, cb) = (t / col_blocks, t % col_blocks);
        let (r0, r1) = (rb * row_block, ((rb + 1) * row_block).min(rows));
        let p0 = cb * groups_per_block * nv;
        let p1 = ((cb + 1) * groups_per_block * nv).min(panel_count);
        for pc in (p0..p1).step_by(nv) {
            let nvc = nv.min(p1 - pc);
            let last_lanes = PANEL.min(d_out - (pc + nvc - 1) * PANEL);
            for k0 in (0..d_in).step_by(kc) {
                for rt in (r0..r1).step_by(mr) {
                    let mrc = mr.min(r1 - rt);
                    let tile = Tile {
                        x: x[rt * d_in + k0..].as_ptr(),
                        panels: w.panels[pc * d_in + k0..].as_ptr(),
                        d_in,
                        k_len: kc.min(d_in - k0),
                        resume: k0 > 0,
                        // SAFETY: rt < rows and pc * PANEL < d_out, so the offset is inside y.
                        y: unsafe { out.ptr().add(rt * d_out + pc * PANEL) },
                        y_stride: d_out,
                        last_lanes,
                    };
                    // SAFETY: rows rt..rt + mrc of x and y and panels pc..pc + nvc exist (the
                    // shape checks above); only the valid lanes of the last panel are touched.
                    unsafe { run_tile(isa, mrc, nvc, &tile) };
                }
            }
        }
    };
    let tasks = row_blocks * col_blocks;
    if threads == 1 {
        (0..tasks).for_each(task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
    Ok(())
}

/// Computes an `mr × nv`-panel micro-tile with the kernel of `isa`.
///
/// # Safety
/// `tile` must describe `mr` readable rows of `x`, `nv` readable panels, and `mr` writable rows
/// of `y` with `(nv - 1) * PANEL + last_lanes` writable columns each.
unsafe fn run_tile(isa: Isa, mr: usize, nv: usize, tile: &Tile) {
    match isa {
        // SAFETY: forwarded from the caller.
        Isa::Portable => unsafe { tile_portable(mr, nv, tile) },
        // SAFETY: forwarded from the caller; `Isa::detected` (or the tests) only pick an x86
        // kernel on a CPU that has its features.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::avx2(mr, nv, tile) },
        // SAFETY: as above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => unsafe { x86::avx512(mr, nv, tile) },
    }
}

/// The portable micro-kernel: up to 4 rows at a time, so the compiler has 4 independent
/// 16-lane chains to vectorize.
///
/// # Safety
/// As [`run_tile`].
unsafe fn tile_portable(mr: usize, nv: usize, t: &Tile) {
    for p in 0..nv {
        let lanes = if p + 1 == nv { t.last_lanes } else { PANEL };
        // SAFETY: forwarded from the caller (panel p is one of the tile's).
        unsafe {
            match mr {
                1 => rows_portable::<1>(t, p, lanes),
                2 => rows_portable::<2>(t, p, lanes),
                3 => rows_portable::<3>(t, p, lanes),
                4 => rows_portable::<4>(t, p, lanes),
                _ => unreachable!("portable tile {mr}x{nv}"),
            }
        }
    }
}

/// `acc[l] = x.mul_add(w[l], acc[l])` for every lane, by value so the lanes stay in registers.
#[inline(always)]
fn fma_lanes(acc: [f32; PANEL], x: f32, w: &[f32; PANEL]) -> [f32; PANEL] {
    std::array::from_fn(|l| x.mul_add(w[l], acc[l]))
}

/// Panel `p` of the tile for its `MR` rows, `lanes` valid columns of it.
///
/// # Safety
/// As [`run_tile`], with `p` one of the tile's panels.
unsafe fn rows_portable<const MR: usize>(t: &Tile, p: usize, lanes: usize) {
    // SAFETY: panel p of the tile is inside the packed weights (caller's contract).
    let panel = unsafe { std::slice::from_raw_parts(t.panels.add(p * t.d_in), t.k_len) };
    let mut acc = [[0f32; PANEL]; MR];
    if t.resume {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: these columns of row r are inside y (caller's contract).
            let yr =
                unsafe { std::slice::from_raw_parts(t.y.add(r * t.y_stride + p * PANEL), lanes) };
            acc[..lanes].copy_from_slice(yr);
        }
    }
    for (k, w) in panel.iter().enumerate() {
        for (r, acc) in acc.iter_mut().enumerate() {
            // SAFETY: row r, column k is inside x (caller's contract).
            let xk = unsafe { *t.x.add(r * t.d_in + k) };
            *acc = fma_lanes(*acc, xk, &w.0);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: these columns of row r are inside y (caller's contract).
        let yr =
            unsafe { std::slice::from_raw_parts_mut(t.y.add(r * t.y_stride + p * PANEL), lanes) };
        yr.copy_from_slice(&acc[..lanes]);
    }
}

/// The x86 micro-kernels. Each is generic over its tile (`MR` rows × `NV` panels) so the
/// accumulators live in registers; the dispatchers below instantiate the tiles `*_tile` picks.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{Lanes, PANEL, Tile};

    /// AVX-512 tile of the main loop (rows > 8): 24 accumulators of 32 registers. 6×4, 12×2
    /// and 14×2 measured the same single-threaded (~90% of the FMA peak); 8×3 reads the fewest
    /// panel bytes per FMA.
    const AVX512_MAIN: (usize, usize) = (8, 3);

    pub(super) fn avx512_tile(rows: usize) -> (usize, usize) {
        match rows {
            1..=3 => (rows, 8),
            4 => (4, 6),
            5 => (5, 5),
            6 | 7 => (rows, 4),
            8 => (8, 3),
            _ => AVX512_MAIN,
        }
    }

    /// # Safety
    /// As `run_tile`, on a CPU with AVX-512F; `(mr, nv)` within what `avx512_tile` returns.
    pub(super) unsafe fn avx512(mr: usize, nv: usize, t: &Tile) {
        macro_rules! dispatch {
            ($($mr:literal => [$($nv:literal),*]),* $(,)?) => {
                // SAFETY: forwarded from the caller.
                unsafe {
                    match (mr, nv) {
                        $($(($mr, $nv) => tile512::<$mr, $nv>(t),)*)*
                        _ => unreachable!("avx512 tile {mr}x{nv}"),
                    }
                }
            };
        }
        dispatch!(
            1 => [1, 2, 3, 4, 5, 6, 7, 8],
            2 => [1, 2, 3, 4, 5, 6, 7, 8],
            3 => [1, 2, 3, 4, 5, 6, 7, 8],
            4 => [1, 2, 3, 4, 5, 6],
            5 => [1, 2, 3, 4, 5],
            6 => [1, 2, 3, 4],
            7 => [1, 2, 3, 4],
            8 => [1, 2, 3],
        )
    }

    /// `MR` rows × `NV` panels: per k, one broadcast of `x[r][k]` per row and one load per
    /// panel, `MR·NV` FMAs, each lane continuing its own output's chain.
    ///
    /// # Safety
    /// As `run_tile`, on a CPU with AVX-512F.
    #[target_feature(enable = "avx512f")]
    unsafe fn tile512<const MR: usize, const NV: usize>(t: &Tile) {
        let d_in = t.d_in;
        let tail: __mmask16 = ((1u32 << t.last_lanes) - 1) as __mmask16;
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        if t.resume {
            for (r, acc) in acc.iter_mut().enumerate() {
                for (p, a) in acc.iter_mut().enumerate() {
                    // SAFETY: row r, columns p·16.. of the tile are inside y; the last panel
                    // loads only its valid lanes.
                    unsafe {
                        let src = t.y.add(r * t.y_stride + p * PANEL);
                        *a = if p + 1 < NV {
                            _mm512_loadu_ps(src)
                        } else {
                            _mm512_maskz_loadu_ps(tail, src)
                        };
                    }
                }
            }
        }
        // One step of every chain of the tile at `k`.
        macro_rules! step {
            ($k:expr) => {{
                let k = $k;
                let mut w = [_mm512_setzero_ps(); NV];
                for (p, w) in w.iter_mut().enumerate() {
                    // SAFETY: panel p, row k is inside the packed weights; `Lanes` is 64-aligned.
                    *w = unsafe { _mm512_load_ps(t.panels.add(p * d_in + k).cast::<f32>()) };
                }
                for (r, acc) in acc.iter_mut().enumerate() {
                    // SAFETY: row r, column k is inside x.
                    let xb = _mm512_set1_ps(unsafe { *t.x.add(r * d_in + k) });
                    for (a, &w) in acc.iter_mut().zip(&w) {
                        *a = _mm512_fmadd_ps(xb, w, *a);
                    }
                }
            }};
        }
        // Unrolled by 4, as in `tile256`.
        let mut k = 0;
        while k + 4 <= t.k_len {
            step!(k);
            step!(k + 1);
            step!(k + 2);
            step!(k + 3);
            k += 4;
        }
        while k < t.k_len {
            step!(k);
            k += 1;
        }
        for (r, acc) in acc.iter().enumerate() {
            for (p, &a) in acc.iter().enumerate() {
                // SAFETY: row r, columns p·16.. of the tile are inside y; the last panel stores
                // only its valid lanes.
                unsafe {
                    let dst = t.y.add(r * t.y_stride + p * PANEL);
                    if p + 1 < NV {
                        _mm512_storeu_ps(dst, a);
                    } else {
                        _mm512_mask_storeu_ps(dst, tail, a);
                    }
                }
            }
        }
    }

    pub(super) fn avx2_tile(rows: usize) -> (usize, usize) {
        match rows {
            1 => (1, 4),
            2 => (2, 3),
            3 => (3, 2),
            _ => (6, 1),
        }
    }

    /// # Safety
    /// As `run_tile`, on a CPU with AVX2 and FMA; `(mr, nv)` within what `avx2_tile` returns.
    pub(super) unsafe fn avx2(mr: usize, nv: usize, t: &Tile) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match (mr, nv) {
                (1, 1) => tile256::<1, 1>(t),
                (1, 2) => tile256::<1, 2>(t),
                (1, 3) => tile256::<1, 3>(t),
                (1, 4) => tile256::<1, 4>(t),
                (2, 1) => tile256::<2, 1>(t),
                (2, 2) => tile256::<2, 2>(t),
                (2, 3) => tile256::<2, 3>(t),
                (3, 1) => tile256::<3, 1>(t),
                (3, 2) => tile256::<3, 2>(t),
                (4, 1) => tile256::<4, 1>(t),
                (5, 1) => tile256::<5, 1>(t),
                (6, 1) => tile256::<6, 1>(t),
                _ => unreachable!("avx2 tile {mr}x{nv}"),
            }
        }
    }

    /// As `tile512` with two 8-lane halves per panel.
    ///
    /// # Safety
    /// As `run_tile`, on a CPU with AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tile256<const MR: usize, const NV: usize>(t: &Tile) {
        let d_in = t.d_in;
        let mut lo = [[_mm256_setzero_ps(); NV]; MR];
        let mut hi = [[_mm256_setzero_ps(); NV]; MR];
        if t.resume {
            for r in 0..MR {
                for p in 0..NV {
                    let lanes = if p + 1 < NV { PANEL } else { t.last_lanes };
                    // SAFETY: row r, columns p·16.. of the tile are inside y, `lanes` of them.
                    unsafe {
                        let src = t.y.add(r * t.y_stride + p * PANEL);
                        if lanes == PANEL {
                            lo[r][p] = _mm256_loadu_ps(src);
                            hi[r][p] = _mm256_loadu_ps(src.add(8));
                        } else {
                            let mut buf = Lanes([0.0; PANEL]);
                            std::ptr::copy_nonoverlapping(src, buf.0.as_mut_ptr(), lanes);
                            lo[r][p] = _mm256_load_ps(buf.0.as_ptr());
                            hi[r][p] = _mm256_load_ps(buf.0.as_ptr().add(8));
                        }
                    }
                }
            }
        }
        // One step of every chain of the tile at `k`.
        macro_rules! step {
            ($k:expr) => {{
                let k = $k;
                let mut w = [(_mm256_setzero_ps(), _mm256_setzero_ps()); NV];
                for (p, w) in w.iter_mut().enumerate() {
                    // SAFETY: panel p, row k is inside the packed weights; `Lanes` is 64-aligned.
                    unsafe {
                        let src = t.panels.add(p * d_in + k).cast::<f32>();
                        *w = (_mm256_load_ps(src), _mm256_load_ps(src.add(8)));
                    }
                }
                for r in 0..MR {
                    // SAFETY: row r, column k is inside x.
                    let xb = _mm256_set1_ps(unsafe { *t.x.add(r * d_in + k) });
                    for (p, &(wl, wh)) in w.iter().enumerate() {
                        lo[r][p] = _mm256_fmadd_ps(xb, wl, lo[r][p]);
                        hi[r][p] = _mm256_fmadd_ps(xb, wh, hi[r][p]);
                    }
                }
            }};
        }
        // Unrolled by 4: the address arithmetic of the rows is shared by four steps, which
        // leaves the two FMA ports to the FMAs.
        let mut k = 0;
        while k + 4 <= t.k_len {
            step!(k);
            step!(k + 1);
            step!(k + 2);
            step!(k + 3);
            k += 4;
        }
        while k < t.k_len {
            step!(k);
            k += 1;
        }
        for r in 0..MR {
            for p in 0..NV {
                let lanes = if p + 1 < NV { PANEL } else { t.last_lanes };
                // SAFETY: row r, columns p·16.. of the tile are inside y, `lanes` of them.
                unsafe {
                    let dst = t.y.add(r * t.y_stride + p * PANEL);
                    if lanes == PANEL {
                        _mm256_storeu_ps(dst, lo[r][p]);
                        _mm256_storeu_ps(dst.add(8), hi[r][p]);
                    } else {
                        let mut buf = Lanes([0.0; PANEL]);
                        _mm256_store_ps(buf.0.as_mut_ptr(), lo[r][p]);
                        _mm256_store_ps(buf.0.as_mut_ptr().add(8), hi[r][p]);
                        std::ptr::copy_nonoverlapping(buf.0.as_ptr(), dst, lanes);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Every kernel this CPU can run.
    fn isas() -> Vec<Isa> {
        #[allow(unused_mut)]
        let mut isas = vec![Isa::Portable];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                isas.push(Isa::Avx2);
            }
            if std::is_x86_feature_detected!("avx512f") {
                isas.push(Isa::Avx512);
            }
        }
        isas
    }

    fn reference(x: &[f32], w: &[f32], rows: usize, d_in: usize, d_out: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; rows * d_out];
        linear_reference(&mut y, x, w, rows, d_in, d_out).unwrap();
        y
    }

    fn forward(x: &[f32], w: &PackedLinear, isa: Isa) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.len() / w.d_in() * w.d_out()];
        forward_with(&mut y, x, w, isa).unwrap();
        y
    }

    fn assert_bits_eq(got: &[f32], want: &[f32], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (e, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g.to_bits(), w.to_bits(), "{what}: element {e}: {g} vs {w}");
        }
    }

    /// (rows, d_in, d_out): remainders of every tile size, d_in 1, d_out 1, one and many panels.
    const SHAPES: &[(usize, usize, usize)] = &[
        (1, 1, 1),
        (1, 1, 7),
        (3, 5, 1),
        (2, 17, 33),
        (5, 64, 16),
        (7, 33, 47),
        (8, 100, 100),
        (9, 31, 129),
        (13, 16, 65),
        (37, 70, 257),
        (1, 96, 1031),
        (4, 576, 1000),
        (300, 19, 23),
        (300, 40, 70),
        // More rows than a micro-tile and d_in past K_BLOCK: the chains pause in y and resume.
        (9, 129, 33),
        (17, 257, 50),
        (37, 300, 100),
        (300, 150, 40),
    ];

    #[test]
    fn every_kernel_equals_the_reference_bit_for_bit() {
        let mut rng = Rng::new(7);
        for &(rows, d_in, d_out) in SHAPES {
            let (x, w) = (rng.vec(rows * d_in, 1.0), rng.vec(d_out * d_in, 0.1));
            let want = reference(&x, &w, rows, d_in, d_out);
            let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
            for isa in isas() {
                let what = format!("{isa:?} rows {rows} d_in {d_in} d_out {d_out}");
                assert_bits_eq(&forward(&x, &packed, isa), &want, &what);
            }
            let mut y = vec![f32::NAN; rows * d_out];
            linear_forward(&mut y, &x, &packed).unwrap();
            assert_bits_eq(&y, &want, "linear_forward");
        }
    }

    /// Every row count and every number of panels left over at the end of a row of tiles, so
    /// each (rows, panels) kernel instance the tile tables can pick runs once.
    #[test]
    fn every_tile_shape_equals_the_reference_bit_for_bit() {
        let mut rng = Rng::new(11);
        let d_in = 3;
        for rows in 1..=17 {
            for panels in 1..=9 {
                let d_out = panels * PANEL - (rows % 3);
                let (x, w) = (rng.vec(rows * d_in, 1.0), rng.vec(d_out * d_in, 1.0));
                let want = reference(&x, &w, rows, d_in, d_out);
                let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
                for isa in isas() {
                    let what = format!("{isa:?} rows {rows} d_out {d_out}");
                    assert_bits_eq(&forward(&x, &packed, isa), &want, &what);
                }
            }
        }
    }

    #[test]
    fn rows_alone_in_any_subset_or_order_equal_the_whole_batch() {
        let mut rng = Rng::new(8);
        for &(rows, d_in, d_out) in &[(37, 45, 77), (300, 24, 40), (20, 576, 129)] {
            let (x, w) = (rng.vec(rows * d_in, 1.0), rng.vec(d_out * d_in, 0.1));
            let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
            for isa in isas() {
                let all = forward(&x, &packed, isa);
                for i in 0..rows {
                    let alone = forward(&x[i * d_in..][..d_in], &packed, isa);
                    assert_bits_eq(&alone, &all[i * d_out..][..d_out], &format!("{isa:?} row {i}"));
                }
                // A random subset in a random order, of every size up to 20.
                for size in 1..=20.min(rows) {
                    let picked: Vec<usize> = (0..size).map(|_| rng.below(rows)).collect();
                    let xs: Vec<f32> = picked
                        .iter()
                        .flat_map(|&i| x[i * d_in..][..d_in].iter().copied())
                        .collect();
                    let got = forward(&xs, &packed, isa);
                    for (slot, &i) in picked.iter().enumerate() {
                        assert_bits_eq(
                            &got[slot * d_out..][..d_out],
                            &all[i * d_out..][..d_out],
                            &format!("{isa:?} subset of {size}, row {i}"),
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_thread_equals_two_threads() {
        let mut rng = Rng::new(9);
        let one = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
        let two = rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap();
        for &(rows, d_in, d_out) in &[(1, 576, 1000), (8, 200, 700), (300, 64, 200)] {
            let (x, w) = (rng.vec(rows * d_in, 1.0), rng.vec(d_out * d_in, 0.1));
            let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
            for isa in isas() {
                let a = one.install(|| forward(&x, &packed, isa));
                let b = two.install(|| forward(&x, &packed, isa));
                assert_bits_eq(&a, &b, &format!("{isa:?} rows {rows} d_in {d_in} d_out {d_out}"));
            }
        }
    }

    #[test]
    fn close_to_the_f64_product() {
        let mut rng = Rng::new(10);
        let (rows, d_in, d_out) = (11, 300, 77);
        let (x, w) = (rng.vec(rows * d_in, 1.0), rng.vec(d_out * d_in, 1.0));
        let packed = PackedLinear::new(&w, d_out, d_in).unwrap();
        let mut y = vec![f32::NAN; rows * d_out];
        linear_forward(&mut y, &x, &packed).unwrap();
        for i in 0..rows {
            for j in 0..d_out {
                let want: f64 = (0..d_in)
                    .map(|k| f64::from(x[i * d_in + k]) * f64::from(w[j * d_in + k]))
                    .sum();
                let got = f64::from(y[i * d_out + j]);
                assert!(
                    (got - want).abs() < 1e-4 * (d_in as f64).sqrt(),
                    "[{i}][{j}] {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn shapes_that_do_not_fit_are_errors() {
        let w = vec![1.0; 6];
        assert!(PackedLinear::new(&w, 2, 4).unwrap_err().to_string().contains("linear pack"));
        assert!(PackedLinear::new(&[], 0, 3).is_err());
        assert!(PackedLinear::new(&[], 3, 0).is_err());
        let packed = PackedLinear::new(&w, 2, 3).unwrap();
        assert_eq!((packed.d_out(), packed.d_in()), (2, 3));
        let mut y = vec![0.0; 4];
        let err = linear_forward(&mut y, &[1.0; 5], &packed).unwrap_err();
        assert!(err.to_string().contains("linear_forward"), "{err}");
        let mut y = vec![0.0; 3];
        assert!(linear_forward(&mut y, &[1.0; 6], &packed).is_err());
        let mut y = vec![0.0; 4];
        assert!(linear_reference(&mut y, &[1.0; 6], &w, 2, 3, 3).is_err());
        // No rows is a valid empty call.
        linear_forward(&mut [], &[], &packed).unwrap();
    }
}
