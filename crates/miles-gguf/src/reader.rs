//! The GGUF container (versions 2 and 3, little-endian): header, metadata, tensor infos, and
//! the aligned data section. The header is streamed through a buffered reader; tensor data is
//! read one tensor at a time, so memory holds one tensor, not the file.
//!
//! Every length read from the file is checked against the bytes that remain before anything
//! is allocated, so a corrupt file is an error naming the byte offset, never a panic or a
//! huge allocation.

use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::dequant::{self, GgmlType};
use crate::metadata::{Array, Metadata, Value};
use crate::{Error, Result};

/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Alignment of the data section when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Arrays nested deeper than this are refused (each level costs stack).
const MAX_ARRAY_DEPTH: usize = 8;

/// One tensor's description. `dims[0]` is the innermost (fastest) dimension: GGUF dims
/// `[in, out]` are PyTorch shape `[out, in]`.
#[derive(Debug, Clone, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Absolute offset of the data in the file.
    pub offset: u64,
    pub n_elements: usize,
    pub n_bytes: usize,
}

impl TensorInfo {
    /// The PyTorch-order shape: `dims` reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// An open GGUF file: its metadata and tensor infos, with the data read on demand.
#[derive(Debug)]
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: Metadata,
    pub tensors: Vec<TensorInfo>,
    pub alignment: u64,
    /// Absolute offset of the data section.
    pub data_start: u64,
    pub file_len: u64,
    file: Mutex<File>,
}

impl GgufFile {
    /// Opens and parses `path`; a corrupt, truncated or unsupported file names the byte offset
    /// or tensor and what is wrong.
    pub fn open(path: &Path) -> Result<Self> {
        let io = |source| Error::Io { path: path.to_path_buf(), source };
        let file = File::open(path).map_err(io)?;
        let file_len = file.metadata().map_err(io)?.len();
        let reader = BufReader::with_capacity(1 << 20, file.try_clone().map_err(io)?);
        let mut p = Parser { r: reader, pos: 0, len: file_len, path };
        let header = p.header()?;
        Ok(GgufFile {
            path: path.to_path_buf(),
            version: header.version,
            metadata: header.metadata,
            tensors: header.tensors,
            alignment: header.alignment,
            data_start: header.data_start,
            file_len,
            file: Mutex::new(file),
        })
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    fn tensor_err(&self, t: &TensorInfo, message: String) -> Error {
        Error::Tensor { path: self.path.clone(), tensor: t.name.clone(), message }
    }

    /// The raw bytes of `t` (bounds were checked when the file was opened).
    pub fn read_data(&self, t: &TensorInfo) -> Result<Vec<u8>> {
        let io = |source| Error::Io { path: self.path.clone(), source };
        let mut data = vec![0u8; t.n_bytes];
        // A poisoned lock only means another reader panicked; the file handle is still good.
        let mut file = self.file.lock().unwrap_or_else(|e| e.into_inner());
        file.seek(SeekFrom::Start(t.offset)).map_err(io)?;
        file.read_exact(&mut data).map_err(io)?;
        Ok(data)
    }

    /// `t` dequantized to f32, in ggml order (row-major over PyTorch's shape).
    pub fn dequantize(&self, t: &TensorInfo) -> Result<Vec<f32>> {
        if !t.ggml_type.is_supported() {
            return Err(
                self.tensor_err(t, dequant::DequantError::Unsupported(t.ggml_type).to_string())
            );
        }
        let data = self.read_data(t)?;
        let mut out = vec![0.0f32; t.n_elements];
        dequant::dequantize(t.ggml_type, &data, &mut out)
            .map_err(|e| self.tensor_err(t, e.to_string()))?;
        Ok(out)
    }
}

struct Header {
    version: u32,
    metadata: Metadata,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_start: u64,
}

/// A reader that knows its offset and the file length.
struct Parser<'a, R> {
    r: R,
    pos: u64,
    len: u64,
    path: &'a Path,
}

