// Top-k sparsification: select by magnitude, scatter back, check finiteness (twin of
// kernels/cpu/topk.py and kernels/cpu/checks.py's mpicomp_all_finite).
//
// |x| is ordered like the bit pattern p = bits & 0x7FFFFFFF (NaN and Inf are p >= 0x7F800000),
// so selection works on integers only. A radix select finds T, the k-th largest pattern, from
// three histograms of the digits [30:20], [19:10], [9:0] of the patterns that share the digits
// chosen so far (integer counts: they do not depend on their order); after each, one block
// finds the digit of T (the bin where the count from the top reaches the k still to find) and
// how many of the k are still to find below it. After the last that number is `ties`: how many
// elements equal to T are kept (every p > T is). This is the twin's rule: the k-th largest T,
// everything above it, and of those equal to it the lowest indices. The kept elements are
// written in index order by a prefix-sum compaction over tiles of ITEMS * blockDim.x elements
// (thread j of a tile owns ITEMS consecutive ones): per tile the counts of p > T and p == T,
// one block scans them (which of the equal ones a tile keeps, where its output starts), and a
// pass writes. The output is unique, so no geometry changes it.
//
// DRAM passes over x (4 bytes an element each; the scheme of docs/kernels.md, "Memory-bound
// kernels"). Before: five (three histograms, the count, the write), 20 bytes an element, the
// first histogram's shared u64 atomics serialized where gradients crowd a few exponent bins.
// Now three, 12 bytes an element, plus the candidates:
//   1. `histogram`: every pattern's top digit (warp-aggregated u32 shared atomics) + NaN/Inf.
//   2. `refine`: per tile, the count of patterns above T's top-digit bin (all kept); the
//      histogram of the second digit of those in the bin, the *candidates*, which it also
//      appends, per tile contiguous, to a buffer (when the bin's count, known from pass 1,
//      fits its capacity: state[USE_CAND]).
//   3. `histogram_cand`: the third digit from the candidates only; `tally`: each tile's counts
//      of p > T and p == T from its above-count and its candidates (a warp per tile).
//   4. `scan` (one block, a segment of tiles per thread), then `write`, which reads x again
//      for the tiles that keep something.
// Where the bin does not fit (many equal magnitudes), pass 3 and the counts read x instead
// (`histogram` with a digit filter, `count`): five passes, 20 bytes an element, as before.
#include "common.cuh"

#ifndef MPICOMP_TOPK_ITEMS
#error "MPICOMP_TOPK_ITEMS comes from kernels/cuda/topk.py (DEFINES)"
#endif


#define MPICOMP_TOPK_ABS 0x7fffffffu
#define MPICOMP_TOPK_INF 0x7f800000u
#define MPICOMP_TOPK_MAX_BINS 2048
#define MPICOMP_TOPK_NONE 0xffffffffu  // no bin: an element past n
#define MPICOMP_TOPK_ROWS 2            // groups of 4 a thread loads per round (passes 1, 3)

// state[]: the digits of T chosen so far, how many of the k are left to find among the
// patterns that share them, the NaN/Inf flag, whether the candidates fit their buffer, and how
// many the buffer holds.
#define MPICOMP_TOPK_PREFIX 0
#define MPICOMP_TOPK_LEFT 1
#define MPICOMP_TOPK_BAD 2
#define MPICOMP_TOPK_USE_CAND 3
#define MPICOMP_TOPK_NCAND 4

// Add a block's shared counts to the global histogram (nonzero bins only).
__device__ __forceinline__ void mpicomp_topk_flush(const u32* h, u32 nbins, u64* hist) {
    __syncthreads();
    for (u32 b = threadIdx.x; b < nbins; b += blockDim.x)
        if (h[b]) atomicAdd(&hist[b], (u64)h[b]);
}

// Patterns of the group of 4 at element i (i a multiple of 4): v[k] = |x[i + k]|'s pattern,
// valid[k] = i + k < n. One 16-byte load where x is aligned and the group lies below n.
__device__ __forceinline__ void mpicomp_topk_group(const u32* x, i64 i, i64 n, bool vec, u32 v[4],
                                                   bool valid[4]) {
    for (int k = 0; k < 4; ++k) v[k] = 0, valid[k] = i + k < n;
    if (i < n) mpicomp_load4(x, i, n, vec, v);
    for (int k = 0; k < 4; ++k) v[k] &= MPICOMP_TOPK_ABS;
}

