// flash_prefill.cu — causal attention of a flat batch of query chunks over the paged KV cache.
//
// Algorithm: FlashAttention-2 forward pass (Dao 2023, "FlashAttention-2: Faster Attention
// with Better Parallelism and Work Partitioning", §3.1, Algorithm 1). A block owns a tile
// of BLOCK_M query rows of one head; it walks the keys in tiles of BLOCK_N staged in
// shared memory and keeps, per query row, the running max m, the running sum l and the
// unnormalised output acc (the "online softmax"). For each key tile:
//     s     = q · kᵀ (already scaled)           m_new = max(m, rowmax(s))
//     p     = exp(s - m_new)                    alpha = exp(m - m_new)
//     l     = alpha * l + rowsum(p)             acc   = alpha * acc + p · v
// and at the end out = acc / l. Only one division per output, none per tile (FA2 §3.1.1).
//
// Paged, chunked, batched (refengine/attention/__init__.py, the attention contract): sequence i owns query
// rows query_start_loc[i] .. query_start_loc[i+1]; its context has seq_lens[i] tokens of
// which the last q_len are this chunk. Query row j sits at position seq_len - q_len + j
// and sees keys 0 ..= that position. Key p lives in block block_tables[i][p / block_size].
// A decode row (q_len == 1) is simply a chunk of one row, so mixed batches just work.
// Grouped-query attention: query head h reads KV head h / (num_heads / num_kv_heads).
//
// Per-layer options (0 = off), as in refengine/attention/numpy_ref.py:
// * window W > 0 (sliding window, transformers' rule): a row at position p sees keys
//   max(0, p - W + 1) ..= p. Key tiles wholly before the window of the block's *first* row
//   are never loaded (later rows' windows start later still); within the loaded tiles each
//   row masks its own keys. A later row may then meet a tile with none of its keys: its m
//   stays -inf, and the update subtracts 0 instead of m so p and alpha are 0, not NaN.
// * soft_cap c > 0 (Gemma 2's attention-logit soft-capping): s = c * tanh(s / c) before
//   the mask and the softmax.
//
// Thread layout (128 threads = 4 warps, BLOCK_M = 32 rows, BLOCK_N = 32 keys, 16 at
// head_dim 256, see prefill::block_n):
//   grid  = (ceil(max_query_len / BLOCK_M), num_heads, num_seqs)
//   thread t serves query row t / 4 ("row") and head dimensions d = part + 4*i
//   (part = t % 4, i < HEAD_DIM / 4). The 4 threads of a row are adjacent lanes of one
//   warp: each computes a partial dot product over its dimensions, two xor-shuffles sum
//   them, and then all 4 hold the full score row, so the softmax needs no more traffic.
//   Interleaved dimensions make the 4 threads read 4 consecutive elements of a K/V row
//   while the 8 rows of the warp read the same ones (a broadcast): no bank conflicts.
//
// Shared memory (dynamic, 2 * BLOCK_N * HEAD_DIM * sizeof(T) bytes, at most 32 KiB):
//   k_tile [BLOCK_N][HEAD_DIM], v_tile [BLOCK_N][HEAD_DIM] in the storage type T.
//
// Quantized caches (int8 / fp8, common.cuh): the same kernel, the cache elements
// dequantized (value * scale, float32) as the tile is staged, into float32 tiles
// (2 * BLOCK_N * HEAD_DIM * 4 bytes, at most 32 KiB): the values paged_decode reads too.
//
// Precision: T is float, __half or __nv_bfloat16 storage; q·k, softmax and p·v in float32.
//
// This is the SIMT formulation (one float32 FMA per product): it serves float32 storage
// (the CPU engine's dtype, in emulation) and is the easiest version to read.
// flash_prefill_mma.cu runs the same loop on tensor cores for float16/bfloat16.
#include "common.cuh"

namespace prefill {
constexpr int kNumThreads = 128;
constexpr int kBlockM = 32;  // query rows per block
constexpr int kThreadsPerRow = kNumThreads / kBlockM;
// Keys per shared-memory tile: 32, or 16 at head_dim 256, where 32 would need ~254 registers
// (q and acc slices of 64 floats each plus 32 scores) and 64 KiB of float32 tiles.
template <int HEAD_DIM>
__host__ __device__ constexpr int block_n() {
    return HEAD_DIM > 128 ? 16 : 32;
}
}  // namespace prefill

