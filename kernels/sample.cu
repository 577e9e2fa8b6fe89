// Token sampling from f32 logits [rows × vocab]: temperature, top-k, then top-p, then one draw
// per row from a given uniform. Same definition as miles-tensor's cpu::sample_row, and the same
// token: a token's mass is floor(exp(z − max) · 2^40) from f32 products and sums rounded one by
// one (__fmul_rn/__fadd_rn, never fused, bit for bit the CPU's; expf's last bits are not the
// CPU's), and masses are integers, so every sum is exact in any order.
//
// One block of 1024 threads per row, whatever the number of rows. The row (600 KB at a 150k
// vocabulary) is reread from L2 on each pass:
//  - the max of z = x / t (and whether any z is NaN or +inf), with top-k's first histogram;
//  - top-k: a radix select over the rank bits of z (11, 11, 10 bits) with count histograms
//    finds the k-th best z; ties there are cut in id order (the first ones by id stay);
//  - top-p: the same radix walk over the top-k set with mass histograms finds the last token,
//    in rank order, whose better-ranked mass is ≤ P; tied tokens share one mass, so the cut
//    among them is a division;
//  - the draw: kept masses summed per warp segment of ids, then the block scans the segment
//    that holds the target, a few ids per thread, in id order.
// Histograms use shared-memory atomics on integers: the same sums whatever the order.
//
// spec_verify_f32 verifies speculative drafts on the same masses (one block per chain of
// drafts): cpu::verify_chain's rule, its 128-bit products and their f64 roundings included.
#include <climits>

#include "common.cuh"

namespace {

constexpr int THREADS = 1024;  // cuda/sample.rs launches this many
constexpr int WARPS = THREADS / 32;
constexpr int BINS = 2048;  // the widest digit: 11 bits
constexpr int LEVELS = 3;  // digits of the 32 rank bits: 11, 11, 10 wide
__device__ __forceinline__ int digit_shift(int level) { return level == 0 ? 21 : level == 1 ? 10 : 0; }
__device__ __forceinline__ int digit_width(int level) { return level == 2 ? 10 : 11; }
constexpr unsigned ALL = 0xffffffffu;
using u64 = unsigned long long;
using u128 = unsigned __int128;

struct Shared {
    unsigned count[BINS];
    u64 mass[BINS];
    u64 seg[WARPS];  // per-warp-segment sums of find_first
    u64 scan64[WARPS];
    u128 seg128[WARPS];  // the same for 128-bit weights (speculative residuals)
    u128 scan128[WARPS];
    unsigned scan32[WARPS];
    float fscratch[32];
    int pick;  // the chosen digit, then the found id
    unsigned pick_count;
    unsigned pick_above_count;
    u64 pick_above_mass;
};

// A row of logits at a temperature, and its max z.
struct Row {
    const float* x;
    int vocab;
    float t;
    float m;
    // x / t (IEEE); x / 1 is x, and t = 1 is the usual case.
    __device__ float z(int i) const { return t == 1.0f ? x[i] : __fdiv_rn(x[i], t); }
};

// The kept set: rank bits above v, and those equal to v up to id idc.
struct Cut {
    unsigned v;
    int idc;
    __device__ bool keeps(unsigned bits, int i) const {
        return bits > v || (bits == v && i <= idc);
    }
};

// Order-preserving bits of z (NaN excluded), -0 as +0: larger is better ranked.
__device__ __forceinline__ unsigned rank_bits(float z) {
    const unsigned b = z == 0.0f ? 0u : __float_as_uint(z);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float from_rank_bits(unsigned v) {
    return __uint_as_float((v & 0x80000000u) ? (v & 0x7fffffffu) : ~v);
}

// floor(exp(d) · 2^40) for d = z − max ≤ 0: cpu::sample_mass, operation for operation.
__device__ __forceinline__ u64 mass(float d) {
    if (d < -28.0f) return 0;
    const float k = floorf(__fadd_rn(__fmul_rn(d, __uint_as_float(0x3fb8aa3bu)), 0.5f));
    const float r = __fsub_rn(__fsub_rn(d, __fmul_rn(k, __uint_as_float(0x3f317200u))),
                              __fmul_rn(k, __uint_as_float(0x35bfbe8eu)));
    float p = __uint_as_float(0x39500d01u);
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3ab60b61u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3c088889u));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3d2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), __uint_as_float(0x3e2aaaabu));
    p = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p = __fadd_rn(__fmul_rn(p, r), 1.0f);
    // floor(p · 2^(k + 40)), p in [0.7, 1.42]: p's 24-bit significand shifted.
    const unsigned b = __float_as_uint(p);
    const u64 significand = (b & 0x7fffffu) | 0x800000u;
    const int shift = static_cast<int>(b >> 23) - 150 + static_cast<int>(k) + 40;
    return shift >= 0 ? significand << shift : significand >> -shift;
}

