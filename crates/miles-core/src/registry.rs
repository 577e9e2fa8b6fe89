//! The static plugin registry. A plugin crate defines one `pub static` [`Plugin`] and submits a
//! [`Registration`] pointing at it:
//!
//! ```
//! use miles_core::{Factory, Plugin, Registration, Reward, RewardError, RewardValue, Sample};
//!
//! struct AlwaysOne;
//! impl Reward for AlwaysOne {
//!     fn score(&self, _: &Sample) -> Result<RewardValue, RewardError> {
//!         Ok(RewardValue::Scalar(1.0))
//!     }
//! }
//!
//! pub static PLUGIN: Plugin = Plugin {
//!     name: "always_one",
//!     version: env!("CARGO_PKG_VERSION"),
//!     description: "scores every response 1",
//!     factory: Factory::Reward(|_config| Ok(Box::new(AlwaysOne))),
//! };
//! miles_core::inventory::submit! { Registration(&PLUGIN) }
//!
//! assert!(miles_core::registry::find(miles_core::PluginKind::Reward, "always_one").is_ok());
//! ```
//!
//! The driver names each linked plugin's `PLUGIN` static once; without such a reference the
//! linker may drop the whole crate, registration included.

use std::fmt;

use serde::Serialize;

use crate::{
    Advantage, Correction, Error, Quantizer, Result, Reward, Rollout, RoutingReplay, Speculator,
};

/// A plugin's configuration: the JSON object the driver builds from flags or the config file.
pub type PluginConfig = serde_json::Value;

/// The things a plugin can provide.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PluginKind {
    Rollout,
    Reward,
    Advantage,
    Quantizer,
    Correction,
    Replay,
    Speculator,
}

impl PluginKind {
    pub const ALL: [PluginKind; 7] = [
        PluginKind::Rollout,
        PluginKind::Reward,
        PluginKind::Advantage,
        PluginKind::Quantizer,
        PluginKind::Correction,
        PluginKind::Replay,
        PluginKind::Speculator,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PluginKind::Rollout => "rollout",
            PluginKind::Reward => "reward",
            PluginKind::Advantage => "advantage",
            PluginKind::Quantizer => "quantizer",
            PluginKind::Correction => "correction",
            PluginKind::Replay => "replay",
            PluginKind::Speculator => "speculator",
        }
    }
}

impl fmt::Display for PluginKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Builds a plugin instance from its configuration; the variant says the kind.
#[derive(Clone, Copy)]
pub enum Factory {
    Rollout(fn(&PluginConfig) -> Result<Box<dyn Rollout>>),
    Reward(fn(&PluginConfig) -> Result<Box<dyn Reward>>),
    Advantage(fn(&PluginConfig) -> Result<Box<dyn Advantage>>),
    Quantizer(fn(&PluginConfig) -> Result<Box<dyn Quantizer>>),
    Correction(fn(&PluginConfig) -> Result<Box<dyn Correction>>),
    Replay(fn(&PluginConfig) -> Result<Box<dyn RoutingReplay>>),
    Speculator(fn(&PluginConfig) -> Result<Box<dyn Speculator>>),
}

/// A statically linked plugin.
pub struct Plugin {
    pub name: &'static str,
    pub version: &'static str,
    /// One line for `miles plugins`.
    pub description: &'static str,
    pub factory: Factory,
}

impl Plugin {
    pub fn kind(&self) -> PluginKind {
        match self.factory {
            Factory::Rollout(_) => PluginKind::Rollout,
            Factory::Reward(_) => PluginKind::Reward,
            Factory::Advantage(_) => PluginKind::Advantage,
            Factory::Quantizer(_) => PluginKind::Quantizer,
            Factory::Correction(_) => PluginKind::Correction,
            Factory::Replay(_) => PluginKind::Replay,
            Factory::Speculator(_) => PluginKind::Speculator,
        }
    }
}

impl fmt::Debug for Plugin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} plugin '{}' v{}", self.kind(), self.name, self.version)
    }
}

/// What plugin crates submit to `inventory`.
pub struct Registration(pub &'static Plugin);

inventory::collect!(Registration);

/// Every registered plugin, sorted by kind then name.
pub fn list() -> Vec<&'static Plugin> {
    let mut all: Vec<&'static Plugin> =
        inventory::iter::<Registration>.into_iter().map(|r| r.0).collect();
    all.sort_by(|a, b| (a.kind(), a.name).cmp(&(b.kind(), b.name)));
    all
}

/// The plugin of `kind` called `name`. The error lists what is available, so a typo in a flag
/// shows the right spelling.
pub fn find(kind: PluginKind, name: &str) -> Result<&'static Plugin> {
    let of_kind: Vec<&'static Plugin> = list().into_iter().filter(|p| p.kind() == kind).collect();
    let mut hits = of_kind.iter().filter(|p| p.name == name);
    match (hits.next(), hits.next()) {
        (Some(p), None) => Ok(p),
        (Some(_), Some(_)) => Err(Error::Plugin(format!(
            "two {kind} plugins are registered as '{name}': rename one of them"
        ))),
        (None, _) => {
            let names: Vec<&str> = of_kind.iter().map(|p| p.name).collect();
            let available = if names.is_empty() { "none".to_string() } else { names.join(", ") };
            Err(Error::Plugin(format!(
                "no {kind} plugin named '{name}'; available: {available} (plugins behind cargo \
                 features are linked with `cargo xtask build --features NAME`)"
            )))
        }
    }
}

