// FFT sparsification (the FFT sparsification paper): CUDA twin of kernels/cpu/fft.py, same
// bytes for the same arrays. The transforms themselves are the device FFT library's (kernels/cuda/fft.py).
//
// Floats are handled as their IEEE-754 bit patterns wherever the twin does so (rounding,
// selection, the range-based N-bit float), so -ftz=true cannot touch them: comparisons of
// magnitudes against the threshold go through an order key of the bits, as numba's float
// compares (denormals included). Float arithmetic (sums, squares, the residual's difference)
// is the twin's, one operation at a time; only denormal results of it differ (flushed).
//
// Selection and scatter work in tiles of MPICOMP_FFT_TILE bins (a fixed size: no result
// depends on the grid): a count pass per tile, a scan over the tiles in one block, then a
// pass where each thread takes one bitmap byte (8 bins) and a block scan gives its slots.
// Errors that must be "the first in order" are found with an integer atomicMin over
// (index << 8 | code): the same key whatever the order the threads run in.
#include "common.cuh"

#define MPICOMP_FFT_ABS 0x7FFFFFFFll
#define MPICOMP_FFT_EXP_INF 0x7F800000ll   // +Inf's bits: every finite magnitude lies below
#define MPICOMP_FFT_FP16_MIN_NORMAL 0x38800000ll  // 2**-14
#define MPICOMP_FFT_FP16_MAX 0x477FE000ll  // 65504.0
#define MPICOMP_FFT_BINS 65536             // bins of one radix-select level (16 bits)
#define MPICOMP_FFT_NONE 0xFFFFFFFFFFFFFFFFull  // "no error yet" of the atomicMin keys

#if MPICOMP_FFT_TILE % 8 != 0
#error "a tile must hold whole bitmap bytes"
#endif

__device__ __forceinline__ i64 mpicomp_fft_min(i64 a, i64 b) { return a < b ? a : b; }
__device__ __forceinline__ i64 mpicomp_fft_max(i64 a, i64 b) { return a > b ? a : b; }

__device__ __forceinline__ bool mpicomp_fft_is_nan(u32 u) { return (u & 0x7FFFFFFFu) > 0x7F800000u; }
__device__ __forceinline__ u32 mpicomp_fft_nonfinite(u32 u) {
    return (u & 0x7F800000u) == 0x7F800000u;
}

