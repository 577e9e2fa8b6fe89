//! The flags of `miles train` and its `--config FILE`, building a [`RunConfig`].
//!
//! [`FLAGS`] has one row per `RunConfig` key; the key is the flag name without `--` and the key of
//! the TOML file. Precedence, lowest first: `RunConfig::default()`, the caller's embedded defaults,
//! the TOML file, the flags given on the command line. Each value is checked against its key on
//! its own before the whole is deserialized, so every error names where the value came from:
//! `--lr: …`, `run.toml: key 'lr': …`.

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};
use clap::error::ErrorKind;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};
use miles_core::config::RunConfig;
use serde_json::{Map, Value};

use crate::slime_compat::{COMPAT, Meaning, Takes};

/// How a flag takes its value on the command line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A `bool`: `--use-tis` sets true; `--use-tis=false` sets false.
    Switch,
    /// A scalar that always has a value (number, string, path, enum).
    Value,
    /// An `Option<T>`: giving the flag sets `Some`.
    Optional,
    /// A `Vec<String>`: the flag repeats (`--rollout-stop A --rollout-stop B`).
    List,
    /// A `Vec<u32>`, comma-separated (`--rollout-stop-token-ids 1,2`); an empty value is [].
    CommaList,
    /// A `Vec<String>` of one flag's values (`--eval-prompt-data aime A.jsonl math B.jsonl`);
    /// in `--config` a string or a list.
    Values,
}

/// The JSON type of a key's value (of its elements for the list kinds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ty {
    Bool,
    /// A non-negative integer (`usize`, `u64`, `u32`).
    UInt,
    /// A signed integer.
    Int,
    /// A number (`f32`); integers are accepted.
    Float,
    Str,
    Path,
    /// A string out of these names (serde's, aliases included).
    Enum(&'static [&'static str]),
    /// `cpu`, `cuda` or `cuda:N`.
    Device,
}

/// One `RunConfig` key as a flag of `miles train`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Flag {
    pub key: &'static str,
    pub kind: Kind,
    pub ty: Ty,
    /// The heading it is listed under in `--help`.
    pub section: &'static str,
    pub help: &'static str,
}

const MODEL: &str = "Model and checkpoints";
const DATA: &str = "Data and evaluation";
const ROLLOUT: &str = "Rollout";
const REWARD: &str = "Reward";
const ADVANTAGE: &str = "Advantage";
const LOSS: &str = "Loss";
const TIS: &str = "Off-policy correction (tis plugin)";
const OPTIM: &str = "Optimizer and schedule";
const LOW: &str = "Low precision (fp8 and int4-qat plugins)";
const SPEC: &str = "Speculative rollouts (eagle-spec plugin)";

const fn switch(section: &'static str, key: &'static str, help: &'static str) -> Flag {
    Flag { key, kind: Kind::Switch, ty: Ty::Bool, section, help }
}
const fn value(section: &'static str, key: &'static str, ty: Ty, help: &'static str) -> Flag {
    Flag { key, kind: Kind::Value, ty, section, help }
}
const fn optional(section: &'static str, key: &'static str, ty: Ty, help: &'static str) -> Flag {
    Flag { key, kind: Kind::Optional, ty, section, help }
}

