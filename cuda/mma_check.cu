// mma_check.cu — one tensor-core MMA, and one ldmatrix, on known matrices: layout self-tests.
//
// mma.cuh encodes our reading of the register layout of mma.sync.m16n8k16 (PTX ISA
// §9.7.14.5.8). The prefill kernel and the CPU emulation both rely on it, so if the reading
// were wrong they would agree with each other and still be wrong on a GPU. This kernel
// builds the fragments from plain row-major matrices with the PTX formulas written out
// afresh, multiplies, and stores D the same way: tests compare it with A·B in NumPy on the
// emulator, and benchmarks/gpu_check.py does the same on the real tensor cores.
//
// Thread layout: one warp (grid 1, block 32). a: [16][16], b: [16][8] (row-major, k x n),
// d: [16][8] float32.
#include "common.cuh"
#include "cp_async.cuh"
#include "mma.cuh"

template <typename T>
__device__ void mma_check(const T* __restrict__ a, const T* __restrict__ b, float* __restrict__ d) {
    const int lane = threadIdx.x % 32;
    const int group = lane >> 2;         // groupID
    const int in_group = lane % 4;       // threadID_in_group
    // A element i of this lane (i = 0..7): row = group (+8 for i in {2,3,6,7}),
    // col = 2 * in_group + (i & 1) (+8 for i >= 4); registers hold pairs (i, i+1).
    unsigned ra[4];
    for (int r = 0; r < 4; ++r) {
        const int i = 2 * r;
        const int row = group + ((i == 2 || i == 6) ? 8 : 0);
        const int col = 2 * in_group + (i >= 4 ? 8 : 0);
        ra[r] = (unsigned)bits_of(a[row * 16 + col]) | ((unsigned)bits_of(a[row * 16 + col + 1]) << 16);
    }
    // B element i (i = 0..3): row (k) = 2 * in_group + (i & 1) (+8 for i >= 2), col (n) = group.
    unsigned rb[2];
    for (int r = 0; r < 2; ++r) {
        const int k = 2 * in_group + (r == 1 ? 8 : 0);
        rb[r] = (unsigned)bits_of(b[k * 8 + group]) | ((unsigned)bits_of(b[(k + 1) * 8 + group]) << 16);
    }
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    mma_m16n8k16<T>(c, ra, rb);
    // C element i: row = group (+8 for i >= 2), col = 2 * in_group + (i & 1).
    for (int i = 0; i < 4; ++i) d[(group + (i >= 2 ? 8 : 0)) * 8 + 2 * in_group + (i & 1)] = c[i];
}

extern "C" __global__ void mma_check_f16(const __half* a, const __half* b, float* d) { mma_check<__half>(a, b, d); }
REFENGINE_EXPORT_KERNEL(mma_check_f16)
extern "C" __global__ void mma_check_bf16(const __nv_bfloat16* a, const __nv_bfloat16* b, float* d) {
    mma_check<__nv_bfloat16>(a, b, d);
}
REFENGINE_EXPORT_KERNEL(mma_check_bf16)

// ldmatrix_check: the fragment layout of ldmatrix .x4 and .x4.trans (mma.cuh), and
// cp.async with its zero fill (cp_async.cuh), on known data. m: four 8x8 matrices of
// 16-bit values, [4][8][8] row-major. Shared memory is first set to all-ones bits; then
// lane l stages row l % 8 of matrix l / 8 (row stride 24 elements) with cp.async, and the
// 8 elements after it as zero fill. out [32 * 4 + 32 * 4 + 32 * 4] unsigned: each lane's
// 4 registers from ldmatrix, then from ldmatrix.trans, then the 16 bytes of its
// zero-filled chunk (all 0). Launch: grid 1, block 32, 32 * 24 * 2 bytes of dynamic
// shared memory.
// (The body is a plain C++ function, as in every kernel file: `shared_mem` must have the
// same linkage wherever it is declared, and all files form one translation unit on NVRTC.)
__device__ void ldmatrix_check(const __half* __restrict__ m, unsigned* __restrict__ out) {
    constexpr int kStride = 24;
    extern __shared__ __align__(16) unsigned char shared_mem[];
    __half* tile = reinterpret_cast<__half*>(shared_mem);
    REFENGINE_CHECK_SHARED_BYTES(32 * kStride * sizeof(__half));
    const int lane = threadIdx.x % 32;
    // Not zero to begin with (a GPU's shared memory often is), so the zero fill shows.
    for (int i = lane; i < 32 * kStride / 2; i += 32) reinterpret_cast<unsigned*>(tile)[i] = 0xffffffffu;
    __syncthreads();
    cp_async_16(tile + lane * kStride, m + lane * 8, true);
    cp_async_16(tile + lane * kStride + 8, m, false);
    cp_async_commit();
    cp_async_wait<0>();
    __syncthreads();
    unsigned r[4];
    ldmatrix_x4(r, tile + lane * kStride);
    for (int i = 0; i < 4; ++i) out[lane * 4 + i] = r[i];
    ldmatrix_x4_trans(r, tile + lane * kStride);
    for (int i = 0; i < 4; ++i) out[128 + lane * 4 + i] = r[i];
    for (int i = 0; i < 4; ++i) out[256 + lane * 4 + i] = reinterpret_cast<const unsigned*>(tile + lane * kStride + 8)[i];
}

extern "C" __global__ void ldmatrix_check_f16(const __half* m, unsigned* out) { ldmatrix_check(m, out); }
REFENGINE_EXPORT_KERNEL(ldmatrix_check_f16)
