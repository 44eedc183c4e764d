// cuda_emu.h — run refengine's CUDA kernels on the CPU, strictly.
//
// The same `.cu` files that nvcc compiles for the GPU are compiled by g++ with this
// header force-included (`g++ -x c++ -include cuda/cuda_emu.h -DREFENGINE_EMULATION`).
// Together with `emu_runtime.cpp` (the scheduler) the result is a shared library that
// runs every block of a grid on the CPU, so kernels are tested on machines without a GPU.
//
// The emulation is meant to *fail* on the bugs that a GPU only shows sometimes:
//
// * Every CUDA thread of a block is a cooperative fiber with its own stack. Between two
//   `__syncthreads()` the fibers run one after another, by default in *reverse* thread
//   order (the last thread first), or shuffled with a seed. A thread that reads shared
//   memory another thread has not yet written (a missing barrier) sees the wrong data.
// * Shared memory is poisoned with 0xFF bytes at the start of every block (NaN for
//   float/half/bfloat16, -1 for integers), so a read before the write is a NaN.
// * A warp collective (`__shfl_*_sync`, `__syncwarp`) exchanges values only when all 32
//   lanes of the warp have reached it; a lane that exited or waits at `__syncthreads()`
//   instead is an error ("divergent warp collective"). Only the full mask is allowed.
// * `__syncthreads()` must be reached by every thread of the block; threads that exit
//   while others wait at the barrier are an error (undefined behaviour in CUDA).
// * `__half` / `__nv_bfloat16` are 16-bit storage types with conversions that round to
//   nearest even, like `__float2half_rn` / `__float2bfloat16_rn`; there is no implicit
//   arithmetic on them, so kernels must convert explicitly (as ours do).
//
// Dynamic shared memory only: kernels declare `extern __shared__ unsigned char shared_mem[]`
// and carve their tiles out of it; the launcher passes the byte count, like
// `cuLaunchKernel`'s `sharedMemBytes`. (GCC places function-local statics of templates
// in COMDAT sections, so static `__shared__` arrays could not be found and poisoned.)
//
// Tensor cores: the instructions the kernels use, mma.sync.m16n8k16 and ldmatrix, are
// emulated in mma.cuh from their documented register layouts (warp collectives, see
// warp_allgather). cp.async is emulated in emu_runtime.cpp with the latest landing the PTX
// ISA allows (at the wait), its destination poisoned from the issue on.
// Not emulated: atomics, wmma fragments, texture memory, streams. Kernels that use them
// do not compile here, which is the intended signal.
#pragma once

#ifndef REFENGINE_EMULATION
#define REFENGINE_EMULATION 1
#endif

#include <cmath>
#include <math.h>  // expf, fmaxf, ... in the global namespace, as in CUDA
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

// ---------------------------------------------------------------------------------------
// Qualifiers and built-in vector types
// ---------------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ /* dynamic shared memory: see shared_mem in emu_runtime.cpp */
#define __restrict__ __restrict

struct uint3 {
    unsigned int x, y, z;
};
struct uint2 {
    unsigned int x, y;
};
struct __align__(16) uint4 {
    unsigned int x, y, z, w;
};
struct dim3 {
    unsigned int x, y, z;
    constexpr dim3(unsigned int x_ = 1, unsigned int y_ = 1, unsigned int z_ = 1) : x(x_), y(y_), z(z_) {}
};

// The one dynamic shared-memory buffer (defined in emu_runtime.cpp). Every kernel's
// `extern __shared__ unsigned char shared_mem[];` refers to it, as on the GPU.
#define REFENGINE_EMU_MAX_SHARED_BYTES (228 * 1024)
extern unsigned char shared_mem[REFENGINE_EMU_MAX_SHARED_BYTES];

