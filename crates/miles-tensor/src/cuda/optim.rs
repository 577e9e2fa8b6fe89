//! AdamW and the gradient sum of squares of `kernels/optim.cu`, over f32 device buffers.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Gpu, driver_error, elementwise_launch};
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
    let n = param.len();
    if n == 0 {
        return Ok(());
    }
    let (step_size, bc2_sqrt, decay) = hyper.step_constants(step);
    let AdamW { beta1, beta2, eps, .. } = *hyper;
    let n_i = n as i64;
    launch!(
        gpu,
        "optim",
        "adamw_f32",
        elementwise_launch(n),
        param,
        m,
        v,
        grad,
        &n_i,
        &grad_scale,
        &beta1,
        &beta2,
        &eps,
        &decay,
        &step_size,
        &bc2_sqrt
    )
}

/// Elements each block of the sum of squares reduces: fixed, so the order of additions depends
/// on the data size alone.
const SUMSQ_CHUNK: usize = 1 << 16;

/// Σ x² in f64, in a fixed order.
pub(crate) fn sum_squares(gpu: &Gpu, x: &CudaSlice<f32>) -> Result<f64> {
    let n = x.len();
    if n == 0 {
        return Ok(0.0);
    }
    let parts = n.div_ceil(SUMSQ_CHUNK);
    let mut partial = gpu.alloc::<f64>(parts)?;
    let cfg = LaunchConfig {
        grid_dim: (parts as u32, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    let (n_i, chunk) = (n as i64, SUMSQ_CHUNK as i64);
    launch!(gpu, "optim", "sumsq_partial_f32", cfg, &mut partial, x, &n_i, &chunk)?;
    let mut total = gpu.alloc::<f64>(1)?;
    let parts_i = parts as i32;
    let one = LaunchConfig { grid_dim: (1, 1, 1), block_dim: (1, 1, 1), shared_mem_bytes: 0 };
    launch!(gpu, "optim", "sumsq_total", one, &mut total, &partial, &parts_i)?;
    let host = gpu.stream().clone_dtoh(&total).map_err(|e| driver_error("copy to host", e))?;
    Ok(host[0])
}
