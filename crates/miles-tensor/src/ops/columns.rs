//! Columns rearranged by a fixed map ([`gather_columns`]) and its adjoint
//! ([`scatter_columns`]): how a latent-attention layer assembles each head's key from its own
//! part and the part every head shares, and pads or trims its values, without a kernel per
//! arrangement.

use super::{floats_only, host_f32, host_out, host_tensor, same_device};
use crate::tensor::Storage;
use crate::{Device, Result, Tensor, ensure};

#[cfg(feature = "cuda")]
use super::device_data;

/// A fixed arrangement of columns, kept on the device that uses it (a captured step reads it
/// there): output column `j` takes source column `map[j]` (zero where negative), the sources
/// being the columns of one or two parts side by side.
#[derive(Debug)]
pub struct ColumnMap {
    /// Each part's width.
    widths: Vec<usize>,
    /// i32 `[out]`.
    map: Tensor,
    /// The adjoint's lists: source column `s` is read by the output columns
    /// `order[starts[s]..starts[s + 1]]`, in increasing order. i32 `[sources + 1]`, `[reads]`.
    starts: Tensor,
    order: Tensor,
}

impl ColumnMap {
    /// The arrangement `map` over parts of `widths` (one or two), on `device`.
    pub fn new(map: &[i32], widths: &[usize], device: &Device) -> Result<Self> {
        const OP: &str = "ColumnMap";
        let sources: usize = widths.iter().sum();
        ensure((1..=2).contains(&widths.len()) && sources < i32::MAX as usize, OP, || {
            format!("parts of widths {widths:?}: one or two parts")
        })?;
        ensure(map.iter().all(|&s| s < sources as i32), OP, || {
            format!("a map into {sources} source columns reads past them")
        })?;
        let mut starts = vec![0i32; sources + 1];
        for &s in map.iter().filter(|&&s| s >= 0) {
            starts[s as usize + 1] += 1;
        }
        for s in 0..sources {
            starts[s + 1] += starts[s];
        }
        let mut next = starts.clone();
        let mut order = vec![0i32; starts[sources] as usize];
        for (j, &s) in map.iter().enumerate().filter(|&(_, &s)| s >= 0) {
            order[next[s as usize] as usize] = j as i32;
            next[s as usize] += 1;
        }
        let i32s = |v: Vec<i32>| {
            let n = v.len();
            Tensor::from_i32(&[n], v, &Device::Cpu).and_then(|t| t.to_device(device))
        };
        Ok(ColumnMap {
            widths: widths.to_vec(),
            map: i32s(map.to_vec())?,
            starts: i32s(starts)?,
            order: i32s(order)?,
        })
    }

    /// Output columns.
    pub fn width(&self) -> usize {
        self.map.len()
    }

    pub fn part_widths(&self) -> &[usize] {
        &self.widths
    }
}

