// INT4 fake quantization, miles' QAT recipe (ops::fake_quantize_int4; CPU twin
// miles-tensor/src/cpu/int4.rs): a weight [rows × cols] of f32 masters in groups of `group`
// consecutive inputs of a row; a group's scale s = max(amax / 7, 1e-5), each weight becomes
// clamp(rint(w / s), −7, 7) · s (rint: round half to even), written in f32 or rounded to bf16.
// max is exact and the quotient and product are single IEEE operations, so the values are the
// CPU's bits. One warp per group, `group` / 32 weights a lane (group is 32 or 128).
#include "common.cuh"

namespace {

template <typename T>
__device__ void fake_quantize(T* out, const float* w, int group, long long groups) {
    const long long g = static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    if (g >= groups) return;
    const int lane = threadIdx.x & 31;
    const float* x = w + g * group;
    float amax = 0.0f;
    for (int i = lane; i < group; i += 32) amax = fmaxf(amax, fabsf(x[i]));
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
    }
    const float s = fmaxf(__fdiv_rn(amax, 7.0f), 1e-5f);
    for (int i = lane; i < group; i += 32) {
        const float r = rintf(__fdiv_rn(x[i], s));
        // The level as an integer, as the CPU keeps it: -0 is 0, and a NaN quotient 0.
        const int level = static_cast<int>(fminf(fmaxf(r, -7.0f), 7.0f));
        const float q = isnan(r) ? 0.0f : static_cast<float>(level);
        float v[1] = {__fmul_rn(q, s)};
        miles::store<1>(out + g * group + i, v);
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
