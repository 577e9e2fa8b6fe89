//! Trainer checkpoints in slime's layout, written atomically, resumed bit-exactly.
//!
//! ```text
//! <root>/
//!   latest_checkpointed_iteration.txt   the iteration of the newest complete checkpoint
//!   iter_0000010/
//!     config.json                       HF config (torch_dtype float32)
//!     model.safetensors                 the weights in F32, HF names: transformers loads the dir
//!     tokenizer.json, tokenizer_config.json, special_tokens_map.json,
//!     generation_config.json, chat_template.jinja    copied from the tokenizer dir, if given
//!     optimizer.safetensors             AdamW moments in F32: `exp_avg.<hf name>`,
//!                                       `exp_avg_sq.<hf name>`; the step count in the
//!                                       metadata (`"step"`)
//!     trainer_state.json                the loop's own state (opaque JSON), pretty-printed
//!     <name>.safetensors                extra weight sets (e.g. `ref`, a frozen reference), F32
//!     draft/                            a speculative draft's MTP layer (`model.safetensors` in
//!                                       its DeepSeek-V3 or MiMo names: a draft directory
//!                                       `--sglang-speculative-draft-model-path` reads), its
//!                                       AdamW moments as drafts of the same names in
//!                                       `exp_avg/` and `exp_avg_sq/`, the step count in
//!                                       `optimizer.json`
//! ```
//!
//! Weights, moments and the step are stored exactly (F32, no rounding), so a resumed run takes
//! the same optimizer steps, bit for bit, as one that never stopped.
//!
//! # Atomicity
//!
//! [`save`] writes everything into `<root>/.iter_0000010.tmp/` (a stale one from a crashed save
//! is removed first), fsyncs every file and the directory, renames it to `iter_0000010` and
//! fsyncs `<root>`; only then does it rewrite the pointer, through a temporary file, fsync,
//! rename and another fsync of `<root>`. A crash at any point leaves the previous checkpoint and
//! the pointer to it intact: loading follows the pointer only, so half-written `.tmp`
//! directories are never read. Re-saving an iteration that already exists moves the old
//! directory aside to `.iter_0000010.old` first and deletes it after the new one is in place;
//! if a crash falls between those two renames, loading that iteration reads the `.old` copy.
//!
//! # A full disk
//!
//! [`save`] first compares the bytes the checkpoint needs with the space free under `<root>`
//! and stops before writing anything when they do not fit; a disk that fills up during the
//! save anyway (another writer, a quota) fails the write. Either way the error is
//! [`Error::NoSpace`], naming the path and the bytes needed and free; the temporary directory
//! is removed so that its space comes back, and the pointer still names the previous
//! checkpoint. [`export_hf`] does the same.
//!
//! # Fault injection
//!
//! The environment variable `MILES_FAULT` injects faults into [`save`], right after
//! `model.safetensors` has been written into the temporary directory, before anything is
//! renamed: `abort-during-save` calls [`std::process::abort`]; `enospc-during-save` (any save)
//! or `enospc-during-save:N` (the save of iteration N) half-writes `optimizer.safetensors`
//! and fails it with ENOSPC, as a disk filling up would. The integration suite checks that the
//! previous checkpoint still loads and the run resumes from it exactly.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use miles_core::Quantizer;
use miles_model::config::config_path;
use miles_model::draft::{Draft, DraftFormat};
use miles_model::file_layout::{file_name, file_tensors, weights_from_files};
use miles_model::{ModelConfig, Weights};
use miles_tensor::cpu::AdamW;
use safetensors::tensor::View;
use safetensors::{Dtype, SafeTensorError, SafeTensors};

use crate::Optimizer;

/// The pointer file slime and Megatron keep next to the iteration directories.
pub const POINTER_FILE: &str = "latest_checkpointed_iteration.txt";
pub const MODEL_FILE: &str = "model.safetensors";
pub const OPTIMIZER_FILE: &str = "optimizer.safetensors";
pub const STATE_FILE: &str = "trainer_state.json";
/// Copied from a tokenizer directory: the first is required, the others when present.
pub const TOKENIZER_FILES: [&str; 5] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
];
/// The environment variable of the injected faults (see the module docs).
pub const FAULT_ENV: &str = "MILES_FAULT";

const EXP_AVG: &str = "exp_avg.";
const EXP_AVG_SQ: &str = "exp_avg_sq.";
const STEP_KEY: &str = "step";

