//! Batch-invariant matrix products: cuBLASLt with one pinned algorithm per shape class.
//!
//! cuBLAS picks a kernel per call from the problem's sizes, and for few rows it likes split-K,
//! whose partial sums change how a row is reduced: a token's activations would then depend on
//! how many tokens share its batch. Here the rows (our `m`, tokens) are the only size that
//! varies; for each class (transposes, `n`, `k`, dtypes, accumulate or not) the algorithm is
//! chosen once: the first of cuBLASLt's heuristic candidates at [`REFERENCE_ROWS`] (no
//! split-K reduction, one K slice) that also runs at every row count of [`PROBED_ROWS`], and
//! then used for every row count. One kernel with one K order
//! computes every output element, so a row's bits are the same in any batch. Decode-sized
//! products (tiers of up to 16, 64 and 256 rows) take the fastest candidate, timed on the
//! device, that reproduces those bits; a large kernel's tiles leave most of the GPU idle at
//! few rows. Besides cuBLASLt's candidates, bf16 products with Wᵀ of up to 64 rows may take
//! `kernels/rows_gemm.cu` (the same k order, with smaller blocks), under the same check. The
//! cost against cuBLAS's own per-call choice is measured by `miles bench … --gemm cublas`.

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Mutex;

use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self as lt_sys, cublasComputeType_t, cublasLtMatmulAlgo_t, cublasLtMatmulDescAttributes_t,
    cublasLtMatmulPreferenceAttributes_t, cublasLtReductionScheme_t, cudaDataType,
};

use super::Gpu;
use crate::cpu::Transpose;
use crate::{Error, Result};

/// Row counts whose heuristic candidates are tried, in order: a training batch's order of size
/// first, then a decode step's.
const REFERENCE_ROWS: [u64; 2] = [8192, 1];
/// Workspace offered to the algorithms (split-K is excluded separately); `MILES_GEMM_WORKSPACE`
/// (bytes) overrides it, to study which kernels a cap lets in.
fn workspace_bytes() -> usize {
    static CAP: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var("MILES_GEMM_WORKSPACE").ok().and_then(|v| v.parse().ok()).unwrap_or(1 << 20)
    })
}
/// Heuristic candidates considered per class.
const CANDIDATES: usize = 32;
/// Row counts a candidate must support (one decode row to a large batch, odd sizes between).
const PROBED_ROWS: [u64; 6] = [1, 2, 7, 259, 1000, 16_384];
/// The self-check: a product of this many rows on fixed pseudo-random operands, whose first
/// rows the runs at [`CHECKED_ROWS`] must reproduce bit for bit.
const CHECK_ROWS: u64 = 4096;
const CHECKED_ROWS: [u64; 6] = [1, 2, 7, 64, 259, 1000];
/// Where else in the batch the checked rows start (multiples of 8 rows keep the operands
/// 16-byte aligned in either dtype).
const SHIFTS: [u64; 2] = [8, 1096];
/// Products of few rows (decode steps) may take another algorithm per tier of row counts: the
/// fastest at the tier's `timed` rows among the heuristic's candidates (and the large one) that
/// reproduce the large algorithm's bits at the tier's `checked` row counts.
struct Tier {
    max_rows: u64,
    timed: u64,
    checked: &'static [u64],
}
const TIERS: [Tier; 3] = [
    Tier { max_rows: 16, timed: 8, checked: &[1, 2, 7, 16] },
    Tier { max_rows: 64, timed: 64, checked: &[1, 7, 33, 64] },
    Tier { max_rows: 256, timed: 256, checked: &[1, 7, 64, 129, 256] },
];
/// Products per timed graph of a candidate.
const TIMED_LAUNCHES: usize = 10;

/// A class's algorithms: `large` for every row count, or a tier's own up to its rows.
#[derive(Clone, Copy)]
struct Pinned {
    large: cublasLtMatmulAlgo_t,
    tiers: [Option<Algo>; TIERS.len()],
}

/// One way to compute a class's product: a cuBLASLt algorithm, or `kernels/rows_gemm.cu` with
/// `bn` columns per block (bf16 `x·Wᵀ` of at most [`ROWS_KERNEL_MAX`] rows).
#[derive(Clone, Copy)]
enum Algo {
    Lt(cublasLtMatmulAlgo_t),
    Rows { bn: u32 },
}