/// Every key of [`RunConfig`], in its order.
pub const FLAGS: &[Flag] = &[
    // Model and checkpoints.
    optional(
        MODEL,
        "hf-checkpoint",
        Ty::Path,
        "HF checkpoint directory (config.json, safetensors, tokenizer.json) of the policy.",
    ),
    optional(MODEL, "save", Ty::Path, "Directory to save checkpoints to."),
    optional(MODEL, "load", Ty::Path, "Checkpoint directory to resume the run from."),
    switch(
        MODEL,
        "load-fallback",
        "A damaged checkpoint at --load (a file not matching its checksum) gives way to the \
         newest intact one before it.",
    ),
    optional(MODEL, "save-interval", Ty::UInt, "Save a checkpoint to --save every N rollouts."),
    switch(
        MODEL,
        "continue-on-save-error",
        "A checkpoint save that fails (a full disk) is a warning and training goes on; \
         without it the run stops, the previous checkpoint still the latest.",
    ),
    switch(
        MODEL,
        "async-save",
        "Write checkpoints in a thread of their own while training goes on (the loop waits \
         for the host copies only, and for the previous save before the next).",
    ),
    optional(MODEL, "save-hf", Ty::Path, "Also write HF-format checkpoints here when saving."),
    value(
        MODEL,
        "seed",
        Ty::UInt,
        "Seed of the demo policy's initialization and of the SFT warm-up's data order.",
    ),
    value(
        MODEL,
        "device",
        Ty::Device,
        "Where the trainer's model runs: cpu, cuda (device 0) or cuda:N; a GPU keeps weights, \
         gradients and AdamW state there and computes in bf16 (miles-rs).",
    ),
    value(
        MODEL,
        "nproc-per-node",
        Ty::UInt,
        "Worker processes to start on this host as one run, one GPU each with --device cuda: \
         each rolls out its share of the prompt groups, gradients and metrics are summed over \
         them (torchrun's flag; a run started by torchrun or Slurm joins through their \
         variables) (miles-rs).",
    ),
    optional(
        MODEL,
        "distributed-backend",
        Ty::Enum(&["nccl", "tcp"]),
        "What sums the gradients over the ranks: nccl (GPUs, one each; the default there) or \
         tcp (the ranks' own group through host memory; the CPU's default, and ranks sharing a \
         GPU) (Megatron's flag).",
    ),
    optional(
        MODEL,
        "arch",
        Ty::Enum(&["qwen3", "llama", "qwen3-moe"]),
        "Architecture of the built-in demo's policy (default qwen3; qwen3-moe: 8 experts, 2 per \
         token); a --hf-checkpoint's config.json names its own (miles-rs).",
    ),
    // Data and evaluation.
    optional(
        DATA,
        "prompt-data",
        Ty::Str,
        "Prompt dataset, JSONL or Parquet (`.parquet`); `FILE@[a:b]` keeps rows a..b (0-based, \
         either end optional).",
    ),
    value(DATA, "input-key", Ty::Str, "Key of the prompt (text or chat messages) in each line."),
    optional(DATA, "label-key", Ty::Str, "Key of the label (the reward's reference) in each line."),
    optional(DATA, "metadata-key", Ty::Str, "Key of per-prompt metadata (any JSON) in each line."),
    switch(DATA, "apply-chat-template", "Render prompts through the tokenizer's chat template."),
    optional(
        DATA,
        "apply-chat-template-kwargs",
        Ty::Str,
        "Extra variables of the chat template, a JSON object (e.g. '{\"enable_thinking\": \
         false}' for Qwen3, tools, date_string).",
    ),
    switch(DATA, "rollout-shuffle", "Shuffle the prompt data (seeded by --rollout-seed)."),
    optional(
        DATA,
        "num-rollout",
        Ty::UInt,
        "Rollouts (RL steps) to run; give this or --num-epoch, not both.",
    ),
    optional(
        DATA,
        "num-epoch",
        Ty::UInt,
        "Passes over --prompt-data to run, instead of --num-rollout.",
    ),
    Flag {
        section: DATA,
        key: "eval-prompt-data",
        kind: Kind::Values,
        ty: Ty::Str,
        help: "Evaluation prompts, JSONL or Parquet, like --prompt-data; slime's NAME FILE [NAME FILE \
         …] evaluates each set apart (eval/NAME, eval/NAME/pass@1).",
    },
    optional(DATA, "eval-interval", Ty::UInt, "Evaluate every N rollouts."),
    value(DATA, "n-samples-per-eval-prompt", Ty::UInt, "Responses sampled per evaluation prompt."),
    optional(
        DATA,
        "eval-max-response-len",
        Ty::UInt,
        "Longest evaluation response in tokens (default: --rollout-max-response-len).",
    ),
    optional(
        DATA,
        "eval-temperature",
        Ty::Float,
        "Evaluation sampling temperature (default: --rollout-temperature).",
    ),
    optional(
        DATA,
        "eval-top-k",
        Ty::Int,
        "Evaluation top-k, 1 for greedy answers (default: --rollout-top-k).",
    ),
    optional(DATA, "eval-top-p", Ty::Float, "Evaluation top-p (default: --rollout-top-p)."),
    optional(
        DATA,
        "run-dir",
        Ty::Path,
        "Directory of metrics.jsonl and plots/ (default: runs/<time>).",
    ),
    switch(
        DATA,
        "use-tensorboard",
        "Also write every metric as TensorBoard scalars to <run dir>/tensorboard/.",
    ),
    value(
        DATA,
        "sft-warmup-steps",
        Ty::UInt,
        "Supervised steps on (prompt, label) pairs before RL, with a fresh optimizer (miles-rs).",
    ),
    optional(DATA, "sft-lr", Ty::Float, "Learning rate of the SFT warm-up (default: --lr)."),
    // Rollout.
    value(
        ROLLOUT,
        "rollout-batch-size",
        Ty::UInt,
        "Prompts per rollout; a rollout has rollout-batch-size × n-samples-per-prompt samples.",
    ),
    value(
        ROLLOUT,
        "n-samples-per-prompt",
        Ty::UInt,
        "Responses sampled per prompt (the group of GRPO).",
    ),
    optional(
        ROLLOUT,
        "over-sampling-batch-size",
        Ty::UInt,
        "Prompts sampled per round when filtering drops groups (>= --rollout-batch-size).",
    ),
    value(ROLLOUT, "rollout-max-response-len", Ty::UInt, "Longest response in tokens."),
    optional(
        ROLLOUT,
        "rollout-max-prompt-len",
        Ty::UInt,
        "Prompts longer than this many tokens are left out.",
    ),
    value(ROLLOUT, "rollout-temperature", Ty::Float, "Sampling temperature (> 0)."),
    value(ROLLOUT, "rollout-top-p", Ty::Float, "Nucleus sampling: keep the top-p mass, in (0, 1]."),
    value(ROLLOUT, "rollout-top-k", Ty::Int, "Sample among the k likeliest tokens; -1 disables."),
    Flag {
        key: "rollout-stop",
        kind: Kind::List,
        ty: Ty::Str,
        section: ROLLOUT,
        help: "Stop a response after this string; repeat the flag for several.",
    },
    Flag {
        key: "rollout-stop-token-ids",
        kind: Kind::CommaList,
        ty: Ty::UInt,
        section: ROLLOUT,
        help: "Stop after any of these token ids (comma-separated), besides the model's EOS.",
    },
    value(ROLLOUT, "rollout-seed", Ty::UInt, "Seed of sampling and of --rollout-shuffle."),
    switch(
        ROLLOUT,
        "partial-rollout",
        "Keep the groups an over-sampled rollout aborts and continue them in the next one.",
    ),
    switch(
        ROLLOUT,
        "mask-offpolicy-in-partial-rollout",
        "With --partial-rollout: tokens from older policies get loss mask 0.",
    ),
    switch(
        ROLLOUT,
        "async",
        "One step off: the next rollout runs, one policy version behind, while this one trains.",
    ),
    value(
        ROLLOUT,
        "max-weight-staleness",
        Ty::UInt,
        "Most policy versions a trained sample may lag the trainer by (1, with --async).",
    ),
    switch(
        ROLLOUT,
        "use-rollout-routing-replay",
        "MoE: record the experts routed to at rollout and replay them in training.",
    ),
    value(
        ROLLOUT,
        "rollout-kv-cache-mb",
        Ty::UInt,
        "KV cache budget of the embedded engine in MiB; sequences wait when full (miles-rs).",
    ),
    value(
        ROLLOUT,
        "rollout-backend",
        Ty::Enum(&["embedded", "sglang"]),
        "Who rolls out: the embedded engine, or SGLang servers (--rollout-url) synced from disk \
         after every step, with --use-tis on unless given.",
    ),
    optional(
        ROLLOUT,
        "rollout-url",
        Ty::Str,
        "The SGLang servers of --rollout-backend sglang, comma-separated http://host:port.",
    ),
    optional(
        ROLLOUT,
        "custom-generate-function-path",
        Ty::Str,
        "slime's custom generate function, `FILE.py:FUNCTION` (default generate): `async def \
         generate(args, sample, sampling_params)` generates each sample (multi-turn, tools) \
         through the embedded engine's HTTP server (args.sglang_router_ip/port), in a Python \
         worker (--rm-python); trained tokens are checked against the engine's.",
    ),
    optional(
        ROLLOUT,
        "rollout-kv-cache-fraction",
        Ty::Float,
        "KV cache budget as a share of the GPU's free memory once the policy is placed; \
         replaces --rollout-kv-cache-mb (slime's --sglang-mem-fraction-static maps here).",
    ),
    value(
        ROLLOUT,
        "rollout-max-running",
        Ty::UInt,
        "Most sequences the embedded engine decodes at once (miles-rs).",
    ),
    // Reward.
    optional(REWARD, "rm-type", Ty::Str, "A built-in reward by name (`miles plugins` lists them)."),
    optional(
        REWARD,
        "custom-rm-path",
        Ty::Str,
        "A reward plugin library, `LIB[:SYMBOL]`, or a Python function, `FILE.py[:FUNCTION]` \
         (default compute_score), run in a worker process.",
    ),
    optional(
        REWARD,
        "rm-python",
        Ty::Path,
        "The Python interpreter for a `FILE.py` --custom-rm-path (default: python3).",
    ),
    optional(
        REWARD,
        "custom-rm-config",
        Ty::Str,
        "JSON handed to the reward when it is created (a plugin's configuration, remote_rm's \
         timeout_secs, max_retries, backoff_ms, concurrency, or a Python reward's timeout_secs, \
         startup_timeout_secs, max_restarts, backoff_ms and its function's `args`).",
    ),
    optional(REWARD, "rm-url", Ty::Str, "URL of a remote reward model."),
    switch(REWARD, "group-rm", "Score each prompt's group of responses in one call."),
    optional(
        REWARD,
        "reward-key",
        Ty::Str,
        "The key to use as the reward when a reward returns an object of values.",
    ),
    // Advantage.
    value(
        ADVANTAGE,
        "advantage-estimator",
        Ty::Enum(&[
            "grpo",
            "gspo",
            "cispo",
            "reinforce_plus_plus",
            "reinforce_plus_plus_baseline",
            "rloo",
            "ppo",
        ]),
        "How rewards become advantages.",
    ),
    switch(
        ADVANTAGE,
        "disable-grpo-std-normalization",
        "GRPO: subtract the group's mean reward without dividing by its std.",
    ),
    switch(
        ADVANTAGE,
        "disable-rewards-normalization",
        "GRPO/GSPO/CISPO/REINFORCE++-baseline: use the raw rewards, no group normalization.",
    ),
    switch(ADVANTAGE, "normalize-advantages", "Whiten the advantages over the whole batch."),
    value(ADVANTAGE, "gamma", Ty::Float, "Discount factor, in [0, 1]."),
    value(ADVANTAGE, "lambd", Ty::Float, "GAE lambda (PPO), in [0, 1]."),
    // Loss.
    value(
        LOSS,
        "loss-type",
        Ty::Enum(&["policy_loss", "sft_loss"]),
        "Training objective: the clipped policy-gradient loss, or supervised NLL.",
    ),
    value(LOSS, "eps-clip", Ty::Float, "PPO clip range: the ratio is clipped below at 1 - eps."),
    optional(
        LOSS,
        "eps-clip-high",
        Ty::Float,
        "Upper clip range: the ratio is clipped above at 1 + eps (default: --eps-clip).",
    ),
    optional(
        LOSS,
        "eps-clip-c",
        Ty::Float,
        "Dual-clip constant (> 1): negative advantages' loss is bounded by -A·c; off when absent.",
    ),
    switch(
        LOSS,
        "use-kl-loss",
        "Add KL(policy ‖ reference) to the loss, weighted by --kl-loss-coef.",
    ),
    value(LOSS, "kl-loss-coef", Ty::Float, "Weight of the KL loss term."),
    value(
        LOSS,
        "kl-loss-type",
        Ty::Enum(&["k1", "kl", "k2", "k3", "low_var_kl"]),
        "Estimator of the KL loss and of the --kl-coef reward penalty; slime's `kl` is k1.",
    ),
    switch(
        LOSS,
        "use-unbiased-kl",
        "Weight the KL loss by the importance ratio (DeepSeek-V3.2's unbiased estimate).",
    ),
    value(LOSS, "kl-coef", Ty::Float, "Weight of the KL penalty taken off the reward."),
    value(LOSS, "entropy-coef", Ty::Float, "Weight of the entropy bonus in the loss."),
    optional(
        LOSS,
        "router-aux-loss-coef",
        Ty::Float,
        "Weight of a Qwen3-MoE policy's load-balancing loss (transformers' \
         router_aux_loss_coef); unset: config.json's when it sets output_router_logits, else off \
         (miles-rs).",
    ),
    switch(
        LOSS,
        "calculate-per-token-loss",
        "Average the loss over all tokens of a step, not per sequence first.",
    ),
    switch(
        LOSS,
        "use-rollout-logprobs",
        "Use the rollout engine's logprobs as the old policy's instead of recomputing them.",
    ),
    switch(
        LOSS,
        "use-opsm",
        "Off-policy sequence masking: drop negative-advantage tokens of drifted sequences.",
    ),
    value(
        LOSS,
        "opsm-delta",
        Ty::Float,
        "OPSM threshold on a sequence's mean old − new log-ratio.",
    ),
    // Off-policy correction.
    switch(TIS, "use-tis", "Correct the rollout/training mismatch by importance sampling."),
    value(
        TIS,
        "tis-level",
        Ty::Enum(&["token", "sequence", "geometric"]),
        "What one importance weight covers: a token, a sequence, or its geometric mean.",
    ),
    value(
        TIS,
        "tis-mode",
        Ty::Enum(&["truncate", "clip", "mask", "icepop"]),
        "Weights out of bounds: truncate and clip clamp, mask drops the token, icepop zeroes it.",
    ),
    value(TIS, "tis-clip", Ty::Float, "Upper bound of the importance weight."),
    optional(
        TIS,
        "tis-clip-low",
        Ty::Float,
        "Lower bound of the importance weight (default 0 for truncate/icepop, 1/upper else).",
    ),
    switch(TIS, "tis-batch-normalize", "Rescale the importance weights to mean 1 over the batch."),
    switch(TIS, "use-rs", "MIS rejection sampling: drop tokens whose ratio is out of bounds."),
    value(
        TIS,
        "rs-level",
        Ty::Enum(&["token", "sequence", "geometric"]),
        "What one rejection ratio covers: a token, a sequence, or its geometric mean.",
    ),
    optional(TIS, "rs-lower-bound", Ty::Float, "Rejection lower bound (default: the TIS one)."),
    optional(TIS, "rs-upper-bound", Ty::Float, "Rejection upper bound (default: --tis-clip)."),
    optional(
        TIS,
        "rs-veto-threshold",
        Ty::Float,
        "With --use-rs: drop a whole sequence when any token's ratio is below this.",
    ),
    // Optimizer and schedule.
    value(OPTIM, "lr", Ty::Float, "Learning rate (Adam)."),
    value(OPTIM, "min-lr", Ty::Float, "Learning rate at the end of the decay."),
    value(OPTIM, "lr-warmup-iters", Ty::UInt, "Optimizer steps of linear warm-up from 0."),
    optional(
        OPTIM,
        "lr-decay-iters",
        Ty::UInt,
        "Optimizer steps the decay spans (default: every step of the run).",
    ),
    value(
        OPTIM,
        "lr-decay-style",
        Ty::Enum(&["constant", "linear", "cosine"]),
        "Decay of the learning rate from --lr to --min-lr.",
    ),
    value(
        OPTIM,
        "optimizer",
        Ty::Enum(&["adam"]),
        "The optimizer: adam (AdamW, decoupled weight decay, as Megatron's adam); sgd is not built.",
    ),
    value(OPTIM, "weight-decay", Ty::Float, "Decoupled weight decay (AdamW)."),
    value(OPTIM, "adam-beta1", Ty::Float, "Adam's first-moment decay."),
    value(OPTIM, "adam-beta2", Ty::Float, "Adam's second-moment decay."),
    value(OPTIM, "adam-eps", Ty::Float, "Adam's epsilon."),
    switch(
        OPTIM,
        "use-precision-aware-optimizer",
        "Megatron's precision-aware optimizer: AdamW's moments in the dtypes below.",
    ),
    value(
        OPTIM,
        "main-params-dtype",
        Ty::Enum(&["fp32", "bf16"]),
        "The matrices' master weights' dtype (with --use-precision-aware-optimizer): bf16 makes \
         each its own compute copy, AdamW rounding updates stochastically (4 bytes a parameter \
         less).",
    ),
    value(
        OPTIM,
        "exp-avg-dtype",
        Ty::Enum(&["fp32", "bf16"]),
        "AdamW's first moment's dtype (with --use-precision-aware-optimizer; bf16 halves it).",
    ),
    value(
        OPTIM,
        "exp-avg-sq-dtype",
        Ty::Enum(&["fp32", "bf16"]),
        "AdamW's second moment's dtype (with --use-precision-aware-optimizer).",
    ),
    value(OPTIM, "clip-grad", Ty::Float, "Clip the gradient's global norm to this; 0 disables."),
    value(
        OPTIM,
        "num-steps-per-rollout",
        Ty::UInt,
        "Optimizer steps per rollout; the samples are split across them.",
    ),
    optional(
        OPTIM,
        "global-batch-size",
        Ty::UInt,
        "Samples per optimizer step; must divide the samples of a rollout.",
    ),
    optional(
        OPTIM,
        "micro-batch-size",
        Ty::UInt,
        "Sequences per forward/backward; a step accumulates its micro-batches (all at once \
         when absent).",
    ),
    // Low precision.
    optional(
        LOW,
        "fp8-format",
        Ty::Enum(&["e4m3"]),
        "Unified FP8: the rollout and the training forward compute every attention and MLP \
         product (experts included) on the same E4M3 weights, requantized at every step, so \
         rollout and training logprobs stay equal; embeddings, norms, the LM head and routers \
         stay in bf16. Needs the fp8 plugin and FP8 tensor cores (H100/H200) or the CPU.",
    ),
    optional(
        LOW,
        "fp8-recipe",
        Ty::Enum(&["blockwise"]),
        "FP8 scaling: blockwise (128×128 weight blocks, 1×128 activation groups, f32 scales, \
         DeepSeek-V3's); the default with --fp8-format.",
    ),
    value(
        LOW,
        "num-layers-at-start-in-bf16",
        Ty::UInt,
        "With --fp8-format: the first N decoder layers stay in bf16.",
    ),
    value(
        LOW,
        "num-layers-at-end-in-bf16",
        Ty::UInt,
        "With --fp8-format: the last N decoder layers stay in bf16.",
    ),
    switch(
        LOW,
        "int4-qat",
        "INT4 quantization-aware training (the int4-qat plugin; miles' \
         OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1 says the same): the rollout and the training forward \
         read every linear layer's weights fake-quantized in symmetric groups, made from the \
         f32 masters at every step, so their logprobs stay equal; gradients pass straight \
         through. On the CPU so far.",
    ),
    value(
        LOW,
        "int4-group-size",
        Ty::UInt,
        "With --int4-qat: inputs per group, 128 or 32 (OPEN_TRAINING_INT4_GROUP_SIZE).",
    ),
    switch(
        LOW,
        "int4-experts-only",
        "With --int4-qat: quantize the routed experts only, as miles does.",
    ),
    // Speculative rollouts.
    optional(
        SPEC,
        "sglang-speculative-algorithm",
        Ty::Enum(&["EAGLE", "NEXTN"]),
        "Roll out speculatively: an MTP draft proposes, the policy verifies; tokens and \
         logprobs stay the policy's (SGLang's flag; the eagle-spec plugin).",
    ),
    optional(SPEC, "sglang-speculative-num-steps", Ty::UInt, "Draft tokens per verification (3)."),
    optional(SPEC, "sglang-speculative-eagle-topk", Ty::UInt, "Drafts per position: 1 (a chain)."),
    optional(
        SPEC,
        "sglang-speculative-num-draft-tokens",
        Ty::UInt,
        "Tokens one verification checks: num-steps + 1 for a chain.",
    ),
    optional(
        SPEC,
        "sglang-speculative-draft-model-path",
        Ty::Path,
        "The draft: an MTP layer's safetensors in DeepSeek-V3's or MiMo's names (a checkpoint's \
         draft/ directory is one).",
    ),
    switch(
        SPEC,
        "sglang-enable-draft-weights-cpu-backup",
        "Accepted for SGLang's scripts: the draft stays in the trainer's process and checkpoints \
         hold it.",
    ),
    switch(
        SPEC,
        "enable-mtp-training",
        "Train the draft during RL on the rollouts' responses (its cross-entropy from their \
         second token), so it keeps up with the policy; train/mtp_loss.",
    ),
    optional(SPEC, "mtp-num-layers", Ty::UInt, "MTP layers of the draft: 1."),
    value(
        SPEC,
        "mtp-loss-scaling-factor",
        Ty::Float,
        "Weight of the MTP loss in each step's loss (0.1).",
    ),
    optional(
        SPEC,
        "mtp-lr",
        Ty::Float,
        "The draft's own learning rate, constant (default: the policy's --lr and schedule); a \
         draft trained from scratch needs a larger one to keep up.",
    ),
    value(
        SPEC,
        "mtp-warmup-steps",
        Ty::UInt,
        "Supervised steps a fresh draft takes on the first rollout's samples, after the first \
         step (0: none), so it proposes from the second iteration; train/mtp_warmup_loss.",
    ),
];