/// Errors of saving and loading checkpoints; each names the file or directory at fault.
#[derive(Debug)]
pub enum Error {
    /// What is wrong with a file or directory of a checkpoint.
    At { path: PathBuf, message: String },
    /// An I/O operation on a path failed.
    Io { path: PathBuf, source: std::io::Error },
    /// Reading weights or a config (these messages name their files too).
    Model(miles_model::Error),
    /// A bad argument.
    Invalid(String),
    /// A file that is not as it was saved ([`manifest::verify`]).
    Damaged { path: PathBuf, message: String },
    /// The disk under `path` has no room for a checkpoint or export: `needed` bytes in all,
    /// `free` when known. Nothing of it was kept.
    NoSpace { path: PathBuf, needed: u64, free: Option<u64> },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::At { path, message } | Error::Damaged { path, message } => {
                write!(f, "{}: {message}", path.display())
            }
            Error::Io { path, source } => write!(f, "{}: {source}", path.display()),
            Error::Model(e) => write!(f, "{e}"),
            Error::Invalid(message) => f.write_str(message),
            Error::NoSpace { path, needed, free } => {
                write!(f, "{}: no space left on the device: the save needs ", path.display())?;
                write!(f, "{}", bytes(*needed))?;
                match free {
                    Some(free) => write!(f, " and {} is free there", bytes(*free))?,
                    None => write!(f, " (the free space is unknown)")?,
                }
                f.write_str("; its partial files were removed")
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(source),
            Error::Model(e) => Some(e),
            _ => None,
        }
    }
}

impl From<miles_model::Error> for Error {
    fn from(e: miles_model::Error) -> Self {
        Error::Model(e)
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `1234567890 bytes (1.15 GiB)`.
fn bytes(n: u64) -> String {
    let gib = n as f64 / (1u64 << 30) as f64;
    if gib >= 0.1 {
        format!("{n} bytes ({gib:.2} GiB)")
    } else {
        format!("{n} bytes ({:.1} MiB)", n as f64 / (1u64 << 20) as f64)
    }
}

fn at(path: &Path, message: impl Into<String>) -> Error {
    Error::At { path: path.to_path_buf(), message: message.into() }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io { path: path.to_path_buf(), source }
}

/// What one checkpoint holds, borrowed from the loop.
#[derive(Debug, Clone, Copy)]
pub struct CheckpointRef<'a> {
    pub config: &'a ModelConfig,
    pub weights: &'a Weights,
    pub optimizer: &'a Optimizer,
    /// The loop's state (rollout id, data cursor, counters), stored as given.
    pub state: &'a serde_json::Value,
    /// Where to copy the tokenizer files from (`tokenizer.json` required).
    pub tokenizer_dir: Option<&'a Path>,
    /// Further weight sets of the same shapes, saved as `<name>.safetensors`.
    pub extra: &'a [(&'a str, &'a Weights)],
    /// The speculative draft, when the run has one.
    pub draft: Option<&'a DraftState>,
}

/// A speculative draft as a checkpoint holds it: its MTP layer, and once trained its AdamW
/// moments (drafts of the same shape) and step count.
#[derive(Debug, Clone, PartialEq)]
pub struct DraftState {
    pub draft: Draft,
    pub moments: Option<(Draft, Draft, u64)>,
}

/// The draft's directory in a checkpoint, and its parts there.
pub const DRAFT_DIR: &str = "draft";
const DRAFT_MOMENTS: [&str; 2] = ["exp_avg", "exp_avg_sq"];
const DRAFT_OPTIMIZER: &str = "optimizer.json";

/// A checkpoint read back by [`load`].
#[derive(Debug, Clone)]
pub struct Loaded {
    pub iteration: u64,
    /// The directory it was read from.
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub weights: Weights,
    pub optimizer: Optimizer,
    pub state: serde_json::Value,
    /// The extra weight sets asked for, in the order asked.
    pub extra: Vec<(String, Weights)>,
    /// The speculative draft, when the checkpoint has one.
    pub draft: Option<DraftState>,
}

/// `iter_0000010`: the directory name of an iteration (7 digits, as slime writes them).
pub fn iter_dir_name(iteration: u64) -> String {
    format!("iter_{iteration:07}")
}

/// `<root>/iter_0000010`.
pub fn iter_dir(root: &Path, iteration: u64) -> PathBuf {
    root.join(iter_dir_name(iteration))
}

/// `<parent>/.<name><suffix>`, next to `path`.
fn beside(path: &Path, suffix: &str) -> Result<PathBuf> {
    let name = path.file_name().ok_or_else(|| {
        Error::Invalid(format!("{}: not a directory name to write to", path.display()))
    })?;
    Ok(parent_of(path).join(format!(".{}{suffix}", name.to_string_lossy())))
}

/// The directory holding `path` (`.` for a bare name).
fn parent_of(path: &Path) -> PathBuf {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    }
}

/// Whether anything (a file, a directory, a dangling link) is at `path`.
fn present(path: &Path) -> bool {
    fs::symlink_metadata(path).is_ok()
}

fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

fn sync_file(path: &Path) -> Result<()> {
    File::open(path).and_then(|f| f.sync_all()).map_err(io(path))
}

/// Writes `bytes` to `path` and fsyncs it.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(bytes).and_then(|()| f.sync_all()).map_err(io(path))
}

/// Creates `dir` (and its parents), fsyncing the parent of each directory it made.
fn create_dirs(dir: &Path) -> Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    let parent = parent_of(dir);
    if dir.parent().is_some_and(|p| !p.as_os_str().is_empty()) {
        create_dirs(&parent)?;
    }
    match fs::create_dir(dir) {
        Ok(()) => sync_dir(&parent),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dir.is_dir() => Ok(()),
        Err(e) => Err(Error::Io { path: dir.to_path_buf(), source: e }),
    }
}

