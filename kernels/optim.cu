// The optimizer on the device: AdamW over f32 master weights and moments (or bf16 moments:
// Megatron's precision-aware optimizer), and the sum of squares behind the global gradient norm.
//
// adamw_multi_f32 computes exactly what miles-tensor's cpu::AdamW::step computes, rounding after
// every operation as the CPU does (the _rn intrinsics keep nvcc from fusing multiply-adds), so
// the two devices give the same bits. sumsq_* reduce in an order fixed by the data size alone
// (chunks of SUMSQ_CHUNK elements, a fixed tree per chunk, chunks in order), in f64.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int SUMSQ_THREADS = 256;

// One tensor of a multi-tensor launch: its buffers (copy, the bf16 compute copy AdamW refreshes,
// may be null; m, v and param are null for a sum of squares; m and v are f32 or bf16 as the
// launch says), its size, and the first of its blocks in the launch (blocks of `chunk` elements,
// tensor after tensor, in order).
struct Slot {
    void* param;
    void* m;
    void* v;
    const float* grad;
    __nv_bfloat16* copy;
    long long n;
    long long first_block;
    // With stochastic rounding (bf16 master weights), the tensor's key for the random bits.
    unsigned long long key;
};

// The slot that block `b` belongs to (the last one starting at or before it).
__device__ __forceinline__ int slot_of(const Slot* slots, int count, long long b) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (slots[mid].first_block <= b) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

// A moment's element as f32, from f32 or bf16 storage; and stored back (bf16: to nearest even).
__device__ __forceinline__ float load_moment(const void* x, size_t i, bool bf16) {
    return bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(x)[i])
                : static_cast<const float*>(x)[i];
}
__device__ __forceinline__ void store_moment(void* x, size_t i, float value, bool bf16) {
    if (bf16) {
        static_cast<__nv_bfloat16*>(x)[i] = __float2bfloat16_rn(value);
    } else {
        static_cast<float*>(x)[i] = value;
    }
}

// cpu::rounding_bits: 16 random bits for element i of tensor `key` at `step`.
__device__ __forceinline__ unsigned rounding_bits(unsigned long long key, unsigned long long step,
                                                  unsigned long long i) {
    unsigned long long z = key * 0x9E3779B97F4A7C15ull ^ step * 0xBF58476D1CE4E5B9ull ^
                           i * 0x94D049BB133111EBull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return (unsigned)((z ^ (z >> 31)) & 0xffffull);
}

// cpu::round_bf16_stochastic: x to a bf16 value, away from zero with the probability of the
// dropped share of a step (not-finite values to nearest).
__device__ __forceinline__ __nv_bfloat16 round_bf16_stochastic(float x, unsigned r) {
    if (!isfinite(x)) return __float2bfloat16_rn(x);
    const unsigned short hi = (unsigned short)((__float_as_uint(x) + r) >> 16);
    return __ushort_as_bfloat16(hi);
}

// The update reads the moments' new values before their storage rounds them.
__device__ __forceinline__ float adamw_element(float p0, void* m, void* v, const float* grad,
                                               size_t i, float grad_scale, float beta1,
                                               float beta2, float eps, float decay,
                                               float step_size, float bc2_sqrt, bool m_bf16,
                                               bool v_bf16) {
    const float g = __fmul_rn(grad[i], grad_scale);
    const float mi =
        __fadd_rn(__fmul_rn(beta1, load_moment(m, i, m_bf16)), __fmul_rn(1.0f - beta1, g));
    const float vi = __fadd_rn(__fmul_rn(beta2, load_moment(v, i, v_bf16)),
                               __fmul_rn(__fmul_rn(1.0f - beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
    store_moment(m, i, mi, m_bf16);
    store_moment(v, i, vi, v_bf16);
    return __fsub_rn(__fmul_rn(p0, decay), __fdiv_rn(__fmul_rn(step_size, mi), denom));
}

// Σ x² over [start, end) of x by one block: threads stride, then a fixed shared-memory tree.
__device__ double block_sumsq(const float* x, long long start, long long end) {
    __shared__ double scratch[SUMSQ_THREADS];
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
    return scratch[0];
}

}  // namespace

// One AdamW step: g = grad·grad_scale (the clipping factor), m and v updated in place, then
// p ← p·decay − step_size·m / (sqrt(v)/bc2_sqrt + eps), with step_size = lr/(1 − β1^t) and
// bc2_sqrt = sqrt(1 − β2^t) computed on the host in f64 as the CPU does; over every tensor of
// `slots` in one launch, each block one chunk of one tensor, writing the bf16 compute copy
// (round to nearest even) where the slot has one. `flags`: bit 0, every m is bf16; bit 1, every
// v; bit 2, every weight is rounded to a bf16 value stochastically (cpu::rounding_bits of the
// slot's key, `step` and the element), bit 3, and kept in bf16 (else in f32).
extern "C" __global__ void adamw_multi_f32(const Slot* slots, int count, long long chunk,
                                           float grad_scale, float beta1, float beta2, float eps,
                                           float decay, float step_size, float bc2_sqrt,
                                           int flags, unsigned long long step) {
    const bool m_bf16 = flags & 1, v_bf16 = flags & 2, rounded = flags & 4, p_bf16 = flags & 8;
    const Slot s = slots[slot_of(slots, count, blockIdx.x)];
    const long long start = (blockIdx.x - s.first_block) * chunk;
    const long long end = start + chunk < s.n ? start + chunk : s.n;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        const float p0 = p_bf16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(s.param)[i])
                                : static_cast<const float*>(s.param)[i];
        float p = adamw_element(p0, s.m, s.v, s.grad, i, grad_scale, beta1, beta2, eps, decay,
                                step_size, bc2_sqrt, m_bf16, v_bf16);
        if (rounded) {
            const __nv_bfloat16 b = round_bf16_stochastic(p, rounding_bits(s.key, step, i));
            if (p_bf16) {
                static_cast<__nv_bfloat16*>(s.param)[i] = b;
                continue;
            }
            p = __bfloat162float(b);
        }
        static_cast<float*>(s.param)[i] = p;
        if (s.copy != nullptr) s.copy[i] = __float2bfloat16_rn(p);
    }
}

// partial[b] = Σ x² over elements [b·chunk, (b+1)·chunk). One block of SUMSQ_THREADS per chunk.
// The same partials for every slot's grad in one launch (a chunk never spans two tensors).
extern "C" __global__ void sumsq_multi_partial_f32(double* partial, const Slot* slots, int count,
                                                   long long chunk) {
    const Slot s = slots[slot_of(slots, count, blockIdx.x)];
    const long long start = (blockIdx.x - s.first_block) * chunk;
    const double sum = block_sumsq(s.grad, start, start + chunk < s.n ? start + chunk : s.n);
    if (threadIdx.x == 0) partial[blockIdx.x] = sum;
}

// out[0] = Σ over slots in order of (Σ of the slot's partials in order): the bits of summing the
// tensors' sums_squares one after the other from 0.
extern "C" __global__ void sumsq_multi_total(double* out, const double* partial, const Slot* slots,
                                             int count, long long chunk) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        double total = 0.0;
        for (int t = 0; t < count; ++t) {
            double sum = 0.0;
            const long long blocks = (slots[t].n + chunk - 1) / chunk;
            for (long long b = 0; b < blocks; ++b) sum += partial[slots[t].first_block + b];
            total += sum;
        }
        out[0] = total;
    }
}

// out[0] = Σ partial[0..parts), in order (one thread: parts is small).
