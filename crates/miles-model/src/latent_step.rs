//! A latent-attention model's steps over its latent cache ([`KvCache::is_latent`]).
//!
//! The cache keeps each token's `kv_a_proj_with_mqa` output, `kv_lora_rank +
//! qk_rope_head_dim` values a layer, instead of every head's key and value. A step writes its
//! rows' outputs there; then each layer expands every cached token its sequences see into
//! keys and values with the training forward's own ops ([`keys_values`], the rotary at each
//! token's position) and attends over them in a one-layer scratch cache. Row by row those are
//! the training forward's keys and values, so the step keeps the training forward's bits.
//! The price is a `kv_b` product over the sequences' history at every step. DeepSeek's
//! absorbed form (`W_uk` folded into the query, `W_uv` after the attention) avoids it, but its
//! sums are not the training forward's, and rollout logprobs must be.

use std::collections::HashMap;

use miles_tensor::cpu::{KEY_BLOCK, PagedLayout, PagedRows};
use miles_tensor::{Tensor, ops};

use crate::backend::Backend;
use crate::device::Dev;
use crate::mla::{KeysValues, keys_values};
use crate::stage_clock::stage;
use crate::{DeviceModel, Error, KvCache, Result};

/// What every layer of one step over a latent cache shares.
pub(crate) struct LatentStep {
    /// The latent rows of layer 0 the step writes (layer l's are l·KEY_BLOCK further)...
    written: Vec<u32>,
    /// ...from these of its rows, where two rows write one slot (a captured step's padding
    /// rows): the later one's, as the paged cache keeps. `None`: every row, in order.
    writers: Option<Vec<u32>>,
    /// Layer 0's latent rows of every block the step's sequences see, up to the last slot
    /// they read, each block once (sequences share their prompt's blocks).
    history: Vec<u32>,
    /// The history rows' rotary tables.
    cos: Tensor,
    sin: Tensor,
    /// Writes the expanded keys and values into the scratch cache, a block at a time.
    write: ops::PagedPlan,
    /// The step's rows over the scratch cache.
    attend: ops::PagedPlan,
    scratch: Tensor,
}

impl LatentStep {
    /// The step of `plan`'s rows over `kv`.
    pub fn new(model: &DeviceModel, plan: &ops::PagedPlan, kv: &KvCache) -> Result<Self> {
        let c = &model.config;
        let seqs = plan.seqs();
        // Each block seen, with its scratch block and its index in the tables (the same in
        // every table that shares it: shared blocks are prompts'); in `order` also the slots
        // the step's sequences read of it.
        let mut seen: HashMap<u32, (u32, usize)> = HashMap::new();
        let mut order: Vec<(u32, usize, usize)> = Vec::new();
        let mut tables: Vec<Vec<u32>> = Vec::with_capacity(seqs.len());
        let mut written = Vec::with_capacity(plan.rows());
        for s in &seqs {
            let end = s.pos0 + s.n;
            let mut table = Vec::with_capacity(end.div_ceil(KEY_BLOCK));
            for (j, &block) in s.table[..end.div_ceil(KEY_BLOCK)].iter().enumerate() {
                let (scratch, at) = *seen.entry(block).or_insert_with(|| {
                    order.push((block, j, 0));
                    ((order.len() - 1) as u32, j)
                });
                if at != j {
                    return Err(Error::Invalid(format!(
                        "latent step: block {block} holds positions from {} and from {}",
                        at * KEY_BLOCK,
                        j * KEY_BLOCK
                    )));
                }
                let read = &mut order[scratch as usize].2;
                *read = (*read).max((end - j * KEY_BLOCK).min(KEY_BLOCK));
                table.push(scratch);
            }
            written.extend(
                (s.pos0..end).map(|p| kv.latent_row(s.table[p / KEY_BLOCK], 0, p % KEY_BLOCK)),
            );
            tables.push(table);
        }
        let mut last: HashMap<u32, usize> = HashMap::new();
        for (r, &row) in written.iter().enumerate() {
            last.insert(row, r);
        }
        let writers = (last.len() < written.len()).then(|| {
            let rows: Vec<u32> =
                (0..written.len()).filter(|&r| last[&written[r]] == r).map(|r| r as u32).collect();
            written = rows.iter().map(|&r| written[r as usize]).collect();
            rows
        });
        let history: Vec<u32> = order
            .iter()
            .flat_map(|&(block, _, read)| (0..read).map(move |slot| kv.latent_row(block, 0, slot)))
            .collect();
        let positions: Vec<u32> = order
            .iter()
            .flat_map(|&(_, j, read)| (0..read).map(move |slot| (j * KEY_BLOCK + slot) as u32))
            .collect();
        let (cos, sin) = model.rope_tensors(&positions)?;
        let layout = PagedLayout {
            blocks: order.len(),
            layers: 1,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        };
        let device = model.device();
        // Block i's slots read, written at their positions: a table reaching index j, all
        // of it i.
        let block_tables: Vec<Vec<u32>> =
            order.iter().enumerate().map(|(i, &(_, j, _))| vec![i as u32; j + 1]).collect();
        let blocks: Vec<PagedRows> = order
            .iter()
            .zip(&block_tables)
            .map(|(&(_, j, read), table)| PagedRows { n: read, pos0: j * KEY_BLOCK, table })
            .collect();
        let write = ops::PagedPlan::new(&blocks, layout, &device)?;
        let rows: Vec<PagedRows> = seqs
            .iter()
            .zip(&tables)
            .map(|(s, table)| PagedRows { n: s.n, pos0: s.pos0, table })
            .collect();
        let attend = ops::PagedPlan::new(&rows, layout, &device)?;
        let scratch = Tensor::zeros(&[layout.rows(), c.head_dim], model.dtype(), &device)?;
        Ok(LatentStep { written, writers, history, cos, sin, write, attend, scratch })
    }
}

