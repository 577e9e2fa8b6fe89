//! The element-wise and gather ops of `kernels/elementwise.cu`. Shapes and dtypes were checked by
//! [`crate::ops`]; these pick the kernel of the operands' dtype and launch it.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::{Buffer, DeviceData, Gpu, driver_error, dtype_mismatch, elementwise_launch};
use crate::cpu::Gate;
use crate::{Error, Result};

fn wrap(gpu: &Arc<Gpu>, data: DeviceData) -> Buffer {
    Buffer { gpu: gpu.clone(), data }
}

/// The streaming kernels load 4 elements at a time when `n` allows it (the same arithmetic per
/// element either way); the launch covers `n / 4` vector steps then. `names` are the v1 and v4
/// kernels.
fn streaming(n: usize, names: [&'static str; 2]) -> (&'static str, LaunchConfig) {
    let v4 = n.is_multiple_of(4);
    (names[usize::from(v4)], elementwise_launch(if v4 { n / 4 } else { n }))
}

/// `h = act(gate)·up` over `n` elements.
pub(crate) fn glu_forward(
    gpu: &Arc<Gpu>,
    gate: &DeviceData,
    up: &DeviceData,
    n: usize,
    act: Gate,
) -> Result<Buffer> {
    let n_i = n as i64;
    let data = per_float!("glu", (gate, up), |T, f| {
        let mut h = gpu.alloc::<T>(n)?;
        if n > 0 {
            let names = match act {
                Gate::Silu => {
                    [kernel!(f, "swiglu_forward", "_v1"), kernel!(f, "swiglu_forward", "_v4")]
                }
                Gate::GeluTanh => {
                    [kernel!(f, "geglu_forward", "_v1"), kernel!(f, "geglu_forward", "_v4")]
                }
            };
            let (k, cfg) = streaming(n, names);
            launch!(gpu, "elementwise", k, cfg, &mut h, gate, up, &n_i)?;
        }
        DeviceData::from(h)
    });
    Ok(wrap(gpu, data))
}

/// [`swiglu_forward`] of the halves of the stacked gate/up product `gu [rows × 2·inter]`.
pub(crate) fn swiglu_stacked(
    gpu: &Arc<Gpu>,
    gu: &DeviceData,
    rows: usize,
    inter: usize,
) -> Result<Buffer> {
    let (rows_i, inter_i) = (rows as i64, inter as i32);
    let n = rows * inter;
    let cfg = elementwise_launch(n);
    let data = per_float!("swiglu_stacked", (gu), |T, f| {
        let mut h = gpu.alloc::<T>(n)?;
        if n > 0 {
            let k = kernel!(f, "swiglu_stacked");
            launch!(gpu, "elementwise", k, cfg, &mut h, gu, &rows_i, &inter_i)?;
        }
        DeviceData::from(h)
    });
    Ok(wrap(gpu, data))
}

/// [`crate::ops::pick_rows_sum`]: one block per output row.
pub(crate) fn pick_rows_sum(
    gpu: &Arc<Gpu>,
    y: &DeviceData,
    picks: &[i32],
    weights: &[f32],
    k: usize,
    width: usize,
) -> Result<Buffer> {
    let rows = picks.len() / k.max(1);
    let (k_i, width_i) = (k as i32, width as i32);
    let cfg = row_block(rows, width);
    let p = upload(gpu, picks)?;
    let w = gpu.stream().clone_htod(weights).map_err(|e| driver_error("copy to device", e))?;
    let data = per_float!("pick_rows_sum", (y), |T, f| {
        let mut out = gpu.alloc::<T>((rows * width).max(1))?;
        if rows > 0 {
            let name = kernel!(f, "pick_rows_sum");
            launch!(gpu, "elementwise", name, cfg, &mut out, y, &p, &w, &k_i, &width_i)?;
        }
        DeviceData::from(out)
    });
    Ok(wrap(gpu, data))
}

/// [`crate::ops::pick_row_dots`]: one block per pick; the dots come back to the host.
pub(crate) fn pick_row_dots(
    gpu: &Arc<Gpu>,
    a: &DeviceData,
    y: &DeviceData,
    picks: &[i32],
    k: usize,
    width: usize,
) -> Result<Vec<f32>> {
    let (k_i, width_i) = (k as i32, width as i32);
    let cfg = row_block(picks.len(), width);
    let p = upload(gpu, picks)?;
    let mut out = gpu.alloc::<f32>(picks.len().max(1))?;
    if !picks.is_empty() {
        per_float!("pick_row_dots", (a, y), |T, f| {
            let name = kernel!(f, "pick_row_dots");
            launch!(gpu, "elementwise", name, cfg, &mut out, a, y, &p, &k_i, &width_i)?
        });
    }
    let host = gpu.stream().clone_dtoh(&out).map_err(|e| driver_error("copy to host", e))?;
    Ok(host[..picks.len()].to_vec())
}

/// `(d_gate, d_up)` of [`glu_forward`] from `dh`.
pub(crate) fn glu_backward(
    gpu: &Arc<Gpu>,
    dh: &DeviceData,
    gate: &DeviceData,
    up: &DeviceData,
    n: usize,
    act: Gate,
) -> Result<(Buffer, Buffer)> {
    let n_i = n as i64;
    let (dg, du) = per_float!("glu_backward", (dh, gate, up), |T, f| {
        let (mut dg, mut du) = (gpu.alloc::<T>(n)?, gpu.alloc::<T>(n)?);
        if n > 0 {
            let names = match act {
                Gate::Silu => {
                    [kernel!(f, "swiglu_backward", "_v1"), kernel!(f, "swiglu_backward", "_v4")]
                }
                Gate::GeluTanh => {
                    [kernel!(f, "geglu_backward", "_v1"), kernel!(f, "geglu_backward", "_v4")]
                }
            };
            let (k, cfg) = streaming(n, names);
            launch!(gpu, "elementwise", k, cfg, &mut dg, &mut du, dh, gate, up, &n_i)?;
        }
        (DeviceData::from(dg), DeviceData::from(du))
    });
    Ok((wrap(gpu, dg), wrap(gpu, du)))
}

/// Rotate-half RoPE of `x [tokens × heads × head_dim]` with f32 `cos`/`sin`
/// `[tokens × head_dim/2]`; `sign` −1 rotates back (the backward).
#[allow(clippy::too_many_arguments)]
pub(crate) fn rope(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    cos: &DeviceData,
    sin: &DeviceData,
    tokens: usize,
    heads: usize,
    head_dim: usize,
    sign: f32,
) -> Result<Buffer> {
    let (DeviceData::F32(c), DeviceData::F32(s)) = (cos, sin) else {
        return Err(Error::DType { op: "rope", message: "cos and sin must be f32".into() });
    };
    let n = tokens * heads * head_dim;
    let (t, h, d) = (tokens as i64, heads as i32, head_dim as i32);
    // 4 pairs per step when a head's half is a multiple of 4.
    let v4 = (head_dim / 2).is_multiple_of(4);
    let cfg = elementwise_launch(if v4 { n / 8 } else { n / 2 });
    let data = per_float!("rope", (x), |T, f| {
        let mut y = gpu.alloc::<T>(n)?;
        if n > 0 {
            let k = if v4 { kernel!(f, "rope", "_v4") } else { kernel!(f, "rope", "_v1") };
            launch!(gpu, "elementwise", k, cfg, &mut y, x, c, s, &t, &h, &d, &sign)?;
        }
        DeviceData::from(y)
    });
    Ok(wrap(gpu, data))
}

/// `a + b` over `n` elements.
pub(crate) fn add(gpu: &Arc<Gpu>, a: &DeviceData, b: &DeviceData, n: usize) -> Result<Buffer> {
    let n_i = n as i64;
    let data = per_float!("add", (a, b), |T, f| {
        let mut out = gpu.alloc::<T>(n)?;
        if n > 0 {
            let (k, cfg) = streaming(n, [kernel!(f, "add", "_v1"), kernel!(f, "add", "_v4")]);
            launch!(gpu, "elementwise", k, cfg, &mut out, a, b, &n_i)?;
        }
        DeviceData::from(out)
    });
    Ok(wrap(gpu, data))
}

/// `x + bias` over `total` elements, rows of `n` each plus `bias [n]`.
pub(crate) fn add_bias(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    bias: &DeviceData,
    total: usize,
    n: usize,
) -> Result<Buffer> {
    let (total_i, n_i) = (total as i64, n as i32);
    let data = per_float!("add_bias", (x, bias), |T, f| {
        let mut out = gpu.alloc::<T>(total)?;
        if total > 0 {
            let k = kernel!(f, "add_bias");
            launch!(
                gpu,
                "elementwise",
                k,
                elementwise_launch(total),
                &mut out,
                x,
                bias,
                &total_i,
                &n_i
            )?;
        }
        DeviceData::from(out)
    });
    Ok(wrap(gpu, data))
}

/// `x · s` over `n` elements.
pub(crate) fn scale(gpu: &Arc<Gpu>, x: &DeviceData, s: f32, n: usize) -> Result<Buffer> {
    let n_i = n as i64;
    let data = per_float!("scale", (x), |T, f| {
        let mut out = gpu.alloc::<T>(n)?;
        if n > 0 {
            let k = kernel!(f, "scale");
            launch!(gpu, "elementwise", k, elementwise_launch(n), &mut out, x, &s, &n_i)?;
        }
        DeviceData::from(out)
    });
    Ok(wrap(gpu, data))
}

/// `cap · tanh(x / cap)` over `n` elements, or with `dy`, the gradient `dy · (1 − (x/cap)²)`
/// from softcap's output `x`.
pub(crate) fn softcap(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    dy: Option<&DeviceData>,
    cap: f32,
    n: usize,
) -> Result<Buffer> {
    let n_i = n as i64;
    let data = match dy {
        None => per_float!("softcap", (x), |T, f| {
            let mut out = gpu.alloc::<T>(n)?;
            if n > 0 {
                let k = kernel!(f, "softcap");
                launch!(gpu, "elementwise", k, elementwise_launch(n), &mut out, x, &cap, &n_i)?;
            }
            DeviceData::from(out)
        }),
        Some(dy) => per_float!("softcap_backward", (x, dy), |T, f| {
            let mut out = gpu.alloc::<T>(n)?;
            if n > 0 {
                let k = kernel!(f, "softcap_backward");
                let cfg = elementwise_launch(n);
                launch!(gpu, "elementwise", k, cfg, &mut out, dy, x, &cap, &n_i)?;
            }
            DeviceData::from(out)
        }),
    };
    Ok(wrap(gpu, data))
}

/// `acc[j] += Σ_r x[r·n + j]` in `cpu::column_sums_acc`'s order: runs of rows summed by a
/// thread each (a grid of runs × columns), then the runs' sums added in order.
pub(crate) fn column_sums_acc(
    gpu: &Arc<Gpu>,
    acc: &mut CudaSlice<f32>,
    x: &DeviceData,
    rows: usize,
    n: usize,
) -> Result<()> {
    let runs = rows.div_ceil(crate::cpu::COLUMN_SUM_ROWS);
    if n == 0 || runs == 0 {
        return Ok(());
    }
    if runs > 65_535 {
        return Err(Error::Shape {
            op: "column_sums_acc",
            message: format!(
                "{rows} rows: at most {} on CUDA",
                65_535 * crate::cpu::COLUMN_SUM_ROWS
            ),
        });
    }
    let mut part = gpu.alloc::<f32>(runs * n)?;
    let (rows_i, n_i, runs_i) = (rows as i64, n as i32, runs as i32);
    let columns = n.div_ceil(128) as u32;
    let cfg = |runs: usize| LaunchConfig {
        grid_dim: (columns, runs as u32, 1),
        block_dim: (128, 1, 1),
        shared_mem_bytes: 0,
    };
    per_float!("column_sums_acc", (x), |T, f| {
        let k = kernel!(f, "column_run_sums");
        launch!(gpu, "elementwise", k, cfg(runs), &mut part, x, &rows_i, &n_i)
    })?;
    launch!(gpu, "elementwise", "column_runs_acc", cfg(1), acc, &part, &runs_i, &n_i)
}

/// Threads per block of the row kernels: whole warps, at most 256, a function of `hidden` alone.
fn row_block(rows: usize, hidden: usize) -> LaunchConfig {
    let threads = (hidden.div_ceil(32) * 32).clamp(32, 256) as u32;
    LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (threads, 1, 1), shared_mem_bytes: 0 }
}

