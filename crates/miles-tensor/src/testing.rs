//! Helpers for tests and benchmarks: seeded random data (never zeros) and gradient checks.

/// SplitMix64: a tiny seeded generator, so test and benchmark inputs are the same on every run.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in [lo, hi).
    pub fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        let unit = (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32;
        lo + (hi - lo) * unit
    }

    /// Approximately standard normal (sum of 4 uniforms, rescaled): cheap and never constant.
    pub fn normal(&mut self) -> f32 {
        let s: f32 = (0..4).map(|_| self.uniform(-1.0, 1.0)).sum();
        s * (3.0f32 / 4.0).sqrt()
    }

    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() * scale).collect()
    }

    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

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