// A key whose unsigned order is the float order of a non-NaN float32 (with -0 == +0).
__device__ __forceinline__ u32 mpicomp_fft_key(u32 u) {
    if ((u & 0x7FFFFFFFu) == 0) u = 0;
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// numba's float32 `a > b` and `a == b` on bit patterns (NaN compares false).
__device__ __forceinline__ u32 mpicomp_fft_gt(u32 a, u32 b) {
    return !mpicomp_fft_is_nan(a) && !mpicomp_fft_is_nan(b) && mpicomp_fft_key(a) > mpicomp_fft_key(b);
}
__device__ __forceinline__ u32 mpicomp_fft_eq(u32 a, u32 b) {
    return !mpicomp_fft_is_nan(a) && !mpicomp_fft_is_nan(b) && mpicomp_fft_key(a) == mpicomp_fft_key(b);
}

// 2**k as a double, for -1022 <= k <= 1023 (exact, as math.ldexp(1.0, k)).
__device__ __forceinline__ double mpicomp_fft_pow2(i64 k) {
    return __longlong_as_double((k + 1023) << 52);
}

// ---- float16 rounding ---------------------------------------------------------------------------
// Elementwise as _round_fp16_span. The twin's error is that of its first chunk of
// MPICOMP_FFT_CHUNK elements whose largest rounding exceeds 65504, and inside it that of the
// first element with NaN/Inf bits or a rounding above 65504: `bad` gets the lowest such
// chunk, chunk_err[c] the lowest (i << 8 | code) of chunk c.
extern "C" __global__ void mpicomp_fft_round_fp16(const u32* x, u32* out, i64 n, u64* chunk_err,
                                                  u64* bad) {
    MPICOMP_FOR(i, n) {
        const i64 b = x[i];
        const i64 a = b & MPICOMP_FFT_ABS;
        i64 r = (a + 0xFFF + ((a >> 13) & 1)) & 0x7FFFE000ll;
        if (a < MPICOMP_FFT_FP16_MIN_NORMAL) {
            // Adding and removing 0.5 rounds to a multiple of 2**-24 (a normal result).
            r = __float_as_uint((__uint_as_float((u32)a) + 0.5f) - 0.5f);
        }
        out[i] = (u32)(r | (b & 0x80000000ll));
        const i64 c = i / MPICOMP_FFT_CHUNK;
        // NaN/Inf count by their bits: their rounding can wrap past bit 31.
        if (r > MPICOMP_FFT_FP16_MAX || a >= MPICOMP_FFT_EXP_INF) atomicMin(bad, (u64)c);
        const int code = a >= MPICOMP_FFT_EXP_INF   ? MPICOMP_FFT_FP16_NONFINITE
                         : r > MPICOMP_FFT_FP16_MAX ? MPICOMP_FFT_FP16_OVERFLOW
                                                    : MPICOMP_FFT_FP16_OK;
        if (code != MPICOMP_FFT_FP16_OK) atomicMin(&chunk_err[c], ((u64)i << 8) | (u64)code);
    }
}

extern "C" __global__ void mpicomp_fft_round_fp16_result(const u64* chunk_err, const u64* bad,
                                                         i64* result) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const u64 c = *bad;
        *result = c == MPICOMP_FFT_NONE ? MPICOMP_FFT_FP16_OK : (i64)(chunk_err[c] & 0xFF);
    }
}

// ---- magnitudes, finiteness, residual addition ---------------------------------------------------
// |X|^2 = re*re + im*im of interleaved `spec`; flag |= 1 when a part is NaN/Inf.
extern "C" __global__ void mpicomp_fft_magnitude(const float* spec, float* mag2, i64 nbins,
                                                 u32* flag) {
    const u32* bits = (const u32*)spec;
    u32 bad = 0;
    MPICOMP_FOR(i, nbins) {
        bad |= mpicomp_fft_nonfinite(bits[2 * i]) | mpicomp_fft_nonfinite(bits[2 * i + 1]);
        const float re = spec[2 * i], im = spec[2 * i + 1];
        mag2[i] = re * re + im * im;
    }
    if (bad) atomicOr(flag, 1u);
}

// flag |= 1 when some x (float32 bits) is NaN/Inf.
extern "C" __global__ void mpicomp_fft_all_finite(const u32* x, i64 n, u32* flag) {
    u32 bad = 0;
    MPICOMP_FOR(i, n) bad |= mpicomp_fft_nonfinite(x[i]);
    if (bad) atomicOr(flag, 1u);
}

// Add the packed residual r (n values; kernels/cpu/fft.py's layout) to the n//2+1 bins of
// spec, write |X|^2 of the sums; flag |= 1 when a sum is NaN/Inf. Bin 0 and the even-n
// Nyquist bin have a real part only in r: their imaginary part gets + 0.0f, as the twin's.
extern "C" __global__ void mpicomp_fft_add_residual(float* spec, const float* r, float* mag2,
                                                    i64 n, u32* flag) {
    const i64 nbins = n / 2 + 1;
    u32 bad = 0;
    MPICOMP_FOR(j, nbins) {
        float dre, dim;
        if (j == 0) {
            dre = r[0], dim = 0.0f;
        } else if (2 * j == n) {
            dre = r[n - 1], dim = 0.0f;
        } else {
            dre = r[2 * j - 1], dim = r[2 * j];
        }
        const float re = spec[2 * j] + dre;
        const float im = spec[2 * j + 1] + dim;
        spec[2 * j] = re;
        spec[2 * j + 1] = im;
        bad |= mpicomp_fft_nonfinite(__float_as_uint(re)) | mpicomp_fft_nonfinite(__float_as_uint(im));
        mag2[j] = re * re + im * im;
    }
    if (bad) atomicOr(flag, 1u);
}

