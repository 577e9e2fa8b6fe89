//! The CUDA backend (feature `cuda`): one context and stream per device, the kernel modules that
//! the build script embedded, cuBLAS, and device buffers. The driver and cuBLAS are loaded at
//! run time (cudarc's dynamic loading), so a machine without them gets an error, not a crash.

use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};

use cudarc::cublas::{CudaBlas, sys as cublas_sys};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtrMut, DeviceRepr,
    DriverError, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use half::bf16;

pub(crate) use attention::{
    MAX_HEAD_DIM, PagedPlanDevice, attention_backward, attention_forward, load_decode_plan,
    mma_head_dim, paged_attention, paged_decode_plan, paged_kv_write, paged_plan,
};
pub(crate) use elementwise::{
    IdGroups, Ids, add, add_bias, column_sums_acc, concat_rows, embedding_backward,
    embedding_backward_into, embedding_forward, gather_columns, glu_backward, glu_forward,
    pick_row_dots, pick_rows_sum, rope, scale, scatter_columns, scatter_rows, softcap,
    split_columns, swiglu_stacked,
};
pub(crate) use grouped::{grouped_rows, grouped_wgrad};
pub(crate) use logprob::{logprob_rows, logprob_rows_backward};
pub(crate) use nccl::{Nccl, join as nccl_join, unique_id as nccl_unique_id};
pub(crate) use ops::{
    add_rmsnorm, matmul, matmul_into, qk_norm_rope, qkv_rope_kv_write, rmsnorm_backward,
    rmsnorm_forward,
};
pub(crate) use optim::{AdamWSlot, Moment, adamw, adamw_multi, sum_squares, sum_squares_multi};
pub(crate) use sample::{sample_rows, sample_rows_on_device, spec_verify};

use crate::tensor::Storage;
use crate::{DType, Error, Result};

/// `launch!(gpu, "module", "kernel", cfg, arg, …)`: launches `kernel` of `kernels/module.cu`
/// with those arguments (references to device slices or to scalars); evaluates to `Result<()>`.
/// Each use must pass exactly the parameters its kernel declares, with buffers of the lengths the
/// kernel indexes (the op checks shapes before it launches).
macro_rules! launch {
    ($gpu:expr, $module:expr, $kernel:expr, $cfg:expr, $($arg:expr),+ $(,)?) => {{
        let gpu: &$crate::cuda::Gpu = $gpu;
        let kernel: &'static str = $kernel;
        let cfg: cudarc::driver::LaunchConfig = $cfg;
        match gpu.function($module, kernel) {
            Err(e) => Err(e),
            Ok(f) => {
                let mut args = gpu.stream().launch_builder(&f);
                $( cudarc::driver::PushKernelArg::arg(&mut args, $arg); )+
                // SAFETY: see the macro's documentation; the arguments match the kernel.
                unsafe { args.launch(cfg) }
                    .map(drop)
                    .map_err(|e| $crate::cuda::driver_error(kernel, e))
            }
        }
    }};
}
/// The float element types of the kernels, which come in pairs named `…_f32` and `…_bf16`.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Float {
    F32,
    BF16,
}

/// `kernel!(float, "name")`: the kernel `"name_f32"` or `"name_bf16"` for `float`;
/// `kernel!(float, "name", "_v4")` appends a suffix after the dtype.
macro_rules! kernel {
    ($float:expr, $name:literal $(, $suffix:literal)?) => {
        match $float {
            $crate::cuda::Float::F32 => concat!($name, "_f32" $(, $suffix)?),
            $crate::cuda::Float::BF16 => concat!($name, "_bf16" $(, $suffix)?),
        }
    };
}

/// `per_float!(op, (a, b, …), |T, float| body)`: one body for both float dtypes. When the
/// operands `a, b, …` (`DeviceData`s) are all f32 or all bf16, each is rebound to its slice, `T`
/// names the element type (`f32`, or `u16` holding bf16 bits) and `float` the [`Float`], and the
/// body's value is the macro's; any other mix returns a dtype error naming `op`.
macro_rules! per_float {
    ($op:expr, ($($x:ident),+ $(,)?), |$t:ident, $float:ident| $body:expr) => {
        match ($($x,)+) {
            ($($crate::cuda::DeviceData::F32($x),)+) => {
                #[allow(dead_code)]
                type $t = f32;
                #[allow(unused_variables)]
                let $float = $crate::cuda::Float::F32;
                $body
            }
            ($($crate::cuda::DeviceData::BF16($x),)+) => {
                #[allow(dead_code)]
                type $t = u16;
                #[allow(unused_variables)]
                let $float = $crate::cuda::Float::BF16;
                $body
            }
            #[allow(unreachable_patterns)]
            _ => return Err($crate::cuda::dtype_mismatch($op)),
        }
    };
}

