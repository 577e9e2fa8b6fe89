//! What several commands share: loading a checkpoint, the `--device` and `--dtype` values, the
//! rollout engine's flags, and starting worker processes (`--nproc-per-node`).

use std::io::Write;
use std::path::Path;

use anyhow::Context;
use clap::{Args, ValueEnum};
use miles_core::Speculator;
use miles_core::config::SpeculativeAlgorithm;
use miles_model::{DeviceModel, Model, ModelConfig, Weights};
use miles_tensor::{DType, Device};

/// SGLang's speculative settings, as `miles train` and `miles generate` take them.
#[derive(Default)]
pub struct SpecFlags {
    pub algorithm: Option<SpeculativeAlgorithm>,
    pub num_steps: Option<usize>,
    pub eagle_topk: Option<usize>,
    pub num_draft_tokens: Option<usize>,
}

/// The `eagle-spec` plugin with `--sglang-speculative-algorithm`, its settings checked there.
pub fn speculator(flags: &SpecFlags) -> anyhow::Result<Option<Box<dyn Speculator>>> {
    let Some(algorithm) = flags.algorithm else { return Ok(None) };
    crate::linked::plugins();
    let settings = serde_json::json!({
        "algorithm": algorithm,
        "num_steps": flags.num_steps,
        "eagle_topk": flags.eagle_topk,
        "num_draft_tokens": flags.num_draft_tokens,
    });
    let s = miles_core::registry::create_speculator("eagle-spec", &settings)
        .context("--sglang-speculative-algorithm")?;
    Ok(Some(s))
}

/// An HF checkpoint directory: config.json and the safetensors weights (checked against its
/// checksums.json first when it has one, as `--save-hf` writes it).
pub fn load_model(dir: &Path) -> anyhow::Result<Model> {
    miles_train::checkpoint::manifest::verify(dir)?;
    let config = ModelConfig::from_file(&dir.join("config.json"))?;
    let weights = Weights::load(dir, &config)?;
    Ok(Model::new(config, weights))
}

/// `--apply-chat-template-kwargs`: a JSON object of extra chat template variables.
pub fn chat_kwargs(flag: Option<&str>) -> anyhow::Result<serde_json::Value> {
    let Some(text) = flag else { return Ok(serde_json::Value::Null) };
    match serde_json::from_str(text) {
        Ok(v @ serde_json::Value::Object(_)) => Ok(v),
        Ok(other) => anyhow::bail!("--apply-chat-template-kwargs: a JSON object, not {other}"),
        Err(e) => anyhow::bail!("--apply-chat-template-kwargs: not JSON ({e}): {text}"),
    }
}

/// `--device`: cpu, cuda or cuda:N.
pub fn parse_device(s: &str) -> Result<Device, String> {
    s.parse().map_err(|e: miles_tensor::Error| e.to_string())
}

/// The compute dtype of a device run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DTypeArg {
    /// bf16 weights and activations, f32 accumulation, f32 masters and moments.
    Bf16,
    /// f32 throughout (parity runs).
    F32,
}

impl DTypeArg {
    pub fn dtype(self) -> DType {
        match self {
            DTypeArg::Bf16 => DType::BF16,
            DTypeArg::F32 => DType::F32,
        }
    }
}

/// Where the rollout engine runs and how (`miles generate`, `miles bench rollout`).
#[derive(Debug, Args)]
pub struct EngineArgs {
    /// Where the engine runs: cpu, cuda (device 0) or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = parse_device)]
    pub device: Device,
    /// Compute dtype on a GPU (the CPU computes in f32).
    #[arg(long, value_enum, default_value = "bf16")]
    pub dtype: DTypeArg,
    /// Run every decode step eagerly instead of replaying captured CUDA graphs.
    #[arg(long)]
    pub disable_cuda_graph: bool,
    /// Prefill at most this many prompt tokens per step: longer prompts are prefilled in
    /// chunks beside the others' decode steps (SGLang's --chunked-prefill-size).
    #[arg(long, value_name = "TOKENS")]
    pub chunked_prefill_size: Option<usize>,
}

/// `--nproc-per-node N`: this command again as ranks 0..N of one run on this host; returns
/// when all have finished, or with the error of the first that failed (the others stopped).
pub(crate) fn launch(n: usize, command: &str, out: &mut dyn Write) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("--nproc-per-node: where is this binary")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let port = match std::env::var("MASTER_PORT").ok().and_then(|p| p.parse().ok()) {
        Some(p) => p,
        None => std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .context("--nproc-per-node: no free port for the rendezvous")?,
    };
    writeln!(out, "miles {command}: {n} worker processes, rendezvous on port {port}")?;
    miles_dist::launch_local(n, port, &exe, &args).context("--nproc-per-node")?;
    Ok(())
}

impl EngineArgs {
    /// `model` on `--device` in its compute dtype: f32 on the CPU, `--dtype` on a GPU.
    pub fn place(&self, model: &Model) -> anyhow::Result<DeviceModel> {
        self.placed(model, DeviceModel::new)
    }

    /// [`EngineArgs::place`] for a model that only generates: never more than one f32 weight
    /// on the device at a time ([`DeviceModel::for_rollout`]).
    pub fn place_for_rollout(&self, model: &Model) -> anyhow::Result<DeviceModel> {
        self.placed(model, DeviceModel::for_rollout)
    }

    fn placed(
        &self,
        model: &Model,
        build: fn(&Model, &Device, DType) -> miles_model::Result<DeviceModel>,
    ) -> anyhow::Result<DeviceModel> {
        let device = self.device;
        if device != Device::Cpu {
            device.ensure_available().with_context(|| format!("--device {device}"))?;
        }
        let dtype = if device == Device::Cpu { DType::F32 } else { self.dtype.dtype() };
        Ok(build(model, &device, dtype)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_kwargs_are_a_json_object_or_a_clear_error() {
        let v = chat_kwargs(Some(r#"{"enable_thinking": false}"#)).unwrap();
        assert_eq!(v["enable_thinking"], false);
        assert!(chat_kwargs(None).unwrap().is_null());
        for (bad, says) in [("[1]", "a JSON object"), ("{oops", "not JSON")] {
            let e = chat_kwargs(Some(bad)).unwrap_err().to_string();
            assert!(e.contains("--apply-chat-template-kwargs") && e.contains(says), "{e}");
        }
    }
}
