//! The C ABI between `miles` and reward plugins loaded at run time (`--custom-rm-path`).
//!
//! A plugin is a `cdylib` that exports one function, by default named
//! [`DEFAULT_SYMBOL`], returning a pointer to a static [`RewardPluginTable`]. The table starts
//! with a [`TableHeader`] (ABI major, minor, struct size) that every version keeps, so the host
//! can refuse a plugin of another major before touching anything else. Only plain bytes cross
//! the boundary: the configuration and the samples go in as JSON, the rewards come out as JSON.
//! Every entry point catches panics, so a bug in a plugin fails that call, not the host.
//!
//! Writing a plugin takes a type implementing [`RewardPlugin`] and one macro call:
//!
//! ```
//! use miles_plugin_abi::{PluginReward, PluginSample, RewardPlugin, export_reward_plugin};
//!
//! struct NonEmpty;
//!
//! impl RewardPlugin for NonEmpty {
//!     fn new(_config: serde_json::Value) -> Result<Self, String> {
//!         Ok(NonEmpty)
//!     }
//!     fn score(&mut self, sample: &PluginSample) -> Result<PluginReward, String> {
//!         Ok(PluginReward::Scalar(if sample.response.trim().is_empty() { 0.0 } else { 1.0 }))
//!     }
//! }
//!
//! export_reward_plugin!(NonEmpty, "non_empty");
//! ```

use std::collections::BTreeMap;
use std::ffi::{c_char, c_void};

use serde::{Deserialize, Serialize};

#[cfg(feature = "host")]
pub mod host;

/// Bumped on any change that breaks existing plugins; the host refuses other majors.
pub const ABI_MAJOR: u32 = 1;
/// Bumped when fields are appended to the table; older plugins remain loadable.
pub const ABI_MINOR: u32 = 0;
/// The symbol the host looks up when `--custom-rm-path` names no other (`LIB:SYMBOL`).
pub const DEFAULT_SYMBOL: &str = "miles_reward_plugin";

/// The first fields of every table version. Read alone before the rest.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct TableHeader {
    pub abi_major: u32,
    pub abi_minor: u32,
    /// `size_of` the plugin's whole table, so later minors can append fields.
    pub struct_size: usize,
}

/// Status codes of [`RewardPluginTable::score`].
pub const STATUS_OK: i32 = 0;
pub const STATUS_ERROR: i32 = 1;

/// Version 1 of the function table.
///
/// Memory rules: strings are NUL-terminated UTF-8. `name` and `version` are static. The output
/// of `score` belongs to the handle and stays valid until the next call on that handle; the
/// message of `last_error` belongs to the calling thread and stays valid until its next call.
#[repr(C)]
pub struct RewardPluginTable {
    pub header: TableHeader,
    pub name: *const c_char,
    pub version: *const c_char,
    /// Builds an instance from a JSON configuration; null on failure (see `last_error`).
    pub create: unsafe extern "C" fn(config: *const u8, config_len: usize) -> *mut c_void,
    /// Scores a JSON array of [`PluginSample`]s, writing a JSON array of [`ScoreResult`]s
    /// (one per sample, same order) to `out`/`out_len`. Returns [`STATUS_OK`] or
    /// [`STATUS_ERROR`] when the whole call failed (see `last_error`).
    pub score: unsafe extern "C" fn(
        handle: *mut c_void,
        input: *const u8,
        input_len: usize,
        out: *mut *const u8,
        out_len: *mut usize,
    ) -> i32,
    /// The message of the calling thread's last failed call, or null.
    pub last_error: unsafe extern "C" fn() -> *const c_char,
    pub destroy: unsafe extern "C" fn(handle: *mut c_void),
}

// The table only holds pointers to statics and functions.
unsafe impl Sync for RewardPluginTable {}

/// What a plugin sees of a sample. Unknown fields of the host's sample are ignored, so the host
/// may send more than this.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PluginSample {
    pub group_index: usize,
    pub index: usize,
    /// A string, or a list of `{"role", "content"}` messages.
    pub prompt: serde_json::Value,
    pub response: String,
    pub response_length: usize,
    pub label: Option<String>,
    pub metadata: serde_json::Value,
}

/// A reward: one number or named numbers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PluginReward {
    Scalar(f64),
    Named(BTreeMap<String, f64>),
}

/// One entry of `score`'s output: `{"reward": …}` or `{"error": "…"}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScoreResult {
    Reward(PluginReward),
    Error(String),
}