impl DeviceModel {
    /// Layer `layer`'s attention of a step over a latent cache: the rows' `kva` (their `kv_a`
    /// outputs) written, the history expanded, the queries `q` (rotated) attending over it.
    pub(crate) fn latent_attention(
        &self,
        layer: usize,
        q: &Tensor,
        kva: &Tensor,
        step: &mut LatentStep,
        kv: &mut KvCache,
    ) -> Result<(Tensor, Tensor)> {
        let c = &self.config;
        let in_layer = |rows: &[u32]| -> Vec<u32> {
            rows.iter().map(|r| r + (layer * KEY_BLOCK) as u32).collect()
        };
        let heads = c.num_attention_heads;
        stage(self.device(), "attention: latent expand", || {
            let rows = in_layer(&step.written);
            match &step.writers {
                Some(writers) => {
                    ops::scatter_rows(kv.data_mut(), &ops::gather_rows(kva, writers)?, &rows)?
                }
                None => ops::scatter_rows(kv.data_mut(), kva, &rows)?,
            }
            let history = ops::gather_rows(kv.data(), &in_layer(&step.history))?;
            let dev = Dev {
                w: self.weights(),
                cos: &step.cos,
                sin: &step.sin,
                local: None,
                cu_seqlens: &[],
                grads: None,
            };
            let KeysValues { k, v, .. } = keys_values(&dev, layer, &history)?;
            let k = dev.rope(layer, k, heads, false)?;
            Ok(ops::paged_kv_write(&mut step.scratch, &k, &v, 0, &step.write)?)
        })?;
        stage(self.device(), "attention: latent attend", || {
            let scores = c.attention_shape(layer).scores;
            Ok(ops::paged_attention(q, &step.scratch, 0, &step.attend, heads, &scores)?)
        })
    }
}

#[cfg(test)]
mod tests {
    use miles_tensor::{DType, Device};

    use crate::model::tests::model;
    use crate::presets::preset;
    use crate::{Architecture, DeviceModel, KvCache, StepRow};

    fn devices() -> Vec<Device> {
        let mut devices = vec![Device::Cpu];
        if Device::Cuda(0).ensure_available().is_ok() {
            devices.push(Device::Cuda(0));
        }
        devices
    }

