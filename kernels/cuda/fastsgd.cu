// FastSGD kernels (the FastSGD paper §3), the CUDA twin of kernels/cpu/fastsgd.py: same bytes.
//
// Exact arithmetic as in the numba twin (docs/codecs.md, "fastsgd"): the bucket sum of |v| is
// an exact integer (limbs of 32 bits, integer atomics only) rounded once to float32; every
// threshold is float64(sum) / b^L; L comes from comparisons, never from a logarithm. Float32
// values go to and from float64 through their bit patterns, never through a conversion that
// -ftz=true (or the emulation's FTZ/DAZ) would flush.
//
// Encoding works on fixed chunks of FS_CHUNK elements that never cross a bucket (chunk j of
// bucket k covers [k*bucket + j*FS_CHUNK, ...)); a block takes one chunk at a time:
//   sum      per chunk: exact limbs of sum |v| added into the bucket's limbs; NaN/Inf flag
//   round    per bucket (one thread): limbs -> float32 bits of the sum
//   filter   per chunk: kept count, first and last kept index, widest gap inside the chunk
//   plan     per bucket (one block): chunk offsets of the codes, previous kept index, d, W
//   codes    per chunk: L codes into the slot, key bits of the chunk
//   finish   per bucket (one block): chunk bit offsets, header, size; zeroes the key words
//   keys     per chunk: (flag, delta) fields OR-ed into the bucket's key words, MSB first
//   copy     per chunk: key words -> key bytes of the slot
// Nothing depends on the block or grid size: chunk boundaries are fixed, and every combination
// across threads is an integer sum, max or OR.
#include "common.cuh"

#define FS_QSIZE 128    // threshold table: L = 0..127, -1 beyond tau (7-step search)
#define FS_CHUNK 2048   // elements of one chunk (fixed: results never depend on it)
#define FS_LIMBS 10     // 32-bit limbs of the exact sum: < 2^(24 + 253 + 29) < 2^320

// ---- scalar helpers ---------------------------------------------------------------------------

__device__ __forceinline__ int fs_bitlen(u64 v) { return 64 - __clzll((long long)v); }

// The float64 value of the float32 bit pattern `bits` (any sign; Inf/NaN kept), exactly.
__device__ __forceinline__ double fs_f32_to_f64(u32 bits) {
    const u32 e = (bits >> 23) & 0xFFu, m = bits & 0x7FFFFFu;
    const u64 sign = (u64)(bits >> 31) << 63;
    u64 b;
    if (e == 0) {
        const double v = (double)m * 0x1p-149;  // subnormal: exact, and a normal double
        b = (u64)__double_as_longlong(v);
    } else if (e == 255) {
        b = (0x7FFull << 52) | ((u64)m << 29);
    } else {
        b = ((u64)(e + 896) << 52) | ((u64)m << 29);  // 1023 - 127 = 896
    }
    return __longlong_as_double((long long)(b | sign));
}

// The float32 bit pattern of float64 `v` rounded to nearest even (subnormals kept, overflow to
// Inf, NaN made quiet). Integer arithmetic only: no flush to zero anywhere.
__device__ u32 fs_f64_to_f32(double v) {
    const u64 b = (u64)__double_as_longlong(v);
    const u32 sign = (u32)(b >> 32) & 0x80000000u;
    int ed = (int)((b >> 52) & 0x7FF);
    u64 md = b & 0xFFFFFFFFFFFFFull;
    if (ed == 0x7FF) return sign | (md ? 0x7FC00000u : 0x7F800000u);
    if (ed == 0) {
        if (md == 0) return sign;
        ed = 1;
    } else {
        md |= 1ull << 52;
    }
    const int E = ed - 1023;  // v = md * 2^(E - 52)
    const int sh = E >= -126 ? 29 : 29 + (-126 - E);
    u64 bits = 0;
    if (sh < 64) {
        u64 r = md >> sh;
        const u64 rem = md & ((1ull << sh) - 1), half = 1ull << (sh - 1);
        if (rem > half || (rem == half && (r & 1))) ++r;
        // normal: r holds the implicit bit, whose carry moves into the exponent field
        bits = E >= -126 ? ((u64)(E + 126) << 23) + r : r;
    }
    if (bits >= 0x7F800000ull) bits = 0x7F800000ull;
    return sign | (u32)bits;
}

// Chunk ch: its bucket k, its index j in the bucket and its element range [c0, c1).
struct FsChunk {
    i64 k, j, b0, c0, c1;
};

__device__ __forceinline__ FsChunk fs_chunk(i64 ch, i64 n, i64 bucket, i64 cpb) {
    FsChunk c;
    c.k = ch / cpb;
    c.j = ch - c.k * cpb;
    c.b0 = c.k * bucket;
    const i64 b1 = min(n, c.b0 + bucket);
    c.c0 = min(b1, c.b0 + c.j * FS_CHUNK);
    c.c1 = min(b1, c.c0 + FS_CHUNK);
    return c;
}

