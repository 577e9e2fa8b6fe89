// Element-wise and gather ops of the decoder: SwiGLU (also from a stacked gate/up product),
// rotary embedding, the residual add, a linear's bias and its gradient, the token embedding and
// its deterministic backward.
//
// Same maths as miles-tensor's cpu::{swiglu_*, rope_*, embedding_*}; values are f32 or bf16 (T),
// all arithmetic f32. Each output element is computed by one thread from its own inputs only, so
// results do not depend on the launch shape or the batch. Names: <op>_{f32,bf16}, and for the
// streaming ops (swiglu, add, rope, embedding_forward) <op>_{f32,bf16}_v{1,4}: 4 elements per
// vector load when the sizes allow.
#include "common.cuh"

namespace {

template <typename T>
__device__ __forceinline__ float get(const T* p, size_t i) {
    float v;
    miles::load<1>(p + i, &v);
    return v;
}

template <typename T>
__device__ __forceinline__ void put(T* p, size_t i, float v) {
    miles::store<1>(p + i, &v);
}

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

#define GRID_STRIDE(i, n) \
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < (n); \
         i += static_cast<size_t>(gridDim.x) * blockDim.x)

// The tanh-approximated GELU's √(2/π) and cubic coefficient (PyTorch's kBeta, kKappa).
constexpr float GELU_BETA = 0.7978846f;
constexpr float GELU_KAPPA = 0.044715f;

__device__ __forceinline__ float gelu_tanh_inner(float g) {
    return tanhf(GELU_BETA * (g + GELU_KAPPA * g * g * g));
}

// h = act(gate) · up, act SiLU (SwiGLU) or, with GELU, the tanh GELU (GeGLU). VEC elements
// per step (VEC = 4 needs n % 4 == 0: aligned vector loads).
template <typename T, int VEC, bool GELU = false>
__device__ void swiglu_forward(T* h, const T* gate, const T* up, long long n) {
    GRID_STRIDE(v, static_cast<size_t>(n) / VEC) {
        const size_t i = v * VEC;
        float g[VEC], u[VEC], out[VEC];
        miles::load<VEC>(gate + i, g);
        miles::load<VEC>(up + i, u);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (GELU) {
                out[j] = 0.5f * g[j] * (1.0f + gelu_tanh_inner(g[j])) * u[j];
            } else {
                out[j] = g[j] * sigmoid(g[j]) * u[j];
            }
        }
        miles::store<VEC>(h + i, out);
    }
}

// swiglu_forward from the stacked gate/up product gu [rows × 2·inter] (the gate's columns
// first), reading both halves in place: h [rows × inter], the bits of a split, then swiglu.
template <typename T>
__device__ void swiglu_stacked(T* h, const T* gu, long long rows, int inter) {
    GRID_STRIDE(i, static_cast<size_t>(rows) * inter) {
        const size_t r = i / inter, j = i % inter;
        const float g = get(gu, r * 2 * inter + j);
        const float u = get(gu, r * 2 * inter + inter + j);
        put(h, i, g * sigmoid(g) * u);
    }
}

// A mixture of experts' combine: out[t, :] = Σ_j w[t·k + j] · y[picks[t·k + j], :], one block
// per row t, each element summed in f32 in rank order j with separately rounded products and
// sums (no contraction into FMAs), as the CPU twin computes it. k = 1 is a scaled gather.
template <typename T>
__device__ void pick_rows_sum(T* out, const T* y, const int* picks, const float* w, int k,
                              int width) {
    const size_t t = blockIdx.x;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const size_t p = t * k + j;
            acc = __fadd_rn(acc, __fmul_rn(w[p], get(y, static_cast<size_t>(picks[p]) * width + i)));
        }
        put(out, t * width + i, acc);
    }
}

// out[p] = a[p / k, :] · y[picks[p], :], one block per pick (the gate weights' gradient).
template <typename T>
__device__ void pick_row_dots(float* out, const T* a, const T* y, const int* picks, int k,
                              int width) {
    __shared__ float scratch[32];
    const size_t p = blockIdx.x;
    const size_t t = p / k;
    float s = 0.0f;
    for (int i = threadIdx.x; i < width; i += blockDim.x) {
        s += get(a, t * width + i) * get(y, static_cast<size_t>(picks[p]) * width + i);
    }
    s = miles::block_sum(s, scratch);
    if (threadIdx.x == 0) {
        out[p] = s;
    }
}