namespace refengine_emu {

// Set by the scheduler each time it switches to a fiber (emu_runtime.cpp).
extern uint3 g_thread_idx;
extern uint3 g_block_idx;
extern dim3 g_block_dim;
extern dim3 g_grid_dim;
extern size_t g_shared_bytes;

inline const uint3& thread_idx() { return g_thread_idx; }
inline const uint3& block_idx() { return g_block_idx; }
inline const dim3& block_dim() { return g_block_dim; }
inline const dim3& grid_dim() { return g_grid_dim; }

// Block-wide barrier: the calling fiber waits until every thread of the block arrives.
void syncthreads();
// Warp collective: every lane publishes `size` bytes from `in`; once all 32 lanes have
// arrived, each lane copies the bytes published by lane `src_lane` into `out`.
void warp_exchange(const void* in, void* out, size_t size, int src_lane, unsigned mask);
// Warp collective: every lane publishes `size` bytes; once all 32 have arrived, each lane
// copies all 32 contributions into `out_all` (lane i's at out_all + i * size). Used by the
// emulated tensor-core MMA (mma.cuh), where each lane needs its peers' fragments.
void warp_allgather(const void* in, void* out_all, size_t size, unsigned mask);
// cp.async (cp_async.cuh): issue a copy of `bytes` into shared memory, of which the first
// `src_bytes` come from `src` and the rest are zeros; close a group; wait until at most
// `newest_pending` groups are still in flight.
void cp_async(void* dst, const void* src, int bytes, int src_bytes);
void cp_async_commit();
void cp_async_wait(int newest_pending);
// Report a strictness violation from inside a kernel (the launch fails with `message`).
[[noreturn]] void kernel_error(const char* message);
// Kernels that carve dynamic shared memory call this (via REFENGINE_CHECK_SHARED_BYTES).
inline void check_shared_bytes(size_t needed) {
    if (needed > g_shared_bytes) kernel_error("kernel needs more dynamic shared memory than the launch gave");
}

inline int lane_id() {
    const unsigned linear = g_thread_idx.x + g_block_dim.x * (g_thread_idx.y + g_block_dim.y * g_thread_idx.z);
    return static_cast<int>(linear % 32u);
}

}  // namespace refengine_emu

#define threadIdx (::refengine_emu::thread_idx())
#define blockIdx (::refengine_emu::block_idx())
#define blockDim (::refengine_emu::block_dim())
#define gridDim (::refengine_emu::grid_dim())
#define warpSize 32

inline void __syncthreads() { ::refengine_emu::syncthreads(); }

inline void __syncwarp(unsigned mask = 0xffffffffu) {
    int dummy = 0, out = 0;
    ::refengine_emu::warp_exchange(&dummy, &out, sizeof(int), ::refengine_emu::lane_id(), mask);
}

// ---------------------------------------------------------------------------------------
// Warp shuffles (CUDA Programming Guide, "Warp Shuffle Functions"): source-lane rules
// including the `width` sub-segments are reproduced exactly.
// ---------------------------------------------------------------------------------------
template <class T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    const int lane = ::refengine_emu::lane_id();
    const int src = (lane & ~(width - 1)) + (src_lane & (width - 1));
    T out;
    ::refengine_emu::warp_exchange(&var, &out, sizeof(T), src, mask);
    return out;
}

template <class T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    const int lane = ::refengine_emu::lane_id();
    int src = lane ^ lane_mask;
    // A lane may read from an earlier segment of `width` lanes, never a later one.
    if (src >= ((lane / width) + 1) * width) src = lane;
    T out;
    ::refengine_emu::warp_exchange(&var, &out, sizeof(T), src, mask);
    return out;
}

template <class T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    const int lane = ::refengine_emu::lane_id();
    int src = lane + static_cast<int>(delta);
    if (src / width != lane / width) src = lane;  // past the end of the segment: own value
    T out;
    ::refengine_emu::warp_exchange(&var, &out, sizeof(T), src, mask);
    return out;
}

template <class T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    const int lane = ::refengine_emu::lane_id();
    int src = lane - static_cast<int>(delta);
    if (src < 0 || src / width != lane / width) src = lane;
    T out;
    ::refengine_emu::warp_exchange(&var, &out, sizeof(T), src, mask);
    return out;
}

// ---------------------------------------------------------------------------------------
// Memory helpers and math intrinsics. The fast-math intrinsics (`__expf`, `__fdividef`)
// are computed exactly here; on the GPU they have a few ulp of error, which the tests'
// float32 tolerances allow for.
// ---------------------------------------------------------------------------------------
template <class T>
inline T __ldg(const T* p) { return *p; }

inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// CUDA's global min/max overloads.
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }

// ---------------------------------------------------------------------------------------
// 16-bit floating-point storage types (IEEE binary16 and bfloat16)
// ---------------------------------------------------------------------------------------
struct __half {
    uint16_t __x;
};
struct __nv_bfloat16 {
    uint16_t __x;
};

