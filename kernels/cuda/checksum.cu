// Adler-32 as parallel reductions (twin of kernels/cpu/checksum.py).
//
// Over bytes b_0..b_{n-1}, Adler-32's sums from (0, 0) are s1 = sum(b_i) and
// s2 = sum((n - i) * b_i) = n * s1 - sum(i * b_i), mod BASE. Both are plain integer sums, so
// each block adds the bytes its threads visit (any grid) into two partials mod BASE, and the
// launcher continues the caller's checksum with kernels/checksum.py's `combine`. Exact integer
// arithmetic: the value never depends on the launch geometry.
#include "common.cuh"

// Per thread: bytes into s1, position-weighted into ws (each term below 2^26: no overflow
// in 64 bits before 2^38 terms a thread).
struct mpicomp_adler_sums {
    u64 s1 = 0, ws = 0;
};

// partials[2b], partials[2b+1] = sum(b_i), sum((i mod BASE) * b_i) mod BASE over block b's
// bytes; dst[i] = src[i] as they are read when `copy`. Whole 32-bit words when src (and dst)
// are 4-byte aligned, single bytes otherwise; the last n % 4 bytes one per thread.
extern "C" __global__ void mpicomp_checksum_adler32(const u8* src, u8* dst, int copy, i64 n,
                                                    u64* partials) {
    __shared__ u64 scratch[32];
    const i64 start = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    const i64 stride = (i64)gridDim.x * blockDim.x;
    const bool words = ((u64)src & 3ull) == 0 && (!copy || ((u64)dst & 3ull) == 0);
    const i64 nw = words ? n / 4 : 0;  // bytes [4 nw, n) go one at a time
    mpicomp_adler_sums s;
    // Byte position of the current word, mod BASE, advanced without a division.
    u64 pos = (u64)((4 * start) % MPICOMP_ADLER_BASE);
    const u64 step = (u64)((4 * stride) % MPICOMP_ADLER_BASE);
    for (i64 q = start; q < nw; q += stride) {
        const u32 v = ((const u32*)src)[q];
        if (copy) ((u32*)dst)[q] = v;
        const u32 b0 = v & 0xFFu, b1 = (v >> 8) & 0xFFu, b2 = (v >> 16) & 0xFFu, b3 = v >> 24;
        const u32 sum = b0 + b1 + b2 + b3;
        s.s1 += sum;
        s.ws += pos * sum + (b1 + 2 * b2 + 3 * b3);
        pos += step;
        if (pos >= MPICOMP_ADLER_BASE) pos -= MPICOMP_ADLER_BASE;
    }
    pos = (u64)((4 * nw + start) % MPICOMP_ADLER_BASE);
    const u64 step1 = (u64)(stride % MPICOMP_ADLER_BASE);
    for (i64 i = 4 * nw + start; i < n; i += stride) {
        const u32 b = src[i];
        if (copy) dst[i] = (u8)b;
        s.s1 += b;
        s.ws += pos * b;
        pos += step1;
        if (pos >= MPICOMP_ADLER_BASE) pos -= MPICOMP_ADLER_BASE;
    }
    const u64 s1 = mpicomp_block_sum<u64>(s.s1 % MPICOMP_ADLER_BASE, scratch);
    const u64 ws = mpicomp_block_sum<u64>(s.ws % MPICOMP_ADLER_BASE, scratch);
    if (threadIdx.x == 0) {
        partials[2 * blockIdx.x] = s1 % MPICOMP_ADLER_BASE;
        partials[2 * blockIdx.x + 1] = ws % MPICOMP_ADLER_BASE;
    }
}

// out[0..3] = Adler-32 `value` continued over the n bytes whose block partials are
// `partials` (as above), little-endian: kernels/checksum.py's `combine` of `span_sums`,
// on the device, so a payload's checksum is written where it lies without a host read.
extern "C" __global__ void mpicomp_checksum_finish(const u64* partials, i64 blocks, i64 n,
                                                   u32 value, u8* out) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const u64 base = MPICOMP_ADLER_BASE;
    u64 p1 = 0, p2 = 0;  // each partial < BASE: no overflow below 2^47 blocks
    for (i64 b = 0; b < blocks; ++b) {
        p1 += partials[2 * b];
        p2 += partials[2 * b + 1];
    }
    const u64 m = (u64)n % base;
    const u64 s1 = p1 % base;
    const u64 s2 = (m * s1 % base + base - p2 % base) % base;  // sum((n - i) * b_i)
    u64 a = value & 0xFFFFu, c = value >> 16;
    c = (c + m * a + s2) % base;
    a = (a + s1) % base;
    const u32 v = (u32)((c << 16) | a);
    for (int k = 0; k < 4; ++k) out[k] = (u8)(v >> (8 * k));
}
