//! Where the engine's forward runs. The scheduler ([`crate::Engine`]) is one piece of code; the
//! [`Policy`] owns the KV cache's storage on the model's device and turns one step's rows
//! into draws with the model lent to it: the forward, the LM head and the sampler run there (on the CPU
//! through its batch-invariant kernels, on a GPU through CUDA graphs of decode steps), so only
//! token ids and logprobs come back.

use miles_core::SamplingParams;
use miles_model::stage_clock::stage;
use miles_model::{
    BlockId, DecodeGraphs, DeviceModel, KvCache, ModelConfig, SampleParams, SpecGraphs, SpecOut,
    SpecRows, StepRow,
};
use miles_tensor::cpu::KEY_BLOCK;
use miles_tensor::{DType, Device, Tensor};

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
pub fn kv_cache_budget(mb: usize, fraction: Option<f64>, device: &Device) -> crate::Result<usize> {
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

/// Steps captured as CUDA graphs over one model's compute copies (named by `of`,
/// [`DeviceModel::buffers_id`]).
#[derive(Default)]
pub(crate) struct Captured {
    pub(crate) graphs: Option<DecodeGraphs>,
    of: u64,
}

impl Captured {
    /// The graphs of `model`'s steps drawing with `params` (leaving states with `None`):
    /// the ones kept when they were captured over its copies for those, else new ones.
    fn over(&mut self, model: &DeviceModel, params: Option<SampleParams>) -> &mut DecodeGraphs {
        let stale = self.graphs.as_ref().is_some_and(|g| g.params() != params);
        if stale || self.of != model.buffers_id() {
            self.graphs = None;
            self.of = model.buffers_id();
        }
        self.graphs.get_or_insert_with(|| match params {
            Some(params) => DecodeGraphs::new(params),
            None => DecodeGraphs::states(),
        })
    }
}

/// The KV cache on a model's device, and the decode steps captured over that model. The model
/// itself is lent for each step: the trainer owns it (zero-copy weight sync), so the cache
/// checks that a lent model is the one it was built for.
pub struct Policy {
    /// The model the cache was built for: its shape, device and compute dtype.
    config: ModelConfig,
    device: Device,
    dtype: DType,
    kv: KvCache,
    /// Captured decode steps of the current sampling parameters.
    pub(crate) graphs: Captured,
    /// Captured speculative steps: the policy's verifications and the draft's proposals.
    pub(crate) verify_graphs: Captured,
    pub(crate) draft_graphs: Captured,
    /// Whole speculative steps captured as one graph each ([`Policy::spec_step`]).
    pub(crate) spec_graphs: Option<SpecGraphs>,
    use_graphs: bool,
    /// A speculative draft's own cache ([`Policy::with_draft`]): its one layer's keys and
    /// values under the same block tables as the policy's.
    draft: Option<(ModelConfig, KvCache)>,
}

impl Policy {
    /// A KV cache of `kv_bytes` for `model`, on its device in its compute dtype; decode steps
    /// replayed as CUDA graphs when `graphs`.
    pub fn new(model: &DeviceModel, kv_bytes: usize, graphs: bool) -> crate::Result<Self> {
        Self::build(model, None, kv_bytes, graphs)
    }

    /// [`Policy::new`] with a speculative draft's cache beside the policy's: the same blocks
    /// in each, so `kv_bytes` pays for both.
    pub fn with_draft(
        model: &DeviceModel,
        draft: &DeviceModel,
        kv_bytes: usize,
        graphs: bool,
    ) -> crate::Result<Self> {
        Self::build(model, Some(draft), kv_bytes, graphs)
    }

    fn build(
        model: &DeviceModel,
        draft: Option<&DeviceModel>,
        kv_bytes: usize,
        graphs: bool,
    ) -> crate::Result<Self> {
        let d = model.config.head_dim;
        if !miles_tensor::ops::paged_attention_runs(&model.device(), model.dtype(), d) {
            return Err(crate::Error::Invalid(format!(
                "rollout engine: on a GPU the paged attention runs in bf16 at head sizes that \
                 are multiples of 16 up to 256, and this model's is {d} in {}: use --dtype bf16 \
                 or --device cpu for it",
                model.dtype()
            )));
        }
        if let Some(dr) = draft
            && (dr.device() != model.device() || dr.dtype() != model.dtype())
        {
            return Err(crate::Error::Invalid(format!(
                "rollout engine: the draft is on {} in {}, the policy on {} in {}",
                dr.device(),
                dr.dtype(),
                model.device(),
                model.dtype()
            )));
        }
        let draft_per_block =
            draft.map_or(0, |dr| KvCache::bytes_per_block(&dr.config, dr.dtype()));
        let per_block = KvCache::bytes_per_block(&model.config, model.dtype()) + draft_per_block;
        let blocks = blocks_in(kv_bytes, per_block)?;
        let kv = KvCache::new(&model.config, blocks, &model.device(), model.dtype())
            .map_err(model_error)?;
        let draft = match draft {
            Some(dr) => Some((
                dr.config.clone(),
                KvCache::new(&dr.config, blocks, &dr.device(), dr.dtype()).map_err(model_error)?,
            )),
            None => None,
        };
        // A mixture of experts routes on the host between layers: no graph can hold a step.
        let use_graphs = graphs && model.config.moe.is_none();
        Ok(Policy {
            config: model.config.clone(),
            device: model.device(),
            dtype: model.dtype(),
            kv,
            graphs: Captured::default(),
            verify_graphs: Captured::default(),
            draft_graphs: Captured::default(),
            spec_graphs: None,
            use_graphs,
            draft,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// Blocks of [`KEY_BLOCK`] tokens the KV cache holds.
    pub fn num_blocks(&self) -> usize {
        self.kv.num_blocks()
    }

    /// Refuses a model other than the one the cache was built for.
    pub fn check(&self, model: &DeviceModel) -> crate::Result<()> {
        if model.config != self.config
            || model.device() != self.device
            || model.dtype() != self.dtype
        {
            return Err(crate::Error::Invalid(format!(
                "rollout engine: its KV cache was built for a {:?} model with {} layers on {:?} \
                 in {:?}, and the model lent to it is another ({:?}, {} layers, {:?}, {:?}); \
                 build an engine for that model",
                self.config.architecture,
                self.config.num_hidden_layers,
                self.device,
                self.dtype,
                model.config.architecture,
                model.config.num_hidden_layers,
                model.device(),
                model.dtype(),
            )));
        }
        Ok(())
    }

    /// One forward of `model` over `rows` (writing their keys and values into the cache), then
    /// one draw per request, in order (requests of one row come together); with them, the
    /// experts each row was routed to in a mixture-of-experts model (`[rows × sparse layers ×
    /// top_k]`, empty for a dense one).
    pub fn step(
        &mut self,
        model: &DeviceModel,
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
            let graphs = self.graphs.over(model, Some(how));
            let drawn = stage(model.device(), "step: decode (graphs)", || {
                model.decode(graphs, rows, &uniforms, &mut self.kv)
            })
            .map_err(model_error)?;
            (drawn, Vec::new())
        } else {
            let device = model.device();
            let (hidden, routes) =
                stage(device, "step: layers", || model.step_routed(rows, &mut self.kv))
                    .map_err(model_error)?;
            let picks: Vec<u32> = draws.iter().map(|&(r, _)| r as u32).collect();
            let drawn = stage(device, "step: head + sample", || {
                model.sample(&hidden, &picks, how, &uniforms)
            })
            .map_err(model_error)?;
            (drawn, routes)
        };
        let drawn = drawn.into_iter().map(|d| d.map(|(token, logprob)| Draw { token, logprob }));
        Ok((drawn.collect(), routes))
    }

    /// Copies every layer of block `src` into `dst` (the draft's too).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> crate::Result<()> {
        if let Some((_, kv)) = &mut self.draft {
            kv.copy_block(src, dst).map_err(model_error)?;
        }
        self.kv.copy_block(src, dst).map_err(model_error)
    }

    /// Whether a draft's cache is kept ([`Policy::with_draft`]).
    pub fn has_draft(&self) -> bool {
        self.draft.is_some()
    }

    /// Refuses a draft other than the one the draft's cache was built for.
    pub fn check_draft(&self, draft: &DeviceModel) -> crate::Result<()> {
        match &self.draft {
            Some((config, _)) if *config == draft.config && draft.device() == self.device => Ok(()),
            Some(_) => Err(crate::Error::Invalid(
                "rollout engine: the draft lent to it is not the one its draft cache was built \
                 for; build an engine for that draft"
                    .into(),
            )),
            None => Err(crate::Error::Invalid(
                "rollout engine: it was built without a draft (Engine::with_draft speculates)"
                    .into(),
            )),
        }
    }

    /// The policy's forward over `rows` (keys and values into its cache): the final-normed
    /// states and the rows' routed experts, no draws (a speculative step verifies them). The
    /// first rows' tokens may be `ids` on the device (`[n × 1]`, a draft's draws) in place of
    /// their own. `drafts_only` steps (every sequence's newest token and its drafts, no
    /// prompt) replay a captured graph; its states may have padding rows after the step's.
    pub fn verify_step(
        &mut self,
        model: &DeviceModel,
        rows: &[StepRow],
        ids: Option<&Tensor>,
        drafts_only: bool,
    ) -> crate::Result<(Tensor, Vec<u16>)> {
        if !(self.use_graphs && drafts_only) {
            let read = read_tokens(rows, ids)?;
            return model.step_routed(&read, &mut self.kv).map_err(model_error);
        }
        let graphs = self.verify_graphs.over(model, None);
        let states =
            model.step_states(graphs, rows, (None, ids), &mut self.kv).map_err(model_error)?;
        Ok((states, Vec::new()))
    }

    /// The draft's step over `rows` fed `states` (its keys and values into its own cache),
    /// the rows' tokens `ids` on the device when given: its final-normed states
    /// ([`DeviceModel::step_draft`]). `proposal` steps (at most the verification's rows, no
    /// prompt) replay a captured graph; their states may have padding rows after the step's.
    pub fn draft_step(
        &mut self,
        draft: &DeviceModel,
        rows: &[StepRow],
        (states, ids): (&Tensor, Option<&Tensor>),
        proposal: bool,
    ) -> crate::Result<Tensor> {
        let Some((_, kv)) = &mut self.draft else {
            return Err(crate::Error::Invalid("rollout engine: no draft cache".into()));
        };
        if !(self.use_graphs && proposal) {
            let read = read_tokens(rows, ids)?;
            return draft.step_draft(&read, states, kv).map_err(model_error);
        }
        let graphs = self.draft_graphs.over(draft, None);
        draft.step_states(graphs, rows, (Some(states), ids), kv).map_err(model_error)
    }

    /// Whether `model`'s steps replay captured graphs here (CUDA, bf16, a dense model, graphs
    /// not turned off).
    pub fn captures(&self, model: &DeviceModel) -> bool {
        self.use_graphs && model.captures_steps()
    }

    /// A whole speculative step of `model` with `draft`, each sequence proposing `k` drafts,
    /// through one captured graph ([`DeviceModel::spec_step`]); `None` where steps are not
    /// captured ([`Policy::captures`]) or this batch's capture failed.
    pub fn spec_step(
        &mut self,
        model: &DeviceModel,
        draft: &DeviceModel,
        rows: SpecRows,
        params: &SamplingParams,
        k: usize,
    ) -> crate::Result<Option<SpecOut>> {
        if !(self.captures(model) && draft.captures_steps()) {
            return Ok(None);
        }
        let Some((_, draft_kv)) = &mut self.draft else {
            return Err(crate::Error::Invalid("rollout engine: no draft cache".into()));
        };
        let how = SampleParams {
            temperature: params.temperature,
            top_k: params.top_k,
            top_p: params.top_p,
        };
        let graphs = match &mut self.spec_graphs {
            Some(g) if g.params() == how && g.drafts() == k => g,
            slot => slot.insert(SpecGraphs::new(how, k)),
        };
        let kvs = (&mut self.kv, draft_kv);
        model.spec_step(draft, graphs, rows, kvs).map_err(model_error)
    }

    /// The block that padding rows of a step read and write (never a sequence's).
    pub fn scratch_block(&self) -> BlockId {
        self.kv.scratch_block()
    }
}

/// `rows` with their first tokens read from `ids` (an eager step reads them on the host).
fn read_tokens<'a>(rows: &[StepRow<'a>], ids: Option<&Tensor>) -> crate::Result<Vec<StepRow<'a>>> {
    match ids {
        Some(ids) => {
            let ids = ids.to_vec_i32().map_err(|e| model_error(e.into()))?;
            Ok(StepRow::with_tokens(rows, &ids))
        }
        None => Ok(rows.to_vec()),
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
