//! INT4 weights as miles' quantization-aware training makes them and compressed-tensors'
//! `pack-quantized` format stores them: each row of a weight `[out × in]` is cut into groups of
//! `group` consecutive inputs; a group's scale is s = max(amax / 7, 1e-5), each weight becomes
//! q = clamp(round(w / s), −7, 7) (round half to even, as `torch.round`), and stands for q · s.
//! Fifteen levels, symmetric: −8 is never produced.
//!
//! Packed, as compressed-tensors writes `weight_packed`: q + 8 as an unsigned nibble, eight
//! of a row's consecutive nibbles in one int32, the first in the lowest bits; a row whose
//! length is not a multiple of 8 ends in a word padded with zero nibbles.

use crate::{Error, Result};

/// The largest INT4 level a weight is rounded to (and its negative the smallest).
pub const INT4_MAX: f32 = 7.0;
/// The least scale of a group (an all-zero group gets it).
const SCALE_FLOOR: f32 = 1e-5;
/// Nibbles per packed int32.
const PER_WORD: usize = 8;

fn invalid(message: String) -> Error {
    Error::Shape { op: "int4", message }
}

/// Refuses a group that does not tile the rows of `len` weights `cols` wide.
fn check_groups(len: usize, cols: usize, group: usize) -> Result<()> {
    if group == 0 || cols == 0 || !cols.is_multiple_of(group) || !len.is_multiple_of(cols) {
        return Err(invalid(format!(
            "{len} weights in rows of {cols}: groups of {group} inputs must divide the row"
        )));
    }
    Ok(())
}

/// The scale of each group of `w` (rows of `cols`, groups of `group`), row-major over groups.
pub fn int4_scales(w: &[f32], cols: usize, group: usize) -> Result<Vec<f32>> {
    check_groups(w.len(), cols, group)?;
    Ok(w.chunks(group)
        .map(|g| {
            let amax = g.iter().fold(0f32, |m, x| m.max(x.abs()));
            (amax / INT4_MAX).max(SCALE_FLOOR)
        })
        .collect())
}

/// The levels of `w` (in −7..=7) and the groups' scales.
pub fn quantize_int4(w: &[f32], cols: usize, group: usize) -> Result<(Vec<i8>, Vec<f32>)> {
    let scales = int4_scales(w, cols, group)?;
    let q = w
        .chunks(group)
        .zip(&scales)
        .flat_map(|(g, &s)| g.iter().map(move |&x| level(x, s)))
        .collect();
    Ok((q, scales))
}

fn level(x: f32, scale: f32) -> i8 {
    (x / scale).round_ties_even().clamp(-INT4_MAX, INT4_MAX) as i8
}

/// The weights the levels stand for: q · s.
pub fn dequantize_int4(q: &[i8], scales: &[f32], group: usize) -> Result<Vec<f32>> {
    if group == 0 || q.len() != scales.len() * group {
        return Err(invalid(format!(
            "{} levels with {} scales of groups of {group}",
            q.len(),
            scales.len()
        )));
    }
    Ok(q.chunks(group)
        .zip(scales)
        .flat_map(|(g, &s)| g.iter().map(move |&v| f32::from(v) * s))
        .collect())
}

/// Fake quantization, the forward weights of QAT: dequantize(quantize(w)).
pub fn fake_quantize_int4(w: &[f32], cols: usize, group: usize) -> Result<Vec<f32>> {
    let (q, scales) = quantize_int4(w, cols, group)?;
    dequantize_int4(&q, &scales, group)
}

/// compressed-tensors' `weight_packed` of levels in rows of `cols`: ⌈cols / 8⌉ words a row.
pub fn pack_int4(q: &[i8], cols: usize) -> Result<Vec<i32>> {
    if cols == 0 || !q.len().is_multiple_of(cols) {
        return Err(invalid(format!("{} levels in rows of {cols}", q.len())));
    }
    Ok(q.chunks(cols)
        .flat_map(|row| row.chunks(PER_WORD))
        .map(|eight| {
            let word = eight
                .iter()
                .enumerate()
                .fold(0u32, |w, (i, &v)| w | (((v + 8) as u32 & 0xF) << (4 * i)));
            word as i32
        })
        .collect())
}

