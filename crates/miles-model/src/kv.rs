//! Paged key/value storage for incremental decoding.
//!
//! The cache is a pool of fixed-size blocks of [`miles_tensor::cpu::KEY_BLOCK`] token slots; a
//! sequence owns a block table (block ids in position order) and position `p` lives in slot
//! `p % KEY_BLOCK` of block `table[p / KEY_BLOCK]`. Who owns which block (allocation, sharing, copy on write) is
//! the rollout scheduler's business; this module only stores.

use miles_tensor::cpu::PagedLayout;
use miles_tensor::{DType, Device, Tensor, ops};

use crate::{Error, ModelConfig, Result};

/// Block ids index a [`KvCache`].
pub type BlockId = u32;

/// The paged KV cache on a device, in the model's compute dtype, laid out as
/// [`PagedLayout`]: the tiles the device attention reads, and one contiguous span per block.
pub struct KvCache {
    layout: PagedLayout,
    data: Tensor,
}

impl KvCache {
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
        Ok(KvCache { layout, data })
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
