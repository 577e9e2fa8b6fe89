// INT4 weights, miles' QAT recipe (CPU twins in miles-tensor/src/cpu/int4.rs): a weight
// [rows × cols] of f32 masters in groups of `group` consecutive inputs of a row; a group's scale
// s = max(amax / 7, 1e-5), each weight's level q = clamp(rint(w / s), −7, 7) (rint: round half to
// even) and its value q · s. max is exact and the quotient and product are single IEEE
// operations, so levels, scales and values are the CPU's bits.
//
// int4_fake_quantize_{f32,bf16} (ops::fake_quantize_int4): the values q · s, in f32 or rounded to
// bf16. One warp per group, `group` / 32 weights a lane (group is 32 or 128).
// int4_quantize_pack (ops::Int4Matrix): the levels as compressed-tensors packs them (q + 8 in a
// nibble, eight of a row's consecutive levels in an int32, the first lowest) and the scales.
// int4_dequantize_{f32,bf16} (Int4Matrix::dequantize): the values q · s back from the packed
// words, one thread a word.
// int4_rows_gemm_* (ops::int4_linear, W4A16): c [m × n] = a [m × k] · wᵀ for a decode step's few
// bf16 rows, w packed: rows_gemm.cu's product, its A tiles loaded the same way and its B tiles
// made in shared memory from the packed words, each value bf16(q · s) as the QAT forward's bf16
// compute copy holds it, then the same m16n8k16 steps in k order into one f32 accumulator; so
// the result has the bits of the bf16 product with the compute copy.
// int4_grouped_rows_* (ops::int4_grouped_linear): the same product for a mixture of experts,
// every expert's rows in one launch.
#include "common.cuh"
#include "mma.cuh"

