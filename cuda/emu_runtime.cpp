// emu_runtime.cpp — the block scheduler behind cuda_emu.h.
//
// A launch runs the grid's blocks one after another on the calling OS thread. Inside a
// block, each CUDA thread is a fiber: a small stack plus saved callee-saved registers,
// switched by `refengine_emu_switch` below (about 20 instructions; no syscalls, unlike
// `swapcontext`, which matters because the kernels shuffle a lot).
//
// Scheduling, one *round* at a time:
//   1. run every runnable fiber, in the chosen order, until it blocks (at a barrier or a
//      warp collective) or returns; as soon as all 32 lanes of a warp wait at the same
//      collective, release that warp and start the round over, so it runs ahead of the
//      warps that have not run yet;
//   2. once all are blocked: if every thread waits at `__syncthreads()`, release the block;
//   3. else the kernel is wrong (a barrier or collective that not every thread reaches, or
//      lanes of a warp at different collectives): fail the launch with a message.
// The order in step 1 is reverse thread order by default, so a thread that consumes data
// produced by a lower-numbered thread without a barrier in between always reads stale or
// poisoned memory.
//
// C API (ctypes): refengine_emu_launch, refengine_emu_last_error, refengine_emu_set_schedule,
// refengine_emu_list_kernels, and the conversion helpers used by the tests.
#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "cuda_emu.h"

#if !defined(__x86_64__)
#error "emu_runtime.cpp: the fiber switch is written for x86-64 (System V ABI)"
#endif

alignas(64) unsigned char shared_mem[REFENGINE_EMU_MAX_SHARED_BYTES];

namespace refengine_emu {

uint3 g_thread_idx;
uint3 g_block_idx;
dim3 g_block_dim;
dim3 g_grid_dim;
size_t g_shared_bytes = 0;

}  // namespace refengine_emu

// ---------------------------------------------------------------------------------------
// Fiber switch: save callee-saved registers + MXCSR/x87 control word on the current
// stack, store the stack pointer to *save_sp, load load_sp, restore, return into the
// other fiber. A new fiber's stack is prepared so the `ret` lands in fiber_entry, which
// calls r13(r12).
// ---------------------------------------------------------------------------------------
extern "C" void refengine_emu_switch(void** save_sp, void* load_sp);
extern "C" void refengine_emu_fiber_entry();
asm(R"(
    .text
    .globl refengine_emu_switch
    .hidden refengine_emu_switch
    .type refengine_emu_switch, @function
refengine_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size refengine_emu_switch, .-refengine_emu_switch

    .globl refengine_emu_fiber_entry
    .hidden refengine_emu_fiber_entry
    .type refengine_emu_fiber_entry, @function
refengine_emu_fiber_entry:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size refengine_emu_fiber_entry, .-refengine_emu_fiber_entry
)");