template <typename T, int VEC, bool GELU = false>
__device__ void swiglu_backward(T* d_gate, T* d_up, const T* dh, const T* gate, const T* up,
                                long long n) {
    GRID_STRIDE(v, static_cast<size_t>(n) / VEC) {
        const size_t i = v * VEC;
        float g[VEC], u[VEC], d[VEC], dg[VEC], du[VEC];
        miles::load<VEC>(gate + i, g);
        miles::load<VEC>(up + i, u);
        miles::load<VEC>(dh + i, d);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            if (GELU) {
                const float t = gelu_tanh_inner(g[j]);
                const float slope = 0.5f * (1.0f + t) + 0.5f * g[j] * (1.0f - t * t) * GELU_BETA *
                                                            (1.0f + 3.0f * GELU_KAPPA * g[j] * g[j]);
                du[j] = d[j] * (0.5f * g[j] * (1.0f + t));
                dg[j] = d[j] * u[j] * slope;
            } else {
                const float s = sigmoid(g[j]);
                du[j] = d[j] * g[j] * s;
                dg[j] = d[j] * u[j] * s * (1.0f + g[j] * (1.0f - s));
            }
        }
        miles::store<VEC>(d_up + i, du);
        miles::store<VEC>(d_gate + i, dg);
    }
}

// Rotate-half RoPE of x [tokens × heads × head_dim] with cos/sin [tokens × head_dim/2]:
// (a, b) → (a·c − b·s, b·c + a·s), s negated for the backward (sign = −1). VEC consecutive
// pairs per step (VEC = 4 needs head_dim/2 % 4 == 0).
template <typename T, int VEC>
__device__ void rope(T* y, const T* x, const float* cos, const float* sin, long long tokens,
                     int heads, int head_dim, float sign) {
    const int half = head_dim / 2;
    const size_t pairs = static_cast<size_t>(tokens) * heads * half;
    GRID_STRIDE(v, pairs / VEC) {
        const size_t p = v * VEC;
        const size_t token = p / (static_cast<size_t>(heads) * half);
        const int j = static_cast<int>(p % half);
        const size_t base = (p / half) * head_dim;  // (token, head) row start
        float c[VEC], s[VEC], a[VEC], b[VEC], ya[VEC], yb[VEC];
        miles::load<VEC>(cos + token * half + j, c);
        miles::load<VEC>(sin + token * half + j, s);
        miles::load<VEC>(x + base + j, a);
        miles::load<VEC>(x + base + j + half, b);
#pragma unroll
        for (int k = 0; k < VEC; ++k) {
            miles::rope_pair(a[k], b[k], c[k], s[k], sign, &ya[k], &yb[k]);
        }
        miles::store<VEC>(y + base + j, ya);
        miles::store<VEC>(y + base + j + half, yb);
    }
}

template <typename T, int VEC>
__device__ void add(T* out, const T* a, const T* b, long long n) {
    GRID_STRIDE(v, static_cast<size_t>(n) / VEC) {
        const size_t i = v * VEC;
        float x[VEC], y[VEC];
        miles::load<VEC>(a + i, x);
        miles::load<VEC>(b + i, y);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            x[j] += y[j];
        }
        miles::store<VEC>(out + i, x);
    }
}

// out[t] = table[ids[t]]: block t copies one row (ids checked on the host; a negative one, a
// sampler's none, reads row 0), VEC elements at a time (VEC = 4 needs hidden % 4 == 0; bf16 →
// f32 → bf16 is exact, so it is a copy).
template <typename T, int VEC>
__device__ void embedding_forward(T* out, const T* table, const int* ids, int hidden) {
    const size_t t = blockIdx.x;
    const size_t row = static_cast<size_t>(max(ids[t], 0)) * hidden;
    for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float v[VEC];
        miles::load<VEC>(table + row + i, v);
        miles::store<VEC>(out + t * hidden + i, v);
    }
}

