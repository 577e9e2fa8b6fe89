//! Speculative sampling's verification (Leviathan et al., Chen et al.), on the integer masses
//! the plain sampler draws from ([`kept_masses`](super::kept_masses)): a draft token x drawn
//! from the draft's distribution Q is kept with probability min(1, P(x)/Q(x)), P the policy's;
//! on rejection the token is drawn from max(0, P − Q) normalized. The token that comes out is
//! distributed exactly as P (to the f64 resolution of the uniforms, as the plain sampler), so a
//! speculative rollout samples the policy's distribution whatever the draft proposes. Masses
//! are at most 2^40 and a vocabulary at most 2^24 tokens, so every product below fits in u128.

use crate::{Result, ensure};

/// Whether draft token `x`, drawn from masses `q`, is kept against the policy's masses `p`,
/// at uniform `u` in [0, 1): always when P(x) ≥ Q(x), else with probability P(x)/Q(x). A
/// token the draft could not have drawn (Q(x) = 0) is never kept.
pub fn accept_draft(p: &[u64], q: &[u64], x: usize, u: f64) -> bool {
    let (wp, wq) = (total(p), total(q));
    // P(x)/Q(x) = p[x]·W_q / (q[x]·W_p).
    let (num, den) = (u128::from(p[x]) * wq, u128::from(q[x]) * wp);
    if den == 0 {
        return false;
    }
    num >= den || u < num as f64 / den as f64
}

/// The token drawn at `u` in [0, 1) from max(0, P − Q) normalized: the policy's mass the draft
/// under-proposed. None when there is none (P = Q, where no draft is ever rejected).
pub fn residual_draw(p: &[u64], q: &[u64], u: f64) -> Option<u32> {
    let (wp, wq) = (total(p), total(q));
    // P(i) − Q(i) in units of 1/(W_p·W_q).
    let residual = |i: usize| (u128::from(p[i]) * wq).saturating_sub(u128::from(q[i]) * wp);
    let sum: u128 = (0..p.len()).map(residual).sum();
    if sum == 0 {
        return None;
    }
    let target = ((u * sum as f64).floor() as u128).min(sum - 1);
    let mut cum = 0;
    (0..p.len())
        .find(|&i| {
            cum += residual(i);
            cum > target
        })
        .map(|i| i as u32)
}

/// What one verification of a chain of drafts gives: the drafts kept (a prefix), then one
/// token of the policy's own (the residual draw at the first rejection, or, every draft kept,
/// a draw from the distribution after the last).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub tokens: Vec<u32>,
}

/// The uniforms one verification step uses at chain position `i`: to test draft i, and to
/// draw the policy's token there.
#[derive(Debug, Clone, Copy)]
pub struct StepUniforms {
    pub accept: f64,
    pub draw: f64,
}

/// Verifies `drafts` (k tokens, draft i drawn from `q[i]`) against the policy's masses at the
/// k + 1 positions (`p[i]` is the distribution of the token at chain position i, given the
/// drafts before it). `u[i]` are position i's uniforms (k + 1 of them). An error when the
/// counts disagree or a policy row has no mass.
pub fn verify_chain(
    p: &[Vec<u64>],
    q: &[Vec<u64>],
    drafts: &[u32],
    u: &[StepUniforms],
) -> Result<Verdict> {
    const OP: &str = "verify_chain";
    let k = drafts.len();
    ensure(p.len() == k + 1 && q.len() == k && u.len() == k + 1, OP, || {
        format!(
            "{k} drafts want {} policy rows, {k} draft rows and {} uniforms; got {}, {}, {}",
            k + 1,
            k + 1,
            p.len(),
            q.len(),
            u.len()
        )
    })?;
    let no_mass = || crate::Error::Shape { op: OP, message: "a policy row has no mass".into() };
    let mut tokens = Vec::with_capacity(k + 1);
    for i in 0..k {
        let x = drafts[i] as usize;
        ensure(x < p[i].len() && p[i].len() == q[i].len(), OP, || {
            format!("draft {x} against rows of {} and {} tokens", p[i].len(), q[i].len())
        })?;
        if accept_draft(&p[i], &q[i], x, u[i].accept) {
            tokens.push(drafts[i]);
            continue;
        }
        // (No residual mass only when the draft's row is the policy's and the draft was not
        // drawn from it: then the policy's own draw.)
        let own = residual_draw(&p[i], &q[i], u[i].draw).or_else(|| super::draw(&p[i], u[i].draw));
        tokens.push(own.ok_or_else(no_mass)?);
        return Ok(Verdict { accepted: i, tokens });
    }
    tokens.push(super::draw(&p[k], u[k].draw).ok_or_else(no_mass)?);
    Ok(Verdict { accepted: k, tokens })
}