fn upload(gpu: &Gpu, v: &[i32]) -> Result<CudaSlice<i32>> {
    gpu.stream().clone_htod(v).map_err(|e| driver_error("copy to device", e))
}

/// Token ids of a device op: from the host (uploaded by the op) or already on the device.
pub(crate) enum Ids<'a> {
    Host(&'a [i32]),
    Device(&'a CudaSlice<i32>, usize),
}

impl Ids<'_> {
    pub(crate) fn len(&self) -> usize {
        match self {
            Ids::Host(v) => v.len(),
            Ids::Device(_, n) => *n,
        }
    }
}

/// `out[t] = table[ids[t]]`, `table [vocab × hidden]` (ids checked by the caller).
pub(crate) fn embedding_forward(
    gpu: &Arc<Gpu>,
    table: &DeviceData,
    ids: Ids,
    hidden: usize,
) -> Result<Buffer> {
    let rows = ids.len();
    let hidden_i = hidden as i32;
    // Rows copied 4 elements at a time when hidden allows; the block covers hidden / 4 then.
    let v4 = hidden.is_multiple_of(4);
    let cfg = row_block(rows, if v4 { hidden / 4 } else { hidden });
    let uploaded = match ids {
        Ids::Host(v) if rows > 0 => Some(upload(gpu, v)?),
        _ => None,
    };
    let ids_d = match ids {
        _ if rows == 0 => None,
        Ids::Host(_) => uploaded.as_ref(),
        Ids::Device(d, _) => Some(d),
    };
    let data = per_float!("embedding", (table), |T, f| {
        let mut out = gpu.alloc::<T>(rows * hidden)?;
        if let Some(ids_d) = ids_d {
            let k = if v4 {
                kernel!(f, "embedding_forward", "_v4")
            } else {
                kernel!(f, "embedding_forward", "_v1")
            };
            launch!(gpu, "elementwise", k, cfg, &mut out, table, ids_d, &hidden_i)?;
        }
        DeviceData::from(out)
    });
    Ok(wrap(gpu, data))
}

