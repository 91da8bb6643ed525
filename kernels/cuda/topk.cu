// Top-k sparsification: select by magnitude, scatter back, check finiteness (twin of
// kernels/cpu/topk.py and kernels/cpu/checks.py's mpicomp_all_finite).
//
// |x| is ordered like the bit pattern p = bits & 0x7FFFFFFF (NaN and Inf are p >= 0x7F800000),
// so selection works on integers only. A radix select finds T, the k-th largest pattern, in
// three histogram passes over the bits [30:20], [19:10], [9:0] of the patterns that share the
// digits chosen so far (integer atomics: counts do not depend on their order); after each pass
// one thread walks the bins from the top to pick the digit of T and how many of the k are still
// to find below it. After the last pass that number is `ties`: how many elements equal to T are
// kept (every p > T is). This is the twin's rule: the k-th largest T, everything above it,
// and of those equal to it the lowest indices.
//
// The kept elements are written in index order by a prefix-sum compaction over tiles of
// ITEMS * blockDim.x elements (thread j of a tile owns ITEMS consecutive elements): one pass
// counts each tile's p > T and p == T, one block scans the tiles' counts (which of the equal
// ones a tile keeps, and where its output starts), and one pass writes. The output is unique,
// so the tile size (the block size) does not change it.
#include "common.cuh"

#ifndef MPICOMP_TOPK_ITEMS
#error "MPICOMP_TOPK_ITEMS comes from kernels/cuda/topk.py (DEFINES)"
#endif


#define MPICOMP_TOPK_ABS 0x7fffffffu
#define MPICOMP_TOPK_INF 0x7f800000u
#define MPICOMP_TOPK_MAX_BINS 2048

// state[]: the digits of T chosen so far, how many of the k are left to find among the
// patterns that share them, and the NaN/Inf flag.
#define MPICOMP_TOPK_PREFIX 0
#define MPICOMP_TOPK_LEFT 1
#define MPICOMP_TOPK_BAD 2

// Add to hist[0, 2^nbits) the digits (p >> shift) of the patterns whose bits above
// shift + nbits equal T's chosen so far. The first pass (shift + nbits == 31) flags NaN/Inf;
// later passes do nothing once it is set.
extern "C" __global__ void mpicomp_topk_histogram(const u32* x, i64 n, int shift, int nbits,
                                                  u64* state, u64* hist) {
    __shared__ u64 h[MPICOMP_TOPK_MAX_BINS];
    const int high = shift + nbits;  // at most 31: shifts stay below 32
    const bool first = high == 31;
    const u32 nbins = 1u << nbits, want = (u32)state[MPICOMP_TOPK_PREFIX] >> high;
    const i64 count = !first && state[MPICOMP_TOPK_BAD] ? 0 : n;
    for (u32 b = threadIdx.x; b < nbins; b += blockDim.x) h[b] = 0;
    __syncthreads();
    u32 bad = 0;
    MPICOMP_FOR(i, count) {
        const u32 p = x[i] & MPICOMP_TOPK_ABS;
        if (first) bad |= (u32)(p >= MPICOMP_TOPK_INF);
        if (p >> high == want) atomicAdd(&h[(p >> shift) & (nbins - 1u)], 1ull);
    }
    __syncthreads();
    for (u32 b = threadIdx.x; b < nbins; b += blockDim.x)
        if (h[b]) atomicAdd(&hist[b], h[b]);
    if (bad) atomicOr(&state[MPICOMP_TOPK_BAD], 1ull);
}

// One thread walks the 2^nbits bins from the top: the digit of T is the bin where the count
// from the top first reaches the k left; those above it are kept and leave the count.
extern "C" __global__ void mpicomp_topk_choose(const u64* hist, int shift, int nbits,
                                               u64* state) {
    if (blockIdx.x != 0 || threadIdx.x != 0 || state[MPICOMP_TOPK_BAD]) return;
    const u64 left = state[MPICOMP_TOPK_LEFT];
    u64 above = 0;
    for (int b = (1 << nbits) - 1; b >= 0; --b) {
        const u64 c = hist[b];
        if (above + c >= left) {
            state[MPICOMP_TOPK_PREFIX] |= (u64)b << shift;
            state[MPICOMP_TOPK_LEFT] = left - above;
            return;
        }
        above += c;
    }
}

