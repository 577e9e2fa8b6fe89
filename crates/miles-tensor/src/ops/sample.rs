//! Token sampling on f32 logits `[rows × vocab]`: temperature, top-k, top-p and one draw per
//! row from a given uniform. Every device returns the CPU reference's token
//! ([`cpu::sample_row`]), and a row's token does not depend on its batch-mates.

use super::dtype_is;
use crate::tensor::Storage;
use crate::{DType, Result, Tensor, cpu, ensure};

/// The token drawn from each row of `logits` (f32 `[rows × vocab]`) with `uniforms[row]` in
/// [0, 1): the `top_k` best tokens are kept (0: all), then the best of those while the mass
/// ranked before a token is at most `top_p` of theirs (1: all), at `temperature`. None for a
/// row whose tempered logits hold a NaN or +inf, or are all -inf. Copied to the host.
pub fn sample_rows(
    logits: &Tensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniforms: &[f64],
) -> Result<Vec<Option<u32>>> {
    const OP: &str = "sample_rows";
    dtype_is(OP, "logits", logits, DType::F32)?;
    ensure(
        logits.shape.len() == 2
            && logits.shape[0] == uniforms.len()
            && logits.shape[1] > 0
            && logits.shape[1] <= i32::MAX as usize,
        OP,
        || format!("logits {:?} for {} uniforms", logits.shape, uniforms.len()),
    )?;
    cpu::sample::check_sampling(OP, temperature, top_p, uniforms)?;
    match &logits.storage {
        Storage::F32(v) => cpu::sample_rows(v, temperature, top_k, top_p, uniforms),
        #[cfg(feature = "cuda")]
        Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(s) }) => {
            let vocab = logits.shape[1];
            crate::cuda::sample_rows(gpu, s, vocab, temperature, top_k, top_p, uniforms)
        }
        _ => unreachable!("an f32 tensor (checked above)"),
    }
}

/// [`sample_rows`] with the uniforms on the logits' device as an i32 tensor `[rows × 2]`, each
/// row the low and high halves of its f64 bits (a captured graph's input), and the tokens left
/// there as an i32 tensor `[rows]` (-1 where [`sample_rows`] gives None). Checks what it can
/// without reading the uniforms back.
pub fn sample_rows_ids(
    logits: &Tensor,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    uniform_bits: &Tensor,
) -> Result<Tensor> {
    const OP: &str = "sample_rows_ids";
    dtype_is(OP, "logits", logits, DType::F32)?;
    dtype_is(OP, "uniform_bits", uniform_bits, DType::I32)?;
    super::same_device(OP, &[logits, uniform_bits])?;
    let rows = logits.shape.first().copied().unwrap_or(0);
    ensure(
        logits.shape.len() == 2
            && uniform_bits.shape == [rows, 2]
            && logits.shape[1] > 0
            && logits.shape[1] <= i32::MAX as usize,
        OP,
        || format!("logits {:?} with uniform bits {:?}", logits.shape, uniform_bits.shape),
    )?;
    match (&logits.storage, &uniform_bits.storage) {
        (Storage::F32(_), Storage::I32(bits)) => {
            let uniforms: Vec<f64> = bits
                .chunks(2)
                .map(|p| f64::from_bits(u64::from(p[0] as u32) | (u64::from(p[1] as u32) << 32)))
                .collect();
            let tokens = sample_rows(logits, temperature, top_k, top_p, &uniforms)?;
            let ids = tokens.into_iter().map(|t| t.map_or(-1, |t| t as i32)).collect();
            Tensor::from_i32(&[rows], ids, &crate::Device::Cpu)
        }
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(s) }),
            Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::I32(u), .. }),
        ) => {
            cpu::sample::check_sampling(OP, temperature, top_p, &[])?;
            let vocab = logits.shape[1];
            let b = crate::cuda::sample_rows_on_device(
                gpu,
                s,
                vocab,
                (temperature, top_k, top_p),
                u,
                rows,
            )?;
            Ok(Tensor { shape: vec![rows], storage: Storage::Cuda(b) })
        }
        _ => unreachable!("f32 logits and i32 bits on one device (checked above)"),
    }
}

/// One chain of draft tokens to verify ([`speculative_verify`]).
#[derive(Debug, Clone, PartialEq)]
pub struct DraftChain {
    /// The policy's rows of the chain: `p_row ..= p_row + drafts.len()` (each the distribution
    /// of the token at its position, given the drafts before it).
    pub p_row: usize,
    /// The draft's rows the drafts were drawn from: `q_row .. q_row + drafts.len()`.
    pub q_row: usize,
    pub drafts: Vec<u32>,
    /// Per policy row, the (accept, draw) uniforms in [0, 1).
    pub uniforms: Vec<(f64, f64)>,
}