// ---- block helpers (every thread of the block calls) --------------------------------------------

// List in kl[0..count) the chunk-relative indices of [c0, c1) with |x| >= qtau (none when
// !any), in order; return count (to every thread).
__device__ int fs_compact(const u32* __restrict__ xbits, i64 c0, i64 c1, bool any, double qtau,
                          int* kl, int* scratch) {
    int count = 0;
    for (i64 t0 = c0; t0 < c1; t0 += blockDim.x) {
        const i64 i = t0 + threadIdx.x;
        int keep = 0;
        if (any && i < c1) keep = fs_f32_to_f64(xbits[i] & 0x7FFFFFFFu) >= qtau;
        int tile;
        const int r = mpicomp_block_exclusive_scan(keep, scratch, &tile);
        if (keep) kl[count + r] = (int)(i - c0);
        count += tile;
    }
    __syncthreads();
    return count;
}

// ---- powers ----------------------------------------------------------------------------------

// p[L] = b^L for L = 0..tau, each the previous one times b (one thread: a chain of tau products).
extern "C" __global__ void mpicomp_fastsgd_powers(double base, i64 tau, double* p) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    double v = 1.0;
    p[0] = v;
    for (i64 L = 1; L <= tau; ++L) {
        v = v * base;
        p[L] = v;
    }
}

// ---- encode ----------------------------------------------------------------------------------

extern "C" __global__ void mpicomp_fastsgd_sum(const u32* __restrict__ xbits, i64 n, i64 bucket,
                                               i64 cpb, i64 nchunks, u64* acc, int* bad) {
    __shared__ u64 limbs[FS_LIMBS];
    __shared__ int sbad;
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        const FsChunk c = fs_chunk(ch, n, bucket, cpb);
        if (threadIdx.x < FS_LIMBS) limbs[threadIdx.x] = 0;
        if (threadIdx.x == 0) sbad = 0;
        __syncthreads();
        u64 my[FS_LIMBS];
#pragma unroll
        for (int t = 0; t < FS_LIMBS; ++t) my[t] = 0;
        int mybad = 0;
        for (i64 i = c.c0 + threadIdx.x; i < c.c1; i += blockDim.x) {
            const u32 u = xbits[i] & 0x7FFFFFFFu, e = u >> 23;
            mybad |= e == 255;
            const u64 m = (u & 0x7FFFFFu) | (e ? 0x800000u : 0u);
            // m * 2^(max(e,1) - 1) in units of 2^-149: 55 bits at most, over two 32-bit limbs
            const int e1 = (int)(e ? e : 1) - 1;
            const u64 v = m << (e1 & 31);
            const int l0 = e1 >> 5;
            const u64 lo = v & 0xFFFFFFFFull, hi = v >> 32;
#pragma unroll
            for (int t = 0; t < FS_LIMBS; ++t) {
                my[t] += t == l0 ? lo : 0;
                my[t] += t == l0 + 1 ? hi : 0;
            }
        }
#pragma unroll
        for (int t = 0; t < FS_LIMBS; ++t)
            if (my[t]) atomicAdd(&limbs[t], my[t]);
        if (mybad) atomicOr(&sbad, 1);
        __syncthreads();
        // each limb < 2^29 * 2^32 per bucket: no overflow
        if (threadIdx.x < FS_LIMBS && limbs[threadIdx.x])
            atomicAdd(&acc[c.k * FS_LIMBS + threadIdx.x], limbs[threadIdx.x]);
        if (threadIdx.x == 0 && sbad) atomicOr(&bad[c.k], 1);
        __syncthreads();
    }
}

// sbits[k] = float32 bits of the exact sum (round half to even, saturated at FLT_MAX).
extern "C" __global__ void mpicomp_fastsgd_round(const u64* acc, const int* bad, i64 nb,
                                                 u32* sbits, int* anybad) {
    MPICOMP_FOR(k, nb) {
        if (bad[k]) {
            sbits[k] = 0;
            atomicOr(anybad, 1);
            continue;
        }
        u32 w[FS_LIMBS];
        u64 carry = 0;
        for (int t = 0; t < FS_LIMBS; ++t) {
            const u64 s = acc[k * FS_LIMBS + t] + carry;
            w[t] = (u32)s;
            carry = s >> 32;
        }
        int top = -1;
        for (int t = FS_LIMBS - 1; t >= 0 && top < 0; --t)
            if (w[t]) top = t * 32 + 31 - __clz((int)w[t]);
        u64 bits = 0;
        if (top >= 0) {
            const int sh = top > 23 ? top - 23 : 0;  // keep 24 significant bits
            u64 mant = 0;
            for (int b = top; b >= sh; --b) mant = (mant << 1) | ((w[b >> 5] >> (b & 31)) & 1u);
            if (sh > 0) {
                const int hb = sh - 1;
                const u32 half = (w[hb >> 5] >> (hb & 31)) & 1u;
                u32 sticky = w[hb >> 5] & ((1u << (hb & 31)) - 1u);
                for (int t = 0; t < (hb >> 5); ++t) sticky |= w[t];
                if (half && (sticky || (mant & 1))) ++mant;
            }
            bits = ((u64)sh << 23) + mant;  // a rounding carry moves into the exponent
            if (bits > 0x7F7FFFFFull) bits = 0x7F7FFFFFull;
        }
        sbits[k] = (u32)bits;
    }
}

