//! Decode steps replayed as CUDA graphs. A pure decode step (one row per running sequence)
//! launches some 15 kernels per layer; from the host that costs more than the GPU takes to run
//! them at RL's batch sizes. So each batch-size bucket's step is captured once, with its
//! inputs (token ids, RoPE tables, the paged plan, the uniform numbers) in buffers that keep
//! their addresses and its outputs (tokens, logprobs) copied into two more; a step then loads
//! the inputs, launches the graph and reads 8 bytes per row back. Rows past the step's
//! sequences are padding on the cache's scratch block. The graph replays the eager step's
//! kernels on the same per-row data, so the tokens and logprob bits are the eager step's.
//!
//! A speculative step's verification is captured the same way ([`DeviceModel::step_states`]):
//! its rows (a sequence's newest token and its drafts at consecutive positions) are run as
//! decode rows, each attending to the cache up to its own position after every row's keys
//! and values are written, and the graph leaves the final-normed states instead of draws.
//!
//! Without CUDA (the CPU's tensor ops, or a build without the feature) [`DeviceModel::decode`]
//! and [`DeviceModel::step_states`] run the eager step.

use miles_tensor::Tensor;
#[cfg(feature = "cuda")]
use miles_tensor::cpu::PagedRows;
#[cfg(feature = "cuda")]
use miles_tensor::{DType, Device, ops};

use crate::{DeviceModel, Error, KvCache, Result, SampleParams, StepRow};

/// Batch sizes of the captured steps: powers of two to 256, then multiples of 128.
#[cfg(any(test, feature = "cuda"))]
pub(crate) fn bucket(rows: usize) -> usize {
    if rows <= 256 { rows.next_power_of_two() } else { rows.div_ceil(128) * 128 }
}

/// The captured decode steps of one sampling configuration (draws), or of steps that leave
/// the final-normed states (`params` `None`), and of one block-table width.
pub struct DecodeGraphs {
    params: Option<SampleParams>,
    /// Blocks per sequence the captured plans hold.
    #[cfg(feature = "cuda")]
    stride: usize,
    #[cfg(feature = "cuda")]
    graphs: Vec<DecodeGraph>,
}

impl DecodeGraphs {
    /// Steps that draw a token per row with `params`.
    pub fn new(params: SampleParams) -> Self {
        Self::of(Some(params))
    }

    /// Steps that leave the rows' final-normed states ([`DeviceModel::step_states`]).
    pub fn states() -> Self {
        Self::of(None)
    }

    fn of(params: Option<SampleParams>) -> Self {
        DecodeGraphs {
            params,
            #[cfg(feature = "cuda")]
            stride: 0,
            #[cfg(feature = "cuda")]
            graphs: Vec::new(),
        }
    }

    /// The draws' sampling configuration; `None` for steps that leave states.
    pub fn params(&self) -> Option<SampleParams> {
        self.params
    }

    /// Captured steps so far.
    pub fn len(&self) -> usize {
        #[cfg(feature = "cuda")]
        return self.graphs.len();
        #[cfg(not(feature = "cuda"))]
        0
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Device time of one replay of each captured step, `(rows, seconds)`, over `iters`
    /// back-to-back replays (the last step's inputs; the KV entries it writes are rewritten
    /// with the same values). Against the decode step's wall time, the rest is the host's:
    /// scheduling, the input and output copies, the launch. For benchmarks.
    pub fn replay_seconds(&self, iters: u64) -> Result<Vec<(usize, f64)>> {
        #[cfg(feature = "cuda")]
        return self
            .graphs
            .iter()
            .filter_map(|g| g.graph.as_ref().map(|graph| (g, graph)))
            .map(|(g, graph)| Ok((g.rows, replay_time(graph, &g.ids.device(), iters)?)))
            .collect();
        #[cfg(not(feature = "cuda"))]
        {
            let _ = iters;
            Ok(Vec::new())
        }
    }
}

/// Device seconds of one replay of `graph`, over `iters` back-to-back replays after a warm
/// one.
#[cfg(feature = "cuda")]
pub(crate) fn replay_time(graph: &miles_tensor::Graph, device: &Device, iters: u64) -> Result<f64> {
    device.time(1, || graph.launch())?;
    let t = device.time(iters, || graph.launch())?;
    Ok(t.as_secs_f64() / iters.max(1) as f64)
}

/// One bucket's graph and the buffers it reads and writes.
#[cfg(feature = "cuda")]
pub(crate) struct DecodeGraph {
    pub(crate) rows: usize,
    /// `None` when capture failed: the body then runs eagerly on the same buffers.
    graph: Option<miles_tensor::Graph>,
    pub(crate) ids: Tensor,
    cos: Tensor,
    sin: Tensor,
    /// The sliding layers' own rotary tables (Gemma 3).
    local: Option<(Tensor, Tensor)>,
    plan: ops::PagedPlan,
    /// A speculative draft's input states `[rows × hidden]` ([`DeviceModel::step_draft`]).
    pub(crate) states_in: Option<Tensor>,
    pub(crate) out: Outputs,
}

/// A step's inputs beside its rows: a uniform number per row (steps that draw), a draft's
/// states (a draft's steps), the rows' tokens on the device (in place of the rows' own).
#[cfg(feature = "cuda")]
#[derive(Clone, Copy)]
struct Inputs<'a> {
    uniforms: &'a [f64],
    states: Option<&'a Tensor>,
    ids: Option<&'a Tensor>,
}

