//! The fused language-model head: for each response position, the log-probability of the
//! target token and the entropy of the tempered distribution, from the final hidden state.
//! Chunked over rows so the `[rows × vocab]` logits never exist all at once; the backward
//! recomputes each chunk's logits instead of keeping them.

use rayon::prelude::*;

use super::linear::{PackedLinear, linear_forward};
use super::matmul::{Transpose, matmul};
use crate::{Error, Result, ensure};

/// Logit elements (rows × vocab) per chunk: 16 MiB of f32.
pub const LOGPROB_CHUNK_ELEMENTS: usize = 1 << 22;

/// Rows per chunk of the head at this vocabulary size (every device uses the CPU's chunks on
/// the CPU: a weight gradient's bits depend on how its rows are cut).
pub fn chunk_rows(vocab: usize) -> usize {
    (LOGPROB_CHUNK_ELEMENTS / vocab.max(1)).max(1)
}

fn check(
    op: &'static str,
    hidden: &[f32],
    weight: &[f32],
    targets: &[u32],
    dim: usize,
) -> Result<usize> {
    let vocab = weight.len() / dim.max(1);
    ensure(
        dim > 0 && weight.len() == vocab * dim && hidden.len() == targets.len() * dim,
        op,
        || {
            format!(
                "hidden {} weight {} for {} targets × dim {dim}",
                hidden.len(),
                weight.len(),
                targets.len()
            )
        },
    )?;
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Shape {
            op,
            message: format!("target {bad} is outside the vocabulary of {vocab}"),
        });
    }
    Ok(vocab)
}

/// Log-sum-exp of `z`, summed in index order.
fn log_sum_exp(z: &[f32]) -> f32 {
    let m = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let s: f32 = z.iter().map(|x| (x - m).exp()).sum();
    m + s.ln()
}

/// Divides a row of logits by the temperature in place and returns its log-sum-exp, so that
/// `z[i] - lse` is log softmax(logits / T)[i]. The scorer and the sampler both call this: the
/// same logits give the same logprob bits in rollout and training.
pub fn tempered_log_softmax(z: &mut [f32], temperature: f32) -> f32 {
    z.iter_mut().for_each(|x| *x /= temperature);
    log_sum_exp(z)
}

/// `logp[r] = log softmax(W·h_r / T)[target_r]` and `entropy[r]` of that distribution, for
/// `hidden` `[rows × dim]` and the LM head `[vocab × dim]` packed for [`linear_forward`] (so a
/// row's logits do not depend on its batch-mates).
pub fn logprob_forward(
    logp: &mut [f32],
    entropy: &mut [f32],
    hidden: &[f32],
    head: &PackedLinear,
    targets: &[u32],
    temperature: f32,
) -> Result<()> {
    let rows = targets.len();
    let (dim, vocab) = (head.d_in(), head.d_out());
    ensure(hidden.len() == rows * dim, "logprob", || {
        format!("hidden {} for {rows} targets × dim {dim}", hidden.len())
    })?;
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Shape {
            op: "logprob",
            message: format!("target {bad} is outside the vocabulary of {vocab}"),
        });
    }
    ensure(logp.len() == rows && entropy.len() == rows && temperature > 0.0, "logprob", || {
        format!(
            "logp {} entropy {} for {rows} rows, temperature {temperature}",
            logp.len(),
            entropy.len()
        )
    })?;
    let per_chunk = chunk_rows(vocab);
    let mut logits = vec![0f32; per_chunk.min(rows) * vocab];
    for start in (0..rows).step_by(per_chunk) {
        let n = per_chunk.min(rows - start);
        let z = &mut logits[..n * vocab];
        linear_forward(z, &hidden[start * dim..(start + n) * dim], head)?;
        z.par_chunks_mut(vocab)
            .zip(logp[start..start + n].par_iter_mut())
            .zip(entropy[start..start + n].par_iter_mut())
            .zip(targets[start..start + n].par_iter())
            .for_each(|(((z, lp), ent), &target)| {
                (*lp, *ent) = logprob_row(z, target as usize, temperature);
            });
    }
    Ok(())
}

/// One row's `(logp of target, entropy)` at `temperature`, from its raw logits `z` (divided by
/// the temperature in place). The fused head and [`logprob_rows_forward`] share it.
pub fn logprob_row(z: &mut [f32], target: usize, temperature: f32) -> (f32, f32) {
    let lse = tempered_log_softmax(z, temperature);
    // H = lse − Σ p·z.
    let expected: f32 = z.iter().map(|x| (x - lse).exp() * x).sum();
    (z[target] - lse, lse - expected)
}

