//! Plugins for the host's failure tests. `miles_reward_plugin`: scores the response length,
//! fails a sample whose response is "error", panics on "panic", and refuses the configuration
//! `{"refuse": true}`. `bad_abi`: a table of ABI major 999. `short_table`: a v1 header whose
//! table is too short.

use std::ffi::c_void;

use miles_plugin_abi::{
    PluginReward, PluginSample, RewardPlugin, RewardPluginTable, TableHeader, export_reward_plugin,
};

struct Touchy;

impl RewardPlugin for Touchy {
    fn new(config: serde_json::Value) -> Result<Self, String> {
        if config.get("refuse").and_then(|v| v.as_bool()) == Some(true) {
            return Err("refusing as configured".into());
        }
        Ok(Touchy)
    }

    fn score(&mut self, sample: &PluginSample) -> Result<PluginReward, String> {
        match sample.response.as_str() {
            "panic" => panic!("touchy plugin was asked to panic"),
            "error" => Err("touchy plugin rejects this sample".into()),
            r => Ok(PluginReward::Scalar(r.chars().count() as f64)),
        }
    }
}

export_reward_plugin!(Touchy, "touchy");

unsafe extern "C" fn create(_: *const u8, _: usize) -> *mut c_void {
    std::ptr::null_mut()
}
unsafe extern "C" fn score(
    _: *mut c_void,
    _: *const u8,
    _: usize,
    _: *mut *const u8,
    _: *mut usize,
) -> i32 {
    1
}
unsafe extern "C" fn last_error() -> *const std::ffi::c_char {
    std::ptr::null()
}
unsafe extern "C" fn destroy(_: *mut c_void) {}

const fn table(abi_major: u32, struct_size: usize) -> RewardPluginTable {
    RewardPluginTable {
        header: TableHeader { abi_major, abi_minor: 0, struct_size },
        name: c"foreign".as_ptr(),
        version: c"0.0.1".as_ptr(),
        create,
        score,
        last_error,
        destroy,
    }
}

static BAD_ABI: RewardPluginTable = table(999, size_of::<RewardPluginTable>());
static SHORT: RewardPluginTable = table(1, 8);

#[unsafe(no_mangle)]
pub extern "C" fn bad_abi() -> *const RewardPluginTable {
    &BAD_ABI
}

#[unsafe(no_mangle)]
pub extern "C" fn short_table() -> *const RewardPluginTable {
    &SHORT
}
