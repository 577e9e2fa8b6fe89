//! The LM head's row statistics on f32 logits `[rows × vocab]`: each row's target logprob and
//! entropy at a temperature, and their gradient. On the device the logits come from a GEMM over
//! a chunk of rows; these ops never see more than that chunk.

use super::{dtype_is, host_tensor, same_device};
use crate::tensor::Storage;
use crate::{DType, Device, Error, Result, Tensor, cpu, ensure};

/// `[rows × vocab]` of `logits`, with `targets` in the vocabulary and a positive temperature.
fn shape_of(op: &'static str, logits: &Tensor, targets: &[u32], temperature: f32) -> Result<usize> {
    dtype_is(op, "logits", logits, DType::F32)?;
    ensure(
        logits.shape.len() == 2 && logits.shape[0] == targets.len() && temperature > 0.0,
        op,
        || {
            format!(
                "logits {:?} for {} targets, temperature {temperature}",
                logits.shape,
                targets.len()
            )
        },
    )?;
    let vocab = logits.shape[1];
    match targets.iter().find(|&&t| t as usize >= vocab) {
        Some(bad) => Err(Error::Shape {
            op,
            message: format!("target {bad} is outside the vocabulary of {vocab}"),
        }),
        None => Ok(vocab),
    }
}

fn host(t: &Tensor) -> &[f32] {
    match &t.storage {
        Storage::F32(v) => v,
        _ => unreachable!("an f32 host tensor (checked by the op)"),
    }
}

#[cfg(feature = "cuda")]
fn device(t: &Tensor) -> &cudarc::driver::CudaSlice<f32> {
    match &t.storage {
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::F32(s), .. }) => s,
        _ => unreachable!("an f32 device tensor (checked by the op)"),
    }
}

/// `(logp, entropy)`, each `[rows]` f32: `log softmax(logits/T)[target]` and the entropy of
/// `softmax(logits/T)`, per row, in f32 (never rounded to bf16 before the log-softmax).
pub fn logprob_rows(
    logits: &Tensor,
    targets: &[u32],
    temperature: f32,
) -> Result<(Tensor, Tensor)> {
    let vocab = shape_of("logprob_rows", logits, targets, temperature)?;
    let rows = targets.len();
    match logits.device() {
        Device::Cpu => {
            let (mut logp, mut entropy) = (vec![0.0; rows], vec![0.0; rows]);
            cpu::logprob_rows_forward(&mut logp, &mut entropy, host(logits), targets, temperature)?;
            let t = |v| Tensor { shape: vec![rows], storage: Storage::F32(v) };
            Ok((t(logp), t(entropy)))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &logits.storage else { unreachable!("on a device") };
            let targets: Vec<i32> = targets.iter().map(|&t| t as i32).collect();
            let (lp, ent) = crate::cuda::logprob_rows(
                &buffer.gpu,
                device(logits),
                crate::cuda::Ids::Host(&targets),
                vocab,
                temperature,
            )?;
            let t = |b| Tensor { shape: vec![rows], storage: Storage::Cuda(b) };
            Ok((t(lp), t(ent)))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            let _ = vocab;
            Err(crate::tensor::not_built())
        }
    }
}

/// [`logprob_rows`] with the targets in an i32 tensor on the logits' device (a captured
/// graph's sampled tokens). The caller guarantees they are in the vocabulary.
pub fn logprob_rows_ids(
    logits: &Tensor,
    targets: &Tensor,
    temperature: f32,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "logprob_rows_ids";
    same_device(OP, &[logits, targets])?;
    dtype_is(OP, "targets", targets, DType::I32)?;
    match &targets.storage {
        Storage::I32(v) => {
            let t: Vec<u32> = v.iter().map(|&i| i as u32).collect();
            logprob_rows(logits, &t, temperature)
        }
        #[cfg(feature = "cuda")]
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::I32(d), .. }) => {
            let rows = targets.len();
            dtype_is(OP, "logits", logits, DType::F32)?;
            ensure(
                logits.shape.len() == 2 && logits.shape[0] == rows && temperature > 0.0,
                OP,
                || {
                    format!(
                        "logits {:?} for {rows} targets, temperature {temperature}",
                        logits.shape
                    )
                },
            )?;
            let Storage::Cuda(buffer) = &logits.storage else { unreachable!("on a device") };
            let ids = crate::cuda::Ids::Device(d, rows);
            let (lp, ent) = crate::cuda::logprob_rows(
                &buffer.gpu,
                device(logits),
                ids,
                logits.shape[1],
                temperature,
            )?;
            let t = |b| Tensor { shape: vec![rows], storage: Storage::Cuda(b) };
            Ok((t(lp), t(ent)))
        }
        _ => unreachable!("an i32 tensor (checked)"),
    }
}