/// The most rows `kernels/rows_gemm.cu` takes, and its columns per block.
const ROWS_KERNEL_MAX: u64 = 64;
const ROWS_KERNEL_BN: [u32; 2] = [16, 64];

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Class {
    ta: bool,
    tb: bool,
    /// The row count for products that reduce over the tokens (`ta`: weight gradients, which
    /// need determinism, not invariance, and get the heuristic's choice at their exact size);
    /// 0 for the row-invariant classes, whose rows are the tokens.
    m: i32,
    n: i32,
    k: i32,
    ab: u32,
    c: u32,
    accumulate: bool,
}

/// A cuBLASLt handle and the pinned algorithm of each class met so far.
pub(crate) struct Lt {
    handle: lt_sys::cublasLtHandle_t,
    algos: Mutex<HashMap<Class, Pinned>>,
    /// Scratch some kernels ask for (a tile scheduler's counters; never split-K partials).
    workspace: cudarc::driver::CudaSlice<u8>,
}

// SAFETY: the handle is used under the Gpu's one stream; cuBLASLt handles are thread-safe for
// calls that do not share descriptors, and every descriptor here is per call.
unsafe impl Send for Lt {}
unsafe impl Sync for Lt {}

fn lt_error(what: &str, e: lt::CublasError) -> Error {
    Error::Device(format!("cuBLASLt {what}: {e}"))
}

/// Descriptors of one problem, destroyed on drop.
struct Problem {
    desc: lt_sys::cublasLtMatmulDesc_t,
    a: lt_sys::cublasLtMatrixLayout_t,
    b: lt_sys::cublasLtMatrixLayout_t,
    c: lt_sys::cublasLtMatrixLayout_t,
}

impl Drop for Problem {
    fn drop(&mut self) {
        // SAFETY: created by Problem::new and destroyed only here.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.a);
            let _ = lt::destroy_matrix_layout(self.b);
            let _ = lt::destroy_matrix_layout(self.c);
            let _ = lt::destroy_matmul_desc(self.desc);
        }
    }
}

fn op(t: bool) -> cublasOperation_t {
    if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N }
}

impl Problem {
    /// Row-major `c[m×n] = op(a)·op(b)` as cuBLASLt's column-major `cᵀ = op(b)ᵀ·op(a)ᵀ`: b
    /// comes first, the transposes carry over, and a row-major matrix is its column-major
    /// transpose.
    fn new(class: Class, m: u64, dtype: cudaDataType, c_dtype: cudaDataType) -> Result<Self> {
        let err = |e| lt_error("descriptor", e);
        let compute = if dtype == cudaDataType::CUDA_R_32F {
            cublasComputeType_t::CUBLAS_COMPUTE_32F_PEDANTIC
        } else {
            cublasComputeType_t::CUBLAS_COMPUTE_32F
        };
        let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F).map_err(err)?;
        let (n, k) = (class.n as u64, class.k as u64);
        // The column-major operands: A_cm is b, B_cm is a.
        let (a_rows, a_cols) = if class.tb { (k, n) } else { (n, k) };
        let (b_rows, b_cols) = if class.ta { (m, k) } else { (k, m) };
        let a = lt::create_matrix_layout(dtype, a_rows, a_cols, a_rows as i64).map_err(err)?;
        let b = lt::create_matrix_layout(dtype, b_rows, b_cols, b_rows as i64).map_err(err)?;
        let c = lt::create_matrix_layout(c_dtype, n, m, n as i64).map_err(err)?;
        let problem = Problem { desc, a, b, c };
        for (attr, t) in [
            (cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA, op(class.tb)),
            (cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB, op(class.ta)),
        ] {
            // SAFETY: the attribute is a cublasOperation_t, passed by pointer with its size.
            unsafe {
                lt::set_matmul_desc_attribute(
                    problem.desc,
                    attr,
                    (&t as *const cublasOperation_t).cast(),
                    std::mem::size_of::<cublasOperation_t>(),
                )
            }
            .map_err(err)?;
        }
        Ok(problem)
    }
}

impl Lt {
    pub(crate) fn new(stream: &std::sync::Arc<cudarc::driver::CudaStream>) -> Result<Self> {
        // SAFETY: only tries to dlopen the library.
        if !unsafe { lt_sys::is_culib_present() } {
            return Err(Error::Device(
                "cuBLASLt (libcublasLt.so.13) is not on the library path: install CUDA 13's \
                 cuBLAS or add its lib folder to LD_LIBRARY_PATH"
                    .into(),
            ));
        }
        let handle = lt::create_handle().map_err(|e| lt_error("create", e))?;
        let workspace = stream
            .alloc_zeros::<u8>(workspace_bytes().max(1))
            .map_err(|e| Error::Device(format!("cuBLASLt workspace: {e}")))?;
        Ok(Lt { handle, algos: Mutex::new(HashMap::new()), workspace })
    }

