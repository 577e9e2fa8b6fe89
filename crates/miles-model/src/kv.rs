//! Paged key/value storage for incremental decoding.
//!
//! The cache is a pool of fixed-size blocks of [`KEY_BLOCK`] token slots; a sequence owns a
//! block table (block ids in position order) and position `p` lives in slot `p % KEY_BLOCK` of
//! block `table[p / KEY_BLOCK]`. Who owns which block (allocation, sharing, copy on write) is
//! the rollout scheduler's business; this module only stores.
//!
//! A block holds, per layer and kv head, the keys transposed (`[head_dim × KEY_BLOCK]`) and the
//! values row by row (`[KEY_BLOCK × head_dim]`): exactly the tiles
//! [`miles_tensor::cpu::attend_row`] reads, so decoding needs no copy and runs the same
//! arithmetic as the training forward.

use miles_tensor::cpu::{KEY_BLOCK, PagedLayout};
use miles_tensor::{DType, Device, Tensor, ops};

use crate::{Error, ModelConfig, Result};

/// Block ids index a [`KvCache`].
pub type BlockId = u32;

pub struct KvCache {
    layers: usize,
    kv_heads: usize,
    head_dim: usize,
    num_blocks: usize,
    data: Vec<f32>,
}

impl KvCache {
    /// Bytes one block takes for `config` (all layers, keys and values).
    pub fn bytes_per_block(config: &ModelConfig) -> usize {
        Self::floats_per_block(config) * std::mem::size_of::<f32>()
    }

    fn floats_per_block(c: &ModelConfig) -> usize {
        c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * KEY_BLOCK
    }

    /// A cache of `num_blocks` blocks.
    pub fn new(config: &ModelConfig, num_blocks: usize) -> Result<Self> {
        let floats = Self::floats_per_block(config).checked_mul(num_blocks).ok_or_else(|| {
            Error::Invalid(format!("a KV cache of {num_blocks} blocks overflows memory"))
        })?;
        let data = miles_tensor::try_zeros::<f32>(floats).ok_or_else(|| {
            Error::Invalid(format!(
                "cannot allocate a KV cache of {} MiB; lower --rollout-kv-cache-mb",
                floats / (1 << 18)
            ))
        })?;
        Ok(KvCache {
            layers: config.num_hidden_layers,
            kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            num_blocks,
            data,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    /// Floats of one (block, layer): keys then values, each `kv_heads × head_dim × KEY_BLOCK`.
    fn layer_span(&self) -> usize {
        2 * self.kv_heads * self.head_dim * KEY_BLOCK
    }

    fn offset(&self, block: BlockId, layer: usize) -> usize {
        (block as usize * self.layers + layer) * self.layer_span()
    }

    /// Stores token `position`'s keys and values (`[kv_heads × head_dim]` each) of `layer`.
    pub fn write(
        &mut self,
        layer: usize,
        table: &[BlockId],
        position: usize,
        k: &[f32],
        v: &[f32],
    ) {
        let (d, kvh) = (self.head_dim, self.kv_heads);
        let slot = position % KEY_BLOCK;
        let (base, span) = (self.offset(table[position / KEY_BLOCK], layer), self.layer_span());
        let (keys, values) = self.data[base..base + span].split_at_mut(kvh * d * KEY_BLOCK);
        for g in 0..kvh {
            let kt = &mut keys[g * d * KEY_BLOCK..(g + 1) * d * KEY_BLOCK];
            for (x, &kx) in k[g * d..(g + 1) * d].iter().enumerate() {
                kt[x * KEY_BLOCK + slot] = kx;
            }
            values[(g * KEY_BLOCK + slot) * d..][..d].copy_from_slice(&v[g * d..(g + 1) * d]);
        }
    }

    /// Keys (transposed) and values of kv head `kv_head` in `block` of `layer`.
    pub fn block(&self, layer: usize, block: BlockId, kv_head: usize) -> (&[f32], &[f32]) {
        let tile = self.head_dim * KEY_BLOCK;
        let base = self.offset(block, layer);
        let keys = &self.data[base + kv_head * tile..][..tile];
        let values = &self.data[base + (self.kv_heads + kv_head) * tile..][..tile];
        (keys, values)
    }

    /// Copies every layer of block `src` into `dst` (copy on write of a shared block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) {
        let span = self.layers * self.layer_span();
        let (s, t) = (self.offset(src, 0), self.offset(dst, 0));
        self.data.copy_within(s..s + span, t);
    }
}

/// The paged KV cache on a device, in the model's compute dtype, laid out as
/// [`PagedLayout`]: the tiles the device attention reads, and one contiguous span per block.
/// Block ids and their ownership are the scheduler's, as for [`KvCache`].
pub struct DeviceKvCache {
    layout: PagedLayout,
    data: Tensor,
}

impl DeviceKvCache {
    /// Bytes one block takes for `config` in `dtype` (all layers, keys and values).
    pub fn bytes_per_block(config: &ModelConfig, dtype: DType) -> usize {
        Self::layout_of(config, 1).rows() * config.head_dim * dtype.size_in_bytes()
    }

    fn layout_of(c: &ModelConfig, blocks: usize) -> PagedLayout {
        PagedLayout {
            blocks,
            layers: c.num_hidden_layers,
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        }
    }

    /// A cache of `num_blocks` blocks on `device`, and one more that the scheduler never
    /// hands out: the padding rows of a captured decode step write and read it.
    pub fn new(
        config: &ModelConfig,
        num_blocks: usize,
        device: &Device,
        dtype: DType,
    ) -> Result<Self> {
        let layout = Self::layout_of(config, num_blocks + 1);
        let data = Tensor::zeros(&[layout.rows(), config.head_dim], dtype, device).map_err(|e| {
            Error::Invalid(format!(
                "cannot allocate a KV cache of {} MiB on {device}: {e}; lower --rollout-kv-cache-mb",
                (num_blocks * Self::bytes_per_block(config, dtype)) >> 20
            ))
        })?;
        Ok(DeviceKvCache { layout, data })
    }

    /// Blocks for sequences (the scratch block aside).
    pub fn num_blocks(&self) -> usize {
        self.layout.blocks - 1
    }

    /// The block padding rows use.
    pub fn scratch_block(&self) -> BlockId {
        (self.layout.blocks - 1) as BlockId
    }

    pub fn layout(&self) -> PagedLayout {
        self.layout
    }

    pub(crate) fn data(&self) -> &Tensor {
        &self.data
    }

    pub(crate) fn data_mut(&mut self) -> &mut Tensor {
        &mut self.data
    }

    /// Copies every layer of block `src` into `dst` (copy on write of a shared block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        let n = self.layout.rows_per_block();
        ops::copy_rows_within(&mut self.data, src as usize * n, dst as usize * n, n)?;
        Ok(())
    }
}
