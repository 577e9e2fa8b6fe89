//! Loading reward plugins into the host. Libraries are never unloaded: a plugin may have
//! spawned threads or registered destructors that must not outlive its code.

use std::ffi::{CStr, c_char, c_void};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use miles_core::{Reward, RewardError, RewardValue, Sample};

use crate::{
    ABI_MAJOR, DEFAULT_SYMBOL, PluginReward, RewardPluginTable, STATUS_OK, ScoreResult, TableHeader,
};

/// Why a plugin could not be loaded or called; the message names the library.
#[derive(Debug)]
pub struct PluginError(pub String);

impl std::fmt::Display for PluginError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for PluginError {}

/// `path[:symbol]` as given to `--custom-rm-path`.
pub fn parse_spec(spec: &str) -> (PathBuf, String) {
    // A trailing `:name` that is a valid identifier selects the symbol; anything else (a
    // Windows drive letter, a colon inside a directory name) belongs to the path.
    if let Some((path, symbol)) = spec.rsplit_once(':') {
        let ident = !symbol.is_empty()
            && symbol.chars().all(|c| c == '_' || c.is_ascii_alphanumeric())
            && !symbol.starts_with(|c: char| c.is_ascii_digit());
        if ident && !path.is_empty() {
            return (PathBuf::from(path), symbol.to_string());
        }
    }
    (PathBuf::from(spec), DEFAULT_SYMBOL.to_string())
}

/// A reward plugin loaded from a shared library, usable wherever a [`Reward`] is.
pub struct DynamicReward {
    path: PathBuf,
    name: String,
    version: String,
    table: &'static RewardPluginTable,
    // The plugin instance is not required to be thread-safe: calls are serialized.
    handle: Mutex<Handle>,
}

struct Handle(*mut c_void);
// SAFETY: the handle is only used under the mutex, one call at a time.
unsafe impl Send for Handle {}