/// The levels of `weight_packed` for a `[rows × cols]` weight; a level −8 (a zero nibble
/// inside the row, which the symmetric format never writes) or a length that is not the
/// shape's is an error.
pub fn unpack_int4(packed: &[i32], rows: usize, cols: usize) -> Result<Vec<i8>> {
    let per_row = cols.div_ceil(PER_WORD);
    if packed.len() != rows * per_row {
        return Err(invalid(format!(
            "weight_packed holds {} int32 and the shape [{rows}, {cols}] needs {} (8 levels each)",
            packed.len(),
            rows * per_row
        )));
    }
    let mut q = Vec::with_capacity(rows * cols);
    for (r, row) in packed.chunks(per_row.max(1)).enumerate().take(rows) {
        for c in 0..cols {
            let nibble = ((row[c / PER_WORD] as u32) >> (4 * (c % PER_WORD))) & 0xF;
            if nibble == 0 {
                return Err(invalid(format!(
                    "weight_packed row {r} column {c} holds level -8, which symmetric INT4 \
                     never writes"
                )));
            }
            q.push(nibble as i8 - 8);
        }
    }
    Ok(q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn levels_follow_mileses_recipe() {
        // One group: amax 3.5 gives s = 0.5; 0.25 / 0.5 = 0.5 rounds to 0 (half to even),
        // 0.75 / 0.5 = 1.5 to 2; -3.5 is -7.
        let w = [0.25, 0.75, -3.5, 1.0];
        let (q, s) = quantize_int4(&w, 4, 4).unwrap();
        assert_eq!((q, s), (vec![0, 2, -7, 2], vec![0.5]));
        // An all-zero group takes the floor scale and stays zero.
        let (q, s) = quantize_int4(&[0.0; 4], 4, 4).unwrap();
        assert_eq!((q, s), (vec![0; 4], vec![1e-5]));
        assert_eq!(fake_quantize_int4(&w, 4, 4).unwrap(), vec![0.0, 1.0, -3.5, 1.0]);
    }

    #[test]
    fn fake_quantization_is_idempotent_and_close() {
        let mut rng = Rng::new(3);
        let (rows, cols, group) = (6, 64, 32);
        let w: Vec<f32> = (0..rows * cols).map(|_| rng.normal() * 0.02).collect();
        let once = fake_quantize_int4(&w, cols, group).unwrap();
        assert_eq!(fake_quantize_int4(&once, cols, group).unwrap(), once);
        let scales = int4_scales(&w, cols, group).unwrap();
        for (i, (a, b)) in w.iter().zip(&once).enumerate() {
            assert!((a - b).abs() <= 0.5 * scales[i / group] * 1.0001, "{i}: {a} {b}");
        }
    }

    #[test]
    fn packing_round_trips_in_compressed_tensors_order() {
        let q: Vec<i8> = vec![-7, -1, 0, 1, 2, 3, 6, 7];
        // q + 8 = [1, 7, 8, 9, 10, 11, 14, 15], the first in the lowest nibble.
        assert_eq!(pack_int4(&q, 8).unwrap(), vec![0xFEBA_9871_u32 as i32]);
        let mut rng = Rng::new(5);
        let many: Vec<i8> = (0..4 * 16).map(|_| rng.below(15) as i8 - 7).collect();
        assert_eq!(unpack_int4(&pack_int4(&many, 16).unwrap(), 4, 16).unwrap(), many);
        // Rows of 12: two words each, the second padded with zero nibbles.
        let rows12 = &many[..24];
        let packed = pack_int4(rows12, 12).unwrap();
        assert_eq!(packed.len(), 4);
        assert_eq!(packed[1] as u32 >> 16, 0);
        assert_eq!(unpack_int4(&packed, 2, 12).unwrap(), rows12);
    }

    #[test]
    fn bad_shapes_and_words_are_errors() {
        let err = |r: Result<Vec<f32>>| r.unwrap_err().to_string();
        assert!(err(fake_quantize_int4(&[0.0; 96], 96, 64)).contains("groups of 64"));
        assert!(err(fake_quantize_int4(&[0.0; 10], 4, 4)).contains("rows of 4"));
        assert!(pack_int4(&[0; 12], 5).unwrap_err().to_string().contains("rows of 5"));
        let short = unpack_int4(&[0x1111_1111], 2, 8).unwrap_err().to_string();
        assert!(short.contains("needs 2"), "{short}");
        let minus8 = unpack_int4(&[0x1111_1110], 1, 8).unwrap_err().to_string();
        assert!(minus8.contains("row 0 column 0 holds level -8"), "{minus8}");
    }
}
