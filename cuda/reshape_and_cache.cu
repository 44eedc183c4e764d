// reshape_and_cache.cu — write this step's keys and values into the paged KV cache.
//
// Contract (refengine/attention/__init__.py): token t's key/value rows go to cache
// slot slot_mapping[t], i.e. block slot / block_size, offset slot % block_size:
//
//   k [T, num_kv_heads, head_dim]  ->  k_cache [num_blocks, block_size, num_kv_heads, head_dim]
//
// Because the cache's inner two dimensions equal the token row, slot s starts at element
// s * num_kv_heads * head_dim: the copy is one contiguous row per token. A negative slot
// (padding) is skipped, as in vLLM's reshape_and_cache.
//
// Thread layout: one block per token (grid.x = T), blockDim.x threads stride over the
// row's num_kv_heads * head_dim elements (coalesced loads and stores).
#include "common.cuh"

template <typename T>
__device__ void reshape_and_cache(const T* __restrict__ k, const T* __restrict__ v, T* __restrict__ k_cache,
                                  T* __restrict__ v_cache, const int* __restrict__ slot_mapping, int row_elems) {
    const int token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // the whole block leaves together: no barrier below
    const T* k_row = k + (long long)token * row_elems;
    const T* v_row = v + (long long)token * row_elems;
    T* k_dst = k_cache + slot * row_elems;
    T* v_dst = v_cache + slot * row_elems;
    for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
        k_dst[i] = k_row[i];
        v_dst[i] = v_row[i];
    }
}

// Exported entry points, one per storage type. Arguments:
//   k, v: [T, row_elems]; k_cache, v_cache: [num_blocks * block_size, row_elems];
//   slot_mapping: int32 [T]; row_elems = num_kv_heads * head_dim.
#define DEFINE_RESHAPE_AND_CACHE(NAME, T)                                                          \
    extern "C" __global__ void NAME(const T* k, const T* v, T* k_cache, T* v_cache,               \
                                    const int* slot_mapping, int row_elems) {                     \
        reshape_and_cache<T>(k, v, k_cache, v_cache, slot_mapping, row_elems);                     \
    }                                                                                              \
    REFENGINE_EXPORT_KERNEL(NAME)

DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_f32, float)
DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_f16, __half)
DEFINE_RESHAPE_AND_CACHE(reshape_and_cache_bf16, __nv_bfloat16)