/// The rows of a deterministic embedding backward: each distinct id, and the positions that
/// hold it (in token order) as `positions[offsets[u]..offsets[u + 1]]`.
pub(crate) struct IdGroups {
    pub(crate) uniq: Vec<i32>,
    pub(crate) offsets: Vec<i32>,
    pub(crate) positions: Vec<i32>,
}

/// `d_table [vocab × hidden]` (f32): each id's row sums its positions' `d_out` rows in token
/// order; other rows are 0.
pub(crate) fn embedding_backward(
    gpu: &Arc<Gpu>,
    d_out: &DeviceData,
    groups: &IdGroups,
    vocab: usize,
    hidden: usize,
) -> Result<Buffer> {
    let mut d_table = gpu.alloc::<f32>(vocab * hidden)?;
    gpu.stream().memset_zeros(&mut d_table).map_err(|e| driver_error("memset", e))?;
    embedding_backward_into(gpu, &mut d_table, d_out, groups, hidden, false)?;
    Ok(wrap(gpu, DeviceData::F32(d_table)))
}

/// Writes (or with `accumulate` adds) each id's sum of its positions' `d_out` rows into its row
/// of `d_table`; other rows are untouched.
pub(crate) fn embedding_backward_into(
    gpu: &Arc<Gpu>,
    d_table: &mut CudaSlice<f32>,
    d_out: &DeviceData,
    groups: &IdGroups,
    hidden: usize,
    accumulate: bool,
) -> Result<()> {
    let rows = groups.uniq.len();
    if rows == 0 || hidden == 0 {
        return Ok(());
    }
    let (uniq, offsets) = (upload(gpu, &groups.uniq)?, upload(gpu, &groups.offsets)?);
    let positions = upload(gpu, &groups.positions)?;
    let cfg = row_block(rows, hidden);
    let (hidden_i, acc) = (hidden as i32, i32::from(accumulate));
    per_float!("embedding_backward", (d_out), |T, f| {
        let k = kernel!(f, "embedding_backward");
        launch!(
            gpu,
            "elementwise",
            k,
            cfg,
            d_table,
            d_out,
            &uniq,
            &offsets,
            &positions,
            &hidden_i,
            &acc
        )
    })
}

