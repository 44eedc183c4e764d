// paged_decode.cu — one new query token per sequence attending over its paged KV cache.
//
// Sources: vLLM's PagedAttention (Kwon et al. 2023, "Efficient Memory Management for Large
// Language Model Serving with PagedAttention", §4.1: keys read block by block through a
// block table) and Flash-Decoding (Dao, Haziza, Massa, Sizov 2023, "Flash-Decoding for
// long-context inference": split the context into partitions processed in parallel, then
// merge the partial softmaxes with their log-sum-exp statistics).
//
// Decode is memory-bound: every K/V byte is read once per step and used for only
// group = num_heads / num_kv_heads query heads. So one block serves *all* the query heads
// of a KV head (up to kGroupTile of them) and reads each K/V tile once for all of them.
//
// Per-layer options (0 = off), as in refengine/attention/numpy_ref.py: a sliding window W
// makes the query (at position seq_len - 1) see only keys [max(0, seq_len - W), seq_len):
// the partitions tile that range and nothing before it is read, so the grid needs only
// ceil(min(max_seq_len, W) / partition_size) partitions. A soft cap c turns every score s
// into c * tanh(s / c) (Gemma 2). Every partition holds at least one key, so the running
// max is finite after its first tile.
//
// Kernel 1, paged_decode_<dtype>_hd<D>:
//   grid  = (num_kv_heads * ceil(group / kGroupTile), num_seqs, num_partitions)
//   block = 128 threads (4 warps); one partition of `partition_size` context tokens.
//   Per key tile (kKeyTile = 32 keys, staged in shared memory as float32):
//     scores:  thread t computes (head g, key k) pairs t, t+128, ...: k = pair % 32, g = pair / 32
//     softmax: warp w owns heads w, w+4; lane = key; warp_max / warp_sum give the tile
//              statistics; the running max m, sum l and rescale factor live in shared memory
//     p · v:   thread t owns the outputs o = t + 128 * i of the kGroupTile x D (head,
//              dimension) pairs: head o / D, dimension o % D (for D dividing 128, dimension
//              t % D of heads t / D + (128 / D) * i; at D = 96 the dimension varies with i)
//   With one partition the block writes the normalised output directly; otherwise it
//   writes acc / l plus (m, l) per (sequence, head, partition) for kernel 2.
//
// Kernel 2, paged_decode_reduce_<dtype>_hd<D>: grid = (num_heads, num_seqs), block = D
// threads (thread = output dimension). Merges the partitions:
//   M = max_p m_p,   w_p = l_p * exp(m_p - M),   out = sum_p w_p * o_p / sum_p w_p.
//   A sequence that filled one partition keeps o_0 as it is (rather than trusting
//   (l * o) / l to round back to o): its output is the same bits whether or not a longer
//   sequence in its batch made the grid several partitions deep. Each sequence's split is
//   fixed by its own length, never by the batch's, so every output's reduction order is too.
//
// Shared memory (dynamic, float32), kernel 1:
//   q_s [kGroupTile][D] | k_s [kKeyTile][D + 1] (padded: the 32 lanes of a warp read 32
//   different keys at the same d, the +1 puts them in 32 different banks) | v_s [kKeyTile][D]
//   | p_s [kGroupTile][kKeyTile] | m_s, l_s, alpha_s [kGroupTile]
#include "common.cuh"

namespace decode {
constexpr int kNumThreads = 128;
constexpr int kNumWarps = kNumThreads / 32;
constexpr int kKeyTile = 32;   // = warp size: in the softmax step a lane owns one key
constexpr int kGroupTile = 8;  // query heads served per block (the rest go to more blocks)

template <int HEAD_DIM>
__host__ __device__ constexpr int shared_floats() {
    return kGroupTile * HEAD_DIM + kKeyTile * (HEAD_DIM + 1) + kKeyTile * HEAD_DIM + kGroupTile * kKeyTile +
           3 * kGroupTile;
}
}  // namespace decode

