// quant_matmul.cu — products with weights kept quantized on the GPU: out = x @ w'.T, where
// w' is the dequantized [out, in] matrix, x [rows, in] is in the activation storage type
// T (float, __half, __nv_bfloat16) and out [rows, out] is float32. All arithmetic is float32.
//
// Formats (refengine/quant; the bytes are the host arrays, uploaded as they are):
//
// * int8 (refengine/quant/int8.py: per-output-channel symmetric, the absmax scheme of
//   LLM.int8(), Dettmers et al. 2022): q int8 [out, in] row-major, scales float32 [out];
//   w'[o, c] = q[o, c] * scales[o]. The kernels compute scales[o] * sum_c x[c] * q[o, c]
//   (one multiply per output, as int8.py's docstring writes the product).
// * int4 (refengine/quant/int4.py, the form AWQ, Lin et al. 2024, and GPTQ, Frantar et al.
//   2023, checkpoints are repacked into by awq_gptq.py): packed uint8 [out, in/2], byte b of
//   a row holds stored column 2b in bits 0-3 and 2b+1 in bits 4-7; scales float32
//   [out, G] and zeros uint8 [out, G] (0..16) per group of group_size stored columns
//   (G = ceil(in / group_size), the last group may be shorter);
//   w'[o, c] = float(q[o, c] - zeros[o, g]) * scales[o, g], g = c / group_size, rounded
//   once, exactly as Int4Weight.dequantize. An act-order permutation is applied to x by the
//   caller (x[:, perm], refengine/ops/cuda.py), so these kernels see stored column order.
//
// Two paths, chosen by the number of rows (refengine/kernels/plans.py, quant_linear_launch):
//
// * GEMV (rows <= qmm::kGemvMaxRows, decode): a block of 4 warps, one output channel per
//   warp (grid.x = ceil(out / 4)). The warp reads its weight row once, coalesced, 16 bytes
//   per lane per step (a uint4 load: 16 int8 weights or 32 int4 weights) when the row is
//   16-byte aligned, byte by byte otherwise; each lane keeps one float32 partial sum per
//   x row (kGemvMaxRows registers), x is read from global memory (L1/L2 serve the
//   repeats), and warp_sum reduces the partials; lane 0 writes the outputs. No shared
//   memory, no barrier.
// * GEMM (more rows, prefill): SIMT tiles (no tensor cores) of kBlockM = 32 rows by
//   kBlockN = 64 output channels per block (grid (ceil(out / 64), ceil(rows / 32))),
//   256 threads as 16 x 16; thread (tx, ty) owns rows ty + 16 i (i < 2) and channels
//   tx + 16 j (j < 4). Each K step of kBlockK = 32 columns stages, in dynamic shared memory:
//     x_tile [kBlockK][kBlockM + 1] float32  (x transposed, converted from T)
//     w_tile [kBlockK][kBlockN + 1] float32  (the weights dequantized: float(q) for int8,
//                                             float(q - z) * s for int4)
//   (the + 1 pads stagger the banks of the column-wise stores), 12.5 KiB in all
//   (qmm::gemm_shared_bytes, plans.QUANT_GEMM_SHARED_BYTES). Out-of-range rows, channels
//   and columns are staged as 0, so any size works. A barrier after staging, one after
//   the multiply (before the next step overwrites the tiles).
#include "common.cuh"

namespace qmm {
constexpr int kGemvThreads = 128;  // 4 warps, one output channel each
constexpr int kGemvWarps = kGemvThreads / 32;
constexpr int kGemvMaxRows = 8;  // rows per GEMV launch; more go to the GEMM
constexpr int kGemmThreads = 256;  // 16 x 16
constexpr int kBlockM = 32, kBlockN = 64, kBlockK = 32;
constexpr int kXStride = kBlockM + 1, kWStride = kBlockN + 1;
__host__ __device__ constexpr int gemm_shared_bytes() { return (kBlockK * kXStride + kBlockK * kWStride) * 4; }

__device__ __forceinline__ bool aligned16(const void* p) {
    return (reinterpret_cast<unsigned long long>(p) & 15ull) == 0;
}

// Byte b (0..3) of a 32-bit word as a signed int8, by an arithmetic shift.
__device__ __forceinline__ float int8_at(unsigned int word, int b) {
    return static_cast<float>(static_cast<int>(word << (24 - 8 * b)) >> 24);
}
}  // namespace qmm