__device__ __forceinline__ u64 row_mass(const Row& row, float z) {
    return mass(__fsub_rn(z, row.m));
}

// Warp shuffles of the sum types (a 128-bit value as its two halves).
__device__ __forceinline__ u64 shfl_xor(u64 v, int o) { return __shfl_xor_sync(ALL, v, o); }
__device__ __forceinline__ u128 shfl_xor(u128 v, int o) {
    const u64 lo = __shfl_xor_sync(ALL, static_cast<u64>(v), o);
    const u64 hi = __shfl_xor_sync(ALL, static_cast<u64>(v >> 64), o);
    return (static_cast<u128>(hi) << 64) | lo;
}
__device__ __forceinline__ unsigned shfl_up(unsigned v, int o) { return __shfl_up_sync(ALL, v, o); }
__device__ __forceinline__ u64 shfl_up(u64 v, int o) { return __shfl_up_sync(ALL, v, o); }
__device__ __forceinline__ u128 shfl_up(u128 v, int o) {
    const u64 lo = __shfl_up_sync(ALL, static_cast<u64>(v), o);
    const u64 hi = __shfl_up_sync(ALL, static_cast<u64>(v >> 64), o);
    return (static_cast<u128>(hi) << 64) | lo;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += shfl_xor(v, o);
    return v;
}

// Sum over the block (integers: exact); `scratch` holds a value per warp.
template <typename T>
__device__ T block_sum(T v, T* scratch) {
    v = warp_sum(v);
    __syncthreads();  // earlier readers of scratch are done
    if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < WARPS; ++w) total += scratch[w];
    return total;
}

// Exclusive prefix sum over the block in thread order.
template <typename T>
__device__ T block_exclusive_scan(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T incl = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T n = shfl_up(incl, o);
        if (lane >= o) incl += n;
    }
    __syncthreads();  // earlier readers of scratch are done
    if (lane == 31) scratch[warp] = incl;
    __syncthreads();
    T base = 0;
    for (int w = 0; w < warp; ++w) base += scratch[w];
    return base + incl - v;
}

// Ids [lo, hi) of warp w's segment: 32 contiguous segments, each a multiple of 32 long.
__device__ __forceinline__ int segment_len(int vocab) {
    return ((vocab + WARPS - 1) / WARPS + 31) / 32 * 32;
}

// The scratch of the segment sums and scans of each weight type.
__device__ __forceinline__ u64* seg_of(Shared& s, u64) { return s.seg; }
__device__ __forceinline__ u128* seg_of(Shared& s, u128) { return s.seg128; }
__device__ __forceinline__ u64* scan_of(Shared& s, u64) { return s.scan64; }
__device__ __forceinline__ u128* scan_of(Shared& s, u128) { return s.scan128; }

// Σ weight(i) over the row, leaving each warp segment's sum in the scratch (for find_first).
template <typename W>
__device__ auto segment_sums(int vocab, W weight, Shared& s) -> decltype(weight(0)) {
    using T = decltype(weight(0));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, len = segment_len(vocab);
    const int lo = min(warp * len, vocab), hi = min(lo + len, vocab);
    T sum = 0;
    for (int i = lo + lane; i < hi; i += 32) sum += weight(i);
    return block_sum(sum, seg_of(s, T{}));
}