/// Makes the empty directory `tmp`, removing a stale one left by a crash. Something other than
/// a directory there is an error (it is not ours to delete).
fn fresh_tmp_dir(tmp: &Path) -> Result<()> {
    if let Ok(meta) = fs::symlink_metadata(tmp) {
        if !meta.is_dir() {
            return Err(at(
                tmp,
                "exists and is not a directory; it is in the way of the checkpoint's \
                 temporary directory: remove it",
            ));
        }
        fs::remove_dir_all(tmp).map_err(io(tmp))?;
    }
    fs::create_dir(tmp).map_err(io(tmp))
}

/// Moves the complete, synced directory `tmp` to `dst`, replacing what is there, and fsyncs
/// their parent. An existing `dst` is renamed to `.<dst>.old` first and deleted after.
fn commit_dir(tmp: &Path, dst: &Path) -> Result<()> {
    let parent = parent_of(dst);
    let old = beside(dst, ".old")?;
    if present(dst) {
        if present(&old) {
            // `dst` is complete, so an `.old` beside it is garbage from an earlier crash.
            fs::remove_dir_all(&old).map_err(io(&old))?;
        }
        fs::rename(dst, &old).map_err(io(dst))?;
    }
    fs::rename(tmp, dst).map_err(io(tmp))?;
    sync_dir(&parent)?;
    if present(&old) {
        fs::remove_dir_all(&old).map_err(io(&old))?;
    }
    Ok(())
}

/// An F32 tensor for safetensors, encoded only when written (one tensor in memory at a time).
/// A tensor as written: f32 values, or FP8 E4M3 codes.
enum TensorView<'a> {
    F32 {
        shape: Vec<usize>,
        data: Cow<'a, [f32]>,
    },
    /// Little-endian bytes of another dtype (E4M3 codes, INT4 words, shapes).
    Raw {
        dtype: Dtype,
        shape: Vec<usize>,
        bytes: Vec<u8>,
    },
}

impl View for TensorView<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            TensorView::F32 { .. } => Dtype::F32,
            TensorView::Raw { dtype, .. } => *dtype,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            TensorView::F32 { shape, .. } | TensorView::Raw { shape, .. } => shape,
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        match self {
            TensorView::F32 { data, .. } => {
                Cow::Owned(data.iter().flat_map(|v| v.to_le_bytes()).collect())
            }
            TensorView::Raw { bytes, .. } => Cow::Borrowed(bytes),
        }
    }
    fn data_len(&self) -> usize {
        match self {
            TensorView::F32 { data, .. } => data.len() * 4,
            TensorView::Raw { bytes, .. } => bytes.len(),
        }
    }
}

/// Named tensors, as written.
type NamedViews<'a> = Vec<(String, TensorView<'a>)>;

/// An HF export in FP8 (`--save-hf` with `--fp8-format`): the weights `names` (those the FP8
/// forward reads) as E4M3 codes with their `<name>_scale_inv` blocks, quantized by the fp8
/// plugin's host reference (the device's codes, bit for bit), and config.json's
/// `quantization_config` saying so, as DeepSeek-V3's checkpoints and SGLang/vLLM have it.
pub struct QuantExport<'a> {
    pub quantizer: &'a dyn Quantizer,
    pub names: Vec<String>,
}

/// The tensors of `w` named `<prefix><file name>` (as HF files hold them: file_layout).
fn named<'a>(config: &ModelConfig, w: &'a Weights, prefix: &str) -> NamedViews<'a> {
    file_tensors(config, w)
        .into_iter()
        .map(|(name, shape, data)| (format!("{prefix}{name}"), TensorView::F32 { shape, data }))
        .collect()
}

/// Writes a safetensors file and fsyncs it.
fn write_tensors(
    path: &Path,
    tensors: NamedViews<'_>,
    metadata: HashMap<String, String>,
) -> Result<()> {
    safetensors::serialize_to_file(tensors, Some(metadata), path).map_err(|e| match e {
        SafeTensorError::IoError(source) => Error::Io { path: path.to_path_buf(), source },
        other => at(path, format!("cannot write safetensors: {other}")),
    })?;
    sync_file(path)
}

fn pt_metadata() -> HashMap<String, String> {
    HashMap::from([("format".to_string(), "pt".to_string())])
}

/// Errors unless `w` has the shapes of `config`, saying which weights are wrong.
fn check_shapes(config: &ModelConfig, w: &Weights, what: &str) -> Result<()> {
    w.check(config).map_err(|e| Error::Invalid(format!("cannot save {what}: {e}")))
}

