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
// bf16 rows, w packed: A tiles loaded as rows_gemm.cu loads them, the packed words and scales
// streamed beside them, and each warp's mma B fragments made from the words in registers, each
// value bf16(q · s) as the QAT forward's bf16 compute copy holds it; then the same m16n8k16
// steps in k order into one f32 accumulator, so the result has the bits of the bf16 product
// with the compute copy.
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

constexpr int SKEW = 8;  // bf16 of padding per shared row of A: ldmatrix without bank conflicts

// The bf16 pair (low, high) = (q_2t · s, q_2t+1 · s) of `word`'s nibbles 2t and 2t + 1: an mma
// B register as the QAT compute copy holds its values. A nibble n becomes the float 2^23 + n
// (n in the mantissa's low bits), less 2^23 + 8: the level n − 8 exactly, without the
// quarter-rate int-to-float conversion.
__device__ __forceinline__ uint32_t level_pair(unsigned word, int t, float s) {
    const unsigned w = word >> (8 * t);
    const float q0 = __fsub_rn(__uint_as_float(0x4B000000u | (w & 15u)), 8388616.0f);
    const float q1 = __fsub_rn(__uint_as_float(0x4B000000u | ((w >> 4) & 15u)), 8388616.0f);
    const __nv_bfloat162 v = __floats2bfloat162_rn(__fmul_rn(q0, s), __fmul_rn(q1, s));
    return *reinterpret_cast<const uint32_t*>(&v);
}

