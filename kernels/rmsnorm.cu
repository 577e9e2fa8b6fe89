// RMSNorm over the last dimension: y = w · x · rstd, rstd = 1/sqrt(mean(x²) + eps), per row.
//
// Same maths as miles-tensor's cpu::rmsnorm_forward / rmsnorm_backward. x, y, dy and dx are
// f32 or bf16 (T); w, rstd and dw are f32, and all arithmetic is f32. One block per row; the
// block size depends on `hidden` alone, so a row's result does not depend on how many rows are
// in the batch. VEC = 4 loads and stores 4 elements at a time (hidden % 4 == 0), VEC = 1 any
// hidden. Names: rmsnorm_{forward,backward}_{f32,bf16}_v{1,4}, rmsnorm_dw_reduce, and the
// fused add_rmsnorm_{f32,bf16}_v{1,4} (a residual add, then the norm), qk_norm_rope_bf16
// (the q/k norms and the rotary embedding) and, for decode steps, qkv_[norm_]rope_kv_write_bf16
// (the split of the q/k/v product, the norms, the rotation and the paged KV write).
#include "common.cuh"

namespace {

template <typename T, int VEC>
__device__ void forward(T* __restrict__ y, float* __restrict__ rstd, const T* __restrict__ x,
                        const float* __restrict__ w, int hidden, float eps) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const T* xr = x + row * hidden;
    T* yr = y + row * hidden;
    const int stride = blockDim.x * VEC;

    const float r = miles::rms_rstd<T, VEC>(xr, hidden, eps, scratch);
    if (threadIdx.x == 0) {
        rstd[row] = r;
    }
    for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
        float v[VEC], g[VEC], out[VEC];
        miles::load<VEC>(xr + i, v);
        miles::load<VEC>(w + i, g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            out[j] = miles::rms_apply(g[j], v[j], r);
        }
        miles::store<VEC>(yr + i, out);
    }
}

// Block b handles rows [b·rows_per_block, (b+1)·rows_per_block): dx row by row, and its partial
// dw (Σ over its rows of dy·x·rstd) in dw_part[b·hidden ..]. Each thread owns the same columns in
// every row, so the partial sums are plain per-thread read-modify-writes, in row order.
template <typename T, int VEC>
__device__ void backward(T* __restrict__ dx, float* __restrict__ dw_part, const T* __restrict__ dy,
                         const T* __restrict__ x, const float* __restrict__ w,
                         const float* __restrict__ rstd, int rows, int hidden,
                         int rows_per_block) {
    __shared__ float scratch[32];
    const int first = blockIdx.x * rows_per_block;
    const int last = min(rows, first + rows_per_block);
    float* part = dw_part + static_cast<size_t>(blockIdx.x) * hidden;
    const int stride = blockDim.x * VEC;

    for (int row = first; row < last; ++row) {
        const size_t offset = static_cast<size_t>(row) * hidden;
        const float r = rstd[row];
        // dx = r·(w·dy − x̂·mean(w·dy·x̂)), x̂ = x·r.
        float dot = 0.0f;
        for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
            float xv[VEC], gv[VEC], wv[VEC];
            miles::load<VEC>(x + offset + i, xv);
            miles::load<VEC>(dy + offset + i, gv);
            miles::load<VEC>(w + i, wv);
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                dot += wv[j] * gv[j] * xv[j] * r;
            }
        }
        const float mean = miles::block_sum(dot, scratch) / static_cast<float>(hidden);
        for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
            float xv[VEC], gv[VEC], wv[VEC], out[VEC], p[VEC];
            miles::load<VEC>(x + offset + i, xv);
            miles::load<VEC>(dy + offset + i, gv);
            miles::load<VEC>(w + i, wv);
            if (row == first) {
#pragma unroll
                for (int j = 0; j < VEC; ++j) {
                    p[j] = 0.0f;
                }
            } else {
                miles::load<VEC>(part + i, p);
            }
#pragma unroll
            for (int j = 0; j < VEC; ++j) {
                const float xhat = xv[j] * r;
                out[j] = r * (wv[j] * gv[j] - xhat * mean);
                p[j] += gv[j] * xhat;
            }
            miles::store<VEC>(dx + offset + i, out);
            miles::store<VEC>(part + i, p);
        }
    }
}

