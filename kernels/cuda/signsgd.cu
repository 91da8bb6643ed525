// signSGD: sign bits, votes, sum |x| and the majority decision (twin of kernels/cpu/signsgd.py).
//
// Floats are read as bit patterns: under -ftz a denormal compares equal to 0 and converts to
// 0.0, while the numba twin sees its value. So x > 0 is "sign clear, not zero, not NaN", a
// finite x has an exponent below 0xFF, and |x| becomes a double exactly from its bits.
//
// sum |x| follows the twin's order: per CHUNK elements, four float64 lanes (element j of the
// chunk to lane j % 4, the last size % 4 elements after them to lane 0), a chunk's sum is
// (l0 + l1) + (l2 + l3), and the chunks' sums are added one by one from 0.0. A block walks one
// chunk at a time in tiles that all its threads load (common.cuh: mpicomp_lane_sums); four of
// its threads run the chunk's four chains from shared memory; a one-thread launch adds the
// chunks (a serial tail of n / CHUNK). Flags (NaN/Inf, a bad count) are OR-ed into an integer
// by each thread at most once.
#include "common.cuh"

#ifndef MPICOMP_SIGNSGD_CHUNK
#error "MPICOMP_SIGNSGD_CHUNK comes from kernels/signsgd.py (kernels/cuda/signsgd.py: DEFINES)"
#endif
#ifndef MPICOMP_SIGNSGD_LANE_THREADS
#error "MPICOMP_SIGNSGD_LANE_THREADS comes from kernels/cuda/signsgd.py (DEFINES)"
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

// Bit i of out = x[i] > 0, LSB-first (the last byte's high bits 0). A warp takes 256 elements
// at a time: lane l loads elements base + 32u + l for u < 8 (8 coalesced 128-byte loads in
// flight per warp), a ballot makes row u the 32-bit word base / 32 + u of out (bit l of it is
// element base + 32u + l: LSB-first, little-endian), and lane u stores it: one 4-byte store
// where out is 4-aligned, bytes past ceil(n / 8) never written. Reads x once, writes n / 8 bytes.
extern "C" __global__ void mpicomp_signsgd_pack(const u32* x, i64 n, u8* out, u64* flags) {
    const i64 nbytes = (n + 7) >> 3;
    const int lane = threadIdx.x & 31;
    const i64 warp = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    const i64 nwarps = ((i64)gridDim.x * blockDim.x) >> 5;
    const bool whole = mpicomp_aligned(out, 4);
    u32 bad = 0;
    for (i64 base = warp * 256; base < n; base += nwarps * 256) {  // uniform over the warp
        u32 b[8];
        for (int u = 0; u < 8; ++u) {
            const i64 i = base + 32 * u + lane;
            b[u] = i < n ? x[i] : 0u;  // +0.0 past the end: a 0 bit, finite
        }
        u32 word = 0;
        for (int u = 0; u < 8; ++u) {
            bad |= mpicomp_signsgd_nonfinite(b[u]);
            const u32 row = __ballot_sync(0xffffffffu, mpicomp_signsgd_positive(b[u]));
            word = lane == u ? row : word;
        }
        const i64 q = (base >> 3) + 4 * lane;  // the first byte of lane's word
        if (lane < 8 && q < nbytes) {
            if (whole && q + 4 <= nbytes) {
                *reinterpret_cast<u32*>(out + q) = word;
            } else {
                for (int k = 0; k < 4; ++k)
                    if (q + k < nbytes) out[q + k] = (u8)(word >> (8 * k));
            }
        }
    }
    if (bad) atomicOr(flags, 1ull);
}