// ---- k-th largest: two-level radix select over the bit patterns --------------------------------
// Level 0 counts the top 16 bits of every value, level 1 the low 16 bits of those whose top is
// state[0]. hist: 65536 zeroed counts per level.
extern "C" __global__ void mpicomp_fft_kth_histogram(const u32* u, i64 n, i64 level,
                                                     const i64* state, u64* hist) {
    const u32 prefix = level ? (u32)state[0] : 0u;
    MPICOMP_FOR(i, n) {
        const u32 v = u[i];
        if (level == 0)
            atomicAdd(&hist[v >> 16], 1ull);
        else if ((v >> 16) == prefix)
            atomicAdd(&hist[v & 0xFFFFu], 1ull);
    }
}

// One block: walk the histogram down from the top bin until k values lie at or above it (the
// twin's rule). Each thread sums a run of bins (from the top), a block scan gives the counts
// above each run, and the one thread whose run holds the crossing walks it.
// Level 0 writes state[0] = bin, state[1] = values above it; level 1 writes state[2] =
// the bit pattern of the k-th largest value.
extern "C" __global__ void mpicomp_fft_kth_select(const u64* hist, i64 level, i64 k, i64* state) {
    __shared__ i64 scratch[32];
    const i64 above = level ? state[1] : 0;
    const i64 kk = k - above;
    const i64 per = (MPICOMP_FFT_BINS + blockDim.x - 1) / blockDim.x;
    const i64 r0 = mpicomp_fft_min(MPICOMP_FFT_BINS, (i64)threadIdx.x * per);
    const i64 r1 = mpicomp_fft_min(MPICOMP_FFT_BINS, r0 + per);
    i64 sum = 0;
    for (i64 r = r0; r < r1; ++r) sum += (i64)hist[MPICOMP_FFT_BINS - 1 - r];
    i64 total;
    const i64 before = mpicomp_block_exclusive_scan(sum, scratch, &total);
    if (before < kk && kk <= before + sum) {
        i64 acc = before;
        for (i64 r = r0; r < r1; ++r) {
            const i64 b = MPICOMP_FFT_BINS - 1 - r;
            const i64 c = (i64)hist[b];
            if (acc + c >= kk) {
                if (level == 0) {
                    state[0] = b;
                    state[1] = acc;
                } else {
                    state[2] = (state[0] << 16) | b;
                }
                break;
            }
            acc += c;
        }
    }
}

// ---- selection and prefix-sum packing --------------------------------------------------------------
// Per tile: bins above the threshold (tile_g) and at it (tile_e).
extern "C" __global__ void mpicomp_fft_select_count(const u32* mag2, i64 nbins,
                                                    const u32* thresh_p, i64* tile_g,
                                                    i64* tile_e) {
    __shared__ i64 scratch[32];
    const u32 thresh = *thresh_p;
    const i64 ntiles = (nbins + MPICOMP_FFT_TILE - 1) / MPICOMP_FFT_TILE;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const i64 lo = t * MPICOMP_FFT_TILE;
        const i64 hi = mpicomp_fft_min(nbins, lo + MPICOMP_FFT_TILE);
        i64 g = 0, e = 0;
        for (i64 i = lo + threadIdx.x; i < hi; i += blockDim.x) {
            g += mpicomp_fft_gt(mag2[i], thresh);
            e += mpicomp_fft_eq(mag2[i], thresh);
        }
        g = mpicomp_block_sum(g, scratch);
        e = mpicomp_block_sum(e, scratch);
        if (threadIdx.x == 0) {
            tile_g[t] = g;
            tile_e[t] = e;
        }
    }
}

