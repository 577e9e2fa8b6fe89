//! [`Tensor`]: a shape, a dtype and storage on the host or on a CUDA device.

use std::fmt;

use half::bf16;

use crate::Result;

/// Element types whose all-zero bytes are the value zero.
///
/// # Safety
/// An implementor's zero bit pattern must be a valid value.
pub unsafe trait ZeroBits: Copy {}
// SAFETY: all-zero bytes are 0.0, 0, bf16's +0 and E4M3's +0.
unsafe impl ZeroBits for f32 {}
unsafe impl ZeroBits for i32 {}
unsafe impl ZeroBits for bf16 {}
unsafe impl ZeroBits for u8 {}

/// `n` zeros, or `None` when the allocator refuses (a huge KV-cache budget, say): the caller
/// gives a clear error instead of the process aborting. A zeroed allocation: the OS hands large
/// ones out lazily, so untouched pages cost nothing.
pub fn try_zeros<T: ZeroBits>(n: usize) -> Option<Vec<T>> {
    if n == 0 {
        return Some(Vec::new());
    }
    let layout = std::alloc::Layout::array::<T>(n).ok()?;
    if layout.size() == 0 {
        return Some(Vec::new());
    }
    // SAFETY: the layout has a non-zero size; on success the block is zero bytes, valid `T`s
    // (`ZeroBits`), allocated with `T`'s layout for exactly `n` elements, as Vec requires.
    unsafe {
        let ptr = std::alloc::alloc_zeroed(layout).cast::<T>();
        (!ptr.is_null()).then(|| Vec::from_raw_parts(ptr, n, n))
    }
}

