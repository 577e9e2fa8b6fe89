// A mixture of experts' products, every expert in one launch (mma.sync m16n8k16, bf16 operands,
// f32 accumulation): ops::grouped_matmul and ops::grouped_matmul_wgrad.
//
// The rows of a layer's picks are sorted by expert; expert e owns rows offsets[e]..offsets[e+1].
// grouped_rows_{nt,nn}: out[s] = x[row(s)] · W_eᵀ (nt, W_e [n × k]) or x[s] · W_e (nn, W_e
// [k × n]) for the rows s of expert e, `row(s)` through a gather table or s itself. The host
// cuts each expert's rows into tiles of BM (`tiles`: expert, first row, end row); grid (n tiles,
// tiles). grouped_wgrad: G_e += a[seg]ᵀ · b[row(seg)] in f32, the sum over expert e's rows;
// grid (n tiles, m tiles, experts with rows).
//
// Bits: an output element is the sum over k in BK-wide steps, each two m16n8k16 products, in
// order, whatever the number of rows of its expert, its tile or its place in the tile. So a
// row's outputs depend on that row and the weights only: a decode step's few rows per expert
// get the bits a training batch's many rows get. No split over k, no atomics.
//
// Tiles are BM × BN × BK in two shared-memory stages (cp.async for the next while computing
// this one); 8 warps as 2 × 4, each 64 × 32 of the output. A 16-byte chunk that does not fit (a
// row stride not a multiple of 8 elements, or the end of k) is loaded element by element.
#include "mma.cuh"

namespace {

using namespace miles;

constexpr int BM = 128;
constexpr int BN = 128;
constexpr int BK = 32;
constexpr int THREADS = 256;
constexpr int SKEW = 8;  // bf16 of padding per shared row: ldmatrix without bank conflicts

// A ROWS × COLS tile (row stride COLS + SKEW) whose row r starts at global `row(r)` (null: a
// zero row), columns col0 .. col0 + COLS of `cols`; `vec`: rows are 16-byte aligned. `any` is
// a valid global address for the zero-byte copies of zero rows.
template <int ROWS, int COLS, class Row>
__device__ __forceinline__ void load_tile(bf16* dst, Row row, int col0, int cols, bool vec,
                                          const bf16* any) {
    constexpr int CHUNKS = COLS / 8;
    for (int e = threadIdx.x; e < ROWS * CHUNKS; e += THREADS) {
        const int r = e / CHUNKS;
        const int c = (e - r * CHUNKS) * 8;
        const bf16* src = row(r);
        bf16* to = dst + r * (COLS + SKEW) + c;
        const int at = col0 + c;
        if (vec && (src == nullptr || at + 8 <= cols)) {
            const bool real = src != nullptr;
            cp_async16(to, real ? src + at : any, real ? 16 : 0);
        } else {
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                to[j] = (src != nullptr && at + j < cols) ? src[at + j] : __float2bfloat16_rn(0.0f);
            }
        }
    }
}

// A's layout: [rows][k] (its rows are the output's) or, transposed, [k][rows].
// B's layout: [n][k] (the product with Bᵀ) or [k][n].
template <bool A_T, bool B_NK>
struct Tiles {
    static constexpr int A_ELEMS = A_T ? BK * (BM + SKEW) : BM * (BK + SKEW);
    static constexpr int B_ELEMS = B_NK ? BN * (BK + SKEW) : BK * (BN + SKEW);
};

// acc[4][4][4] += the BM × BN tile's product over one BK step from shared `sa`, `sb`.
template <bool A_T, bool B_NK>
__device__ __forceinline__ void tile_step(float (*acc)[4][4], const bf16* sa, const bf16* sb) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wm = (warp >> 2) * 64;
    const int wn = (warp & 3) * 32;