    /// The class's algorithm, chosen on first use: no workspace and no split-K reduction.
    fn algo(
        &self,
        gpu: &Gpu,
        class: Class,
        dtype: cudaDataType,
        c_dtype: cudaDataType,
    ) -> Result<Pinned> {
        let mut algos = self.algos.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(a) = algos.get(&class) {
            return Ok(*a);
        }
        if class.ta {
            let exact = self.candidates(class, class.m as u64, dtype, c_dtype)?;
            let algo = *exact.first().ok_or_else(|| {
                Error::Device(format!("cuBLASLt: no split-K-free algorithm for {class:?}"))
            })?;
            let pinned = Pinned { large: algo, tiers: [None; TIERS.len()] };
            algos.insert(class, pinned);
            return Ok(pinned);
        }
        let check = Check::new(self, class, dtype, c_dtype)?;
        let mut reasons = Vec::new();
        let mut chosen = None;
        'search: for reference in REFERENCE_ROWS {
            for candidate in self.candidates(class, reference, dtype, c_dtype)? {
                let candidate = one_slice(candidate)?;
                let why = match self.why_not(class, &candidate, dtype, c_dtype, &PROBED_ROWS)? {
                    Some(why) => why,
                    None => {
                        let algo = Algo::Lt(candidate);
                        let full = check.run(self, gpu, &algo, CHECK_ROWS, 0)?;
                        match check.differs(self, gpu, &algo, &full, &CHECKED_ROWS)? {
                            None => {
                                chosen = Some((candidate, full));
                                break 'search;
                            }
                            Some(rows) => format!("{rows} rows are not the rows of {CHECK_ROWS}"),
                        }
                    }
                };
                reasons.push(why);
            }
        }
        let (large, full) = chosen.ok_or_else(|| {
            Error::Device(format!(
                "cuBLASLt: no split-K-free algorithm for {class:?} runs at every row count and \
                 gives a row the same bits in any batch ({}); use the cuBLAS route (--gemm \
                 cublas), which is not batch-invariant",
                reasons.join("; ")
            ))
        })?;
        // Every tier's heuristic candidates, for every tier: the favourite at 256 rows may be
        // the fastest at 64 too.
        let mut pool: Vec<cublasLtMatmulAlgo_t> = Vec::new();
        for tier in &TIERS {
            for candidate in self.candidates(class, tier.timed, dtype, c_dtype)? {
                let candidate = one_slice(candidate)?;
                if !pool.iter().any(|a| a.data == candidate.data) {
                    pool.push(candidate);
                }
            }
        }
        let mut pool: Vec<Algo> = pool.into_iter().map(Algo::Lt).collect();
        if rows_kernel_fits(class) {
            pool.extend(ROWS_KERNEL_BN.map(|bn| Algo::Rows { bn }));
        }
        let mut tiers = [None; TIERS.len()];
        let mut picks = Vec::new();
        for (slot, tier) in tiers.iter_mut().zip(&TIERS) {
            let pick = self.fastest_same_bits(gpu, class, tier, &check, &large, &full, &pool)?;
            picks.push(pick.as_ref().map_or("large".to_string(), |(algo, ms, large_ms)| {
                let name = match algo {
                    Algo::Lt(a) => describe(a),
                    Algo::Rows { bn } => format!("rows_gemm.cu, {bn} columns a block"),
                };
                format!("≤{} rows {name} ({ms:.4} ms, large {large_ms:.4} ms)", tier.max_rows)
            }));
            *slot = pick.map(|(algo, _, _)| algo);
        }
        let pinned = Pinned { large, tiers };
        if std::env::var_os("MILES_GEMM_LOG").is_some() {
            eprintln!(
                "gemm {class:?}: large {}; {}; rejected: {reasons:?}",
                describe(&large),
                picks.join("; ")
            );
        }
        algos.insert(class, pinned);
        Ok(pinned)
    }

    /// The fastest algorithm of `pool` at `tier.timed` rows that computes `large`'s bits at the
    /// tier's checked row counts, with its time and the large one's; `None` when that is `large`.
    #[allow(clippy::too_many_arguments)]
    fn fastest_same_bits(
        &self,
        gpu: &Gpu,
        class: Class,
        tier: &Tier,
        check: &Check,
        large: &cublasLtMatmulAlgo_t,
        full: &[u8],
        pool: &[Algo],
    ) -> Result<Option<(Algo, f32, f32)>> {
        let (dtype, c_dtype) = (check.dtype, check.c_dtype);
        let large_ms = check.time(self, gpu, &Algo::Lt(*large), tier.timed)?;
        let mut timed = Vec::new();
        for &candidate in pool {
            let runs = match &candidate {
                Algo::Lt(a) => self.why_not(class, a, dtype, c_dtype, tier.checked)?.is_none(),
                Algo::Rows { .. } => tier.max_rows <= ROWS_KERNEL_MAX,
            };
            if !runs {
                continue;
            }
            // A candidate that fails to launch is only not taken.
            let time = check.time(self, gpu, &candidate, tier.timed);
            if let Algo::Rows { bn } = candidate
                && std::env::var_os("MILES_GEMM_LOG").is_some()
            {
                let ms = time.as_ref().map(|ms| format!("{ms:.4} ms")).map_err(|e| e.to_string());
                eprintln!(
                    "gemm {class:?}: ≤{} rows rows_gemm.cu, {bn} columns a block: {ms:?} (large \
                     {large_ms:.4} ms)",
                    tier.max_rows
                );
            }
            if let Ok(ms) = time
                && ms < large_ms
            {
                timed.push((ms, candidate));
            }
        }
        timed.sort_by(|a, b| a.0.total_cmp(&b.0));
        for (ms, candidate) in timed {
            if check.differs(self, gpu, &candidate, full, tier.checked)?.is_none() {
                return Ok(Some((candidate, ms, large_ms)));
            }
        }
        Ok(None)
    }

    /// The heuristic's split-K-free, workspace-free candidates at `rows` rows, best first.
    fn candidates(
        &self,
        class: Class,
        rows: u64,
        dtype: cudaDataType,
        c_dtype: cudaDataType,
    ) -> Result<Vec<cublasLtMatmulAlgo_t>> {
        let problem = Problem::new(class, rows, dtype, c_dtype)?;
        let pref = lt::create_matmul_pref().map_err(|e| lt_error("preference", e))?;
        let workspace = workspace_bytes();
        let reduction = cublasLtReductionScheme_t::CUBLASLT_REDUCTION_SCHEME_NONE as u32;
        // SAFETY: each attribute is passed by pointer with its size (usize and u32).
        let set = unsafe {
            lt::set_matmul_pref_attribute(
                pref,
                cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&workspace as *const usize).cast(),
                std::mem::size_of::<usize>(),
            )
            .and_then(|()| {
                lt::set_matmul_pref_attribute(
                    pref,
                    cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                    (&reduction as *const u32).cast(),
                    std::mem::size_of::<u32>(),
                )
            })
        };
        let mut found = [std::mem::MaybeUninit::<lt_sys::cublasLtMatmulHeuristicResult_t>::zeroed();
            CANDIDATES];
        let mut count = 0i32;
        // SAFETY: the descriptors are alive; `found` holds CANDIDATES results.
        let heuristic = set.and_then(|()| {
            unsafe {
                lt_sys::cublasLtMatmulAlgoGetHeuristic(
                    self.handle,
                    problem.desc,
                    problem.a,
                    problem.b,
                    problem.c,
                    problem.c,
                    pref,
                    CANDIDATES as i32,
                    found.as_mut_ptr().cast(),
                    &mut count,
                )
            }
            .result()
        });
        // SAFETY: created above, not used after.
        unsafe {
            let _ = lt::destroy_matmul_pref(pref);
        }
        heuristic.map_err(|e| lt_error(&format!("heuristic for {class:?}"), e))?;
        Ok(found
            .iter()
            .take(count.max(0) as usize)
            // SAFETY: the heuristic wrote the first `count` entries.
            .map(|c| unsafe { c.assume_init() })
            .filter(|c| c.state == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS)
            .map(|c| c.algo)
            .collect())
    }

    /// `None` when `algo` runs the class at each of the `probed` row counts within the workspace;
    /// else the first row count where it does not, and why.
    fn why_not(
        &self,
        class: Class,
        algo: &cublasLtMatmulAlgo_t,
        dtype: cudaDataType,
        c_dtype: cudaDataType,
        probed: &[u64],
    ) -> Result<Option<String>> {
        for &rows in probed {
            let p = Problem::new(class, rows, dtype, c_dtype)?;
            let mut result =
                std::mem::MaybeUninit::<lt_sys::cublasLtMatmulHeuristicResult_t>::zeroed();
            // SAFETY: the descriptors are alive; `result` is written by the call.
            let status = unsafe {
                lt_sys::cublasLtMatmulAlgoCheck(
                    self.handle,
                    p.desc,
                    p.a,
                    p.b,
                    p.c,
                    p.c,
                    algo,
                    result.as_mut_ptr(),
                )
            };
            // SAFETY: zero-initialized, and written on success.
            let workspace = unsafe { result.assume_init() }.workspaceSize;
            if status != lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Ok(Some(format!("{rows} rows: {status:?}")));
            }
            if workspace > workspace_bytes() {
                return Ok(Some(format!("{rows} rows: needs {workspace} bytes of workspace")));
            }
        }
        Ok(None)
    }

    /// Row-major `c[m×n] (+)= op(a)·op(b)` on `stream`, with the class's pinned algorithm;
    /// operands and result are f32 or bf16 as the flags say.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn matmul(
        &self,
        gpu: &Gpu,
        stream: lt_sys::cudaStream_t,
        (a, ta): (*const c_void, Transpose),
        (b, tb): (*const c_void, Transpose),
        c: *mut c_void,
        (m, k, n): (i32, i32, i32),
        (ab_f32, c_f32): (bool, bool),
        accumulate: bool,
    ) -> Result<()> {
        let dt = |f32: bool| if f32 { cudaDataType::CUDA_R_32F } else { cudaDataType::CUDA_R_16BF };
        let (dtype, c_dtype) = (dt(ab_f32), dt(c_f32));
        let class = Class {
            ta: ta == Transpose::Yes,
            tb: tb == Transpose::Yes,
            m: if ta == Transpose::Yes { m } else { 0 },
            n,
            k,
            ab: dtype as u32,
            c: c_dtype as u32,
            accumulate,
        };
        let pinned = self.algo(gpu, class, dtype, c_dtype)?;
        let tier = TIERS.iter().position(|t| m as u64 <= t.max_rows);
        let algo = tier.and_then(|t| pinned.tiers[t]).unwrap_or(Algo::Lt(pinned.large));
        self.run(gpu, &algo, class, m, (a, b, c), (dtype, c_dtype), accumulate, stream)
    }

    /// One product with `algo`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        gpu: &Gpu,
        algo: &Algo,
        class: Class,
        m: i32,
        (a, b, c): (*const c_void, *const c_void, *mut c_void),
        dtypes: (cudaDataType, cudaDataType),
        accumulate: bool,
        stream: lt_sys::cudaStream_t,
    ) -> Result<()> {
        match *algo {
            Algo::Lt(ref algo) => {
                self.launch(algo, class, m, (a, b, c), dtypes, accumulate, stream)
            }
            Algo::Rows { bn } => rows_kernel(gpu, bn, (m, class.n, class.k), (a, b, c)),
        }
    }

    /// One product with `algo`.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        algo: &cublasLtMatmulAlgo_t,
        class: Class,
        m: i32,
        (a, b, c): (*const c_void, *const c_void, *mut c_void),
        (dtype, c_dtype): (cudaDataType, cudaDataType),
        accumulate: bool,
        stream: lt_sys::cudaStream_t,
    ) -> Result<()> {
        let (k, n) = (class.k, class.n);
        let problem = Problem::new(class, m as u64, dtype, c_dtype)?;
        let (alpha, beta) = (1.0f32, if accumulate { 1.0f32 } else { 0.0 });
        let stream_ = self.workspace.stream().clone();
        let (ws, _ws_sync) = cudarc::driver::DevicePtr::device_ptr(&self.workspace, &stream_);
        // SAFETY: the pointers address buffers of the sizes the layouts describe (checked by
        // the op); the workspace holds what the algorithm was checked to need.
        unsafe {
            lt::matmul(
                self.handle,
                problem.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                b,
                problem.a,
                a,
                problem.b,
                c,
                problem.c,
                c,
                problem.c,
                algo,
                ws as *mut c_void,
                workspace_bytes(),
                stream,
            )
        }
        .map_err(|e| lt_error(&format!("matmul {m}×{k}·{k}×{n}"), e))
    }
}