mod attention;
mod elementwise;
pub(crate) mod fp8;
mod gemm_lt;
mod grouped;
pub(crate) mod int4;
mod logprob;
mod nccl;
mod ops;
mod optim;
mod sample;

mod embedded {
    include!(concat!(env!("OUT_DIR"), "/kernels.rs"));
}

/// One opened CUDA device: its context, the stream every op runs on, the kernels, cuBLAS.
pub(crate) struct Gpu {
    ordinal: usize,
    stream: Arc<CudaStream>,
    modules: Vec<(&'static str, Arc<CudaModule>)>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    /// Created on the first matrix product, so the kernels work where cuBLAS is missing.
    blas: OnceLock<std::result::Result<Mutex<CudaBlas>, String>>,
    /// cuBLASLt and the pinned algorithms of the batch-invariant route, made on first use.
    lt: OnceLock<std::result::Result<gemm_lt::Lt, String>>,
    /// The compute capability and SM count, asked once (they pick kernel families and grids).
    pub(crate) facts: OnceLock<fp8::Facts>,
}

/// Devices opened so far, by ordinal (failures are not kept: the next call tries again).
static GPUS: Mutex<Vec<(usize, Arc<Gpu>)>> = Mutex::new(Vec::new());

/// The opened device `ordinal`, opening it on first use.
pub(crate) fn gpu(ordinal: usize) -> Result<Arc<Gpu>> {
    let mut gpus = GPUS.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, gpu)) = gpus.iter().find(|(o, _)| *o == ordinal) {
        return Ok(gpu.clone());
    }
    let gpu = Arc::new(open(ordinal)?);
    gpu.keep_freed_memory()?;
    gpus.push((ordinal, gpu.clone()));
    Ok(gpu)
}

/// The CUDA devices present (0 without the driver library); creates no context.
pub(crate) fn device_count() -> usize {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    catch_unwind(CudaContext::device_count)
        .ok()
        .and_then(Result::ok)
        .map_or(0, |n| n.max(0) as usize)
}

fn no_device(why: impl std::fmt::Display) -> Error {
    Error::Device(format!("no CUDA device: {why}"))
}

pub(crate) fn driver_error(what: &str, e: DriverError) -> Error {
    Error::Device(format!("CUDA {what}: {e}"))
}

fn open(ordinal: usize) -> Result<Gpu> {
    // SAFETY: only tries to dlopen the driver library.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(no_device("the NVIDIA driver library (libcuda.so.1) is not on this machine"));
    }
    // cudarc panics on a missing driver symbol; that is an error here too.
    let opened = catch_unwind(AssertUnwindSafe(|| -> Result<_> {
        let count = CudaContext::device_count().map_err(no_device)?;
        if ordinal >= count.max(0) as usize {
            return Err(no_device(format!("cuda:{ordinal} asked for, {count} device(s) present")));
        }
        let ctx = CudaContext::new(ordinal).map_err(no_device)?;
        // SAFETY: every op of this crate runs on the one stream below, so the cross-stream
        // events that tracking records are never needed; the collectives' stream
        // (`cuda/nccl.rs`) orders itself against it with events of its own.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own, not the legacy default one: CUDA graphs are captured from it.
        let stream = ctx.new_stream().map_err(|e| driver_error("stream", e))?;
        let mut modules = Vec::new();
        for (name, fatbin) in embedded::MODULES {
            let module = ctx
                .load_module(Ptx::from_binary(fatbin.to_vec()))
                .map_err(|e| driver_error(&format!("loading kernels/{name}.cu"), e))?;
            modules.push((*name, module));
        }
        Ok(Gpu {
            ordinal,
            stream,
            modules,
            functions: Mutex::new(HashMap::new()),
            blas: OnceLock::new(),
            lt: OnceLock::new(),
            facts: OnceLock::new(),
        })
    }));
    opened.unwrap_or_else(|panic| Err(no_device(panic_message(&panic))))
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "the CUDA driver library panicked".into())
}

