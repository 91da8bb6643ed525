// QSGD-MaxNorm kernels (paper 000 §3.1-3.4), CUDA twins of kernels/cpu/qsgd.py: norms,
// stochastic codes, scale indices, reconstruction, GlobalRandK coordinates.
//
// Float arithmetic is the numba twin's, operation for operation (built with --fmad=false):
// a = |v| / norm, y = a * s, l = floor(y), code l + 1 iff u < y - l, norm the element's
// block's (kernels/qsgd.py). The squared norm adds in its fixed order: 8 lanes per piece (CHUNK
// elements, or a block's cut), lanes ((0+1)+(2+3))+((4+5)+(6+7)), pieces in order.
// Error results are bit masks OR-ed into one u32 (integer atomics: order-free).
// Constants come from kernels/qsgd.py as -D macros (kernels/cuda/qsgd.py: DEFINES).
#include "common.cuh"

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

// Code i of a stream of `width`-bit codes (1..32), LSB-first (kernels/cpu/bits.py's layout):
// bits [i*width, (i+1)*width), bit b in byte b / 8 at b % 8. Reads only this code's bytes.
__device__ __forceinline__ u32 qsgd_code_at(const u8* stream, i64 i, int width) {
    const u64 bit = (u64)i * (u64)width;
    const u64 p = bit >> 3;
    const int off = (int)(bit & 7);
    const int nbytes = (off + width + 7) >> 3;  // 1..5
    u64 acc = 0;
    for (int t = 0; t < nbytes; ++t) acc |= (u64)stream[p + t] << (8 * t);  // shift <= 32
    return (u32)((acc >> off) & ((1ull << width) - 1ull));                  // width <= 32
}

// ---- block norms ---------------------------------------------------------------------------------

// The norms of the coded vector's blocks (kernels/qsgd.py): norms[b] for starts[b] <= i <
// starts[b + 1], nb blocks; `regular` > 0: block b is [b * regular, (b + 1) * regular).
#define QSGD_BLOCKS const float *norms, const i64 *starts, i64 nb, i64 regular
#define QSGD_BLOCKS_ARGS norms, starts, nb, regular

// The block of element i (mpicomp_qsgd_block_at): i / regular, or a binary search of starts.
__device__ __forceinline__ i64 qsgd_block_at(const i64* starts, i64 nb, i64 regular, i64 i) {
    if (regular > 0) return i / regular;
    i64 lo = 0, hi = nb;  // starts[lo] <= i < starts[hi]
    while (hi - lo > 1) {
        const i64 mid = lo + (hi - lo) / 2;
        if (starts[mid] <= i) lo = mid; else hi = mid;
    }
    return lo;
}

// The norm of element i's block; ERR_NORM into *bad unless it is a finite float32 >= 0.
__device__ __forceinline__ float qsgd_norm_of(i64 i, QSGD_BLOCKS, u32* bad) {
    const float norm = norms[qsgd_block_at(starts, nb, regular, i)];
    *bad |= (norm >= 0.0f && norm <= MPICOMP_QSGD_F32_MAX) ? 0u : (u32)MPICOMP_QSGD_ERR_NORM;
    return norm;
}

// ---- squared norm -------------------------------------------------------------------------------

// lanes[8p + l] = lane l of piece p (elements pieces[p] <= i < pieces[p + 1]): elements j = l,
// l+8, ... of the piece's whole octets in order, then (lane 0) the tail of fewer than 8, as
// mpicomp_qsgd_sumsq adds them.
extern "C" __global__ void mpicomp_qsgd_sumsq_lanes(const float* x, const i64* idx, int dense,
                                                     const i64* pieces, i64 npieces,
                                                     double* lanes) {
    MPICOMP_FOR(q, npieces * 8) {
        const i64 lo = pieces[q >> 3], hi = pieces[(q >> 3) + 1];
        const i64 lane = q & 7, m = hi - lo, full = m - m % 8;
        double acc = 0.0;
        if (dense) {
            for (i64 j = lane; j < full; j += 8) acc += (double)x[lo + j] * (double)x[lo + j];
            if (lane == 0)
                for (i64 j = full; j < m; ++j) acc += (double)x[lo + j] * (double)x[lo + j];
        } else {
            for (i64 j = lane; j < full; j += 8) {
                const float v = x[idx[lo + j]];
                acc += (double)v * (double)v;
            }
            if (lane == 0)
                for (i64 j = full; j < m; ++j) {
                    const float v = x[idx[lo + j]];
                    acc += (double)v * (double)v;
                }
        }
        lanes[q] = acc;
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

// ---- codes ---------------------------------------------------------------------------------------

template <class T>
__device__ void qsgd_quantize(const float* x, const i64* idx, int dense, QSGD_BLOCKS, i64 levels,
                              u64 key, T* out, i64 n, u32* err) {
    const float s = (float)levels;
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const i64 at = dense ? i : idx[i];  // the uniform is drawn at the index in x
        const float v = x[at], norm = qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad);
        bool ok;
        const float a = qsgd_unit(v, norm, &ok);
        bad |= (u32)!ok;
        out[i] = (T)qsgd_round(v, a, s, mpicomp_uniform(key, (u64)at));
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
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const float norm = qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad);
        bool ok;
        const float a = qsgd_unit(x[dense ? i : idx[i]], norm, &ok);
        bad |= (u32)!ok;
        out[i] = qsgd_pick_scale(a, scales, ns);
    }
    if (bad) atomicOr(err, bad);
}

