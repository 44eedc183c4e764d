// mma.cuh — one warp-wide tensor-core instruction, and its exact CPU emulation.
//
//   D[16x8] (float32) += A[16x16] (f16 or bf16, row-major) · B[16x8] (f16 or bf16, "col")
//
// is PTX `mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32` (sm_80+). The
// matrices live in registers spread over the 32 lanes of a warp, with a documented layout
// (PTX ISA, §9.7.14.5.8 "Matrix Fragments for mma.m16n8k16 with floating point type").
// With g = lane / 4 ("groupID") and t = lane % 4 ("threadID_in_group"):
//
//   A (4 x 32-bit regs, 2 elements each, low half first):
//     a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//     a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
//   B (2 regs; B is K x N = 16 x 8, two consecutive k of one column n per register):
//     b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
//   C/D (4 floats):
//     c[0], c[1] = D[g][2t], D[g][2t+1]          c[2], c[3] = D[g+8][2t], D[g+8][2t+1]
//
// ldmatrix (PTX ISA §9.7.14.5.15, `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`)
// loads four 8x8 matrices of 16-bit values from shared memory straight into this layout.
// Lane 8i + r gives the address of row r of matrix i (16 contiguous bytes, 16-byte
// aligned); register i of lane (g, t) then receives
//   plain:  M_i[g][2t], M_i[g][2t+1]          .trans: M_i[2t][g], M_i[2t+1][g]
// i.e. a B fragment of K (rows = keys: plain) or of V (rows = keys, but n = d: .trans)
// in one instruction instead of one load per element pair.
//
// Because this layout is *documented* (unlike wmma fragments), a kernel may do row-wise
// work on the accumulators directly in registers (FlashAttention-2's softmax), and the
// emulation below can reproduce the instruction exactly: each lane gathers its peers'
// fragments (one warp collective, so all 32 lanes must be converged, as on the GPU) and
// computes its own four outputs in float32.
#pragma once
#include "common.cuh"

// Two storage values packed into one 32-bit register, `lo` in the low 16 bits.
__device__ __forceinline__ unsigned pack_pair(float lo, float hi, __half) {
    return (unsigned)__half_as_ushort(__float2half_rn(lo)) | ((unsigned)__half_as_ushort(__float2half_rn(hi)) << 16);
}
__device__ __forceinline__ unsigned pack_pair(float lo, float hi, __nv_bfloat16) {
    return (unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(lo)) |
           ((unsigned)__bfloat16_as_ushort(__float2bfloat16_rn(hi)) << 16);
}

// The 16 bits of a storage value.
__device__ __forceinline__ unsigned short bits_of(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

#ifdef REFENGINE_EMULATION

namespace mma_emu {
inline float unpack(unsigned reg, int high, __half) { return __half2float(__ushort_as_half((unsigned short)(reg >> (16 * high)))); }
inline float unpack(unsigned reg, int high, __nv_bfloat16) {
    return __bfloat162float(__ushort_as_bfloat16((unsigned short)(reg >> (16 * high))));
}
struct Fragments {
    unsigned a[4];
    unsigned b[2];
};
}  // namespace mma_emu

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2]) {
    using namespace mma_emu;
    Fragments mine, all[32];
    for (int i = 0; i < 4; ++i) mine.a[i] = a[i];
    for (int i = 0; i < 2; ++i) mine.b[i] = b[i];
    ::refengine_emu::warp_allgather(&mine, all, sizeof(Fragments), 0xffffffffu);

    // A[row][k]: which lane and register hold it (inverse of the table above).
    auto A = [&](int row, int k) {
        const int lane = (row % 8) * 4 + (k % 8) / 2;
        const int reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        return unpack(all[lane].a[reg], k % 2, T{});
    };
    auto B = [&](int k, int n) {
        const int lane = n * 4 + (k % 8) / 2;
        const int reg = k >= 8 ? 1 : 0;
        return unpack(all[lane].b[reg], k % 2, T{});
    };
    const int lane = ::refengine_emu::lane_id();
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0);
        const int col = 2 * t + (i % 2);
        float sum = 0.0f;
        for (int k = 0; k < 16; ++k) sum += A(row, k) * B(k, col);
        d[i] += sum;
    }
}

// ldmatrix x4: `row` is this lane's row address (see the table at the top).
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4_impl(unsigned r[4], const void* row) {
    const auto* mine = static_cast<const unsigned char*>(row);
    if (mine < shared_mem || mine + 16 > shared_mem + ::refengine_emu::g_shared_bytes)
        ::refengine_emu::kernel_error("ldmatrix row address outside the launch's dynamic shared memory");
    if (reinterpret_cast<uintptr_t>(mine) % 16) ::refengine_emu::kernel_error("ldmatrix row address not 16-byte aligned");
    // Each lane publishes the 16 bytes of its row as they are when it reaches the
    // instruction (what a lane writes after it cannot leak into its peers' registers).
    struct Row {
        unsigned char bytes[16];
    } own, rows[32];
    std::memcpy(own.bytes, mine, 16);
    ::refengine_emu::warp_allgather(&own, rows, sizeof(Row), 0xffffffffu);
    const int lane = ::refengine_emu::lane_id();
    const int g = lane / 4, t = lane % 4;
    for (int i = 0; i < 4; ++i) {
        unsigned short lo, hi;
        if (TRANS) {  // column g of rows 2t, 2t + 1
            std::memcpy(&lo, rows[8 * i + 2 * t].bytes + 2 * g, 2);
            std::memcpy(&hi, rows[8 * i + 2 * t + 1].bytes + 2 * g, 2);
        } else {  // row g, columns 2t, 2t + 1
            std::memcpy(&lo, rows[8 * i + g].bytes + 4 * t, 2);
            std::memcpy(&hi, rows[8 * i + g].bytes + 4 * t + 2, 2);
        }
        r[i] = (unsigned)lo | ((unsigned)hi << 16);
    }
}

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) { ldmatrix_x4_impl<false>(r, row); }
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row) { ldmatrix_x4_impl<true>(r, row); }

#else  // the real instructions

__device__ __forceinline__ void ldmatrix_x4(unsigned r[4], const void* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(unsigned r[4], const void* row) {
    const unsigned addr = static_cast<unsigned>(__cvta_generic_to_shared(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float d[4], const unsigned a[4], const unsigned b[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<__half>(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<__nv_bfloat16>(float d[4], const unsigned a[4], const unsigned b[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

#endif
