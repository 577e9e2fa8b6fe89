// FP8 E4M3 with blockwise scaling, as DeepGEMM and miles compute it (ops::Fp8Matrix,
// ops::fp8_linear; CPU twins in miles-tensor/src/cpu/fp8.rs).
//
// fp8_quantize_blocks_{f32,bf16}: a weight [rows × cols] in 128 × 128 blocks (partial at the
// edges), one block of threads per block: amax = max |w| (at least 1e-4), codes
// e4m3(w · (448 / amax)) rounded to nearest even and saturated (__NV_SATFINITE), scale
// amax / 448. max is exact and the products and quotients are single IEEE operations, so the
// codes and scales are the CPU's bits.
// fp8_quantize_rows_{f32,bf16}: activations [rows × cols] per 1 × 128 group of a row, the
// same recipe; one warp per (row, group).
// fp8_gemm_{f32,bf16}_{big,m16,m64} (mma.sync, sm_89 on) and fp8_gemm_{f32,bf16}_{tma,wg_mid,
// swap8,swap16,swap32,swap64} (wgmma, Hopper): y = x · wᵀ from x's codes [m × k] with scales [m × ⌈k/128⌉] and w's codes [n × k]
// with scales [⌈n/128⌉ × ⌈k/128⌉], written in f32 or bf16. fp8_grouped_{f32,bf16} (Hopper):
// the same per expert over an MoE layer's sorted, gathered rows.
//
// Bits: every output is, for each 128-wide slice of k in order, the slice's products summed on
// the tensor cores from zero (four m16n8k32 mma.sync, or four m64nNk32 wgmma), then promoted
// as DeepGEMM does: acc = fma(part, sx · sw, acc), the scales' product rounded to f32 first
// (the CPU twin's `mul_add`; one instruction an output, so the promotion keeps up with wgmma).
// The tile shape only decides which outputs a block computes, never how: a row's outputs
// depend on that row and the weights alone, in a decode step as in a training batch. No split
// over k, no atomics.
// The two families differ from each other (and from the CPU's exact sums) in the tensor
// cores' own accumulation within a slice (Hopper's FP8 wgmma keeps fewer bits); a device uses
// one family for every product.
//
// mma.sync tiles: BM × BN outputs, 128 of k a stage, STAGES stages of cp.async in flight;
// warps laid out WARPS_M × WARPS_N, each MFRAG × 16 rows by NFRAG × 8 columns. Shared rows are
// 128 + 16 bytes (ldmatrix without bank conflicts). wgmma tiles: 128-byte rows in the 128-byte
// swizzle (wgmma.cuh). k must be a multiple of 16 (16-byte row chunks).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <type_traits>

#include "mma.cuh"
#include "wgmma.cuh"

namespace {

using namespace miles;

constexpr float E4M3_MAX = 448.0f;
constexpr float AMAX_FLOOR = 1e-4f;
constexpr int BLOCK = 128;
constexpr int ROW_BYTES = BLOCK + 16;

__device__ __forceinline__ float load(const float* p, long i) { return p[i]; }
__device__ __forceinline__ float load(const bf16* p, long i) { return __bfloat162float(p[i]); }
__device__ __forceinline__ void store(float* p, long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(bf16* p, long i, float v) { p[i] = __float2bfloat16_rn(v); }
// Two neighbours at once (i even, the row's width even: aligned). (Unused where the sm_90a
// kernels compile to __trap: no warning for that.)
#pragma nv_diag_suppress 177
__device__ __forceinline__ void store2(float* p, long i, float a, float b) {
    *reinterpret_cast<float2*>(p + i) = make_float2(a, b);
}
__device__ __forceinline__ void store2(bf16* p, long i, float a, float b) {
    *reinterpret_cast<__nv_bfloat162*>(p + i) = __floats2bfloat162_rn(a, b);
}
#pragma nv_diag_default 177

__device__ __forceinline__ uint8_t e4m3(float x) {
    return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

template <class T>
__device__ void quantize_blocks(uint8_t* codes, float* scales, const T* w, int rows, int cols) {
    __shared__ float partial[8];
    const int r0 = blockIdx.y * BLOCK, c0 = blockIdx.x * BLOCK;
    const int nr = min(BLOCK, rows - r0), nc = min(BLOCK, cols - c0);
    float amax = 0.0f;
    for (int e = threadIdx.x; e < nr * nc; e += blockDim.x) {
        const int r = e / nc, c = e - r * nc;
        amax = fmaxf(amax, fabsf(load(w, (long)(r0 + r) * cols + c0 + c)));
    }
    amax = warp_max(amax);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) amax = fmaxf(amax, partial[i]);
    amax = fmaxf(amax, AMAX_FLOOR);
    const float multiplier = __fdiv_rn(E4M3_MAX, amax);
    if (threadIdx.x == 0) scales[blockIdx.y * gridDim.x + blockIdx.x] = __fdiv_rn(amax, E4M3_MAX);
    for (int e = threadIdx.x; e < nr * nc; e += blockDim.x) {
        const int r = e / nc, c = e - r * nc;
        const long i = (long)(r0 + r) * cols + c0 + c;
        codes[i] = e4m3(__fmul_rn(load(w, i), multiplier));
    }
}

// One warp per (row, group of 128): blockDim (32, 8), grid (groups, ⌈rows / 8⌉).
template <class T>
__device__ void quantize_rows(uint8_t* codes, float* scales, const T* x, int rows, int cols) {
    const int row = blockIdx.y * 8 + threadIdx.y;
    if (row >= rows) return;
    const int c0 = blockIdx.x * BLOCK;
    float v[4];
    float amax = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = c0 + threadIdx.x * 4 + j;
        v[j] = c < cols ? load(x, (long)row * cols + c) : 0.0f;
        amax = fmaxf(amax, fabsf(v[j]));
    }
    amax = fmaxf(warp_max(amax), AMAX_FLOOR);
    const float multiplier = __fdiv_rn(E4M3_MAX, amax);
    if (threadIdx.x == 0) scales[(long)row * gridDim.x + blockIdx.x] = __fdiv_rn(amax, E4M3_MAX);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const int c = c0 + threadIdx.x * 4 + j;
        if (c < cols) codes[(long)row * cols + c] = e4m3(__fmul_rn(v[j], multiplier));
    }
}

