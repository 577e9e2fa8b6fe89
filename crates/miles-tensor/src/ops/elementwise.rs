//! The decoder's element-wise and gather ops: SwiGLU, RoPE, the residual add, the token
//! embedding and its deterministic backward. f32 or bf16 values, f32 arithmetic.

use super::{dtype_is, floats_only, host_f32, host_out, host_tensor, same_device};
use crate::cpu;
use crate::tensor::Storage;
use crate::{DType, Device, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::device_data;

/// The GPU of a device tensor.
#[cfg(feature = "cuda")]
fn gpu_of(t: &Tensor) -> &std::sync::Arc<crate::cuda::Gpu> {
    match &t.storage {
        Storage::Cuda(buffer) => &buffer.gpu,
        _ => unreachable!("gpu_of a host tensor"),
    }
}

#[cfg(feature = "cuda")]
fn on_device(shape: Vec<usize>, buffer: crate::cuda::Buffer) -> Tensor {
    Tensor { shape, storage: Storage::Cuda(buffer) }
}

fn same_shape(op: &'static str, tensors: &[&Tensor]) -> Result<()> {
    let first = &tensors[0].shape;
    ensure(tensors.iter().all(|t| &t.shape == first), op, || {
        let shapes: Vec<String> = tensors.iter().map(|t| format!("{:?}", t.shape)).collect();
        format!("operands must share a shape: {}", shapes.join(", "))
    })?;
    let dtype = tensors[0].dtype();
    match tensors.iter().find(|t| t.dtype() != dtype) {
        Some(t) => dtype_is(op, "every operand", t, dtype),
        None => Ok(()),
    }
}

/// `h = act(gate) · up` elementwise (`act`: SiLU for SwiGLU, tanh GELU for GeGLU).
pub fn glu_forward(gate: &Tensor, up: &Tensor, act: cpu::Gate) -> Result<Tensor> {
    const OP: &str = "glu";
    let device = same_device(OP, &[gate, up])?;
    floats_only(OP, &[gate, up])?;
    same_shape(OP, &[gate, up])?;
    match device {
        Device::Cpu => {
            let mut h = host_out(gate.len());
            cpu::glu_forward(&mut h, &host_f32(gate), &host_f32(up), act)?;
            Ok(host_tensor(gate.shape.clone(), h, gate.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let (g, u) = (device_data(gate), device_data(up));
            let h = crate::cuda::glu_forward(gpu_of(gate), g, u, gate.len(), act)?;
            Ok(on_device(gate.shape.clone(), h))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `h = silu(gate) · up`: [`glu_forward`] with SiLU.
pub fn swiglu_forward(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    glu_forward(gate, up, cpu::Gate::Silu)
}

/// [`swiglu_forward`] of the two halves of the stacked gate/up product `gu` `[rows × 2·inter]`
/// (the gate's columns first): `[rows × inter]`, the bits of [`split_columns`] then
/// [`swiglu_forward`], without the split on CUDA.
pub fn swiglu_stacked(gu: &Tensor) -> Result<Tensor> {
    const OP: &str = "swiglu_stacked";
    floats_only(OP, &[gu])?;
    ensure(gu.shape.len() == 2 && gu.shape[1].is_multiple_of(2), OP, || {
        format!("gu {:?} must be [rows × 2·inter]", gu.shape)
    })?;
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
    let (rows, inter) = (gu.shape[0], gu.shape[1] / 2);
    match &gu.storage {
        #[cfg(feature = "cuda")]
        Storage::Cuda(buffer) => {
            let h = crate::cuda::swiglu_stacked(&buffer.gpu, &buffer.data, rows, inter)?;
            Ok(on_device(vec![rows, inter], h))
        }
        _ => {
            let [gate, up]: [Tensor; 2] = split_columns(gu, &[inter, inter])?
                .try_into()
                .unwrap_or_else(|_| unreachable!("two widths, two parts"));
            swiglu_forward(&gate, &up)
        }
    }
}

/// Gradients of [`glu_forward`] with respect to `gate` and `up`.
pub fn glu_backward(
    dh: &Tensor,
    gate: &Tensor,
    up: &Tensor,
    act: cpu::Gate,
) -> Result<(Tensor, Tensor)> {
    const OP: &str = "glu_backward";
    let device = same_device(OP, &[dh, gate, up])?;
    floats_only(OP, &[dh, gate, up])?;
    same_shape(OP, &[dh, gate, up])?;
    let shape = gate.shape.clone();
    match device {
        Device::Cpu => {
            let (mut dg, mut du) = (host_out(gate.len()), host_out(gate.len()));
            let (d, g, u) = (host_f32(dh), host_f32(gate), host_f32(up));
            cpu::glu_backward(&mut dg, &mut du, &d, &g, &u, act)?;
            let dtype = gate.dtype();
            Ok((host_tensor(shape.clone(), dg, dtype), host_tensor(shape, du, dtype)))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let (d, g, u) = (device_data(dh), device_data(gate), device_data(up));
            let (dg, du) = crate::cuda::glu_backward(gpu_of(gate), d, g, u, gate.len(), act)?;
            Ok((on_device(shape.clone(), dg), on_device(shape, du)))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// Gradients of [`swiglu_forward`]: [`glu_backward`] with SiLU.
pub fn swiglu_backward(dh: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    glu_backward(dh, gate, up, cpu::Gate::Silu)
}

/// Rotate-half rotary embedding of `x [tokens × heads × head_dim]` with the f32 tables
/// `cos`, `sin` `[tokens × head_dim/2]` (`cpu::rope_tables`); `inverse` rotates back, which is
/// the backward of the forward rotation.
pub fn rope(x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor> {
    const OP: &str = "rope";
    let device = same_device(OP, &[x, cos, sin])?;
    floats_only(OP, &[x, cos, sin])?;
    ensure(x.shape.len() == 3 && x.shape[2].is_multiple_of(2), OP, || {
        format!("x {:?} must be [tokens × heads × head_dim], head_dim even", x.shape)
    })?;
    let (tokens, heads, head_dim) = (x.shape[0], x.shape[1], x.shape[2]);
    let table = [tokens, head_dim / 2];
    ensure(cos.shape == table && sin.shape == table, OP, || {
        format!("cos {:?} and sin {:?} must be {table:?}", cos.shape, sin.shape)
    })?;
    dtype_is(OP, "cos", cos, DType::F32)?;
    dtype_is(OP, "sin", sin, DType::F32)?;
    match device {
        Device::Cpu => {
            let mut y = host_f32(x).into_owned();
            let (c, s) = (host_f32(cos), host_f32(sin));
            if inverse {
                cpu::rope_backward(&mut y, &c, &s, heads, head_dim)?;
            } else {
                cpu::rope_forward(&mut y, &c, &s, heads, head_dim)?;
            }
            Ok(host_tensor(x.shape.clone(), y, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let sign = if inverse { -1.0 } else { 1.0 };
            let (xd, c, s) = (device_data(x), device_data(cos), device_data(sin));
            let y = crate::cuda::rope(gpu_of(x), xd, c, s, tokens, heads, head_dim, sign)?;
            Ok(on_device(x.shape.clone(), y))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `a + b` (the residual connection); `a` and `b` share shape and dtype.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    let device = same_device("add", &[a, b])?;
    floats_only("add", &[a, b])?;
    same_shape("add", &[a, b])?;
    match device {
        Device::Cpu => {
            let sum = host_f32(a).iter().zip(host_f32(b).iter()).map(|(x, y)| x + y).collect();
            Ok(host_tensor(a.shape.clone(), sum, a.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let c = crate::cuda::add(gpu_of(a), device_data(a), device_data(b), a.len())?;
            Ok(on_device(a.shape.clone(), c))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `x + bias` with the same `bias [n]` on every row of `x [rows × n]`: a linear's bias, in
/// f32 arithmetic.
pub fn add_bias(x: &Tensor, bias: &Tensor) -> Result<Tensor> {
    const OP: &str = "add_bias";
    let device = same_device(OP, &[x, bias])?;
    floats_only(OP, &[x, bias])?;
    let n = bias.len();
    ensure(
        x.shape.len() == 2 && bias.shape.len() == 1 && x.shape[1] == n && x.dtype() == bias.dtype(),
        OP,
        || format!("x {:?} and bias {:?} (of x's dtype)", x.shape, bias.shape),
    )?;
    match device {
        Device::Cpu => {
            let b = host_f32(bias);
            let out = host_f32(x)
                .chunks(n.max(1))
                .flat_map(|row| row.iter().zip(b.iter()).map(|(v, b)| v + b))
                .collect();
            Ok(host_tensor(x.shape.clone(), out, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let out =
                crate::cuda::add_bias(gpu_of(x), device_data(x), device_data(bias), x.len(), n)?;
            Ok(on_device(x.shape.clone(), out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `x · s` elementwise in f32 arithmetic, in `x`'s dtype (Gemma's embedding times √hidden,
/// and its gradient).
pub fn scale(x: &Tensor, s: f32) -> Result<Tensor> {
    floats_only("scale", &[x])?;
    match x.device() {
        Device::Cpu => {
            let out = host_f32(x).iter().map(|v| v * s).collect();
            Ok(host_tensor(x.shape.clone(), out, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let out = crate::cuda::scale(gpu_of(x), device_data(x), s, x.len())?;
            Ok(on_device(x.shape.clone(), out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `cap · tanh(x / cap)` elementwise in f32 arithmetic, in `x`'s dtype (Gemma 2's
/// soft-capped logits).
pub fn softcap(x: &Tensor, cap: f32) -> Result<Tensor> {
    floats_only("softcap", &[x])?;
    match x.device() {
        Device::Cpu => {
            let out = host_f32(x).iter().map(|v| cap * (v / cap).tanh()).collect();
            Ok(host_tensor(x.shape.clone(), out, x.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let out = crate::cuda::softcap(gpu_of(x), device_data(x), None, cap, x.len())?;
            Ok(on_device(x.shape.clone(), out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// The gradient through [`softcap`] from its output `y`: `dy · (1 − (y / cap)²)`; `dy` and
/// `y` share shape and dtype.
pub fn softcap_backward(dy: &Tensor, y: &Tensor, cap: f32) -> Result<Tensor> {
    const OP: &str = "softcap_backward";
    let device = same_device(OP, &[dy, y])?;
    floats_only(OP, &[dy, y])?;
    same_shape(OP, &[dy, y])?;
    match device {
        Device::Cpu => {
            let grad = |(d, y): (&f32, &f32)| d * (1.0 - (y / cap) * (y / cap));
            let out = host_f32(dy).iter().zip(host_f32(y).iter()).map(grad).collect();
            Ok(host_tensor(dy.shape.clone(), out, dy.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let (d, yd) = (device_data(dy), device_data(y));
            let out = crate::cuda::softcap(gpu_of(dy), yd, Some(d), cap, dy.len())?;
            Ok(on_device(dy.shape.clone(), out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// `acc[j] += Σ_r x[r][j]` over the rows of `x [rows × n]` in row order, into the f32 `acc
/// [n]`: a linear's bias gradient.
pub fn column_sums_acc(acc: &mut Tensor, x: &Tensor) -> Result<()> {
    const OP: &str = "column_sums_acc";
    same_device(OP, &[acc, x])?;
    floats_only(OP, &[x])?;
    dtype_is(OP, "acc", acc, DType::F32)?;
    let n = acc.len();
    ensure(x.shape.len() == 2 && acc.shape.len() == 1 && x.shape[1] == n, OP, || {
        format!("x {:?} into acc {:?}", x.shape, acc.shape)
    })?;
    match &mut acc.storage {
        Storage::F32(a) => {
            cpu::column_sums_acc(a, &host_f32(x));
            Ok(())
        }
        #[cfg(feature = "cuda")]
        Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(a) }) => {
            let gpu = gpu.clone();
            crate::cuda::column_sums_acc(&gpu, a, device_data(x), x.shape[0], n)
        }
        _ => unreachable!("acc is f32 (checked)"),
    }
}

/// `[vocab × hidden]` of an embedding table, checking `ids` against the vocabulary.
fn table_shape(op: &'static str, table: &Tensor, ids: &[u32]) -> Result<(usize, usize)> {
    ensure(table.shape.len() == 2, op, || {
        format!("table {:?} must be [vocab × hidden]", table.shape)
    })?;
    let (vocab, hidden) = (table.shape[0], table.shape[1]);
    match ids.iter().find(|&&id| id as usize >= vocab) {
        Some(bad) => Err(crate::Error::Shape {
            op,
            message: format!("token id {bad} is outside the vocabulary of {vocab}"),
        }),
        None => Ok((vocab, hidden)),
    }
}

/// `out[t] = table[ids[t]]`: `[tokens × hidden]` in the table's dtype. The ids come from the
/// host (they are the tokens the scheduler holds) and are checked against the vocabulary.
pub fn embedding_forward(table: &Tensor, ids: &[u32]) -> Result<Tensor> {
    floats_only("embedding", &[table])?;
    let (_, hidden) = table_shape("embedding", table, ids)?;
    let shape = vec![ids.len(), hidden];
    match table.device() {
        Device::Cpu => {
            let mut out = host_out(ids.len() * hidden);
            cpu::embedding_forward(&mut out, &host_f32(table), ids, hidden)?;
            Ok(host_tensor(shape, out, table.dtype()))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let ids: Vec<i32> = ids.iter().map(|&id| id as i32).collect();
            let ids = crate::cuda::Ids::Host(&ids);
            let out =
                crate::cuda::embedding_forward(gpu_of(table), device_data(table), ids, hidden)?;
            Ok(on_device(shape, out))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// [`embedding_forward`] with the ids in an i32 tensor on the table's device (a captured
/// graph's input). The caller guarantees they are below the vocabulary (on a device they are
/// not read back to be checked); a negative id (a sampler's none, -1) reads row 0.
pub fn embedding_forward_ids(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    const OP: &str = "embedding_ids";
    same_device(OP, &[table, ids])?;
    dtype_is(OP, "ids", ids, DType::I32)?;
    match &ids.storage {
        Storage::I32(v) => {
            let ids: Vec<u32> = v.iter().map(|&i| i.max(0) as u32).collect();
            embedding_forward(table, &ids)
        }
        #[cfg(feature = "cuda")]
        Storage::Cuda(crate::cuda::Buffer { data: crate::cuda::DeviceData::I32(d), .. }) => {
            floats_only(OP, &[table])?;
            ensure(table.shape.len() == 2, OP, || format!("table {:?}", table.shape))?;
            let hidden = table.shape[1];
            let rows = ids.len();
            let ids = crate::cuda::Ids::Device(d, rows);
            let out =
                crate::cuda::embedding_forward(gpu_of(table), device_data(table), ids, hidden)?;
            Ok(on_device(vec![rows, hidden], out))
        }
        _ => unreachable!("an i32 tensor (checked)"),
    }
}

/// The gradient of [`embedding_forward`]: `d_table [vocab × hidden]` (f32), each id's row the
/// sum of its tokens' `d_out` rows in token order. No atomics: the same bits on every run and
/// on both devices.
pub fn embedding_backward(d_out: &Tensor, ids: &[u32], vocab: usize) -> Result<Tensor> {
    const OP: &str = "embedding_backward";
    floats_only(OP, &[d_out])?;
    ensure(d_out.shape.len() == 2 && d_out.shape[0] == ids.len(), OP, || {
        format!("d_out {:?} must be [{} ids × hidden]", d_out.shape, ids.len())
    })?;
    let hidden = d_out.shape[1];
    if let Some(bad) = ids.iter().find(|&&id| id as usize >= vocab) {
        return Err(crate::Error::Shape {
            op: OP,
            message: format!("token id {bad} is outside the vocabulary of {vocab}"),
        });
    }
    let shape = vec![vocab, hidden];
    match d_out.device() {
        Device::Cpu => {
            let mut d_table = vec![0.0; vocab * hidden]; // cpu::embedding_backward adds into it
            cpu::embedding_backward(&mut d_table, &host_f32(d_out), ids, hidden)?;
            Ok(host_tensor(shape, d_table, DType::F32))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let groups = id_groups(ids);
            let d = crate::cuda::embedding_backward(
                gpu_of(d_out),
                device_data(d_out),
                &groups,
                vocab,
                hidden,
            )?;
            Ok(on_device(shape, d))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// [`embedding_backward`] added into an existing f32 gradient `d_table [vocab × hidden]` (only
/// the rows of `ids` are touched): a step's embedding gradient without a second table.
pub fn embedding_backward_acc(d_table: &mut Tensor, d_out: &Tensor, ids: &[u32]) -> Result<()> {
    const OP: &str = "embedding_backward_acc";
    same_device(OP, &[d_table, d_out])?;
    floats_only(OP, &[d_out])?;
    dtype_is(OP, "d_table", d_table, DType::F32)?;
    ensure(
        d_table.shape.len() == 2
            && d_out.shape.len() == 2
            && d_out.shape[0] == ids.len()
            && d_out.shape[1] == d_table.shape[1],
        OP,
        || {
            format!(
                "d_out {:?} for {} ids into d_table {:?}",
                d_out.shape,
                ids.len(),
                d_table.shape
            )
        },
    )?;
    table_shape(OP, d_table, ids)?;
    let hidden = d_table.shape[1];
    match &mut d_table.storage {
        Storage::F32(t) => cpu::embedding_backward(t, &host_f32(d_out), ids, hidden),
        #[cfg(feature = "cuda")]
        Storage::Cuda(crate::cuda::Buffer { gpu, data: crate::cuda::DeviceData::F32(t) }) => {
            let gpu = gpu.clone();
            crate::cuda::embedding_backward_into(
                &gpu,
                t,
                device_data(d_out),
                &id_groups(ids),
                hidden,
                true,
            )
        }
        _ => unreachable!("d_table is f32 (checked)"),
    }
}

/// `out[i] = x[rows[i]]` of a 2-D `x`: the rows the LM head reads.
pub fn gather_rows(x: &Tensor, rows: &[u32]) -> Result<Tensor> {
    ensure(
        x.shape.len() == 2 && rows.iter().all(|&r| (r as usize) < x.shape[0]),
        "gather_rows",
        || format!("rows {:?} of x {:?}", rows.iter().max(), x.shape),
    )?;
    embedding_forward(x, rows)
}

/// A mixture of experts' combine: `out[t] = Σ_j weights[t·k + j] · y[picks[t·k + j]]`,
/// `[picks / k × width]` in `y`'s dtype, each element summed in f32 in rank order `j` with
/// separately rounded products and sums (the same bits on every device). `k = 1` is a
/// gather of scaled rows.
pub fn pick_rows_sum(y: &Tensor, picks: &[u32], weights: &[f32], k: usize) -> Result<Tensor> {
    const OP: &str = "pick_rows_sum";
    floats_only(OP, &[y])?;
    let ok = y.shape.len() == 2
        && k > 0
        && picks.len() == weights.len()
        && picks.len().is_multiple_of(k)
        && picks.iter().all(|&r| (r as usize) < y.shape[0]);
    ensure(ok, OP, || {
        format!("{} picks ({} weights, k {k}) of y {:?}", picks.len(), weights.len(), y.shape)
    })?;
    let (rows, width) = (picks.len() / k, y.shape[1]);
    match &y.storage {
        #[cfg(feature = "cuda")]
        Storage::Cuda(buffer) => {
            let p: Vec<i32> = picks.iter().map(|&r| r as i32).collect();
            let out = crate::cuda::pick_rows_sum(&buffer.gpu, &buffer.data, &p, weights, k, width)?;
            Ok(on_device(vec![rows, width], out))
        }
        _ => {
            let v = host_f32(y);
            let mut out = vec![0.0f32; rows * width];
            for (t, row) in out.chunks_mut(width).enumerate() {
                for j in 0..k {
                    let (r, w) = (picks[t * k + j] as usize, weights[t * k + j]);
                    let src = &v[r * width..(r + 1) * width];
                    row.iter_mut().zip(src).for_each(|(o, x)| *o += w * x);
                }
            }
            Ok(host_tensor(vec![rows, width], out, y.dtype()))
        }
    }
}

/// `out[p] = a[p / k] · y[picks[p]]` (rows of one width), on the host: a mixture of experts'
/// gate-weight gradients.
pub fn pick_row_dots(a: &Tensor, y: &Tensor, picks: &[u32], k: usize) -> Result<Vec<f32>> {
    const OP: &str = "pick_row_dots";
    same_device(OP, &[a, y])?;
    floats_only(OP, &[a, y])?;
    let ok = a.shape.len() == 2
        && y.shape.len() == 2
        && a.shape[1] == y.shape[1]
        && a.dtype() == y.dtype()
        && k > 0
        && picks.len() == a.shape[0] * k
        && picks.iter().all(|&r| (r as usize) < y.shape[0]);
    ensure(ok, OP, || {
        format!("{} picks (k {k}) of a {:?} against y {:?}", picks.len(), a.shape, y.shape)
    })?;
    let width = a.shape[1];
    match (&a.storage, &y.storage) {
        #[cfg(feature = "cuda")]
        (Storage::Cuda(ab), Storage::Cuda(yb)) => {
            let p: Vec<i32> = picks.iter().map(|&r| r as i32).collect();
            crate::cuda::pick_row_dots(&ab.gpu, &ab.data, &yb.data, &p, k, width)
        }
        _ => {
            let (av, yv) = (host_f32(a), host_f32(y));
            Ok(picks
                .iter()
                .enumerate()
                .map(|(p, &r)| {
                    let t = p / k;
                    let x = &av[t * width..(t + 1) * width];
                    let z = &yv[r as usize * width..(r as usize + 1) * width];
                    x.iter().zip(z).map(|(u, v)| u * v).sum()
                })
                .collect())
        }
    }
}

/// `dst[rows[i]] = src[i]` for distinct `rows`; `dst` `[n × width]`, `src` `[rows × width]`,
/// one dtype.
pub fn scatter_rows(dst: &mut Tensor, src: &Tensor, rows: &[u32]) -> Result<()> {
    const OP: &str = "scatter_rows";
    same_device(OP, &[dst, src])?;
    floats_only(OP, &[dst, src])?;
    dtype_is(OP, "src", src, dst.dtype())?;
    let ok = dst.shape.len() == 2
        && src.shape.len() == 2
        && src.shape[0] == rows.len()
        && src.shape[1] == dst.shape[1]
        && rows.iter().all(|&r| (r as usize) < dst.shape[0]);
    ensure(ok, OP, || {
        format!("src {:?} into dst {:?} at {} rows", src.shape, dst.shape, rows.len())
    })?;
    // (Sorted, not a flag per row of `dst`: the KV cache copies a block at a time out of
    // millions of rows.)
    let mut sorted = rows.to_vec();
    sorted.sort_unstable();
    ensure(sorted.windows(2).all(|w| w[0] != w[1]), OP, || "rows repeat".into())?;
    let width = dst.shape[1];
    scatter_flat(dst, src, rows, width)
}

/// Rows `src..src + n` of a 2-D `t` copied over rows `dst..dst + n` (ranges apart): a paged KV
/// cache's copy on write of a block. On the CPU one memory copy; on CUDA a gather and a scatter.
pub fn copy_rows_within(t: &mut Tensor, src: usize, dst: usize, n: usize) -> Result<()> {
    const OP: &str = "copy_rows_within";
    floats_only(OP, &[t])?;
    let ok =
        t.shape.len() == 2 && src.max(dst) + n <= t.shape[0] && (src + n <= dst || dst + n <= src);
    ensure(ok, OP, || format!("rows {src}.. and {dst}.. ({n} each) of {:?}", t.shape))?;
    let width = t.shape[1];
    match &mut t.storage {
        Storage::F32(v) => v.copy_within(src * width..(src + n) * width, dst * width),
        Storage::BF16(v) => v.copy_within(src * width..(src + n) * width, dst * width),
        _ => {
            let rows = |at: usize| (at as u32..(at + n) as u32).collect::<Vec<u32>>();
            let span = gather_rows(t, &rows(src))?;
            return scatter_rows(t, &span, &rows(dst));
        }
    }
    Ok(())
}

/// `dst[rows[i]] = src[i]` over both tensors' elements seen as rows of `width` (checked by the
/// caller): the paged KV cache writes its `head_dim`-wide rows through it.
pub(super) fn scatter_flat(
    dst: &mut Tensor,
    src: &Tensor,
    rows: &[u32],
    width: usize,
) -> Result<()> {
    match &mut dst.storage {
        Storage::F32(d) => {
            let s = host_f32(src);
            for (i, &r) in rows.iter().enumerate() {
                d[r as usize * width..][..width].copy_from_slice(&s[i * width..][..width]);
            }
            Ok(())
        }
        Storage::BF16(d) => {
            let Storage::BF16(s) = &src.storage else { unreachable!("src is bf16 (checked)") };
            for (i, &r) in rows.iter().enumerate() {
                d[r as usize * width..][..width].copy_from_slice(&s[i * width..][..width]);
            }
            Ok(())
        }
        Storage::I32(_) | Storage::F8(_) => unreachable!("floats_only"),
        #[cfg(feature = "cuda")]
        Storage::Cuda(buffer) => {
            let rows: Vec<i32> = rows.iter().map(|&r| r as i32).collect();
            let gpu = buffer.gpu.clone();
            crate::cuda::scatter_rows(&gpu, &mut buffer.data, device_data(src), &rows, width)
        }
    }
}

/// The columns of `x` `[rows × Σ widths]` as two or three tensors `[rows × widths[i]]` (a fused
/// product's output split into its parts), exact copies.
pub fn split_columns(x: &Tensor, widths: &[usize]) -> Result<Vec<Tensor>> {
    const OP: &str = "split_columns";
    floats_only(OP, &[x])?;
    ensure(
        x.shape.len() == 2
            && (2..=3).contains(&widths.len())
            && widths.iter().sum::<usize>() == x.shape[1],
        OP,
        || format!("x {:?} into column widths {widths:?}", x.shape),
    )?;
    let rows = x.shape[0];
    match &x.storage {
        #[cfg(feature = "cuda")]
        Storage::Cuda(buffer) => {
            Ok(crate::cuda::split_columns(&buffer.gpu, &buffer.data, rows, widths)?
                .into_iter()
                .zip(widths)
                .map(|(b, &w)| on_device(vec![rows, w], b))
                .collect())
        }
        _ => {
            let v = host_f32(x);
            let width = x.shape[1];
            let mut at = 0;
            Ok(widths
                .iter()
                .map(|&w| {
                    let mut part = Vec::with_capacity(rows * w);
                    for row in v.chunks_exact(width.max(1)).take(rows) {
                        part.extend_from_slice(&row[at..at + w]);
                    }
                    at += w;
                    host_tensor(vec![rows, w], part, x.dtype())
                })
                .collect())
        }
    }
}

/// `parts` (one dtype, one device, equal widths) stacked by rows: `[Σ rows × width]`. Token
/// ids (i32) too.
pub fn concat_rows(parts: &[&Tensor]) -> Result<Tensor> {
    const OP: &str = "concat_rows";
    ensure(!parts.is_empty(), OP, || "no parts".into())?;
    same_device(OP, parts)?;
    if parts[0].dtype() != DType::I32 {
        floats_only(OP, parts)?;
    }
    let (dtype, width) = (parts[0].dtype(), parts[0].shape.last().copied().unwrap_or(0));
    ensure(
        parts.iter().all(|p| p.dtype() == dtype && p.shape.len() == 2 && p.shape[1] == width),
        OP,
        || {
            format!(
                "parts {:?}",
                parts.iter().map(|p| (p.shape.clone(), p.dtype())).collect::<Vec<_>>()
            )
        },
    )?;
    let rows: usize = parts.iter().map(|p| p.shape[0]).sum();
    match parts[0].device() {
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let data: Vec<&crate::cuda::DeviceData> =
                parts.iter().map(|p| device_data(p)).collect();
            Ok(on_device(vec![rows, width], crate::cuda::concat_rows(gpu_of(parts[0]), &data)?))
        }
        _ if dtype == DType::I32 => {
            let mut all = Vec::with_capacity(rows * width);
            for p in parts {
                all.extend(p.to_vec_i32()?);
            }
            Tensor::from_i32(&[rows, width], all, &Device::Cpu)
        }
        _ => {
            let mut all = Vec::with_capacity(rows * width);
            for p in parts {
                all.extend_from_slice(&host_f32(p));
            }
            Ok(host_tensor(vec![rows, width], all, dtype))
        }
    }
}

/// Each distinct id with the positions holding it, in token order (a stable sort by id).
#[cfg(feature = "cuda")]
fn id_groups(ids: &[u32]) -> crate::cuda::IdGroups {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    order.sort_by_key(|&t| ids[t]);
    let mut groups =
        crate::cuda::IdGroups { uniq: Vec::new(), offsets: vec![0], positions: Vec::new() };
    for (k, &t) in order.iter().enumerate() {
        if k > 0 && ids[order[k - 1]] != ids[t] {
            groups.offsets.push(k as i32);
        }
        if k == 0 || ids[order[k - 1]] != ids[t] {
            groups.uniq.push(ids[t] as i32);
        }
        groups.positions.push(t as i32);
    }
    if !ids.is_empty() {
        groups.offsets.push(ids.len() as i32);
    }
    groups
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::tests::{devices, max_rel_err, round_out, tensor};
    use crate::rng::Rng;

    fn dtypes() -> [DType; 2] {
        [DType::F32, DType::BF16]
    }

    /// f32 agrees to 1e-5 of the output's scale (the CPU and the GPU use different exp()); a
    /// bf16 output is rounded once more.
    fn tol(dtype: DType) -> f64 {
        if dtype == DType::F32 { 1e-5 } else { 1e-2 }
    }

    fn check(what: String, got: &Tensor, want: &[f32], dtype: DType) {
        let err = max_rel_err(&what, &got.to_vec_f32().unwrap(), &round_out(want, dtype));
        assert!(err <= tol(dtype), "{what}: max relative error {err:.3e} > {:e}", tol(dtype));
    }

    fn rounded(v: &[f32], dtype: DType) -> Vec<f32> {
        round_out(v, dtype)
    }

    #[test]
    fn gated_activations_match_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(41);
        for device in devices() {
            // 1000 takes the 4-wide kernels, the others the scalar ones.
            for &n in &[1usize, 7, 1000, 3 * 4864 + 5] {
                let (gate, up, dh) = (rng.vec(n, 4.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
                for dtype in dtypes() {
                    let (g, u, d) =
                        (rounded(&gate, dtype), rounded(&up, dtype), rounded(&dh, dtype));
                    for act in [cpu::Gate::Silu, cpu::Gate::GeluTanh] {
                        let mut h = vec![0.0; n];
                        cpu::glu_forward(&mut h, &g, &u, act).unwrap();
                        let (mut dg, mut du) = (vec![0.0; n], vec![0.0; n]);
                        cpu::glu_backward(&mut dg, &mut du, &d, &g, &u, act).unwrap();
                        let t = |v: &[f32]| tensor(&[n], v, dtype, &device);
                        let ht = glu_forward(&t(&gate), &t(&up), act).unwrap();
                        let (dgt, dut) = glu_backward(&t(&dh), &t(&gate), &t(&up), act).unwrap();
                        assert_eq!((ht.dtype(), ht.device()), (dtype, device));
                        let what = |name: &str| format!("{device} {dtype} {act:?} {name} n={n}");
                        check(what("h"), &ht, &h, dtype);
                        check(what("d_gate"), &dgt, &dg, dtype);
                        check(what("d_up"), &dut, &du, dtype);
                    }
                }
            }
        }
    }

    #[test]
    fn rope_matches_the_cpu_reference_and_inverts_on_every_device() {
        let mut rng = Rng::new(42);
        for device in devices() {
            for &(tokens, heads, head_dim) in &[(1, 1, 2), (7, 3, 64), (333, 8, 128), (5, 2, 10)] {
                let positions: Vec<u32> = (0..tokens as u32).map(|p| p * 37 % 4096).collect();
                let (cos, sin) =
                    cpu::rope_tables(&positions, &cpu::rope_inv_freq(head_dim, 1e6), 1.0);
                let x = rng.vec(tokens * heads * head_dim, 1.0);
                for dtype in dtypes() {
                    let mut want = rounded(&x, dtype);
                    cpu::rope_forward(&mut want, &cos, &sin, heads, head_dim).unwrap();
                    let shape = [tokens, heads, head_dim];
                    let xt = tensor(&shape, &x, dtype, &device);
                    let table = [tokens, head_dim / 2];
                    let (ct, st) = (
                        tensor(&table, &cos, DType::F32, &device),
                        tensor(&table, &sin, DType::F32, &device),
                    );
                    let yt = rope(&xt, &ct, &st, false).unwrap();
                    let what = format!("{device} {dtype} rope {shape:?}");
                    check(what.clone(), &yt, &want, dtype);
                    // The inverse rotation brings x back (the backward of a rotation).
                    let back = rope(&yt, &ct, &st, true).unwrap().to_vec_f32().unwrap();
                    let err = max_rel_err(&what, &back, &rounded(&x, dtype));
                    assert!(err <= 2.0 * tol(dtype), "{what}: inverse {err:.3e}");
                }
            }
        }
    }

    #[test]
    fn add_matches_the_cpu_reference_on_every_device() {
        let mut rng = Rng::new(43);
        for device in devices() {
            // 17×241 takes the scalar kernel, 16×256 the 4-wide one.
            for shape in [[17, 241], [16, 256]] {
                let n = shape[0] * shape[1];
                let (a, b) = (rng.vec(n, 1.0), rng.vec(n, 1.0));
                for dtype in dtypes() {
                    let want: Vec<f32> = rounded(&a, dtype)
                        .iter()
                        .zip(rounded(&b, dtype))
                        .map(|(x, y)| x + y)
                        .collect();
                    let c = add(
                        &tensor(&shape, &a, dtype, &device),
                        &tensor(&shape, &b, dtype, &device),
                    )
                    .unwrap();
                    assert_eq!(c.shape(), shape);
                    // The same single rounding on both devices: the same bits.
                    let got = c.to_vec_f32().unwrap();
                    assert_eq!(got, round_out(&want, dtype), "{device} {dtype} add {shape:?}");
                }
            }
        }
    }

    #[test]
    fn a_bias_and_its_gradient_have_the_cpus_bits_on_every_device() {
        let mut rng = Rng::new(47);
        for device in devices() {
            for (rows, n) in [(1, 3), (17, 241), (300, 64), (777, 130)] {
                let (x, b, g0) = (rng.vec(rows * n, 1.0), rng.vec(n, 1.0), rng.vec(n, 1.0));
                for dtype in dtypes() {
                    let (xr, br) = (rounded(&x, dtype), rounded(&b, dtype));
                    let want: Vec<f32> =
                        xr.chunks(n).flat_map(|r| r.iter().zip(&br).map(|(v, b)| v + b)).collect();
                    let y = add_bias(
                        &tensor(&[rows, n], &x, dtype, &device),
                        &tensor(&[n], &b, dtype, &device),
                    )
                    .unwrap();
                    let what = format!("{device} {dtype} add_bias {rows}×{n}");
                    assert_eq!(y.to_vec_f32().unwrap(), round_out(&want, dtype), "{what}");
                    // The gradient: runs of rows summed in row order, then the runs in order.
                    let mut want = g0.clone();
                    cpu::column_sums_acc(&mut want, &xr);
                    let mut acc = tensor(&[n], &g0, DType::F32, &device);
                    column_sums_acc(&mut acc, &tensor(&[rows, n], &x, dtype, &device)).unwrap();
                    assert_eq!(acc.to_vec_f32().unwrap(), want, "{what}: column sums");
                }
            }
            let x = tensor(&[2, 3], &[1.0; 6], DType::F32, &device);
            let e = add_bias(&x, &tensor(&[4], &[0.0; 4], DType::F32, &device)).unwrap_err();
            assert!(e.to_string().contains("add_bias"), "{e}");
            // Soft-capping and its gradient against the formulas.
            let (x, v) = (rng.vec(300, 40.0), rng.vec(300, 1.0));
            let y = softcap(&tensor(&[300], &x, DType::F32, &device), 30.0).unwrap();
            let dy = softcap_backward(&tensor(&[300], &v[..300], DType::F32, &device), &y, 30.0)
                .unwrap();
            let (y, dy) = (y.to_vec_f32().unwrap(), dy.to_vec_f32().unwrap());
            for i in 0..300 {
                let t = (f64::from(x[i]) / 30.0).tanh();
                assert!((f64::from(y[i]) - 30.0 * t).abs() < 1e-4, "{device} softcap");
                let want = f64::from(v[i]) * (1.0 - t * t);
                assert!((f64::from(dy[i]) - want).abs() < 1e-4, "{device} softcap_backward");
            }
            // A scalar scale: one f32 product and the dtype's rounding, the CPU's bits.
            let v = rng.vec(1001, 3.0);
            for dtype in dtypes() {
                let want: Vec<f32> = rounded(&v, dtype).iter().map(|x| x * 33.941_125).collect();
                let got = scale(&tensor(&[1001], &v, dtype, &device), 33.941_125).unwrap();
                assert_eq!(got.to_vec_f32().unwrap(), round_out(&want, dtype), "{device} {dtype}");
            }
            assert!(e.to_string().contains("add_bias"), "{e}");
        }
    }

    #[test]
    fn embedding_matches_the_cpu_reference_bit_for_bit_on_every_device() {
        let mut rng = Rng::new(44);
        for device in devices() {
            for &(vocab, hidden, tokens) in &[(11, 8, 40), (1000, 576, 333), (50, 1001, 7)] {
                let table = rng.vec(vocab * hidden, 1.0);
                // Repeated ids, so the backward sums several rows into one.
                let ids: Vec<u32> = (0..tokens).map(|_| rng.below(vocab.min(30)) as u32).collect();
                let d_out = rng.vec(tokens * hidden, 1.0);
                for dtype in dtypes() {
                    let tt = tensor(&[vocab, hidden], &table, dtype, &device);
                    let out = embedding_forward(&tt, &ids).unwrap();
                    let mut want = vec![0.0; tokens * hidden];
                    cpu::embedding_forward(&mut want, &rounded(&table, dtype), &ids, hidden)
                        .unwrap();
                    let what = format!("{device} {dtype} embedding {vocab}×{hidden}, {tokens} ids");
                    assert_eq!(out.to_vec_f32().unwrap(), want, "{what}: forward");
                    let dt = tensor(&[tokens, hidden], &d_out, dtype, &device);
                    let d_table = embedding_backward(&dt, &ids, vocab).unwrap();
                    let mut want = vec![0.0; vocab * hidden];
                    cpu::embedding_backward(&mut want, &rounded(&d_out, dtype), &ids, hidden)
                        .unwrap();
                    assert_eq!(d_table.dtype(), DType::F32);
                    // Token order on both devices: the same bits.
                    assert_eq!(d_table.to_vec_f32().unwrap(), want, "{what}: backward");
                    // Added into an existing gradient: the rows of the ids move, the rest not.
                    let base = rng.vec(vocab * hidden, 1.0);
                    let mut acc = tensor(&[vocab, hidden], &base, DType::F32, &device);
                    embedding_backward_acc(&mut acc, &dt, &ids).unwrap();
                    let got = acc.to_vec_f32().unwrap();
                    let sum: Vec<f32> = base.iter().zip(&want).map(|(a, b)| a + b).collect();
                    let err = max_rel_err(&what, &got, &sum);
                    assert!(err < 1e-6, "{what}: accumulated backward {err:.3e}");
                }
            }
            // Ids on the device: a sampler's -1 reads row 0.
            let table = tensor(&[3, 4], &rng.vec(12, 1.0), DType::F32, &device);
            let ids = Tensor::from_i32(&[3], vec![2, -1, 0], &device).unwrap();
            let rows = embedding_forward_ids(&table, &ids).unwrap().to_vec_f32().unwrap();
            let want = embedding_forward(&table, &[2, 0, 0]).unwrap().to_vec_f32().unwrap();
            assert_eq!(rows, want, "{device} ids with -1");
            let table = tensor(&[4, 2], &[0.0; 8], DType::F32, &device);
            let err = embedding_forward(&table, &[1, 4]).unwrap_err().to_string();
            assert!(err.contains("token id 4 is outside the vocabulary of 4"), "{err}");
            let d = tensor(&[2, 2], &[0.0; 4], DType::F32, &device);
            assert!(embedding_backward(&d, &[1, 9], 4).is_err());
            assert!(embedding_backward(&d, &[1], 4).is_err());
        }
    }

    #[test]
    fn rows_gather_and_scatter_on_every_device() {
        let mut rng = Rng::new(45);
        for device in devices() {
            for dtype in dtypes() {
                let x = rng.vec(9 * 5, 1.0);
                let xt = tensor(&[9, 5], &x, dtype, &device);
                let rows = [7u32, 0, 3];
                let g = gather_rows(&xt, &rows).unwrap();
                let want: Vec<f32> =
                    rows.iter().flat_map(|&r| x[r as usize * 5..][..5].to_vec()).collect();
                assert_eq!(
                    g.to_vec_f32().unwrap(),
                    round_out(&want, dtype),
                    "{device} {dtype} gather"
                );
                let mut back = Tensor::zeros(&[9, 5], dtype, &device).unwrap();
                scatter_rows(&mut back, &g, &rows).unwrap();
                let got = back.to_vec_f32().unwrap();
                for r in 0..9 {
                    let row = &got[r * 5..][..5];
                    if rows.contains(&(r as u32)) {
                        assert_eq!(
                            row,
                            &round_out(&x[r * 5..][..5], dtype)[..],
                            "{device} {dtype} row {r}"
                        );
                    } else {
                        assert!(
                            row.iter().all(|&v| v == 0.0),
                            "{device} {dtype} row {r} untouched"
                        );
                    }
                }
                assert!(
                    scatter_rows(&mut back, &g, &[1, 1, 2])
                        .unwrap_err()
                        .to_string()
                        .contains("repeat")
                );
                assert!(gather_rows(&xt, &[9]).is_err());
            }
        }
    }

    /// A block of rows copied within a tensor is an exact copy, and the rest is untouched;
    /// overlapping or out-of-range ranges are errors. Every device and dtype.
    #[test]
    fn rows_copied_within_a_tensor_are_exact_on_every_device() {
        let mut rng = Rng::new(41);
        let data = rng.vec(10 * 6, 1.0);
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                let mut t = tensor(&[10, 6], &data, dtype, &device);
                let before = t.to_vec_f32().unwrap();
                copy_rows_within(&mut t, 1, 6, 3).unwrap();
                let mut want = before.clone();
                want.copy_within(6..24, 36);
                assert_eq!(t.to_vec_f32().unwrap(), want, "{device} {dtype}");
                assert!(copy_rows_within(&mut t, 1, 2, 3).is_err(), "overlap");
                assert!(copy_rows_within(&mut t, 8, 0, 3).is_err(), "past the end");
            }
        }
    }

    #[test]
    fn mismatched_operands_are_errors() {
        let dev = Device::Cpu;
        let a = tensor(&[2, 3], &[1.0; 6], DType::F32, &dev);
        let b = tensor(&[3, 2], &[1.0; 6], DType::F32, &dev);
        assert!(add(&a, &b).unwrap_err().to_string().contains("share a shape"));
        let bf = tensor(&[2, 3], &[1.0; 6], DType::BF16, &dev);
        assert!(swiglu_forward(&a, &bf).unwrap_err().to_string().contains("bf16"));
        let table = tensor(&[2, 1], &[1.0; 2], DType::F32, &dev);
        assert!(
            rope(&tensor(&[2, 1, 3], &[1.0; 6], DType::F32, &dev), &table, &table, false).is_err()
        );
    }

    /// The experts' combine and its gate gradients against a direct loop, on every device and
    /// float dtype: the combine's bits equal on every device, the dots within rounding.
    #[test]
    fn pick_rows_sum_and_dots_match_the_reference() {
        let mut rng = crate::rng::Rng::new(63);
        let (n, width, k, rows) = (11usize, 200usize, 3usize, 7usize);
        let y = rng.vec(n * width, 1.0);
        let a = rng.vec(rows * width, 1.0);
        let picks: Vec<u32> = (0..rows * k).map(|_| rng.below(n) as u32).collect();
        let weights = rng.vec(rows * k, 1.0);
        for dtype in [DType::F32, DType::BF16] {
            let (yr, ar) = (round_out(&y, dtype), round_out(&a, dtype));
            let mut want = vec![0.0f32; rows * width];
            for t in 0..rows {
                for j in 0..k {
                    let (r, w) = (picks[t * k + j] as usize, weights[t * k + j]);
                    for i in 0..width {
                        want[t * width + i] += w * yr[r * width + i];
                    }
                }
            }
            let want = round_out(&want, dtype);
            let dots: Vec<f64> = (0..rows * k)
                .map(|p| {
                    let (t, r) = (p / k, picks[p] as usize);
                    (0..width).map(|i| f64::from(ar[t * width + i] * yr[r * width + i])).sum()
                })
                .collect();
            for device in devices() {
                let what = format!("{device} {dtype}");
                let yt = tensor(&[n, width], &y, dtype, &device);
                let got = pick_rows_sum(&yt, &picks, &weights, k).unwrap();
                assert_eq!(got.shape(), [rows, width]);
                assert_eq!(got.to_vec_f32().unwrap(), want, "{what}: combine");
                let at = tensor(&[rows, width], &a, dtype, &device);
                let got = pick_row_dots(&at, &yt, &picks, k).unwrap();
                for (g, w) in got.iter().zip(&dots) {
                    assert!(
                        (f64::from(*g) - w).abs() < 1e-4 * (1.0 + w.abs()),
                        "{what}: {g} vs {w}"
                    );
                }
            }
        }
        let yt = tensor(&[n, width], &y, DType::F32, &Device::Cpu);
        assert!(pick_rows_sum(&yt, &[0, 99], &[1.0, 1.0], 1).is_err());
        assert!(pick_rows_sum(&yt, &[0, 1], &[1.0], 1).is_err());
    }

    /// SwiGLU of a stacked gate/up product gives the bits of the split, then swiglu_forward, on
    /// every device and float dtype (on CUDA its own kernel); an odd width is an error.
    #[test]
    fn swiglu_stacked_has_the_bits_of_split_then_swiglu() {
        let mut rng = crate::rng::Rng::new(62);
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                for (rows, inter) in [(1usize, 1536usize), (64, 1536), (37, 7), (256, 3072)] {
                    let gu = rng.vec(rows * 2 * inter, 3.0);
                    let gu = tensor(&[rows, 2 * inter], &gu, dtype, &device);
                    let got = swiglu_stacked(&gu).unwrap();
                    let parts = split_columns(&gu, &[inter, inter]).unwrap();
                    let want = swiglu_forward(&parts[0], &parts[1]).unwrap();
                    let what = format!("{device} {dtype} {rows}×{inter}");
                    assert_eq!((got.shape(), got.dtype()), (want.shape(), want.dtype()), "{what}");
                    let bits = |t: &Tensor| -> Vec<u32> {
                        t.to_vec_f32().unwrap().iter().map(|v| v.to_bits()).collect()
                    };
                    assert!(bits(&got) == bits(&want), "{what}: not the separate ops' bits");
                }
            }
            let odd = tensor(&[2, 5], &[1.0; 10], DType::F32, &device);
            assert!(swiglu_stacked(&odd).unwrap_err().to_string().contains("2·inter"));
        }
    }

    /// A fused product's output split into its parts, and weights stacked into a fused one: exact
    /// copies on every device, in both float dtypes; bad shapes are errors.
    #[test]
    fn split_columns_and_concat_rows_copy_exactly_on_every_device() {
        let mut rng = crate::rng::Rng::new(61);
        let (rows, widths) = (37usize, [96usize, 32, 32]);
        let x = rng.vec(rows * 160, 1.0);
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                let xr = round_out(&x, dtype);
                let t = tensor(&[rows, 160], &x, dtype, &device);
                for ws in [&widths[..], &[100, 60][..]] {
                    let parts = split_columns(&t, ws).unwrap();
                    let mut at = 0;
                    for (p, &w) in parts.iter().zip(ws) {
                        assert_eq!(p.shape(), [rows, w]);
                        let want: Vec<f32> = (0..rows)
                            .flat_map(|r| xr[r * 160 + at..r * 160 + at + w].to_vec())
                            .collect();
                        assert_eq!(p.to_vec_f32().unwrap(), want, "{device} {dtype} {ws:?}");
                        at += w;
                    }
                }
                let a = tensor(&[3, 160], &x[..480], dtype, &device);
                let joined = concat_rows(&[&a, &t]).unwrap();
                assert_eq!(joined.shape(), [3 + rows, 160]);
                let mut want = round_out(&x[..480], dtype);
                want.extend(&xr);
                assert_eq!(joined.to_vec_f32().unwrap(), want, "{device} {dtype} concat");
                assert!(split_columns(&t, &[100, 50]).is_err());
                assert!(split_columns(&t, &[160]).is_err());
                let narrow = tensor(&[2, 8], &x[..16], dtype, &device);
                assert!(concat_rows(&[&a, &narrow]).is_err());
            }
            // Token ids: a speculative step's inputs, joined on the device.
            let ids = |v: Vec<i32>| Tensor::from_i32(&[v.len(), 1], v, &device).unwrap();
            let joined = concat_rows(&[&ids(vec![3, -1]), &ids(vec![]), &ids(vec![7])]).unwrap();
            assert_eq!(
                (joined.shape(), joined.to_vec_i32().unwrap()),
                (&[3, 1][..], vec![3, -1, 7])
            );
            let float = tensor(&[1, 1], &[1.0], DType::F32, &device);
            assert!(concat_rows(&[&ids(vec![1]), &float]).is_err());
        }
    }
}
