// Causal grouped-query attention over packed sequences on the tensor cores (mma.sync m16n8k16,
// bf16 operands, f32 accumulation): the bf16 route of ops::attention_{forward,backward} and
// of the paged attention, at every head size that is a multiple of 16 up to 256. attention.cu
// keeps f32.
//
// The reduction structure is the one of attention.cu and the CPU reference: key blocks of KB
// keys anchored at each sequence's first token, one online-softmax step per block. A query row
// sits in one row of an m16 fragment; its scores, softmax step and P·V products never mix with
// other rows and the order of every sum is fixed by the block and fragment shapes alone. So a
// row's bits depend on its own sequence only: not on the pack, the batch size, which row of the
// tile it occupies, nor on how many rows share its tile (a decode step with one query row in a
// tile gives the same bits). Blocks past a row's diagonal add exact zeros.
//
// How scores are formed (cpu::Scores): scale · q·k, soft-capped to cap · tanh(s / cap) when
// cap > 0 (Gemma 2), over the keys j of a query i with i − window < j ≤ i when window > 0
// (sliding layers). Blocks wholly outside a row's keys add exact zeros to it (the online
// softmax's rescale is then 1), so the kernels skip them without changing a bit.
//
// Layout as attention.cu: q [tokens × q_heads × D], k and v [tokens × kv_heads × D], bf16; lse
// f32 [tokens × q_heads] (natural log of the scaled scores' sum of exponentials); `tiles` holds
// [sequence start, sequence end, tile start] per tile. Grid (tiles, heads), 4 warps per block.
// The forward and dq give each warp 16 query rows of a 64-row tile; dk/dv gives each warp 16
// keys of a key block and walks the queries that see them in chunks of QC. Each kernel loads
// the next key block (or query chunk) with cp.async into the other of two shared buffers while
// it computes the current one.
#include "mma.cuh"

namespace {

constexpr int KB = 64;       // keys per block (cpu::KEY_BLOCK)
constexpr int QB = 64;       // query rows per tile (cpu::QUERY_BLOCK)
constexpr int QC = 32;       // query rows per step of dk/dv
constexpr int WARPS = 4;
constexpr int THREADS = WARPS * 32;
constexpr int SKEW = 8;      // bf16 of padding per shared-memory row: ldmatrix without conflicts
constexpr float LOG2E = 1.4426950408889634f;

using namespace miles;

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&v);
}

// Rows [0, rows) of width D from global `src` (row r at src + r·stride) into shared `dst` (row
// stride D + SKEW) as cp.async copies of 16 bytes, rows past n zero-filled by the copy itself,
// so the next block's rows stream in while the current one is computed. They have landed after
// the wait() that follows their commit(), and a barrier.
template <int D, int NT = THREADS>
__device__ __forceinline__ void load_rows_async(bf16* dst, const bf16* src, size_t stride,
                                                int rows, int n) {
    constexpr int CHUNKS = D / 8;
    for (int e = threadIdx.x; e < rows * CHUNKS; e += NT) {
        const int r = e / CHUNKS;
        const int c = (e - r * CHUNKS) * 8;
        // A zero-filled row reads nothing; its address only has to be valid: row 0's.
        const bf16* from = src + (r < n ? r : 0) * stride + c;
        const int bytes = r < n ? 16 : 0;
        cp_async16(dst + r * (D + SKEW) + c, from, bytes);
    }
}

// The A fragment (16 rows × 16 columns at column k0) of a row-major shared tile.
template <int D>
__device__ __forceinline__ void load_a(uint32_t* a, const bf16* tile, int row0, int k0) {
    const int lane = threadIdx.x & 31;
    const int r = row0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldsm_x4(a, tile + r * (D + SKEW) + k0 + (lane >> 4) * 8);
}