// d_table[uniq[u]] (+)= Σ d_out[positions[k]] for k in [offsets[u], offsets[u+1]), positions
// in token order: block u owns one vocabulary row, each thread one column, so every sum runs in
// the CPU reference's order and no two blocks touch the same row (no atomics). `accumulate`
// adds the sum into the row (a gradient summed over micro-batches) instead of writing it.
template <typename T>
__device__ void embedding_backward(float* d_table, const T* d_out, const int* uniq,
                                   const int* offsets, const int* positions, int hidden,
                                   int accumulate) {
    const int u = blockIdx.x;
    float* dst = d_table + static_cast<size_t>(uniq[u]) * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int k = offsets[u]; k < offsets[u + 1]; ++k) {
            acc += get(d_out, static_cast<size_t>(positions[k]) * hidden + i);
        }
        dst[i] = accumulate ? dst[i] + acc : acc;
    }
}

}  // namespace

// The vectorized element-wise kernels, VEC 1 (any n) and 4 (n % 4 == 0).
#define VECTORIZED(T, SUFFIX, VEC)                                                             \
    extern "C" __global__ void swiglu_forward_##SUFFIX##_v##VEC(T* h, const T* gate,           \
                                                                const T* up, long long n) {    \
        swiglu_forward<T, VEC>(h, gate, up, n);                                                \
    }                                                                                          \
    extern "C" __global__ void swiglu_backward_##SUFFIX##_v##VEC(                              \
        T* d_gate, T* d_up, const T* dh, const T* gate, const T* up, long long n) {            \
        swiglu_backward<T, VEC>(d_gate, d_up, dh, gate, up, n);                                \
    }                                                                                          \
    extern "C" __global__ void geglu_forward_##SUFFIX##_v##VEC(T* h, const T* gate,            \
                                                               const T* up, long long n) {     \
        swiglu_forward<T, VEC, true>(h, gate, up, n);                                          \
    }                                                                                          \
    extern "C" __global__ void geglu_backward_##SUFFIX##_v##VEC(                               \
        T* d_gate, T* d_up, const T* dh, const T* gate, const T* up, long long n) {            \
        swiglu_backward<T, VEC, true>(d_gate, d_up, dh, gate, up, n);                          \
    }                                                                                          \
    extern "C" __global__ void add_##SUFFIX##_v##VEC(T* out, const T* a, const T* b,           \
                                                     long long n) {                            \
        add<T, VEC>(out, a, b, n);                                                             \
    }                                                                                          \
    extern "C" __global__ void rope_##SUFFIX##_v##VEC(T* y, const T* x, const float* cos,      \
                                                      const float* sin, long long tokens,      \
                                                      int heads, int head_dim, float sign) {   \
        rope<T, VEC>(y, x, cos, sin, tokens, heads, head_dim, sign);                           \
    }                                                                                          \
    extern "C" __global__ void embedding_forward_##SUFFIX##_v##VEC(                            \
        T* out, const T* table, const int* ids, int hidden) {                                  \
        embedding_forward<T, VEC>(out, table, ids, hidden);                                    \
    }

VECTORIZED(float, f32, 1)
VECTORIZED(float, f32, 4)
VECTORIZED(__nv_bfloat16, bf16, 1)
VECTORIZED(__nv_bfloat16, bf16, 4)

// dst[rows[i]] = src[i], one block per source row (the rows are distinct: no races).
template <typename T>
__device__ void scatter_rows(T* dst, const T* src, const int* rows, int hidden) {
    const size_t i = blockIdx.x;
    const size_t row = static_cast<size_t>(rows[i]) * hidden;
    for (int x = threadIdx.x; x < hidden; x += blockDim.x) {
        dst[row + x] = src[i * hidden + x];
    }
}

