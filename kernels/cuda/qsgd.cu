// QSGD-MaxNorm kernels (the unbiased quantizers paper §3.1-3.4), CUDA twins of
// kernels/cpu/qsgd.py: norms, stochastic codes, scale indices, reconstruction, GlobalRandK coordinates.
//
// Float arithmetic is the numba twin's, operation for operation (built with --fmad=false):
// a = |v| / norm, y = a * s, l = floor(y), code l + 1 iff u < y - l, norm the element's
// block's (kernels/qsgd.py). The squared norm adds in its fixed order: 8 lanes per piece (CHUNK
// elements, or a block's cut), lanes ((0+1)+(2+3))+((4+5)+(6+7)), pieces in order.
// Error results are bit masks OR-ed into one u32 (integer atomics: order-free).
// Constants come from kernels/qsgd.py as -D macros (kernels/cuda/qsgd.py: DEFINES).
//
// Memory access (docs/kernels.md, "Memory-bound kernels"): the sum of squares loads its pieces
// through shared-memory tiles (common.cuh: mpicomp_lane_sums), so its 8 chains per piece run the
// twin's order while the loads stay coalesced; the element kernels give a thread 4 consecutive
// elements (vector loads and stores, the block of an element found once per group), and the
// packed decode reads the stream as aligned 32-bit words. Only access patterns differ from the
// twin: every element's arithmetic is its own.
#include "common.cuh"

#ifndef MPICOMP_QSGD_LANE_THREADS
#error "MPICOMP_QSGD_LANE_THREADS comes from kernels/cuda/qsgd.py (DEFINES)"
#endif

#define QSGD_CHUNK ((i64)MPICOMP_QSGD_CHUNK)
#define QSGD_TILE ((i64)MPICOMP_QSGD_TILE)
#define QSGD_EMPTY (~0ull)

__device__ __forceinline__ i64 qsgd_min64(i64 a, i64 b) { return a < b ? a : b; }

// ---- element arithmetic (mpicomp_qsgd_unit, _round, _value of the numba twin) ------------------

// a = |v| / norm clamped to [0, 1]; *ok false for NaN/Inf or a above the norm bound (a is 0 then).
__device__ __forceinline__ float qsgd_unit(float v, float norm, bool* ok) {
    float a;
    if (norm > 0.0f)
        a = fabsf(v) / norm;
    else if (v == 0.0f)
        a = 0.0f;
    else
        a = __int_as_float(0x7f800000);  // +inf
    *ok = a <= MPICOMP_QSGD_LIMIT;
    return *ok ? (a < 1.0f ? a : 1.0f) : 0.0f;
}

// The signed code of v: l = floor(a * s), plus 1 iff u < a * s - l.
__device__ __forceinline__ int qsgd_round(float v, float a, float s, float u) {
    const float y = a * s;
    float lo = floorf(y);
    if (u < y - lo) lo = lo + 1.0f;
    const int c = (int)lo;
    return v < 0.0f ? -c : c;
}

// ((c * norm) / s) / nr in float32.
__device__ __forceinline__ float qsgd_value(i64 c, float norm, float s, float nr) {
    return (((float)c * norm) / s) / nr;
}

__device__ __forceinline__ bool qsgd_far(i64 c, i64 limit) { return (c > limit) | (c < -limit); }

// The largest k with a * scales[k] <= scales[0]: the count of t >= 1 that pass (monotone).
__device__ __forceinline__ u8 qsgd_pick_scale(float a, const float* scales, i64 ns) {
    i64 k = 0;
    for (i64 t = 1; t < ns; ++t) k += (i64)(a * scales[t] <= scales[0]);
    return (u8)k;
}

// scales[k] when 0 <= k < ns (*inside true), else scales[0].
__device__ __forceinline__ float qsgd_scale_at(const float* scales, i64 ns, i64 k, bool* inside) {
    *inside = (k >= 0) & (k < ns);
    return scales[*inside ? k : 0];
}

// A stream of `width`-bit codes (1..32), LSB-first (kernels/cpu/bits.py's layout): code i is
// bits [i*width, (i+1)*width), bit b in byte b / 8 at b % 8. It is read as the little-endian
// 32-bit words of the aligned addresses (the stream's start rounded down to 4 bytes): a word
// wholly inside the stream's `nbytes` bytes in one load, one at its ends byte by byte (bytes
// outside read as 0), so no load leaves the buffer.
struct qsgd_stream {
    const u8* p;
    i64 nbytes;
    int mis;  // the stream's start past its aligned address, in bytes
    int width;
    u32 mask;

    __device__ __forceinline__ qsgd_stream(const u8* stream, i64 size, int w)
        : p(stream), nbytes(size), mis((int)((unsigned long long)stream & 3)), width(w),
          mask(w == 32 ? 0xffffffffu : (1u << w) - 1u) {}

