//! FP8 E4M3 as Hopper's tensor cores and DeepSeek-V3's checkpoints hold it (`e4m3fn`: 1 sign
//! bit, 4 exponent bits of bias 7, 3 mantissa bits; no infinities; S.1111.111 is NaN; largest
//! finite ±448, smallest subnormal 2⁻⁹), and the blockwise scaling miles trains with: one f32
//! scale per 128 × 128 block of a weight, per 1 × 128 group of an activation row.
//!
//! The conversion rounds to nearest, ties to even, and saturates at ±448 (CUDA's
//! `__NV_SATFINITE`), so a GPU kernel converting the same f32 gives the same byte. A block is
//! scaled as DeepGEMM's `per_block_cast_to_fp8` does: amax = max |x| (at least 1e-4), each
//! element converted as x · (448 / amax), and the dequantization multiplier s = amax / 448
//! stored (HF's `weight_scale_inv`): w ≈ q · s.

/// The largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The side of a weight's scaling block, and the width of an activation's scaling group.
pub const FP8_BLOCK: usize = 128;
/// The least amax a block is scaled by (an all-zero block gets scale 1e-4 / 448).
const AMAX_FLOOR: f32 = 1e-4;

/// The value of an E4M3 code.
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let exponent = i32::from((code >> 3) & 0xF);
    let mantissa = f32::from(code & 7);
    let magnitude = match exponent {
        0xF if code & 7 == 7 => return f32::NAN,
        0 => mantissa * (-9f32).exp2(),
        e => (8.0 + mantissa) * ((e - 10) as f32).exp2(),
    };
    sign * magnitude
}

/// `x` rounded to the nearest E4M3 value (ties to even), saturating at ±448; NaN stays NaN.
pub fn f32_to_e4m3(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 31) as u8) << 7;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7F;
    }
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    if a < (-6f32).exp2() {
        // Subnormal: a multiple of 2⁻⁹ (exact in f32: a power-of-two scaling); 8 · 2⁻⁹ is
        // the smallest normal, whose code is 8 as well.
        return sign | (a * 512.0).round_ties_even() as u8;
    }
    let mut exponent = ((bits >> 23) & 0xFF) as i32 - 127;
    let fraction = bits & 0x7F_FFFF;
    let (mut kept, rest, half) = (fraction >> 20, fraction & 0xF_FFFF, 1 << 19);
    if rest > half || (rest == half && kept & 1 == 1) {
        kept += 1;
    }
    if kept == 8 {
        kept = 0;
        exponent += 1;
    }
    // a < 448 rounds to at most 448 (exponent 8, mantissa 6): never the NaN pattern.
    sign | (((exponent + 7) as u8) << 3) | kept as u8
}

/// The scaling of one block: the multiplier its elements are converted with, and the scale
/// stored for dequantization.
fn block_scaling(amax: f32) -> (f32, f32) {
    let amax = amax.max(AMAX_FLOOR);
    (E4M3_MAX / amax, amax / E4M3_MAX)
}

/// A `[rows × cols]` matrix in E4M3 with one scale per `FP8_BLOCK`² block (the last row and
/// column of blocks partial where the sides are not multiples of it): returns the codes
/// (row-major, like `w`) and the scales (row-major over `[⌈rows/128⌉ × ⌈cols/128⌉]` blocks).
pub fn quantize_blocks(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(w.len(), rows * cols, "quantize_blocks: {} values for {rows} × {cols}", w.len());
    let (block_rows, block_cols) = (rows.div_ceil(FP8_BLOCK), cols.div_ceil(FP8_BLOCK));
    let mut codes = vec![0u8; w.len()];
    let mut scales = Vec::with_capacity(block_rows * block_cols);
    for br in 0..block_rows {
        let rows_of = br * FP8_BLOCK..((br + 1) * FP8_BLOCK).min(rows);
        for bc in 0..block_cols {
            let cols_of = bc * FP8_BLOCK..((bc + 1) * FP8_BLOCK).min(cols);
            let row = |r: usize| &w[r * cols + cols_of.start..r * cols + cols_of.end];
            let amax = rows_of.clone().flat_map(row).fold(0f32, |m, x| m.max(x.abs()));
            let (multiplier, scale) = block_scaling(amax);
            for r in rows_of.clone() {
                for c in cols_of.clone() {
                    codes[r * cols + c] = f32_to_e4m3(w[r * cols + c] * multiplier);
                }
            }
            scales.push(scale);
        }
    }
    (codes, scales)
}