extern "C" __global__ void mpicomp_fastsgd_filter(const u32* __restrict__ xbits, i64 n,
                                                  i64 bucket, i64 cpb, i64 nchunks,
                                                  const double* powers, i64 tau,
                                                  const u32* sbits, const int* bad,
                                                  i64* ccount, i64* cfirst, i64* clast,
                                                  i64* cgap) {
    __shared__ int kl[FS_CHUNK];
    __shared__ int scratch[32];
    __shared__ int gap;
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        const FsChunk c = fs_chunk(ch, n, bucket, cpb);
        if (bad[c.k]) continue;  // uniform over the block
        const double s = fs_f32_to_f64(sbits[c.k]);
        if (threadIdx.x == 0) gap = 0;
        const int count = fs_compact(xbits, c.c0, c.c1, s > 0.0, s / powers[tau], kl, scratch);
        int mine = 0;
        for (int r = 1 + threadIdx.x; r < count; r += blockDim.x) mine = max(mine, kl[r] - kl[r - 1]);
        if (mine) atomicMax(&gap, mine);
        __syncthreads();
        if (threadIdx.x == 0) {
            const i64 rel = c.j * FS_CHUNK;
            ccount[ch] = count;
            cfirst[ch] = count ? rel + kl[0] : 0;
            clast[ch] = count ? rel + kl[count - 1] : -1;
            cgap[ch] = gap;
        }
        __syncthreads();
    }
}

// Per bucket: coff (codes before each chunk), cprev (the bucket-relative kept index before the
// chunk, 0 when none: the first delta counts from 0), d and W.
extern "C" __global__ void mpicomp_fastsgd_plan(i64 nb, i64 cpb, const int* bad,
                                                const i64* ccount, const i64* cfirst,
                                                const i64* clast, const i64* cgap, i64* coff,
                                                i64* cprev, i64* dk, int* wk) {
    __shared__ i64 scratch[32];
    __shared__ u64 widest;
    for (i64 k = blockIdx.x; k < nb; k += gridDim.x) {
        if (bad[k]) continue;
        if (threadIdx.x == 0) widest = 0;
        i64 run = 0, last = -1;
        for (i64 t0 = 0; t0 < cpb; t0 += blockDim.x) {
            const i64 j = t0 + threadIdx.x, ch = k * cpb + j;
            const bool in = j < cpb;
            const i64 cnt = in ? ccount[ch] : 0;
            i64 tile, tmax;
            const i64 before = mpicomp_block_exclusive_scan(cnt, scratch, &tile);
            const i64 prevl = max(last, mpicomp_block_exclusive_max(in && cnt ? clast[ch] : -1, -1,
                                                              scratch, &tmax));
            if (in) {
                coff[ch] = run + before;
                cprev[ch] = prevl < 0 ? 0 : prevl;
                if (cnt) {
                    const i64 delta = cfirst[ch] - (prevl < 0 ? 0 : prevl);
                    const i64 wide = max(delta, cgap[ch]);
                    if (wide) atomicMax(&widest, (u64)wide);
                }
            }
            run += tile;
            last = max(last, tmax);
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            dk[k] = run;
            wk[k] = fs_bitlen(widest);
        }
        __syncthreads();
    }
}

// Width table of W and flag_bits (as mpicomp_fastsgd_widths); one thread fills it.
__device__ void fs_widths(int W, int fb, int* width, int* flag_of) {
    const int nflags = 1 << fb;
    for (int c = 0; c < nflags; ++c) width[c] = ((c + 1) * W + nflags - 1) >> fb;
    int c = 0;
    for (int k = 0; k <= W; ++k) {
        while (width[c] < k) ++c;
        flag_of[k] = c;
    }
}