// B fragments of two n-tiles (rows n0..n0+15 of a row-major tile as the columns of B, their
// columns k0..k0+15 as its rows): b[0..2] for rows n0..n0+7, b[2..4] for n0+8..n0+15.
template <int D>
__device__ __forceinline__ void load_b(uint32_t* b, const bf16* tile, int n0, int k0) {
    const int lane = threadIdx.x & 31;
    const int r = n0 + (lane & 7) + (lane >> 4) * 8;
    ldsm_x4(b, tile + r * (D + SKEW) + k0 + ((lane >> 3) & 1) * 8);
}

// B fragments of a row-major tile read as B itself (rows k0..k0+15 of the tile are the k of
// B, its columns n0..n0+15 two n-tiles): b[0..2] for columns n0..n0+7, b[2..4] for n0+8...
template <int D>
__device__ __forceinline__ void load_b_t(uint32_t* b, const bf16* tile, int k0, int n0) {
    const int lane = threadIdx.x & 31;
    const int r = k0 + (lane & 7) + ((lane >> 3) & 1) * 8;
    ldsm_x4_t(b, tile + r * (D + SKEW) + n0 + (lane >> 4) * 8);
}

// s[n-tile][4] = rows(a-tile, row0..row0+15) · rows(b-tile, 0..KB)ᵀ over D: a row's scores
// against a block's keys (or dO·Vᵀ), the sum over dimensions in k-steps of 16.
template <int D, int N>
__device__ __forceinline__ void scores(float (*s)[4], const bf16* a_tile, int row0,
                                       const bf16* b_tile) {
#pragma unroll
    for (int n = 0; n < N; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
    for (int k = 0; k < D / 16; ++k) {
        uint32_t a[4];
        load_a<D>(a, a_tile, row0, k * 16);
#pragma unroll
        for (int n = 0; n < N; n += 2) {
            uint32_t b[4];
            load_b<D>(b, b_tile, n * 8, k * 16);
            mma(s[n], a, b);
            mma(s[n + 1], a, b + 2);
        }
    }
}

// acc[D/8][4] += p (16 × 8·N, C-fragment layout, rounded to bf16) · tile rows 0..8·N (× D).
template <int D, int N>
__device__ __forceinline__ void accumulate(float (*acc)[4], const float (*p)[4], const bf16* tile) {
#pragma unroll
    for (int k = 0; k < N / 2; ++k) {
        const uint32_t a[4] = {pack(p[2 * k][0], p[2 * k][1]), pack(p[2 * k][2], p[2 * k][3]),
                               pack(p[2 * k + 1][0], p[2 * k + 1][1]),
                               pack(p[2 * k + 1][2], p[2 * k + 1][3])};
#pragma unroll
        for (int n = 0; n < D / 8; n += 2) {
            uint32_t b[4];
            load_b_t<D>(b, tile, k * 16, n * 8);
            mma(acc[n], a, b);
            mma(acc[n + 1], a, b + 2);
        }
    }
}

// Sum over the four lanes of a quad (the lanes that share a fragment row), in a fixed order.
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}

// The scores' form: see the top of the file.
struct Scoring {
    float scale, cap;
    int window;
    // The exponent's factor and the unit of lse: capped scores are formed already scaled.
    __device__ __forceinline__ float unit() const { return cap > 0.0f ? 1.0f : scale; }
    // A score from the raw product q·k (scaled only when capped: see unit()).
    __device__ __forceinline__ float form(float s) const {
        return cap > 0.0f ? __fmul_rn(cap, tanhf(__fmul_rn(s, scale / cap))) : s;
    }
    // d(score)/d(scale · q·k), from the formed score.
    __device__ __forceinline__ float slope(float score) const {
        return cap > 0.0f ? 1.0f - (score / cap) * (score / cap) : 1.0f;
    }
    __device__ __forceinline__ bool sees(int i, int j) const {
        return j <= i && (window <= 0 || j > i - window);
    }
    // The first key a query at position i sees (0 without a window).
    __device__ __forceinline__ int first(int i) const {
        return window > 0 ? max(0, i + 1 - window) : 0;
    }
};