// The block's product of `m` rows (row r of A at a_row(r), of C at c_row(r)) with the packed
// weight `words`, `scales` ([n × k]) over output columns blockIdx.x · BN .., BN = 16 · WARPS.
// A, the words and the scales stream through STAGES shared-memory stages of BK inputs
// (cp.async); each of the MT · WARPS warps owns one row tile of 16 and 16 columns and makes
// their mma B fragments from the words in registers (no shared tile of values, one barrier a
// stage). The MT warps of a column group make the same fragments: redundant work, but in
// parallel, where one warp over all row tiles would take MT times as long.
template <int MT, int WARPS, int BK, int STAGES, class ARow, class CRow>
__device__ __forceinline__ void int4_rows_gemm(ARow a_row, CRow c_row, const int* words,
                                               const float* scales, int m, int n, int k,
                                               int group) {
    using namespace miles;
    constexpr int ROWS = MT * 16, BN = WARPS * 16, THREADS = MT * WARPS * 32;
    constexpr int LD = BK + SKEW;
    constexpr int CHUNKS = BK / 8;   // 16-byte chunks of a stage row of A
    constexpr int WCHUNKS = BK / 32; // 16-byte chunks (4 words) of a stage row of the weight
    constexpr int WLD = BK / 8 + 4;  // words per shared row: the 8 rows a load reads hit 8 banks
    constexpr int SCALES = BK / 32;  // a scale per 32 inputs of a stage row
    extern __shared__ __align__(16) unsigned char shared[];
    bf16* sa = reinterpret_cast<bf16*>(shared);                          // STAGES × [ROWS][LD]
    int* sw = reinterpret_cast<int*>(sa + STAGES * ROWS * LD);           // STAGES × [BN][WLD]
    float* ss = reinterpret_cast<float*>(sw + STAGES * BN * WLD);        // STAGES × [BN][SCALES]
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
        int* dw = sw + stage * BN * WLD;
        for (int e = threadIdx.x; e < BN * WCHUNKS; e += THREADS) {
            const int r = e / WCHUNKS, at = k0 + (e % WCHUNKS) * 32;
            const bool real = n0 + r < n && at < k;
            cp_async16(dw + r * WLD + (e % WCHUNKS) * 4,
                       real ? words + (n0 + r) * row_words + at / 8 : words, real ? 16 : 0);
        }
        float* ds = ss + stage * BN * SCALES;
        for (int e = threadIdx.x; e < BN * SCALES; e += THREADS) {
            const int r = e / SCALES, at = k0 + (e % SCALES) * 32;
            const bool real = n0 + r < n && at < k;
            cp_async4(ds + e, real ? scales + (n0 + r) * row_groups + at / group : scales,
                      real ? 4 : 0);
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
    const int g = lane >> 2, t = lane & 3;  // the mma fragments' group and thread in it
    const int tile = warp % MT, group16 = warp / MT;  // this warp's row tile and columns
    const bool rows_here = tile * 16 < m;
    float acc[2][4];
#pragma unroll
    for (int j = 0; j < 2; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    for (int s = 0; s < steps; ++s) {
        wait<STAGES - 2>();
        __syncthreads();
        // The stage read last iteration is free again (every warp is past it).
        const int next = s + STAGES - 1;
        if (next < steps) load(next % STAGES, next * BK);
        commit();
        if (!rows_here) continue;  // (still at every barrier and load)
        const bf16* ta = sa + (s % STAGES) * ROWS * LD;
        const int* tw = sw + (s % STAGES) * BN * WLD;
        const float* ts = ss + (s % STAGES) * BN * SCALES;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            // k/16 mma steps in all, as the bf16 product takes (k is a multiple of 32).
            if (s * BK + kk >= k) break;
            // B of this lane's columns g and g + 8 of the warp's 16: inputs kk + 2t, +1 (the
            // first word of the 16) and kk + 8 + 2t, +1 (the second).
            uint32_t b[2][2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int col = group16 * 16 + h * 8 + g;
                const int* cw = tw + col * WLD + kk / 8;
                const float sc = ts[col * SCALES + kk / 32];
                b[h][0] = level_pair(static_cast<unsigned>(cw[0]), t, sc);
                b[h][1] = level_pair(static_cast<unsigned>(cw[1]), t, sc);
            }
            uint32_t af[4];
            const int row = tile * 16 + (lane & 7) + ((lane >> 3) & 1) * 8;
            ldsm_x4(af, ta + row * LD + kk + (lane >> 4) * 8);
            mma(acc[0], af, b[0]);
            mma(acc[1], af, b[1]);
        }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int col = n0 + group16 * 16 + h * 8 + t * 2;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int row = tile * 16 + g + half * 8;
            if (row >= m || col >= n) continue;
            bf16* o = c_row(row) + col;
            o[0] = __float2bfloat16_rn(acc[h][2 * half]);
            if (col + 1 < n) o[1] = __float2bfloat16_rn(acc[h][2 * half + 1]);
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

// Up to 16 rows (one row tile) or up to 64 (four), 16, 32 or 64 columns a block, a warp per
// row tile and 16 columns, 64 inputs a stage. Requires k and group multiples of 32, group
// dividing k (the host checks).
#define INT4_ROWS_GEMM(NAME, MT, WARPS, STAGES)                                                \
    extern "C" __global__ void __launch_bounds__(MT * WARPS * 32)                             \
        NAME(miles::bf16* c, const miles::bf16* a, const int* words, const float* scales,       \
             int m, int n, int k, int group) {                                                \
        int4_rows_gemm<MT, WARPS, 64, STAGES>([&](int r) { return a + (size_t)r * k; },         \
                                              [&](int r) { return c + (size_t)r * n; }, words,  \
                                              scales, m, n, k, group);                          \
    }
INT4_ROWS_GEMM(int4_rows_gemm_m16_w1, 1, 1, 16)
INT4_ROWS_GEMM(int4_rows_gemm_m16_w2, 1, 2, 16)
INT4_ROWS_GEMM(int4_rows_gemm_m16_w4, 1, 4, 12)
INT4_ROWS_GEMM(int4_rows_gemm_m64_w1, 4, 1, 6)
INT4_ROWS_GEMM(int4_rows_gemm_m64_w2, 4, 2, 6)
INT4_ROWS_GEMM(int4_rows_gemm_m64_w4, 4, 4, 6)

// A mixture of experts' W4A16 products (ops::int4_grouped_linear): out[s] = x[row(s)] · W_eᵀ
// for the rows s of expert e, row(s) = rows[s] (use_rows) or s, W_e packed at words[e],
// scales[e]. `tiles` holds (expert, first row, end row) per block row, at most 64 rows each
// (grouped_gemm.cu's cut); grid (column blocks, tiles). The same steps as the rows product, so a
// row's outputs have the bits of grouped_gemm.cu's product with the bf16 compute copies.
#define INT4_GROUPED_ROWS(NAME, BN)                                                            \
    extern "C" __global__ void __launch_bounds__(BN * 8)                                      \
        NAME(miles::bf16* out, const miles::bf16* x, const int* rows, int use_rows,             \
             const unsigned long long* words, const unsigned long long* scales,                 \
             const int* tiles, int n, int k, int group) {                                       \
        const int expert = tiles[3 * blockIdx.y];                                               \
        const int first = tiles[3 * blockIdx.y + 1];                                            \
        const int end = tiles[3 * blockIdx.y + 2];                                              \
        int4_rows_gemm<4, BN / 16, 64, 6>(                                                      \
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
