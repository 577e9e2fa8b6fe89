//! AdamW and the gradient sum of squares of `kernels/optim.cu`, over f32 device buffers.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop};

use super::{Gpu, driver_error};
use crate::Result;
use crate::cpu::AdamW;

/// One AdamW step in place; the hyper-parameters as `cpu::AdamW::step` derives them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn adamw(
    gpu: &Gpu,
    hyper: &AdamW,
    step: u64,
    grad_scale: f32,
    param: &mut CudaSlice<f32>,
    m: &mut CudaSlice<f32>,
    v: &mut CudaSlice<f32>,
    grad: &CudaSlice<f32>,
) -> Result<()> {
    let slot = AdamWSlot {
        param: Moment::F32(param),
        m: Moment::F32(m),
        v: Moment::F32(v),
        grad,
        copy: None,
        rounding_key: None,
    };
    adamw_multi(gpu, hyper, step, grad_scale, &mut [slot])
}

/// Elements each block of the sum of squares reduces: fixed, so the order of additions depends
/// on the data size alone.
const SUMSQ_CHUNK: usize = 1 << 16;

/// Σ x² in f64, in a fixed order.
pub(crate) fn sum_squares(gpu: &Gpu, x: &CudaSlice<f32>) -> Result<f64> {
    sum_squares_multi(gpu, &[x])
}

/// An AdamW moment's or weight's buffer: f32, or bf16 (Megatron's precision-aware optimizer;
/// bf16 master weights).
pub(crate) enum Moment<'a> {
    F32(&'a mut CudaSlice<f32>),
    BF16(&'a mut CudaSlice<u16>),
}

impl Moment<'_> {
    fn is_bf16(&self) -> bool {
        matches!(self, Moment::BF16(_))
    }
}

/// The buffers of one tensor in a multi-tensor AdamW step.
pub(crate) struct AdamWSlot<'a> {
    pub param: Moment<'a>,
    pub m: Moment<'a>,
    pub v: Moment<'a>,
    pub grad: &'a CudaSlice<f32>,
    /// The bf16 compute copy to refresh from the updated weights, if the tensor has one.
    pub copy: Option<&'a mut CudaSlice<u16>>,
    /// The weights rounded to bf16 values stochastically, with this key's random bits.
    pub rounding_key: Option<u64>,
}

impl Moment<'_> {
    fn len(&self) -> usize {
        match self {
            Moment::F32(x) => x.len(),
            Moment::BF16(x) => x.len(),
        }
    }

    fn ptr_mut<'s>(&'s mut self, stream: &'s Arc<CudaStream>) -> (u64, SyncOnDrop<'s>) {
        match self {
            Moment::F32(x) => x.device_ptr_mut(stream),
            Moment::BF16(x) => x.device_ptr_mut(stream),
        }
    }
}

/// `kernels/optim.cu`'s `Slot` table on the device (eight 8-byte words per tensor: its five
/// pointers, size, first block and rounding key) and the launch's block count: blocks of
/// SUMSQ_CHUNK elements, tensor after tensor.
fn slot_table(
    gpu: &Gpu,
    slots: &[[u64; 5]],
    sizes: &[usize],
    keys: &[u64],
) -> Result<(CudaSlice<u64>, u32)> {
    let mut words = Vec::with_capacity(slots.len() * 8);
    let mut block = 0usize;
    for ((ptrs, &n), i) in slots.iter().zip(sizes).zip(0..) {
        words.extend_from_slice(ptrs);
        words.extend([n as u64, block as u64, keys.get(i).copied().unwrap_or(0)]);
        block += n.div_ceil(SUMSQ_CHUNK);
    }
    let table = gpu.stream().clone_htod(&words).map_err(|e| driver_error("copy to device", e))?;
    Ok((table, block as u32))
}