// A query tile of the forward: rows q0 .. q0 + n of q (and of out, lse), one sequence's
// positions pos0 .. pos0 + n, seeing keys 0 .. pos0 + n.
struct QueryTile {
    int q0, n, pos0;
};

// The keys of packed sequences: key j of the sequence starting at row `start` is row start + j
// of k and v ([tokens × kv_heads × D]).
struct PackedKeys {
    const bf16* k;
    const bf16* v;
    size_t stride;
    int start;
    template <int D>
    __device__ __forceinline__ void block(int b, int kvh, const bf16** kb, const bf16** vb,
                                          size_t* rs) const {
        const size_t at = (size_t)(start + b * KB) * stride + kvh * D;
        *kb = k + at;
        *vb = v + at;
        *rs = stride;
    }
};

// The keys of the paged KV cache: key block b of a sequence is cache block table[b], laid out
// [blocks][layers][keys, values][kv_heads][KB][D]; a block of one kv head is a KB × D tile.
struct PagedKeys {
    const bf16* cache;
    const int* table;
    int layer, layers, kv_heads;
    template <int D>
    __device__ __forceinline__ void block(int b, int kvh, const bf16** kb, const bf16** vb,
                                          size_t* rs) const {
        const size_t tile = (size_t)KB * D;
        const size_t base = ((size_t)table[b] * layers + layer) * 2 * kv_heads * tile;
        *kb = cache + base + kvh * tile;
        *vb = *kb + kv_heads * tile;
        *rs = D;
    }
};

// One online-softmax step of a warp's 16 query rows (rows row0.. of the shared tile `qs`, at
// positions pa for fragment rows g and pb for g + 8) over the key block at j0 (keys `ks`,
// values `vs` in shared memory): scores, the causal mask, the rescale of l and acc, then
// acc += p·V. The forward and the decode kernel share it, so a row's bits are the same in both.
template <int D>
__device__ __forceinline__ void block_step(float (*acc)[4], float* m, float* l, const bf16* qs,
                                           int row0, const bf16* ks, const bf16* vs, int j0,
                                           int pa, int pb, Scoring sc) {
    const int t = threadIdx.x & 3;
    const float sl2 = sc.unit() * LOG2E;
    float s[KB / 8][4];
    scores<D, KB / 8>(s, qs, row0, ks);
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int nt = 0; nt < KB / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int j = j0 + nt * 8 + 2 * t + (e & 1);
            const int i = e < 2 ? pa : pb;
            s[nt][e] = sc.sees(i, j) ? sc.form(s[nt][e]) : -INFINITY;
            mx[e >> 1] = fmaxf(mx[e >> 1], s[nt][e]);
        }
    }
    float base[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const float new_m = fmaxf(m[r], quad_max(mx[r]));
        // A row that has seen no key yet keeps m = -inf: exponents from 0 then.
        const float use = new_m == -INFINITY ? 0.0f : new_m;
        const float alpha = exp2f(__fmul_rn(m[r] - use, sl2));
        l[r] = __fmul_rn(l[r], alpha);
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
            acc[nn][2 * r] = __fmul_rn(acc[nn][2 * r], alpha);
            acc[nn][2 * r + 1] = __fmul_rn(acc[nn][2 * r + 1], alpha);
        }
        m[r] = new_m;
        base[r] = __fmul_rn(use, sl2);
    }
#pragma unroll
    for (int nt = 0; nt < KB / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const float p = exp2f(__fmaf_rn(s[nt][e], sl2, -base[e >> 1]));
            s[nt][e] = p;
            l[e >> 1] = __fadd_rn(l[e >> 1], p);
        }
    }
    accumulate<D, KB / 8>(acc, s, vs);
}

