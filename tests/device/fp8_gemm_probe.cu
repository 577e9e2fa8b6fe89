// The FP8 products of kernels/fp8.cu by themselves, beside cuBLAS's bf16 GEMM at the same shape
// in one process: TMA-fed wgmma (Hopper) against mma.sync (values), a row's bits at every row
// count on the TMA and the swapped decode tiles, and times at the train shape (16384 × 4096 ×
// 12288) and at Qwen3-8B's decode shapes. Built and run on the device (nvcc there), for
// iterating on the kernels without a Rust build (`/tmp/probe once`: one call of each at the
// train shape, for ncu):
//   nvcc -arch=sm_90a -O3 -std=c++17 -I kernels tests/device/fp8_gemm_probe.cu \
//     -L/usr/local/cuda-13.0/targets/x86_64-linux/lib -lcublas -lcuda -o /tmp/probe && /tmp/probe
#include <cublas_v2.h>
#include <cuda.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "../../kernels/fp8.cu"

#define CK(x)                                                                                   \
    do {                                                                                        \
        cudaError_t e = (x);                                                                    \
        if (e != cudaSuccess) {                                                                 \
            printf("%s: %s (line %d)\n", #x, cudaGetErrorString(e), __LINE__);                  \
            exit(1);                                                                            \
        }                                                                                       \
    } while (0)

static uint32_t state = 12345;
static uint32_t next() { return state ^= state << 13, state ^= state >> 17, state ^= state << 5; }
// A random E4M3 code, never NaN.
static uint8_t code() {
    for (;;) {
        const uint8_t c = next() & 0xff;
        if ((c & 0x7f) != 0x7f) return c;
    }
}

static TensorMap tmap(const uint8_t* p, int rows, int k, int box_rows) {
    TensorMap t;
    cuuint64_t dims[2] = {(cuuint64_t)k, (cuuint64_t)rows}, strides[1] = {(cuuint64_t)k};
    cuuint32_t box[2] = {128, (cuuint32_t)box_rows}, es[2] = {1, 1};
    if (cuTensorMapEncodeTiled((CUtensorMap*)&t, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, (void*)p, dims,
                               strides, box, es, CU_TENSOR_MAP_INTERLEAVE_NONE,
                               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) != CUDA_SUCCESS) {
        printf("cuTensorMapEncodeTiled failed\n");
        exit(1);
    }
    return t;
}

struct Operands {
    uint8_t *xq, *wq;
    float *xs, *ws, *y;
};

// The two products as fp8.rs launches them.
// `blocks` 0: one block a tile (as fp8.rs launches it); else that many, each walking tiles
// (persistent: one block an SM).
static void tma(const Operands& o, int m, int n, int k, int blocks = 0) {
    const int tiles = (m + 127) / 128 * ((n + 127) / 128), smem = 6 * 256 * 128 + 1024 + 96;
    fp8_gemm_f32_tma<<<blocks ? std::min(blocks, tiles) : tiles, 384, smem>>>(
        o.y, tmap(o.xq, m, k, 128), o.xs, tmap(o.wq, n, k, 128), o.ws, m, n, k);
}
// The swapped decode tile with NT columns of x, ST stages and SL slices in flight (fp8.rs's:
// 8/16, 16/16, 32/10 with four slices, 64/8 with two); others instantiated here to compare.
template <int NT, int ST, int SL>
__global__ void __launch_bounds__(160) swap_kernel(float* y, const __grid_constant__ TensorMap xmap,
                                                   const float* xs,
                                                   const __grid_constant__ TensorMap wmap,
                                                   const float* ws, int m, int n, int k) {
    gemm_swap<NT, ST, SL>(y, &xmap, xs, &wmap, ws, m, n, k, blockIdx.x);
}
template <int NT, int ST, int SL = 2>
static void swap(const Operands& o, int m, int n, int k) {
    const int smem = ST * (64 + NT) * 128 + 1024 + ST * 16;
    static bool ready = false;
    if (!ready) {
        CK(cudaFuncSetAttribute(swap_kernel<NT, ST, SL>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        ready = true;
    }
    swap_kernel<NT, ST, SL><<<(n + 63) / 64, 160, smem>>>(o.y, tmap(o.xq, m, k, NT), o.xs,
                                                          tmap(o.wq, n, k, 64), o.ws, m, n, k);
}
// As fp8.rs picks for m rows.
static void swap_for(const Operands& o, int m, int n, int k) {
    if (m <= 8) swap<8, 16, 4>(o, m, n, k);
    else if (m <= 16) swap<16, 16, 4>(o, m, n, k);
    else if (m <= 32) swap<32, 10, 4>(o, m, n, k);
    else swap<64, 6>(o, m, n, k);
}
static void mma_sync(const Operands& o, int m, int n, int k) {
    const dim3 grid((m + 127) / 128, (n + 127) / 128);
    fp8_gemm_f32_big<<<grid, 256, 3 * 256 * 144>>>(o.y, o.xq, o.xs, o.wq, o.ws, m, n, k);
}

template <class F>
static float ms_per_call(F f, int calls) {
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    for (int i = 0; i < 3; ++i) f();
    cudaEventRecord(a);
    for (int i = 0; i < calls; ++i) f();
    cudaEventRecord(b);
    CK(cudaEventSynchronize(b));
    float ms;
    cudaEventElapsedTime(&ms, a, b);
    return ms / calls;
}

int main(int argc, char** argv) {
    CK(cudaFuncSetAttribute(fp8_gemm_f32_tma, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            6 * 256 * 128 + 1024 + 96));
    CK(cudaFuncSetAttribute(fp8_gemm_f32_big, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            3 * 256 * 144));
    const int M = 16384, K = 4096, N = 12288, KB = K / 128;
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    std::vector<uint8_t> hx((size_t)M * K), hw((size_t)N * K);
    std::vector<float> hxs((size_t)M * KB), hws((size_t)N / 128 * KB);
    for (auto& c : hx) c = code();
    for (auto& c : hw) c = code();
    for (auto& s : hxs) s = 0.001f * (1 + next() % 1000);
    for (auto& s : hws) s = 0.001f * (1 + next() % 1000);
    Operands o;
    CK(cudaMalloc(&o.xq, hx.size()));
    CK(cudaMalloc(&o.wq, hw.size()));
    CK(cudaMalloc(&o.xs, hxs.size() * 4));
    CK(cudaMalloc(&o.ws, hws.size() * 4));
    CK(cudaMalloc(&o.y, (size_t)M * N * 4));
    CK(cudaMemcpy(o.xq, hx.data(), hx.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(o.wq, hw.data(), hw.size(), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(o.xs, hxs.data(), hxs.size() * 4, cudaMemcpyHostToDevice));
    CK(cudaMemcpy(o.ws, hws.data(), hws.size() * 4, cudaMemcpyHostToDevice));

    if (argc > 1 && strcmp(argv[1], "once") == 0) {  // for ncu: one call of each at the train shape
        tma(o, M, N, K);
        swap_for(o, 1, N, K);
        CK(cudaDeviceSynchronize());
        return 0;
    }
    // Values against mma.sync, and a row's bits at every row count, at three widths.
    const int R = 1500;
    std::vector<float> all((size_t)R * N), got((size_t)R * N), other((size_t)R * N);
    for (int n : {N, 200, 96}) {
        tma(o, R, n, K);
        CK(cudaMemcpy(all.data(), o.y, (size_t)R * n * 4, cudaMemcpyDeviceToHost));
        mma_sync(o, R, n, K);
        CK(cudaMemcpy(other.data(), o.y, (size_t)R * n * 4, cudaMemcpyDeviceToHost));
        double worst = 0, squares = 0;
        for (size_t i = 0; i < (size_t)R * n; ++i) {
            worst = fmax(worst, fabs(all[i] - other[i]));
            squares += (double)other[i] * other[i];
        }
        printf("n = %d: wgmma vs mma.sync max |diff| %.3e, rms of the outputs %.3e\n", n, worst,
               sqrt(squares / ((double)R * n)));
        auto compare = [&](const char* what, int m) {
            CK(cudaMemcpy(got.data(), o.y, (size_t)m * n * 4, cudaMemcpyDeviceToHost));
            size_t differ = 0;
            for (size_t i = 0; i < (size_t)m * n; ++i) differ += memcmp(&got[i], &all[i], 4) != 0;
            if (differ) {
                printf("  %s %d rows: %zu outputs differ from the 1500-row product\n", what, m,
                       differ);
            }
        };
        for (int m : {1, 3, 17, 64, 65, 200, 1000}) {
            CK(cudaMemset(o.y, 0xff, (size_t)m * n * 4));
            tma(o, m, n, K);
            compare("tma", m);
        }
        for (int m : {1, 200, 1500}) {
            CK(cudaMemset(o.y, 0xff, (size_t)m * n * 4));
            tma(o, m, n, K, sms);
            compare("tma persistent", m);
        }
        for (int m : {1, 3, 8, 9, 16, 17, 32, 33, 63, 64}) {
            CK(cudaMemset(o.y, 0xff, (size_t)m * n * 4));
            swap_for(o, m, n, K);
            CK(cudaGetLastError());
            compare("swap", m);
            if (m > 32) {
                CK(cudaMemset(o.y, 0xff, (size_t)m * n * 4));
                swap<64, 4>(o, m, n, K);
                compare("swap64, 4 stages", m);
            }
        }
    }
    printf("bits checked\n");

    const double flop = 2.0 * M * N * K;
    float t = ms_per_call([&] { tma(o, M, N, K); }, 20);
    printf("tma      %d x %d x %d: %.3f ms, %.0f TFLOP/s\n", M, K, N, t, flop / t / 1e9);
    t = ms_per_call([&] { tma(o, M, N, K, sms); }, 20);
    printf("tma, %d persistent blocks %d x %d x %d: %.3f ms, %.0f TFLOP/s\n", sms, M, K, N, t,
           flop / t / 1e9);
    t = ms_per_call([&] { mma_sync(o, M, N, K); }, 20);
    printf("mma.sync %d x %d x %d: %.3f ms, %.0f TFLOP/s\n", M, K, N, t, flop / t / 1e9);
    for (int m : {1, 64, 256}) {
        t = ms_per_call([&] { tma(o, m, N, K); }, 50);
        printf("tma      %d x %d x %d: %.1f us, %.0f GB/s of weight\n", m, K, N, t * 1e3,
               (double)N * K / t / 1e6);
    }
    // Decode products of Qwen3-8B (q, k/v, gate/up, down, stacked q/k/v) on the swapped tiles.
    const int shapes[][2] = {{4096, 4096}, {1024, 4096}, {12288, 4096}, {4096, 12288}, {6144, 4096}};
    for (const auto& shape : shapes) {
        const int n = shape[0], k = shape[1];
        auto report = [&](const char* what, int m, float t) {
            printf("%-10s %2d x %5d x %5d: %6.1f us, %5.0f GB/s of weight\n", what, m, k, n,
                   t * 1e3, (double)n * k / t / 1e6);
        };
        for (int m : {1, 8, 16, 32, 64}) report("swap", m, ms_per_call([&] { swap_for(o, m, n, k); }, 50));
        report("swap64/4", 64, ms_per_call([&] { swap<64, 4>(o, 64, n, k); }, 50));
        report("swap64/8", 64, ms_per_call([&] { swap<64, 8>(o, 64, n, k); }, 50));
    }
    cublasHandle_t h;
    cublasCreate(&h);
    __nv_bfloat16 *a, *b, *c;
    CK(cudaMalloc(&a, (size_t)M * K * 2));
    CK(cudaMalloc(&b, (size_t)N * K * 2));
    CK(cudaMalloc(&c, (size_t)M * N * 2));
    CK(cudaMemset(a, 0x3c, (size_t)M * K * 2));
    CK(cudaMemset(b, 0x3c, (size_t)N * K * 2));
    const float one = 1, zero = 0;
    for (int m : {M, 64, 1}) {
        t = ms_per_call([&] {
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, N, m, K, &one, b, CUDA_R_16BF, K, a,
                         CUDA_R_16BF, K, &zero, c, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
        }, 20);
        printf("cuBLAS bf16 %d x %d x %d: %.3f ms, %.0f TFLOP/s\n", m, K, N, t,
               2.0 * m * N * K / t / 1e9);
    }
    // The products of a Qwen3-0.6B training forward at 32 x 512 (q/k/v stacked, o, gate/up
    // stacked, down): K is small, so a tile's start and end weigh as much as its k loop.
    const int small[][2] = {{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}};
    for (const auto& shape : small) {
        const int n = shape[0], k = shape[1];
        const double f = 2.0 * M * n * k;
        const float t1 = ms_per_call([&] { tma(o, M, n, k); }, 20);
        const float t2 = ms_per_call([&] { tma(o, M, n, k, sms); }, 20);
        const float t3 = ms_per_call([&] {
            cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, n, M, k, &one, b, CUDA_R_16BF, k, a,
                         CUDA_R_16BF, k, &zero, c, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F,
                         CUBLAS_GEMM_DEFAULT);
        }, 20);
        printf("0.6B %d x %d x %d: tma %.0f, persistent %.0f, cuBLAS bf16 %.0f TFLOP/s\n", M, k,
               n, f / t1 / 1e9, f / t2 / 1e9, f / t3 / 1e9);
    }
    return 0;
}
