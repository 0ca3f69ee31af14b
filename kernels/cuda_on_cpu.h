// CUDA C on a CPU: just enough of CUDA's execution model to run ds4ref's kernels/*.cu with a
// C++ compiler, so that the kernels' own source is tested where no GPU is present (appendix F).
// Written for ds4ref; no code copied. Compiled as C++17 with -DDS4_CUDA_ON_CPU and -include.
//
// Every CUDA thread of a block is a fiber: a small stack of its own and a saved stack pointer.
// One OS thread runs a block's fibers in turn, each until it reaches __syncthreads(), a warp
// shuffle, or its end, where it switches back to the scheduler. When every live thread of a
// warp waits at a shuffle the scheduler releases the warp; when every thread of the block waits
// at __syncthreads() it releases the block. Blocks run one after another. Whatever a real GPU
// leaves undefined and these kernels must not rely on is an error with a message: a shuffle
// whose warp has exited lanes or lanes at another shuffle, a barrier after some threads
// returned, a launch shape CUDA would refuse.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <mutex>
#include <tuple>
#include <utility>
#include <vector>
#include <sys/mman.h>

struct dim3 { unsigned x, y, z; };

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static   // one copy, shared by the block's fibers (blocks run in turn)

namespace cuda_on_cpu {

// -- fibers: a stack each, and a switch that saves one stack pointer and loads another --------------
enum State { RUNNING, AT_WARP, AT_BLOCK, DONE, FAILED };

struct Fiber {
    void *sp = nullptr;          // saved stack pointer while switched out
    char *stack = nullptr;       // mmap'd: a guard page, then STACK bytes
    dim3 tid{0, 0, 0};
    int lane = 0, warp = 0;
    State state = DONE;
    unsigned shuffles = 0;       // how many shuffles this thread has made, and the source line
    int line = 0;                // of the one it waits at: a warp's lanes must agree on both
};

constexpr size_t STACK = 64 * 1024, GUARD = 4096;

inline dim3 block_idx{0, 0, 0}, grid_dim{1, 1, 1}, block_dim{1, 1, 1};
inline Fiber *current = nullptr;
inline void *scheduler_sp = nullptr;      // the scheduler's stack pointer while a fiber runs
inline std::function<void()> body;             // the kernel call, with its arguments bound
inline std::vector<Fiber> fibers;
inline std::vector<unsigned char> dyn_shared;  // extern __shared__ memory of this launch
inline uint64_t slots[2][32 * 32];             // shuffle values: two rounds x 32 warps x 32 lanes
inline char error[512];
inline std::mutex launching;
inline unsigned long long stats[3];            // the last launch: blocks, passes, fiber switches

}  // namespace cuda_on_cpu

#define threadIdx (cuda_on_cpu::current->tid)
#define blockIdx (cuda_on_cpu::block_idx)
#define blockDim (cuda_on_cpu::block_dim)
#define gridDim (cuda_on_cpu::grid_dim)

#if defined(__x86_64__) && !defined(DS4_CUDA_ON_CPU_UCONTEXT)
// cuda_on_cpu_switch(&save, next): push the callee-saved registers, store the stack pointer in
// save, load next, pop that stack's registers and return into it.
extern "C" void cuda_on_cpu_switch(void **save, void *next);
asm(".text\n.globl cuda_on_cpu_switch\n.hidden cuda_on_cpu_switch\n"
    ".type cuda_on_cpu_switch,@function\ncuda_on_cpu_switch:\n"
    "  pushq %rbp\n  pushq %rbx\n  pushq %r12\n  pushq %r13\n  pushq %r14\n  pushq %r15\n"
    "  movq %rsp, (%rdi)\n  movq %rsi, %rsp\n"
    "  popq %r15\n  popq %r14\n  popq %r13\n  popq %r12\n  popq %rbx\n  popq %rbp\n  ret\n"
    ".size cuda_on_cpu_switch,.-cuda_on_cpu_switch\n");
namespace cuda_on_cpu {
inline void fiber_main();
inline void to_fiber(Fiber &f) { cuda_on_cpu_switch(&scheduler_sp, f.sp); }
inline void to_scheduler() { cuda_on_cpu_switch(&current->sp, scheduler_sp); }
// A new fiber's stack: six zero registers, then fiber_main as the address `ret` jumps to
// (so that fiber_main starts with the stack aligned as after a call).
inline void start(Fiber &f) {
    // stacks start 64 bytes apart modulo 4 KiB, so that their tops do not share cache sets
    const size_t stagger = (size_t)(&f - fibers.data()) % 63 * 64;
    void **top = (void **)(f.stack + GUARD + STACK - stagger);
    *--top = nullptr;                      // fiber_main's return address: it never returns
    *--top = (void *)&fiber_main;
    for (int i = 0; i < 6; i++) *--top = nullptr;
    f.sp = top;
}
inline void grow_contexts(size_t) {}
}  // namespace cuda_on_cpu
#else
// Elsewhere (or with -DDS4_CUDA_ON_CPU_UCONTEXT): POSIX ucontext, slower (a system call per switch).
#include <ucontext.h>
namespace cuda_on_cpu {
inline void fiber_main();
inline std::vector<ucontext_t> contexts;
inline ucontext_t scheduler_ctx;
inline ucontext_t &context(Fiber &f) { return contexts[&f - fibers.data()]; }
inline void to_fiber(Fiber &f) { swapcontext(&scheduler_ctx, &context(f)); }
inline void to_scheduler() { swapcontext(&context(*current), &scheduler_ctx); }
inline void start(Fiber &f) {
    ucontext_t &c = context(f);
    getcontext(&c);
    c.uc_stack.ss_sp = f.stack + GUARD;
    c.uc_stack.ss_size = STACK;
    c.uc_link = nullptr;
    makecontext(&c, fiber_main, 0);
}
inline void grow_contexts(size_t n) { contexts.resize(n); }
}  // namespace cuda_on_cpu
#endif