extern "C" __global__ void mpicomp_fastsgd_codes(
    const u32* __restrict__ xbits, i64 n, i64 bucket, i64 cpb, i64 nchunks, const double* powers,
    i64 tau, i64 fb, const u32* sbits, const int* bad, const i64* coff, const i64* cprev,
    const int* wk, u8* scratch_out, i64 cap, i64* cbits) {
    __shared__ int kl[FS_CHUNK];
    __shared__ double q[FS_QSIZE];
    __shared__ int width[32], flag_of[33];
    __shared__ int iscratch[32];
    __shared__ i64 lscratch[32];
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        const FsChunk c = fs_chunk(ch, n, bucket, cpb);
        if (bad[c.k]) continue;
        const double s = fs_f32_to_f64(sbits[c.k]);
        for (int L = threadIdx.x; L < FS_QSIZE; L += blockDim.x) q[L] = L <= tau ? s / powers[L] : -1.0;
        if (threadIdx.x == 0) fs_widths(wk[c.k], (int)fb, width, flag_of);
        const int count = fs_compact(xbits, c.c0, c.c1, s > 0.0, s / powers[tau], kl, iscratch);
        u8* codes = scratch_out + c.k * cap + MPICOMP_FASTSGD_HEAD + coff[ch];
        const i64 rel = c.j * FS_CHUNK, prev0 = cprev[ch];
        i64 bits = 0;
        for (int r = threadIdx.x; r < count; r += blockDim.x) {
            const u32 u = xbits[c.c0 + kl[r]], ua = u & 0x7FFFFFFFu;
            const double a = fs_f32_to_f64(ua);  // exact, subnormals too (no float32 math)
            // L = the smallest L with q[L] <= a, by the 7-step search over q (non-increasing,
            // -1 beyond tau; a >= q[tau], as a was kept). The numba twin finds the same L in
            // its table of float32 cells for a normal a, and by this search for a subnormal a
            // (whose cell, of exponent field 0, can hold many thresholds).
            int L = 0;
            for (int step = FS_QSIZE >> 1; step; step >>= 1) L += q[L + step - 1] > a ? step : 0;
            codes[r] = (u8)(L | ((u >> 31) << 7));
            const i64 delta = rel + kl[r] - (r ? rel + kl[r - 1] : prev0);
            bits += fb + width[flag_of[fs_bitlen((u64)delta)]];
        }
        const i64 total = mpicomp_block_sum(bits, lscratch);
        if (threadIdx.x == 0) cbits[ch] = total;
        __syncthreads();
    }
}

// Per bucket: chunk bit offsets, the header and the size (0 for a NaN/Inf bucket, which writes
// nothing); zeroes the words the keys are OR-ed into.
extern "C" __global__ void mpicomp_fastsgd_finish(i64 nb, i64 cpb, const int* bad,
                                                  const u32* sbits, const i64* dk, const int* wk,
                                                  const i64* cbits, i64* cboff, i64* kbytes,
                                                  u32* words, i64 wcap, u8* scratch_out, i64 cap,
                                                  i64* sizes) {
    __shared__ i64 scratch[32];
    for (i64 k = blockIdx.x; k < nb; k += gridDim.x) {
        if (bad[k]) {
            if (threadIdx.x == 0) sizes[k] = 0;
            continue;
        }
        i64 run = 0;
        for (i64 t0 = 0; t0 < cpb; t0 += blockDim.x) {
            const i64 j = t0 + threadIdx.x;
            const i64 b = j < cpb ? cbits[k * cpb + j] : 0;
            i64 tile;
            const i64 before = mpicomp_block_exclusive_scan(b, scratch, &tile);
            if (j < cpb) cboff[k * cpb + j] = run + before;
            run += tile;
        }
        const i64 key_bytes = (run + 7) >> 3, d = dk[k];
        for (i64 t = threadIdx.x; t < (run + 31) >> 5; t += blockDim.x) words[k * wcap + t] = 0;
        if (threadIdx.x < 13) {
            const u32 fields[3] = {sbits[k], (u32)d, (u32)key_bytes};
            const int t = threadIdx.x;
            scratch_out[k * cap + t] = t < 12 ? (u8)(fields[t >> 2] >> (8 * (t & 3))) : (u8)wk[k];
        }
        if (threadIdx.x == 0) {
            kbytes[k] = key_bytes;
            sizes[k] = MPICOMP_FASTSGD_HEAD + d + key_bytes;
        }
    }
}

