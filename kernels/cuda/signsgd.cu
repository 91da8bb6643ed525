// signSGD: sign bits, votes, sum |x| and the majority decision (twin of kernels/cpu/signsgd.py).
//
// Floats are read as bit patterns: under -ftz a denormal compares equal to 0 and converts to
// 0.0, while the numba twin sees its value. So x > 0 is "sign clear, not zero, not NaN", a
// finite x has an exponent below 0xFF, and |x| becomes a double exactly from its bits.
//
// sum |x| follows the twin's order: per CHUNK elements, four float64 lanes (element j of the
// chunk to lane j % 4, the last size % 4 elements after them to lane 0), a chunk's sum is
// (l0 + l1) + (l2 + l3), and the chunks' sums are added one by one from 0.0. One thread runs
// one lane of one chunk; a one-thread launch adds the chunks (a serial tail of n / CHUNK).
// Flags (NaN/Inf, a bad count) are OR-ed into an integer by each thread at most once.
#include "common.cuh"

#ifndef MPICOMP_SIGNSGD_CHUNK
#error "MPICOMP_SIGNSGD_CHUNK comes from kernels/signsgd.py (kernels/cuda/signsgd.py: DEFINES)"
#endif
#if MPICOMP_SIGNSGD_CHUNK % 8 != 0
#error "a chunk owns whole bytes of sign bits"
#endif


#define MPICOMP_SIGNSGD_ABS 0x7fffffffu
#define MPICOMP_SIGNSGD_INF 0x7f800000u

// The twin's x > 0 for the float32 of bit pattern b: +denormals, +normals and +Inf.
__device__ __forceinline__ u32 mpicomp_signsgd_positive(u32 b) {
    return (u32)(b - 1u < MPICOMP_SIGNSGD_INF);
}

__device__ __forceinline__ u32 mpicomp_signsgd_nonfinite(u32 b) {
    return (u32)((b & MPICOMP_SIGNSGD_ABS) >= MPICOMP_SIGNSGD_INF);
}

// |x| as float64, exact from the bits (a denormal is m * 2^-149; NaN/Inf as they are).
__device__ __forceinline__ double mpicomp_signsgd_abs64(u32 b) {
    const u32 a = b & MPICOMP_SIGNSGD_ABS;
    if (a < 0x00800000u) return (double)(i32)a * 0x1p-149;
    return (double)__uint_as_float(a);
}

// out[i] = x[i] > 0; flags[0] |= 1 if x holds NaN/Inf.
extern "C" __global__ void mpicomp_signsgd_votes(const u32* x, i64 n, u8* out, u64* flags) {
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const u32 b = x[i];
        bad |= mpicomp_signsgd_nonfinite(b);
        out[i] = (u8)mpicomp_signsgd_positive(b);
    }
    if (bad) atomicOr(flags, 1ull);
}

// Bit i of out = x[i] > 0, LSB-first, one thread per byte (the last byte's high bits 0).
extern "C" __global__ void mpicomp_signsgd_pack(const u32* x, i64 n, u8* out, u64* flags) {
    const i64 nbytes = (n + 7) >> 3;
    u32 bad = 0;
    MPICOMP_FOR(q, nbytes) {
        const i64 lo = q * 8;
        const int m = n - lo < 8 ? (int)(n - lo) : 8;
        u32 byte = 0;
        for (int k = 0; k < m; ++k) {
            const u32 b = x[lo + k];
            bad |= mpicomp_signsgd_nonfinite(b);
            byte |= mpicomp_signsgd_positive(b) << k;
        }
        out[q] = (u8)byte;
    }
    if (bad) atomicOr(flags, 1ull);
}