/// `algo` with one K slice pinned, whatever the heuristic's default.
fn one_slice(mut algo: cublasLtMatmulAlgo_t) -> Result<cublasLtMatmulAlgo_t> {
    let splits = 1i32;
    // SAFETY: the attribute is an int32.
    unsafe {
        lt_sys::cublasLtMatmulAlgoConfigSetAttribute(
            &mut algo,
            lt_sys::cublasLtMatmulAlgoConfigAttributes_t::CUBLASLT_ALGO_CONFIG_SPLITK_NUM,
            (&splits as *const i32).cast(),
            std::mem::size_of::<i32>(),
        )
    }
    .result()
    .map_err(|e| lt_error("split-K", e))?;
    Ok(algo)
}

/// Fixed pseudo-random operands of a class for the self-check, on the device.
struct Check {
    class: Class,
    dtype: cudaDataType,
    c_dtype: cudaDataType,
    a: cudarc::driver::CudaSlice<u8>,
    b: cudarc::driver::CudaSlice<u8>,
}

impl Check {
    fn new(lt: &Lt, class: Class, dtype: cudaDataType, c_dtype: cudaDataType) -> Result<Self> {
        let f32 = dtype == cudaDataType::CUDA_R_32F;
        let (n, k) = (class.n as usize, class.k as usize);
        let bytes = |len: usize, seed: u64| -> Vec<u8> {
            let mut x = seed;
            let mut out = Vec::with_capacity(len * 4);
            for _ in 0..len {
                // xorshift64*: values in [-1, 1).
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let v = ((x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 40) as f32)
                    / (1u64 << 23) as f32
                    - 1.0;
                if f32 {
                    out.extend_from_slice(&v.to_le_bytes());
                } else {
                    out.extend_from_slice(&half::bf16::from_f32(v).to_bits().to_le_bytes());
                }
            }
            out
        };
        let stream = lt.workspace.stream().clone();
        let up = |v: Vec<u8>| {
            stream.clone_htod(&v).map_err(|e| crate::cuda::driver_error("copy to device", e))
        };
        Ok(Check {
            class,
            dtype,
            c_dtype,
            a: up(bytes(CHECK_ROWS as usize * k, 0x9e37_79b9))?,
            b: up(bytes(n * k, 0x85eb_ca6b))?,
        })
    }

