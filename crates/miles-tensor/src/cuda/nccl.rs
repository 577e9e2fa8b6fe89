//! NCCL between the ranks of a run, one GPU each. Each communicator runs on a stream of its
//! own: a collective starts after what the device's op stream queued before it, runs beside
//! what is queued after (the rest of a backward), and the op stream waits for it at
//! [`Nccl::finish`]. libnccl is loaded at run time; a machine without it gets an error, not a
//! crash.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::Duration;

use cudarc::driver::{CudaSlice, CudaStream};
use cudarc::nccl::result::NcclError;
use cudarc::nccl::{Comm, Id, ReduceOp, group_end, group_start};

use super::{Gpu, driver_error, gpu};
use crate::collective::{wait_for, within};
use crate::{Error, Result};

/// NCCL's result code with its own words on the last error (e.g. "Duplicate GPU detected").
fn nccl_error(what: &str, e: NcclError) -> Error {
    // SAFETY: both return static or library-owned strings (or null); the comm argument of
    // ncclGetLastError is unused by NCCL, and null is allowed.
    let said = |p: *const std::ffi::c_char| {
        (!p.is_null())
            .then(|| unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy().into_owned())
    };
    let code = said(unsafe { cudarc::nccl::sys::ncclGetErrorString(e.0) }).unwrap_or_default();
    // NCCL before 2.13 has no ncclGetLastError (cudarc panics on a missing symbol); its text is
    // the last error NCCL saw, most likely this one.
    let last =
        catch_unwind(|| unsafe { cudarc::nccl::sys::ncclGetLastError(std::ptr::null_mut()) })
            .ok()
            .and_then(said)
            .filter(|l| !l.is_empty())
            .map(|l| format!(" (NCCL's last error: {l})"))
            .unwrap_or_default();
    let hint = if e.0 == cudarc::nccl::sys::ncclResult_t::ncclInvalidUsage
        && what.starts_with("init")
    {
        "; NCCL needs one GPU a rank: with several processes pass --device cuda (rank i takes GPU \
         i of its host), or --distributed-backend tcp for ranks that share a GPU"
    } else {
        ""
    };
    Error::Device(format!("NCCL {what}: {:?}: {code}{last}{hint}", e.0))
}

/// Runs `f` where libnccl is present (cudarc panics on a missing library or symbol).
fn with_nccl<T>(what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    // SAFETY: only tries to dlopen the library.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::Device(format!(
            "NCCL {what}: libnccl.so is not on this machine (install NCCL or put it on \
             LD_LIBRARY_PATH)"
        )));
    }
    catch_unwind(AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(Error::Device(format!("NCCL {what}: the library failed to load"))))
}

/// A new communicator's unique id, 128 bytes: one rank makes it, every rank joins with it.
pub(crate) fn unique_id() -> Result<Vec<u8>> {
    with_nccl("unique id", || {
        let id = Id::new().map_err(|e| nccl_error("unique id", e))?;
        Ok(id.internal().iter().map(|&c| c as u8).collect())
    })
}

/// One rank's communicator on CUDA device `ordinal`. Dropping it aborts it (cudarc's `Comm`
/// calls `ncclCommAbort`), which also ends collectives stuck on a dead rank.
pub(crate) struct Nccl {
    comm: Comm,
    gpu: Arc<Gpu>,
    /// The communicator's stream.
    stream: Arc<CudaStream>,
}

/// A communicator on its way from the thread that made it.
struct Joined(Comm);
// SAFETY: an NCCL communicator may be used from any thread, one at a time; it moves once.
unsafe impl Send for Joined {}

/// Joins the communicator `id` as `rank` of `size`, waiting at most `timeout` for every rank.
pub(crate) fn join(
    ordinal: usize,
    id: &[u8],
    rank: usize,
    size: usize,
    timeout: Duration,
) -> Result<Nccl> {
    let gpu = gpu(ordinal)?;
    let internal: [std::ffi::c_char; 128] = id
        .iter()
        .map(|&b| b as std::ffi::c_char)
        .collect::<Vec<_>>()
        .try_into()
        .map_err(|_| Error::Device(format!("NCCL id of {} bytes, not 128", id.len())))?;
    let what = format!("NCCL init of rank {rank} of {size}");
    let stream = gpu.stream().context().new_stream().map_err(|e| driver_error("stream", e))?;
    let comm_stream = stream.clone();
    let joined = within(&what, timeout, move || {
        // NCCL takes the thread's current device as the rank's GPU.
        stream.context().bind_to_thread().map_err(|e| driver_error("bind context", e))?;
        with_nccl("init", || {
            Comm::from_rank(stream, rank, size, Id::uninit(internal))
                .map(Joined)
                .map_err(|e| nccl_error(&format!("init of rank {rank} of {size}"), e))
        })
    })?;
    Ok(Nccl { comm: joined.0, gpu, stream: comm_stream })
}

impl Nccl {
    /// Makes the communicator's stream wait for what the op stream queued so far.
    fn after_ops(&self) -> Result<()> {
        let queued = self.gpu.stream().record_event(None).map_err(|e| driver_error("event", e))?;
        self.stream.wait(&queued).map_err(|e| driver_error("stream wait", e))
    }

    /// Makes the op stream wait for the collectives started so far, and waits on the host, at
    /// most `timeout`, until they have run.
    pub(crate) fn finish(&self, what: &str, timeout: Duration) -> Result<()> {
        let done = self.stream.record_event(None).map_err(|e| driver_error(what, e))?;
        self.gpu.stream().wait(&done).map_err(|e| driver_error(what, e))?;
        wait_for(what, timeout, || done.try_is_complete().map_err(|e| driver_error(what, e)))
    }

    /// Sums each buffer over the ranks in place, all in one NCCL group, and waits for it.
    pub(crate) fn all_reduce_sum(
        &self,
        bufs: &mut [&mut CudaSlice<f32>],
        timeout: Duration,
    ) -> Result<()> {
        self.start_all_reduce_sum(bufs)?;
        self.finish("NCCL all-reduce of the gradients", timeout)
    }

    /// Starts summing each buffer over the ranks in place, all in one NCCL group, after the
    /// ops queued so far; [`Nccl::finish`] waits for it.
    pub(crate) fn start_all_reduce_sum(&self, bufs: &mut [&mut CudaSlice<f32>]) -> Result<()> {
        self.after_ops()?;
        group_start().map_err(|e| nccl_error("group start", e))?;
        let mut result = Ok(());
        for b in bufs.iter_mut() {
            if let Err(e) = self.comm.all_reduce_in_place(&mut **b, &ReduceOp::Sum) {
                result = Err(nccl_error("all-reduce", e));
                break;
            }
        }
        group_end().map_err(|e| nccl_error("group end", e))?;
        result
    }

    /// Rank `root`'s buffers to every rank, in place, all in one NCCL group.
    pub(crate) fn broadcast(
        &self,
        bufs: &mut [&mut CudaSlice<f32>],
        root: usize,
        timeout: Duration,
    ) -> Result<()> {
        self.after_ops()?;
        group_start().map_err(|e| nccl_error("group start", e))?;
        let mut result = Ok(());
        for b in bufs.iter_mut() {
            if let Err(e) = self.comm.broadcast_in_place(&mut **b, root as i32) {
                result = Err(nccl_error("broadcast", e));
                break;
            }
        }
        group_end().map_err(|e| nccl_error("group end", e))?;
        result?;
        self.finish(&format!("NCCL broadcast from rank {root}"), timeout)
    }
}