// Thread t = 4c + l sums lane l of chunk c into lanes[t] (and, when VOTES, writes the votes of
// its elements to `out`); res[1] |= 1 if x holds NaN/Inf.
template <bool VOTES>
__device__ __forceinline__ void mpicomp_signsgd_lanes(const u32* x, i64 n, u8* out,
                                                      double* lanes, u64* res) {
    const i64 nchunks = (n + MPICOMP_SIGNSGD_CHUNK - 1) / MPICOMP_SIGNSGD_CHUNK;
    u32 bad = 0;
    MPICOMP_FOR(t, 4 * nchunks) {
        const i64 lo = (t >> 2) * (i64)MPICOMP_SIGNSGD_CHUNK;
        const int lane = (int)(t & 3);
        const i64 size = n - lo < MPICOMP_SIGNSGD_CHUNK ? n - lo : MPICOMP_SIGNSGD_CHUNK;
        const i64 full = size - size % 4;
        double acc = 0.0;
        for (i64 j = lane; j < full; j += 4) {
            const u32 b = x[lo + j];
            acc += mpicomp_signsgd_abs64(b);
            bad |= mpicomp_signsgd_nonfinite(b);
            if (VOTES) out[lo + j] = (u8)mpicomp_signsgd_positive(b);
        }
        if (lane == 0) {
            for (i64 j = full; j < size; ++j) {
                const u32 b = x[lo + j];
                acc += mpicomp_signsgd_abs64(b);
                bad |= mpicomp_signsgd_nonfinite(b);
                if (VOTES) out[lo + j] = (u8)mpicomp_signsgd_positive(b);
            }
        }
        lanes[t] = acc;
    }
    if (bad) atomicOr(res + 1, 1ull);
}

extern "C" __global__ void mpicomp_signsgd_abs_lanes(const u32* x, i64 n, double* lanes,
                                                     u64* res) {
    mpicomp_signsgd_lanes<false>(x, n, nullptr, lanes, res);
}

extern "C" __global__ void mpicomp_signsgd_votes_lanes(const u32* x, i64 n, u8* out,
                                                       double* lanes, u64* res) {
    mpicomp_signsgd_lanes<true>(x, n, out, lanes, res);
}

// res[0] = the bits of sum over chunks (in order, from 0.0) of (l0 + l1) + (l2 + l3).
// One thread: the serial tail over n / CHUNK partial sums.
extern "C" __global__ void mpicomp_signsgd_total(const double* lanes, i64 nchunks, u64* res) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double total = 0.0;
    for (i64 c = 0; c < nchunks; ++c) {
        const double* l = lanes + 4 * c;
        total += (l[0] + l[1]) + (l[2] + l[3]);
    }
    res[0] = (u64)__double_as_longlong(total);
}

// Bit i of out = majority of `nranks` votes with counts[i] for +1, LSB-first, one thread per
// byte. A tie follows `tie`; TIE_RANDOM (even nranks only) draws bit 63 of the counter-based
// RNG at global index offset + i. flags[0] |= 1 if a count lies outside [0, nranks].
extern "C" __global__ void mpicomp_signsgd_majority(const void* counts, int kind, i64 n,
                                                    i64 nranks, int tie, u64 key, i64 offset,
                                                    u8* out, u64* flags) {
    const i64 nbytes = (n + 7) >> 3;
    const bool draw = tie == MPICOMP_SIGNSGD_TIE_RANDOM && nranks % 2 == 0;
    const u64 fixed = tie == MPICOMP_SIGNSGD_TIE_POSITIVE;
    u32 bad = 0;
    MPICOMP_FOR(q, nbytes) {
        const i64 lo = q * 8;
        const int m = n - lo < 8 ? (int)(n - lo) : 8;
        u32 byte = 0;
        for (int k = 0; k < m; ++k) {
            const i64 count = mpicomp_load_int(counts, kind, lo + k);
            bad |= (u32)((count < 0) | (count > nranks));
            const i64 twice = (i64)((u64)count * 2ull);  // wraps as int64 does in the twin
            const u64 pick = draw ? mpicomp_bits(key, (u64)offset + (u64)(lo + k)) >> 63 : fixed;
            byte |= (u32)((twice > nranks) | ((twice == nranks) & (pick == 1ull))) << k;
        }
        out[q] = (u8)byte;
    }
    if (bad) atomicOr(flags, 1ull);
}

// out[i] = +scale if bit i of `bits` is set, else -scale (bit patterns: -scale flips the sign
// bit, as the twin's negation does, denormals and NaN included).
extern "C" __global__ void mpicomp_signsgd_expand(const u8* bits, float scale, u32* out, i64 n) {
    const u32 pos = __float_as_uint(scale), neg = pos ^ 0x80000000u;
    MPICOMP_FOR(i, n) out[i] = (bits[i >> 3] >> (i & 7)) & 1 ? pos : neg;
}