impl Gpu {
    pub(crate) fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's default memory pool, from which every buffer of this crate comes
    /// (cudarc allocates stream-ordered where the device supports it, as the H100/H200 do).
    fn pool(&self) -> Result<cudarc::driver::sys::CUmemoryPool> {
        let dev = self.stream.context().cu_device();
        // SAFETY: `dev` is this context's device.
        unsafe { cudarc::driver::result::device::get_default_mem_pool(dev) }
            .map_err(|e| driver_error("memory pool", e))
    }

    /// Peak bytes in use from the pool since it was opened or [`Gpu::reset_peak_memory`].
    pub(crate) fn peak_memory(&self) -> Result<u64> {
        self.pool_bytes(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
    }

    /// Bytes in use from the pool now (the buffers alive, once the stream has freed the
    /// dropped ones).
    pub(crate) fn memory_in_use(&self) -> Result<u64> {
        self.stream.synchronize().map_err(|e| driver_error("synchronize", e))?;
        self.pool_bytes(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
    }

    fn pool_bytes(&self, attr: cudarc::driver::sys::CUmemPool_attribute) -> Result<u64> {
        let mut v = 0u64;
        // SAFETY: both attributes read are u64s (cuuint64_t).
        unsafe {
            cudarc::driver::result::mem_pool::get_attribute(
                self.pool()?,
                attr,
                (&mut v as *mut u64).cast(),
            )
        }
        .map_err(|e| driver_error("memory pool attribute", e))?;
        Ok(v)
    }

    /// `(free, total)` bytes of device memory, as the driver reports them (memory this
    /// process's pool keeps counts as used).
    pub(crate) fn memory_info(&self) -> Result<(u64, u64)> {
        self.stream.context().bind_to_thread().map_err(|e| driver_error("bind context", e))?;
        let (free, total) =
            cudarc::driver::result::mem_get_info().map_err(|e| driver_error("memory info", e))?;
        Ok((free as u64, total as u64))
    }

    /// The chip's name, as the driver gives it ("NVIDIA H200").
    pub(crate) fn name(&self) -> Result<String> {
        self.stream.context().name().map_err(|e| driver_error("device name", e))
    }

    /// Device time of `iters` runs of `f`, between two events on the stream.
    pub(crate) fn time(
        &self,
        iters: u64,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<std::time::Duration> {
        let flags = Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = self.stream.record_event(flags).map_err(|e| driver_error("event", e))?;
        for _ in 0..iters {
            f()?;
        }
        let end = self.stream.record_event(flags).map_err(|e| driver_error("event", e))?;
        let ms = start.elapsed_ms(&end).map_err(|e| driver_error("event time", e))?;
        Ok(std::time::Duration::from_secs_f64(f64::from(ms) / 1e3))
    }

    pub(crate) fn reset_peak_memory(&self) -> Result<()> {
        let mut zero = 0u64;
        let attr = cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH;
        // SAFETY: the attribute is a u64, and 0 is the one value it may be set to.
        unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                self.pool()?,
                attr,
                (&mut zero as *mut u64).cast(),
            )
        }
        .map_err(|e| driver_error("memory pool attribute", e))
    }

    /// Keeps freed memory in the pool instead of returning it to the driver at each
    /// synchronization: a step's buffers are reused by the next step of the same shapes, as
    /// a caching allocator does, without an allocation from the driver per step.
    fn keep_freed_memory(&self) -> Result<()> {
        let mut threshold = u64::MAX;
        let attr = cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD;
        // SAFETY: the attribute is a u64.
        unsafe {
            cudarc::driver::result::mem_pool::set_attribute(
                self.pool()?,
                attr,
                (&mut threshold as *mut u64).cast(),
            )
        }
        .map_err(|e| driver_error("memory pool attribute", e))
    }

    /// Waits for everything queued on the device.
    pub(crate) fn synchronize(&self) -> Result<()> {
        self.stream.synchronize().map_err(|e| driver_error("synchronize", e))
    }

    /// The kernel `name` of `kernels/<module>.cu`.
    pub(crate) fn function(&self, module: &str, name: &'static str) -> Result<CudaFunction> {
        let mut functions = self.functions.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let (_, m) = self
            .modules
            .iter()
            .find(|(n, _)| *n == module)
            .ok_or_else(|| Error::Device(format!("no kernel module kernels/{module}.cu")))?;
        let f = m
            .load_function(name)
            .map_err(|e| driver_error(&format!("kernel {name} of kernels/{module}.cu"), e))?;
        functions.insert(name, f.clone());
        Ok(f)
    }

    /// The cuBLAS handle (created on first use), locked: cuBLAS handles are not reentrant.
    pub(crate) fn blas(&self) -> Result<MutexGuard<'_, CudaBlas>> {
        let blas = self.blas.get_or_init(|| {
            // SAFETY: only tries to dlopen the library.
            if !unsafe { cublas_sys::is_culib_present() } {
                return Err("cuBLAS (libcublas.so.13) is not on the library path: install CUDA \
                            13's cuBLAS or add its lib folder to LD_LIBRARY_PATH"
                    .to_string());
            }
            let made = catch_unwind(AssertUnwindSafe(|| {
                let blas = CudaBlas::new(self.stream.clone())?;
                // No TF32 behind f32's back (the f32 product also asks for the pedantic compute
                // type, which ignores NVIDIA_TF32_OVERRIDE).
                // SAFETY: the handle was just created and is not shared yet.
                unsafe {
                    cublas_sys::cublasSetMathMode(
                        *blas.handle(),
                        cublas_sys::cublasMath_t::CUBLAS_DEFAULT_MATH,
                    )
                }
                .result()?;
                Ok::<_, cudarc::cublas::result::CublasError>(blas)
            }));
            match made {
                Ok(Ok(blas)) => Ok(Mutex::new(blas)),
                Ok(Err(e)) => Err(format!("cuBLAS: {e}")),
                Err(panic) => Err(format!("cuBLAS: {}", panic_message(&panic))),
            }
        });
        match blas {
            Ok(blas) => Ok(blas.lock().unwrap_or_else(PoisonError::into_inner)),
            Err(e) => Err(Error::Device(e.clone())),
        }
    }