/// Value type ids of the GGUF spec.
const T_U8: u32 = 0;
const T_I8: u32 = 1;
const T_U16: u32 = 2;
const T_I16: u32 = 3;
const T_U32: u32 = 4;
const T_I32: u32 = 5;
const T_F32: u32 = 6;
const T_BOOL: u32 = 7;
const T_STRING: u32 = 8;
const T_ARRAY: u32 = 9;
const T_U64: u32 = 10;
const T_I64: u32 = 11;
const T_F64: u32 = 12;

/// The fewest bytes one element of value type `ty` takes in the file.
fn min_size(ty: u32) -> Option<u64> {
    Some(match ty {
        T_U8 | T_I8 | T_BOOL => 1,
        T_U16 | T_I16 => 2,
        T_U32 | T_I32 | T_F32 => 4,
        T_U64 | T_I64 | T_F64 | T_STRING => 8,
        T_ARRAY => 12,
        _ => return None,
    })
}

/// Numeric arrays: one bounded read, then a conversion.
macro_rules! numeric_array {
    ($p:expr, $n:expr, $what:expr, $t:ty, $variant:ident) => {{
        let size = std::mem::size_of::<$t>();
        let bytes = $p.bytes($n * size, $what)?;
        Array::$variant(
            bytes
                .chunks_exact(size)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk of the type's size")))
                .collect(),
        )
    }};
}