// ROWS rows of 128 bytes of k from `src` (row stride k) into shared `dst` (stride
// ROW_BYTES), starting at row r0 of `limit` and byte k0; rows and chunks outside read zeros.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_tile(uint8_t* dst, const uint8_t* src, int r0, int limit,
                                          int k0, int k) {
    constexpr int CHUNKS = ROWS * (BLOCK / 16);
#pragma unroll
    for (int e = threadIdx.x; e < CHUNKS; e += THREADS) {
        const int r = e >> 3, c = (e & 7) * 16;
        const bool real = r0 + r < limit && k0 + c < k;
        const uint8_t* from = real ? src + (long)(r0 + r) * k + k0 + c : src;
        cp_async16(dst + r * ROW_BYTES + c, from, real ? 16 : 0);
    }
}

template <int WARPS_M, int WARPS_N, int MFRAG, int NFRAG, int STAGES, class Out>
__device__ void gemm(Out* y, const uint8_t* xq, const float* xs, const uint8_t* wq,
                     const float* ws, int m, int n, int k) {
    constexpr int THREADS = WARPS_M * WARPS_N * 32;
    constexpr int BM = WARPS_M * MFRAG * 16, BN = WARPS_N * NFRAG * 8;
    static_assert(NFRAG % 2 == 0, "B fragments load in pairs");
    extern __shared__ __align__(16) uint8_t smem[];
    uint8_t* sa = smem;
    uint8_t* sb = smem + STAGES * BM * ROW_BYTES;

    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int kb_n = (k + BLOCK - 1) / BLOCK;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int wm = (warp / WARPS_N) * MFRAG * 16, wn = (warp % WARPS_N) * NFRAG * 8;
    const int g = lane >> 2, t = lane & 3;

    float acc[MFRAG][NFRAG][4];
#pragma unroll
    for (int i = 0; i < MFRAG; ++i)
#pragma unroll
        for (int j = 0; j < NFRAG; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) acc[i][j][q] = 0.0f;

    auto issue = [&](int kb) {
        if (kb < kb_n) {
            const int s = kb % STAGES;
            load_tile<BM, THREADS>(sa + s * BM * ROW_BYTES, xq, m0, m, kb * BLOCK, k);
            load_tile<BN, THREADS>(sb + s * BN * ROW_BYTES, wq, n0, n, kb * BLOCK, k);
        }
        commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    for (int kb = 0; kb < kb_n; ++kb) {
        wait<STAGES - 2>();
        __syncthreads();
        issue(kb + STAGES - 1);
        const uint8_t* ta = sa + (kb % STAGES) * BM * ROW_BYTES;
        const uint8_t* tb = sb + (kb % STAGES) * BN * ROW_BYTES;

        float part[MFRAG][NFRAG][4];
#pragma unroll
        for (int i = 0; i < MFRAG; ++i)
#pragma unroll
            for (int j = 0; j < NFRAG; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) part[i][j][q] = 0.0f;
#pragma unroll
        for (int kk = 0; kk < BLOCK; kk += 32) {
            uint32_t a[MFRAG][4], b[NFRAG][2];
#pragma unroll
            for (int i = 0; i < MFRAG; ++i) {
                const uint8_t* p = ta + (wm + i * 16 + (lane & 15)) * ROW_BYTES + kk + (lane >> 4) * 16;
                ldsm_x4(a[i], reinterpret_cast<const bf16*>(p));
            }
#pragma unroll
            for (int j = 0; j < NFRAG; j += 2) {
                const int row = wn + j * 8 + (lane & 7) + (lane >> 4) * 8;
                const uint8_t* p = tb + row * ROW_BYTES + kk + ((lane >> 3) & 1) * 16;
                uint32_t r[4];
                ldsm_x4(r, reinterpret_cast<const bf16*>(p));
                b[j][0] = r[0];
                b[j][1] = r[1];
                b[j + 1][0] = r[2];
                b[j + 1][1] = r[3];
            }
#pragma unroll
            for (int i = 0; i < MFRAG; ++i)
#pragma unroll
                for (int j = 0; j < NFRAG; ++j) mma_e4m3(part[i][j], a[i], b[j]);
        }
        // Promotion: this slice's sums, scaled by the row's and the weight block's scales.
#pragma unroll
        for (int i = 0; i < MFRAG; ++i) {
            float sx[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int row = m0 + wm + i * 16 + g + h * 8;
                sx[h] = row < m ? xs[(long)row * kb_n + kb] : 0.0f;
            }
#pragma unroll
            for (int j = 0; j < NFRAG; ++j) {
                const int col = min(n0 + wn + j * 8, n - 1);
                const float sw = ws[(long)(col / BLOCK) * kb_n + kb];
                const float scale[2] = {__fmul_rn(sx[0], sw), __fmul_rn(sx[1], sw)};
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    acc[i][j][q] = __fmaf_rn(part[i][j][q], scale[q >> 1], acc[i][j][q]);
                }
            }
        }
    }
    wait<0>();

#pragma unroll
    for (int i = 0; i < MFRAG; ++i)
#pragma unroll
        for (int j = 0; j < NFRAG; ++j)
#pragma unroll
            for (int q = 0; q < 4; ++q) {
                const int row = m0 + wm + i * 16 + g + (q >> 1) * 8;
                const int col = n0 + wn + j * 8 + t * 2 + (q & 1);
                if (row < m && col < n) store(y, (long)row * n + col, acc[i][j][q]);
            }
}