// One block. ties = k - (bins above): bins at the threshold are taken lowest index first, so
// a tile takes min(e, max(0, ties - equal bins before it)) of them. Writes each tile's first
// dense slot (tile_first), its equal bins before it (tile_ebefore) and state[0] = ties.
extern "C" __global__ void mpicomp_fft_select_scan(const i64* tile_g, const i64* tile_e,
                                                   i64 ntiles, i64 k, i64* tile_first,
                                                   i64* tile_ebefore, i64* state) {
    __shared__ i64 scratch[32];
    i64 g = 0;
    for (i64 t = threadIdx.x; t < ntiles; t += blockDim.x) g += tile_g[t];
    const i64 ties = k - mpicomp_block_sum(g, scratch);
    i64 ecarry = 0, kcarry = 0;
    for (i64 base = 0; base < ntiles; base += blockDim.x) {
        const i64 t = base + threadIdx.x;
        const i64 e = t < ntiles ? tile_e[t] : 0;
        i64 etotal, ktotal;
        const i64 ebefore = ecarry + mpicomp_block_exclusive_scan(e, scratch, &etotal);
        const i64 take = mpicomp_fft_min(e, mpicomp_fft_max(0, ties - ebefore));
        const i64 kept = t < ntiles ? tile_g[t] + take : 0;
        const i64 first = kcarry + mpicomp_block_exclusive_scan(kept, scratch, &ktotal);
        if (t < ntiles) {
            tile_first[t] = first;
            tile_ebefore[t] = ebefore;
        }
        ecarry += etotal;
        kcarry += ktotal;
    }
    if (threadIdx.x == 0) state[0] = ties;
}

// Per tile, one thread per bitmap byte: keep bins above the threshold, and bins at it whose
// rank among those (in index order) is below ties; write the byte, the kept parts at their
// prefix-sum slots (real in dense[0:k], imaginary in dense[k:2k]), count the float32
// exponents of the nonzero kept parts into hist and their largest |bits| into *vmax.
extern "C" __global__ void mpicomp_fft_select_pack(const u32* spec, const u32* mag2, i64 nbins,
                                                   const u32* thresh_p, i64 k,
                                                   const i64* tile_first, const i64* tile_ebefore,
                                                   const i64* state, u8* bitmap, u32* dense,
                                                   i64* hist, u32* vmax) {
    __shared__ i64 scratch[32];
    __shared__ u32 block_hist[256];
    __shared__ u32 block_vmax;
    const u32 thresh = *thresh_p;
    const i64 ties = state[0];
    const i64 ntiles = (nbins + MPICOMP_FFT_TILE - 1) / MPICOMP_FFT_TILE;
    const i64 nbytes = (nbins + 7) >> 3;
    for (int e = threadIdx.x; e < 256; e += blockDim.x) block_hist[e] = 0;
    if (threadIdx.x == 0) block_vmax = 0;
    __syncthreads();
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        i64 ecarry = tile_ebefore[t], kcarry = tile_first[t];
        const i64 b0 = t * (MPICOMP_FFT_TILE / 8);
        const i64 b1 = mpicomp_fft_min(nbytes, b0 + MPICOMP_FFT_TILE / 8);
        for (i64 base = b0; base < b1; base += blockDim.x) {
            const i64 j = base + threadIdx.x;
            u32 gtm = 0, eqm = 0;
            if (j < b1) {
                for (int q = 0; q < 8; ++q) {
                    const i64 i = j * 8 + q;
                    if (i < nbins) {
                        gtm |= mpicomp_fft_gt(mag2[i], thresh) << q;
                        eqm |= mpicomp_fft_eq(mag2[i], thresh) << q;
                    }
                }
            }
            i64 etotal, ktotal;
            i64 rank = ecarry + mpicomp_block_exclusive_scan((i64)__popc(eqm), scratch, &etotal);
            u32 keep = gtm;
            for (int q = 0; q < 8; ++q) {
                if ((eqm >> q) & 1u) {
                    if (rank < ties) keep |= 1u << q;
                    ++rank;
                }
            }
            i64 slot = kcarry + mpicomp_block_exclusive_scan((i64)__popc(keep), scratch, &ktotal);
            if (j < b1) {
                bitmap[j] = (u8)keep;
                for (int q = 0; q < 8; ++q) {
                    if (!((keep >> q) & 1u)) continue;
                    const i64 i = j * 8 + q;
                    const u32 re = spec[2 * i], im = spec[2 * i + 1];
                    if (slot < k) {  // always, unless thresh and k disagree
                        dense[slot] = re;
                        dense[k + slot] = im;
                    }
                    ++slot;
                    const u32 ar = re & 0x7FFFFFFFu, ai = im & 0x7FFFFFFFu;
                    atomicMax(&block_vmax, ar > ai ? ar : ai);
                    if (ar) atomicAdd(&block_hist[ar >> 23], 1u);
                    if (ai) atomicAdd(&block_hist[ai >> 23], 1u);
                }
            }
            ecarry += etotal;
            kcarry += ktotal;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 256; e += blockDim.x)
        if (block_hist[e]) atomicAdd((u64*)&hist[e], (u64)block_hist[e]);
    if (threadIdx.x == 0 && block_vmax) atomicMax(vmax, block_vmax);
}

