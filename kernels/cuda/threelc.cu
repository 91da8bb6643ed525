// 3LC (the 3LC paper §3): max pass, ternarize + quartic encoding with fused error feedback,
// zero-run encoding by scans, and the validating decoders. Twins of kernels/cpu/threelc.py,
// byte for byte. Constants come from kernels/threelc.py (kernels/cuda/threelc.py: DEFINES):
//   MPICOMP_THREELC_ZERO_BYTE, _RUN_BASE, _MAX_RUN, _MAX_QUARTIC, _ITEMS (bytes per thread of
//   a zero-run tile), and the flags _BAD_BYTE, _BAD_PAD, _BAD_ZERO of the quartic check.
//
// Zero-run kernels split the byte stream into `nspans` contiguous spans of `span` bytes, one
// per block (grid-stride over spans, so any grid works). Each span is walked in tiles of
// blockDim.x * ITEMS bytes with block scans; a one-thread tail scans the per-span summaries.
// Every scan is over integers, so no result depends on the geometry.
#include "common.cuh"

#define TLC_ZB MPICOMP_THREELC_ZERO_BYTE
#define TLC_ITEMS MPICOMP_THREELC_ITEMS

__device__ __forceinline__ i64 tlc_max64(i64 a, i64 b) { return a < b ? b : a; }
__device__ __forceinline__ i64 tlc_min64(i64 a, i64 b) { return a < b ? a : b; }

// ---- max --------------------------------------------------------------------------------------
// top = max over i of the uint32 pattern of (x[i] + r[i]) with the sign cleared (an integer max:
// exact in any order; NaN/Inf are exactly the patterns >= 0x7F800000, as in the numba twin).
// Without r the pattern is read as bits, never through float arithmetic (nothing flushed).
// `top` must hold 0 before the launch; mpicomp_threelc_scale finishes M = top * s.
extern "C" __global__ void mpicomp_threelc_max(const float* x, const float* r, int use_r, i64 n,
                                               u32* top) {
    __shared__ u32 scratch[32];
    u32 m = 0;
    MPICOMP_FOR(i, n) {
        const u32 bits = use_r ? __float_as_uint(x[i] + r[i]) : ((const u32*)x)[i];
        m = max(m, bits & 0x7fffffffu);
    }
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_down_sync(0xffffffffu, m, off));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) scratch[warp] = m;
    __syncthreads();
    if (threadIdx.x == 0) {
        u32 b = 0;
        for (int w = 0; w < warps; ++w) b = max(b, scratch[w]);
        if (b) atomicMax(top, b);
    }
}

// ---- scale ------------------------------------------------------------------------------------
// The 4 bytes of M (float32, little-endian, as a payload holds them) at `p`, which may be
// unaligned: read and written a byte at a time.
__device__ __forceinline__ u32 tlc_load_scale(const u8* p) {
    return (u32)p[0] | ((u32)p[1] << 8) | ((u32)p[2] << 16) | ((u32)p[3] << 24);
}

__device__ __forceinline__ bool tlc_is_nan(u32 bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }

// One thread: scale = M = top * s rounded to nearest even and clamped to FLT_MAX, as the twin's
// float32 product (s in [1, 2), its bits `s_bits`), in integers: a GPU's float multiply would
// flush a denormal top or M to zero. top >= 0x7F800000 (NaN/Inf met) writes a quiet NaN, the
// "not encodable" mark mpicomp_threelc_quartic_encode does nothing on.
extern "C" __global__ void mpicomp_threelc_scale(const u32* top, u32 s_bits, u8* scale) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u32 t = top[0];
    u32 bits = 0;
    if (t >= 0x7f800000u) {
        bits = 0x7fc00000u;
    } else if (t != 0) {
        const u64 ms = (s_bits & 0x7fffffu) | 0x800000u;
        const bool normal = t >= 0x800000u;
        const u64 mt = normal ? (u64)((t & 0x7fffffu) | 0x800000u) : (u64)t;
        const int e = (normal ? (int)(t >> 23) - 150 : -149) - 23;  // top * s = p * 2^e
        const u64 p = mt * ms;
        const int width = 64 - __clzll((long long)p);
        int q = e + width - 24;  // M = m * 2^q, m of 24 bits (fewer when denormal)
        if (q < -149) q = -149;
        const int shift = q - e;  // >= 23: every product has its low bits to round off
        u64 m = p >> shift;
        const u64 rem = p & ((1ull << shift) - 1), half = 1ull << (shift - 1);
        if (rem > half || (rem == half && (m & 1))) ++m;
        if (m == (1ull << 24)) {
            m >>= 1;
            ++q;
        }
        if (m < (1ull << 23))
            bits = (u32)m;  // denormal (q == -149)
        else if (q + 150 >= 255)
            bits = 0x7f7fffffu;  // FLT_MAX
        else
            bits = ((u32)(q + 150) << 23) | ((u32)m & 0x7fffffu);
    }
    for (int b = 0; b < 4; ++b) scale[b] = (u8)(bits >> (8 * b));
}

