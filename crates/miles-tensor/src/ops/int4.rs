//! INT4 weights as miles' quantization-aware training makes them: fake-quantized values for
//! the training forward ([`fake_quantize_int4`]), and packed levels with their scales for the
//! rollout engine ([`Int4Matrix`], W4A16: [`int4_linear`]), whose products have the bits of
//! the training forward's.

use super::{dtype_is, floats_only, host_tensor, same_device};
use crate::cpu::Transpose;
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, cpu, ensure};

/// A `[n × k]` weight in INT4 as W4A16 keeps it: compressed-tensors' packed levels (`words`,
/// i32 `[n × k/8]`: q + 8 nibbles, eight a word, the first lowest) and miles' f32 scales
/// (`[n × k/group]`), on one device; it stands for the fake-quantized weight q · s.
pub struct Int4Matrix {
    words: Tensor,
    scales: Tensor,
    group: usize,
}

impl std::fmt::Debug for Int4Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [n, k] = self.shape();
        write!(f, "Int4Matrix([{n}, {k}] / {}, {})", self.group, self.words.device())
    }
}

impl Int4Matrix {
    /// The f32 weight `w` `[n × k]` quantized on its device in groups of `group` inputs (a
    /// multiple of 8 dividing `k`).
    pub fn quantize(w: &Tensor, group: usize) -> Result<Int4Matrix> {
        const OP: &str = "Int4Matrix::quantize";
        dtype_is(OP, "w", w, DType::F32)?;
        let (n, k) = match w.shape[..] {
            [n, k] => (n, k),
            _ => (0, 0),
        };
        ensure(
            w.shape.len() == 2 && group > 0 && group.is_multiple_of(8) && k.is_multiple_of(group),
            OP,
            || format!("w {:?} in groups of {group} (a multiple of 8 dividing its rows)", w.shape),
        )?;
        let device = w.device();
        let mut q = Int4Matrix {
            words: Tensor::zeros(&[n, k / 8], DType::I32, &device)?,
            scales: Tensor::zeros(&[n, k / group], DType::F32, &device)?,
            group,
        };
        q.requantize(w)?;
        Ok(q)
    }

    /// Quantizes `w` (this matrix's shape, on its device) into this matrix in place: its
    /// buffers keep their addresses, for the CUDA graphs that read them.
    pub fn requantize(&mut self, w: &Tensor) -> Result<()> {
        const OP: &str = "Int4Matrix::requantize";
        dtype_is(OP, "w", w, DType::F32)?;
        same_device(OP, &[w, &self.words])?;
        let [n, k] = self.shape();
        ensure(w.shape == [n, k], OP, || {
            format!("a weight {:?} into an INT4 matrix [{n}, {k}]", w.shape)
        })?;
        match (&w.storage, &mut self.words.storage, &mut self.scales.storage) {
            (Storage::F32(v), Storage::I32(words), Storage::F32(scales)) => {
                let (q, s) = cpu::quantize_int4(v, k, self.group)?;
                (*words, *scales) = (cpu::pack_int4(&q, k)?, s);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(wb), Storage::Cuda(words), Storage::Cuda(scales)) => {
                use crate::cuda::DeviceData;
                let (DeviceData::F32(ws), DeviceData::I32(words), DeviceData::F32(scales)) =
                    (&wb.data, &mut words.data, &mut scales.data)
                else {
                    unreachable!("an f32 weight, i32 words and f32 scales (checked)")
                };
                crate::cuda::int4::quantize_pack(&wb.gpu, ws, words, scales, self.group)
            }
            _ => unreachable!("one device (checked)"),
        }
    }

    /// `[n, k]`, the weight's shape.
    pub fn shape(&self) -> [usize; 2] {
        [self.words.shape[0], self.words.shape[1] * 8]
    }

    pub fn group(&self) -> usize {
        self.group
    }

    /// Bytes the matrix holds on its device: half a byte a weight, four a group.
    pub fn bytes(&self) -> usize {
        4 * (self.words.len() + self.scales.len())
    }

