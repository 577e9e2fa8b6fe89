//! Tensors and the op set of miles-rs.
//!
//! [`cpu`] holds the reference implementation of every op: plain Rust over row-major `f32`
//! slices, multi-threaded with rayon, matrix products through the `gemm` crate. Each forward op
//! has its backward beside it, and every device kernel is tested against these.
//! Reductions run in a fixed order, whatever the thread count, so results are reproducible.
//!
//! [`Tensor`] holds a shape, a [`DType`] and host or device storage; [`ops`] dispatches on the
//! tensor's [`Device`]: the CPU goes through [`cpu`], CUDA (feature `cuda`) through the kernels
//! of `kernels/*.cu` (embedded in the binary by the build script) and cuBLAS, loaded at run time
//! through cudarc. A build without the feature, or a machine without a GPU, answers a request
//! for `Device::Cuda(_)` with [`Error::Device`], never a panic.

mod collective;
pub mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
pub mod ops;
pub mod rng;
mod tensor;
pub mod testing;

pub use collective::Collective;
pub use cpu::Transpose;
#[cfg(feature = "cuda")]
pub use cuda::Graph;
pub use tensor::{DType, Device, Tensor, ZeroBits, try_zeros};

/// Errors of the op layer: shapes or dtypes that do not fit, or a device that is not there.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {message}")]
    Shape { op: &'static str, message: String },
    #[error("dtype mismatch in {op}: {message}")]
    DType { op: &'static str, message: String },
    #[error("{0}")]
    Device(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Fails with a shape error unless `ok`.
pub(crate) fn ensure(ok: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::Shape { op, message: message() }) }
}

/// Debug builds fill every op's output with NaN before the op writes it, so a kernel that skips
/// an element shows up as a non-finite value in the tests (timings turn it off).
pub(crate) static POISON_OUTPUTS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(cfg!(debug_assertions));

pub(crate) fn poison_outputs() -> bool {
    POISON_OUTPUTS.load(std::sync::atomic::Ordering::Relaxed)
}

/// How device matrix products are computed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmRoute {
    /// cuBLASLt with one pinned, split-K-free algorithm per shape class: a row's result does
    /// not depend on how many rows share the product (batch-invariant). The default.
    Invariant,
    /// cuBLAS's own choice per call (its heuristics may split K for few rows): the comparison
    /// point for what invariance costs.
    Cublas,
}

static GEMM_ROUTE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Sets the route of every later device matrix product in this process.
pub fn set_gemm_route(route: GemmRoute) {
    GEMM_ROUTE.store(route == GemmRoute::Cublas, std::sync::atomic::Ordering::Relaxed);
}

pub fn gemm_route() -> GemmRoute {
    if GEMM_ROUTE.load(std::sync::atomic::Ordering::Relaxed) {
        GemmRoute::Cublas
    } else {
        GemmRoute::Invariant
    }
}