// ---------------------------------------------------------------------------------------
// GEMV
// ---------------------------------------------------------------------------------------

// Lane partial sums -> out[r, o] = scale * sum (all 32 lanes call it; lane 0 writes).
__device__ __forceinline__ void gemv_store(float* __restrict__ out, const float* acc, int rows, int out_features,
                                           int o, float scale) {
#pragma unroll
    for (int r = 0; r < qmm::kGemvMaxRows; ++r) {
        if (r < rows) {  // uniform over the warp
            const float total = warp_sum(acc[r]);
            if (threadIdx.x % 32 == 0) out[(long long)r * out_features + o] = total * scale;
        }
    }
}

// out [rows, out_features] float32; x [rows, in] T; q int8 [out, in]; scales float32 [out].
template <typename T>
__device__ void int8_gemv(float* __restrict__ out, const T* __restrict__ x, const signed char* __restrict__ q,
                          const float* __restrict__ scales, int rows, int out_features, int in_features) {
    const int lane = threadIdx.x % 32;
    const int o = blockIdx.x * qmm::kGemvWarps + threadIdx.x / 32;
    if (o >= out_features) return;  // the whole warp leaves: no collective is left for it
    const signed char* w = q + (long long)o * in_features;
    float acc[qmm::kGemvMaxRows];
#pragma unroll
    for (int r = 0; r < qmm::kGemvMaxRows; ++r) acc[r] = 0.0f;

    if (in_features % 16 == 0 && qmm::aligned16(q)) {  // every row starts 16-byte aligned
        const uint4* w16 = reinterpret_cast<const uint4*>(w);
        for (int chunk = lane; chunk < in_features / 16; chunk += 32) {
            const uint4 p = w16[chunk];
            const unsigned int words[4] = {p.x, p.y, p.z, p.w};
            const int c0 = chunk * 16;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                float wf[4];
#pragma unroll
                for (int b = 0; b < 4; ++b) wf[b] = qmm::int8_at(words[i], b);
#pragma unroll
                for (int r = 0; r < qmm::kGemvMaxRows; ++r) {
                    if (r < rows) {
                        const T* xr = x + (long long)r * in_features + c0 + 4 * i;
#pragma unroll
                        for (int b = 0; b < 4; ++b) acc[r] += load_float(xr[b]) * wf[b];
                    }
                }
            }
        }
    } else {  // any width: one byte per lane per step (still coalesced)
        for (int c = lane; c < in_features; c += 32) {
            const float wf = static_cast<float>(w[c]);
#pragma unroll
            for (int r = 0; r < qmm::kGemvMaxRows; ++r)
                if (r < rows) acc[r] += load_float(x[(long long)r * in_features + c]) * wf;
        }
    }
    gemv_store(out, acc, rows, out_features, o, scales[o]);
}

