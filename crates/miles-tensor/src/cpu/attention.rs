//! Causal attention with grouped-query heads over packed variable-length sequences.
//!
//! Layout: `q` is `[tokens × q_heads × head_dim]`, `k` and `v` are `[tokens × kv_heads ×
//! head_dim]`, sequences packed back to back with `cu_seqlens` (`[0, len0, len0+len1, …]`).
//! Query head `h` reads kv head `h / (q_heads / kv_heads)`. Scores are scaled by
//! `1/sqrt(head_dim)`; each token attends to itself and the earlier tokens of its sequence.
//!
//! Work is split into tiles: a block of query rows of one head (forward, dq) or a block of
//! keys of one kv head (dk, dv). A tile copies its key and value block transposed
//! (`[head_dim × block]`), so scores of one query against the block are axpys over contiguous
//! memory that vectorize, with no horizontal sums. The forward keeps an online softmax over key
//! blocks and saves only the log-sum-exp per (token, head): memory stays linear in sequence
//! length. The backward recomputes probabilities from it. Key blocks start at the sequence's
//! first token and every sum runs in a fixed order inside one tile, so results do not depend on
//! how sequences are packed or how many threads run.

use rayon::prelude::*;

use super::dot;
use crate::{Result, ensure};

/// Keys per block: the width of the transposed tiles and the paged KV cache's block size.
pub const KEY_BLOCK: usize = 64;
/// Query rows per forward / dq tile.
pub(crate) const QUERY_BLOCK: usize = 64;

/// Shapes of one attention call, and how its scores are formed.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape {
    pub q_heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub scores: Scores,
}

/// How a query's scores over its keys are formed: `(q · scale)·k`, soft-capped to
/// `cap · tanh(s / cap)` when `softcap` is set (Gemma 2), over the last `window` keys only
/// when it is set (sliding-window layers: key j is seen by query i when i − window < j ≤ i).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scores {
    pub scale: f32,
    pub softcap: Option<f32>,
    pub window: Option<usize>,
}

impl Scores {
    /// Plain causal attention over heads of `head_dim`: scale 1/√head_dim.
    pub fn plain(head_dim: usize) -> Self {
        Scores { scale: 1.0 / (head_dim as f32).sqrt(), softcap: None, window: None }
    }

    /// Whether the scores are plain scaled dot products over every earlier key.
    pub fn is_plain_causal(&self) -> bool {
        self.softcap.is_none() && self.window.is_none()
    }

    /// A cap is positive and finite, a window at least one key.
    pub(crate) fn check(&self, op: &'static str) -> Result<()> {
        ensure(
            self.softcap.is_none_or(|c| c.is_finite() && c > 0.0)
                && self.window.is_none_or(|w| w > 0)
                && self.scale.is_finite(),
            op,
            || format!("{self:?}: the scale and cap must be finite, the cap and window positive"),
        )
    }

    /// The first key a query that sees `visible` keys (of its sequence, causally) attends to.
    pub fn first_key(&self, visible: usize) -> usize {
        self.window.map_or(0, |w| visible.saturating_sub(w))
    }

    /// The score from the scaled dot product.
    fn cap(&self, s: f32) -> f32 {
        match self.softcap {
            Some(c) => c * (s / c).tanh(),
            None => s,
        }
    }

    /// d(score)/d(scaled dot product), from the score: 1 − (score / cap)².
    fn cap_grad(&self, score: f32) -> f32 {
        match self.softcap {
            Some(c) => 1.0 - (score / c) * (score / c),
            None => 1.0,
        }
    }
}

impl AttentionShape {
    /// Plain causal attention ([`Scores::plain`]).
    pub fn new(q_heads: usize, kv_heads: usize, head_dim: usize) -> Self {
        AttentionShape { q_heads, kv_heads, head_dim, scores: Scores::plain(head_dim) }
    }