    // Word k from the aligned address: stream bytes [4k - mis, 4k - mis + 4).
    __device__ __forceinline__ u32 word(i64 k) const {
        const i64 at = 4 * k - mis;
        if (at >= 0 && at + 4 <= nbytes) return *reinterpret_cast<const u32*>(p + at);
        u32 w = 0;
        for (int t = 0; t < 4; ++t)
            if (at + t >= 0 && at + t < nbytes) w |= (u32)p[at + t] << (8 * t);
        return w;
    }

    // c[j] = code i0 + j for j < cnt (cnt <= 4): 4 codes span at most 5 words, each loaded
    // once (only those the codes touch); then a 64-bit window slides over them, code by code.
    __device__ __forceinline__ void codes4(i64 i0, int cnt, u32 c[4]) const {
        const i64 bit = 8 * (i64)mis + i0 * width;
        const i64 k = bit >> 5;
        const int last = (int)(((bit + (i64)cnt * width - 1) >> 5) - k);  // 0..4
        u32 w0 = word(k), w1 = last >= 1 ? word(k + 1) : 0u, w2 = last >= 2 ? word(k + 2) : 0u;
        u32 w3 = last >= 3 ? word(k + 3) : 0u, w4 = last >= 4 ? word(k + 4) : 0u;
        int s = (int)(bit & 31);  // code j starts at bit s of w1:w0, s < 32
        for (int j = 0; j < 4; ++j) {
            c[j] = __funnelshift_r(w0, w1, (unsigned)s) & mask;
            s += width;
            if (s >= 32) {
                w0 = w1, w1 = w2, w2 = w3, w3 = w4;
                s -= 32;
            }
        }
    }
};

// ---- block norms ---------------------------------------------------------------------------------

// The norms of the coded vector's blocks (kernels/qsgd.py): norms[b] for starts[b] <= i <
// starts[b + 1], nb blocks; `regular` > 0: block b is [b * regular, (b + 1) * regular).
#define QSGD_BLOCKS const float *norms, const i64 *starts, i64 nb, i64 regular
#define QSGD_BLOCKS_ARGS norms, starts, nb, regular

// i / d for i, d >= 0: a 32-bit division where both fit (a 64-bit one is a long subroutine).
__device__ __forceinline__ i64 qsgd_div(i64 i, i64 d) {
    if (((u64)i | (u64)d) >> 32 == 0) return (i64)((u32)i / (u32)d);
    return i / d;
}