// Where a tile's rows of x come from: rows [begin, end) of the output, each read from row
// `source(r)` of x. Dense products read row r itself; an expert's piece of the grouped product
// reads the token each sorted row stands for.
struct Rows {
    int begin, end;
    const int* gather;  // null: row r of x is row r
    __device__ int source(int r) const { return gather ? gather[r] : r; }
};

// ROWS rows of 128 bytes of k, from output row r0 on (rows of x through `rows`, row stride k),
// into the swizzled tile `dst` (wgmma.cuh), from byte k0; rows and chunks outside read zeros.
template <int ROWS, int THREADS>
__device__ __forceinline__ void load_swizzled(uint8_t* dst, const uint8_t* src, Rows rows, int r0,
                                              int k0, int k) {
#pragma unroll
    for (int e = threadIdx.x; e < ROWS * 8; e += THREADS) {
        const int r = e >> 3, c = e & 7;
        const bool real = r0 + r < rows.end && k0 + c * 16 < k;
        const uint8_t* from = real ? src + (long)rows.source(r0 + r) * k + k0 + c * 16 : src;
        cp_async16(dst + swizzled(r, c), from, real ? 16 : 0);
    }
}

// The scales one thread of a warpgroup needs for a slice: its two rows' and the weight block's.
struct SliceScales {
    float x0, x1, w;
};

// Where a thread of a warpgroup whose 64 output rows start at `m0` and whose columns start at
// `n0` finds its scales (rows past the end read the last row's: their outputs are never stored).
struct ScaleRows {
    const float *x0, *x1, *w;
    __device__ ScaleRows(const float* xs, const float* ws, Rows rows, int m0, int n0, int kb_n) {
        const int row = m0 + (threadIdx.x & 127) / 32 * 16 + (threadIdx.x & 31) / 4;
        x0 = xs + (long)rows.source(min(row, rows.end - 1)) * kb_n;
        x1 = xs + (long)rows.source(min(row + 8, rows.end - 1)) * kb_n;
        w = ws + (long)(n0 / BLOCK) * kb_n;
    }
// (Unused where the sm_90a kernels compile to __trap: no warning for that.)
#pragma nv_diag_suppress 177
    __device__ SliceScales at(int kb) const { return {x0[kb], x1[kb], w[kb]}; }
#pragma nv_diag_default 177
};

