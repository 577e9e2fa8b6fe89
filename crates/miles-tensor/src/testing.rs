//! Helpers for tests and benchmarks: gradient checks against central differences.

pub use crate::rng::Rng;

/// Compares an analytic gradient with central differences of `loss` at up to `samples`
/// coordinates of `x` (all of them when `x` is small). Panics with the worst coordinate.
pub fn check_gradient(
    name: &str,
    x: &mut [f32],
    analytic: &[f32],
    samples: usize,
    mut loss: impl FnMut(&[f32]) -> f64,
) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let step = 1e-2f32;
    let indices: Vec<usize> = if x.len() <= samples {
        (0..x.len()).collect()
    } else {
        let mut rng = Rng::new(x.len() as u64);
        (0..samples).map(|_| rng.below(x.len())).collect()
    };
    for i in indices {
        let orig = x[i];
        x[i] = orig + step;
        let plus = loss(x);
        x[i] = orig - step;
        let minus = loss(x);
        x[i] = orig;
        let numeric = (plus - minus) / (2.0 * f64::from(step));
        let a = f64::from(analytic[i]);
        let tol = 2e-2 * a.abs().max(numeric.abs()) + 2e-3;
        assert!(
            (a - numeric).abs() <= tol,
            "{name}[{i}]: analytic {a} vs numeric {numeric} (tolerance {tol})"
        );
    }
}

/// Σ r·y in f64: the scalar loss whose gradient with respect to y is r.
pub fn dot(r: &[f32], y: &[f32]) -> f64 {
    r.iter().zip(y).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum()
}