// ---- the range-based N-bit float (the FFT sparsification paper, Alg. 1) -------------------------
__device__ __forceinline__ double mpicomp_fft_eps_squared(i64 eps_bits) {
    const i64 e = eps_bits >> 23;
    const i64 mant = eps_bits & 0x7FFFFF;
    const double v = e > 0 ? (double)(mant | 0x800000) * mpicomp_fft_pow2(e - 150)
                           : (double)mant * mpicomp_fft_pow2(-149);
    return v * v;
}

// One block: thread per m computes the twin's error bound (float64, exponents in ascending
// order: each term is exact, the sum rounds as the twin's), thread 0 picks the smallest, ties
// to the larger m. out[0] = m, out[1] = pbase. vmax: the largest kept |part|'s bits, read
// from the device (select_pack's result).
extern "C" __global__ void mpicomp_fft_choose_range(const i64* hist, const u32* vmax_p, i64 bits,
                                                    i64* out) {
    const i64 vmax = (i64)*vmax_p;
    __shared__ double errs[MPICOMP_FFT_MAX_MANTISSA + 1];
    __shared__ i64 pbases[MPICOMP_FFT_MAX_MANTISSA + 1];
    const i64 q = (1ll << (bits - 1)) - 1;
    for (int m = threadIdx.x; m <= MPICOMP_FFT_MAX_MANTISSA; m += blockDim.x) {
        const int shift = MPICOMP_FFT_MAX_MANTISSA - m;
        const i64 pbase = mpicomp_fft_max(1, (vmax >> shift) - q + 1);
        const i64 eps_bits = pbase << shift;
        const i64 ee = eps_bits >> 23;
        const double eps2 = mpicomp_fft_eps_squared(eps_bits);
        double err = 0.0;
        for (int e = 0; e < 256; ++e) {
            const i64 c = hist[e];
            if (c == 0) continue;
            const double b2 = e > ee    ? mpicomp_fft_pow2(2 * (e - 127 - m))
                              : e == ee ? eps2
                                        : mpicomp_fft_pow2(2 * (e - 126));
            err += (double)c * b2;
        }
        errs[m] = err;
        pbases[m] = pbase;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        i64 best_m = MPICOMP_FFT_MAX_MANTISSA, best_pbase = 1;
        double best_err = __longlong_as_double(0x7FF0000000000000ll);  // +Inf
        for (int m = MPICOMP_FFT_MAX_MANTISSA; m >= 0; --m) {
            if (errs[m] < best_err) {
                best_err = errs[m];
                best_m = m;
                best_pbase = pbases[m];
            }
        }
        out[0] = best_m;
        out[1] = best_pbase;
    }
}