// One warpgroup's 64 × BN outputs for one 128-wide slice of k: the slice's four wgmma from zero
// into `part`, then promoted into `acc` (acc = fma(part, sx · sw, acc), as `gemm`). The bits of an
// output depend on its row and column alone, whatever BN or the kernel.
template <int BN>
__device__ __forceinline__ void slice(float* acc, float* part, const uint8_t* ta, const uint8_t* tb,
                                      SliceScales sc) {
    constexpr int R = BN / 2;
    fence_regs<R>(part);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_e4m3<BN>(part, tile_desc(ta, j * 32), tile_desc(tb, j * 32), j);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs<R>(part);
    const float s0 = __fmul_rn(sc.x0, sc.w), s1 = __fmul_rn(sc.x1, sc.w);
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = __fmaf_rn(part[i], (i & 2) ? s1 : s0, acc[i]);
}

// A warpgroup's 64 × BN outputs from (m0, n0), in wgmma's accumulator layout, rows below m.
template <int BN, class Out>
__device__ __forceinline__ void store_tile(Out* y, const float* acc, int m0, int n0, int m, int n) {
    const int row0 = m0 + (threadIdx.x & 127) / 32 * 16 + (threadIdx.x & 31) / 4;
    const int col0 = n0 + (threadIdx.x & 3) * 2;
#pragma unroll
    for (int i = 0; i < BN / 2; i += 2) {
        const int row = row0 + ((i & 2) ? 8 : 0), col = col0 + (i >> 2) * 8;
        if (row >= m || col >= n) continue;
        if (col + 1 < n && n % 2 == 0) {
            store2(y, (long)row * n + col, acc[i], acc[i + 1]);
        } else {
            store(y, (long)row * n + col, acc[i]);
            if (col + 1 < n) store(y, (long)row * n + col + 1, acc[i + 1]);
        }
    }
}

// The Hopper product for up to 1024 rows, and for an expert's piece of the grouped product
// (rows gathered, so no TMA): WG warpgroups, each 64 rows × BN columns from output row
// `rows.begin` and column n0, every thread loading STAGES stages of 128 of k ahead through
// cp.async.
template <int WG, int BN, int STAGES, class Out>
__device__ void tile_wg(Out* y, const uint8_t* xq, const float* xs, const uint8_t* wq,
                        const float* ws, Rows rows, int n0, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int THREADS = WG * 128, BM = WG * 64;
    constexpr int A_BYTES = BM * BLOCK, B_BYTES = BN * BLOCK;
    static_assert(BLOCK % BN == 0, "a column tile lies in one weight block");
    uint8_t* sa = smem_1024();
    uint8_t* sb = sa + STAGES * A_BYTES;

    const int m0 = rows.begin + (threadIdx.x >> 7) * 64;
    const int kb_n = (k + BLOCK - 1) / BLOCK;
    const ScaleRows scales(xs, ws, rows, m0, n0, kb_n);
    const Rows weight_rows{n0, n, nullptr};

    float acc[BN / 2], part[BN / 2];
#pragma unroll
    for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;

    auto issue = [&](int kb) {
        if (kb < kb_n) {
            const int s = kb % STAGES;
            load_swizzled<BM, THREADS>(sa + s * A_BYTES, xq, rows, rows.begin, kb * BLOCK, k);
            load_swizzled<BN, THREADS>(sb + s * B_BYTES, wq, weight_rows, n0, kb * BLOCK, k);
        }
        commit();
    };
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) issue(s);

    SliceScales sc = scales.at(0);
    for (int kb = 0; kb < kb_n; ++kb) {
        wait<STAGES - 2>();
        fence_proxy_async();
        __syncthreads();
        issue(kb + STAGES - 1);
        // The next slice's scales load while this one computes.
        const SliceScales next = scales.at(min(kb + 1, kb_n - 1));
        const int s = kb % STAGES;
        slice<BN>(acc, part, sa + s * A_BYTES + (threadIdx.x >> 7) * 64 * BLOCK, sb + s * B_BYTES, sc);
        sc = next;
    }
    wait<0>();
    store_tile<BN>(y, acc, m0, n0, rows.end, n);
#else
    __trap();
#endif
}

template <int WG, int BN, int STAGES, class Out>
__device__ void gemm_wg(Out* y, const uint8_t* xq, const float* xs, const uint8_t* wq,
                        const float* ws, int m, int n, int k) {
    const Rows rows{(int)blockIdx.x * WG * 64, m, nullptr};
    tile_wg<WG, BN, STAGES>(y, xq, xs, wq, ws, rows, blockIdx.y * BN, n, k);
}

// The grouped product over an MoE layer's experts: block (column tile, piece) runs `tile_wg`
// on piece p = (expert e, first sorted row, end row) (`pieces`, 3 ints each) with expert e's
// codes and scales (`wqs[e]`, `wss[e]`), the sorted rows read from x's rows `gather` (or x's
// own rows when null). Each output has the bits the dense product gives its row.
template <int WG, int BN, int STAGES, class Out>
__device__ void grouped_wg(Out* y, const uint8_t* xq, const float* xs, const int* gather,
                           const int* pieces, const uint8_t* const* wqs, const float* const* wss,
                           int n, int k) {
    const int* p = pieces + 3 * blockIdx.y;
    const Rows rows{p[1], p[2], gather};
    tile_wg<WG, BN, STAGES>(y, xq, xs, wqs[p[0]], wss[p[0]], rows, blockIdx.x * BN, n, k);
}

