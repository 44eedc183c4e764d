// layers.cu — the small per-token kernels around attention in a Llama-family layer.
//
// * rms_norm:          out = x / sqrt(mean(x^2) + eps) * weight       (Zhang & Sennrich 2019;
//                      HF LlamaRMSNorm: statistics in float32)
// * silu_and_mul:      out = silu(x[:, :I]) * x[:, I:]                 (SwiGLU, Shazeer 2020;
//                      the gate and up projections fused as one [T, 2I] matmul output)
// * gelu_tanh_and_mul: out = gelu_tanh(x[:, :I]) * x[:, I:]            (GeGLU, Shazeer 2020, eq. 5;
//                      gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))),
//                      Hendrycks & Gimpel 2016: Gemma's "gelu_pytorch_tanh")
// * rotary_embedding:  rotate q and k in place by their position       (RoFormer, Su et al.
//                      2021; the "rotate_half" / GPT-NeoX pairing of HF Llama: dimension
//                      i pairs with i + rotary_dim / 2)
//
// All arithmetic is float32; T is the storage type (float, __half, __nv_bfloat16). Nothing
// here depends on head_dim: rotary_embedding takes it (any even size, 96 and 256 included)
// as an argument, and rms_norm normalises rows of any length.
//
// Thread layouts: one block per token (grid.x = T), blockDim.x threads striding over the
// token's elements. rms_norm reduces the sum of squares with warp_sum, then across the
// block's warps through shared memory (one float per warp).
#include "common.cuh"

namespace layers {
constexpr int kMaxWarps = 32;  // blockDim.x <= 1024
}

// x, out: [T, hidden]; weight: [hidden]. Dynamic shared memory: 32 floats (one partial
// sum per warp). blockDim.x: a multiple of 32.
template <typename T>
__device__ void rms_norm(T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ weight, int hidden,
                         float eps) {
    extern __shared__ __align__(16) unsigned char shared_mem[];
    float* warp_sums = reinterpret_cast<float*>(shared_mem);
    REFENGINE_CHECK_SHARED_BYTES(layers::kMaxWarps * sizeof(float));

    const T* row = x + (long long)blockIdx.x * hidden;
    float sum_sq = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = load_float(row[i]);
        sum_sq += v * v;
    }
    sum_sq = warp_sum(sum_sq);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int num_warps = blockDim.x / 32;
    if (lane == 0) warp_sums[warp] = sum_sq;
    __syncthreads();  // every warp's partial sum is in shared memory
    float total = 0.0f;
    for (int w = 0; w < num_warps; ++w) total += warp_sums[w];  // each thread adds them, same order
    const float inv_rms = rsqrtf(total / hidden + eps);

    T* out_row = out + (long long)blockIdx.x * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x)
        store_float(&out_row[i], load_float(row[i]) * inv_rms * load_float(weight[i]));
}

// x: [T, 2 * inter] (gate then up); out: [T, inter].
template <typename T>
__device__ void silu_and_mul(T* __restrict__ out, const T* __restrict__ x, int inter) {
    const T* gate = x + (long long)blockIdx.x * 2 * inter;
    const T* up = gate + inter;
    T* out_row = out + (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float g = load_float(gate[i]);
        const float silu = g / (1.0f + __expf(-g));
        store_float(&out_row[i], silu * load_float(up[i]));
    }
}

// x: [T, 2 * inter] (gate then up); out: [T, inter]. The same float32 operation order as
// refengine.ops.layers.gelu_tanh_and_mul.
template <typename T>
__device__ void gelu_tanh_and_mul(T* __restrict__ out, const T* __restrict__ x, int inter) {
    constexpr float kSqrt2OverPi = 0.7978845608028654f;
    const T* gate = x + (long long)blockIdx.x * 2 * inter;
    const T* up = gate + inter;
    T* out_row = out + (long long)blockIdx.x * inter;
    for (int i = threadIdx.x; i < inter; i += blockDim.x) {
        const float g = load_float(gate[i]);
        const float inner = kSqrt2OverPi * (g + 0.044715f * g * g * g);
        const float gelu = 0.5f * g * (1.0f + tanhf(inner));
        store_float(&out_row[i], gelu * load_float(up[i]));
    }
}

// q: [T, num_heads, head_dim], k: [T, num_kv_heads, head_dim], both rotated in place;
// positions: int32 [T]; cos_sin: float32 [max_position, rotary_dim] holding
// cos(pos * inv_freq[i]) in columns i < rotary_dim / 2 and the sines after them.
// Dimensions >= rotary_dim (partial rotary) are left alone.
template <typename T>
__device__ void rotary_embedding(T* __restrict__ q, T* __restrict__ k, const int* __restrict__ positions,
                                 const float* __restrict__ cos_sin, int num_heads, int num_kv_heads, int head_dim,
                                 int rotary_dim) {
    const int token = blockIdx.x;
    const int half = rotary_dim / 2;
    const float* cos_row = cos_sin + (long long)positions[token] * rotary_dim;
    const float* sin_row = cos_row + half;
    const int pairs_q = num_heads * half;
    const int pairs = (num_heads + num_kv_heads) * half;
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        // Pair p: head (p / half) of q, or of k after the q heads; dimension i and i + half.
        const bool is_q = p < pairs_q;
        const int head = is_q ? p / half : (p - pairs_q) / half;
        const int i = p % half;
        T* vec = is_q ? q + ((long long)token * num_heads + head) * head_dim
                      : k + ((long long)token * num_kv_heads + head) * head_dim;
        const float x1 = load_float(vec[i]);
        const float x2 = load_float(vec[i + half]);
        const float c = cos_row[i], s = sin_row[i];
        store_float(&vec[i], x1 * c - x2 * s);
        store_float(&vec[i + half], x2 * c + x1 * s);
    }
}

#define DEFINE_LAYER_KERNELS(TAG, T)                                                                           \
    extern "C" __global__ void rms_norm_##TAG(T* out, const T* x, const T* weight, int hidden, float eps) {    \
        rms_norm<T>(out, x, weight, hidden, eps);                                                              \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(rms_norm_##TAG)                                                                    \
    extern "C" __global__ void silu_and_mul_##TAG(T* out, const T* x, int inter) {                             \
        silu_and_mul<T>(out, x, inter);                                                                        \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(silu_and_mul_##TAG)                                                                \
    extern "C" __global__ void gelu_tanh_and_mul_##TAG(T* out, const T* x, int inter) {                        \
        gelu_tanh_and_mul<T>(out, x, inter);                                                                   \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(gelu_tanh_and_mul_##TAG)                                                           \
    extern "C" __global__ void rotary_embedding_##TAG(T* q, T* k, const int* positions, const float* cos_sin,  \
                                                      int num_heads, int num_kv_heads, int head_dim,           \
                                                      int rotary_dim) {                                        \
        rotary_embedding<T>(q, k, positions, cos_sin, num_heads, num_kv_heads, head_dim, rotary_dim);          \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(rotary_embedding_##TAG)

DEFINE_LAYER_KERNELS(f32, float)
DEFINE_LAYER_KERNELS(f16, __half)
DEFINE_LAYER_KERNELS(bf16, __nv_bfloat16)
