// Arbitrary-width bit packing (kernels/bits.py's layout; twin of kernels/cpu/bits.py).
//
// Code i of a stream of `w`-bit codes occupies bits [i*w, (i+1)*w), LSB-first; bit b lives in
// byte b/8 at position b%8. Packing kernels give each thread one 32-bit word of the output
// (bits [32k, 32k+32)): it gathers the codes that overlap the word and writes it with one
// store, so writes are whole words and no two threads touch one byte. Unpacking kernels give
// each thread one element. Every byte of the packed size is written, no byte past it.
//
// Integer arrays of any dtype come in as `const void*` with a `kind`:
// log2(itemsize) | 4 when unsigned (kernels/cuda/device.py: int_kind). The switch is the same for
// the whole grid, so it costs a uniform branch.
#include "common.cuh"

#if MPICOMP_BITS_MAX_WIDTH > 32
#error "the packing kernels hold a code in 32 bits"
#endif

// 32 bits of a stream of `nbytes` bytes from byte 4q, zeros past its end (never read).
__device__ __forceinline__ u64 mpicomp_bits_word(const u8* s, i64 nbytes, bool aligned, i64 q) {
    const i64 b = q * 4;
    if (aligned && b + 4 <= nbytes) return ((const u32*)s)[q];
    u64 v = 0;
    for (int t = 0; t < 4; ++t)
        if (b + t < nbytes) v |= (u64)s[b + t] << (8 * t);
    return v;
}

// Code e of `w` bits (1..32) of a stream: at most two words, the shift below 64.
__device__ __forceinline__ u32 mpicomp_bits_code(const u8* s, i64 nbytes, bool aligned, i64 e,
                                                 int w) {
    const u64 bit = (u64)e * (u64)w;
    const i64 q = (i64)(bit >> 5);
    const int off = (int)(bit & 31);
    u64 v = mpicomp_bits_word(s, nbytes, aligned, q);
    if (off + w > 32) v |= mpicomp_bits_word(s, nbytes, aligned, q + 1) << 32;
    return (u32)((v >> off) & ((1ull << w) - 1ull));
}

__device__ __forceinline__ bool mpicomp_bits_aligned(const void* p) {
    return ((u64)p & 3ull) == 0;
}

// Write the `nbytes`-byte stream of n codes of `ow` bits whose code e is value(e) (masked to
// `ow` bits). Thread per output word k: codes e0 = 32k/ow .. (32k+31)/ow overlap it.
template <class F>
__device__ __forceinline__ void mpicomp_bits_repack(i64 n, int ow, u8* out, i64 nbytes, F value) {
    const bool aligned = mpicomp_bits_aligned(out);
    const u64 mask = (1ull << ow) - 1ull;
    const i64 words = (nbytes + 3) >> 2;
    MPICOMP_FOR(k, words) {
        const u64 lo = (u64)k * 32ull;
        i64 last = (i64)((lo + 31ull) / (u64)ow);
        if (last > n - 1) last = n - 1;
        u64 acc = 0;
        for (i64 e = (i64)(lo / (u64)ow); e <= last; ++e) {
            const i64 off = (i64)((u64)e * (u64)ow - lo);  // in (-ow, 32)
            const u64 v = (u64)value(e) & mask;
            acc |= off >= 0 ? v << off : v >> -off;
        }
        const i64 b = k * 4;
        if (aligned && b + 4 <= nbytes) {
            ((u32*)out)[k] = (u32)acc;
        } else {
            for (int t = 0; t < 4; ++t)
                if (b + t < nbytes) out[b + t] = (u8)(acc >> (8 * t));
        }
    }
}

// Pack (u32)(codes[i] + shift) at `width` bits: mpicomp_bits_pack_shifted.
extern "C" __global__ void mpicomp_bits_pack_shifted(const void* codes, int kind, i64 n,
                                                     i64 shift, int width, u8* out,
                                                     i64 nbytes) {
    mpicomp_bits_repack(n, width, out, nbytes, [&](i64 e) {
        return (u32)((u64)mpicomp_load_int(codes, kind, e) + (u64)shift);
    });
}

// out[i] = code i - shift: mpicomp_bits_unpack_shifted.
extern "C" __global__ void mpicomp_bits_unpack_shifted(const u8* stream, i64 nbytes_in,
                                                       int width, i64 shift, void* out,
                                                       int kind, i64 n) {
    const bool aligned = mpicomp_bits_aligned(stream);
    MPICOMP_FOR(i, n) {
        const u32 c = mpicomp_bits_code(stream, nbytes_in, aligned, i, width);
        mpicomp_store_int(out, kind, i, (u64)c - (u64)shift);
    }
}

// Pack code i + (u32)(mine[i] + shift) (uint32 arithmetic) at `out_width` bits: one ring step.
extern "C" __global__ void mpicomp_bits_add_repack(const u8* stream, i64 nbytes_in, int width,
                                                   const void* mine, int kind, i64 n,
                                                   i64 shift, int out_width, u8* out,
                                                   i64 nbytes) {
    const bool aligned = mpicomp_bits_aligned(stream);
    mpicomp_bits_repack(n, out_width, out, nbytes, [&](i64 e) {
        const u32 c = mpicomp_bits_code(stream, nbytes_in, aligned, e, width);
        return c + (u32)((u64)mpicomp_load_int(mine, kind, e) + (u64)shift);
    });
}

// out[i] = code i + mine[i] + shift (int64 arithmetic, wrapping): a ring step's sums unpacked.
extern "C" __global__ void mpicomp_bits_add_unpack(const u8* stream, i64 nbytes_in, int width,
                                                   const void* mine, int kind, i64 shift,
                                                   void* out, int out_kind, i64 n) {
    const bool aligned = mpicomp_bits_aligned(stream);
    MPICOMP_FOR(i, n) {
        const u32 c = mpicomp_bits_code(stream, nbytes_in, aligned, i, width);
        const u64 m = (u64)mpicomp_load_int(mine, kind, i);
        mpicomp_store_int(out, out_kind, i, (u64)c + m + (u64)shift);
    }
}

// Pack min(code i, (u32)mine[i]) at `width` bits: the MIN ring's step.
extern "C" __global__ void mpicomp_bits_min_repack(const u8* stream, i64 nbytes_in, int width,
                                                   const void* mine, int kind, i64 n, u8* out,
                                                   i64 nbytes) {
    const bool aligned = mpicomp_bits_aligned(stream);
    mpicomp_bits_repack(n, width, out, nbytes, [&](i64 e) {
        const u32 c = mpicomp_bits_code(stream, nbytes_in, aligned, e, width);
        const u32 m = (u32)mpicomp_load_int(mine, kind, e);
        return c < m ? c : m;
    });
}
