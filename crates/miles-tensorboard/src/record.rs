//! TFRecord framing, the container every TensorBoard event file uses.
//!
//! A record is `len: u64 LE`, `masked_crc32c(len bytes): u32 LE`, `data`,
//! `masked_crc32c(data): u32 LE`. TensorBoard's reader checks both CRCs, so a torn or
//! half-written record is detected rather than misread.

/// Added after the rotation; TensorFlow masks its CRCs so that a CRC of data that itself holds
/// CRCs does not degenerate.
const MASK_DELTA: u32 = 0xa282_ead8;

/// CRC32C (Castagnoli) of `bytes`, masked as TFRecord stores it.
pub(crate) fn masked_crc32c(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// `data` framed as one TFRecord, ready for a single `write_all`.
pub(crate) fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut record = Vec::with_capacity(data.len() + 16);
    record.extend_from_slice(&len);
    record.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    record.extend_from_slice(data);
    record.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    record
}