// The first id i with Σ_{j ≤ i} weight(j) > target (< the total), after segment_sums with the
// same weights: the segment that holds it is split into runs of consecutive ids, one per
// thread, scanned over the block; the thread whose run crosses the target walks it.
template <typename W>
__device__ int find_first(int vocab, W weight, decltype(weight(0)) target, Shared& s) {
    using T = decltype(weight(0));
    const T* seg = seg_of(s, T{});
    const int len = segment_len(vocab);
    T before = 0;
    int w = 0;
    for (; w < WARPS - 1 && before + seg[w] <= target; ++w) before += seg[w];
    const int lo = min(w * len, vocab), hi = min(lo + len, vocab);
    const int per = (len + THREADS - 1) / THREADS;
    const int tlo = min(lo + static_cast<int>(threadIdx.x) * per, hi), thi = min(tlo + per, hi);
    T mine = 0;
    for (int i = tlo; i < thi; ++i) mine += weight(i);
    T cum = before + block_exclusive_scan(mine, scan_of(s, T{}));
    if (cum <= target && target < cum + mine) {
        for (int i = tlo; i < thi; ++i) {
            cum += weight(i);
            if (cum > target) {
                s.pick = i;
                break;
            }
        }
    }
    __syncthreads();
    const int found = s.pick;
    __syncthreads();  // s.pick is reused
    return found;
}

// The n-th (1-based) id, in id order, whose z has rank bits v.
__device__ int nth_with_bits(const Row& row, unsigned v, unsigned n, Shared& s) {
    auto is_v = [&](int i) -> u64 { return rank_bits(row.z(i)) == v ? 1 : 0; };
    segment_sums(row.vocab, is_v, s);
    return find_first(row.vocab, is_v, n - 1, s);
}

// Shared-memory atomicAdd of a u64 as two native 32-bit ones with the carry (the u64 one is a
// compare-and-swap loop, slow when lanes collide); the sum is exact, read after a barrier.
__device__ __forceinline__ void add_u64(u64* p, u64 v) {
    unsigned* words = reinterpret_cast<unsigned*>(p);  // little-endian: low word first
    const unsigned lo = static_cast<unsigned>(v), old = atomicAdd(words, lo);
    const unsigned hi = static_cast<unsigned>(v >> 32) + (old + lo < old ? 1u : 0u);
    if (hi) atomicAdd(words + 1, hi);
}

// Histograms (counts, and masses when with_mass) of the digit at `level` of the rank bits of
// the tokens of `cut` whose bits above that digit are those of `prefix`. With masses (top-p),
// tokens with z − max < −28 are left out: their mass is 0 and all the positive mass is ranked
// before them, more than P, so they are never kept and never make a bucket the one kept.
__device__ void histogram(const Row& row, int level, unsigned prefix, Cut cut, bool with_mass,
                          Shared& s) {
    for (int b = threadIdx.x; b < BINS; b += THREADS) {
        s.count[b] = 0;
        s.mass[b] = 0;
    }
    __syncthreads();
    const int shift = digit_shift(level), top = shift + digit_width(level);
    const unsigned high = top >= 32 ? 0u : ~0u << top, digit = (1u << digit_width(level)) - 1;
    for (int i = threadIdx.x; i < row.vocab; i += THREADS) {
        const float z = row.z(i);
        const unsigned bits = rank_bits(z);
        if ((bits & high) != (prefix & high) || !cut.keeps(bits, i)) continue;
        if (with_mass && __fsub_rn(z, row.m) < -28.0f) continue;
        const unsigned d = (bits >> shift) & digit;
        atomicAdd(&s.count[d], 1u);
        if (with_mass) {
            const u64 w = row_mass(row, z);
            if (w) add_u64(&s.mass[d], w);
        }
    }
    __syncthreads();
}

