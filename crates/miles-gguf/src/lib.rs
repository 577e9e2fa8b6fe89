//! GGUF (llama.cpp's model format) in: a reader for versions 2 and 3, dequantization of the
//! common ggml types to f32, and conversion of `llama` and `qwen3` models with byte-level BPE
//! tokenizers into HF checkpoints that `miles-model` loads.
//!
//! This crate knows GGUF; it writes checkpoints only through `miles-model`'s `ModelConfig`,
//! `Weights` and `Tokenizer`, so what it produces is what the rest of miles-rs reads.

pub mod convert;
pub mod dequant;
mod error;
pub mod metadata;
pub mod reader;
pub mod tokenizer;

pub use convert::{OutputDtype, Summary, convert};
pub use dequant::GgmlType;
pub use error::{Error, Result};
pub use metadata::{Array, Metadata, Value};
pub use reader::{GgufFile, TensorInfo};
