//! INT4 fake quantization: the forward weights of miles' quantization-aware training.

use super::{dtype_is, floats_only, host_tensor, same_device};
use crate::tensor::Storage;
use crate::{DType, Result, Tensor, cpu, ensure};

/// Writes into `out` (f32 or bf16, `w`'s shape and device) the fake-quantized f32 weight `w`
/// `[rows × cols]` in groups of `group` inputs ([`cpu::fake_quantize_int4`]: each group's
/// values q · s), in place (its buffer keeps its address, for the CUDA graphs that read it):
/// on every device the CPU's values, rounded to nearest even for bf16.
pub fn fake_quantize_int4(w: &Tensor, group: usize, out: &mut Tensor) -> Result<()> {
    const OP: &str = "fake_quantize_int4";
    dtype_is(OP, "w", w, DType::F32)?;
    floats_only(OP, &[out])?;
    same_device(OP, &[w, out])?;
    let cols = w.shape.get(1).copied().unwrap_or(0);
    ensure(
        w.shape.len() == 2 && out.shape == w.shape && group > 0 && cols.is_multiple_of(group),
        OP,
        || format!("w {:?} into {:?} in groups of {group}", w.shape, out.shape),
    )?;
    match (&w.storage, &mut out.storage) {
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(ws) }),
            Storage::Cuda(o),
        ) => crate::cuda::int4::fake_quantize(gpu, ws, &mut o.data, group),
        (Storage::F32(v), _) => {
            let values = cpu::fake_quantize_int4(v, cols, group)?;
            let dtype = out.dtype();
            out.storage = host_tensor(w.shape.clone(), values, dtype).storage;
            Ok(())
        }
        _ => unreachable!("an f32 w and an f32 or bf16 out on one device (checked above)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, tensor};
    use crate::rng::Rng;

    /// Every device writes the CPU's fake-quantized values (rounded to bf16 in bf16), over
    /// groups of 32 and 128 with an all-zero group, one whose amax is a level's exact multiple,
    /// halves that tie, small negatives (level 0 is +0, never -0) and a NaN (level 0, as the
    /// CPU's cast of it).
    #[test]
    fn fake_quantize_int4_has_the_cpus_values_on_every_device() {
        let mut rng = Rng::new(31);
        for device in devices() {
            for (rows, cols, group) in [(7, 256, 32), (5, 384, 128), (1, 32, 32)] {
                let mut w = rng.vec(rows * cols, 0.05);
                w[..group].fill(0.0);
                if rows > 1 {
                    // s = 1: ties at ±0.5, ±2.5 round to even.
                    w[group..2 * group].fill(0.5);
                    w[group] = 7.0;
                    w[group + 1] = -2.5;
                    w[group + 2] = 1.5;
                    w[2 * group + 3] = f32::NAN;
                }
                let wt = tensor(&[rows, cols], &w, DType::F32, &device);
                let want = cpu::fake_quantize_int4(&w, cols, group).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let mut out = Tensor::zeros(&[rows, cols], dtype, &device).unwrap();
                    fake_quantize_int4(&wt, group, &mut out).unwrap();
                    let want: Vec<f32> = match dtype {
                        DType::BF16 => {
                            want.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
                        }
                        _ => want.clone(),
                    };
                    let got = out.to_vec_f32().unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&got), bits(&want), "{device} {dtype} {rows}×{cols}/{group}");
                    if rows > 1 {
                        assert_eq!(&got[group..group + 3], &[7.0, -2.0, 2.0]);
                    }
                }
            }
            let w = tensor(&[2, 48], &[0.0; 96], DType::F32, &device);
            let mut out = Tensor::zeros(&[2, 48], DType::F32, &device).unwrap();
            assert!(fake_quantize_int4(&w, 32, &mut out).is_err());
            let mut narrow = Tensor::zeros(&[2, 32], DType::F32, &device).unwrap();
            assert!(fake_quantize_int4(&w, 16, &mut narrow).is_err());
        }
    }
}
