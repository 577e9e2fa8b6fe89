//! Causal grouped-query attention over packed variable-length sequences (`cu_seqlens`), forward
//! and backward, as [`crate::cpu::attention_forward`] lays it out. On the device the kernels keep
//! the CPU's order (key blocks anchored at each sequence's start, keys summed in order), so a
//! sequence's results have the same bits however it is packed.

use super::{floats_only, host_f32, host_out, host_tensor, same_device};
use crate::cpu::{self, AttentionShape, PagedLayout, PagedRows};
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::device_data;

fn tokens_of(
    op: &'static str,
    q: &Tensor,
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<usize> {
    let tokens = cu_seqlens.last().copied().unwrap_or(0);
    ensure(shape.head_dim > 0 && shape.q_heads > 0, op, || format!("{shape:?} has no heads"))?;
    ensure(q.len() == tokens * shape.q_heads * shape.head_dim, op, || {
        format!("q {:?} for {tokens} tokens of {shape:?}", q.shape)
    })?;
    Ok(tokens)
}

#[cfg(feature = "cuda")]
fn device_ready(
    op: &'static str,
    t: &Tensor,
    shape: AttentionShape,
) -> Result<std::sync::Arc<crate::cuda::Gpu>> {
    ensure(
        shape.head_dim <= crate::cuda::MAX_HEAD_DIM && shape.head_dim.is_multiple_of(4),
        op,
        || {
            format!(
                "head_dim {}: the CUDA kernels take a multiple of 4 up to {}",
                shape.head_dim,
                crate::cuda::MAX_HEAD_DIM
            )
        },
    )?;
    match &t.storage {
        Storage::Cuda(buffer) => Ok(buffer.gpu.clone()),
        _ => unreachable!("a device tensor"),
    }
}

/// `(out, lse)`: `out` shaped and typed like `q`, `lse` f32 `[tokens × q_heads]`. `q` holds
/// `tokens × q_heads × head_dim` elements, `k` and `v` `tokens × kv_heads × head_dim`, all one
/// dtype.
pub fn attention_forward(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "attention";
    let device = same_device(OP, &[q, k, v])?;
    floats_only(OP, &[q, k, v])?;
    let tokens = tokens_of(OP, q, cu_seqlens, shape)?;
    shape.check(OP, tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    ensure(k.dtype() == q.dtype() && v.dtype() == q.dtype(), OP, || {
        format!("q {}, k {}, v {}: one dtype", q.dtype(), k.dtype(), v.dtype())
    })?;
    let lse_shape = vec![tokens, shape.q_heads];
    match device {
        Device::Cpu => {
            let (mut out, mut lse) = (host_out(q.len()), host_out(tokens * shape.q_heads));
            cpu::attention_forward(
                &mut out,
                &mut lse,
                &host_f32(q),
                &host_f32(k),
                &host_f32(v),
                cu_seqlens,
                shape,
            )?;
            Ok((
                host_tensor(q.shape.clone(), out, q.dtype()),
                host_tensor(lse_shape, lse, DType::F32),
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let gpu = device_ready(OP, q, shape)?;
            let (out, lse) = crate::cuda::attention_forward(
                &gpu,
                device_data(q),
                device_data(k),
                device_data(v),
                cu_seqlens,
                shape,
            )?;
            Ok((
                Tensor { shape: q.shape.clone(), storage: Storage::Cuda(out) },
                Tensor { shape: lse_shape, storage: Storage::Cuda(lse) },
            ))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `(dq, dk, dv)` of [`attention_forward`] from `d_out` (like `q`) and the forward's `out` and
/// `lse`. Every sum runs in a fixed order: the same bits on every run.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    d_out: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    out: &Tensor,
    lse: &Tensor,
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<(Tensor, Tensor, Tensor)> {
    const OP: &str = "attention_backward";
    let device = same_device(OP, &[d_out, q, k, v, out, lse])?;
    floats_only(OP, &[d_out, q, k, v, out, lse])?;
    let tokens = tokens_of(OP, q, cu_seqlens, shape)?;
    shape.check(OP, tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    let dtype = q.dtype();
    ensure(
        [k, v, d_out, out].iter().all(|t| t.dtype() == dtype)
            && lse.dtype() == DType::F32
            && d_out.len() == q.len()
            && out.len() == q.len()
            && lse.len() == tokens * shape.q_heads,
        OP,
        || {
            format!(
                "d_out {:?} {}, out {:?} {}, lse {:?} {} for q {:?} {dtype}",
                d_out.shape,
                d_out.dtype(),
                out.shape,
                out.dtype(),
                lse.shape,
                lse.dtype(),
                q.shape
            )
        },
    )?;
    match device {
        Device::Cpu => {
            let (mut dq, mut dk, mut dv) =
                (host_out(q.len()), host_out(k.len()), host_out(v.len()));
            cpu::attention_backward(
                &mut dq,
                &mut dk,
                &mut dv,
                &host_f32(d_out),
                &host_f32(q),
                &host_f32(k),
                &host_f32(v),
                &host_f32(out),
                &host_f32(lse),
                cu_seqlens,
                shape,
            )?;
            Ok((
                host_tensor(q.shape.clone(), dq, dtype),
                host_tensor(k.shape.clone(), dk, dtype),
                host_tensor(v.shape.clone(), dv, dtype),
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let gpu = device_ready(OP, q, shape)?;
            let crate::cuda::DeviceData::F32(lse_d) = device_data(lse) else {
                unreachable!("lse is f32 (checked)")
            };
            let (dq, dk, dv) = crate::cuda::attention_backward(
                &gpu,
                device_data(d_out),
                device_data(q),
                device_data(k),
                device_data(v),
                device_data(out),
                lse_d,
                cu_seqlens,
                shape,
            )?;
            let t =
                |shape: &[usize], b| Tensor { shape: shape.to_vec(), storage: Storage::Cuda(b) };
            Ok((t(&q.shape, dq), t(&k.shape, dk), t(&v.shape, dv)))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// One step's rows over a paged KV cache, prepared once (on the device: the tiles, block
/// tables and write slots uploaded) and read by every layer's [`paged_kv_write`] and
/// [`paged_attention`]. The sequences take the step's rows in order.
pub struct PagedPlan {
    layout: PagedLayout,
    rows: usize,
    seqs: Vec<(usize, usize, Vec<u32>)>,
    /// (stride, scratch block) of a fixed-capacity decode plan.
    decode: Option<(usize, u32)>,
    #[cfg(feature = "cuda")]
    device: Option<crate::cuda::PagedPlanDevice>,
}

impl PagedPlan {
    pub fn new(seqs: &[PagedRows], layout: PagedLayout, device: &Device) -> Result<Self> {
        let rows = cpu::attention::check_paged("paged_plan", seqs, 0, layout)?;
        #[cfg(not(feature = "cuda"))]
        if *device != Device::Cpu {
            return Err(crate::tensor::not_built());
        }
        let owned = seqs.iter().map(|s| (s.n, s.pos0, s.table.to_vec())).collect();
        Ok(PagedPlan {
            layout,
            rows,
            seqs: owned,
            decode: None,
            #[cfg(feature = "cuda")]
            device: match device {
                Device::Cpu => None,
                Device::Cuda(ordinal) => {
                    Some(crate::cuda::paged_plan(&crate::cuda::gpu(*ordinal)?, seqs)?)
                }
            },
        })
    }

    /// A plan of `rows` decode rows (one position of one sequence each) whose contents
    /// [`PagedPlan::load_decode`] replaces at every step while its device buffers stay put, as
    /// a captured graph needs. Tables hold up to `stride` blocks; rows beyond a step's
    /// sequences attend to block `scratch` alone (a block the scheduler never hands out).
    pub fn for_decode(
        rows: usize,
        stride: usize,
        scratch: u32,
        layout: PagedLayout,
        device: &Device,
    ) -> Result<Self> {
        ensure((scratch as usize) < layout.blocks && stride > 0, "paged_plan", || {
            format!("scratch block {scratch} of {}, stride {stride}", layout.blocks)
        })?;
        let table = vec![scratch];
        let pad = vec![PagedRows { n: 1, pos0: 0, table: &table }; rows];
        let mut plan = PagedPlan::new(&pad, layout, device)?;
        plan.decode = Some((stride, scratch));
        #[cfg(feature = "cuda")]
        if let Device::Cuda(ordinal) = device {
            let gpu = crate::cuda::gpu(*ordinal)?;
            plan.device = Some(crate::cuda::paged_decode_plan(&gpu, rows, stride, scratch)?);
        }
        Ok(plan)
    }

    /// Loads one decode step's sequences (each of one row, at most the plan's rows, tables of
    /// at most its stride) into a [`PagedPlan::for_decode`] plan; the rows after them are
    /// padding on the scratch block.
    pub fn load_decode(&mut self, seqs: &[PagedRows]) -> Result<()> {
        const OP: &str = "paged_plan";
        let (stride, scratch) = self
            .decode
            .ok_or_else(|| crate::Error::Device("load_decode: not a decode plan".into()))?;
        ensure(
            seqs.len() <= self.rows && seqs.iter().all(|s| s.n == 1 && s.table.len() <= stride),
            OP,
            || format!("{} sequences for {} decode rows of stride {stride}", seqs.len(), self.rows),
        )?;
        cpu::attention::check_paged(OP, seqs, 0, self.layout)?;
        self.seqs = seqs.iter().map(|s| (1, s.pos0, s.table.to_vec())).collect();
        self.seqs.resize(self.rows, (1, 0, vec![scratch]));
        #[cfg(feature = "cuda")]
        if let Some(d) = &mut self.device {
            crate::cuda::load_decode_plan(d, seqs)?;
        }
        Ok(())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The plan's sequences: rows, first position and block table.
    pub fn seqs(&self) -> Vec<PagedRows<'_>> {
        self.seqs.iter().map(|(n, pos0, table)| PagedRows { n: *n, pos0: *pos0, table }).collect()
    }
}

/// The CPU's key writes: each key row into its tile's column (`key_rows` are the rows the key
/// would take untransposed, slot 0 of a tile marking its start).
fn write_keys_transposed(cache: &mut Tensor, k: &Tensor, key_rows: &[u32], d: usize) {
    fn write<T: Copy>(cache: &mut [T], k: &[T], key_rows: &[u32], d: usize) {
        let kb = cpu::KEY_BLOCK;
        for (i, &r) in key_rows.iter().enumerate() {
            let (r, slot) = (r as usize, r as usize % kb);
            let tile = (r - slot) * d;
            for (x, &value) in k[i * d..][..d].iter().enumerate() {
                cache[tile + x * kb + slot] = value;
            }
        }
    }
    match (&mut cache.storage, &k.storage) {
        (Storage::F32(c), Storage::F32(k)) => write(c, k, key_rows, d),
        (Storage::BF16(c), Storage::BF16(k)) => write(c, k, key_rows, d),
        _ => unreachable!("host float tensors of one dtype (checked)"),
    }
}

/// Stores this step's keys and values (`k`, `v` `[rows × kv_heads × head_dim]`, the plan's
/// rows) into the paged `cache` (`[layout.rows() × head_dim]`, their dtype) at each row's
/// position of `layer`.
pub fn paged_kv_write(
    cache: &mut Tensor,
    k: &Tensor,
    v: &Tensor,
    layer: usize,
    plan: &PagedPlan,
) -> Result<()> {
    const OP: &str = "paged_kv_write";
    let device = same_device(OP, &[cache, k, v])?;
    floats_only(OP, &[cache, k, v])?;
    let layout = plan.layout;
    let (rows, kvh, d) = (plan.rows, layout.kv_heads, layout.head_dim);
    ensure(
        layer < layout.layers
            && k.dtype() == cache.dtype()
            && v.dtype() == cache.dtype()
            && k.len() == rows * kvh * d
            && v.len() == k.len()
            && cache.len() == layout.rows() * d,
        OP,
        || {
            format!(
                "layer {layer}: k {:?} v {:?} {} into cache {:?} {} for {rows} rows",
                k.shape,
                v.shape,
                k.dtype(),
                cache.shape,
                cache.dtype()
            )
        },
    )?;
    match device {
        Device::Cpu => {
            let mut key_rows = Vec::with_capacity(rows * kvh);
            for s in plan.seqs() {
                for p in s.pos0..s.pos0 + s.n {
                    let block = s.table[p / cpu::KEY_BLOCK];
                    for g in 0..kvh {
                        key_rows.push(layout.key_row(block, layer, g, p % cpu::KEY_BLOCK) as u32);
                    }
                }
            }
            let value_rows: Vec<u32> =
                key_rows.iter().map(|&r| r + layout.value_offset() as u32).collect();
            write_keys_transposed(cache, k, &key_rows, d);
            super::elementwise::scatter_flat(cache, v, &value_rows, d)
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let plan = plan.device.as_ref().ok_or_else(|| {
                crate::Error::Device("paged_kv_write: the plan was made for the CPU".into())
            })?;
            let Storage::Cuda(buffer) = &mut cache.storage else { unreachable!("on a device") };
            let gpu = buffer.gpu.clone();
            crate::cuda::paged_kv_write(
                &gpu,
                &mut buffer.data,
                device_data(k),
                device_data(v),
                plan,
                layer,
                layout,
            )
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// A decode step's attention inputs from the stacked q/k/v product `qkv` `[rows × (q_heads +
/// 2·kv_heads)·head_dim]` of the plan's rows: the keys and values written to `cache` as
/// [`paged_kv_write`] writes them, and the queries returned, the keys and queries first
/// normalized per head by `norms` (Qwen3's q and k norm weights, as
/// [`super::qk_norm_rope`]) and rotated by `cos`/`sin` `[rows × head_dim/2]`. The bits of
/// [`super::split_columns`], the norms, [`super::rope`] and [`paged_kv_write`]; on CUDA in
/// bf16 one launch.
#[allow(clippy::too_many_arguments)]
pub fn qkv_rope_kv_write(
    qkv: &Tensor,
    norms: Option<(&Tensor, &Tensor)>,
    eps: f32,
    cos: &Tensor,
    sin: &Tensor,
    cache: &mut Tensor,
    layer: usize,
    plan: &PagedPlan,
    q_heads: usize,
) -> Result<Tensor> {
    const OP: &str = "qkv_rope_kv_write";
    let device = same_device(OP, &[qkv, cos, sin, cache])?;
    let layout = plan.layout;
    let (rows, kvh, d) = (plan.rows, layout.kv_heads, layout.head_dim);
    let widths = [q_heads * d, kvh * d, kvh * d];
    ensure(qkv.shape == [rows, widths.iter().sum()], OP, || {
        format!("qkv {:?} for {rows} rows of {q_heads} + 2·{kvh} heads of {d}", qkv.shape)
    })?;
    let fused = cfg!(feature = "cuda")
        && device != Device::Cpu
        && qkv.dtype() == DType::BF16
        && cache.dtype() == DType::BF16
        && d.is_multiple_of(4)
        && d <= 1024
        && layer < layout.layers;
    if !fused {
        let [q, k, v]: [Tensor; 3] = super::split_columns(qkv, &widths)?
            .try_into()
            .unwrap_or_else(|_| unreachable!("three widths, three parts"));
        let (q, k) = match norms {
            Some((q_w, k_w)) => {
                let [q, _, k, _] = super::qk_norm_rope(&q, &k, q_w, k_w, eps, cos, sin)?;
                (q, k)
            }
            None => {
                let turn = |x: Tensor, heads: usize| -> Result<Tensor> {
                    let width = x.shape[1];
                    let r = super::rope(&x.reshape(&[rows, heads, d])?, cos, sin, false)?;
                    r.reshape(&[rows, width])
                };
                (turn(q, q_heads)?, turn(k, kvh)?)
            }
        };
        paged_kv_write(cache, &k, &v, layer, plan)?;
        return Ok(q);
    }
    #[cfg(feature = "cuda")]
    {
        let table = [rows, d / 2];
        ensure(cos.shape == table && sin.shape == table, OP, || {
            format!("cos {:?} and sin {:?} must be {table:?}", cos.shape, sin.shape)
        })?;
        if let Some((q_w, k_w)) = norms {
            ensure(q_w.shape == [d] && k_w.shape == [d], OP, || {
                format!("q_w {:?} and k_w {:?} must be [{d}]", q_w.shape, k_w.shape)
            })?;
        }
        let dev_plan = plan
            .device
            .as_ref()
            .ok_or_else(|| crate::Error::Device(format!("{OP}: the plan was made for the CPU")))?;
        let Storage::Cuda(buffer) = &mut cache.storage else { unreachable!("on a device") };
        let gpu = buffer.gpu.clone();
        let crate::cuda::DeviceData::BF16(cache_data) = &mut buffer.data else {
            unreachable!("the cache is bf16")
        };
        let q = crate::cuda::qkv_rope_kv_write(
            &gpu,
            super::bf16_data(qkv),
            norms.map(|(q_w, k_w)| (device_data(q_w), device_data(k_w))),
            (device_data(cos), device_data(sin)),
            cache_data,
            (dev_plan.slots(), layer, layout.layers),
            rows,
            (q_heads, kvh, d),
            eps,
        )?;
        Ok(Tensor { shape: vec![rows, q_heads * d], storage: Storage::Cuda(q) })
    }
    #[cfg(not(feature = "cuda"))]
    unreachable!("fused only with the cuda feature")
}

/// Whether [`paged_attention`] runs on `device` in `dtype` at `head_dim` (any on the CPU; bf16
/// at multiples of 16 up to 256 on CUDA), so a caller can skip the decode path where it cannot.
pub fn paged_attention_runs(device: &Device, dtype: DType, head_dim: usize) -> bool {
    match device {
        Device::Cpu => true,
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => dtype == DType::BF16 && crate::cuda::mma_head_dim(head_dim),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            let _ = (dtype, head_dim);
            false
        }
    }
}

/// Attention of the plan's query rows (`q` `[rows × q_heads × head_dim]`) over the paged
/// `cache` of `layer`, this step's keys and values already written: `(out, lse)` as
/// [`attention_forward`] gives them, with the same bits per row. On CUDA it runs in bf16 at
/// head sizes that are multiples of 16 up to 256 (the tensor-core forward reading key blocks
/// through the block tables).
pub fn paged_attention(
    q: &Tensor,
    cache: &Tensor,
    layer: usize,
    plan: &PagedPlan,
    q_heads: usize,
    scores: &cpu::Scores,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "paged_attention";
    let device = same_device(OP, &[q, cache])?;
    floats_only(OP, &[q, cache])?;
    let (layout, rows) = (plan.layout, plan.rows);
    let d = layout.head_dim;
    scores.check(OP)?;
    ensure(
        layer < layout.layers
            && q.dtype() == cache.dtype()
            && q.len() == rows * q_heads * d
            && cache.len() == layout.rows() * d
            && layout.kv_heads > 0
            && q_heads.is_multiple_of(layout.kv_heads),
        OP,
        || {
            format!(
                "layer {layer}: q {:?} {} with {q_heads} heads, cache {:?} {} for {rows} rows of \
                 {layout:?}",
                q.shape,
                q.dtype(),
                cache.shape,
                cache.dtype()
            )
        },
    )?;
    let lse_shape = vec![rows, q_heads];
    match device {
        Device::Cpu => {
            let (mut out, mut lse) = (host_out(q.len()), host_out(rows * q_heads));
            cpu::paged_attention_forward(
                &mut out,
                &mut lse,
                &host_f32(q),
                &host_f32(cache),
                layer,
                &plan.seqs(),
                q_heads,
                layout,
                scores,
            )?;
            Ok((
                host_tensor(q.shape.clone(), out, q.dtype()),
                host_tensor(lse_shape, lse, DType::F32),
            ))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let dp = plan.device.as_ref().ok_or_else(|| {
                crate::Error::Device("paged_attention: the plan was made for the CPU".into())
            })?;
            let Storage::Cuda(buffer) = &q.storage else { unreachable!("a device tensor") };
            let (out, lse) = crate::cuda::paged_attention(
                &buffer.gpu,
                device_data(q),
                device_data(cache),
                layer,
                dp,
                q_heads,
                layout,
                scores,
            )?;
            Ok((
                Tensor { shape: q.shape.clone(), storage: Storage::Cuda(out) },
                Tensor { shape: lse_shape, storage: Storage::Cuda(lse) },
            ))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, max_rel_err, round_out, tensor};

    /// [`max_rel_err`] against a scale of at least 1 (the inputs' order): a gradient that is
    /// zero up to rounding (one token sees only itself, so dq cancels) is then not judged
    /// relative to its own noise.
    fn err_vs_unit(what: &str, got: &[f32], want: &[f32]) -> f64 {
        let scale = want.iter().fold(0f64, |m, w| m.max(f64::from(*w).abs()));
        max_rel_err(what, got, want) * scale.max(1e-30) / scale.max(1.0)
    }
    use crate::rng::Rng;

    /// `shape` with its scores scaled by `scale`, capped at `cap`, over a `window`.
    fn scored(
        shape: AttentionShape,
        scale: f32,
        cap: Option<f32>,
        window: Option<usize>,
    ) -> AttentionShape {
        AttentionShape { scores: cpu::Scores { scale, softcap: cap, window }, ..shape }
    }

    /// Packings with sequences shorter and longer than a key block, one empty, and lengths that
    /// are not multiples of the tiles; sliding windows (shorter than some sequences, longer
    /// than a key block or not) and soft-capped scores.
    fn cases() -> Vec<(Vec<usize>, AttentionShape)> {
        let s = AttentionShape::new;
        vec![
            (vec![0, 5, 5, 70, 200], scored(s(4, 2, 16), 0.2, Some(3.0), Some(70))),
            (vec![0, 37, 170], scored(s(8, 4, 128), 0.09, None, Some(33))),
            (vec![0, 300], scored(s(2, 1, 256), 0.2, Some(1.5), Some(130))),
            (vec![0, 90, 91], scored(s(4, 2, 48), 0.15, Some(2.0), None)),
            (vec![0, 1], s(1, 1, 4)),
            (vec![0, 5, 5, 70, 200], s(4, 2, 16)),
            (vec![0, 64, 129, 130], s(6, 3, 64)),
            (vec![0, 300], s(4, 1, 100)),
            (vec![0, 37, 170], s(16, 8, 128)),
            // Gemma's 256 and the other sizes of the tensor-core kernels.
            (vec![0, 3, 90], s(4, 2, 80)),
            (vec![0, 70, 75], s(2, 1, 256)),
        ]
    }

    fn inputs(rng: &mut Rng, cu: &[usize], s: AttentionShape) -> [Vec<f32>; 4] {
        let t = *cu.last().unwrap();
        [
            rng.vec(t * s.q_heads * s.head_dim, 1.5),
            rng.vec(t * s.kv_heads * s.head_dim, 1.5),
            rng.vec(t * s.kv_heads * s.head_dim, 1.0),
            rng.vec(t * s.q_heads * s.head_dim, 1.0),
        ]
    }

    #[test]
    fn attention_matches_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(51);
        for (cu, s) in cases() {
            let [q, k, v, d_out] = inputs(&mut rng, &cu, s);
            for dtype in [DType::F32, DType::BF16] {
                // The reference sees the inputs as the device does (rounded to bf16).
                let r = |x: &[f32]| round_out(x, dtype);
                let (qr, kr, vr, dr) = (r(&q), r(&k), r(&v), r(&d_out));
                let t = cu.last().copied().unwrap();
                let mut out = vec![0.0; q.len()];
                let mut lse = vec![0.0; t * s.q_heads];
                cpu::attention_forward(&mut out, &mut lse, &qr, &kr, &vr, &cu, s).unwrap();
                let outr = r(&out);
                let (mut dq, mut dk, mut dv) =
                    (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
                cpu::attention_backward(
                    &mut dq, &mut dk, &mut dv, &dr, &qr, &kr, &vr, &outr, &lse, &cu, s,
                )
                .unwrap();
                // f32: different exp() and FMA contraction; bf16: outputs rounded once more.
                let tol = if dtype == DType::F32 { 2e-5 } else { 1.5e-2 };
                for device in devices() {
                    let dev = |x: &[f32], n: usize| tensor(&[t, n * s.head_dim], x, dtype, &device);
                    let (qt, kt, vt) =
                        (dev(&q, s.q_heads), dev(&k, s.kv_heads), dev(&v, s.kv_heads));
                    let (ot, lt) = attention_forward(&qt, &kt, &vt, &cu, s).unwrap();
                    let what =
                        |name: &str| format!("{device} {dtype} attention {name} {cu:?} {s:?}");
                    for (name, got, want) in [("out", &ot, &out), ("lse", &lt, &lse)] {
                        let want =
                            if name == "out" { round_out(want, dtype) } else { want.clone() };
                        let err = err_vs_unit(&what(name), &got.to_vec_f32().unwrap(), &want);
                        assert!(err <= tol, "{}: {err:.3e}", what(name));
                    }
                    // The backward from the reference's own forward, so only its error counts.
                    let (ot, lt) =
                        (dev(&out, s.q_heads), tensor(&[t, s.q_heads], &lse, DType::F32, &device));
                    let dt = dev(&d_out, s.q_heads);
                    let (gq, gk, gv) =
                        attention_backward(&dt, &qt, &kt, &vt, &ot, &lt, &cu, s).unwrap();
                    for (name, got, want) in [("dq", &gq, &dq), ("dk", &gk, &dk), ("dv", &gv, &dv)]
                    {
                        let err = err_vs_unit(
                            &what(name),
                            &got.to_vec_f32().unwrap(),
                            &round_out(want, dtype),
                        );
                        assert!(err <= tol, "{}: {err:.3e}", what(name));
                    }
                }
            }
        }
    }

    /// A sequence's outputs have the same bits alone, packed first or last, beside sequences of
    /// any length; the backward gives the same bits run after run.
    #[test]
    fn attention_is_batch_invariant_and_deterministic_on_every_device() {
        let mut rng = Rng::new(52);
        let plain = AttentionShape::new(8, 2, 64);
        for s in [plain, scored(plain, 0.1, Some(2.5), Some(40))] {
            batch_invariant_and_deterministic(&mut rng, s);
        }
    }

    fn batch_invariant_and_deterministic(rng: &mut Rng, s: AttentionShape) {
        let lens = [150usize, 1, 64, 77];
        let seqs: Vec<[Vec<f32>; 4]> = lens.iter().map(|&n| inputs(rng, &[0, n], s)).collect();
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                let run = |order: &[usize]| {
                    let mut cu = vec![0];
                    let mut parts: [Vec<f32>; 4] = Default::default();
                    for &i in order {
                        cu.push(cu.last().unwrap() + lens[i]);
                        for (p, x) in parts.iter_mut().zip(&seqs[i]) {
                            p.extend_from_slice(x);
                        }
                    }
                    let t = *cu.last().unwrap();
                    let dev = |x: &[f32], n: usize| tensor(&[t, n * s.head_dim], x, dtype, &device);
                    let (q, k, v, d) = (
                        dev(&parts[0], 8),
                        dev(&parts[1], 2),
                        dev(&parts[2], 2),
                        dev(&parts[3], 8),
                    );
                    let (o, l) = attention_forward(&q, &k, &v, &cu, s).unwrap();
                    let (dq, dk, dv) = attention_backward(&d, &q, &k, &v, &o, &l, &cu, s).unwrap();
                    let v = |t: &Tensor| t.to_vec_f32().unwrap();
                    (cu, [v(&o), v(&l), v(&dq), v(&dk), v(&dv)])
                };
                // Rows of sequence `i` in a run, per output (lse has one value per head).
                let rows = |cu: &[usize], order: &[usize], i: usize, out: &[Vec<f32>; 5]| {
                    let at = order.iter().position(|&x| x == i).unwrap();
                    let (a, b) = (cu[at], cu[at + 1]);
                    let widths = [8 * 64, 8, 8 * 64, 2 * 64, 2 * 64];
                    out.iter()
                        .zip(widths)
                        .map(|(o, w)| o[a * w..b * w].to_vec())
                        .collect::<Vec<_>>()
                };
                let alone: Vec<_> = (0..lens.len())
                    .map(|i| {
                        let (cu, out) = run(&[i]);
                        rows(&cu, &[i], i, &out)
                    })
                    .collect();
                for order in [vec![0, 1, 2, 3], vec![3, 2, 1, 0], vec![2, 0]] {
                    let (cu, out) = run(&order);
                    assert_eq!(run(&order).1, out, "{device} {dtype} {s:?}: two runs differ");
                    for &i in &order {
                        assert!(
                            rows(&cu, &order, i, &out) == alone[i],
                            "{device} {dtype} {s:?}: sequence {i} in {order:?} differs"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn bad_attention_operands_are_errors() {
        let dev = Device::Cpu;
        let s = AttentionShape::new(4, 3, 2);
        let q = tensor(&[2, 8], &[0.5; 16], DType::F32, &dev);
        let k = tensor(&[2, 6], &[0.5; 12], DType::F32, &dev);
        let err = attention_forward(&q, &k, &k, &[0, 2], s).unwrap_err().to_string();
        assert!(err.contains("not a multiple"), "{err}");
        let s = AttentionShape::new(4, 2, 2);
        let k = tensor(&[2, 4], &[0.5; 8], DType::F32, &dev);
        assert!(attention_forward(&q, &k, &k, &[0, 3], s).is_err());
        let kb = tensor(&[2, 4], &[0.5; 8], DType::BF16, &dev);
        assert!(
            attention_forward(&q, &kb, &kb, &[0, 2], s)
                .unwrap_err()
                .to_string()
                .contains("one dtype")
        );
    }

    /// The paged attention over a cache filled in pieces (a prompt, then chunks, then decode
    /// rows) gives each row the bits of the packed forward over the whole sequences: on the CPU
    /// in f32 and bf16, on CUDA in bf16 (its tensor-core kernel), with block tables out of
    /// order and shared by no one.
    #[test]
    fn paged_attention_has_the_bits_of_the_packed_forward() {
        let mut rng = Rng::new(77);
        let lens = [1usize, 70, 129, 64, 200];
        let cu: Vec<usize> = std::iter::once(0)
            .chain(lens.iter().scan(0, |a, &n| {
                *a += n;
                Some(*a)
            }))
            .collect();
        let mut shapes: Vec<AttentionShape> =
            [16usize, 64, 80, 128, 256].iter().map(|&d| AttentionShape::new(6, 2, d)).collect();
        // Sliding windows shorter than most sequences (a key block's length or not), soft-capped
        // scores: Gemma's layers.
        shapes.push(scored(AttentionShape::new(6, 2, 16), 0.2, Some(3.0), Some(70)));
        shapes.push(scored(AttentionShape::new(6, 2, 256), 0.06, None, Some(64)));
        shapes.push(scored(AttentionShape::new(6, 2, 32), 0.1, Some(2.0), Some(5)));
        for s in shapes {
            let d = s.head_dim;
            let [q, k, v, _] = inputs(&mut rng, &cu, s);
            let t = *cu.last().unwrap();
            let blocks_of = |n: usize| n.div_ceil(cpu::KEY_BLOCK);
            let total: usize = lens.iter().map(|&n| blocks_of(n)).sum::<usize>() + 3;
            let layout = PagedLayout { blocks: total, layers: 2, kv_heads: 2, head_dim: d };
            // Block ids handed out in a scrambled order.
            let mut ids: Vec<u32> = (0..total as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.below(i + 1));
            }
            let mut tables = Vec::new();
            for &n in &lens {
                tables.push(ids.drain(..blocks_of(n)).collect::<Vec<u32>>());
            }
            // Each sequence cut into steps: [0, a), [a, b), then one row at a time.
            let steps: Vec<Vec<(usize, usize)>> = lens
                .iter()
                .map(|&n| {
                    let (a, b) = (n / 2, n.saturating_sub(2).max(n / 2));
                    let mut v = vec![(0, a), (a, b)];
                    v.extend((b..n).map(|p| (p, p + 1)));
                    v.retain(|&(x, y)| y > x);
                    v
                })
                .collect();
            for device in devices() {
                for dtype in [DType::F32, DType::BF16] {
                    if device != Device::Cpu && dtype == DType::F32 {
                        continue; // CUDA's paged kernel is the bf16 tensor-core one
                    }
                    let what = format!("{device} {dtype} d{d} {:?}", s.scores);
                    let dev = |x: &[f32], n: usize, rows: usize| {
                        tensor(&[rows, n * d], x, dtype, &device)
                    };
                    let (want, want_lse) =
                        attention_forward(&dev(&q, 6, t), &dev(&k, 2, t), &dev(&v, 2, t), &cu, s)
                            .unwrap();
                    let (want, want_lse) =
                        (want.to_vec_f32().unwrap(), want_lse.to_vec_f32().unwrap());
                    let mut cache =
                        tensor(&[layout.rows(), d], &vec![0.5; layout.rows() * d], dtype, &device);
                    let rounds = steps.iter().map(Vec::len).max().unwrap();
                    for round in 0..rounds {
                        // One call per round over every sequence with a step left.
                        let seqs: Vec<(usize, PagedRows)> = (0..lens.len())
                            .filter_map(|i| {
                                steps[i].get(round).map(|&(a, b)| {
                                    (i, PagedRows { n: b - a, pos0: a, table: &tables[i] })
                                })
                            })
                            .collect();
                        let gather = |x: &[f32], heads: usize| -> Vec<f32> {
                            seqs.iter()
                                .flat_map(|(i, r)| {
                                    let at = (cu[*i] + r.pos0) * heads * d;
                                    x[at..at + r.n * heads * d].to_vec()
                                })
                                .collect()
                        };
                        let rows: usize = seqs.iter().map(|(_, r)| r.n).sum();
                        let paged: Vec<PagedRows> = seqs.iter().map(|(_, r)| *r).collect();
                        let plan = PagedPlan::new(&paged, layout, &device).unwrap();
                        for layer in [1, 0] {
                            let (kt, vt) =
                                (dev(&gather(&k, 2), 2, rows), dev(&gather(&v, 2), 2, rows));
                            paged_kv_write(&mut cache, &kt, &vt, layer, &plan).unwrap();
                        }
                        let qt = dev(&gather(&q, 6), 6, rows);
                        let (out, lse) =
                            paged_attention(&qt, &cache, 0, &plan, 6, &s.scores).unwrap();
                        let (out, lse) = (out.to_vec_f32().unwrap(), lse.to_vec_f32().unwrap());
                        let mut row = 0;
                        for (i, r) in &seqs {
                            for p in r.pos0..r.pos0 + r.n {
                                let (g, w) = (row * 6, (cu[*i] + p) * 6);
                                assert!(
                                    out[g * d..(g + 6) * d] == want[w * d..(w + 6) * d]
                                        && lse[g..g + 6] == want_lse[w..w + 6],
                                    "{what}: sequence {i} position {p} (round {round})"
                                );
                                row += 1;
                            }
                        }
                    }
                }
            }
        }
    }

    /// The decode step's fused q/k/v preparation writes the cache and returns the queries with
    /// the bits of the split, the q/k norms (or none) with the rotation, and paged_kv_write: on
    /// every device, for Qwen3-like (norms, d 128) and Llama-like (none, d 64) shapes, decode
    /// rows and a prefill chunk in one plan, layer 1 of 2 (the cache's other bytes untouched).
    #[test]
    fn qkv_rope_kv_write_has_the_bits_of_the_separate_ops() {
        let mut rng = Rng::new(78);
        let eps = 1e-6;
        for (q_heads, kv_heads, d, norms) in [(16usize, 8usize, 128usize, true), (9, 3, 64, false)]
        {
            let layout = PagedLayout { blocks: 6, layers: 2, kv_heads, head_dim: d };
            let tables: [Vec<u32>; 3] = [vec![4, 1], vec![0], vec![5, 2, 3]];
            // A decode row at position 70, a 5-row chunk at 10, a decode row at 130.
            let seqs = [
                PagedRows { n: 1, pos0: 70, table: &tables[0] },
                PagedRows { n: 5, pos0: 10, table: &tables[1] },
                PagedRows { n: 1, pos0: 130, table: &tables[2] },
            ];
            let rows = 7;
            let positions: Vec<u32> = [70, 10, 11, 12, 13, 14, 130].to_vec();
            let (cos, sin) = cpu::rope_tables(&positions, &cpu::rope_inv_freq(d, 1e4), 1.0);
            let width = (q_heads + 2 * kv_heads) * d;
            let qkv = rng.vec(rows * width, 2.0);
            let fill = rng.vec(layout.rows() * d, 1.0);
            let w =
                |rng: &mut Rng| -> Vec<f32> { rng.vec(d, 0.5).iter().map(|x| 1.0 + x).collect() };
            let (q_w, k_w) = (w(&mut rng), w(&mut rng));
            for device in devices() {
                for dtype in [DType::F32, DType::BF16] {
                    let what = format!("{device} {dtype} {q_heads}/{kv_heads}×{d}");
                    let plan = PagedPlan::new(&seqs, layout, &device).unwrap();
                    let table = |v: &[f32]| tensor(&[rows, d / 2], v, DType::F32, &device);
                    let (cos, sin) = (table(&cos), table(&sin));
                    let weights = (
                        tensor(&[d], &q_w, DType::F32, &device),
                        tensor(&[d], &k_w, DType::F32, &device),
                    );
                    let norm = norms.then_some((&weights.0, &weights.1));
                    let qkv = tensor(&[rows, width], &qkv, dtype, &device);
                    let mut cache = tensor(&[layout.rows(), d], &fill, dtype, &device);
                    let q = qkv_rope_kv_write(
                        &qkv, norm, eps, &cos, &sin, &mut cache, 1, &plan, q_heads,
                    )
                    .unwrap();
                    // The separate ops.
                    let mut want_cache = tensor(&[layout.rows(), d], &fill, dtype, &device);
                    let parts =
                        crate::ops::split_columns(&qkv, &[q_heads * d, kv_heads * d, kv_heads * d])
                            .unwrap();
                    let (want_q, k) = if norms {
                        let [q, _, k, _] = crate::ops::qk_norm_rope(
                            &parts[0], &parts[1], &weights.0, &weights.1, eps, &cos, &sin,
                        )
                        .unwrap();
                        (q, k)
                    } else {
                        let turn = |x: &Tensor, heads: usize| {
                            let x3 =
                                tensor(&[rows, heads, d], &x.to_vec_f32().unwrap(), dtype, &device);
                            let r = crate::ops::rope(&x3, &cos, &sin, false).unwrap();
                            r.reshape(&[rows, heads * d]).unwrap()
                        };
                        (turn(&parts[0], q_heads), turn(&parts[1], kv_heads))
                    };
                    paged_kv_write(&mut want_cache, &k, &parts[2], 1, &plan).unwrap();
                    let bits = |t: &Tensor| -> Vec<u32> {
                        t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
                    };
                    assert_eq!((q.shape(), q.dtype()), (want_q.shape(), want_q.dtype()), "{what}");
                    assert!(bits(&q) == bits(&want_q), "{what}: queries differ");
                    assert!(bits(&cache) == bits(&want_cache), "{what}: caches differ");
                    assert!(
                        bits(&cache) != bits(&tensor(&[layout.rows(), d], &fill, dtype, &device))
                    );
                }
            }
        }
    }
}
