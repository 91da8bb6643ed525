// float32 <-> float16 on bit patterns (twin of kernels/cpu/fp16.py): no cuda_fp16.h, the same
// integer rounding as the numba twin, so the bytes match NumPy's astype.
//
// NaN results follow x86 SSE's rule, written out here and in the numba twin alike: an
// operation on a NaN returns the first NaN operand, quieted; an invalid one (Inf - Inf,
// Inf / Inf) returns the "default NaN" 0xFFC00000. A GPU returns 0x7FFFFFFF for all of them,
// and a CPU compiler may swap an add's operands, so NaNs are made here explicitly.
// Reductions (range check, finiteness, the payload's Adler-32 sums) are exact integer ones:
// one partial per block, combined on the host, whatever the grid.
#include "common.cuh"


// float32 bit patterns (sign cleared).
#define MPICOMP_F16_MAX_BITS 0x477FE000u    // 65504, the largest finite float16
#define MPICOMP_F16_MIN_NORMAL 0x38800000u  // 2^-14
#define MPICOMP_F16_HALF_BITS 0x3F000000u   // 0.5: its ulp (2^-24) is the subnormal step
#define MPICOMP_F16_REBIAS 0xC8000000u      // (15 - 127) << 23, modulo 2^32
#define MPICOMP_F16_OVERFLOW 0x47800000u    // 65536: from here float16 is Inf
#define MPICOMP_F32_ABS 0x7FFFFFFFu
#define MPICOMP_F32_INF 0x7F800000u
#define MPICOMP_F32_QUIET 0x00400000u
#define MPICOMP_F32_DEFAULT_NAN 0xFFC00000u

// float16 bits of float32 bits u (|x| <= 65504), round to nearest even (the twin's _to_half).
__device__ __forceinline__ u32 mpicomp_fp16_to_half(u32 u) {
    const u32 a = u & MPICOMP_F32_ABS;
    u32 h;
    if (a < MPICOMP_F16_MIN_NORMAL) {
        // Adding 0.5 rounds |x| to a multiple of 2^-24 in hardware (a float32 denormal
        // flushed to 0 here rounds to 0 there too: it lies far below 2^-25).
        h = __float_as_uint(__uint_as_float(a) + 0.5f) - MPICOMP_F16_HALF_BITS;
    } else {
        // Rebias, round the 13 dropped bits half to even; a carry bumps the exponent.
        h = (a + MPICOMP_F16_REBIAS + 0xFFFu + ((a >> 13) & 1u)) >> 13;
    }
    return (h | ((u >> 16) & 0x8000u)) & 0xFFFFu;  // np.uint16(): keep 16 bits
}

// As above for any float32: beyond float16's range Inf, NaN a quiet NaN (_to_half_any).
__device__ __forceinline__ u32 mpicomp_fp16_to_half_any(u32 u) {
    const u32 a = u & MPICOMP_F32_ABS;
    if (a < MPICOMP_F16_OVERFLOW) return mpicomp_fp16_to_half(u);
    const u32 big = a <= MPICOMP_F32_INF ? 0x7C00u : 0x7E00u | (a >> 13);
    return (big & 0x7FFFu) | ((u >> 16) & 0x8000u);
}

// float32 bits of float16 bits h, NaN payloads kept (_to_single).
__device__ __forceinline__ u32 mpicomp_fp16_to_single(u32 h) {
    const u32 sign = (h & 0x8000u) << 16;
    const u32 e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    u32 bits;
    if (e == 0)
        bits = __float_as_uint((float)m * 5.9604645e-08f);  // m * 2^-24: exact, normal
    else if (e == 31)
        bits = MPICOMP_F32_INF | (m << 13);
    else
        bits = ((e + 112u) << 23) | (m << 13);
    return bits | sign;
}

__device__ __forceinline__ bool mpicomp_fp16_isnan(u32 f) { return (f & MPICOMP_F32_ABS) > MPICOMP_F32_INF; }

