// Products of a decode step's few rows with a weight: c [m × n] = a [m × k] · wᵀ, w [n × k],
// bf16 operands and result, f32 accumulation, m ≤ 64 (ops::matmul through the batch-invariant
// route, where the pinning picks it for a tier of row counts that it serves faster and with the
// same bits: gemm_lt.rs).
//
// Bits: an output element is the sum over k in 16-wide m16n8k16 steps, in order, into one f32
// accumulator from zero, as the large cuBLASLt algorithm and grouped_gemm.cu compute it: no
// split over k, no atomics. The pinning checks the bits before it uses the kernel.
//
// A block holds every row (MT tiles of 16, one warp each) and BN columns of w; k streams through
// STAGES shared-memory stages of BK (cp.async), deep enough that a block's loads are mostly in
// flight at once: at decode sizes the product is a few round trips to memory, not arithmetic. Requires k % 8 == 0 and
// 16-byte aligned rows (the host checks).
#include "mma.cuh"

namespace {

using namespace miles;

constexpr int BK = 32;
constexpr int SKEW = 8;  // bf16 of padding per shared row: ldmatrix without bank conflicts
constexpr int LD = BK + SKEW;

// c = a · wᵀ for rows r < m, read from `a_row(r)` and written to `c_row(r)`; w [n × k], this
// block's BN of its rows.
template <int MT, int BN, int STAGES, class ARow, class CRow>
__device__ __forceinline__ void rows_product(ARow a_row, CRow c_row, const bf16* w, int m, int n,
                                             int k) {
    constexpr int ROWS = MT * 16;
    constexpr int THREADS = MT * 32;
    constexpr int CHUNKS = BK / 8;  // 16-byte chunks per stage row
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* sa = reinterpret_cast<bf16*>(shared);  // STAGES × [ROWS][LD]
    bf16* sb = sa + STAGES * ROWS * LD;          // STAGES × [BN][LD]
    const int n0 = blockIdx.x * BN;
    auto load = [&](int stage, int k0) {
        bf16* da = sa + stage * ROWS * LD;
        for (int e = threadIdx.x; e < ROWS * CHUNKS; e += THREADS) {
            const int r = e / CHUNKS, at = k0 + (e % CHUNKS) * 8;
            const bool real = r < m && at < k;
            cp_async16(da + r * LD + (e % CHUNKS) * 8, real ? a_row(r) + at : w, real ? 16 : 0);
        }
        bf16* db = sb + stage * BN * LD;
        for (int e = threadIdx.x; e < BN * CHUNKS; e += THREADS) {
            const int r = e / CHUNKS, at = k0 + (e % CHUNKS) * 8;
            const bool real = n0 + r < n && at < k;
            cp_async16(db + r * LD + (e % CHUNKS) * 8, real ? w + (size_t)(n0 + r) * k + at : w,
                       real ? 16 : 0);
        }
    };
    const int steps = (k + BK - 1) / BK;
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < steps) load(s, s * BK);
        commit();
    }
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    float acc[BN / 8][4];
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int s = 0; s < steps; ++s) {
        wait<STAGES - 2>();
        __syncthreads();
        // The stage read last iteration is free again (every warp is past it).
        const int next = s + STAGES - 1;
        if (next < steps) load(next % STAGES, next * BK);
        commit();
        const bf16* ta = sa + (s % STAGES) * ROWS * LD;
        const bf16* tb = sb + (s % STAGES) * BN * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[4];
            const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm_x4(af, ta + row * LD + kk + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < BN / 16; ++j) {
                uint32_t b[4];
                const int col = j * 16 + (lane & 7) + (lane >> 4) * 8;
                ldsm_x4(b, tb + col * LD + kk + ((lane >> 3) & 1) * 8);
                mma(acc[2 * j], af, b);
                mma(acc[2 * j + 1], af, b + 2);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j) {
        const int col = n0 + j * 8 + (lane & 3) * 2;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = warp * 16 + (lane >> 2) + h * 8;
            if (row >= m || col >= n) continue;
            bf16* o = c_row(row) + col;
            o[0] = __float2bfloat16_rn(acc[j][2 * h]);
            if (col + 1 < n) o[1] = __float2bfloat16_rn(acc[j][2 * h + 1]);
        }
    }
}

template <int MT, int BN, int STAGES>
__device__ __forceinline__ void rows_gemm(bf16* c, const bf16* a, const bf16* w, int m, int n,
                                          int k) {
    rows_product<MT, BN, STAGES>([&](int r) { return a + (size_t)r * k; },
                                 [&](int r) { return c + (size_t)r * n; }, w, m, n, k);
}

}  // namespace

// Up to 16 rows (one warp) or up to 64 (four warps), 16 or 64 columns a block; stages enough
// to keep ~100 KB of loads in flight per block (most of k at decode sizes).
#define ROWS_GEMM(NAME, MT, BN, STAGES)                                                        \
    extern "C" __global__ void __launch_bounds__(MT * 32)                                     \
        NAME(bf16* c, const bf16* a, const bf16* w, int m, int n, int k) {                   \
        rows_gemm<MT, BN, STAGES>(c, a, w, m, n, k);                                           \
    }
ROWS_GEMM(rows_gemm_m16_n16, 1, 16, 32)
ROWS_GEMM(rows_gemm_m16_n64, 1, 64, 16)
ROWS_GEMM(rows_gemm_m64_n16, 4, 16, 16)
ROWS_GEMM(rows_gemm_m64_n64, 4, 64, 12)

// A mixture's experts at decode sizes (ops::grouped_matmul, x·W_eᵀ): grid (n / 64, pieces);
// a piece (`tiles`: expert, first row, end row) holds at most 16 of one expert's sorted rows,
// x's row `rows[s]` (or s) for sorted row s. The k order is grouped_gemm.cu's, so a row gets
// the bits the large tiles give it, with a sixteenth of their products and a deep pipeline.
extern "C" __global__ void __launch_bounds__(32)
    grouped_rows_m16_n64(bf16* out, const bf16* x, const int* rows, int use_rows,
                         const unsigned long long* w, const int* tiles, int n, int k) {
    const int expert = tiles[3 * blockIdx.y];
    const int first = tiles[3 * blockIdx.y + 1];
    const int end = tiles[3 * blockIdx.y + 2];
    rows_product<1, 64, 16>(
        [&](int r) { return x + (size_t)(use_rows ? rows[first + r] : first + r) * k; },
        [&](int r) { return out + (size_t)(first + r) * n; },
        reinterpret_cast<const bf16*>(w[expert]), end - first, n, k);
}