// The chunks of x as mpicomp_lane_sums reads them: |x| of each element as its float64 term;
// when VOTES, out[i] = x[i] > 0 written from the loaded words (4 bytes in one store where out is
// 4-aligned); `bad` collects NaN/Inf.
template <bool VOTES> struct mpicomp_signsgd_chunks {
    const u32* x;
    i64 n;
    u8* out;
    bool vec, vec_out;  // x 16-aligned, out 4-aligned (chunk starts are multiples of 4)
    u32 bad;

    __device__ i64 lo(i64 c) const { return c * (i64)MPICOMP_SIGNSGD_CHUNK; }
    __device__ i64 hi(i64 c) const {
        const i64 e = (c + 1) * (i64)MPICOMP_SIGNSGD_CHUNK;
        return e < n ? e : n;
    }
    __device__ void fetch(i64 i, i64 end, u32 v[4]) const {
        for (int k = 0; k < 4; ++k) v[k] = 0u;
        mpicomp_load4(x, i, end, vec, v);
    }
    __device__ void use(i64 i, i64 lo, i64 end, const u32 v[4]) {  // i >= lo: chunks start at 4k
        u8 votes[4];
        for (int k = 0; k < 4; ++k) {
            bad |= i + k < end ? mpicomp_signsgd_nonfinite(v[k]) : 0u;
            votes[k] = (u8)mpicomp_signsgd_positive(v[k]);
        }
        if constexpr (VOTES) mpicomp_store4(out, i, end, vec_out, votes);
    }
    __device__ double term(u32 b) const { return mpicomp_signsgd_abs64(b); }
};

// lanes[4c + l] = lane l of chunk c (and, when VOTES, the votes of x into `out`); res[1] |= 1
// if x holds NaN/Inf. Dynamic shared memory: MPICOMP_LANE_TILE(blockDim.x) u32; one chunk per
// block at a time (group 1: a chunk's tiles feed its own four chains), so the chains of all
// chunks run at once where the blocks are resident together: blocks of at most
// MPICOMP_SIGNSGD_LANE_THREADS threads, 12 of them per SM (40 registers a thread).
template <bool VOTES>
__device__ __forceinline__ void mpicomp_signsgd_lanes(const u32* x, i64 n, u8* out,
                                                      double* lanes, u64* res) {
    extern __shared__ __align__(16) u32 mpicomp_signsgd_tile[];
    mpicomp_signsgd_chunks<VOTES> src{x, n, out, mpicomp_aligned(x, 16),
                                      VOTES && mpicomp_aligned(out, 4), 0u};
    const i64 nchunks = (n + MPICOMP_SIGNSGD_CHUNK - 1) / MPICOMP_SIGNSGD_CHUNK;
    mpicomp_lane_sums<4>(src, nchunks, 1, lanes, mpicomp_signsgd_tile);
    if (src.bad) atomicOr(res + 1, 1ull);
}

extern "C" __global__ __launch_bounds__(MPICOMP_SIGNSGD_LANE_THREADS, 12) void
mpicomp_signsgd_abs_lanes(const u32* x, i64 n, double* lanes, u64* res) {
    mpicomp_signsgd_lanes<false>(x, n, nullptr, lanes, res);
}

extern "C" __global__ __launch_bounds__(MPICOMP_SIGNSGD_LANE_THREADS, 12) void
mpicomp_signsgd_votes_lanes(const u32* x, i64 n, u8* out, double* lanes, u64* res) {
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
// bit, as the twin's negation does, denormals and NaN included). One thread per 4 elements
// (half a byte of bits): one 16-byte store where out is 16-aligned.
extern "C" __global__ void mpicomp_signsgd_expand(const u8* bits, float scale, u32* out, i64 n) {
    const u32 pos = __float_as_uint(scale), neg = pos ^ 0x80000000u;
    const bool vec = mpicomp_aligned(out, 16);
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const u32 nibble = (u32)bits[g >> 1] >> (4 * (g & 1));
        u32 v[4];
        for (int k = 0; k < 4; ++k) v[k] = (nibble >> k) & 1u ? pos : neg;
        mpicomp_store4(out, 4 * g, n, vec, v);
    }
}
