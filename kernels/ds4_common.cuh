// Shared helpers of ds4ref's CUDA kernels (CuPy RawModule, NVRTC or nvcc).
// Written for ds4ref from the formulas in ds4.c (antirez/ds4 @ 8d57664); no code copied.
#pragma once

typedef unsigned char  u8;
typedef signed char    i8;
typedef unsigned short u16;
typedef unsigned int   u32;

#ifdef DS4_CUDA_ON_CPU
// Compiled for a CPU (kernels/cuda_on_cpu.h, appendix F): the same conversion in C.
__device__ __forceinline__ float f16_to_f32(u16 h) { return cuda_on_cpu_half(h); }
#define DYNAMIC_SHARED(type, name) type *name = (type *)cuda_on_cpu::dyn_shared.data()
#else
// IEEE half -> float with one PTX instruction, so no cuda_fp16.h include is needed under NVRTC.
__device__ __forceinline__ float f16_to_f32(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
// The block's dynamic shared memory (the launch's shared_mem bytes), as an array of type.
#define DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// GGUF blocks have odd sizes (34, 66, 84 bytes), so fields are only 2-byte aligned.
__device__ __forceinline__ u16 load_u16(const u8 *p) { return *(const u16 *)p; }
__device__ __forceinline__ u32 load_u32_a2(const u8 *p) {
    return (u32)load_u16(p) | ((u32)load_u16(p + 2) << 16);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions over blockDim.x <= 1024 threads (a multiple of 32), through 32 shared slots.
__device__ float block_sum(float v, float *shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warp = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < n_warp ? shared32[lane] : 0.0f;
    return warp_sum(v);
}

__device__ double block_sum_d(double v, double *shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warp = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < n_warp ? shared32[lane] : 0.0;
    return warp_sum_d(v);
}

__device__ float block_max(float v, float *shared32) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, n_warp = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared32[warp] = v;
    __syncthreads();
    v = lane < n_warp ? shared32[lane] : -3.0e38f;
    return warp_max(v);
}