// Bits of a + b with x86's NaN rule (a first).
__device__ __forceinline__ u32 mpicomp_fp16_add_x86(u32 a, u32 b) {
    if (mpicomp_fp16_isnan(a)) return a | MPICOMP_F32_QUIET;
    if (mpicomp_fp16_isnan(b)) return b | MPICOMP_F32_QUIET;
    const u32 s = __float_as_uint(__uint_as_float(a) + __uint_as_float(b));
    return mpicomp_fp16_isnan(s) ? MPICOMP_F32_DEFAULT_NAN : s;
}

// Bits of a / b (b != 0) with x86's NaN rule and gradual underflow: where -ftz=true flushes
// the quotient, it is rounded again onto the float32 denormal grid from the double quotient
// (correctly rounded; no double-rounding error: see the launcher's docs).
__device__ __forceinline__ u32 mpicomp_fp16_div_x86(u32 a, u32 b) {
    if (mpicomp_fp16_isnan(a)) return a | MPICOMP_F32_QUIET;
    if (mpicomp_fp16_isnan(b)) return b | MPICOMP_F32_QUIET;
    const u32 q = __float_as_uint(__uint_as_float(a) / __uint_as_float(b));
    if (mpicomp_fp16_isnan(q)) return MPICOMP_F32_DEFAULT_NAN;
    const u32 aa = a & MPICOMP_F32_ABS, ba = b & MPICOMP_F32_ABS;
    if ((q & MPICOMP_F32_INF) != 0 || aa == 0 || ba == MPICOMP_F32_INF) return q;
    // |a / b| < 2^-126 and a != 0: the denormal NumPy/numba compute.
    const double d = (double)__uint_as_float(aa) / (double)__uint_as_float(ba);
    const u64 db = (u64)__double_as_longlong(d);
    const int s = 926 - (int)(db >> 52);  // d * 2^149 = mant >> s, s >= 30
    u32 m = 0;
    if (s <= 53) {
        const u64 mant = (db & 0xFFFFFFFFFFFFFull) | (1ull << 52);
        const u64 rem = mant & ((1ull << s) - 1ull), half = 1ull << (s - 1);
        m = (u32)(mant >> s);
        if (rem > half || (rem == half && (m & 1u))) ++m;  // 0x800000 is 2^-126 itself
    }
    return m | ((a ^ b) & 0x80000000u);
}

// ---- kernels ----------------------------------------------------------------------------------
//
// The element kernels are memory-bound: ideally they read their input once and write their
// output once, as a copy does. Before, each thread of a half-occupied grid made one 2- or
// 4-byte access per element (one load in flight) with 64-bit index arithmetic per element.
// Now each thread moves ROWS groups of 4 consecutive elements per round, the rows 4 * blockDim.x
// elements apart, so a warp's accesses are contiguous (512 bytes of float32, 256 of float16
// bits per access), and every row's load is issued before any row is converted (16-32 bytes a
// thread in flight). A group is one vector access: 16 bytes of float32, 8 bytes of float16 bits
// (a payload body starts 8-byte aligned: its header is 16 + 8 * ndim bytes). The vector loop
// runs when the base pointers are aligned (checked once per launch: the branch is uniform) and
// covers the groups of 4 below n; the last n % 4 elements, or every element when a pointer is
// misaligned, go one by one through the scalar loop (the kernels' old code). Both loops are
// grid-stride, so no result depends on the geometry; the launcher sizes the grid to hold every
// thread an SM can run (fp16.py: _shape). Flags and the payload's Adler-32 sums are exact integer
// reductions: any order of adding gives the same partials.

// The vector loop: i0 = the first element of this thread's row 0 in each round.
#define MPICOMP_FP16_ROUNDS(i0, rows, n)                                                       \
    for (i64 i0 = (i64)blockIdx.x * (rows) * 4 * blockDim.x + 4 * (i64)threadIdx.x; i0 < (n); \
         i0 += (i64)gridDim.x * (rows) * 4 * blockDim.x)