/// [`verify_chain`] on raw logits, as the engine verifies: the policy's rows `p_rows` (k + 1
/// of them, position i's distribution at row `p_rows[i]`) and the draft's `q_rows` (k) of
/// `p` and `q` (`[· × vocab]`) become the sampler's masses at `temperature`, `top_k`, `top_p`
/// ([`kept_masses`](super::kept_masses)); the chain is cut before the first policy row without
/// mass (and before a draft row without mass): its tokens are those of the rows before, none
/// when the first has none.
#[allow(clippy::too_many_arguments)]
pub fn verify_logits(
    (p, q): (&[f32], &[f32]),
    vocab: usize,
    (p_rows, q_rows): (&[usize], &[usize]),
    drafts: &[u32],
    u: &[StepUniforms],
    temperature: f32,
    top_k: usize,
    top_p: f32,
) -> Result<Vec<u32>> {
    ensure(
        p_rows.len() == drafts.len() + 1 && q_rows.len() == drafts.len(),
        "verify_logits",
        || {
            format!(
                "{} drafts with {} policy rows and {} draft rows",
                drafts.len(),
                p_rows.len(),
                q_rows.len()
            )
        },
    )?;
    let masses = |rows: &[f32], r: usize| {
        super::kept_masses(&rows[r * vocab..(r + 1) * vocab], temperature, top_k, top_p)
    };
    let mut pm: Vec<Vec<u64>> = p_rows.iter().map_while(|&r| masses(p, r)).collect();
    if pm.is_empty() {
        return Ok(Vec::new());
    }
    let k = pm.len() - 1;
    let qm: Vec<Vec<u64>> = q_rows[..k].iter().map_while(|&r| masses(q, r)).collect();
    pm.truncate(qm.len() + 1);
    let k = qm.len();
    Ok(verify_chain(&pm, &qm, &drafts[..k], &u[..=k])?.tokens)
}