/// The gradient of `g_lp·logp + g_ent·entropy` of one row with respect to its raw logits,
/// written over `z` (the raw logits on entry).
pub fn logprob_row_backward(z: &mut [f32], target: usize, temperature: f32, g_lp: f32, g_ent: f32) {
    z.iter_mut().for_each(|x| *x /= temperature);
    let lse = log_sum_exp(z);
    let ent = lse - z.iter().map(|x| (x - lse).exp() * x).sum::<f32>();
    // d/dz_j: logp → δ_j − p_j; entropy → −p_j·(log p_j + H). Then ÷T for raw logits.
    for (j, x) in z.iter_mut().enumerate() {
        let log_p = *x - lse;
        let p = log_p.exp();
        let onehot = if j == target { 1.0 } else { 0.0 };
        *x = (g_lp * (onehot - p) - g_ent * p * (log_p + ent)) / temperature;
    }
}

/// [`logprob_row`] over the rows of `logits` `[rows × vocab]` (given, not computed from a
/// hidden state: the device path's GEMM makes them).
pub fn logprob_rows_forward(
    logp: &mut [f32],
    entropy: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    temperature: f32,
) -> Result<()> {
    let vocab = rows_vocab("logprob_rows", logits, targets, temperature)?;
    ensure(logp.len() == targets.len() && entropy.len() == targets.len(), "logprob_rows", || {
        format!("logp {} entropy {} for {} rows", logp.len(), entropy.len(), targets.len())
    })?;
    // Rows in parallel: each row's numbers are its own.
    logits
        .par_chunks(vocab)
        .zip(logp.par_iter_mut().zip(entropy.par_iter_mut()))
        .zip(targets.par_iter())
        .for_each_init(
            || vec![0f32; vocab],
            |z, ((row, (lp, ent)), &target)| {
                z.copy_from_slice(row);
                (*lp, *ent) = logprob_row(z, target as usize, temperature);
            },
        );
    Ok(())
}

/// [`logprob_row_backward`] over the rows of `logits`: `d_logits` `[rows × vocab]`.
pub fn logprob_rows_backward(
    d_logits: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    d_logp: &[f32],
    d_entropy: &[f32],
    temperature: f32,
) -> Result<()> {
    let vocab = rows_vocab("logprob_rows_backward", logits, targets, temperature)?;
    let rows = targets.len();
    ensure(
        d_logits.len() == logits.len() && d_logp.len() == rows && d_entropy.len() == rows,
        "logprob_rows_backward",
        || {
            format!(
                "d_logits {} d_logp {} d_entropy {}",
                d_logits.len(),
                d_logp.len(),
                d_entropy.len()
            )
        },
    )?;
    d_logits.copy_from_slice(logits);
    d_logits.par_chunks_mut(vocab).enumerate().for_each(|(r, z)| {
        logprob_row_backward(z, targets[r] as usize, temperature, d_logp[r], d_entropy[r]);
    });
    Ok(())
}

/// The vocabulary of `logits` `[targets × vocab]`, with every target inside it.
fn rows_vocab(
    op: &'static str,
    logits: &[f32],
    targets: &[u32],
    temperature: f32,
) -> Result<usize> {
    let vocab = logits.len() / targets.len().max(1);
    ensure(vocab > 0 && logits.len() == targets.len() * vocab && temperature > 0.0, op, || {
        format!("logits {} for {} targets, temperature {temperature}", logits.len(), targets.len())
    })?;
    if let Some(&bad) = targets.iter().find(|&&t| t as usize >= vocab) {
        return Err(Error::Shape {
            op,
            message: format!("target {bad} is outside the vocabulary of {vocab}"),
        });
    }
    Ok(vocab)
}

