// flash_prefill_mma.cu — flash_prefill.cu's algorithm on tensor cores (float16 / bfloat16).
//
// Same contract and same FlashAttention-2 loop (Dao 2023, §3.1, Algorithm 1) as
// flash_prefill.cu — read that file first. The difference is who multiplies: here both
// inner products, S = Q·Kᵀ and O += P·V, are `mma.sync m16n8k16` tensor-core instructions
// (see mma.cuh for the register layout), and the online softmax runs directly on the
// accumulator registers, as in FA2 §3.1.1 ("the warp owns whole rows, so no shared memory
// is needed for the softmax statistics").
//
// Thread layout: 128 threads = 4 warps; a block owns BLOCK_M = 64 query rows of one head,
// warp w the 16 rows 16w .. 16w+15. grid = (ceil(max_query_len / 64), num_heads, num_seqs);
// blockIdx.x counts down the query tiles, so the blocks with the most keys start first.
// Within a warp (g = lane / 4, t = lane % 4) a lane holds, for every 8-column tile j:
//   S[g][8j + 2t, +1] and S[g + 8][8j + 2t, +1]      (mma.cuh's C layout)
// so a row's values are spread over the 4 lanes of a group: row max / sum need two
// xor-shuffles (1, 2). The scores of two adjacent 8-key tiles, rounded to T, are exactly
// the A fragment of the next MMA (P·V): P never leaves registers.
//
// Per key tile i (BLOCK_N = 64 keys; 32 at head_dim 256, see prefill_mma::block_n), with
// one K and one V buffer in shared memory:
//   wait for K(i); barrier; start copying V(i) (cp.async, cp_async.cuh);
//   1. S = Q·Kᵀ: (HEAD_DIM / 16) x (BLOCK_N / 8) MMAs per warp; Q's A fragments stay in
//      registers for the whole kernel (up to head_dim 128; at 256 they are loaded per
//      k-step); K's B fragments come two k-steps per `ldmatrix.x4`;
//   2. scale, soft-cap, causal and window mask, online softmax on the S registers;
//   wait for V(i); barrier; start copying K(i + 1);
//   3. O += P·V: (BLOCK_N / 16) x (HEAD_DIM / 8) MMAs; V's B fragments come two d-tiles per
//      `ldmatrix.x4.trans` (V is stored [key][d]; the MMA wants it k-major).
// So each tile's copy overlaps the other half's math (FA2 §3.3; the same two-buffer
// schedule as the FlashAttention-2 CUDA kernels). Copies go through the block table 16 bytes
// at a time and are zero-filled past the last key (P is 0 there, but 0 · NaN is not).
// A warp whose 16 rows all precede the tile (the causal upper triangle), or whose rows'
// windows all start after it, skips 1-3 but still takes part in the barriers and copies.
//
// Sliding window (window > 0) and soft cap (soft_cap > 0) as in flash_prefill.cu: key tiles
// wholly before the window of the block's first row are never loaded, each row masks keys
// outside max(0, p - window + 1) ..= p, and a row whose running max is still -inf
// (none of its keys met yet) subtracts 0 instead, so it gets p = alpha = 0, not NaN.
//
// Shared memory (dynamic): 2 * BLOCK_N * (HEAD_DIM + 8) * 2 bytes (K and V tiles; rows padded
// by 8 elements so the 8 rows of an ldmatrix hit 8 different 16-byte bank groups).
// Precision: T inputs, float32 accumulation and softmax; P is rounded to T for the P·V
// product (as in FlashAttention-2), which the T-precision tolerance of the tests covers.
//
// Quantized KV caches (int8 / fp8) have no variant here: the plan sends them to flash_prefill.cu's
// SIMT kernel. These tiles reach ldmatrix as 16-bit values through cp.async; dequantizing would
// take a register pass per tile and round the dequantized keys to 16 bits, which paged_decode
// (float32 tiles) does not, so prefill and decode would read different values.
//
// Not done (next steps for speed, to be measured on an H200 first): a deeper pipeline (two
// K/V stages fit the 48 KiB a launch gets without opting in up to head_dim 64; head_dim 128
// needs 69.6 KiB and cudaFuncAttributeMaxDynamicSharedMemorySize), block-table lookups done
// once per tile for K and V, 128-row blocks, and Hopper wgmma/TMA (FlashAttention-3).
#include "common.cuh"
#include "cp_async.cuh"
#include "mma.cuh"