// out [rows, out_features] float32; x [rows, in] T (stored column order); packed uint8
// [out, in/2]; scales float32 [out, G]; zeros uint8 [out, G].
template <typename T>
__device__ void int4_gemv(float* __restrict__ out, const T* __restrict__ x, const unsigned char* __restrict__ packed,
                          const float* __restrict__ scales, const unsigned char* __restrict__ zeros, int rows,
                          int out_features, int in_features, int group_size) {
    const int lane = threadIdx.x % 32;
    const int o = blockIdx.x * qmm::kGemvWarps + threadIdx.x / 32;
    if (o >= out_features) return;
    const int n_groups = (in_features + group_size - 1) / group_size;
    const unsigned char* w = packed + (long long)o * (in_features / 2);
    const float* s_row = scales + (long long)o * n_groups;
    const unsigned char* z_row = zeros + (long long)o * n_groups;
    float acc[qmm::kGemvMaxRows];
#pragma unroll
    for (int r = 0; r < qmm::kGemvMaxRows; ++r) acc[r] = 0.0f;

    if (in_features % 32 == 0 && qmm::aligned16(packed)) {  // 16 bytes = 32 columns per lane per step
        const uint4* w16 = reinterpret_cast<const uint4*>(w);
        for (int chunk = lane; chunk < in_features / 32; chunk += 32) {
            const uint4 p = w16[chunk];
            const unsigned int words[4] = {p.x, p.y, p.z, p.w};
            const int c0 = chunk * 32, g0 = c0 / group_size;
            const bool one_group = g0 == (c0 + 31) / group_size;  // else the 32 columns straddle groups
            const float s0 = s_row[g0];
            const int z0 = z_row[g0];
#pragma unroll
            for (int i = 0; i < 4; ++i) {  // word i: columns c0 + 8i .. c0 + 8i + 7, nibble j = column 8i + j
                float wf[8];
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    const int nibble = (words[i] >> (4 * j)) & 15;
                    if (one_group) {
                        wf[j] = static_cast<float>(nibble - z0) * s0;
                    } else {
                        const int g = (c0 + 8 * i + j) / group_size;
                        wf[j] = static_cast<float>(nibble - static_cast<int>(z_row[g])) * s_row[g];
                    }
                }
#pragma unroll
                for (int r = 0; r < qmm::kGemvMaxRows; ++r) {
                    if (r < rows) {
                        const T* xr = x + (long long)r * in_features + c0 + 8 * i;
#pragma unroll
                        for (int j = 0; j < 8; ++j) acc[r] += load_float(xr[j]) * wf[j];
                    }
                }
            }
        }
    } else {  // any even width: one byte (two columns) per lane per step
        for (int b = lane; b < in_features / 2; b += 32) {
            const unsigned int byte = w[b];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int c = 2 * b + h, g = c / group_size;
                const float wf = static_cast<float>(static_cast<int>((byte >> (4 * h)) & 15) -
                                                    static_cast<int>(z_row[g])) * s_row[g];
#pragma unroll
                for (int r = 0; r < qmm::kGemvMaxRows; ++r)
                    if (r < rows) acc[r] += load_float(x[(long long)r * in_features + c]) * wf;
            }
        }
    }
    gemv_store(out, acc, rows, out_features, o, 1.0f);
}

// ---------------------------------------------------------------------------------------
// GEMM (tiles dequantized into shared memory)
// ---------------------------------------------------------------------------------------

// The int8 tile element float(q[o, c]); the scale is applied to the finished sum.
struct Int8Tile {
    const signed char* q;
    const float* scales;
    int in_features;
    __device__ float weight(int o, int c) const { return static_cast<float>(q[(long long)o * in_features + c]); }
    __device__ float finish(int o, float sum) const { return sum * scales[o]; }
};

// The int4 tile element float(q - z) * s, the dequantized weight itself.
struct Int4Tile {
    const unsigned char* packed;
    const float* scales;
    const unsigned char* zeros;
    int in_features, group_size, n_groups;
    __device__ float weight(int o, int c) const {
        const unsigned int byte = packed[(long long)o * (in_features / 2) + c / 2];
        const int g = c / group_size;
        const int nibble = static_cast<int>((byte >> (4 * (c % 2))) & 15);
        return static_cast<float>(nibble - static_cast<int>(zeros[(long long)o * n_groups + g])) *
               scales[(long long)o * n_groups + g];
    }
    __device__ float finish(int, float sum) const { return sum; }
};

