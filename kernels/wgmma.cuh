// Hopper primitives (sm_90a; fp8.cu's wgmma products): shared-memory matrix descriptors for
// tiles of 128-byte K-major rows in the 128-byte swizzle, the m64nNk32 E4M3 wgmma with f32
// accumulation and its fences, mbarriers, TMA tile loads and warpgroup register budgets.
#pragma once

#include <stdint.h>

#include "mma.cuh"

namespace miles {

// A tile of rows of 128 bytes of k, stored swizzled as wgmma's 128-byte mode reads it: the
// 16-byte chunk c of row r at r · 128 + (c ^ (r mod 8)) · 16. The tile starts 1024-aligned.
__device__ __forceinline__ int swizzled(int r, int c) { return r * 128 + ((c ^ (r & 7)) << 4); }

// Dynamic shared memory from its first 1024-aligned byte (the 128-byte swizzle's alignment;
// launches add 1024 bytes for it).
__device__ __forceinline__ uint8_t* smem_1024() {
    extern __shared__ __align__(16) uint8_t smem_raw[];
    return smem_raw + ((1024 - (smem_addr(smem_raw) & 1023)) & 1023);
}

// The descriptor of such a tile at `p`, its k advanced by `k_bytes` (a multiple of 16 below
// 128): start address >> 4, leading offset 1 (unused in this mode), stride 1024 bytes between
// groups of 8 rows, 128-byte swizzle.
__device__ __forceinline__ uint64_t tile_desc(const uint8_t* p, int k_bytes) {
    const uint64_t a = smem_addr(p) + k_bytes;
    return ((a & 0x3FFFF) >> 4) | (1ull << 16) | ((1024ull >> 4) << 32) | (1ull << 62);
}

__device__ __forceinline__ void wgmma_fence() {
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int pending>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory");
}
// Keeps the compiler from moving accesses of an accumulator across the asynchronous wgmma.
template <int N>
__device__ __forceinline__ void fence_regs(float* d) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared-memory proxies: what threads wrote (cp.async, st.shared) visible to wgmma's reads.
__device__ __forceinline__ void fence_proxy_async() {
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

#define MILES_R8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
                    "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])

// d (+)= a · bᵀ over 32 of k for 64 rows × N columns (N / 2 floats a thread, laid out per
// 8-column chunk as mma.sync's m16n8 fragments, warp w of the group holding rows 16w..16w+15);
// `accumulate` 0 starts from zero.
template <int N>
__device__ __forceinline__ void wgmma_e4m3(float* d, uint64_t a, uint64_t b, int accumulate);

template <>
__device__ __forceinline__ void wgmma_e4m3<8>(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {%0,%1,%2,%3}, %4, %5, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<16>(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, %8, %9, p, 1, 1;\n}\n"
        : MILES_R8(0)
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<32>(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %18, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, %16, %17, p, 1, 1;\n}\n"
        : MILES_R8(0), MILES_R8(8)
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<64>(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1;\n}\n"
        : MILES_R8(0), MILES_R8(8), MILES_R8(16), MILES_R8(24)
        : "l"(a), "l"(b), "r"(accumulate));
}

template <>
__device__ __forceinline__ void wgmma_e4m3<128>(float* d, uint64_t a, uint64_t b, int accumulate) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
        "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
        "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
        "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
        "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, %64, %65, p, 1, 1;\n}\n"
        : MILES_R8(0), MILES_R8(8), MILES_R8(16), MILES_R8(24), MILES_R8(32), MILES_R8(40),
          MILES_R8(48), MILES_R8(56)
        : "l"(a), "l"(b), "r"(accumulate));
}

#undef MILES_R8

// mbarriers: shared-memory barriers with phases. A wait names the parity of the phase it waits
// to see completed; a fresh barrier counts the phase before it (parity 1) as completed.
__device__ __forceinline__ void bar_init(uint64_t* b, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(b)), "r"(count));
}
// After the barriers' initialization, before any thread (or TMA) uses them.
__device__ __forceinline__ void bar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bar_arrive(uint64_t* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(b)) : "memory");
}
// Arrives where `pred` holds (a predicate, not a branch: no divergence beside wgmma).
__device__ __forceinline__ void bar_arrive_if(uint64_t* b, bool pred) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %1, 0;\n@p mbarrier.arrive.shared::cta.b64 _, [%0];\n}\n" ::"r"(
            smem_addr(b)),
        "r"((int)pred)
        : "memory");
}
// Arrives, and makes the phase wait for `bytes` more from TMA loads as well.
__device__ __forceinline__ void bar_arrive_tx(uint64_t* b, int bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(b)),
                 "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bar_wait(uint64_t* b, int parity) {
    asm volatile(
        "{\n.reg .pred done;\nWAIT_%=:\n"
        "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        "@!done bra WAIT_%=;\n}\n" ::"r"(smem_addr(b)),
        "r"(parity)
        : "memory");
}

// A TMA descriptor (CUtensorMap, made on the host), passed as a __grid_constant__ parameter.
struct alignas(64) TensorMap {
    unsigned long long bits[16];
};

// The box of `map` at (inner c0, outer c1) into shared `dst` (1024-aligned for the 128-byte
// swizzle), its bytes completing on `bar`. Outside the tensor the box reads zeros.
__device__ __forceinline__ void tma_load(void* dst, const TensorMap* map, int c0, int c1,
                                         uint64_t* bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
        " [%0], [%1, {%2, %3}], [%4];\n" ::"r"(smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(smem_addr(bar))
        : "memory");
}

// Hands registers between warpgroups: a producer gives back, the consumers take.
template <int REGS>
__device__ __forceinline__ void regs_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void regs_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(REGS));
}

}  // namespace miles
