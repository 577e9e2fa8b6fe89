//! A mixture of experts' products, every expert at once: the rows of a layer's picks sorted by
//! expert, expert `e` owning rows `offsets[e]..offsets[e+1]`. On CUDA one launch each (bf16,
//! `kernels/grouped_gemm.cu`), with a row's bits independent of how many rows its expert has;
//! on the CPU the reference loops.

use super::{floats_only, host_f32, host_out, host_tensor, same_device};
use crate::cpu::Transpose;
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::device_data;

/// Offsets of `experts` runs: from 0, never decreasing, ending at `total` when given.
pub(super) fn offsets_ok(offsets: &[u32], experts: usize) -> bool {
    offsets.len() == experts + 1 && offsets[0] == 0 && offsets.windows(2).all(|w| w[0] <= w[1])
}

/// `out[s] = x[row(s)]·W_eᵀ` (`tw` [`Transpose::Yes`], each weight `[n × k]`, a linear layer)
/// or `x[row(s)]·W_e` (`tw` No, each `[k × n]`: its input gradient) for the rows `s` of each
/// expert `e`, where `row(s) = rows[s]` (a gather, fused) or `s`. `x` is `[· × k]`; the result
/// `[offsets[E] × n]` in `x`'s dtype, accumulated in f32.
pub fn grouped_matmul(
    x: &Tensor,
    rows: Option<&[u32]>,
    offsets: &[u32],
    weights: &[&Tensor],
    tw: Transpose,
) -> Result<Tensor> {
    const OP: &str = "grouped_matmul";
    let mut all = vec![x];
    all.extend(weights);
    let device = same_device(OP, &all)?;
    floats_only(OP, &all)?;
    let w0 = weights.first().map(|w| w.shape.clone()).unwrap_or_default();
    let ok = x.shape.len() == 2
        && w0.len() == 2
        && weights.iter().all(|w| w.shape == w0 && w.dtype() == x.dtype())
        && offsets_ok(offsets, weights.len());
    ensure(ok, OP, || {
        format!(
            "x {:?} with {} experts' weights {w0:?}, {} offsets",
            x.shape,
            weights.len(),
            offsets.len()
        )
    })?;
    let (k, n) = match tw {
        Transpose::Yes => (w0[1], w0[0]),
        Transpose::No => (w0[0], w0[1]),
    };
    let total = offsets[weights.len()] as usize;
    let rows_ok = match rows {
        Some(r) => r.len() == total && r.iter().all(|&i| (i as usize) < x.shape[0]),
        None => x.shape[0] == total,
    };
    ensure(x.shape[1] == k && rows_ok, OP, || {
        format!("x {:?} against weights {w0:?} ({tw:?}), {total} rows", x.shape)
    })?;
    match device {
        Device::Cpu => {
            let xv = host_f32(x);
            let mut out = host_out(total * n);
            for (e, w) in weights.iter().enumerate() {
                let wv = host_f32(w);
                for s in offsets[e] as usize..offsets[e + 1] as usize {
                    let r = rows.map_or(s, |r| r[s] as usize);
                    let xr = &xv[r * k..(r + 1) * k];
                    for (j, o) in out[s * n..(s + 1) * n].iter_mut().enumerate() {
                        *o = match tw {
                            Transpose::Yes => dot(xr, &wv[j * k..(j + 1) * k]),
                            Transpose::No => {
                                xr.iter().enumerate().map(|(i, a)| a * wv[i * n + j]).sum()
                            }
                        };
                    }
                }
            }
            Ok(host_tensor(vec![total, n], out, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &x.storage else { unreachable!("a device tensor") };
            let ws: Vec<_> = weights.iter().map(|w| device_data(w)).collect();
            let nt = tw == Transpose::Yes;
            let out =
                crate::cuda::grouped_rows(&buffer.gpu, &buffer.data, rows, offsets, &ws, n, k, nt)?;
            Ok(Tensor { shape: vec![total, n], storage: Storage::Cuda(out) })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The experts' weight gradients: `grads[e] += Σ_s a[s]ᵀ · b[row(s)]` over the rows `s` of
/// expert `e` (`row` as in [`grouped_matmul`]), `a` `[offsets[E] × m]`, `b` `[· × n]` of one
/// float dtype, each gradient f32 `[m × n]`.
pub fn grouped_matmul_wgrad(
    grads: &mut [&mut Tensor],
    a: &Tensor,
    b: &Tensor,
    rows: Option<&[u32]>,
    offsets: &[u32],
) -> Result<()> {
    const OP: &str = "grouped_matmul_wgrad";
    let device = same_device(OP, &[a, b])?;
    floats_only(OP, &[a, b])?;
    let (m, n) = (a.shape.get(1).copied().unwrap_or(0), b.shape.get(1).copied().unwrap_or(0));
    let total = offsets.last().copied().unwrap_or(0) as usize;
    let rows_ok = match rows {
        Some(r) => r.len() == total && r.iter().all(|&i| (i as usize) < b.shape[0]),
        None => b.shape[0] == total,
    };
    let ok = a.shape.len() == 2
        && b.shape.len() == 2
        && a.dtype() == b.dtype()
        && a.shape[0] == total
        && rows_ok
        && offsets_ok(offsets, grads.len())
        && grads
            .iter()
            .all(|g| g.shape == [m, n] && g.dtype() == DType::F32 && g.device() == device);
    ensure(ok, OP, || {
        format!(
            "a {:?}, b {:?}, {} gradients, {} offsets",
            a.shape,
            b.shape,
            grads.len(),
            offsets.len()
        )
    })?;
    match device {
        Device::Cpu => {
            let (av, bv) = (host_f32(a), host_f32(b));
            for (e, g) in grads.iter_mut().enumerate() {
                let Storage::F32(gv) = &mut g.storage else { unreachable!("checked f32") };
                let seg = offsets[e] as usize..offsets[e + 1] as usize;
                for i in 0..m {
                    for j in 0..n {
                        let sum: f32 = seg
                            .clone()
                            .map(|s| av[s * m + i] * bv[rows.map_or(s, |r| r[s] as usize) * n + j])
                            .sum();
                        gv[i * n + j] += sum;
                    }
                }
            }
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &a.storage else { unreachable!("a device tensor") };
            let gpu = buffer.gpu.clone();
            let mut gs: Vec<&mut crate::cuda::DeviceData> = grads
                .iter_mut()
                .map(|g| match &mut g.storage {
                    Storage::Cuda(b) => &mut b.data,
                    _ => unreachable!("checked on the device"),
                })
                .collect();
            crate::cuda::grouped_wgrad(
                &gpu,
                &mut gs,
                &buffer.data,
                device_data(b),
                rows,
                offsets,
                (m, n),
            )
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, max_rel_err, tensor};
    use crate::rng::Rng;

    /// Offsets of `experts` runs of random lengths (some empty) summing to `total`.
    fn random_offsets(rng: &mut Rng, experts: usize, total: usize) -> Vec<u32> {
        let mut cuts: Vec<u32> = (0..experts - 1).map(|_| rng.below(total + 1) as u32).collect();
        cuts.sort_unstable();
        let mut offsets = vec![0];
        offsets.extend(cuts);
        offsets.push(total as u32);
        offsets
    }

    /// Both products and the weight gradient against plain per-expert loops in f64 over the
    /// dtype's values, on every device (CUDA in bf16), at shapes that take the 16-byte loads and
    /// at ones that do not (widths not a multiple of 8), with and without a gather.
    #[test]
    fn grouped_products_match_per_expert_loops_on_every_device() {
        let mut rng = Rng::new(71);
        for &(experts, total, k, n) in &[
            (4usize, 300usize, 64usize, 136usize),
            (3, 37, 6, 10),
            (5, 260, 200, 72),
            (24, 200, 72, 100),
        ] {
            let offsets = random_offsets(&mut rng, experts, total);
            let x_rows = total / 2 + 3;
            let rows: Vec<u32> = (0..total).map(|_| rng.below(x_rows) as u32).collect();
            let x = rng.vec(x_rows * k, 1.0);
            let xp = rng.vec(total * k, 1.0);
            let w: Vec<Vec<f32>> = (0..experts).map(|_| rng.vec(n * k, 0.2)).collect();
            let g0: Vec<Vec<f32>> = (0..experts).map(|_| rng.vec(n * k, 0.1)).collect();
            for device in devices() {
                let dtypes: &[DType] =
                    if device == Device::Cpu { &[DType::F32, DType::BF16] } else { &[DType::BF16] };
                for &dtype in dtypes {
                    let r = |v: &[f32]| crate::ops::tests::round_out(v, dtype);
                    let what = format!("{device} {dtype} {experts}×{total}×{k}×{n}");
                    let wt: Vec<Tensor> =
                        w.iter().map(|w| tensor(&[n, k], w, dtype, &device)).collect();
                    let wr: Vec<&Tensor> = wt.iter().collect();
                    let (xv, xpv) = (r(&x), r(&xp));
                    let wv: Vec<Vec<f32>> = w.iter().map(|w| r(w)).collect();
                    let expert_of =
                        |s: usize| offsets.windows(2).position(|o| s < o[1] as usize).unwrap();
                    // Forward with the gather: [total × n].
                    let xt = tensor(&[x_rows, k], &x, dtype, &device);
                    let got =
                        grouped_matmul(&xt, Some(&rows), &offsets, &wr, Transpose::Yes).unwrap();
                    let mut want = vec![0.0f32; total * n];
                    for s in 0..total {
                        let (e, xr) = (expert_of(s), rows[s] as usize);
                        for j in 0..n {
                            let v: f64 = (0..k)
                                .map(|i| f64::from(xv[xr * k + i]) * f64::from(wv[e][j * k + i]))
                                .sum();
                            want[s * n + j] = v as f32;
                        }
                    }
                    let tol = if dtype == DType::F32 { 1e-5 } else { 1e-2 };
                    let err = max_rel_err(&what, &got.to_vec_f32().unwrap(), &want);
                    assert!(err < tol, "{what} x·Wᵀ: {err:.3e}");
                    // The input gradient without a gather, W_e read as [k' = n × n' = k]: [total × k].
                    let dy = rng.vec(total * n, 1.0);
                    let dyv = r(&dy);
                    let dyt = tensor(&[total, n], &dy, dtype, &device);
                    let got = grouped_matmul(&dyt, None, &offsets, &wr, Transpose::No).unwrap();
                    let mut want = vec![0.0f32; total * k];
                    for s in 0..total {
                        let e = expert_of(s);
                        for i in 0..k {
                            let v: f64 = (0..n)
                                .map(|j| f64::from(dyv[s * n + j]) * f64::from(wv[e][j * k + i]))
                                .sum();
                            want[s * k + i] = v as f32;
                        }
                    }
                    let err = max_rel_err(&what, &got.to_vec_f32().unwrap(), &want);
                    assert!(err < tol, "{what} dy·W: {err:.3e}");
                    // The weight gradient, gathered b: G_e [n × k] += dy[seg]ᵀ · x[rows[seg]].
                    let mut gt: Vec<Tensor> =
                        g0.iter().map(|g| tensor(&[n, k], g, DType::F32, &device)).collect();
                    let mut gr: Vec<&mut Tensor> = gt.iter_mut().collect();
                    grouped_matmul_wgrad(&mut gr, &dyt, &xt, Some(&rows), &offsets).unwrap();
                    for (e, g) in gt.iter().enumerate() {
                        let mut want = g0[e].clone();
                        for s in offsets[e] as usize..offsets[e + 1] as usize {
                            for j in 0..n {
                                for i in 0..k {
                                    want[j * k + i] +=
                                        dyv[s * n + j] * xv[rows[s] as usize * k + i];
                                }
                            }
                        }
                        let err = max_rel_err(&what, &g.to_vec_f32().unwrap(), &want);
                        assert!(err < 1e-4, "{what} expert {e} gradient: {err:.3e}");
                    }
                    // Without a gather too.
                    let xpt = tensor(&[total, k], &xp, dtype, &device);
                    let mut gt: Vec<Tensor> =
                        g0.iter().map(|g| tensor(&[n, k], g, DType::F32, &device)).collect();
                    let mut gr: Vec<&mut Tensor> = gt.iter_mut().collect();
                    grouped_matmul_wgrad(&mut gr, &dyt, &xpt, None, &offsets).unwrap();
                    let e = experts - 1;
                    let mut want = g0[e].clone();
                    for s in offsets[e] as usize..total {
                        for j in 0..n {
                            for i in 0..k {
                                want[j * k + i] += dyv[s * n + j] * xpv[s * k + i];
                            }
                        }
                    }
                    let err = max_rel_err(&what, &gt[e].to_vec_f32().unwrap(), &want);
                    assert!(err < 1e-4, "{what} last expert's gradient, no gather: {err:.3e}");
                }
            }
        }
    }

    /// On CUDA a row's outputs have the same bits whether its expert has 1 row or hundreds
    /// (decode against training; the 128-row tiles against the 16-row pieces of decode-sized
    /// runs): every row alone against the whole batch, with few experts (large tiles) and many
    /// (pieces, some experts over 16 rows), at widths that fill the tiles and ones that do not.
    #[test]
    fn grouped_rows_have_the_bits_of_the_row_alone() {
        let device = Device::Cuda(0);
        if let Err(e) = device.ensure_available() {
            println!("skipping CUDA: {e}");
            return;
        }
        let mut rng = Rng::new(72);
        for (experts, total, k, n) in
            [(8usize, 700usize, 256usize, 192usize), (8, 700, 72, 100), (40, 600, 72, 100)]
        {
            let offsets = random_offsets(&mut rng, experts, total);
            let x = tensor(&[total, k], &rng.vec(total * k, 1.0), DType::BF16, &device);
            let wt: Vec<Tensor> = (0..experts)
                .map(|_| tensor(&[n, k], &rng.vec(n * k, 0.1), DType::BF16, &device))
                .collect();
            let wr: Vec<&Tensor> = wt.iter().collect();
            let rows: Vec<u32> = (0..total as u32).collect();
            let all = grouped_matmul(&x, Some(&rows), &offsets, &wr, Transpose::Yes).unwrap();
            let all = all.to_vec_f32().unwrap();
            for s in [0usize, 1, 15, 16, 63, 128, 129, 300, total - 1] {
                let e = offsets.windows(2).position(|o| s < o[1] as usize).unwrap();
                let mut one = vec![0u32; experts + 1];
                one[e + 1..].iter_mut().for_each(|o| *o = 1);
                let got = grouped_matmul(&x, Some(&[s as u32]), &one, &wr, Transpose::Yes).unwrap();
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                let what = format!("{experts}×{total}×{k}×{n} row {s}");
                assert_eq!(
                    bits(&got.to_vec_f32().unwrap()),
                    bits(&all[s * n..(s + 1) * n]),
                    "{what}"
                );
            }
        }
    }

    #[test]
    fn bad_groups_are_errors() {
        let cpu = Device::Cpu;
        let x = tensor(&[4, 8], &[0.5; 32], DType::F32, &cpu);
        let w = tensor(&[3, 8], &[0.5; 24], DType::F32, &cpu);
        let ws = [&w, &w];
        assert!(grouped_matmul(&x, None, &[0, 2, 4], &ws, Transpose::Yes).is_ok());
        assert!(grouped_matmul(&x, None, &[0, 2, 3], &ws, Transpose::Yes).is_err());
        assert!(grouped_matmul(&x, None, &[1, 2, 4], &ws, Transpose::Yes).is_err());
        assert!(grouped_matmul(&x, None, &[0, 3, 2], &ws, Transpose::Yes).is_err());
        assert!(grouped_matmul(&x, Some(&[0, 9]), &[0, 1, 2], &ws, Transpose::Yes).is_err());
        assert!(grouped_matmul(&x, None, &[0, 2, 4], &ws, Transpose::No).is_err());
        let mut g = tensor(&[3, 8], &[0.0; 24], DType::BF16, &cpu);
        let dy = tensor(&[4, 3], &[0.5; 12], DType::F32, &cpu);
        assert!(grouped_matmul_wgrad(&mut [&mut g], &dy, &x, None, &[0, 4]).is_err());
    }
}