/// The f32 values of [`quantize_blocks`]' output: q · s per block.
pub fn dequantize_blocks(codes: &[u8], scales: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let block_cols = cols.div_ceil(FP8_BLOCK);
    assert_eq!(codes.len(), rows * cols, "dequantize_blocks: {} codes", codes.len());
    assert_eq!(scales.len(), rows.div_ceil(FP8_BLOCK) * block_cols, "dequantize_blocks: scales");
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            e4m3_to_f32(codes[i]) * scales[(r / FP8_BLOCK) * block_cols + c / FP8_BLOCK]
        })
        .collect()
}

/// Activation rows `[rows × cols]` in E4M3 with one scale per 1 × `FP8_BLOCK` group of each
/// row (the dynamic per-token scaling of the FP8 forward): codes row-major, scales
/// `[rows × ⌈cols/128⌉]`.
pub fn quantize_rows(x: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<f32>) {
    assert_eq!(x.len(), rows * cols, "quantize_rows: {} values for {rows} × {cols}", x.len());
    let mut codes = Vec::with_capacity(x.len());
    let mut scales = Vec::with_capacity(rows * cols.div_ceil(FP8_BLOCK));
    for row in x.chunks(cols.max(1)).take(rows) {
        for group in row.chunks(FP8_BLOCK) {
            let (multiplier, scale) = block_scaling(group.iter().fold(0f32, |m, v| m.max(v.abs())));
            codes.extend(group.iter().map(|&v| f32_to_e4m3(v * multiplier)));
            scales.push(scale);
        }
    }
    (codes, scales)
}