namespace cuda_on_cpu {

inline void fail(const char *msg) {
    snprintf(error, sizeof error, "block (%u,%u,%u) thread (%u,%u,%u): %s", block_idx.x,
             block_idx.y, block_idx.z, current->tid.x, current->tid.y, current->tid.z, msg);
    current->state = FAILED;
    to_scheduler();                         // the scheduler never switches back
}

// A waiting thread hands the CPU back to the scheduler, which resumes it once it is released.
inline void wait(State at) {
    current->state = at;
    to_scheduler();
}

inline void fiber_main() {
    body();
    current->state = DONE;
    to_scheduler();
}

// Release the warps whose live lanes all wait at the same shuffle, else the block at a barrier.
// Returns false (with `error` set) where CUDA's behaviour would be undefined.
inline bool release(int n) {
    bool any = false;
    for (int w0 = 0; w0 < n; w0 += 32) {
        int waiting = 0, at_block = 0, done = 0, lanes = n - w0 < 32 ? n - w0 : 32;
        for (int l = 0; l < lanes; l++) {
            State s = fibers[w0 + l].state;
            waiting += s == AT_WARP, at_block += s == AT_BLOCK, done += s == DONE;
        }
        if (!waiting) continue;
        const char *why = lanes < 32 ? "the block's last warp is short (blockDim not a multiple of 32)"
                          : done ? "some of its lanes have returned"
                          : at_block ? "some of its lanes wait at __syncthreads()" : nullptr;
        if (why) {
            snprintf(error, sizeof error, "block (%u,%u,%u) warp %d: %d lanes wait at a full-warp "
                     "shuffle, but %s", block_idx.x, block_idx.y, block_idx.z, w0 / 32, waiting, why);
            return false;
        }
        for (int l = 1; l < lanes; l++) {
            const Fiber &a = fibers[w0], &b = fibers[w0 + l];
            if (a.shuffles != b.shuffles || a.line != b.line) {
                snprintf(error, sizeof error, "block (%u,%u,%u) warp %d: lane 0 waits at its "
                         "shuffle %u (line %d), lane %d at its shuffle %u (line %d)", block_idx.x,
                         block_idx.y, block_idx.z, w0 / 32, a.shuffles, a.line, l, b.shuffles, b.line);
                return false;
            }
        }
        for (int l = 0; l < lanes; l++) fibers[w0 + l].state = RUNNING;
        any = true;
    }
    if (any) return true;
    int at_block = 0, done = 0;
    for (int t = 0; t < n; t++) at_block += fibers[t].state == AT_BLOCK, done += fibers[t].state == DONE;
    if (at_block && done) {
        snprintf(error, sizeof error, "block (%u,%u,%u): __syncthreads() after %d of %d threads "
                 "returned", block_idx.x, block_idx.y, block_idx.z, done, n);
        return false;
    }
    for (int t = 0; t < n; t++)
        if (fibers[t].state == AT_BLOCK) fibers[t].state = RUNNING;
    return true;
}

// Run one block to its end: each pass resumes every running fiber until it waits or ends.
inline bool run_block(int n) {
    for (int t = 0; t < n; t++) {
        Fiber &f = fibers[t];
        f.tid = {t % block_dim.x, t / block_dim.x % block_dim.y, t / (block_dim.x * block_dim.y)};
        f.lane = t % 32, f.warp = t / 32, f.shuffles = 0, f.state = RUNNING;
        start(f);
    }
    for (;;) {
        int live = 0;
        stats[1]++;
        for (int t = 0; t < n; t++) {
            if (fibers[t].state != RUNNING) continue;
            current = &fibers[t];
            stats[2]++;
            to_fiber(fibers[t]);
            if (fibers[t].state == FAILED) return false;
        }
        for (int t = 0; t < n; t++) live += fibers[t].state != DONE;
        if (!live) return true;
        if (!release(n)) return false;
    }
}

inline bool check_launch(const unsigned *d, size_t smem) {
    const unsigned long long threads = (unsigned long long)d[3] * d[4] * d[5];
    if (!d[0] || !d[1] || !d[2] || !threads || threads > 1024 || d[5] > 64 || d[1] > 65535 ||
        d[2] > 65535) {
        snprintf(error, sizeof error, "launch grid (%u,%u,%u) block (%u,%u,%u): a shape CUDA "
                 "refuses (a zero dimension, more than 1024 threads, grid.y or .z over 65535)",
                 d[0], d[1], d[2], d[3], d[4], d[5]);
        return false;
    }
    if (smem > 227 * 1024) {
        snprintf(error, sizeof error, "launch: %zu bytes of dynamic shared memory (CUDA allows "
                 "at most 227 KiB per block)", smem);
        return false;
    }
    return true;
}

inline bool grow(size_t n) {
    while (fibers.size() < n) {
        Fiber f;
        void *p = mmap(nullptr, GUARD + STACK, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                       -1, 0);
        if (p == MAP_FAILED) return false;
        mprotect(p, GUARD, PROT_NONE);    // a stack overflow faults instead of corrupting
        f.stack = (char *)p;
        fibers.push_back(f);
    }
    grow_contexts(fibers.size());
    return true;
}

// Launch kernel over the grid: dims = {grid x, y, z, block x, y, z}; params[i] points at the
// i-th argument's value, as in cuLaunchKernel. Returns 0, or 1 with the reason in err.
template <typename... A, size_t... I>
void call(void (*kernel)(A...), void **params, std::index_sequence<I...>) {
    kernel(*(A *)params[I]...);
}

template <typename... A>
int launch(void (*kernel)(A...), const unsigned *dims, size_t smem, void **params, char *err,
           int errlen) {
    std::lock_guard<std::mutex> one_launch_at_a_time(launching);   // ctypes drops the GIL
    error[0] = 0;
    stats[0] = stats[1] = stats[2] = 0;
    const int n = (int)(dims[3] * dims[4] * dims[5]);
    bool ok = check_launch(dims, smem) && grow((size_t)n);
    if (ok) {
        grid_dim = {dims[0], dims[1], dims[2]};
        block_dim = {dims[3], dims[4], dims[5]};
        dyn_shared.assign(smem + 16, 0xff);   // unwritten shared memory reads as NaN / -1
        body = [&] { call(kernel, params, std::index_sequence_for<A...>{}); };
        for (unsigned z = 0; ok && z < dims[2]; z++)
            for (unsigned y = 0; ok && y < dims[1]; y++)
                for (unsigned x = 0; ok && x < dims[0]; x++) {
                    block_idx = {x, y, z};
                    stats[0]++;
                    ok = run_block(n);
                }
    } else if (!error[0]) {
        snprintf(error, sizeof error, "launch: no memory for %d fiber stacks", n);
    }
    snprintf(err, errlen, "%s", error);
    return ok ? 0 : 1;
}

}  // namespace cuda_on_cpu

