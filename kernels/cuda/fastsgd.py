"""Launchers of the CUDA ``fastsgd`` family (kernels/cuda/fastsgd.cu): the numba record's names
and signatures (kernels/cpu/fastsgd.py), the same bytes.

Host synchronizations: ``encode`` one (its NaN/Inf flag), ``scan`` one (its error code);
``powers``, ``assemble`` and ``decode`` none.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import fastsgd as _k

FAMILY = "fastsgd"

#: Constants shared with the numba twin, as -D macros of the module.
DEFINES = {
    "MPICOMP_FASTSGD_HEAD": str(_k.BUCKET_HEAD_BYTES),
    "MPICOMP_FASTSGD_PREFIX": str(_k.PREFIX_BYTES),
    "MPICOMP_FASTSGD_SIGN_BIT": str(_k.SIGN_BIT),
    "MPICOMP_FASTSGD_OK": str(_k.OK),
    "MPICOMP_FASTSGD_ERR_TRUNCATED": str(_k.ERR_TRUNCATED),
    "MPICOMP_FASTSGD_ERR_TRAILING": str(_k.ERR_TRAILING),
    "MPICOMP_FASTSGD_ERR_SUM": str(_k.ERR_SUM),
    "MPICOMP_FASTSGD_ERR_COUNT": str(_k.ERR_COUNT),
    "MPICOMP_FASTSGD_ERR_WIDTH": str(_k.ERR_WIDTH),
    "MPICOMP_FASTSGD_ERR_CODE": str(_k.ERR_CODE),
    "MPICOMP_FASTSGD_ERR_KEY_BITS": str(_k.ERR_KEY_BITS),
    "MPICOMP_FASTSGD_ERR_KEY_ORDER": str(_k.ERR_KEY_ORDER),
    "MPICOMP_FASTSGD_ERR_KEY_FLAG": str(_k.ERR_KEY_FLAG),
    "MPICOMP_FASTSGD_ERR_KEY_TAIL": str(_k.ERR_KEY_TAIL),
}

#: Elements of one encoding chunk and bytes of one assembly piece (FS_CHUNK, FS_PIECE in the .cu).
CHUNK = 2048
PIECE = 4096
_LIMBS = 10  # FS_LIMBS: 32-bit limbs of a bucket's exact sum


def launchers(dev) -> SimpleNamespace:
    """Return the ``fastsgd`` launchers bound to ``dev``."""
    xp = dev.xp
    i64 = np.int64

    def k(name):
        return dev.kernel(FAMILY, f"mpicomp_fastsgd_{name}", DEFINES)

    def powers(base, tau):
        """Return b^L for L = 0..tau as float64, each the previous one times b."""
        p = xp.empty(int(tau) + 1, np.float64)
        k("powers")((1,), (32,), (np.float64(base), i64(tau), p))
        return p

    def encode(x, bucket, powers, flag_bits, scratch, cap, sizes) -> bool:
        """Encode float32 ``x`` bucket by bucket into ``cap``-byte slots of ``scratch``, each
        bucket's byte count into ``sizes``; return False if ``x`` holds NaN or Inf (one sync)."""
        n, nb = int(x.size), int(sizes.size)
        if nb == 0:
            return True
        bucket, fb, cap = int(bucket), int(flag_bits), int(cap)
        tau = int(powers.size) - 1
        xbits = x.view(np.uint32)
        blen = min(bucket, n)
        cpb = -(-blen // CHUNK)  # chunks per bucket (the last bucket's tail ones may be empty)
        nchunks = nb * cpb
        # Worst-case key words of one bucket: every value kept with the widest key.
        wcap = (blen * (fb + max(blen - 1, 0).bit_length()) + 31) // 32 + 1
        acc = xp.zeros(nb * _LIMBS, np.uint64)
        bad = xp.zeros(nb, np.int32)
        anybad = xp.zeros(1, np.int32)
        sbits = xp.empty(nb, np.uint32)
        per_chunk = xp.empty((8, nchunks), np.int64)
        ccount, cfirst, clast, cgap, coff, cprev, cbits, cboff = per_chunk
        dk = xp.empty(nb, np.int64)
        wk = xp.empty(nb, np.int32)
        kbytes = xp.empty(nb, np.int64)
        words = xp.empty(nb * wcap, np.uint32)
        t = (dev.threads,)
        gc = (min(dev.max_blocks, nchunks),)  # a block per chunk, grid-stride
        gb = (min(dev.max_blocks, nb),)  # a block per bucket, grid-stride
        geo = (xbits, i64(n), i64(bucket), i64(cpb), i64(nchunks))
        k("sum")(gc, t, (*geo, acc, bad))
        k("round")((dev.grid(nb),), t, (acc, bad, i64(nb), sbits, anybad))
        sel = (powers, i64(tau))
        k("filter")(gc, t, (*geo, *sel, sbits, bad, ccount, cfirst, clast, cgap))
        k("plan")(gb, t, (i64(nb), i64(cpb), bad, ccount, cfirst, clast, cgap, coff, cprev, dk, wk))
        k("codes")(
            gc, t, (*geo, *sel, i64(fb), sbits, bad, coff, cprev, wk, scratch, i64(cap), cbits)
        )
        k("finish")(
            gb,
            t,
            (i64(nb), i64(cpb), bad, sbits, dk, wk, cbits, cboff, kbytes, words, i64(wcap))
            + (scratch, i64(cap), sizes),
        )
        k("keys")(gc, t, (*geo, *sel, i64(fb), sbits, bad, cprev, wk, cboff, words, i64(wcap)))
        k("copy")(
            gc, t, (i64(nb), i64(cpb), bad, dk, kbytes, cboff, words, i64(wcap), scratch, i64(cap))
        )
        return not int(dev.to_host(anybad, why="fastsgd.encode: non-finite flag")[0])

    def assemble(scratch, cap, sizes, offsets, body):
        """Copy bucket k's sizes[k] bytes from scratch[k*cap:] to body[offsets[k]:]."""
        nb = int(sizes.size)
        if nb == 0:
            return
        ppb = max(-(-int(cap) // PIECE), 1)
        grid = (min(dev.max_blocks, nb * ppb),)
        args = (scratch, i64(cap), sizes, offsets, i64(nb), i64(ppb), body)
        k("assemble")(grid, (dev.threads,), args)

    def scan(body, n, bucket, flag_bits, offsets, sums):
        """Walk the bucket headers, check every length against the body; fill offsets and
        sums; return an error code (one sync)."""
        err = xp.zeros(1, np.int64)
        nb = int(offsets.size) - 1
        args = (body, i64(body.size), i64(n), i64(bucket), i64(flag_bits), offsets, sums)
        k("scan")((1,), (32,), (*args, i64(nb), err))
        return int(dev.to_host(err, why="fastsgd.scan: corrupt-stream flag")[0])

    def decode(body, n, bucket, powers, flag_bits, offsets, sums, out, errs, accumulate):
        """Scatter +-float32(sum / b^L) at the decoded keys of each bucket into out; set errs[k]
        (each bucket's slice zeroed first unless ``accumulate``, where values are added)."""
        nb = int(offsets.size) - 1
        if nb <= 0:
            return
        n, bucket = int(n), int(bucket)
        if not accumulate:
            m = min(n, nb * bucket)
            k("zero")((dev.grid(m),), (dev.threads,), (out, i64(m)))
        args = (body, i64(n), i64(bucket), powers, i64(powers.size - 1), i64(flag_bits))
        args += (offsets, sums, i64(nb), out, errs, np.int32(bool(accumulate)))
        k("decode")((dev.grid(nb),), (dev.threads,), args)

    return SimpleNamespace(
        powers=powers, encode=encode, assemble=assemble, scan=scan, decode=decode
    )
