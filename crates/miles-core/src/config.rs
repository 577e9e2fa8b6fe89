//! Run configuration. Every key is a slime/miles flag name without the leading `--`
//! (`rollout-batch-size`, `eps-clip-high`, …), with the same meaning and, where slime has one,
//! the same default; a TOML file uses the same keys and flags override it. Unknown keys are
//! refused so a typo never silently falls back to a default.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{Error, Result, SamplingParams};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdvantageEstimator {
    #[default]
    Grpo,
    Gspo,
    /// CISPO (MiniMax-M1): GRPO advantages with the loss −sg(clip(ρ))·A·logp.
    Cispo,
    ReinforcePlusPlus,
    ReinforcePlusPlusBaseline,
    Rloo,
    Ppo,
}

/// Estimators of KL(policy ‖ reference) for `--kl-loss-type`; slime's `kl` is `k1`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlLossType {
    #[default]
    #[serde(alias = "kl")]
    K1,
    K2,
    K3,
    LowVarKl,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossType {
    #[default]
    PolicyLoss,
    SftLoss,
}

/// `--fp8-format`: the FP8 element type (E4M3, what Hopper's tensor cores and DeepSeek-V3's
/// checkpoints hold; Transformer Engine's `hybrid` and E5M2 are not implemented).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Format {
    #[default]
    E4m3,
}

/// `--sglang-speculative-algorithm`: SGLang's EAGLE with a one-layer MTP draft (its `NEXTN`
/// is the same); EAGLE3's multi-layer draft is not implemented.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SpeculativeAlgorithm {
    #[serde(rename = "EAGLE", alias = "NEXTN")]
    Eagle,
}

/// `--fp8-recipe`: how FP8 values are scaled. `blockwise`: 128 × 128 weight blocks and
/// 1 × 128 activation groups with f32 scales (DeepSeek-V3's, miles' on Hopper).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fp8Recipe {
    #[default]
    Blockwise,
}

/// What one importance weight covers: a token, a whole sequence (product of token ratios), or
/// the geometric mean of a sequence's token ratios.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TisLevel {
    #[default]
    Token,
    Sequence,
    Geometric,
}

/// What happens to a weight outside the bounds: `truncate` caps it at the upper bound (TIS),
/// `clip` clamps it into [lower, upper], `mask` drops the token from the loss (MIS), `icepop`
/// sets the weight to 0 but keeps the token in the loss (slime's `icepop_function`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TisMode {
    #[default]
    Truncate,
    Clip,
    Mask,
    Icepop,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecayStyle {
    #[default]
    Constant,
    Linear,
    Cosine,
}

/// `--rollout-backend`: the embedded engine, or SGLang servers of the user's
/// (`--rollout-url`); vLLM's API is not spoken yet.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RolloutBackend {
    #[default]
    Embedded,
    Sglang,
}

/// `--optimizer`: slime's `adam` is Megatron's, decoupled weight decay (AdamW).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Optimizer {
    #[default]
    Adam,
}

/// `--main-params-dtype`, `--exp-avg-dtype`, `--exp-avg-sq-dtype`: the dtype the optimizer
/// keeps its master weights or a moment in (Megatron's precision-aware optimizer; its fp16 and
/// fp8 are not built, and bf16 masters are ours: Megatron's are fp32 or fp16).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateDtype {
    #[default]
    Fp32,
    Bf16,
}

impl StateDtype {
    /// The flag's spelling.
    pub fn label(self) -> &'static str {
        match self {
            StateDtype::Fp32 => "fp32",
            StateDtype::Bf16 => "bf16",
        }
    }
}

/// A list given as one string or as a list (`--config`'s `eval-prompt-data = "FILE"`).
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    d: D,
) -> std::result::Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match Option::<OneOrMany>::deserialize(d)? {
        None => Vec::new(),
        Some(OneOrMany::One(s)) => vec![s],
        Some(OneOrMany::Many(v)) => v,
    })
}

/// The built-in demo policy's architecture (`--arch`, miles-rs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DemoArch {
    Qwen3,
    Llama,
    Qwen3Moe,
}

impl DemoArch {
    pub fn as_str(self) -> &'static str {
        match self {
            DemoArch::Qwen3 => "qwen3",
            DemoArch::Llama => "llama",
            DemoArch::Qwen3Moe => "qwen3-moe",
        }
    }
}

/// What sums the ranks' gradients and hands out the starting weights (`--distributed-backend`,
/// Megatron's flag; miles-rs' choices). Unset: NCCL for GPU tensors, the TCP group for host ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DistBackend {
    /// NCCL between the ranks' GPUs, one GPU a rank.
    Nccl,
    /// The ranks' TCP group, through host memory: any device, ranks may share a GPU.
    Tcp,
}

/// `--device`, parsed once: `cpu`, `cuda` (the rank's GPU: device 0 in one process, the local
/// rank's under torchrun) or `cuda:N` (that GPU whatever the rank).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSpec {
    #[default]
    Cpu,
    Cuda,
    CudaOrdinal(usize),
}

impl DeviceSpec {
    pub fn is_cuda(self) -> bool {
        self != DeviceSpec::Cpu
    }
}

impl std::str::FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceSpec::Cpu),
            "cuda" => Ok(DeviceSpec::Cuda),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSpec::CudaOrdinal)
                .ok_or_else(|| format!("device `{s}`: use cpu, cuda (device 0) or cuda:N")),
        }
    }
}

impl TryFrom<String> for DeviceSpec {
    type Error = String;

    fn try_from(s: String) -> std::result::Result<Self, String> {
        s.parse()
    }
}