// C: the cache element (T, or signed char / unsigned char for int8 / fp8 caches); Q: its
// KvQuant (common.cuh). Quantized caches are dequantized while the tile is staged, into
// float32 tiles: k_scales / v_scales [slots, num_kv_heads] per token (int8), or the layer's
// k_scale / v_scale (fp8); unquantized ones ignore all four.
template <typename T, typename C, int Q, int HEAD_DIM>
__device__ void flash_prefill(const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
                              T* __restrict__ out, const int* __restrict__ query_start_loc,
                              const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                              int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, float scale,
                              int window, float soft_cap, const float* __restrict__ k_scales,
                              const float* __restrict__ v_scales, float k_scale, float v_scale) {
    using namespace prefill;
    using TileT = typename refengine_if<Q == kKvNone, T, float>::type;  // shared-memory tile type
    constexpr int kBlockN = block_n<HEAD_DIM>();
    constexpr int kDimsPerThread = HEAD_DIM / kThreadsPerRow;
    static_assert(HEAD_DIM % kThreadsPerRow == 0, "head_dim must be a multiple of 4");

    const int q_tile = blockIdx.x;
    const int head = blockIdx.y;
    const int seq = blockIdx.z;
    const int q_start = query_start_loc[seq];
    const int q_len = query_start_loc[seq + 1] - q_start;
    if (q_tile * kBlockM >= q_len) return;  // this sequence has fewer rows: the whole block exits

    const int seq_len = seq_lens[seq];
    const int ctx_len = seq_len - q_len;  // tokens cached before this chunk
    const int kv_head = head / (num_heads / num_kv_heads);
    const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;

    const int row = threadIdx.x / kThreadsPerRow;  // 0 .. kBlockM-1
    const int part = threadIdx.x % kThreadsPerRow;  // which interleaved quarter of head_dim
    const int q_row = q_tile * kBlockM + row;       // row within this sequence's chunk
    const bool row_valid = q_row < q_len;
    // Rows past the chunk end (last tile) compute a copy of the last real row and store
    // nothing; they still take part in every shuffle and barrier.
    const int q_row_clamped = row_valid ? q_row : q_len - 1;
    const int q_pos = ctx_len + q_row_clamped;  // sees keys 0 ..= q_pos
    const int q_first_key = window > 0 ? q_pos - window + 1 : 0;  // ... from here on (may be < 0)
    const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;

    // This thread's slice of the query row, pre-multiplied by the softmax scale.
    float q_reg[kDimsPerThread];
    const T* q_ptr = q + ((long long)(q_start + q_row_clamped) * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) q_reg[i] = load_float(q_ptr[part + kThreadsPerRow * i]) * scale;

    float acc[kDimsPerThread];
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) acc[i] = 0.0f;
    float m = REFENGINE_NEG_INF;  // running row max
    float l = 0.0f;               // running row sum of exp(s - m)

    extern __shared__ __align__(16) unsigned char shared_mem[];
    TileT* k_tile = reinterpret_cast<TileT*>(shared_mem);
    TileT* v_tile = k_tile + kBlockN * HEAD_DIM;
    REFENGINE_CHECK_SHARED_BYTES(2 * kBlockN * HEAD_DIM * sizeof(TileT));

    // Keys any row of this tile may see: up to the position of its last real row (causal),
    // and from the key tile holding the first row's first key (window; 0 without one).
    const int last_row = min(q_tile * kBlockM + kBlockM, q_len) - 1;
    const int kv_end = ctx_len + last_row + 1;
    const int kv_begin = window > 0 ? max(0, ctx_len + q_tile * kBlockM - window + 1) / kBlockN * kBlockN : 0;

    for (int kv_start = kv_begin; kv_start < kv_end; kv_start += kBlockN) {
        // 1. Stage the K and V tile through the block table (coalesced along head_dim).
        //    Keys past kv_end are zero, never garbage: p = 0 times a NaN would be NaN.
        for (int idx = threadIdx.x; idx < kBlockN * HEAD_DIM; idx += kNumThreads) {
            const int key = idx / HEAD_DIM;
            const int d = idx % HEAD_DIM;
            const int pos = kv_start + key;
            if (pos < kv_end) {
                const long long physical_block = block_table[pos / block_size];
                const long long slot = physical_block * block_size + pos % block_size;
                const long long offset = (slot * num_kv_heads + kv_head) * HEAD_DIM + d;
                if constexpr (Q == kKvNone) {
                    k_tile[idx] = k_cache[offset];
                    v_tile[idx] = v_cache[offset];
                } else {  // dequantize: value * scale in float32, as the twin and paged_decode do
                    float ks = k_scale, vs = v_scale;
                    if constexpr (Q == kKvInt8) {
                        ks = k_scales[slot * num_kv_heads + kv_head];
                        vs = v_scales[slot * num_kv_heads + kv_head];
                    }
                    k_tile[idx] = kv_element<Q>(k_cache[offset]) * ks;
                    v_tile[idx] = kv_element<Q>(v_cache[offset]) * vs;
                }
            } else {
                store_float(&k_tile[idx], 0.0f);
                store_float(&v_tile[idx], 0.0f);
            }
        }
        __syncthreads();  // the tile is complete before anyone reads it

        // 2. Scores s[j] = q · k_j for this row (soft-capped); causal and window mask by position.
        float s[kBlockN];
#pragma unroll
        for (int j = 0; j < kBlockN; ++j) {
            float partial = 0.0f;
#pragma unroll
            for (int i = 0; i < kDimsPerThread; ++i)
                partial += q_reg[i] * load_float(k_tile[j * HEAD_DIM + part + kThreadsPerRow * i]);
            // Sum the 4 partial dot products of this row (lanes 4r .. 4r+3).
            partial += __shfl_xor_sync(REFENGINE_FULL_MASK, partial, 1);
            partial += __shfl_xor_sync(REFENGINE_FULL_MASK, partial, 2);
            if (soft_cap > 0.0f) partial = soft_cap * tanhf(partial * inv_cap);
            const int key = kv_start + j;
            s[j] = (key <= q_pos && key >= q_first_key) ? partial : REFENGINE_NEG_INF;
        }

        // 3. Online softmax update. m_new is -inf only while this row has met none of its
        //    keys (a window that starts in a later tile): subtract 0 then, so that
        //    exp(-inf - 0) = 0 instead of exp(-inf + inf) = NaN.
        float tile_max = REFENGINE_NEG_INF;
#pragma unroll
        for (int j = 0; j < kBlockN; ++j) tile_max = fmaxf(tile_max, s[j]);
        const float m_new = fmaxf(m, tile_max);
        const float m_sub = m_new == REFENGINE_NEG_INF ? 0.0f : m_new;
        const float alpha = __expf(m - m_sub);  // rescales what was accumulated so far
        l *= alpha;
#pragma unroll
        for (int i = 0; i < kDimsPerThread; ++i) acc[i] *= alpha;

        // 4. acc += p · V_tile.
#pragma unroll
        for (int j = 0; j < kBlockN; ++j) {
            const float p = __expf(s[j] - m_sub);
            l += p;
#pragma unroll
            for (int i = 0; i < kDimsPerThread; ++i)
                acc[i] += p * load_float(v_tile[j * HEAD_DIM + part + kThreadsPerRow * i]);
        }
        m = m_new;
        __syncthreads();  // everyone is done with this tile before the next one overwrites it
    }

    if (!row_valid) return;
    const float inv_l = 1.0f / l;
    T* out_ptr = out + ((long long)(q_start + q_row) * num_heads + head) * HEAD_DIM;