/// Writes `config.json` and `model.safetensors` (F32, or with `fp8` those weights in E4M3)
/// into `dir`.
/// `extra` tensors follow the model's (a DeepSeek-V3 export's MTP layer, unquantized).
fn write_config_and_model(
    dir: &Path,
    config: &ModelConfig,
    weights: &Weights,
    quant: Option<&QuantExport<'_>>,
    extra: NamedViews<'_>,
) -> Result<()> {
    let path = config_path(dir);
    let mut json = config.to_hf_json("float32");
    let mut tensors = named(config, weights, "");
    tensors.extend(extra);
    if let Some(quant) = quant {
        let kept;
        // (Named as the files name them: GLM-4's gate and up are one tensor there.)
        let names: Vec<String> = quant.names.iter().map(|n| file_name(config, n)).collect();
        let format = quant.quantizer.format();
        json["quantization_config"] = match format.name.as_str() {
            "fp8_e4m3" => {
                (tensors, kept) = quantized(tensors, quant, &names)?;
                serde_json::json!({
                    "quant_method": "fp8",
                    "fmt": "e4m3",
                    "activation_scheme": "dynamic",
                    "weight_block_size": format.block,
                    "modules_to_not_convert": kept,
                })
            }
            "int4_packed" => {
                (tensors, kept) = quantized(tensors, quant, &names)?;
                compressed_tensors_config(format.block[1], kept)
            }
            other => {
                return Err(Error::Invalid(format!("no export writes the {other} format")));
            }
        };
    }
    let text = serde_json::to_string_pretty(&json)
        .map_err(|e| at(&path, format!("cannot encode the config: {e}")))?;
    write_synced(&path, text.as_bytes())?;
    write_tensors(&dir.join(MODEL_FILE), tensors, pt_metadata())
}

/// compressed-tensors' `quantization_config` of symmetric INT4 groups of `group` inputs,
/// weights only, with the modules `ignore`d (what vLLM and SGLang read).
fn compressed_tensors_config(group: usize, ignore: Vec<String>) -> serde_json::Value {
    serde_json::json!({
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": true,
                    "strategy": "group",
                    "group_size": group,
                    "dynamic": false,
                    "actorder": null,
                    "observer": "minmax",
                    "observer_kwargs": {},
                    "block_structure": null,
                },
                "input_activations": null,
                "output_activations": null,
            }
        },
        "ignore": ignore,
    })
}

/// `tensors` with `names` quantized (FP8: the E4M3 codes, each preceded by its
/// `_scale_inv`; INT4: compressed-tensors' `_packed`, `_scale` and `_shape`), and the modules
/// of the linear layers left unquantized (LM head, routers, layers kept out).
fn quantized<'a>(
    tensors: NamedViews<'a>,
    quant: &QuantExport<'_>,
    names: &[String],
) -> Result<(NamedViews<'a>, Vec<String>)> {
    let (mut out, mut kept) = (Vec::with_capacity(tensors.len()), Vec::new());
    for (name, view) in tensors {
        let TensorView::F32 { shape, data } = &view else {
            unreachable!("named() gives f32 views")
        };
        if !names.contains(&name) {
            if shape.len() == 2 && name != "model.embed_tokens.weight" {
                kept.push(name.trim_end_matches(".weight").to_string());
            }
            out.push((name, view));
            continue;
        }
        let q = quant
            .quantizer
            .quantize(&miles_core::WeightView { name: &name, shape, data })
            .map_err(|e| Error::Invalid(format!("{} export of {name}: {e}", q_name(quant))))?;
        let [br, bc] = q.format.block;
        let scales = vec![shape[0].div_ceil(br), shape[1].div_ceil(bc)];
        let shape = shape.clone();
        if q.format.bits == 4 {
            let (rows, cols) = (shape[0], shape[1]);
            let packed = vec![rows, cols.div_ceil(8)];
            let dims: Vec<u8> =
                [rows as i64, cols as i64].iter().flat_map(|d| d.to_le_bytes()).collect();
            out.push((
                format!("{name}_packed"),
                TensorView::Raw { dtype: Dtype::I32, shape: packed, bytes: q.data },
            ));
            out.push((
                format!("{name}_scale"),
                TensorView::F32 { shape: scales, data: q.scales.into() },
            ));
            out.push((
                format!("{name}_shape"),
                TensorView::Raw { dtype: Dtype::I64, shape: vec![2], bytes: dims },
            ));
            continue;
        }
        out.push((
            format!("{name}_scale_inv"),
            TensorView::F32 { shape: scales, data: q.scales.into() },
        ));
        out.push((name, TensorView::Raw { dtype: Dtype::F8_E4M3, shape, bytes: q.data }));
    }
    // A tied head has no tensor of its own, but the module is there and stays unconverted.
    if !kept.iter().any(|k| k == "lm_head") {
        kept.insert(0, "lm_head".into());
    }
    Ok((out, kept))
}

fn q_name(quant: &QuantExport<'_>) -> &'static str {
    if quant.quantizer.format().bits == 4 { "INT4" } else { "FP8" }
}

fn copy_tokenizer(from: &Path, dir: &Path) -> Result<()> {
    for (k, name) in TOKENIZER_FILES.iter().enumerate() {
        let src = from.join(name);
        let bytes = match fs::read(&src) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && k > 0 => continue,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(at(&src, "missing: the tokenizer directory must hold tokenizer.json"));
            }
            Err(source) => return Err(Error::Io { path: src, source }),
        };
        write_synced(&dir.join(name), &bytes)?;
    }
    Ok(())
}