// Range parameters read from the device (chosen by choose_range, or a payload's fields) are
// clamped to what the shifts below can take: a corrupt payload's are refused by its caller
// when read, and meanwhile must not make a shift undefined.
__device__ __forceinline__ i64 mpicomp_fft_shift(i64 s) {
    return s < 0 ? 0 : s > MPICOMP_FFT_MAX_MANTISSA ? MPICOMP_FFT_MAX_MANTISSA : s;
}
__device__ __forceinline__ i64 mpicomp_fft_bits(i64 b) { return b < 1 ? 1 : b > 32 ? 32 : b; }

// The N-bit code of float32 bits v (sign bit on top; 0 below eps).
__device__ __forceinline__ i64 mpicomp_fft_encode(i64 v, i64 vmax, i64 pbase, int shift, int bits) {
    i64 a = v & MPICOMP_FFT_ABS;
    if (a > vmax) a = vmax;
    const i64 top = a >> shift;
    if (top < pbase) return 0;
    return (i64)(((u64)(v >> 31) << (bits - 1)) | (u64)(top - pbase + 1));
}

// The float32 bits of an N-bit code, -1 for a sign on a zero magnitude, -2 beyond float32.
__device__ __forceinline__ i64 mpicomp_fft_decode(i64 code, i64 pbase, int shift, int bits) {
    const i64 mag = code & ((1ll << (bits - 1)) - 1);
    const i64 sign = code >> (bits - 1);
    if (mag == 0) return sign ? -1 : 0;
    const i64 p = (mag + pbase - 1) << shift;
    if (p >= MPICOMP_FFT_EXP_INF) return -2;
    return (i64)(((u64)sign << 31) | (u64)p);
}

// One thread per group of eight codes (exactly `bits` bytes of out), LSB-first.
extern "C" __global__ void mpicomp_fft_quantize_pack(const u32* values, i64 n, const u32* vmax_p,
                                                     const i64* pbase_p, const i64* shift_p,
                                                     i64 bits, u8* out) {
    const i64 ngroups = (n + 7) / 8;
    const i64 vmax = (i64)*vmax_p, pbase = *pbase_p, shift = mpicomp_fft_shift(*shift_p);
    MPICOMP_FOR(g, ngroups) {
        u64 acc = 0;
        int nacc = 0;
        i64 pos = g * bits;
        const i64 end = mpicomp_fft_min(n, g * 8 + 8);
        for (i64 i = g * 8; i < end; ++i) {
            const i64 code = mpicomp_fft_encode(values[i], vmax, pbase, (int)shift, (int)bits);
            acc |= (u64)code << nacc;
            nacc += (int)bits;
            while (nacc >= 8) {
                out[pos++] = (u8)(acc & 0xFF);
                acc >>= 8;
                nacc -= 8;
            }
        }
        if (nacc > 0) out[pos] = (u8)(acc & 0xFF);
    }
}

// One thread per group of eight codes; out gets max(decoded, 0); *err_key the lowest
// (i << 8 | error) of the bad codes.
// pbase, shift, bits and the code count n are read from the device (a payload's fields);
// nmax (out's size) bounds n.
extern "C" __global__ void mpicomp_fft_unpack_dequantize(const u8* stream, i64 nstream,
                                                         const i64* pbase_p, const i64* shift_p,
                                                         const i64* bits_p, u32* out, i64 nmax,
                                                         const i64* n_p, u64* err_key) {
    const i64 pbase = *pbase_p, shift = mpicomp_fft_shift(*shift_p);
    const i64 bits = mpicomp_fft_bits(*bits_p);
    const i64 n = mpicomp_fft_max(0, mpicomp_fft_min(*n_p, nmax));
    const i64 ngroups = (n + 7) / 8;
    const u64 mask = (1ull << bits) - 1ull;
    MPICOMP_FOR(g, ngroups) {
        u64 acc = 0;
        int nacc = 0;
        i64 pos = g * bits;
        const i64 end = mpicomp_fft_min(n, g * 8 + 8);
        for (i64 i = g * 8; i < end; ++i) {
            while (nacc < bits) {
                acc |= (u64)(pos < nstream ? stream[pos] : 0) << nacc;
                ++pos;
                nacc += 8;
            }
            const i64 p = mpicomp_fft_decode((i64)(acc & mask), pbase, (int)shift, (int)bits);
            if (p < 0) {
                const u64 code = p == -1 ? MPICOMP_FFT_DECODE_NEGATIVE_ZERO : MPICOMP_FFT_DECODE_OVERFLOW;
                atomicMin(err_key, ((u64)i << 8) | code);
            }
            out[i] = (u32)(p > 0 ? p : 0);
            acc >>= bits;
            nacc -= (int)bits;
        }
    }
}