// Pass 1 (shift + nbits == 31): hist[0, 2048) += the top digits (p >> 20) of every pattern,
// state[BAD] |= some NaN/Inf. Gradients crowd few bins, and lanes adding to one shared counter
// are serialized: a warp first counts, with one ballot, the lanes whose bin is lane 0's, and
// one lane adds them; the others add one each. Counts are u32 per block (the launcher keeps a
// block's elements below 2^32), flushed to the u64 global histogram.
//
// The fallback third pass (shift == 0, when the candidates did not fit): hist[0, 2^nbits) +=
// the digits (p >> shift) of the patterns whose bits above shift + nbits equal T's chosen so
// far; nothing once state[BAD] is set or when the candidates fit.
extern "C" __global__ void mpicomp_topk_histogram(const u32* x, i64 n, int shift, int nbits,
                                                  u64* state, u64* hist) {
    __shared__ u32 h[MPICOMP_TOPK_MAX_BINS];
    const int high = shift + nbits;  // at most 31: shifts stay below 32
    const bool first = high == 31;
    if (!first && (state[MPICOMP_TOPK_BAD] || state[MPICOMP_TOPK_USE_CAND])) return;
    const u32 nbins = 1u << nbits, want = (u32)state[MPICOMP_TOPK_PREFIX] >> high;
    const int lane = threadIdx.x & 31;
    const bool vec = mpicomp_aligned(x, 16);
    for (u32 b = threadIdx.x; b < nbins; b += blockDim.x) h[b] = 0;
    __syncthreads();
    u32 bad = 0;
    const i64 row = 4 * (i64)blockDim.x, span = MPICOMP_TOPK_ROWS * row;
    for (i64 base = (i64)blockIdx.x * span; base < n; base += (i64)gridDim.x * span) {
        u32 v[MPICOMP_TOPK_ROWS][4];
        bool valid[MPICOMP_TOPK_ROWS][4];
#pragma unroll
        for (int r = 0; r < MPICOMP_TOPK_ROWS; ++r)
            mpicomp_topk_group(x, base + r * row + 4 * threadIdx.x, n, vec, v[r], valid[r]);
#pragma unroll
        for (int r = 0; r < MPICOMP_TOPK_ROWS; ++r)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 p = v[r][k];
                if (first) {
                    bad |= (u32)(valid[r][k] && p >= MPICOMP_TOPK_INF);
                    const u32 bin = valid[r][k] ? p >> 20 : MPICOMP_TOPK_NONE;  // uniform loop:
                    const u32 lead = __shfl_sync(0xffffffffu, bin, 0);  // every lane is here
                    const u32 same = __ballot_sync(0xffffffffu, bin == lead);
                    if (bin != lead) {
                        if (bin != MPICOMP_TOPK_NONE) atomicAdd(&h[bin], 1u);
                    } else if (lane == 0 && lead != MPICOMP_TOPK_NONE) {
                        atomicAdd(&h[lead], (u32)__popc(same));
                    }
                } else if (valid[r][k] && p >> high == want) {
                    atomicAdd(&h[(p >> shift) & (nbins - 1u)], 1u);
                }
            }
    }
    mpicomp_topk_flush(h, nbins, hist);
    if (bad) atomicOr(&state[MPICOMP_TOPK_BAD], 1ull);
}

// One block finds the digit of T from a histogram: the bin where the count from the top first
// reaches the k left; those above it are kept and leave the count. Thread t sums a run of bins
// from the top, a block scan gives each run the count above it, and the thread whose run holds
// the crossing walks it. After the first digit, state[USE_CAND] = the chosen bin's count fits
// `cap` (the candidate buffer).
extern "C" __global__ void mpicomp_topk_choose(const u64* hist, int shift, int nbits, i64 cap,
                                               u64* state) {
    __shared__ u64 scratch[32];
    if (blockIdx.x != 0 || state[MPICOMP_TOPK_BAD]) return;
    const u64 left = state[MPICOMP_TOPK_LEFT];
    const int nbins = 1 << nbits, per = (nbins + blockDim.x - 1) / blockDim.x;
    const int lo = threadIdx.x * per, hi = lo + per < nbins ? lo + per : nbins;  // ranks from top
    u64 mine = 0, total;
    for (int r = lo; r < hi; ++r) mine += hist[nbins - 1 - r];
    u64 above = mpicomp_block_exclusive_scan(mine, scratch, &total);
    if (above >= left || above + mine < left) return;  // not in my run
    for (int r = lo; r < hi; ++r) {
        const int b = nbins - 1 - r;
        const u64 c = hist[b];
        if (above + c >= left) {
            state[MPICOMP_TOPK_PREFIX] |= (u64)b << shift;
            state[MPICOMP_TOPK_LEFT] = left - above;
            if (shift + nbits == 31) state[MPICOMP_TOPK_USE_CAND] = c <= (u64)cap;
            return;
        }
        above += c;
    }
}