// ---- quartic encode ---------------------------------------------------------------------------
// Byte j = sum_k digit(k*L + j) * 3^(4-k), digit = trit + 1 (0 in pad positions); with use_r,
// r = (x + r) - trit * M in the same pass. Same float operations as the twin, in the same order.
// M is read from the 4 bytes `scale_bytes`; a NaN M (x + r was not finite) writes nothing.
extern "C" __global__ void mpicomp_threelc_quartic_encode(const float* x, float* r, int use_r,
                                                          const u8* scale_bytes, i64 n, i64 L,
                                                          u8* out) {
    const u32 scale_bits = tlc_load_scale(scale_bytes);
    if (tlc_is_nan(scale_bits)) return;
    const float scale = __uint_as_float(scale_bits);
    MPICOMP_FOR(j, L) {
        u32 byte = 0;
        for (int k = 0; k < 5; ++k) {
            const i64 i = (i64)k * L + j;
            u32 digit = 0;
            if (i < n) {
                const float v = use_r ? x[i] + r[i] : x[i];
                digit = 1;
                // round-half-to-even(v / M) for |v / M| <= 1: exactly +-0.5 rounds to 0.
                if (scale > 0.f) {
                    const float q = v / scale;
                    if (q > 0.5f)
                        digit = 2;
                    else if (q < -0.5f)
                        digit = 0;
                }
                if (use_r) r[i] = digit == 2 ? v - scale : (digit == 0 ? v + scale : v);
            }
            byte = byte * 3u + digit;
        }
        out[j] = (u8)byte;
    }
}

// ---- zero-run encode --------------------------------------------------------------------------
// A byte is emitted for every byte != ZB, and for every ZB at offset t % MAX_RUN == 0 of its run
// (t = i - p - 1, p the last position < i holding a byte != ZB, or -1): the greedy twin's chunks.
// p comes from a max-scan of "positions holding a byte != ZB"; output offsets from a sum-scan.

// Per span b: last[b] = its last position holding a byte != ZB (-1 if none); lead[b] = its ZB
// bytes before the first such position (their emits depend on the spans before: the tail counts
// them); rest[b] = the bytes it emits from that position on.
extern "C" __global__ void mpicomp_threelc_zero_run_summary(const u8* src, i64 L, i64 span,
                                                            i64 nspans, i64* last, i64* lead,
                                                            i64* rest) {
    __shared__ i64 scratch64[32];
    __shared__ u64 scratch_sum[32];
    for (i64 b = blockIdx.x; b < nspans; b += gridDim.x) {
        const i64 start = tlc_min64(L, b * span), end = tlc_min64(L, start + span);
        i64 carry = start - 1;  // below start: no byte != ZB seen in this span yet
        u64 counts = 0;         // emits in the low half, lead bytes in the high half
        for (i64 base = start; base < end; base += (i64)blockDim.x * TLC_ITEMS) {
            const i64 i0 = base + (i64)threadIdx.x * TLC_ITEMS;
            i64 mine = -1;
            for (int q = 0; q < TLC_ITEMS; ++q)
                if (i0 + q < end && src[i0 + q] != TLC_ZB) mine = i0 + q;
            i64 tile_last;
            i64 p = tlc_max64(carry, mpicomp_block_exclusive_max(mine, -1, scratch64, &tile_last));
            u64 c = 0;
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) {
                const i64 i = i0 + q;
                if (src[i] != TLC_ZB) {
                    p = i;
                    c += 1;
                } else if (p < start) {
                    c += 1ull << 32;
                } else if ((i - p - 1) % MPICOMP_THREELC_MAX_RUN == 0) {
                    c += 1;
                }
            }
            // At most 8 * 1024 * ITEMS per tile: neither half carries into the other.
            counts += mpicomp_block_sum<u64>(c, scratch_sum);
            carry = tlc_max64(carry, tile_last);
        }
        if (threadIdx.x == 0) {
            last[b] = carry >= start ? carry : -1;
            lead[b] = (i64)(counts >> 32);
            rest[b] = (i64)(counts & 0xffffffffull);
        }
    }
}

