// Device helpers every family shares. Constants come from Python as -D macros
// (kernels/cuda/device.py: defines()), so each lives once, in kernels/<family>.py.
#pragma once

typedef signed char i8;
typedef short i16;
typedef int i32;
typedef long long i64;
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// ---- integer arrays of any dtype -------------------------------------------------------------
// `kind` is log2(itemsize) | 4 if unsigned (kernels/cuda/device.py: int_kind).

// Element i as int64 (uint64 wraps, as np.int64() does).
__device__ __forceinline__ i64 mpicomp_load_int(const void* p, int kind, i64 i) {
    switch (kind) {
    case 0: return ((const i8*)p)[i];
    case 1: return ((const i16*)p)[i];
    case 2: return ((const i32*)p)[i];
    case 3: return ((const i64*)p)[i];
    case 4: return ((const u8*)p)[i];
    case 5: return ((const u16*)p)[i];
    case 6: return ((const u32*)p)[i];
    default: return (i64)((const u64*)p)[i];
    }
}

// Store the low bits of v into element i (NumPy's wrap on a store).
__device__ __forceinline__ void mpicomp_store_int(void* p, int kind, i64 i, u64 v) {
    switch (kind & 3) {
    case 0: ((u8*)p)[i] = (u8)v; break;
    case 1: ((u16*)p)[i] = (u16)v; break;
    case 2: ((u32*)p)[i] = (u32)v; break;
    default: ((u64*)p)[i] = v; break;
    }
}

// ---- counter-based random numbers (kernels/rng.py, kernels/cpu/rng.py) ----------------------
__device__ __forceinline__ u64 mpicomp_mix64(u64 z) {
    z = (z ^ (z >> 30)) * MPICOMP_RNG_M1;
    z = (z ^ (z >> 27)) * MPICOMP_RNG_M2;
    return z ^ (z >> 31);
}

// 64 random bits of element `index` under `key` (rng.key(seed, step, stream) on the host).
__device__ __forceinline__ u64 mpicomp_bits(u64 key, u64 index) {
    return mpicomp_mix64(key + (index + 1ull) * MPICOMP_RNG_GOLDEN);
}

// A float32 uniform in [0, 1) from 24 random bits: exact, so every backend agrees.
__device__ __forceinline__ float mpicomp_uniform(u64 key, u64 index) {
    return (float)(unsigned)(mpicomp_bits(key, index) >> 40) * 5.9604645e-08f;
}

// ---- grid-stride loops ------------------------------------------------------------------------
// Kernels walk their elements with a grid-stride loop, so any grid computes the same result.
#define MPICOMP_FOR(i, n)                                                                  \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n);                 \
         i += (i64)gridDim.x * blockDim.x)

// ---- block-wide scans and reductions (blockDim.x a multiple of 32, at most 1024) ---------------
// `scratch` holds 32 values of T in shared memory; every thread of the block must call. For
// integers only: a float sum would depend on the block size (results must not).

template <class T> __device__ __forceinline__ T mpicomp_warp_sum(T v) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
    return v;
}

// Sum over the block; the result is returned to every thread.
template <class T> __device__ T mpicomp_block_sum(T v, T* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = mpicomp_warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < warps; ++w) total += scratch[w];  // in warp order: deterministic
    __syncthreads();
    return total;
}

// Exclusive prefix sum over the block in thread order; *total gets the block's sum.
template <class T> __device__ T mpicomp_block_exclusive_scan(T v, T* scratch, T* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    T inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc += y;
    }
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    T before = 0, sum = 0;
    for (int w = 0; w < warps; ++w) {
        if (w < warp) before += scratch[w];
        sum += scratch[w];
    }
    __syncthreads();
    *total = sum;
    return before + inc - v;
}

// Exclusive max-scan over the block in thread order (`none` for thread 0); *total gets the
// block's max. Exact in any order, so geometry-free for floats' bit patterns and integers.
__device__ i64 mpicomp_block_exclusive_max(i64 v, i64 none, i64* scratch, i64* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    i64 inc = v;
    for (int off = 1; off < 32; off <<= 1) {
        const i64 y = __shfl_up_sync(0xffffffffu, inc, off);
        if (lane >= off) inc = inc < y ? y : inc;
    }
    i64 exc = __shfl_up_sync(0xffffffffu, inc, 1);
    if (lane == 0) exc = none;
    if (lane == 31) scratch[warp] = inc;
    __syncthreads();
    i64 before = none, all = none;
    for (int w = 0; w < warps; ++w) {
        if (w < warp) before = before < scratch[w] ? scratch[w] : before;
        all = all < scratch[w] ? scratch[w] : all;
    }
    __syncthreads();
    *total = all;
    return before < exc ? exc : before;
}
