//! Token sampling of `kernels/sample.cu`: one draw per row of f32 logits, the CPU's token.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Buffer, DeviceData, Gpu, driver_error};
use crate::Result;

/// Threads per row: the kernel's constant, so a row's result never depends on the batch.
const SAMPLE_THREADS: u32 = 1024;

/// The token drawn from each row of `logits [rows × vocab]` with its uniform (the kernel's -1,
/// None: a tempered logit is NaN or +inf, or all are -inf); `top_k` 0 or ≥ vocab and `top_p` 1
/// keep every token.
pub(crate) fn sample_rows(
    gpu: &Arc<Gpu>,
    logits: &CudaSlice<f32>,
    vocab: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniforms: &[f64],
) -> Result<Vec<Option<u32>>> {
    let rows = uniforms.len();
    if rows == 0 {
        return Ok(Vec::new());
    }
    let stream = gpu.stream();
    let u = stream.clone_htod(uniforms).map_err(|e| driver_error("copy to device", e))?;
    let tokens = launch_sample(gpu, logits, vocab, (temperature, top_k, top_p), &u, rows)?;
    let tokens = stream.clone_dtoh(&tokens).map_err(|e| driver_error("copy to host", e))?;
    Ok(tokens.into_iter().map(|t| u32::try_from(t).ok()).collect())
}

/// [`sample_rows`] with each row's uniform as the two i32 halves of its f64 bits in a device
/// buffer (a captured graph's input), the tokens left on the device (-1: none).
pub(crate) fn sample_rows_on_device(
    gpu: &Arc<Gpu>,
    logits: &CudaSlice<f32>,
    vocab: usize,
    (temperature, top_k, top_p): (f32, usize, f32),
    uniform_bits: &CudaSlice<i32>,
    rows: usize,
) -> Result<Buffer> {
    let tokens =
        launch_sample(gpu, logits, vocab, (temperature, top_k, top_p), uniform_bits, rows)?;
    Ok(Buffer { gpu: gpu.clone(), data: DeviceData::I32(tokens) })
}

/// One block per row; the kernel reads `uniforms` as doubles (f64s, or their bits as i32
/// pairs: a device pointer is a device pointer).
fn launch_sample<U: cudarc::driver::DeviceRepr>(
    gpu: &Arc<Gpu>,
    logits: &CudaSlice<f32>,
    vocab: usize,
    (temperature, top_k, top_p): (f32, usize, f32),
    uniforms: &CudaSlice<U>,
    rows: usize,
) -> Result<CudaSlice<i32>> {
    let mut tokens = gpu.alloc::<i32>(rows)?;
    if rows > 0 {
        let cfg = LaunchConfig {
            grid_dim: (rows as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (vocab_i, top_k_i) = (vocab as i32, if top_k < vocab { top_k as i32 } else { 0 });
        launch!(
            gpu,
            "sample",
            "sample_rows_f32",
            cfg,
            &mut tokens,
            logits,
            uniforms,
            &vocab_i,
            &temperature,
            &top_k_i,
            &top_p
        )?;
    }
    Ok(tokens)
}

/// One speculative verification per chain of `kernels/sample.cu`'s `spec_verify_f32`:
/// `chains` (first policy row, first draft row, drafts), the drafts at the policy rows after
/// each chain row (`drafts`, one per policy row), the (accept, draw) uniforms laid out with
/// `stride` drafts per chain, chain rows `p_step` and `q_step` apart: the tokens each chain
/// gives (their counts, and the tokens at the chain's policy rows of a zeroed `[rows]`).
pub(crate) fn spec_verify(
    gpu: &Arc<Gpu>,
    (p, q, drafts): (&CudaSlice<f32>, &CudaSlice<f32>, &CudaSlice<i32>),
    (rows, vocab): (usize, usize),
    (temperature, top_k, top_p): (f32, usize, f32),
    (chains, uniforms, n): (&CudaSlice<i32>, &CudaSlice<i32>, usize),
    (stride, p_step, q_step): (usize, usize, usize),
) -> Result<(Buffer, Buffer)> {
    let mut tokens = match Buffer::zeros(gpu, crate::DType::I32, rows.max(1))?.data {
        DeviceData::I32(t) => t,
        _ => unreachable!("an i32 buffer"),
    };
    let mut counts = gpu.alloc::<i32>(n.max(1))?;
    if n > 0 {
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (SAMPLE_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let (stride_i, vocab_i) = (stride as i32, vocab as i32);
        let (p_step_i, q_step_i) = (p_step as i32, q_step as i32);
        let top_k_i = if top_k < vocab { top_k as i32 } else { 0 };
        launch!(
            gpu,
            "sample",
            "spec_verify_f32",
            cfg,
            &mut tokens,
            &mut counts,
            p,
            q,
            chains,
            drafts,
            uniforms,
            &stride_i,
            &p_step_i,
            &q_step_i,
            &vocab_i,
            &temperature,
            &top_k_i,
            &top_p
        )?;
    }
    let wrap = |d| Buffer { gpu: gpu.clone(), data: d };
    Ok((wrap(DeviceData::I32(counts)), wrap(DeviceData::I32(tokens))))
}