impl DynamicReward {
    /// Loads `spec` (`path[:symbol]`) and creates an instance with `config`.
    pub fn load(spec: &str, config: &serde_json::Value) -> Result<Self, PluginError> {
        let (path, symbol) = parse_spec(spec);
        let table = open_table(&path, &symbol)?;
        let name = c_str(table.name).unwrap_or_else(|| "<unnamed>".into());
        let version = c_str(table.version).unwrap_or_else(|| "?".into());
        let config_bytes =
            if config.is_null() { Vec::new() } else { config.to_string().into_bytes() };
        // SAFETY: the table passed the header checks; the buffer lives across the call.
        let handle = unsafe { (table.create)(config_bytes.as_ptr(), config_bytes.len()) };
        if handle.is_null() {
            return Err(PluginError(format!(
                "reward plugin {} ({name}) refused its configuration: {}",
                path.display(),
                last_error(table)
            )));
        }
        Ok(DynamicReward { path, name, version, table, handle: Mutex::new(Handle(handle)) })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn version(&self) -> &str {
        &self.version
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Scores a batch in one plugin call.
    pub fn score_batch(
        &self,
        samples: &[Sample],
    ) -> Result<Vec<Result<RewardValue, RewardError>>, PluginError> {
        let fail =
            |what: String| PluginError(format!("reward plugin {}: {what}", self.path.display()));
        let input =
            serde_json::to_vec(samples).map_err(|e| fail(format!("encoding samples: {e}")))?;
        let guard = self.handle.lock().unwrap_or_else(|poison| poison.into_inner());
        let (mut out, mut out_len): (*const u8, usize) = (std::ptr::null(), 0);
        // SAFETY: the handle came from this table's `create`; the mutex serializes calls.
        let status = unsafe {
            (self.table.score)(guard.0, input.as_ptr(), input.len(), &mut out, &mut out_len)
        };
        if status != STATUS_OK {
            return Err(fail(last_error(self.table)));
        }
        if out.is_null() {
            return Err(fail("score returned success but no output".into()));
        }
        // SAFETY: the output stays valid until the next call on this handle, which the held
        // lock prevents; we copy it out before releasing.
        let bytes = unsafe { std::slice::from_raw_parts(out, out_len) };
        let results = read_results(bytes, samples.len()).map_err(fail);
        drop(guard);
        results
    }
}

/// A plugin's output for `n` samples: a JSON array of one result per sample, each a reward or
/// an error of its own; the error says what is wrong with the output.
fn read_results(bytes: &[u8], n: usize) -> Result<Vec<Result<RewardValue, RewardError>>, String> {
    let results: Vec<ScoreResult> = serde_json::from_slice(bytes)
        .map_err(|e| format!("output is not a JSON array of results: {e}"))?;
    if results.len() != n {
        return Err(format!("returned {} results for {n} samples", results.len()));
    }
    Ok(results
        .into_iter()
        .map(|r| match r {
            ScoreResult::Reward(PluginReward::Scalar(v)) => Ok(RewardValue::Scalar(v)),
            ScoreResult::Reward(PluginReward::Named(m)) => Ok(RewardValue::Named(m)),
            ScoreResult::Error(e) => Err(RewardError::new(e)),
        })
        .collect())
}

/// The fuzzing harness's way in (`fuzz/`): bytes read as a plugin's output for 2 samples, and
/// as the samples a plugin is given; errors are the expected outcome.
#[doc(hidden)]
pub fn fuzz_plugin_json(bytes: &[u8]) {
    let _ = read_results(bytes, 2);
    let _ = serde_json::from_slice::<Vec<crate::PluginSample>>(bytes);
}

impl Reward for DynamicReward {
    fn score(&self, sample: &Sample) -> Result<RewardValue, RewardError> {
        self.score_group(std::slice::from_ref(sample))
            .pop()
            .unwrap_or_else(|| Err(RewardError::new("plugin returned no result")))
    }

    /// One plugin call for the whole group; a failed call fails each of its samples.
    fn score_group(&self, samples: &[Sample]) -> Vec<Result<RewardValue, RewardError>> {
        match self.score_batch(samples) {
            Ok(results) => results,
            Err(e) => samples.iter().map(|_| Err(RewardError::new(e.to_string()))).collect(),
        }
    }
}

impl Drop for DynamicReward {
    fn drop(&mut self) {
        let handle = self.handle.get_mut().unwrap_or_else(|p| p.into_inner());
        // SAFETY: the handle came from `create` and is not used again.
        unsafe { (self.table.destroy)(handle.0) };
    }
}

/// Reads the `name` and `version` of a plugin without creating an instance (`miles plugins`).
pub fn describe(spec: &str) -> Result<(String, String), PluginError> {
    let (path, symbol) = parse_spec(spec);
    let table = open_table(&path, &symbol)?;
    Ok((
        c_str(table.name).unwrap_or_else(|| "<unnamed>".into()),
        c_str(table.version).unwrap_or_else(|| "?".into()),
    ))
}

fn open_table(path: &Path, symbol: &str) -> Result<&'static RewardPluginTable, PluginError> {
    let shown = path.display();
    if !path.exists() {
        return Err(PluginError(format!(
            "reward plugin {shown} does not exist: build the plugin crate (cargo build --release) \
             and pass the path of its shared library"
        )));
    }
    // SAFETY: loading runs the library's initializers; that is what loading a plugin means.
    let library = unsafe { libloading::Library::new(path) }.map_err(|e| {
        PluginError(format!(
            "cannot load reward plugin {shown}: {e} (is it a cdylib for this platform?)"
        ))
    })?;
    // Never unloaded: see the module comment.
    let library: &'static libloading::Library = Box::leak(Box::new(library));
    type Entry = unsafe extern "C" fn() -> *const RewardPluginTable;
    // SAFETY: the symbol's type is the ABI's contract; a mismatch is caught by the header.
    let entry = unsafe { library.get::<Entry>(symbol.as_bytes()) }.map_err(|_| {
        PluginError(format!(
            "{shown} does not export `{symbol}`: it is not a miles reward plugin, or it exports \
             under another name (pick it with --custom-rm-path {shown}:SYMBOL); plugins export \
             with miles_plugin_abi::export_reward_plugin!"
        ))
    })?;
    // SAFETY: the entry point takes no arguments and returns a pointer to a static.
    let table = unsafe { entry() };
    if table.is_null() {
        return Err(PluginError(format!("{shown}: `{symbol}` returned a null table")));
    }
    // SAFETY: every table version starts with the header.
    let header = unsafe { *table.cast::<TableHeader>() };
    if header.abi_major != ABI_MAJOR {
        return Err(PluginError(format!(
            "{shown} was built for miles plugin ABI v{}.{}, but this miles speaks v{ABI_MAJOR}: \
             rebuild the plugin against miles-plugin-abi {}",
            header.abi_major,
            header.abi_minor,
            env!("CARGO_PKG_VERSION")
        )));
    }
    if header.struct_size < std::mem::size_of::<RewardPluginTable>() {
        return Err(PluginError(format!(
            "{shown}: its function table is {} bytes, shorter than ABI v{ABI_MAJOR}'s {}: the \
             plugin is corrupt or was not built with export_reward_plugin!",
            header.struct_size,
            std::mem::size_of::<RewardPluginTable>()
        )));
    }
    // SAFETY: major and size checked, so the fields of v1 are all there.
    Ok(unsafe { &*table })
}

fn c_str(p: *const c_char) -> Option<String> {
    // SAFETY: the ABI says these are NUL-terminated static strings.
    (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

fn last_error(table: &RewardPluginTable) -> String {
    // SAFETY: `last_error` returns null or a string valid until the thread's next call.
    c_str(unsafe { (table.last_error)() }).unwrap_or_else(|| "the plugin gave no reason".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_split_an_optional_symbol() {
        assert_eq!(parse_spec("lib.so"), (PathBuf::from("lib.so"), DEFAULT_SYMBOL.into()));
        assert_eq!(parse_spec("a/lib.so:alt_1"), (PathBuf::from("a/lib.so"), "alt_1".into()));
        assert_eq!(
            parse_spec("C:\\x\\r.dll"),
            (PathBuf::from("C:\\x\\r.dll"), DEFAULT_SYMBOL.into())
        );
        assert_eq!(parse_spec("a:b/lib.so"), (PathBuf::from("a:b/lib.so"), DEFAULT_SYMBOL.into()));
    }

    #[test]
    fn a_missing_file_is_named() {
        let err = describe("/nonexistent/libx.so").unwrap_err().to_string();
        assert!(err.contains("/nonexistent/libx.so does not exist"), "{err}");
        let dir = std::env::temp_dir().join("miles-abi-not-a-lib.so");
        std::fs::write(&dir, b"not an elf").unwrap();
        let err = describe(dir.to_str().unwrap()).unwrap_err().to_string();
        assert!(err.contains("cannot load reward plugin"), "{err}");
    }
}