    /// cuBLASLt for the batch-invariant GEMM route (created on first use).
    pub(crate) fn lt(&self) -> Result<&gemm_lt::Lt> {
        let lt = self.lt.get_or_init(|| {
            catch_unwind(AssertUnwindSafe(|| gemm_lt::Lt::new(&self.stream)))
                .unwrap_or_else(|panic| Err(Error::Device(panic_message(&panic))))
                .map_err(|e| e.to_string())
        });
        lt.as_ref().map_err(|e| Error::Device(e.clone()))
    }

    /// `len` elements of uninitialized device memory, NaN-filled when [`crate::POISON_OUTPUTS`].
    pub(crate) fn alloc<T: DeviceRepr>(&self, len: usize) -> Result<CudaSlice<T>> {
        // SAFETY: every op writes its whole output before anyone reads it (the tests check
        // this by poisoning), and no T of this crate has invalid bit patterns.
        let mut slice =
            unsafe { self.stream.alloc::<T>(len) }.map_err(|e| driver_error("alloc", e))?;
        if crate::poison_outputs() && len > 0 {
            let bytes = slice.num_bytes();
            let (ptr, _sync) = slice.device_ptr_mut(&self.stream);
            // SAFETY: `ptr` addresses `bytes` bytes of the slice just allocated.
            unsafe {
                cudarc::driver::result::memset_d8_async(ptr, 0xFF, bytes, self.stream.cu_stream())
            }
            .map_err(|e| driver_error("memset", e))?;
        }
        Ok(slice)
    }
}

/// A captured sequence of this crate's ops on one device, replayed with one launch.
pub struct Graph {
    graph: cudarc::driver::CudaGraph,
}

impl Gpu {
    /// Records what `f` queues on the stream (nothing runs) into a graph. `f` must not copy
    /// from or to the host nor wait for the device; buffers it allocates and drops become the
    /// graph's own.
    pub(crate) fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let mode = cudarc::driver::sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        self.stream.begin_capture(mode).map_err(|e| driver_error("begin capture", e))?;
        let body = f();
        let flags = cudarc::driver::sys::CUgraphInstantiate_flags(0);
        let ended = self.stream.end_capture(flags);
        body?;
        let graph = ended
            .map_err(|e| driver_error("end capture", e))?
            .ok_or_else(|| Error::Device("the captured graph is empty".into()))?;
        Ok(Graph { graph })
    }
}

// SAFETY: a graph may be used from any thread as long as no two use it at once (CUDA's graph
// thread-safety rules); `Graph` is not `Sync`, so its one owner is the only user.
unsafe impl Send for Graph {}

impl Graph {
    /// Queues one replay on the device's stream.
    pub fn launch(&self) -> Result<()> {
        self.graph.launch().map_err(|e| driver_error("graph launch", e))
    }
}

