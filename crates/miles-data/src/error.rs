use std::path::PathBuf;

/// Everything that can go wrong loading or serving prompts. Each message says what failed,
/// where (the file and line, the spec, the flag) and what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be opened or read.
    #[error("cannot read {}: {source}; check the path", path.display())]
    Io { path: PathBuf, source: std::io::Error },
    /// The `FILE@[a:b]` row slice is malformed or selects nothing.
    #[error("{spec}: {message}")]
    Slice { spec: String, message: String },
    /// One row of the file is malformed: not UTF-8, not a JSON object, a key missing or of the
    /// wrong kind. `line` is 1-based.
    #[error("{}:{line}: {message}", path.display())]
    Row { path: PathBuf, line: usize, message: String },
    /// A `.parquet` file cannot be read as prompts: it is not Parquet, lacks a column the keys
    /// name, has a prompt column of a type a prompt cannot be, uses a codec or type that is not
    /// built in, or is corrupt.
    #[error("{}: {message}", path.display())]
    Parquet { path: PathBuf, message: String },
    /// One row of a Parquet file is malformed (a null prompt, a chat message without a role…);
    /// `row` is 1-based, as [`crate::PromptRow::line`] is.
    #[error("{}: row {row} (counted from 1): {message}", path.display())]
    ParquetRow { path: PathBuf, row: usize, message: String },
    /// The dataset has no row to serve.
    #[error("{dataset}: no prompt rows{hint}")]
    Empty { dataset: String, hint: String },
    /// A saved [`crate::Cursor`] does not fit this data source.
    #[error("cannot restore the data cursor: {message}")]
    Cursor { message: String },
}
