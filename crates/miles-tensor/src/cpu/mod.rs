//! CPU reference implementations. Row-major `f32` slices; shapes in the argument names.

pub(crate) mod attention;
mod elementwise;
mod fp8;
mod int4;
mod linear;
mod logprob;
mod matmul;
mod optim;
pub(crate) mod sample;
mod speculative;

pub use attention::{
    AttentionShape, KEY_BLOCK, PagedLayout, PagedRows, Scores, attend_row, attention_backward,
    attention_forward, paged_attention_forward,
};
pub use elementwise::{
    COLUMN_SUM_ROWS, Gate, column_sums_acc, embedding_backward, embedding_forward, glu_backward,
    glu_forward, rmsnorm_backward, rmsnorm_forward, rope_backward, rope_forward, rope_inv_freq,
    rope_tables, swiglu_backward, swiglu_forward,
};
pub use fp8::{
    E4M3_MAX, FP8_BLOCK, dequantize_blocks, e4m3_to_f32, f32_to_e4m3, fp8_linear, quantize_blocks,
    quantize_rows,
};
pub use int4::{
    INT4_MAX, dequantize_int4, fake_quantize_int4, int4_scales, pack_int4, quantize_int4,
    unpack_int4,
};
pub use linear::{PackedLinear, linear_forward, linear_reference};
pub use logprob::{
    LOGPROB_CHUNK_ELEMENTS, chunk_rows, logprob_backward, logprob_forward, logprob_row,
    logprob_row_backward, logprob_rows_backward, logprob_rows_forward, tempered_log_softmax,
};
pub use matmul::{Transpose, matmul};
pub use optim::{
    AdamW, clip_scale, global_norm, round_bf16_stochastic, rounding_bits, sum_squares,
};
pub use sample::{MASS_BITS, draw, kept_masses, sample_mass, sample_row, sample_rows};
pub use speculative::{
    StepUniforms, Verdict, accept_draft, residual_draw, verify_chain, verify_logits,
};

/// Lanes of the partial sums in [`dot`].
const DOT_LANES: usize = 16;

/// Σ a·b with 16 independent partial sums (so the compiler vectorizes it) combined in a fixed
/// tree: the same inputs give the same bits whatever the batch or thread count.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; DOT_LANES];
    let (ca, cb) = (a.chunks_exact(DOT_LANES), b.chunks_exact(DOT_LANES));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..DOT_LANES {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[i] += x * y;
    }
    let mut width = DOT_LANES / 2;
    while width > 0 {
        for i in 0..width {
            acc[i] += acc[i + width];
        }
        width /= 2;
    }
    acc[0]
}

#[cfg(test)]
mod tests {
    use crate::rng::Rng;

    #[test]
    fn dot_matches_f64_at_every_length() {
        let mut rng = Rng::new(12);
        for n in [0, 1, 15, 16, 17, 64, 100, 1000] {
            let (a, b) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
            let want: f64 = a.iter().zip(&b).map(|(x, y)| f64::from(*x) * f64::from(*y)).sum();
            assert!((f64::from(super::dot(&a, &b)) - want).abs() < 1e-4, "n {n}");
        }
    }
}
