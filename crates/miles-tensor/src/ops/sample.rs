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

/// `uniforms` as [`sample_rows_ids`] reads them: i32 `[rows × 2]` on `device`, each row the
/// low and high halves of its f64 bits.
pub fn uniform_bits(uniforms: &[f64], device: &crate::Device) -> Result<Tensor> {
    let bits = uniforms
        .iter()
        .flat_map(|u| {
            let b = u.to_bits();
            [b as u32 as i32, (b >> 32) as u32 as i32]
        })
        .collect();
    Tensor::from_i32(&[uniforms.len(), 2], bits, device)
}

/// One chain of draft tokens to verify ([`speculative_verify`]): chain position i's policy
/// row is `p_row + i · p_step` (i ≤ `len`), its draft row `q_row + i · q_step` (i < `len`),
/// and draft i is the policy's input token at position i + 1's row.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftChain {
    pub p_row: usize,
    pub q_row: usize,
    /// Drafts proposed; the chain ends before a draft outside the vocabulary (a sampler's -1).
    pub len: usize,
    /// Per policy row, the (accept, draw) uniforms in [0, 1).
    pub uniforms: Vec<(f64, f64)>,
}

/// What [`speculative_verify`] leaves on the logits' device: per chain the number of tokens
/// it gives (`counts`, i32 `[chains]`), and those tokens at the chain's policy rows (`tokens`,
/// i32 `[policy rows]`, 0 at every other row: each row's target for its logprob).
#[derive(Debug)]
pub struct Verified {
    pub counts: Tensor,
    pub tokens: Tensor,
}

impl Verified {
    /// Each chain's tokens, read to the host.
    pub fn to_host(&self, chains: &[DraftChain], p_step: usize) -> Result<Vec<Vec<u32>>> {
        let (counts, tokens) = (self.counts.to_vec_i32()?, self.tokens.to_vec_i32()?);
        Ok(chains
            .iter()
            .zip(counts)
            .map(|(ch, n)| (0..n as usize).map(|i| tokens[ch.p_row + i * p_step] as u32).collect())
            .collect())
    }
}

/// Speculative sampling's verification of each chain, on the policy's logits `p` and the
/// draft's `q` (f32 `[rows × vocab]`, one device) at `temperature`, `top_k`, `top_p`, the
/// drafts read from `drafts` (i32, one per policy row: the rows' input tokens) and chain rows
/// `steps` = (p_step, q_step) apart: the drafts kept, then one token of the policy's own,
/// distributed as the sampler's draws ([`cpu::verify_logits`] is the definition; every device
/// gives its tokens). Nothing is read back.
pub fn speculative_verify(
    p: &Tensor,
    q: &Tensor,
    drafts: &Tensor,
    chains: &[DraftChain],
    steps: (usize, usize),
    how: (f32, usize, f32),
) -> Result<Verified> {
    let stride = chains.iter().map(|c| c.len).max().unwrap_or(0);
    let mut tables = ChainTables::new(chains.len(), stride, steps, &p.device())?;
    tables.load(chains)?;
    speculative_verify_tables(p, q, drafts, &tables, how)
}

/// The chains of [`speculative_verify`] on a device, in buffers that keep their addresses
/// from one [`ChainTables::load`] to the next (a captured graph's input): per chain its
/// policy row, draft row and length (i32 `[chains × 3]`), and its (accept, draw) uniforms as
/// f64 bits (i32 `[chains × (stride + 1) × 2, 2]`, the low half first).
pub struct ChainTables {
    meta: Tensor,
    uniforms: Tensor,
    /// The longest chain the buffers hold.
    stride: usize,
    steps: (usize, usize),
    /// Policy and draft rows the loaded chains reach (one past the highest each reads).
    reach: (usize, usize),
}

