// Causal grouped-query attention over packed sequences, forward and backward, in the order of
// the CPU reference (crates/miles-tensor/src/cpu/attention.rs): key blocks of KB keys anchored
// at each sequence's first token, one online-softmax step per block, every sum over keys taken
// in key order. A row's result depends only on its own sequence, never on where it sits in the
// pack or how many sequences share the batch: that is what lets rollout and training agree.
//
// Layout: q [tokens × q_heads × d], k and v [tokens × kv_heads × d], f32 or bf16 (widened to
// f32 in shared memory; all arithmetic f32). `tiles` holds three ints per tile: the sequence's
// first token, its end, and the tile's first row (query rows for the forward and dq, keys for
// dk/dv), as the host's tiles() lists them. Grid: (tiles, heads).
//
// The forward and dq kernels give each warp whole query rows: lanes take keys to form the
// block's scores (a dot product in dimension order, as the CPU's), then take four consecutive
// dimensions each to accumulate over the block's keys in order (the scores passed by shuffle).
// dk/dv gives each warp KEYS_PER_WARP keys and walks the (query, head) pairs in order. Shared
// memory is read 4 floats at a time (head_dim a multiple of 4; key rows padded by 4 floats so
// the lanes' 16-byte reads of different keys fall in different banks); a lane keeps dimensions
// 4·lane.. and 128 + 4·lane.. (head_dim ≤ 256).
//
// Scores as cpu::Scores forms them: the scaled product, soft-capped to cap · tanh(s / cap) when
// cap > 0, over keys j of a query i with i − window < j ≤ i when window > 0; blocks before a
// row's window are skipped, as the CPU skips them.
#include "common.cuh"

namespace {

constexpr int KB = 64;            // keys per block (cpu::KEY_BLOCK)
constexpr int QB = 64;            // query rows per tile (the CPU's QUERY_BLOCK)
constexpr int WARPS = 8;
constexpr int THREADS = WARPS * 32;
constexpr int ROWS_PER_WARP = QB / WARPS;
constexpr int CHUNKS = 2;         // groups of 4 dimensions per lane: head_dim ≤ 256
constexpr int MAXC = 4 * CHUNKS;  // dimensions per lane
constexpr int PAD = 4;            // floats of padding per key row
constexpr int PAIRS = 16;         // (query, head) pairs staged at a time by dk/dv
constexpr int KEYS_PER_WARP = KB / WARPS;
constexpr unsigned FULL = 0xffffffffu;

__device__ __forceinline__ float f32(float x) { return x; }
__device__ __forceinline__ float f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void put(float* p, float x) { *p = x; }
__device__ __forceinline__ void put(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// The scores' form: see the top of the file.
struct Scoring {
    float scale, cap;
    int window;
    // A score from the scaled product.
    __device__ __forceinline__ float form(float s) const {
        return cap > 0.0f ? cap * tanhf(s / cap) : s;
    }
    // d(score)/d(scaled product), from the score.
    __device__ __forceinline__ float slope(float score) const {
        return cap > 0.0f ? 1.0f - (score / cap) * (score / cap) : 1.0f;
    }
    // The first key (of its sequence) that a query seeing `visible` keys attends to.
    __device__ __forceinline__ int first(int visible) const {
        return window > 0 ? max(0, visible - window) : 0;
    }
};

// Keys j0..j0+n of kv head `kvh` into ks (row stride d+PAD) and, when vs is given, the values
// with row stride vstride.
template <typename T>
__device__ void load_block(float* ks, float* vs, int vstride, const T* k, const T* v, int j0,
                           int n, int kv_heads, int kvh, int d) {
    for (int e = threadIdx.x; e < n * d; e += THREADS) {
        const int jj = e / d;
        const int x = e - jj * d;
        const size_t at = ((size_t)(j0 + jj) * kv_heads + kvh) * d + x;
        ks[jj * (d + PAD) + x] = f32(k[at]);
        if (vs != nullptr) {
            vs[jj * vstride + x] = f32(v[at]);
        }
    }
}

// Σ_x a[x]·t[x] in dimension order (the CPU's project()), 4 floats per shared-memory read;
// `scale` multiplies each a[x] first (the CPU's pre-scaled queries).
__device__ __forceinline__ float dot_in_order(const float* a, const float* t, int d,
                                              float scale = 1.0f) {
    float s = 0.0f;
    for (int x = 0; x < d; x += 4) {
        const float4 u = *reinterpret_cast<const float4*>(a + x);
        const float4 v = *reinterpret_cast<const float4*>(t + x);
        s += (u.x * scale) * v.x;
        s += (u.y * scale) * v.y;
        s += (u.z * scale) * v.z;
        s += (u.w * scale) * v.w;
    }
    return s;
}

// acc[4·c + e] += g · row[128·c + 4·lane + e] for this lane's dimensions (four per chunk).
__device__ __forceinline__ void axpy4(float* acc, float g, const float* row, int lane, int d) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int x = 128 * c + 4 * lane;
        if (x < d) {
            const float4 v = *reinterpret_cast<const float4*>(row + x);
            acc[4 * c] += g * v.x;
            acc[4 * c + 1] += g * v.y;
            acc[4 * c + 2] += g * v.z;
            acc[4 * c + 3] += g * v.w;
        }
    }
}