    pub(crate) fn check(
        &self,
        op: &'static str,
        tokens: usize,
        q: usize,
        k: usize,
        v: usize,
        cu: &[usize],
    ) -> Result<()> {
        let AttentionShape { q_heads, kv_heads, head_dim, scores } = *self;
        scores.check(op)?;
        ensure(kv_heads > 0 && q_heads.is_multiple_of(kv_heads), op, || {
            format!("{q_heads} query heads are not a multiple of {kv_heads} kv heads")
        })?;
        ensure(
            q == tokens * q_heads * head_dim && k == tokens * kv_heads * head_dim && v == k,
            op,
            || {
                format!(
                    "q {q} k {k} v {v} for {tokens} tokens, heads {q_heads}/{kv_heads}, head_dim {head_dim}"
                )
            },
        )?;
        ensure(
            cu.first() == Some(&0)
                && cu.last() == Some(&tokens)
                && cu.windows(2).all(|w| w[0] <= w[1]),
            op,
            || format!("cu_seqlens {cu:?} must rise from 0 to {tokens}"),
        )
    }
}

/// One key block of one kv head, transposed: `kt[x * KEY_BLOCK + j] = k[j0 + j][x]`.
struct KeyTile {
    j0: usize,
    len: usize,
    kt: Vec<f32>,
    vt: Vec<f32>,
}

impl KeyTile {
    fn new(
        k: &[f32],
        v: &[f32],
        j0: usize,
        len: usize,
        kvh: usize,
        kv_heads: usize,
        d: usize,
    ) -> Self {
        let mut kt = vec![0f32; d * KEY_BLOCK];
        let mut vt = vec![0f32; d * KEY_BLOCK];
        for j in 0..len {
            let row = ((j0 + j) * kv_heads + kvh) * d;
            for x in 0..d {
                kt[x * KEY_BLOCK + j] = k[row + x];
                vt[x * KEY_BLOCK + j] = v[row + x];
            }
        }
        KeyTile { j0, len, kt, vt }
    }

    /// `out[j] = Σ_x a[x] · t[x][j]` for the tile's keys, x in order (so each entry is the same
    /// sum whichever tile computes it).
    fn project(t: &[f32], a: &[f32], out: &mut [f32; KEY_BLOCK]) {
        out.fill(0.0);
        for (x, &ax) in a.iter().enumerate() {
            let col = &t[x * KEY_BLOCK..(x + 1) * KEY_BLOCK];
            for (o, c) in out.iter_mut().zip(col) {
                *o += ax * c;
            }
        }
    }
}

fn scaled(row: &[f32], scale: f32) -> Vec<f32> {
    row.iter().map(|x| x * scale).collect()
}

fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    y.iter_mut().zip(x).for_each(|(y, x)| *y += a * x);
}

/// (sequence start, sequence end, tile start, tile end).
pub(crate) type Tile = (usize, usize, usize, usize);

/// Tiles of `block` rows over each sequence.
pub(crate) fn tiles(cu_seqlens: &[usize], block: usize) -> Vec<Tile> {
    let mut out = Vec::new();
    for w in cu_seqlens.windows(2) {
        let mut s = w[0];
        while s < w[1] {
            out.push((w[0], w[1], s, (s + block).min(w[1])));
            s += block;
        }
    }
    out
}

/// One query row attending over key blocks: `out_row = softmax(scores)·V` over its keys
/// `first..visible` (of its sequence; [`Scores::first_key`]), returning the log-sum-exp.
/// `block(b)` gives key block `b` of the row's kv head as `(kt, v)`: keys transposed
/// (`kt[x * KEY_BLOCK + j]`) and values row by row (`v[j * v_stride + x]`). Training, prefill
/// and decode all call this one function, so a token's attention output has the same bits
/// whichever batch, packing or cache it came from.
pub fn attend_row<'a>(
    out_row: &mut [f32],
    q_row: &[f32],
    (first, visible): (usize, usize),
    scores: &Scores,
    v_stride: usize,
    block: impl Fn(usize) -> (&'a [f32], &'a [f32]),
) -> f32 {
    let d = q_row.len();
    let qs = scaled(q_row, scores.scale);
    let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
    out_row.fill(0.0);
    let mut s = [0f32; KEY_BLOCK];
    for b in first / KEY_BLOCK..visible.div_ceil(KEY_BLOCK) {
        let (kt, v) = block(b);
        let lo = first.saturating_sub(b * KEY_BLOCK);
        let n = KEY_BLOCK.min(visible - b * KEY_BLOCK);
        KeyTile::project(kt, &qs, &mut s);
        s[lo..n].iter_mut().for_each(|x| *x = scores.cap(*x));
        let block_max = s[lo..n].iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let new_m = m.max(block_max);
        let rescale = (m - new_m).exp();
        l *= rescale;
        out_row.iter_mut().for_each(|x| *x *= rescale);
        for (jj, sj) in s[..n].iter().enumerate().skip(lo) {
            let p = (sj - new_m).exp();
            l += p;
            axpy(out_row, p, &v[jj * v_stride..][..d]);
        }
        m = new_m;
    }
    out_row.iter_mut().for_each(|x| *x /= l);
    m + l.ln()
}