// Pass 2, tile t (ITEMS * blockDim.x elements from t * that): hist[0, 1024) += the digits
// [19:10] of the candidates (p >> 20 == T's top digit); when they fit (state[USE_CAND]), they
// are appended to cand[] (the tile's contiguous: its start and count in tile_cand[2t, 2t + 1],
// the room reserved with one atomic per tile) and tile_above[t] = the tile's p >> 20 above the
// digit. The tile's rows are loaded as in pass 1 (a warp's loads contiguous): counts do not
// depend on which thread holds an element.
extern "C" __global__ void mpicomp_topk_refine(const u32* x, i64 n, u64* state, u64* hist,
                                               u32* cand, i64* tile_above, i64* tile_cand) {
    __shared__ u32 h[1024];
    __shared__ i64 scratch[32];
    __shared__ i64 room;
    if (state[MPICOMP_TOPK_BAD]) return;  // the same for the whole grid
    const u32 want = (u32)state[MPICOMP_TOPK_PREFIX] >> 20;
    const bool keep = state[MPICOMP_TOPK_USE_CAND] != 0;
    const bool vec = mpicomp_aligned(x, 16);
    constexpr int ROWS = MPICOMP_TOPK_ITEMS / 4;
    for (u32 b = threadIdx.x; b < 1024; b += blockDim.x) h[b] = 0;
    __syncthreads();
    const i64 row = 4 * (i64)blockDim.x, tile = ROWS * row, ntiles = (n + tile - 1) / tile;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        u32 v[ROWS][4];
        bool valid[ROWS][4];
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
            mpicomp_topk_group(x, t * tile + r * row + 4 * threadIdx.x, n, vec, v[r], valid[r]);
        i64 above = 0, mine = 0;
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const u32 d = v[r][k] >> 20;
                above += valid[r][k] && d > want;
                if (valid[r][k] && d == want) {
                    ++mine;
                    atomicAdd(&h[(v[r][k] >> 10) & 1023u], 1u);
                }
            }
        if (!keep) continue;  // uniform
        i64 count;
        i64 at = mpicomp_block_exclusive_scan(mine, scratch, &count);
        above = mpicomp_block_sum(above, scratch);
        if (threadIdx.x == 0) {
            room = count ? (i64)atomicAdd(&state[MPICOMP_TOPK_NCAND], (u64)count) : 0;
            tile_above[t] = above;
            tile_cand[2 * t] = room;
            tile_cand[2 * t + 1] = count;
        }
        __syncthreads();
        at += room;
        __syncthreads();  // `room` is read before the next tile sets it
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
            for (int k = 0; k < 4; ++k)
                if (valid[r][k] && v[r][k] >> 20 == want) cand[at++] = v[r][k];
    }
    mpicomp_topk_flush(h, 1024, hist);
}

// Pass 3 from the candidates (when they fit): hist[0, 1024) += the digits [9:0] of those whose
// digits [19:10] are T's.
extern "C" __global__ void mpicomp_topk_histogram_cand(const u32* cand, u64* state, u64* hist) {
    __shared__ u32 h[1024];
    if (state[MPICOMP_TOPK_BAD] || !state[MPICOMP_TOPK_USE_CAND]) return;
    const i64 ncand = (i64)state[MPICOMP_TOPK_NCAND];
    const u32 want = (u32)state[MPICOMP_TOPK_PREFIX] >> 10;
    for (u32 b = threadIdx.x; b < 1024; b += blockDim.x) h[b] = 0;
    __syncthreads();
    MPICOMP_FOR(i, ncand) {
        const u32 p = cand[i];
        if (p >> 10 == want) atomicAdd(&h[p & 1023u], 1u);
    }
    mpicomp_topk_flush(h, 1024, hist);
}

