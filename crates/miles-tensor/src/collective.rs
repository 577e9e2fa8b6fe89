//! Collectives between the ranks of a run, one GPU each (NCCL): gradient sums and the weights'
//! broadcast, in place on f32 device tensors. They run on the communicator's own stream after
//! the device's ops queued before them; a sum can be started and waited for later
//! ([`Collective::start_all_reduce_sum`], [`Collective::wait`]) so that it overlaps the ops
//! queued between.
//!
//! Sums are NCCL's: for a given world size and machine the same algorithm reduces the same
//! chunks in the same order on every step, and every rank receives the same bits.
//!
//! Nothing waits forever: joining and every collective are bounded by the communicator's
//! timeout. A rank that died or is stuck makes the others stop with an error naming the
//! collective; dropping the communicator then aborts it (`ncclCommAbort`), which frees the
//! kernels waiting on the dead rank.

use std::time::Duration;
#[cfg(any(feature = "cuda", test))]
use std::time::Instant;

#[cfg(feature = "cuda")]
use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor};

/// One rank's communicator.
pub struct Collective {
    #[cfg(feature = "cuda")]
    nccl: crate::cuda::Nccl,
    device: Device,
    rank: usize,
    size: usize,
    #[cfg(feature = "cuda")]
    timeout: Duration,
}

impl Collective {
    /// A new communicator's id (rank 0 makes it and hands it to the others).
    pub fn new_id() -> Result<Vec<u8>> {
        #[cfg(feature = "cuda")]
        return crate::cuda::nccl_unique_id();
        #[cfg(not(feature = "cuda"))]
        Err(crate::tensor::not_built())
    }

    /// Joins the communicator `id` as `rank` of `size` on `device` (a CUDA device), waiting
    /// until every rank has joined, and each collective until it finishes, at most `timeout`.
    pub fn join(
        device: &Device,
        id: &[u8],
        rank: usize,
        size: usize,
        timeout: Duration,
    ) -> Result<Collective> {
        let Device::Cuda(_ordinal) = *device else {
            return Err(Error::Device("NCCL collectives run on CUDA devices, not the CPU".into()));
        };
        if rank >= size {
            return Err(Error::Device(format!("NCCL: rank {rank} of a world of {size}")));
        }
        #[cfg(feature = "cuda")]
        return Ok(Collective {
            nccl: crate::cuda::nccl_join(_ordinal, id, rank, size, timeout)?,
            device: *device,
            rank,
            size,
            timeout,
        });
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (id, timeout);
            Err(crate::tensor::not_built())
        }
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn size(&self) -> usize {
        self.size
    }

    /// Sums every tensor over the ranks, in place (f32 tensors on this communicator's device).
    pub fn all_reduce_sum(&self, tensors: &mut [&mut Tensor]) -> Result<()> {
        self.check("all_reduce_sum", tensors)?;
        #[cfg(feature = "cuda")]
        self.nccl.all_reduce_sum(&mut slices(tensors), self.timeout)?;
        Ok(())
    }

    /// Starts [`Collective::all_reduce_sum`] after the device's ops queued so far, on the
    /// communicator's own stream: the ops queued next run beside it until [`Collective::wait`].
    /// The tensors must stay alive and untouched until then.
    pub fn start_all_reduce_sum(&self, tensors: &mut [&mut Tensor]) -> Result<()> {
        self.check("start_all_reduce_sum", tensors)?;
        #[cfg(feature = "cuda")]
        self.nccl.start_all_reduce_sum(&mut slices(tensors))?;
        Ok(())
    }

    /// Orders the device's next ops after the collectives started so far and waits until they
    /// have run (at most the communicator's timeout).
    pub fn wait(&self) -> Result<()> {
        #[cfg(feature = "cuda")]
        self.nccl.finish("NCCL all-reduce of the gradients", self.timeout)?;
        Ok(())
    }

    /// Rank `root`'s tensors to every rank, in place.
    pub fn broadcast(&self, tensors: &mut [&mut Tensor], root: usize) -> Result<()> {
        self.check("broadcast", tensors)?;
        if root >= self.size {
            return Err(Error::Device(format!("NCCL broadcast from rank {root} of {}", self.size)));
        }
        #[cfg(feature = "cuda")]
        self.nccl.broadcast(&mut slices(tensors), root, self.timeout)?;
        Ok(())
    }

    fn check(&self, op: &'static str, tensors: &[&mut Tensor]) -> Result<()> {
        match tensors.iter().find(|t| t.dtype() != DType::F32 || t.device() != self.device) {
            Some(t) => Err(Error::DType {
                op,
                message: format!(
                    "{} tensor on {}: f32 on {} only",
                    t.dtype(),
                    t.device(),
                    self.device
                ),
            }),
            None => Ok(()),
        }
    }
}

/// Waits until `done()` says so; an error naming `what` once `timeout` has passed. Checks
/// every 10 µs at first, then every 200 µs: a step waits here for the end of its backward and
/// its last sums, and a coarser poll would add its period to every step.
#[cfg(any(feature = "cuda", test))]
pub(crate) fn wait_for(
    what: &str,
    timeout: Duration,
    mut done: impl FnMut() -> Result<bool>,
) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut pause = Duration::from_micros(10);
    loop {
        if done()? {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(stuck(what, timeout));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_micros(200));
    }
}

