//! FP8 E4M3 with blockwise scaling (DeepGEMM's recipe, miles' unified FP8): a weight as codes
//! in 128 × 128 blocks with one f32 scale each ([`Fp8Matrix`]), activations quantized per
//! 1 × 128 group of a row on the fly, and the product of the two ([`fp8_linear`]). The CPU
//! goes through `cpu::fp8` (the reference); CUDA through `kernels/fp8.cu`, whose codes and
//! scales are the CPU's bits and whose products agree with the CPU's to the tensor cores'
//! rounding. A row's result never depends on the rows beside it, on either device.

use super::{floats_only, host_f32, host_tensor, same_device};
use crate::cpu::{self, FP8_BLOCK};
use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor, ensure};

/// A `[n × k]` weight in E4M3: `codes` (`F8E4M3`, `[n × k]`) and `scales` (f32,
/// `[⌈n/128⌉ × ⌈k/128⌉]`, HF's `weight_scale_inv`: w ≈ code · scale), on one device.
pub struct Fp8Matrix {
    codes: Tensor,
    scales: Tensor,
}

impl std::fmt::Debug for Fp8Matrix {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Fp8Matrix({:?}, {})", self.codes.shape, self.codes.device())
    }
}

fn scale_shape(n: usize, k: usize) -> [usize; 2] {
    [n.div_ceil(FP8_BLOCK), k.div_ceil(FP8_BLOCK)]
}

fn matrix_dims(op: &'static str, w: &Tensor) -> Result<(usize, usize)> {
    floats_only(op, &[w])?;
    match w.shape[..] {
        [n, k] => Ok((n, k)),
        _ => Err(Error::Shape { op, message: format!("a matrix, not shape {:?}", w.shape) }),
    }
}

impl Fp8Matrix {
    /// `w` (f32 or bf16 `[n × k]`) quantized on its device.
    pub fn quantize(w: &Tensor) -> Result<Fp8Matrix> {
        let (n, k) = matrix_dims("Fp8Matrix::quantize", w)?;
        let device = w.device();
        let mut q = Fp8Matrix {
            codes: Tensor::zeros(&[n, k], DType::F8E4M3, &device)?,
            scales: Tensor::zeros(&scale_shape(n, k), DType::F32, &device)?,
        };
        q.requantize(w)?;
        Ok(q)
    }

    /// Quantizes `w` (this matrix's shape and device) into this matrix in place: its buffers
    /// keep their addresses, for the CUDA graphs that read them.
    pub fn requantize(&mut self, w: &Tensor) -> Result<()> {
        const OP: &str = "Fp8Matrix::requantize";
        let (n, k) = matrix_dims(OP, w)?;
        same_device(OP, &[w, &self.codes])?;
        ensure([n, k] == self.shape(), OP, || {
            format!("a weight {:?} into an FP8 matrix {:?}", w.shape, self.codes.shape)
        })?;
        match (&mut self.codes.storage, &mut self.scales.storage) {
            (Storage::F8(codes), Storage::F32(scales)) => {
                (*codes, *scales) = cpu::quantize_blocks(&host_f32(w), n, k);
                Ok(())
            }
            #[cfg(feature = "cuda")]
            (Storage::Cuda(codes), Storage::Cuda(scales)) => {
                use crate::cuda::DeviceData;
                let (DeviceData::F8(codes), DeviceData::F32(scales)) =
                    (&mut codes.data, &mut scales.data)
                else {
                    unreachable!("an Fp8Matrix holds F8E4M3 codes and f32 scales")
                };
                let Storage::Cuda(wb) = &w.storage else { unreachable!("same device") };
                crate::cuda::fp8::quantize_blocks(&wb.gpu, &wb.data, codes, scales, (n, k))
            }
            _ => unreachable!("an Fp8Matrix holds F8E4M3 codes and f32 scales on one device"),
        }
    }