// C: the cache element (T, or signed char / unsigned char for int8 / fp8 caches); Q: its
// KvQuant (common.cuh). Quantized elements are dequantized as the tile is staged (value *
// scale in float32, the same values flash_prefill reads): k_scales / v_scales [slots,
// num_kv_heads] per token for int8, the layer's k_scale / v_scale for fp8.
template <typename T, typename C, int Q, int HEAD_DIM>
__device__ void paged_decode(const T* __restrict__ q, const C* __restrict__ k_cache, const C* __restrict__ v_cache,
                             T* __restrict__ out, float* __restrict__ partial_out, float* __restrict__ partial_max,
                             float* __restrict__ partial_sum, const int* __restrict__ query_start_loc,
                             const int* __restrict__ seq_lens, const int* __restrict__ block_tables,
                             int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, float scale,
                             int partition_size, int window, float soft_cap, const float* __restrict__ k_scales,
                             const float* __restrict__ v_scales, float k_scale, float v_scale) {
    using namespace decode;
    static_assert((kGroupTile * HEAD_DIM) % kNumThreads == 0, "kGroupTile * head_dim must be a multiple of 128");
    constexpr int kAccPerThread = kGroupTile * HEAD_DIM / kNumThreads;  // outputs each thread accumulates
    constexpr int kVec = 16 / sizeof(C);                                // elements per 16-byte load
    static_assert(HEAD_DIM % kVec == 0, "head_dim must be a multiple of 16 bytes' elements (16-byte loads)");
    constexpr int kChunksPerRow = HEAD_DIM / kVec;

    const int seq = blockIdx.y;
    const int partition = blockIdx.z;
    if (query_start_loc[seq + 1] == query_start_loc[seq]) return;  // no query row this step
    const int seq_len = seq_lens[seq];
    const int key_begin = window > 0 ? max(0, seq_len - window) : 0;  // first key the query sees
    const int part_start = key_begin + partition * partition_size;
    if (part_start >= seq_len) return;  // a shorter sequence (or window) than the longest: nothing here
    const int part_end = min(seq_len, part_start + partition_size);

    const int group = num_heads / num_kv_heads;
    const int group_chunks = (group + kGroupTile - 1) / kGroupTile;
    const int kv_head = blockIdx.x / group_chunks;
    const int g_first = (blockIdx.x % group_chunks) * kGroupTile;  // first head of the group served here
    const int num_g = min(kGroupTile, group - g_first);
    const int head0 = kv_head * group + g_first;                   // its global query-head index
    const int token = query_start_loc[seq + 1] - 1;                // the decode row (last of the sequence)
    const int* block_table = block_tables + (long long)seq * max_blocks_per_seq;

    extern __shared__ __align__(16) unsigned char shared_mem[];
    float* q_s = reinterpret_cast<float*>(shared_mem);
    float* k_s = q_s + kGroupTile * HEAD_DIM;
    float* v_s = k_s + kKeyTile * (HEAD_DIM + 1);
    float* p_s = v_s + kKeyTile * HEAD_DIM;
    float* m_s = p_s + kGroupTile * kKeyTile;
    float* l_s = m_s + kGroupTile;
    float* alpha_s = l_s + kGroupTile;
    REFENGINE_CHECK_SHARED_BYTES(shared_floats<HEAD_DIM>() * sizeof(float));

    const int tid = threadIdx.x;
    const int warp = tid / 32;
    const int lane = tid % 32;

    // Query rows of the served heads, scaled (unused head slots: zero).
    for (int idx = tid; idx < kGroupTile * HEAD_DIM; idx += kNumThreads) {
        const int g = idx / HEAD_DIM;
        q_s[idx] = g < num_g ? load_float(q[((long long)token * num_heads + head0 + g) * HEAD_DIM + idx % HEAD_DIM]) * scale
                             : 0.0f;
    }
    if (tid < kGroupTile) {
        m_s[tid] = REFENGINE_NEG_INF;
        l_s[tid] = 0.0f;
    }
    float acc[kAccPerThread];
#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) acc[i] = 0.0f;
    const float inv_cap = soft_cap > 0.0f ? 1.0f / soft_cap : 0.0f;

    for (int tile_start = part_start; tile_start < part_end; tile_start += kKeyTile) {
        // 1. Stage K and V (converted to float32) through the block table, 16 bytes per
        //    load (decode is bandwidth-bound: wide loads keep the memory system busy with
        //    few instructions); zero past the end of the partition.
        for (int idx = tid; idx < kKeyTile * kChunksPerRow; idx += kNumThreads) {
            const int key = idx / kChunksPerRow;
            const int d = (idx % kChunksPerRow) * kVec;
            const int pos = tile_start + key;
            uint4 k_raw = {0u, 0u, 0u, 0u}, v_raw = {0u, 0u, 0u, 0u};  // zero bits = 0.0 in every C
            float ks = k_scale, vs = v_scale;  // fp8: the layer's; int8: the token's (below)
            if (pos < part_end) {
                const long long physical_block = block_table[pos / block_size];
                const long long slot = physical_block * block_size + pos % block_size;
                const long long offset = (slot * num_kv_heads + kv_head) * HEAD_DIM + d;
                k_raw = *reinterpret_cast<const uint4*>(k_cache + offset);
                v_raw = *reinterpret_cast<const uint4*>(v_cache + offset);
                if constexpr (Q == kKvInt8) {
                    ks = k_scales[slot * num_kv_heads + kv_head];
                    vs = v_scales[slot * num_kv_heads + kv_head];
                }
            }
            const C* k_vec = reinterpret_cast<const C*>(&k_raw);
            const C* v_vec = reinterpret_cast<const C*>(&v_raw);
#pragma unroll
            for (int e = 0; e < kVec; ++e) {
                if constexpr (Q == kKvNone) {
                    k_s[key * (HEAD_DIM + 1) + d + e] = load_float(k_vec[e]);
                    v_s[key * HEAD_DIM + d + e] = load_float(v_vec[e]);
                } else {
                    k_s[key * (HEAD_DIM + 1) + d + e] = kv_element<Q>(k_vec[e]) * ks;
                    v_s[key * HEAD_DIM + d + e] = kv_element<Q>(v_vec[e]) * vs;
                }
            }
        }
        __syncthreads();  // q_s, stats (first tile) and the K/V tile are complete

        // 2. Scores for every (head, key) pair of the tile. Head slots past the group
        //    (num_g < kGroupTile) get a dummy finite score and are never written out.
        for (int pair = tid; pair < kGroupTile * kKeyTile; pair += kNumThreads) {
            const int key = pair % kKeyTile;
            const int g = pair / kKeyTile;
            float dot = 0.0f;
            if (g < num_g) {
#pragma unroll 8
                for (int d = 0; d < HEAD_DIM; ++d) dot += q_s[g * HEAD_DIM + d] * k_s[key * (HEAD_DIM + 1) + d];
            }
            if (soft_cap > 0.0f) dot = soft_cap * tanhf(dot * inv_cap);
            p_s[pair] = (tile_start + key < part_end) ? dot : REFENGINE_NEG_INF;
        }
        __syncthreads();  // all scores written

        // 3. Online softmax per head; lane = key. Read m before the shuffles: lane 0
        //    overwrites it after them, and the shuffles order that write after every read.
        for (int g = warp; g < kGroupTile; g += kNumWarps) {
            const float m_old = m_s[g];
            const float s = p_s[g * kKeyTile + lane];
            const float m_new = fmaxf(m_old, warp_max(s));  // finite: the tile has >= 1 key
            const float p = __expf(s - m_new);
            const float tile_sum = warp_sum(p);
            p_s[g * kKeyTile + lane] = p;
            if (lane == 0) {
                const float alpha = __expf(m_old - m_new);
                alpha_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + tile_sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();  // probabilities and rescale factors ready

        // 4. acc = alpha * acc + p · V for the outputs this thread owns.
#pragma unroll
        for (int i = 0; i < kAccPerThread; ++i) {
            const int g = (tid + kNumThreads * i) / HEAD_DIM;
            const int d = (tid + kNumThreads * i) % HEAD_DIM;
            if (g >= num_g) continue;  // an unused head slot
            float sum = 0.0f;
#pragma unroll 8
            for (int key = 0; key < kKeyTile; ++key) sum += p_s[g * kKeyTile + key] * v_s[key * HEAD_DIM + d];
            acc[i] = acc[i] * alpha_s[g] + sum;
        }
        __syncthreads();  // done with this tile before the next one overwrites it
    }

#pragma unroll
    for (int i = 0; i < kAccPerThread; ++i) {
        const int g = (tid + kNumThreads * i) / HEAD_DIM;
        const int d = (tid + kNumThreads * i) % HEAD_DIM;
        if (g >= num_g) continue;
        const int head = head0 + g;
        const float o = acc[i] / l_s[g];
        if (gridDim.z == 1) {  // the whole context (or window) in one partition: final answer
            store_float(&out[((long long)token * num_heads + head) * HEAD_DIM + d], o);
        } else {
            const long long idx = ((long long)seq * num_heads + head) * gridDim.z + partition;
            partial_out[idx * HEAD_DIM + d] = o;
            if (d == 0) {
                partial_max[idx] = m_s[g];
                partial_sum[idx] = l_s[g];
            }
        }
    }
}

template <typename T, int HEAD_DIM>
__device__ void paged_decode_reduce(T* __restrict__ out, const float* __restrict__ partial_out,
                                    const float* __restrict__ partial_max, const float* __restrict__ partial_sum,
                                    const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                                    int num_heads, int num_partitions, int partition_size, int window) {
    const int head = blockIdx.x;
    const int seq = blockIdx.y;
    const int d = threadIdx.x;
    if (query_start_loc[seq + 1] == query_start_loc[seq]) return;  // no query row this step
    const int seq_len = seq_lens[seq];
    const int keys = window > 0 ? min(seq_len, window) : seq_len;  // what kernel 1 read
    const int used = (keys + partition_size - 1) / partition_size;  // partitions this sequence filled
    const long long base = ((long long)seq * num_heads + head) * num_partitions;
    const int token = query_start_loc[seq + 1] - 1;
    if (used == 1) {  // acc / l as kernel 1 computed it: the same bits as a batch with one partition
        store_float(&out[((long long)token * num_heads + head) * HEAD_DIM + d], partial_out[base * HEAD_DIM + d]);
        return;
    }

    float global_max = REFENGINE_NEG_INF;
    for (int p = 0; p < used; ++p) global_max = fmaxf(global_max, partial_max[base + p]);
    float numerator = 0.0f, denominator = 0.0f;
    for (int p = 0; p < used; ++p) {
        const float w = partial_sum[base + p] * __expf(partial_max[base + p] - global_max);
        numerator += w * partial_out[(base + p) * HEAD_DIM + d];
        denominator += w;
    }
    store_float(&out[((long long)token * num_heads + head) * HEAD_DIM + d], numerator / denominator);
}

// Exported kernels. paged_decode_<dtype>_hd<D>: 128 threads, grid as above,
// decode::shared_floats<D>() * 4 bytes of dynamic shared memory. partial_* are float32
// scratch of [num_seqs, num_heads, num_partitions] (x D for partial_out); unused (may be
// any pointer) when num_partitions == 1. partition_size must be a multiple of 32. window:
// keys per query (0 = all), the same for both kernels; soft_cap: 0 = none. At head_dim 256
// kernel 1 needs 73.2 KiB of shared memory, over the 48 KiB default (the launcher opts in).
// k_cache and v_cache must be 16-byte aligned (any CuPy allocation is).
// (No __launch_bounds__(128) on the main kernel: with it ptxas aims at full occupancy,
// 32 registers, and spills for head_dim 32; left alone it takes 32-126 by head dim and
// spills nothing: cuda/check_nvcc.sh prints the counts.)
#define DEFINE_PAGED_DECODE(NAME, REDUCE_NAME, T, HEAD_DIM)                                                   \
    extern "C" __global__ void NAME(                                                                          \
        const T* q, const T* k_cache, const T* v_cache, T* out, float* partial_out, float* partial_max,  \
             float* partial_sum, const int* query_start_loc, const int* seq_lens, const int* block_tables,    \
             int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, float scale,            \
             int partition_size, int window, float soft_cap) {                                                \
        paged_decode<T, T, kKvNone, HEAD_DIM>(q, k_cache, v_cache, out, partial_out, partial_max, partial_sum, \
                                              query_start_loc, seq_lens, block_tables, max_blocks_per_seq,      \
                                              num_heads, num_kv_heads, block_size, scale, partition_size,       \
                                              window, soft_cap, nullptr, nullptr, 1.0f, 1.0f);                  \
    }                                                                                                         \
    REFENGINE_EXPORT_KERNEL(NAME)                                                                             \
    extern "C" __global__ void __launch_bounds__(HEAD_DIM)                                                    \
        REDUCE_NAME(T* out, const float* partial_out, const float* partial_max, const float* partial_sum,     \
                    const int* query_start_loc, const int* seq_lens, int num_heads, int num_partitions,       \
                    int partition_size, int window) {                                                         \
        paged_decode_reduce<T, HEAD_DIM>(out, partial_out, partial_max, partial_sum, query_start_loc,         \
                                         seq_lens, num_heads, num_partitions, partition_size, window);        \
    }                                                                                                         \
    REFENGINE_EXPORT_KERNEL(REDUCE_NAME)

DEFINE_PAGED_DECODE(paged_decode_f32_hd32, paged_decode_reduce_f32_hd32, float, 32)
DEFINE_PAGED_DECODE(paged_decode_f32_hd64, paged_decode_reduce_f32_hd64, float, 64)
DEFINE_PAGED_DECODE(paged_decode_f32_hd96, paged_decode_reduce_f32_hd96, float, 96)
DEFINE_PAGED_DECODE(paged_decode_f32_hd128, paged_decode_reduce_f32_hd128, float, 128)
DEFINE_PAGED_DECODE(paged_decode_f32_hd256, paged_decode_reduce_f32_hd256, float, 256)
DEFINE_PAGED_DECODE(paged_decode_f16_hd32, paged_decode_reduce_f16_hd32, __half, 32)
DEFINE_PAGED_DECODE(paged_decode_f16_hd64, paged_decode_reduce_f16_hd64, __half, 64)
DEFINE_PAGED_DECODE(paged_decode_f16_hd96, paged_decode_reduce_f16_hd96, __half, 96)
DEFINE_PAGED_DECODE(paged_decode_f16_hd128, paged_decode_reduce_f16_hd128, __half, 128)
DEFINE_PAGED_DECODE(paged_decode_f16_hd256, paged_decode_reduce_f16_hd256, __half, 256)
DEFINE_PAGED_DECODE(paged_decode_bf16_hd32, paged_decode_reduce_bf16_hd32, __nv_bfloat16, 32)
DEFINE_PAGED_DECODE(paged_decode_bf16_hd64, paged_decode_reduce_bf16_hd64, __nv_bfloat16, 64)
DEFINE_PAGED_DECODE(paged_decode_bf16_hd96, paged_decode_reduce_bf16_hd96, __nv_bfloat16, 96)
DEFINE_PAGED_DECODE(paged_decode_bf16_hd128, paged_decode_reduce_bf16_hd128, __nv_bfloat16, 128)
DEFINE_PAGED_DECODE(paged_decode_bf16_hd256, paged_decode_reduce_bf16_hd256, __nv_bfloat16, 256)

// Quantized caches: paged_decode_<dtype>_<int8|fp8e4m3|fp8e5m2>_hd<D>, the same launch (and the
// same paged_decode_reduce_<dtype>_hd<D> after it) with four more arguments: k_scales, v_scales
// float32 [num_blocks * block_size, num_kv_heads] (int8; any pointer for fp8) and k_scale,
// v_scale (fp8: the layer's scales; int8: unused). The caches hold one byte per value.
#define DEFINE_PAGED_DECODE_QUANT(NAME, T, C, Q, HEAD_DIM)                                                     \
    extern "C" __global__ void NAME(                                                                          \
        const T* q, const C* k_cache, const C* v_cache, T* out, float* partial_out, float* partial_max,       \
        float* partial_sum, const int* query_start_loc, const int* seq_lens, const int* block_tables,         \
        int max_blocks_per_seq, int num_heads, int num_kv_heads, int block_size, float scale,                 \
        int partition_size, int window, float soft_cap, const float* k_scales, const float* v_scales,         \
        float k_scale, float v_scale) {                                                                       \
        paged_decode<T, C, Q, HEAD_DIM>(q, k_cache, v_cache, out, partial_out, partial_max, partial_sum,      \
                                        query_start_loc, seq_lens, block_tables, max_blocks_per_seq,          \
                                        num_heads, num_kv_heads, block_size, scale, partition_size, window,   \
                                        soft_cap, k_scales, v_scales, k_scale, v_scale);                      \
    }                                                                                                         \
    REFENGINE_EXPORT_KERNEL(NAME)

#define DEFINE_PAGED_DECODE_QUANTS(DT, T, HEAD_DIM)                                                              \
    DEFINE_PAGED_DECODE_QUANT(paged_decode_##DT##_int8_hd##HEAD_DIM, T, signed char, kKvInt8, HEAD_DIM)         \
    DEFINE_PAGED_DECODE_QUANT(paged_decode_##DT##_fp8e4m3_hd##HEAD_DIM, T, unsigned char, kKvFp8E4m3, HEAD_DIM) \
    DEFINE_PAGED_DECODE_QUANT(paged_decode_##DT##_fp8e5m2_hd##HEAD_DIM, T, unsigned char, kKvFp8E5m2, HEAD_DIM)

DEFINE_PAGED_DECODE_QUANTS(f32, float, 32)
DEFINE_PAGED_DECODE_QUANTS(f32, float, 64)
DEFINE_PAGED_DECODE_QUANTS(f32, float, 96)
DEFINE_PAGED_DECODE_QUANTS(f32, float, 128)
DEFINE_PAGED_DECODE_QUANTS(f32, float, 256)
DEFINE_PAGED_DECODE_QUANTS(f16, __half, 32)
DEFINE_PAGED_DECODE_QUANTS(f16, __half, 64)
DEFINE_PAGED_DECODE_QUANTS(f16, __half, 96)
DEFINE_PAGED_DECODE_QUANTS(f16, __half, 128)
DEFINE_PAGED_DECODE_QUANTS(f16, __half, 256)
DEFINE_PAGED_DECODE_QUANTS(bf16, __nv_bfloat16, 32)
DEFINE_PAGED_DECODE_QUANTS(bf16, __nv_bfloat16, 64)
DEFINE_PAGED_DECODE_QUANTS(bf16, __nv_bfloat16, 96)
DEFINE_PAGED_DECODE_QUANTS(bf16, __nv_bfloat16, 128)
DEFINE_PAGED_DECODE_QUANTS(bf16, __nv_bfloat16, 256)