#pragma unroll
    for (int kk = 0; kk < BK; kk += 16) {
        uint32_t a[4][4];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int m0 = wm + i * 16;
            if constexpr (A_T) {
                const int k = kk + (lane >> 4) * 8 + (lane & 7);
                ldsm_x4_t(a[i], sa + k * (BM + SKEW) + m0 + ((lane >> 3) & 1) * 8);
            } else {
                const int m = m0 + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4(a[i], sa + m * (BK + SKEW) + kk + (lane >> 4) * 8);
            }
        }
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int n0 = wn + j * 16;
            uint32_t b[4];
            if constexpr (B_NK) {
                const int n = n0 + (lane & 7) + (lane >> 4) * 8;
                ldsm_x4(b, sb + n * (BK + SKEW) + kk + ((lane >> 3) & 1) * 8);
            } else {
                const int k = kk + (lane & 7) + ((lane >> 3) & 1) * 8;
                ldsm_x4_t(b, sb + k * (BN + SKEW) + n0 + (lane >> 4) * 8);
            }
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                mma(acc[i][2 * j], a[i], b);
                mma(acc[i][2 * j + 1], a[i], b + 2);
            }
        }
    }
}

// The tile's product over k = 0 .. k_len: `a_row(i, k0)` / `b_row(i, k0)` give the global
// start of row i of the stage's A / B tile (rows as laid out in shared memory) or null.
template <bool A_T, bool B_NK, class ARow, class BRow>
__device__ __forceinline__ void tile_product(float (*acc)[4][4], bf16* smem, int k_len,
                                             ARow a_row, int a_cols, bool a_vec, BRow b_row,
                                             int b_cols, bool b_vec, int m_base, int n_base,
                                             const bf16* any) {
    using T = Tiles<A_T, B_NK>;
    bf16* sa[2] = {smem, smem + T::A_ELEMS};
    bf16* sb[2] = {smem + 2 * T::A_ELEMS, smem + 2 * T::A_ELEMS + T::B_ELEMS};
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    auto load = [&](int stage, int k0) {
        // A: [BM rows][BK of k] at (m_base, k0), or [BK rows of k][BM] at (k0, m_base).
        if constexpr (A_T) {
            load_tile<BK, BM>(sa[stage], [&](int r) { return a_row(k0 + r); }, m_base, a_cols,
                              a_vec, any);
        } else {
            load_tile<BM, BK>(sa[stage], [&](int r) { return a_row(r); }, k0, a_cols, a_vec, any);
        }
        if constexpr (B_NK) {
            load_tile<BN, BK>(sb[stage], [&](int r) { return b_row(r); }, k0, b_cols, b_vec, any);
        } else {
            load_tile<BK, BN>(sb[stage], [&](int r) { return b_row(k0 + r); }, n_base, b_cols,
                              b_vec, any);
        }
        commit();
    };
    const int steps = (k_len + BK - 1) / BK;
    if (steps > 0) load(0, 0);
    for (int s = 0; s < steps; ++s) {
        if (s + 1 < steps) {
            load((s + 1) & 1, (s + 1) * BK);
            wait<1>();
        } else {
            wait<0>();
        }
        __syncthreads();
        tile_step<A_T, B_NK>(acc, sa[s & 1], sb[s & 1]);
        __syncthreads();
    }
}

// Calls f(m, n, v0, v1) for this thread's output pairs (columns n, n + 1) of the tile.
template <class F>
__device__ __forceinline__ void for_outputs(const float (*acc)[4][4], F f) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int wm = (warp >> 2) * 64;
    const int wn = (warp & 3) * 32;
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int m = wm + i * 16 + (lane >> 2);
            const int n = wn + j * 8 + (lane & 3) * 2;
            f(m, n, acc[i][j][0], acc[i][j][1]);
            f(m + 8, n, acc[i][j][2], acc[i][j][3]);
        }
}