// The first bad code's error, else DECODE_PADDING for nonzero bits after the last code.
extern "C" __global__ void mpicomp_fft_unpack_result(const u8* stream, i64 nstream,
                                                     const i64* bits_p, i64 nmax, const i64* n_p,
                                                     const u64* err_key, i64* result) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        const i64 bits = mpicomp_fft_bits(*bits_p);
        const i64 n = mpicomp_fft_max(0, mpicomp_fft_min(*n_p, nmax));
        const u64 e = *err_key;
        const i64 used = (n * bits) & 7;
        if (e != MPICOMP_FFT_NONE)
            *result = (i64)(e & 0xFF);
        else if (used && nstream > 0 && (stream[nstream - 1] >> used) != 0)
            *result = MPICOMP_FFT_DECODE_PADDING;
        else
            *result = MPICOMP_FFT_DECODE_OK;
    }
}

// ---- scatter of a payload into a spectrum ---------------------------------------------------------
// Bitmap byte j of nbins bins, the padding bits of the last byte cleared.
__device__ __forceinline__ u32 mpicomp_fft_bitmap_byte(const u8* bitmap, i64 j, i64 nbins) {
    u32 b = bitmap[j];
    if (j == ((nbins + 7) >> 3) - 1 && (nbins & 7)) b &= (1u << (nbins & 7)) - 1u;
    return b;
}

extern "C" __global__ void mpicomp_fft_scatter_count(const u8* bitmap, i64 nbins, i64* tile_n) {
    __shared__ i64 scratch[32];
    const i64 ntiles = (nbins + MPICOMP_FFT_TILE - 1) / MPICOMP_FFT_TILE;
    const i64 nbytes = (nbins + 7) >> 3;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        const i64 b0 = t * (MPICOMP_FFT_TILE / 8);
        const i64 b1 = mpicomp_fft_min(nbytes, b0 + MPICOMP_FFT_TILE / 8);
        i64 cnt = 0;
        for (i64 j = b0 + threadIdx.x; j < b1; j += blockDim.x)
            cnt += __popc(mpicomp_fft_bitmap_byte(bitmap, j, nbins));
        cnt = mpicomp_block_sum(cnt, scratch);
        if (threadIdx.x == 0) tile_n[t] = cnt;
    }
}

// One block: tile_first = exclusive prefix of tile_n; state[0] = DECODE_OK, DECODE_COUNT (not
// k bits) or DECODE_PADDING (bits past the last bin), checked in that order.
extern "C" __global__ void mpicomp_fft_scatter_scan(const u8* bitmap, i64 nbins, const i64* tile_n,
                                                    i64 ntiles, const i64* k_p, i64* tile_first,
                                                    i64* state) {
    __shared__ i64 scratch[32];
    const i64 k = *k_p;
    i64 carry = 0;
    for (i64 base = 0; base < ntiles; base += blockDim.x) {
        const i64 t = base + threadIdx.x;
        i64 total;
        const i64 first = carry + mpicomp_block_exclusive_scan(t < ntiles ? tile_n[t] : 0, scratch, &total);
        if (t < ntiles) tile_first[t] = first;
        carry += total;
    }
    if (threadIdx.x == 0) {
        const i64 used = nbins & 7;
        if (carry != k)
            state[0] = MPICOMP_FFT_DECODE_COUNT;
        else if (used && (bitmap[((nbins + 7) >> 3) - 1] >> used) != 0)
            state[0] = MPICOMP_FFT_DECODE_PADDING;
        else
            state[0] = MPICOMP_FFT_DECODE_OK;
    }
}

