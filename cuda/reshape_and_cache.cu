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

// Quantized caches (common.cuh, "Quantized KV caches"): the same slots, written as int8 or fp8.
//
// int8 (LMDeploy's scheme, refengine.attention.kv_cache.quantize_int8): per token and KV head,
// scale = max|x| / 127 and q = rint(x / scale) clamped to [-127, 127] (0 for a zero row);
// the scale goes to k_scales / v_scales [num_blocks * block_size, num_kv_heads]. Warp w of
// the block quantizes KV heads w, w + 4, ...: its lanes stride over head_dim, warp_max gives
// the row's max|x| (exact in any order, so the scale is the twin's bit for bit).
//
// fp8 (vLLM's reshape_and_cache with kv_cache_dtype fp8): stored = float_to_fp8(x / k_scale),
// one float scale per layer; the k_scales / v_scales arrays are not read.
template <typename T, int Q>
__device__ void reshape_and_cache_quant(const T* __restrict__ k, const T* __restrict__ v,
                                        unsigned char* __restrict__ k_cache, unsigned char* __restrict__ v_cache,
                                        float* __restrict__ k_scales, float* __restrict__ v_scales,
                                        const int* __restrict__ slot_mapping, int num_kv_heads, int head_dim,
                                        float k_scale, float v_scale) {
    const int token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0) return;  // the whole block leaves together
    const int row_elems = num_kv_heads * head_dim;
    const T* k_row = k + (long long)token * row_elems;
    const T* v_row = v + (long long)token * row_elems;
    unsigned char* k_dst = k_cache + slot * row_elems;
    unsigned char* v_dst = v_cache + slot * row_elems;
    if constexpr (Q == kKvInt8) {
        const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
        for (int h = warp; h < num_kv_heads; h += num_warps) {  // uniform per warp: warp_max is safe
            const T* kh = k_row + h * head_dim;
            const T* vh = v_row + h * head_dim;
            float k_max = 0.0f, v_max = 0.0f;
            for (int d = lane; d < head_dim; d += 32) {
                k_max = fmaxf(k_max, fabsf(load_float(kh[d])));
                v_max = fmaxf(v_max, fabsf(load_float(vh[d])));
            }
            const float ks = warp_max(k_max) / 127.0f;
            const float vs = warp_max(v_max) / 127.0f;
            const float k_div = ks > 0.0f ? ks : 1.0f;  // a zero row: scale 0, values 0
            const float v_div = vs > 0.0f ? vs : 1.0f;
            for (int d = lane; d < head_dim; d += 32) {
                const float kq = fminf(fmaxf(rintf(load_float(kh[d]) / k_div), -127.0f), 127.0f);
                const float vq = fminf(fmaxf(rintf(load_float(vh[d]) / v_div), -127.0f), 127.0f);
                k_dst[h * head_dim + d] = static_cast<unsigned char>(static_cast<signed char>(static_cast<int>(kq)));
                v_dst[h * head_dim + d] = static_cast<unsigned char>(static_cast<signed char>(static_cast<int>(vq)));
            }
            if (lane == 0) {
                k_scales[slot * num_kv_heads + h] = ks;
                v_scales[slot * num_kv_heads + h] = vs;
            }
        }
    } else {
        for (int i = threadIdx.x; i < row_elems; i += blockDim.x) {
            k_dst[i] = float_to_fp8<Q>(load_float(k_row[i]) / k_scale);
            v_dst[i] = float_to_fp8<Q>(load_float(v_row[i]) / v_scale);
        }
    }
}

// Exported: reshape_and_cache_<dt>_<int8|fp8e4m3|fp8e5m2>. Launch with a multiple of 32
// threads, grid (T). Arguments: k, v [T, num_kv_heads * head_dim] in T; k_cache, v_cache
// [num_blocks * block_size, num_kv_heads * head_dim] bytes (int8 or fp8 codes); k_scales,
// v_scales float32 [num_blocks * block_size, num_kv_heads] (int8 only; any pointer for fp8);
// slot_mapping int32 [T]; k_scale, v_scale: the layer's fp8 scales (int8: unused).
#define DEFINE_RESHAPE_AND_CACHE_QUANT(NAME, T, Q)                                                           \
    extern "C" __global__ void NAME(const T* k, const T* v, unsigned char* k_cache, unsigned char* v_cache,   \
                                    float* k_scales, float* v_scales, const int* slot_mapping,                \
                                    int num_kv_heads, int head_dim, float k_scale, float v_scale) {           \
        reshape_and_cache_quant<T, Q>(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping, num_kv_heads, \
                                      head_dim, k_scale, v_scale);                                            \
    }                                                                                                         \
    REFENGINE_EXPORT_KERNEL(NAME)

#define DEFINE_RESHAPE_AND_CACHE_QUANTS(DT, T)                                          \
    DEFINE_RESHAPE_AND_CACHE_QUANT(reshape_and_cache_##DT##_int8, T, kKvInt8)           \
    DEFINE_RESHAPE_AND_CACHE_QUANT(reshape_and_cache_##DT##_fp8e4m3, T, kKvFp8E4m3)     \
    DEFINE_RESHAPE_AND_CACHE_QUANT(reshape_and_cache_##DT##_fp8e5m2, T, kKvFp8E5m2)

DEFINE_RESHAPE_AND_CACHE_QUANTS(f32, float)
DEFINE_RESHAPE_AND_CACHE_QUANTS(f16, __half)
DEFINE_RESHAPE_AND_CACHE_QUANTS(bf16, __nv_bfloat16)