// s = a + b (rounded to T, as the add kernel's output), then forward() over s: a residual add
// and the next norm in one launch, with the two kernels' bits. Each thread rereads only the
// chunks of s it wrote itself, so no barrier sits between the two.
template <typename T, int VEC>
__device__ void add_forward(T* __restrict__ sum, T* __restrict__ y, float* __restrict__ rstd,
                            const T* __restrict__ a, const T* __restrict__ b,
                            const float* __restrict__ w, int hidden, float eps) {
    const size_t row = static_cast<size_t>(blockIdx.x) * hidden;
    for (int i = threadIdx.x * VEC; i < hidden; i += blockDim.x * VEC) {
        float x[VEC], d[VEC];
        miles::load<VEC>(a + row + i, x);
        miles::load<VEC>(b + row + i, d);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            x[j] += d[j];
        }
        miles::store<VEC>(sum + row + i, x);
    }
    forward<T, VEC>(y, rstd, sum, w, hidden, eps);
}

// One head of one token (d values at x), normalized by w when NORM (Qwen3's q/k norms: as
// rmsnorm's block for a row of d, launched with the same block size, rounded to bf16 as
// rmsnorm's output is; rstd to *rstd when given), then rotated as rope does, to y: the bits of
// the separate kernels. cos and sin are the token's rows of the tables.
template <bool NORM>
__device__ void norm_rope_head(__nv_bfloat16* y, float* rstd, const __nv_bfloat16* x,
                               const float* w, const float* cos, const float* sin, int d,
                               float eps) {
    __shared__ float scratch[32];
    extern __shared__ float normed[];  // [d]: the head after the norm, rounded to bf16
    if (NORM) {
        const float r = miles::rms_rstd<__nv_bfloat16, 4>(x, d, eps, scratch);
        if (rstd != nullptr && threadIdx.x == 0) {
            *rstd = r;
        }
        for (int i = threadIdx.x * 4; i < d; i += blockDim.x * 4) {
            float v[4], g[4];
            miles::load<4>(x + i, v);
            miles::load<4>(w + i, g);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                normed[i + j] =
                    __bfloat162float(__float2bfloat16_rn(miles::rms_apply(g[j], v[j], r)));
            }
        }
    } else {
        for (int i = threadIdx.x; i < d; i += blockDim.x) {
            normed[i] = __bfloat162float(x[i]);
        }
    }
    __syncthreads();
    const int half = d / 2;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float ya, yb;
        miles::rope_pair(normed[j], normed[j + half], cos[j], sin[j], 1.0f, &ya, &yb);
        y[j] = __float2bfloat16_rn(ya);
        y[j + half] = __float2bfloat16_rn(yb);
    }
}

// Qwen3's q and k norms and the rotary embedding in one launch: block (token, h) takes head h
// of q (h < q_heads) or head h - q_heads of k. rstd as rmsnorm writes it.
__device__ void qk_norm_rope(__nv_bfloat16* q_out, float* q_rstd, __nv_bfloat16* k_out,
                             float* k_rstd, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const float* q_w, const float* k_w, const float* cos,
                             const float* sin, int q_heads, int kv_heads, int d, float eps) {
    const size_t token = blockIdx.x;
    const bool is_q = static_cast<int>(blockIdx.y) < q_heads;
    const int heads = is_q ? q_heads : kv_heads;
    const size_t row = token * heads + (is_q ? blockIdx.y : blockIdx.y - q_heads);
    const size_t half = d / 2;
    norm_rope_head<true>((is_q ? q_out : k_out) + row * d, (is_q ? q_rstd : k_rstd) + row,
                         (is_q ? q : k) + row * d, is_q ? q_w : k_w, cos + token * half,
                         sin + token * half, d, eps);
}

