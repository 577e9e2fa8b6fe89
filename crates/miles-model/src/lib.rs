//! Decoder-only transformers with an explicit forward and backward: Qwen3 (q/k RMSNorm),
//! Llama and Qwen3-MoE (routed SwiGLU experts, on the CPU so far), over packed variable-length
//! batches, with HF checkpoints in and out.
//!
//! The model returns, for the response tokens of each sequence, `logp` and the entropy of the
//! tempered next-token distribution; its backward takes d(loss)/d(logp) and d(loss)/d(entropy)
//! and yields the gradient of every weight. Losses live in host math elsewhere.

mod backend;
pub mod chat_template;
pub mod config;
mod decode;
pub mod device;
pub mod draft;
mod error;
pub mod file_layout;
pub mod kv;
mod latent_step;
mod layer;
mod mla;
pub mod model;
pub mod moe;
pub mod presets;
pub mod rope;
mod spec_graph;
pub mod stage_clock;
pub mod testing;
pub mod tokenizer;
pub mod weights;

pub use config::{Architecture, Biases, GemmaConfig, MlaConfig, ModelConfig, MoeConfig, Routing};
pub use decode::DecodeGraphs;
pub use device::{DeviceModel, Forward, Fp8Layers, Int4Layers, SampleParams, fp8_weight_names};
pub use error::{Error, Result};
pub use kv::{BlockId, KvCache};
pub use model::{Model, PackedBatch, RoutedBatch, StepRow};
pub use rope::RopeScaling;
pub use spec_graph::{SpecGraphs, SpecOut, SpecRows};
pub use tokenizer::Tokenizer;
pub use weights::{ExpertWeights, LayerWeights, Weights};
