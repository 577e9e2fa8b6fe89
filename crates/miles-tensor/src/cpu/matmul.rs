use gemm::Parallelism;

use crate::{Result, ensure};

/// Whether an operand is stored transposed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transpose {
    No,
    Yes,
}

/// Products below this many multiply-adds run on one thread: spawning costs more.
const PARALLEL_MIN_FLOPS: usize = 1 << 18;

/// `c[m×n] = op(a)·op(b)`, or `c += op(a)·op(b)` when `accumulate`. `a` is stored `[m×k]`
/// (or `[k×m]` when transposed), `b` is `[k×n]` (or `[n×k]`); all row-major.
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    c: &mut [f32],
    a: &[f32],
    ta: Transpose,
    b: &[f32],
    tb: Transpose,
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) -> Result<()> {
    ensure(a.len() == m * k && b.len() == k * n && c.len() == m * n, "matmul", || {
        format!("a {} b {} c {} for m {m} k {k} n {n}", a.len(), b.len(), c.len())
    })?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            c.fill(0.0);
        }
        return Ok(());
    }
    // Strides (column, row) of each operand as an m×k / k×n / m×n matrix.
    let (a_cs, a_rs) = match ta {
        Transpose::No => (1, k as isize),
        Transpose::Yes => (m as isize, 1),
    };
    let (b_cs, b_rs) = match tb {
        Transpose::No => (1, n as isize),
        Transpose::Yes => (k as isize, 1),
    };
    let parallelism = if m * n * k >= PARALLEL_MIN_FLOPS {
        Parallelism::Rayon(rayon::current_num_threads())
    } else {
        Parallelism::None
    };
    // SAFETY: the length checks above bound every index the strides can reach.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs,
            a_rs,
            b.as_ptr(),
            b_cs,
            b_rs,
            1.0,
            1.0,
            false,
            false,
            false,
            parallelism,
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    fn naive(
        a: &[f32],
        ta: Transpose,
        b: &[f32],
        tb: Transpose,
        m: usize,
        k: usize,
        n: usize,
    ) -> Vec<f64> {
        let at = |i: usize, p: usize| match ta {
            Transpose::No => a[i * k + p],
            Transpose::Yes => a[p * m + i],
        };
        let bt = |p: usize, j: usize| match tb {
            Transpose::No => b[p * n + j],
            Transpose::Yes => b[j * k + p],
        };
        let mut c = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                c[i * n + j] = (0..k).map(|p| f64::from(at(i, p)) * f64::from(bt(p, j))).sum();
            }
        }
        c
    }

    #[test]
    fn matches_the_naive_product_in_every_layout() {
        let mut rng = Rng::new(1);
        for &(m, k, n) in &[(1, 1, 1), (3, 5, 7), (17, 33, 9), (64, 128, 96)] {
            for ta in [Transpose::No, Transpose::Yes] {
                for tb in [Transpose::No, Transpose::Yes] {
                    let a = rng.vec(m * k, 1.0);
                    let b = rng.vec(k * n, 1.0);
                    let init = rng.vec(m * n, 1.0);
                    let want = naive(&a, ta, &b, tb, m, k, n);
                    let mut c = init.clone();
                    matmul(&mut c, &a, ta, &b, tb, m, k, n, false).unwrap();
                    for (x, y) in c.iter().zip(&want) {
                        assert!((f64::from(*x) - y).abs() < 1e-4 * (k as f64).sqrt(), "{x} vs {y}");
                    }
                    let mut c = init.clone();
                    matmul(&mut c, &a, ta, &b, tb, m, k, n, true).unwrap();
                    for ((x, y), c0) in c.iter().zip(&want).zip(&init) {
                        let y = y + f64::from(*c0);
                        assert!((f64::from(*x) - y).abs() < 1e-4 * (k as f64).sqrt(), "{x} vs {y}");
                    }
                }
            }
        }
    }

    #[test]
    fn wrong_lengths_are_errors() {
        let mut c = vec![0.0; 4];
        let err =
            matmul(&mut c, &[1.0; 3], Transpose::No, &[1.0; 4], Transpose::No, 2, 2, 2, false);
        assert!(err.unwrap_err().to_string().contains("matmul"));
    }
}
