// Helpers shared by the kernels of miles-rs: vector loads and stores that widen to f32, and a
// block-wide sum whose order of additions is fixed (the same bits on every run and every thread).
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace miles {

// Loads VEC consecutive elements at `p` (aligned to VEC elements) as f32.
template <int VEC>
__device__ __forceinline__ void load(const float* p, float* v) {
    if constexpr (VEC == 4) {
        const float4 t = *reinterpret_cast<const float4*>(p);
        v[0] = t.x;
        v[1] = t.y;
        v[2] = t.z;
        v[3] = t.w;
    } else {
        static_assert(VEC == 1, "VEC is 1 or 4");
        v[0] = *p;
    }
}

template <int VEC>
__device__ __forceinline__ void load(const __nv_bfloat16* p, float* v) {
    if constexpr (VEC == 4) {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        const float2 lo = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.x));
        const float2 hi = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.y));
        v[0] = lo.x;
        v[1] = lo.y;
        v[2] = hi.x;
        v[3] = hi.y;
    } else {
        static_assert(VEC == 1, "VEC is 1 or 4");
        v[0] = __bfloat162float(*p);
    }
}

// Stores VEC f32 values at `p`, rounding to nearest even for bf16.
template <int VEC>
__device__ __forceinline__ void store(float* p, const float* v) {
    if constexpr (VEC == 4) {
        *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
    } else {
        static_assert(VEC == 1, "VEC is 1 or 4");
        *p = v[0];
    }
}

template <int VEC>
__device__ __forceinline__ void store(__nv_bfloat16* p, const float* v) {
    if constexpr (VEC == 4) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(v[0], v[1]);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(v[2], v[3]);
        uint2 t;
        t.x = *reinterpret_cast<const uint32_t*>(&lo);
        t.y = *reinterpret_cast<const uint32_t*>(&hi);
        *reinterpret_cast<uint2*>(p) = t;
    } else {
        static_assert(VEC == 1, "VEC is 1 or 4");
        *p = __float2bfloat16_rn(v[0]);
    }
}

// Butterfly sum over a warp: every lane ends with the same bits (a + b == b + a).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, offset);
    }
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the total.
// `scratch` is 32 floats of shared memory; calls may follow each other in a loop.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // the previous call's readers are done with scratch
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    // Every warp adds the warp totals in the same order, so all threads hold the same value.
    return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// Maximum over a warp: every lane ends with the same value (max is exact in any order).
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    }
    return v;
}

// Maximum over the block (as block_sum: blockDim.x a multiple of 32; every thread gets it).
__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int warps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    return warp_max(lane < warps ? scratch[lane] : -INFINITY);
}

// RMSNorm's rstd of the row `xr` (1/sqrt(mean(x²) + eps)), every thread of the block getting
// it: each thread sums the squares of its VEC-element chunks, then block_sum. rmsnorm.cu and the
// fused q/k kernel share it (and rms_apply), so their bits agree for the same block size.
template <typename T, int VEC>
__device__ __forceinline__ float rms_rstd(const T* xr, int hidden, float eps, float* scratch) {
    const int stride = blockDim.x * VEC;
    float ss = 0.0f;
    for (int i = threadIdx.x * VEC; i < hidden; i += stride) {
        float v[VEC];
        load<VEC>(xr + i, v);
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
            ss += v[j] * v[j];
        }
    }
    const float ms = block_sum(ss, scratch) / static_cast<float>(hidden);
    return 1.0f / sqrtf(ms + eps);
}

// One normalized element: weight · (x · rstd).
__device__ __forceinline__ float rms_apply(float w, float x, float rstd) { return w * (x * rstd); }

// One rotary pair (a at j, b at j + half of a head): sign +1 rotates, -1 is the backward.
__device__ __forceinline__ void rope_pair(float a, float b, float c, float s, float sign,
                                          float* ya, float* yb) {
    const float sk = sign * s;
    *ya = a * c - b * sk;
    *yb = b * c + a * sk;
}

}  // namespace miles