/// `dst[rows[i]] = src[i]` for distinct `rows` (checked on the host), `hidden` wide.
pub(crate) fn scatter_rows(
    gpu: &Arc<Gpu>,
    dst: &mut DeviceData,
    src: &DeviceData,
    rows: &[i32],
    hidden: usize,
) -> Result<()> {
    if rows.is_empty() || hidden == 0 {
        return Ok(());
    }
    let cfg = row_block(rows.len(), hidden);
    let (rows_d, hidden_i) = (upload(gpu, rows)?, hidden as i32);
    per_float!("scatter_rows", (dst, src), |T, f| {
        let k = kernel!(f, "scatter_rows");
        launch!(gpu, "elementwise", k, cfg, dst, src, &rows_d, &hidden_i)
    })
}

/// The columns of `x [rows × Σ widths]` as two or three tensors (checked by the op), one launch.
pub(crate) fn split_columns(
    gpu: &Arc<Gpu>,
    x: &DeviceData,
    rows: usize,
    widths: &[usize],
) -> Result<Vec<Buffer>> {
    let w = |i: usize| widths.get(i).copied().unwrap_or(0);
    let (w0, w1, w2) = (w(0) as i32, w(1) as i32, w(2) as i32);
    let width: usize = widths.iter().sum();
    let cfg = row_block(rows, width);
    Ok(per_float!("split_columns", (x), |T, f| {
        let mut outs: Vec<CudaSlice<T>> =
            (0..3).map(|i| gpu.alloc::<T>(rows * w(i).max(1))).collect::<Result<_>>()?;
        if rows > 0 && width > 0 {
            let [o0, o1, o2] = &mut outs[..] else { unreachable!("three outputs") };
            let k = kernel!(f, "split_columns");
            launch!(gpu, "elementwise", k, cfg, x, o0, &w0, o1, &w1, o2, &w2)?;
        }
        outs.into_iter().take(widths.len()).map(|s| wrap(gpu, DeviceData::from(s))).collect()
    }))
}

