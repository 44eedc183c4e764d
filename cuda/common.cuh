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

// ---------------------------------------------------------------------------------------
// Quantized KV caches (kv_cache_dtype "int8", "fp8_e4m3", "fp8_e5m2"; refengine/core/block_manager.py).
//
// * int8 (LMDeploy's scheme): int8 values and a float32 scale per token and KV head,
//   value = q * scale[slot][kv_head]; written by reshape_and_cache_<dt>_int8.
// * fp8 (vLLM's scheme): one byte per value and one float scale per layer (k_scale,
//   v_scale), stored = fp8(x / scale), read = float(fp8) * scale.
// Both read the dequantized value in float32; the NumPy twin (refengine/attention/numpy_ref.py,
// float_to_fp8 / fp8_to_float) computes the same bits.
//
// The fp8 formats (OCP 8-bit floating point, as PyTorch's float8_e4m3fn / float8_e5m2):
// * E4M3: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN
//   (0x7F / 0xFF); largest finite 448, smallest subnormal 2^-9;
// * E5M2: sign, 5 exponent bits (bias 15), 2 mantissa bits, IEEE-like (the top byte of a
//   binary16): infinities and NaNs at exponent 31; largest finite 57344, subnormal 2^-16.
// float -> fp8 rounds to nearest even and saturates (|x| beyond the largest finite value,
// infinities included, becomes +-max; vLLM's __NV_SATFINITE conversion); NaN stays NaN
// (sign | 0x7F). Written with integer operations so the emulation and the GPU agree bit for bit.
// ---------------------------------------------------------------------------------------
enum KvQuant { kKvNone = 0, kKvInt8 = 1, kKvFp8E4m3 = 2, kKvFp8E5m2 = 3 };

__device__ __forceinline__ unsigned refengine_float_bits(float x) {
#ifdef REFENGINE_EMULATION
    return ::refengine_emu::float_bits(x);
#else
    return __float_as_uint(x);
#endif
}

__device__ __forceinline__ float refengine_bits_float(unsigned u) {
#ifdef REFENGINE_EMULATION
    return ::refengine_emu::bits_float(u);
#else
    return __uint_as_float(u);
#endif
}

// Format constants: exponent bits E, mantissa bits M, bias, largest finite value.
template <int Q> struct Fp8Format;
template <> struct Fp8Format<kKvFp8E4m3> {
    static constexpr int kMant = 3, kBias = 7;
    static constexpr float kMax = 448.0f;
    static constexpr float kSubnormalStep = 1.0f / 512.0f;  // 2^(1 - bias - M)
};
template <> struct Fp8Format<kKvFp8E5m2> {
    static constexpr int kMant = 2, kBias = 15;
    static constexpr float kMax = 57344.0f;
    static constexpr float kSubnormalStep = 1.0f / 65536.0f;
};

template <int Q>
__device__ __forceinline__ unsigned char float_to_fp8(float x) {
    using F = Fp8Format<Q>;
    const unsigned bits = refengine_float_bits(x);
    const unsigned sign = (bits >> 24) & 0x80u;
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<unsigned char>(sign | 0x7fu);  // NaN
    // Saturate first: rounding is monotonic, so clamping before it equals rounding then clamping.
    const float a = fminf(refengine_bits_float(bits & 0x7fffffffu), F::kMax);
    unsigned code;
    if (a < F::kSubnormalStep * (1 << F::kMant)) {
        // below the smallest normal: a multiple of the subnormal step (exact scaling by 2^k,
        // rintf rounds half to even); 2^M here is the smallest normal's code, as it should be
        code = static_cast<unsigned>(rintf(a * (1.0f / F::kSubnormalStep)));
    } else {
        // normal: round float32's 23-bit mantissa to M bits, half to even (a carry moves
        // into the exponent), then rebias the exponent from 127 to the format's
        constexpr int kDrop = 23 - F::kMant;
        unsigned u = refengine_float_bits(a);
        u += (1u << (kDrop - 1)) - 1u + ((u >> kDrop) & 1u);
        code = (u >> kDrop) - (static_cast<unsigned>(127 - F::kBias) << F::kMant);
    }
    return static_cast<unsigned char>(sign | code);
}

template <int Q>
__device__ __forceinline__ float fp8_to_float(unsigned char c) {
    using F = Fp8Format<Q>;
    const unsigned code = c;
    const unsigned sign = (code & 0x80u) << 24;
    const unsigned exp = (code & 0x7fu) >> F::kMant;
    const unsigned mant = code & ((1u << F::kMant) - 1u);
    unsigned bits;
    if (exp == 0) {  // zero or subnormal: mant * 2^(1 - bias - M), exact
        bits = refengine_float_bits(static_cast<float>(mant) * F::kSubnormalStep);
    } else if (Q == kKvFp8E4m3 && (code & 0x7fu) == 0x7fu) {
        bits = 0x7fc00000u;  // E4M3's only NaN
    } else if (Q == kKvFp8E5m2 && exp == 31) {
        bits = 0x7f800000u | (mant << 21);  // infinity (mant 0) or NaN
    } else {
        bits = ((exp + 127u - F::kBias) << 23) | (mant << (23 - F::kMant));
    }
    return refengine_bits_float(sign | bits);
}

// One cached element as float32 (before the scale): the storage type's own conversion for
// unquantized caches, the integer for int8, the fp8 decoding for fp8.
template <int Q, typename C>
__device__ __forceinline__ float kv_element(C x) {
    if constexpr (Q == kKvInt8) {
        return static_cast<float>(x);
    } else if constexpr (Q == kKvFp8E4m3 || Q == kKvFp8E5m2) {
        return fp8_to_float<Q>(x);
    } else {
        return load_float(x);
    }
}

// Compile-time type choice (NVRTC has no <type_traits>).
template <bool B, typename A, typename Z> struct refengine_if { using type = A; };
template <typename A, typename Z> struct refengine_if<false, A, Z> { using type = Z; };