    /// The weight it stands for, q · s, in `dtype` (f32, or rounded to bf16): the values of
    /// [`fake_quantize_int4`] of the weight it was quantized from.
    pub fn dequantize(&self, dtype: DType) -> Result<Tensor> {
        let [n, k] = self.shape();
        #[cfg(feature = "cuda")]
        if let (Storage::Cuda(wb), Storage::Cuda(sb)) = (&self.words.storage, &self.scales.storage)
        {
            use crate::cuda::DeviceData;
            let (DeviceData::I32(words), DeviceData::F32(scales)) = (&wb.data, &sb.data) else {
                unreachable!("an Int4Matrix holds i32 words and f32 scales")
            };
            let mut out = Tensor::zeros(&[n, k], dtype, &self.words.device())?;
            let Storage::Cuda(ob) = &mut out.storage else { unreachable!("on the device") };
            crate::cuda::int4::dequantize(&wb.gpu, (words, scales), &mut ob.data, self.group)?;
            return Ok(out);
        }
        let words = self.words.to_vec_i32()?;
        let levels = cpu::unpack_int4(&words, n, k)?;
        let values = cpu::dequantize_int4(&levels, &self.scales.to_vec_f32()?, self.group)?;
        Tensor::from_f32(&[n, k], values, &Device::Cpu)?
            .to_dtype(dtype)?
            .to_device(&self.words.device())
    }
}

/// The most rows [`int4_linear`] reads the packed words for on a GPU (a decode step's).
pub const INT4_ROWS_MAX: usize = 64;

/// W4A16: `x · wᵀ` for `x` `[m × k]` (bf16 or f32) and an INT4 `w`, with the bits of
/// [`super::matmul`] of `x` with the dequantized weight in `x`'s dtype (the QAT forward's
/// product with its compute copy). On a GPU, bf16 rows up to 64 (a decode step's) go through
/// `kernels/int4.cu`, which reads the packed words (a quarter of bf16's bytes); other shapes
/// dequantize the weight first.
pub fn int4_linear(x: &Tensor, w: &Int4Matrix) -> Result<Tensor> {
    const OP: &str = "int4_linear";
    floats_only(OP, &[x])?;
    same_device(OP, &[x, &w.words])?;
    let [n, k] = w.shape();
    ensure(x.shape.len() == 2 && x.shape[1] == k, OP, || {
        format!("x {:?} against an INT4 weight [{n}, {k}]", x.shape)
    })?;
    #[cfg(feature = "cuda")]
    if let (Storage::Cuda(xb), Storage::Cuda(wb), Storage::Cuda(sb)) =
        (&x.storage, &w.words.storage, &w.scales.storage)
    {
        use crate::cuda::DeviceData;
        let m = x.shape[0];
        if let (DeviceData::BF16(a), DeviceData::I32(words), DeviceData::F32(scales)) =
            (&xb.data, &wb.data, &sb.data)
            && m <= INT4_ROWS_MAX
            && k.is_multiple_of(32)
            && w.group.is_multiple_of(32)
        {
            let c = crate::cuda::int4::rows_gemm(&xb.gpu, a, (words, scales), (m, n, k), w.group)?;
            let data = crate::cuda::Buffer { gpu: xb.gpu.clone(), data: DeviceData::BF16(c) };
            return Ok(Tensor { shape: vec![m, n], storage: Storage::Cuda(data) });
        }
    }
    super::matmul(x, Transpose::No, &w.dequantize(x.dtype())?, Transpose::Yes)
}

