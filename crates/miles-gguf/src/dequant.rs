//! ggml tensor types and their dequantization to f32, block by block, with the layouts of
//! ggml-quants.c (`block_q4_0`, `block_q4_K`, …). Every block is little-endian.

use half::{bf16, f16};
use rayon::prelude::*;

/// The ggml tensor types a GGUF file may name. Ids are ggml's; removed ids (4, 5, 31–33, 36–38)
/// are unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    Bf16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
}

/// K-quant super-block size (`QK_K`).
const QK_K: usize = 256;

/// (type, ggml id, name, elements per block, bytes per block), from ggml's type traits.
const TYPES: [(GgmlType, u32, &str, usize, usize); 32] = [
    (GgmlType::F32, 0, "F32", 1, 4),
    (GgmlType::F16, 1, "F16", 1, 2),
    (GgmlType::Q4_0, 2, "Q4_0", 32, 18),
    (GgmlType::Q4_1, 3, "Q4_1", 32, 20),
    (GgmlType::Q5_0, 6, "Q5_0", 32, 22),
    (GgmlType::Q5_1, 7, "Q5_1", 32, 24),
    (GgmlType::Q8_0, 8, "Q8_0", 32, 34),
    (GgmlType::Q8_1, 9, "Q8_1", 32, 40),
    (GgmlType::Q2K, 10, "Q2_K", QK_K, 84),
    (GgmlType::Q3K, 11, "Q3_K", QK_K, 110),
    (GgmlType::Q4K, 12, "Q4_K", QK_K, 144),
    (GgmlType::Q5K, 13, "Q5_K", QK_K, 176),
    (GgmlType::Q6K, 14, "Q6_K", QK_K, 210),
    (GgmlType::Q8K, 15, "Q8_K", QK_K, 292),
    (GgmlType::Iq2Xxs, 16, "IQ2_XXS", QK_K, 66),
    (GgmlType::Iq2Xs, 17, "IQ2_XS", QK_K, 74),
    (GgmlType::Iq3Xxs, 18, "IQ3_XXS", QK_K, 98),
    (GgmlType::Iq1S, 19, "IQ1_S", QK_K, 50),
    (GgmlType::Iq4Nl, 20, "IQ4_NL", 32, 18),
    (GgmlType::Iq3S, 21, "IQ3_S", QK_K, 110),
    (GgmlType::Iq2S, 22, "IQ2_S", QK_K, 82),
    (GgmlType::Iq4Xs, 23, "IQ4_XS", QK_K, 136),
    (GgmlType::I8, 24, "I8", 1, 1),
    (GgmlType::I16, 25, "I16", 1, 2),
    (GgmlType::I32, 26, "I32", 1, 4),
    (GgmlType::I64, 27, "I64", 1, 8),
    (GgmlType::F64, 28, "F64", 1, 8),
    (GgmlType::Iq1M, 29, "IQ1_M", QK_K, 56),
    (GgmlType::Bf16, 30, "BF16", 1, 2),
    (GgmlType::Tq1_0, 34, "TQ1_0", QK_K, 54),
    (GgmlType::Tq2_0, 35, "TQ2_0", QK_K, 66),
    (GgmlType::Mxfp4, 39, "MXFP4", 32, 17),
];

/// The types [`dequantize`] handles.
pub const SUPPORTED: [GgmlType; 9] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::Bf16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

impl GgmlType {
    pub fn from_id(id: u32) -> Option<Self> {
        TYPES.iter().find(|t| t.1 == id).map(|t| t.0)
    }

    fn traits(self) -> &'static (GgmlType, u32, &'static str, usize, usize) {
        TYPES.iter().find(|t| t.0 == self).expect("every type has a row in TYPES")
    }

    pub fn id(self) -> u32 {
        self.traits().1
    }

    /// ggml's name: `Q4_K`, `BF16`, …
    pub fn name(self) -> &'static str {
        self.traits().2
    }

    /// Elements per block: rows must hold a whole number of blocks.
    pub fn block_size(self) -> usize {
        self.traits().3
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        self.traits().4
    }

    pub fn is_supported(self) -> bool {
        SUPPORTED.contains(&self)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a tensor could not be dequantized; the caller adds the file and tensor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DequantError {
    Unsupported(GgmlType),
    /// `bytes` does not hold exactly `out.len()` elements of the type.
    Length {
        expected: usize,
        found: usize,
    },
}

impl std::fmt::Display for DequantError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DequantError::Unsupported(t) => {
                let names: Vec<&str> = SUPPORTED.iter().map(|t| t.name()).collect();
                write!(f, "ggml type {t} is not supported; supported: {}", names.join(", "))
            }
            DequantError::Length { expected, found } => {
                write!(f, "expected {expected} bytes of data, found {found}")
            }
        }
    }
}