    /// A matrix of given `codes` (`F8E4M3` `[n × k]`) and `scales` (f32, one per 128 × 128
    /// block): an FP8 checkpoint's tensors.
    pub fn from_parts(codes: Tensor, scales: Tensor) -> Result<Fp8Matrix> {
        const OP: &str = "Fp8Matrix::from_parts";
        same_device(OP, &[&codes, &scales])?;
        let ok = codes.dtype() == DType::F8E4M3
            && scales.dtype() == DType::F32
            && codes.shape.len() == 2
            && scales.shape[..] == scale_shape(codes.shape[0], codes.shape[1]);
        ensure(ok, OP, || {
            format!(
                "codes {} {:?} with scales {} {:?}: want F8E4M3 [n, k] with f32 [⌈n/128⌉, ⌈k/128⌉]",
                codes.dtype(),
                codes.shape,
                scales.dtype(),
                scales.shape
            )
        })?;
        Ok(Fp8Matrix { codes, scales })
    }

    /// `[n, k]`.
    pub fn shape(&self) -> [usize; 2] {
        [self.codes.shape[0], self.codes.shape[1]]
    }

    pub fn device(&self) -> Device {
        self.codes.device()
    }

    /// Bytes the matrix holds: a byte a weight, four a block.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.scales.len()
    }

    pub fn codes(&self) -> &Tensor {
        &self.codes
    }

    pub fn scales(&self) -> &Tensor {
        &self.scales
    }

    /// The values the codes stand for (code · scale), copied to the host.
    pub fn dequantize_to_host(&self) -> Result<Vec<f32>> {
        let [n, k] = self.shape();
        let codes = self.codes.to_vec_f8_codes()?;
        Ok(cpu::dequantize_blocks(&codes, &self.scales.to_vec_f32()?, n, k))
    }
}