/// The gradient of `Σ d_logp·logp + d_entropy·entropy` with respect to `logits` (f32,
/// `[rows × vocab]`), recomputing each row's statistics rather than keeping them; `out` is
/// its dtype (f32, or bf16 rounded from the f32 value).
pub fn logprob_rows_backward(
    logits: &Tensor,
    targets: &[u32],
    temperature: f32,
    d_logp: &Tensor,
    d_entropy: &Tensor,
    out: DType,
) -> Result<Tensor> {
    const OP: &str = "logprob_rows_backward";
    ensure(out != DType::I32, OP, || "the gradient is f32 or bf16, not i32".into())?;
    let dev = same_device(OP, &[logits, d_logp, d_entropy])?;
    let vocab = shape_of(OP, logits, targets, temperature)?;
    for (what, t) in [("d_logp", d_logp), ("d_entropy", d_entropy)] {
        dtype_is(OP, what, t, DType::F32)?;
        ensure(t.shape == [targets.len()], OP, || {
            format!("{what} {:?} for {} rows", t.shape, targets.len())
        })?;
    }
    match dev {
        Device::Cpu => {
            let mut d = vec![0.0; logits.len()];
            cpu::logprob_rows_backward(
                &mut d,
                host(logits),
                targets,
                host(d_logp),
                host(d_entropy),
                temperature,
            )?;
            Ok(host_tensor(logits.shape.clone(), d, out))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(buffer) = &logits.storage else { unreachable!("on a device") };
            let d = crate::cuda::logprob_rows_backward(
                &buffer.gpu,
                device(logits),
                targets,
                device(d_logp),
                device(d_entropy),
                vocab,
                temperature,
                out == DType::BF16,
            )?;
            Ok(Tensor { shape: logits.shape.clone(), storage: Storage::Cuda(d) })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            let _ = vocab;
            Err(crate::tensor::not_built())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, max_rel_err, tensor};
    use crate::rng::Rng;

    #[test]
    fn logprob_rows_match_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(61);
        for device in devices() {
            for &(rows, vocab) in &[(1, 2), (7, 1000), (33, 49_152), (3, 151_936)] {
                for &temperature in &[1.0f32, 0.7] {
                    let logits = rng.vec(rows * vocab, 8.0);
                    let targets: Vec<u32> = (0..rows).map(|_| rng.below(vocab) as u32).collect();
                    let (d_logp, d_ent) = (rng.vec(rows, 1.0), rng.vec(rows, 1.0));
                    let (mut lp, mut ent) = (vec![0.0; rows], vec![0.0; rows]);
                    cpu::logprob_rows_forward(&mut lp, &mut ent, &logits, &targets, temperature)
                        .unwrap();
                    let mut d = vec![0.0; rows * vocab];
                    cpu::logprob_rows_backward(
                        &mut d,
                        &logits,
                        &targets,
                        &d_logp,
                        &d_ent,
                        temperature,
                    )
                    .unwrap();

                    let lt = tensor(&[rows, vocab], &logits, DType::F32, &device);
                    let (lpt, entt) = logprob_rows(&lt, &targets, temperature).unwrap();
                    let what = |n: &str| {
                        format!("{device} logprob_rows {n} {rows}×{vocab} T={temperature}")
                    };
                    // Sums over the vocabulary in another order: logp to 1e-5 of its scale;
                    // entropy = lse − E[x] cancels, so its error is relative to the logits'
                    // scale rather than its own: 1e-4.
                    for (name, got, want, tol) in
                        [("logp", &lpt, &lp, 1e-5), ("entropy", &entt, &ent, 1e-4)]
                    {
                        let err = max_rel_err(&what(name), &got.to_vec_f32().unwrap(), want);
                        assert!(err <= tol, "{}: {err:.3e}", what(name));
                    }
                    let dt = |v: &[f32]| tensor(&[rows], v, DType::F32, &device);
                    // d_logits carries the entropy's error through p·(log p + H): 1e-4; in
                    // bf16, the rounding of the output as well.
                    for (out, tol) in [(DType::F32, 1e-4), (DType::BF16, 8e-3)] {
                        let (dl, de) = (dt(&d_logp), dt(&d_ent));
                        let dlt = logprob_rows_backward(&lt, &targets, temperature, &dl, &de, out)
                            .unwrap();
                        assert_eq!(dlt.dtype(), out);
                        let err = max_rel_err(&what("d_logits"), &dlt.to_vec_f32().unwrap(), &d);
                        assert!(err <= tol, "{} {out}: {err:.3e}", what("d_logits"));
                    }
                    println!("{}: ok", what("all"));
                    // A row alone gives the bits it gives in the batch (batch invariance).
                    let r = rows - 1;
                    let one = tensor(&[1, vocab], &logits[r * vocab..], DType::F32, &device);
                    let (lp1, _) = logprob_rows(&one, &targets[r..], temperature).unwrap();
                    let batch = lpt.to_vec_f32().unwrap()[r];
                    assert_eq!(
                        lp1.to_vec_f32().unwrap()[0].to_bits(),
                        batch.to_bits(),
                        "{}",
                        what("alone")
                    );
                }
            }
        }
    }

    #[test]
    fn bad_logprob_inputs_are_errors() {
        let dev = Device::Cpu;
        let logits = tensor(&[2, 3], &[0.0; 6], DType::F32, &dev);
        let err = logprob_rows(&logits, &[0, 3], 1.0).unwrap_err().to_string();
        assert!(err.contains("target 3 is outside the vocabulary of 3"), "{err}");
        assert!(logprob_rows(&logits, &[0], 1.0).is_err());
        assert!(logprob_rows(&logits, &[0, 1], 0.0).is_err());
        let bf = tensor(&[2, 3], &[0.0; 6], DType::BF16, &dev);
        assert!(logprob_rows(&bf, &[0, 1], 1.0).unwrap_err().to_string().contains("f32"));
    }
}