/// What a plugin author implements.
pub trait RewardPlugin: Sized + Send + 'static {
    /// Builds the plugin from its configuration (`--custom-rm-config`, JSON; null when none).
    fn new(config: serde_json::Value) -> Result<Self, String>;

    /// Scores one sample; an `Err` marks that sample failed.
    fn score(&mut self, sample: &PluginSample) -> Result<PluginReward, String>;

    /// Scores samples that arrived together (a prompt's group, or a batch). Override for
    /// group-relative rewards or to batch work; the default scores each sample alone.
    fn score_batch(&mut self, samples: &[PluginSample]) -> Vec<Result<PluginReward, String>> {
        samples.iter().map(|s| self.score(s)).collect()
    }
}

/// Exports `$plugin` (a [`RewardPlugin`]) as a miles reward plugin called `$name`, under
/// [`DEFAULT_SYMBOL`] or the given symbol (`export_reward_plugin!(T, "name", my_symbol)`, loaded
/// as `--custom-rm-path lib.so:my_symbol`), so one library can carry several rewards.
#[macro_export]
macro_rules! export_reward_plugin {
    ($plugin:ty, $name:literal) => {
        $crate::export_reward_plugin!($plugin, $name, miles_reward_plugin);
    };
    ($plugin:ty, $name:literal, $symbol:ident) => {
        #[unsafe(no_mangle)]
        pub extern "C" fn $symbol() -> *const $crate::RewardPluginTable {
            static TABLE: $crate::RewardPluginTable = $crate::RewardPluginTable {
                header: $crate::TableHeader {
                    abi_major: $crate::ABI_MAJOR,
                    abi_minor: $crate::ABI_MINOR,
                    struct_size: ::std::mem::size_of::<$crate::RewardPluginTable>(),
                },
                name: concat!($name, "\0").as_ptr().cast(),
                version: concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast(),
                create: $crate::__private::create::<$plugin>,
                score: $crate::__private::score::<$plugin>,
                last_error: $crate::__private::last_error,
                destroy: $crate::__private::destroy::<$plugin>,
            };
            &TABLE
        }
    };
}

/// The plugin side of the table, instantiated by [`export_reward_plugin!`]. Not public API.
#[doc(hidden)]
pub mod __private {
    use std::cell::RefCell;
    use std::ffi::{CString, c_char, c_void};
    use std::panic::{AssertUnwindSafe, catch_unwind};

    use super::{PluginSample, RewardPlugin, STATUS_ERROR, STATUS_OK, ScoreResult};

    thread_local! {
        static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    }

    struct Instance<P> {
        plugin: P,
        output: Vec<u8>,
    }

    fn set_error(message: String) {
        let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
        LAST_ERROR.with(|e| *e.borrow_mut() = Some(c));
    }

