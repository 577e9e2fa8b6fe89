// RMSNorm over the last dimension: y = w · x · rstd, rstd = 1/sqrt(mean(x²) + eps), per row.
//
// Same maths as miles-tensor's cpu::rmsnorm_forward / rmsnorm_backward. x, y, dy and dx are
// f32 or bf16 (T); w, rstd and dw are f32, and all arithmetic is f32. One block per row; the
// block size depends on `hidden` alone, so a row's result does not depend on how many rows are
// in the batch. VEC = 4 loads and stores 4 elements at a time (hidden % 4 == 0), VEC = 1 any
// hidden. Names: rmsnorm_{forward,backward}_{f32,bf16}_v{1,4}, rmsnorm_dw_reduce.
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

    float ss = 0.0f;
    for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
        float v[VEC];
        miles::load<VEC>(xr + i, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            ss += v[j] * v[j];
        }
    }
    const float ms = miles::block_sum(ss, scratch) / static_cast<float>(hidden);
    const float r = 1.0f / sqrtf(ms + eps);
    if (threadIdx.x == 0) {
        rstd[row] = r;
    }
    for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
        float v[VEC], g[VEC], out[VEC];
        miles::load<VEC>(xr + i, v);
        miles::load<VEC>(w + i, g);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            out[j] = g[j] * (v[j] * r);
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

}  // namespace

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