    /// The product's `rows × n` result bytes with `algo` (onto zeros when accumulating), of
    /// the operand rows from `skip` on.
    fn run(&self, lt: &Lt, gpu: &Gpu, algo: &Algo, rows: u64, skip: u64) -> Result<Vec<u8>> {
        let stream = lt.workspace.stream().clone();
        let err = |e| crate::cuda::driver_error("self-check", e);
        let size = if self.c_dtype == cudaDataType::CUDA_R_32F { 4 } else { 2 };
        let mut c =
            stream.alloc_zeros::<u8>(rows as usize * self.class.n as usize * size).map_err(err)?;
        {
            let (a, _a) = cudarc::driver::DevicePtr::device_ptr(&self.a, &stream);
            let in_size = if self.dtype == cudaDataType::CUDA_R_32F { 4 } else { 2 };
            let a = a + skip * self.class.k as u64 * in_size;
            let (b, _b) = cudarc::driver::DevicePtr::device_ptr(&self.b, &stream);
            let (cp, _c) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut c, &stream);
            lt.run(
                gpu,
                algo,
                self.class,
                rows as i32,
                (a as *const c_void, b as *const c_void, cp as *mut c_void),
                (self.dtype, self.c_dtype),
                self.class.accumulate,
                stream.cu_stream() as lt_sys::cudaStream_t,
            )?;
        }
        stream.clone_dtoh(&c).map_err(err)
    }

    /// Device milliseconds per product of `rows` rows with `algo`: CUDA events around replays
    /// of a graph of [`TIMED_LAUNCHES`] products, as decode steps replay them. Timed eagerly,
    /// the host's cost per launch (several µs for cuBLASLt) would hide the kernels'
    /// differences at decode sizes; where capture fails, eagerly after all.
    fn time(&self, lt: &Lt, gpu: &Gpu, algo: &Algo, rows: u64) -> Result<f32> {
        let stream = lt.workspace.stream().clone();
        let err = |e| crate::cuda::driver_error("gemm timing", e);
        let size = if self.c_dtype == cudaDataType::CUDA_R_32F { 4 } else { 2 };
        let mut c =
            stream.alloc_zeros::<u8>(rows as usize * self.class.n as usize * size).map_err(err)?;
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let (start, end) = (
            stream.context().new_event(flags).map_err(err)?,
            stream.context().new_event(flags).map_err(err)?,
        );
        let (a, _a) = cudarc::driver::DevicePtr::device_ptr(&self.a, &stream);
        let (b, _b) = cudarc::driver::DevicePtr::device_ptr(&self.b, &stream);
        let (cp, _c) = cudarc::driver::DevicePtrMut::device_ptr_mut(&mut c, &stream);
        let cu_stream = stream.cu_stream() as lt_sys::cudaStream_t;
        let products = || -> Result<()> {
            for _ in 0..TIMED_LAUNCHES {
                lt.run(
                    gpu,
                    algo,
                    self.class,
                    rows as i32,
                    (a as *const c_void, b as *const c_void, cp as *mut c_void),
                    (self.dtype, self.c_dtype),
                    self.class.accumulate,
                    cu_stream,
                )?;
            }
            Ok(())
        };
        products()?; // loads the kernel, warms the caches
        const REPLAYS: usize = 3;
        let launches = match gpu.capture(products) {
            Ok(graph) => {
                graph.launch()?;
                start.record(&stream).map_err(err)?;
                for _ in 0..REPLAYS {
                    graph.launch()?;
                }
                REPLAYS * TIMED_LAUNCHES
            }
            Err(_) => {
                start.record(&stream).map_err(err)?;
                products()?;
                TIMED_LAUNCHES
            }
        };
        end.record(&stream).map_err(err)?;
        Ok(start.elapsed_ms(&end).map_err(err)? / launches as f32)
    }

    /// The first of `rows` whose product with `algo` is not the matching part of `full`: the
    /// product of the first rows, and of rows starting at [`SHIFTS`] (a token at another place
    /// of its batch).
    fn differs(
        &self,
        lt: &Lt,
        gpu: &Gpu,
        algo: &Algo,
        full: &[u8],
        rows: &[u64],
    ) -> Result<Option<u64>> {
        let row_bytes = full.len() / CHECK_ROWS as usize;
        for &r in rows {
            for skip in std::iter::once(0).chain(SHIFTS) {
                let got = self.run(lt, gpu, algo, r, skip)?;
                let at = skip as usize * row_bytes;
                if got[..] != full[at..at + got.len()] {
                    return Ok(Some(r));
                }
            }
        }
        Ok(None)
    }
}

