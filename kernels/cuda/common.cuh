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

// ---- four consecutive elements in one access ---------------------------------------------------
// Elementwise kernels move 4 consecutive elements per thread: one 4-, 8- or 16-byte access
// (two of 16 for 8-byte elements) where all 4 lie below `n` and the address is aligned to the
// access, else one access per element (elements from n on untouched). Callers decide alignment
// once per launch (mpicomp_aligned of the base pointer, with i a multiple of 4), so the branch
// is uniform. CUDA's float4/uint2 are not in the emulation: these aligned structs stand in
// (nvcc turns a copy of one into one vector access).
struct __align__(16) mpicomp_x16 { u32 w[4]; };
struct __align__(8) mpicomp_x8 { u32 w[2]; };

// Whether p is aligned to `bytes` (a power of two).
__device__ __forceinline__ bool mpicomp_aligned(const void* p, unsigned bytes) {
    return ((unsigned long long)p & (bytes - 1)) == 0;
}

// The unsigned type of the same size as T (codes and floats move as their bits).
template <int S> struct mpicomp_uint_of;
template <> struct mpicomp_uint_of<1> { typedef u8 type; };
template <> struct mpicomp_uint_of<2> { typedef u16 type; };
template <> struct mpicomp_uint_of<4> { typedef u32 type; };
template <> struct mpicomp_uint_of<8> { typedef u64 type; };

// The alignment the vector path of mpicomp_load4/store4 needs for elements of `size` bytes.
__device__ __forceinline__ unsigned mpicomp_vec_align(int size) {
    return size >= 4 ? 16u : 4u * size;
}

// v[k] = p[i + k] for i + k < n; `vec`: p + i is aligned to mpicomp_vec_align(sizeof(U)).
template <class U>
__device__ __forceinline__ void mpicomp_load4(const U* p, i64 i, i64 n, bool vec, U v[4]) {
    if (vec && i + 4 <= n) {
        if constexpr (sizeof(U) == 1) {
            const u32 w = *reinterpret_cast<const u32*>(p + i);
            for (int k = 0; k < 4; ++k) v[k] = (U)(w >> (8 * k));
        } else if constexpr (sizeof(U) == 2) {
            const mpicomp_x8 w = *reinterpret_cast<const mpicomp_x8*>(p + i);
            for (int k = 0; k < 4; ++k) v[k] = (U)(w.w[k >> 1] >> (16 * (k & 1)));
        } else if constexpr (sizeof(U) == 4) {
            const mpicomp_x16 w = *reinterpret_cast<const mpicomp_x16*>(p + i);
            for (int k = 0; k < 4; ++k) v[k] = (U)w.w[k];
        } else {
            const mpicomp_x16 a = *reinterpret_cast<const mpicomp_x16*>(p + i);
            const mpicomp_x16 b = *reinterpret_cast<const mpicomp_x16*>(p + i + 2);
            v[0] = (U)a.w[0] | (U)a.w[1] << 32;
            v[1] = (U)a.w[2] | (U)a.w[3] << 32;
            v[2] = (U)b.w[0] | (U)b.w[1] << 32;
            v[3] = (U)b.w[2] | (U)b.w[3] << 32;
        }
    } else {
        for (int k = 0; k < 4; ++k)
            if (i + k < n) v[k] = p[i + k];
    }
}

// p[i + k] = v[k] for i + k < n; `vec` as for mpicomp_load4.
template <class U>
__device__ __forceinline__ void mpicomp_store4(U* p, i64 i, i64 n, bool vec, const U v[4]) {
    if (vec && i + 4 <= n) {
        if constexpr (sizeof(U) == 1) {
            *reinterpret_cast<u32*>(p + i) =
                (u32)v[0] | (u32)v[1] << 8 | (u32)v[2] << 16 | (u32)v[3] << 24;
        } else if constexpr (sizeof(U) == 2) {
            mpicomp_x8 w;
            w.w[0] = (u32)v[0] | (u32)v[1] << 16;
            w.w[1] = (u32)v[2] | (u32)v[3] << 16;
            *reinterpret_cast<mpicomp_x8*>(p + i) = w;
        } else if constexpr (sizeof(U) == 4) {
            mpicomp_x16 w;
            for (int k = 0; k < 4; ++k) w.w[k] = (u32)v[k];
            *reinterpret_cast<mpicomp_x16*>(p + i) = w;
        } else {
            mpicomp_x16 a, b;
            a.w[0] = (u32)v[0], a.w[1] = (u32)(v[0] >> 32), a.w[2] = (u32)v[1];
            a.w[3] = (u32)(v[1] >> 32);
            b.w[0] = (u32)v[2], b.w[1] = (u32)(v[2] >> 32), b.w[2] = (u32)v[3];
            b.w[3] = (u32)(v[3] >> 32);
            *reinterpret_cast<mpicomp_x16*>(p + i) = a;
            *reinterpret_cast<mpicomp_x16*>(p + i + 2) = b;
        }
    } else {
        for (int k = 0; k < 4; ++k)
            if (i + k < n) p[i + k] = v[k];
    }
}