#define BOTH(T, SUFFIX)                                                                        \
    extern "C" __global__ void embedding_backward_##SUFFIX(                                    \
        float* d_table, const T* d_out, const int* uniq, const int* offsets,                   \
        const int* positions, int hidden, int accumulate) {                                    \
        embedding_backward(d_table, d_out, uniq, offsets, positions, hidden, accumulate);      \
    }                                                                                          \
    extern "C" __global__ void scatter_rows_##SUFFIX(T* dst, const T* src, const int* rows,   \
                                                     int hidden) {                             \
        scatter_rows(dst, src, rows, hidden);                                                  \
    }

BOTH(float, f32)
BOTH(__nv_bfloat16, bf16)

// out = x + bias, the same bias on every row of n: a linear's bias.
template <typename T>
__device__ void add_bias(T* out, const T* x, const T* bias, long long total, int n) {
    GRID_STRIDE(i, static_cast<size_t>(total)) {
        put(out, i, get(x, i) + get(bias, i % n));
    }
}

// A bias's gradient acc[j] += Σ_r x[r·n + j] in two passes, in the CPU reference's order
// (cpu::column_sums_acc): part[c·n + j] sums run c of COLUMN_SUM_ROWS rows in row order, one
// thread a (run, column), then acc[j] += the runs' sums in order.
constexpr int COLUMN_SUM_ROWS = 256;

template <typename T>
__device__ void column_run_sums(float* part, const T* x, long long rows, int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) {
        return;
    }
    const long long r0 = static_cast<long long>(blockIdx.y) * COLUMN_SUM_ROWS;
    const long long r1 = min(rows, r0 + COLUMN_SUM_ROWS);
    float sum = 0.0f;
    for (long long r = r0; r < r1; ++r) {
        sum += get(x, static_cast<size_t>(r) * n + j);
    }
    part[static_cast<size_t>(blockIdx.y) * n + j] = sum;
}

extern "C" __global__ void column_runs_acc(float* acc, const float* part, int runs, int n) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= n) {
        return;
    }
    float total = 0.0f;
    for (int c = 0; c < runs; ++c) {
        total += part[static_cast<size_t>(c) * n + j];
    }
    acc[j] += total;
}

// out = x · s, one scalar for every element (Gemma's scaled embedding and its gradient).
template <typename T>
__device__ void scale(T* out, const T* x, float s, long long n) {
    GRID_STRIDE(i, static_cast<size_t>(n)) {
        put(out, i, get(x, i) * s);
    }
}

// out = cap · tanh(x / cap) (Gemma 2's soft-capped logits), and its gradient from the output
// y: dx = dy · (1 − (y / cap)²).
template <typename T>
__device__ void softcap(T* out, const T* x, float cap, long long n) {
    GRID_STRIDE(i, static_cast<size_t>(n)) {
        put(out, i, cap * tanhf(get(x, i) / cap));
    }
}

template <typename T>
__device__ void softcap_backward(T* dx, const T* dy, const T* y, float cap, long long n) {
    GRID_STRIDE(i, static_cast<size_t>(n)) {
        const float r = get(y, i) / cap;
        put(dx, i, get(dy, i) * (1.0f - r * r));
    }
}

#define BIAS(T, SUFFIX)                                                                        \
    extern "C" __global__ void add_bias_##SUFFIX(T* out, const T* x, const T* bias,           \
                                                 long long total, int n) {                     \
        add_bias(out, x, bias, total, n);                                                      \
    }                                                                                          \
    extern "C" __global__ void column_run_sums_##SUFFIX(float* part, const T* x, long long rows, \
                                                        int n) {                                \
        column_run_sums(part, x, rows, n);                                                      \
    }                                                                                           \
    extern "C" __global__ void scale_##SUFFIX(T* out, const T* x, float s, long long n) {      \
        scale(out, x, s, n);                                                                   \
    }                                                                                          \
    extern "C" __global__ void softcap_##SUFFIX(T* out, const T* x, float cap, long long n) {  \
        softcap(out, x, cap, n);                                                               \
    }                                                                                          \
    extern "C" __global__ void softcap_backward_##SUFFIX(T* dx, const T* dy, const T* y,       \
                                                         float cap, long long n) {             \
        softcap_backward(dx, dy, y, cap, n);                                                   \
    }

BIAS(float, f32)
BIAS(__nv_bfloat16, bf16)