// One thread: per span, p before it (pin) and its output offset (offs); total[0] = the length.
extern "C" __global__ void mpicomp_threelc_zero_run_tail(const i64* last, const i64* lead,
                                                         const i64* rest, i64 nspans, i64 L,
                                                         i64 span, i64* pin, i64* offs,
                                                         i64* total) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 p = -1, off = 0;
    for (i64 b = 0; b < nspans; ++b) {
        const i64 start = tlc_min64(L, b * span);
        pin[b] = p;
        offs[b] = off;
        // The lead bytes sit at run offsets t0 .. t0 + lead - 1: each multiple of MAX_RUN emits.
        const i64 t0 = start - p - 1, t1 = t0 + lead[b], m = MPICOMP_THREELC_MAX_RUN;
        off += (t1 + m - 1) / m - (t0 + m - 1) / m + rest[b];
        if (last[b] >= 0) p = last[b];
    }
    total[0] = off;
}

// Write the emitted bytes of every span at offs[b] on (p before the span: pin[b]).
extern "C" __global__ void mpicomp_threelc_zero_run_write(const u8* src, i64 L, i64 span,
                                                          i64 nspans, const i64* pin,
                                                          const i64* offs, u8* dst) {
    __shared__ i64 scratch64[32];
    __shared__ u32 scratch32[32];
    for (i64 b = blockIdx.x; b < nspans; b += gridDim.x) {
        const i64 start = tlc_min64(L, b * span), end = tlc_min64(L, start + span);
        i64 carry = pin[b], off = offs[b];
        for (i64 base = start; base < end; base += (i64)blockDim.x * TLC_ITEMS) {
            const i64 i0 = base + (i64)threadIdx.x * TLC_ITEMS;
            i64 mine = -1;
            for (int q = 0; q < TLC_ITEMS; ++q)
                if (i0 + q < end && src[i0 + q] != TLC_ZB) mine = i0 + q;
            i64 tile_last;
            const i64 p0 = tlc_max64(carry, mpicomp_block_exclusive_max(mine, -1, scratch64, &tile_last));
            i64 p = p0;
            u32 c = 0;
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) {
                const i64 i = i0 + q;
                if (src[i] != TLC_ZB) {
                    p = i;
                    ++c;
                } else if ((i - p - 1) % MPICOMP_THREELC_MAX_RUN == 0) {
                    ++c;
                }
            }
            u32 tile_count;
            i64 k = off + mpicomp_block_exclusive_scan<u32>(c, scratch32, &tile_count);
            p = p0;
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) {
                const i64 i = i0 + q;
                const u8 v = src[i];
                if (v != TLC_ZB) {
                    p = i;
                    dst[k++] = v;
                } else if ((i - p - 1) % MPICOMP_THREELC_MAX_RUN == 0) {
                    // The chunk runs to the next byte != ZB (in any span), at most MAX_RUN long.
                    int len = 1;
                    while (len < MPICOMP_THREELC_MAX_RUN && i + len < L && src[i + len] == TLC_ZB)
                        ++len;
                    dst[k++] = (u8)(len == 1 ? TLC_ZB : MPICOMP_THREELC_RUN_BASE + len - 2);
                }
            }
            off += tile_count;
            carry = tlc_max64(carry, tile_last);
        }
    }
}

// ---- zero-run decode --------------------------------------------------------------------------
// Code c >= RUN_BASE expands to c - RUN_BASE + 2 bytes ZB, any other byte to itself.
__device__ __forceinline__ u32 tlc_width(u8 c) {
    return c >= MPICOMP_THREELC_RUN_BASE ? (u32)c - (MPICOMP_THREELC_RUN_BASE - 2) : 1u;
}

// sums[b] = the decoded length of span b.
extern "C" __global__ void mpicomp_threelc_zero_run_sums(const u8* src, i64 L, i64 span,
                                                         i64 nspans, i64* sums) {
    __shared__ u64 scratch[32];
    for (i64 b = blockIdx.x; b < nspans; b += gridDim.x) {
        const i64 start = tlc_min64(L, b * span), end = tlc_min64(L, start + span);
        u64 acc = 0;
        for (i64 base = start; base < end; base += (i64)blockDim.x * TLC_ITEMS) {
            const i64 i0 = base + (i64)threadIdx.x * TLC_ITEMS;
            u64 w = 0;
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) w += tlc_width(src[i0 + q]);
            acc += mpicomp_block_sum<u64>(w, scratch);
        }
        if (threadIdx.x == 0) sums[b] = (i64)acc;
    }
}

// One thread: offs = exclusive prefix sums of sums; total[0] = the decoded length.
extern "C" __global__ void mpicomp_threelc_zero_run_offsets(const i64* sums, i64 nspans,
                                                            i64* offs, i64* total) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 off = 0;
    for (i64 b = 0; b < nspans; ++b) {
        offs[b] = off;
        off += sums[b];
    }
    total[0] = off;
}