// ---- float64 lane sums in the numba twins' order, loads coalesced -------------------------------
// The twins add float64 terms in LANES sequential chains per piece: for piece p (elements
// [lo, hi), m = hi - lo, full = m - m % LANES), lane l adds the terms of lo + l, lo + l + LANES,
// ... below lo + full, in order, and lane 0 then those of [lo + full, hi). A chain's order fixes
// the sum's bits, so one thread runs each chain; what the GPU needs besides is loads in flight,
// which one strided load per chain thread does not give.
//
// So a block takes `group` consecutive pieces (group * LANES <= blockDim.x) and walks their
// element range in tiles of MPICOMP_LANE_TILE(blockDim.x) elements (the first one starting at
// the multiple of 4 at or below the range's start). Every thread loads MPICOMP_LANE_VECS groups
// of 4 consecutive 32-bit words of the next tile into registers (one 16-byte load each where
// the source allows it; a warp's loads are contiguous) *before* the chains of the current tile
// run, so loads and chains overlap; after a barrier it stores them to the shared-memory tile
// (and the source may use them: sign votes, flags). Thread t < LANES * group then adds, from the
// tile, the terms of lane t % LANES of piece t / LANES that fall in it, main part then tail:
// tiles go in element order and a lane's tail follows its main part, so each chain adds exactly
// the twin's terms in the twin's order. Each input word is read from DRAM once.
//
// `Src` supplies: lo(p), hi(p) (piece bounds), fetch(i, end, v) (v[k] = the word of element
// i + k for i + k < end, i a multiple of 4), use(i, lo, end, v) (side effects of the elements
// lo <= i + k < end), and term(word) (the float64 term of an element). Every thread of the block
// must call; `tile` is dynamic shared memory of MPICOMP_LANE_TILE(blockDim.x) u32.
// MPICOMP_LANE_VECS comes from the DEFINES of the families that use this (their launchers size
// the shared memory from the same constant).
#ifdef MPICOMP_LANE_VECS
#define MPICOMP_LANE_TILE(threads) (4 * MPICOMP_LANE_VECS * (i64)(threads))

template <int LANES, class Src>
__device__ void mpicomp_lane_sums(Src& src, i64 npieces, i64 group, double* lanes, u32* tile) {
    const i64 span = MPICOMP_LANE_TILE(blockDim.x);
    const int t = threadIdx.x, lane = t % LANES;
    const i64 mine = t / LANES;
    for (i64 p0 = (i64)blockIdx.x * group; p0 < npieces; p0 += (i64)gridDim.x * group) {
        const i64 pend = p0 + group < npieces ? p0 + group : npieces;
        const i64 lo = src.lo(p0), hi = src.hi(pend - 1);
        const bool chain = p0 + mine < pend;
        i64 next = 0, stop = 0, end = 0;  // my next main element, its end, the piece's end
        if (chain) {
            const i64 a = src.lo(p0 + mine);
            end = src.hi(p0 + mine);
            stop = end - (end - a) % LANES;
            next = a + lane;
        }
        double acc = 0.0;
        u32 v[MPICOMP_LANE_VECS][4];
        i64 t0 = lo & ~(i64)3;
        for (int r = 0; r < MPICOMP_LANE_VECS; ++r) {
            const i64 i = t0 + 4 * ((i64)t + (i64)r * blockDim.x);
            if (i < hi) src.fetch(i, hi, v[r]);
        }
        for (; t0 < hi; t0 += span) {
            __syncthreads();  // the chains are done with the previous tile
            for (int r = 0; r < MPICOMP_LANE_VECS; ++r) {
                const i64 at = 4 * ((i64)t + (i64)r * blockDim.x), i = t0 + at;
                if (i < hi) {
                    mpicomp_x16 w;
                    for (int k = 0; k < 4; ++k) w.w[k] = v[r][k];
                    *reinterpret_cast<mpicomp_x16*>(tile + at) = w;
                    src.use(i, lo, hi, v[r]);
                }
            }
            __syncthreads();
            for (int r = 0; r < MPICOMP_LANE_VECS; ++r) {  // the next tile, while the chains run
                const i64 i = t0 + span + 4 * ((i64)t + (i64)r * blockDim.x);
                if (i < hi) src.fetch(i, hi, v[r]);
            }
            if (chain) {
                const i64 last = t0 + span < stop ? t0 + span : stop;
                for (; next < last; next += LANES) acc += src.term(tile[next - t0]);
                if (lane == 0) {
                    const i64 from = stop > t0 ? stop : t0, to = t0 + span < end ? t0 + span : end;
                    for (i64 j = from; j < to; ++j) acc += src.term(tile[j - t0]);
                }
            }
        }
        if (chain) lanes[(p0 + mine) * LANES + lane] = acc;
    }
}
#endif  // MPICOMP_LANE_VECS
