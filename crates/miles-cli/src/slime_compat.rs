//! The cluster, Megatron and SGLang flags that slime's example scripts pass, so that those
//! scripts' argument lists run as `miles train` arguments: each is mapped onto a flag of ours
//! where it has a meaning here, accepted with one warning where it has none, and refused by
//! name only where it asks for something not built (tensor, pipeline, context or expert
//! parallelism above 1, several nodes).

use anyhow::bail;
use serde_json::{Map, Value};

/// How a slime flag is taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takes {
    /// A switch (`--swiglu`, `--colocate=false`).
    Switch,
    /// One value (`--num-layers 36`).
    Value,
    /// One or more values (`--sglang-cuda-graph-bs 1 2 4 8`).
    Values,
}

/// What a slime flag means here.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Meaning {
    /// Nothing: accepted with a warning that says why.
    Inert(&'static str),
    /// A size that must be 1 (or a switch that must be off): more is not built.
    AtMostOne(&'static str),
    /// Our flag of that name takes the value.
    Is(&'static str),
    /// A number that must be 0 (dropout): anything else is not built.
    Zero(&'static str),
    /// A value that must end with the first (a Python path naming what is built in here).
    Only(&'static str, &'static str),
}

/// A slime flag this driver takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Compat {
    pub key: &'static str,
    pub takes: Takes,
    pub meaning: Meaning,
}

const fn inert(key: &'static str, takes: Takes, why: &'static str) -> Compat {
    Compat { key, takes, meaning: Meaning::Inert(why) }
}

const ARCH: &str = "the architecture is --hf-checkpoint's config.json";
const ONE_PROCESS: &str = "no Megatron here: each process holds the whole model";
const NUMERICS: &str = "the kernels keep f32 where it matters already";

/// Every slime flag taken here. (Megatron's model flags restate config.json: they are taken
/// and left to it.)
pub const COMPAT: &[Compat] = &[
    // Megatron's model flags.
    inert("swiglu", Takes::Switch, ARCH),
    inert("num-layers", Takes::Value, ARCH),
    inert("hidden-size", Takes::Value, ARCH),
    inert("ffn-hidden-size", Takes::Value, ARCH),
    inert("num-attention-heads", Takes::Value, ARCH),
    inert("group-query-attention", Takes::Switch, ARCH),
    inert("num-query-groups", Takes::Value, ARCH),
    inert("use-rotary-position-embeddings", Takes::Switch, ARCH),
    inert("position-embedding-type", Takes::Value, ARCH),
    inert("disable-bias-linear", Takes::Switch, ARCH),
    inert("add-qkv-bias", Takes::Switch, ARCH),
    inert("normalization", Takes::Value, ARCH),
    inert("norm-epsilon", Takes::Value, ARCH),
    inert("rotary-base", Takes::Value, ARCH),
    inert("vocab-size", Takes::Value, ARCH),
    inert("make-vocab-size-divisible-by", Takes::Value, ARCH),
    inert("kv-channels", Takes::Value, ARCH),
    inert("qk-layernorm", Takes::Switch, ARCH),
    inert("untie-embeddings-and-output-weights", Takes::Switch, ARCH),
    inert("num-experts", Takes::Value, ARCH),
    inert("moe-ffn-hidden-size", Takes::Value, ARCH),
    inert("moe-router-topk", Takes::Value, ARCH),
    inert("moe-router-score-function", Takes::Value, ARCH),
    inert("moe-router-pre-softmax", Takes::Switch, ARCH),
    inert("moe-router-load-balancing-type", Takes::Value, ARCH),
    inert("moe-token-dispatcher-type", Takes::Value, ONE_PROCESS),
    inert("moe-grouped-gemm", Takes::Switch, "the experts' products are grouped already"),
    inert("moe-aux-loss-coeff", Takes::Value, "the aux loss weight is --router-aux-loss-coef"),
    inert("moe-layer-freq", Takes::Value, ARCH),
    inert(
        "moe-token-drop-policy",
        Takes::Value,
        "no token is dropped: every expert takes its rows",
    ),
    inert("moe-router-dtype", Takes::Value, "the router's softmax is f32"),
    inert(
        "moe-permute-fusion",
        Takes::Switch,
        "the experts' gathers are fused into their products",
    ),
    inert("rotary-percent", Takes::Value, ARCH),
    // Megatron's parallelism and memory.
    Compat {
        key: "tensor-model-parallel-size",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "tensor parallelism is not built; runs are data parallel (--nproc-per-node)",
        ),
    },
    Compat {
        key: "pipeline-model-parallel-size",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "pipeline parallelism is not built; runs are data parallel (--nproc-per-node)",
        ),
    },
    Compat {
        key: "context-parallel-size",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "context parallelism is not built; each process holds whole sequences",
        ),
    },
    Compat {
        key: "expert-model-parallel-size",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "expert parallelism is not built; each process holds every expert",
        ),
    },
    Compat {
        key: "expert-tensor-parallel-size",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne("expert tensor parallelism is not built"),
    },
    inert(
        "sequence-parallel",
        Takes::Switch,
        "it splits what tensor parallelism splits: none here",
    ),
    inert("use-distributed-optimizer", Takes::Switch, ONE_PROCESS),
    inert("recompute-granularity", Takes::Value, "activations are kept, not recomputed"),
    inert("recompute-method", Takes::Value, "activations are kept, not recomputed"),
    inert("recompute-num-layers", Takes::Value, "activations are kept, not recomputed"),
    inert(
        "use-dynamic-batch-size",
        Takes::Switch,
        "sequences are packed without padding; --micro-batch-size bounds a forward",
    ),
    inert(
        "max-tokens-per-gpu",
        Takes::Value,
        "sequences are packed without padding; --micro-batch-size bounds a forward",
    ),
    inert("balance-data", Takes::Switch, "each process takes its part of every step's groups"),
    Compat {
        key: "attention-dropout",
        takes: Takes::Value,
        meaning: Meaning::Zero("dropout is not built (RL runs with none)"),
    },
    Compat {
        key: "hidden-dropout",
        takes: Takes::Value,
        meaning: Meaning::Zero("dropout is not built (RL runs with none)"),
    },
    inert("accumulate-allreduce-grads-in-fp32", Takes::Switch, "gradients are summed in f32"),
    inert("attention-softmax-in-fp32", Takes::Switch, NUMERICS),
    inert("attention-backend", Takes::Value, "attention is this project's own kernels"),
    inert("bf16", Takes::Switch, "a GPU computes in bf16 with f32 masters already"),
    inert("optimizer-cpu-offload", Takes::Switch, "the optimizer state stays on the GPU"),
    inert("overlap-cpu-optimizer-d2h-h2d", Takes::Switch, "the optimizer state stays on the GPU"),
    inert("ref-load", Takes::Value, "the KL reference is --hf-checkpoint's weights"),
    // Ray's placement.
    Compat {
        key: "actor-num-nodes",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "several nodes are started by torchrun or Slurm, one process per GPU",
        ),
    },
    Compat {
        key: "actor-num-gpus-per-node",
        takes: Takes::Value,
        meaning: Meaning::Is("nproc-per-node"),
    },
    inert(
        "colocate",
        Takes::Switch,
        "the rollout engine always shares the trainer's GPU and weights",
    ),
    // SGLang's.
    Compat {
        key: "rollout-num-gpus-per-engine",
        takes: Takes::Value,
        meaning: Meaning::AtMostOne(
            "the embedded engine runs on its process's GPU (tensor parallel engines are not built)",
        ),
    },
    Compat {
        key: "sglang-mem-fraction-static",
        takes: Takes::Value,
        meaning: Meaning::Is("rollout-kv-cache-fraction"),
    },
    inert("sglang-cuda-graph-bs", Takes::Values, "the engine captures the batch sizes it runs"),
    // slime's.
    Compat {
        key: "dynamic-sampling-filter-path",
        takes: Takes::Value,
        meaning: Meaning::Only(
            "check_reward_nonzero_std",
            "the built-in filter of --over-sampling-batch-size keeps the groups whose rewards \
             have a spread (slime's check_reward_nonzero_std); other filters are not taken",
        ),
    },
    // Weights & Biases: the metrics go to metrics.jsonl and TensorBoard (--use-tensorboard).
    inert("use-wandb", Takes::Switch, WANDB),
    inert("wandb-project", Takes::Value, WANDB),
    inert("wandb-group", Takes::Value, WANDB),
    inert("wandb-run-id", Takes::Value, WANDB),
    inert("wandb-key", Takes::Value, WANDB),
    inert("wandb-host", Takes::Value, WANDB),
    inert("wandb-team", Takes::Value, WANDB),
];

