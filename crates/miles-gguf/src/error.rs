use std::path::PathBuf;

/// Errors of GGUF reading and conversion. Every message names the file and the byte offset,
/// metadata key or tensor, and what is wrong.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// The byte layout is wrong: a corrupt, truncated or non-GGUF file.
    #[error("{}: at byte {offset}: {message}", path.display())]
    Format { path: PathBuf, offset: u64, message: String },
    #[error("{}: metadata '{key}': {message}", path.display())]
    Metadata { path: PathBuf, key: String, message: String },
    #[error("{}: tensor '{tensor}': {message}", path.display())]
    Tensor { path: PathBuf, tensor: String, message: String },
    /// The file is valid GGUF but holds something this converter does not handle.
    #[error("{}: {message}", path.display())]
    Unsupported { path: PathBuf, message: String },
    #[error(transparent)]
    Model(#[from] miles_model::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