/// Writes `out` `[tokens × q_heads × head_dim]` and `lse` `[tokens × q_heads]`.
pub fn attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, head_dim: d, scores } = shape;
    let tokens = lse.len() / q_heads.max(1);
    shape.check("attention", tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    ensure(out.len() == q.len() && lse.len() == tokens * q_heads, "attention", || {
        format!("out {} lse {} for q {}", out.len(), lse.len(), q.len())
    })?;
    let group = q_heads / kv_heads;
    // Transposed key tiles of each (sequence, kv head), built once; values are read in place.
    let seq_tiles: Vec<Vec<Vec<KeyTile>>> = cu_seqlens
        .par_windows(2)
        .map(|w| {
            (0..kv_heads)
                .map(|kvh| {
                    (w[0]..w[1])
                        .step_by(KEY_BLOCK)
                        .map(|j0| {
                            KeyTile::new(k, v, j0, KEY_BLOCK.min(w[1] - j0), kvh, kv_heads, d)
                        })
                        .collect()
                })
                .collect()
        })
        .collect();
    // (head, sequence, tile)
    let work: Vec<(usize, usize, Tile)> = (0..q_heads)
        .flat_map(|h| tiles(cu_seqlens, QUERY_BLOCK).into_iter().map(move |t| (h, t)))
        // The last sequence starting at the tile's start is the tile's (empty ones come first).
        .map(|(h, t)| (h, cu_seqlens.partition_point(|&c| c <= t.0) - 1, t))
        .collect();
    let v_stride = kv_heads * d;
    let results: Vec<(Vec<f32>, Vec<f32>)> = work
        .par_iter()
        .map(|&(h, seq, (a, _, i0, i1))| {
            let kvh = h / group;
            let key_tiles = &seq_tiles[seq][kvh];
            let mut acc = vec![0f32; (i1 - i0) * d];
            let mut row_lse = vec![0f32; i1 - i0];
            for (r, i) in (i0..i1).enumerate() {
                let visible = i + 1 - a;
                row_lse[r] = attend_row(
                    &mut acc[r * d..(r + 1) * d],
                    &q[(i * q_heads + h) * d..][..d],
                    (scores.first_key(visible), visible),
                    &scores,
                    v_stride,
                    |b| {
                        let j0 = key_tiles[b].j0;
                        (&key_tiles[b].kt[..], &v[(j0 * kv_heads + kvh) * d..])
                    },
                );
            }
            (acc, row_lse)
        })
        .collect();
    for (&(h, _, (_, _, i0, i1)), (acc, row_lse)) in work.iter().zip(results) {
        for (r, i) in (i0..i1).enumerate() {
            out[(i * q_heads + h) * d..][..d].copy_from_slice(&acc[r * d..(r + 1) * d]);
            lse[i * q_heads + h] = row_lse[r];
        }
    }
    Ok(())
}

/// Geometry of a paged KV cache, `[blocks][layers][keys, values][kv_heads][KEY_BLOCK][head_dim]`:
/// one kv head's keys (or values) in one block of one layer are a `KEY_BLOCK × head_dim` tile,
/// read whole by the attention kernels, and one block of every layer is a contiguous span. On
/// the CPU a key tile is stored transposed (`[head_dim × KEY_BLOCK]`, the order
/// [`attend_row`] reads), so a decode step reads the cache in place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedLayout {
    pub blocks: usize,
    pub layers: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
}

impl PagedLayout {
    /// Rows of `head_dim` elements in one block (all layers, keys and values).
    pub fn rows_per_block(&self) -> usize {
        self.layers * 2 * self.kv_heads * KEY_BLOCK
    }

    /// Rows of `head_dim` elements in the whole cache.
    pub fn rows(&self) -> usize {
        self.blocks * self.rows_per_block()
    }

    /// The row holding kv head `kv_head`'s key at `slot` of `block` in `layer`; its value is
    /// `kv_heads · KEY_BLOCK` rows further.
    pub fn key_row(&self, block: u32, layer: usize, kv_head: usize, slot: usize) -> usize {
        ((block as usize * self.layers + layer) * 2 * self.kv_heads + kv_head) * KEY_BLOCK + slot
    }