// out [rows, out_features] float32; x [rows, in] T. Layout: header comment.
template <typename T, typename Tile>
__device__ void quant_gemm(float* __restrict__ out, const T* __restrict__ x, const Tile tile, int rows,
                           int out_features, int in_features) {
    using namespace qmm;
    extern __shared__ __align__(16) unsigned char shared_mem[];
    float* x_tile = reinterpret_cast<float*>(shared_mem);  // [kBlockK][kXStride]
    float* w_tile = x_tile + kBlockK * kXStride;           // [kBlockK][kWStride]
    REFENGINE_CHECK_SHARED_BYTES(gemm_shared_bytes());

    const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    const int n0 = blockIdx.x * kBlockN, m0 = blockIdx.y * kBlockM;
    float acc[2][4];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;

    for (int k0 = 0; k0 < in_features; k0 += kBlockK) {
        // Consecutive threads take consecutive columns of one row / channel: coalesced reads.
        for (int e = threadIdx.x; e < kBlockM * kBlockK; e += kGemmThreads) {
            const int m = e / kBlockK, k = e % kBlockK;
            const int row = m0 + m, c = k0 + k;
            x_tile[k * kXStride + m] = row < rows && c < in_features ? load_float(x[(long long)row * in_features + c])
                                                                     : 0.0f;
        }
        for (int e = threadIdx.x; e < kBlockN * kBlockK; e += kGemmThreads) {
            const int n = e / kBlockK, k = e % kBlockK;
            const int o = n0 + n, c = k0 + k;
            w_tile[k * kWStride + n] = o < out_features && c < in_features ? tile.weight(o, c) : 0.0f;
        }
        __syncthreads();  // both tiles staged
#pragma unroll 4
        for (int k = 0; k < kBlockK; ++k) {
            float a[2], b[4];
#pragma unroll
            for (int i = 0; i < 2; ++i) a[i] = x_tile[k * kXStride + ty + 16 * i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = w_tile[k * kWStride + tx + 16 * j];
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();  // every thread is done with the tiles before the next step restages them
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = m0 + ty + 16 * i;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int o = n0 + tx + 16 * j;
            if (row < rows && o < out_features) out[(long long)row * out_features + o] = tile.finish(o, acc[i][j]);
        }
    }
}

#define DEFINE_QUANT_MATMUL_KERNELS(TAG, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(qmm::kGemvThreads)                                            \
        int8_gemv_##TAG(float* out, const T* x, const signed char* q, const float* scales, int rows,         \
                        int out_features, int in_features) {                                                  \
        int8_gemv<T>(out, x, q, scales, rows, out_features, in_features);                                     \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(int8_gemv_##TAG)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::kGemmThreads)                                            \
        int8_gemm_##TAG(float* out, const T* x, const signed char* q, const float* scales, int rows,         \
                        int out_features, int in_features) {                                                  \
        quant_gemm<T>(out, x, Int8Tile{q, scales, in_features}, rows, out_features, in_features);             \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(int8_gemm_##TAG)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::kGemvThreads)                                            \
        int4_gemv_##TAG(float* out, const T* x, const unsigned char* packed, const float* scales,            \
                        const unsigned char* zeros, int rows, int out_features, int in_features,              \
                        int group_size) {                                                                     \
        int4_gemv<T>(out, x, packed, scales, zeros, rows, out_features, in_features, group_size);             \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(int4_gemv_##TAG)                                                                   \
    extern "C" __global__ void __launch_bounds__(qmm::kGemmThreads)                                            \
        int4_gemm_##TAG(float* out, const T* x, const unsigned char* packed, const float* scales,            \
                        const unsigned char* zeros, int rows, int out_features, int in_features,              \
                        int group_size) {                                                                     \
        const int n_groups = (in_features + group_size - 1) / group_size;                                     \
        quant_gemm<T>(out, x, Int4Tile{packed, scales, zeros, in_features, group_size, n_groups}, rows,       \
                      out_features, in_features);                                                             \
    }                                                                                                          \
    REFENGINE_EXPORT_KERNEL(int4_gemm_##TAG)

DEFINE_QUANT_MATMUL_KERNELS(f32, float)
DEFINE_QUANT_MATMUL_KERNELS(f16, __half)
DEFINE_QUANT_MATMUL_KERNELS(bf16, __nv_bfloat16)