fn check_extra_names<'a>(names: impl IntoIterator<Item = &'a str>) -> Result<()> {
    let mut seen = Vec::new();
    for name in names {
        let ok = !name.is_empty()
            && !name.starts_with('.')
            && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
            && !matches!(name, "model" | "optimizer");
        if !ok {
            return Err(Error::Invalid(format!(
                "extra weight set '{name}': the name must be letters, digits, '_', '-' or '.', \
                 not start with '.', and not be 'model' or 'optimizer'"
            )));
        }
        if seen.contains(&name) {
            return Err(Error::Invalid(format!("extra weight set '{name}' is given twice")));
        }
        seen.push(name);
    }
    Ok(())
}

/// A fault `MILES_FAULT` injects into the save of `iteration` (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Fault {
    Abort,
    NoSpace,
}

fn fault_in_save(iteration: u64) -> Option<Fault> {
    let spec = std::env::var(FAULT_ENV).ok()?;
    match spec.split_once(':') {
        _ if spec == "abort-during-save" => Some(Fault::Abort),
        _ if spec == "enospc-during-save" => Some(Fault::NoSpace),
        Some(("enospc-during-save", at)) if at.parse() == Ok(iteration) => Some(Fault::NoSpace),
        _ => None,
    }
}

/// What a disk that fills up does to a write: part of the file lands, then ENOSPC.
fn write_until_full(path: &Path) -> Result<()> {
    let mut f = File::create(path).map_err(io(path))?;
    f.write_all(&[0u8; 4096]).map_err(io(path))?;
    Err(Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::from_raw_os_error(libc::ENOSPC),
    })
}

/// The bytes a checkpoint of `ckpt` takes: its tensors' data, the tokenizer files, and room
/// for headers and the small JSON files.
fn checkpoint_bytes(ckpt: &CheckpointRef) -> Result<u64> {
    let floats = |w: &Weights| w.tensors().iter().map(|t| t.len() as u64).sum::<u64>();
    let mut n = 3 * floats(ckpt.weights);
    n += ckpt.extra.iter().map(|(_, w)| floats(w)).sum::<u64>();
    if let Some(d) = ckpt.draft {
        let draft: u64 =
            d.draft.named(ckpt.config)?.iter().map(|(_, _, data)| data.len() as u64).sum();
        n += if d.moments.is_some() { 3 * draft } else { draft };
    }
    let mut total = 4 * n + (1 << 20);
    if let Some(dir) = ckpt.tokenizer_dir {
        for name in TOKENIZER_FILES {
            total += fs::metadata(dir.join(name)).map_or(0, |m| m.len());
        }
    }
    Ok(total)
}

/// The bytes free to an unprivileged writer on the filesystem holding `dir`, when the system
/// says.
fn free_bytes(dir: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut stat = std::mem::MaybeUninit::<libc::statvfs>::zeroed();
    // SAFETY: `path` is a NUL-terminated string and `stat` a buffer of the struct statvfs
    // fills; it is read only when the call succeeds.
    let stat = unsafe {
        if libc::statvfs(path.as_ptr(), stat.as_mut_ptr()) != 0 {
            return None;
        }
        stat.assume_init()
    };
    Some(stat.f_bavail as u64 * stat.f_frsize as u64)
}

/// Whether `e` is a write failing for want of space (ENOSPC, EDQUOT).
fn out_of_space(e: &Error) -> bool {
    use std::io::ErrorKind::{QuotaExceeded, StorageFull};
    matches!(e, Error::Io { source, .. } if matches!(source.kind(), StorageFull | QuotaExceeded))
}

/// Runs the writes of a checkpoint or export into `tmp` (already created); on failure removes
/// `tmp`, whose half-written files would hold on to space, and turns a full disk into
/// [`Error::NoSpace`] naming the file and the bytes `needed`.
fn writing(tmp: &Path, needed: u64, write: impl FnOnce() -> Result<()>) -> Result<()> {
    let Err(e) = write() else { return Ok(()) };
    // Best effort: the error that stopped the save is the one to report.
    let _ = fs::remove_dir_all(tmp);
    if !out_of_space(&e) {
        return Err(e);
    }
    let Error::Io { path, .. } = e else { unreachable!("out_of_space matched Io") };
    let free = free_bytes(&parent_of(tmp));
    Err(Error::NoSpace { path, needed, free })
}

/// Stops before writing anything when the filesystem under `dir` has less than `needed`
/// bytes free.
fn check_space(dir: &Path, needed: u64) -> Result<()> {
    match free_bytes(dir) {
        Some(free) if free < needed => {
            Err(Error::NoSpace { path: dir.to_path_buf(), needed, free: Some(free) })
        }
        _ => Ok(()),
    }
}