// The Hopper product, warp-specialized, for more than 1024 rows: one thread of the first
// warpgroup streams 128-of-k stages of the 128 × BN tile's operands by TMA into STAGES
// swizzled stages (a `full` and an `empty` barrier each), and two consumer warpgroups of 64
// rows each run `slice` at their own pace, so one's promotion overlaps the other's wgmma. Tiles
// walk the output in groups of GROUP row tiles, so that a wave's operands stay in L2
// (one-dimensional grid; a block may take several tiles, see below).
template <int BN, int STAGES, int GROUP, class Out>
__device__ void gemm_tma(Out* y, const TensorMap* xmap, const float* xs, const TensorMap* wmap,
                         const float* ws, int m, int n, int k) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int BM = 128;
    constexpr int A_BYTES = BM * BLOCK, B_BYTES = BN * BLOCK;
    static_assert(BLOCK % BN == 0, "a column tile lies in one weight block");
    uint8_t* sa = smem_1024();
    uint8_t* sb = sa + STAGES * A_BYTES;
    uint64_t* full = reinterpret_cast<uint64_t*>(sb + STAGES * B_BYTES);
    uint64_t* empty = full + STAGES;

    const int tiles_m = (m + BM - 1) / BM, tiles_n = (n + BN - 1) / BN;
    const int tiles = tiles_m * tiles_n, per_group = GROUP * tiles_n;
    // Tile t's first row and column: groups of GROUP row tiles, column by column within one.
    auto origin = [&](int t, int& m0, int& n0) {
        const int first = t / per_group * GROUP, rows_in_group = min(tiles_m - first, GROUP);
        m0 = (first + (t % per_group) % rows_in_group) * BM;
        n0 = (t % per_group) / rows_in_group * BN;
    };
    const int kb_n = (k + BLOCK - 1) / BLOCK;
    const int wg = threadIdx.x >> 7;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full + s, 1);
            bar_init(empty + s, 2);
        }
        bar_init_fence();
    }
    __syncthreads();

    // A block takes tiles blockIdx.x, + gridDim.x, ...: one each when the grid covers them,
    // several when it is one block an SM (the producer then loads the next tile's first stages
    // while the consumers store this one's). `it` counts the stages used over all of them.
    if (wg == 0) {
        regs_dec<40>();
        if (threadIdx.x == 0) {
            int it = 0;
            for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
                int m0, n0;
                origin(t, m0, n0);
                for (int kb = 0; kb < kb_n; ++kb, ++it) {
                    const int s = it % STAGES;
                    bar_wait(empty + s, ((it / STAGES) & 1) ^ 1);
                    bar_arrive_tx(full + s, A_BYTES + B_BYTES);
                    tma_load(sa + s * A_BYTES, xmap, kb * BLOCK, m0, full + s);
                    tma_load(sb + s * B_BYTES, wmap, kb * BLOCK, n0, full + s);
                }
            }
        }
        return;
    }
    regs_inc<232>();
    const int c = wg - 1;
    float acc[BN / 2], part[BN / 2];
    int it = 0;
    for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
        int m0, n0;
        origin(t, m0, n0);
        const ScaleRows scales(xs, ws, Rows{m0, m, nullptr}, m0 + c * 64, n0, kb_n);
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) acc[i] = 0.0f;
        SliceScales sc = scales.at(0);
        for (int kb = 0; kb < kb_n; ++kb, ++it) {
            const int s = it % STAGES;
            // The next slice's scales load while this one computes.
            const SliceScales next = scales.at(min(kb + 1, kb_n - 1));
            bar_wait(full + s, (it / STAGES) & 1);
            slice<BN>(acc, part, sa + s * A_BYTES + c * 64 * BLOCK, sb + s * B_BYTES, sc);
            if ((threadIdx.x & 127) == 0) bar_arrive(empty + s);
            sc = next;
        }
        store_tile<BN>(y, acc, m0 + c * 64, n0, m, n);
    }
#else
    __trap();
#endif
}