template <int D, class Keys>
__device__ void forward(bf16* out, float* lse, const bf16* q, QueryTile tile, Keys keys,
                        int q_heads, int kv_heads, Scoring sc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [QB][D+SKEW]
    bf16* kv = qs + QB * (D + SKEW);                  // 2 × ([KB][D+SKEW] keys, then values)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int n = tile.n, pos0 = tile.pos0, kv_len = tile.pos0 + tile.n;
    const int h = blockIdx.y;
    const int kvh = h / (q_heads / kv_heads);
    const size_t q_stride = (size_t)q_heads * D;
    // Block b's keys and values go to buffer b % 2; block b + 1 loads while b is computed.
    auto load_block = [&](int b) {
        const bf16 *kb, *vb;
        size_t rs;
        keys.template block<D>(b, kvh, &kb, &vb, &rs);
        bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        const int valid = min(KB, kv_len - b * KB);
        load_rows_async<D>(ks, kb, rs, KB, valid);
        load_rows_async<D>(ks + KB * (D + SKEW), vb, rs, KB, valid);
    };

    // The first block that the tile's first row sees.
    const int b0 = sc.first(pos0) / KB;
    load_rows_async<D>(qs, q + (size_t)tile.q0 * q_stride + h * D, q_stride, QB, n);
    load_block(b0);
    commit();
    // This warp's rows are 16·warp + g and + 8 of the tile, at positions pa and pb.
    const int row0 = warp * 16;
    const int pa = pos0 + row0 + g, pb = pa + 8;
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[D / 8][4];
#pragma unroll
    for (int nn = 0; nn < D / 8; ++nn) acc[nn][0] = acc[nn][1] = acc[nn][2] = acc[nn][3] = 0.0f;

    const int blocks = (kv_len + KB - 1) / KB;
    for (int b = b0; b < blocks; ++b) {
        const int j0 = b * KB;
        if (b + 1 < blocks) {
            load_block(b + 1);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();  // block b (and the queries) are in shared memory for every thread
        const bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        const bf16* vs = ks + KB * (D + SKEW);
        // Else this warp has no rows, or every row is before the block or past its window.
        if (row0 < n && j0 <= pos0 + row0 + 15 &&
            (sc.window <= 0 || j0 + KB - 1 > pos0 + row0 - sc.window)) {
            block_step<D>(acc, m, l, qs, row0, ks, vs, j0, pa, pb, sc);
        }
        __syncthreads();  // buffer b % 2 is free for block b + 2
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = row0 + g + 8 * r;
        const float sum = quad_sum(l[r]);
        if (rr >= n) continue;
        const size_t row = (size_t)(tile.q0 + rr) * q_heads + h;
        const float inv = 1.0f / sum;
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
            *reinterpret_cast<__nv_bfloat162*>(out + row * D + nn * 8 + 2 * t) =
                __floats2bfloat162_rn(__fmul_rn(acc[nn][2 * r], inv),
                                      __fmul_rn(acc[nn][2 * r + 1], inv));
        }
        if (t == 0) lse[row] = __fmaf_rn(m[r], sc.unit(), logf(sum));
    }
}