/// Saves iteration `iteration` under `root` (see the module docs for the layout and the order
/// of writes) and points `latest_checkpointed_iteration.txt` at it. Returns the directory.
pub fn save(root: &Path, iteration: u64, ckpt: &CheckpointRef) -> Result<PathBuf> {
    let config = ckpt.config;
    check_shapes(config, ckpt.weights, "the weights")?;
    let (m, v) = ckpt.optimizer.moments();
    check_shapes(config, m, "the optimizer's first moments")?;
    check_shapes(config, v, "the optimizer's second moments")?;
    check_extra_names(ckpt.extra.iter().map(|(n, _)| *n))?;
    for (name, w) in ckpt.extra {
        check_shapes(config, w, &format!("the extra weight set '{name}'"))?;
    }

    let needed = checkpoint_bytes(ckpt)?;
    create_dirs(root)?;
    check_space(root, needed)?;
    let dst = iter_dir(root, iteration);
    let tmp = beside(&dst, ".tmp")?;
    fresh_tmp_dir(&tmp)?;
    writing(&tmp, needed, || write_checkpoint(&tmp, iteration, ckpt))?;
    commit_dir(&tmp, &dst)?;
    write_pointer(root, iteration)?;
    Ok(dst)
}

/// Writes every file of a checkpoint into `tmp`, the manifest last, and syncs `tmp`.
fn write_checkpoint(tmp: &Path, iteration: u64, ckpt: &CheckpointRef) -> Result<()> {
    let config = ckpt.config;
    let (m, v) = ckpt.optimizer.moments();
    write_config_and_model(tmp, config, ckpt.weights, None, Vec::new())?;
    match fault_in_save(iteration) {
        Some(Fault::Abort) => {
            eprintln!("{FAULT_ENV}=abort-during-save: aborting in the middle of a save");
            std::process::abort();
        }
        Some(Fault::NoSpace) => return write_until_full(&tmp.join(OPTIMIZER_FILE)),
        None => {}
    }
    if let Some(from) = ckpt.tokenizer_dir {
        copy_tokenizer(from, tmp)?;
    }
    let mut moments = named(config, m, EXP_AVG);
    moments.extend(named(config, v, EXP_AVG_SQ));
    // One key: safetensors writes metadata from a HashMap, whose order would change the
    // file's bytes from run to run.
    let meta = HashMap::from([(STEP_KEY.to_string(), ckpt.optimizer.steps().to_string())]);
    write_tensors(&tmp.join(OPTIMIZER_FILE), moments, meta)?;
    for (name, w) in ckpt.extra {
        let path = tmp.join(format!("{name}.safetensors"));
        write_tensors(&path, named(config, w, ""), pt_metadata())?;
    }
    if let Some(draft) = ckpt.draft {
        save_draft(&tmp.join(DRAFT_DIR), config, draft)?;
    }
    let state_path = tmp.join(STATE_FILE);
    let mut text = serde_json::to_string_pretty(ckpt.state)
        .map_err(|e| at(&state_path, format!("cannot encode the trainer state: {e}")))?;
    text.push('\n');
    write_synced(&state_path, text.as_bytes())?;
    manifest::write(tmp)?;
    sync_dir(tmp)
}

/// Writes a draft's directory (see the module docs), every file and directory synced.
fn save_draft(dir: &Path, policy: &ModelConfig, d: &DraftState) -> Result<()> {
    let write = |dir: &Path, draft: &Draft| -> Result<()> {
        draft.save(dir, policy)?;
        sync_file(&dir.join(MODEL_FILE))?;
        sync_dir(dir)
    };
    write(dir, &d.draft)?;
    if let Some((m, v, steps)) = &d.moments {
        for (name, moment) in DRAFT_MOMENTS.iter().zip([m, v]) {
            write(&dir.join(name), moment)?;
        }
        let text = serde_json::json!({ STEP_KEY: steps }).to_string();
        write_synced(&dir.join(DRAFT_OPTIMIZER), text.as_bytes())?;
    }
    sync_dir(dir)
}

/// Reads a checkpoint's draft directory, when there is one.
fn load_draft(dir: &Path, policy: &ModelConfig) -> Result<Option<DraftState>> {
    if !dir.join(MODEL_FILE).exists() {
        return Ok(None);
    }
    let draft = Draft::load(dir, policy)?;
    let path = dir.join(DRAFT_OPTIMIZER);
    if !path.exists() {
        return Ok(Some(DraftState { draft, moments: None }));
    }
    let text = String::from_utf8(read_required(&path, "the draft's step count")?)
        .map_err(|e| at(&path, format!("not UTF-8 text: {e}")))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| at(&path, format!("not valid JSON: {e}")))?;
    let steps = json[STEP_KEY]
        .as_u64()
        .ok_or_else(|| at(&path, format!("expected {{\"{STEP_KEY}\": <n>}}, found {text}")))?;
    let m = Draft::load(&dir.join(DRAFT_MOMENTS[0]), policy)?;
    let v = Draft::load(&dir.join(DRAFT_MOMENTS[1]), policy)?;
    Ok(Some(DraftState { draft, moments: Some((m, v, steps)) }))
}