namespace prefill_mma {
constexpr int kNumThreads = 128;
constexpr int kBlockM = 64;  // query rows per block (16 per warp)
constexpr int kPad = 8;      // elements of padding per shared-memory row
// Keys per shared-memory tile: 64, or 32 at head_dim 256. There a lane already holds 128
// output floats (and would hold 64 Q-fragment registers); 64-key tiles would add 32 score
// registers and need 67.6 KiB of shared memory; 32-key tiles take 33.8 KiB, under the
// 48 KiB a launch gets without opting in.
template <int HEAD_DIM>
__host__ __device__ constexpr int block_n() {
    return HEAD_DIM > 128 ? 32 : 64;
}
}  // namespace prefill_mma

template <typename T, int HEAD_DIM>
__device__ void flash_prefill_mma(const T* __restrict__ q, const T* __restrict__ k_cache,
                                  const T* __restrict__ v_cache, T* __restrict__ out,
                                  const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                                  const int* __restrict__ block_tables, int max_blocks_per_seq, int num_heads,
                                  int num_kv_heads, int block_size, float scale, int window, float soft_cap) {
    using namespace prefill_mma;
    constexpr int kBlockN = block_n<HEAD_DIM>();
    static_assert(HEAD_DIM % 32 == 0, "head_dim must be a multiple of 32 (ldmatrix.x4 covers two k-steps)");
    constexpr int kStride = HEAD_DIM + kPad;           // shared-memory row length (elements)
    constexpr int kDimSteps = HEAD_DIM / 16;           // k-steps of Q·Kᵀ
    constexpr int kKeyTiles8 = kBlockN / 8;            // n-tiles of S
    constexpr int kDimTiles8 = HEAD_DIM / 8;           // n-tiles of O
    constexpr int kChunks = HEAD_DIM / 8;              // 16-byte chunks per K/V row

    // Highest query tiles (the most keys, causally) first: the long blocks start early.
    const int q_tile = gridDim.x - 1 - blockIdx.x;
    const int head = blockIdx.y;
    const int seq = blockIdx.z;
    const int q_start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_start;
    if (q_tile * kBlockM >= q_len) return;  // whole block exits together

    const int seq_len = seq_lens[seq];
    const int ctx_len = seq_len - q_len;
    const int kv_head = head / (num_heads / num_kv_heads);
    const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;

    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int g = lane / 4;  // groupID: this lane's rows are g and g + 8 of the warp's 16
    const int t = lane % 4;  // threadID_in_group: its columns are 2t, 2t + 1 (+ 8)

    // Query rows held by this lane (within the sequence's chunk) and their positions.
    const int row0 = q_tile * kBlockM + warp * 16 + g;
    const int row1 = row0 + 8;
    const int last_row = min(q_tile * kBlockM + kBlockM, q_len) - 1;
    const int pos0 = ctx_len + min(row0, last_row);  // padding rows borrow the last real row
    const int pos1 = ctx_len + min(row1, last_row);
    // Largest position among the warp's 16 rows: keys beyond it are masked for the warp;
    // with a window, keys before the first key of its first row are too.
    const int warp_last_pos = ctx_len + min(q_tile * kBlockM + warp * 16 + 15, last_row);
    const int warp_first_key = window > 0 ? ctx_len + min(q_tile * kBlockM + warp * 16, last_row) - window + 1 : 0;
    const int first_key0 = window > 0 ? pos0 - window + 1 : 0;  // rows g, g + 8 see keys first_key .. pos
    const int first_key1 = window > 0 ? pos1 - window + 1 : 0;
    const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;

    // Q's A fragment of k-step ks (zero for padding rows), straight from global memory.
    const T* q_row0 = q + ((long long)(q_start + min(row0, last_row)) * num_heads + head) * HEAD_DIM;
    const T* q_row1 = q + ((long long)(q_start + min(row1, last_row)) * num_heads + head) * HEAD_DIM;
    const bool valid0 = row0 < q_len, valid1 = row1 < q_len;
    auto load_q_frag = [&](unsigned frag[4], int ks) {
        const int c = ks * 16 + 2 * t;
        frag[0] = valid0 ? *reinterpret_cast<const unsigned*>(q_row0 + c) : 0u;
        frag[1] = valid1 ? *reinterpret_cast<const unsigned*>(q_row1 + c) : 0u;
        frag[2] = valid0 ? *reinterpret_cast<const unsigned*>(q_row0 + c + 8) : 0u;
        frag[3] = valid1 ? *reinterpret_cast<const unsigned*>(q_row1 + c + 8) : 0u;
    };
    // Up to head_dim 128 all of Q's fragments are loaded once into registers. At 256 they
    // would pin 64 of a lane's 255 registers next to O's 128: there they are loaded at each
    // k-step of every key tile instead (read-only data, hitting L1 after the first tile), so
    // ptxas may keep them in registers or re-read them rather than spill.
    constexpr bool kQInRegisters = HEAD_DIM <= 128;
    unsigned q_frag[kQInRegisters ? kDimSteps : 1][4];
    if constexpr (kQInRegisters) {
#pragma unroll
        for (int ks = 0; ks < kDimSteps; ++ks) load_q_frag(q_frag[ks], ks);
    }

    float o[kDimTiles8][4];  // output accumulator in the C layout
#pragma unroll
    for (int j = 0; j < kDimTiles8; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.0f;
    float m0 = REFENGINE_NEG_INF, m1 = REFENGINE_NEG_INF;  // running max of rows g, g + 8
    float l0 = 0.0f, l1 = 0.0f;  // this lane's share of the running sums (reduced at the end)

    extern __shared__ __align__(16) unsigned char shared_mem[];
    T* k_tile = reinterpret_cast<T*>(shared_mem);
    T* v_tile = k_tile + kBlockN * kStride;
    REFENGINE_CHECK_SHARED_BYTES(2 * kBlockN * kStride * sizeof(T));

    const int kv_end = ctx_len + last_row + 1;  // keys the block's last row sees
    // The key tile holding the first key of the block's first row: earlier tiles are
    // wholly before every row's window and are never loaded.
    const int kv_begin = window > 0 ? max(0, ctx_len + q_tile * kBlockM - window + 1) / kBlockN * kBlockN : 0;

    // Start copying keys [kv_start, kv_start + kBlockN) of `cache` into `tile`: 16-byte chunks
    // through the block table, zero-filled past kv_end (P is 0 there, but 0 * NaN is not).
    auto load_tile = [&](T* tile, const T* cache, int kv_start) {
        for (int idx = threadIdx.x; idx < kBlockN * kChunks; idx += kNumThreads) {
            const int key = idx / kChunks;
            const int d = (idx % kChunks) * 8;
            const int pos = kv_start + key;
            const bool valid = pos < kv_end;
            long long offset = 0;  // a valid address even when nothing is read
            if (valid) {
                const long long slot = (long long)block_table[pos / block_size] * block_size + pos % block_size;
                offset = (slot * num_kv_heads + kv_head) * HEAD_DIM + d;
            }
            cp_async_16(tile + key * kStride + d, cache + offset, valid);
        }
        cp_async_commit();
    };

    // ldmatrix row addresses of this lane (lane 8i + r gives row r of matrix i):
    //   K: matrices (keys 8j.., d 16ks + 8i..) for i = 0..3 -> B fragments of k-steps ks, ks+1;
    //   V: matrices (keys 16kk + 8(i%2).., d 8(j + i/2)..) -> B fragments of d-tiles j, j+1.
    const int mat = lane / 8, mat_row = lane % 8;
    const T* k_lane = k_tile + mat_row * kStride + mat * 8;
    const T* v_lane = v_tile + ((mat % 2) * 8 + mat_row) * kStride + (mat / 2) * 8;

    // The FlashAttention-2 pipeline over one K and one V buffer: V(i) travels while
    // S = Q·K(i)ᵀ is computed, and K(i+1) while O += P·V(i).
    load_tile(k_tile, k_cache, kv_begin);
    for (int kv_start = kv_begin; kv_start < kv_end; kv_start += kBlockN) {
        cp_async_wait<0>();  // this thread's part of K(i) has landed ...
        __syncthreads();     // ... everyone's has, and nobody still reads V(i-1)
        load_tile(v_tile, v_cache, kv_start);

        // Warp-uniform: some row of the warp sees a key of this tile.
        const bool active = kv_start <= warp_last_pos && kv_start + kBlockN > warp_first_key;
        float s[kKeyTiles8][4];
        float m_sub0 = 0.0f, m_sub1 = 0.0f;  // what P subtracts: m, or 0 while m is -inf
        if (active) {
            // 1. S = Q·Kᵀ for 16 rows x kBlockN keys, two k-steps at a time.
#pragma unroll
            for (int j = 0; j < kKeyTiles8; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < kDimSteps; ks += 2) {
                unsigned qa_loaded[4], qb_loaded[4];
                const unsigned* qa = qa_loaded;
                const unsigned* qb = qb_loaded;
                if constexpr (kQInRegisters) {
                    qa = q_frag[ks];
                    qb = q_frag[ks + 1];
                } else {
                    load_q_frag(qa_loaded, ks);
                    load_q_frag(qb_loaded, ks + 1);
                }
#pragma unroll
                for (int j = 0; j < kKeyTiles8; ++j) {
                    unsigned b[4];  // b[0..1]: k-step ks, b[2..3]: k-step ks + 1
                    ldmatrix_x4(b, k_lane + j * 8 * kStride + ks * 16);
                    mma_m16n8k16<T>(s[j], qa, b);
                    mma_m16n8k16<T>(s[j], qb, b + 2);
                }
            }

            // 2. Scale, soft-cap, mask, online softmax (rows g and g + 8 of the warp).
            float tile_max0 = REFENGINE_NEG_INF, tile_max1 = REFENGINE_NEG_INF;
#pragma unroll
            for (int j = 0; j < kKeyTiles8; ++j) {
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int key = kv_start + j * 8 + 2 * t + (i % 2);
                    const int pos = i < 2 ? pos0 : pos1;
                    const int first_key = i < 2 ? first_key0 : first_key1;
                    float x = s[j][i] * scale;
                    if (soft_cap > 0.0f) x = soft_cap * tanhf(x * inv_cap);
                    s[j][i] = (key <= pos && key >= first_key) ? x : REFENGINE_NEG_INF;
                }
                tile_max0 = fmaxf(tile_max0, fmaxf(s[j][0], s[j][1]));
                tile_max1 = fmaxf(tile_max1, fmaxf(s[j][2], s[j][3]));
            }
            // The 4 lanes of a group hold the same two rows: combine their maxima.
            tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(REFENGINE_FULL_MASK, tile_max0, 1));
            tile_max0 = fmaxf(tile_max0, __shfl_xor_sync(REFENGINE_FULL_MASK, tile_max0, 2));
            tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(REFENGINE_FULL_MASK, tile_max1, 1));
            tile_max1 = fmaxf(tile_max1, __shfl_xor_sync(REFENGINE_FULL_MASK, tile_max1, 2));
            // -inf only while a row has met none of its keys (a window starting in a later
            // tile, or a row of a warp that is active for its other rows): subtract 0 then,
            // so p = exp(-inf) = 0 and alpha = 0, not exp(-inf + inf) = NaN.
            const float m_new0 = fmaxf(m0, tile_max0), m_new1 = fmaxf(m1, tile_max1);
            m_sub0 = m_new0 == REFENGINE_NEG_INF ? 0.0f : m_new0;
            m_sub1 = m_new1 == REFENGINE_NEG_INF ? 0.0f : m_new1;
            const float alpha0 = __expf(m0 - m_sub0), alpha1 = __expf(m1 - m_sub1);
            m0 = m_new0;
            m1 = m_new1;
            l0 *= alpha0;
            l1 *= alpha1;
#pragma unroll
            for (int j = 0; j < kDimTiles8; ++j) {
                o[j][0] *= alpha0;
                o[j][1] *= alpha0;
                o[j][2] *= alpha1;
                o[j][3] *= alpha1;
            }
        }

        cp_async_wait<0>();  // V(i) has landed (this thread's part) ...
        __syncthreads();     // ... everyone's has, and nobody still reads K(i)
        if (kv_start + kBlockN < kv_end) load_tile(k_tile, k_cache, kv_start + kBlockN);

        if (active) {
            // 3. O += P·V, 16 keys (two S tiles = one A fragment) at a time.
#pragma unroll
            for (int kk = 0; kk < kBlockN / 16; ++kk) {
                float p[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    p[h][0] = __expf(s[2 * kk + h][0] - m_sub0);
                    p[h][1] = __expf(s[2 * kk + h][1] - m_sub0);
                    p[h][2] = __expf(s[2 * kk + h][2] - m_sub1);
                    p[h][3] = __expf(s[2 * kk + h][3] - m_sub1);
                    l0 += p[h][0] + p[h][1];
                    l1 += p[h][2] + p[h][3];
                }
                unsigned a[4];
                a[0] = pack_pair(p[0][0], p[0][1], T{});  // row g,     keys 2t, 2t+1
                a[1] = pack_pair(p[0][2], p[0][3], T{});  // row g + 8, keys 2t, 2t+1
                a[2] = pack_pair(p[1][0], p[1][1], T{});  // row g,     keys 2t+8, 2t+9
                a[3] = pack_pair(p[1][2], p[1][3], T{});  // row g + 8, keys 2t+8, 2t+9
#pragma unroll
                for (int j = 0; j < kDimTiles8; j += 2) {
                    unsigned b[4];  // b[0..1]: d-tile j, b[2..3]: d-tile j + 1
                    ldmatrix_x4_trans(b, v_lane + kk * 16 * kStride + j * 8);
                    mma_m16n8k16<T>(o[j], a, b);
                    mma_m16n8k16<T>(o[j + 1], a, b + 2);
                }
            }
        }
    }

    // Full row sums: add the 4 lanes' shares.
    l0 += __shfl_xor_sync(REFENGINE_FULL_MASK, l0, 1);
    l0 += __shfl_xor_sync(REFENGINE_FULL_MASK, l0, 2);
    l1 += __shfl_xor_sync(REFENGINE_FULL_MASK, l1, 1);
    l1 += __shfl_xor_sync(REFENGINE_FULL_MASK, l1, 2);
    const float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
    T* out0 = out + ((long long)(q_start + row0) * num_heads + head) * HEAD_DIM + 2 * t;
    T* out1 = out + ((long long)(q_start + row1) * num_heads + head) * HEAD_DIM + 2 * t;