/// Where a tensor lives and its ops run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    Cpu,
    /// The CUDA device of this ordinal (needs the `cuda` feature and a GPU).
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl Device {
    /// Ok when tensors can be made here; else why not ("built without CUDA …", "no CUDA
    /// device: …"). Opens the device on first use.
    pub fn ensure_available(&self) -> Result<()> {
        match *self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal).map(drop),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// How many CUDA devices this machine has (0 without the driver, or built without CUDA).
    /// Opens none of them.
    pub fn cuda_count() -> usize {
        #[cfg(feature = "cuda")]
        return crate::cuda::device_count();
        #[cfg(not(feature = "cuda"))]
        0
    }

    /// Waits until the ops queued on this device are done (ops run asynchronously on a GPU;
    /// copies to the host wait by themselves). For timings.
    pub fn synchronize(&self) -> Result<()> {
        match *self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.synchronize(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = crate::Error;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device> {
        let bad =
            || crate::Error::Device(format!("device `{s}`: use cpu, cuda (device 0) or cuda:N"));
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => match s.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Device::Cuda).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}

impl Device {
    /// Peak bytes of device memory held by this crate's buffers since the device was opened
    /// or [`Device::reset_peak_memory`] (0 on the CPU).
    pub fn peak_memory(&self) -> Result<u64> {
        match *self {
            Device::Cpu => Ok(0),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.peak_memory(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// Bytes of device memory this crate's buffers hold now (0 on the CPU).
    pub fn memory_in_use(&self) -> Result<u64> {
        match *self {
            Device::Cpu => Ok(0),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.memory_in_use(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// The chip's name ("cpu" on the CPU).
    pub fn name(&self) -> Result<String> {
        match *self {
            Device::Cpu => Ok("cpu".into()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.name(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// `(free, total)` bytes of device memory (`None` on the CPU, whose budget is the
    /// caller's).
    pub fn memory_info(&self) -> Result<Option<(u64, u64)>> {
        match *self {
            Device::Cpu => Ok(None),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.memory_info().map(Some),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// Captures what `f` queues on this device into a [`crate::Graph`] that replays it with
    /// one launch (CUDA graphs). `f` runs the ops without executing them: it must not copy to
    /// or from the host, wait for the device, or read results. Only on CUDA.
    #[cfg(feature = "cuda")]
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<crate::Graph> {
        match *self {
            Device::Cpu => Err(crate::Error::Device("graphs are captured on CUDA only".into())),
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.capture(f),
        }
    }

    /// Time the device spends on `iters` runs of `f`: between CUDA events recorded around
    /// them on the device's stream (launch gaps included, host time before the first launch
    /// not), or the wall time on the CPU. For benchmarks.
    pub fn time(
        &self,
        iters: u64,
        mut f: impl FnMut() -> Result<()>,
    ) -> Result<std::time::Duration> {
        match *self {
            Device::Cpu => {
                let start = std::time::Instant::now();
                for _ in 0..iters {
                    f()?;
                }
                Ok(start.elapsed())
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.time(iters, f),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    pub fn reset_peak_memory(&self) -> Result<()> {
        match *self {
            Device::Cpu => Ok(()),
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)?.reset_peak_memory(),
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }
}

/// The error for any CUDA request in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn not_built() -> crate::Error {
    crate::Error::Device(
        "built without CUDA: rebuild with `cargo xtask build --features cuda` \
         (or cargo's `--features miles-tensor/cuda`)"
            .into(),
    )
}

/// Element types. Float arithmetic is f32 whatever the storage type; `I32` holds integers
/// (token ids, offsets) and is never converted to or from a float implicitly. `F8E4M3` holds
/// FP8 codes (`cpu::e4m3_to_f32`), unscaled: their scales live beside them
/// ([`crate::ops::Fp8Matrix`]); they read as f32 but are made only by quantizing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    F32,
    BF16,
    I32,
    F8E4M3,
}

impl DType {
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::BF16 => 2,
            DType::F8E4M3 => 1,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::I32 => "i32",
            DType::F8E4M3 => "f8e4m3",
        })
    }
}

pub(crate) enum Storage {
    F32(Vec<f32>),
    BF16(Vec<bf16>),
    I32(Vec<i32>),
    F8(Vec<u8>),
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::Buffer),
}

impl Storage {
    /// At most `n` elements of host storage.
    #[cfg(feature = "cuda")]
    fn truncated(mut self, n: usize) -> Storage {
        match &mut self {
            Storage::F32(v) => v.truncate(n),
            Storage::BF16(v) => v.truncate(n),
            Storage::I32(v) => v.truncate(n),
            Storage::F8(v) => v.truncate(n),
            Storage::Cuda(_) => {}
        }
        self
    }
}

/// A dense row-major tensor: shape, dtype, and host or device storage.
pub struct Tensor {
    pub(crate) shape: Vec<usize>,
    pub(crate) storage: Storage,
}

impl fmt::Debug for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Tensor({:?}, {}, {})", self.shape, self.dtype(), self.device())
    }
}

fn check_len(shape: &[usize], len: usize) -> Result<()> {
    let want: usize = shape.iter().product();
    crate::ensure(want == len, "Tensor", || {
        format!("shape {shape:?} holds {want} elements, got {len}")
    })
}

/// Integers and floats do not convert into each other silently.
pub(crate) fn int_float(from: DType, to: DType) -> crate::Error {
    crate::Error::DType {
        op: "to_dtype",
        message: format!("{from} tensors do not convert to {to}; integers and floats stay apart"),
    }
}

/// A tensor of host `storage` moved onto `device`.
fn place(shape: Vec<usize>, storage: Storage, device: &Device) -> Result<Tensor> {
    match *device {
        Device::Cpu => Ok(Tensor { shape, storage }),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let gpu = crate::cuda::gpu(ordinal)?;
            let buffer = crate::cuda::Buffer::from_host(&gpu, &storage)?;
            Ok(Tensor { shape, storage: Storage::Cuda(buffer) })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(not_built()),
    }
}

impl Tensor {
    /// An f32 tensor of `data` (row-major, `shape`'s product elements) on `device`.
    pub fn from_f32(shape: &[usize], data: Vec<f32>, device: &Device) -> Result<Tensor> {
        check_len(shape, data.len())?;
        place(shape.to_vec(), Storage::F32(data), device)
    }

    /// A bf16 tensor of `data` on `device`.
    pub fn from_bf16(shape: &[usize], data: Vec<bf16>, device: &Device) -> Result<Tensor> {
        check_len(shape, data.len())?;
        place(shape.to_vec(), Storage::BF16(data), device)
    }

    /// An i32 tensor of `data` on `device`.
    pub fn from_i32(shape: &[usize], data: Vec<i32>, device: &Device) -> Result<Tensor> {
        check_len(shape, data.len())?;
        place(shape.to_vec(), Storage::I32(data), device)
    }

    /// A tensor of E4M3 `codes` on `device`.
    pub fn from_f8_codes(shape: &[usize], codes: Vec<u8>, device: &Device) -> Result<Tensor> {
        check_len(shape, codes.len())?;
        place(shape.to_vec(), Storage::F8(codes), device)
    }

    /// `shape`'s product zeros of `dtype` on `device`.
    pub fn zeros(shape: &[usize], dtype: DType, device: &Device) -> Result<Tensor> {
        let len: usize = shape.iter().product();
        match *device {
            Device::Cpu => {
                let refused = || {
                    let bytes = len.saturating_mul(dtype.size_in_bytes());
                    crate::Error::Device(format!("cannot allocate {bytes} bytes of host memory"))
                };
                let storage = match dtype {
                    DType::F32 => Storage::F32(try_zeros(len).ok_or_else(refused)?),
                    DType::BF16 => Storage::BF16(try_zeros(len).ok_or_else(refused)?),
                    DType::I32 => Storage::I32(try_zeros(len).ok_or_else(refused)?),
                    DType::F8E4M3 => Storage::F8(try_zeros(len).ok_or_else(refused)?),
                };
                Ok(Tensor { shape: shape.to_vec(), storage })
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(ordinal) => {
                let gpu = crate::cuda::gpu(ordinal)?;
                let buffer = crate::cuda::Buffer::zeros(&gpu, dtype, len)?;
                Ok(Tensor { shape: shape.to_vec(), storage: Storage::Cuda(buffer) })
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(_) => Err(not_built()),
        }
    }

    /// Sets every element to zero in place.
    pub fn zero_(&mut self) -> Result<()> {
        match &mut self.storage {
            Storage::F32(v) => v.fill(0.0),
            Storage::BF16(v) => v.fill(bf16::ZERO),
            Storage::I32(v) => v.fill(0),
            Storage::F8(v) => v.fill(0),
            #[cfg(feature = "cuda")]
            Storage::Cuda(buffer) => buffer.zero()?,
        }
        Ok(())
    }

    /// Overwrites the elements with `src`'s (same dtype and length; `src` on the host or on
    /// this tensor's device), in place: on a device the buffer keeps its address.
    pub fn copy_from(&mut self, src: &Tensor) -> Result<()> {
        if src.dtype() != self.dtype() || src.len() != self.len() {
            return Err(crate::Error::Shape {
                op: "copy_from",
                message: format!(
                    "{} {:?} into {} {:?}",
                    src.dtype(),
                    src.shape,
                    self.dtype(),
                    self.shape
                ),
            });
        }
        match (&mut self.storage, &src.storage) {
            #[cfg(feature = "cuda")]
            (Storage::Cuda(buffer), from) => {
                if let Storage::Cuda(b) = from
                    && b.ordinal() != buffer.ordinal()
                {
                    return Err(crate::Error::Device("copy_from: another device".into()));
                }
                buffer.copy_from(from)
            }
            #[cfg(feature = "cuda")]
            (to, Storage::Cuda(_)) => {
                *to = src.to_device(&Device::Cpu)?.storage;
                Ok(())
            }
            (Storage::F32(to), Storage::F32(from)) => {
                to.copy_from_slice(from);
                Ok(())
            }
            (Storage::BF16(to), Storage::BF16(from)) => {
                to.copy_from_slice(from);
                Ok(())
            }
            (Storage::I32(to), Storage::I32(from)) => {
                to.copy_from_slice(from);
                Ok(())
            }
            (Storage::F8(to), Storage::F8(from)) => {
                to.copy_from_slice(from);
                Ok(())
            }
            _ => unreachable!("the dtypes are equal (checked above)"),
        }
    }

    /// A copy on the same device (a new buffer; `Clone` is not implemented because a device
    /// copy can fail).
    pub fn try_clone(&self) -> Result<Tensor> {
        let mut copy = Tensor::zeros(&self.shape, self.dtype(), &self.device())?;
        copy.copy_from(self)?;
        Ok(copy)
    }

    /// The same elements seen with another shape of as many elements (no copy).
    pub fn reshape(self, shape: &[usize]) -> Result<Tensor> {
        check_len(shape, self.len())?;
        Ok(Tensor { shape: shape.to_vec(), storage: self.storage })
    }

    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.shape.iter().product()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn dtype(&self) -> DType {
        match &self.storage {
            Storage::F32(_) => DType::F32,
            Storage::BF16(_) => DType::BF16,
            Storage::I32(_) => DType::I32,
            Storage::F8(_) => DType::F8E4M3,
            #[cfg(feature = "cuda")]
            Storage::Cuda(buffer) => buffer.dtype(),
        }
    }

    pub fn device(&self) -> Device {
        match &self.storage {
            Storage::F32(_) | Storage::BF16(_) | Storage::I32(_) | Storage::F8(_) => Device::Cpu,
            #[cfg(feature = "cuda")]
            Storage::Cuda(buffer) => Device::Cuda(buffer.ordinal()),
        }
    }

    /// A copy of this tensor on `device`.
    pub fn to_device(&self, device: &Device) -> Result<Tensor> {
        let host = match &self.storage {
            Storage::F32(v) => Storage::F32(v.clone()),
            Storage::BF16(v) => Storage::BF16(v.clone()),
            Storage::I32(v) => Storage::I32(v.clone()),
            Storage::F8(v) => Storage::F8(v.clone()),
            // (An empty tensor's device buffer holds one placeholder element: not copied.)
            #[cfg(feature = "cuda")]
            Storage::Cuda(buffer) => buffer.to_host()?.truncated(self.len()),
        };
        place(self.shape.clone(), host, device)
    }

    /// A copy of this tensor with elements of `dtype`, on the same device (bf16 rounds to
    /// nearest even). FP8 codes convert to nothing else: they are made by quantizing
    /// ([`crate::ops::Fp8Matrix`]) and read through [`Tensor::to_vec_f32`].
    pub fn to_dtype(&self, dtype: DType) -> Result<Tensor> {
        let shape = self.shape.clone();
        if (self.dtype() == DType::F8E4M3) != (dtype == DType::F8E4M3) {
            return Err(crate::Error::DType {
                op: "to_dtype",
                message: format!(
                    "{} does not convert to {dtype}: FP8 codes come from ops::Fp8Matrix::quantize",
                    self.dtype()
                ),
            });
        }
        let storage = match (&self.storage, dtype) {
            (Storage::F32(v), DType::F32) => Storage::F32(v.clone()),
            (Storage::BF16(v), DType::BF16) => Storage::BF16(v.clone()),
            (Storage::F32(v), DType::BF16) => {
                Storage::BF16(v.iter().map(|&x| bf16::from_f32(x)).collect())
            }
            (Storage::BF16(v), DType::F32) => Storage::F32(v.iter().map(|x| x.to_f32()).collect()),
            (Storage::I32(v), DType::I32) => Storage::I32(v.clone()),
            (Storage::F8(v), _) => Storage::F8(v.clone()),
            (Storage::I32(_), _) | (Storage::F32(_) | Storage::BF16(_), DType::I32) => {
                return Err(int_float(self.dtype(), dtype));
            }
            (_, DType::F8E4M3) => unreachable!("refused above"),
            #[cfg(feature = "cuda")]
            (Storage::Cuda(buffer), dtype) => Storage::Cuda(buffer.to_dtype(dtype)?),
        };
        Ok(Tensor { shape, storage })
    }

    /// The elements as f32, copied to the host (FP8 codes as their unscaled values).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        match &self.storage {
            Storage::F32(v) => Ok(v.clone()),
            Storage::F8(v) => Ok(v.iter().map(|&c| crate::cpu::e4m3_to_f32(c)).collect()),
            Storage::BF16(v) => Ok(v.iter().map(|x| x.to_f32()).collect()),
            Storage::I32(_) => Err(int_float(DType::I32, DType::F32)),
            #[cfg(feature = "cuda")]
            Storage::Cuda(buffer) => {
                let mut v = buffer.to_vec_f32()?;
                v.truncate(self.len()); // an empty tensor's placeholder element
                Ok(v)
            }
        }
    }

    /// The elements of an i32 tensor, copied to the host.
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        match self.to_device(&Device::Cpu)?.storage {
            Storage::I32(v) => Ok(v),
            _ => Err(int_float(self.dtype(), DType::I32)),
        }
    }

    /// The codes of an FP8 tensor, copied to the host.
    pub fn to_vec_f8_codes(&self) -> Result<Vec<u8>> {
        match self.to_device(&Device::Cpu)?.storage {
            Storage::F8(v) => Ok(v),
            _ => Err(crate::Error::DType {
                op: "to_vec_f8_codes",
                message: format!("a {} tensor holds no FP8 codes", self.dtype()),
            }),
        }
    }

    /// The elements as bf16 (rounded to nearest even from f32), copied to the host.
    pub fn to_vec_bf16(&self) -> Result<Vec<bf16>> {
        Ok(self.to_vec_f32()?.into_iter().map(bf16::from_f32).collect())
    }
}
