//! CRCs, varints and whole events against bytes made by TensorBoard's own Python writer, and a
//! round trip through a small reader that checks what TensorBoard's reader checks.

use std::fs;
use std::path::{Path, PathBuf};

use super::*;
use crate::proto::{FILE_VERSION, put_varint};
use crate::record::{frame, masked_crc32c};

/// A fresh directory under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(label: &str) -> TempDir {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir()
            .join(format!("miles-tensorboard-{label}-{}-{n}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        TempDir(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

fn hex(text: &str) -> Vec<u8> {
    (0..text.len()).step_by(2).map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap()).collect()
}

// The golden records below come from tensorboard 2.21's `event_pb2.Event(...).SerializeToString()`
// framed by `tensorboard.summary.writer.record_writer.RecordWriter`.

/// `Event(wall_time=1700000000.25, file_version="brain.Event:2")`.
const GOLDEN_VERSION_RECORD: &str = "1800000000000000a37f4b220900001040fc54d9411a0d627261696e2e\
                                     4576656e743a32338d2fe9";
/// `Event(wall_time=1700000001.5, step=3, summary=Summary(value=[Value(tag="train/loss",
/// simple_value=0.5), Value(tag="rollout/raw_reward", simple_value=-1.25)]))`.
const GOLDEN_SCALARS_RECORD: &str = "3b000000000000001a23ac5c0900006040fc54d94110032a2e0a110a0a\
                                     747261696e2f6c6f7373150000003f0a190a12726f6c6c6f75742f7261\
                                     775f726577617264150000a0bf9d412d7d";

#[test]
fn crc32c_known_answer() {
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
}

#[test]
fn masked_crc32c_matches_tensorflow() {
    // The mask of a zero CRC is the delta itself; the other value is TensorBoard's
    // `masked_crc32c(b"123456789")`.
    assert_eq!(masked_crc32c(b""), 0xa282_ead8);
    assert_eq!(masked_crc32c(b"123456789"), 0xc78a_b0e5);
}

#[test]
fn file_version_record_is_byte_for_byte_tensorboards() {
    let record = frame(&proto::file_version_event(1_700_000_000.25));
    assert_eq!(record, hex(GOLDEN_VERSION_RECORD));
}

#[test]
fn scalars_record_is_byte_for_byte_tensorboards() {
    let scalars = [("train/loss", 0.5), ("rollout/raw_reward", -1.25)];
    let record = frame(&proto::scalars_event(3, 1_700_000_001.5, &scalars));
    assert_eq!(record, hex(GOLDEN_SCALARS_RECORD));
}

#[test]
fn negative_step_is_a_ten_byte_varint_like_protobufs() {
    // tensorboard: Event(step=-1, summary=Summary()).SerializeToString().
    assert_eq!(proto::scalars_event(-1, 0.0, &[]), hex("10ffffffffffffffffff012a00"));
}

#[test]
fn varint_edge_cases() {
    let encode = |value: u64| {
        let mut out = Vec::new();
        put_varint(&mut out, value);
        out
    };
    assert_eq!(encode(0), [0x00]);
    assert_eq!(encode(1), [0x01]);
    assert_eq!(encode(127), [0x7f]);
    assert_eq!(encode(128), [0x80, 0x01]);
    assert_eq!(encode(300), [0xac, 0x02]);
    assert_eq!(encode(16_383), [0xff, 0x7f]);
    assert_eq!(encode(16_384), [0x80, 0x80, 0x01]);
    assert_eq!(encode(u64::MAX), [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01]);
    for value in [0, 1, 127, 128, 300, 1 << 35, u64::MAX >> 1, u64::MAX] {
        let bytes = encode(value);
        let mut at = 0;
        assert_eq!(read_varint(&bytes, &mut at), value);
        assert_eq!(at, bytes.len());
    }
}

/// (step, wall_time, scalars) as handed to `write_scalars`.
type LoggedStep = (i64, f64, Vec<(&'static str, f64)>);

#[test]
fn round_trip_through_a_reader() {
    let dir = TempDir::new("round-trip");
    let logdir = dir.path().join("tb"); // not there yet: create makes it
    let mut writer = EventWriter::create(&logdir).unwrap();
    let steps: Vec<LoggedStep> = vec![
        (0, 1_700_000_000.0, vec![("train/loss", 2.5), ("rollout/raw_reward", 0.0)]),
        (1, 1_700_000_001.5, vec![("train/loss", 1.75), ("rollout/raw_reward", 0.125)]),
        (2, 1_700_000_003.0, vec![("train/loss", f64::NAN), ("perf/step_time", f64::INFINITY)]),
        (300, 1_700_000_004.0, vec![("train/loss", -0.1)]),
    ];
    for (step, wall_time, scalars) in &steps {
        writer.write_scalars(*step, *wall_time, scalars).unwrap();
    }
    let path = writer.path().to_path_buf();
    drop(writer);

    let name = path.file_name().unwrap().to_str().unwrap();
    let parts: Vec<&str> = name.split('.').collect();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    assert_eq!(parts.last(), Some(&"0"), "{name}");
    assert_eq!(parts[parts.len() - 2], std::process::id().to_string(), "{name}");
    assert!(parts[3].parse::<u64>().unwrap() > 1_600_000_000, "{name}");

    let events = read_events(&path);
    assert_eq!(events.len(), 1 + steps.len());
    assert_eq!(events[0].file_version.as_deref(), Some(FILE_VERSION));
    assert!(events[0].wall_time > 1_600_000_000.0);
    assert!(events[0].values.is_empty());
    for (event, (step, wall_time, scalars)) in events[1..].iter().zip(&steps) {
        assert_eq!(event.step, *step);
        assert_eq!(event.wall_time, *wall_time);
        assert_eq!(event.file_version, None);
        let expected: Vec<(String, u32)> = scalars
            .iter()
            .map(|&(tag, value)| (tag.to_string(), (value as f32).to_bits()))
            .collect();
        let got: Vec<(String, u32)> =
            event.values.iter().map(|(tag, value)| (tag.clone(), value.to_bits())).collect();
        assert_eq!(got, expected, "step {step}");
    }
}

#[test]
fn second_file_with_the_same_name_gets_the_next_suffix() {
    // Two writers of one process in one second share a stem; neither may truncate the other.
    let dir = TempDir::new("two-writers");
    fs::create_dir_all(dir.path()).unwrap();
    let stem = "events.out.tfevents.1700000000.host.42";
    let (first, _) = create_new_file(dir.path(), stem).unwrap();
    let (second, _) = create_new_file(dir.path(), stem).unwrap();
    assert_eq!(first, dir.path().join(format!("{stem}.0")));
    assert_eq!(second, dir.path().join(format!("{stem}.1")));
}

#[test]
fn unwritable_directory_error_names_the_path() {
    let dir = TempDir::new("blocked");
    fs::create_dir_all(dir.path()).unwrap();
    let blocker = dir.path().join("a-file");
    fs::write(&blocker, b"not a directory").unwrap();
    let logdir = blocker.join("tb");
    let error = EventWriter::create(&logdir).unwrap_err();
    assert!(matches!(error, Error::CreateDir { .. }), "{error:?}");
    let message = error.to_string();
    assert!(message.contains(&logdir.display().to_string()), "{message}");
    assert!(message.starts_with("cannot create the TensorBoard log directory"), "{message}");
}

#[test]
fn hostname_is_one_file_name_component() {
    let name = hostname();
    assert!(!name.is_empty());
    assert!(!name.contains('/'), "{name}");
}

// A tiny reader: TFRecord framing with both CRCs checked, then the Event fields decoded.

#[derive(Debug, Default)]
struct ReadEvent {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    values: Vec<(String, f32)>,
}

fn read_events(path: &Path) -> Vec<ReadEvent> {
    let bytes = fs::read(path).unwrap();
    let mut events = Vec::new();
    let mut at = 0;
    while at < bytes.len() {
        let len_bytes = &bytes[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        assert_eq!(u32_at(&bytes, at + 8), masked_crc32c(len_bytes), "length CRC at byte {at}");
        let data = &bytes[at + 12..at + 12 + len];
        assert_eq!(u32_at(&bytes, at + 12 + len), masked_crc32c(data), "data CRC at byte {at}");
        events.push(decode_event(data));
        at += 12 + len + 4;
    }
    assert_eq!(at, bytes.len(), "trailing bytes");
    events
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(bytes[at..at + 4].try_into().unwrap())
}

fn read_varint(bytes: &[u8], at: &mut usize) -> u64 {
    let mut value = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = bytes[*at];
        *at += 1;
        value |= u64::from(byte & 0x7f) << shift;
        if byte & 0x80 == 0 {
            return value;
        }
    }
    panic!("varint longer than ten bytes");
}

/// Splits a message into (field number, payload) pairs; the payload of a varint field is its
/// value as little-endian bytes.
fn fields(message: &[u8]) -> Vec<(u32, Vec<u8>)> {
    let mut out = Vec::new();
    let mut at = 0;
    while at < message.len() {
        let key = read_varint(message, &mut at);
        let (field, wire_type) = ((key >> 3) as u32, key & 7);
        let payload = match wire_type {
            0 => read_varint(message, &mut at).to_le_bytes().to_vec(),
            1 => {
                at += 8;
                message[at - 8..at].to_vec()
            }
            2 => {
                let len = read_varint(message, &mut at) as usize;
                at += len;
                message[at - len..at].to_vec()
            }
            5 => {
                at += 4;
                message[at - 4..at].to_vec()
            }
            other => panic!("unexpected wire type {other} for field {field}"),
        };
        out.push((field, payload));
    }
    out
}

fn decode_event(data: &[u8]) -> ReadEvent {
    let mut event = ReadEvent::default();
    for (field, payload) in fields(data) {
        match field {
            1 => event.wall_time = f64::from_le_bytes(payload.try_into().unwrap()),
            2 => event.step = u64::from_le_bytes(payload.try_into().unwrap()) as i64,
            3 => event.file_version = Some(String::from_utf8(payload).unwrap()),
            5 => {
                for (field, value) in fields(&payload) {
                    assert_eq!(field, 1, "Summary holds only `value`");
                    let mut tag = String::new();
                    let mut simple_value = None;
                    for (field, payload) in fields(&value) {
                        match field {
                            1 => tag = String::from_utf8(payload).unwrap(),
                            2 => {
                                simple_value = Some(f32::from_le_bytes(payload.try_into().unwrap()))
                            }
                            other => panic!("unexpected Summary.Value field {other}"),
                        }
                    }
                    event.values.push((tag, simple_value.unwrap()));
                }
            }
            other => panic!("unexpected Event field {other}"),
        }
    }
    event
}