/// The row of `key` (kebab-case).
pub fn flag(key: &str) -> Option<&'static Flag> {
    FLAGS.iter().find(|f| f.key == key)
}

const CONFIG_ID: &str = "config";

/// `miles train`'s arguments: the TOML file and the flags given on the command line, as JSON
/// values of their keys' types (only flags the user gave).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TrainArgs {
    pub config: Option<PathBuf>,
    pub flags: Map<String, Value>,
    /// The slime flags of [`crate::slime_compat`] given (their values as given).
    pub compat: Map<String, Value>,
}

/// `RunConfig::default()` as a JSON object.
fn default_object() -> Map<String, Value> {
    match serde_json::to_value(RunConfig::default()) {
        Ok(Value::Object(map)) => map,
        other => unreachable!("RunConfig serializes to an object, not {other:?}"),
    }
}

/// Adds `--config FILE` and one long flag per row of [`FLAGS`] to `cmd`. No flag has a clap
/// default, so the matches hold only what the user gave.
pub fn add_flags(cmd: Command) -> Command {
    let defaults = default_object();
    let config = Arg::new(CONFIG_ID)
        .long("config")
        .value_name("FILE")
        .value_parser(clap::value_parser!(PathBuf))
        .help(
            "TOML file of run settings, keyed by the flag names (`rollout-batch-size = 8`); \
             flags given here override it.",
        );
    let cmd = FLAGS
        .iter()
        .fold(cmd.arg(config), |cmd, flag| cmd.arg(flag_arg(flag, defaults.get(flag.key))));
    COMPAT.iter().fold(cmd, |cmd, row| cmd.arg(compat_arg(row)))
}