impl From<DeviceSpec> for String {
    fn from(d: DeviceSpec) -> String {
        d.to_string()
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda => f.write_str("cuda"),
            DeviceSpec::CudaOrdinal(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// One run's settings, flat like slime's argument namespace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields, rename_all = "kebab-case")]
pub struct RunConfig {
    // Model and checkpoints.
    pub hf_checkpoint: Option<PathBuf>,
    pub save: Option<PathBuf>,
    pub load: Option<PathBuf>,
    /// A damaged checkpoint at `--load` (a file not matching its checksum) is skipped for the
    /// newest intact one before it, said on stderr, instead of stopping the run.
    pub load_fallback: bool,
    pub save_interval: Option<usize>,
    /// A checkpoint save that fails (a full disk) is a warning and training goes on, instead
    /// of stopping the run.
    pub continue_on_save_error: bool,
    /// Checkpoints are written by a thread of their own while training goes on (Megatron's
    /// flag); the loop waits only for the host copies, and for the last save before the next.
    pub async_save: bool,
    pub save_hf: Option<PathBuf>,
    pub seed: u64,
    /// Where the trainer's model runs (miles-rs).
    pub device: DeviceSpec,
    /// The built-in demo policy's architecture: `qwen3` (when unset), `llama` or `qwen3-moe`
    /// (miles-rs; a checkpoint's config.json names its own).
    pub arch: Option<DemoArch>,
    /// Worker processes to start on this host, one run over them (torchrun's flag; miles-rs).
    pub nproc_per_node: usize,
    /// What sums the gradients over the ranks (unset: NCCL on GPUs, TCP on the CPU).
    pub distributed_backend: Option<DistBackend>,

    // Data.
    pub prompt_data: Option<String>,
    pub input_key: String,
    pub label_key: Option<String>,
    pub metadata_key: Option<String>,
    pub apply_chat_template: bool,
    /// A JSON object of extra chat template variables (`{"enable_thinking": false}`).
    pub apply_chat_template_kwargs: Option<String>,
    pub rollout_shuffle: bool,
    pub num_rollout: Option<usize>,
    pub num_epoch: Option<usize>,
    /// One file, or slime's NAME FILE pairs (each set evaluated apart).
    #[serde(deserialize_with = "one_or_many")]
    pub eval_prompt_data: Vec<String>,
    pub eval_interval: Option<usize>,
    pub n_samples_per_eval_prompt: usize,
    /// Eval sampling; each falls back to its rollout counterpart.
    pub eval_max_response_len: Option<usize>,
    pub eval_temperature: Option<f32>,
    /// 1: greedy evaluation.
    pub eval_top_k: Option<i64>,
    pub eval_top_p: Option<f32>,
    /// Where `metrics.jsonl` and `plots/` go (miles-rs; default `runs/<time>`).
    pub run_dir: Option<PathBuf>,
    /// Every metric also as TensorBoard scalars in `<run dir>/tensorboard/` (slime's flag).
    pub use_tensorboard: bool,
    /// miles-rs: supervised steps on (prompt, label) pairs before RL, with a fresh optimizer at
    /// `sft-lr` (default `lr`); the demo's warm-up.
    pub sft_warmup_steps: usize,
    pub sft_lr: Option<f32>,

    // Rollout.
    pub rollout_batch_size: usize,
    pub n_samples_per_prompt: usize,
    pub over_sampling_batch_size: Option<usize>,
    pub rollout_max_response_len: usize,
    pub rollout_max_prompt_len: Option<usize>,
    pub rollout_temperature: f32,
    pub rollout_top_p: f32,
    /// slime's convention: -1 disables top-k.
    pub rollout_top_k: i64,
    pub rollout_stop: Vec<String>,
    pub rollout_stop_token_ids: Vec<u32>,
    pub rollout_seed: u64,
    /// Groups left unfinished when dynamic sampling aborts the rollout go to a buffer, and the
    /// next rollout continues them first.
    pub partial_rollout: bool,
    /// Tokens a continued response got from an older policy train with loss mask 0 (miles').
    pub mask_offpolicy_in_partial_rollout: bool,
    /// One-step-off asynchronous training (`--async`, slime's `train_async.py`): the rollout of
    /// iteration k + 1 runs, on a copy of the policy one version behind, while iteration k
    /// trains.
    #[serde(rename = "async")]
    pub one_step_off: bool,
    /// The most policy versions a trained sample may lag the trainer by (with `--async`: 1).
    pub max_weight_staleness: usize,
    pub use_rollout_routing_replay: bool,
    /// Embedded engine limits (miles-rs).
    pub rollout_kv_cache_mb: usize,
    /// Who rolls out: the embedded engine, or the SGLang servers at `rollout_url`
    /// (comma-separated `http://host:port`), synced from disk after every step.
    pub rollout_backend: RolloutBackend,
    pub rollout_url: Option<String>,
    /// The KV cache budget as a share of the GPU's free memory once the policy is placed
    /// (SGLang's `--mem-fraction-static` role; slime's flag maps here); replaces the MiB.
    pub rollout_kv_cache_fraction: Option<f64>,
    pub rollout_max_running: usize,
    /// slime's custom generate function, `FILE.py:FUNCTION`: each sample is generated by it
    /// (multi-turn, tools) through the embedded engine's HTTP server, in a Python worker.
    pub custom_generate_function_path: Option<String>,

    // Reward.
    pub rm_type: Option<String>,
    pub custom_rm_path: Option<String>,
    /// The Python interpreter that runs a `--custom-rm-path FILE.py:FUNCTION` reward
    /// (default `python3`).
    pub rm_python: Option<PathBuf>,
    /// JSON handed to the reward when it is created (a plugin's, or remote_rm's settings).
    pub custom_rm_config: Option<String>,
    pub rm_url: Option<String>,
    pub group_rm: bool,
    pub reward_key: Option<String>,

    // Advantage.
    pub advantage_estimator: AdvantageEstimator,
    pub disable_grpo_std_normalization: bool,
    /// GRPO/GSPO/CISPO/REINFORCE++-baseline: use the raw rewards, no group normalization.
    pub disable_rewards_normalization: bool,
    pub normalize_advantages: bool,
    pub gamma: f32,
    pub lambd: f32,

    // Loss.
    pub loss_type: LossType,
    pub eps_clip: f32,
    /// Upper clip range; slime defaults it to `eps-clip`.
    pub eps_clip_high: Option<f32>,
    /// Dual-clip constant (> 1); off when absent.
    pub eps_clip_c: Option<f32>,
    pub use_kl_loss: bool,
    pub kl_loss_coef: f32,
    pub kl_loss_type: KlLossType,
    /// Weight the KL loss by the importance ratio π/π_old (DeepSeek-V3.2's unbiased estimate).
    pub use_unbiased_kl: bool,
    pub kl_coef: f32,
    pub entropy_coef: f32,
    /// A Qwen3-MoE policy's load-balancing loss weight, over its config.json's (miles-rs).
    pub router_aux_loss_coef: Option<f32>,
    pub calculate_per_token_loss: bool,
    pub use_rollout_logprobs: bool,
    /// Off-policy sequence masking: drop the negative-advantage tokens of sequences whose mean
    /// old − new log-ratio exceeds `opsm-delta`.
    pub use_opsm: bool,
    pub opsm_delta: f32,

    // Off-policy correction (the `tis` plugin).
    pub use_tis: bool,
    pub tis_level: TisLevel,
    pub tis_mode: TisMode,
    /// Upper bound of the importance weight (MIS's `tis_upper_bound`).
    pub tis_clip: f32,
    /// Lower bound of the importance weight (MIS's `tis_lower_bound`); default 0 for truncate
    /// and icepop (slime's `--tis-clip-low`), 1/upper for clip and mask (MIS's default).
    pub tis_clip_low: Option<f32>,
    pub tis_batch_normalize: bool,
    /// MIS rejection sampling: tokens (or sequences) whose ratio at `rs-level` is outside
    /// [rs-lower-bound, rs-upper-bound] leave the loss.
    pub use_rs: bool,
    pub rs_level: TisLevel,
    /// Default: the TIS lower bound as `tis-clip-low` resolves for clip/mask (1/upper).
    pub rs_lower_bound: Option<f32>,
    /// Default: `tis-clip`.
    pub rs_upper_bound: Option<f32>,
    /// With `use-rs`: drop a whole sequence when any token's ratio is below this.
    pub rs_veto_threshold: Option<f32>,

    // Optimizer and schedule.
    pub lr: f32,
    pub min_lr: f32,
    pub lr_warmup_iters: usize,
    /// Optimizer steps the decay spans; default: every step of the run.
    pub lr_decay_iters: Option<usize>,
    pub lr_decay_style: LrDecayStyle,
    pub weight_decay: f32,
    pub optimizer: Optimizer,
    pub adam_beta1: f32,
    pub adam_beta2: f32,
    pub adam_eps: f32,
    /// Megatron's switch for the optimizer dtypes below (without it they must stay fp32).
    pub use_precision_aware_optimizer: bool,
    /// bf16: the matrices' master weights are their bf16 compute copies, AdamW rounding each
    /// update stochastically.
    pub main_params_dtype: StateDtype,
    pub exp_avg_dtype: StateDtype,
    pub exp_avg_sq_dtype: StateDtype,
    pub clip_grad: f32,
    pub num_steps_per_rollout: usize,
    pub global_batch_size: Option<usize>,
    /// Sequences per forward/backward; a step accumulates its micro-batches (all at once when
    /// absent).
    pub micro_batch_size: Option<usize>,

    // Low precision.
    /// Unified FP8: rollout and training forward on the same E4M3 weights (the `fp8` plugin).
    pub fp8_format: Option<Fp8Format>,
    /// The FP8 scaling recipe (with `fp8-format`; `blockwise` when unset).
    pub fp8_recipe: Option<Fp8Recipe>,
    pub num_layers_at_start_in_bf16: usize,
    pub num_layers_at_end_in_bf16: usize,
    /// INT4 quantization-aware training (the `int4-qat` plugin; miles'
    /// `OPEN_TRAINING_INT4_FAKE_QAT_FLAG=1`): the forward reads fake-quantized weights.
    pub int4_qat: bool,
    /// Inputs per INT4 group: 128 or 32 (miles' `OPEN_TRAINING_INT4_GROUP_SIZE`).
    pub int4_group_size: usize,
    /// INT4 QAT on the routed experts only (miles' choice), not every linear layer.
    pub int4_experts_only: bool,

    // Speculative rollouts and MTP training (the eagle-spec plugin).
    /// SGLang's `--speculative-algorithm`: `EAGLE` (or `NEXTN`) rolls out speculatively with
    /// an MTP draft.
    pub sglang_speculative_algorithm: Option<SpeculativeAlgorithm>,
    /// Draft tokens per verification (default 3).
    pub sglang_speculative_num_steps: Option<usize>,
    /// Drafts per step: 1 (a chain).
    pub sglang_speculative_eagle_topk: Option<usize>,
    /// Tokens a verification checks: num-steps + 1 for a chain.
    pub sglang_speculative_num_draft_tokens: Option<usize>,
    /// The draft's checkpoint: DeepSeek-V3's or MiMo's MTP layer in safetensors.
    pub sglang_speculative_draft_model_path: Option<PathBuf>,
    /// SGLang keeps a host copy of the draft's weights; here the draft never leaves the
    /// trainer's process and checkpoints hold it, so the flag is accepted for the scripts.
    pub sglang_enable_draft_weights_cpu_backup: bool,
    /// Trains the draft during RL: its cross-entropy on the rollout's responses, from their
    /// second token (miles' loss mask shifted), added to every optimizer step.
    pub enable_mtp_training: bool,
    /// MTP layers of the draft (Megatron's flag); 1 is what is implemented.
    pub mtp_num_layers: Option<usize>,
    /// The MTP loss's weight in the step's loss (Megatron's default 0.1).
    pub mtp_loss_scaling_factor: f32,
    /// The draft's own learning rate, constant (default: the policy's, on its schedule). A
    /// draft trained from scratch keeps up with the policy only at a larger one.
    pub mtp_lr: Option<f32>,
    /// Supervised AdamW steps a fresh draft (one that has taken no step) takes on the first
    /// step's rollout, after that step: the policy's own samples, so it proposes from the
    /// start (0: none; it learns only online).
    pub mtp_warmup_steps: usize,
}

impl Default for RunConfig {
    fn default() -> Self {
        RunConfig {
            hf_checkpoint: None,
            save: None,
            load: None,
            load_fallback: false,
            continue_on_save_error: false,
            async_save: false,
            save_interval: None,
            save_hf: None,
            seed: 1234,
            device: DeviceSpec::Cpu,
            arch: None,
            nproc_per_node: 1,
            distributed_backend: None,
            prompt_data: None,
            input_key: "input".into(),
            label_key: None,
            metadata_key: None,
            apply_chat_template: false,
            apply_chat_template_kwargs: None,
            rollout_shuffle: false,
            num_rollout: None,
            num_epoch: None,
            eval_prompt_data: Vec::new(),
            eval_interval: None,
            n_samples_per_eval_prompt: 1,
            eval_max_response_len: None,
            eval_temperature: None,
            eval_top_k: None,
            eval_top_p: None,
            run_dir: None,
            use_tensorboard: false,
            sft_warmup_steps: 0,
            sft_lr: None,
            rollout_batch_size: 8,
            n_samples_per_prompt: 1,
            over_sampling_batch_size: None,
            rollout_max_response_len: 1024,
            rollout_max_prompt_len: None,
            rollout_temperature: 1.0,
            rollout_top_p: 1.0,
            rollout_top_k: -1,
            rollout_stop: Vec::new(),
            rollout_stop_token_ids: Vec::new(),
            rollout_seed: 42,
            partial_rollout: false,
            mask_offpolicy_in_partial_rollout: false,
            one_step_off: false,
            max_weight_staleness: 1,
            use_rollout_routing_replay: false,
            rollout_kv_cache_mb: 1024,
            rollout_kv_cache_fraction: None,
            rollout_backend: RolloutBackend::Embedded,
            rollout_url: None,
            custom_generate_function_path: None,
            rollout_max_running: 64,
            rm_type: None,
            custom_rm_path: None,
            rm_python: None,
            custom_rm_config: None,
            rm_url: None,
            group_rm: false,
            reward_key: None,
            advantage_estimator: AdvantageEstimator::Grpo,
            disable_grpo_std_normalization: false,
            disable_rewards_normalization: false,
            normalize_advantages: false,
            gamma: 1.0,
            lambd: 1.0,
            loss_type: LossType::PolicyLoss,
            eps_clip: 0.2,
            eps_clip_high: None,
            eps_clip_c: None,
            use_kl_loss: false,
            kl_loss_coef: 0.0,
            kl_loss_type: KlLossType::K1,
            use_unbiased_kl: false,
            kl_coef: 0.0,
            entropy_coef: 0.0,
            router_aux_loss_coef: None,
            calculate_per_token_loss: false,
            use_rollout_logprobs: false,
            use_opsm: false,
            opsm_delta: 1e-4,
            use_tis: false,
            tis_level: TisLevel::Token,
            tis_mode: TisMode::Truncate,
            tis_clip: 2.0,
            tis_clip_low: None,
            tis_batch_normalize: false,
            use_rs: false,
            rs_level: TisLevel::Token,
            rs_lower_bound: None,
            rs_upper_bound: None,
            rs_veto_threshold: None,
            lr: 1e-6,
            min_lr: 0.0,
            lr_warmup_iters: 0,
            lr_decay_iters: None,
            lr_decay_style: LrDecayStyle::Constant,
            weight_decay: 0.0,
            optimizer: Optimizer::Adam,
            adam_beta1: 0.9,
            adam_beta2: 0.98,
            adam_eps: 1e-8,
            use_precision_aware_optimizer: false,
            main_params_dtype: StateDtype::Fp32,
            exp_avg_dtype: StateDtype::Fp32,
            exp_avg_sq_dtype: StateDtype::Fp32,
            clip_grad: 1.0,
            num_steps_per_rollout: 1,
            global_batch_size: None,
            micro_batch_size: None,
            fp8_format: None,
            fp8_recipe: None,
            num_layers_at_start_in_bf16: 0,
            num_layers_at_end_in_bf16: 0,
            int4_qat: false,
            int4_group_size: 128,
            int4_experts_only: false,
            sglang_speculative_algorithm: None,
            sglang_speculative_num_steps: None,
            sglang_speculative_eagle_topk: None,
            sglang_speculative_num_draft_tokens: None,
            sglang_speculative_draft_model_path: None,
            sglang_enable_draft_weights_cpu_backup: false,
            enable_mtp_training: false,
            mtp_num_layers: None,
            mtp_loss_scaling_factor: 0.1,
            mtp_lr: None,
            mtp_warmup_steps: 0,
        }
    }
}

fn check(ok: bool, key: &str, message: impl FnOnce() -> String) -> Result<()> {
    if ok { Ok(()) } else { Err(Error::config(key, message())) }
}

impl RunConfig {
    /// Parses a JSON object of flag-named keys; an unknown key is an error that names it.
    pub fn from_json(value: serde_json::Value) -> Result<Self> {
        serde_json::from_value(value).map_err(|e| Error::Plugin(format!("run configuration: {e}")))
    }

    /// Checks ranges and combinations; the error names the offending flag.
    pub fn validate(&self) -> Result<()> {
        check(self.nproc_per_node >= 1, "nproc-per-node", || "must be at least 1".into())?;
        let nccl_on_cpu =
            self.distributed_backend == Some(DistBackend::Nccl) && !self.device.is_cuda();
        check(!nccl_on_cpu, "distributed-backend", || {
            "nccl sums GPU tensors; with --device cpu the ranks use tcp".into()
        })?;
        check(self.rollout_batch_size >= 1, "rollout-batch-size", || "must be at least 1".into())?;
        check(self.n_samples_per_prompt >= 1, "n-samples-per-prompt", || {
            "must be at least 1".into()
        })?;
        let external = self.rollout_backend != RolloutBackend::Embedded;
        if let Some(spec) = &self.custom_generate_function_path {
            check(!external, "custom-generate-function-path", || {
                "runs on the embedded engine (not with --rollout-backend sglang)".into()
            })?;
            let python =
                spec.rsplit_once(':').is_some_and(|(f, n)| f.ends_with(".py") && !n.is_empty())
                    || spec.ends_with(".py");
            check(python, "custom-generate-function-path", || {
                format!(
                    "{spec}: give FILE.py:FUNCTION (slime's generate(args, sample, sampling_params))"
                )
            })?;
            check(
                self.nproc_per_node == 1 && !self.one_step_off && !self.partial_rollout,
                "custom-generate-function-path",
                || {
                    "runs in one process and synchronously for now (not with --nproc-per-node, \
                 --async or --partial-rollout)"
                        .into()
                },
            )?;
        }
        check(external == self.rollout_url.is_some(), "rollout-url", || match external {
            true => "--rollout-backend sglang: give the servers' http://host:port addresses".into(),
            false => "names external servers: give --rollout-backend sglang too".into(),
        })?;
        if external {
            check(self.nproc_per_node == 1 && !self.one_step_off, "rollout-backend", || {
                "sglang: runs in one process and synchronously for now (not with \
                 --nproc-per-node or --async)"
                    .into()
            })?;
            let local = self.sglang_speculative_algorithm.is_some()
                || self.fp8_format.is_some()
                || self.int4_qat
                || self.use_rollout_routing_replay;
            check(!local, "rollout-backend", || {
                "sglang: speculative rollouts, FP8, INT4 QAT and routing replay are the embedded \
                 engine's"
                    .into()
            })?;
        }
        if let Some(f) = self.rollout_kv_cache_fraction {
            check(f > 0.0 && f < 1.0, "rollout-kv-cache-fraction", || {
                format!("{f} is outside (0, 1)")
            })?;
        }
        if let Some(over) = self.over_sampling_batch_size {
            check(over >= self.rollout_batch_size, "over-sampling-batch-size", || {
                format!("{over} is below --rollout-batch-size {}", self.rollout_batch_size)
            })?;
        }
        check(
            !self.partial_rollout || self.over_sampling_batch_size.is_some(),
            "partial-rollout",
            || {
                "keeps the groups an over-sampled rollout aborts: give --over-sampling-batch-size \
             (with the dynamic sampling it brings)"
                    .into()
            },
        )?;
        check(
            self.partial_rollout || !self.mask_offpolicy_in_partial_rollout,
            "mask-offpolicy-in-partial-rollout",
            || {
                "masks the older policies' tokens of continued responses: it needs --partial-rollout".into()
            },
        )?;
        check(!self.partial_rollout || self.nproc_per_node == 1, "partial-rollout", || {
            format!("runs in one process for now, not --nproc-per-node {}", self.nproc_per_node)
        })?;
        if self.one_step_off {
            let n = self.max_weight_staleness;
            check(n >= 1, "max-weight-staleness", || {
                "0 with --async: an asynchronous rollout is one policy version behind; drop \
                 --async to train on-policy"
                    .into()
            })?;
            check(n == 1, "max-weight-staleness", || {
                format!("{n}: --async runs exactly one step off for now (1)")
            })?;
            check(self.nproc_per_node == 1, "async", || {
                format!("runs in one process for now, not --nproc-per-node {}", self.nproc_per_node)
            })?;
            check(self.device == DeviceSpec::Cpu, "async", || {
                format!(
                    "runs on the CPU for now: on {} the rollout and the step would need their \
                     own CUDA streams, which the engine does not have yet",
                    self.device
                )
            })?;
            check(self.loss_type != LossType::SftLoss, "async", || {
                "a supervised run (--loss-type sft_loss) has no rollout to overlap".into()
            })?;
            let quantized = self.fp8_format.is_some() || self.int4_qat;
            check(!quantized, "async", || {
                "not with --fp8-format or --int4-qat yet (the copy that rolls out would need \
                 its own quantized weights)"
                    .into()
            })?;
            let drafted = self.sglang_speculative_algorithm.is_some() || self.enable_mtp_training;
            check(!drafted, "async", || {
                "not with speculative rollouts or MTP training yet (the copy that rolls out would \
                 need its own draft)"
                    .into()
            })?;
        }
        check(self.rollout_max_response_len >= 1, "rollout-max-response-len", || {
            "must be at least 1".into()
        })?;
        check(self.rollout_temperature > 0.0, "rollout-temperature", || {
            format!("{} must be > 0 (greedy decoding is top-k 1)", self.rollout_temperature)
        })?;
        check(self.rollout_top_p > 0.0 && self.rollout_top_p <= 1.0, "rollout-top-p", || {
            format!("{} is outside (0, 1]", self.rollout_top_p)
        })?;
        check(self.rollout_top_k == -1 || self.rollout_top_k >= 1, "rollout-top-k", || {
            format!("{} must be -1 (off) or at least 1", self.rollout_top_k)
        })?;
        check(self.eps_clip > 0.0, "eps-clip", || format!("{} must be > 0", self.eps_clip))?;
        if let Some(high) = self.eps_clip_high {
            check(high > 0.0, "eps-clip-high", || format!("{high} must be > 0"))?;
        }
        if let Some(c) = self.eps_clip_c {
            check(c > 1.0, "eps-clip-c", || format!("{c} must be > 1 (dual clip bounds -A·c)"))?;
        }
        check((0.0..=1.0).contains(&self.gamma), "gamma", || {
            format!("{} outside [0, 1]", self.gamma)
        })?;
        check((0.0..=1.0).contains(&self.lambd), "lambd", || {
            format!("{} outside [0, 1]", self.lambd)
        })?;
        self.validate_correction()?;
        self.validate_fp8()?;
        self.validate_int4()?;
        self.validate_optimizer_dtypes()?;
        self.validate_speculative()?;
        check(self.opsm_delta.is_finite(), "opsm-delta", || {
            format!("{} is not finite", self.opsm_delta)
        })?;
        check(self.lr >= 0.0, "lr", || format!("{} must be >= 0", self.lr))?;
        check(self.min_lr <= self.lr, "min-lr", || {
            format!("{} exceeds --lr {}", self.min_lr, self.lr)
        })?;
        check(self.clip_grad >= 0.0, "clip-grad", || format!("{} must be >= 0", self.clip_grad))?;
        check(self.num_steps_per_rollout >= 1, "num-steps-per-rollout", || {
            "must be at least 1".into()
        })?;
        if let Some(g) = self.global_batch_size {
            let total = self.rollout_batch_size * self.n_samples_per_prompt;
            check(g >= 1 && total.is_multiple_of(g), "global-batch-size", || {
                format!("{g} must divide rollout-batch-size × n-samples-per-prompt = {total}")
            })?;
        }
        for (ok, key) in [
            (self.n_samples_per_eval_prompt >= 1, "n-samples-per-eval-prompt"),
            (self.rollout_kv_cache_mb >= 1, "rollout-kv-cache-mb"),
            (self.rollout_max_running >= 1, "rollout-max-running"),
            (self.micro_batch_size != Some(0), "micro-batch-size"),
            (self.eval_max_response_len != Some(0), "eval-max-response-len"),
            (self.eval_interval != Some(0), "eval-interval"),
            (self.save_interval != Some(0), "save-interval"),
        ] {
            check(ok, key, || "must be at least 1".into())?;
        }
        if let Some(t) = self.eval_temperature {
            check(t > 0.0, "eval-temperature", || format!("{t} must be > 0"))?;
        }
        if let Some(p) = self.eval_top_p {
            check(p > 0.0 && p <= 1.0, "eval-top-p", || format!("{p} is outside (0, 1]"))?;
        }
        let sets = self.eval_prompt_data.len();
        check(sets <= 1 || sets.is_multiple_of(2), "eval-prompt-data", || {
            format!("{sets} values: give one FILE, or NAME FILE pairs")
        })?;
        if let Some(k) = self.eval_top_k {
            check(k == -1 || k >= 1, "eval-top-k", || {
                format!("{k} must be -1 (off) or at least 1")
            })?;
        }
        if let Some(lr) = self.sft_lr {
            check(lr >= 0.0, "sft-lr", || format!("{lr} must be >= 0"))?;
        }
        check(self.num_rollout.is_none() || self.num_epoch.is_none(), "num-epoch", || {
            "give --num-rollout or --num-epoch, not both".into()
        })?;
        Ok(())
    }

    /// The speculative flags go together: the chain's settings with an algorithm, an
    /// algorithm with a draft to run (a checkpoint, or one trained from scratch), one MTP
    /// layer. (The plugin checks the algorithm's own settings.)
    fn validate_speculative(&self) -> Result<()> {
        let on = self.sglang_speculative_algorithm.is_some();
        for (key, given) in [
            ("sglang-speculative-num-steps", self.sglang_speculative_num_steps.is_some()),
            ("sglang-speculative-eagle-topk", self.sglang_speculative_eagle_topk.is_some()),
            (
                "sglang-speculative-num-draft-tokens",
                self.sglang_speculative_num_draft_tokens.is_some(),
            ),
            ("sglang-enable-draft-weights-cpu-backup", self.sglang_enable_draft_weights_cpu_backup),
        ] {
            check(on || !given, key, || {
                "takes effect only with --sglang-speculative-algorithm EAGLE".into()
            })?;
        }
        let has_draft = self.sglang_speculative_draft_model_path.is_some();
        // (A DeepSeek-V3 --hf-checkpoint may carry its MTP layer: the trainer looks.)
        check(
            !on || has_draft || self.enable_mtp_training || self.hf_checkpoint.is_some(),
            "sglang-speculative-algorithm",
            || {
                "needs a draft: --sglang-speculative-draft-model-path DIR (an MTP layer's \
             safetensors), or --enable-mtp-training to train one from scratch during the run"
                    .into()
            },
        )?;
        check(
            !has_draft || on || self.enable_mtp_training,
            "sglang-speculative-draft-model-path",
            || "is used with --sglang-speculative-algorithm EAGLE or --enable-mtp-training".into(),
        )?;
        if let Some(n) = self.mtp_num_layers {
            check(n == 1, "mtp-num-layers", || {
                format!("{n}: the draft is one MTP layer (DeepSeek-V3's and MiMo's); give 1")
            })?;
            check(on || self.enable_mtp_training, "mtp-num-layers", || {
                "takes effect with --enable-mtp-training or --sglang-speculative-algorithm".into()
            })?;
        }
        let f = self.mtp_loss_scaling_factor;
        check(f.is_finite() && f >= 0.0, "mtp-loss-scaling-factor", || {
            format!("{f} must be a number >= 0")
        })?;
        check(self.mtp_warmup_steps == 0 || self.enable_mtp_training, "mtp-warmup-steps", || {
            "warms up the draft that --enable-mtp-training trains: give that too".into()
        })?;
        if let Some(lr) = self.mtp_lr {
            check(lr.is_finite() && lr > 0.0, "mtp-lr", || format!("{lr} must be a number > 0"))?;
            check(self.enable_mtp_training, "mtp-lr", || {
                "is the draft's learning rate: it takes effect with --enable-mtp-training".into()
            })?;
        }
        Ok(())
    }

    /// The moments' dtypes take effect with `--use-precision-aware-optimizer`, as in Megatron.
    fn validate_optimizer_dtypes(&self) -> Result<()> {
        for (key, d) in [
            ("main-params-dtype", self.main_params_dtype),
            ("exp-avg-dtype", self.exp_avg_dtype),
            ("exp-avg-sq-dtype", self.exp_avg_sq_dtype),
        ] {
            check(self.use_precision_aware_optimizer || d == StateDtype::Fp32, key, || {
                format!("{} needs --use-precision-aware-optimizer (Megatron's rule)", d.label())
            })?;
        }
        let bf16_masters = self.main_params_dtype == StateDtype::Bf16;
        check(
            !(bf16_masters && (self.int4_qat || self.fp8_format.is_some())),
            "main-params-dtype",
            || {
                "bf16 goes without --int4-qat and --fp8-format (they quantize from f32 masters)"
                    .into()
            },
        )
    }

    /// INT4 QAT's flags go together, its groups are miles' sizes, and it is the only
    /// quantization of the weights.
    fn validate_int4(&self) -> Result<()> {
        let g = self.int4_group_size;
        check(matches!(g, 32 | 128), "int4-group-size", || format!("{g}: groups are 128 or 32"))?;
        if !self.int4_qat {
            check(g == 128 && !self.int4_experts_only, "int4-group-size", || {
                "and --int4-experts-only take effect with --int4-qat".into()
            })?;
            return Ok(());
        }
        check(self.fp8_format.is_none(), "int4-qat", || {
            "with --fp8-format: one quantization of the weights at a time".into()
        })
    }

    /// The FP8 flags go together: a recipe or bf16 layers only with a format.
    fn validate_fp8(&self) -> Result<()> {
        let off = self.fp8_format.is_none();
        check(!(off && self.fp8_recipe.is_some()), "fp8-recipe", || {
            "needs --fp8-format e4m3 (the recipe says how FP8 is scaled)".into()
        })?;
        for (key, n) in [
            ("num-layers-at-start-in-bf16", self.num_layers_at_start_in_bf16),
            ("num-layers-at-end-in-bf16", self.num_layers_at_end_in_bf16),
        ] {
            check(!(off && n > 0), key, || {
                format!("{n} layers kept in bf16 means nothing without --fp8-format e4m3")
            })?;
        }
        Ok(())
    }

    /// The off-policy correction's flags: ranges, and the combinations slime refuses.
    fn validate_correction(&self) -> Result<()> {
        check(self.tis_clip > 0.0, "tis-clip", || format!("{} must be > 0", self.tis_clip))?;
        if let Some(low) = self.tis_clip_low {
            check(low >= 0.0 && low < self.tis_clip, "tis-clip-low", || {
                format!("{low} must be in [0, --tis-clip {})", self.tis_clip)
            })?;
        }
        let rs_flags = [
            ("rs-lower-bound", self.rs_lower_bound),
            ("rs-upper-bound", self.rs_upper_bound),
            ("rs-veto-threshold", self.rs_veto_threshold),
        ];
        for (key, value) in rs_flags {
            if let Some(v) = value {
                check(v > 0.0 || (key == "rs-lower-bound" && v == 0.0), key, || {
                    format!("{v} must be > 0")
                })?;
                check(self.use_rs, key, || "takes effect only with --use-rs".into())?;
            }
        }
        check(!self.use_rs || self.use_tis, "use-rs", || {
            "rejection sampling is part of the tis correction: add --use-tis".into()
        })?;
        check(
            !(self.tis_batch_normalize && self.tis_level == TisLevel::Geometric),
            "tis-batch-normalize",
            || "is not defined for --tis-level geometric (slime refuses it too)".into(),
        )?;
        check(!(self.use_tis && self.use_rollout_logprobs), "use-rollout-logprobs", || {
            "cannot be combined with --use-tis: with the rollout's logprobs as the old policy the \
             PPO ratio already corrects for the rollout engine (slime refuses the same pair)"
                .into()
        })
    }

    /// Settings that run but are probably not what the user meant, as slime warns of them.
    pub fn warnings(&self) -> Vec<String> {
        let mut out = Vec::new();
        let d = RunConfig::default();
        use AdvantageEstimator::{Cispo, Grpo, Gspo, Rloo};
        let estimator = serde_json::to_value(self.advantage_estimator).unwrap_or_default();
        let estimator = estimator.as_str().unwrap_or_default();
        if self.kl_coef != 0.0 && matches!(self.advantage_estimator, Grpo | Gspo | Cispo | Rloo) {
            out.push(format!(
                "--kl-coef {} shapes only REINFORCE++ rewards; --advantage-estimator {estimator} \
                 ignores it (as slime does): use --use-kl-loss --kl-loss-coef for a KL term",
                self.kl_coef
            ));
        }
        let tis_set = self.tis_mode != d.tis_mode
            || self.tis_level != d.tis_level
            || self.tis_clip != d.tis_clip
            || self.tis_clip_low.is_some()
            || self.tis_batch_normalize;
        if tis_set && !self.use_tis {
            out.push("the --tis-* settings take effect only with --use-tis".into());
        }
        if self.opsm_delta != d.opsm_delta && !self.use_opsm {
            out.push("--opsm-delta takes effect only with --use-opsm".into());
        }
        if self.eps_clip_c.is_some() && self.advantage_estimator == Cispo {
            out.push("--eps-clip-c (dual clip) does not apply to CISPO's loss".into());
        }
        if self.advantage_estimator == AdvantageEstimator::Cispo && self.eps_clip < 1.0 {
            out.push(format!(
                "CISPO is canonically single-sided, but --eps-clip {} keeps the lower clip bound \
                 {} active; set --eps-clip 1.0 (and tune --eps-clip-high, e.g. 4.0) for the \
                 canonical wide setting",
                self.eps_clip,
                1.0 - self.eps_clip
            ));
        }
        out
    }

    /// The rollout engine's sampling parameters.
    pub fn sampling_params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.rollout_temperature,
            top_p: self.rollout_top_p,
            top_k: usize::try_from(self.rollout_top_k).unwrap_or(0),
            max_new_tokens: self.rollout_max_response_len,
            stop: self.rollout_stop.clone(),
            stop_token_ids: self.rollout_stop_token_ids.clone(),
            ignore_eos: false,
            seed: self.rollout_seed,
        }
    }

    /// The configuration of the `tis` correction plugin, from the `--tis-*` keys.
    pub fn tis_config(&self) -> serde_json::Value {
        serde_json::json!({
            "level": self.tis_level,
            "mode": self.tis_mode,
            "upper": self.tis_clip,
            "lower": self.tis_clip_low,
            "batch_normalize": self.tis_batch_normalize,
            "use_rs": self.use_rs,
            "rs_level": self.rs_level,
            "rs_lower": self.rs_lower_bound,
            "rs_upper": self.rs_upper_bound,
            "rs_veto_threshold": self.rs_veto_threshold,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_slime_flag_names() {
        let c = RunConfig::from_json(serde_json::json!({
            "rollout-batch-size": 32,
            "n-samples-per-prompt": 8,
            "advantage-estimator": "reinforce_plus_plus_baseline",
            "eps-clip-high": 0.28,
            "kl-loss-type": "low_var_kl",
            "use-tis": true,
            "tis-mode": "mask",
        }))
        .unwrap();
        assert_eq!(c.rollout_batch_size, 32);
        assert_eq!(c.advantage_estimator, AdvantageEstimator::ReinforcePlusPlusBaseline);
        assert_eq!(c.eps_clip_high, Some(0.28));
        assert_eq!(c.kl_loss_type, KlLossType::LowVarKl);
        assert_eq!(c.tis_mode, TisMode::Mask);
        c.validate().unwrap();
        let back: RunConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
        assert_eq!(back, c);
    }

    #[test]
    fn slime_kl_alias_and_unknown_keys() {
        let c = RunConfig::from_json(serde_json::json!({"kl-loss-type": "kl"})).unwrap();
        assert_eq!(c.kl_loss_type, KlLossType::K1);
        let err = RunConfig::from_json(serde_json::json!({"rollout-batchsize": 4})).unwrap_err();
        assert!(err.to_string().contains("rollout-batchsize"), "{err}");
    }

    /// A custom generate function is a Python file's function, on the embedded engine, in
    /// one synchronous process.
    #[test]
    fn custom_generate_functions_are_checked() {
        let c = |json: serde_json::Value| RunConfig::from_json(json).unwrap().validate();
        let bad = |json: serde_json::Value| c(json).unwrap_err().to_string();
        c(serde_json::json!({"custom-generate-function-path": "tools.py:generate"})).unwrap();
        c(serde_json::json!({"custom-generate-function-path": "tools.py"})).unwrap();
        let key = "custom-generate-function-path";
        let e = bad(serde_json::json!({ key: "tools.so:generate" }));
        assert!(e.starts_with("--custom-generate-function-path:") && e.contains("FILE.py"), "{e}");
        let e = bad(serde_json::json!({ key: "t.py:g", "rollout-backend": "sglang",
                                         "rollout-url": "http://x:1" }));
        assert!(e.contains("embedded engine"), "{e}");
        for flag in ["async", "partial-rollout"] {
            let e = bad(serde_json::json!({ key: "t.py:g", flag: true }));
            assert!(e.contains("synchronously"), "{flag}: {e}");
        }
    }

    /// The speculative flags go together, and each refusal names its flag.
    #[test]
    fn speculative_flags_need_their_partners() {
        let c = |json: serde_json::Value| RunConfig::from_json(json).unwrap().validate();
        let bad = |json: serde_json::Value| c(json).unwrap_err().to_string();
        let e = bad(serde_json::json!({"sglang-speculative-algorithm": "EAGLE"}));
        assert!(e.starts_with("--sglang-speculative-algorithm:") && e.contains("needs a draft"));
        c(serde_json::json!({"sglang-speculative-algorithm": "NEXTN", "enable-mtp-training": true}))
            .unwrap();
        c(serde_json::json!({
            "sglang-speculative-algorithm": "EAGLE",
            "sglang-speculative-draft-model-path": "/d",
            "sglang-speculative-num-steps": 2,
            "mtp-num-layers": 1,
        }))
        .unwrap();
        for key in ["sglang-speculative-num-steps", "sglang-speculative-num-draft-tokens"] {
            let e = bad(serde_json::json!({ key: 3, "enable-mtp-training": true }));
            assert!(e.starts_with(&format!("--{key}:")) && e.contains("only with"), "{e}");
        }
        let e = bad(serde_json::json!({"sglang-speculative-draft-model-path": "/d"}));
        assert!(e.starts_with("--sglang-speculative-draft-model-path:"), "{e}");
        let e = bad(serde_json::json!({"enable-mtp-training": true, "mtp-num-layers": 2}));
        assert!(e.starts_with("--mtp-num-layers:") && e.contains("give 1"), "{e}");
        let e = bad(serde_json::json!({"mtp-loss-scaling-factor": -1.0}));
        assert!(e.starts_with("--mtp-loss-scaling-factor:"), "{e}");
        let e = RunConfig::from_json(serde_json::json!({"sglang-speculative-algorithm": "EAGLE3"}));
        assert!(e.unwrap_err().to_string().contains("EAGLE3"));
    }

    #[test]
    fn validation_names_the_flag() {
        let bad = |c: RunConfig| c.validate().unwrap_err().to_string();
        let d = RunConfig::default;
        assert!(bad(RunConfig { eps_clip_c: Some(0.5), ..d() }).starts_with("--eps-clip-c:"));
        assert!(bad(RunConfig { tis_clip_low: Some(3.0), ..d() }).starts_with("--tis-clip-low:"));
        assert!(bad(RunConfig { rollout_top_k: 0, ..d() }).starts_with("--rollout-top-k:"));
        assert!(
            bad(RunConfig { over_sampling_batch_size: Some(2), ..d() })
                .starts_with("--over-sampling-batch-size:")
        );
        let over = Some(64);
        let two = RunConfig { partial_rollout: true, over_sampling_batch_size: over, ..d() };
        assert!(
            bad(RunConfig { nproc_per_node: 2, ..two })
                .starts_with("--partial-rollout: runs in one")
        );
        assert!(
            bad(RunConfig { global_batch_size: Some(3), ..d() })
                .starts_with("--global-batch-size:")
        );
        RunConfig::default().validate().unwrap();
    }

    #[test]
    fn correction_combinations_slime_refuses_are_errors() {
        let bad = |c: RunConfig| c.validate().unwrap_err().to_string();
        let tis = || RunConfig { use_tis: true, ..RunConfig::default() };
        let e = bad(RunConfig { use_rollout_logprobs: true, ..tis() });
        assert!(e.starts_with("--use-rollout-logprobs: cannot be combined with --use-tis"), "{e}");
        let geometric =
            RunConfig { tis_level: TisLevel::Geometric, tis_batch_normalize: true, ..tis() };
        assert!(bad(geometric).starts_with("--tis-batch-normalize:"));
        let e = bad(RunConfig { use_rs: true, ..RunConfig::default() });
        assert!(e.starts_with("--use-rs:") && e.contains("--use-tis"), "{e}");
        let e = bad(RunConfig { rs_veto_threshold: Some(1e-4), ..tis() });
        assert_eq!(e, "--rs-veto-threshold: takes effect only with --use-rs");
        let e = bad(RunConfig { use_rs: true, rs_upper_bound: Some(0.0), ..tis() });
        assert!(e.starts_with("--rs-upper-bound: 0 must be > 0"), "{e}");
        RunConfig {
            use_rs: true,
            rs_veto_threshold: Some(1e-4),
            rs_lower_bound: Some(0.0),
            ..tis()
        }
        .validate()
        .unwrap();
        // The rollout's logprobs without TIS, and TIS without them, are both fine.
        RunConfig { use_rollout_logprobs: true, ..RunConfig::default() }.validate().unwrap();
        tis().validate().unwrap();
    }

    #[test]
    fn cispo_with_a_narrow_lower_clip_warns_as_slime_does() {
        let c =
            RunConfig { advantage_estimator: AdvantageEstimator::Cispo, ..RunConfig::default() };
        let w = c.warnings();
        assert_eq!(w.len(), 1);
        assert!(w[0].contains("--eps-clip 0.2"), "{w:?}");
        assert!(RunConfig { eps_clip: 1.0, ..c.clone() }.warnings().is_empty());
        assert!(RunConfig::default().warnings().is_empty());
        // Settings that do nothing in their company say so.
        let warns = |c: RunConfig| c.warnings().join("\n");
        let w = warns(RunConfig { kl_coef: 0.1, ..RunConfig::default() });
        assert!(w.contains("--advantage-estimator grpo ignores it"), "{w}");
        let rpp = AdvantageEstimator::ReinforcePlusPlus;
        assert!(
            warns(RunConfig { kl_coef: 0.1, advantage_estimator: rpp, ..RunConfig::default() })
                .is_empty()
        );
        let w = warns(RunConfig { tis_mode: TisMode::Mask, ..RunConfig::default() });
        assert!(w.contains("only with --use-tis"), "{w}");
        let w = warns(RunConfig { opsm_delta: 0.1, ..RunConfig::default() });
        assert!(w.contains("only with --use-opsm"), "{w}");
        let w = warns(RunConfig { eps_clip: 1.0, eps_clip_c: Some(3.0), ..c });
        assert!(w.contains("does not apply to CISPO"), "{w}");
    }

    #[test]
    fn sampling_params_follow_the_rollout_flags() {
        let c = RunConfig { rollout_top_k: -1, rollout_temperature: 0.7, ..RunConfig::default() };
        let p = c.sampling_params();
        assert_eq!((p.top_k, p.temperature, p.seed), (0, 0.7, 42));
        let c = RunConfig { rollout_top_k: 20, ..c };
        assert_eq!(c.sampling_params().top_k, 20);
    }
}