// The block of element i (mpicomp_qsgd_block_at): i / regular, or a binary search of starts.
__device__ __forceinline__ i64 qsgd_block_at(const i64* starts, i64 nb, i64 regular, i64 i) {
    if (regular > 0) return qsgd_div(i, regular);
    i64 lo = 0, hi = nb;  // starts[lo] <= i < starts[hi]
    while (hi - lo > 1) {
        const i64 mid = lo + (hi - lo) / 2;
        if (starts[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// ERR_NORM unless `norm` is a finite float32 >= 0.
__device__ __forceinline__ u32 qsgd_norm_bad(float norm) {
    return (norm >= 0.0f && norm <= MPICOMP_QSGD_F32_MAX) ? 0u : (u32)MPICOMP_QSGD_ERR_NORM;
}

// The norm of element i's block for increasing i: a thread finds the block of the first
// element of its group of 4 once (a division or a binary search) and steps to the next block
// where an element passes the block's end, checking the norm of each block it uses (as the
// twin checks the norm of every block holding an element).
struct qsgd_cursor {
    i64 b, end;
    float norm;

    __device__ __forceinline__ i64 end_of(const i64* starts, i64 regular) const {
        return regular > 0 ? (b + 1) * regular : starts[b + 1];
    }
    __device__ __forceinline__ qsgd_cursor(i64 i, QSGD_BLOCKS, u32* bad) {
        b = qsgd_block_at(starts, nb, regular, i);
        end = end_of(starts, regular);
        norm = norms[b];
        *bad |= qsgd_norm_bad(norm);
    }
    __device__ __forceinline__ float at(i64 i, QSGD_BLOCKS, u32* bad) {
        if (i >= end) {
            do {  // past empty blocks (a search lands on the block holding i)
                ++b;
                end = end_of(starts, regular);
            } while (i >= end);
            norm = norms[b];
            *bad |= qsgd_norm_bad(norm);
        }
        return norm;
    }
};

// ---- squared norm -------------------------------------------------------------------------------

// The pieces of the coded vector (x when DENSE, else x[idx]) as mpicomp_lane_sums (common.cuh)
// reads them: the float64 square of each value is its term, as mpicomp_qsgd_sumsq adds them.
template <bool DENSE> struct qsgd_pieces {
    const u32* x;  // the bits of x
    const i64* idx;
    const i64* pieces;
    bool vec;  // x 16-aligned (DENSE)

    __device__ i64 lo(i64 p) const { return pieces[p]; }
    __device__ i64 hi(i64 p) const { return pieces[p + 1]; }
    __device__ void fetch(i64 i, i64 end, u32 v[4]) const {
        for (int k = 0; k < 4; ++k) v[k] = 0u;
        if constexpr (DENSE) {
            mpicomp_load4(x, i, end, vec, v);
        } else {
            for (int k = 0; k < 4; ++k)
                if (i + k < end) v[k] = x[idx[i + k]];
        }
    }
    __device__ void use(i64, i64, i64, const u32*) const {}
    __device__ double term(u32 b) const {
        const float v = __uint_as_float(b);
        return (double)v * (double)v;
    }
};

// lanes[8p + l] = lane l of piece p (elements pieces[p] <= i < pieces[p + 1]): elements j = l,
// l+8, ... of the piece's whole octets in order, then (lane 0) the tail of fewer than 8, as
// mpicomp_qsgd_sumsq adds them. A block takes `group` pieces at a time (group * 8 <=
// blockDim.x; the launcher makes a group's elements about one tile), loads their elements
// in coalesced tiles into shared memory (MPICOMP_LANE_TILE(blockDim.x) u32, dynamic), and
// thread 8q + l runs lane l of piece q of the group from there: each chain the twin's. Pieces
// of a CHUNK (the tensor's norm) make one piece per block: blocks of at most
// MPICOMP_QSGD_LANE_THREADS threads, 12 of them per SM, so that all run at once.
extern "C" __global__ __launch_bounds__(MPICOMP_QSGD_LANE_THREADS, 12) void
mpicomp_qsgd_sumsq_lanes(const float* x, const i64* idx, int dense, const i64* pieces,
                         i64 npieces, i64 group, double* lanes) {
    extern __shared__ __align__(16) u32 qsgd_tile[];
    const u32* bits = reinterpret_cast<const u32*>(x);
    if (dense) {
        qsgd_pieces<true> src{bits, idx, pieces, mpicomp_aligned(x, 16)};
        mpicomp_lane_sums<8>(src, npieces, group, lanes, qsgd_tile);
    } else {
        qsgd_pieces<false> src{bits, idx, pieces, false};
        mpicomp_lane_sums<8>(src, npieces, group, lanes, qsgd_tile);
    }
}

// A piece's sum: its lanes combined as a tree of fixed shape.
__device__ __forceinline__ double qsgd_piece_sum(const double* l) {
    return ((l[0] + l[1]) + (l[2] + l[3])) + ((l[4] + l[5]) + (l[6] + l[7]));
}

// *out = the chunk sums (pieces of CHUNK elements) added in chunk order: one block; the
// serial part runs over chunks, not elements.
extern "C" __global__ void mpicomp_qsgd_sumsq_total(double* lanes, i64 nchunks, double* out) {
    if (blockIdx.x != 0) return;
    for (i64 c = threadIdx.x; c < nchunks; c += blockDim.x)
        lanes[8 * c] = qsgd_piece_sum(lanes + 8 * c);
    __syncthreads();
    if (threadIdx.x == 0) {
        double total = 0.0;
        for (i64 c = 0; c < nchunks; ++c) total += lanes[8 * c];
        *out = total;
    }
}

// out[b] = (float)sqrt(the sums of block b's pieces first[b] <= p < first[b + 1], in order);
// ERR_VALUE for a NaN/Inf sum, ERR_OVERFLOW for a norm beyond float32 (out[b] = 0 then).
extern "C" __global__ void mpicomp_qsgd_block_norms(const double* lanes, const i64* first, i64 nb,
                                                     float* out, u32* err) {
    u32 bad = 0;
    MPICOMP_FOR(b, nb) {
        double total = 0.0;
        for (i64 p = first[b]; p < first[b + 1]; ++p) total += qsgd_piece_sum(lanes + 8 * p);
        const double norm = sqrt(total);
        const bool finite = isfinite(total), fits = norm <= (double)MPICOMP_QSGD_F32_MAX;
        bad |= (finite ? 0u : (u32)MPICOMP_QSGD_ERR_VALUE) |
               (finite && !fits ? (u32)MPICOMP_QSGD_ERR_OVERFLOW : 0u);
        out[b] = finite && fits ? (float)norm : 0.0f;
    }
    if (bad) atomicOr(err, bad);
}

// ---- groups of 4 elements -----------------------------------------------------------------------
// The element kernels below give each thread 4 consecutive elements at a time (grid-stride over
// groups, so a warp's accesses are contiguous): one 16-byte load of x (4-byte loads of 4
// codes or indices, 16-byte stores of 4 floats, one store of 4 codes) where aligned, the
// element's block found once per group (qsgd_cursor), and each element's arithmetic exactly
// the twin's. Nothing but the access pattern changes: the bytes are the twin's.

// The values of x (dense: x[i]; else x[idx[i]]) of elements i0 .. i0 + 3 below n, and the
// indices in x their uniforms are drawn at.
__device__ __forceinline__ void qsgd_values4(const float* x, const i64* idx, int dense, bool vec,
                                             i64 i0, i64 n, float v[4], i64 at[4]) {
    u32 b[4] = {0u, 0u, 0u, 0u};
    if (dense) {
        mpicomp_load4(reinterpret_cast<const u32*>(x), i0, n, vec, b);
        for (int k = 0; k < 4; ++k) at[k] = i0 + k;
    } else {
        u64 ix[4] = {0ull, 0ull, 0ull, 0ull};
        mpicomp_load4(reinterpret_cast<const u64*>(idx), i0, n, mpicomp_aligned(idx, 16), ix);
        for (int k = 0; k < 4; ++k) {
            at[k] = (i64)ix[k];
            if (i0 + k < n) b[k] = reinterpret_cast<const u32*>(x)[at[k]];
        }
    }
    for (int k = 0; k < 4; ++k) v[k] = __uint_as_float(b[k]);
}

// ---- codes ---------------------------------------------------------------------------------------

template <class T>
__device__ void qsgd_quantize(const float* x, const i64* idx, int dense, QSGD_BLOCKS, i64 levels,
                              u64 key, T* out, i64 n, u32* err) {
    typedef typename mpicomp_uint_of<sizeof(T)>::type U;
    const float s = (float)levels;
    const bool vx = dense && mpicomp_aligned(x, 16);
    const bool vo = mpicomp_aligned(out, mpicomp_vec_align(sizeof(T)));
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        float v[4];
        i64 at[4];
        qsgd_values4(x, idx, dense, vx, i0, n, v, at);
        qsgd_cursor cur(i0, QSGD_BLOCKS_ARGS, &bad);
        U c[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; ++k) {
            if (i0 + k >= n) break;
            bool ok;
            const float a = qsgd_unit(v[k], cur.at(i0 + k, QSGD_BLOCKS_ARGS, &bad), &ok);
            bad |= (u32)!ok;
            c[k] = (U)(T)qsgd_round(v[k], a, s, mpicomp_uniform(key, (u64)at[k]));
        }
        mpicomp_store4(reinterpret_cast<U*>(out), i0, n, vo, c);
    }
    if (bad) atomicOr(err, bad);
}

extern "C" __global__ void mpicomp_qsgd_quantize_i8(const float* x, const i64* idx, int dense,
                                                     QSGD_BLOCKS, i64 levels, u64 key,
                                                     signed char* out, i64 n, u32* err) {
    qsgd_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, levels, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_quantize_i16(const float* x, const i64* idx, int dense,
                                                      QSGD_BLOCKS, i64 levels, u64 key, short* out,
                                                      i64 n, u32* err) {
    qsgd_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, levels, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_quantize_i32(const float* x, const i64* idx, int dense,
                                                      QSGD_BLOCKS, i64 levels, u64 key, int* out,
                                                      i64 n, u32* err) {
    qsgd_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, levels, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_quantize_i64(const float* x, const i64* idx, int dense,
                                                      QSGD_BLOCKS, i64 levels, u64 key, i64* out,
                                                      i64 n, u32* err) {
    qsgd_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, levels, key, out, n, err);
}

extern "C" __global__ void mpicomp_qsgd_multiscale_index(const float* x, const i64* idx,
                                                          int dense, QSGD_BLOCKS,
                                                          const float* scales, i64 ns, u8* out,
                                                          i64 n, u32* err) {
    const bool vx = dense && mpicomp_aligned(x, 16), vo = mpicomp_aligned(out, 4);
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        float v[4];
        i64 at[4];
        qsgd_values4(x, idx, dense, vx, i0, n, v, at);
        qsgd_cursor cur(i0, QSGD_BLOCKS_ARGS, &bad);
        u8 k4[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; ++k) {
            if (i0 + k >= n) break;
            bool ok;
            const float a = qsgd_unit(v[k], cur.at(i0 + k, QSGD_BLOCKS_ARGS, &bad), &ok);
            bad |= (u32)!ok;
            k4[k] = qsgd_pick_scale(a, scales, ns);
        }
        mpicomp_store4(out, i0, n, vo, k4);
    }
    if (bad) atomicOr(err, bad);
}

// Codes at scale scales[sidx[i]]; errors: ERR_VALUE, ERR_INDEX (bit 1), ERR_UNSAFE (bit 2).
template <class T, class K>
__device__ void qsgd_ms_quantize(const float* x, const i64* idx, int dense, QSGD_BLOCKS,
                                 const float* scales, i64 ns, const K* sidx, u64 key, T* out,
                                 i64 n, u32* err) {
    typedef typename mpicomp_uint_of<sizeof(T)>::type U;
    typedef typename mpicomp_uint_of<sizeof(K)>::type KU;
    const float smin = scales[0];
    const bool vx = dense && mpicomp_aligned(x, 16);
    const bool vk = mpicomp_aligned(sidx, mpicomp_vec_align(sizeof(K)));
    const bool vo = mpicomp_aligned(out, mpicomp_vec_align(sizeof(T)));
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        float v[4];
        i64 at[4];
        qsgd_values4(x, idx, dense, vx, i0, n, v, at);
        KU k4[4] = {0, 0, 0, 0};
        mpicomp_load4(reinterpret_cast<const KU*>(sidx), i0, n, vk, k4);
        qsgd_cursor cur(i0, QSGD_BLOCKS_ARGS, &bad);
        U c[4] = {0, 0, 0, 0};
        for (int k = 0; k < 4; ++k) {
            if (i0 + k >= n) break;
            bool inside, ok;
            const float s = qsgd_scale_at(scales, ns, (i64)(K)k4[k], &inside);
            const float a = qsgd_unit(v[k], cur.at(i0 + k, QSGD_BLOCKS_ARGS, &bad), &ok);
            const bool safe = a * s <= smin;
            bad |= (u32)!ok | ((u32)!inside << 1) | ((u32)!safe << 2);
            c[k] = (U)(T)qsgd_round(v[k], safe ? a : 0.0f, s, mpicomp_uniform(key, (u64)at[k]));
        }
        mpicomp_store4(reinterpret_cast<U*>(out), i0, n, vo, c);
    }
    if (bad) atomicOr(err, bad);
}

// One kernel per (code dtype, scale-index dtype): codes int8..int64; indices uint8 or int64
// (the launcher widens any other integer dtype to int64, as the twin's np.int64(k) does).
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i8_u8(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const u8* sidx, u64 key, signed char* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i16_u8(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const u8* sidx, u64 key, short* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i32_u8(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const u8* sidx, u64 key, int* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i64_u8(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const u8* sidx, u64 key, i64* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i8_i64(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const i64* sidx, u64 key, signed char* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i16_i64(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const i64* sidx, u64 key, short* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i32_i64(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const i64* sidx, u64 key, int* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_quantize_i64_i64(
    const float* x, const i64* idx, int dense, QSGD_BLOCKS, const float* scales, i64 ns,
    const i64* sidx, u64 key, i64* out, i64 n, u32* err) {
    qsgd_ms_quantize(x, idx, dense, QSGD_BLOCKS_ARGS, scales, ns, sidx, key, out, n, err);
}

// ---- reconstruction ------------------------------------------------------------------------------
// Groups of 4 as the codes above: 4 codes (or 4 from the packed stream, or 4 scale indices) in
// one load, 4 floats in one 16-byte store where aligned.

// int64 code -> float32 as the twin's np.float32(np.int64(c)): int32 codes convert from int32
// (the same correctly rounded value, without the 64-bit conversion).
template <class C> __device__ __forceinline__ float qsgd_float_of(C c) {
    if constexpr (sizeof(C) <= 4) return (float)(i32)c;
    return (float)c;
}

// ((c * norm) / s) / nr in float32 for a code c of type C.
template <class C>
__device__ __forceinline__ float qsgd_value_of(C c, float norm, float s, float nr) {
    return ((qsgd_float_of(c) * norm) / s) / nr;
}

// out[i] = ((codes[i] * norm) / levels) / nranks for codes of type C, norm the block of element
// base + i (codes and out start at element `base` of the coded vector: a row decodes alone).
template <class C>
__device__ void qsgd_dequantize(const C* codes, QSGD_BLOCKS, i64 levels, i64 nranks, i64 limit,
                                float* out, i64 base, i64 n, u32* err) {
    typedef typename mpicomp_uint_of<sizeof(C)>::type U;
    const float s = (float)levels, nr = (float)nranks;
    const bool vc = mpicomp_aligned(codes, mpicomp_vec_align(sizeof(C)));
    const bool vo = mpicomp_aligned(out, 16);
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        U c4[4] = {0, 0, 0, 0};
        mpicomp_load4(reinterpret_cast<const U*>(codes), i0, n, vc, c4);
        qsgd_cursor cur(base + i0, QSGD_BLOCKS_ARGS, &bad);
        u32 o[4] = {0u, 0u, 0u, 0u};
        for (int k = 0; k < 4; ++k) {
            if (i0 + k >= n) break;
            const C c = (C)c4[k];
            o[k] = __float_as_uint(
                qsgd_value_of(c, cur.at(base + i0 + k, QSGD_BLOCKS_ARGS, &bad), s, nr));
            bad |= qsgd_far((i64)c, limit) ? (u32)MPICOMP_QSGD_ERR_RANGE : 0u;
        }
        mpicomp_store4(reinterpret_cast<u32*>(out), i0, n, vo, o);
    }
    if (bad) atomicOr(err, bad);
}

// Codes of `bytes` bytes each (1, 2, 4 or 8).
extern "C" __global__ void mpicomp_qsgd_dequantize(const void* codes, int bytes, QSGD_BLOCKS,
                                                    i64 levels, i64 nranks, i64 limit,
                                                    float* out, i64 base, i64 n, u32* err) {
    switch (bytes) {
        case 1:
            qsgd_dequantize((const signed char*)codes, QSGD_BLOCKS_ARGS, levels, nranks, limit,
                            out, base, n, err);
            break;
        case 2:
            qsgd_dequantize((const short*)codes, QSGD_BLOCKS_ARGS, levels, nranks, limit, out, base,
                            n, err);
            break;
        case 4:
            qsgd_dequantize((const int*)codes, QSGD_BLOCKS_ARGS, levels, nranks, limit, out, base,
                            n, err);
            break;
        default:
            qsgd_dequantize((const i64*)codes, QSGD_BLOCKS_ARGS, levels, nranks, limit, out, base,
                            n, err);
    }
}

// Code sums straight from the ring's packed result: sum i = (code i of stream) - shift, element
// base + i; the stream holds `nbytes` bytes (qsgd_stream reads none past them).
extern "C" __global__ void mpicomp_qsgd_dequantize_packed(const u8* stream, i64 nbytes, int width,
                                                           i64 shift, QSGD_BLOCKS, i64 levels,
                                                           i64 nranks, i64 limit, float* out,
                                                           i64 base, i64 n, u32* err) {
    const float s = (float)levels, nr = (float)nranks;
    const qsgd_stream codes(stream, nbytes, width);
    const bool vo = mpicomp_aligned(out, 16);
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        const int cnt = n - i0 < 4 ? (int)(n - i0) : 4;
        u32 c4[4];
        codes.codes4(i0, cnt, c4);
        qsgd_cursor cur(base + i0, QSGD_BLOCKS_ARGS, &bad);
        u32 o[4] = {0u, 0u, 0u, 0u};
        for (int k = 0; k < cnt; ++k) {
            const i64 c = (i64)c4[k] - shift;
            const float norm = cur.at(base + i0 + k, QSGD_BLOCKS_ARGS, &bad);
            o[k] = __float_as_uint(qsgd_value(c, norm, s, nr));
            bad |= qsgd_far(c, limit) ? (u32)MPICOMP_QSGD_ERR_RANGE : 0u;
        }
        mpicomp_store4(reinterpret_cast<u32*>(out), i0, n, vo, o);
    }
    if (bad) atomicOr(err, bad);
}

// Value of code sum c at scale index k: ERR_INDEX (bit 1) outside the set, ERR_RANGE (bit 3).
__device__ __forceinline__ float qsgd_ms_value(i64 c, i64 k, const float* scales, i64 ns,
                                               float norm, float nr, i64 limit, u32* bad) {
    bool inside;
    const float s = qsgd_scale_at(scales, ns, k, &inside);
    *bad |= ((u32)!inside << 1) | ((u32)qsgd_far(c, limit) << 3);
    return qsgd_value(c, norm, s, nr);
}

template <class C, class K>
__device__ void qsgd_ms_dequantize(const C* codes, const K* sidx, QSGD_BLOCKS,
                                   const float* scales, i64 ns, i64 nranks, i64 limit, float* out,
                                   i64 base, i64 n, u32* err) {
    typedef typename mpicomp_uint_of<sizeof(C)>::type CU;
    typedef typename mpicomp_uint_of<sizeof(K)>::type KU;
    const float nr = (float)nranks;
    const bool vc = mpicomp_aligned(codes, mpicomp_vec_align(sizeof(C)));
    const bool vk = mpicomp_aligned(sidx, mpicomp_vec_align(sizeof(K)));
    const bool vo = mpicomp_aligned(out, 16);
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        CU c4[4] = {0, 0, 0, 0};
        KU k4[4] = {0, 0, 0, 0};
        mpicomp_load4(reinterpret_cast<const CU*>(codes), i0, n, vc, c4);
        mpicomp_load4(reinterpret_cast<const KU*>(sidx), i0, n, vk, k4);
        qsgd_cursor cur(base + i0, QSGD_BLOCKS_ARGS, &bad);
        u32 o[4] = {0u, 0u, 0u, 0u};
        for (int k = 0; k < 4; ++k) {
            if (i0 + k >= n) break;
            const float norm = cur.at(base + i0 + k, QSGD_BLOCKS_ARGS, &bad);
            o[k] = __float_as_uint(qsgd_ms_value((i64)(C)c4[k], (i64)(K)k4[k], scales, ns, norm,
                                                 nr, limit, &bad));
        }
        mpicomp_store4(reinterpret_cast<u32*>(out), i0, n, vo, o);
    }
    if (bad) atomicOr(err, bad);
}

extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i8_u8(
    const signed char* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i16_u8(
    const short* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i32_u8(
    const int* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i64_u8(
    const i64* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i8_i64(
    const signed char* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i16_i64(
    const short* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i32_i64(
    const int* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i64_i64(
    const i64* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, base, n,
                       err);
}

template <class K>
__device__ void qsgd_ms_dequantize_packed(const u8* stream, i64 nbytes, int width, i64 shift,
                                          const K* sidx, QSGD_BLOCKS, const float* scales, i64 ns,
                                          i64 nranks, i64 limit, float* out, i64 base, i64 n,
                                          u32* err) {
    typedef typename mpicomp_uint_of<sizeof(K)>::type KU;
    const float nr = (float)nranks;
    const qsgd_stream codes(stream, nbytes, width);
    const bool vk = mpicomp_aligned(sidx, mpicomp_vec_align(sizeof(K)));
    const bool vo = mpicomp_aligned(out, 16);
    u32 bad = 0;
    MPICOMP_FOR(g, (n + 3) >> 2) {
        const i64 i0 = 4 * g;
        const int cnt = n - i0 < 4 ? (int)(n - i0) : 4;
        u32 c4[4];
        codes.codes4(i0, cnt, c4);
        KU k4[4] = {0, 0, 0, 0};
        mpicomp_load4(reinterpret_cast<const KU*>(sidx), i0, n, vk, k4);
        qsgd_cursor cur(base + i0, QSGD_BLOCKS_ARGS, &bad);
        u32 o[4] = {0u, 0u, 0u, 0u};
        for (int k = 0; k < cnt; ++k) {
            const i64 c = (i64)c4[k] - shift;
            const float norm = cur.at(base + i0 + k, QSGD_BLOCKS_ARGS, &bad);
            o[k] = __float_as_uint(
                qsgd_ms_value(c, (i64)(K)k4[k], scales, ns, norm, nr, limit, &bad));
        }
        mpicomp_store4(reinterpret_cast<u32*>(out), i0, n, vo, o);
    }
    if (bad) atomicOr(err, bad);
}

extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_packed_u8(
    const u8* stream, i64 nbytes, int width, i64 shift, const u8* sidx, QSGD_BLOCKS,
    const float* scales, i64 ns, i64 nranks, i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize_packed(stream, nbytes, width, shift, sidx, QSGD_BLOCKS_ARGS, scales, ns,
                              nranks, limit, out, base, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_packed_i64(
    const u8* stream, i64 nbytes, int width, i64 shift, const i64* sidx, QSGD_BLOCKS,
    const float* scales, i64 ns, i64 nranks, i64 limit, float* out, i64 base, i64 n, u32* err) {
    qsgd_ms_dequantize_packed(stream, nbytes, width, shift, sidx, QSGD_BLOCKS_ARGS, scales, ns,
                              nranks, limit, out, base, n, err);
}

// ---- GlobalRandK coordinates ---------------------------------------------------------------------

extern "C" __global__ void mpicomp_qsgd_grandk_scatter(const float* vals, const i64* idx,
                                                        float ratio, float* out, i64 k) {
    MPICOMP_FOR(j, k) { out[idx[j]] = vals[j] * ratio; }  // distinct coordinates: no conflict
}

// Floyd's algorithm, as the twin runs it: for j = first .. n-1 (first = n - k), draw
// t_j = floor(bits(key, j) * (j+1) / 2^64), take t_j unless already taken, else j. In parallel:
// t_j is taken before step j iff it was preset in the mask, or drawn at an earlier step (the
// smallest step drawing each value is kept in a table), or it is a step t >= first whose own
// draw was taken (then step t took t itself): a chain t_j > t_t > ... that strictly decreases.
__device__ __forceinline__ i64 grandk_draw(u64 key, i64 j) {
    return (i64)__umul64hi(mpicomp_bits(key, (u64)j), (u64)(j + 1));
}

__device__ __forceinline__ u64 grandk_home(i64 t, u64 capmask) {
    return mpicomp_mix64((u64)t) & capmask;
}

// The table: direct (first[t] for t in [0, n)) or open addressing (keys, capacity capmask + 1).
// It holds, per drawn value, the smallest offset j - first that drew it.
__device__ __forceinline__ u32* grandk_entry(i64 t, int direct, u32* table, u64* keys,
                                             u64 capmask) {
    if (direct) return table + t;
    u64 s = grandk_home(t, capmask);
    for (;;) {
        const u64 prev = atomicCAS(keys + s, QSGD_EMPTY, (u64)t);
        if (prev == QSGD_EMPTY || prev == (u64)t) return table + s;
        s = (s + 1) & capmask;
    }
}

__device__ __forceinline__ u32 grandk_lookup(i64 t, int direct, const u32* table, const u64* keys,
                                             u64 capmask) {
    if (direct) return table[t];
    u64 s = grandk_home(t, capmask);
    while (keys[s] != (u64)t) s = (s + 1) & capmask;  // every value looked up was drawn
    return table[s];
}

extern "C" __global__ void mpicomp_qsgd_grandk_draw(i64 n, i64 k, u64 key, int direct, u32* table,
                                                     u64* keys, u64 capmask) {
    const i64 first = n - k;
    MPICOMP_FOR(q, k) {
        atomicMin(grandk_entry(grandk_draw(key, first + q), direct, table, keys, capmask), (u32)q);
    }
}

extern "C" __global__ void mpicomp_qsgd_grandk_resolve(i64 n, i64 k, u64 key, const u8* mask,
                                                        int direct, const u32* table,
                                                        const u64* keys, u64 capmask,
                                                        i64* picks) {
    const i64 first = n - k;
    MPICOMP_FOR(q, k) {
        const i64 j = first + q, tj = grandk_draw(key, j);
        i64 cur = j, t = tj;
        bool taken = false;  // was t_j taken before step j?
        while (t != cur) {   // t_cur == cur: never taken before step cur
            if (mask[t] || grandk_lookup(t, direct, table, keys, capmask) < (u32)(cur - first)) {
                taken = true;
                break;
            }
            if (t < first) break;
            cur = t;  // t in [first, cur): taken iff step t's own draw was
            t = grandk_draw(key, cur);
        }
        picks[q] = taken ? j : tj;
    }
}

extern "C" __global__ void mpicomp_qsgd_grandk_mark(const i64* picks, i64 k, u8* mask) {
    MPICOMP_FOR(q, k) { mask[picks[q]] = 1; }
}

// One pass of a bottom-up merge sort: runs of `w` sorted values merged in pairs; each value
// finds its place by a binary search in the other run (ties: the left run first).
extern "C" __global__ void mpicomp_qsgd_grandk_merge(const i64* src, i64* dst, i64 n, i64 w) {
    MPICOMP_FOR(i, n) {
        const i64 run = i / w, left = (run - (run & 1)) * w;
        const i64 mid = qsgd_min64(left + w, n), end = qsgd_min64(left + 2 * w, n);
        const i64 v = src[i];
        i64 lo, hi, rank;
        if ((run & 1) == 0) {  // values of the right run below v
            lo = mid, hi = end;
            while (lo < hi) {
                const i64 m = lo + (hi - lo) / 2;
                if (src[m] < v) lo = m + 1; else hi = m;
            }
            rank = (i - left) + (lo - mid);
        } else {  // values of the left run up to v
            lo = left, hi = mid;
            while (lo < hi) {
                const i64 m = lo + (hi - lo) / 2;
                if (src[m] <= v) lo = m + 1; else hi = m;
            }
            rank = (i - mid) + (lo - left);
        }
        dst[left + rank] = v;
    }
}

// Compaction of the mask in TILE-byte tiles, one block per tile at a time: counts, a scan of
// the counts (one block), then each tile writes its positions in order.
extern "C" __global__ void mpicomp_qsgd_grandk_count(const u8* mask, i64 n, i64* counts) {
    __shared__ i64 scratch[32];
    const i64 ntiles = (n + QSGD_TILE - 1) / QSGD_TILE;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const i64 lo = tile * QSGD_TILE, hi = qsgd_min64(n, lo + QSGD_TILE);
        i64 c = 0;
        for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) c += mask[i] != 0;
        c = mpicomp_block_sum(c, scratch);
        if (threadIdx.x == 0) counts[tile] = c;
    }
}

extern "C" __global__ void mpicomp_qsgd_grandk_offsets(i64* counts, i64 ntiles) {
    __shared__ i64 scratch[32];
    if (blockIdx.x != 0) return;
    i64 carry = 0;
    for (i64 base = 0; base < ntiles; base += blockDim.x) {
        const i64 i = base + threadIdx.x;
        const i64 v = i < ntiles ? counts[i] : 0;
        i64 total;
        const i64 ex = mpicomp_block_exclusive_scan(v, scratch, &total);
        if (i < ntiles) counts[i] = carry + ex;
        carry += total;
    }
}

extern "C" __global__ void mpicomp_qsgd_grandk_compact(const u8* mask, i64 n,
                                                        const i64* offsets, i64* out, i64 nout) {
    __shared__ i64 scratch[32];
    const i64 ntiles = (n + QSGD_TILE - 1) / QSGD_TILE;
    for (i64 tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        const i64 lo = tile * QSGD_TILE, hi = qsgd_min64(n, lo + QSGD_TILE);
        i64 pos = offsets[tile];
        for (i64 base = lo; base < hi; base += blockDim.x) {
            const i64 i = base + threadIdx.x;
            const i64 hit = i < hi && mask[i] != 0;
            i64 total;
            const i64 ex = mpicomp_block_exclusive_scan(hit, scratch, &total);
            if (hit && pos + ex < nout) out[pos + ex] = i;
            pos += total;
        }
    }
}