fn half(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// Blocks dequantized per rayon task: large enough to amortize scheduling.
const BLOCKS_PER_TASK: usize = 4096;

/// Dequantizes `bytes` (whole blocks of `ty`) into `out`.
pub fn dequantize(ty: GgmlType, bytes: &[u8], out: &mut [f32]) -> Result<(), DequantError> {
    let (bs, ts) = (ty.block_size(), ty.type_size());
    let kernel: fn(&[u8], &mut [f32]) = match ty {
        GgmlType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        GgmlType::F16 => |b, y| y[0] = half(b),
        GgmlType::Bf16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        GgmlType::Q8_0 => q8_0,
        GgmlType::Q4_0 => q4_0,
        GgmlType::Q4_1 => q4_1,
        GgmlType::Q4K => q4_k,
        GgmlType::Q5K => q5_k,
        GgmlType::Q6K => q6_k,
        other => return Err(DequantError::Unsupported(other)),
    };
    let expected = out.len() / bs * ts;
    if !out.len().is_multiple_of(bs) || bytes.len() != expected {
        return Err(DequantError::Length { expected, found: bytes.len() });
    }
    out.par_chunks_mut(bs * BLOCKS_PER_TASK).zip(bytes.par_chunks(ts * BLOCKS_PER_TASK)).for_each(
        |(y, b)| {
            for (y, b) in y.chunks_exact_mut(bs).zip(b.chunks_exact(ts)) {
                kernel(b, y);
            }
        },
    );
    Ok(())
}

/// `block_q8_0`: f16 scale, 32 × i8.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = half(b);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = d * f32::from(q as i8);
    }
}

/// `block_q4_0`: f16 scale, 16 bytes of nibbles; low nibbles are elements 0–15, high 16–31,
/// offset by 8.
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = half(b);
    for (j, &q) in b[2..18].iter().enumerate() {
        y[j] = d * (f32::from(q & 0x0f) - 8.0);
        y[j + 16] = d * (f32::from(q >> 4) - 8.0);
    }
}

/// `block_q4_1`: f16 scale and minimum, then nibbles as in Q4_0, unsigned.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (half(b), half(&b[2..]));
    for (j, &q) in b[4..20].iter().enumerate() {
        y[j] = d * f32::from(q & 0x0f) + m;
        y[j + 16] = d * f32::from(q >> 4) + m;
    }
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) packed in 12 bytes
/// (`get_scale_min_k4`): the first four in the low 6 bits of bytes 0–3 / 4–7, the last four
/// split between the nibbles of bytes 8–11 and the top 2 bits of bytes 0–7.
fn scale_min_k4(j: usize, q: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    };
    (f32::from(sc), f32::from(m))
}

/// `block_q4_K`: f16 d and dmin, 12 bytes of scales, 128 bytes of nibbles. Each 32-byte chunk
/// holds two sub-blocks of 32: low nibbles first, then high.
fn q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(b), half(&b[2..]));
    let scales = &b[4..16];
    for (c, qs) in b[16..144].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let y = &mut y[64 * c..64 * (c + 1)];
        for (l, &q) in qs.iter().enumerate() {
            y[l] = d1 * f32::from(q & 0x0f) - m1;
            y[l + 32] = d2 * f32::from(q >> 4) - m2;
        }
    }
}