namespace refengine_emu {
inline uint32_t float_bits(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float bits_float(uint32_t u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
}  // namespace refengine_emu

// float -> binary16, round to nearest even (including subnormals; overflow -> inf).
inline __half __float2half_rn(float f) {
    const uint32_t x = ::refengine_emu::float_bits(f);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t ax = x & 0x7fffffffu;
    __half h;
    if (ax >= 0x7f800000u) {  // inf or NaN (NaN stays a quiet NaN)
        h.__x = static_cast<uint16_t>(sign | (ax > 0x7f800000u ? 0x7e00u : 0x7c00u));
        return h;
    }
    if (ax >= 0x477ff000u) {  // >= 65520 rounds to inf
        h.__x = static_cast<uint16_t>(sign | 0x7c00u);
        return h;
    }
    if (ax < 0x38800000u) {  // below 2^-14: a half subnormal, m * 2^-24
        const uint32_t e = ax >> 23;
        if (e < 100) {  // < 2^-27: rounds to zero
            h.__x = static_cast<uint16_t>(sign);
            return h;
        }
        const uint32_t mant = (ax & 0x7fffffu) | 0x800000u;
        const uint32_t shift = 126u - e;  // value = mant * 2^(e-150); want units of 2^-24
        uint32_t m = mant >> shift;
        const uint32_t rem = mant & ((1u << shift) - 1u);
        const uint32_t halfway = 1u << (shift - 1u);
        if (rem > halfway || (rem == halfway && (m & 1u))) ++m;
        h.__x = static_cast<uint16_t>(sign | m);
        return h;
    }
    uint32_t out = ((((ax >> 23) - 127u + 15u)) << 10) | ((ax & 0x7fffffu) >> 13);
    const uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (out & 1u))) ++out;  // a carry bumps the exponent
    h.__x = static_cast<uint16_t>(sign | out);
    return h;
}
inline __half __float2half(float f) { return __float2half_rn(f); }

inline float __half2float(__half h) {
    const uint32_t sign = static_cast<uint32_t>(h.__x & 0x8000u) << 16;
    const uint32_t e = (h.__x >> 10) & 0x1fu;
    const uint32_t m = h.__x & 0x3ffu;
    if (e == 0) {
        const float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
        return sign ? -v : v;
    }
    if (e == 31) return ::refengine_emu::bits_float(sign | 0x7f800000u | (m << 13));
    return ::refengine_emu::bits_float(sign | ((e - 15u + 127u) << 23) | (m << 13));
}

// float -> bfloat16, round to nearest even; NaN stays NaN.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
    const uint32_t x = ::refengine_emu::float_bits(f);
    __nv_bfloat16 b;
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        b.__x = static_cast<uint16_t>((x >> 16) | 0x40u);
        return b;
    }
    b.__x = static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
    return b;
}
inline __nv_bfloat16 __float2bfloat16(float f) { return __float2bfloat16_rn(f); }
inline float __bfloat162float(__nv_bfloat16 b) {
    return ::refengine_emu::bits_float(static_cast<uint32_t>(b.__x) << 16);
}

// Bit casts (CUDA Math API names).
inline unsigned short __half_as_ushort(__half h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline float __int_as_float(int i) { return ::refengine_emu::bits_float(static_cast<uint32_t>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(::refengine_emu::float_bits(f)); }

// ---------------------------------------------------------------------------------------
// Kernel registry: `REFENGINE_EXPORT_KERNEL(name)` (common.cuh) registers an
// `extern "C" __global__` function so the runtime can launch it by name with a
// `void** args` array, exactly like `cuLaunchKernel` / `cupy.RawKernel`.
// ---------------------------------------------------------------------------------------
#include <utility>

namespace refengine_emu {

using KernelThunk = void (*)(void** args);
void register_kernel(const char* name, KernelThunk thunk, int num_args);

template <class... Args, size_t... I>
inline void call_with_args(void (*kernel)(Args...), void** args, std::index_sequence<I...>) {
    kernel(*static_cast<std::remove_cv_t<std::remove_reference_t<Args>>*>(args[I])...);
}

template <auto Kernel>
struct KernelRegistrar;

template <class... Args, void (*Kernel)(Args...)>
struct KernelRegistrar<Kernel> {
    static void thunk(void** args) { call_with_args(Kernel, args, std::index_sequence_for<Args...>{}); }
    explicit KernelRegistrar(const char* name) { register_kernel(name, &thunk, static_cast<int>(sizeof...(Args))); }
};

}  // namespace refengine_emu