// A decode step's attention, where every tile is one query row: one warp per (row, kv head),
// whose 16 fragment rows are the group's query heads at the row's position (rows past the group
// are zeros). Each head's row goes through the forward's block_step over the same key blocks,
// so it gets the forward's bits, with a warp and under a third of the shared memory per tile
// instead of four warps per query head.
template <int D>
__device__ void decode(bf16* out, float* lse, const bf16* q, int q0, int pos0, PagedKeys keys,
                       int q_heads, int kv_heads, Scoring sc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [16][D+SKEW]
    bf16* kv = qs + 16 * (D + SKEW);                  // 2 × ([KB][D+SKEW] keys, then values)
    const int lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int kvh = blockIdx.y, group = q_heads / kv_heads;
    const int kv_len = pos0 + 1;
    auto load_block = [&](int b) {
        const bf16 *kb, *vb;
        size_t rs;
        keys.template block<D>(b, kvh, &kb, &vb, &rs);
        bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        const int valid = min(KB, kv_len - b * KB);
        load_rows_async<D, 32>(ks, kb, rs, KB, valid);
        load_rows_async<D, 32>(ks + KB * (D + SKEW), vb, rs, KB, valid);
    };
    // The group's heads are consecutive in q's row q0.
    load_rows_async<D, 32>(qs, q + ((size_t)q0 * q_heads + kvh * group) * D, D, 16, group);
    const int b0 = sc.first(pos0) / KB;
    load_block(b0);
    commit();
    float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    float acc[D / 8][4];
#pragma unroll
    for (int nn = 0; nn < D / 8; ++nn) acc[nn][0] = acc[nn][1] = acc[nn][2] = acc[nn][3] = 0.0f;
    const int blocks = (kv_len + KB - 1) / KB;
    for (int b = b0; b < blocks; ++b) {
        if (b + 1 < blocks) {
            load_block(b + 1);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        __syncwarp();  // block b (and the queries) are in shared memory for every lane
        const bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        block_step<D>(acc, m, l, qs, 0, ks, ks + KB * (D + SKEW), b * KB, pos0, pos0, sc);
        __syncwarp();  // buffer b % 2 is free for block b + 2
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int rr = g + 8 * r;
        const float sum = quad_sum(l[r]);
        if (rr >= group) continue;
        const size_t row = (size_t)q0 * q_heads + kvh * group + rr;
        const float inv = 1.0f / sum;
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
            *reinterpret_cast<__nv_bfloat162*>(out + row * D + nn * 8 + 2 * t) =
                __floats2bfloat162_rn(__fmul_rn(acc[nn][2 * r], inv),
                                      __fmul_rn(acc[nn][2 * r + 1], inv));
        }
        if (t == 0) lse[row] = __fmaf_rn(m[r], sc.unit(), logf(sum));
    }
}

