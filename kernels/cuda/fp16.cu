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

// h16 = float16 bits of x; per block: partials[3b] = some |x| > 65504 or NaN, then the
// payload bytes' sum and position-weighted sum mod BASE (when want_sum).
extern "C" __global__ void mpicomp_fp16_encode(const u32* x, u16* h16, i64 n, int want_sum,
                                               u64* partials) {
    __shared__ u64 scratch[32];
    u32 top = 0;
    u64 s1 = 0, ws = 0;
    const i64 start = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    // (byte position of element i) mod BASE, advanced without a division per element.
    u64 pos = (u64)((2 * start) % MPICOMP_ADLER_BASE);
    const u64 step = (u64)((2 * stride) % MPICOMP_ADLER_BASE);
    for (i64 i = start; i < n; i += stride) {
        const u32 u = x[i];
        const u32 a = u & MPICOMP_F32_ABS;
        top = a > top ? a : top;
        const u32 h = mpicomp_fp16_to_half(u);
        h16[i] = (u16)h;
        if (want_sum) {
            const u32 lo = h & 0xFFu, hi = h >> 8;
            s1 += lo + hi;
            ws += pos * (lo + hi) + hi;  // bytes 2i and 2i+1; below 2^25 a term
            pos += step;
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

// out = float32 of h (/ scale when `divide`); flags[b] = block b met a NaN/Inf.
extern "C" __global__ void mpicomp_fp16_decode(const u16* h, u32* out, i64 n, float scale,
                                               int divide, u32* flags) {
    const u32 by = __float_as_uint(scale);
    int special = 0;
    MPICOMP_FOR(i, n) {
        const u32 v = h[i];
        special |= (v & 0x7C00u) == 0x7C00u;
        const u32 f = mpicomp_fp16_to_single(v);
        out[i] = divide ? mpicomp_fp16_div_x86(f, by) : f;
    }
    special = __syncthreads_or(special);
    if (threadIdx.x == 0) flags[blockIdx.x] = (u32)special;
}

// b = float16(float32(a) + float32(b)), elementwise: MPI's float16 sum.
extern "C" __global__ void mpicomp_fp16_add(const u16* a, u16* b, i64 n) {
    MPICOMP_FOR(i, n) {
        const u32 s = mpicomp_fp16_add_x86(mpicomp_fp16_to_single(a[i]),
                                           mpicomp_fp16_to_single(b[i]));
        b[i] = (u16)mpicomp_fp16_to_half_any(s);
    }
}

// flags[b] = block b met float16 bits with an all-ones exponent (NaN or Inf).
extern "C" __global__ void mpicomp_fp16_all_finite(const u16* h, i64 n, u32* flags) {
    int special = 0;
    MPICOMP_FOR(i, n) special |= (h[i] & 0x7C00u) == 0x7C00u;
    special = __syncthreads_or(special);
    if (threadIdx.x == 0) flags[blockIdx.x] = (u32)special;
}