/// Speculative sampling's verification of each chain, on the policy's logits `p` and the
/// draft's `q` (f32 `[rows × vocab]`, one device) at `temperature`, `top_k`, `top_p`: the
/// drafts kept, then one token of the policy's own, distributed as the sampler's draws
/// ([`cpu::verify_logits`] is the definition; every device gives its tokens). Copied to the
/// host.
pub fn speculative_verify(
    p: &Tensor,
    q: &Tensor,
    chains: &[DraftChain],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<Vec<Vec<u32>>> {
    const OP: &str = "speculative_verify";
    dtype_is(OP, "p", p, DType::F32)?;
    dtype_is(OP, "q", q, DType::F32)?;
    super::same_device(OP, &[p, q])?;
    let vocab = p.shape.get(1).copied().unwrap_or(0);
    ensure(
        p.shape.len() == 2
            && q.shape.len() == 2
            && q.shape[1] == vocab
            && vocab > 0
            && vocab <= i32::MAX as usize,
        OP,
        || format!("policy logits {:?} beside draft logits {:?}", p.shape, q.shape),
    )?;
    for (c, ch) in chains.iter().enumerate() {
        let k = ch.drafts.len();
        ensure(
            ch.p_row + k < p.shape[0]
                && ch.q_row + k <= q.shape[0]
                && ch.uniforms.len() == k + 1
                && ch.drafts.iter().all(|&x| (x as usize) < vocab),
            OP,
            || {
                format!(
                    "chain {c}: {k} drafts (the largest {:?}) from policy row {} and draft row                      {} with {} uniform pairs, over {:?} and {:?}",
                    ch.drafts.iter().max(),
                    ch.p_row,
                    ch.q_row,
                    ch.uniforms.len(),
                    p.shape,
                    q.shape
                )
            },
        )?;
        let flat: Vec<f64> = ch.uniforms.iter().flat_map(|&(a, d)| [a, d]).collect();
        cpu::sample::check_sampling(OP, temperature, top_p, &flat)?;
    }
    match (&p.storage, &q.storage) {
        (Storage::F32(pv), Storage::F32(qv)) => chains
            .iter()
            .map(|ch| {
                let u: Vec<cpu::StepUniforms> = ch
                    .uniforms
                    .iter()
                    .map(|&(accept, draw)| cpu::StepUniforms { accept, draw })
                    .collect();
                let rows = (ch.p_row, ch.q_row);
                cpu::verify_logits((pv, qv), vocab, rows, &ch.drafts, &u, temperature, top_k, top_p)
            })
            .collect(),
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(ps) }),
            Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::F32(qs), .. }),
        ) => {
            let stride = chains.iter().map(|c| c.drafts.len()).max().unwrap_or(0);
            let mut meta = Vec::with_capacity(3 * chains.len());
            let mut drafts = vec![0i32; chains.len() * stride];
            let mut uniforms = vec![0.0f64; 2 * chains.len() * (stride + 1)];
            for (c, ch) in chains.iter().enumerate() {
                meta.extend([ch.p_row as i32, ch.q_row as i32, ch.drafts.len() as i32]);
                for (i, &x) in ch.drafts.iter().enumerate() {
                    drafts[c * stride + i] = x as i32;
                }
                for (i, &(a, d)) in ch.uniforms.iter().enumerate() {
                    let at = 2 * (c * (stride + 1) + i);
                    uniforms[at..at + 2].copy_from_slice(&[a, d]);
                }
            }
            let how = (temperature, top_k, top_p);
            crate::cuda::spec_verify(gpu, (ps, qs), vocab, how, &meta, &drafts, &uniforms, stride)
        }
        _ => unreachable!("f32 logits on one device (checked above)"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Device;
    use crate::ops::tests::{devices, tensor};
    use crate::rng::Rng;

    /// Rows that reach every path: plain, many ties (and -0.0 beside 0.0), -inf entries and a
    /// tied max, few finite logits, masses mostly 0, a nearly flat row, and rows giving None.
    fn rows(rng: &mut Rng, vocab: usize) -> Vec<f32> {
        let mut out = Vec::new();
        for kind in 0..9 {
            let mut row = match kind {
                4 => rng.vec(vocab, 40.0),
                5 => rng.vec(vocab, 0.05),
                _ => rng.vec(vocab, 3.0),
            };
            match kind {
                1 => row.iter_mut().for_each(|x| {
                    *x = (*x * 1.5).round() / 2.0;
                    if *x == 0.0 && rng.below(2) == 0 {
                        *x = -0.0;
                    }
                }),
                2 => {
                    row.iter_mut()
                        .filter(|_| rng.below(10) == 0)
                        .for_each(|x| *x = f32::NEG_INFINITY);
                    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    (0..3).for_each(|_| row[rng.below(vocab)] = max);
                }
                3 => row.iter_mut().skip(5).for_each(|x| *x = f32::NEG_INFINITY),
                6 => row[rng.below(vocab)] = f32::NAN,
                7 => row.fill(f32::NEG_INFINITY),
                8 => row[rng.below(vocab)] = f32::INFINITY,
                _ => {}
            }
            out.extend(row);
        }
        out
    }

    #[test]
    fn sample_rows_match_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(74);
        for device in devices() {
            for vocab in [1000, 4097, 151_936] {
                let logits = rows(&mut rng, vocab);
                let n = logits.len() / vocab;
                let lt = tensor(&[n, vocab], &logits, DType::F32, &device);
                let mut some = 0;
                for temperature in [1.0f32, 0.7] {
                    for top_k in [0, 1, 20, 1000] {
                        for top_p in [1.0f32, 0.9, 0.3] {
                            // Spread over [0, 1): one stratum per row.
                            let uniforms: Vec<f64> = (0..n)
                                .map(|r| (r as f64 + f64::from(rng.uniform(0.0, 1.0))) / n as f64)
                                .collect();
                            let got =
                                sample_rows(&lt, temperature, top_k, top_p, &uniforms).unwrap();
                            let what = format!(
                                "{device} sample_rows vocab {vocab} T={temperature} top_k {top_k} top_p {top_p}"
                            );
                            for (r, (row, &u)) in logits.chunks(vocab).zip(&uniforms).enumerate() {
                                let want = cpu::sample_row(row, temperature, top_k, top_p, u);
                                assert_eq!(got[r], want, "{what}: row {r}, u {u}");
                                assert_eq!(want.is_none(), r >= 6, "{what}: row {r}");
                                some += usize::from(want.is_some());
                            }
                            // A row alone gives the token it gives in the batch.
                            let r = rng.below(6);
                            let one = tensor(
                                &[1, vocab],
                                &logits[r * vocab..(r + 1) * vocab],
                                DType::F32,
                                &device,
                            );
                            let alone =
                                sample_rows(&one, temperature, top_k, top_p, &uniforms[r..=r])
                                    .unwrap();
                            assert_eq!(alone[0], got[r], "{what}: row {r} alone");
                        }
                    }
                }
                println!("{device} sample_rows vocab {vocab}: {some} tokens equal");
            }
        }
    }

    /// Small and odd vocabularies, top_k at and around the vocabulary, top_p near 0 and 1,
    /// uniforms at both ends, and rows of all-equal logits (every cut falls inside a tie).
    #[test]
    fn sample_rows_match_the_cpu_reference_at_the_edges() {
        let mut rng = Rng::new(76);
        for device in devices() {
            for vocab in [1, 2, 33, 1025, 65_537] {
                let mut logits = rows(&mut rng, vocab);
                logits.truncate(6 * vocab);
                logits.extend(std::iter::repeat_n(1.5, vocab));
                logits.extend((0..vocab).map(|i| (i % 3) as f32));
                let n = logits.len() / vocab;
                let lt = tensor(&[n, vocab], &logits, DType::F32, &device);
                for top_k in [0, 1, 2, vocab.saturating_sub(1), vocab, vocab + 5] {
                    for top_p in [1.0f32, 0.999, 0.5, 1e-3] {
                        for u in [0.0, 0.5, 1.0 - f64::EPSILON / 2.0] {
                            let uniforms = vec![u; n];
                            let got = sample_rows(&lt, 0.7, top_k, top_p, &uniforms).unwrap();
                            for (r, row) in logits.chunks(vocab).enumerate() {
                                let want = cpu::sample_row(row, 0.7, top_k, top_p, u);
                                assert_eq!(
                                    got[r], want,
                                    "{device} vocab {vocab} top_k {top_k} top_p {top_p} u {u}: row {r}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Speculative verification on every device gives the CPU definition's tokens: drafts
    /// from draft rows near the policy's (mostly kept), far from them (mostly replaced), equal
    /// to them (all kept), tokens the draft could not have drawn, a policy row with a NaN
    /// inside a chain (cut there) and one without mass first (no token), under top-k and top-p.
    #[test]
    fn speculative_verify_matches_the_cpu_definition_on_every_device() {
        let mut rng = Rng::new(91);
        for device in devices() {
            for vocab in [1000, 151_936] {
                let (mut p, mut q, mut chains) = (Vec::new(), Vec::new(), Vec::new());
                for c in 0..24 {
                    let k = c % 5;
                    let (p_row, q_row) = (p.len() / vocab, q.len() / vocab);
                    let base: Vec<f32> = rng.vec(vocab * (k + 1), 3.0);
                    p.extend(&base);
                    let noise = [0.0f32, 0.3, 3.0][c % 3];
                    for (i, x) in base.iter().enumerate().take(vocab * k) {
                        q.push(x + noise * rng.normal() + if i % 7 == 0 { noise } else { 0.0 });
                    }
                    if c == 8 {
                        p[(p_row + 2) * vocab + 17] = f32::NAN;
                    }
                    if c == 9 {
                        p[p_row * vocab..(p_row + 1) * vocab].fill(f32::NEG_INFINITY);
                    }
                    let drafts = (0..k)
                        .map(|i| {
                            let row = &q[(q_row + i) * vocab..(q_row + i + 1) * vocab];
                            match c % 4 {
                                3 => rng.below(vocab) as u32,
                                _ => cpu::sample_row(
                                    row,
                                    0.8,
                                    0,
                                    1.0,
                                    rng.next_u64() as f64 / 2f64.powi(64),
                                )
                                .unwrap_or(0),
                            }
                        })
                        .collect();
                    let uniforms = (0..=k)
                        .map(|_| {
                            (f64::from(rng.uniform(0.0, 1.0)), f64::from(rng.uniform(0.0, 1.0)))
                        })
                        .collect();
                    chains.push(DraftChain { p_row, q_row, drafts, uniforms });
                }
                let (np, nq) = (p.len() / vocab, q.len() / vocab);
                let pt = tensor(&[np, vocab], &p, DType::F32, &device);
                let qt = tensor(&[nq, vocab], &q, DType::F32, &device);
                let (mut kept, mut replaced) = (0, 0);
                for (t, top_k, top_p) in [(0.8f32, 0, 1.0f32), (1.0, 50, 1.0), (0.7, 0, 0.9)] {
                    let got = speculative_verify(&pt, &qt, &chains, t, top_k, top_p).unwrap();
                    for (c, ch) in chains.iter().enumerate() {
                        let u: Vec<cpu::StepUniforms> = ch
                            .uniforms
                            .iter()
                            .map(|&(accept, draw)| cpu::StepUniforms { accept, draw })
                            .collect();
                        let want = cpu::verify_logits(
                            (&p, &q),
                            vocab,
                            (ch.p_row, ch.q_row),
                            &ch.drafts,
                            &u,
                            t,
                            top_k,
                            top_p,
                        )
                        .unwrap();
                        let what = format!("{device} vocab {vocab} T={t} k={top_k} p={top_p}");
                        assert_eq!(got[c], want, "{what}: chain {c}");
                        let same = want.iter().zip(&ch.drafts).take_while(|(a, b)| a == b).count();
                        kept += same;
                        replaced += usize::from(same < ch.drafts.len() && want.len() > same);
                    }
                    assert!(got[9].is_empty() && got[8].len() <= 2, "{got:?}");
                }
                assert!(kept > 20 && replaced > 10, "{device}: {kept} kept, {replaced} replaced");
            }
        }
    }

    #[test]
    fn bad_sample_inputs_are_errors() {
        for device in devices() {
            let empty = tensor(&[0, 5], &[], DType::F32, &device);
            assert_eq!(sample_rows(&empty, 1.0, 0, 1.0, &[]).unwrap(), []);
        }
        let dev = Device::Cpu;
        let logits = tensor(&[2, 3], &[0.0; 6], DType::F32, &dev);
        assert!(sample_rows(&logits, 1.0, 0, 1.0, &[0.5]).is_err());
        assert!(sample_rows(&logits, 0.0, 0, 1.0, &[0.5, 0.5]).is_err());
        assert!(sample_rows(&logits, 1.0, 0, 0.0, &[0.5, 0.5]).is_err());
        let err = sample_rows(&logits, 1.0, 0, 1.0, &[0.5, 1.0]).unwrap_err().to_string();
        assert!(err.contains("outside [0, 1)"), "{err}");
        let flat = tensor(&[6], &[0.0; 6], DType::F32, &dev);
        assert!(sample_rows(&flat, 1.0, 0, 1.0, &[0.5]).is_err());
        let bf = tensor(&[2, 3], &[0.0; 6], DType::BF16, &dev);
        assert!(
            sample_rows(&bf, 1.0, 0, 1.0, &[0.5, 0.5]).unwrap_err().to_string().contains("f32")
        );
    }
}
