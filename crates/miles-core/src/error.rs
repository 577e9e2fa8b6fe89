use std::path::PathBuf;

/// The errors of the core layer. Every message says what was wrong and, where it can, what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A configuration value is out of range or inconsistent; `key` is the flag name.
    #[error("--{key}: {message}")]
    Config { key: String, message: String },
    /// A plugin lookup failed or a plugin refused its configuration.
    #[error("{0}")]
    Plugin(String),
    /// An input file could not be read or parsed; `line` is 1-based where it applies.
    #[error("{}{}: {message}", path.display(), line.map(|l| format!(":{l}")).unwrap_or_default())]
    Input { path: PathBuf, line: Option<usize>, message: String },
    /// Input slices whose lengths disagree, or other misuse of an API by the caller.
    #[error("invalid input: {0}")]
    Invalid(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn config(key: &str, message: impl Into<String>) -> Self {
        Error::Config { key: key.to_string(), message: message.into() }
    }
}