namespace {

// The group's scale, every lane of the warp: s = max(amax / 7, 1e-5).
__device__ __forceinline__ float group_scale(const float* x, int group, int lane) {
    float amax = 0.0f;
    for (int i = lane; i < group; i += 32) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    return fmaxf(__fdiv_rn(amax, 7.0f), 1e-5f);
}

// A weight's level, as the CPU keeps it: an integer (-0 is 0), a NaN quotient 0.
__device__ __forceinline__ int level(float x, float s) {
    const float r = rintf(__fdiv_rn(x, s));
    return isnan(r) ? 0 : static_cast<int>(fminf(fmaxf(r, -7.0f), 7.0f));
}

template <typename T>
__device__ void fake_quantize(T* out, const float* w, int group, long long groups) {
    const long long g = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (g >= groups) return;
    const int lane = threadIdx.x & 31;
    const float* x = w + g * group;
    const float s = group_scale(x, group, lane);
    for (int i = lane; i < group; i += 32) {
        float v[1] = {__fmul_rn(static_cast<float>(level(x[i], s)), s)};
        miles::store<1>(out + g * group + i, v);
    }
}

constexpr int BK = 32;
constexpr int SKEW = 8;  // bf16 of padding per shared row: ldmatrix without bank conflicts
constexpr int LD = BK + SKEW;
constexpr int WORDS = BK / 8;  // packed words of a row per stage (16 bytes)

// The block's product of `m` rows (row r of A at a_row(r), of C at c_row(r)) with the packed
// weight `words`, `scales` ([n × k]), over output columns blockIdx.x · BN ..
template <int MT, int BN, int STAGES, class ARow, class CRow>
__device__ __forceinline__ void int4_rows_gemm(ARow a_row, CRow c_row, const int* words,
                                               const float* scales, int m, int n, int k,
                                               int group) {
    using namespace miles;
    constexpr int ROWS = MT * 16;
    constexpr int THREADS = MT * 32;
    constexpr int CHUNKS = BK / 8;  // 16-byte chunks of a stage row of A
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* sa = reinterpret_cast<bf16*>(shared);             // STAGES × [ROWS][LD]
    bf16* tile = sa + STAGES * ROWS * LD;                    // [BN][LD]: this step's B
    int* sw = reinterpret_cast<int*>(tile + BN * LD);        // STAGES × [BN][WORDS]
    const int n0 = blockIdx.x * BN;
    const size_t row_words = k / 8, row_groups = k / group;
    auto load = [&](int stage, int k0) {
        bf16* da = sa + stage * ROWS * LD;
        for (int e = threadIdx.x; e < ROWS * CHUNKS; e += THREADS) {
            const int r = e / CHUNKS, at = k0 + (e % CHUNKS) * 8;
            const bool real = r < m && at < k;
            // (A zero-byte copy still names a valid address: the words'.)
            const void* src = real ? static_cast<const void*>(a_row(r) + at) : words;
            cp_async16(da + r * LD + (e % CHUNKS) * 8, src, real ? 16 : 0);
        }
        int* dw = sw + stage * BN * WORDS;
        for (int r = threadIdx.x; r < BN; r += THREADS) {
            const bool real = n0 + r < n;
            cp_async16(dw + r * WORDS, real ? words + (n0 + r) * row_words + k0 / 8 : words,
                       real ? 16 : 0);
        }
    };
    const int steps = k / BK;
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
        // The stage read last iteration, and the tile, are free again (every warp is past them).
        const int next = s + STAGES - 1;
        if (next < steps) load(next % STAGES, next * BK);
        commit();
        // B from the packed words: each value bf16(q · s), 8 of them (one word) a chunk.
        const int* tw = sw + (s % STAGES) * BN * WORDS;
        for (int e = threadIdx.x; e < BN * WORDS; e += THREADS) {
            const int r = e / WORDS, ch = e % WORDS;
            const float sc = n0 + r < n ? scales[(n0 + r) * row_groups + (s * BK) / group] : 0.0f;
            const unsigned word = static_cast<unsigned>(tw[r * WORDS + ch]);
            float v[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int q = static_cast<int>((word >> (4 * i)) & 15u) - 8;
                v[i] = __fmul_rn(static_cast<float>(q), sc);
            }
            store<4>(tile + r * LD + ch * 8, v);
            store<4>(tile + r * LD + ch * 8 + 4, v + 4);
        }
        __syncthreads();
        const bf16* ta = sa + (s % STAGES) * ROWS * LD;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[4];
            const int row = warp * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm_x4(af, ta + row * LD + kk + (lane >> 4) * 8);
#pragma unroll
            for (int j = 0; j < BN / 16; ++j) {
                uint32_t b[4];
                const int col = j * 16 + (lane & 7) + (lane >> 4) * 8;
                ldsm_x4(b, tile + col * LD + kk + ((lane >> 3) & 1) * 8);
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

}  // namespace

extern "C" __global__ void int4_fake_quantize_f32(float* out, const float* w, int group,
                                                  long long groups) {
    fake_quantize(out, w, group, groups);
}

extern "C" __global__ void int4_fake_quantize_bf16(__nv_bfloat16* out, const float* w, int group,
                                                   long long groups) {
    fake_quantize(out, w, group, groups);
}

// words[g · group / 8 + j] for group g: its levels j·8 .. j·8 + 7 as nibbles q + 8, and
// scales[g] its scale. One warp per group; lanes below group / 8 write a word each.
extern "C" __global__ void int4_quantize_pack(int* words, float* scales, const float* w,
                                              int group, long long groups) {
    const long long g = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (g >= groups) return;
    const int lane = threadIdx.x & 31;
    const float* x = w + g * group;
    const float s = group_scale(x, group, lane);
    if (lane == 0) scales[g] = s;
    for (int j = lane; j < group / 8; j += 32) {
        unsigned word = 0;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            word |= static_cast<unsigned>(level(x[j * 8 + i], s) + 8) << (4 * i);
        }
        words[g * (group / 8) + j] = static_cast<int>(word);
    }
}

// Up to 16 rows (one warp) or up to 64 (four warps), 16 columns a block. Requires k and group
// multiples of 32, group dividing k (the host checks).
#define INT4_ROWS_GEMM(NAME, MT, BN, STAGES)                                                   \
    extern "C" __global__ void __launch_bounds__(MT * 32)                                     \
        NAME(miles::bf16* c, const miles::bf16* a, const int* words, const float* scales,       \
             int m, int n, int k, int group) {                                                \
        int4_rows_gemm<MT, BN, STAGES>([&](int r) { return a + (size_t)r * k; },               \
                                       [&](int r) { return c + (size_t)r * n; }, words, scales, \
                                       m, n, k, group);                                         \
    }
INT4_ROWS_GEMM(int4_rows_gemm_m16_n16, 1, 16, 16)
INT4_ROWS_GEMM(int4_rows_gemm_m64_n16, 4, 16, 8)

// A mixture of experts' W4A16 products (ops::int4_grouped_linear): out[s] = x[row(s)] · W_eᵀ
// for the rows s of expert e, row(s) = rows[s] (use_rows) or s, W_e packed at words[e],
// scales[e]. `tiles` holds (expert, first row, end row) per block row, at most 64 rows each
// (grouped_gemm.cu's cut); grid (column blocks, tiles). The same steps as the rows product, so a
// row's outputs have the bits of grouped_gemm.cu's product with the bf16 compute copies.
#define INT4_GROUPED_ROWS(NAME, BN)                                                            \
    extern "C" __global__ void __launch_bounds__(128)                                         \
        NAME(miles::bf16* out, const miles::bf16* x, const int* rows, int use_rows,             \
             const unsigned long long* words, const unsigned long long* scales,                 \
             const int* tiles, int n, int k, int group) {                                       \
        const int expert = tiles[3 * blockIdx.y];                                               \
        const int first = tiles[3 * blockIdx.y + 1];                                            \
        const int end = tiles[3 * blockIdx.y + 2];                                              \
        int4_rows_gemm<4, BN, 8>(                                                               \
            [&](int r) { return x + (size_t)(use_rows ? rows[first + r] : first + r) * k; },    \
            [&](int r) { return out + (size_t)(first + r) * n; },                               \
            reinterpret_cast<const int*>(words[expert]),                                        \
            reinterpret_cast<const float*>(scales[expert]), end - first, n, k, group);          \
    }
INT4_GROUPED_ROWS(int4_grouped_rows_n16, 16)
INT4_GROUPED_ROWS(int4_grouped_rows_n64, 64)

// out[i] = q_i · s for the 8 levels of words[w] (i = 8w ..), s the scale of their group.
template <typename T>
__device__ void dequantize(T* out, const int* words, const float* scales, int group,
                           long long count) {
    const long long w = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x;
    if (w >= count) return;
    const float s = scales[w * 8 / group];
    const unsigned word = static_cast<unsigned>(words[w]);
    float v[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        v[i] = __fmul_rn(static_cast<float>(static_cast<int>((word >> (4 * i)) & 15u) - 8), s);
    }
    miles::store<4>(out + w * 8, v);
    miles::store<4>(out + w * 8 + 4, v + 4);
}

extern "C" __global__ void int4_dequantize_f32(float* out, const int* words, const float* scales,
                                               int group, long long count) {
    dequantize(out, words, scales, group, count);
}

extern "C" __global__ void int4_dequantize_bf16(__nv_bfloat16* out, const int* words,
                                                const float* scales, int group, long long count) {
    dequantize(out, words, scales, group, count);
}
