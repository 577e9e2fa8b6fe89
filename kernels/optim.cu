// The optimizer on the device: AdamW over f32 master weights and moments, and the sum of
// squares behind the global gradient norm.
//
// adamw_f32 computes exactly what miles-tensor's cpu::AdamW::step computes, rounding after
// every operation as the CPU does (the _rn intrinsics keep nvcc from fusing multiply-adds), so
// the two devices give the same bits. sumsq_* reduce in an order fixed by the data size alone
// (chunks of SUMSQ_CHUNK elements, a fixed tree per chunk, chunks in order), in f64.
#include <stdint.h>

namespace {

constexpr int SUMSQ_THREADS = 256;

}  // namespace

// One AdamW step: g = grad·grad_scale (the clipping factor), m and v updated in place, then
// p ← p·decay − step_size·m / (sqrt(v)/bc2_sqrt + eps), with step_size = lr/(1 − β1^t) and
// bc2_sqrt = sqrt(1 − β2^t) computed on the host in f64 as the CPU does.
extern "C" __global__ void adamw_f32(float* param, float* m, float* v, const float* grad,
                                     long long n, float grad_scale, float beta1, float beta2,
                                     float eps, float decay, float step_size, float bc2_sqrt) {
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x;
         i < static_cast<size_t>(n); i += static_cast<size_t>(gridDim.x) * blockDim.x) {
        const float g = __fmul_rn(grad[i], grad_scale);
        const float mi = __fadd_rn(__fmul_rn(beta1, m[i]), __fmul_rn(1.0f - beta1, g));
        const float vi =
            __fadd_rn(__fmul_rn(beta2, v[i]), __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        m[i] = mi;
        v[i] = vi;
        param[i] = __fsub_rn(__fmul_rn(param[i], decay), __fdiv_rn(__fmul_rn(step_size, mi), denom));
    }
}

// partial[b] = Σ x² over elements [b·chunk, (b+1)·chunk): threads stride the chunk, then a fixed
// shared-memory tree. One block of SUMSQ_THREADS per chunk.
extern "C" __global__ void sumsq_partial_f32(double* partial, const float* x, long long n,
                                             long long chunk) {
    __shared__ double scratch[SUMSQ_THREADS];
    const long long start = blockIdx.x * chunk;
    const long long end = start + chunk < n ? start + chunk : n;
    double acc = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += SUMSQ_THREADS) {
        const double xi = x[i];
        acc += xi * xi;
    }
    scratch[threadIdx.x] = acc;
    __syncthreads();
    for (int width = SUMSQ_THREADS / 2; width > 0; width /= 2) {
        if (threadIdx.x < width) {
            scratch[threadIdx.x] += scratch[threadIdx.x + width];
        }
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        partial[blockIdx.x] = scratch[0];
    }
}

// out[0] = Σ partial[0..parts), in order (one thread: parts is small).
extern "C" __global__ void sumsq_total(double* out, const double* partial, int parts) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        double total = 0.0;
        for (int b = 0; b < parts; ++b) {
            total += partial[b];
        }
        out[0] = total;
    }
}