/// `block_q5_K`: Q4_K plus a fifth bit per element: bit `s` of `qh[l]` belongs to element `l`
/// of sub-block `s`.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (half(b), half(&b[2..]));
    let scales = &b[4..16];
    let qh = &b[16..48];
    for (c, qs) in b[48..176].chunks_exact(32).enumerate() {
        let (sc1, m1) = scale_min_k4(2 * c, scales);
        let (sc2, m2) = scale_min_k4(2 * c + 1, scales);
        let (d1, m1, d2, m2) = (d * sc1, dmin * m1, d * sc2, dmin * m2);
        let y = &mut y[64 * c..64 * (c + 1)];
        for (l, (&q, &h)) in qs.iter().zip(qh).enumerate() {
            let lo = (q & 0x0f) | (((h >> (2 * c)) & 1) << 4);
            let hi = (q >> 4) | (((h >> (2 * c + 1)) & 1) << 4);
            y[l] = d1 * f32::from(lo) - m1;
            y[l + 32] = d2 * f32::from(hi) - m2;
        }
    }
}

/// `block_q6_K`: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 i8 scales (one per 16
/// elements), f16 d. Each half of 128 elements uses 64 `ql` and 32 `qh` bytes.
fn q6_k(b: &[u8], y: &mut [f32]) {
    let d = half(&b[208..]);
    let scales = &b[192..208];
    for h in 0..2 {
        let ql = &b[64 * h..64 * (h + 1)];
        let qh = &b[128 + 32 * h..128 + 32 * (h + 1)];
        let y = &mut y[128 * h..128 * (h + 1)];
        for l in 0..32 {
            let q = [
                (ql[l] & 0x0f) | ((qh[l] & 3) << 4),
                (ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4),
                (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4),
                (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4),
            ];
            for (k, &q) in q.iter().enumerate() {
                let e = l + 32 * k;
                let scale = f32::from(scales[8 * h + e / 16] as i8);
                y[e] = d * scale * f32::from(i16::from(q) - 32);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    fn run(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
        let mut out = vec![0.0; n];
        dequantize(ty, bytes, &mut out).unwrap();
        out
    }

    #[test]
    fn type_table_matches_ggml_ids_and_sizes() {
        for (ty, id, name, bs, ts) in TYPES {
            assert_eq!(GgmlType::from_id(id), Some(ty), "{name}");
            assert_eq!((ty.name(), ty.block_size(), ty.type_size()), (name, bs, ts));
        }
        assert_eq!(GgmlType::from_id(4), None, "Q4_2 was removed from ggml");
        assert_eq!(GgmlType::from_id(1000), None);
    }

    #[test]
    fn hand_made_q4_0_and_q8_0_blocks() {
        // Q4_0: d = 0.5, byte j = (hi << 4) | lo with lo = j, hi = 15 - j.
        let mut b = f16_bytes(0.5).to_vec();
        b.extend((0..16u8).map(|j| ((15 - j) << 4) | j));
        let y = run(GgmlType::Q4_0, &b, 32);
        for j in 0..16 {
            assert_eq!(y[j], 0.5 * (j as f32 - 8.0));
            assert_eq!(y[j + 16], 0.5 * (7.0 - j as f32));
        }
        let mut b = f16_bytes(0.25).to_vec();
        b.extend((0..32).map(|j| (j as i8 - 16) as u8));
        let y = run(GgmlType::Q8_0, &b, 32);
        assert_eq!(y[0], -4.0);
        assert_eq!(y[31], 3.75);
    }

    #[test]
    fn q4_k_scales_unpack_the_high_bits() {
        // Sub-block 5: scale = (q[9] & 15) | (q[1] >> 6) << 4, min = (q[9] >> 4) | (q[5] >> 6) << 4.
        let mut q = [0u8; 12];
        q[1] = 0b1100_0001;
        q[5] = 0b0100_0010;
        q[9] = 0x3a;
        assert_eq!(scale_min_k4(1, &q), (1.0, 2.0));
        assert_eq!(scale_min_k4(5, &q), (58.0, 19.0));
    }

    #[test]
    fn unsupported_types_and_bad_lengths_are_refused() {
        let mut out = vec![0.0; 256];
        let err = dequantize(GgmlType::Q2K, &[0; 84], &mut out).unwrap_err();
        assert!(err.to_string().starts_with("ggml type Q2_K is not supported; supported: F32"));
        let err = dequantize(GgmlType::Q4K, &[0; 100], &mut out).unwrap_err();
        assert_eq!(err.to_string(), "expected 144 bytes of data, found 100");
        let err = dequantize(GgmlType::Q8_0, &[0; 34], &mut out[..31]).unwrap_err();
        assert!(matches!(err, DequantError::Length { .. }));
    }
}