    /// Runs `f`, turning an error or a panic into the thread's last error.
    fn guarded<T>(what: &str, f: impl FnOnce() -> Result<T, String>) -> Option<T> {
        match catch_unwind(AssertUnwindSafe(f)) {
            Ok(Ok(v)) => Some(v),
            Ok(Err(e)) => {
                set_error(e);
                None
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "unknown panic payload".into());
                set_error(format!("plugin panicked in {what}: {msg}"));
                None
            }
        }
    }

    /// # Safety
    /// `config` points to `config_len` readable bytes (or is null with length 0).
    pub unsafe extern "C" fn create<P: RewardPlugin>(
        config: *const u8,
        config_len: usize,
    ) -> *mut c_void {
        let bytes = if config.is_null() {
            &[][..]
        } else {
            // SAFETY: the host passes a live buffer of this length.
            unsafe { std::slice::from_raw_parts(config, config_len) }
        };
        guarded("create", || {
            let value = if bytes.is_empty() {
                serde_json::Value::Null
            } else {
                serde_json::from_slice(bytes)
                    .map_err(|e| format!("configuration is not JSON: {e}"))?
            };
            let plugin = P::new(value)?;
            Ok(Box::into_raw(Box::new(Instance { plugin, output: Vec::new() })).cast())
        })
        .unwrap_or(std::ptr::null_mut())
    }

    /// # Safety
    /// `handle` came from `create::<P>` and is not used concurrently; `input` points to
    /// `input_len` readable bytes; `out` and `out_len` are writable.
    pub unsafe extern "C" fn score<P: RewardPlugin>(
        handle: *mut c_void,
        input: *const u8,
        input_len: usize,
        out: *mut *const u8,
        out_len: *mut usize,
    ) -> i32 {
        if handle.is_null() || input.is_null() || out.is_null() || out_len.is_null() {
            set_error("score called with a null pointer".into());
            return STATUS_ERROR;
        }
        // SAFETY: per the contract above.
        let (instance, bytes) = unsafe {
            (&mut *handle.cast::<Instance<P>>(), std::slice::from_raw_parts(input, input_len))
        };
        let done = guarded("score", || {
            let samples: Vec<PluginSample> = serde_json::from_slice(bytes)
                .map_err(|e| format!("samples are not a JSON array of samples: {e}"))?;
            let results = instance.plugin.score_batch(&samples);
            if results.len() != samples.len() {
                return Err(format!(
                    "score_batch returned {} results for {} samples",
                    results.len(),
                    samples.len()
                ));
            }
            let results: Vec<ScoreResult> = results
                .into_iter()
                .map(|r| match r {
                    Ok(v) => ScoreResult::Reward(v),
                    Err(e) => ScoreResult::Error(e),
                })
                .collect();
            instance.output = serde_json::to_vec(&results).map_err(|e| e.to_string())?;
            Ok(())
        });
        match done {
            Some(()) => {
                // SAFETY: checked non-null; the host reads the buffer before its next call.
                unsafe {
                    *out = instance.output.as_ptr();
                    *out_len = instance.output.len();
                }
                STATUS_OK
            }
            None => STATUS_ERROR,
        }
    }

    pub unsafe extern "C" fn last_error() -> *const c_char {
        LAST_ERROR.with(|e| e.borrow().as_ref().map_or(std::ptr::null(), |c| c.as_ptr()))
    }

    /// # Safety
    /// `handle` came from `create::<P>` and is not used afterwards.
    pub unsafe extern "C" fn destroy<P: RewardPlugin>(handle: *mut c_void) {
        if !handle.is_null() {
            // SAFETY: per the contract; a panic in the plugin's Drop is contained.
            let instance = unsafe { Box::from_raw(handle.cast::<Instance<P>>()) };
            let _ = catch_unwind(AssertUnwindSafe(move || drop(instance)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    struct Echo {
        bonus: f64,
    }

    impl RewardPlugin for Echo {
        fn new(config: serde_json::Value) -> Result<Self, String> {
            let bonus = config.get("bonus").and_then(|b| b.as_f64()).unwrap_or(0.0);
            if bonus < 0.0 {
                return Err("bonus must be >= 0".into());
            }
            Ok(Echo { bonus })
        }
        fn score(&mut self, s: &PluginSample) -> Result<PluginReward, String> {
            match s.response.as_str() {
                "panic" => panic!("asked to panic"),
                "" => Err("empty response".into()),
                r => Ok(PluginReward::Scalar(r.len() as f64 + self.bonus)),
            }
        }
    }

    export_reward_plugin!(Echo, "echo", echo_table);

    fn last_error(table: &RewardPluginTable) -> String {
        let p = unsafe { (table.last_error)() };
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn call(table: &RewardPluginTable, handle: *mut c_void, input: &str) -> Result<String, String> {
        let (mut out, mut len) = (std::ptr::null(), 0usize);
        let status =
            unsafe { (table.score)(handle, input.as_ptr(), input.len(), &mut out, &mut len) };
        if status != STATUS_OK {
            return Err(last_error(table));
        }
        Ok(String::from_utf8(unsafe { std::slice::from_raw_parts(out, len) }.to_vec()).unwrap())
    }

    #[test]
    fn the_table_scores_and_contains_errors_and_panics() {
        let table = unsafe { &*echo_table() };
        assert_eq!(table.header.abi_major, ABI_MAJOR);
        assert_eq!(unsafe { CStr::from_ptr(table.name) }.to_str().unwrap(), "echo");

        let bad = br#"{"bonus": -1}"#;
        assert!(unsafe { (table.create)(bad.as_ptr(), bad.len()) }.is_null());
        assert_eq!(last_error(table), "bonus must be >= 0");

        let config = br#"{"bonus": 0.5}"#;
        let handle = unsafe { (table.create)(config.as_ptr(), config.len()) };
        assert!(!handle.is_null());
        let out = call(table, handle, r#"[{"response": "abc"}, {"response": ""}]"#).unwrap();
        let results: Vec<ScoreResult> = serde_json::from_str(&out).unwrap();
        assert_eq!(
            results,
            vec![
                ScoreResult::Reward(PluginReward::Scalar(3.5)),
                ScoreResult::Error("empty response".into())
            ]
        );
        let err = call(table, handle, r#"[{"response": "panic"}]"#).unwrap_err();
        assert!(err.contains("plugin panicked in score: asked to panic"), "{err}");
        let err = call(table, handle, "not json").unwrap_err();
        assert!(err.contains("not a JSON array"), "{err}");
        // The instance still works after a panic.
        assert!(call(table, handle, r#"[{"response": "ok"}]"#).unwrap().contains("2.5"));
        unsafe { (table.destroy)(handle) };
    }
}