/// A slime flag of [`COMPAT`] as clap takes it: a switch or one value, as given.
fn compat_arg(row: &'static crate::slime_compat::Compat) -> Arg {
    let arg = Arg::new(row.key)
        .long(row.key)
        .help_heading(
            "slime's cluster, Megatron and SGLang flags (mapped, or taken with a warning)",
        )
        .help(match row.meaning {
            Meaning::Inert(why) => why,
            Meaning::AtMostOne(why) | Meaning::Zero(why) | Meaning::Only(_, why) => why,
            Meaning::Is(ours) => ours,
        });
    match row.takes {
        Takes::Switch => arg
            .action(ArgAction::Set)
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .value_name("BOOL"),
        Takes::Value => arg.action(ArgAction::Set).num_args(1).allow_negative_numbers(true),
        Takes::Values => arg.action(ArgAction::Set).num_args(1..).allow_negative_numbers(true),
    }
}

fn flag_arg(flag: &'static Flag, default: Option<&Value>) -> Arg {
    let mut help = flag.help.to_string();
    if let Ty::Enum(names) = flag.ty {
        help.push_str(&format!(" [one of: {}]", names.join(", ")));
    }
    if let Some(shown) = default.and_then(|d| shown_default(flag.ty, d)) {
        help.push_str(&format!(" [default: {shown}]"));
    }
    let arg = Arg::new(flag.key).long(flag.key).help(help).help_heading(flag.section);
    let numeric = matches!(flag.ty, Ty::UInt | Ty::Int | Ty::Float);
    match flag.kind {
        Kind::Switch => arg
            .action(ArgAction::Set)
            .num_args(0..=1)
            .require_equals(true)
            .default_missing_value("true")
            .value_name("BOOL")
            .overrides_with(flag.key),
        Kind::Value | Kind::Optional => arg
            .action(ArgAction::Set)
            .num_args(1)
            .value_name(value_name(flag.ty))
            .allow_negative_numbers(numeric)
            .overrides_with(flag.key),
        Kind::List => arg.action(ArgAction::Append).num_args(1).value_name("TEXT"),
        Kind::CommaList => {
            arg.action(ArgAction::Append).num_args(1).value_delimiter(',').value_name("ID,...")
        }
        Kind::Values => {
            arg.action(ArgAction::Set).num_args(1..).value_name("TEXT").overrides_with(flag.key)
        }
    }
}

fn value_name(ty: Ty) -> &'static str {
    match ty {
        Ty::Bool => "BOOL",
        Ty::UInt | Ty::Int => "N",
        Ty::Float => "X",
        Ty::Str => "TEXT",
        Ty::Path => "PATH",
        Ty::Enum(_) => "NAME",
        Ty::Device => "DEVICE",
    }
}

/// The default as `--help` shows it; none for absent, false and empty defaults.
fn shown_default(ty: Ty, default: &Value) -> Option<String> {
    match default {
        Value::Null | Value::Bool(false) => None,
        Value::Array(items) if items.is_empty() => None,
        Value::String(s) => Some(s.clone()),
        // The f32 keys serialize widened to f64 (1e-6 as 9.99…e-7); show them as f32.
        Value::Number(n) if ty == Ty::Float => n.as_f64().map(|x| {
            let x = x as f32;
            if x != 0.0 && x.abs() < 1e-3 { format!("{x:e}") } else { format!("{x}") }
        }),
        other => Some(other.to_string()),
    }
}

impl clap::Args for TrainArgs {
    fn augment_args(cmd: Command) -> Command {
        add_flags(cmd)
    }

    fn augment_args_for_update(cmd: Command) -> Command {
        add_flags(cmd)
    }
}

fn given(matches: &ArgMatches, id: &str) -> bool {
    matches.value_source(id) == Some(ValueSource::CommandLine)
}

impl clap::FromArgMatches for TrainArgs {
    fn from_arg_matches(matches: &ArgMatches) -> Result<Self, clap::Error> {
        let mut args = TrainArgs::default();
        args.update_from_arg_matches(matches)?;
        Ok(args)
    }

    fn update_from_arg_matches(&mut self, matches: &ArgMatches) -> Result<(), clap::Error> {
        if given(matches, CONFIG_ID) {
            self.config = matches.get_one::<PathBuf>(CONFIG_ID).cloned();
        }
        for flag in FLAGS {
            if !given(matches, flag.key) {
                continue;
            }
            let raw: Vec<&str> = matches
                .get_many::<String>(flag.key)
                .map(|values| values.map(String::as_str).collect())
                .unwrap_or_default();
            let value = flag_value(flag, &raw)
                .and_then(|value| check_value(flag, &value).map(|()| value))
                .map_err(|e| {
                    clap::Error::raw(ErrorKind::ValueValidation, format!("--{}: {e}\n", flag.key))
                })?;
            self.flags.insert(flag.key.to_string(), value);
        }
        for row in COMPAT {
            if !given(matches, row.key) {
                continue;
            }
            let raw: Vec<&String> =
                matches.get_many::<String>(row.key).into_iter().flatten().collect();
            let value = match (row.takes, raw.as_slice()) {
                (Takes::Switch, [raw]) => Value::Bool(parse_bool(raw).map_err(|e| {
                    clap::Error::raw(ErrorKind::ValueValidation, format!("--{}: {e}\n", row.key))
                })?),
                (Takes::Value, [raw]) => Value::String((*raw).clone()),
                _ => Value::Array(raw.iter().map(|s| Value::String((*s).clone())).collect()),
            };
            self.compat.insert(row.key.to_string(), value);
        }
        Ok(())
    }
}

/// The JSON value of a flag from its command-line strings (the last one wins for scalars).
pub fn flag_value(flag: &Flag, raw: &[&str]) -> Result<Value, String> {
    let last = raw.last().copied().unwrap_or("");
    match flag.kind {
        Kind::Switch => parse_bool(last).map(Value::Bool),
        Kind::Value | Kind::Optional => parse_scalar(flag.ty, last),
        Kind::List | Kind::Values => {
            Ok(Value::Array(raw.iter().map(|s| Value::String((*s).into())).collect()))
        }
        Kind::CommaList => {
            if raw == [""] {
                return Ok(Value::Array(Vec::new()));
            }
            raw.iter()
                .map(|s| {
                    s.trim().parse::<u32>().map(Value::from).map_err(|_| {
                        format!("invalid value '{s}': expected comma-separated token ids (0, 1, …)")
                    })
                })
                .collect::<Result<Vec<_>, _>>()
                .map(Value::Array)
        }
    }
}

fn parse_bool(s: &str) -> Result<bool, String> {
    match s {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => Err(format!("invalid value '{s}': expected true or false")),
    }
}

fn parse_scalar(ty: Ty, s: &str) -> Result<Value, String> {
    let invalid = |expected: &str| format!("invalid value '{s}': expected {expected}");
    match ty {
        Ty::Bool => parse_bool(s).map(Value::Bool),
        Ty::UInt => {
            s.parse::<u64>().map(Value::from).map_err(|_| invalid("a non-negative integer"))
        }
        Ty::Int => s.parse::<i64>().map(Value::from).map_err(|_| invalid("an integer")),
        Ty::Float => s
            .parse::<f64>()
            .ok()
            .and_then(serde_json::Number::from_f64)
            .map(Value::Number)
            .ok_or_else(|| invalid("a number")),
        Ty::Str | Ty::Path | Ty::Enum(_) | Ty::Device => Ok(Value::String(s.to_string())),
    }
}

/// What a value is, for "expected …, found …".
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "nothing (null)".into(),
        Value::Bool(_) => "a boolean".into(),
        Value::Number(n) => format!("the number {n}"),
        Value::String(_) => "a string".into(),
        Value::Array(_) => "an array".into(),
        Value::Object(_) => "a table".into(),
    }
}

