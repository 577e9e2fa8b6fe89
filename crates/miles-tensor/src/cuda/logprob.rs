//! The LM head's row statistics of `kernels/logprob.cu`: logp and entropy from f32 logits, and
//! their gradient with respect to the logits.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Buffer, DeviceData, Gpu, driver_error};
use crate::Result;

/// Threads per row: a constant, so a row's reduction order never depends on the batch.
const LOGPROB_THREADS: u32 = 512;

fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (LOGPROB_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn targets_on(gpu: &Gpu, targets: &[u32]) -> Result<CudaSlice<i32>> {
    let t: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
    gpu.stream().clone_htod(&t).map_err(|e| driver_error("copy to device", e))
}

/// `(logp, entropy)` `[rows]` of `logits [rows × vocab]` at temperature `t`; the targets from
/// the host or already on the device.
pub(crate) fn logprob_rows(
    gpu: &Arc<Gpu>,
    logits: &CudaSlice<f32>,
    targets: super::Ids,
    vocab: usize,
    t: f32,
) -> Result<(Buffer, Buffer)> {
    let rows = targets.len();
    let (mut logp, mut entropy) = (gpu.alloc::<f32>(rows)?, gpu.alloc::<f32>(rows)?);
    if rows > 0 {
        let uploaded;
        let targets = match targets {
            super::Ids::Host(v) => {
                uploaded =
                    gpu.stream().clone_htod(v).map_err(|e| driver_error("copy to device", e))?;
                &uploaded
            }
            super::Ids::Device(d, _) => d,
        };
        let vocab_i = vocab as i32;
        launch!(
            gpu,
            "logprob",
            "logprob_rows_f32",
            per_row(rows),
            &mut logp,
            &mut entropy,
            logits,
            targets,
            &vocab_i,
            &t
        )?;
    }
    let wrap = |s| Buffer { gpu: gpu.clone(), data: DeviceData::F32(s) };
    Ok((wrap(logp), wrap(entropy)))
}

/// `d_logits [rows × vocab]` of `d_logp·logp + d_entropy·entropy`, in f32 or rounded to bf16.
#[allow(clippy::too_many_arguments)]
pub(crate) fn logprob_rows_backward(
    gpu: &Arc<Gpu>,
    logits: &CudaSlice<f32>,
    targets: &[u32],
    d_logp: &CudaSlice<f32>,
    d_entropy: &CudaSlice<f32>,
    vocab: usize,
    t: f32,
    bf16_out: bool,
) -> Result<Buffer> {
    let rows = targets.len();
    let targets = targets_on(gpu, if rows > 0 { targets } else { &[0] })?;
    let vocab_i = vocab as i32;
    macro_rules! run {
        ($ty:ty, $kernel:expr, $wrap:path) => {{
            let mut d_logits = gpu.alloc::<$ty>(rows * vocab)?;
            if rows > 0 {
                launch!(
                    gpu,
                    "logprob",
                    $kernel,
                    per_row(rows),
                    &mut d_logits,
                    logits,
                    &targets,
                    d_logp,
                    d_entropy,
                    &vocab_i,
                    &t
                )?;
            }
            $wrap(d_logits)
        }};
    }
    let data = if bf16_out {
        run!(u16, "logprob_rows_backward_bf16", DeviceData::BF16)
    } else {
        run!(f32, "logprob_rows_backward_f32", DeviceData::F32)
    };
    Ok(Buffer { gpu: gpu.clone(), data })
}
