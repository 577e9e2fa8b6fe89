use std::path::PathBuf;

/// Errors of model loading and compute. Every message names the file and the field or tensor.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {message}", path.display())]
    Config { path: PathBuf, message: String },
    #[error("{}: tensor '{tensor}': {message}", path.display())]
    Tensor { path: PathBuf, tensor: String, message: String },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Op(#[from] miles_tensor::Error),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