fn total(w: &[u64]) -> u128 {
    w.iter().map(|&m| u128::from(m)).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::kept_masses;
    use crate::rng::Rng;

    fn uniform(rng: &mut Rng) -> f64 {
        (rng.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn probabilities(w: &[u64]) -> Vec<f64> {
        let t: u64 = w.iter().sum();
        w.iter().map(|&m| m as f64 / t as f64).collect()
    }

    /// Pearson's statistic of `counts` against `expected` probabilities; cells expected
    /// below 5 are pooled into one.
    fn chi_square(counts: &[u64], expected: &[f64]) -> (f64, usize) {
        let n: u64 = counts.iter().sum();
        let (mut stat, mut cells, mut pooled_o, mut pooled_e) = (0.0, 0usize, 0.0, 0.0);
        for (&o, &p) in counts.iter().zip(expected) {
            let e = p * n as f64;
            if e < 5.0 {
                assert!(p > 0.0 || o == 0, "a token of probability 0 came out");
                (pooled_o, pooled_e) = (pooled_o + o as f64, pooled_e + e);
            } else {
                stat += (o as f64 - e).powi(2) / e;
                cells += 1;
            }
        }
        if pooled_e >= 5.0 {
            stat += (pooled_o - pooled_e).powi(2) / pooled_e;
            cells += 1;
        }
        (stat, cells.saturating_sub(1))
    }

    /// The chi-square bound at p = 1e-4 for `df` degrees of freedom (Wilson–Hilferty).
    fn bound(df: usize) -> f64 {
        let (k, z) = (df as f64, 3.719);
        k * (1.0 - 2.0 / (9.0 * k) + z * (2.0 / (9.0 * k)).sqrt()).powi(3)
    }

    fn logits(rng: &mut Rng, vocab: usize, spread: f32) -> Vec<f32> {
        rng.vec(vocab, spread)
    }

    #[test]
    fn one_verified_token_is_distributed_as_the_policy_samples() {
        let mut rng = Rng::new(5);
        // Settings: plain, top-k, top-p, a draft that misses part of the policy's support.
        for (t, top_k, top_p) in [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 3, 0.9)] {
            let vocab = 12;
            let p = kept_masses(&logits(&mut rng, vocab, 1.5), t, top_k, top_p).unwrap();
            let q = kept_masses(&logits(&mut rng, vocab, 1.5), t, top_k, top_p).unwrap();
            let mut counts = vec![0u64; vocab];
            let mut kept = 0;
            let n = 200_000;
            for _ in 0..n {
                let x = crate::cpu::draw(&q, uniform(&mut rng)).unwrap();
                let u = [
                    StepUniforms { accept: uniform(&mut rng), draw: uniform(&mut rng) },
                    StepUniforms { accept: 0.0, draw: uniform(&mut rng) },
                ];
                let v = verify_chain(&[p.clone(), p.clone()], std::slice::from_ref(&q), &[x], &u)
                    .unwrap();
                kept += v.accepted;
                counts[v.tokens[0] as usize] += 1;
            }
            let (stat, df) = chi_square(&counts, &probabilities(&p));
            assert!(stat < bound(df), "t {t} k {top_k} p {top_p}: chi² {stat:.1} on {df} df");
            // The acceptance rate is Σ min(P, Q).
            let (pp, qq) = (probabilities(&p), probabilities(&q));
            let want: f64 = pp.iter().zip(&qq).map(|(a, b)| a.min(*b)).sum();
            let got = kept as f64 / n as f64;
            assert!((got - want).abs() < 5.0 * (want * (1.0 - want) / n as f64).sqrt() + 1e-9);
        }
    }

    /// Two chain positions, the second's distribution depending on the first token: the pairs
    /// that come out are distributed as two plain draws one after the other.
    #[test]
    fn a_chain_gives_the_policys_joint_distribution() {
        let mut rng = Rng::new(9);
        let vocab = 5;
        let (t, top_k, top_p) = (0.9, 0, 0.95);
        let masses =
            |rng: &mut Rng| kept_masses(&logits(rng, vocab, 2.0), t, top_k, top_p).unwrap();
        let p0 = masses(&mut rng);
        let q0 = masses(&mut rng);
        // Policy and draft at position 1 given token a at position 0.
        let p1: Vec<Vec<u64>> = (0..vocab).map(|_| masses(&mut rng)).collect();
        let q1: Vec<Vec<u64>> = (0..vocab).map(|_| masses(&mut rng)).collect();
        let p2: Vec<Vec<u64>> = (0..vocab).map(|_| masses(&mut rng)).collect();
        let mut counts = vec![0u64; vocab * vocab];
        let n = 300_000;
        for _ in 0..n {
            let a = crate::cpu::draw(&q0, uniform(&mut rng)).unwrap();
            let b = crate::cpu::draw(&q1[a as usize], uniform(&mut rng)).unwrap();
            let u: Vec<StepUniforms> = (0..3)
                .map(|_| StepUniforms { accept: uniform(&mut rng), draw: uniform(&mut rng) })
                .collect();
            let p = [p0.clone(), p1[a as usize].clone(), p2[b as usize].clone()];
            let v = verify_chain(&p, &[q0.clone(), q1[a as usize].clone()], &[a, b], &u).unwrap();
            // The second token when the first draft was rejected: the plain draw after it.
            let second = if v.tokens.len() >= 2 {
                v.tokens[1]
            } else {
                crate::cpu::draw(&p1[v.tokens[0] as usize], uniform(&mut rng)).unwrap()
            };
            counts[v.tokens[0] as usize * vocab + second as usize] += 1;
        }
        let (pp0, mut want) = (probabilities(&p0), Vec::new());
        for a in 0..vocab {
            for b in probabilities(&p1[a]) {
                want.push(pp0[a] * b);
            }
        }
        let (stat, df) = chi_square(&counts, &want);
        assert!(stat < bound(df), "chi² {stat:.1} on {df} df");
    }

    #[test]
    fn greedy_verification_keeps_exactly_the_policys_best_tokens() {
        let mut rng = Rng::new(3);
        for _ in 0..500 {
            let vocab = 7;
            let rows: Vec<Vec<f32>> = (0..4).map(|_| logits(&mut rng, vocab, 2.0)).collect();
            let p: Vec<Vec<u64>> =
                rows.iter().map(|r| kept_masses(r, 1.0, 1, 1.0).unwrap()).collect();
            let best: Vec<u32> =
                p.iter().map(|w| w.iter().position(|&m| m > 0).unwrap() as u32).collect();
            // A greedy draft that is right, then wrong.
            let drafts = [best[0], (best[1] + 1) % vocab as u32, best[2]];
            let q: Vec<Vec<u64>> = drafts
                .iter()
                .map(|&d| (0..vocab).map(|i| u64::from(i == d as usize) << 40).collect())
                .collect();
            let u: Vec<StepUniforms> = (0..4)
                .map(|_| StepUniforms { accept: uniform(&mut rng), draw: uniform(&mut rng) })
                .collect();
            let v = verify_chain(&p, &q, &drafts, &u).unwrap();
            assert_eq!(v, Verdict { accepted: 1, tokens: vec![best[0], best[1]] });
            let e = verify_chain(&p[..2], &q, &drafts, &u).unwrap_err().to_string();
            assert!(e.contains("3 drafts want 4 policy rows"), "{e}");
        }
    }

    #[test]
    fn a_draft_the_draft_could_not_draw_is_rejected_and_equal_distributions_accept_all() {
        let p = vec![3u64 << 38, 1 << 38, 0];
        assert!(!accept_draft(&p, &[1, 0, 0], 1, 0.0));
        assert!(accept_draft(&p, &p, 0, 0.999_999) && accept_draft(&p, &p, 1, 0.999_999));
        assert_eq!(residual_draw(&p, &p, 0.5), None);
        // P = (3/4, 1/4, 0), Q = (1/4, 3/4, 0): the residual is all on token 0.
        let q = vec![1u64 << 38, 3 << 38, 0];
        assert_eq!(residual_draw(&p, &q, 0.999), Some(0));
        // Token 1 kept with probability (1/4)/(3/4).
        assert!(accept_draft(&p, &q, 1, 0.333) && !accept_draft(&p, &q, 1, 0.334));
    }
}
