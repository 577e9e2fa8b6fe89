// Element-wise dtype conversions (grid-stride loops over n elements).
#include "common.cuh"

extern "C" __global__ void f32_to_bf16(__nv_bfloat16* y, const float* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = __float2bfloat16_rn(x[i]);
    }
}

extern "C" __global__ void bf16_to_f32(float* y, const __nv_bfloat16* x, long long n) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        y[i] = __bfloat162float(x[i]);
    }
}