/// Whether `device` runs the FP8 products: the CPU (emulated exactly), a GPU with FP8 tensor
/// cores (compute capability 8.9 or later: Ada, Hopper and on); an error naming the device
/// otherwise.
pub fn fp8_supported(device: &Device) -> Result<()> {
    match *device {
        Device::Cpu => Ok(()),
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => {
            let gpu = crate::cuda::gpu(ordinal)?;
            let (major, minor) = crate::cuda::fp8::capability(&gpu)?;
            if (major, minor) >= (8, 9) {
                Ok(())
            } else {
                Err(Error::Device(format!(
                    "FP8 needs FP8 tensor cores (compute capability 8.9 or later, e.g. an H100 or \
                     H200); {device} has {major}.{minor}: drop --fp8-format, or run on such a GPU"
                )))
            }
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `x` (f32 or bf16 `[rows × k]`) quantized per 1 × 128 group of each row: codes
/// (`F8E4M3`, `[rows × k]`) and scales (f32, `[rows × ⌈k/128⌉]`), on `x`'s device.
pub fn fp8_quantize_rows(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let (rows, k) = matrix_dims("fp8_quantize_rows", x)?;
    let scales_shape = [rows, k.div_ceil(FP8_BLOCK)];
    match &x.storage {
        #[cfg(feature = "cuda")]
        Storage::Cuda(b) => {
            use crate::cuda::{Buffer, DeviceData};
            let (codes, scales) = crate::cuda::fp8::quantize_rows(&b.gpu, &b.data, (rows, k))?;
            let tensor = |shape: &[usize], data| Tensor {
                shape: shape.to_vec(),
                storage: Storage::Cuda(Buffer { gpu: b.gpu.clone(), data }),
            };
            Ok((
                tensor(&[rows, k], DeviceData::F8(codes)),
                tensor(&scales_shape, DeviceData::F32(scales)),
            ))
        }
        _ => {
            let (codes, scales) = cpu::quantize_rows(&host_f32(x), rows, k);
            let codes = Tensor { shape: vec![rows, k], storage: Storage::F8(codes) };
            Ok((codes, host_tensor(scales_shape.to_vec(), scales, DType::F32)))
        }
    }
}

/// `x · wᵀ` in FP8: `x` (f32 or bf16 `[rows × k]`) quantized per 1 × 128 group of each row,
/// multiplied by `w`'s codes slice by slice of 128 along k, each slice's sum promoted into an
/// f32 accumulator with the row's and the block's scales (`cpu::fp8_linear`). The result is
/// `[rows × n]` in `x`'s dtype. On CUDA k must be a multiple of 16.
pub fn fp8_linear(x: &Tensor, w: &Fp8Matrix) -> Result<Tensor> {
    Ok(fp8_linear_many(x, &[w])?.remove(0))
}

/// [`fp8_linear`] of one `x` by several weights (a layer's q, k and v), `x` quantized once:
/// each output has the bits [`fp8_linear`] gives it.
pub fn fp8_linear_many(x: &Tensor, ws: &[&Fp8Matrix]) -> Result<Vec<Tensor>> {
    const OP: &str = "fp8_linear";
    let (_, k) = matrix_dims(OP, x)?;
    for w in ws {
        same_device(OP, &[x, &w.codes])?;
        let [n, wk] = w.shape();
        ensure(k == wk, OP, || format!("x {:?} against an FP8 weight [{n}, {wk}]", x.shape))?;
    }
    let (xq, xs) = fp8_quantize_rows(x)?;
    let (rows, out) = (xq.shape[0], x.dtype());
    match (&xq.storage, &xs.storage) {
        (Storage::F8(xq), Storage::F32(xs)) => ws
            .iter()
            .map(|w| {
                let (Storage::F8(wq), Storage::F32(wsc)) = (&w.codes.storage, &w.scales.storage)
                else {
                    unreachable!("codes are F8E4M3, scales f32, on x's device")
                };
                let n = w.shape()[0];
                let y = cpu::fp8_linear((xq, xs), (wq, wsc), rows, k, n);
                Ok(host_tensor(vec![rows, n], y, out))
            })
            .collect(),
        #[cfg(feature = "cuda")]
        (Storage::Cuda(xq), Storage::Cuda(xs)) => {
            use crate::cuda::{Buffer, DeviceData};
            let (DeviceData::F8(xq_d), DeviceData::F32(xs_d)) = (&xq.data, &xs.data) else {
                unreachable!("codes are F8E4M3, scales f32")
            };
            let weights = ws
                .iter()
                .map(|w| match (&w.codes.storage, &w.scales.storage) {
                    (Storage::Cuda(wq), Storage::Cuda(wsc)) => match (&wq.data, &wsc.data) {
                        (DeviceData::F8(wq), DeviceData::F32(wsc)) => (wq, wsc, w.shape()[0]),
                        _ => unreachable!("codes are F8E4M3, scales f32"),
                    },
                    _ => unreachable!("one device (checked)"),
                })
                .collect::<Vec<_>>();
            let ys = crate::cuda::fp8::gemm_many(&xq.gpu, (xq_d, xs_d), &weights, (rows, k), out)?;
            Ok(ys
                .into_iter()
                .zip(ws)
                .map(|(data, w)| Tensor {
                    shape: vec![rows, w.shape()[0]],
                    storage: Storage::Cuda(Buffer { gpu: xq.gpu.clone(), data }),
                })
                .collect())
        }
        _ => unreachable!("one device (checked)"),
    }
}

/// Whether `device` runs [`fp8_grouped_linear`]: the CPU, and Hopper GPUs (its kernel is
/// wgmma's). Elsewhere a mixture of experts runs its FP8 experts one at a time.
pub fn fp8_grouped_supported(device: &Device) -> bool {
    match *device {
        Device::Cpu => true,
        #[cfg(feature = "cuda")]
        Device::Cuda(ordinal) => crate::cuda::gpu(ordinal)
            .and_then(|gpu| crate::cuda::fp8::capability(&gpu))
            .is_ok_and(|c| c == (9, 0)),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => false,
    }
}

/// The experts' FP8 products over a mixture-of-experts layer's rows sorted by expert (the
/// layout of [`super::grouped_matmul`]): for the rows `s` of expert `e`
/// (`offsets[e]..offsets[e + 1]`), `x[row(s)] · W_eᵀ` with `row(s) = rows[s]` (a gather) or
/// `s`. Each row gets the bits [`fp8_linear`] gives it (x quantized per row, then the same
/// slices and promotions), so an expert's rows compute alike alone or grouped. `x` is
/// `[· × k]`; the result `[offsets[E] × n]` in `x`'s dtype.
pub fn fp8_grouped_linear(
    x: &Tensor,
    rows: Option<&[u32]>,
    offsets: &[u32],
    experts: &[&Fp8Matrix],
) -> Result<Tensor> {
    const OP: &str = "fp8_grouped_linear";
    let (tokens, k) = matrix_dims(OP, x)?;
    let mut all = vec![x];
    all.extend(experts.iter().map(|w| &w.codes));
    same_device(OP, &all)?;
    let [n, wk] = experts.first().map_or([0, k], |w| w.shape());
    let total = offsets.last().copied().unwrap_or(0) as usize;
    let rows_ok = match rows {
        Some(r) => r.len() == total && r.iter().all(|&i| (i as usize) < tokens),
        None => tokens == total,
    };
    let ok = wk == k
        && experts.iter().all(|w| w.shape() == [n, k])
        && super::grouped::offsets_ok(offsets, experts.len())
        && rows_ok;
    ensure(ok, OP, || {
        format!(
            "x {:?} against {} FP8 experts [{n}, {wk}], {} offsets ending at {total}",
            x.shape,
            experts.len(),
            offsets.len()
        )
    })?;
    let (xq, xs) = fp8_quantize_rows(x)?;
    match (&xq.storage, &xs.storage) {
        (Storage::F8(xq), Storage::F32(xs)) => {
            let kb = k.div_ceil(FP8_BLOCK);
            let mut out = vec![0.0; total * n];
            for (e, w) in experts.iter().enumerate() {
                let (Storage::F8(wq), Storage::F32(ws)) = (&w.codes.storage, &w.scales.storage)
                else {
                    unreachable!("one device (checked)")
                };
                let (from, to) = (offsets[e] as usize, offsets[e + 1] as usize);
                let source = |s: usize| rows.map_or(s, |r| r[s] as usize);
                let codes: Vec<u8> =
                    (from..to).flat_map(|s| &xq[source(s) * k..][..k]).copied().collect();
                let scales: Vec<f32> =
                    (from..to).flat_map(|s| &xs[source(s) * kb..][..kb]).copied().collect();
                let y = cpu::fp8_linear((&codes, &scales), (wq, ws), to - from, k, n);
                out[from * n..to * n].copy_from_slice(&y);
            }
            Ok(host_tensor(vec![total, n], out, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        (Storage::Cuda(xq_b), Storage::Cuda(xs_b)) => {
            use crate::cuda::{Buffer, DeviceData};
            let (DeviceData::F8(xq), DeviceData::F32(xs)) = (&xq_b.data, &xs_b.data) else {
                unreachable!("codes are F8E4M3, scales f32")
            };
            let mut weights = Vec::with_capacity(experts.len());
            for w in experts {
                let (Storage::Cuda(wq), Storage::Cuda(ws)) = (&w.codes.storage, &w.scales.storage)
                else {
                    unreachable!("one device (checked)")
                };
                let (DeviceData::F8(wq), DeviceData::F32(ws)) = (&wq.data, &ws.data) else {
                    unreachable!("codes are F8E4M3, scales f32")
                };
                weights.push((wq, ws));
            }
            let y = crate::cuda::fp8::grouped(
                &xq_b.gpu,
                (xq, xs),
                rows,
                offsets,
                &weights,
                (n, k),
                x.dtype(),
            )?;
            Ok(Tensor {
                shape: vec![total, n],
                storage: Storage::Cuda(Buffer { gpu: xq_b.gpu.clone(), data: y }),
            })
        }
        _ => unreachable!("quantized on x's device"),
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{devices, max_rel_err};
    use super::*;
    use crate::rng::Rng;

    /// Shapes with partial blocks on every side, decode-sized and training-sized row counts;
    /// widths that are not multiples of 16 (refused on CUDA, clearly) too.
    const SHAPES: [(usize, usize, usize); 5] =
        [(1, 256, 320), (5, 144, 200), (16, 128, 64), (40, 272, 136), (130, 384, 256)];

    fn random(rng: &mut Rng, rows: usize, cols: usize, scale: f32) -> Vec<f32> {
        (0..rows * cols).map(|_| scale * rng.normal()).collect()
    }

    #[test]
    fn weights_quantize_to_the_cpus_bits_on_every_device() {
        let mut rng = Rng::new(81);
        for device in devices() {
            for &(_, n, k) in &SHAPES {
                let mut w = random(&mut rng, n, k, 0.05);
                w[7] = 0.0; // and a block of zeros keeps its floor scale
                let (want_codes, want_scales) = cpu::quantize_blocks(&w, n, k);
                for dtype in [DType::F32, DType::BF16] {
                    let t = Tensor::from_f32(&[n, k], w.clone(), &device).unwrap();
                    let t = t.to_dtype(dtype).unwrap();
                    let q = Fp8Matrix::quantize(&t).unwrap();
                    let host = t.to_vec_f32().unwrap();
                    let (codes, scales) = if dtype == DType::F32 {
                        (want_codes.clone(), want_scales.clone())
                    } else {
                        cpu::quantize_blocks(&host, n, k)
                    };
                    assert_eq!(
                        q.codes().to_vec_f8_codes().unwrap(),
                        codes,
                        "{device} {dtype} {n}×{k}"
                    );
                    let got: Vec<u32> =
                        q.scales().to_vec_f32().unwrap().iter().map(|s| s.to_bits()).collect();
                    let want: Vec<u32> = scales.iter().map(|s| s.to_bits()).collect();
                    assert_eq!(got, want, "{device} {dtype} {n}×{k} scales");
                }
            }
        }
    }

    #[test]
    fn activation_rows_quantize_to_the_cpus_bits_on_every_device() {
        let mut rng = Rng::new(82);
        for device in devices() {
            for &(rows, _, k) in &SHAPES {
                let x = random(&mut rng, rows, k, 3.0);
                let (codes, scales) = cpu::quantize_rows(&x, rows, k);
                let t = Tensor::from_f32(&[rows, k], x, &device).unwrap();
                let (got_codes, got_scales) = fp8_quantize_rows(&t).unwrap();
                assert_eq!(got_codes.to_vec_f8_codes().unwrap(), codes, "{device} {rows}×{k}");
                assert_eq!(got_scales.to_vec_f32().unwrap(), scales, "{device} {rows}×{k}");
            }
        }
    }

    #[test]
    fn the_product_matches_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(83);
        for device in devices() {
            for &(rows, n, k) in &SHAPES {
                let x = random(&mut rng, rows, k, 1.0);
                let w = random(&mut rng, n, k, 0.05);
                let (wq, ws) = cpu::quantize_blocks(&w, n, k);
                let reference = |x: &[f32]| {
                    let (xq, xs) = cpu::quantize_rows(x, rows, k);
                    cpu::fp8_linear((&xq, &xs), (&wq, &ws), rows, k, n)
                };
                // The reference is close to the exact product: E4M3 keeps 3 mantissa bits.
                let exact: Vec<f32> = (0..rows * n)
                    .map(|i| (0..k).map(|j| x[i / n * k + j] * w[i % n * k + j]).sum())
                    .collect();
                let err = max_rel_err("fp8 vs exact", &reference(&x), &exact);
                assert!(err < 0.08, "{rows}×{k}·{n}: {err}");
                let wt = Tensor::from_f32(&[n, k], w, &device).unwrap();
                let q = Fp8Matrix::quantize(&wt).unwrap();
                for dtype in [DType::F32, DType::BF16] {
                    let xt = Tensor::from_f32(&[rows, k], x.clone(), &device).unwrap();
                    let xt = xt.to_dtype(dtype).unwrap();
                    let want = reference(&xt.to_vec_f32().unwrap());
                    if device != Device::Cpu && !k.is_multiple_of(16) {
                        let e = fp8_linear(&xt, &q).unwrap_err().to_string();
                        assert!(e.contains("must be a multiple of 16 on CUDA"), "{e}");
                        continue;
                    }
                    let y = fp8_linear(&xt, &q).unwrap();
                    assert_eq!((y.shape(), y.dtype()), (&[rows, n][..], dtype));
                    let got = y.to_vec_f32().unwrap();
                    // The CPU in f32 is the reference itself; bf16 rounds the result; the
                    // tensor cores sum a slice's products in their own order.
                    let tol = match (device, dtype) {
                        (Device::Cpu, DType::F32) => 0.0,
                        (Device::Cpu, _) => 4e-3,
                        _ => 1e-2,
                    };
                    let err = max_rel_err("fp8_linear", &got, &want);
                    assert!(err <= tol, "{device} {dtype} {rows}×{k}·{n}: {err}");
                }
            }
        }
    }

    #[test]
    fn a_rows_product_does_not_depend_on_its_batch_on_every_device() {
        let mut rng = Rng::new(84);
        // n not a multiple of 64: the tiles' last columns are partial. k = 1152 (nine blocks)
        // takes the swapped tiles' four-slices path and its tail, k = 384 their two-slices one.
        let n = 328;
        for (device, k) in devices().into_iter().flat_map(|d| [(d, 384), (d, 1152)]) {
            let w = Tensor::from_f32(&[n, k], random(&mut rng, n, k, 0.05), &device).unwrap();
            let q = Fp8Matrix::quantize(&w).unwrap();
            let x = random(&mut rng, 1100, k, 1.0);
            let bits = |rows: usize| -> Vec<u32> {
                let t = Tensor::from_f32(&[rows, k], x[..rows * k].to_vec(), &device).unwrap();
                let t = t.to_dtype(DType::BF16).unwrap();
                let y = fp8_linear(&t, &q).unwrap().to_vec_f32().unwrap();
                y.iter().map(|v| v.to_bits()).collect()
            };
            let all = bits(1100);
            // Every tile of both families: 1 to 64 rows the narrow ones (Hopper's swapped
            // tiles of 8, 16, 32 and 64), then the middle ones, and 200 (mma.sync) or 1025 and
            // 1100 (Hopper's TMA-fed tile) the widest.
            for rows in [1, 3, 8, 9, 16, 17, 32, 33, 63, 64, 65, 200, 1024, 1025] {
                assert_eq!(bits(rows), all[..rows * n], "{device}, k = {k}: {rows} rows");
            }
        }
    }

    /// Several weights of one x (one launch on Hopper's decode tiles, three weights a launch)
    /// give each output the bits of its own product, whatever the widths.
    #[test]
    fn many_weights_give_each_output_its_own_products_bits_on_every_device() {
        let mut rng = Rng::new(86);
        let k = 272;
        let widths = [200, 64, 328, 96];
        for device in devices() {
            let weights: Vec<Fp8Matrix> = widths
                .iter()
                .map(|&n| {
                    let w = Tensor::from_f32(&[n, k], random(&mut rng, n, k, 0.05), &device);
                    Fp8Matrix::quantize(&w.unwrap()).unwrap()
                })
                .collect();
            let refs: Vec<&Fp8Matrix> = weights.iter().collect();
            for rows in [1, 9, 40, 100] {
                let x = Tensor::from_f32(&[rows, k], random(&mut rng, rows, k, 1.0), &device);
                let x = x.unwrap().to_dtype(DType::BF16).unwrap();
                let many = fp8_linear_many(&x, &refs).unwrap();
                for (w, got) in weights.iter().zip(&many) {
                    let want = fp8_linear(&x, w).unwrap().to_vec_f32().unwrap();
                    let got = got.to_vec_f32().unwrap();
                    let same = want.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(
                        same && want.len() == got.len(),
                        "{device}: {rows} rows, {:?}",
                        w.shape()
                    );
                }
            }
        }
    }

    /// The grouped product against the experts one by one, with a gather, experts without
    /// rows and pieces longer than a tile: the same bits on every device.
    #[test]
    fn grouped_experts_give_each_row_its_dense_bits_on_every_device() {
        let mut rng = Rng::new(85);
        let (n, k, tokens) = (192, 256, 150);
        let offsets = [0u32, 7, 7, 140, 141, 300];
        let rows: Vec<u32> = (0..300).map(|_| rng.below(tokens) as u32).collect();
        for device in devices() {
            if !fp8_grouped_supported(&device) {
                continue;
            }
            let ws: Vec<Fp8Matrix> = (0..5)
                .map(|_| {
                    let w = Tensor::from_f32(&[n, k], random(&mut rng, n, k, 0.05), &device);
                    Fp8Matrix::quantize(&w.unwrap()).unwrap()
                })
                .collect();
            let experts: Vec<&Fp8Matrix> = ws.iter().collect();
            let x = random(&mut rng, tokens, k, 1.0);
            let xt = Tensor::from_f32(&[tokens, k], x.clone(), &device).unwrap();
            for dtype in [DType::F32, DType::BF16] {
                let xt = xt.to_dtype(dtype).unwrap();
                let y = fp8_grouped_linear(&xt, Some(&rows), &offsets, &experts).unwrap();
                assert_eq!((y.shape(), y.dtype()), (&[300, n][..], dtype));
                let got: Vec<u32> = y.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect();
                let xh = xt.to_vec_f32().unwrap();
                for e in 0..5 {
                    let (from, to) = (offsets[e] as usize, offsets[e + 1] as usize);
                    let gathered: Vec<f32> = (from..to)
                        .flat_map(|s| &xh[rows[s] as usize * k..][..k])
                        .copied()
                        .collect();
                    let xe = Tensor::from_f32(&[to - from, k], gathered, &device).unwrap();
                    let want = fp8_linear(&xe.to_dtype(dtype).unwrap(), experts[e]).unwrap();
                    let want: Vec<u32> =
                        want.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got[from * n..to * n], want[..], "{device} {dtype} expert {e}");
                }
            }
            // Without a gather, row s is x's row s.
            let xs = Tensor::from_f32(&[300, k], random(&mut rng, 300, k, 1.0), &device).unwrap();
            let y = fp8_grouped_linear(&xs, None, &offsets, &experts).unwrap();
            let tail: Vec<u32> = (141..300).collect();
            let want = fp8_linear(&super::super::gather_rows(&xs, &tail).unwrap(), experts[4]);
            let want = want.unwrap();
            assert_eq!(
                y.to_vec_f32().unwrap()[141 * n..],
                want.to_vec_f32().unwrap()[..],
                "{device}: no gather"
            );
        }
        let cpu = Device::Cpu;
        let w = Fp8Matrix::quantize(&Tensor::from_f32(&[4, 8], vec![0.5; 32], &cpu).unwrap());
        let w = w.unwrap();
        let x = Tensor::from_f32(&[3, 8], vec![1.0; 24], &cpu).unwrap();
        let e = fp8_grouped_linear(&x, Some(&[0, 5]), &[0, 2], &[&w]).unwrap_err().to_string();
        assert!(e.contains("x [3, 8] against 1 FP8 experts [4, 8], 2 offsets ending at 2"), "{e}");
    }

    #[test]
    fn bad_operands_are_errors() {
        let cpu = Device::Cpu;
        let w = Tensor::from_f32(&[4, 8], vec![0.5; 32], &cpu).unwrap();
        let q = Fp8Matrix::quantize(&w).unwrap();
        let x = Tensor::from_f32(&[2, 6], vec![1.0; 12], &cpu).unwrap();
        let e = fp8_linear(&x, &q).unwrap_err().to_string();
        assert!(e.contains("x [2, 6] against an FP8 weight [4, 8]"), "{e}");
        let ids = Tensor::from_i32(&[2, 8], vec![1; 16], &cpu).unwrap();
        assert!(fp8_linear(&ids, &q).unwrap_err().to_string().contains("one is i32"));
        let e = q.codes().to_dtype(DType::F32).unwrap_err().to_string();
        assert!(e.contains("f8e4m3 does not convert to f32"), "{e}");
        let scales = Tensor::from_f32(&[2, 1], vec![1.0; 2], &cpu).unwrap();
        let codes = Tensor::from_f8_codes(&[4, 8], vec![0; 32], &cpu).unwrap();
        let e = Fp8Matrix::from_parts(codes, scales).unwrap_err().to_string();
        assert!(e.contains("scales f32 [2, 1]"), "{e}");
        let mut q2 = Fp8Matrix::quantize(&w).unwrap();
        let other = Tensor::from_f32(&[8, 4], vec![0.5; 32], &cpu).unwrap();
        assert!(q2.requantize(&other).unwrap_err().to_string().contains("a weight [8, 4]"));
        assert_eq!(q.dequantize_to_host().unwrap(), vec![0.5; 32]);
    }
}
