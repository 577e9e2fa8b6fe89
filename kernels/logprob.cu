// The row statistics of the language-model head: from f32 logits [rows × vocab], the
// log-probability of each row's target token and the entropy of the tempered distribution,
// and the gradient of g_lp·logp + g_ent·entropy with respect to the raw logits.
//
// Same maths as miles-tensor's cpu::logprob_row / logprob_row_backward: x = z / T, lse =
// max + log Σ exp(x − max), logp = x[target] − lse, entropy = lse − Σ p·x, all f32, but in one
// pass over the row: each thread keeps a running (max m, Σ exp(x − m), Σ exp(x − m)·x), rescaled
// when its max grows, and the threads' triples are merged in a fixed order (a butterfly within
// each warp, then the warps in order). One block of LOGPROB_THREADS per row whatever the number
// of rows: a row's results do not depend on its batch-mates (rollout and training agree).
#include "common.cuh"

namespace {

// A running softmax over part of a row: max m, s = Σ exp(x − m), e = Σ exp(x − m)·x.
struct Online {
    float m;
    float s;
    float e;
};

__device__ __forceinline__ void push(Online& a, float x) {
    if (x > a.m) {
        const float r = expf(a.m - x);  // 0 while a is empty (m = −inf)
        a.s = a.s * r + 1.0f;
        a.e = a.e * r + x;
        a.m = x;
    } else {
        const float p = expf(x - a.m);
        a.s += p;
        a.e += p * x;
    }
}

// a merged with b; symmetric in its bits (IEEE sums and products commute), so both lanes of a
// butterfly step get the same triple.
__device__ __forceinline__ Online merge(Online a, Online b) {
    const float m = fmaxf(a.m, b.m);
    if (m == -INFINITY) return a;
    const float ra = expf(a.m - m), rb = expf(b.m - m);
    return {m, a.s * ra + b.s * rb, a.e * ra + b.e * rb};
}

struct RowStats {
    float lse;
    float entropy;
};

// lse and entropy of row z (raw logits) at temperature t; every thread gets them. `scratch`
// holds 3 floats per warp.
__device__ RowStats row_stats(const float* z, int vocab, float t, float* scratch) {
    Online a = {-INFINITY, 0.0f, 0.0f};
    if ((vocab & 3) == 0) {  // rows 16-byte aligned: four logits per load
        const float4* z4 = reinterpret_cast<const float4*>(z);
        for (int i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
            const float4 v = z4[i];
            push(a, v.x / t);
            push(a, v.y / t);
            push(a, v.z / t);
            push(a, v.w / t);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) push(a, z[i] / t);
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const Online b = {__shfl_xor_sync(0xffffffffu, a.m, offset),
                          __shfl_xor_sync(0xffffffffu, a.s, offset),
                          __shfl_xor_sync(0xffffffffu, a.e, offset)};
        a = merge(a, b);
    }
    const int warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        scratch[3 * warp] = a.m;
        scratch[3 * warp + 1] = a.s;
        scratch[3 * warp + 2] = a.e;
    }
    __syncthreads();
    Online total = {scratch[0], scratch[1], scratch[2]};
    for (int w = 1; w < warps; ++w) {
        total = merge(total, {scratch[3 * w], scratch[3 * w + 1], scratch[3 * w + 2]});
    }
    const float lse = total.m + logf(total.s);
    return {lse, lse - total.e / total.s};
}

}  // namespace

extern "C" __global__ void logprob_rows_f32(float* logp, float* entropy, const float* logits,
                                            const int* targets, int vocab, float t) {
    __shared__ float scratch[3 * 32];
    const size_t row = blockIdx.x;
    const float* z = logits + row * vocab;
    const RowStats st = row_stats(z, vocab, t, scratch);
    if (threadIdx.x == 0) {
        // A negative target (a sampler's "no token") has no logprob.
        const int target = targets[row];
        logp[row] = target < 0 ? NAN : z[target] / t - st.lse;
        entropy[row] = st.entropy;
    }
}

// d_logits[j] = (g_lp·(δ_j − p_j) − g_ent·p_j·(log p_j + H)) / T, written in f32 or rounded to
// bf16 (what the head's products take next).
template <typename Out>
__device__ void backward_row(Out* d_logits, const float* logits, const int* targets,
                             const float* d_logp, const float* d_entropy, int vocab, float t) {
    __shared__ float scratch[3 * 32];
    const size_t row = blockIdx.x;
    const float* z = logits + row * vocab;
    const RowStats st = row_stats(z, vocab, t, scratch);
    const float g_lp = d_logp[row], g_ent = d_entropy[row];
    const int target = targets[row];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float log_p = z[i] / t - st.lse;
        const float p = expf(log_p);
        const float onehot = i == target ? 1.0f : 0.0f;
        const float d = (g_lp * (onehot - p) - g_ent * p * (log_p + st.entropy)) / t;
        miles::store<1>(d_logits + row * vocab + i, &d);
    }
}

extern "C" __global__ void logprob_rows_backward_f32(float* d_logits, const float* logits,
                                                     const int* targets, const float* d_logp,
                                                     const float* d_entropy, int vocab,
                                                     float t) {
    backward_row(d_logits, logits, targets, d_logp, d_entropy, vocab, t);
}

extern "C" __global__ void logprob_rows_backward_bf16(__nv_bfloat16* d_logits,
                                                      const float* logits, const int* targets,
                                                      const float* d_logp,
                                                      const float* d_entropy, int vocab,
                                                      float t) {
    backward_row(d_logits, logits, targets, d_logp, d_entropy, vocab, t);
}