/// The FP8 blockwise product y = x · wᵀ as DeepGEMM computes it, the reference of the FP8
/// kernels: `x` is `[rows × k]` activations quantized per 1 × 128 group ([`quantize_rows`]),
/// `w` a `[n × k]` weight quantized per 128 × 128 block ([`quantize_blocks`]). Each 128-wide
/// slice of k is a sum of products of code values (each product exact in f32; summed in f32,
/// k in order), then promoted into the f32 accumulator, slice after slice, as DeepGEMM does:
/// `acc = fma(partial, row scale · block scale, acc)` (the scales' product rounded first, one
/// rounding for the multiply-add). A row's bits depend on that row alone.
pub fn fp8_linear(
    (x_codes, x_scales): (&[u8], &[f32]),
    (w_codes, w_scales): (&[u8], &[f32]),
    rows: usize,
    k: usize,
    n: usize,
) -> Vec<f32> {
    use rayon::prelude::*;
    let groups = k.div_ceil(FP8_BLOCK);
    assert_eq!((x_codes.len(), x_scales.len()), (rows * k, rows * groups), "fp8_linear: x");
    assert_eq!(
        (w_codes.len(), w_scales.len()),
        (n * k, n.div_ceil(FP8_BLOCK) * groups),
        "fp8_linear: w"
    );
    let table: Vec<f32> = (0..=255u8).map(e4m3_to_f32).collect();
    // wᵀ as values, [k × n]: the inner loop runs over columns, each column's sum still
    // taken over k in order (vectorized across columns, not across k).
    let mut wt = vec![0f32; k * n];
    for (c, row) in w_codes.chunks(k.max(1)).enumerate().take(n) {
        for (j, &code) in row.iter().enumerate() {
            wt[j * n + c] = table[usize::from(code)];
        }
    }
    let mut y = vec![0f32; rows * n];
    let one_row = |(r, out): (usize, &mut [f32])| {
        let mut partial = vec![0f32; n];
        for g in 0..groups {
            partial.fill(0.0);
            for j in g * FP8_BLOCK..((g + 1) * FP8_BLOCK).min(k) {
                let a = table[usize::from(x_codes[r * k + j])];
                for (p, &b) in partial.iter_mut().zip(&wt[j * n..(j + 1) * n]) {
                    // (A product of two codes is exact in f32: no fused multiply-add needed.)
                    *p += a * b;
                }
            }
            let xs = x_scales[r * groups + g];
            for (c, (acc, &p)) in out.iter_mut().zip(&partial).enumerate() {
                *acc = p.mul_add(xs * w_scales[(c / FP8_BLOCK) * groups + g], *acc);
            }
        }
    };
    if rows * n * k >= 1 << 18 {
        y.par_chunks_mut(n.max(1)).enumerate().for_each(one_row);
    } else {
        y.chunks_mut(n.max(1)).enumerate().for_each(one_row);
    }
    y
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// tests/fixtures/fp8/e4m3.json, written by make_e4m3.py with ml_dtypes.
    fn fixture() -> serde_json::Value {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/fp8/e4m3.json");
        serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
    }

    #[test]
    fn the_codec_rounds_as_ml_dtypes_does() {
        let f = fixture();
        for (code, want) in f["decode"].as_array().unwrap().iter().enumerate() {
            let got = e4m3_to_f32(code as u8);
            match want.as_u64() {
                None => assert!(got.is_nan(), "code {code:#04x}: {got}"),
                Some(bits) => assert_eq!(got.to_bits(), bits as u32, "code {code:#04x}"),
            }
        }
        let pairs = f["encode"].as_array().unwrap();
        assert!(pairs.len() > 10_000);
        for pair in pairs {
            let (bits, code) = (pair[0].as_u64().unwrap() as u32, pair[1].as_u64().unwrap() as u8);
            let x = f32::from_bits(bits);
            assert_eq!(f32_to_e4m3(x), code, "{x:e}");
        }
    }

    #[test]
    fn the_conversion_saturates_and_keeps_nan() {
        for (x, code) in
            [(448.0, 0x7E), (463.9, 0x7E), (464.0, 0x7E), (1e30, 0x7E), (f32::INFINITY, 0x7E)]
        {
            assert_eq!(f32_to_e4m3(x), code, "{x}");
            assert_eq!(f32_to_e4m3(-x), code | 0x80, "{}", -x);
        }
        assert!(e4m3_to_f32(f32_to_e4m3(f32::NAN)).is_nan());
        assert_eq!(f32_to_e4m3(-0.0), 0x80);
        // Every code but NaN survives a round trip.
        for code in (0..=255u8).filter(|c| c & 0x7F != 0x7F) {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(code)), code);
        }
    }

    /// Blocks of 128 × 128 with partial edge blocks: each block's amax maps to ±448 exactly,
    /// and the round trip is within half an E4M3 step (relative 2⁻⁴) of every element.
    #[test]
    fn blocks_scale_by_their_own_amax_at_any_shape() {
        let mut rng = Rng::new(5);
        for (rows, cols) in [(128, 128), (300, 200), (1, 7), (129, 257)] {
            let mut w: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
            // One block far larger than the rest: its scale must not leak into the others.
            w[0] = 1e3;
            let (codes, scales) = quantize_blocks(&w, rows, cols);
            assert_eq!(scales.len(), rows.div_ceil(128) * cols.div_ceil(128));
            assert_eq!(scales[0], 1e3 / 448.0);
            assert_eq!(codes[0], 0x7E);
            let back = dequantize_blocks(&codes, &scales, rows, cols);
            let block_cols = cols.div_ceil(128);
            for (i, (&x, &y)) in w.iter().zip(&back).enumerate() {
                let s = scales[(i / cols / 128) * block_cols + (i % cols) / 128];
                // Normal range: relative error 2⁻⁴; below it, half a subnormal step.
                let bound = (x.abs() / 16.0).max(s * (-10f32).exp2()) * 1.0001;
                assert!((x - y).abs() <= bound, "{rows}×{cols} [{i}]: {x} → {y}");
            }
        }
        let (codes, scales) = quantize_blocks(&[0.0; 6], 2, 3);
        assert_eq!((codes, scales), (vec![0; 6], vec![1e-4 / 448.0]));
    }

    /// Close to the product of the dequantized operands (the codes' products are exact in
    /// f32; the sums round), and a row's bits are the same alone as in any batch.
    #[test]
    fn the_blockwise_product_is_the_dequantized_one_per_row() {
        let mut rng = Rng::new(7);
        let (rows, k, n) = (5, 300, 130);
        let x: Vec<f32> = (0..rows * k).map(|_| rng.normal()).collect();
        let w: Vec<f32> = (0..n * k).map(|_| 0.05 * rng.normal()).collect();
        let (xq, xs) = quantize_rows(&x, rows, k);
        let (wq, ws) = quantize_blocks(&w, n, k);
        let y = fp8_linear((&xq, &xs), (&wq, &ws), rows, k, n);
        let xd: Vec<f32> = {
            let groups = k.div_ceil(FP8_BLOCK);
            (0..rows * k)
                .map(|i| e4m3_to_f32(xq[i]) * xs[(i / k) * groups + (i % k) / 128])
                .collect()
        };
        let wd = dequantize_blocks(&wq, &ws, n, k);
        for r in 0..rows {
            for c in 0..n {
                let exact: f64 =
                    (0..k).map(|i| f64::from(xd[r * k + i]) * f64::from(wd[c * k + i])).sum();
                let scale: f64 =
                    (0..k).map(|i| f64::from((xd[r * k + i] * wd[c * k + i]).abs())).sum();
                let got = f64::from(y[r * n + c]);
                assert!((got - exact).abs() <= 1e-6 * scale + 1e-9, "[{r}, {c}]: {got} vs {exact}");
            }
            let one = fp8_linear((&xq[r * k..][..k], &xs[r * 3..][..3]), (&wq, &ws), 1, k, n);
            assert_eq!(one, y[r * n..][..n], "row {r} alone");
        }
        // The definition, one output at a time: each 128-slice summed over k in order, then
        // promoted with one fused multiply-add by the scales' product. The column-vectorized
        // kernel has its bits.
        let groups = k.div_ceil(FP8_BLOCK);
        for r in 0..rows {
            for c in 0..n {
                let mut acc = 0f32;
                for g in 0..groups {
                    let mut partial = 0f32;
                    for j in g * FP8_BLOCK..((g + 1) * FP8_BLOCK).min(k) {
                        partial += e4m3_to_f32(xq[r * k + j]) * e4m3_to_f32(wq[c * k + j]);
                    }
                    let scale = xs[r * groups + g] * ws[(c / FP8_BLOCK) * groups + g];
                    acc = partial.mul_add(scale, acc);
                }
                assert_eq!(acc.to_bits(), y[r * n + c].to_bits(), "[{r}, {c}]");
            }
        }
    }

    #[test]
    fn activation_rows_scale_per_group_of_128() {
        let mut rng = Rng::new(6);
        let (rows, cols) = (3, 300);
        let x: Vec<f32> = (0..rows * cols).map(|_| rng.normal()).collect();
        let (codes, scales) = quantize_rows(&x, rows, cols);
        assert_eq!((codes.len(), scales.len()), (rows * cols, rows * 3));
        for (r, row) in x.chunks(cols).enumerate() {
            for (g, group) in row.chunks(128).enumerate() {
                let amax = group.iter().fold(0f32, |m, v| m.max(v.abs()));
                assert_eq!(scales[r * 3 + g], amax / 448.0);
                let (q, _) = quantize_blocks(group, 1, group.len());
                assert_eq!(codes[r * cols + g * 128..][..group.len()], q[..]);
            }
        }
    }
}