/// `y[r, j] = src[r, map[j]]` (0 where the map is negative), `src` the columns of `parts`
/// (`[rows × widths[p]]`, one dtype) side by side: `[rows × map.width()]`, exact copies.
pub fn gather_columns(parts: &[&Tensor], m: &ColumnMap) -> Result<Tensor> {
    const OP: &str = "gather_columns";
    let device = same_device(OP, &[parts, &[&m.map]].concat())?;
    floats_only(OP, parts)?;
    let rows = parts.first().map_or(0, |p| p.shape.first().copied().unwrap_or(0));
    let fits = parts.len() == m.widths.len()
        && parts.iter().zip(&m.widths).all(|(p, &w)| p.shape == [rows, w])
        && parts.iter().all(|p| p.dtype() == parts[0].dtype());
    ensure(fits, OP, || {
        let shapes: Vec<_> = parts.iter().map(|p| (p.shape.clone(), p.dtype())).collect();
        format!("parts {shapes:?} for a map over widths {:?} (rows each, one dtype)", m.widths)
    })?;
    let (out, dtype) = (m.width(), parts[0].dtype());
    match device {
        Device::Cpu => {
            let src: Vec<_> = parts.iter().map(|p| host_f32(p)).collect();
            let map = host_i32(&m.map);
            let w0 = m.widths[0];
            let mut y = host_out(rows * out);
            for (r, row) in y.chunks_exact_mut(out.max(1)).enumerate().take(rows) {
                for (v, &s) in row.iter_mut().zip(map) {
                    *v = match s {
                        s if s < 0 => 0.0,
                        s if (s as usize) < w0 => src[0][r * w0 + s as usize],
                        s => src[1][r * m.widths[1] + s as usize - w0],
                    };
                }
            }
            Ok(host_tensor(vec![rows, out], y, dtype))
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(first) = &parts[0].storage else { unreachable!("on a device") };
            let second = device_data(parts.get(1).unwrap_or(&parts[0]));
            let w1 = m.widths.get(1).copied().unwrap_or(0);
            let y = crate::cuda::gather_columns(
                &first.gpu,
                (&first.data, second),
                (m.widths[0], w1),
                i32_data(&m.map),
                (rows, out),
            )?;
            Ok(Tensor { shape: vec![rows, out], storage: Storage::Cuda(y) })
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => Err(crate::tensor::not_built()),
    }
}

/// The adjoint of [`gather_columns`]: each part's `dx[r, s] = Σ dy[r, j]` over the output
/// columns `j` that read source column `s`, summed in f32 in increasing `j` (so the bits do
/// not depend on the device), stored in `dy`'s dtype.
pub fn scatter_columns(dy: &Tensor, m: &ColumnMap) -> Result<Vec<Tensor>> {
    const OP: &str = "scatter_columns";
    let device = same_device(OP, &[dy, &m.map])?;
    floats_only(OP, &[dy])?;
    let rows = dy.shape.first().copied().unwrap_or(0);
    ensure(dy.shape == [rows, m.width()], OP, || {
        format!("dy {:?} for a map of {} output columns", dy.shape, m.width())
    })?;
    let sources: usize = m.widths.iter().sum();
    let whole = match device {
        Device::Cpu => {
            let (g, starts, order) = (host_f32(dy), host_i32(&m.starts), host_i32(&m.order));
            let out = m.width();
            let mut dx = host_out(rows * sources);
            for (r, row) in dx.chunks_exact_mut(sources.max(1)).enumerate().take(rows) {
                for (s, v) in row.iter_mut().enumerate() {
                    let reads = &order[starts[s] as usize..starts[s + 1] as usize];
                    *v = reads.iter().fold(0.0f32, |acc, &j| acc + g[r * out + j as usize]);
                }
            }
            host_tensor(vec![rows, sources], dx, dy.dtype())
        }
        #[cfg(feature = "cuda")]
        Device::Cuda(_) => {
            let Storage::Cuda(b) = &dy.storage else { unreachable!("on a device") };
            let (starts, order) = (i32_data(&m.starts), i32_data(&m.order));
            let dx = crate::cuda::scatter_columns(
                &b.gpu,
                &b.data,
                (starts, order),
                (rows, m.width(), sources),
            )?;
            Tensor { shape: vec![rows, sources], storage: Storage::Cuda(dx) }
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => return Err(crate::tensor::not_built()),
    };
    match m.widths[..] {
        [_] => Ok(vec![whole]),
        [a, b] => super::split_columns(&whole, &[a, b]),
        _ => unreachable!("one or two parts (ColumnMap::new)"),
    }
}

fn host_i32(t: &Tensor) -> &[i32] {
    match &t.storage {
        Storage::I32(v) => v,
        _ => unreachable!("a ColumnMap's host tensors are i32"),
    }
}

#[cfg(feature = "cuda")]
fn i32_data(t: &Tensor) -> &cudarc::driver::CudaSlice<i32> {
    match device_data(t) {
        crate::cuda::DeviceData::I32(s) => s,
        _ => unreachable!("a ColumnMap's device tensors are i32"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DType;
    use crate::ops::tests::{devices, round_out, tensor};
    use crate::rng::Rng;

    /// A latent-attention-like arrangement: 3 heads of 4 columns, each head's first two from
    /// its own 2 columns of part 0, its last two the 2 shared columns of part 1, then a
    /// padding column; and its adjoint, which sums the shared columns over the heads.
    fn heads_map() -> Vec<i32> {
        (0..3).flat_map(|h| [2 * h, 2 * h + 1, 6, 7, -1]).collect()
    }

    #[test]
    fn columns_gather_and_scatter_as_defined_on_every_device() {
        let mut rng = Rng::new(41);
        let (a, b) = (rng.vec(5 * 6, 1.0), rng.vec(5 * 2, 1.0));
        let dy = rng.vec(5 * 15, 1.0);
        let map = heads_map();
        for device in devices() {
            for dtype in [DType::F32, DType::BF16] {
                let m = ColumnMap::new(&map, &[6, 2], &device).unwrap();
                let (ta, tb) =
                    (tensor(&[5, 6], &a, dtype, &device), tensor(&[5, 2], &b, dtype, &device));
                let y = gather_columns(&[&ta, &tb], &m).unwrap().to_vec_f32().unwrap();
                let (a, b) = (ta.to_vec_f32().unwrap(), tb.to_vec_f32().unwrap());
                for r in 0..5 {
                    for (j, &s) in map.iter().enumerate() {
                        let want = match s {
                            -1 => 0.0,
                            s if s < 6 => a[r * 6 + s as usize],
                            s => b[r * 2 + s as usize - 6],
                        };
                        assert_eq!(y[r * 15 + j], want, "{device} {dtype} row {r} column {j}");
                    }
                }
                let tdy = tensor(&[5, 15], &dy, dtype, &device);
                let d = scatter_columns(&tdy, &m).unwrap();
                let g = tdy.to_vec_f32().unwrap();
                let (da, db) = (d[0].to_vec_f32().unwrap(), d[1].to_vec_f32().unwrap());
                for r in 0..5 {
                    let own: Vec<f32> = (0..6).map(|s| g[r * 15 + (s / 2) * 5 + s % 2]).collect();
                    assert_eq!(&da[r * 6..r * 6 + 6], round_out(&own, dtype), "{device} {dtype}");
                    for s in 0..2 {
                        let sum = (0..3).fold(0.0f32, |acc, h| acc + g[r * 15 + h * 5 + 2 + s]);
                        assert_eq!(db[r * 2 + s], round_out(&[sum], dtype)[0], "{device} {dtype}");
                    }
                }
            }
        }
    }

    #[test]
    fn column_maps_refuse_what_they_cannot_hold() {
        let cpu = Device::Cpu;
        assert!(ColumnMap::new(&[0, 8], &[6, 2], &cpu).is_err());
        assert!(ColumnMap::new(&[0], &[1, 1, 1], &cpu).is_err());
        let m = ColumnMap::new(&heads_map(), &[6, 2], &cpu).unwrap();
        let x = Tensor::zeros(&[5, 6], DType::F32, &cpu).unwrap();
        let e = gather_columns(&[&x], &m).unwrap_err().to_string();
        assert!(e.contains("gather_columns"), "{e}");
        let dy = Tensor::zeros(&[5, 14], DType::F32, &cpu).unwrap();
        assert!(scatter_columns(&dy, &m).is_err());
    }
}