extern "C" __global__ void mpicomp_fastsgd_keys(const u32* __restrict__ xbits, i64 n, i64 bucket,
                                                i64 cpb, i64 nchunks, const double* powers,
                                                i64 tau, i64 fb, const u32* sbits,
                                                const int* bad, const i64* cprev, const int* wk,
                                                const i64* cboff, u32* words, i64 wcap) {
    __shared__ int kl[FS_CHUNK];
    __shared__ int width[32], flag_of[33];
    __shared__ int iscratch[32];
    __shared__ i64 lscratch[32];
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        const FsChunk c = fs_chunk(ch, n, bucket, cpb);
        if (bad[c.k]) continue;
        const double s = fs_f32_to_f64(sbits[c.k]);
        if (threadIdx.x == 0) fs_widths(wk[c.k], (int)fb, width, flag_of);
        const int count = fs_compact(xbits, c.c0, c.c1, s > 0.0, s / powers[tau], kl, iscratch);
        const i64 rel = c.j * FS_CHUNK, prev0 = cprev[ch];
        u32* w = words + c.k * wcap;
        i64 run = cboff[ch];
        for (int r0 = 0; r0 < count; r0 += blockDim.x) {
            const int r = r0 + threadIdx.x;
            i64 len = 0;
            u64 field = 0;
            if (r < count) {
                const i64 delta = rel + kl[r] - (r ? rel + kl[r - 1] : prev0);
                const int f = flag_of[fs_bitlen((u64)delta)];
                len = fb + width[f];
                field = ((u64)f << width[f]) | (u64)delta;
            }
            i64 tile;
            const i64 off = run + mpicomp_block_exclusive_scan(len, lscratch, &tile);
            if (len) {
                // bits [off, off + len) of the stream, MSB first: up to 3 words (sh + len <= 65)
                const i64 wi = off >> 5;
                const int tot = (int)(off & 31) + (int)len;
                u64 hi;
                u32 lo = 0;
                if (tot <= 64) {
                    hi = field << (64 - tot);
                } else {
                    hi = field >> (tot - 64);
                    lo = (u32)(field << (96 - tot));
                }
                if (hi >> 32) atomicOr(&w[wi], (u32)(hi >> 32));
                if ((u32)hi) atomicOr(&w[wi + 1], (u32)hi);
                if (lo) atomicOr(&w[wi + 2], lo);
            }
            run += tile;
        }
        __syncthreads();
    }
}

// Key bytes of chunk ch: from its first bit's byte up to the next chunk's (the bucket's last
// chunk: up to key_bytes), so chunks write disjoint bytes.
extern "C" __global__ void mpicomp_fastsgd_copy(i64 nb, i64 cpb, const int* bad, const i64* dk,
                                                const i64* kbytes, const i64* cboff,
                                                const u32* words, i64 wcap, u8* scratch_out,
                                                i64 cap) {
    const i64 nchunks = nb * cpb;
    for (i64 ch = blockIdx.x; ch < nchunks; ch += gridDim.x) {
        const i64 k = ch / cpb, j = ch - k * cpb;
        if (bad[k]) continue;
        const i64 b0 = cboff[ch] >> 3, b1 = j + 1 < cpb ? cboff[ch + 1] >> 3 : kbytes[k];
        u8* out = scratch_out + k * cap + MPICOMP_FASTSGD_HEAD + dk[k];
        const u32* w = words + k * wcap;
        for (i64 i = b0 + threadIdx.x; i < b1; i += blockDim.x)
            out[i] = (u8)(w[i >> 2] >> (24 - 8 * (i & 3)));
    }
}

// ---- assemble --------------------------------------------------------------------------------

#define FS_PIECE 4096  // bytes of one (bucket, piece) work item

extern "C" __global__ void mpicomp_fastsgd_assemble(const u8* __restrict__ scratch_in, i64 cap,
                                                    const i64* sizes, const i64* offsets, i64 nb,
                                                    i64 ppb, u8* body) {
    for (i64 it = blockIdx.x; it < nb * ppb; it += gridDim.x) {
        const i64 k = it / ppb, p0 = (it - k * ppb) * FS_PIECE;
        const i64 p1 = min(sizes[k], p0 + FS_PIECE);
        for (i64 i = p0 + threadIdx.x; i < p1; i += blockDim.x)
            body[offsets[k] + i] = scratch_in[k * cap + i];
    }
}

// ---- scan ------------------------------------------------------------------------------------

__device__ __forceinline__ i64 fs_get_u32(const u8* p) {
    return (i64)p[0] | ((i64)p[1] << 8) | ((i64)p[2] << 16) | ((i64)p[3] << 24);
}