/// W4A16 for a mixture of experts: [`super::grouped_matmul`] (`Transpose::Yes`: `out[s] =
/// x[row(s)] · W_eᵀ` for the rows s of each expert e) with INT4 weights, with the bits of that
/// product over the dequantized weights in `x`'s dtype. On a GPU in bf16 one launch of
/// `kernels/int4.cu` reads every expert's packed words; elsewhere the weights are dequantized
/// first.
pub fn int4_grouped_linear(
    x: &Tensor,
    rows: Option<&[u32]>,
    offsets: &[u32],
    experts: &[&Int4Matrix],
) -> Result<Tensor> {
    const OP: &str = "int4_grouped_linear";
    floats_only(OP, &[x])?;
    let words: Vec<&Tensor> = experts.iter().map(|w| &w.words).collect();
    let mut all = vec![x];
    all.extend(&words);
    same_device(OP, &all)?;
    let [n, k] = experts.first().map_or([0, 0], |w| w.shape());
    let group = experts.first().map_or(0, |w| w.group);
    ensure(
        !experts.is_empty()
            && experts.iter().all(|w| w.shape() == [n, k] && w.group == group)
            && x.shape.len() == 2
            && x.shape[1] == k,
        OP,
        || {
            format!(
                "x {:?} against {} INT4 experts [{n}, {k}] (one shape, one group)",
                x.shape,
                experts.len()
            )
        },
    )?;
    #[cfg(feature = "cuda")]
    if let Storage::Cuda(xb) = &x.storage
        && let crate::cuda::DeviceData::BF16(a) = &xb.data
        && k.is_multiple_of(32)
        && group.is_multiple_of(32)
        && super::grouped::offsets_ok(offsets, experts.len())
        && rows.map_or(x.shape[0] == offsets[experts.len()] as usize, |r| {
            r.len() == offsets[experts.len()] as usize
                && r.iter().all(|&i| (i as usize) < x.shape[0])
        })
    {
        use crate::cuda::DeviceData;
        let parts: Vec<_> = experts
            .iter()
            .map(|w| match (&w.words.storage, &w.scales.storage) {
                (Storage::Cuda(wb), Storage::Cuda(sb)) => match (&wb.data, &sb.data) {
                    (DeviceData::I32(words), DeviceData::F32(scales)) => (words, scales),
                    _ => unreachable!("an Int4Matrix holds i32 words and f32 scales"),
                },
                _ => unreachable!("on x's device (checked)"),
            })
            .collect();
        let total = offsets[experts.len()] as usize;
        let c = crate::cuda::int4::grouped_rows_gemm(
            &xb.gpu,
            a,
            (rows, offsets),
            &parts,
            (n, k),
            group,
        )?;
        let data = crate::cuda::Buffer { gpu: xb.gpu.clone(), data: DeviceData::BF16(c) };
        return Ok(Tensor { shape: vec![total, n], storage: Storage::Cuda(data) });
    }
    let dequantized: Vec<Tensor> =
        experts.iter().map(|w| w.dequantize(x.dtype())).collect::<Result<_>>()?;
    let weights: Vec<&Tensor> = dequantized.iter().collect();
    super::grouped_matmul(x, rows, offsets, &weights, Transpose::Yes)
}

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
            assert!(Int4Matrix::quantize(&w, 32).is_err());
            assert!(Int4Matrix::quantize(&w, 12).is_err());
            let mut narrow = Tensor::zeros(&[2, 32], DType::F32, &device).unwrap();
            assert!(fake_quantize_int4(&w, 16, &mut narrow).is_err());
        }
    }

    /// An [`Int4Matrix`] holds the CPU's packed words and scales on every device, stands for
    /// the fake-quantized weight, and is requantized in place.
    #[test]
    fn int4_matrices_pack_the_cpus_levels_on_every_device() {
        let mut rng = Rng::new(32);
        for device in devices() {
            for (n, k, group) in [(40, 576, 32), (24, 256, 128)] {
                let w = rng.vec(n * k, 0.05);
                let wt = tensor(&[n, k], &w, DType::F32, &device);
                let mut m = Int4Matrix::quantize(&wt, group).unwrap();
                let (q, scales) = cpu::quantize_int4(&w, k, group).unwrap();
                let what = format!("{device} [{n}, {k}] / {group}");
                assert_eq!(m.words.to_vec_i32().unwrap(), cpu::pack_int4(&q, k).unwrap(), "{what}");
                assert_eq!(m.scales.to_vec_f32().unwrap(), scales, "{what}");
                assert_eq!(
                    (m.shape(), m.group(), m.bytes()),
                    ([n, k], group, n * k / 2 + 4 * n * k / group)
                );
                let fake = cpu::fake_quantize_int4(&w, k, group).unwrap();
                assert_eq!(m.dequantize(DType::F32).unwrap().to_vec_f32().unwrap(), fake, "{what}");
                let rounded: Vec<f32> =
                    fake.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
                let bf16 = m.dequantize(DType::BF16).unwrap();
                assert_eq!((bf16.dtype(), bf16.to_vec_f32().unwrap()), (DType::BF16, rounded));
                // Requantized from another weight, in place.
                let w2 = rng.vec(n * k, 0.05);
                m.requantize(&tensor(&[n, k], &w2, DType::F32, &device)).unwrap();
                let fake2 = cpu::fake_quantize_int4(&w2, k, group).unwrap();
                assert_eq!(
                    m.dequantize(DType::F32).unwrap().to_vec_f32().unwrap(),
                    fake2,
                    "{what}"
                );
                let narrow = tensor(&[n, k - 32], &w2[..n * (k - 32)], DType::F32, &device);
                assert!(m.requantize(&narrow).is_err());
            }
        }
    }

    /// W4A16 products have the bits of the bf16 (and f32) product with the fake-quantized
    /// weight in the same dtype, at a decode step's row counts (the packed kernel on a GPU:
    /// one row tile, four, blocks of one, two and four warps, ragged column blocks, a last
    /// stage of half the inputs) and past them (the dequantized weight's product).
    #[test]
    fn int4_products_have_the_bits_of_the_fake_quantized_weights_product() {
        let mut rng = Rng::new(33);
        for device in devices() {
            let mut shapes = vec![(960, 576, 32), (200, 1536, 128), (24, 64, 32), (40, 96, 32)];
            // On a GPU, columns enough for blocks of two and four warps (one per SM or more).
            if device != Device::Cpu {
                shapes.extend([(4300, 96, 32), (9000, 128, 128)]);
            }
            for (n, k, group) in shapes {
                let w = rng.vec(n * k, 0.05);
                let m4 =
                    Int4Matrix::quantize(&tensor(&[n, k], &w, DType::F32, &device), group).unwrap();
                let fake = cpu::fake_quantize_int4(&w, k, group).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let wd = tensor(&[n, k], &fake, dtype, &device);
                    for m in [1, 3, 16, 17, 64, 65, 130] {
                        let x = tensor(&[m, k], &rng.vec(m * k, 1.0), dtype, &device);
                        let got = int4_linear(&x, &m4).unwrap();
                        let want =
                            super::super::matmul(&x, Transpose::No, &wd, Transpose::Yes).unwrap();
                        let what = format!("{device} {dtype} [{m}, {k}] · [{n}, {k}]ᵀ / {group}");
                        assert_eq!(got.shape(), [m, n], "{what}");
                        assert_eq!(got.dtype(), dtype, "{what}");
                        let bits = |t: &Tensor| {
                            t.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                        };
                        assert_eq!(bits(&got), bits(&want), "{what}");
                    }
                }
            }
            let m4 = Int4Matrix::quantize(&tensor(&[8, 64], &[0.5; 512], DType::F32, &device), 32)
                .unwrap();
            let x = tensor(&[2, 32], &[1.0; 64], DType::F32, &device);
            assert!(int4_linear(&x, &m4).unwrap_err().to_string().contains("INT4 weight [8, 64]"));
        }
    }

    /// The experts' W4A16 product has, row for row, the bits of the grouped product over the
    /// experts' fake-quantized weights: with and without a gather table, an expert without
    /// rows, one with more rows than a tile (64), column counts past a block's edge; shapes
    /// that disagree are refused by name.
    #[test]
    fn int4_grouped_products_have_the_bits_of_the_dequantized_experts_product() {
        let mut rng = Rng::new(34);
        for device in devices() {
            for (n, k, group) in [(80, 256, 32), (768, 128, 128)] {
                let experts: Vec<Vec<f32>> = (0..4).map(|_| rng.vec(n * k, 0.05)).collect();
                let packed: Vec<Int4Matrix> = experts
                    .iter()
                    .map(|w| {
                        Int4Matrix::quantize(&tensor(&[n, k], w, DType::F32, &device), group)
                            .unwrap()
                    })
                    .collect();
                let packed: Vec<&Int4Matrix> = packed.iter().collect();
                let offsets = [0u32, 3, 3, 73, 75];
                let total = 75;
                // (The grouped products on a GPU run in bf16, as grouped.rs's tests have them.)
                let dtypes: &[DType] =
                    if device == Device::Cpu { &[DType::F32, DType::BF16] } else { &[DType::BF16] };
                for &dtype in dtypes {
                    let fake: Vec<Tensor> = experts
                        .iter()
                        .map(|w| {
                            let v = cpu::fake_quantize_int4(w, k, group).unwrap();
                            tensor(&[n, k], &v, dtype, &device)
                        })
                        .collect();
                    let fake: Vec<&Tensor> = fake.iter().collect();
                    let gather: Vec<u32> = (0..total).map(|_| rng.below(20) as u32).collect();
                    for rows in [None, Some(&gather[..])] {
                        let m = if rows.is_some() { 20 } else { total as usize };
                        let x = tensor(&[m, k], &rng.vec(m * k, 1.0), dtype, &device);
                        let got = int4_grouped_linear(&x, rows, &offsets, &packed).unwrap();
                        let want =
                            super::super::grouped_matmul(&x, rows, &offsets, &fake, Transpose::Yes)
                                .unwrap();
                        let what = format!("{device} {dtype} n {n} k {k} / {group}, {rows:?}");
                        assert_eq!((got.shape(), got.dtype()), (want.shape(), dtype), "{what}");
                        let bits = |t: &Tensor| {
                            t.to_vec_f32().unwrap().iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                        };
                        assert_eq!(bits(&got), bits(&want), "{what}");
                    }
                }
            }
            let mut one = |n, k| {
                Int4Matrix::quantize(
                    &tensor(&[n, k], &rng.vec(n * k, 1.0), DType::F32, &device),
                    32,
                )
                .unwrap()
            };
            let (a, b) = (one(8, 64), one(16, 64));
            let x = tensor(&[2, 64], &[1.0; 128], DType::BF16, &device);
            let e = int4_grouped_linear(&x, None, &[0, 1, 2], &[&a, &b]).unwrap_err().to_string();
            assert!(e.contains("int4_grouped_linear") && e.contains("one shape"), "{e}");
        }
    }
}