// tile_gt[t], tile_eq[t] = counts of p > T and p == T in tile t, from its above-count and its
// candidates (when they fit): a warp per tile.
extern "C" __global__ void mpicomp_topk_tally(i64 ntiles, const u64* state, const u32* cand,
                                              const i64* tile_above, const i64* tile_cand,
                                              i64* tile_gt, i64* tile_eq) {
    if (state[MPICOMP_TOPK_BAD] || !state[MPICOMP_TOPK_USE_CAND]) return;
    const u32 thresh = (u32)state[MPICOMP_TOPK_PREFIX];
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 t = ((i64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; t < ntiles; t += warps) {
        const i64 start = tile_cand[2 * t], count = tile_cand[2 * t + 1];
        u32 gt = 0, eq = 0;
        for (i64 j = lane; j < count; j += 32) {
            const u32 p = cand[start + j];
            gt += p > thresh;
            eq += p == thresh;
        }
        gt = mpicomp_warp_sum(gt);  // < 2^32: a tile's elements
        eq = mpicomp_warp_sum(eq);
        if (lane == 0) {
            tile_gt[t] = tile_above[t] + gt;
            tile_eq[t] = eq;
        }
    }
}

// This thread's ITEMS elements of tile t: patterns into p[] (two 16-byte loads where x is
// aligned), counts of p > T and p == T.
__device__ __forceinline__ void mpicomp_topk_tile(const u32* x, i64 n, i64 t, u32 thresh,
                                                  bool vec, u32* p, i64* gt, i64* eq) {
    const i64 lo = (t * blockDim.x + threadIdx.x) * (i64)MPICOMP_TOPK_ITEMS;
    *gt = 0;
    *eq = 0;
#pragma unroll
    for (int j = 0; j < MPICOMP_TOPK_ITEMS; j += 4) {
        for (int k = 0; k < 4; ++k) p[j + k] = 0;
        if (lo + j < n) mpicomp_load4(x, lo + j, n, vec, p + j);
    }
#pragma unroll
    for (int j = 0; j < MPICOMP_TOPK_ITEMS; ++j) {
        const u32 a = p[j] & MPICOMP_TOPK_ABS;
        *gt += lo + j < n && a > thresh;
        *eq += lo + j < n && a == thresh;
    }
}

// The fallback counts (the candidates did not fit): tile_gt[t], tile_eq[t] = counts of p > T
// and p == T in tile t, from x.
extern "C" __global__ void mpicomp_topk_count(const u32* x, i64 n, const u64* state,
                                              i64* tile_gt, i64* tile_eq) {
    __shared__ i64 scratch[32];
    if (state[MPICOMP_TOPK_BAD] || state[MPICOMP_TOPK_USE_CAND]) return;  // the whole grid
    const u32 thresh = (u32)state[MPICOMP_TOPK_PREFIX];
    const bool vec = mpicomp_aligned(x, 16);
    const i64 tile = (i64)MPICOMP_TOPK_ITEMS * blockDim.x, ntiles = (n + tile - 1) / tile;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        u32 p[MPICOMP_TOPK_ITEMS];
        i64 gt, eq;
        mpicomp_topk_tile(x, n, t, thresh, vec, p, &gt, &eq);
        gt = mpicomp_block_sum(gt, scratch);
        eq = mpicomp_block_sum(eq, scratch);
        if (threadIdx.x == 0) {
            tile_gt[t] = gt;
            tile_eq[t] = eq;
        }
    }
}

__device__ __forceinline__ i64 mpicomp_topk_clamp(i64 v, i64 hi) {
    return v < 0 ? 0 : v > hi ? hi : v;
}

// One block: tile_eq[t] becomes the count of p == T before tile t, tile_start[t] where tile t's
// output starts (tiles keep their p > T and their share of the first `ties` equal ones), both
// for t = ntiles too (the totals). Thread j takes a run of consecutive tiles: it sums them, a
// block scan places the run, and it walks the run again; three walks and two block scans in
// all, where one scan per blockDim.x tiles made the block wait ntiles / blockDim.x times.
extern "C" __global__ void mpicomp_topk_scan(i64 ntiles, const u64* state, const i64* tile_gt,
                                             i64* tile_eq, i64* tile_start) {
    __shared__ i64 scratch[32];
    if (blockIdx.x != 0 || state[MPICOMP_TOPK_BAD]) return;
    const i64 ties = (i64)state[MPICOMP_TOPK_LEFT];
    const i64 per = (ntiles + blockDim.x - 1) / blockDim.x, lo = threadIdx.x * per;
    const i64 hi = lo + per < ntiles ? lo + per : ntiles;
    i64 eq_run = 0, eq_total, kept_run = 0, kept_total;
    for (i64 t = lo; t < hi; ++t) eq_run += tile_eq[t];
    const i64 eq_base = mpicomp_block_exclusive_scan(eq_run, scratch, &eq_total);
    i64 e = eq_base;
    for (i64 t = lo; t < hi; ++t) {
        const i64 eq = tile_eq[t];
        kept_run += tile_gt[t] + mpicomp_topk_clamp(ties - e, eq);
        e += eq;
    }
    i64 s = mpicomp_block_exclusive_scan(kept_run, scratch, &kept_total);
    e = eq_base;
    for (i64 t = lo; t < hi; ++t) {
        const i64 eq = tile_eq[t], kept = tile_gt[t] + mpicomp_topk_clamp(ties - e, eq);
        tile_eq[t] = e;
        tile_start[t] = s;
        e += eq;
        s += kept;
    }
    if (threadIdx.x == 0) {
        tile_eq[ntiles] = eq_total;
        tile_start[ntiles] = kept_total;
    }
}

