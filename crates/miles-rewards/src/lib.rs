//! Built-in rewards, each registered with the core registry under its `--rm-type` name.
//! [`BUILTIN`] names every registration so the driver can keep this crate linked.

mod exact_match;

pub use exact_match::ExactMatch;

/// Every reward this crate registers.
pub static BUILTIN: &[&miles_core::Plugin] = &[&exact_match::PLUGIN];