/// `f` on a thread of its own, its result if it comes within `timeout`, else an error naming
/// `what` (the thread stays blocked; the caller is expected to stop).
#[cfg(any(feature = "cuda", test))]
pub(crate) fn within<T: Send + 'static>(
    what: &str,
    timeout: Duration,
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(timeout) {
        Ok(result) => result,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(stuck(what, timeout)),
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
            Err(Error::Device(format!("{what}: the thread running it panicked")))
        }
    }
}

#[cfg(any(feature = "cuda", test))]
fn stuck(what: &str, timeout: Duration) -> Error {
    Error::Device(format!(
        "{what} did not finish within {timeout:?}: another rank stopped or is stuck (its own log \
         says why), so this rank stops too"
    ))
}

#[cfg(feature = "cuda")]
fn slices<'a>(tensors: &'a mut [&mut Tensor]) -> Vec<&'a mut cudarc::driver::CudaSlice<f32>> {
    tensors
        .iter_mut()
        .map(|t| match &mut t.storage {
            Storage::Cuda(b) => match &mut b.data {
                crate::cuda::DeviceData::F32(s) => s,
                _ => unreachable!("checked f32"),
            },
            _ => unreachable!("checked on the device"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collectives_refuse_the_cpu_and_bad_ranks() {
        let err = |r: Result<Collective>| r.err().map(|e| e.to_string()).unwrap_or_default();
        let t = Duration::from_secs(5);
        assert!(err(Collective::join(&Device::Cpu, &[0; 128], 0, 1, t)).contains("CUDA devices"));
        assert!(err(Collective::join(&Device::Cuda(0), &[0; 128], 2, 2, t)).contains("rank 2"));
    }

    /// A collective that never finishes (a dead peer) is an error naming it after the timeout,
    /// not a hang; one that finishes returns as soon as it does.
    #[test]
    fn waits_end_at_the_timeout_with_the_collectives_name() {
        let t = Duration::from_millis(150);
        let started = Instant::now();
        let err = wait_for("NCCL all-reduce", t, || Ok(false)).unwrap_err().to_string();
        assert!(started.elapsed() >= t, "{:?}", started.elapsed());
        assert!(err.contains("NCCL all-reduce did not finish within 150ms"), "{err}");
        assert!(err.contains("another rank stopped"), "{err}");
        let mut polls = 0;
        wait_for("x", Duration::from_secs(60), || {
            polls += 1;
            Ok(polls == 3)
        })
        .unwrap();
        assert_eq!(polls, 3);
        let failing = wait_for("x", Duration::from_secs(60), || Err(Error::Device("bad".into())));
        assert!(failing.unwrap_err().to_string().contains("bad"));
    }

    /// Joining a communicator whose other ranks never come stops at the timeout; a join that
    /// completes hands its result over, and a panicking one is an error.
    #[test]
    fn blocking_joins_are_bounded() {
        let t = Duration::from_millis(100);
        let hang = within("NCCL init of rank 1 of 2", t, || {
            std::thread::sleep(Duration::from_secs(3600));
            Ok(())
        });
        assert!(hang.unwrap_err().to_string().contains("NCCL init of rank 1 of 2 did not finish"));
        assert_eq!(within("x", Duration::from_secs(60), || Ok(7)).unwrap(), 7);
        let panicked = within::<()>("x", Duration::from_secs(60), || panic!("boom"));
        assert!(panicked.unwrap_err().to_string().contains("panicked"));
    }

    /// On one GPU a world of one rank: the sum and the broadcast leave every bit in place.
    #[test]
    fn a_world_of_one_keeps_its_tensors_on_cuda() {
        let device = Device::Cuda(0);
        if let Err(e) = device.ensure_available() {
            println!("skipping CUDA: {e}");
            return;
        }
        let id = Collective::new_id().unwrap();
        let c = Collective::join(&device, &id, 0, 1, Duration::from_secs(60)).unwrap();
        let mut rng = crate::rng::Rng::new(81);
        let (a, b) = (rng.vec(1000, 1.0), rng.vec(37, 1.0));
        let mut ta = Tensor::from_f32(&[1000], a.clone(), &device).unwrap();
        let mut tb = Tensor::from_f32(&[37], b.clone(), &device).unwrap();
        c.all_reduce_sum(&mut [&mut ta, &mut tb]).unwrap();
        c.broadcast(&mut [&mut ta, &mut tb], 0).unwrap();
        assert_eq!((ta.to_vec_f32().unwrap(), tb.to_vec_f32().unwrap()), (a.clone(), b.clone()));
        // Started on the communicator's stream, with an op queued beside it before the wait:
        // both keep their values.
        c.start_all_reduce_sum(&mut [&mut ta]).unwrap();
        let doubled = crate::ops::add(&tb, &tb).unwrap();
        c.wait().unwrap();
        assert_eq!(ta.to_vec_f32().unwrap(), a);
        let twice: Vec<f32> = b.iter().map(|x| x + x).collect();
        assert_eq!(doubled.to_vec_f32().unwrap(), twice);
        let mut bf =
            Tensor::from_f32(&[4], vec![1.0; 4], &device).unwrap().to_dtype(DType::BF16).unwrap();
        assert!(c.all_reduce_sum(&mut [&mut bf]).is_err());
    }
}
