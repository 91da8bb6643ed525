"""CUDA launchers of the FastSGD family (``fastsgd.cu``), twins of ``kernels/cpu/fastsgd.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them); the same bytes. Host
synchronizations: ``encode`` one (its NaN/Inf flag), ``scan`` one (its error code), both
through ``readback.read`` (later, with their batch, inside one); ``powers``, ``assemble``
and ``decode`` none.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import fastsgd as _k
from mpicomp.kernels.cuda import bind, family_kernel
from mpicomp.kernels.readback import read

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
#: Most threads of a decode block (FS_DT in the .cu: its shared tables are sized for it).
DECODE_THREADS = 128
_LIMBS = 10  # FS_LIMBS: 32-bit limbs of a bucket's exact sum

_i64 = np.int64  # keeps the long argument tuples short


_kernel = family_kernel(FAMILY, DEFINES)


def powers(dev, base, tau):
    """Return b^L for L = 0..tau as float64, each the previous one times b (no libm pow)."""
    p = dev.xp.empty(int(tau) + 1, np.float64)
    _kernel(dev, "powers")((1,), (32,), (np.float64(base), _i64(tau), p))
    return p


def assemble(dev, scratch, cap, sizes, offsets, body):
    """Copy bucket k's sizes[k] bytes from scratch[k*cap:] to body[offsets[k]:]."""
    nb = int(sizes.size)
    if nb == 0:
        return
    ppb = max(-(-int(cap) // PIECE), 1)
    grid = (min(dev.max_blocks, nb * ppb),)
    args = (scratch, _i64(cap), sizes, offsets, _i64(nb), _i64(ppb), body)
    _kernel(dev, "assemble")(grid, (dev.threads,), args)


def scan(dev, body, n, bucket, flag_bits, offsets, sums):
    """Walk the bucket headers, check every length against the body; fill offsets and sums; return an error code."""
    err = dev.xp.zeros(1, np.int64)
    nb = int(offsets.size) - 1
    args = (body, _i64(body.size), _i64(n), _i64(bucket), _i64(flag_bits), offsets, sums)
    _kernel(dev, "scan")((1,), (32,), (*args, _i64(nb), err))
    return read(dev, err, "fastsgd.scan: corrupt-stream flag", _first_int)


def decode(dev, body, n, bucket, powers, flag_bits, offsets, sums, out, errs, accumulate):
    """As ``kernels.cpu.fastsgd.mpicomp_fastsgd_decode``: each bucket's values scattered
    into ``out`` (its slice zeroed first unless ``accumulate``), errs[k] set; a block per
    bucket decodes its key stream in parallel, FS_SEG-bit segments at a time."""
    nb = int(offsets.size) - 1
    if nb <= 0:
        return
    # Blocks of DECODE_THREADS fit twice as many per SM as the grid-stride ones (8 on an
    # H100, by shared memory): 100M elements' 763 buckets then decode in one wave.
    grid = (int(min(nb, 2 * dev.max_blocks)),)
    block = (min(dev.threads, DECODE_THREADS),)
    args = (body, _i64(n), _i64(bucket), powers, _i64(powers.size - 1), _i64(flag_bits))
    args += (offsets, sums, _i64(nb), out, errs, np.int32(bool(accumulate)))
    _kernel(dev, "decode")(grid, block, args)


def encode(dev, x, bucket, powers, flag_bits, scratch, cap, sizes) -> bool:
    """Encode float32 ``x`` bucket by bucket into ``cap``-byte slots of ``scratch``, each
    bucket's byte count into ``sizes``; return False if ``x`` holds NaN or Inf."""
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
    xp = dev.xp
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
    geo = (xbits, _i64(n), _i64(bucket), _i64(cpb), _i64(nchunks))
    _kernel(dev, "sum")(gc, t, (*geo, acc, bad))
    _kernel(dev, "round")(*dev.launch_shape(nb), (acc, bad, _i64(nb), sbits, anybad))
    sel = (powers, _i64(tau))
    _kernel(dev, "filter")(gc, t, (*geo, *sel, sbits, bad, ccount, cfirst, clast, cgap))
    _kernel(dev, "plan")(
        gb, t, (_i64(nb), _i64(cpb), bad, ccount, cfirst, clast, cgap, coff, cprev, dk, wk)
    )
    _kernel(dev, "codes")(
        gc, t, (*geo, *sel, _i64(fb), sbits, bad, coff, cprev, wk, scratch, _i64(cap), cbits)
    )
    _kernel(dev, "finish")(
        gb,
        t,
        (_i64(nb), _i64(cpb), bad, sbits, dk, wk, cbits, cboff, kbytes, words, _i64(wcap))
        + (scratch, _i64(cap), sizes),
    )
    _kernel(dev, "keys")(
        gc, t, (*geo, *sel, _i64(fb), sbits, bad, cprev, wk, cboff, words, _i64(wcap))
    )
    _kernel(dev, "copy")(
        gc, t, (_i64(nb), _i64(cpb), bad, dk, kbytes, cboff, words, _i64(wcap), scratch, _i64(cap))
    )
    return read(dev, anybad, "fastsgd.encode: non-finite flag", _none_bad)


def _first_int(host) -> int:
    return int(host[0])


def _none_bad(host) -> bool:
    return not int(host[0])


def launchers(dev) -> SimpleNamespace:
    """Return the ``fastsgd`` launchers bound to ``dev``."""
    return bind(dev, "fastsgd")