/// Points `<root>/latest_checkpointed_iteration.txt` at `iteration`, atomically and durably.
fn write_pointer(root: &Path, iteration: u64) -> Result<()> {
    let pointer = root.join(POINTER_FILE);
    let tmp = beside(&pointer, ".tmp")?;
    write_synced(&tmp, iteration.to_string().as_bytes())?;
    fs::rename(&tmp, &pointer).map_err(io(&pointer))?;
    sync_dir(root)
}

/// The iteration `<root>/latest_checkpointed_iteration.txt` names; `None` when there is no
/// such file. A file that does not hold an iteration number is an error naming it.
pub fn latest_iteration(root: &Path) -> Result<Option<u64>> {
    let pointer = root.join(POINTER_FILE);
    let text = match fs::read_to_string(&pointer) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(source) => return Err(Error::Io { path: pointer, source }),
    };
    let trimmed = text.trim();
    trimmed.parse::<u64>().map(Some).map_err(|_| {
        at(&pointer, format!("holds '{trimmed}', expected an iteration number such as 10"))
    })
}

/// Loads the checkpoint `latest_checkpointed_iteration.txt` points at, with the optimizer's
/// hyper-parameters from the caller (they may change on resume) and the extra weight sets
/// `extra_names`. Errors when `root` holds no checkpoint.
pub fn load(root: &Path, hyper: AdamW, clip_grad: f64, extra_names: &[&str]) -> Result<Loaded> {
    let Some(iteration) = latest_iteration(root)? else {
        return Err(at(
            root,
            format!(
                "no checkpoint to resume from ({POINTER_FILE} is missing); drop --load or point \
                 it at a directory holding {POINTER_FILE}"
            ),
        ));
    };
    load_iteration(root, iteration, hyper, clip_grad, extra_names)
}

/// [`load`], or when the checkpoint the pointer names is damaged ([`Error::Damaged`]), the
/// newest intact one before it (`--load-fallback`): the checkpoint loaded, and each skipped
/// iteration with what is wrong with it.
pub fn load_intact(
    root: &Path,
    hyper: AdamW,
    clip_grad: f64,
    extra_names: &[&str],
) -> Result<(Loaded, Vec<(u64, Error)>)> {
    let Some(latest) = latest_iteration(root)? else {
        return load(root, hyper, clip_grad, extra_names).map(|l| (l, Vec::new()));
    };
    let mut iterations: Vec<u64> = fs::read_dir(root)
        .map_err(io(root))?
        .filter_map(|e| e.ok()?.file_name().to_str()?.strip_prefix("iter_")?.parse().ok())
        .filter(|&i| i <= latest)
        .collect();
    iterations.sort_unstable_by(|a, b| b.cmp(a));
    let mut skipped = Vec::new();
    for iteration in iterations {
        match load_iteration(root, iteration, hyper, clip_grad, extra_names) {
            Ok(loaded) => return Ok((loaded, skipped)),
            Err(e @ Error::Damaged { .. }) => skipped.push((iteration, e)),
            Err(e) => return Err(e),
        }
    }
    let why: Vec<String> = skipped.iter().map(|(_, e)| e.to_string()).collect();
    Err(at(root, format!("no intact checkpoint to resume from: {}", why.join("; "))))
}

/// Loads iteration `iteration` of `root` (whatever the pointer says).
pub fn load_iteration(
    root: &Path,
    iteration: u64,
    hyper: AdamW,
    clip_grad: f64,
    extra_names: &[&str],
) -> Result<Loaded> {
    check_extra_names(extra_names.iter().copied())?;
    let dir = resolve(root, iteration)?;
    manifest::verify(&dir)?;
    let config = ModelConfig::from_file(&config_path(&dir))?;
    let weights = Weights::load(&dir, &config)?;

    let path = dir.join(OPTIMIZER_FILE);
    let bytes = read_required(&path, "the optimizer state")?;
    let st = parse_safetensors(&path, &bytes)?;
    let (_, header) = SafeTensors::read_metadata(&bytes)
        .map_err(|e| at(&path, format!("not a safetensors file: {e}")))?;
    let step_text = header.metadata().as_ref().and_then(|m| m.get(STEP_KEY));
    let step = step_text.and_then(|s| s.parse::<u64>().ok()).ok_or_else(|| {
        at(
            &path,
            format!(
                "the metadata must hold the step count as \"{STEP_KEY}\": \"<n>\", found {step_text:?}"
            ),
        )
    })?;
    let m = weights_from(&st, &path, &config, EXP_AVG)?;
    let v = weights_from(&st, &path, &config, EXP_AVG_SQ)?;
    let optimizer = Optimizer::from_state(&config, hyper, clip_grad, m, v, step)
        .map_err(|e| at(&path, e.to_string()))?;

    let state_path = dir.join(STATE_FILE);
    let text = String::from_utf8(read_required(&state_path, "the trainer state")?)
        .map_err(|e| at(&state_path, format!("not UTF-8 text: {e}")))?;
    let state =
        serde_json::from_str(&text).map_err(|e| at(&state_path, format!("not valid JSON: {e}")))?;

    let mut extra = Vec::new();
    for name in extra_names {
        let path = dir.join(format!("{name}.safetensors"));
        let bytes = read_required(&path, &format!("the extra weight set '{name}'"))?;
        let st = parse_safetensors(&path, &bytes)?;
        extra.push((name.to_string(), weights_from(&st, &path, &config, "")?));
    }
    let draft = load_draft(&dir.join(DRAFT_DIR), &config)?;
    Ok(Loaded { iteration, dir, config, weights, optimizer, state, extra, draft })
}