/// Checks `value` against the type of `flag`'s key; the message names neither key nor source.
pub fn check_value(flag: &Flag, value: &Value) -> Result<(), String> {
    let wrong = |expected: &str, found: &Value| {
        Err(format!("expected {expected}, found {}", describe(found)))
    };
    if value.is_null() && flag.kind == Kind::Optional {
        return Ok(());
    }
    match flag.kind {
        Kind::Switch => {
            if !value.is_boolean() {
                return wrong("true or false", value);
            }
        }
        Kind::Value | Kind::Optional => {
            let (ok, expected) = match flag.ty {
                Ty::Bool => (value.is_boolean(), "true or false"),
                Ty::UInt => (value.is_u64(), "a non-negative integer"),
                Ty::Int => (value.is_i64(), "an integer"),
                Ty::Float => (value.is_number(), "a number"),
                Ty::Str | Ty::Path | Ty::Enum(_) | Ty::Device => (value.is_string(), "a string"),
            };
            if !ok {
                return wrong(expected, value);
            }
        }
        Kind::Values if value.is_string() => {}
        Kind::List | Kind::CommaList | Kind::Values => {
            let (is_item, expected): (fn(&Value) -> bool, _) = if flag.kind != Kind::CommaList {
                (Value::is_string, "an array of strings")
            } else {
                (Value::is_u64, "an array of token ids")
            };
            match value {
                Value::Array(items) => {
                    if let Some(bad) = items.iter().find(|item| !is_item(item)) {
                        return Err(format!("expected {expected}, found {} in it", describe(bad)));
                    }
                }
                other => return wrong(expected, other),
            }
        }
    }
    let mut one = Map::new();
    one.insert(flag.key.to_string(), value.clone());
    match serde_json::from_value::<RunConfig>(Value::Object(one)) {
        Ok(_) => Ok(()),
        Err(e) => match (flag.ty, value) {
            (Ty::Enum(names), Value::String(s)) => {
                Err(format!("unknown value '{s}'; expected one of {}", names.join(", ")))
            }
            _ => Err(e.to_string()),
        },
    }
}

/// Edit distance of two keys (Levenshtein, by char).
fn distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, &cb) in b.iter().enumerate() {
            let next = (diagonal + usize::from(ca != cb)).min(row[j] + 1).min(row[j + 1] + 1);
            diagonal = row[j + 1];
            row[j + 1] = next;
        }
    }
    row[b.len()]
}

/// slime flags of the RL loop that miles-rs does not take, with what to do instead. A run given
/// one, as a flag or as a key of `--config`, stops with this answer rather than a bare
/// "unknown argument". (Cluster, Megatron and SGLang flags are [`crate::slime_compat`]'s.)
pub const SLIME_UNSUPPORTED: &[(&str, &str)] = &[
    ("custom-advantage-function-path", "the estimators are built in: --advantage-estimator"),
    ("custom-loss-function-path", "the losses are built in: --loss-type policy_loss|sft_loss"),
    ("custom-pg-loss-reducer-function-path", "the reducer is built in: --calculate-per-token-loss"),
    (
        "custom-tis-function-path",
        "the tis plugin implements slime's vanilla TIS, icepop and MIS: --use-tis with \
         --tis-mode truncate|clip|mask|icepop, --tis-level, --use-rs and the --rs-* flags",
    ),
    (
        "get-mismatch-metrics",
        "--use-tis reports the mismatch metrics (train/mis_kl, train/mis_chi2_token, …); \
         train/train_rollout_logprob_abs_diff is reported always",
    ),
    ("tis-upper-bound", "MIS's key is --tis-clip here"),
    (
        "tis-lower-bound",
        "MIS's key is --tis-clip-low here for clip and mask; MIS's truncate uses it only as the \
         rejection lower bound: --rs-lower-bound",
    ),
    ("custom-reward-post-process-path", "use --disable-rewards-normalization or a reward plugin"),
    ("use-opd", "on-policy distillation is not implemented"),
    ("opd-type", "on-policy distillation is not implemented"),
    ("opd-kl-coef", "on-policy distillation is not implemented"),
    ("ref-update-interval", "the reference model stays the initial policy"),
    ("value-clip", "PPO's critic is not implemented (nor --advantage-estimator ppo)"),
    ("num-critic-only-steps", "PPO's critic is not implemented (nor --advantage-estimator ppo)"),
    ("use-rollout-entropy", "entropy-based loss masks are not implemented"),
    ("use-routing-replay", "Rollout Routing Replay is --use-rollout-routing-replay (MoE)"),
    ("reset-optimizer-states", "the optimizer state always carries over"),
    ("use-stateless-adam", "AdamW keeps its moments"),
    ("disable-compute-advantages-and-returns", "use --loss-type sft_loss for supervised steps"),
    ("keep-old-actor", "the old policy's logprobs are computed once per rollout"),
    (
        "log-probs-chunk-size",
        "the fused LM head never holds all rows' logits; --micro-batch-size bounds memory",
    ),
    ("recompute-loss-function", "the loss is host math over per-token logprobs"),
];

/// The answer to an unsupported slime flag (`key` without `--`).
pub fn unsupported_slime_flag(key: &str) -> Option<String> {
    let (k, why) = SLIME_UNSUPPORTED.iter().find(|(k, _)| *k == key)?;
    Some(format!("--{k} is a slime flag that miles-rs does not support: {why}"))
}

/// A clap "unknown argument" error for an unsupported slime flag, with the answer instead.
pub fn explain_unknown_argument(e: clap::Error) -> clap::Error {
    use clap::error::{ContextKind, ContextValue};
    if e.kind() != ErrorKind::UnknownArgument {
        return e;
    }
    let Some(ContextValue::String(arg)) = e.get(ContextKind::InvalidArg) else {
        return e;
    };
    let key = arg.trim_start_matches('-').split('=').next().unwrap_or_default();
    match unsupported_slime_flag(key) {
        Some(answer) => clap::Error::raw(ErrorKind::UnknownArgument, format!("{answer}\n")),
        None => e,
    }
}

/// The known key closest to `key`, when it is close enough to be a typo.
pub fn closest_key(key: &str) -> Option<&'static str> {
    let (best, d) = FLAGS.iter().map(|f| (f.key, distance(key, f.key))).min_by_key(|&(_, d)| d)?;
    (d <= (key.chars().count() / 3).max(2)).then_some(best)
}

/// Checks a layer of `key: value` pairs (snake_case keys accepted) and writes it over `merged`;
/// `source` prefixes the messages (`run.toml`, `built-in defaults`).
fn overlay(
    (merged, compat): (&mut Map<String, Value>, &mut Map<String, Value>),
    layer: &Map<String, Value>,
    source: &str,
) -> anyhow::Result<()> {
    let mut seen: Map<String, Value> = Map::new();
    for (spelled, value) in layer {
        let key = spelled.replace('_', "-");
        if crate::slime_compat::compat(&key).is_some() {
            compat.insert(key, value.clone());
            continue;
        }
        let Some(flag) = flag(&key) else {
            if let Some(answer) = unsupported_slime_flag(&key) {
                bail!("{source}: key '{spelled}': {answer}");
            }
            let hint = match closest_key(&key) {
                Some(close) => format!("; did you mean '{close}'?"),
                None if value.is_object() => "; the keys are flat flag names, no [tables]".into(),
                None => "; `miles train --help` lists the keys".into(),
            };
            bail!("{source}: unknown key '{spelled}'{hint}");
        };
        if let Some(Value::String(first)) = seen.get(&key) {
            bail!("{source}: key '{key}' is given twice (as '{first}' and '{spelled}')");
        }
        seen.insert(key.clone(), Value::String(spelled.clone()));
        check_value(flag, value).map_err(|e| anyhow::anyhow!("{source}: key '{spelled}': {e}"))?;
        merged.insert(key, value.clone());
    }
    Ok(())
}

/// The keys of a TOML file as JSON; a syntax error names the file, line and column.
fn read_toml(path: &Path) -> anyhow::Result<Map<String, Value>> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).with_context(|| format!("--config {shown}"))?;
    let table: toml::Table = toml::from_str(&text).map_err(|e| {
        let at = e.span().map(|span| {
            let before = &text[..span.start.min(text.len())];
            let line = before.matches('\n').count() + 1;
            let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
            format!(":{line}:{column}")
        });
        anyhow::anyhow!(
            "{shown}{}: invalid TOML: {}",
            at.unwrap_or_default(),
            e.message().trim_end()
        )
    })?;
    table
        .into_iter()
        .map(|(key, value)| {
            let json =
                toml_to_json(value).map_err(|e| anyhow::anyhow!("{shown}: key '{key}': {e}"))?;
            Ok((key, json))
        })
        .collect()
}

fn toml_to_json(value: toml::Value) -> Result<Value, String> {
    Ok(match value {
        toml::Value::String(s) => Value::String(s),
        toml::Value::Integer(i) => Value::from(i),
        toml::Value::Float(x) => Value::Number(
            serde_json::Number::from_f64(x).ok_or_else(|| format!("{x} is not a finite number"))?,
        ),
        toml::Value::Boolean(b) => Value::Bool(b),
        toml::Value::Datetime(d) => Value::String(d.to_string()),
        toml::Value::Array(items) => {
            Value::Array(items.into_iter().map(toml_to_json).collect::<Result<_, _>>()?)
        }
        toml::Value::Table(table) => Value::Object(
            table
                .into_iter()
                .map(|(k, v)| Ok((k, toml_to_json(v)?)))
                .collect::<Result<_, String>>()?,
        ),
    })
}