// dq for a tile of query rows of one head: Σ over visible keys, block by block, of
// scale · ds · k with ds = p ⊙ (dO·vᵀ − delta) ⊙ slope and p recomputed from lse.
template <int D>
__device__ void backward_dq(bf16* dq, const bf16* d_out, const bf16* q, const bf16* k,
                            const bf16* v, const float* lse, const float* delta, const int* tiles,
                            int q_heads, int kv_heads, Scoring sc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* qs = reinterpret_cast<bf16*>(smem_raw);  // [QB][D+SKEW]
    bf16* dos = qs + QB * (D + SKEW);                 // [QB][D+SKEW]
    bf16* kv = dos + QB * (D + SKEW);                 // 2 × ([KB][D+SKEW] keys, then values)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int a = tiles[3 * blockIdx.x];
    const int i0 = tiles[3 * blockIdx.x + 2];
    const int i1 = min(i0 + QB, tiles[3 * blockIdx.x + 1]);
    const int h = blockIdx.y;
    const int kvh = h / (q_heads / kv_heads);
    const size_t q_stride = (size_t)q_heads * D, kv_stride = (size_t)kv_heads * D;
    const float sl2 = sc.unit() * LOG2E;
    // As the forward: block b in buffer b % 2, block b + 1 loading while b is computed.
    auto load_block = [&](int b) {
        const int j0 = a + b * KB;
        bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        load_rows_async<D>(ks, k + (size_t)j0 * kv_stride + kvh * D, kv_stride, KB,
                           min(KB, i1 - j0));
        load_rows_async<D>(ks + KB * (D + SKEW), v + (size_t)j0 * kv_stride + kvh * D, kv_stride,
                           KB, min(KB, i1 - j0));
    };

    load_rows_async<D>(qs, q + (size_t)i0 * q_stride + h * D, q_stride, QB, i1 - i0);
    load_rows_async<D>(dos, d_out + (size_t)i0 * q_stride + h * D, q_stride, QB, i1 - i0);
    const int b0 = sc.first(i0 - a) / KB;
    load_block(b0);
    commit();
    const int row0 = warp * 16;
    const int ia = i0 + row0 + g, ib = ia + 8;
    float lse2[2], del[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r == 0 ? ia : ib;
        const size_t row = (size_t)i * q_heads + h;
        lse2[r] = i < i1 ? lse[row] * LOG2E : 0.0f;
        del[r] = i < i1 ? delta[row] : 0.0f;
    }
    float acc[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;

    const int blocks = (i1 - a + KB - 1) / KB;
    for (int b = b0; b < blocks; ++b) {
        const int j0 = a + b * KB;
        if (b + 1 < blocks) {
            load_block(b + 1);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();
        const bf16* ks = kv + (b & 1) * 2 * KB * (D + SKEW);
        const bf16* vs = ks + KB * (D + SKEW);
        if (j0 <= i0 + row0 + 15 &&
            (sc.window <= 0 || j0 + KB - 1 > i0 + row0 - sc.window)) {
            float s[KB / 8][4], dp[KB / 8][4];
            scores<D, KB / 8>(s, qs, row0, ks);
            scores<D, KB / 8>(dp, dos, row0, vs);
#pragma unroll
            for (int nt = 0; nt < KB / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int j = j0 + nt * 8 + 2 * t + (e & 1);
                    const int r = e >> 1;
                    const int i = r == 0 ? ia : ib;
                    if (!sc.sees(i, j) || i >= i1) {
                        s[nt][e] = 0.0f;
                        continue;
                    }
                    const float score = sc.form(s[nt][e]);
                    const float p = exp2f(score * sl2 - lse2[r]);
                    s[nt][e] = p * (dp[nt][e] - del[r]) * sc.slope(score);
                }
            }
            accumulate<D, KB / 8>(acc, s, ks);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r == 0 ? ia : ib;
        if (i >= i1) continue;
        const size_t row = (size_t)i * q_heads + h;
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
            *reinterpret_cast<__nv_bfloat162*>(dq + row * D + nn * 8 + 2 * t) =
                __floats2bfloat162_rn(acc[nn][2 * r] * sc.scale, acc[nn][2 * r + 1] * sc.scale);
        }
    }
}

// dk and dv for a block of keys of one kv head: over the group's heads in order, then the
// queries that see the block in chunks of QC, dv += pᵀ·dO and dk += scale · dsᵀ·q, with the
// scores computed keys-first (k·qᵀ) so that keys are the fragments' rows.
template <int D>
__device__ void backward_dkdv(bf16* dk, bf16* dv, const bf16* d_out, const bf16* q, const bf16* k,
                              const bf16* v, const float* lse, const float* delta,
                              const int* tiles, int q_heads, int kv_heads, Scoring sc) {
    extern __shared__ __align__(16) unsigned char smem_raw[];
    bf16* ks = reinterpret_cast<bf16*>(smem_raw);  // [KB][D+SKEW]
    bf16* vs = ks + KB * (D + SKEW);                  // [KB][D+SKEW]
    bf16* qdo = vs + KB * (D + SKEW);                 // 2 × ([QC][D+SKEW] queries, then dO)
    float* stats = reinterpret_cast<float*>(qdo + 4 * QC * (D + SKEW));  // 2 × (lse·log2e, delta)
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int g = lane >> 2, t = lane & 3;
    const int j0 = tiles[3 * blockIdx.x + 2];
    const int len = min(KB, tiles[3 * blockIdx.x + 1] - j0);
    // The queries that see a key of the block: up to the sequence's end, or the window's.
    const int end = sc.window > 0 ? min(tiles[3 * blockIdx.x + 1], j0 + len - 1 + sc.window)
                                  : tiles[3 * blockIdx.x + 1];
    const int kvh = blockIdx.y;
    const int group = q_heads / kv_heads;
    const size_t q_stride = (size_t)q_heads * D, kv_stride = (size_t)kv_heads * D;
    const float sl2 = sc.unit() * LOG2E;
    // Step c covers head kvh·group + c / chunks, queries j0 + (c % chunks)·QC onwards; its rows
    // go to buffer c % 2 (cp.async), its lse and delta there too (plain stores, made visible by
    // the barrier that starts step c).
    const int chunks = (end - j0 + QC - 1) / QC;
    auto load_step = [&](int c) {
        const int h = kvh * group + c / chunks;
        const int c0 = j0 + (c % chunks) * QC;
        const int n = min(QC, end - c0);
        bf16* qs = qdo + (c & 1) * 2 * QC * (D + SKEW);
        load_rows_async<D>(qs, q + (size_t)c0 * q_stride + h * D, q_stride, QC, n);
        load_rows_async<D>(qs + QC * (D + SKEW), d_out + (size_t)c0 * q_stride + h * D, q_stride,
                           QC, n);
        float* st = stats + (c & 1) * 2 * QC;
        for (int r = threadIdx.x; r < QC; r += THREADS) {
            const size_t row = (size_t)(c0 + r) * q_heads + h;
            st[r] = r < n ? lse[row] * LOG2E : 0.0f;
            st[QC + r] = r < n ? delta[row] : 0.0f;
        }
    };

    load_rows_async<D>(ks, k + (size_t)j0 * kv_stride + kvh * D, kv_stride, KB, len);
    load_rows_async<D>(vs, v + (size_t)j0 * kv_stride + kvh * D, kv_stride, KB, len);
    load_step(0);
    commit();
    const int key0 = warp * 16;
    const int ja = j0 + key0 + g, jb = ja + 8;
    float ak[D / 8][4], av[D / 8][4];
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) ak[n][e] = av[n][e] = 0.0f;

    const int steps = group * chunks;
    for (int c = 0; c < steps; ++c) {
        if (c + 1 < steps) {
            load_step(c + 1);
            commit();
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();
        const int c0 = j0 + (c % chunks) * QC;
        const int n = min(QC, end - c0);
        const bf16* qs = qdo + (c & 1) * 2 * QC * (D + SKEW);
        const bf16* dos = qs + QC * (D + SKEW);
        const float* lse2 = stats + (c & 1) * 2 * QC;
        const float* del = lse2 + QC;
        // Else every query of the chunk is before these keys, or past their window.
        if (c0 + QC - 1 >= j0 + key0 && (sc.window <= 0 || c0 < j0 + key0 + 15 + sc.window)) {
            float s[QC / 8][4], dp[QC / 8][4];
            scores<D, QC / 8>(s, ks, key0, qs);
            scores<D, QC / 8>(dp, vs, key0, dos);
#pragma unroll
            for (int nt = 0; nt < QC / 8; ++nt) {
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int cc = nt * 8 + 2 * t + (e & 1);
                    const int i = c0 + cc;
                    const int j = e < 2 ? ja : jb;
                    if (!sc.sees(i, j) || cc >= n) {
                        s[nt][e] = dp[nt][e] = 0.0f;
                        continue;
                    }
                    const float score = sc.form(s[nt][e]);
                    const float p = exp2f(score * sl2 - lse2[cc]);
                    s[nt][e] = p;
                    dp[nt][e] = p * (dp[nt][e] - del[cc]) * sc.slope(score);
                }
            }
            accumulate<D, QC / 8>(av, s, dos);
            accumulate<D, QC / 8>(ak, dp, qs);
        }
        __syncthreads();  // buffer c % 2 is free for step c + 2
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int j = r == 0 ? ja : jb;
        if (j >= j0 + len) continue;
        const size_t at = ((size_t)j * kv_heads + kvh) * D;
#pragma unroll
        for (int nn = 0; nn < D / 8; ++nn) {
            *reinterpret_cast<__nv_bfloat162*>(dk + at + nn * 8 + 2 * t) =
                __floats2bfloat162_rn(ak[nn][2 * r] * sc.scale, ak[nn][2 * r + 1] * sc.scale);
            *reinterpret_cast<__nv_bfloat162*>(dv + at + nn * 8 + 2 * t) =
                __floats2bfloat162_rn(av[nn][2 * r], av[nn][2 * r + 1]);
        }
    }
}

}  // namespace

