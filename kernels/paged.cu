// Writes of the paged KV cache (layout in miles-tensor's cpu::PagedLayout: [blocks][layers]
// [keys, values][kv_heads][KEY_BLOCK][head_dim]): a step's keys and values, each row to the
// (block, slot) of its position. The step's slots are uploaded once and serve every layer.
#include <cuda_bf16.h>
#include <stdint.h>

namespace {

constexpr int KB = 64;  // cpu::KEY_BLOCK

// Grid (rows, kv_heads); k and v are [rows × kv_heads × d]; slots[2r] is row r's block id,
// slots[2r + 1] its slot in the block.
template <typename T>
__device__ void kv_write(T* cache, const T* k, const T* v, const int* slots, int layer,
                         int layers, int kv_heads, int d) {
    const int r = blockIdx.x, g = blockIdx.y;
    const size_t tile = (size_t)KB * d;
    const size_t base = ((size_t)slots[2 * r] * layers + layer) * 2 * kv_heads * tile;
    T* key = cache + base + g * tile + (size_t)slots[2 * r + 1] * d;
    T* value = key + kv_heads * tile;
    const size_t from = ((size_t)r * kv_heads + g) * d;
    for (int x = threadIdx.x; x < d; x += blockDim.x) {
        key[x] = k[from + x];
        value[x] = v[from + x];
    }
}

}  // namespace

#define KV_WRITE(T, SUFFIX)                                                                     \
    extern "C" __global__ void paged_kv_write_##SUFFIX(T* cache, const T* k, const T* v,        \
                                                       const int* slots, int layer, int layers, \
                                                       int kv_heads, int d) {                   \
        kv_write(cache, k, v, slots, layer, layers, kv_heads, d);                               \
    }

KV_WRITE(float, f32)
KV_WRITE(__nv_bfloat16, bf16)