// Writes this lane's dimensions of a row.
template <typename T>
__device__ __forceinline__ void put4(T* row, const float* acc, float mul, int lane, int d) {
#pragma unroll
    for (int c = 0; c < CHUNKS; ++c) {
        const int x = 128 * c + 4 * lane;
        if (x < d) {
#pragma unroll
            for (int e = 0; e < 4; ++e) put(row + x + e, acc[4 * c + e] * mul);
        }
    }
}

template <typename T>
__device__ void forward(T* out, float* lse, const T* q, const T* k, const T* v, const int* tiles,
                        int q_heads, int kv_heads, int d, Scoring sc) {
    extern __shared__ float smem[];
    float* ks = smem;                       // [KB][d+PAD]
    float* vs = ks + KB * (d + PAD);        // [KB][d]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    float* qs = vs + KB * d + warp * d;     // this warp's scaled query row
    const int a = tiles[3 * blockIdx.x];
    const int i0 = tiles[3 * blockIdx.x + 2];
    const int i1 = min(i0 + QB, tiles[3 * blockIdx.x + 1]);
    const int h = blockIdx.y;
    const int kvh = h / (q_heads / kv_heads);

    float m[ROWS_PER_WARP], l[ROWS_PER_WARP], acc[ROWS_PER_WARP][MAXC];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
#pragma unroll
        for (int c = 0; c < MAXC; ++c) acc[r][c] = 0.0f;
    }
    const int blocks = (i1 - a + KB - 1) / KB;
    for (int b = sc.first(i0 + 1 - a) / KB; b < blocks; ++b) {
        const int j0 = a + b * KB;
        __syncthreads();  // the previous block's readers are done
        load_block(ks, vs, d, k, v, j0, min(KB, i1 - j0), kv_heads, kvh, d);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = i0 + warp + r * WARPS;
            const int visible = i + 1 - a;
            const int lo = sc.first(visible) - b * KB;  // the block's first key this row sees
            // Uniform across the warp: no row, or the block is past the row or before its window.
            if (i >= i1 || visible <= b * KB || lo >= KB) continue;
            const int n = min(KB, visible - b * KB);
            const T* qi = q + ((size_t)i * q_heads + h) * d;
            for (int x = lane; x < d; x += 32) qs[x] = f32(qi[x]) * sc.scale;
            __syncwarp();
            const float s0 = lane < n && lane >= lo
                                 ? sc.form(dot_in_order(qs, ks + lane * (d + PAD), d))
                                 : -INFINITY;
            const float s1 = lane + 32 < n && lane + 32 >= lo
                                 ? sc.form(dot_in_order(qs, ks + (lane + 32) * (d + PAD), d))
                                 : -INFINITY;
            __syncwarp();  // qs is rewritten by the next row
            const float new_m = fmaxf(m[r], miles::warp_max(fmaxf(s0, s1)));
            const float rescale = expf(m[r] - new_m);
            l[r] *= rescale;
#pragma unroll
            for (int c = 0; c < MAXC; ++c) acc[r][c] *= rescale;
            const float p0 = lane < n && lane >= lo ? expf(s0 - new_m) : 0.0f;
            const float p1 = lane + 32 < n && lane + 32 >= lo ? expf(s1 - new_m) : 0.0f;
            for (int jj = max(lo, 0); jj < n; ++jj) {
                const float p = __shfl_sync(FULL, jj < 32 ? p0 : p1, jj & 31);
                l[r] += p;
                axpy4(acc[r], p, vs + jj * d, lane, d);
            }
            m[r] = new_m;
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = i0 + warp + r * WARPS;
        if (i >= i1) continue;
        const size_t row = (size_t)i * q_heads + h;
        put4(out + row * d, acc[r], 1.0f / l[r], lane, d);
        if (lane == 0) lse[row] = m[r] + logf(l[r]);
    }
}