// The scalar loop over elements [from, n).
#define MPICOMP_FP16_EACH(i, from, n)                                                          \
    for (i64 i = (from) + (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);               \
         i += (i64)gridDim.x * blockDim.x)

__device__ __forceinline__ mpicomp_x8 mpicomp_fp16_load8(const u16* p, i64 i) {
    return *reinterpret_cast<const mpicomp_x8*>(p + i);
}

// h16 = float16 bits of x; per block: partials[3b] = some |x| > 65504 or NaN, then the
// payload bytes' sum and position-weighted sum mod BASE (when want_sum).
//
// The weighted sum: element i's bytes lie at positions 2i and 2i + 1. A group of 4 starting at
// element i adds P * S + L, where P = 2i mod BASE (stepped by a constant per round and per row:
// no division in the loop), S the sum of its 8 bytes and L = sum of j * byte j (j = 0..7):
// exact mod BASE, as P + j is the byte's position mod BASE. P < 3 * BASE and S < 2^11, so
// P * S + L < 2^30 fits 32 bits; the 64-bit sums cannot wrap.
extern "C" __global__ __launch_bounds__(MPICOMP_FP16_THREADS, MPICOMP_FP16_BLOCKS_ENCODE) void mpicomp_fp16_encode(
    const u32* __restrict__ x, u16* __restrict__ h16, i64 n, int want_sum, u64* partials) {
    constexpr int ROWS = 2;
    __shared__ u64 scratch[32];
    const bool vec = mpicomp_aligned(x, 16) && mpicomp_aligned(h16, 8);
    const i64 nvec = vec ? n & ~(i64)3 : 0, row = 4 * (i64)blockDim.x;
    const u32 row_pos = (u32)((2 * row) % MPICOMP_ADLER_BASE);
    const u32 step = (u32)((2 * ROWS * row * gridDim.x) % MPICOMP_ADLER_BASE);
    u32 pos = (u32)((2 * ((i64)blockIdx.x * ROWS * row + 4 * (i64)threadIdx.x)) %
                    MPICOMP_ADLER_BASE);
    u32 top = 0;
    u64 s1 = 0, ws = 0;
    MPICOMP_FP16_ROUNDS(i0, ROWS, nvec) {
        mpicomp_x16 v[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)  // every load first
            if (i0 + r * row < nvec) v[r] = *reinterpret_cast<const mpicomp_x16*>(x + i0 + r * row);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const i64 i = i0 + r * row;
            if (i >= nvec) break;
            mpicomp_x8 h;
            u32 sum = 0, weighted = 0;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 u = v[r].w[k], a = u & MPICOMP_F32_ABS;
                top = a > top ? a : top;
                const u32 b = mpicomp_fp16_to_half(u);
                if (k & 1)
                    h.w[k >> 1] |= b << 16;
                else
                    h.w[k >> 1] = b;
                const u32 lo = b & 0xFFu, hi = b >> 8;
                sum += lo + hi;
                weighted += 2u * k * (lo + hi) + hi;
            }
            *reinterpret_cast<mpicomp_x8*>(h16 + i) = h;
            if (want_sum) {
                s1 += sum;
                ws += (u64)((pos + (u32)r * row_pos) * sum + weighted);
            }
        }
        pos += step;
        if (pos >= MPICOMP_ADLER_BASE) pos -= MPICOMP_ADLER_BASE;
    }
    // The scalar loop: the byte position of element i mod BASE, stepped per element.
    const i64 first = nvec + (i64)blockIdx.x * blockDim.x + threadIdx.x;
    pos = (u32)((2 * first) % MPICOMP_ADLER_BASE);
    const u32 each = (u32)((2 * (i64)gridDim.x * blockDim.x) % MPICOMP_ADLER_BASE);
    MPICOMP_FP16_EACH(i, nvec, n) {
        const u32 u = x[i], a = u & MPICOMP_F32_ABS;
        top = a > top ? a : top;
        const u32 h = mpicomp_fp16_to_half(u);
        h16[i] = (u16)h;
        if (want_sum) {
            const u32 lo = h & 0xFFu, hi = h >> 8;
            s1 += lo + hi;
            ws += (u64)(pos * (lo + hi) + hi);  // bytes 2i and 2i+1; below 2^25 a term
            pos += each;
            if (pos >= MPICOMP_ADLER_BASE) pos -= MPICOMP_ADLER_BASE;
        }
    }
    const int bad = __syncthreads_or(top > MPICOMP_F16_MAX_BITS);
    s1 = mpicomp_block_sum<u64>(s1 % MPICOMP_ADLER_BASE, scratch);
    ws = mpicomp_block_sum<u64>(ws % MPICOMP_ADLER_BASE, scratch);
    if (threadIdx.x == 0) {
        partials[3 * blockIdx.x] = (u64)bad;
        partials[3 * blockIdx.x + 1] = s1 % MPICOMP_ADLER_BASE;
        partials[3 * blockIdx.x + 2] = ws % MPICOMP_ADLER_BASE;
    }
}