    pub fn value_offset(&self) -> usize {
        self.kv_heads * KEY_BLOCK
    }
}

/// Consecutive query rows of one sequence in a paged call: `n` rows at positions `pos0 ..
/// pos0 + n`, seeing keys `0 ..= position` through the block table `table` (block ids in
/// position order). The sequences of a call take the query rows in order.
#[derive(Debug, Clone, Copy)]
pub struct PagedRows<'a> {
    pub n: usize,
    pub pos0: usize,
    pub table: &'a [u32],
}

/// Checks a paged call: rows and tables against the layout; returns the total rows.
pub(crate) fn check_paged(
    op: &'static str,
    seqs: &[PagedRows],
    layer: usize,
    layout: PagedLayout,
) -> Result<usize> {
    ensure(layer < layout.layers, op, || format!("layer {layer} of {}", layout.layers))?;
    for (i, s) in seqs.iter().enumerate() {
        ensure(
            s.table.len() * KEY_BLOCK >= s.pos0 + s.n
                && s.table.iter().all(|&b| (b as usize) < layout.blocks),
            op,
            || {
                format!(
                    "sequence {i}: positions up to {} through {} blocks of a {}-block cache",
                    s.pos0 + s.n,
                    s.table.len(),
                    layout.blocks
                )
            },
        )?;
    }
    Ok(seqs.iter().map(|s| s.n).sum())
}

/// Attention of query rows over a paged KV cache (`cache` `[layout.rows() × head_dim]`, this
/// step's keys already written): `out` `[rows × q_heads × head_dim]` and `lse`
/// `[rows × q_heads]`, the scores formed by `scores`. Each row runs [`attend_row`] over its
/// key blocks as the training forward does, so its bits equal the packed forward's for the
/// same token.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_forward(
    out: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    cache: &[f32],
    layer: usize,
    seqs: &[PagedRows],
    q_heads: usize,
    layout: PagedLayout,
    scores: &Scores,
) -> Result<()> {
    const OP: &str = "paged_attention";
    let PagedLayout { kv_heads, head_dim: d, .. } = layout;
    let rows = check_paged(OP, seqs, layer, layout)?;
    ensure(kv_heads > 0 && q_heads.is_multiple_of(kv_heads), OP, || {
        format!("{q_heads} query heads are not a multiple of {kv_heads} kv heads")
    })?;
    ensure(
        q.len() == rows * q_heads * d
            && out.len() == q.len()
            && lse.len() == rows * q_heads
            && cache.len() == layout.rows() * d,
        OP,
        || {
            format!(
                "q {} out {} lse {} cache {} for {rows} rows",
                q.len(),
                out.len(),
                lse.len(),
                cache.len()
            )
        },
    )?;
    let group = q_heads / kv_heads;
    let mut starts = Vec::with_capacity(seqs.len());
    let mut r0 = 0;
    for s in seqs {
        starts.push(r0);
        r0 += s.n;
    }
    let work: Vec<(usize, usize)> =
        (0..seqs.len()).flat_map(|i| (0..kv_heads).map(move |g| (i, g))).collect();
    let results: Vec<Vec<(usize, Vec<f32>, f32)>> = work
        .par_iter()
        .map(|&(i, g)| {
            let s = &seqs[i];
            let visible = s.pos0 + s.n;
            // Each block's key tile (transposed, as the CPU stores it) and values, in place.
            let tiles: Vec<(usize, usize)> = (0..visible.div_ceil(KEY_BLOCK))
                .map(|b| {
                    let first = layout.key_row(s.table[b], layer, g, 0);
                    (first * d, (first + layout.value_offset()) * d)
                })
                .collect();
            let mut done = Vec::new();
            for h in g * group..(g + 1) * group {
                for r in 0..s.n {
                    let row = starts[i] + r;
                    let mut o = vec![0f32; d];
                    let visible = s.pos0 + r + 1;
                    let l = attend_row(
                        &mut o,
                        &q[(row * q_heads + h) * d..][..d],
                        (scores.first_key(visible), visible),
                        scores,
                        d,
                        |b| (&cache[tiles[b].0..][..d * KEY_BLOCK], &cache[tiles[b].1..]),
                    );
                    done.push((row * q_heads + h, o, l));
                }
            }
            done
        })
        .collect();
    for (at, o, l) in results.into_iter().flatten() {
        out[at * d..(at + 1) * d].copy_from_slice(&o);
        lse[at] = l;
    }
    Ok(())
}