// Expand every span at offs[b] into dst[0, Ld) (what falls at or past Ld is dropped, as the twin
// stops there), then fill dst[total, Ld) with ZB: dst ends as the twin leaves it.
extern "C" __global__ void mpicomp_threelc_zero_run_expand(const u8* src, i64 L, i64 span,
                                                           i64 nspans, const i64* offs,
                                                           const i64* total, u8* dst, i64 Ld) {
    __shared__ u32 scratch[32];
    for (i64 b = blockIdx.x; b < nspans; b += gridDim.x) {
        const i64 start = tlc_min64(L, b * span), end = tlc_min64(L, start + span);
        i64 off = offs[b];
        for (i64 base = start; base < end; base += (i64)blockDim.x * TLC_ITEMS) {
            const i64 i0 = base + (i64)threadIdx.x * TLC_ITEMS;
            u32 w = 0;
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) w += tlc_width(src[i0 + q]);
            u32 tile_width;
            i64 k = off + mpicomp_block_exclusive_scan<u32>(w, scratch, &tile_width);
            for (int q = 0; q < TLC_ITEMS && i0 + q < end; ++q) {
                const u8 c = src[i0 + q];
                const u32 width = tlc_width(c);
                if (c >= MPICOMP_THREELC_RUN_BASE) {
                    for (u32 e = 0; e < width && k + e < Ld; ++e) dst[k + e] = (u8)TLC_ZB;
                } else if (k < Ld) {
                    dst[k] = c;
                }
                k += width;
            }
            off += tile_width;
        }
    }
    const i64 from = tlc_max64(0, tlc_min64(total[0], Ld));
    MPICOMP_FOR(i, Ld - from) dst[from + i] = (u8)TLC_ZB;
}

// ---- quartic decode ---------------------------------------------------------------------------
__device__ __forceinline__ u32 tlc_digit(u32 b, int k) {
    switch (k) {
        case 0: return b / 81u;
        case 1: return b / 27u % 3u;
        case 2: return b / 9u % 3u;
        case 3: return b / 3u % 3u;
        default: return b % 3u;
    }
}

// flags |= BAD_BYTE (a byte above MAX_QUARTIC), BAD_PAD (a non-zero digit in a pad position),
// BAD_ZERO (M = +-0, from the 4 bytes `scale`, and a real position's digit != 1). `flags` must
// hold 0 before the launch; the host picks the twin's error code by the twin's order of checks.
extern "C" __global__ void mpicomp_threelc_quartic_check(const u8* src, i64 L, i64 n,
                                                         const u8* scale, u32* flags) {
    // M == 0 as IEEE decides it, on the bits: a GPU comparison would take a denormal M for zero.
    const int zero_scale = (tlc_load_scale(scale) & 0x7fffffffu) == 0;
    u32 bad = 0;
    MPICOMP_FOR(j, L) {
        const u32 b = src[j];
        if (b > MPICOMP_THREELC_MAX_QUARTIC) {
            bad |= MPICOMP_THREELC_BAD_BYTE;
            continue;
        }
        for (int k = 0; k < 5; ++k) {
            const u32 d = tlc_digit(b, k);
            if ((i64)k * L + j >= n) {
                if (d != 0) bad |= MPICOMP_THREELC_BAD_PAD;
            } else if (zero_scale && d != 1) {
                bad |= MPICOMP_THREELC_BAD_ZERO;
            }
        }
    }
    if (bad) atomicOr(flags, bad);  // integer bits: the same in any order
}

// out[k*L + j] = (digit k of src[j] - 1) * M for k*L + j < n, written as bit patterns: M, M with
// the sign flipped, or +0 (what the twin's scale / -scale / 0 are; no float op to flush). M is
// the 4 bytes `scale`. Nothing is written when the check set a flag (as the twin writes nothing).
extern "C" __global__ void mpicomp_threelc_quartic_decode(const u8* src, const u8* scale, i64 L,
                                                          i64 n, const u32* flags, u32* out) {
    if (flags[0]) return;
    const u32 scale_bits = tlc_load_scale(scale);
    MPICOMP_FOR(j, L) {
        const u32 b = src[j];
        for (int k = 0; k < 5; ++k) {
            const i64 i = (i64)k * L + j;
            if (i < n) {
                const u32 d = tlc_digit(b, k);
                out[i] = d == 2 ? scale_bits : (d == 0 ? scale_bits ^ 0x80000000u : 0u);
            }
        }
    }
}