// float32 bits of float16 bits v (/ scale's bits `by` when DIVIDE).
template <bool DIVIDE> __device__ __forceinline__ u32 mpicomp_fp16_decode_one(u32 v, u32 by) {
    const u32 f = mpicomp_fp16_to_single(v);
    return DIVIDE ? mpicomp_fp16_div_x86(f, by) : f;
}

// out = float32 of h (/ scale when DIVIDE); flags[b] = block b met a NaN/Inf. A group: one
// 8-byte load of 4 halves, one 16-byte store of 4 floats. Two kernels: the division (a float
// division and the denormal fix-up) needs registers the plain conversion does not.
template <bool DIVIDE>
__device__ __forceinline__ void mpicomp_fp16_decode_all(const u16* __restrict__ h,
                                                        u32* __restrict__ out, i64 n, u32 by,
                                                        u32* flags) {
    constexpr int ROWS = DIVIDE ? 2 : 4;
    const bool vec = mpicomp_aligned(h, 8) && mpicomp_aligned(out, 16);
    const i64 nvec = vec ? n & ~(i64)3 : 0, row = 4 * (i64)blockDim.x;
    u32 special = 0;
    MPICOMP_FP16_ROUNDS(i0, ROWS, nvec) {
        mpicomp_x8 v[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (i0 + r * row < nvec) v[r] = mpicomp_fp16_load8(h, i0 + r * row);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const i64 i = i0 + r * row;
            if (i >= nvec) break;
            mpicomp_x16 f;
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 b = (v[r].w[k >> 1] >> (16 * (k & 1))) & 0xFFFFu;
                special |= (b & 0x7C00u) == 0x7C00u;
                f.w[k] = mpicomp_fp16_decode_one<DIVIDE>(b, by);
            }
            *reinterpret_cast<mpicomp_x16*>(out + i) = f;
        }
    }
    MPICOMP_FP16_EACH(i, nvec, n) {
        const u32 b = h[i];
        special |= (b & 0x7C00u) == 0x7C00u;
        out[i] = mpicomp_fp16_decode_one<DIVIDE>(b, by);
    }
    special = __syncthreads_or(special);
    if (threadIdx.x == 0) flags[blockIdx.x] = special;
}

extern "C" __global__ __launch_bounds__(MPICOMP_FP16_THREADS, MPICOMP_FP16_BLOCKS_DECODE) void mpicomp_fp16_decode(
    const u16* __restrict__ h, u32* __restrict__ out, i64 n, u32* flags) {
    mpicomp_fp16_decode_all<false>(h, out, n, 0u, flags);
}