// One thread walks the bucket headers (each offset follows from the one before); err[0] gets
// the error code. On an error every bucket from the failing one on is left empty (its offset
// and the next equal, its sum 0), as in the numba twin: the decode may run before the error
// is read, and reads only the buckets the walk checked.
extern "C" __global__ void mpicomp_fastsgd_scan(const u8* body, i64 size, i64 n, i64 bucket,
                                                i64 fb, i64* offsets, u32* sums, i64 nb,
                                                i64* err) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    i64 pos = MPICOMP_FASTSGD_PREFIX;
    for (i64 k = 0; k < nb; ++k) {
        const i64 blen = min(n - k * bucket, bucket);
        i64 e = MPICOMP_FASTSGD_OK, sb = 0, d = 0, kb = 0;
        if (size - pos < MPICOMP_FASTSGD_HEAD) {
            e = MPICOMP_FASTSGD_ERR_TRUNCATED;
        } else {
            sb = fs_get_u32(body + pos);
            d = fs_get_u32(body + pos + 4);
            kb = fs_get_u32(body + pos + 8);
            const i64 W = body[pos + 12];
            if (sb >= 0x7F800000ll) e = MPICOMP_FASTSGD_ERR_SUM;
            else if (d > blen) e = MPICOMP_FASTSGD_ERR_COUNT;
            else if (d > 0 && sb == 0) e = MPICOMP_FASTSGD_ERR_SUM;
            else if (W > fs_bitlen((u64)(blen - 1))) e = MPICOMP_FASTSGD_ERR_WIDTH;
            else if (d == 0 && (W != 0 || kb != 0)) e = MPICOMP_FASTSGD_ERR_WIDTH;
            else if (kb * 8 < d * fb || kb > (d * (fb + W) + 7) / 8) e = MPICOMP_FASTSGD_ERR_WIDTH;
            else if (size - pos - MPICOMP_FASTSGD_HEAD < d + kb) e = MPICOMP_FASTSGD_ERR_TRUNCATED;
        }
        if (e != MPICOMP_FASTSGD_OK) {
            for (i64 r = k; r < nb; ++r) {
                offsets[r] = pos;
                sums[r] = 0;
            }
            offsets[nb] = pos;
            err[0] = e;
            return;
        }
        offsets[k] = pos;
        sums[k] = (u32)sb;
        pos += MPICOMP_FASTSGD_HEAD + d + kb;
    }
    offsets[nb] = pos;
    err[0] = pos != size ? MPICOMP_FASTSGD_ERR_TRAILING : MPICOMP_FASTSGD_OK;
}

// ---- decode ----------------------------------------------------------------------------------
//
// A block per bucket (grid-stride over buckets), walking the bucket's key stream in rounds of
// blockDim.x segments of FS_SEG bits, a thread per segment. The (flag, delta) fields delimit
// themselves, but where a segment's first field starts depends on every field before it. It
// starts at one of fb + W bit offsets from the segment's start (the phases: no field is
// wider), so each round:
//   1. paths    each thread follows its segment's fields from every phase: the table of the
//               phase each path leaves into the next segment at (FS_DEAD: the stream ends);
//               a path that meets phase 0's path stops there (the rest is the same)
//   2. compose  an inclusive scan of the tables over the block by function composition
//               (Hillis-Steele): every segment's true phase, from the round's first one
//   3. count    each thread walks its true path: its fields and the sum of their deltas;
//               block-wide exclusive scans give each segment's first key index and key
//   4. check    each thread walks again with its keys known, with the numba twin's checks
//               per key in its order (code <= tau, then flag, order, inside the bucket); the
//               smallest failing key index over the block (a min) ends the bucket; keys go to
//               shared memory
//   5. write    the keys before that index: the slice zeroed up to the last one (coalesced),
//               then the values, a thread per key (neighbouring keys, neighbouring threads)
// After the last round: the checks of the stream's end (too few fields, padding, exact W). The
// same checks of the same keys in the same order as the twin's serial walk: the same error
// code, and the same writes before it.

#define FS_SEG 64                 // stream bits of one segment (more than the widest field)
#define FS_PHASES 34              // phases of a segment: fb + W <= 5 + 29
#define FS_DEAD 255               // the phase of a path on which the stream ends
#define FS_DT 128                 // most threads of a decode block (sizes its shared arrays)
#define FS_SEG_KEYS (FS_SEG / 2)  // valid keys of a segment: W >= 1 makes every field >= 2 bits
#define FS_NONE 0x7FFFFFFFFFFFFFFFll

// out[i] = 0 for i in [a, b), by the threads of the block.
__device__ __forceinline__ void fs_zero(float* o, i64 a, i64 b) {
    for (i64 i = a + threadIdx.x; i < b; i += blockDim.x) o[i] = 0.0f;
}

// float32 a + b rounded once (through float64, exact for a sum of two float32 values), without
// the flush to zero a float32 add has under -ftz=true.
__device__ __forceinline__ float fs_add(float a, u32 b) {
    const double s = fs_f32_to_f64(__float_as_uint(a)) + fs_f32_to_f64(b);
    return __uint_as_float(fs_f64_to_f32(s));
}

// The stream bits [start, start + 128) of a segment, MSB first, zero past the stream's end.
struct FsWindow {
    u64 w0, w1;
    i64 start;
};

__device__ FsWindow fs_window(const u8* stream, i64 slen, i64 start) {
    FsWindow g;
    g.start = start;
    g.w0 = g.w1 = 0;
    const i64 b0 = start >> 3;
    for (int t = 0; t < 16; ++t) {
        const u64 b = b0 + t < slen ? stream[b0 + t] : 0;
        if (t < 8) g.w0 |= b << (56 - 8 * t);
        else g.w1 |= b << (120 - 8 * t);
    }
    return g;
}

struct FsField {
    int c, len;
    i64 delta;
};