// The lowest digit d (of `bins`) with tokens whose digits above d hold fewer than `need`
// tokens and at most `budget` mass; into s.pick, s.pick_count and s.pick_above_*. Thread t
// holds bins (bins − 1 − 2t, bins − 2 − 2t), so a scan in thread order sums the digits above.
__device__ void pick_digit(int bins, unsigned need, u64 budget, Shared& s) {
    const int hi = bins - 1 - 2 * static_cast<int>(threadIdx.x), lo = hi - 1;
    const unsigned c_hi = hi >= 0 ? s.count[hi] : 0, c_lo = lo >= 0 ? s.count[lo] : 0;
    const u64 w_hi = hi >= 0 ? s.mass[hi] : 0, w_lo = lo >= 0 ? s.mass[lo] : 0;
    const unsigned c_above = block_exclusive_scan(c_hi + c_lo, s.scan32);
    const u64 w_above = block_exclusive_scan(w_hi + w_lo, s.scan64);
    if (threadIdx.x == 0) s.pick = BINS;
    __syncthreads();
    const bool ok_hi = hi >= 0 && c_hi > 0 && c_above < need && w_above <= budget;
    const bool ok_lo =
        lo >= 0 && c_lo > 0 && c_above + c_hi < need && w_above + w_hi <= budget;
    if (ok_lo || ok_hi) atomicMin(&s.pick, ok_lo ? lo : hi);
    __syncthreads();
    if (s.pick == lo || s.pick == hi) {
        const bool at_lo = s.pick == lo;
        s.pick_count = at_lo ? c_lo : c_hi;
        s.pick_above_count = at_lo ? c_above + c_hi : c_above;
        s.pick_above_mass = at_lo ? w_above + w_hi : w_above;
    }
    __syncthreads();
}

// Keeps the `k` best tokens (0 < k < vocab), the first digit's counts already in s.count.
__device__ Cut top_k_cut(const Row& row, unsigned k, Shared& s) {
    const Cut all = {0u, INT_MAX};
    unsigned prefix = 0, need = k;  // need: how many of the current bucket stay
    for (int level = 0; level < LEVELS; ++level) {
        if (level > 0) histogram(row, level, prefix, all, false, s);
        pick_digit(1 << digit_width(level), need, ~0ull, s);
        prefix |= static_cast<unsigned>(s.pick) << digit_shift(level);
        need -= s.pick_above_count;
    }
    const unsigned tied = s.pick_count;
    return {prefix, need < tied ? nth_with_bits(row, prefix, need, s) : INT_MAX};
}

// Keeps, of the set `cut`, the best tokens while the mass ranked before each is ≤ P =
// floor(top_p · its mass).
__device__ Cut top_p_cut(const Row& row, float top_p, Cut cut, Shared& s) {
    unsigned prefix = 0;
    u64 p = 0, above = 0;  // above: the set's mass ranked above the current bucket
    for (int level = 0; level < LEVELS; ++level) {
        histogram(row, level, prefix, cut, true, s);
        if (level == 0) {
            u64 mine = 0;
            for (int b = threadIdx.x; b < BINS; b += THREADS) mine += s.mass[b];
            const u64 total = block_sum(mine, s.scan64);
            p = static_cast<u64>(
                floor(__dmul_rn(static_cast<double>(top_p), __ull2double_rn(total))));
        }
        pick_digit(1 << digit_width(level), ~0u, p - above, s);
        prefix |= static_cast<unsigned>(s.pick) << digit_shift(level);
        above += s.pick_above_mass;
    }
    // The tied tokens of rank bits `prefix` (an id-ordered prefix of all those with these bits)
    // share one mass w: the j-th (from 0) has above + j·w before it.
    const unsigned tied = s.pick_count;
    const u64 w = row_mass(row, from_rank_bits(prefix));
    const u64 n = w == 0 ? tied : min(static_cast<u64>(tied), (p - above) / w + 1);
    if (n < tied) return {prefix, nth_with_bits(row, prefix, static_cast<unsigned>(n), s)};
    return {prefix, prefix == cut.v ? cut.idc : INT_MAX};
}

// The row's max z and its kept set (temperature, top-k, top-p) into row.m and cut; false when a
// tempered logit is NaN or +inf or all are −inf (cpu::kept_masses gives None).
__device__ bool kept_set(Row& row, int top_k, float top_p, Shared& s, Cut& cut) {
    const bool by_k = top_k > 0 && top_k < row.vocab;
    for (int b = threadIdx.x; b < BINS; b += THREADS) s.count[b] = 0;
    __syncthreads();
    int bad = 0;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < row.vocab; i += THREADS) {
        const float z = row.z(i);
        bad |= isnan(z) || z == INFINITY;
        m = fmaxf(m, z);
        // top-k's first histogram (counts need no max) in the same pass
        if (by_k) atomicAdd(&s.count[rank_bits(z) >> digit_shift(0)], 1u);
    }
    row.m = miles::block_max(m, s.fscratch);
    if (__syncthreads_or(bad) || row.m == -INFINITY) return false;
    cut = {0u, INT_MAX};  // rank bits are never 0 (that would be a NaN): all kept
    if (by_k) cut = top_k_cut(row, static_cast<unsigned>(top_k), s);
    if (top_p < 1.0f) cut = top_p_cut(row, top_p, cut, s);
    return true;
}