// delta[row] = dO·O per (token, head): the softmax backward's row term. One warp per row.
template <typename T>
__device__ void delta(float* out, const T* d_out, const T* o, long rows, int d) {
    const long warps = (long)gridDim.x * (blockDim.x >> 5);
    const int lane = threadIdx.x & 31;
    for (long row = (long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); row < rows;
         row += warps) {
        float s = 0.0f;
        for (int x = lane; x < d; x += 32) s += f32(d_out[row * d + x]) * f32(o[row * d + x]);
        s = miles::warp_sum(s);
        if (lane == 0) out[row] = s;
    }
}

// dq for a tile of query rows of one head: Σ over visible keys in order of scale·ds·k.
template <typename T>
__device__ void backward_dq(T* dq, const T* d_out, const T* q, const T* k, const T* v,
                            const float* lse, const float* delta, const int* tiles, int q_heads,
                            int kv_heads, int d, Scoring sc) {
    extern __shared__ float smem[];
    float* ks = smem;                       // [KB][d+PAD]
    float* vs = ks + KB * (d + PAD);        // [KB][d+PAD]
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    float* qs = vs + KB * (d + PAD) + warp * 2 * d;
    float* dos = qs + d;
    const int a = tiles[3 * blockIdx.x];
    const int i0 = tiles[3 * blockIdx.x + 2];
    const int i1 = min(i0 + QB, tiles[3 * blockIdx.x + 1]);
    const int h = blockIdx.y;
    const int kvh = h / (q_heads / kv_heads);

    float acc[ROWS_PER_WARP][MAXC];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r)