    /// Each step's hidden states as bits: a prompt of 70 tokens; a second sequence sharing its
    /// first block, its own 6 prompt tokens and the first's next row; then two decode steps
    /// of both.
    fn step_bits(dm: &DeviceModel, kv: &mut KvCache) -> Vec<Vec<u32>> {
        let (first, second): (&[u32], &[u32]) = (&[3, 0], &[3, 5]);
        // (The second sequence's own tokens differ from the first's.)
        let rows = |table: &'static [u32], from: usize, to: usize| {
            let token = move |p: usize| (p * 7 + 1 + table[1] as usize) as u32 % 64;
            (from..to).map(move |p| StepRow { token: token(p), position: p, blocks: table })
        };
        let steps: Vec<Vec<StepRow>> = vec![
            rows(first, 0, 70).collect(),
            rows(second, 64, 70).chain(rows(first, 70, 71)).collect(),
            rows(second, 70, 71).chain(rows(first, 71, 72)).collect(),
            rows(second, 71, 72).chain(rows(first, 72, 73)).collect(),
        ];
        steps
            .iter()
            .map(|rows| {
                let hidden = dm.step(rows, kv).unwrap().to_vec_f32().unwrap();
                hidden.iter().map(|v| v.to_bits()).collect()
            })
            .collect()
    }

    /// A latent cache holds `kv_lora_rank + qk_rope_head_dim` values a token and layer, and
    /// steps over it have the bits of steps over every head's keys and values (the shared
    /// block expanded once for both sequences), in f32 and bf16 on every device.
    #[test]
    fn latent_steps_have_the_bits_of_steps_over_full_keys_and_values() {
        let c = preset("tiny", Some(Architecture::DeepseekV3)).unwrap();
        let m = model(c.clone(), 5);
        let mla = c.mla.clone().unwrap();
        let width = mla.kv_lora_rank + mla.qk_rope_head_dim;
        let per_token = c.num_hidden_layers * width;
        assert_eq!(KvCache::bytes_per_token(&c, DType::BF16), per_token * 2);
        let mut full = c.clone();
        full.mla = None;
        let full_per_token = KvCache::bytes_per_token(&full, DType::BF16);
        assert_eq!(
            full_per_token,
            c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
        );
        for device in devices() {
            // (CUDA's paged attention runs in bf16.)
            let runs = |&dtype: &DType| {
                miles_tensor::ops::paged_attention_runs(&device, dtype, c.head_dim)
            };
            for dtype in [DType::F32, DType::BF16].into_iter().filter(runs) {
                let dm = DeviceModel::new(&m, &device, dtype).unwrap();
                let mut latent = KvCache::new(&c, 8, &device, dtype).unwrap();
                assert!(latent.is_latent());
                assert_eq!(latent.data().shape(), [9 * c.num_hidden_layers * 64, width]);
                let mut keys_values = KvCache::new(&full, 8, &device, dtype).unwrap();
                assert!(!keys_values.is_latent());
                let (a, b) = (step_bits(&dm, &mut latent), step_bits(&dm, &mut keys_values));
                assert!(a.iter().all(|s| !s.is_empty()));
                assert!(a == b, "{device} {dtype}: latent steps differ from full ones");
            }
        }
    }

    /// A block that two tables hold at different positions (never a shared prompt's) is an
    /// error naming it, not a wrong expansion.
    #[test]
    fn a_block_at_two_positions_is_refused() {
        let c = preset("tiny", Some(Architecture::DeepseekV3)).unwrap();
        let dm = DeviceModel::new(&model(c.clone(), 5), &Device::Cpu, DType::F32).unwrap();
        let mut kv = KvCache::new(&c, 8, &Device::Cpu, DType::F32).unwrap();
        let (first, second): (&[u32], &[u32]) = (&[3], &[0, 3]);
        let rows = [
            StepRow { token: 1, position: 0, blocks: first },
            StepRow { token: 2, position: 64, blocks: second },
        ];
        let err = dm.step(&rows, &mut kv).unwrap_err().to_string();
        assert!(err.contains("block 3 holds positions from 0 and from 64"), "{err}");
    }
}