// Codes at scale scales[sidx[i]]; errors: ERR_VALUE, ERR_INDEX (bit 1), ERR_UNSAFE (bit 2).
template <class T, class K>
__device__ void qsgd_ms_quantize(const float* x, const i64* idx, int dense, QSGD_BLOCKS,
                                 const float* scales, i64 ns, const K* sidx, u64 key, T* out,
                                 i64 n, u32* err) {
    const float smin = scales[0];
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const i64 at = dense ? i : idx[i];
        const float v = x[at], norm = qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad);
        bool inside, ok;
        const float s = qsgd_scale_at(scales, ns, (i64)sidx[i], &inside);
        const float a = qsgd_unit(v, norm, &ok);
        const bool safe = a * s <= smin;
        bad |= (u32)!ok | ((u32)!inside << 1) | ((u32)!safe << 2);
        out[i] = (T)qsgd_round(v, safe ? a : 0.0f, s, mpicomp_uniform(key, (u64)at));
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

// Code i of an array of signed codes of `bytes` bytes each (1, 2, 4 or 8), as int64.
__device__ __forceinline__ i64 qsgd_code(const void* codes, int bytes, i64 i) {
    switch (bytes) {
        case 1: return ((const signed char*)codes)[i];
        case 2: return ((const short*)codes)[i];
        case 4: return ((const int*)codes)[i];
        default: return ((const i64*)codes)[i];
    }
}

// out[i] = ((codes[i] * norm) / levels) / nranks, codes of `bytes` bytes each.
extern "C" __global__ void mpicomp_qsgd_dequantize(const void* codes, int bytes, QSGD_BLOCKS,
                                                    i64 levels, i64 nranks, i64 limit,
                                                    float* out, i64 n, u32* err) {
    const float s = (float)levels, nr = (float)nranks;
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const i64 c = qsgd_code(codes, bytes, i);
        out[i] = qsgd_value(c, qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad), s, nr);
        bad |= qsgd_far(c, limit) ? (u32)MPICOMP_QSGD_ERR_RANGE : 0u;
    }
    if (bad) atomicOr(err, bad);
}

// Code sums straight from the ring's packed result: sum i = (code i of stream) - shift.
extern "C" __global__ void mpicomp_qsgd_dequantize_packed(const u8* stream, int width, i64 shift,
                                                           QSGD_BLOCKS, i64 levels, i64 nranks,
                                                           i64 limit, float* out, i64 n,
                                                           u32* err) {
    const float s = (float)levels, nr = (float)nranks;
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const i64 c = (i64)qsgd_code_at(stream, i, width) - shift;
        out[i] = qsgd_value(c, qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad), s, nr);
        bad |= qsgd_far(c, limit) ? (u32)MPICOMP_QSGD_ERR_RANGE : 0u;
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
                                   i64 n, u32* err) {
    const float nr = (float)nranks;
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const float norm = qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad);
        out[i] = qsgd_ms_value((i64)codes[i], (i64)sidx[i], scales, ns, norm, nr, limit, &bad);
    }
    if (bad) atomicOr(err, bad);
}

extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i8_u8(
    const signed char* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i16_u8(
    const short* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i32_u8(
    const int* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i64_u8(
    const i64* codes, const u8* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i8_i64(
    const signed char* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i16_i64(
    const short* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i32_i64(
    const int* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_i64_i64(
    const i64* codes, const i64* sidx, QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
    i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize(codes, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks, limit, out, n, err);
}

template <class K>
__device__ void qsgd_ms_dequantize_packed(const u8* stream, int width, i64 shift, const K* sidx,
                                          QSGD_BLOCKS, const float* scales, i64 ns, i64 nranks,
                                          i64 limit, float* out, i64 n, u32* err) {
    const float nr = (float)nranks;
    u32 bad = 0;
    MPICOMP_FOR(i, n) {
        const i64 c = (i64)qsgd_code_at(stream, i, width) - shift;
        const float norm = qsgd_norm_of(i, QSGD_BLOCKS_ARGS, &bad);
        out[i] = qsgd_ms_value(c, (i64)sidx[i], scales, ns, norm, nr, limit, &bad);
    }
    if (bad) atomicOr(err, bad);
}

extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_packed_u8(
    const u8* stream, int width, i64 shift, const u8* sidx, QSGD_BLOCKS, const float* scales,
    i64 ns, i64 nranks, i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize_packed(stream, width, shift, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks,
                              limit, out, n, err);
}
extern "C" __global__ void mpicomp_qsgd_multiscale_dequantize_packed_i64(
    const u8* stream, int width, i64 shift, const i64* sidx, QSGD_BLOCKS, const float* scales,
    i64 ns, i64 nranks, i64 limit, float* out, i64 n, u32* err) {
    qsgd_ms_dequantize_packed(stream, width, shift, sidx, QSGD_BLOCKS_ARGS, scales, ns, nranks,
                              limit, out, n, err);
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