#pragma unroll
        for (int c = 0; c < MAXC; ++c) acc[r][c] = 0.0f;
    const int blocks = (i1 - a + KB - 1) / KB;
    for (int b = sc.first(i0 + 1 - a) / KB; b < blocks; ++b) {
        const int j0 = a + b * KB;
        __syncthreads();
        load_block(ks, vs, d + PAD, k, v, j0, min(KB, i1 - j0), kv_heads, kvh, d);
        __syncthreads();
#pragma unroll
        for (int r = 0; r < ROWS_PER_WARP; ++r) {
            const int i = i0 + warp + r * WARPS;
            const int visible = i + 1 - a;
            const int lo = sc.first(visible) - b * KB;
            if (i >= i1 || visible <= b * KB || lo >= KB) continue;
            const int n = min(KB, visible - b * KB);
            const size_t row = (size_t)i * q_heads + h;
            for (int x = lane; x < d; x += 32) {
                qs[x] = f32(q[row * d + x]) * sc.scale;
                dos[x] = f32(d_out[row * d + x]);
            }
            __syncwarp();
            const float lse_r = lse[row];
            const float delta_r = delta[row];
            float ds0 = 0.0f, ds1 = 0.0f;
            if (lane < n && lane >= lo) {
                const float score = sc.form(dot_in_order(qs, ks + lane * (d + PAD), d));
                const float p = expf(score - lse_r);
                ds0 = p * (dot_in_order(dos, vs + lane * (d + PAD), d) - delta_r) *
                      sc.slope(score);
            }
            if (lane + 32 < n && lane + 32 >= lo) {
                const float score = sc.form(dot_in_order(qs, ks + (lane + 32) * (d + PAD), d));
                const float p = expf(score - lse_r);
                ds1 = p * (dot_in_order(dos, vs + (lane + 32) * (d + PAD), d) - delta_r) *
                      sc.slope(score);
            }
            __syncwarp();
            for (int jj = max(lo, 0); jj < n; ++jj) {
                const float g = sc.scale * __shfl_sync(FULL, jj < 32 ? ds0 : ds1, jj & 31);
                axpy4(acc[r], g, ks + jj * (d + PAD), lane, d);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int i = i0 + warp + r * WARPS;
        if (i >= i1) continue;
        const size_t row = (size_t)i * q_heads + h;
        put4(dq + row * d, acc[r], 1.0f, lane, d);
    }
}

// dk and dv for a block of keys of one kv head: the (query, head) pairs that see it, queries
// in order and the group's heads in order within each, as the CPU sums them.
template <typename T>
__device__ void backward_dkdv(T* dk, T* dv, const T* d_out, const T* q, const T* k, const T* v,
                              const float* lse, const float* delta, const int* tiles,
                              int q_heads, int kv_heads, int d, Scoring sc) {
    extern __shared__ float smem[];
    float* ks = smem;                       // [KB][d+PAD]
    float* vs = ks + KB * (d + PAD);        // [KB][d+PAD]
    float* qst = vs + KB * (d + PAD);       // [PAIRS][d] queries (unscaled)
    float* dost = qst + PAIRS * d;          // [PAIRS][d] output gradients
    float* ps = dost + PAIRS * d;           // [PAIRS][KB] probabilities
    float* dss = ps + PAIRS * KB;           // [PAIRS][KB] score gradients
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int j0 = tiles[3 * blockIdx.x + 2];
    const int len = min(KB, tiles[3 * blockIdx.x + 1] - j0);
    // The queries that see a key of the block: up to the sequence's end, or the window's.
    const int end = sc.window > 0 ? min(tiles[3 * blockIdx.x + 1], j0 + len - 1 + sc.window)
                                  : tiles[3 * blockIdx.x + 1];
    const int kvh = blockIdx.y;
    const int group = q_heads / kv_heads;

    load_block(ks, vs, d + PAD, k, v, j0, len, kv_heads, kvh, d);
    float ak[KEYS_PER_WARP][MAXC], av[KEYS_PER_WARP][MAXC];
#pragma unroll
    for (int kk = 0; kk < KEYS_PER_WARP; ++kk)
#pragma unroll
        for (int c = 0; c < MAXC; ++c) ak[kk][c] = av[kk][c] = 0.0f;

    const int pairs = (end - j0) * group;
    for (int p0 = 0; p0 < pairs; p0 += PAIRS) {
        const int np = min(PAIRS, pairs - p0);
        __syncthreads();  // the tiles are loaded; the previous batch's readers are done
        for (int e = threadIdx.x; e < np * d; e += THREADS) {
            const int pp = e / d;
            const int x = e - pp * d;
            const int pair = p0 + pp;
            const size_t row = (size_t)(j0 + pair / group) * q_heads + kvh * group + pair % group;
            qst[pp * d + x] = f32(q[row * d + x]);
            dost[pp * d + x] = f32(d_out[row * d + x]);
        }
        __syncthreads();
        // Phase A: one (pair, key) per thread and step, keys along the lanes.
        for (int e = threadIdx.x; e < np * KB; e += THREADS) {
            const int pp = e / KB;
            const int jj = e - pp * KB;
            const int pair = p0 + pp;
            const int i = j0 + pair / group;
            const size_t row = (size_t)i * q_heads + kvh * group + pair % group;
            float p = 0.0f, ds = 0.0f;
            // Keys j0 + jj with i − window < j0 + jj ≤ i.
            if (jj < min(len, i + 1 - j0) && (sc.window <= 0 || j0 + jj > i - sc.window)) {
                const float s = sc.form(
                    dot_in_order(qst + pp * d, ks + jj * (d + PAD), d, sc.scale));
                p = expf(s - lse[row]);
                ds = p * (dot_in_order(dost + pp * d, vs + jj * (d + PAD), d) - delta[row]) *
                     sc.slope(s);
            }
            ps[pp * KB + jj] = p;
            dss[pp * KB + jj] = ds;
        }
        __syncthreads();
        // Phase B: this warp's keys, dimensions along the lanes, pairs in order.
        for (int pp = 0; pp < np; ++pp) {
            const int i = j0 + (p0 + pp) / group;
            const int n = min(len, i + 1 - j0);
            const int lo = sc.window > 0 ? i + 1 - sc.window - j0 : 0;  // may be negative
#pragma unroll
            for (int kk = 0; kk < KEYS_PER_WARP; ++kk) {
                const int jj = warp * KEYS_PER_WARP + kk;
                if (jj >= n || jj < lo) continue;
                axpy4(av[kk], ps[pp * KB + jj], dost + pp * d, lane, d);
                axpy4(ak[kk], sc.scale * dss[pp * KB + jj], qst + pp * d, lane, d);
            }
        }
    }
#pragma unroll
    for (int kk = 0; kk < KEYS_PER_WARP; ++kk) {
        const int jj = warp * KEYS_PER_WARP + kk;
        if (jj >= len) continue;
        const size_t at = ((size_t)(j0 + jj) * kv_heads + kvh) * d;
        put4(dk + at, ak[kk], 1.0f, lane, d);
        put4(dv + at, av[kk], 1.0f, lane, d);
    }
}

}  // namespace