impl ChainTables {
    /// Buffers for `chains` chains of up to `stride` drafts, rows `steps` apart, on `device`.
    pub fn new(
        chains: usize,
        stride: usize,
        steps: (usize, usize),
        device: &crate::Device,
    ) -> Result<Self> {
        ensure(steps.0 > 0 && steps.1 > 0, "chain_tables", || format!("steps {steps:?}"))?;
        Ok(ChainTables {
            meta: Tensor::zeros(&[chains, 3], DType::I32, device)?,
            uniforms: Tensor::zeros(&[chains * (stride + 1) * 2, 2], DType::I32, device)?,
            stride,
            steps,
            reach: (0, 0),
        })
    }

    /// Writes `chains` (exactly as many as the buffers hold, none longer than their stride,
    /// each with a uniform pair in [0, 1) per policy row) into the buffers.
    pub fn load(&mut self, chains: &[DraftChain]) -> Result<()> {
        const OP: &str = "chain_tables";
        let (n, stride) = (self.meta.shape[0], self.stride);
        ensure(chains.len() == n, OP, || format!("{} chains into tables of {n}", chains.len()))?;
        let (p_step, q_step) = self.steps;
        let mut meta = Vec::with_capacity(3 * n);
        let mut bits = vec![0i32; 4 * n * (stride + 1)];
        let mut reach = (0, 0);
        for (c, ch) in chains.iter().enumerate() {
            let k = ch.len;
            ensure(k <= stride && ch.uniforms.len() == k + 1, OP, || {
                format!(
                    "chain {c}: {k} drafts with {} uniform pairs, tables of {stride}",
                    ch.uniforms.len()
                )
            })?;
            let flat: Vec<f64> = ch.uniforms.iter().flat_map(|&(a, d)| [a, d]).collect();
            cpu::sample::check_sampling(OP, 1.0, 1.0, &flat)?;
            for (i, u) in flat.iter().enumerate() {
                let (b, at) = (u.to_bits(), 2 * (2 * c * (stride + 1) + i));
                bits[at..at + 2].copy_from_slice(&[b as u32 as i32, (b >> 32) as u32 as i32]);
            }
            meta.extend([ch.p_row, ch.q_row, k].map(|x| x as i32));
            reach.0 = reach.0.max(ch.p_row + k * p_step + 1);
            if k > 0 {
                reach.1 = reach.1.max(ch.q_row + (k - 1) * q_step + 1);
            }
        }
        let cpu = crate::Device::Cpu;
        self.meta.copy_from(&Tensor::from_i32(&[n, 3], meta, &cpu)?)?;
        self.uniforms.copy_from(&Tensor::from_i32(&[bits.len() / 2, 2], bits, &cpu)?)?;
        self.reach = reach;
        Ok(())
    }

    /// The chains as loaded, read back.
    fn read(&self) -> Result<Vec<DraftChain>> {
        let (meta, bits) = (self.meta.to_vec_i32()?, self.uniforms.to_vec_i32()?);
        let u = |at: usize| {
            f64::from_bits(
                u64::from(bits[2 * at] as u32) | (u64::from(bits[2 * at + 1] as u32) << 32),
            )
        };
        Ok(meta
            .chunks(3)
            .enumerate()
            .map(|(c, m)| {
                let len = m[2] as usize;
                let base = 2 * c * (self.stride + 1);
                let uniforms = (0..=len).map(|i| (u(base + 2 * i), u(base + 2 * i + 1))).collect();
                DraftChain { p_row: m[0] as usize, q_row: m[1] as usize, len, uniforms }
            })
            .collect())
    }
}