#pragma unroll
    for (int j = 0; j < kDimTiles8; ++j) {
        if (row0 < q_len) {
            store_float(&out0[j * 8], o[j][0] * inv0);
            store_float(&out0[j * 8 + 1], o[j][1] * inv0);
        }
        if (row1 < q_len) {
            store_float(&out1[j * 8], o[j][2] * inv1);
            store_float(&out1[j * 8 + 1], o[j][3] * inv1);
        }
    }
}

// Exported kernels: flash_prefill_mma_<f16|bf16>_hd<D>. Launch with 128 threads, grid
// (ceil(max_query_len / 64), num_heads, num_seqs), 2 * prefill_mma::block_n<D>() * (D + 8) * 2
// bytes of dynamic shared memory; same arguments as flash_prefill_* (window and soft_cap
// included). q, k_cache, v_cache must be 16-byte aligned (any CuPy allocation is).
#define DEFINE_FLASH_PREFILL_MMA(NAME, T, HEAD_DIM)                                                             \
    extern "C" __global__ void __launch_bounds__(prefill_mma::kNumThreads)                                      \
        NAME(const T* q, const T* k_cache, const T* v_cache, T* out, const int* query_start_loc,                \
             const int* seq_lens, const int* block_tables, int max_blocks_per_seq, int num_heads,               \
             int num_kv_heads, int block_size, float scale, int window, float soft_cap) {                       \
        flash_prefill_mma<T, HEAD_DIM>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,       \
                                       max_blocks_per_seq, num_heads, num_kv_heads, block_size, scale, window,  \
                                       soft_cap);                                                               \
    }                                                                                                           \
    REFENGINE_EXPORT_KERNEL(NAME)

DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_f16_hd32, __half, 32)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_f16_hd64, __half, 64)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_f16_hd96, __half, 96)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_f16_hd128, __half, 128)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_f16_hd256, __half, 256)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_bf16_hd32, __nv_bfloat16, 32)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_bf16_hd64, __nv_bfloat16, 64)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_bf16_hd96, __nv_bfloat16, 96)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_bf16_hd128, __nv_bfloat16, 128)
DEFINE_FLASH_PREFILL_MMA(flash_prefill_mma_bf16_hd256, __nv_bfloat16, 256)
