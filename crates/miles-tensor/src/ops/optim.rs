//! The optimizer's ops: one AdamW step over f32 master weights and f32 or bf16 moments, and
//! the sum of squares behind the global gradient norm, both giving the same bits on every
//! device.

use rayon::prelude::*;

use super::{dtype_is, same_device};
use crate::cpu::{self, AdamW};
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, ensure};

/// The f32 elements of a host tensor, mutably.
fn host_f32_mut(t: &mut Tensor) -> &mut [f32] {
    match &mut t.storage {
        Storage::F32(v) => v,
        _ => unreachable!("host_f32_mut of a non-f32 or device tensor (checked by the op)"),
    }
}

#[cfg(feature = "cuda")]
fn device_f32_mut(t: &mut Tensor) -> &mut cudarc::driver::CudaSlice<f32> {
    match &mut t.storage {
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::F32(s), .. }) => s,
        _ => unreachable!("device_f32_mut of a non-f32 or host tensor (checked by the op)"),
    }
}

#[cfg(feature = "cuda")]
fn device_bf16_mut(t: &mut Tensor) -> &mut cudarc::driver::CudaSlice<u16> {
    match &mut t.storage {
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::BF16(s), .. }) => s,
        _ => unreachable!("device_bf16_mut of a non-bf16 or host tensor (checked by the op)"),
    }
}

#[cfg(feature = "cuda")]
fn device_moment(t: &mut Tensor) -> crate::cuda::Moment<'_> {
    match t.dtype() {
        DType::BF16 => crate::cuda::Moment::BF16(device_bf16_mut(t)),
        _ => crate::cuda::Moment::F32(device_f32_mut(t)),
    }
}

#[cfg(feature = "cuda")]
fn device_f32(t: &Tensor) -> &cudarc::driver::CudaSlice<f32> {
    match &t.storage {
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::F32(s), .. }) => s,
        _ => unreachable!("device_f32 of a non-f32 or host tensor (checked by the op)"),
    }
}