/// Gradients of [`logprob_forward`] given `d_logp` and `d_entropy`: writes `d_hidden`, adds
/// into `d_weight`.
#[allow(clippy::too_many_arguments)]
pub fn logprob_backward(
    d_hidden: &mut [f32],
    d_weight: &mut [f32],
    d_logp: &[f32],
    d_entropy: &[f32],
    hidden: &[f32],
    weight: &[f32],
    targets: &[u32],
    temperature: f32,
) -> Result<()> {
    let rows = targets.len();
    let dim = hidden.len() / rows.max(1);
    let vocab = check("logprob_backward", hidden, weight, targets, dim)?;
    ensure(
        d_hidden.len() == hidden.len()
            && d_weight.len() == weight.len()
            && d_logp.len() == rows
            && d_entropy.len() == rows,
        "logprob_backward",
        || {
            format!(
                "d_hidden {} d_weight {} d_logp {} d_entropy {}",
                d_hidden.len(),
                d_weight.len(),
                d_logp.len(),
                d_entropy.len()
            )
        },
    )?;
    let per_chunk = chunk_rows(vocab);
    let mut logits = vec![0f32; per_chunk.min(rows) * vocab];
    for start in (0..rows).step_by(per_chunk) {
        let n = per_chunk.min(rows - start);
        let h = &hidden[start * dim..(start + n) * dim];
        let z = &mut logits[..n * vocab];
        matmul(z, h, Transpose::No, weight, Transpose::Yes, n, dim, vocab, false)?;
        z.par_chunks_mut(vocab)
            .zip(d_logp[start..start + n].par_iter())
            .zip(d_entropy[start..start + n].par_iter())
            .zip(targets[start..start + n].par_iter())
            .for_each(|(((z, &g_lp), &g_ent), &target)| {
                logprob_row_backward(z, target as usize, temperature, g_lp, g_ent);
            });
        matmul(
            &mut d_hidden[start * dim..(start + n) * dim],
            z,
            Transpose::No,
            weight,
            Transpose::No,
            n,
            vocab,
            dim,
            false,
        )?;
        matmul(d_weight, z, Transpose::Yes, h, Transpose::No, vocab, n, dim, true)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Rng, check_gradient, dot};

    fn pack(weight: &[f32], dim: usize) -> PackedLinear {
        PackedLinear::new(weight, weight.len() / dim, dim).unwrap()
    }

    fn forward(hidden: &[f32], weight: &[f32], targets: &[u32], t: f32) -> (Vec<f32>, Vec<f32>) {
        let dim = hidden.len() / targets.len();
        let mut logp = vec![f32::NAN; targets.len()];
        let mut ent = vec![f32::NAN; targets.len()];
        logprob_forward(&mut logp, &mut ent, hidden, &pack(weight, dim), targets, t).unwrap();
        (logp, ent)
    }

    #[test]
    fn matches_an_explicit_softmax() {
        let (rows, dim, vocab, t) = (3, 4, 5, 0.7f32);
        let mut rng = Rng::new(8);
        let hidden = rng.vec(rows * dim, 1.0);
        let weight = rng.vec(vocab * dim, 1.0);
        let targets = [4u32, 0, 2];
        let (logp, ent) = forward(&hidden, &weight, &targets, t);
        for r in 0..rows {
            let z: Vec<f64> = (0..vocab)
                .map(|v| {
                    (0..dim)
                        .map(|i| f64::from(hidden[r * dim + i]) * f64::from(weight[v * dim + i]))
                        .sum::<f64>()
                        / f64::from(t)
                })
                .collect();
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + z.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            let want_lp = z[targets[r] as usize] - lse;
            let want_ent: f64 = -z.iter().map(|x| (x - lse).exp() * (x - lse)).sum::<f64>();
            assert!((f64::from(logp[r]) - want_lp).abs() < 1e-5);
            assert!((f64::from(ent[r]) - want_ent).abs() < 1e-5);
        }
    }

    #[test]
    fn gradients_match_finite_differences() {
        let (rows, dim, vocab, t) = (4, 6, 7, 0.8f32);
        let mut rng = Rng::new(9);
        let mut hidden = rng.vec(rows * dim, 1.0);
        let mut weight = rng.vec(vocab * dim, 1.0);
        let targets = [1u32, 6, 0, 3];
        let (a, b) = (rng.vec(rows, 1.0), rng.vec(rows, 1.0));
        let loss = |h: &[f32], w: &[f32]| {
            let (lp, ent) = forward(h, w, &targets, t);
            dot(&a, &lp) + dot(&b, &ent)
        };
        let mut dh = vec![f32::NAN; hidden.len()];
        let mut dw = vec![0.0; weight.len()];
        logprob_backward(&mut dh, &mut dw, &a, &b, &hidden, &weight, &targets, t).unwrap();
        let wc = weight.clone();
        check_gradient("logprob d_hidden", &mut hidden, &dh, 64, |h| loss(h, &wc));
        let hc = hidden.clone();
        check_gradient("logprob d_weight", &mut weight, &dw, 64, |w| loss(&hc, w));
    }

    #[test]
    fn chunking_does_not_change_the_result() {
        // A vocabulary large enough that a chunk holds fewer rows than the batch.
        let vocab = LOGPROB_CHUNK_ELEMENTS / 2 + 3;
        let (rows, dim) = (5, 2);
        let mut rng = Rng::new(10);
        let hidden = rng.vec(rows * dim, 1.0);
        let weight = rng.vec(vocab * dim, 0.1);
        let targets = [0u32, 1, (vocab - 1) as u32, 7, 9];
        let (logp, _) = forward(&hidden, &weight, &targets, 1.0);
        for r in 0..rows {
            let (one, _) =
                forward(&hidden[r * dim..(r + 1) * dim], &weight, &targets[r..r + 1], 1.0);
            assert_eq!(one[0], logp[r]);
        }
        assert!(forward_err(&hidden, &weight, vocab as u32).contains("outside the vocabulary"));
    }

    fn forward_err(hidden: &[f32], weight: &[f32], bad: u32) -> String {
        let mut lp = vec![0.0; 5];
        let mut ent = vec![0.0; 5];
        logprob_forward(&mut lp, &mut ent, hidden, &pack(weight, 2), &[0, 0, bad, 0, 0], 1.0)
            .unwrap_err()
            .to_string()
    }
}