/// `y[r, j] = src[r, map[j]]` (0 where negative), `src` the `w0` columns of `a` beside the
/// `w1` of `b` (`a` again, unread, when `w1` is 0): `[rows × out]`.
pub(crate) fn gather_columns(
    gpu: &Arc<Gpu>,
    (a, b): (&DeviceData, &DeviceData),
    (w0, w1): (usize, usize),
    map: &CudaSlice<i32>,
    (rows, out): (usize, usize),
) -> Result<Buffer> {
    let (w0, w1, out_i) = (w0 as i32, w1 as i32, out as i32);
    let cfg = row_block(rows, out);
    per_float!("gather_columns", (a, b), |T, f| {
        let mut y = gpu.alloc::<T>((rows * out).max(1))?;
        if rows > 0 && out > 0 {
            let k = kernel!(f, "gather_columns");
            launch!(gpu, "elementwise", k, cfg, &mut y, a, &w0, b, &w1, map, &out_i)?;
        }
        Ok(wrap(gpu, DeviceData::from(y)))
    })
}

/// The adjoint of [`gather_columns`]: `dx[r, s]` the f32 sum, in list order, of `dy[r, j]`
/// over `j` in `order[starts[s]..starts[s + 1]]`, `dy` `[rows × out]`: `[rows × sources]`.
pub(crate) fn scatter_columns(
    gpu: &Arc<Gpu>,
    dy: &DeviceData,
    (starts, order): (&CudaSlice<i32>, &CudaSlice<i32>),
    (rows, out, sources): (usize, usize, usize),
) -> Result<Buffer> {
    let (out_i, sources_i) = (out as i32, sources as i32);
    let cfg = row_block(rows, sources);
    per_float!("scatter_columns", (dy), |T, f| {
        let mut dx = gpu.alloc::<T>((rows * sources).max(1))?;
        if rows > 0 && sources > 0 {
            let k = kernel!(f, "scatter_columns");
            launch!(gpu, "elementwise", k, cfg, &mut dx, dy, &out_i, starts, order, &sources_i)?;
        }
        Ok(wrap(gpu, DeviceData::from(dx)))
    })
}

/// The rows of `parts` (one dtype, one width) stacked into one buffer.
pub(crate) fn concat_rows(gpu: &Arc<Gpu>, parts: &[&DeviceData]) -> Result<Buffer> {
    let stream = gpu.stream().clone();
    let err = |e| driver_error("device copy", e);
    macro_rules! run {
        ($ty:ty, $variant:path) => {{
            let slices: Vec<&CudaSlice<$ty>> = parts
                .iter()
                .map(|p| match p {
                    $variant(s) => Ok(s),
                    _ => Err(dtype_mismatch("concat_rows")),
                })
                .collect::<Result<_>>()?;
            let total: usize = slices.iter().map(|s| s.len()).sum();
            let mut out = gpu.alloc::<$ty>(total.max(1))?;
            let mut at = 0;
            for s in slices {
                if s.len() > 0 {
                    let mut view = out.slice_mut(at..at + s.len());
                    stream.memcpy_dtod(s, &mut view).map_err(err)?;
                }
                at += s.len();
            }
            wrap(gpu, $variant(out))
        }};
    }
    Ok(match parts.first() {
        Some(DeviceData::F32(_)) => run!(f32, DeviceData::F32),
        Some(DeviceData::BF16(_)) => run!(u16, DeviceData::BF16),
        Some(DeviceData::I32(_)) => run!(i32, DeviceData::I32),
        _ => return Err(dtype_mismatch("concat_rows")),
    })
}