template <bool B_NK>
__device__ __forceinline__ void grouped_rows(bf16* out, const bf16* x, const int* rows,
                                             int use_rows, const unsigned long long* w,
                                             const int* tiles, int n, int k, int vec_a,
                                             int vec_b) {
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* smem = reinterpret_cast<bf16*>(shared);
    const int expert = tiles[3 * blockIdx.y];
    const int first = tiles[3 * blockIdx.y + 1];
    const int end = tiles[3 * blockIdx.y + 2];
    const int n_base = blockIdx.x * BN;
    const bf16* we = reinterpret_cast<const bf16*>(w[expert]);
    auto a_row = [&](int r) -> const bf16* {
        const int s = first + r;
        if (s >= end) return nullptr;
        return x + (size_t)(use_rows ? rows[s] : s) * k;
    };
    // B [n][k]: row r is output column n_base + r; B [k][n]: row r is k index r.
    auto b_row = [&](int r) -> const bf16* {
        if constexpr (B_NK) {
            return n_base + r < n ? we + (size_t)(n_base + r) * k : nullptr;
        } else {
            return r < k ? we + (size_t)r * n : nullptr;
        }
    };
    float acc[4][4][4];
    tile_product<false, B_NK>(acc, smem, k, a_row, k, vec_a != 0, b_row, B_NK ? k : n,
                              vec_b != 0, 0, n_base, x);
    for_outputs(acc, [&](int m, int c, float v0, float v1) {
        const int s = first + m;
        const int col = n_base + c;
        if (s >= end || col >= n) return;
        bf16* o = out + (size_t)s * n + col;
        o[0] = __float2bfloat16_rn(v0);
        if (col + 1 < n) o[1] = __float2bfloat16_rn(v1);
    });
}

}  // namespace

// out[s] = x[row(s)] · W_eᵀ, W_e [n × k] (the experts' forward products).
extern "C" __global__ void __launch_bounds__(THREADS)
    grouped_rows_nt_bf16(bf16* out, const bf16* x, const int* rows, int use_rows,
                         const unsigned long long* w, const int* tiles, int n, int k, int vec_a,
                         int vec_b) {
    grouped_rows<true>(out, x, rows, use_rows, w, tiles, n, k, vec_a, vec_b);
}

// out[s] = x[row(s)] · W_e, W_e [k × n] (the backward's products with the experts' weights).
extern "C" __global__ void __launch_bounds__(THREADS)
    grouped_rows_nn_bf16(bf16* out, const bf16* x, const int* rows, int use_rows,
                         const unsigned long long* w, const int* tiles, int n, int k, int vec_a,
                         int vec_b) {
    grouped_rows<false>(out, x, rows, use_rows, w, tiles, n, k, vec_a, vec_b);
}

// G_e [m × n] (f32) += Σ over expert e's rows s of a[s]ᵀ · b[row(s)]: a [rows × m], b [· × n].
// `segs` holds (expert, first row, end row) per expert with rows; grid (n tiles, m tiles, segs).
extern "C" __global__ void __launch_bounds__(THREADS)
    grouped_wgrad_bf16(const unsigned long long* g, const bf16* a, const bf16* b,
                       const int* rows, int use_rows, const int* segs, int m, int n, int vec_a,
                       int vec_b) {
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* smem = reinterpret_cast<bf16*>(shared);
    const int expert = segs[3 * blockIdx.z];
    const int first = segs[3 * blockIdx.z + 1];
    const int end = segs[3 * blockIdx.z + 2];
    const int m_base = blockIdx.y * BM;
    const int n_base = blockIdx.x * BN;
    // Both operands are read along the expert's rows: A's row r is a[first + r] ([k][m]
    // layout), B's row r is b[row(first + r)] ([k][n]).
    auto a_row = [&](int r) -> const bf16* {
        const int s = first + r;
        return s < end ? a + (size_t)s * m : nullptr;
    };
    auto b_row = [&](int r) -> const bf16* {
        const int s = first + r;
        if (s >= end) return nullptr;
        return b + (size_t)(use_rows ? rows[s] : s) * n;
    };
    float acc[4][4][4];
    tile_product<true, false>(acc, smem, end - first, a_row, m, vec_a != 0, b_row, n,
                              vec_b != 0, m_base, n_base, a);
    float* ge = reinterpret_cast<float*>(g[expert]);
    for_outputs(acc, [&](int r, int c, float v0, float v1) {
        const int row = m_base + r;
        const int col = n_base + c;
        if (row >= m || col >= n) return;
        float* o = ge + (size_t)row * n + col;
        o[0] += v0;
        if (col + 1 < n) o[1] += v1;
    });
}