/// One AdamW step over every slot in one launch, as [`adamw`] does tensor by tensor, refreshing
/// the compute copies in the same pass.
pub(crate) fn adamw_multi(
    gpu: &Gpu,
    hyper: &AdamW,
    step: u64,
    grad_scale: f32,
    slots: &mut [AdamWSlot],
) -> Result<()> {
    let stream = gpu.stream().clone();
    let sizes: Vec<usize> = slots.iter().map(|s| s.param.len()).collect();
    let flags_of = |s: &AdamWSlot| {
        i32::from(s.m.is_bf16())
            | (i32::from(s.v.is_bf16()) << 1)
            | (i32::from(s.rounding_key.is_some()) << 2)
            | (i32::from(s.param.is_bf16()) << 3)
    };
    let flags = slots.first().map_or(0, flags_of);
    if slots.iter().any(|s| flags_of(s) != flags) {
        return Err(crate::Error::Device(
            "adamw_multi: every tensor's moments and weights must have one kind in a launch".into(),
        ));
    }
    let keys: Vec<u64> = slots.iter().map(|s| s.rounding_key.unwrap_or(0)).collect();
    let (table, blocks) = {
        let mut ptrs = Vec::with_capacity(slots.len());
        let mut guards = Vec::new();
        for s in slots.iter_mut() {
            let (p, gp) = s.param.ptr_mut(&stream);
            let (m, gm) = s.m.ptr_mut(&stream);
            let (v, gv) = s.v.ptr_mut(&stream);
            let (g, gg) = s.grad.device_ptr(&stream);
            let copy = match s.copy.as_mut() {
                Some(c) => {
                    let (c, gc) = c.device_ptr_mut(&stream);
                    guards.push(gc);
                    c
                }
                None => 0,
            };
            guards.extend([gp, gm, gv, gg]);
            ptrs.push([p, m, v, g, copy]);
        }
        slot_table(gpu, &ptrs, &sizes, &keys)?
    };
    if blocks == 0 {
        return Ok(());
    }
    let (step_size, bc2_sqrt, decay) = hyper.step_constants(step);
    let AdamW { beta1, beta2, eps, .. } = *hyper;
    let (count, chunk) = (slots.len() as i32, SUMSQ_CHUNK as i64);
    let cfg =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch!(
        gpu,
        "optim",
        "adamw_multi_f32",
        cfg,
        &table,
        &count,
        &chunk,
        &grad_scale,
        &beta1,
        &beta2,
        &eps,
        &decay,
        &step_size,
        &bc2_sqrt,
        &flags,
        &step
    )
}

/// Σ over the tensors in order of their [`sum_squares`], with the same bits, in two launches.
pub(crate) fn sum_squares_multi(gpu: &Gpu, xs: &[&CudaSlice<f32>]) -> Result<f64> {
    let stream = gpu.stream().clone();
    let sizes: Vec<usize> = xs.iter().map(|x| x.len()).collect();
    let (table, blocks) = {
        let mut ptrs = Vec::with_capacity(xs.len());
        let mut guards = Vec::with_capacity(xs.len());
        for x in xs {
            let (g, guard) = x.device_ptr(&stream);
            guards.push(guard);
            ptrs.push([0, 0, 0, g, 0]);
        }
        slot_table(gpu, &ptrs, &sizes, &[])?
    };
    if blocks == 0 {
        return Ok(0.0);
    }
    let mut partial = gpu.alloc::<f64>(blocks as usize)?;
    let (count, chunk) = (xs.len() as i32, SUMSQ_CHUNK as i64);
    let cfg =
        LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, "optim", "sumsq_multi_partial_f32", cfg, &mut partial, &table, &count, &chunk)?;
    let mut total = gpu.alloc::<f64>(1)?;
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, "optim", "sumsq_multi_total", one, &mut total, &partial, &table, &count, &chunk)?;
    let host = stream.clone_dtoh(&total).map_err(|e| driver_error("copy to host", e))?;
    Ok(host[0])
}