// When state[0] is DECODE_OK: add dense[slot] (real) and dense[k + slot] (imaginary) to the
// bin of the slot-th set bit. One thread per bitmap byte, slots from a block scan.
extern "C" __global__ void mpicomp_fft_scatter_add(const u8* bitmap, const float* dense,
                                                   const i64* k_p, const i64* tile_first,
                                                   const i64* state, float* spec, i64 nbins) {
    __shared__ i64 scratch[32];
    if (state[0] != MPICOMP_FFT_DECODE_OK) return;  // uniform: before any barrier
    const i64 k = *k_p;  // the count of set bits (state[0] says so): slots stay below it
    const i64 ntiles = (nbins + MPICOMP_FFT_TILE - 1) / MPICOMP_FFT_TILE;
    const i64 nbytes = (nbins + 7) >> 3;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        i64 carry = tile_first[t];
        const i64 b0 = t * (MPICOMP_FFT_TILE / 8);
        const i64 b1 = mpicomp_fft_min(nbytes, b0 + MPICOMP_FFT_TILE / 8);
        for (i64 base = b0; base < b1; base += blockDim.x) {
            const i64 j = base + threadIdx.x;
            const u32 b = j < b1 ? mpicomp_fft_bitmap_byte(bitmap, j, nbins) : 0u;
            i64 total;
            i64 slot = carry + mpicomp_block_exclusive_scan((i64)__popc(b), scratch, &total);
            for (int q = 0; q < 8; ++q) {
                if (!((b >> q) & 1u)) continue;
                const i64 i = j * 8 + q;
                spec[2 * i] += dense[slot];
                spec[2 * i + 1] += dense[k + slot];
                ++slot;
            }
            carry += total;
        }
    }
}

// ---- the residual of error feedback ---------------------------------------------------------------
// v minus its N-bit float decoded, on bits (v - (+0) is v: kept without float arithmetic).
__device__ __forceinline__ u32 mpicomp_fft_qerr(u32 v, i64 vmax, i64 pbase, int shift, int bits) {
    const i64 code = mpicomp_fft_encode(v, vmax, pbase, shift, bits);
    const u32 p = (u32)mpicomp_fft_decode(code, pbase, shift, bits);
    if (p == 0) return v;
    return __float_as_uint(__uint_as_float(v) - __uint_as_float(p));
}

// Thread per bin: a bin not in the bitmap keeps its parts, a kept one their quantization
// errors; written into r in the packed layout (bin 0 and the even-n Nyquist bin: real only).
extern "C" __global__ void mpicomp_fft_residual(const u32* spec, const u8* bitmap,
                                                const u32* vmax_p, const i64* pbase_p,
                                                const i64* shift_p, i64 bits, u32* r, i64 n) {
    const i64 nbins = n / 2 + 1;
    const i64 vmax = (i64)*vmax_p, pbase = *pbase_p, shift = mpicomp_fft_shift(*shift_p);
    MPICOMP_FOR(j, nbins) {
        u32 re = spec[2 * j], im = spec[2 * j + 1];
        if ((bitmap[j >> 3] >> (j & 7)) & 1) {
            re = mpicomp_fft_qerr(re, vmax, pbase, (int)shift, (int)bits);
            im = mpicomp_fft_qerr(im, vmax, pbase, (int)shift, (int)bits);
        }
        if (j == 0) {
            r[0] = re;
        } else if (2 * j == n) {
            r[n - 1] = re;
        } else {
            r[2 * j - 1] = re;
            r[2 * j] = im;
        }
    }
}