/// An algorithm's id, tile, stages and cluster shape (`MILES_GEMM_LOG=1` prints each pin).
fn describe(algo: &cublasLtMatmulAlgo_t) -> String {
    use lt_sys::cublasLtMatmulAlgoConfigAttributes_t as A;
    let get = |attr: A| {
        let (mut v, mut written) = (0u32, 0usize);
        // SAFETY: these attributes are 32-bit integers; `v` holds 4 bytes.
        let status = unsafe {
            lt_sys::cublasLtMatmulAlgoConfigGetAttribute(
                algo,
                attr,
                (&mut v as *mut u32).cast(),
                std::mem::size_of::<u32>(),
                &mut written,
            )
        };
        if status == lt_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS { v as i64 } else { -1 }
    };
    format!(
        "id {} tile {} stages {} cluster {}",
        get(A::CUBLASLT_ALGO_CONFIG_ID),
        get(A::CUBLASLT_ALGO_CONFIG_TILE_ID),
        get(A::CUBLASLT_ALGO_CONFIG_STAGES_ID),
        get(A::CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)
    )
}

/// Whether `kernels/rows_gemm.cu` computes the class: bf16 `x·Wᵀ` into bf16, no accumulation,
/// 16-byte rows (whether it gives the large algorithm's bits is checked when pinning).
fn rows_kernel_fits(class: Class) -> bool {
    let bf16 = cudaDataType::CUDA_R_16BF as u32;
    !class.ta
        && class.tb
        && class.ab == bf16
        && class.c == bf16
        && !class.accumulate
        && class.k % 8 == 0
}