// This thread's ITEMS elements of tile t: patterns into p[], counts of p > T and p == T.
__device__ __forceinline__ void mpicomp_topk_tile(const u32* x, i64 n, i64 t, u32 thresh,
                                                  u32* p, i64* gt, i64* eq) {
    const i64 lo = (t * blockDim.x + threadIdx.x) * (i64)MPICOMP_TOPK_ITEMS;
    *gt = 0;
    *eq = 0;
#pragma unroll
    for (int j = 0; j < MPICOMP_TOPK_ITEMS; ++j) {
        p[j] = lo + j < n ? x[lo + j] : 0u;
        const u32 a = p[j] & MPICOMP_TOPK_ABS;
        *gt += lo + j < n && a > thresh;
        *eq += lo + j < n && a == thresh;
    }
}

// tile_gt[t], tile_eq[t] = counts of p > T and p == T in tile t.
extern "C" __global__ void mpicomp_topk_count(const u32* x, i64 n, const u64* state,
                                              i64* tile_gt, i64* tile_eq) {
    __shared__ i64 scratch[32];
    if (state[MPICOMP_TOPK_BAD]) return;  // the same for the whole block
    const u32 thresh = (u32)state[MPICOMP_TOPK_PREFIX];
    const i64 tile = (i64)MPICOMP_TOPK_ITEMS * blockDim.x, ntiles = (n + tile - 1) / tile;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        u32 p[MPICOMP_TOPK_ITEMS];
        i64 gt, eq;
        mpicomp_topk_tile(x, n, t, thresh, p, &gt, &eq);
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

// One block: tile_eq[t] becomes the count of p == T before tile t, tile_start[t] where
// tile t's output starts (tiles keep their p > T and their share of the first `ties`
// equal ones).
extern "C" __global__ void mpicomp_topk_scan(i64 ntiles, const u64* state, const i64* tile_gt,
                                             i64* tile_eq, i64* tile_start) {
    __shared__ i64 scratch[32];
    if (blockIdx.x != 0 || state[MPICOMP_TOPK_BAD]) return;
    const i64 ties = (i64)state[MPICOMP_TOPK_LEFT];
    i64 eq_carry = 0, kept_carry = 0;
    for (i64 base = 0; base < ntiles; base += blockDim.x) {
        const i64 t = base + threadIdx.x;
        const i64 eq = t < ntiles ? tile_eq[t] : 0, gt = t < ntiles ? tile_gt[t] : 0;
        i64 total;
        const i64 eq_before = eq_carry + mpicomp_block_exclusive_scan(eq, scratch, &total);
        eq_carry += total;
        const i64 kept = gt + mpicomp_topk_clamp(ties - eq_before, eq);
        const i64 start = kept_carry + mpicomp_block_exclusive_scan(kept, scratch, &total);
        kept_carry += total;
        if (t < ntiles) {
            tile_eq[t] = eq_before;
            tile_start[t] = start;
        }
    }
}

// Write the kept (index, value) pairs of every tile from tile_start[t], in index order.
extern "C" __global__ void mpicomp_topk_write(const u32* x, i64 n, const u64* state,
                                              const i64* tile_eq_before, const i64* tile_start,
                                              void* out_idx, int idx_kind, u32* out_val) {
    __shared__ i64 scratch[32];
    if (state[MPICOMP_TOPK_BAD]) return;
    const u32 thresh = (u32)state[MPICOMP_TOPK_PREFIX];
    const i64 ties = (i64)state[MPICOMP_TOPK_LEFT];
    const i64 tile = (i64)MPICOMP_TOPK_ITEMS * blockDim.x, ntiles = (n + tile - 1) / tile;
    for (i64 t = blockIdx.x; t < ntiles; t += gridDim.x) {
        u32 p[MPICOMP_TOPK_ITEMS];
        i64 gt, eq, total;
        mpicomp_topk_tile(x, n, t, thresh, p, &gt, &eq);
        const i64 eq_before =
            tile_eq_before[t] + mpicomp_block_exclusive_scan(eq, scratch, &total);
        i64 take = mpicomp_topk_clamp(ties - eq_before, eq);  // my equal ones that are kept
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