/// A factory function of one kind.
type Make<T> = fn(&PluginConfig) -> Result<Box<T>>;

/// Finds the plugin of `kind` called `name` and builds it; `pick` takes the factory out of
/// the matching `Factory` variant (it always matches: `find` filtered by kind).
fn create<T: ?Sized>(
    kind: PluginKind,
    name: &str,
    config: &PluginConfig,
    pick: fn(Factory) -> Option<Make<T>>,
) -> Result<Box<T>> {
    let plugin = find(kind, name)?;
    let make = pick(plugin.factory)
        .ok_or_else(|| Error::Plugin(format!("{plugin:?} is not a {kind} plugin")))?;
    make(config)
}

/// Instantiates the reward plugin `name`.
pub fn create_reward(name: &str, config: &PluginConfig) -> Result<Box<dyn Reward>> {
    create(PluginKind::Reward, name, config, |f| match f {
        Factory::Reward(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the correction plugin `name`.
pub fn create_correction(name: &str, config: &PluginConfig) -> Result<Box<dyn Correction>> {
    create(PluginKind::Correction, name, config, |f| match f {
        Factory::Correction(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the routing replay `name` (`r3`).
pub fn create_replay(name: &str, config: &PluginConfig) -> Result<Box<dyn RoutingReplay>> {
    create(PluginKind::Replay, name, config, |f| match f {
        Factory::Replay(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the speculative decoding scheme `name` (`eagle-spec`).
pub fn create_speculator(name: &str, config: &PluginConfig) -> Result<Box<dyn Speculator>> {
    create(PluginKind::Speculator, name, config, |f| match f {
        Factory::Speculator(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the advantage estimator `name`.
pub fn create_advantage(name: &str, config: &PluginConfig) -> Result<Box<dyn Advantage>> {
    create(PluginKind::Advantage, name, config, |f| match f {
        Factory::Advantage(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the quantizer `name`.
pub fn create_quantizer(name: &str, config: &PluginConfig) -> Result<Box<dyn Quantizer>> {
    create(PluginKind::Quantizer, name, config, |f| match f {
        Factory::Quantizer(make) => Some(make),
        _ => None,
    })
}

/// Instantiates the rollout engine `name`.
pub fn create_rollout(name: &str, config: &PluginConfig) -> Result<Box<dyn Rollout>> {
    create(PluginKind::Rollout, name, config, |f| match f {
        Factory::Rollout(make) => Some(make),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{RewardError, RewardValue, Sample};

    struct Constant(f64);
    impl Reward for Constant {
        fn score(&self, _: &Sample) -> Result<RewardValue, RewardError> {
            Ok(RewardValue::Scalar(self.0))
        }
    }

    static TEST_REWARD: Plugin = Plugin {
        name: "registry_test_constant",
        version: "9.9.9",
        description: "test",
        factory: Factory::Reward(|config| {
            let v = config.get("value").and_then(|v| v.as_f64()).unwrap_or(0.25);
            Ok(Box::new(Constant(v)))
        }),
    };
    inventory::submit! { Registration(&TEST_REWARD) }

    static DUPLICATE_A: Plugin = Plugin {
        name: "registry_test_twice",
        version: "1",
        description: "test",
        factory: Factory::Reward(|_| Ok(Box::new(Constant(0.0)))),
    };
    static DUPLICATE_B: Plugin = Plugin { version: "2", ..DUPLICATE_A };
    inventory::submit! { Registration(&DUPLICATE_A) }
    inventory::submit! { Registration(&DUPLICATE_B) }

    #[test]
    fn registered_plugins_are_listed_and_found() {
        assert!(list().iter().any(|p| p.name == "registry_test_constant"));
        let p = find(PluginKind::Reward, "registry_test_constant").unwrap();
        assert_eq!((p.kind(), p.version), (PluginKind::Reward, "9.9.9"));
        let r =
            create_reward("registry_test_constant", &serde_json::json!({"value": 2.0})).unwrap();
        assert_eq!(r.score(&Sample::default()).unwrap(), RewardValue::Scalar(2.0));
    }

    #[test]
    fn lookup_errors_list_what_is_available() {
        let err = find(PluginKind::Reward, "registry_test_constnat").unwrap_err().to_string();
        assert!(err.contains("no reward plugin named 'registry_test_constnat'"), "{err}");
        assert!(err.contains("registry_test_constant"), "{err}");
        let err = find(PluginKind::Quantizer, "fp8").unwrap_err().to_string();
        assert!(err.contains("available: none"), "{err}");
        // A name registered for another kind is not found under this one.
        assert!(create_correction("registry_test_constant", &serde_json::Value::Null).is_err());
    }

    #[test]
    fn a_name_registered_twice_is_refused() {
        let err = find(PluginKind::Reward, "registry_test_twice").unwrap_err().to_string();
        assert!(err.contains("two reward plugins"), "{err}");
    }
}
