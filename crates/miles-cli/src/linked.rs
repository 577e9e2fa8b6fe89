//! The plugin crates compiled into this binary. Naming each crate's registration here keeps the
//! linker from dropping it (nothing else references a plugin crate, and an unreferenced crate
//! takes its `inventory` registration with it). This is the one file that knows the features.

use miles_core::Plugin;

/// Cargo features of this build that link a plugin crate, for `miles --version`.
pub const FEATURES: &[&str] = &[
    #[cfg(feature = "tis")]
    "tis",
];

/// Every statically linked plugin, built-in rewards included.
pub fn plugins() -> Vec<&'static Plugin> {
    let mut all: Vec<&'static Plugin> = miles_rewards::BUILTIN.to_vec();
    #[cfg(feature = "tis")]
    all.push(&miles_plugin_tis::PLUGIN);
    // Keep the references alive through optimization; the registry is then read from inventory.
    std::hint::black_box(&all);
    all
}
