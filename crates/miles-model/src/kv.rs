//! Paged key/value storage for incremental decoding.
//!
//! The cache is a pool of fixed-size blocks of [`miles_tensor::cpu::KEY_BLOCK`] token slots; a
//! sequence owns a block table (block ids in position order) and position `p` lives in slot
//! `p % KEY_BLOCK` of block `table[p / KEY_BLOCK]`. Who owns which block (allocation, sharing, copy on write) is
//! the rollout scheduler's business; this module only stores.
//!
//! A model with DeepSeek's latent attention keeps less: each token's `kv_a_proj_with_mqa`
//! output (`kv_lora_rank` + `qk_rope_head_dim` values a layer, the compressed latent and the
//! rotary key), from which every step expands the heads' keys and values as the training
//! forward does (`DeviceModel::step`).

use miles_tensor::cpu::{KEY_BLOCK, PagedLayout};
use miles_tensor::{DType, Device, Tensor, ops};

use crate::{Error, ModelConfig, Result};

/// Block ids index a [`KvCache`].
pub type BlockId = u32;

/// The paged KV cache on a device, in the model's compute dtype, laid out as
/// [`PagedLayout`]: the tiles the device attention reads, and one contiguous span per block.
/// A latent-attention model's holds latent rows instead ([`KvCache::latent_row`]).
pub struct KvCache {
    /// The attention's layout (for a latent cache: of the keys and values it expands).
    layout: PagedLayout,
    data: Tensor,
    /// The width of a latent row, for a latent-attention model.
    latent: Option<usize>,
}

impl KvCache {
    /// Bytes one block takes for `config` in `dtype` (all layers, keys and values, or latents).
    pub fn bytes_per_block(config: &ModelConfig, dtype: DType) -> usize {
        let (rows, width) = Self::shape_of(config, 1);
        rows * width * dtype.size_in_bytes()
    }

    /// Bytes one token's entries take in all layers.
    pub fn bytes_per_token(config: &ModelConfig, dtype: DType) -> usize {
        Self::bytes_per_block(config, dtype) / KEY_BLOCK
    }

    /// The data's `[rows, width]` for `blocks` blocks.
    fn shape_of(c: &ModelConfig, blocks: usize) -> (usize, usize) {
        match Self::latent_width(c) {
            Some(width) => (blocks * c.num_hidden_layers * KEY_BLOCK, width),
            None => (Self::layout_of(c, blocks).rows(), c.head_dim),
        }
    }

    fn latent_width(c: &ModelConfig) -> Option<usize> {
        c.mla.as_ref().map(|m| m.kv_lora_rank + m.qk_rope_head_dim)
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
        let (rows, width) = Self::shape_of(config, num_blocks + 1);
        let data = Tensor::zeros(&[rows, width], dtype, device).map_err(|e| {
            Error::Invalid(format!(
                "cannot allocate a KV cache of {} MiB on {device}: {e}; lower --rollout-kv-cache-mb",
                (num_blocks * Self::bytes_per_block(config, dtype)) >> 20
            ))
        })?;
        Ok(KvCache { layout, data, latent: Self::latent_width(config) })
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

    /// Whether the cache holds latent rows (a latent-attention model's).
    pub fn is_latent(&self) -> bool {
        self.latent.is_some()
    }

    /// The row of a latent cache holding `layer`'s latent at `slot` of `block` (a block's
    /// rows are contiguous, layer by layer).
    pub(crate) fn latent_row(&self, block: BlockId, layer: usize, slot: usize) -> u32 {
        ((block as usize * self.layout.layers + layer) * KEY_BLOCK + slot) as u32
    }

    /// Rows of the data one block spans.
    fn rows_per_block(&self) -> usize {
        match self.latent {
            Some(_) => self.layout.layers * KEY_BLOCK,
            None => self.layout.rows_per_block(),
        }
    }

    pub(crate) fn data(&self) -> &Tensor {
        &self.data
    }

    pub(crate) fn data_mut(&mut self) -> &mut Tensor {
        &mut self.data
    }

    /// Copies every layer of block `src` into `dst` (copy on write of a shared block).
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId) -> Result<()> {
        let n = self.rows_per_block();
        ops::copy_rows_within(&mut self.data, src as usize * n, dst as usize * n, n)?;
        Ok(())
    }
}