namespace refengine_emu {
namespace {

enum class State { Runnable, AtBarrier, AtWarpCollective, Done, Failed };

constexpr size_t kStackBytes = 64 * 1024;
constexpr int kWarpSize = 32;
constexpr size_t kMaxExchangeBytes = 32;

// An issued cp.async that has not landed yet (see cp_async below).
struct PendingCopy {
    unsigned char* dst;
    const unsigned char* src;
    int bytes;
    int src_bytes;
    int group;  // commit groups before it: it belongs to group number `group`
};

struct Fiber {
    void* sp = nullptr;
    State state = State::Done;
    uint3 tid{0, 0, 0};
    int linear = 0;
    unsigned collectives = 0;  // warp collectives done so far (selects the buffer half)
    unsigned collective_kind = 0;  // what it waits at: shuffle or all-gather, and the width
    int committed = 0;         // cp.async groups committed so far
    std::vector<PendingCopy> pending;
    std::vector<unsigned char> stack;
};

struct WarpBuffers {
    // Double-buffered by collective parity: a lane that finished collective k and races
    // ahead writes collective k+1's half, never the one its slower peers still read.
    unsigned char slot[2][kWarpSize][kMaxExchangeBytes];
};

struct Registry {
    std::map<std::string, std::pair<KernelThunk, int>> kernels;
};

Registry& registry() {
    static Registry r;
    return r;
}

std::vector<Fiber> g_fibers;
std::vector<WarpBuffers> g_warps;
Fiber* g_current = nullptr;
void* g_scheduler_sp = nullptr;
KernelThunk g_thunk = nullptr;
void** g_args = nullptr;
std::string g_error;
int g_schedule_mode = 0;  // 0 reverse, 1 forward, 2 shuffled
unsigned long long g_seed = 0;

void set_error(const char* fmt, ...) {
    if (!g_error.empty()) return;  // keep the first
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    g_error = buf;
}

void block_current(State s) {
    Fiber* f = g_current;
    f->state = s;
    refengine_emu_switch(&f->sp, g_scheduler_sp);
}

void fiber_main(Fiber* f) {
    g_thunk(g_args);
    f->state = State::Done;
    refengine_emu_switch(&f->sp, g_scheduler_sp);
    std::abort();  // a finished fiber is never resumed
}

void prepare_fiber(Fiber& f) {
    if (f.stack.empty()) f.stack.resize(kStackBytes);
    uintptr_t top = reinterpret_cast<uintptr_t>(f.stack.data() + f.stack.size()) & ~uintptr_t(15);
    // Frame popped by refengine_emu_switch: [mxcsr|fpucw][r15][r14][r13][r12][rbx][rbp][ret]
    uint64_t* frame = reinterpret_cast<uint64_t*>(top - 8 * 8);
    frame[0] = 0x1f80ull | (0x037full << 32);  // default MXCSR, default x87 control word
    frame[1] = 0;                                // r15
    frame[2] = 0;                                // r14
    frame[3] = reinterpret_cast<uint64_t>(&fiber_main);  // r13: function to call
    frame[4] = reinterpret_cast<uint64_t>(&f);           // r12: its argument
    frame[5] = 0;                                        // rbx
    frame[6] = 0;                                        // rbp
    frame[7] = reinterpret_cast<uint64_t>(&refengine_emu_fiber_entry);
    f.sp = frame;
    f.state = State::Runnable;
    f.collectives = 0;
    f.committed = 0;
    f.pending.clear();
}

void resume(Fiber& f) {
    g_current = &f;
    g_thread_idx = f.tid;
    refengine_emu_switch(&g_scheduler_sp, f.sp);
    g_current = nullptr;
}

const char* state_name(State s) {
    switch (s) {
        case State::Runnable: return "running";
        case State::AtBarrier: return "__syncthreads";
        case State::AtWarpCollective: return "a warp collective";
        case State::Done: return "exit";
        case State::Failed: return "error";
    }
    return "?";
}

// Run one block to completion. Returns false (with g_error set) on a violation.
bool run_block(int nthreads, std::mt19937_64& rng) {
    if (static_cast<int>(g_fibers.size()) < nthreads) g_fibers.resize(nthreads);
    const int nwarps = nthreads / kWarpSize;
    if (static_cast<int>(g_warps.size()) < nwarps) g_warps.resize(nwarps);

    for (int i = 0; i < nthreads; ++i) {
        Fiber& f = g_fibers[i];
        f.linear = i;
        f.tid.x = i % g_block_dim.x;
        f.tid.y = (i / g_block_dim.x) % g_block_dim.y;
        f.tid.z = i / (g_block_dim.x * g_block_dim.y);
        prepare_fiber(f);
    }
    // Poison: shared memory and the warp exchange buffers start as 0xFF (NaN / -1).
    std::memset(shared_mem, 0xff, sizeof(shared_mem));
    for (int w = 0; w < nwarps; ++w) std::memset(&g_warps[w], 0xff, sizeof(WarpBuffers));

    std::vector<int> order(nthreads);
    for (int i = 0; i < nthreads; ++i) order[i] = (g_schedule_mode == 1) ? i : nthreads - 1 - i;

    // A warp whose 32 lanes have all reached the same collective goes on at once, ahead of
    // the warps that have not run yet: warps are independent between barriers, and a warp
    // that runs ahead is what exposes a missing __syncthreads() (it reads tile rows the
    // other warps have not stored, or overwrites rows they still read).
    auto release_if_complete = [&](int w) {
        const unsigned count = g_fibers[w * kWarpSize].collectives;
        for (int l = 0; l < kWarpSize; ++l) {
            const Fiber& f = g_fibers[w * kWarpSize + l];
            if (f.state != State::AtWarpCollective || f.collectives != count ||
                f.collective_kind != g_fibers[w * kWarpSize].collective_kind)
                return false;
        }
        for (int l = 0; l < kWarpSize; ++l) g_fibers[w * kWarpSize + l].state = State::Runnable;
        return true;
    };

    for (;;) {
        if (g_schedule_mode == 2) std::shuffle(order.begin(), order.end(), rng);
        bool ran_ahead = false;
        for (int i : order) {
            Fiber& f = g_fibers[i];
            if (f.state != State::Runnable) continue;
            resume(f);
            if (f.state == State::Failed) return false;
            if (f.state == State::AtWarpCollective && release_if_complete(i / kWarpSize)) {
                ran_ahead = true;  // start the pass over: that warp's lanes come first again
                break;
            }
        }
        if (ran_ahead) continue;
        // Everyone is blocked or finished. A warp whose 32 lanes met at the same collective
        // was released above, so lanes still waiting at one mean a broken kernel.
        int done = 0, at_barrier = 0;
        for (int w = 0; w < nwarps; ++w) {
            int waiting = 0;
            for (int l = 0; l < kWarpSize; ++l) waiting += g_fibers[w * kWarpSize + l].state == State::AtWarpCollective;
            if (waiting == 0) continue;
            if (waiting == kWarpSize) {
                set_error("warp %d: lanes meet at different warp collectives (mismatched counts or kinds)", w);
                return false;
            }
            for (int l = 0; l < kWarpSize; ++l) {
                const Fiber& f = g_fibers[w * kWarpSize + l];
                if (f.state != State::AtWarpCollective) {
                    set_error("divergent warp collective: warp %d lane %d is at %s while %d lanes wait "
                              "at a shuffle/__syncwarp (block %u,%u,%u)",
                              w, l, state_name(f.state), waiting, g_block_idx.x, g_block_idx.y, g_block_idx.z);
                    return false;
                }
            }
        }
        for (int i = 0; i < nthreads; ++i) {
            if (g_fibers[i].state == State::Done) ++done;
            if (g_fibers[i].state == State::AtBarrier) ++at_barrier;
        }
        if (done == nthreads) return true;
        if (at_barrier == nthreads) {
            for (int i = 0; i < nthreads; ++i) g_fibers[i].state = State::Runnable;
            continue;
        }
        set_error("__syncthreads reached by %d of %d threads, %d exited (block %u,%u,%u)", at_barrier, nthreads,
                  done, g_block_idx.x, g_block_idx.y, g_block_idx.z);
        return false;
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------
// Device-side primitives (declared in cuda_emu.h)
// ---------------------------------------------------------------------------------------
void syncthreads() {
    if (g_current == nullptr) kernel_error("__syncthreads outside a kernel");
    block_current(State::AtBarrier);
}

void warp_exchange(const void* in, void* out, size_t size, int src_lane, unsigned mask) {
    if (g_current == nullptr) kernel_error("warp collective outside a kernel");
    if (mask != 0xffffffffu) kernel_error("strict emulation: warp collectives must use the full mask 0xffffffff");
    if (size > kMaxExchangeBytes) kernel_error("warp shuffle of a value wider than 32 bytes");
    if (src_lane < 0 || src_lane >= kWarpSize) kernel_error("warp shuffle source lane out of range");
    Fiber* f = g_current;
    const int warp = f->linear / kWarpSize;
    const int lane = f->linear % kWarpSize;
    const unsigned half = f->collectives & 1u;
    std::memcpy(g_warps[warp].slot[half][lane], in, size);
    f->collective_kind = 1000u + static_cast<unsigned>(size);  // a shuffle of `size` bytes
    block_current(State::AtWarpCollective);  // resumes once all 32 lanes have published
    std::memcpy(out, g_warps[warp].slot[half][src_lane], size);
    f->collectives += 1;
}

void warp_allgather(const void* in, void* out_all, size_t size, unsigned mask) {
    if (g_current == nullptr) kernel_error("warp collective outside a kernel");
    if (mask != 0xffffffffu) kernel_error("strict emulation: warp collectives must use the full mask 0xffffffff");
    if (size > kMaxExchangeBytes) kernel_error("warp all-gather of a value wider than 32 bytes");
    Fiber* f = g_current;
    const int warp = f->linear / kWarpSize;
    const int lane = f->linear % kWarpSize;
    const unsigned half = f->collectives & 1u;
    std::memcpy(g_warps[warp].slot[half][lane], in, size);
    f->collective_kind = 2000u + static_cast<unsigned>(size);  // an all-gather (mma, ldmatrix)
    block_current(State::AtWarpCollective);
    for (int l = 0; l < kWarpSize; ++l)
        std::memcpy(static_cast<unsigned char*>(out_all) + l * size, g_warps[warp].slot[half][l], size);
    f->collectives += 1;
}

// cp.async, strictly: the destination is poisoned when the copy is issued and the bytes
// land only when this thread's cp.async.wait_group retires the copy's group, the latest
// moment the PTX ISA allows. A thread that reads a tile before waiting, or reads another
// thread's part of it without a __syncthreads() after that thread's wait, or issues into a
// buffer others still read, sees NaNs or stale data.
void cp_async(void* dst, const void* src, int bytes, int src_bytes) {
    if (g_current == nullptr) kernel_error("cp.async outside a kernel");
    auto* d = static_cast<unsigned char*>(dst);
    if (d < shared_mem || d + bytes > shared_mem + g_shared_bytes)
        kernel_error("cp.async destination is outside the launch's dynamic shared memory");
    if (bytes != 4 && bytes != 8 && bytes != 16) kernel_error("cp.async copies 4, 8 or 16 bytes");
    if (reinterpret_cast<uintptr_t>(dst) % bytes || reinterpret_cast<uintptr_t>(src) % bytes)
        kernel_error("cp.async addresses must be aligned to the copy size");
    if (src_bytes < 0 || src_bytes > bytes) kernel_error("cp.async src-size out of range");
    std::memset(d, 0xff, bytes);
    g_current->pending.push_back({d, static_cast<const unsigned char*>(src), bytes, src_bytes, g_current->committed});
}

void cp_async_commit() {
    if (g_current == nullptr) kernel_error("cp.async.commit_group outside a kernel");
    g_current->committed += 1;
}

void cp_async_wait(int newest_pending) {
    if (g_current == nullptr) kernel_error("cp.async.wait_group outside a kernel");
    Fiber* f = g_current;
    const int last_done = f->committed - newest_pending;  // groups [0, last_done) complete
    std::vector<PendingCopy> still;
    for (const PendingCopy& c : f->pending) {
        if (c.group < last_done) {
            std::memcpy(c.dst, c.src, c.src_bytes);
            std::memset(c.dst + c.src_bytes, 0, c.bytes - c.src_bytes);  // zero fill past src-size
        } else {
            still.push_back(c);
        }
    }
    f->pending.swap(still);
}

void kernel_error(const char* message) {
    set_error("%s (thread %u,%u,%u of block %u,%u,%u)", message, g_thread_idx.x, g_thread_idx.y, g_thread_idx.z,
              g_block_idx.x, g_block_idx.y, g_block_idx.z);
    if (g_current == nullptr) std::abort();
    block_current(State::Failed);
    std::abort();  // never resumed
}

void register_kernel(const char* name, KernelThunk thunk, int num_args) {
    registry().kernels[name] = {thunk, num_args};
}

}  // namespace refengine_emu

// ---------------------------------------------------------------------------------------
// C API for ctypes
// ---------------------------------------------------------------------------------------
using namespace refengine_emu;

extern "C" {

// Launch kernel `name` over grid (gx, gy, gz) x block (bx, by, bz) with `shared_bytes` of
// dynamic shared memory. `args[i]` points at the i-th kernel argument, as in cuLaunchKernel.
// Returns 0 on success, -1 on a failure whose message refengine_emu_last_error() gives.
int refengine_emu_launch(const char* name, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                         unsigned bz, size_t shared_bytes, void** args, int num_args) {
    g_error.clear();
    auto it = registry().kernels.find(name);
    if (it == registry().kernels.end()) {
        set_error("no kernel named %s in this library", name);
        return -1;
    }
    if (it->second.second != num_args) {
        set_error("kernel %s takes %d arguments, launch passed %d", name, it->second.second, num_args);
        return -1;
    }
    const unsigned nthreads = bx * by * bz;
    if (nthreads == 0 || nthreads > 1024 || nthreads % 32 != 0) {
        set_error("block of %u threads: must be a multiple of 32 and at most 1024", nthreads);
        return -1;
    }
    if (shared_bytes > REFENGINE_EMU_MAX_SHARED_BYTES) {
        set_error("%zu bytes of shared memory requested; an H200 block has at most %d", shared_bytes,
                  REFENGINE_EMU_MAX_SHARED_BYTES);
        return -1;
    }
    g_thunk = it->second.first;
    g_args = args;
    g_grid_dim = dim3(gx, gy, gz);
    g_block_dim = dim3(bx, by, bz);
    g_shared_bytes = shared_bytes;
    std::mt19937_64 rng(g_seed);
    for (unsigned z = 0; z < gz; ++z)
        for (unsigned y = 0; y < gy; ++y)
            for (unsigned x = 0; x < gx; ++x) {
                g_block_idx = uint3{x, y, z};
                if (!run_block(static_cast<int>(nthreads), rng)) return -1;
            }
    return 0;
}

const char* refengine_emu_last_error() { return g_error.c_str(); }

// mode 0: reverse thread order (default), 1: forward, 2: shuffled every round with `seed`.
void refengine_emu_set_schedule(int mode, unsigned long long seed) {
    g_schedule_mode = mode;
    g_seed = seed;
}

// Newline-separated names of the registered kernels (pointer valid until the next call).
const char* refengine_emu_list_kernels() {
    static std::string names;
    names.clear();
    for (const auto& kv : registry().kernels) names += kv.first + "\n";
    return names.c_str();
}

// Conversions exposed so the tests can compare the emulated rounding with NumPy/ml_dtypes.
void refengine_emu_f32_to_f16(const float* in, uint16_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = __float2half_rn(in[i]).__x;
}
void refengine_emu_f16_to_f32(const uint16_t* in, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = __half2float(__half{in[i]});
}
void refengine_emu_f32_to_bf16(const float* in, uint16_t* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = __float2bfloat16_rn(in[i]).__x;
}
void refengine_emu_bf16_to_f32(const uint16_t* in, float* out, size_t n) {
    for (size_t i = 0; i < n; ++i) out[i] = __bfloat162float(__nv_bfloat16{in[i]});
}

}  // extern "C"