/// [`speculative_verify`] of the chains in `tables` (their steps, their uniforms), reading
/// nothing back on a GPU: a captured graph's verification.
pub fn speculative_verify_tables(
    p: &Tensor,
    q: &Tensor,
    drafts: &Tensor,
    tables: &ChainTables,
    (temperature, top_k, top_p): (f32, usize, f32),
) -> Result<Verified> {
    const OP: &str = "speculative_verify";
    dtype_is(OP, "p", p, DType::F32)?;
    dtype_is(OP, "q", q, DType::F32)?;
    dtype_is(OP, "drafts", drafts, DType::I32)?;
    super::same_device(OP, &[p, q, drafts, &tables.meta, &tables.uniforms])?;
    let vocab = p.shape.get(1).copied().unwrap_or(0);
    let (p_step, q_step) = tables.steps;
    ensure(
        p.shape.len() == 2
            && q.shape.len() == 2
            && q.shape[1] == vocab
            && vocab > 0
            && vocab <= i32::MAX as usize
            && drafts.len() == p.shape[0]
            && tables.reach.0 <= p.shape[0]
            && tables.reach.1 <= q.shape[0],
        OP,
        || {
            format!(
                "policy logits {:?} beside draft logits {:?}, {} drafts, chains reaching policy \
                 row {} and draft row {}",
                p.shape,
                q.shape,
                drafts.len(),
                tables.reach.0,
                tables.reach.1
            )
        },
    )?;
    cpu::sample::check_sampling(OP, temperature, top_p, &[])?;
    match (&p.storage, &q.storage, &drafts.storage) {
        (Storage::F32(pv), Storage::F32(qv), Storage::I32(dv)) => {
            let mut tokens = vec![0i32; p.shape[0]];
            let mut counts = Vec::with_capacity(tables.meta.shape[0]);
            for ch in tables.read()? {
                let ids: Vec<u32> = (1..=ch.len)
                    .map(|i| dv[ch.p_row + i * p_step])
                    .map_while(|x| u32::try_from(x).ok().filter(|&x| (x as usize) < vocab))
                    .collect();
                let k = ids.len();
                let p_rows: Vec<usize> = (0..=k).map(|i| ch.p_row + i * p_step).collect();
                let q_rows: Vec<usize> = (0..k).map(|i| ch.q_row + i * q_step).collect();
                let u: Vec<cpu::StepUniforms> = ch.uniforms[..=k]
                    .iter()
                    .map(|&(accept, draw)| cpu::StepUniforms { accept, draw })
                    .collect();
                let kept = cpu::verify_logits(
                    (pv, qv),
                    vocab,
                    (&p_rows, &q_rows),
                    &ids,
                    &u,
                    temperature,
                    top_k,
                    top_p,
                )?;
                for (i, &t) in kept.iter().enumerate() {
                    tokens[p_rows[i]] = t as i32;
                }
                counts.push(kept.len() as i32);
            }
            let cpu = crate::Device::Cpu;
            Ok(Verified {
                counts: Tensor::from_i32(&[counts.len()], counts, &cpu)?,
                tokens: Tensor::from_i32(&[p.shape[0]], tokens, &cpu)?,
            })
        }
        #[cfg(feature = "cuda")]
        (
            Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(ps) }),
            Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::F32(qs), .. }),
            Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::I32(ds), .. }),
        ) => {
            let (Storage::Cuda(meta), Storage::Cuda(uniforms)) =
                (&tables.meta.storage, &tables.uniforms.storage)
            else {
                unreachable!("tables on the logits' device (checked above)")
            };
            let (crate::cuda::DeviceData::I32(meta), crate::cuda::DeviceData::I32(uniforms)) =
                (&meta.data, &uniforms.data)
            else {
                unreachable!("i32 tables")
            };
            let rows = p.shape[0];
            let (counts, tokens) = crate::cuda::spec_verify(
                gpu,
                (ps, qs, ds),
                (rows, vocab),
                (temperature, top_k, top_p),
                (meta, uniforms, tables.meta.shape[0]),
                (tables.stride, p_step, q_step),
            )?;
            Ok(Verified {
                counts: Tensor {
                    shape: vec![tables.meta.shape[0]],
                    storage: Storage::Cuda(counts),
                },
                tokens: Tensor { shape: vec![rows], storage: Storage::Cuda(tokens) },
            })
        }
        _ => unreachable!("f32 logits and i32 drafts on one device (checked above)"),
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
    /// inside a chain (cut there), one without mass first (no token) and a draft of -1 (cut
    /// before it), under top-k and top-p; chains laid out as the engine lays them out (each
    /// position's rows of every chain together, so a chain's rows are `n` apart).
    #[test]
    fn speculative_verify_matches_the_cpu_definition_on_every_device() {
        let mut rng = Rng::new(91);
        let (n, slots) = (24, 4);
        for device in devices() {
            for vocab in [1000, 151_936] {
                let mut p: Vec<f32> = rng.vec(vocab * n * (slots + 1), 3.0);
                let mut q: Vec<f32> = Vec::with_capacity(vocab * n * slots);
                let noise = |c: usize| [0.0f32, 0.3, 3.0][c % 3];
                for r in 0..n * slots {
                    let (c, base) = (r % n, &p[r * vocab..(r + 1) * vocab]);
                    let row: Vec<f32> = base
                        .iter()
                        .enumerate()
                        .map(|(i, x)| {
                            x + noise(c) * rng.normal() + if i % 7 == 0 { noise(c) } else { 0.0 }
                        })
                        .collect();
                    q.extend(row);
                }
                p[(8 + 2 * n) * vocab + 17] = f32::NAN;
                p[9 * vocab..10 * vocab].fill(f32::NEG_INFINITY);
                // Every row's input token: junk, then each chain's drafts.
                let mut drafts: Vec<i32> =
                    (0..n * (slots + 1)).map(|_| rng.below(vocab) as i32).collect();
                let mut chains = Vec::new();
                for c in 0..n {
                    let k = c % 5;
                    for i in 0..k {
                        let row = &q[(c + i * n) * vocab..(c + i * n + 1) * vocab];
                        let u = rng.next_u64() as f64 / 2f64.powi(64);
                        let x = match c % 4 {
                            3 => rng.below(vocab) as u32,
                            _ => cpu::sample_row(row, 0.8, 0, 1.0, u).unwrap_or(0),
                        };
                        drafts[c + (i + 1) * n] = x as i32;
                    }
                    let uniforms = (0..=k)
                        .map(|_| {
                            (f64::from(rng.uniform(0.0, 1.0)), f64::from(rng.uniform(0.0, 1.0)))
                        })
                        .collect();
                    chains.push(DraftChain { p_row: c, q_row: c, len: k, uniforms });
                }
                drafts[14 + 2 * n] = -1;
                let pt = tensor(&[n * (slots + 1), vocab], &p, DType::F32, &device);
                let qt = tensor(&[n * slots, vocab], &q, DType::F32, &device);
                let dt = Tensor::from_i32(&[n * (slots + 1)], drafts.clone(), &device).unwrap();
                let (mut kept, mut replaced) = (0, 0);
                for how in [(0.8f32, 0, 1.0f32), (1.0, 50, 1.0), (0.7, 0, 0.9)] {
                    let out = speculative_verify(&pt, &qt, &dt, &chains, (n, n), how).unwrap();
                    let got = out.to_host(&chains, n).unwrap();
                    let tokens = out.tokens.to_vec_i32().unwrap();
                    let mut rows_given = vec![false; n * (slots + 1)];
                    for (c, ch) in chains.iter().enumerate() {
                        let ids: Vec<u32> = (1..=ch.len)
                            .map(|i| drafts[c + i * n])
                            .take_while(|&x| x >= 0)
                            .map(|x| x as u32)
                            .collect();
                        let k = ids.len();
                        let p_rows: Vec<usize> = (0..=k).map(|i| c + i * n).collect();
                        let q_rows: Vec<usize> = (0..k).map(|i| c + i * n).collect();
                        let u: Vec<cpu::StepUniforms> = ch.uniforms[..=k]
                            .iter()
                            .map(|&(accept, draw)| cpu::StepUniforms { accept, draw })
                            .collect();
                        let (t, top_k, top_p) = how;
                        let rows = (p_rows.as_slice(), q_rows.as_slice());
                        let want =
                            cpu::verify_logits((&p, &q), vocab, rows, &ids, &u, t, top_k, top_p)
                                .unwrap();
                        let what = format!("{device} vocab {vocab} {how:?}");
                        assert_eq!(got[c], want, "{what}: chain {c}");
                        want.iter().enumerate().for_each(|(i, _)| rows_given[c + i * n] = true);
                        let same = want.iter().zip(&ids).take_while(|(a, b)| a == b).count();
                        kept += same;
                        replaced += usize::from(same < ids.len() && want.len() > same);
                    }
                    assert!(got[9].is_empty() && got[8].len() <= 2 && got[14].len() <= 2);
                    for (r, &t) in tokens.iter().enumerate() {
                        assert!(rows_given[r] || t == 0, "{device}: row {r} given {t}");
                    }
                }
                assert!(kept > 20 && replaced > 10, "{device}: {kept} kept, {replaced} replaced");
                // Tables loaded again in place (a captured graph's buffers) verify the chains
                // loaded last.
                let how = (0.7, 0, 0.9);
                let mut tables = ChainTables::new(n, slots, (n, n), &device).unwrap();
                let mut shifted = chains.clone();
                shifted.rotate_left(1);
                shifted.iter_mut().enumerate().for_each(|(c, ch)| (ch.p_row, ch.q_row) = (c, c));
                tables.load(&shifted).unwrap();
                let first = speculative_verify_tables(&pt, &qt, &dt, &tables, how).unwrap();
                tables.load(&chains).unwrap();
                let again = speculative_verify_tables(&pt, &qt, &dt, &tables, how).unwrap();
                let want = speculative_verify(&pt, &qt, &dt, &chains, (n, n), how).unwrap();
                assert_eq!(again.to_host(&chains, n).unwrap(), want.to_host(&chains, n).unwrap());
                let shifted_want = speculative_verify(&pt, &qt, &dt, &shifted, (n, n), how);
                let shifted_want = shifted_want.unwrap().to_host(&shifted, n).unwrap();
                assert_eq!(first.to_host(&shifted, n).unwrap(), shifted_want, "{device}");
            }
        }
    }

    #[test]
    fn chain_tables_refuse_what_they_cannot_hold() {
        let dev = Device::Cpu;
        let chain = |len: usize, u: f64| DraftChain {
            p_row: 0,
            q_row: 0,
            len,
            uniforms: vec![(u, 0.5); len + 1],
        };
        let mut tables = ChainTables::new(2, 2, (2, 2), &dev).unwrap();
        let err = |t: &mut ChainTables, c: &[DraftChain]| t.load(c).unwrap_err().to_string();
        assert!(err(&mut tables, &[chain(1, 0.5)]).contains("1 chains into tables of 2"));
        assert!(err(&mut tables, &[chain(1, 0.5), chain(3, 0.5)]).contains("tables of 2"));
        assert!(err(&mut tables, &[chain(1, 0.5), chain(1, 1.0)]).contains("outside [0, 1)"));
        tables.load(&[chain(1, 0.5), chain(2, 0.5)]).unwrap();
        // Chains reaching policy row 4 and draft row 2 need that many rows.
        let p = tensor(&[4, 3], &[0.0; 12], DType::F32, &dev);
        let q = tensor(&[2, 3], &[0.0; 6], DType::F32, &dev);
        let ids = Tensor::from_i32(&[4], vec![0; 4], &dev).unwrap();
        let how = (1.0, 0, 1.0);
        let e = speculative_verify_tables(&p, &q, &ids, &tables, how).unwrap_err().to_string();
        assert!(e.contains("reaching policy row 5 and draft row 3"), "{e}");
        assert!(ChainTables::new(2, 2, (0, 2), &dev).is_err());
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