#pragma unroll
    for (int i = 0; i < kDimsPerThread; ++i) store_float(&out_ptr[part + kThreadsPerRow * i], acc[i] * inv_l);
}

// Exported kernels: flash_prefill_<dtype>_hd<head_dim>. Launch with 128 threads,
// grid (ceil(max_query_len / 32), num_heads, num_seqs) and
// 2 * prefill::block_n<head_dim>() * head_dim * sizeof(T) bytes of dynamic shared memory.
// Arguments: q [T, num_heads, head_dim];
// k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]; out like q;
// query_start_loc int32 [B+1]; seq_lens int32 [B]; block_tables int32 [B, max_blocks_per_seq];
// window (keys per query, 0 = no sliding window); soft_cap (0 = none).
#define DEFINE_FLASH_PREFILL(NAME, T, HEAD_DIM)                                                                 \
    extern "C" __global__ void __launch_bounds__(prefill::kNumThreads)                                          \
        NAME(const T* q, const T* k_cache, const T* v_cache, T* out, const int* query_start_loc,                \
             const int* seq_lens, const int* block_tables, int max_blocks_per_seq, int num_heads,               \
             int num_kv_heads, int block_size, float scale, int window, float soft_cap) {                       \
        flash_prefill<T, T, kKvNone, HEAD_DIM>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables, \
                                               max_blocks_per_seq, num_heads, num_kv_heads, block_size, scale,   \
                                               window, soft_cap, nullptr, nullptr, 1.0f, 1.0f);                  \
    }                                                                                                           \
    REFENGINE_EXPORT_KERNEL(NAME)