const WANDB: &str = "metrics go to metrics.jsonl and TensorBoard (--use-tensorboard)";

/// The row of `key`.
pub fn compat(key: &str) -> Option<&'static Compat> {
    COMPAT.iter().find(|c| c.key == key)
}

/// Applies the slime flags `given` (key → value, from the command line or `--config`) to the
/// run's keys `merged`: mapped ones become our flags (`source` names where they came from);
/// refused ones are an error naming the flag; the rest are listed in one warning, returned.
pub fn apply(
    given: &Map<String, Value>,
    merged: &mut Map<String, Value>,
) -> anyhow::Result<Option<String>> {
    let mut inert = Vec::new();
    for (key, value) in given {
        let Some(row) = compat(key) else { continue };
        let number = value.as_f64().or_else(|| value.as_str().and_then(|s| s.parse().ok()));
        match row.meaning {
            Meaning::Inert(why) => inert.push(format!("--{key} ({why})")),
            Meaning::AtMostOne(why) => match number {
                Some(n) if n <= 1.0 => {}
                _ => bail!("--{key} {}: {why}", shown(value)),
            },
            Meaning::Zero(why) => match number {
                Some(0.0) => {}
                _ => bail!("--{key} {}: {why}", shown(value)),
            },
            Meaning::Only(suffix, why) => match value.as_str() {
                Some(path) if path.ends_with(suffix) => {}
                _ => bail!("--{key} {}: {why}", shown(value)),
            },
            Meaning::Is(ours) => {
                let mapped = match (ours, number) {
                    ("nproc-per-node", Some(n)) if n >= 1.0 && n.fract() == 0.0 => {
                        Value::from(n as u64)
                    }
                    ("rollout-kv-cache-fraction", Some(f)) if f > 0.0 && f < 1.0 => Value::from(f),
                    _ => bail!("--{key} {}: not a value for --{ours}", shown(value)),
                };
                if let Some(theirs) = merged.get(ours).filter(|v| **v != mapped && !v.is_null()) {
                    let default = default_of(ours);
                    if default.as_ref() != Some(theirs) {
                        bail!(
                            "--{key} {} and --{ours} {} disagree; give one",
                            shown(value),
                            shown(theirs)
                        );
                    }
                }
                merged.insert(ours.to_string(), mapped);
            }
        }
    }
    Ok((!inert.is_empty()).then(|| {
        format!("warning: slime flags without a meaning here, taken and left: {}", inert.join(", "))
    }))
}

fn shown(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// `key`'s value in `RunConfig::default()`.
fn default_of(key: &str) -> Option<Value> {
    let defaults = serde_json::to_value(miles_core::config::RunConfig::default()).ok()?;
    defaults.get(key).cloned()
}