// The Hopper product for decode-sized batches (up to 64 rows), operands swapped: 64 rows of the
// weight are wgmma's 64-row side and x's rows its NT columns, so a step of a few tokens
// computes NT columns, not 64 or 128 padded rows, and streams the weight at the memory's rate.
// Each output is still its slices' four wgmma from zero, promoted fma(part, sx · sw, acc) in k
// order: the products and their sums over 32 of k are those of the unswapped tiles (the device tests
// compare rows across batch sizes, hence across tiles). Warps 0–3 compute; warp 4 streams
// STAGES stages (64 weight rows and NT rows of x, 128 of k each) by TMA. The consumer issues
// slice kb + 1's wgmma before promoting slice kb (two `part` buffers), so the tensor cores and
// the promotion overlap; with SLICES > 2 (and enough of k), SLICES - 1 slices ahead: each
// slice's four wgmma are one dependent chain, and a product of few weight tiles is as long as
// its chains (four up to 32 rows, two at 64, where 32 accumulators a thread leave no room).
template <int NT, int STAGES, int SLICES, class Out>
__device__ void gemm_swap(Out* y, const TensorMap* xmap, const float* xs, const TensorMap* wmap,
                          const float* ws, int m, int n, int k, int tile) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    constexpr int W_BYTES = 64 * BLOCK, X_BYTES = NT * BLOCK, R = NT / 2;
    static_assert(NT % 8 == 0 && NT <= 64, "x's rows are wgmma's N: 8 to 64");
    uint8_t* sw = smem_1024();
    uint8_t* sx = sw + STAGES * W_BYTES;
    uint64_t* full = reinterpret_cast<uint64_t*>(sx + STAGES * X_BYTES);
    uint64_t* empty = full + STAGES;
    const int n0 = tile * 64;
    const int kb_n = (k + BLOCK - 1) / BLOCK;

    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; ++s) {
            bar_init(full + s, 1);
            bar_init(empty + s, 1);
        }
        bar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x >= 128) {
        if (threadIdx.x == 128) {
            for (int kb = 0; kb < kb_n; ++kb) {
                const int s = kb % STAGES;
                bar_wait(empty + s, ((kb / STAGES) & 1) ^ 1);
                bar_arrive_tx(full + s, W_BYTES + X_BYTES);
                tma_load(sw + s * W_BYTES, wmap, kb * BLOCK, n0, full + s);
                tma_load(sx + s * X_BYTES, xmap, kb * BLOCK, 0, full + s);
            }
        }
        return;
    }
    // This thread's outputs (wgmma's accumulator layout, swapped): weight rows w0 and w0 + 8,
    // and x's rows t0 + (i & 1) + (i >> 2) · 8 for part[i]; their scales, NT / 4 of x's rows
    // and the weight block's a slice, loaded when the slice's wgmma are issued and used a slice
    // later, so their latency hides behind the tensor cores.
    const int w0 = n0 + (threadIdx.x >> 5) * 16 + (threadIdx.x & 31) / 4;
    const int t0 = (threadIdx.x & 3) * 2;
    const float* wscale = ws + (long)(n0 / BLOCK) * kb_n;
    struct Scales {
        float x[NT / 4], w;
    };
    auto issue = [&](int kb, float* part, Scales& sc) {
        const int s = kb % STAGES;
        bar_wait(full + s, (kb / STAGES) & 1);
        fence_regs<R>(part);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            wgmma_e4m3<NT>(part, tile_desc(sw + s * W_BYTES, j * 32),
                           tile_desc(sx + s * X_BYTES, j * 32), j);
        }
        wgmma_commit();
#pragma unroll
        for (int j = 0; j < NT / 4; ++j) {
            const int t = min(t0 + (j & 1) + (j >> 1) * 8, m - 1);
            sc.x[j] = xs[(long)t * kb_n + kb];
        }
        sc.w = wscale[kb];
    };
    float acc[R], even[R], odd[R];
    Scales sc_even, sc_odd;
