// cp_async.cuh — asynchronous global -> shared copies (sm_80+), and their CPU emulation.
//
// `cp.async` (PTX ISA §9.7.9.25) lets a thread start a 16-byte copy into shared memory
// without waiting for it, so the next K/V tile can travel while the tensor cores work on
// the current one (the pipelining of FlashAttention-2, Dao 2023, §3.3, and of CUTLASS).
// The rules a kernel must follow, all enforced by the emulation:
//   1. copies are grouped by `cp_async_commit()`; `cp_async_wait<N>()` returns once at most
//      the N newest groups are still in flight (N = 0: all landed);
//   2. a thread only knows about its *own* copies: to read bytes another thread copied,
//      that thread must have waited and a __syncthreads() must follow its wait;
//   3. the destination holds garbage from the issue until the wait: nobody may still be
//      reading the old contents when a new copy into it is issued.
// `fill == false` copies zero bytes and zero-fills the 16 (the "src-size" operand), which
// is how tiles are padded past the last key without a branch around the instruction.
#pragma once
#include "common.cuh"

#ifdef REFENGINE_EMULATION

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
    ::refengine_emu::cp_async(smem, gmem, 16, fill ? 16 : 0);
}
__device__ __forceinline__ void cp_async_commit() { ::refengine_emu::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { ::refengine_emu::cp_async_wait(N); }

#else

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool fill) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
    // .cg: cache in L2 only (K/V tiles are read once per block; keep L1 for nothing else).
    // No "memory" clobber: nothing may read the destination before cp_async_wait (which has
    // one), and without it the compiler can hoist the next chunk's address loads.
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(fill ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

#endif
