#include "common.cuh"
extern "C" __global__ void mpicomp_smoke_uniform(u64 key, float* out, i64 n) {
    MPICOMP_FOR(i, n) out[i] = mpicomp_uniform(key, (u64)i);
}
extern "C" __global__ void mpicomp_smoke_scan(const u32* in, u32* out, u32* totals, i64 n) {
    __shared__ u32 scratch[32];
    i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    u32 total;
    u32 v = mpicomp_block_exclusive_scan<u32>(i < n ? in[i] : 0u, scratch, &total);
    if (i < n) out[i] = v;
    if (threadIdx.x == 0) totals[blockIdx.x] = total;
}

// ---- kernels with the bugs the emulation must report ------------------------------------------
extern "C" __global__ void divergent_barrier(float* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void two_barriers(float* out) {
    if (threadIdx.x & 1) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.f;
}

extern "C" __global__ void partial_shuffle(u32* out) {
    u32 v = threadIdx.x;
    if (threadIdx.x < 16) v = __shfl_down_sync(0xffffffffu, v, 1);
    out[threadIdx.x] = v;
}

// Warp votes and a shuffle by index: the lanes' values must travel as on a GPU.
extern "C" __global__ void warp_ops(const u32* in, u32* ballots, u32* firsts, int* counts) {
    const u32 v = in[blockIdx.x * blockDim.x + threadIdx.x];
    const u32 b = __ballot_sync(0xffffffffu, v & 1u);
    const u32 first = __shfl_sync(0xffffffffu, v, 0);
    const int count = __syncthreads_count(v & 1u);
    if ((threadIdx.x & 31) == 0) ballots[(blockIdx.x * blockDim.x + threadIdx.x) >> 5] = b;
    firsts[blockIdx.x * blockDim.x + threadIdx.x] = first;
    if (threadIdx.x == 0) counts[blockIdx.x] = count;
}

// Dynamic shared memory: reverse each block's slice through it.
extern "C" __global__ void reverse_block(const float* in, float* out) {
    extern __shared__ float tile[];
    const unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = in[i];
    __syncthreads();
    out[i] = tile[blockDim.x - 1 - threadIdx.x];
}

// Denormals flush to zero as under CuPy's -ftz=true.
extern "C" __global__ void halve(const float* x, float* y) { y[threadIdx.x] = x[threadIdx.x] * 0.5f; }

// ---- bugs only a sanitizer sees (make test-sanitize) -------------------------------------------
extern "C" __global__ void racy_shift(const float* in, float* out, int n) {
    __shared__ float tile[1024];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    tile[threadIdx.x] = i < n ? in[i] : 0.f;
    // missing __syncthreads(): a neighbour's slot may not be written yet
    if (i < n) out[i] = tile[(threadIdx.x + 1) % blockDim.x];
}

extern "C" __global__ void read_past_end(const float* in, float* out, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = in[i] * 2.f;  // no i < n guard
}

extern "C" __global__ void shift_by_width(const u32* in, u32* out, int bits) {
    out[threadIdx.x] = in[threadIdx.x] & ((1u << bits) - 1u);  // bits == 32 is undefined
}