/// `c[m×n] = a[m×k]·bᵀ` (b `[n×k]`) with `kernels/rows_gemm.cu`, `m` ≤ [`ROWS_KERNEL_MAX`].
fn rows_kernel(
    gpu: &Gpu,
    bn: u32,
    (m, n, k): (i32, i32, i32),
    (a, b, c): (*const c_void, *const c_void, *mut c_void),
) -> Result<()> {
    // (kernel, warps, stages) of rows_gemm.cu's instances.
    let (kernel, warps, stages) = match (m <= 16, bn) {
        (true, 16) => ("rows_gemm_m16_n16", 1u32, 32u32),
        (true, _) => ("rows_gemm_m16_n64", 1, 16),
        (false, 16) => ("rows_gemm_m64_n16", 4, 16),
        (false, _) => ("rows_gemm_m64_n64", 4, 12),
    };
    if m as u64 > ROWS_KERNEL_MAX {
        return Err(Error::Device(format!("rows_gemm.cu takes at most 64 rows, not {m}")));
    }
    const BK: u32 = 32;
    const SKEW: u32 = 8;
    let bytes = stages * (16 * warps + bn) * (BK + SKEW) * 2;
    // Over 48 KiB of shared memory is asked for explicitly (once per capture in a graph).
    gpu.function("rows_gemm", kernel)?
        .set_attribute(
            cudarc::driver::sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )
        .map_err(|e| crate::cuda::driver_error(kernel, e))?;
    let cfg = cudarc::driver::LaunchConfig {
        grid_dim: ((n as u32).div_ceil(bn), 1, 1),
        block_dim: (32 * warps, 1, 1),
        shared_mem_bytes: bytes,
    };
    let (c, a, b) = (c as u64, a as u64, b as u64);
    launch!(gpu, "rows_gemm", kernel, cfg, &c, &a, &b, &m, &n, &k)
}

