//! The plugin crates compiled into this binary. Naming each crate's registration here keeps the
//! linker from dropping it (nothing else references a plugin crate, and an unreferenced crate
//! takes its `inventory` registration with it). This is the one file that knows the features.

use miles_core::Plugin;

/// Cargo features of this build (plugin crates and the CUDA backend), for `miles --version`.
pub const FEATURES: &[&str] = &[
    #[cfg(feature = "tis")]
    "tis",
    #[cfg(feature = "r3")]
    "r3",
    #[cfg(feature = "fp8")]
    "fp8",
    #[cfg(feature = "eagle-spec")]
    "eagle-spec",
    #[cfg(feature = "int4-qat")]
    "int4-qat",
    #[cfg(feature = "cuda")]
    "cuda",
];

/// Every statically linked plugin, built-in rewards and advantage estimators included.
pub fn plugins() -> Vec<&'static Plugin> {
    let features: &[&'static Plugin] = &[
        #[cfg(feature = "tis")]
        &miles_plugin_tis::PLUGIN,
        #[cfg(feature = "r3")]
        &miles_plugin_r3::PLUGIN,
        #[cfg(feature = "fp8")]
        &miles_plugin_fp8::PLUGIN,
        #[cfg(feature = "eagle-spec")]
        &miles_plugin_eagle_spec::PLUGIN,
        #[cfg(feature = "int4-qat")]
        &miles_plugin_int4_qat::PLUGIN,
    ];
    let builtin = miles_rewards::BUILTIN.iter().chain(miles_train::advantage::BUILTIN);
    let all: Vec<&'static Plugin> = builtin.chain(features).copied().collect();
    // Keep the references alive through optimization; the registry is then read from inventory.
    std::hint::black_box(&all);
    all
}