#define SWIGLU_STACKED(T, SUFFIX)                                                              \
    extern "C" __global__ void swiglu_stacked_##SUFFIX(T* h, const T* gu, long long rows,     \
                                                       int inter) {                            \
        swiglu_stacked(h, gu, rows, inter);                                                    \
    }

SWIGLU_STACKED(float, f32)
SWIGLU_STACKED(__nv_bfloat16, bf16)

#define PICK_ROWS(T, SUFFIX)                                                                   \
    extern "C" __global__ void pick_rows_sum_##SUFFIX(T* out, const T* y, const int* picks,   \
                                                      const float* w, int k, int width) {      \
        pick_rows_sum(out, y, picks, w, k, width);                                             \
    }                                                                                          \
    extern "C" __global__ void pick_row_dots_##SUFFIX(float* out, const T* a, const T* y,     \
                                                      const int* picks, int k, int width) {    \
        pick_row_dots(out, a, y, picks, k, width);                                             \
    }

PICK_ROWS(float, f32)
PICK_ROWS(__nv_bfloat16, bf16)

// The columns of x [rows × (w0 + w1 + w2)] into o0 [rows × w0], o1 [rows × w1], o2 [rows × w2]
// (w2 = 0: two parts), one block per row: a fused product's output split into its parts.
template <typename T>
__device__ void split_columns(const T* x, T* o0, int w0, T* o1, int w1, T* o2, int w2) {
    const size_t r = blockIdx.x;
    const int width = w0 + w1 + w2;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        const T v = x[r * width + c];
        if (c < w0) {
            o0[r * w0 + c] = v;
        } else if (c < w0 + w1) {
            o1[r * w1 + (c - w0)] = v;
        } else {
            o2[r * w2 + (c - w0 - w1)] = v;
        }
    }
}

#define SPLIT(T, SUFFIX)                                                                        \
    extern "C" __global__ void split_columns_##SUFFIX(const T* x, T* o0, int w0, T* o1, int w1, \
                                                      T* o2, int w2) {                          \
        split_columns(x, o0, w0, o1, w1, o2, w2);                                               \
    }

SPLIT(float, f32)
SPLIT(__nv_bfloat16, bf16)

// Columns by a fixed map (ops::gather_columns): a block per row, a thread per output column.
template <typename T>
__device__ void gather_columns(T* y, const T* a, int w0, const T* b, int w1, const int* map,
                               int out) {
    const size_t r = blockIdx.x;
    for (int j = threadIdx.x; j < out; j += blockDim.x) {
        const int s = map[j];
        float v = 0.0f;
        if (s >= 0) miles::load<1>(s < w0 ? &a[r * w0 + s] : &b[r * w1 + (s - w0)], &v);
        miles::store<1>(&y[r * out + j], &v);
    }
}

// Its adjoint (ops::scatter_columns): each source column the f32 sum of the output columns
// that read it, in their order, rounded once.
template <typename T>
__device__ void scatter_columns(T* dx, const T* dy, int out, const int* starts, const int* order,
                                int sources) {
    const size_t r = blockIdx.x;
    for (int s = threadIdx.x; s < sources; s += blockDim.x) {
        float acc = 0.0f;
        for (int e = starts[s]; e < starts[s + 1]; ++e) {
            float v;
            miles::load<1>(&dy[r * out + order[e]], &v);
            acc += v;
        }
        miles::store<1>(&dx[r * sources + s], &acc);
    }
}

#define COLUMNS(T, SUFFIX)                                                                      \
    extern "C" __global__ void gather_columns_##SUFFIX(T* y, const T* a, int w0, const T* b,    \
                                                       int w1, const int* map, int out) {       \
        gather_columns(y, a, w0, b, w1, map, out);                                              \
    }                                                                                           \
    extern "C" __global__ void scatter_columns_##SUFFIX(T* dx, const T* dy, int out,            \
                                                        const int* starts, const int* order,    \
                                                        int sources) {                          \
        scatter_columns(dx, dy, out, starts, order, sources);                                   \
    }

COLUMNS(float, f32)
COLUMNS(__nv_bfloat16, bf16)
