//! Where the engine's forward runs. The scheduler ([`crate::Engine`]) is one piece of code; the
//! [`Policy`] owns the model and the KV cache's storage on the model's device and turns one
//! step's rows into draws: the forward, the LM head and the sampler run there (on the CPU
//! through its batch-invariant kernels, on a GPU through CUDA graphs of decode steps), so only
//! token ids and logprobs come back.

use miles_core::SamplingParams;
use miles_model::{
    BlockId, DecodeGraphs, DeviceModel, KvCache, ModelConfig, SampleParams, StepRow,
};
use miles_tensor::cpu::KEY_BLOCK;

use crate::sampler::Draw;

/// One draw of a step: the row whose next token is drawn, and its uniform number.
pub type DrawRequest = (usize, f64);

/// Blocks that fit `bytes` at `per_block` bytes each, or the flag's error.
pub(crate) fn blocks_in(bytes: usize, per_block: usize) -> crate::Result<usize> {
    match bytes / per_block.max(1) {
        0 => Err(crate::Error::config(
            "rollout-kv-cache-mb",
            format!(
                "{bytes} bytes hold no KV block of this model ({per_block} bytes per {KEY_BLOCK} tokens)"
            ),
        )),
        n => Ok(n),
    }
}

/// The KV cache budget in bytes: `fraction` of the device's free memory when given (SGLang's
/// `--mem-fraction-static` role; GPU only), else `mb` MiB.
pub fn kv_cache_budget(
    mb: usize,
    fraction: Option<f64>,
    device: &miles_tensor::Device,
) -> crate::Result<usize> {
    let Some(f) = fraction else {
        return mb.checked_mul(1 << 20).ok_or_else(|| {
            crate::Error::config(
                "rollout-kv-cache-mb",
                "too large for this machine's address space",
            )
        });
    };
    if !(f > 0.0 && f <= 1.0) {
        return Err(crate::Error::config(
            "rollout-kv-cache-fraction",
            format!("{f} is outside (0, 1]"),
        ));
    }
    let info = device
        .memory_info()
        .map_err(|e| crate::Error::config("rollout-kv-cache-fraction", e.to_string()))?;
    match info {
        Some((free, _)) => Ok((free as f64 * f) as usize),
        None => Err(crate::Error::config(
            "rollout-kv-cache-fraction",
            "is a share of GPU memory; on the CPU give --rollout-kv-cache-mb",
        )),
    }
}

pub(crate) fn model_error(e: miles_model::Error) -> crate::Error {
    crate::Error::Invalid(format!("rollout engine: {e}"))
}

/// The model on its device (the CPU, or a GPU) with its KV cache there.
pub struct Policy {
    pub(crate) model: DeviceModel,
    kv: KvCache,
    /// Captured decode steps of the current sampling parameters.
    pub(crate) graphs: Option<DecodeGraphs>,
    use_graphs: bool,
}

impl Policy {
    /// `model` with a KV cache of `kv_bytes` on its device, in its compute dtype; decode steps
    /// replayed as CUDA graphs when `graphs`.
    pub fn new(model: DeviceModel, kv_bytes: usize, graphs: bool) -> crate::Result<Self> {
        let d = model.config.head_dim;
        if model.device() != miles_tensor::Device::Cpu && !matches!(d, 64 | 128) {
            return Err(crate::Error::Invalid(format!(
                "rollout engine: on a GPU the paged attention runs at head_dim 64 or 128, and \
                 this model's is {d}: use --device cpu for it"
            )));
        }
        let per_block = KvCache::bytes_per_block(&model.config, model.dtype());
        let blocks = blocks_in(kv_bytes, per_block)?;
        let kv = KvCache::new(&model.config, blocks, &model.device(), model.dtype())
            .map_err(model_error)?;
        // A mixture of experts routes on the host between layers: no graph can hold a step.
        let use_graphs = graphs && model.config.moe.is_none();
        Ok(Policy { model, kv, graphs: None, use_graphs })
    }
}

impl Policy {
    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Blocks of [`KEY_BLOCK`] tokens the KV cache holds.
    pub fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    /// One forward over `rows` (writing their keys and values into the cache), then one draw
    /// per request, in order (requests of one row come together); with them, the experts each
    /// row was routed to in a mixture-of-experts model (`[rows × sparse layers × top_k]`, empty
    /// for a dense one).
    pub fn step(
        &mut self,
        rows: &[StepRow],
        draws: &[DrawRequest],
        params: &SamplingParams,
    ) -> crate::Result<(Vec<Option<Draw>>, Vec<u16>)> {
        let how = SampleParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
        };
        let uniforms: Vec<f64> = draws.iter().map(|&(_, u)| u).collect();
        // A pure decode step (one draw per row, each row its own sequence's) replays a graph.
        let decode = self.use_graphs
            && rows.len() == draws.len()
            && draws.iter().enumerate().all(|(i, d)| d.0 == i);
        let (drawn, routes) = if decode {
            let graphs = match &mut self.graphs {
                Some(g) if g.params() == how => g,
                slot => slot.insert(DecodeGraphs::new(how)),
            };
            let drawn =
                self.model.decode(graphs, rows, &uniforms, &mut self.kv).map_err(model_error)?;
            (drawn, Vec::new())
        } else {
            let (hidden, routes) =
                self.model.step_routed(rows, &mut self.kv).map_err(model_error)?;
            let picks: Vec<u32> = draws.iter().map(|&(r, _)| r as u32).collect();
            (self.model.sample(&hidden, &picks, how, &uniforms).map_err(model_error)?, routes)
        };
        let drawn = drawn.into_iter().map(|d| d.map(|(token, logprob)| Draw { token, logprob }));
        Ok((drawn.collect(), routes))
    }

    /// Copies every layer of block `src` into `dst`.
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> crate::Result<()> {
        self.kv.copy_block(src, dst).map_err(model_error)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use miles_tensor::Device;

    #[test]
    fn kv_budgets_name_their_flag() {
        assert_eq!(kv_cache_budget(3, None, &Device::Cpu).unwrap(), 3 << 20);
        let err = |mb, f| kv_cache_budget(mb, f, &Device::Cpu).unwrap_err().to_string();
        assert!(err(1, Some(0.5)).contains("rollout-kv-cache-fraction"));
        assert!(err(1, Some(0.5)).contains("on the CPU give --rollout-kv-cache-mb"));
        assert!(err(1, Some(1.5)).contains("outside (0, 1]"));
        assert!(err(1, Some(f64::NAN)).contains("outside (0, 1]"));
        assert!(err(usize::MAX, None).contains("rollout-kv-cache-mb"));
        assert!(blocks_in(10, 100).unwrap_err().to_string().contains("rollout-kv-cache-mb"));
        assert_eq!(blocks_in(250, 100).unwrap(), 2);
    }
}
