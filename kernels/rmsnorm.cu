// RMSNorm over the last dimension: y = w · x · rstd, rstd = 1/sqrt(mean(x²) + eps), per row.
//
// Same maths as miles-tensor's cpu::rmsnorm_forward / rmsnorm_backward. x, y, dy and dx are
// f32 or bf16 (T); w, rstd and dw are f32, and all arithmetic is f32. One block per row; the
// block size depends on `hidden` alone, so a row's result does not depend on how many rows are
// in the batch. VEC = 4 loads and stores 4 elements at a time (hidden % 4 == 0), VEC = 1 any
// hidden. Names: rmsnorm_{forward,backward}_{f32,bf16}_v{1,4}, rmsnorm_dw_reduce, and the
// fused add_rmsnorm_{f32,bf16}_v{1,4} (a residual add, then the norm) and qk_norm_rope_bf16
// (the q/k norms and the rotary embedding).
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

// Qwen3's per-head q and k norms, then the rotary embedding, in one launch: block (token, h)
// normalizes head h of q (h < q_heads) or head h - q_heads of k, as rmsnorm's block for a row
// of d (launched with the same block size), rounds it to bf16 as rmsnorm's output is, and
// rotates it as rope does: the bits of the three separate kernels. rstd as rmsnorm writes it.
__device__ void qk_norm_rope(__nv_bfloat16* q_out, float* q_rstd, __nv_bfloat16* k_out,
                             float* k_rstd, const __nv_bfloat16* q, const __nv_bfloat16* k,
                             const float* q_w, const float* k_w, const float* cos,
                             const float* sin, int q_heads, int kv_heads, int d, float eps) {
    __shared__ float scratch[32];
    extern __shared__ float normed[];  // [d]: the head after the norm, rounded to bf16
    const size_t token = blockIdx.x;
    const bool is_q = static_cast<int>(blockIdx.y) < q_heads;
    const int heads = is_q ? q_heads : kv_heads;
    const size_t row = token * heads + (is_q ? blockIdx.y : blockIdx.y - q_heads);
    const __nv_bfloat16* x = (is_q ? q : k) + row * d;
    const float* w = is_q ? q_w : k_w;
    const float r = miles::rms_rstd<__nv_bfloat16, 4>(x, d, eps, scratch);
    if (threadIdx.x == 0) {
        (is_q ? q_rstd : k_rstd)[row] = r;
    }
    for (int i = threadIdx.x * 4; i < d; i += blockDim.x * 4) {
        float v[4], g[4];
        miles::load<4>(x + i, v);
        miles::load<4>(w + i, g);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            normed[i + j] = __bfloat162float(__float2bfloat16_rn(miles::rms_apply(g[j], v[j], r)));
        }
    }
    __syncthreads();
    const int half = d / 2;
    __nv_bfloat16* y = (is_q ? q_out : k_out) + row * d;
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float ya, yb;
        miles::rope_pair(normed[j], normed[j + half], cos[token * half + j], sin[token * half + j],
                         1.0f, &ya, &yb);
        y[j] = __float2bfloat16_rn(ya);
        y[j + half] = __float2bfloat16_rn(yb);
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