DEFINE_FLASH_PREFILL(flash_prefill_f32_hd32, float, 32)
DEFINE_FLASH_PREFILL(flash_prefill_f32_hd64, float, 64)
DEFINE_FLASH_PREFILL(flash_prefill_f32_hd96, float, 96)
DEFINE_FLASH_PREFILL(flash_prefill_f32_hd128, float, 128)
DEFINE_FLASH_PREFILL(flash_prefill_f32_hd256, float, 256)
DEFINE_FLASH_PREFILL(flash_prefill_f16_hd32, __half, 32)
DEFINE_FLASH_PREFILL(flash_prefill_f16_hd64, __half, 64)
DEFINE_FLASH_PREFILL(flash_prefill_f16_hd96, __half, 96)
DEFINE_FLASH_PREFILL(flash_prefill_f16_hd128, __half, 128)
DEFINE_FLASH_PREFILL(flash_prefill_f16_hd256, __half, 256)
DEFINE_FLASH_PREFILL(flash_prefill_bf16_hd32, __nv_bfloat16, 32)
DEFINE_FLASH_PREFILL(flash_prefill_bf16_hd64, __nv_bfloat16, 64)
DEFINE_FLASH_PREFILL(flash_prefill_bf16_hd96, __nv_bfloat16, 96)
DEFINE_FLASH_PREFILL(flash_prefill_bf16_hd128, __nv_bfloat16, 128)
DEFINE_FLASH_PREFILL(flash_prefill_bf16_hd256, __nv_bfloat16, 256)

// Quantized caches: flash_prefill_<dtype>_<int8|fp8e4m3|fp8e5m2>_hd<head_dim>, the same launch
// but 2 * block_n * head_dim * 4 bytes of shared memory (float32 tiles) and four more
// arguments: k_scales, v_scales float32 [num_blocks * block_size, num_kv_heads] (int8; any
// pointer for fp8), k_scale, v_scale (fp8: the layer's scales; int8: unused). The caches are
// int8 values or fp8 codes, one byte each. (flash_prefill_mma has no quantized variants: the
// plan sends quantized caches here, see refengine/kernels/plans.py.)
#define DEFINE_FLASH_PREFILL_QUANT(NAME, T, C, Q, HEAD_DIM)                                                     \
    extern "C" __global__ void __launch_bounds__(prefill::kNumThreads)                                          \
        NAME(const T* q, const C* k_cache, const C* v_cache, T* out, const int* query_start_loc,                \
             const int* seq_lens, const int* block_tables, int max_blocks_per_seq, int num_heads,               \
             int num_kv_heads, int block_size, float scale, int window, float soft_cap, const float* k_scales,  \
             const float* v_scales, float k_scale, float v_scale) {                                             \
        flash_prefill<T, C, Q, HEAD_DIM>(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_tables,     \
                                         max_blocks_per_seq, num_heads, num_kv_heads, block_size, scale,        \
                                         window, soft_cap, k_scales, v_scales, k_scale, v_scale);               \
    }                                                                                                           \
    REFENGINE_EXPORT_KERNEL(NAME)

#define DEFINE_FLASH_PREFILL_QUANTS(DT, T, HEAD_DIM)                                                              \
    DEFINE_FLASH_PREFILL_QUANT(flash_prefill_##DT##_int8_hd##HEAD_DIM, T, signed char, kKvInt8, HEAD_DIM)         \
    DEFINE_FLASH_PREFILL_QUANT(flash_prefill_##DT##_fp8e4m3_hd##HEAD_DIM, T, unsigned char, kKvFp8E4m3, HEAD_DIM) \
    DEFINE_FLASH_PREFILL_QUANT(flash_prefill_##DT##_fp8e5m2_hd##HEAD_DIM, T, unsigned char, kKvFp8E5m2, HEAD_DIM)

DEFINE_FLASH_PREFILL_QUANTS(f32, float, 32)
DEFINE_FLASH_PREFILL_QUANTS(f32, float, 64)
DEFINE_FLASH_PREFILL_QUANTS(f32, float, 96)
DEFINE_FLASH_PREFILL_QUANTS(f32, float, 128)
DEFINE_FLASH_PREFILL_QUANTS(f32, float, 256)
DEFINE_FLASH_PREFILL_QUANTS(f16, __half, 32)
DEFINE_FLASH_PREFILL_QUANTS(f16, __half, 64)
DEFINE_FLASH_PREFILL_QUANTS(f16, __half, 96)
DEFINE_FLASH_PREFILL_QUANTS(f16, __half, 128)
DEFINE_FLASH_PREFILL_QUANTS(f16, __half, 256)
DEFINE_FLASH_PREFILL_QUANTS(bf16, __nv_bfloat16, 32)
DEFINE_FLASH_PREFILL_QUANTS(bf16, __nv_bfloat16, 64)
DEFINE_FLASH_PREFILL_QUANTS(bf16, __nv_bfloat16, 96)
DEFINE_FLASH_PREFILL_QUANTS(bf16, __nv_bfloat16, 128)
DEFINE_FLASH_PREFILL_QUANTS(bf16, __nv_bfloat16, 256)
