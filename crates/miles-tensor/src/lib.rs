//! Tensors and the op set of miles-rs.
//!
//! [`cpu`] holds the reference implementation of every op: plain Rust over row-major `f32`
//! slices, multi-threaded with rayon, matrix products through the `gemm` crate. Each forward op
//! has its backward beside it, and every later device kernel is tested against these.
//! Reductions run in a fixed order, whatever the thread count, so results are reproducible.

pub mod cpu;
pub mod rng;
pub mod testing;

/// Errors of the op layer: shapes that do not fit, or a device that is not there.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch in {op}: {message}")]
    Shape { op: &'static str, message: String },
    #[error("{0}")]
    Device(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Fails with a shape error unless `ok`.
pub(crate) fn ensure(ok: bool, op: &'static str, message: impl FnOnce() -> String) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::Shape { op, message: message() }) }
}