/// The directory of `iteration`: `iter_…`, or its `.old` copy when a re-save of it crashed
/// between moving the old directory aside and moving the new one in.
fn resolve(root: &Path, iteration: u64) -> Result<PathBuf> {
    let dir = iter_dir(root, iteration);
    if dir.is_dir() {
        return Ok(dir);
    }
    let old = beside(&dir, ".old")?;
    if old.is_dir() {
        return Ok(old);
    }
    Err(at(
        &root.join(POINTER_FILE),
        format!("points at iteration {iteration}, but {} does not exist", dir.display()),
    ))
}

fn read_required(path: &Path, what: &str) -> Result<Vec<u8>> {
    fs::read(path).map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            at(path, format!("missing: the checkpoint has no file with {what}"))
        } else {
            Error::Io { path: path.to_path_buf(), source: e }
        }
    })
}

fn parse_safetensors<'a>(path: &Path, bytes: &'a [u8]) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(bytes).map_err(|e| at(path, format!("not a safetensors file: {e}")))
}

/// Weights whose tensor `<prefix><hf name>` is read from `st` (F32, the config's shapes).
fn weights_from(
    st: &SafeTensors<'_>,
    path: &Path,
    config: &ModelConfig,
    prefix: &str,
) -> Result<Weights> {
    weights_from_files(config, |name, shape| {
        let full = format!("{prefix}{name}");
        let view = st.tensor(&full).map_err(|e| match e {
            SafeTensorError::TensorNotFound(_) => at(path, format!("tensor '{full}' is missing")),
            other => at(path, format!("tensor '{full}': {other}")),
        })?;
        if view.dtype() != Dtype::F32 || view.shape() != shape {
            return Err(at(
                path,
                format!(
                    "tensor '{full}' is {:?} {:?}, expected F32 {shape:?}",
                    view.dtype(),
                    view.shape()
                ),
            ));
        }
        Ok(view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    })
}

/// Writes a plain HF model directory (`config.json`, `model.safetensors` in F32 or, with
/// `quant`, its matrices in DeepSeek-V3's FP8 format or compressed-tensors' INT4
/// `pack-quantized`, the tokenizer files) at `dir`, replacing one there:
/// written beside it as `.<name>.tmp` and renamed.
pub fn export_hf(
    dir: &Path,
    config: &ModelConfig,
    weights: &Weights,
    tokenizer_dir: Option<&Path>,
    quant: Option<&QuantExport<'_>>,
    mtp: Option<&Draft>,
) -> Result<()> {
    check_shapes(config, weights, "the weights")?;
    let tmp = beside(dir, ".tmp")?;
    let parent = parent_of(dir);
    create_dirs(&parent)?;
    // f32 at most (a quantized export is smaller), and room for the rest.
    let needed = 4 * weights.tensors().iter().map(|t| t.len() as u64).sum::<u64>() + (1 << 20);
    check_space(&parent, needed)?;
    fresh_tmp_dir(&tmp)?;
    writing(&tmp, needed, || {
        let (config, extra) = with_mtp(config, weights, mtp)?;
        write_config_and_model(&tmp, &config, weights, quant, extra)?;
        if let Some(from) = tokenizer_dir {
            copy_tokenizer(from, &tmp)?;
        }
        manifest::write(&tmp)?;
        sync_dir(&tmp)
    })?;
    commit_dir(&tmp, dir)
}

/// A DeepSeek-V3 export's config and MTP tensors: `mtp` (a draft in DeepSeek's format)
/// written after the layers as DeepSeek ships it, and `num_nextn_predict_layers` saying
/// whether it is there. Other families' files have no place for a draft.
fn with_mtp<'a>(
    config: &ModelConfig,
    weights: &'a Weights,
    mtp: Option<&'a Draft>,
) -> Result<(ModelConfig, NamedViews<'a>)> {
    let mut out = config.clone();
    let Some(mla) = out.mla.as_mut() else { return Ok((out, Vec::new())) };
    let mtp = mtp.filter(|d| d.format == DraftFormat::DeepSeek);
    mla.mtp_layers = usize::from(mtp.is_some());
    let extra = match mtp {
        Some(d) => d
            .checkpoint_tensors(config, weights)?
            .into_iter()
            .map(|(name, shape, data)| (name, TensorView::F32 { shape, data }))
            .collect(),
        None => Vec::new(),
    };
    Ok((out, extra))
}

pub mod manifest;
#[cfg(test)]
mod tests;