extern "C" __global__ __launch_bounds__(MPICOMP_FP16_THREADS, MPICOMP_FP16_BLOCKS_DECODE_SCALED) void mpicomp_fp16_decode_scaled(
    const u16* __restrict__ h, u32* __restrict__ out, i64 n, float scale, u32* flags) {
    mpicomp_fp16_decode_all<true>(h, out, n, __float_as_uint(scale), flags);
}

// float16 bits of float16(float32(a) + float32(b)).
__device__ __forceinline__ u32 mpicomp_fp16_add_one(u32 a, u32 b) {
    return mpicomp_fp16_to_half_any(
        mpicomp_fp16_add_x86(mpicomp_fp16_to_single(a), mpicomp_fp16_to_single(b)));
}

// b = float16(float32(a) + float32(b)), elementwise: MPI's float16 sum. A group: two 8-byte
// loads, one 8-byte store.
extern "C" __global__ __launch_bounds__(MPICOMP_FP16_THREADS, MPICOMP_FP16_BLOCKS_ADD) void mpicomp_fp16_add(
    const u16* __restrict__ a, u16* __restrict__ b, i64 n) {
    constexpr int ROWS = 2;
    const bool vec = mpicomp_aligned(a, 8) && mpicomp_aligned(b, 8);
    const i64 nvec = vec ? n & ~(i64)3 : 0, row = 4 * (i64)blockDim.x;
    MPICOMP_FP16_ROUNDS(i0, ROWS, nvec) {
        mpicomp_x8 p[ROWS], q[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            if (i0 + r * row < nvec) {
                p[r] = mpicomp_fp16_load8(a, i0 + r * row);
                q[r] = mpicomp_fp16_load8(b, i0 + r * row);
            }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            const i64 i = i0 + r * row;
            if (i >= nvec) break;
            mpicomp_x8 s;
#pragma unroll
            for (int w = 0; w < 2; ++w) {
                const u32 lo = mpicomp_fp16_add_one(p[r].w[w] & 0xFFFFu, q[r].w[w] & 0xFFFFu);
                const u32 hi = mpicomp_fp16_add_one(p[r].w[w] >> 16, q[r].w[w] >> 16);
                s.w[w] = lo | hi << 16;
            }
            *reinterpret_cast<mpicomp_x8*>(b + i) = s;
        }
    }
    MPICOMP_FP16_EACH(i, nvec, n) b[i] = (u16)mpicomp_fp16_add_one(a[i], b[i]);
}

// flags[b] = block b met float16 bits with an all-ones exponent (NaN or Inf). A group: one
// 8-byte load.
extern "C" __global__ __launch_bounds__(MPICOMP_FP16_THREADS, MPICOMP_FP16_BLOCKS_ALL_FINITE) void mpicomp_fp16_all_finite(
    const u16* __restrict__ h, i64 n, u32* flags) {
    constexpr int ROWS = 4;
    const bool vec = mpicomp_aligned(h, 8);
    const i64 nvec = vec ? n & ~(i64)3 : 0, row = 4 * (i64)blockDim.x;
    u32 special = 0;
    MPICOMP_FP16_ROUNDS(i0, ROWS, nvec) {
        mpicomp_x8 v[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            v[r].w[0] = v[r].w[1] = 0;
            if (i0 + r * row < nvec) v[r] = mpicomp_fp16_load8(h, i0 + r * row);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int w = 0; w < 2; ++w)
                special |= ((v[r].w[w] & 0x7C00u) == 0x7C00u) |
                           ((v[r].w[w] & 0x7C000000u) == 0x7C000000u);
    }
    MPICOMP_FP16_EACH(i, nvec, n) special |= (h[i] & 0x7C00u) == 0x7C00u;
    special = __syncthreads_or(special);
    if (threadIdx.x == 0) flags[blockIdx.x] = special;
}