// The forward, dq and dkdv kernels take the arguments of kernels/attention.cu's (the head size
// too, which D fixes here), so the host launches either with one argument list.
#define ATTENTION_MMA_KERNELS(D)                                                                 \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_mma_forward_d##D(            \
        bf16* out, float* lse, const bf16* q, const bf16* k, const bf16* v, const int* tiles,    \
        int q_heads, int kv_heads, int /* d: D */, float scale, float cap, int window) {         \
        const int* tl = tiles + 3 * blockIdx.x;                                                  \
        const int end = min(tl[2] + QB, tl[1]);                                                  \
        const QueryTile tile = {tl[2], end - tl[2], tl[2] - tl[0]};                              \
        const PackedKeys keys = {k, v, (size_t)kv_heads * D, tl[0]};                             \
        forward<D>(out, lse, q, tile, keys, q_heads, kv_heads, {scale, cap, window});            \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_mma_paged_d##D(              \
        bf16* out, float* lse, const bf16* q, const bf16* cache, const int* tiles,               \
        const int* tables, int layer, int layers, int q_heads, int kv_heads, float scale,        \
        float cap, int window) {                                                                 \
        const int* tl = tiles + 4 * blockIdx.x;                                                  \
        const QueryTile tile = {tl[0], tl[1], tl[2]};                                            \
        const PagedKeys keys = {cache, tables + tl[3], layer, layers, kv_heads};                 \
        forward<D>(out, lse, q, tile, keys, q_heads, kv_heads, {scale, cap, window});            \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(32) attention_decode_paged_d##D(                \
        bf16* out, float* lse, const bf16* q, const bf16* cache, const int* tiles,               \
        const int* tables, int layer, int layers, int q_heads, int kv_heads, float scale,        \
        float cap, int window) {                                                                 \
        const int* tl = tiles + 4 * blockIdx.x;                                                  \
        const PagedKeys keys = {cache, tables + tl[3], layer, layers, kv_heads};                 \
        decode<D>(out, lse, q, tl[0], tl[2], keys, q_heads, kv_heads,                            \
                  {scale, cap, window});                                                         \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_mma_dq_d##D(                 \
        bf16* dq, const bf16* d_out, const bf16* q, const bf16* k, const bf16* v,                \
        const float* lse, const float* delta, const int* tiles, int q_heads, int kv_heads,       \
        int /* d: D */, float scale, float cap, int window) {                                    \
        backward_dq<D>(dq, d_out, q, k, v, lse, delta, tiles, q_heads, kv_heads,                 \
                       {scale, cap, window});                                                    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(THREADS) attention_mma_dkdv_d##D(               \
        bf16* dk, bf16* dv, const bf16* d_out, const bf16* q, const bf16* k, const bf16* v,      \
        const float* lse, const float* delta, const int* tiles, int q_heads, int kv_heads,       \
        int /* d: D */, float scale, float cap, int window) {                                    \
        backward_dkdv<D>(dk, dv, d_out, q, k, v, lse, delta, tiles, q_heads, kv_heads,           \
                         {scale, cap, window});                                                  \
    }

// Every head size that is a multiple of 16 up to 256 (the host's by_head_dim! lists them).
ATTENTION_MMA_KERNELS(16)
ATTENTION_MMA_KERNELS(32)
ATTENTION_MMA_KERNELS(48)
ATTENTION_MMA_KERNELS(64)
ATTENTION_MMA_KERNELS(80)
ATTENTION_MMA_KERNELS(96)
ATTENTION_MMA_KERNELS(112)
ATTENTION_MMA_KERNELS(128)
ATTENTION_MMA_KERNELS(144)
ATTENTION_MMA_KERNELS(160)
ATTENTION_MMA_KERNELS(176)
ATTENTION_MMA_KERNELS(192)
ATTENTION_MMA_KERNELS(208)
ATTENTION_MMA_KERNELS(224)
ATTENTION_MMA_KERNELS(240)
ATTENTION_MMA_KERNELS(256)