impl<R: Read> Parser<'_, R> {
    fn format_err(&self, offset: u64, message: String) -> Error {
        Error::Format { path: self.path.to_path_buf(), offset, message }
    }

    fn remaining(&self) -> u64 {
        self.len - self.pos
    }

    /// Fails unless `n` more bytes exist.
    fn need(&self, n: u64, what: &str) -> Result<()> {
        if n > self.remaining() {
            return Err(self.format_err(
                self.pos,
                format!(
                    "truncated file: {what} needs {n} bytes but the file ends at byte {}",
                    self.len
                ),
            ));
        }
        Ok(())
    }

    fn bytes(&mut self, n: usize, what: &str) -> Result<Vec<u8>> {
        self.need(n as u64, what)?;
        let mut buf = vec![0u8; n];
        self.r
            .read_exact(&mut buf)
            .map_err(|source| Error::Io { path: self.path.to_path_buf(), source })?;
        self.pos += n as u64;
        Ok(buf)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let v = self.bytes(N, what)?;
        Ok(v.try_into().expect("bytes returns N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let start = self.pos;
        let n = self.u64(what)?;
        if n > self.remaining() {
            return Err(self.format_err(
                start,
                format!(
                    "{what}: string length {n} runs past the end of the file ({} bytes); the file is corrupt or truncated",
                    self.len
                ),
            ));
        }
        let bytes = self.bytes(n as usize, what)?;
        String::from_utf8(bytes)
            .map_err(|e| self.format_err(start + 8, format!("{what}: not valid UTF-8 ({e})")))
    }

    fn header(&mut self) -> Result<Header> {
        if self.len < 4 {
            return Err(self.format_err(
                0,
                format!("not a GGUF file: it is {} bytes, shorter than the magic", self.len),
            ));
        }
        let magic: [u8; 4] = self.array("the magic")?;
        if &magic != b"GGUF" {
            return Err(self.format_err(
                0,
                format!(
                    "not a GGUF file: the magic is {:?}, expected \"GGUF\"",
                    String::from_utf8_lossy(&magic)
                ),
            ));
        }
        let version = self.u32("the version")?;
        match version {
            2 | 3 => {}
            1 => {
                return Err(self.format_err(
                    4,
                    "GGUF version 1 is not supported (only versions 2 and 3); re-convert the model with a current llama.cpp".into(),
                ));
            }
            v if v.swap_bytes() == 2 || v.swap_bytes() == 3 => {
                return Err(self.format_err(4, "big-endian GGUF is not supported".into()));
            }
            v => {
                return Err(self.format_err(
                    4,
                    format!("GGUF version {v} is not supported (only versions 2 and 3)"),
                ));
            }
        }
        let tensor_count = self.u64("the tensor count")?;
        let kv_count = self.u64("the metadata count")?;
        // A key/value takes at least 13 bytes, a tensor info 24: larger counts cannot fit.
        if kv_count.saturating_mul(13) > self.remaining() {
            return Err(self.format_err(
                16,
                format!(
                    "metadata count {kv_count} cannot fit in the file ({} bytes); the file is corrupt or truncated",
                    self.len
                ),
            ));
        }
        if tensor_count.saturating_mul(24) > self.remaining() {
            return Err(self.format_err(
                8,
                format!(
                    "tensor count {tensor_count} cannot fit in the file ({} bytes); the file is corrupt or truncated",
                    self.len
                ),
            ));
        }
        let mut entries: Vec<(String, Value)> = Vec::new();
        for k in 0..kv_count {
            let at = self.pos;
            let key = self.string(&format!("metadata key {k}"))?;
            if entries.iter().any(|(e, _)| *e == key) {
                return Err(self.format_err(at, format!("metadata key '{key}' appears twice")));
            }
            let ty = self.u32(&format!("the type of metadata '{key}'"))?;
            let value = self.value(ty, &key, 0)?;
            entries.push((key, value));
        }
        let metadata = Metadata::new(self.path, entries);
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_i128() {
                Some(a) if a > 0 && (a as u64).is_power_of_two() && a <= 1 << 30 => a as u64,
                _ => {
                    return Err(metadata
                        .err("general.alignment", format!("must be a power of two, found {v:?}")));
                }
            },
        };
        let mut infos = Vec::new();
        for k in 0..tensor_count {
            infos.push(self.tensor_info(k)?);
        }
        let data_start = self.pos.div_ceil(alignment) * alignment;
        let mut tensors: Vec<TensorInfo> = Vec::with_capacity(infos.len());
        for (name, dims, ty, rel) in infos {
            if tensors.iter().any(|t| t.name == name) {
                return Err(self.tensor_err(&name, "appears twice in the tensor list".into()));
            }
            let t = self.check_tensor(name, dims, ty, rel, data_start, alignment)?;
            tensors.push(t);
        }
        Ok(Header { version, metadata, tensors, alignment, data_start })
    }

    fn tensor_err(&self, tensor: &str, message: String) -> Error {
        Error::Tensor { path: self.path.to_path_buf(), tensor: tensor.to_string(), message }
    }

    fn tensor_info(&mut self, k: u64) -> Result<(String, Vec<u64>, GgmlType, u64)> {
        let name = self.string(&format!("the name of tensor {k}"))?;
        let at = self.pos;
        let n_dims = self.u32(&format!("the dimension count of tensor '{name}'"))?;
        if n_dims == 0 || n_dims as usize > MAX_DIMS {
            return Err(self.format_err(
                at,
                format!("tensor '{name}' has {n_dims} dimensions (ggml allows 1 to {MAX_DIMS})"),
            ));
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(self.u64(&format!("the dimensions of tensor '{name}'"))?);
        }
        let at = self.pos;
        let id = self.u32(&format!("the type of tensor '{name}'"))?;
        let ty = GgmlType::from_id(id).ok_or_else(|| {
            self.format_err(at, format!("tensor '{name}' has unknown ggml type id {id}"))
        })?;
        let offset = self.u64(&format!("the offset of tensor '{name}'"))?;
        Ok((name, dims, ty, offset))
    }

    /// Sizes from the dims and type, and the data range against the file.
    fn check_tensor(
        &self,
        name: String,
        dims: Vec<u64>,
        ty: GgmlType,
        rel: u64,
        data_start: u64,
        alignment: u64,
    ) -> Result<TensorInfo> {
        let err = |m: String| self.tensor_err(&name, m);
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .and_then(|n| usize::try_from(n).ok())
            .ok_or_else(|| err(format!("dims {dims:?} overflow the element count")))?;
        let bs = ty.block_size() as u64;
        if !dims[0].is_multiple_of(bs) {
            return Err(err(format!(
                "rows of {} elements are not a whole number of {ty} blocks ({bs} elements)",
                dims[0]
            )));
        }
        let n_bytes = (n_elements / ty.block_size())
            .checked_mul(ty.type_size())
            .ok_or_else(|| err(format!("dims {dims:?} overflow the byte size")))?;
        if !rel.is_multiple_of(alignment) {
            return Err(err(format!(
                "data offset {rel} is not a multiple of the alignment {alignment}"
            )));
        }
        let start = data_start.checked_add(rel);
        let end = start.and_then(|s| s.checked_add(n_bytes as u64));
        match (start, end) {
            (Some(start), Some(end)) if end <= self.len => {
                Ok(TensorInfo { name, dims, ggml_type: ty, offset: start, n_elements, n_bytes })
            }
            _ => Err(err(format!(
                "{n_bytes} bytes of {ty} data at byte {} run past the end of the file ({} bytes); the file is truncated",
                data_start as u128 + rel as u128,
                self.len
            ))),
        }
    }

    fn value(&mut self, ty: u32, key: &str, depth: usize) -> Result<Value> {
        let what = format!("metadata '{key}'");
        let at = self.pos;
        Ok(match ty {
            T_U8 => Value::U8(u8::from_le_bytes(self.array(&what)?)),
            T_I8 => Value::I8(i8::from_le_bytes(self.array(&what)?)),
            T_U16 => Value::U16(u16::from_le_bytes(self.array(&what)?)),
            T_I16 => Value::I16(i16::from_le_bytes(self.array(&what)?)),
            T_U32 => Value::U32(self.u32(&what)?),
            T_I32 => Value::I32(i32::from_le_bytes(self.array(&what)?)),
            T_U64 => Value::U64(self.u64(&what)?),
            T_I64 => Value::I64(i64::from_le_bytes(self.array(&what)?)),
            T_F32 => Value::F32(f32::from_le_bytes(self.array(&what)?)),
            T_F64 => Value::F64(f64::from_le_bytes(self.array(&what)?)),
            T_BOOL => Value::Bool(self.bool(&what, at)?),
            T_STRING => Value::String(self.string(&what)?),
            T_ARRAY => Value::Array(self.array_value(key, depth)?),
            other => {
                return Err(self.format_err(
                    at - 4,
                    format!("metadata '{key}' has unknown value type {other}"),
                ));
            }
        })
    }

    fn bool(&mut self, what: &str, at: u64) -> Result<bool> {
        match self.array::<1>(what)?[0] {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.format_err(at, format!("{what}: {b} is not a bool (0 or 1)"))),
        }
    }

    fn array_value(&mut self, key: &str, depth: usize) -> Result<Array> {
        let at = self.pos;
        if depth >= MAX_ARRAY_DEPTH {
            return Err(self.format_err(
                at,
                format!("metadata '{key}': arrays nested more than {MAX_ARRAY_DEPTH} deep"),
            ));
        }
        let what = format!("metadata '{key}'");
        let ty = self.u32(&what)?;
        let n = self.u64(&what)?;
        let min = min_size(ty).ok_or_else(|| {
            self.format_err(at, format!("metadata '{key}' is an array of unknown value type {ty}"))
        })?;
        if n.saturating_mul(min) > self.remaining() {
            return Err(self.format_err(
                at + 4,
                format!(
                    "metadata '{key}': an array of {n} elements cannot fit in the {} bytes left; the file is corrupt or truncated",
                    self.remaining()
                ),
            ));
        }
        let n = n as usize;
        Ok(match ty {
            T_U8 => Array::U8(self.bytes(n, &what)?),
            T_I8 => numeric_array!(self, n, &what, i8, I8),
            T_U16 => numeric_array!(self, n, &what, u16, U16),
            T_I16 => numeric_array!(self, n, &what, i16, I16),
            T_U32 => numeric_array!(self, n, &what, u32, U32),
            T_I32 => numeric_array!(self, n, &what, i32, I32),
            T_U64 => numeric_array!(self, n, &what, u64, U64),
            T_I64 => numeric_array!(self, n, &what, i64, I64),
            T_F32 => numeric_array!(self, n, &what, f32, F32),
            T_F64 => numeric_array!(self, n, &what, f64, F64),
            T_BOOL => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    let at = self.pos;
                    v.push(self.bool(&what, at)?);
                }
                Array::Bool(v)
            }
            T_STRING => {
                let mut v = Vec::with_capacity(n);
                for i in 0..n {
                    v.push(self.string(&format!("metadata '{key}' element {i}"))?);
                }
                Array::String(v)
            }
            _ => {
                let mut v = Vec::with_capacity(n);
                for _ in 0..n {
                    v.push(self.array_value(key, depth + 1)?);
                }
                Array::Array(v)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf").join(name)
    }

    /// A GGUF file built by hand, for headers the Python writer would never produce.
    struct Bytes(Vec<u8>);

    impl Bytes {
        fn header(version: u32, tensors: u64, kvs: u64) -> Self {
            let mut b = Bytes(b"GGUF".to_vec());
            b.u32(version).u64(tensors).u64(kvs);
            b
        }
        fn u32(&mut self, v: u32) -> &mut Self {
            self.0.extend(v.to_le_bytes());
            self
        }
        fn u64(&mut self, v: u64) -> &mut Self {
            self.0.extend(v.to_le_bytes());
            self
        }
        fn str(&mut self, s: &str) -> &mut Self {
            self.u64(s.len() as u64);
            self.0.extend(s.as_bytes());
            self
        }
        /// A tensor info with `dims`, ggml type id and relative offset.
        fn tensor(&mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> &mut Self {
            self.str(name).u32(dims.len() as u32);
            for &d in dims {
                self.u64(d);
            }
            self.u32(ty).u64(offset)
        }
        fn pad_to(&mut self, align: usize) -> &mut Self {
            while !self.0.len().is_multiple_of(align) {
                self.0.push(0);
            }
            self
        }
        fn open(&self, name: &str) -> Result<GgufFile> {
            let path = std::env::temp_dir().join(format!("miles-gguf-{name}.gguf"));
            std::fs::write(&path, &self.0).unwrap();
            GgufFile::open(&path)
        }
        fn err(&self, name: &str) -> String {
            self.open(name).expect_err("the file is refused").to_string()
        }
    }

    #[test]
    fn reads_every_metadata_value_type_of_the_fixture() {
        let g = GgufFile::open(&fixture("dequant.gguf")).unwrap();
        assert_eq!((g.version, g.alignment), (3, DEFAULT_ALIGNMENT));
        let m = &g.metadata;
        assert_eq!(m.str("general.architecture").unwrap(), "fixture");
        let v = |k: &str| m.get(k).unwrap().clone();
        assert_eq!(v("fixture.u8"), Value::U8(200));
        assert_eq!(v("fixture.i8"), Value::I8(-100));
        assert_eq!(v("fixture.u16"), Value::U16(60000));
        assert_eq!(v("fixture.i16"), Value::I16(-30000));
        assert_eq!(v("fixture.u32"), Value::U32(4_000_000_000));
        assert_eq!(v("fixture.i32"), Value::I32(-2_000_000_000));
        assert_eq!(v("fixture.u64"), Value::U64((1 << 63) + 5));
        assert_eq!(v("fixture.i64"), Value::I64(-(1 << 62)));
        assert_eq!(v("fixture.f32"), Value::F32(0.15625));
        assert_eq!(v("fixture.f64"), Value::F64(-2.5e-300));
        assert_eq!(v("fixture.bool"), Value::Bool(true));
        assert_eq!(v("fixture.string"), Value::String("héllo ✓".into()));
        let strings = ["a", "", "日本"].map(String::from).to_vec();
        assert_eq!(v("fixture.strings"), Value::Array(Array::String(strings)));
        assert_eq!(v("fixture.i32s"), Value::Array(Array::I32(vec![1, -2, 3])));
        assert_eq!(v("fixture.f32s"), Value::Array(Array::F32(vec![0.5, -1.0])));
        let Value::Array(Array::Array(nested)) = v("fixture.nested") else { panic!() };
        assert_eq!(nested.len(), 2);
        assert_eq!(nested[0].as_i128s(), Some(vec![1, 2]));
        assert_eq!(nested[1].as_i128s(), Some(vec![3]));
        let Value::Array(Array::Array(nested)) = v("fixture.nested_strings") else { panic!() };
        assert_eq!(nested[1], Array::String(vec!["z".into()]));
        assert_eq!(m.opt_usize("fixture.u8").unwrap(), Some(200));
        let e = m.opt_usize("fixture.i8").unwrap_err().to_string();
        assert!(e.ends_with("metadata 'fixture.i8': -100 is not a valid count or size"), "{e}");
        let e = m.opt_bool("fixture.string").unwrap_err().to_string();
        assert!(e.ends_with("metadata 'fixture.string': expected a bool, found string"), "{e}");
    }

    /// gguf-py quantized (or, for K-quants, drew random blocks) and dequantized each tensor;
    /// ours must agree exactly: the same f32 operations in the same order.
    #[test]
    fn dequantizes_every_supported_type_like_gguf_py() {
        let g = GgufFile::open(&fixture("dequant.gguf")).unwrap();
        for ty in crate::dequant::SUPPORTED {
            let t = g.tensor(ty.name()).unwrap_or_else(|| panic!("fixture has {ty}"));
            assert_eq!((t.ggml_type, t.shape()), (ty, vec![2, 512]));
            let reference = g.tensor(&format!("{ty}.ref")).unwrap();
            assert_eq!(reference.ggml_type, GgmlType::F32);
            let (ours, theirs) = (g.dequantize(t).unwrap(), g.dequantize(reference).unwrap());
            let bad = ours.iter().zip(&theirs).position(|(a, b)| a.to_bits() != b.to_bits());
            assert_eq!(bad, None, "{ty}: element {bad:?} differs");
            assert!(ours.iter().any(|v| *v != 0.0), "{ty}: all zero");
        }
        let q5 = g.tensor("Q5_0").unwrap();
        let err = g.dequantize(q5).unwrap_err().to_string();
        assert!(
            err.ends_with("tensor 'Q5_0': ggml type Q5_0 is not supported; supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K"),
            "{err}"
        );
    }

    #[test]
    fn bad_magic_versions_and_short_headers_are_named() {
        let e = Bytes(b"GGU".to_vec()).err("short");
        assert!(
            e.ends_with(
                "short.gguf: at byte 0: not a GGUF file: it is 3 bytes, shorter than the magic"
            ),
            "{e}"
        );
        let e = Bytes(b"GGML\x03\0\0\0".to_vec()).err("magic");
        assert!(e.contains("at byte 0: not a GGUF file: the magic is \"GGML\""), "{e}");
        let e = Bytes::header(1, 0, 0).err("v1");
        assert!(
            e.contains("at byte 4: GGUF version 1 is not supported (only versions 2 and 3)"),
            "{e}"
        );
        let e = Bytes::header(4, 0, 0).err("v4");
        assert!(e.contains("GGUF version 4 is not supported"), "{e}");
        let e = Bytes::header(3u32.swap_bytes(), 0, 0).err("be");
        assert!(e.contains("big-endian GGUF is not supported"), "{e}");
        let mut b = Bytes::header(3, 0, 0);
        b.0.truncate(12);
        let e = b.err("count");
        assert!(e.contains("at byte 8: truncated file: the tensor count needs 8 bytes but the file ends at byte 12"), "{e}");
        let e = Bytes::header(2, 0, 0).open("empty-v2").unwrap();
        assert!(e.tensors.is_empty() && e.metadata.entries().is_empty());
    }

    #[test]
    fn garbage_lengths_are_refused_before_allocating() {
        let e = Bytes::header(3, 0, u64::MAX).err("kv-count");
        assert!(
            e.contains("metadata count 18446744073709551615 cannot fit in the file (24 bytes)"),
            "{e}"
        );
        let e = Bytes::header(3, 1 << 40, 0).err("tensor-count");
        assert!(e.contains("tensor count 1099511627776 cannot fit"), "{e}");
        let mut b = Bytes::header(3, 0, 1);
        b.u64(1 << 60).0.extend([0; 16]);
        let e = b.err("key-len");
        assert!(e.contains("at byte 24: metadata key 0: string length 1152921504606846976 runs past the end of the file (48 bytes)"), "{e}");
        let mut b = Bytes::header(3, 0, 1);
        b.str("k").u32(9).u32(8).u64(1 << 50);
        let e = b.err("array-len");
        assert!(
            e.contains("metadata 'k': an array of 1125899906842624 elements cannot fit"),
            "{e}"
        );
        let mut b = Bytes::header(3, 0, 1);
        b.str("k").u32(13).u32(0);
        let e = b.err("value-type");
        assert!(e.contains("metadata 'k' has unknown value type 13"), "{e}");
        let mut b = Bytes::header(3, 0, 1);
        b.str("deep").u32(9);
        for _ in 0..20 {
            b.u32(9).u64(1);
        }
        b.0.extend([0; 64]);
        let e = b.err("deep");
        assert!(e.contains("metadata 'deep': arrays nested more than 8 deep"), "{e}");
        let mut b = Bytes::header(3, 0, 2);
        b.str("k").u32(4).u32(1).str("k").u32(4).u32(2);
        assert!(b.err("dup").contains("metadata key 'k' appears twice"));
        let mut b = Bytes::header(3, 0, 1);
        b.str("general.alignment").u32(4).u32(48);
        assert!(b.err("align").contains("metadata 'general.alignment': must be a power of two"));
    }

    #[test]
    fn bad_tensor_infos_name_the_tensor() {
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[4], 99, 0);
        let e = b.err("type");
        assert!(e.contains("tensor 'w' has unknown ggml type id 99"), "{e}");
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[1 << 32, 1 << 32, 1 << 32], 0, 0);
        let e = b.err("overflow");
        assert!(
            e.ends_with(
                "tensor 'w': dims [4294967296, 4294967296, 4294967296] overflow the element count"
            ),
            "{e}"
        );
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[1, 1, 1, 1, 1], 0, 0);
        assert!(b.err("dims").contains("tensor 'w' has 5 dimensions (ggml allows 1 to 4)"));
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[48], 12, 0);
        let e = b.err("blocks");
        assert!(e.contains("tensor 'w': rows of 48 elements are not a whole number of Q4_K blocks (256 elements)"), "{e}");
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[8], 0, 0).pad_to(32).0.extend([0; 16]);
        let e = b.err("past-end");
        assert!(e.contains("tensor 'w': 32 bytes of F32 data at byte 64 run past the end of the file (80 bytes); the file is truncated"), "{e}");
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[8], 0, 4).pad_to(32).0.extend([0; 64]);
        assert!(
            b.err("misaligned").contains("data offset 4 is not a multiple of the alignment 32")
        );
        let mut b = Bytes::header(3, 2, 0);
        b.tensor("w", &[8], 0, 0).tensor("w", &[8], 0, 32).pad_to(32).0.extend([0; 64]);
        assert!(b.err("dup-tensor").contains("tensor 'w': appears twice in the tensor list"));
        let mut b = Bytes::header(3, 1, 0);
        b.tensor("w", &[2, 2], 0, 0).pad_to(32);
        b.0.extend([1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|v| v.to_le_bytes()));
        let g = b.open("good").unwrap();
        let t = g.tensor("w").unwrap();
        assert_eq!((t.shape(), t.offset, t.n_bytes), (vec![2, 2], 96, 16));
        assert_eq!(g.dequantize(t).unwrap(), vec![1.0, 2.0, 3.0, 4.0]);
    }
}