/// The run's configuration: `RunConfig::default()`, then `base` (the caller's embedded
/// defaults), then the TOML file of `args.config`, then the flags, each layer checked key by key
/// with errors naming its source; then `RunConfig::validate()`, whose error is returned as-is.
pub fn build_run_config(base: &Map<String, Value>, args: &TrainArgs) -> anyhow::Result<RunConfig> {
    let mut merged = default_object();
    let mut compat = Map::new();
    overlay((&mut merged, &mut compat), base, "built-in defaults")?;
    if let Some(path) = &args.config {
        let file = read_toml(path)?;
        overlay((&mut merged, &mut compat), &file, &path.display().to_string())?;
    }
    for (key, value) in &args.flags {
        let Some(flag) = flag(key) else {
            bail!("--{key}: not a flag of `miles train`");
        };
        check_value(flag, value).map_err(|e| anyhow::anyhow!("--{key}: {e}"))?;
        merged.insert(key.clone(), value.clone());
    }
    compat.extend(args.compat.clone());
    if let Some(warning) = crate::slime_compat::apply(&compat, &mut merged)? {
        eprintln!("{warning}");
    }
    let config: RunConfig = serde_json::from_value(Value::Object(merged))
        .map_err(|e| anyhow::anyhow!("run configuration: {e}"))?;
    config.validate()?;
    Ok(config)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use clap::{Args, FromArgMatches};
    use miles_core::config::{AdvantageEstimator, DistBackend, KlLossType, TisMode};
    use serde_json::json;

    use super::*;

    fn parse(argv: &[&str]) -> Result<TrainArgs, String> {
        let cmd = TrainArgs::augment_args(Command::new("train"));
        let matches = cmd
            .try_get_matches_from(std::iter::once("train").chain(argv.iter().copied()))
            .map_err(|e| explain_unknown_argument(e).to_string())?;
        TrainArgs::from_arg_matches(&matches).map_err(|e| e.to_string())
    }

    fn config(argv: &[&str]) -> anyhow::Result<RunConfig> {
        let args = parse(argv).map_err(anyhow::Error::msg)?;
        build_run_config(&Map::new(), &args)
    }

    fn error(result: anyhow::Result<RunConfig>) -> String {
        format!("{:#}", result.expect_err("expected an error"))
    }

    /// A TOML file under a fresh directory of the system temp dir.
    fn toml_file(text: &str) -> PathBuf {
        static N: AtomicUsize = AtomicUsize::new(0);
        let dir = std::env::temp_dir().join(format!(
            "miles-run-flags-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("run.toml");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn the_table_covers_exactly_the_run_config_keys() {
        let keys: BTreeSet<String> = default_object().keys().cloned().collect();
        let rows: BTreeSet<String> = FLAGS.iter().map(|f| f.key.to_string()).collect();
        assert_eq!(rows.len(), FLAGS.len(), "a key has two rows");
        let missing: Vec<_> = keys.difference(&rows).collect();
        let extra: Vec<_> = rows.difference(&keys).collect();
        assert!(missing.is_empty(), "RunConfig keys without a flag: {missing:?}");
        assert!(extra.is_empty(), "flags that are no RunConfig key: {extra:?}");
    }

    #[test]
    fn each_row_kind_and_type_fit_the_key() {
        let defaults = default_object();
        for flag in FLAGS {
            let default = &defaults[flag.key];
            let fits = |v: Value| check_value(flag, &v).is_ok();
            match flag.kind {
                Kind::Switch => assert_eq!(default, &json!(false), "{}", flag.key),
                Kind::Optional => assert!(default.is_null(), "{} is not an Option", flag.key),
                Kind::Value => {
                    assert!(!default.is_null() && !default.is_array(), "{}", flag.key);
                    // The default itself passes the row's check.
                    check_value(flag, default).unwrap();
                }
                Kind::List | Kind::CommaList | Kind::Values => {
                    assert_eq!(default, &json!([]), "{}", flag.key)
                }
            }
            // What the row's type accepts, RunConfig accepts, and what it refuses, RunConfig
            // refuses too (the row's check runs before serde's, so test serde alone).
            let serde_ok =
                |v: Value| serde_json::from_value::<RunConfig>(json!({ flag.key: v })).is_ok();
            let (good, bad) = match (flag.kind, flag.ty) {
                (Kind::Switch, _) => (json!(true), json!("x")),
                (Kind::List | Kind::Values, _) => (json!(["a"]), json!([1])),
                (Kind::CommaList, _) => (json!([1, 2]), json!(["a"])),
                (_, Ty::UInt) => (json!(3), json!(0.5)),
                (_, Ty::Int) => (json!(-3), json!(0.5)),
                (_, Ty::Float) => (json!(0.5), json!("x")),
                (_, Ty::Str | Ty::Path) => (json!("x"), json!(1)),
                (_, Ty::Enum(names)) => (json!(names[0]), json!("no-such-value")),
                (_, Ty::Device) => (json!("cuda:1"), json!("gpu")),
                (_, Ty::Bool) => panic!("{}: a bool must be a switch", flag.key),
            };
            assert!(fits(good.clone()) && serde_ok(good.clone()), "{}: {good} refused", flag.key);
            assert!(!fits(bad.clone()) && !serde_ok(bad.clone()), "{}: {bad} accepted", flag.key);
            if flag.ty == Ty::UInt && flag.kind != Kind::CommaList {
                assert!(!serde_ok(json!(-1)), "{} is signed", flag.key);
            }
            if flag.ty == Ty::Int {
                assert!(serde_ok(json!(-1)), "{} is unsigned", flag.key);
            }
        }
    }

    #[test]
    fn enum_rows_list_exactly_what_serde_accepts() {
        for flag in FLAGS {
            let Ty::Enum(names) = flag.ty else { continue };
            for name in names {
                check_value(flag, &json!(name)).unwrap_or_else(|e| panic!("{}: {e}", flag.key));
            }
            let err = serde_json::from_value::<RunConfig>(json!({ flag.key: "zzz" }))
                .unwrap_err()
                .to_string();
            // serde's "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, `c`".
            let expected = err.split(", expected ").nth(1).unwrap_or_else(|| panic!("{err}"));
            let serde_names: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
            assert_eq!(&serde_names, names, "{}", flag.key);
        }
    }

    #[test]
    fn no_flags_give_the_defaults_and_an_empty_map() {
        let args = parse(&[]).unwrap();
        assert_eq!(args, TrainArgs::default());
        assert_eq!(build_run_config(&Map::new(), &args).unwrap(), RunConfig::default());
    }

    #[test]
    fn precedence_is_default_base_toml_flag() {
        let base = json!({"rollout-batch-size": 2, "n-samples-per-prompt": 4, "lr": 0.5})
            .as_object()
            .unwrap()
            .clone();
        let file = toml_file("n-samples-per-prompt = 8\nlr = 0.25\n");
        let args = parse(&["--config", file.to_str().unwrap(), "--lr", "0.125"]).unwrap();
        assert_eq!(args.config.as_deref(), Some(file.as_path()));
        assert_eq!(args.flags, *json!({"lr": 0.125}).as_object().unwrap());
        let c = build_run_config(&base, &args).unwrap();
        assert_eq!(c.rollout_batch_size, 2); // base over default 8
        assert_eq!(c.n_samples_per_prompt, 8); // file over base
        assert_eq!(c.lr, 0.125); // flag over file
        assert_eq!(c.seed, RunConfig::default().seed);
        // The flags map holds only what was given: a flag equal to the default still overrides.
        let args = parse(&["--config", file.to_str().unwrap(), "--n-samples-per-prompt", "1"]);
        assert_eq!(build_run_config(&base, &args.unwrap()).unwrap().n_samples_per_prompt, 1);
    }

    #[test]
    fn switches_optionals_lists_and_negative_numbers() {
        let c = config(&[
            "--use-tis",
            "--group-rm=true",
            "--eps-clip-high",
            "0.28",
            "--save-interval",
            "5",
            "--rollout-stop",
            "</answer>",
            "--rollout-stop",
            "\n\n",
            "--rollout-stop-token-ids",
            "7,11",
            "--rollout-stop-token-ids",
            "13",
            "--rollout-top-k",
            "-1",
            "--rollout-seed",
            "3",
            "--rollout-seed",
            "9",
            "--hf-checkpoint",
            "models/tiny",
            "--tis-mode",
            "mask",
            "--kl-loss-type",
            "kl",
            "--advantage-estimator",
            "reinforce_plus_plus_baseline",
        ])
        .unwrap();
        assert!(c.use_tis && c.group_rm);
        assert!(!c.partial_rollout);
        assert_eq!(c.eps_clip_high, Some(0.28));
        assert_eq!(c.save_interval, Some(5));
        assert_eq!(c.rollout_stop, ["</answer>", "\n\n"]);
        assert_eq!(c.rollout_stop_token_ids, [7, 11, 13]);
        assert_eq!(c.rollout_top_k, -1);
        assert_eq!(c.rollout_seed, 9, "the last of a repeated flag wins");
        assert_eq!(c.hf_checkpoint, Some(PathBuf::from("models/tiny")));
        assert_eq!(c.tis_mode, TisMode::Mask);
        assert_eq!(c.kl_loss_type, KlLossType::K1);
        assert_eq!(c.advantage_estimator, AdvantageEstimator::ReinforcePlusPlusBaseline);
        let c = config(&["--rollout-top-k", "-1", "--lr", "-0", "--rollout-top-k", "20"]).unwrap();
        assert_eq!(c.rollout_top_k, 20);

        // `=false` undoes a switch set by a lower layer; an empty id list clears one.
        let file = toml_file("use-tis = true\nrollout-stop-token-ids = [1, 2]\n");
        let f = file.to_str().unwrap();
        let c = config(&["--config", f, "--use-tis=false", "--rollout-stop-token-ids", ""]);
        let c = c.unwrap();
        assert!(!c.use_tis);
        assert!(c.rollout_stop_token_ids.is_empty());
        // A switch takes no separate value.
        assert!(parse(&["--use-tis", "false"]).is_err());
    }

    #[test]
    fn bad_flag_values_name_the_flag() {
        let e = parse(&["--lr", "abc"]).unwrap_err();
        assert!(e.contains("--lr: invalid value 'abc': expected a number"), "{e}");
        let e = parse(&["--rollout-batch-size", "-3"]).unwrap_err();
        assert!(
            e.contains("--rollout-batch-size: invalid value '-3': expected a non-negative integer"),
            "{e}"
        );
        let e = parse(&["--rollout-top-k", "1.5"]).unwrap_err();
        assert!(e.contains("--rollout-top-k: invalid value '1.5': expected an integer"), "{e}");
        let e = parse(&["--rollout-stop-token-ids", "1,x"]).unwrap_err();
        assert!(e.contains("--rollout-stop-token-ids: invalid value 'x'"), "{e}");
        let e = parse(&["--use-tis=yes"]).unwrap_err();
        assert!(e.contains("--use-tis: invalid value 'yes': expected true or false"), "{e}");
        let e = parse(&["--advantage-estimator", "foo"]).unwrap_err();
        assert!(
            e.contains(
                "--advantage-estimator: unknown value 'foo'; expected one of grpo, gspo, cispo, \
                 reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, ppo"
            ),
            "{e}"
        );
        // The same checks hold for a hand-built TrainArgs.
        let args = TrainArgs {
            flags: json!({"tis-mode": "soft"}).as_object().unwrap().clone(),
            ..TrainArgs::default()
        };
        let e = error(build_run_config(&Map::new(), &args));
        assert!(e.starts_with("--tis-mode: unknown value 'soft'; expected one of truncate"), "{e}");
        let args = TrainArgs {
            flags: json!({"lrr": 1}).as_object().unwrap().clone(),
            ..TrainArgs::default()
        };
        assert!(error(build_run_config(&Map::new(), &args)).starts_with("--lrr:"));
        assert!(parse(&["--no-such-flag", "1"]).is_err());
    }

    #[test]
    fn toml_errors_name_the_file_and_key() {
        let file = toml_file("rollout-batch-size = 4\nrollout-batchsize = 8\n");
        let shown = file.display().to_string();
        let e = error(config(&["--config", &shown]));
        assert_eq!(
            e,
            format!("{shown}: unknown key 'rollout-batchsize'; did you mean 'rollout-batch-size'?")
        );

        let file = toml_file("lr = \"fast\"\n");
        let shown = file.display().to_string();
        let e = error(config(&["--config", &shown]));
        assert_eq!(e, format!("{shown}: key 'lr': expected a number, found a string"));

        let file = toml_file("advantage-estimator = \"foo\"\n");
        let e = error(config(&["--config", file.to_str().unwrap()]));
        assert!(e.ends_with("key 'advantage-estimator': unknown value 'foo'; expected one of grpo, gspo, cispo, reinforce_plus_plus, reinforce_plus_plus_baseline, rloo, ppo"), "{e}");

        let file = toml_file("seed = 1\nlr = \n");
        let shown = file.display().to_string();
        let e = error(config(&["--config", &shown]));
        assert!(e.starts_with(&format!("{shown}:2:")), "{e}");
        assert!(e.contains("invalid TOML"), "{e}");

        let file = toml_file("rollout-stop = [\"a\", 1]\n");
        let e = error(config(&["--config", file.to_str().unwrap()]));
        assert!(e.contains("key 'rollout-stop': expected an array of strings"), "{e}");

        let file = toml_file("[rollout]\nbatch-size = 4\n");
        let e = error(config(&["--config", file.to_str().unwrap()]));
        assert!(e.contains("unknown key 'rollout'; the keys are flat"), "{e}");

        let file = toml_file("rollout_seed = 1\nrollout-seed = 2\n");
        let e = error(config(&["--config", file.to_str().unwrap()]));
        assert!(e.contains("key 'rollout-seed' is given twice"), "{e}");

        let missing = std::env::temp_dir().join("miles-run-flags-no-such-dir/run.toml");
        let e = error(config(&["--config", missing.to_str().unwrap()]));
        assert!(e.starts_with(&format!("--config {}", missing.display())), "{e}");
    }

    #[test]
    fn toml_accepts_snake_case_and_every_value_type() {
        let file = toml_file(
            "rollout_batch_size = 4\nn-samples-per-prompt = 2\nlr = 1\nuse_tis = true\n\
             rs-veto-threshold = 1e-4\nuse-rs = true\nrollout-stop = [\"###\"]\nrollout-top-k = -1\n\
             kl-loss-type = \"low_var_kl\"\nprompt-data = \"data.jsonl@[0:8]\"\n",
        );
        let c = config(&["--config", file.to_str().unwrap()]).unwrap();
        assert_eq!((c.rollout_batch_size, c.n_samples_per_prompt), (4, 2));
        assert_eq!(c.lr, 1.0, "an integer is a number");
        assert!(c.use_tis);
        assert_eq!(c.rs_veto_threshold, Some(1e-4));
        assert_eq!(c.rollout_stop, ["###"]);
        assert_eq!(c.kl_loss_type, KlLossType::LowVarKl);
        assert_eq!(c.prompt_data.as_deref(), Some("data.jsonl@[0:8]"));
    }

    #[test]
    fn validation_errors_surface_as_is() {
        let e = error(config(&["--eps-clip-c", "0.5"]));
        assert!(e.starts_with("--eps-clip-c: 0.5 must be > 1"), "{e}");
        let file = toml_file("num-rollout = 3\n");
        let e = error(config(&["--config", file.to_str().unwrap(), "--num-epoch", "2"]));
        assert!(e.starts_with("--num-epoch: give --num-rollout or --num-epoch"), "{e}");
        let e = error(config(&["--distributed-backend", "nccl"]));
        assert!(e.starts_with("--distributed-backend: nccl sums GPU tensors"), "{e}");
        let c = config(&["--distributed-backend", "tcp", "--device", "cuda:0"]).unwrap();
        assert_eq!(c.distributed_backend, Some(DistBackend::Tcp));
        let base = json!({"rollout-batch-size": 0}).as_object().unwrap().clone();
        let e = error(build_run_config(&base, &TrainArgs::default()));
        assert!(e.starts_with("--rollout-batch-size: must be at least 1"), "{e}");
        let base = json!({"rollout-batch-size": "8"}).as_object().unwrap().clone();
        let e = error(build_run_config(&base, &TrainArgs::default()));
        assert!(e.starts_with("built-in defaults: key 'rollout-batch-size'"), "{e}");
    }

    #[test]
    fn unsupported_slime_flags_say_what_to_do_instead() {
        let e = parse(&["--custom-tis-function-path", "mis.py:f"]).unwrap_err();
        assert!(e.contains("--custom-tis-function-path is a slime flag that miles-rs does not support: the tis plugin"), "{e}");
        let e = parse(&["--use-opd=true"]).unwrap_err();
        assert!(e.contains("--use-opd is a slime flag"), "{e}");
        let file = toml_file("get_mismatch_metrics = true\n");
        let e = error(config(&["--config", file.to_str().unwrap()]));
        assert!(e.ends_with("key 'get_mismatch_metrics': --get-mismatch-metrics is a slime flag that miles-rs does not support: --use-tis reports the mismatch metrics (train/mis_kl, train/mis_chi2_token, …); train/train_rollout_logprob_abs_diff is reported always"), "{e}");
        // None of them is a flag miles-rs has.
        for (key, _) in SLIME_UNSUPPORTED {
            assert!(flag(key).is_none(), "{key}");
        }
        // A plain typo still gets its hint.
        assert!(parse(&["--eps-clip-hgih", "0.3"]).is_err());
    }

    #[test]
    fn help_lists_enum_values_and_defaults() {
        let mut cmd = TrainArgs::augment_args(Command::new("train"));
        let help = cmd.render_long_help().to_string();
        assert!(help.contains("--config <FILE>"), "{help}");
        assert!(help.contains("[one of: grpo, gspo, cispo, reinforce_plus_plus"), "{help}");
        assert!(help.contains("[default: 8]"), "{help}");
        assert!(help.contains("[default: 1e-6]"), "{help}");
        assert!(help.contains("--use-tis[=<BOOL>]"), "{help}");
        for flag in FLAGS {
            assert!(
                help.contains(&format!("--{} ", flag.key))
                    || help.contains(&format!("--{}[", flag.key))
                    || help.contains(&format!("--{}\n", flag.key)),
                "{}",
                flag.key
            );
        }
        assert_eq!(closest_key("eps-clip-hgih"), Some("eps-clip-high"));
        assert_eq!(closest_key("learning-rate"), None);
    }

    /// The argument lists of slime's example scripts (Qwen2.5-0.5B on GSM8K, Qwen3-4B and
    /// Qwen3-30B-A3B; their model, checkpoint, rollout, eval, perf, GRPO, optimizer, W&B,
    /// SGLang and misc arrays, paths replaced) run as `miles train` arguments; the parallelism
    /// not built here is refused by name, and with it set to 1 they run.
    #[test]
    fn slimes_example_scripts_run_unchanged_but_for_parallelism_not_built() {
        const COMMON: &str = "--swiglu --use-rotary-position-embeddings --disable-bias-linear \
            --normalization RMSNorm --norm-epsilon 1e-6 --rotary-base 1000000 \
            --group-query-attention --vocab-size 151936 --hf-checkpoint /m --ref-load /m_dist \
            --prompt-data /d/train.jsonl --input-key prompt --label-key label \
            --apply-chat-template --rollout-shuffle --num-rollout 3000 \
            --rollout-max-response-len 8192 --rollout-temperature 0.8 --sequence-parallel \
            --pipeline-model-parallel-size 1 --context-parallel-size 1 \
            --expert-tensor-parallel-size 1 --use-dynamic-batch-size --max-tokens-per-gpu 9216 \
            --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 \
            --kl-loss-type low_var_kl --entropy-coef 0.00 --eps-clip 0.2 --eps-clip-high 0.28 \
            --optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 \
            --adam-beta1 0.9 --adam-beta2 0.98 --sglang-mem-fraction-static 0.7 \
            --attention-dropout 0.0 --hidden-dropout 0.0 --accumulate-allreduce-grads-in-fp32 \
            --attention-softmax-in-fp32 --attention-backend flash --actor-num-nodes 1 --colocate";
        const QWEN25_05B: &str = "--num-layers 24 --hidden-size 896 --ffn-hidden-size 4864 \
            --num-attention-heads 14 --add-qkv-bias --num-query-groups 2 --rm-type math \
            --rollout-batch-size 32 --n-samples-per-prompt 8 --over-sampling-batch-size 64 \
            --dynamic-sampling-filter-path \
            slime.rollout.filter_hub.dynamic_sampling_filters.check_reward_nonzero_std \
            --global-batch-size 256 --eval-interval 20 --eval-prompt-data gsm8k /d/test.parquet \
            --n-samples-per-eval-prompt 1 --eval-max-response-len 1024 --eval-top-k 1 \
            --tensor-model-parallel-size 1 --expert-model-parallel-size 1 --use-wandb \
            --wandb-project slime-test --wandb-group test-qwen2.5-0.5B-gsm8k \
            --rollout-num-gpus-per-engine 1 --actor-num-gpus-per-node 4";
        const QWEN3_4B: &str = "--num-layers 36 --hidden-size 2560 --ffn-hidden-size 9728 \
            --num-attention-heads 32 --num-query-groups 8 --kv-channels 128 --qk-layernorm \
            --load /ckpt --save /ckpt --save-interval 20 --rm-type deepscaler \
            --rollout-batch-size 32 --n-samples-per-prompt 8 --global-batch-size 256 \
            --balance-data --eval-interval 20 --eval-prompt-data aime /d/aime.jsonl \
            --n-samples-per-eval-prompt 16 --eval-max-response-len 16384 --eval-top-p 0.7 \
            --tensor-model-parallel-size 2 --expert-model-parallel-size 1 \
            --recompute-granularity full --recompute-method uniform --recompute-num-layers 1 \
            --rollout-num-gpus-per-engine 2 --actor-num-gpus-per-node 8";
        const QWEN3_30B_A3B: &str = "--qk-layernorm --num-attention-heads 32 \
            --num-query-groups 4 --kv-channels 128 --num-layers 48 --hidden-size 2048 \
            --ffn-hidden-size 6144 --position-embedding-type rope --rotary-percent 1.0 \
            --untie-embeddings-and-output-weights --moe-ffn-hidden-size 768 \
            --moe-router-score-function softmax --moe-token-dispatcher-type alltoall \
            --moe-router-topk 8 --moe-layer-freq ([1]*48) --num-experts 128 --moe-grouped-gemm \
            --moe-token-drop-policy probs --moe-router-dtype fp32 --moe-permute-fusion \
            --moe-aux-loss-coeff 0 --rm-type deepscaler --rollout-batch-size 8 \
            --n-samples-per-prompt 4 --global-batch-size 32 --balance-data \
            --eval-prompt-data aime /d/aime.jsonl --n-samples-per-eval-prompt 16 \
            --eval-max-response-len 16384 --eval-top-p 0.7 --tensor-model-parallel-size 4 \
            --expert-model-parallel-size 8 --recompute-granularity full \
            --recompute-method uniform --recompute-num-layers 1 --use-tis \
            --tis-level geometric --optimizer-cpu-offload --overlap-cpu-optimizer-d2h-h2d \
            --use-precision-aware-optimizer --use-wandb --wandb-project slime-dev \
            --wandb-group qwen3-30B-A3B-TIS --wandb-run-id qwen3-30B-A3B-TIS-sequence \
            --wandb-key KEY --rollout-num-gpus-per-engine 8 \
            --sglang-cuda-graph-bs 1 2 4 8 16 24 32 --actor-num-gpus-per-node 8";
        let run = |script: &str, ones: bool| -> anyhow::Result<RunConfig> {
            let mut text = format!("{COMMON} {script}");
            if ones {
                for key in ["tensor-model", "expert-model"] {
                    for n in ["2", "4", "8"] {
                        let given = format!("--{key}-parallel-size {n} ");
                        text = text.replace(&given, &format!("--{key}-parallel-size 1 "));
                    }
                }
                for n in ["2", "8"] {
                    let given = format!("--rollout-num-gpus-per-engine {n} ");
                    text = text.replace(&given, "--rollout-num-gpus-per-engine 1 ");
                }
            }
            config(&text.split_whitespace().collect::<Vec<_>>())
        };
        let c = run(QWEN25_05B, false).unwrap();
        assert_eq!((c.nproc_per_node, c.rollout_kv_cache_fraction), (4, Some(0.7)));
        assert_eq!(c.eval_prompt_data, ["gsm8k", "/d/test.parquet"]);
        assert_eq!((c.over_sampling_batch_size, c.eval_top_k), (Some(64), Some(1)));
        let e = error(run(QWEN3_4B, false));
        assert!(
            e.contains("--tensor-model-parallel-size 2: tensor parallelism is not built"),
            "{e}"
        );
        let c = run(QWEN3_4B, true).unwrap();
        assert_eq!((c.nproc_per_node, c.eval_top_p), (8, Some(0.7)));
        let e = error(run(QWEN3_30B_A3B, false));
        assert!(e.contains("--tensor-model-parallel-size 4: tensor parallelism"), "{e}");
        let c = run(QWEN3_30B_A3B, true).unwrap();
        assert!(c.use_tis && c.eval_prompt_data.len() == 2);
        // Meaning what they say: dropout, other filters, several nodes.
        for (flags, says) in [
            ("--attention-dropout 0.1", "--attention-dropout 0.1: dropout is not built"),
            ("--dynamic-sampling-filter-path my.filter", "other filters are not taken"),
            ("--actor-num-nodes 2", "--actor-num-nodes 2: several nodes"),
            ("--eval-prompt-data a b c", "--eval-prompt-data: 3 values"),
            ("--optimizer sgd", "--optimizer"),
        ] {
            let e = error(config(&flags.split_whitespace().collect::<Vec<_>>()));
            assert!(e.contains(says), "{flags}: {e}");
        }
        // A config file takes them as keys too.
        let file = toml_file("tensor-model-parallel-size = 1\nsequence-parallel = true\n");
        config(&["--config", file.to_str().unwrap()]).unwrap();
    }
}