// A decode step's queries, keys and values from the stacked q/k/v product qkv [tokens ×
// (q_heads + 2·kv_heads)·d]: block (token, h) takes head h of q (h < q_heads), normalized
// (NORM, with q_w) and rotated, to q_out [tokens × q_heads·d]; or kv head g = h - q_heads:
// its key normalized (k_w) and rotated, and its value, into the paged cache at the token's
// (block, slot) of `slots` (layout as kernels/paged.cu's). The bits of split_columns,
// qk_norm_rope (or rope) and paged_kv_write, in one launch.
template <bool NORM>
__device__ void qkv_rope_kv_write(__nv_bfloat16* q_out, __nv_bfloat16* cache,
                                  const __nv_bfloat16* qkv, const float* q_w, const float* k_w,
                                  const float* cos, const float* sin, const int* slots,
                                  int layer, int layers, int q_heads, int kv_heads, int d,
                                  float eps) {
    constexpr int KB = 64;  // cpu::KEY_BLOCK
    const size_t token = blockIdx.x;
    const int h = blockIdx.y;
    const __nv_bfloat16* row = qkv + token * (q_heads + 2 * kv_heads) * d;
    const size_t half = d / 2;
    const float* c = cos + token * half;
    const float* s = sin + token * half;
    if (h < q_heads) {
        norm_rope_head<NORM>(q_out + (token * q_heads + h) * d, nullptr, row + h * d, q_w, c, s,
                             d, eps);
        return;
    }
    const int g = h - q_heads;
    const size_t tile = static_cast<size_t>(KB) * d;
    const size_t base =
        (static_cast<size_t>(slots[2 * token]) * layers + layer) * 2 * kv_heads * tile;
    __nv_bfloat16* key = cache + base + g * tile + static_cast<size_t>(slots[2 * token + 1]) * d;
    __nv_bfloat16* value = key + kv_heads * tile;
    norm_rope_head<NORM>(key, nullptr, row + (q_heads + g) * d, k_w, c, s, d, eps);
    const __nv_bfloat16* v = row + (q_heads + kv_heads + g) * d;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        value[x] = v[x];
    }
}

}  // namespace

extern "C" __global__ void __launch_bounds__(1024) qk_norm_rope_bf16(
    __nv_bfloat16* q_out, float* q_rstd, __nv_bfloat16* k_out, float* k_rstd,
    const __nv_bfloat16* q, const __nv_bfloat16* k, const float* q_w, const float* k_w,
    const float* cos, const float* sin, int q_heads, int kv_heads, int d, float eps) {
    qk_norm_rope(q_out, q_rstd, k_out, k_rstd, q, k, q_w, k_w, cos, sin, q_heads, kv_heads, d,
                 eps);
}

#define QKV_ROPE_KV_WRITE(NAME, NORM)                                                           \
    extern "C" __global__ void __launch_bounds__(1024) NAME(                                    \
        __nv_bfloat16* q_out, __nv_bfloat16* cache, const __nv_bfloat16* qkv, const float* q_w, \
        const float* k_w, const float* cos, const float* sin, const int* slots, int layer,      \
        int layers, int q_heads, int kv_heads, int d, float eps) {                              \
        qkv_rope_kv_write<NORM>(q_out, cache, qkv, q_w, k_w, cos, sin, slots, layer, layers,    \
                                q_heads, kv_heads, d, eps);                                     \
    }

QKV_ROPE_KV_WRITE(qkv_rope_kv_write_bf16, false)
QKV_ROPE_KV_WRITE(qkv_norm_rope_kv_write_bf16, true)

#define MILES_RMSNORM(NAME, T, VEC)                                                              \
    extern "C" __global__ void __launch_bounds__(1024)                                          \
        rmsnorm_forward_##NAME##_v##VEC(T* y, float* rstd, const T* x, const float* w,          \
                                        int hidden, float eps) {                                 \
        forward<T, VEC>(y, rstd, x, w, hidden, eps);                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) rmsnorm_backward_##NAME##_v##VEC(        \
        T* dx, float* dw_part, const T* dy, const T* x, const float* w, const float* rstd,       \
        int rows, int hidden, int rows_per_block) {                                              \
        backward<T, VEC>(dx, dw_part, dy, x, w, rstd, rows, hidden, rows_per_block);             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(1024) add_rmsnorm_##NAME##_v##VEC(             \
        T* sum, T* y, float* rstd, const T* a, const T* b, const float* w, int hidden,           \
        float eps) {                                                                             \
        add_forward<T, VEC>(sum, y, rstd, a, b, w, hidden, eps);                                 \
    }

MILES_RMSNORM(f32, float, 1)
MILES_RMSNORM(f32, float, 4)
MILES_RMSNORM(bf16, __nv_bfloat16, 1)
MILES_RMSNORM(bf16, __nv_bfloat16, 4)

// dw[j] = Σ_b dw_part[b·hidden + j], b = 0, 1, … in order: the same bits on every run.
extern "C" __global__ void rmsnorm_dw_reduce(float* __restrict__ dw,
                                             const float* __restrict__ dw_part, int parts,
                                             int hidden) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= hidden) {
        return;
    }
    float s = 0.0f;
    for (int b = 0; b < parts; ++b) {
        s += dw_part[static_cast<size_t>(b) * hidden + j];
    }
    dw[j] = s;
}