/// Device memory of one dtype (bf16 travels as its bits).
pub(crate) enum DeviceData {
    F32(CudaSlice<f32>),
    BF16(CudaSlice<u16>),
    I32(CudaSlice<i32>),
    F8(CudaSlice<u8>),
}

/// A tensor's storage on a device.
pub(crate) struct Buffer {
    pub(crate) gpu: Arc<Gpu>,
    pub(crate) data: DeviceData,
}

impl DeviceData {
    pub(crate) fn dtype(&self) -> DType {
        match self {
            DeviceData::F32(_) => DType::F32,
            DeviceData::BF16(_) => DType::BF16,
            DeviceData::I32(_) => DType::I32,
            DeviceData::F8(_) => DType::F8E4M3,
        }
    }
}

impl From<CudaSlice<f32>> for DeviceData {
    fn from(s: CudaSlice<f32>) -> Self {
        DeviceData::F32(s)
    }
}

impl From<CudaSlice<u16>> for DeviceData {
    fn from(s: CudaSlice<u16>) -> Self {
        DeviceData::BF16(s)
    }
}

/// The error of a float kernel given operands of mixed dtypes, or integers.
pub(crate) fn dtype_mismatch(op: &'static str) -> Error {
    Error::DType { op, message: "operands differ in dtype, or are not f32/bf16".into() }
}

impl Buffer {
    pub(crate) fn dtype(&self) -> DType {
        self.data.dtype()
    }