// What the last launch of this library did: {blocks, scheduler passes, switches into fibers}.
extern "C" void cuda_on_cpu_stats(unsigned long long *out) {
    for (int i = 0; i < 3; i++) out[i] = cuda_on_cpu::stats[i];
}

// One exported launcher per kernel, named cuda_on_cpu_<kernel>.
#define CUDA_ON_CPU_EXPORT(k)                                                                 \
    extern "C" int cuda_on_cpu_##k(const unsigned *dims, size_t smem, void **params,        \
                                   char *err, int errlen) {                                  \
        return cuda_on_cpu::launch(k, dims, smem, params, err, errlen);                      \
    }

// -- the CUDA built-ins the kernels use ---------------------------------------------------------------
inline void __syncthreads() { cuda_on_cpu::wait(cuda_on_cpu::AT_BLOCK); }

// v from lane ^ offset: every lane writes its value into this round's slot, the warp meets, each
// reads its partner's slot. Two rounds of slots alternate, so a fast lane's next write never
// lands on a value that a slow lane has still to read.
// (A macro, so that the runtime knows the source line each lane waits at.)
namespace cuda_on_cpu {
template <typename T>
inline T shfl_xor(int line, unsigned mask, T v, int offset, int width = 32) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    if (mask != 0xffffffffu || width != 32 || offset < 0 || offset > 31)
        fail("__shfl_xor_sync: only a full mask, width 32 and offsets 0..31 are modelled");
    Fiber *me = current;
    uint64_t *round = slots[me->shuffles & 1] + 32 * me->warp;
    memcpy(&round[me->lane], &v, sizeof(T));
    me->line = line;
    wait(AT_WARP);
    T out;
    memcpy(&out, &round[me->lane ^ offset], sizeof(T));
    me->shuffles++;
    return out;
}
}  // namespace cuda_on_cpu
#define __shfl_xor_sync(...) cuda_on_cpu::shfl_xor(__LINE__, __VA_ARGS__)

// sum of the four signed byte products of a and b, plus c
inline int __dp4a(int a, int b, int c) {
    for (int k = 0; k < 4; k++) c += (int)(int8_t)(a >> (8 * k)) * (int)(int8_t)(b >> (8 * k));
    return c;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }

// IEEE half bits -> float (normals, subnormals, infinities, NaNs), as cvt.f32.f16 does.
inline float cuda_on_cpu_half(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        float f = (float)man * 0x1p-24f;   // subnormal (or zero): exact in float
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