/// Gradients of [`attention_forward`]: writes `dq`, `dk`, `dv` from `d_out`, using the saved
/// `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    d_out: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    out: &[f32],
    lse: &[f32],
    cu_seqlens: &[usize],
    shape: AttentionShape,
) -> Result<()> {
    let AttentionShape { q_heads, kv_heads, head_dim: d, scores } = shape;
    let tokens = lse.len() / q_heads.max(1);
    shape.check("attention_backward", tokens, q.len(), k.len(), v.len(), cu_seqlens)?;
    ensure(
        dq.len() == q.len()
            && dk.len() == k.len()
            && dv.len() == v.len()
            && d_out.len() == q.len()
            && out.len() == q.len(),
        "attention_backward",
        || format!("gradient buffers do not match q {} k {}", q.len(), k.len()),
    )?;
    let group = q_heads / kv_heads;
    let scale = scores.scale;
    let q_scaled = scaled(q, scale);
    // The keys `a + first_key(..)..=i` a query row `i` of the sequence starting at `a` sees.
    let first_of = |a: usize, i: usize| a + scores.first_key(i + 1 - a);
    // delta[t, h] = dO·O, the softmax backward's row term.
    let delta: Vec<f32> =
        d_out.par_chunks(d).zip(out.par_chunks(d)).map(|(a, b)| dot(a, b)).collect();

    // dq: tiles of query rows of one head, key blocks in order.
    let work: Vec<(usize, (usize, usize, usize, usize))> = (0..q_heads)
        .flat_map(|h| tiles(cu_seqlens, QUERY_BLOCK).into_iter().map(move |t| (h, t)))
        .collect();
    let dq_tiles: Vec<Vec<f32>> = work
        .par_iter()
        .map(|&(h, (a, _, i0, i1))| {
            let kvh = h / group;
            let mut dq_t = vec![0f32; (i1 - i0) * d];
            let (mut s, mut dp) = ([0f32; KEY_BLOCK], [0f32; KEY_BLOCK]);
            // Key blocks anchored at the sequence start, from the first one a row sees.
            let mut j0 = a + (first_of(a, i0) - a) / KEY_BLOCK * KEY_BLOCK;
            while j0 < i1 {
                let tile = KeyTile::new(k, v, j0, KEY_BLOCK.min(i1 - j0), kvh, kv_heads, d);
                for (r, i) in (i0.max(j0)..i1).map(|i| (i - i0, i)) {
                    let row = i * q_heads + h;
                    let lo = first_of(a, i).saturating_sub(tile.j0);
                    let n = tile.len.min(i + 1 - tile.j0);
                    if lo >= n {
                        continue;
                    }
                    KeyTile::project(&tile.kt, &q_scaled[row * d..][..d], &mut s);
                    KeyTile::project(&tile.vt, &d_out[row * d..][..d], &mut dp);
                    let dq_r = &mut dq_t[r * d..(r + 1) * d];
                    for jj in lo..n {
                        let score = scores.cap(s[jj]);
                        let p = (score - lse[row]).exp();
                        let ds = p * (dp[jj] - delta[row]) * scores.cap_grad(score);
                        axpy(dq_r, scale * ds, &k[((tile.j0 + jj) * kv_heads + kvh) * d..][..d]);
                    }
                }
                j0 += KEY_BLOCK;
            }
            dq_t
        })
        .collect();
    for (&(h, (_, _, i0, i1)), dq_t) in work.iter().zip(dq_tiles) {
        for (r, i) in (i0..i1).enumerate() {
            dq[(i * q_heads + h) * d..][..d].copy_from_slice(&dq_t[r * d..(r + 1) * d]);
        }
    }

    // dk, dv: tiles of keys of one kv head; queries, then the group's heads, in order.
    let work: Vec<(usize, (usize, usize, usize, usize))> = (0..kv_heads)
        .flat_map(|g| tiles(cu_seqlens, KEY_BLOCK).into_iter().map(move |t| (g, t)))
        .collect();
    let kv_tiles: Vec<(Vec<f32>, Vec<f32>)> = work
        .par_iter()
        .map(|&(kvh, (a, b, j0, j1))| {
            let tile = KeyTile::new(k, v, j0, j1 - j0, kvh, kv_heads, d);
            let (mut dk_t, mut dv_t) = (vec![0f32; tile.len * d], vec![0f32; tile.len * d]);
            let (mut s, mut dp) = ([0f32; KEY_BLOCK], [0f32; KEY_BLOCK]);
            for i in j0..b {
                let lo = first_of(a, i).saturating_sub(j0);
                let n = tile.len.min(i + 1 - j0);
                if lo >= n {
                    // Later queries see no key of this tile either.
                    break;
                }
                for h in kvh * group..(kvh + 1) * group {
                    let row = i * q_heads + h;
                    let qv = &q[row * d..][..d];
                    let dov = &d_out[row * d..][..d];
                    KeyTile::project(&tile.kt, &q_scaled[row * d..][..d], &mut s);
                    KeyTile::project(&tile.vt, dov, &mut dp);
                    for jj in lo..n {
                        let score = scores.cap(s[jj]);
                        let p = (score - lse[row]).exp();
                        axpy(&mut dv_t[jj * d..(jj + 1) * d], p, dov);
                        let ds = p * (dp[jj] - delta[row]) * scores.cap_grad(score);
                        axpy(&mut dk_t[jj * d..(jj + 1) * d], scale * ds, qv);
                    }
                }
            }
            (dk_t, dv_t)
        })
        .collect();
    for (&(kvh, (_, _, j0, j1)), (dk_t, dv_t)) in work.iter().zip(kv_tiles) {
        for (r, j) in (j0..j1).enumerate() {
            let at = (j * kv_heads + kvh) * d;
            dk[at..at + d].copy_from_slice(&dk_t[r * d..(r + 1) * d]);
            dv[at..at + d].copy_from_slice(&dv_t[r * d..(r + 1) * d]);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{Rng, check_gradient, dot as dot64};

    /// Full-matrix softmax attention in f64, one sequence and head at a time, the scores
    /// formed as `s.scores` says (scale, soft-cap, window).
    fn naive(q: &[f32], k: &[f32], v: &[f32], cu: &[usize], s: AttentionShape) -> Vec<f64> {
        let AttentionShape { q_heads, kv_heads, head_dim: d, scores } = s;
        let mut out = vec![0f64; q.len()];
        let scale = f64::from(scores.scale);
        let cap = |x: f64| scores.softcap.map_or(x, |c| f64::from(c) * (x / f64::from(c)).tanh());
        for w in cu.windows(2) {
            for h in 0..q_heads {
                let g = h / (q_heads / kv_heads);
                for i in w[0]..w[1] {
                    let first =
                        w[0] + scores.window.map_or(0, |n| (i + 1 - w[0]).saturating_sub(n));
                    let scores: Vec<f64> = (first..=i)
                        .map(|j| {
                            cap((0..d)
                                .map(|x| {
                                    f64::from(q[(i * q_heads + h) * d + x])
                                        * f64::from(k[(j * kv_heads + g) * d + x])
                                })
                                .sum::<f64>()
                                * scale)
                        })
                        .collect();
                    let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = scores.iter().map(|s| (s - m).exp()).sum();
                    for (j, s) in (first..=i).zip(&scores) {
                        let p = (s - m).exp() / z;
                        for x in 0..d {
                            out[(i * q_heads + h) * d + x] +=
                                p * f64::from(v[(j * kv_heads + g) * d + x]);
                        }
                    }
                }
            }
        }
        out
    }

    /// The shapes with a sliding window (shorter than the sequences, not a multiple of the key
    /// block), soft-capping and a scale of their own, alone and together.
    fn shaped(base: AttentionShape) -> Vec<AttentionShape> {
        let with = |scale, softcap, window| AttentionShape {
            scores: Scores { scale, softcap, window },
            ..base
        };
        vec![
            with(0.3, None, Some(70)),
            with(base.scores.scale, Some(1.5), None),
            with(0.6, Some(2.0), Some(5)),
            with(base.scores.scale, None, Some(1)),
        ]
    }

    fn forward(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        cu: &[usize],
        s: AttentionShape,
    ) -> (Vec<f32>, Vec<f32>) {
        let tokens = *cu.last().unwrap();
        let mut out = vec![f32::NAN; q.len()];
        let mut lse = vec![f32::NAN; tokens * s.q_heads];
        attention_forward(&mut out, &mut lse, q, k, v, cu, s).unwrap();
        (out, lse)
    }

    #[test]
    fn matches_full_softmax_attention_on_packed_sequences() {
        let mut rng = Rng::new(5);
        // 150 tokens in one sequence spans several key blocks.
        let mut cases = vec![
            (vec![0, 5, 9, 21], AttentionShape::new(4, 2, 8)),
            (vec![0, 150, 151], AttentionShape::new(3, 1, 16)),
        ];
        for s in shaped(AttentionShape::new(3, 1, 16)) {
            cases.push((vec![0, 150, 151, 200], s));
        }
        for (cu, s) in cases {
            let t = *cu.last().unwrap();
            let q = rng.vec(t * s.q_heads * s.head_dim, 1.0);
            let k = rng.vec(t * s.kv_heads * s.head_dim, 1.0);
            let v = rng.vec(t * s.kv_heads * s.head_dim, 1.0);
            let (out, lse) = forward(&q, &k, &v, &cu, s);
            assert!(lse.iter().all(|x| x.is_finite()));
            for (a, b) in out.iter().zip(naive(&q, &k, &v, &cu, s)) {
                assert!((f64::from(*a) - b).abs() < 1e-5, "{a} vs {b}");
            }
        }
    }

    #[test]
    fn a_sequence_ignores_its_neighbours() {
        let s = AttentionShape::new(2, 1, 4);
        let mut rng = Rng::new(6);
        let (q, mut k, v) = (rng.vec(6 * 8, 1.0), rng.vec(6 * 4, 1.0), rng.vec(6 * 4, 1.0));
        let cu = [0, 3, 6];
        let (before, _) = forward(&q, &k, &v, &cu, s);
        k[4 * 4] += 5.0; // a key of the second sequence
        let (after, _) = forward(&q, &k, &v, &cu, s);
        assert_eq!(&before[..3 * 8], &after[..3 * 8]);
        assert_ne!(&before[3 * 8..], &after[3 * 8..]);
    }

    #[test]
    fn gradients_match_finite_differences() {
        let plain = AttentionShape::new(4, 2, 4);
        for s in std::iter::once(plain).chain(shaped(plain)) {
            // A window of 70 covers these sequences; 5 and 1 cut them.
            gradients_of(s);
        }
    }

    fn gradients_of(s: AttentionShape) {
        let cu = [0, 3, 8];
        let t = 8;
        let mut rng = Rng::new(7);
        let mut q = rng.vec(t * 16, 0.7);
        let mut k = rng.vec(t * 8, 0.7);
        let mut v = rng.vec(t * 8, 0.7);
        let r = rng.vec(t * 16, 1.0);
        let (out, lse) = forward(&q, &k, &v, &cu, s);
        let (mut dq, mut dk, mut dv) =
            (vec![f32::NAN; q.len()], vec![f32::NAN; k.len()], vec![f32::NAN; v.len()]);
        attention_backward(&mut dq, &mut dk, &mut dv, &r, &q, &k, &v, &out, &lse, &cu, s).unwrap();
        let (kc, vc) = (k.clone(), v.clone());
        check_gradient("attention dq", &mut q, &dq, 128, |q| {
            dot64(&r, &forward(q, &kc, &vc, &cu, s).0)
        });
        let qc = q.clone();
        check_gradient("attention dk", &mut k, &dk, 64, |k| {
            dot64(&r, &forward(&qc, k, &vc, &cu, s).0)
        });
        let kc = k.clone();
        check_gradient("attention dv", &mut v, &dv, 64, |v| {
            dot64(&r, &forward(&qc, &kc, v, &cu, s).0)
        });
    }

    #[test]
    fn bad_shapes_are_errors() {
        let s = AttentionShape::new(3, 2, 4);
        let mut out = vec![0.0; 12];
        let mut lse = vec![0.0; 3];
        let err =
            attention_forward(&mut out, &mut lse, &[0.0; 12], &[0.0; 8], &[0.0; 8], &[0, 1], s);
        assert!(err.unwrap_err().to_string().contains("multiple"));
        let s = AttentionShape::new(2, 1, 2);
        let mut lse = vec![0.0; 6];
        let err =
            attention_forward(&mut out, &mut lse, &[0.0; 12], &[0.0; 6], &[0.0; 6], &[0, 2], s);
        assert!(err.unwrap_err().to_string().contains("cu_seqlens"));
    }
}
