//! The few protobuf messages a scalar event needs, encoded by hand.
//!
//! Field numbers are those of TensorBoard's `event.proto` and `summary.proto`:
//! `Event { wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
//! summary = 5 (Summary) }`, `Summary { repeated Value value = 1 }`,
//! `Summary.Value { tag = 1 (string), simple_value = 2 (float) }`. Three messages do not
//! justify a protobuf code generator in the build.

/// Protobuf wire types used here.
const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LENGTH_DELIMITED: u32 = 2;
const FIXED32: u32 = 5;

mod event {
    pub const WALL_TIME: u32 = 1;
    pub const STEP: u32 = 2;
    pub const FILE_VERSION: u32 = 3;
    pub const SUMMARY: u32 = 5;
}
mod summary {
    pub const VALUE: u32 = 1;
}
mod value {
    pub const TAG: u32 = 1;
    pub const SIMPLE_VALUE: u32 = 2;
}

/// The version string TensorBoard expects in a file's first event.
pub(crate) const FILE_VERSION: &str = "brain.Event:2";

/// Base-128 varint, least significant group first.
pub(crate) fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8 & 0x7f) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_key(out: &mut Vec<u8>, field: u32, wire_type: u32) {
    put_varint(out, u64::from((field << 3) | wire_type));
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(out, field, LENGTH_DELIMITED);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// The fields every event carries, skipped when zero as any proto3 encoder does, so an event
/// is byte for byte what TensorBoard's own Python writer makes of it.
fn put_event_header(out: &mut Vec<u8>, wall_time: f64, step: i64) {
    // proto3 skips a double only when its bits are zero: -0.0 is written.
    if wall_time.to_bits() != 0 {
        put_key(out, event::WALL_TIME, FIXED64);
        out.extend_from_slice(&wall_time.to_le_bytes());
    }
    if step != 0 {
        put_key(out, event::STEP, VARINT);
        // int64 (not sint64): a negative step is its two's complement, ten bytes long.
        put_varint(out, step as u64);
    }
}

/// The first event of a file: identifies the format to TensorBoard.
pub(crate) fn file_version_event(wall_time: f64) -> Vec<u8> {
    let mut out = Vec::new();
    put_event_header(&mut out, wall_time, 0);
    put_bytes(&mut out, event::FILE_VERSION, FILE_VERSION.as_bytes());
    out
}

/// One step's scalars as an `Event` holding a `Summary`. Values are narrowed to f32, the
/// type of `simple_value`; NaN and infinities pass through unchanged.
pub(crate) fn scalars_event(step: i64, wall_time: f64, scalars: &[(&str, f64)]) -> Vec<u8> {
    let mut summary = Vec::new();
    let mut entry = Vec::new();
    for &(tag, scalar) in scalars {
        entry.clear();
        if !tag.is_empty() {
            // Skipped when empty, as proto3 does for a plain string field.
            put_bytes(&mut entry, value::TAG, tag.as_bytes());
        }
        put_key(&mut entry, value::SIMPLE_VALUE, FIXED32);
        entry.extend_from_slice(&(scalar as f32).to_le_bytes());
        put_bytes(&mut summary, summary::VALUE, &entry);
    }
    let mut out = Vec::new();
    put_event_header(&mut out, wall_time, step);
    put_bytes(&mut out, event::SUMMARY, &summary);
    out
}
