//! CPU reference implementations. Row-major `f32` slices; shapes in the argument names.

mod attention;
mod elementwise;
mod logprob;
mod matmul;
mod optim;

pub use attention::{AttentionShape, attention_backward, attention_forward};
pub use elementwise::{
    embedding_backward, embedding_forward, rmsnorm_backward, rmsnorm_forward, rope_backward,
    rope_forward, rope_tables, swiglu_backward, swiglu_forward,
};
pub use logprob::{LOGPROB_CHUNK_ELEMENTS, logprob_backward, logprob_forward};
pub use matmul::{Transpose, matmul};
pub use optim::{AdamW, clip_scale, global_norm};
