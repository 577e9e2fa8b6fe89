// The row statistics of the language-model head: from f32 logits [rows × vocab], the
// log-probability of each row's target token and the entropy of the tempered distribution,
// and the gradient of g_lp·logp + g_ent·entropy with respect to the raw logits.
//
// Same maths as miles-tensor's cpu::logprob_row / logprob_row_backward: x = z / T, lse =
// max + log Σ exp(x − max), logp = x[target] − lse, entropy = lse − Σ exp(x − lse)·x, all f32.
// One block of LOGPROB_THREADS per row, whatever the number of rows, and block sums in a fixed
// order: a row's results do not depend on its batch-mates (rollout and training agree).
#include "common.cuh"

namespace {

struct RowStats {
    float lse;
    float entropy;
};

// lse and entropy of row z (raw logits) at temperature t; every thread gets them.
__device__ RowStats row_stats(const float* z, int vocab, float t, float* scratch) {
    float m = -INFINITY;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        m = fmaxf(m, z[i] / t);
    }
    m = miles::block_max(m, scratch);
    float s = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        s += expf(z[i] / t - m);
    }
    const float lse = m + logf(miles::block_sum(s, scratch));
    float e = 0.0f;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = z[i] / t;
        e += expf(x - lse) * x;
    }
    return {lse, lse - miles::block_sum(e, scratch)};
}

}  // namespace

extern "C" __global__ void logprob_rows_f32(float* logp, float* entropy, const float* logits,
                                            const int* targets, int vocab, float t) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float* z = logits + row * vocab;
    const RowStats st = row_stats(z, vocab, t, scratch);
    if (threadIdx.x == 0) {
        logp[row] = z[targets[row]] / t - st.lse;
        entropy[row] = st.entropy;
    }
}

// d_logits[j] = (g_lp·(δ_j − p_j) − g_ent·p_j·(log p_j + H)) / T.
extern "C" __global__ void logprob_rows_backward_f32(float* d_logits, const float* logits,
                                                     const int* targets, const float* d_logp,
                                                     const float* d_entropy, int vocab,
                                                     float t) {
    __shared__ float scratch[32];
    const size_t row = blockIdx.x;
    const float* z = logits + row * vocab;
    const RowStats st = row_stats(z, vocab, t, scratch);
    const float g_lp = d_logp[row], g_ent = d_entropy[row];
    const int target = targets[row];
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float log_p = z[i] / t - st.lse;
        const float p = expf(log_p);
        const float onehot = i == target ? 1.0f : 0.0f;
        d_logits[row * vocab + i] = (g_lp * (onehot - p) - g_ent * p * (log_p + st.entropy)) / t;
    }
}
