//! Collectives between the ranks of a run, one GPU each (NCCL): gradient sums and the weights'
//! broadcast, in place on f32 device tensors, ordered with the device's ops.
//!
//! Sums are NCCL's: for a given world size and machine the same algorithm reduces the same
//! chunks in the same order on every step, and every rank receives the same bits.

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
}

impl Collective {
    /// A new communicator's id (rank 0 makes it and hands it to the others).
    pub fn new_id() -> Result<Vec<u8>> {
        #[cfg(feature = "cuda")]
        return crate::cuda::nccl_unique_id();
        #[cfg(not(feature = "cuda"))]
        Err(crate::tensor::not_built())
    }

    /// Joins the communicator `id` as `rank` of `size` on `device` (a CUDA device; blocks until
    /// every rank has joined).
    pub fn join(device: &Device, id: &[u8], rank: usize, size: usize) -> Result<Collective> {
        let Device::Cuda(_ordinal) = *device else {
            return Err(Error::Device("NCCL collectives run on CUDA devices, not the CPU".into()));
        };
        if rank >= size {
            return Err(Error::Device(format!("NCCL: rank {rank} of a world of {size}")));
        }
        #[cfg(feature = "cuda")]
        return Ok(Collective {
            nccl: crate::cuda::nccl_join(_ordinal, id, rank, size)?,
            device: *device,
            rank,
            size,
        });
        #[cfg(not(feature = "cuda"))]
        {
            let _ = id;
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
        self.nccl.all_reduce_sum(&mut slices(tensors))?;
        Ok(())
    }

    /// Rank `root`'s tensors to every rank, in place.
    pub fn broadcast(&self, tensors: &mut [&mut Tensor], root: usize) -> Result<()> {
        self.check("broadcast", tensors)?;
        if root >= self.size {
            return Err(Error::Device(format!("NCCL broadcast from rank {root} of {}", self.size)));
        }
        #[cfg(feature = "cuda")]
        self.nccl.broadcast(&mut slices(tensors), root)?;
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
        assert!(err(Collective::join(&Device::Cpu, &[0; 128], 0, 1)).contains("CUDA devices"));
        assert!(err(Collective::join(&Device::Cuda(0), &[0; 128], 2, 2)).contains("rank 2"));
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
        let c = Collective::join(&device, &id, 0, 1).unwrap();
        let mut rng = crate::rng::Rng::new(81);
        let (a, b) = (rng.vec(1000, 1.0), rng.vec(37, 1.0));
        let mut ta = Tensor::from_f32(&[1000], a.clone(), &device).unwrap();
        let mut tb = Tensor::from_f32(&[37], b.clone(), &device).unwrap();
        c.all_reduce_sum(&mut [&mut ta, &mut tb]).unwrap();
        c.broadcast(&mut [&mut ta, &mut tb], 0).unwrap();
        assert_eq!((ta.to_vec_f32().unwrap(), tb.to_vec_f32().unwrap()), (a, b));
        let mut bf =
            Tensor::from_f32(&[4], vec![1.0; 4], &device).unwrap().to_dtype(DType::BF16).unwrap();
        assert!(c.all_reduce_sum(&mut [&mut bf]).is_err());
    }
}