#define ATTENTION_KERNELS(SUFFIX, T)                                                             \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_forward_##SUFFIX(            \
        T* out, float* lse, const T* q, const T* k, const T* v, const int* tiles, int q_heads,   \
        int kv_heads, int d, float scale, float cap, int window) {                               \
        forward(out, lse, q, k, v, tiles, q_heads, kv_heads, d, {scale, cap, window});           \
    }                                                                                            \
    extern "C" __global__ void attention_delta_##SUFFIX(float* out, const T* d_out, const T* o,  \
                                                        long rows, int d) {                      \
        delta(out, d_out, o, rows, d);                                                           \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_dq_##SUFFIX(                 \
        T* dq, const T* d_out, const T* q, const T* k, const T* v, const float* lse,             \
        const float* delta, const int* tiles, int q_heads, int kv_heads, int d, float scale,     \
        float cap, int window) {                                                                 \
        backward_dq(dq, d_out, q, k, v, lse, delta, tiles, q_heads, kv_heads, d,                 \
                    {scale, cap, window});                                                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_dkdv_##SUFFIX(               \
        T* dk, T* dv, const T* d_out, const T* q, const T* k, const T* v, const float* lse,      \
        const float* delta, const int* tiles, int q_heads, int kv_heads, int d, float scale,     \
        float cap, int window) {                                                                 \
        backward_dkdv(dk, dv, d_out, q, k, v, lse, delta, tiles, q_heads, kv_heads, d,           \
                      {scale, cap, window});                                                     \
    }

ATTENTION_KERNELS(f32, float)
ATTENTION_KERNELS(bf16, __nv_bfloat16)