// The field at bit p < FS_SEG of the window (it ends before bit 98: inside the window).
__device__ __forceinline__ FsField fs_field(const FsWindow& g, int p, int fb, int W) {
    const u64 v = p ? (g.w0 << p) | (g.w1 >> (64 - p)) : g.w0;
    FsField f;
    f.c = (int)(v >> (64 - fb));
    const int w = ((f.c + 1) * W + (1 << fb) - 1) >> fb;
    f.len = fb + w;
    f.delta = w ? (i64)((v << fb) >> (64 - w)) : 0;
    return f;
}

// Follow the fields from bit p while they start in the segment and end in the stream (avail
// bits), calling visit(field, its end) until it returns false; return the bit reached (below
// FS_SEG only where the stream ended or visit stopped).
template <class Visit>
__device__ __forceinline__ int fs_walk(const FsWindow& g, int p, i64 avail, int fb, int W,
                                       Visit visit) {
    while (p < FS_SEG && g.start + p < avail) {
        const FsField f = fs_field(g, p, fb, W);
        if (g.start + p + f.len > avail) break;
        p += f.len;
        if (!visit(f, p)) break;
    }
    return p;
}

// Scatter bucket k's values at its keys into out (its slice zeroed first unless accumulate);
// errs[k] as the numba twin's decoder. Every branch on bucket state is uniform over the block.
extern "C" __global__ void mpicomp_fastsgd_decode(const u8* body, i64 n, i64 bucket,
                                                  const double* powers, i64 tau, i64 fb_,
                                                  const i64* offsets, const u32* sums, i64 nb,
                                                  float* out, i64* errs, int accumulate) {
    __shared__ u8 tab[2][FS_DT][FS_PHASES];     // phase tables: the scan's two buffers
    __shared__ int skeys[FS_DT * FS_SEG_KEYS];  // the round's keys, by index from its first
    __shared__ u32 vtab[FS_QSIZE];              // float32 bits of sum / b^L
    __shared__ i64 lscratch[32];
    __shared__ i64 s_err, s_used;
    __shared__ int s_code;
    const int fb = (int)fb_, T = blockDim.x, t = threadIdx.x;
    for (i64 k = blockIdx.x; k < nb; k += gridDim.x) {
        const i64 pos0 = offsets[k], start = k * bucket;
        const i64 blen = min(n, start + bucket) - start;
        float* o = out + start;
        // A bucket shorter than its header is one a failed scan left empty: nothing is read.
        const bool empty = offsets[k + 1] - pos0 < MPICOMP_FASTSGD_HEAD;
        const i64 d = empty ? 0 : fs_get_u32(body + pos0 + 4);
        i64 cursor = 0;  // elements of the slice zeroed so far
        int code = empty ? MPICOMP_FASTSGD_ERR_TRUNCATED : MPICOMP_FASTSGD_OK;
        if (d > 0) {
            const int W = body[pos0 + 12], P = fb + W;
            const u8* codes = body + pos0 + MPICOMP_FASTSGD_HEAD;
            const u8* stream = codes + d;
            const i64 slen = offsets[k + 1] - (pos0 + MPICOMP_FASTSGD_HEAD + d), avail = slen * 8;
            const i64 nseg = (avail + FS_SEG - 1) / FS_SEG;
            const double s = fs_f32_to_f64(sums[k]);
            for (int L = t; L <= tau; L += T) vtab[L] = fs_f64_to_f32(s / powers[L]);
            if (t == 0) s_err = FS_NONE;
            // Round state (the same in every thread): the phase of its first segment, the
            // index and key of the fields before it.
            int e0 = 0;
            i64 j0 = 0, key0 = 0, err = FS_NONE;
            int big = 0;  // a valid delta >= 2^(W-1): W is exact
            for (i64 seg0 = 0; seg0 < nseg; seg0 += T) {
                const FsWindow g = fs_window(stream, slen, (seg0 + t) * FS_SEG);
                // 1. paths; one that reaches a field start of phase 0's path goes on as it does
                u64 seen = 0;  // the field starts of phase 0's path in the segment
                int exit0 = FS_DEAD;
                for (int e = 0; e < P; ++e) {
                    int p = e;
                    if (e == 0 || !((seen >> e) & 1))
                        p = fs_walk(g, e, avail, fb, W, [&](const FsField&, int end) {
                            if (e == 0) {
                                seen |= end < FS_SEG ? 1ull << end : 0;
                                return true;
                            }
                            return end >= FS_SEG || !((seen >> end) & 1);
                        });
                    const int x = p >= FS_SEG              ? p - FS_SEG
                                  : e && ((seen >> p) & 1) ? exit0
                                                           : FS_DEAD;
                    if (e == 0) {
                        exit0 = x;
                        seen |= 1;
                    }
                    tab[0][t][e] = (u8)x;
                }
                __syncthreads();
                // 2. compose: tab[cur][t] = the phase after segment t from the phase before
                // segment max(0, t - 2 off + 1), for growing off
                int cur = 0;
                for (int off = 1; off < T; off <<= 1) {
                    for (int e = 0; e < P; ++e) {
                        const int h = t >= off ? tab[cur][t - off][e] : e;
                        tab[cur ^ 1][t][e] = h == FS_DEAD ? (u8)FS_DEAD : tab[cur][t][h];
                    }
                    cur ^= 1;
                    __syncthreads();
                }
                const int entry = t ? tab[cur][t - 1][e0] : e0;
                const int next = tab[cur][T - 1][e0];
                // 3. count
                i64 cnt = 0, sum = 0;
                if (entry != FS_DEAD)
                    fs_walk(g, entry, avail, fb, W, [&](const FsField& f, int) {
                        ++cnt;
                        sum += f.delta;
                        return true;
                    });
                i64 rcount, rsum;
                const i64 jb = j0 + mpicomp_block_exclusive_scan(cnt, lscratch, &rcount);
                const i64 kb = key0 + mpicomp_block_exclusive_scan(sum, lscratch, &rsum);
                // 4. check
                i64 j = jb, key = kb, mine = FS_NONE;
                int mycode = MPICOMP_FASTSGD_OK, mybig = 0;
                if (entry != FS_DEAD && jb < d)
                    fs_walk(g, entry, avail, fb, W, [&](const FsField& f, int end) {
                        if (j >= d) return false;
                        if ((codes[j] & 0x7F) > tau) {
                            mycode = MPICOMP_FASTSGD_ERR_CODE;  // checked before the key
                        } else {
                            key += f.delta;
                            const i64 least =
                                f.c ? 1ll << (((f.c * W) + (1 << fb) - 1) >> fb) : 0;
                            if (f.delta < least) mycode = MPICOMP_FASTSGD_ERR_KEY_FLAG;
                            else if ((j > 0 && f.delta == 0) || key >= blen)
                                mycode = MPICOMP_FASTSGD_ERR_KEY_ORDER;
                        }
                        if (mycode != MPICOMP_FASTSGD_OK) {
                            mine = j;
                            return false;
                        }
                        mybig |= W > 0 && (f.delta >> (W - 1)) != 0;
                        const i64 slot = j - j0;  // < FS_DT * FS_SEG_KEYS (see FS_SEG_KEYS)
                        if (slot < FS_DT * FS_SEG_KEYS) skeys[slot] = (int)key;
                        if (j == d - 1) s_used = g.start + end;
                        ++j;
                        return true;
                    });
                if (mine != FS_NONE) atomicMin(&s_err, mine);
                big |= __syncthreads_or(mybig);
                if (mine != FS_NONE && mine == s_err) s_code = mycode;  // one thread: j is its own
                err = s_err;
                // 5. write the keys before the first failure
                const i64 nvalid = min(min(err, d), j0 + rcount) - j0;
                if (nvalid > 0 && !accumulate) {
                    const i64 last = skeys[nvalid - 1];
                    fs_zero(o, cursor, last + 1);
                    cursor = last + 1;
                    __syncthreads();  // the zeros before the values
                }
                for (i64 i = t; i < nvalid; i += T) {
                    const u8 c = codes[j0 + i];
                    const u32 sign = c & MPICOMP_FASTSGD_SIGN_BIT ? 0x80000000u : 0u;
                    const u32 v = vtab[c & 0x7F] | sign;
                    const i64 at = skeys[i];
                    o[at] = accumulate ? fs_add(o[at], v) : __uint_as_float(v);
                }
                __syncthreads();  // skeys, tab and s_code are reused
                j0 += rcount;
                key0 += rsum;
                e0 = next;
                if (err != FS_NONE) {
                    code = s_code;
                    break;
                }
                if (e0 == FS_DEAD) break;  // the stream ends in this round
            }
            if (err == FS_NONE) {
                // j0 fields in all: too few, or an exact end (padding < 8 zero bits, W exact)
                if (j0 < d) {
                    code = (codes[j0] & 0x7F) > tau ? MPICOMP_FASTSGD_ERR_CODE
                                                    : MPICOMP_FASTSGD_ERR_KEY_BITS;
                } else {
                    const i64 used = s_used;
                    bool bad = avail - used >= 8 || (W > 0 && !big);
                    for (i64 b = used; b < avail && !bad; ++b)
                        bad = (stream[b >> 3] >> (7 - (b & 7))) & 1;
                    if (bad) code = MPICOMP_FASTSGD_ERR_KEY_TAIL;
                }
            }
        }
        if (!accumulate) fs_zero(o, cursor, blen);
        if (t == 0) errs[k] = code;
        __syncthreads();  // shared state is reused by the next bucket
    }
}