// Write the kept (index, value) pairs of every tile from tile_start[t], in index order. A tile
// that keeps nothing is not read; where the tile's equal ones are all kept or none is (every
// tile but the one where the ties run out), no scan of them is needed.
extern "C" __global__ void mpicomp_topk_write(const u32* x, i64 n, const u64* state,
                                              const i64* tile_eq_before, const i64* tile_start,
                                              void* out_idx, int idx_kind, u32* out_val) {
    __shared__ i64 scratch[32];
    if (state[MPICOMP_TOPK_BAD]) return;
    const u32 thresh = (u32)state[MPICOMP_TOPK_PREFIX];
    const i64 ties = (i64)state[MPICOMP_TOPK_LEFT];
    const bool vec = mpicomp_aligned(x, 16);
    const i64 tile = (i64)MPICOMP_TOPK_ITEMS * blockDim.x, ntiles = (n + tile - 1) / tile;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        if (tile_start[t + 1] == tile_start[t]) continue;  // uniform
        u32 p[MPICOMP_TOPK_ITEMS];
        i64 gt, eq, total;
        mpicomp_topk_tile(x, n, t, thresh, vec, p, &gt, &eq);
        const i64 before = tile_eq_before[t], here = tile_eq_before[t + 1] - before;
        i64 take;  // my equal ones that are kept
        if (ties - before <= 0)
            take = 0;
        else if (ties - before >= here)
            take = eq;
        else
            take = mpicomp_topk_clamp(
                ties - before - mpicomp_block_exclusive_scan(eq, scratch, &total), eq);
        i64 at = tile_start[t] + mpicomp_block_exclusive_scan(gt + take, scratch, &total);
        const i64 lo = (t * blockDim.x + threadIdx.x) * (i64)MPICOMP_TOPK_ITEMS;
#pragma unroll
        for (int j = 0; j < MPICOMP_TOPK_ITEMS; ++j) {
            const u32 a = p[j] & MPICOMP_TOPK_ABS;
            if (lo + j >= n || a < thresh || (a == thresh && take == 0)) continue;
            take -= a == thresh;
            mpicomp_store_int(out_idx, idx_kind, at, (u64)(lo + j));
            out_val[at] = p[j];
            ++at;
        }
    }
}

// out[indices[j]] = values[j] (bit patterns). *err = min over failing j of j << 2 | code:
// code 1 if indices[j] is not in (indices[j - 1], n) (j = 0: [0, n)), else 2 if values[j]
// is not finite. The smallest failing j decides, as in the twin's loop that stops there
// (a negative index fails here too: it fails the twin at j or earlier, never writes).
extern "C" __global__ void mpicomp_topk_scatter(const void* indices, int kind, i64 k,
                                                const u32* values, i64 n, u32* out, u64* err) {
    MPICOMP_FOR(j, k) {
        const i64 i = mpicomp_load_int(indices, kind, j);
        const i64 prev = j > 0 ? mpicomp_load_int(indices, kind, j - 1) : -1;
        const u32 v = values[j];
        const u64 code = i < 0 || i <= prev || i >= n             ? 1ull
                         : (v & MPICOMP_TOPK_ABS) >= MPICOMP_TOPK_INF ? 2ull
                                                                      : 0ull;
        if (code)
            atomicMin(err, (u64)j << 2 | code);
        else
            out[i] = v;
    }
}

// flags[0] |= 1 if x holds NaN/Inf (each thread ORs at most once).
extern "C" __global__ void mpicomp_topk_all_finite(const u32* x, i64 n, u64* flags) {
    u32 bad = 0;
    MPICOMP_FOR(i, n) bad |= (u32)((x[i] & MPICOMP_TOPK_ABS) >= MPICOMP_TOPK_INF);
    if (bad) atomicOr(flags, 1ull);
}