/// A draw per row: the uniform numbers in, the tokens and their logprobs out.
#[cfg(feature = "cuda")]
pub(crate) struct DrawBuffers {
    params: SampleParams,
    uniforms: Tensor,
    tokens: Tensor,
    logp: Tensor,
}

/// What a captured step leaves in its buffers.
#[cfg(feature = "cuda")]
pub(crate) enum Outputs {
    Draws(Box<DrawBuffers>),
    /// The final-normed states `[rows × hidden]`.
    States(Tensor),
}

impl DeviceModel {
    /// One decode step: `rows` are one position of distinct sequences; draws the next token of
    /// each with `uniforms[i]` as [`DeviceModel::step`] then [`DeviceModel::sample`] do, with
    /// the same bits, through a captured graph on CUDA.
    pub fn decode(
        &self,
        graphs: &mut DecodeGraphs,
        rows: &[StepRow],
        uniforms: &[f64],
        kv: &mut KvCache,
    ) -> Result<Vec<Option<(u32, f32)>>> {
        let Some(params) = graphs.params else {
            return Err(Error::Invalid("decode: these graphs leave states, not draws".into()));
        };
        if rows.len() != uniforms.len() {
            return Err(Error::Invalid(format!(
                "{} decode rows with {} uniform numbers",
                rows.len(),
                uniforms.len()
            )));
        }
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) && self.dtype() == DType::BF16 {
            let g = self.replay(graphs, rows, Inputs { uniforms, states: None, ids: None }, kv)?;
            let Outputs::Draws(d) = &g.out else { unreachable!("draw graphs") };
            let (tokens, logp) = (d.tokens.to_vec_i32()?, d.logp.to_vec_f32()?);
            return Ok(tokens[..rows.len()]
                .iter()
                .zip(&logp)
                .map(|(&t, &lp)| u32::try_from(t).ok().map(|t| (t, lp)))
                .collect());
        }
        let hidden = self.step(rows, kv)?;
        let picks: Vec<u32> = (0..rows.len() as u32).collect();
        self.sample(&hidden, &picks, params, uniforms)
    }

    /// [`DeviceModel::step`] over rows that each attend to the cache up to their own position
    /// (a sequence's rows at consecutive positions, or rows of distinct sequences), or with
    /// `states` a draft's [`DeviceModel::step_draft`], through a captured graph on CUDA: the
    /// final-normed states `[rows × hidden]`, with the eager step's bits. The graph's padding
    /// rows may follow the step's (the tensor has at least `rows.len()` rows). With `ids`
    /// (i32 `[rows × 1]` on the model's device, a sampler's draws: -1 reads as token 0) the
    /// rows' tokens are those, never read to the host on a GPU. Dense models only: a mixture
    /// of experts routes on the host.
    pub fn step_states(
        &self,
        graphs: &mut DecodeGraphs,
        rows: &[StepRow],
        (states, ids): (Option<&Tensor>, Option<&Tensor>),
        kv: &mut KvCache,
    ) -> Result<Tensor> {
        if graphs.params.is_some() {
            return Err(Error::Invalid("step_states: these graphs draw, not leave states".into()));
        }
        if let Some(s) = states
            && s.shape().first() != Some(&rows.len())
        {
            return Err(Error::Invalid(format!(
                "step_states: {} rows with states {:?}",
                rows.len(),
                s.shape()
            )));
        }
        if let Some(ids) = ids
            && ids.shape() != [rows.len(), 1]
        {
            return Err(Error::Invalid(format!(
                "step_states: {} rows with ids {:?}",
                rows.len(),
                ids.shape()
            )));
        }
        #[cfg(feature = "cuda")]
        if matches!(self.device(), Device::Cuda(_)) && self.dtype() == DType::BF16 {
            let g = self.replay(graphs, rows, Inputs { uniforms: &[], states, ids }, kv)?;
            let Outputs::States(states) = &g.out else { unreachable!("state graphs") };
            return Ok(states.try_clone()?);
        }
        let read;
        let rows = match ids {
            Some(ids) => {
                read = StepRow::with_tokens(rows, &ids.to_vec_i32()?);
                &read[..]
            }
            None => rows,
        };
        match states {
            Some(states) => self.step_draft(rows, states, kv),
            None => self.step(rows, kv),
        }
    }

    /// Loads the step into its bucket's buffers and replays the bucket's graph (capturing it
    /// first when new): the step's outputs are then in the graph's buffers.
    #[cfg(feature = "cuda")]
    fn replay<'g>(
        &self,
        graphs: &'g mut DecodeGraphs,
        rows: &[StepRow],
        inputs: Inputs,
        kv: &mut KvCache,
    ) -> Result<&'g DecodeGraph> {
        self.check_step_tokens(rows)?;
        // Tables wider than the captured plans': capture again, twice as wide.
        let widest = rows.iter().map(|r| r.blocks.len()).max().unwrap_or(1);
        if widest > graphs.stride {
            graphs.stride = widest.next_power_of_two().max(8);
            graphs.graphs.clear();
        }
        let b = bucket(rows.len());
        let index = match graphs.graphs.iter().position(|g| g.rows == b) {
            Some(i) => {
                let g = &mut graphs.graphs[i];
                self.load_inputs(g, rows, inputs)?;
                match &g.graph {
                    Some(graph) => graph.launch()?,
                    None => self.decode_body(g, kv)?,
                }
                i
            }
            None => {
                let g = self.capture_decode(b, graphs.stride, graphs.params, rows, inputs, kv)?;
                graphs.graphs.push(g);
                graphs.graphs.len() - 1
            }
        };
        Ok(&graphs.graphs[index])
    }

    /// Writes a step's inputs into the graph's buffers (padding rows: token 0 at position 0 of
    /// the scratch block, uniform 0, the first row's states).
    #[cfg(feature = "cuda")]
    fn load_inputs(&self, g: &mut DecodeGraph, rows: &[StepRow], inputs: Inputs) -> Result<()> {
        match (&mut g.states_in, inputs.states) {
            (Some(buffer), Some(states)) => {
                let mut picks: Vec<u32> = (0..rows.len() as u32).collect();
                picks.resize(g.rows, 0);
                buffer.copy_from(&ops::gather_rows(states, &picks)?)?;
            }
            (None, None) => {}
            _ => {
                return Err(Error::Invalid(
                    "a captured step: a draft's steps take states, a policy's do not".into(),
                ));
            }
        }
        self.load_rows(g, rows)?;
        if let Some(ids) = inputs.ids {
            let pad = Tensor::zeros(&[g.rows - rows.len(), 1], DType::I32, &self.device())?;
            g.ids.copy_from(&ops::concat_rows(&[ids, &pad])?)?;
        }
        let Outputs::Draws(d) = &mut g.out else { return Ok(()) };
        let mut uniforms = inputs.uniforms.to_vec();
        uniforms.resize(g.rows, 0.0);
        d.uniforms.copy_from(&ops::uniform_bits(&uniforms, &Device::Cpu)?)?;
        Ok(())
    }

    /// Writes what `rows` give a step into the graph's buffers, all from the host: their
    /// tokens, rotary tables and paged plan (padding rows: token 0 at position 0 of the
    /// scratch block).
    #[cfg(feature = "cuda")]
    pub(crate) fn load_rows(&self, g: &mut DecodeGraph, rows: &[StepRow]) -> Result<()> {
        let cpu = Device::Cpu;
        let mut ids: Vec<i32> = rows.iter().map(|r| r.token as i32).collect();
        ids.resize(g.rows, 0);
        g.ids.copy_from(&Tensor::from_i32(&[g.rows], ids, &cpu)?)?;
        let mut positions: Vec<u32> = rows.iter().map(|r| r.position as u32).collect();
        positions.resize(g.rows, 0);
        let c = &self.config;
        let (cos, sin) = c.rope_tables(&positions);
        let half = [g.rows, c.head_dim / 2];
        g.cos.copy_from(&Tensor::from_f32(&half, cos, &cpu)?)?;
        g.sin.copy_from(&Tensor::from_f32(&half, sin, &cpu)?)?;
        if let (Some((lc, ls)), Some((cos, sin))) = (&mut g.local, c.local_rope_tables(&positions))
        {
            lc.copy_from(&Tensor::from_f32(&half, cos, &cpu)?)?;
            ls.copy_from(&Tensor::from_f32(&half, sin, &cpu)?)?;
        }
        let seqs: Vec<PagedRows> =
            rows.iter().map(|r| PagedRows { n: 1, pos0: r.position, table: r.blocks }).collect();
        g.plan.load_decode(&seqs)?;
        Ok(())
    }

    /// Makes bucket `rows`'s buffers, runs the step once eagerly on them (this step's result;
    /// it also loads the kernels and pins the GEMM algorithms), then captures the same body.
    #[cfg(feature = "cuda")]
    fn capture_decode(
        &self,
        rows: usize,
        stride: usize,
        params: Option<SampleParams>,
        step: &[StepRow],
        inputs: Inputs,
        kv: &mut KvCache,
    ) -> Result<DecodeGraph> {
        let mut g = self.graph_buffers(rows, stride, params, inputs.states.is_some(), kv)?;
        self.load_inputs(&mut g, step, inputs)?;
        self.decode_body(&mut g, kv)?;
        let body = || {
            self.decode_body(&mut g, kv).map_err(|e| match e {
                Error::Op(e) => e,
                other => miles_tensor::Error::Device(other.to_string()),
            })
        };
        // This step's result is in `g` already; a graph that cannot be captured leaves the
        // later steps eager.
        g.graph = match self.device().capture(body) {
            Ok(graph) => Some(graph),
            Err(e) => {
                eprintln!("warning: decode steps run eagerly: capturing a CUDA graph failed: {e}");
                None
            }
        };
        Ok(g)
    }

    /// The buffers of a step of `rows` rows (tables `stride` blocks wide) that draws with
    /// `params` or leaves states, a draft's when `states` (its input states), over `kv`.
    #[cfg(feature = "cuda")]
    pub(crate) fn graph_buffers(
        &self,
        rows: usize,
        stride: usize,
        params: Option<SampleParams>,
        states: bool,
        kv: &KvCache,
    ) -> Result<DecodeGraph> {
        let (c, device) = (&self.config, self.device());
        let half = [rows, c.head_dim / 2];
        let layout = kv.layout();
        let plan = ops::PagedPlan::for_decode(rows, stride, kv.scratch_block(), layout, &device)?;
        Ok(DecodeGraph {
            rows,
            graph: None,
            ids: Tensor::zeros(&[rows], DType::I32, &device)?,
            cos: Tensor::zeros(&half, DType::F32, &device)?,
            sin: Tensor::zeros(&half, DType::F32, &device)?,
            local: match c.local_rope_tables(&[]) {
                Some(_) => Some((
                    Tensor::zeros(&half, DType::F32, &device)?,
                    Tensor::zeros(&half, DType::F32, &device)?,
                )),
                None => None,
            },
            plan,
            states_in: match states {
                true => Some(Tensor::zeros(&[rows, c.hidden_size], self.dtype(), &device)?),
                false => None,
            },
            out: match params {
                Some(params) => Outputs::Draws(Box::new(DrawBuffers {
                    params,
                    uniforms: Tensor::zeros(&[rows, 2], DType::I32, &device)?,
                    tokens: Tensor::zeros(&[rows], DType::I32, &device)?,
                    logp: Tensor::zeros(&[rows], DType::F32, &device)?,
                })),
                None => {
                    Outputs::States(Tensor::zeros(&[rows, c.hidden_size], self.dtype(), &device)?)
                }
            },
        })
    }

    /// The step on the graph's buffers: what is captured.
    #[cfg(feature = "cuda")]
    pub(crate) fn decode_body(&self, g: &mut DecodeGraph, kv: &mut KvCache) -> Result<()> {
        let mut x = self.embed(ops::embedding_forward_ids(self.embedding(), &g.ids)?)?;
        if let Some(states) = &g.states_in {
            x = self.draft_mix(x, states)?.0;
        }
        let local = g.local.as_ref().map(|(c, s)| (c, s));
        let hidden = self.step_layers(x, (&g.cos, &g.sin), local, &g.plan, kv)?;
        match &mut g.out {
            Outputs::States(states) => states.copy_from(&hidden)?,
            Outputs::Draws(d) => {
                let logits = self.head_all(&hidden)?;
                drop(hidden);
                let (t, k, p) = (d.params.temperature, d.params.top_k, d.params.top_p);
                let drawn = ops::sample_rows_ids(&logits, t, k, p, &d.uniforms)?;
                d.tokens.copy_from(&drawn)?;
                d.logp.copy_from(&ops::logprob_rows_ids(&logits, &drawn, t)?.0)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::bucket;

    #[test]
    fn buckets_cover_every_batch() {
        assert_eq!(
            [1, 2, 3, 5, 64, 65, 256, 257, 300].map(bucket),
            [1, 2, 4, 8, 64, 128, 256, 384, 384]
        );
    }
}