    pub(crate) fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    pub(crate) fn from_host(gpu: &Arc<Gpu>, host: &Storage) -> Result<Buffer> {
        let stream = gpu.stream();
        let data = match host {
            Storage::F32(v) => DeviceData::F32(
                stream.clone_htod(v).map_err(|e| driver_error("copy to device", e))?,
            ),
            Storage::BF16(v) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                DeviceData::BF16(
                    stream.clone_htod(&bits).map_err(|e| driver_error("copy to device", e))?,
                )
            }
            Storage::I32(v) => DeviceData::I32(
                stream.clone_htod(v).map_err(|e| driver_error("copy to device", e))?,
            ),
            Storage::F8(v) => {
                DeviceData::F8(stream.clone_htod(v).map_err(|e| driver_error("copy to device", e))?)
            }
            Storage::Cuda(_) => {
                return Err(Error::Device("from_host: storage is on a device".into()));
            }
        };
        Ok(Buffer { gpu: gpu.clone(), data })
    }

    /// Overwrites this buffer with `src` (host storage, or a buffer of the same dtype and
    /// length on the same device), keeping its address: inputs of a captured graph are loaded
    /// this way, and a graph's results copied out.
    pub(crate) fn copy_from(&mut self, src: &Storage) -> Result<()> {
        let stream = self.gpu.stream().clone();
        let err = |e| driver_error("copy into a buffer", e);
        match (&mut self.data, src) {
            (DeviceData::F32(d), Storage::F32(v)) => stream.memcpy_htod(v, d).map_err(err),
            (DeviceData::I32(d), Storage::I32(v)) => stream.memcpy_htod(v, d).map_err(err),
            (DeviceData::F8(d), Storage::F8(v)) => stream.memcpy_htod(v, d).map_err(err),
            (DeviceData::BF16(d), Storage::BF16(v)) => {
                let bits: Vec<u16> = v.iter().map(|x| x.to_bits()).collect();
                stream.memcpy_htod(&bits, d).map_err(err)
            }
            (DeviceData::F32(d), Storage::Cuda(Buffer { data: DeviceData::F32(s), .. })) => {
                stream.memcpy_dtod(s, d).map_err(err)
            }
            (DeviceData::I32(d), Storage::Cuda(Buffer { data: DeviceData::I32(s), .. })) => {
                stream.memcpy_dtod(s, d).map_err(err)
            }
            (DeviceData::F8(d), Storage::Cuda(Buffer { data: DeviceData::F8(s), .. })) => {
                stream.memcpy_dtod(s, d).map_err(err)
            }
            (DeviceData::BF16(d), Storage::Cuda(Buffer { data: DeviceData::BF16(s), .. })) => {
                stream.memcpy_dtod(s, d).map_err(err)
            }
            _ => Err(Error::Device("copy_from: another dtype".into())),
        }
    }

    /// `len` zeros of `dtype` on `gpu`.
    pub(crate) fn zeros(gpu: &Arc<Gpu>, dtype: DType, len: usize) -> Result<Buffer> {
        let stream = gpu.stream();
        let err = |e| driver_error("alloc_zeros", e);
        let data = match dtype {
            DType::F32 => DeviceData::F32(stream.alloc_zeros(len).map_err(err)?),
            DType::BF16 => DeviceData::BF16(stream.alloc_zeros(len).map_err(err)?),
            DType::I32 => DeviceData::I32(stream.alloc_zeros(len).map_err(err)?),
            DType::F8E4M3 => DeviceData::F8(stream.alloc_zeros(len).map_err(err)?),
        };
        Ok(Buffer { gpu: gpu.clone(), data })
    }

    pub(crate) fn zero(&mut self) -> Result<()> {
        let stream = self.gpu.stream().clone();
        let err = |e| driver_error("memset", e);
        match &mut self.data {
            DeviceData::F32(s) => stream.memset_zeros(s).map_err(err),
            DeviceData::BF16(s) => stream.memset_zeros(s).map_err(err),
            DeviceData::I32(s) => stream.memset_zeros(s).map_err(err),
            DeviceData::F8(s) => stream.memset_zeros(s).map_err(err),
        }
    }

    pub(crate) fn to_host(&self) -> Result<Storage> {
        let stream = self.gpu.stream();
        let err = |e| driver_error("copy to host", e);
        Ok(match &self.data {
            DeviceData::F32(s) => Storage::F32(stream.clone_dtoh(s).map_err(err)?),
            DeviceData::BF16(s) => Storage::BF16(
                stream.clone_dtoh(s).map_err(err)?.into_iter().map(bf16::from_bits).collect(),
            ),
            DeviceData::I32(s) => Storage::I32(stream.clone_dtoh(s).map_err(err)?),
            DeviceData::F8(s) => Storage::F8(stream.clone_dtoh(s).map_err(err)?),
        })
    }

    pub(crate) fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match self.to_host()? {
            Storage::F32(v) => Ok(v),
            Storage::BF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            Storage::I32(_) => Err(crate::tensor::int_float(DType::I32, DType::F32)),
            Storage::F8(v) => Ok(v.iter().map(|&c| crate::cpu::e4m3_to_f32(c)).collect()),
            Storage::Cuda(_) => Err(Error::Device("to_host returned device storage".into())),
        }
    }

    pub(crate) fn to_dtype(&self, dtype: DType) -> Result<Buffer> {
        let gpu = &self.gpu;
        let stream = gpu.stream();
        let copy = |e| driver_error("device copy", e);
        let data = match (&self.data, dtype) {
            (DeviceData::F32(s), DType::F32) => {
                DeviceData::F32(stream.clone_dtod(s).map_err(copy)?)
            }
            (DeviceData::BF16(s), DType::BF16) => {
                DeviceData::BF16(stream.clone_dtod(s).map_err(copy)?)
            }
            (DeviceData::F32(s), DType::BF16) => {
                let mut out = gpu.alloc::<u16>(s.len())?;
                if !s.is_empty() {
                    let n = s.len() as i64;
                    launch!(
                        gpu,
                        "convert",
                        "f32_to_bf16",
                        elementwise_launch(s.len()),
                        &mut out,
                        s,
                        &n
                    )?;
                }
                DeviceData::BF16(out)
            }
            (DeviceData::I32(s), DType::I32) => {
                DeviceData::I32(stream.clone_dtod(s).map_err(copy)?)
            }
            (DeviceData::F8(s), DType::F8E4M3) => {
                DeviceData::F8(stream.clone_dtod(s).map_err(copy)?)
            }
            (DeviceData::F8(_), _) | (_, DType::F8E4M3) => {
                unreachable!("Tensor::to_dtype refuses FP8 conversions")
            }
            (DeviceData::I32(_), _) | (_, DType::I32) => {
                return Err(crate::tensor::int_float(self.dtype(), dtype));
            }
            (DeviceData::BF16(s), DType::F32) => {
                let mut out = gpu.alloc::<f32>(s.len())?;
                if !s.is_empty() {
                    let n = s.len() as i64;
                    launch!(
                        gpu,
                        "convert",
                        "bf16_to_f32",
                        elementwise_launch(s.len()),
                        &mut out,
                        s,
                        &n
                    )?;
                }
                DeviceData::F32(out)
            }
        };
        Ok(Buffer { gpu: gpu.clone(), data })
    }
}

/// The launch shape of the grid-stride element-wise kernels over `n` elements (each element is
/// computed alone, so the shape does not change a result).
pub(crate) fn elementwise_launch(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(256).clamp(1, 132 * 16) as u32;
    LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 }
}