/// One AdamW step in place: `grad · grad_scale` (the clipping factor) updates `m`, `v` and
/// `param`, all f32 and of one shape, as `cpu::AdamW::step` does (`step` counts from 1). The
/// CUDA kernel rounds exactly as the CPU does: both give the same bits.
pub fn adamw_step(
    hyper: &AdamW,
    step: u64,
    grad_scale: f32,
    param: &mut Tensor,
    m: &mut Tensor,
    v: &mut Tensor,
    grad: &Tensor,
) -> Result<()> {
    const OP: &str = "adamw";
    let device = same_device(OP, &[param, m, v, grad])?;
    for (what, t) in [("param", &*param), ("m", &*m), ("v", &*v), ("grad", grad)] {
        dtype_is(OP, what, t, DType::F32)?;
        ensure(t.shape == param.shape, OP, || {
            format!("{what} {:?} must be shaped like param {:?}", t.shape, param.shape)
        })?;
    }
    ensure(step >= 1, OP, || "step counts from 1".into())?;
    match device {
        Device::Cpu => {
            let scaled: Vec<f32>;
            let g = match &grad.storage {
                Storage::F32(g) if grad_scale == 1.0 => g.as_slice(),
                Storage::F32(g) => {
                    scaled = g.iter().map(|x| x * grad_scale).collect();
                    &scaled
                }
                _ => unreachable!("grad is f32 on the host"),
            };
            let (m, v) = (host_f32_mut(m), host_f32_mut(v));
            hyper.step(host_f32_mut(param), g, m, v, step)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let gpu = match &param.storage {
                Storage::Cuda(buffer) => buffer.gpu.clone(),
                _ => unreachable!("param is on a device"),
            };
            let (p, mm, vv) = (device_f32_mut(param), device_f32_mut(m), device_f32_mut(v));
            crate::cuda::adamw(&gpu, hyper, step, grad_scale, p, mm, vv, device_f32(grad))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// One tensor of [`adamw_multi`]: the f32 master, its moments (f32, or bf16 as Megatron's
/// precision-aware optimizer keeps them) and gradient (one shape), and the bf16 compute copy
/// of the master that the step refreshes, if it has one.
pub struct AdamWTensors<'a> {
    /// The master: f32, or bf16 with `rounding_key` (a bf16 master is its own compute copy).
    pub param: &'a mut Tensor,
    pub m: &'a mut Tensor,
    pub v: &'a mut Tensor,
    pub grad: &'a Tensor,
    pub copy: Option<&'a mut Tensor>,
    /// Bf16 master weights: the new weight is rounded to a bf16 value stochastically
    /// ([`cpu::round_bf16_stochastic`] with [`cpu::rounding_bits`] of this key, the step and the
    /// element), kept in the param's dtype.
    pub rounding_key: Option<u64>,
}

/// [`adamw_step`] over many tensors, with the same bits, refreshing each compute copy from
/// its updated master (round to nearest even): one launch for all of them on CUDA.
pub fn adamw_multi(
    hyper: &AdamW,
    step: u64,
    grad_scale: f32,
    tensors: &mut [AdamWTensors],
) -> Result<()> {
    const OP: &str = "adamw_multi";
    let Some(first) = tensors.first() else { return Ok(()) };
    let device = first.param.device();
    for t in tensors.iter() {
        let mut all = vec![&*t.param, &*t.m, &*t.v, t.grad];
        all.extend(t.copy.as_deref());
        ensure(same_device(OP, &all)? == device, OP, || "tensors on different devices".into())?;
        dtype_is(OP, "grad", t.grad, DType::F32)?;
        let kind = |t: &AdamWTensors| (t.param.dtype(), t.rounding_key.is_some());
        ensure(
            match kind(t) {
                (DType::F32, _) => true,
                (DType::BF16, rounded) => rounded && t.copy.is_none(),
                _ => false,
            },
            OP,
            || {
                format!(
                    "param is {:?}: f32, or bf16 rounded stochastically with no copy",
                    t.param.dtype()
                )
            },
        )?;
        ensure(kind(t) == kind(first), OP, || {
            "every tensor's weights of one kind (dtype and rounding)".into()
        })?;
        for (what, x) in [("m", &*t.m), ("v", &*t.v)] {
            ensure(matches!(x.dtype(), DType::F32 | DType::BF16), OP, || {
                format!("{what} is {:?}: moments are f32 or bf16", x.dtype())
            })?;
        }
        let pair = |t: &AdamWTensors| (t.m.dtype(), t.v.dtype());
        ensure(pair(t) == pair(first), OP, || {
            format!(
                "moments {:?} beside {:?}: one dtype pair for every tensor",
                pair(t),
                pair(first)
            )
        })?;
        if let Some(c) = t.copy.as_deref() {
            dtype_is(OP, "copy", c, DType::BF16)?;
        }
        for x in all {
            ensure(x.shape == t.param.shape, OP, || {
                format!("{:?} must be shaped like param {:?}", x.shape, t.param.shape)
            })?;
        }
    }
    ensure(step >= 1, OP, || "step counts from 1".into())?;
    match device {
        Device::Cpu => {
            for t in tensors.iter_mut() {
                // bf16 moments and weights: the step in f32 (the update reads the unrounded new
                // moments), stored back rounded as the kernel does: moments to nearest even,
                // weights stochastically.
                let round = |p: &mut Tensor, key| {
                    host_f32_mut(p).par_iter_mut().enumerate().for_each(|(i, x)| {
                        let r = cpu::rounding_bits(key, step, i as u64);
                        *x = cpu::round_bf16_stochastic(*x, r).to_f32();
                    })
                };
                if [&*t.param, &*t.m, &*t.v].iter().all(|x| x.dtype() == DType::F32) {
                    adamw_step(hyper, step, grad_scale, t.param, t.m, t.v, t.grad)?;
                    if let Some(key) = t.rounding_key {
                        round(t.param, key);
                    }
                } else {
                    let mut p = t.param.to_dtype(DType::F32)?;
                    let mut m = t.m.to_dtype(DType::F32)?;
                    let mut v = t.v.to_dtype(DType::F32)?;
                    adamw_step(hyper, step, grad_scale, &mut p, &mut m, &mut v, t.grad)?;
                    if let Some(key) = t.rounding_key {
                        round(&mut p, key);
                    }
                    *t.param = p.to_dtype(t.param.dtype())?;
                    *t.m = m.to_dtype(t.m.dtype())?;
                    *t.v = v.to_dtype(t.v.dtype())?;
                }
                if let Some(c) = t.copy.as_deref_mut() {
                    *c = t.param.to_dtype(DType::BF16)?;
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let gpu = match &tensors[0].param.storage {
                Storage::Cuda(buffer) => buffer.gpu.clone(),
                _ => unreachable!("param is on a device"),
            };
            let mut slots: Vec<crate::cuda::AdamWSlot> = tensors
                .iter_mut()
                .map(|t| crate::cuda::AdamWSlot {
                    param: device_moment(t.param),
                    m: device_moment(t.m),
                    v: device_moment(t.v),
                    grad: device_f32(t.grad),
                    copy: t.copy.as_deref_mut().map(device_bf16_mut),
                    rounding_key: t.rounding_key,
                })
                .collect();
            crate::cuda::adamw_multi(&gpu, hyper, step, grad_scale, &mut slots)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// Σ over `tensors` in order of their [`sum_squares`], with the same bits (two launches on
/// CUDA for all of them): the square of the global gradient norm.
pub fn sum_squares_multi(tensors: &[&Tensor]) -> Result<f64> {
    const OP: &str = "sum_squares_multi";
    if tensors.is_empty() {
        return Ok(0.0);
    }
    let device = same_device(OP, tensors)?;
    for t in tensors {
        dtype_is(OP, "every tensor", t, DType::F32)?;
    }
    match device {
        Device::Cpu => tensors.iter().try_fold(0.0, |sum, t| Ok(sum + sum_squares(t)?)),
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let gpu = match &tensors[0].storage {
                Storage::Cuda(buffer) => buffer.gpu.clone(),
                _ => unreachable!("on a device"),
            };
            let slices: Vec<_> = tensors.iter().map(|t| device_f32(t)).collect();
            crate::cuda::sum_squares_multi(&gpu, &slices)
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// Σ x² of an f32 tensor, in f64 and in an order fixed by its size (a gradient's share of the
/// global norm: `sqrt` of the sum over tensors, summed in order).
pub fn sum_squares(t: &Tensor) -> Result<f64> {
    dtype_is("sum_squares", "the tensor", t, DType::F32)?;
    match t.device() {
        Device::Cpu => {
            let Storage::F32(v) = &t.storage else { unreachable!("f32 on the host") };
            Ok(cpu::sum_squares(v))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &t.storage else { unreachable!("on a device") };
            crate::cuda::sum_squares(&buffer.gpu, device_f32(t))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, tensor};
    use crate::rng::Rng;

    #[test]
    fn adamw_gives_the_cpu_bits_on_every_device() {
        let mut rng = Rng::new(51);
        let hyper = AdamW { lr: 3e-4, beta1: 0.9, beta2: 0.98, eps: 1e-8, weight_decay: 0.1 };
        let n = 100_003;
        let param0 = rng.vec(n, 1.0);
        let grads: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(n, 0.01)).collect();
        // The reference: three steps of cpu::AdamW, the last one clipped by 0.5.
        let (mut p, mut m, mut v) = (param0.clone(), vec![0.0; n], vec![0.0; n]);
        for (i, g) in grads.iter().enumerate() {
            let scale = if i == 2 { 0.5 } else { 1.0 };
            let g: Vec<f32> = g.iter().map(|x| x * scale).collect();
            hyper.step(&mut p, &g, &mut m, &mut v, i as u64 + 1).unwrap();
        }
        for device in devices() {
            let t = |x: &[f32]| tensor(&[n], x, DType::F32, &device);
            let (mut pt, mut mt, mut vt) = (t(&param0), t(&vec![0.0; n]), t(&vec![0.0; n]));
            for (i, g) in grads.iter().enumerate() {
                let scale = if i == 2 { 0.5 } else { 1.0 };
                adamw_step(&hyper, i as u64 + 1, scale, &mut pt, &mut mt, &mut vt, &t(g)).unwrap();
            }
            assert_eq!(pt.to_vec_f32().unwrap(), p, "{device}: weights");
            assert_eq!(mt.to_vec_f32().unwrap(), m, "{device}: first moments");
            assert_eq!(vt.to_vec_f32().unwrap(), v, "{device}: second moments");
            let bad = tensor(&[n - 1], &param0[1..], DType::F32, &device);
            assert!(adamw_step(&hyper, 1, 1.0, &mut pt, &mut mt, &mut vt, &bad).is_err());
            assert!(adamw_step(&hyper, 0, 1.0, &mut pt, &mut mt, &mut vt, &t(&param0)).is_err());
        }
    }

    /// The multi-tensor step gives every tensor the bits of its own step, the compute copies
    /// those of converting the new weights; the multi-tensor sum those of summing in order.
    #[test]
    fn multi_tensor_adamw_and_norm_give_the_single_tensor_bits() {
        let mut rng = Rng::new(53);
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 };
        let sizes = [1usize, 0, (1 << 16) + 5, 300, 3 << 16];
        let data: Vec<[Vec<f32>; 2]> =
            sizes.iter().map(|&n| [rng.vec(n, 1.0), rng.vec(n, 0.1)]).collect();
        for device in devices() {
            let t = |x: &[f32]| tensor(&[x.len()], x, DType::F32, &device);
            let single: Vec<Vec<f32>> = data
                .iter()
                .map(|[p, g]| {
                    let (mut p, mut m, mut v) =
                        (t(p), t(&vec![0.0; p.len()]), t(&vec![0.0; p.len()]));
                    for step in 1..=2 {
                        adamw_step(&hyper, step, 0.7, &mut p, &mut m, &mut v, &t(g)).unwrap();
                    }
                    p.to_vec_f32().unwrap()
                })
                .collect();
            let mut ps: Vec<Tensor> = data.iter().map(|[p, _]| t(p)).collect();
            let gs: Vec<Tensor> = data.iter().map(|[_, g]| t(g)).collect();
            let zeros = || data.iter().map(|[p, _]| t(&vec![0.0; p.len()])).collect::<Vec<_>>();
            let (mut ms, mut vs) = (zeros(), zeros());
            let mut copies: Vec<Tensor> =
                data.iter().map(|[p, _]| tensor(&[p.len()], p, DType::BF16, &device)).collect();
            for step in 1..=2 {
                let mut parts: Vec<AdamWTensors> = ps
                    .iter_mut()
                    .zip(&mut ms)
                    .zip(&mut vs)
                    .zip(&gs)
                    .zip(&mut copies)
                    .enumerate()
                    .map(|(i, ((((param, m), v), grad), copy))| AdamWTensors {
                        param,
                        m,
                        v,
                        grad,
                        copy: (i != 3).then_some(copy),
                        rounding_key: None,
                    })
                    .collect();
                adamw_multi(&hyper, step, 0.7, &mut parts).unwrap();
            }
            for (i, (p, want)) in ps.iter().zip(&single).enumerate() {
                assert_eq!(&p.to_vec_f32().unwrap(), want, "{device}: tensor {i}");
                let copy = copies[i].to_vec_f32().unwrap();
                let rounded: Vec<f32> = if i == 3 {
                    data[i][0].iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
                } else {
                    want.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect()
                };
                assert_eq!(copy, rounded, "{device}: copy {i} (3 has none: left alone)");
            }
            let refs: Vec<&Tensor> = gs.iter().collect();
            let sum = refs.iter().fold(0.0, |s, g| s + sum_squares(g).unwrap());
            assert_eq!(sum_squares_multi(&refs).unwrap().to_bits(), sum.to_bits(), "{device}");
            let bf = tensor(&[2], &[1.0, 2.0], DType::BF16, &device);
            assert!(sum_squares_multi(&[&gs[0], &bf]).is_err());
            let mut bad_copy = t(&data[0][0]);
            let (mut p, mut m, mut v) = (t(&[1.0]), t(&[0.0]), t(&[0.0]));
            let g = t(&[1.0]);
            let mut parts = [AdamWTensors {
                param: &mut p,
                m: &mut m,
                v: &mut v,
                grad: &g,
                copy: Some(&mut bad_copy),
                rounding_key: None,
            }];
            assert!(adamw_multi(&hyper, 1, 1.0, &mut parts).is_err(), "an f32 copy");
        }
    }

    /// [`adamw_multi`] over one tensor without a copy: `[param, m, v]`.
    fn one_step(
        hyper: &AdamW,
        step: u64,
        [param, m, v]: [&mut Tensor; 3],
        grad: &Tensor,
        rounding_key: Option<u64>,
    ) -> Result<()> {
        let mut parts = [AdamWTensors { param, m, v, grad, copy: None, rounding_key }];
        adamw_multi(hyper, step, 1.0, &mut parts)
    }

    /// bf16 moments (Megatron's `--exp-avg-dtype bf16 --exp-avg-sq-dtype bf16`): each step
    /// in f32 from the stored values, the weights updated with the unrounded new moments, which
    /// are then stored to nearest even; the same bits on every device, for either moment alone
    /// in bf16 too. Mixed pairs in one call are refused.
    #[test]
    fn bf16_moments_step_in_f32_and_store_rounded_on_every_device() {
        let mut rng = Rng::new(54);
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 };
        let n = (1 << 16) + 77;
        let param0 = rng.vec(n, 1.0);
        let grads: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(n, 0.05)).collect();
        let round =
            |x: &mut [f32]| x.iter_mut().for_each(|x| *x = half::bf16::from_f32(*x).to_f32());
        for (m_bf16, v_bf16) in [(true, true), (true, false), (false, true)] {
            let (mut p, mut m, mut v) = (param0.clone(), vec![0.0; n], vec![0.0; n]);
            for (i, g) in grads.iter().enumerate() {
                hyper.step(&mut p, g, &mut m, &mut v, i as u64 + 1).unwrap();
                if m_bf16 {
                    round(&mut m);
                }
                if v_bf16 {
                    round(&mut v);
                }
            }
            let dtype = |bf16: bool| if bf16 { DType::BF16 } else { DType::F32 };
            for device in devices() {
                let t = |x: &[f32], d| tensor(&[n], x, d, &device);
                let mut pt = t(&param0, DType::F32);
                let mut mt = t(&vec![0.0; n], dtype(m_bf16));
                let mut vt = t(&vec![0.0; n], dtype(v_bf16));
                for (i, g) in grads.iter().enumerate() {
                    let g = t(g, DType::F32);
                    one_step(&hyper, i as u64 + 1, [&mut pt, &mut mt, &mut vt], &g, None).unwrap();
                }
                let what = format!("{device} m bf16 {m_bf16} v bf16 {v_bf16}");
                assert_eq!(mt.dtype(), dtype(m_bf16), "{what}");
                assert_eq!(pt.to_vec_f32().unwrap(), p, "{what}: weights");
                assert_eq!(mt.to_vec_f32().unwrap(), m, "{what}: first moments");
                assert_eq!(vt.to_vec_f32().unwrap(), v, "{what}: second moments");
            }
        }
        for device in devices() {
            let t = |x: &[f32], d| tensor(&[1], x, d, &device);
            let (mut p1, mut p2) = (t(&[1.0], DType::F32), t(&[1.0], DType::F32));
            let (mut m1, mut v1) = (t(&[0.0], DType::BF16), t(&[0.0], DType::BF16));
            let (mut m2, mut v2) = (t(&[0.0], DType::F32), t(&[0.0], DType::F32));
            let g = t(&[1.0], DType::F32);
            let mut parts = [
                AdamWTensors {
                    param: &mut p1,
                    m: &mut m1,
                    v: &mut v1,
                    grad: &g,
                    copy: None,
                    rounding_key: None,
                },
                AdamWTensors {
                    param: &mut p2,
                    m: &mut m2,
                    v: &mut v2,
                    grad: &g,
                    copy: None,
                    rounding_key: None,
                },
            ];
            let err = adamw_multi(&hyper, 1, 1.0, &mut parts).unwrap_err().to_string();
            assert!(err.contains("one dtype pair"), "{device}: {err}");
        }
    }

    /// bf16 master weights: each step's new weight rounded to a bf16 value stochastically
    /// with the counter's bits, the same bits on every device and whether the weights are kept
    /// in bf16 or (the CPU's twin) as f32 values; a bf16 weight without rounding is refused.
    #[test]
    fn bf16_weights_round_stochastically_with_the_same_bits_on_every_device() {
        let mut rng = Rng::new(55);
        let hyper = AdamW { lr: 1e-3, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.01 };
        let n = (1 << 16) + 33;
        let round = |x: f32| half::bf16::from_f32(x).to_f32();
        let param0: Vec<f32> = rng.vec(n, 1.0).into_iter().map(round).collect();
        let grads: Vec<Vec<f32>> = (0..3).map(|_| rng.vec(n, 0.05)).collect();
        let key = 17u64;
        let (mut p, mut m, mut v) = (param0.clone(), vec![0.0; n], vec![0.0; n]);
        for (i, g) in grads.iter().enumerate() {
            let step = i as u64 + 1;
            hyper.step(&mut p, g, &mut m, &mut v, step).unwrap();
            for (j, x) in p.iter_mut().enumerate() {
                *x = cpu::round_bf16_stochastic(*x, cpu::rounding_bits(key, step, j as u64))
                    .to_f32();
            }
        }
        let moved = p.iter().zip(&param0).filter(|(a, b)| a != b).count();
        assert!(moved > n / 10, "the weights moved: {moved}");
        for device in devices() {
            for dtype in [DType::BF16, DType::F32] {
                let t = |x: &[f32], d| tensor(&[n], x, d, &device);
                let mut pt = t(&param0, dtype);
                let (mut mt, mut vt) = (t(&vec![0.0; n], DType::F32), t(&vec![0.0; n], DType::F32));
                for (i, g) in grads.iter().enumerate() {
                    let g = t(g, DType::F32);
                    let state = [&mut pt, &mut mt, &mut vt];
                    one_step(&hyper, i as u64 + 1, state, &g, Some(key)).unwrap();
                }
                assert_eq!(pt.dtype(), dtype);
                assert_eq!(pt.to_vec_f32().unwrap(), p, "{device} weights kept in {dtype}");
                assert_eq!(mt.to_vec_f32().unwrap(), m, "{device} {dtype}: first moments");
            }
            let t = |x: &[f32], d| tensor(&[1], x, d, &device);
            let (mut p1, mut m1, mut v1) =
                (t(&[1.0], DType::BF16), t(&[0.0], DType::F32), t(&[0.0], DType::F32));
            let g = t(&[1.0], DType::F32);
            let state = [&mut p1, &mut m1, &mut v1];
            assert!(one_step(&hyper, 1, state, &g, None).is_err(), "{device}: bf16 unrounded");
        }
    }

    #[test]
    fn sum_squares_matches_the_cpu_and_repeats_on_every_device() {
        let mut rng = Rng::new(52);
        for device in devices() {
            for &n in &[0usize, 1, 1000, (1 << 16) + 3, 3 << 17] {
                let x = rng.vec(n, 1.0);
                let want = cpu::global_norm(&[&x]).powi(2);
                let t = tensor(&[n], &x, DType::F32, &device);
                let got = sum_squares(&t).unwrap();
                assert!(
                    (got - want).abs() <= 1e-12 * want.max(1.0),
                    "{device} n={n}: {got} vs {want}"
                );
                assert_eq!(sum_squares(&t).unwrap().to_bits(), got.to_bits(), "{device}: repeat");
            }
            assert!(sum_squares(&tensor(&[2], &[1.0, 2.0], DType::BF16, &device)).is_err());
        }
    }
}
