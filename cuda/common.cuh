// common.cuh — helpers shared by refengine's kernels (GPU and CPU emulation alike).
//
// * load_float / store_float: explicit conversions between the storage type (float,
//   __half, __nv_bfloat16) and float32, the type all arithmetic is done in.
// * warp_max / warp_sum: butterfly reductions with __shfl_xor_sync; every lane ends with
//   the result.
// * REFENGINE_EXPORT_KERNEL(name): make an `extern "C" __global__` kernel launchable by
//   name in the CPU emulation (no-op under nvcc, where cupy finds it by its C name).
// * REFENGINE_CHECK_SHARED_BYTES(n): in emulation, fail the launch if the host passed less
//   dynamic shared memory than the kernel carves (no-op on the GPU).
#pragma once

#ifdef REFENGINE_EMULATION
// cuda_emu.h is force-included by the compiler command line (-include cuda_emu.h).
#define REFENGINE_EXPORT_KERNEL(name) \
    static ::refengine_emu::KernelRegistrar<&name> refengine_registrar_##name(#name);
#define REFENGINE_CHECK_SHARED_BYTES(n) ::refengine_emu::check_shared_bytes(n)
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define REFENGINE_EXPORT_KERNEL(name)
#define REFENGINE_CHECK_SHARED_BYTES(n) ((void)(n))
#endif

#define REFENGINE_FULL_MASK 0xffffffffu

// Storage <-> float32. Overloads rather than implicit conversions so every rounding
// point is visible in the kernel source.
__device__ __forceinline__ float load_float(float x) { return x; }
__device__ __forceinline__ float load_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float load_float(__nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void store_float(float* p, float x) { *p = x; }
__device__ __forceinline__ void store_float(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store_float(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// Reductions over a whole warp (all 32 lanes must call them).
__device__ __forceinline__ float warp_max(float x) {
    for (int offset = 16; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(REFENGINE_FULL_MASK, x, offset));
    return x;
}

__device__ __forceinline__ float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset /= 2) x += __shfl_xor_sync(REFENGINE_FULL_MASK, x, offset);
    return x;
}

// -infinity from its bit pattern: needs no <cmath> (NVRTC has none).
#define REFENGINE_NEG_INF __int_as_float(static_cast<int>(0xff800000u))