#pragma unroll
    for (int i = 0; i < R; ++i) acc[i] = 0.0f;
    // Slice kb's promotion from `part` (its wgmma done: wait<1> leaves only the next slice's
    // in flight); its stage freed.
    auto promote = [&](int kb, float* part, const Scales& sc) {
        fence_regs<R>(part);
        bar_arrive_if(empty + kb % STAGES, threadIdx.x == 0);
        float scale[NT / 4];
#pragma unroll
        for (int j = 0; j < NT / 4; ++j) scale[j] = __fmul_rn(sc.x[j], sc.w);
#pragma unroll
        for (int i = 0; i < R; ++i) {
            acc[i] = __fmaf_rn(part[i], scale[(i & 1) + (i >> 2) * 2], acc[i]);
        }
    };
    // SLICES slices in flight (kb_n ≥ 2 · SLICES): groups of SLICES steps, each issuing the
    // slice SLICES - 1 ahead and promoting one; the tail unrolled for each remainder, so that
    // every buffer index and wait count is a constant.
    auto many_slices = [&](auto slices) {
        constexpr int S = decltype(slices)::value;
        float part[S][R];
        Scales sc[S];
#pragma unroll
        for (int b = 0; b < S - 1; ++b) issue(b, part[b], sc[b]);
        int kb = 0;
        for (; kb + 2 * S - 1 <= kb_n; kb += S) {
#pragma unroll
            for (int b = 0; b < S; ++b) {
                issue(kb + b + S - 1, part[(b + S - 1) % S], sc[(b + S - 1) % S]);
                wgmma_wait<S - 1>();
                promote(kb + b, part[b], sc[b]);
            }
        }
        auto tail = [&](auto remaining) {
            constexpr int r = decltype(remaining)::value;
#pragma unroll
            for (int i = 0; i < r; ++i) {
                const int ahead = (i + S - 1) % S;
                if (i + S - 1 < r) issue(kb + i + S - 1, part[ahead], sc[ahead]);
                const int pending = (r - 1 - i) < (S - 1) ? (r - 1 - i) : (S - 1);
                if (pending == 0) wgmma_wait<0>();
                else if (pending == 1) wgmma_wait<1>();
                else if (pending == 2) wgmma_wait<2>();
                else wgmma_wait<3>();
                promote(kb + i, part[i % S], sc[i % S]);
            }
        };
        static_assert(S == 3 || S == 4, "the tail's waits count up to 3");
        // S - 1 to 2S - 2 slices remain here.
        switch (kb_n - kb) {
            case S - 1: tail(std::integral_constant<int, S - 1>{}); break;
            case S: tail(std::integral_constant<int, S>{}); break;
            case S + 1: tail(std::integral_constant<int, S + 1>{}); break;
            default: tail(std::integral_constant<int, 2 * S - 2>{}); break;
        }
    };
    auto two_slices = [&]() {
        issue(0, even, sc_even);
        int kb = 0;
        for (; kb + 2 < kb_n; kb += 2) {
            issue(kb + 1, odd, sc_odd);
            wgmma_wait<1>();
            promote(kb, even, sc_even);
            issue(kb + 2, even, sc_even);
            wgmma_wait<1>();
            promote(kb + 1, odd, sc_odd);
        }
        if (kb + 1 < kb_n) {
            issue(kb + 1, odd, sc_odd);
            wgmma_wait<1>();
            promote(kb, even, sc_even);
            wgmma_wait<0>();
            promote(kb + 1, odd, sc_odd);
        } else {
            wgmma_wait<0>();
            promote(kb, even, sc_even);
        }
    };
    if constexpr (SLICES > 2) {
        if (kb_n >= 2 * SLICES) {
            many_slices(std::integral_constant<int, SLICES>{});
        } else {
            two_slices();
        }
    } else {
        two_slices();
    }
#pragma unroll
    for (int i = 0; i < R; ++i) {
        const int row = t0 + (i & 1) + (i >> 2) * 8, col = w0 + ((i & 2) ? 8 : 0);
        if (row < m && col < n) store(y, (long)row * n + col, acc[i]);
    }
#else
    __trap();
#endif
}

// Up to three weights multiplied by one x in one launch (a layer's q, k and v, or gate and up):
// the blocks walk their 64-row tiles in order, each output with the bits of its own product.
template <class Out>
struct alignas(128) Parts {
    TensorMap w[3];  // the codes of each weight, boxes of 64 rows
    const float* ws[3];
    Out* y[3];
    int n[3];
    int count;
};

template <int NT, int STAGES, int SLICES, class Out>
__device__ void gemm_swap_parts(const Parts<Out>* parts, const TensorMap* xmap, const float* xs,
                                int m, int k) {
    int p = 0, tile = blockIdx.x;
    while (p + 1 < parts->count && tile >= (parts->n[p] + 63) / 64) {
        tile -= (parts->n[p] + 63) / 64;
        ++p;
    }
    gemm_swap<NT, STAGES, SLICES>(parts->y[p], xmap, xs, &parts->w[p], parts->ws[p], m,
                                  parts->n[p], k, tile);
}

}  // namespace

#define QUANTIZE(name, T)                                                                       \
    extern "C" __global__ void fp8_quantize_blocks_##name(uint8_t* codes, float* scales,      \
                                                          const T* w, int rows, int cols) {    \
        quantize_blocks(codes, scales, w, rows, cols);                                        \
    }                                                                                         \
    extern "C" __global__ void fp8_quantize_rows_##name(uint8_t* codes, float* scales,        \
                                                        const T* x, int rows, int cols) {      \
        quantize_rows(codes, scales, x, rows, cols);                                          \
    }
QUANTIZE(f32, float)
QUANTIZE(bf16, bf16)

