//! INT4 fake quantization of `kernels/int4.cu` (miles' QAT weights), checked by
//! [`crate::ops::fake_quantize_int4`].

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{DeviceData, Gpu};
use crate::Result;

/// Warps (groups) per block of threads.
const GROUPS_PER_BLOCK: usize = 8;

/// `out` (f32 or bf16, `w`'s length) = the fake-quantized `w`, groups of `group` consecutive
/// weights.
pub(crate) fn fake_quantize(
    gpu: &Gpu,
    w: &CudaSlice<f32>,
    out: &mut DeviceData,
    group: usize,
) -> Result<()> {
    let groups = w.len() / group;
    if groups == 0 {
        return Ok(());
    }
    let cfg = LaunchConfig {
        grid_dim: (groups.div_ceil(GROUPS_PER_BLOCK) as u32, 1, 1),
        block_dim: (32 * GROUPS_PER_BLOCK as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (group, groups) = (group as i32, groups as i64);
    let out = out;
    per_float!("fake_quantize_int4", (out), |T, f| {
        launch!(gpu, "int4", kernel!(f, "int4_fake_quantize"), cfg, out, w, &group, &groups)
    })
}