#[cfg(test)]
mod tests {
    use cudarc::driver::DevicePtr;

    use super::*;
    use crate::cuda::DeviceData;
    use crate::rng::Rng;
    use crate::tensor::Storage;
    use crate::{DType, Device, Tensor, ops};

    fn bf16_tensor(shape: &[usize], data: Vec<f32>, device: &Device) -> Tensor {
        Tensor::from_f32(shape, data, &Device::Cpu)
            .and_then(|t| t.to_dtype(DType::BF16))
            .and_then(|t| t.to_device(device))
            .unwrap()
    }

    /// The device address of a bf16 tensor's element `at`.
    fn address(t: &Tensor, at: usize) -> *mut c_void {
        let Storage::Cuda(b) = &t.storage else { panic!("a CUDA tensor") };
        let DeviceData::BF16(s) = &b.data else { panic!("a bf16 tensor") };
        let (p, _sync) = s.device_ptr(b.gpu.stream());
        (p + 2 * at as u64) as *mut c_void
    }

    /// `kernels/rows_gemm.cu` against the CPU's products on fresh random operands, at every
    /// instance (1 and 4 warps, 16 and 64 columns a block) and ragged edges (n not a multiple
    /// of the block, k not of 32); where k is a multiple of 16 also against the large cuBLASLt
    /// algorithm's bits, the property that lets the pinning pick it for decode steps.
    #[test]
    fn the_rows_kernel_matches_the_cpu_and_the_large_algorithms_bits() {
        let device = Device::Cuda(0);
        if let Err(e) = device.ensure_available() {
            println!("skipping CUDA: {e}");
            return;
        }
        let gpu = crate::cuda::gpu(0).unwrap();
        let mut rng = Rng::new(91);
        for (k, n) in [(576, 960), (1536, 576), (64, 200), (40, 24)] {
            let big = 300;
            let x = bf16_tensor(&[big, k], rng.vec(big * k, 1.0), &device);
            let w = bf16_tensor(&[n, k], rng.vec(n * k, 0.1), &device);
            let large = ops::matmul(&x, Transpose::No, &w, Transpose::Yes).unwrap();
            let large = large.to_vec_bf16().unwrap();
            let (xh, wh) = (x.to_vec_f32().unwrap(), w.to_vec_f32().unwrap());
            for m in [1usize, 5, 16, 17, 64] {
                let skip = 3;
                for bn in ROWS_KERNEL_BN {
                    let out = Tensor::zeros(&[m, n], DType::BF16, &device).unwrap();
                    let (a, b) = (address(&x, skip * k), address(&w, 0));
                    rows_kernel(&gpu, bn, (m as i32, n as i32, k as i32), (a, b, address(&out, 0)))
                        .unwrap();
                    let got = out.to_vec_bf16().unwrap();
                    let what = format!("m {m} k {k} n {n} bn {bn}");
                    let want: Vec<f32> = (0..m * n)
                        .map(|i| {
                            let (r, c) = (skip + i / n, i % n);
                            (0..k).map(|j| xh[r * k + j] * wh[c * k + j]).sum()
                        })
                        .collect();
                    let scale = want.iter().fold(0f32, |s, v| s.max(v.abs()));
                    let err =
                        got.iter().zip(&want).fold(0f32, |e, (g, w)| e.max((g.to_f32() - w).abs()));
                    assert!(err <= 1e-2 * scale, "{what}: error {err} at scale {scale}");
                    if k % 16 == 0 {
                        let rows = &large[skip * n..(skip + m) * n];
                        let same = got.iter().zip(rows).all(|(g, l)| g.to_bits() == l.to_bits());
                        assert!(same, "{what}: not the large algorithm's bits");
                    }
                }
            }
        }
    }
}