// Whether the row has masses (kept_set's test, without its cuts).
__device__ bool has_mass(const Row& row, Shared& s) {
    int bad = 0;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < row.vocab; i += THREADS) {
        const float z = row.z(i);
        bad |= isnan(z) || z == INFINITY;
        m = fmaxf(m, z);
    }
    m = miles::block_max(m, s.fscratch);
    return !__syncthreads_or(bad) && m != -INFINITY;
}

__device__ __forceinline__ u64 kept_mass(const Row& row, Cut cut, int i) {
    const float z = row.z(i);
    return cut.keeps(rank_bits(z), i) ? row_mass(row, z) : 0;
}

// The token at u of the kept masses (cpu::draw): the first whose running sum passes
// floor(u · total).
__device__ int draw_kept(const Row& row, Cut cut, double u, Shared& s) {
    auto w = [&](int i) -> u64 { return kept_mass(row, cut, i); };
    const u64 total = segment_sums(row.vocab, w, s);
    const u64 target =
        min(static_cast<u64>(floor(__dmul_rn(u, __ull2double_rn(total)))), total - 1);
    return find_first(row.vocab, w, target, s);
}

// x rounded to the nearest double, ties to even (Rust's `x as f64`).
__device__ double u128_to_double(u128 x) {
    const u64 hi = static_cast<u64>(x >> 64);
    if (hi == 0) return __ull2double_rn(static_cast<u64>(x));
    const int lz = __clzll(hi);
    const u128 n = x << lz;  // the top bit at 127
    const u64 top = static_cast<u64>(n >> 64), rest = static_cast<u64>(n);
    u64 mant = top >> 11;  // 53 bits
    const u64 round = top & 0x7ffu;
    if (round > 0x400u || (round == 0x400u && (rest != 0 || (mant & 1)))) ++mant;
    return ldexp(__ull2double_rn(mant), 75 - lz);
}

// A non-negative integral double as a u128 (Rust's `d as u128`).
__device__ u128 double_to_u128(double d) {
    if (d < 18446744073709551616.0) return static_cast<u128>(__double2ull_rz(d));
    int e;
    const double f = frexp(d, &e);  // d = f · 2^e, f in [0.5, 1)
    return static_cast<u128>(__double2ull_rz(ldexp(f, 53))) << (e - 53);
}

}  // namespace

// tokens[r]: the token drawn from row r with uniform uniforms[r] in [0, 1), or −1 when a
// tempered logit is NaN or +inf or all are −inf. top_k 0 (or ≥ vocab) and top_p ≥ 1 keep all.
extern "C" __global__ void __launch_bounds__(THREADS)
    sample_rows_f32(int* tokens, const float* logits, const double* uniforms, int vocab, float t,
                    int top_k, float top_p) {
    __shared__ Shared s;
    const size_t r = blockIdx.x;
    Row row = {logits + r * vocab, vocab, t, -INFINITY};
    Cut cut;
    if (!kept_set(row, top_k, top_p, s, cut)) {
        if (threadIdx.x == 0) tokens[r] = -1;
        return;
    }
    const int token = draw_kept(row, cut, uniforms[r], s);
    if (threadIdx.x == 0) tokens[r] = token;
}