// The tile shapes (shared memory: STAGES · (BM + BN) · 144 bytes):
//   big: 128 × 128, 8 warps, 3 stages (110,592 B): training-sized products;
//   m64: 64 × 64, 4 warps, 6 stages (110,592 B) and m16: 16 × 64, 4 warps, 8 stages
//   (92,160 B): decode-sized products, narrow so that a weight's columns spread over the SMs.
#define GEMM(name, Out, tag, WM, WN, MF, NF, ST)                                                  \
    extern "C" __global__ void __launch_bounds__(WM * WN * 32)                                  \
        fp8_gemm_##name##_##tag(Out* y, const uint8_t* xq, const float* xs, const uint8_t* wq,  \
                                const float* ws, int m, int n, int k) {                         \
        gemm<WM, WN, MF, NF, ST>(y, xq, xs, wq, ws, m, n, k);                                   \
    }
GEMM(f32, float, big, 2, 4, 4, 4, 3)
GEMM(bf16, bf16, big, 2, 4, 4, 4, 3)
GEMM(f32, float, m64, 1, 4, 4, 2, 6)
GEMM(bf16, bf16, m64, 1, 4, 4, 2, 6)
GEMM(f32, float, m16, 1, 4, 1, 2, 8)
GEMM(bf16, bf16, m16, 1, 4, 1, 2, 8)

// The Hopper tile fed by cp.async (shared memory: STAGES · (64 · WG + BN) · 128 bytes, plus
// 1024 to align): wg_mid, 128 × 64, 2 warpgroups, 5 stages (123,904 B).
#define GEMM_WG(name, Out, tag, WG, BN, ST)                                                       \
    extern "C" __global__ void __launch_bounds__(WG * 128)                                      \
        fp8_gemm_##name##_##tag(Out* y, const uint8_t* xq, const float* xs, const uint8_t* wq,  \
                                const float* ws, int m, int n, int k) {                         \
        gemm_wg<WG, BN, ST>(y, xq, xs, wq, ws, m, n, k);                                        \
    }
GEMM_WG(f32, float, wg_mid, 2, 64, 5)
GEMM_WG(bf16, bf16, wg_mid, 2, 64, 5)

// The warp-specialized Hopper tile, 128 × 128 with 6 stages (197,632 B with the barriers),
// 384 threads (a producer warpgroup and two consumers), groups of 8 row tiles.
#define GEMM_TMA(name, Out)                                                                       \
    extern "C" __global__ void __launch_bounds__(384, 1) fp8_gemm_##name##_tma(                 \
        Out* y, const __grid_constant__ TensorMap xmap, const float* xs,                        \
        const __grid_constant__ TensorMap wmap, const float* ws, int m, int n, int k) {         \
        gemm_tma<128, 6, 8>(y, &xmap, xs, &wmap, ws, m, n, k);                                  \
    }
GEMM_TMA(f32, float)
GEMM_TMA(bf16, bf16)

// The swapped decode tiles: NT rows of x against 64 weight rows a block, over one to three
// weights (`Parts`), 160 threads (four computing warps, one streaming), STAGES · (64 + NT) ·
// 128 bytes plus 1024 and the barriers: swap8 and swap16 16 stages (148 KB, 165 KB), swap32 10
// (124 KB), swap64 6 (99 KB: two blocks an SM); four slices in flight up to 32 rows, two at
// 64 (the probe's figures, H100: 16 rows × 12288 × 4096 in 22.3 µs against 27.1 with two
// slices; 64 rows × 12288 × 4096 in 27.5 µs at 6 stages against 30.1 at 8).
#define GEMM_SWAP(name, Out, NT, ST, SL)                                                          \
    extern "C" __global__ void __launch_bounds__(160) fp8_gemm_##name##_swap##NT(               \
        const __grid_constant__ Parts<Out> parts, const __grid_constant__ TensorMap xmap,       \
        const float* xs, int m, int k) {                                                        \
        gemm_swap_parts<NT, ST, SL>(&parts, &xmap, xs, m, k);                                   \
    }
GEMM_SWAP(f32, float, 8, 16, 4)
GEMM_SWAP(bf16, bf16, 8, 16, 4)
GEMM_SWAP(f32, float, 16, 16, 4)
GEMM_SWAP(bf16, bf16, 16, 16, 4)
GEMM_SWAP(f32, float, 32, 10, 4)
GEMM_SWAP(bf16, bf16, 32, 10, 4)
GEMM_SWAP(f32, float, 64, 6, 2)
GEMM_SWAP(bf16, bf16, 64, 6, 2)

// The grouped tile: 128 × 64, 2 warpgroups, 5 stages (123,904 B), grid (column tiles, pieces).
#define GROUPED(name, Out)                                                                        \
    extern "C" __global__ void __launch_bounds__(256) fp8_grouped_##name(                       \
        Out* y, const uint8_t* xq, const float* xs, const int* gather, const int* pieces,       \
        const uint8_t* const* wqs, const float* const* wss, int n, int k) {                     \
        grouped_wg<2, 64, 5>(y, xq, xs, gather, pieces, wqs, wss, n, k);                        \
    }
GROUPED(f32, float)
GROUPED(bf16, bf16)