// Speculative verification, one block per chain c: chains[3c..] = (first policy row p0, first
// draft row q0, drafts k); chain position i's policy row p_logits[p0 + i·p_step] (i ≤ k), its
// draft row q_logits[q0 + i·q_step] (i < k) (f32, [· × vocab]), draft i the input token of the
// next policy row (drafts[p0 + (i + 1)·p_step]; the chain ends before one outside the
// vocabulary), and per policy row i the (accept, draw) uniforms at
// uniforms[2 (c · (stride + 1) + i) ..]. The kept drafts and the policy's own token go to
// tokens[p0 + n·p_step] (their chain rows), their number n to counts[c]: cpu's verify_chain over
// the leading policy rows with masses (and the draft rows with masses).
extern "C" __global__ void __launch_bounds__(THREADS)
    spec_verify_f32(int* tokens, int* counts, const float* p_logits, const float* q_logits,
                    const int* chains, const int* drafts, const double* uniforms, int stride,
                    int p_step, int q_step, int vocab, float t, int top_k, float top_p) {
    __shared__ Shared s;
    const int c = blockIdx.x;
    const size_t p0 = chains[3 * c], q0 = chains[3 * c + 1];
    int k = chains[3 * c + 2];
    const double* u = uniforms + 2 * static_cast<size_t>(c) * (stride + 1);
    auto prow_at = [&](int i) -> size_t { return p0 + static_cast<size_t>(i) * p_step; };
    auto prow = [&](int i) -> Row { return {p_logits + prow_at(i) * vocab, vocab, t, -INFINITY}; };
    auto qrow = [&](int i) -> Row {
        return {q_logits + (q0 + static_cast<size_t>(i) * q_step) * vocab, vocab, t, -INFINITY};
    };
    auto draft = [&](int i) -> int { return drafts[prow_at(i + 1)]; };
    for (int i = 0; i < k; ++i) {
        if (draft(i) < 0 || draft(i) >= vocab) k = i;
    }
    // The leading policy rows with masses, and the draft rows before them with masses.
    int g = 0;
    while (g <= k && has_mass(prow(g), s)) ++g;
    int n = 0;
    if (g > 0) {
        k = g - 1;
        for (int i = 0; i < k; ++i) {
            if (!has_mass(qrow(i), s)) k = i;
        }
        for (int i = 0;; ++i) {
            Row pr = prow(i);
            Cut pc;
            kept_set(pr, top_k, top_p, s, pc);
            if (i == k) {  // every draft kept: the policy's draw after them
                const int token = draw_kept(pr, pc, u[2 * i + 1], s);
                if (threadIdx.x == 0) tokens[prow_at(n)] = token;
                ++n;
                break;
            }
            Row qr = qrow(i);
            Cut qc;
            kept_set(qr, top_k, top_p, s, qc);
            auto wp = [&](int j) -> u64 { return kept_mass(pr, pc, j); };
            auto wq = [&](int j) -> u64 { return kept_mass(qr, qc, j); };
            const u64 total_p = segment_sums(vocab, wp, s), total_q = segment_sums(vocab, wq, s);
            const int x = draft(i);
            const u128 num = static_cast<u128>(wp(x)) * total_q;
            const u128 den = static_cast<u128>(wq(x)) * total_p;
            const bool keep = den != 0 && (num >= den || u[2 * i] < __ddiv_rn(u128_to_double(num),
                                                                              u128_to_double(den)));
            if (keep) {
                if (threadIdx.x == 0) tokens[prow_at(n)] = x;
                ++n;
                continue;
            }
            // The policy's mass the draft under-proposed: max(0, P − Q) in units of
            // 1 / (W_p · W_q); when there is none, the policy's own draw.
            auto wr = [&](int j) -> u128 {
                const u128 a = static_cast<u128>(wp(j)) * total_q;
                const u128 b = static_cast<u128>(wq(j)) * total_p;
                return a > b ? a - b : 0;
            };
            const u128 sum = segment_sums(vocab, wr, s);
            int token;
            if (sum == 0) {
                token = draw_kept(pr, pc, u[2 * i + 1], s);
            } else {
                const double scaled = floor(__dmul_rn(u[2 * i + 1], u128_to_double(sum)));
                const u128 at = double_to_u128(scaled), target = at < sum - 1 ? at : sum - 1;
                token = find_first(vocab, wr, target, s);
            }
            if (threadIdx.x == 0) tokens[prow_at(n)] = token;
            ++n;
            break;
        }
    }
    if (threadIdx.x == 0) counts[c] = n;
}
