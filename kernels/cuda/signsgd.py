"""CUDA launchers of the signSGD family (``signsgd.cu``), twins of ``kernels/cpu/signsgd.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them); same outputs and return
values. The launchers that return a flag or a sum bring it to the host once
(``dev.to_host``); ``expand`` brings nothing back.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.cuda import bind
from mpicomp.kernels.cuda.device import int_kind
from mpicomp.kernels.signsgd import CHUNK, TIE_POSITIVE, TIE_RANDOM

DEFINES = {
    "MPICOMP_SIGNSGD_CHUNK": str(CHUNK),
    "MPICOMP_SIGNSGD_TIE_POSITIVE": str(TIE_POSITIVE),
    "MPICOMP_SIGNSGD_TIE_RANDOM": str(TIE_RANDOM),
}


def _out(a, dtype, size: int, what: str):
    # The kernels write through a raw pointer: a strided view would be written wrongly.
    if not a.flags.c_contiguous or a.dtype != dtype:
        raise ValueError(f"signsgd {what}: out must be a C-contiguous {np.dtype(dtype)} array")
    a = a.reshape(-1)
    if a.size < size:
        raise ValueError(f"signsgd {what}: out has {a.size} elements, needs {size}")
    return a


def _kernel(dev, name: str):
    return dev.kernel("signsgd", f"mpicomp_signsgd_{name}", DEFINES)


def _bits_of(dev, x, what: str):
    x = dev.xp.ascontiguousarray(x).reshape(-1)
    if x.dtype != np.float32:
        raise TypeError(f"signsgd {what}: x must be float32, got {x.dtype}")
    return x.view(np.uint32)  # the kernels read bit patterns (denormals survive -ftz)


def _grid(dev, n: int):
    return (dev.grid(n),), (dev.threads,)


def _sum_abs(dev, x, out):
    """Return (no NaN/Inf, sum |x|) of the bits ``x``; write the votes too when ``out`` is given."""
    n = x.size
    if n == 0:
        return True, 0.0
    nchunks = (n + CHUNK - 1) // CHUNK
    lanes = dev.xp.empty(4 * nchunks, np.float64)
    res = dev.xp.zeros(2, np.uint64)  # the bits of the sum, the NaN/Inf flag
    if out is None:
        _kernel(dev, "abs_lanes")(*_grid(dev, 4 * nchunks), (x, np.int64(n), lanes, res))
    else:
        _kernel(dev, "votes_lanes")(*_grid(dev, 4 * nchunks), (x, np.int64(n), out, lanes, res))
    _kernel(dev, "total")((1,), (32,), (lanes, np.int64(nchunks), res))
    res = dev.to_host(res, why="signsgd.sum_abs: sum and non-finite flag")
    return not res[1], float(res[:1].view(np.float64)[0])


def _flagged(dev, name: str, n_items: int, *args):
    """Launch ``name`` over ``n_items`` with ``args`` and a flag; return not flag."""
    flags = dev.xp.zeros(1, np.uint64)
    _kernel(dev, name)(*_grid(dev, n_items), (*args, flags))
    return not dev.to_host(flags, why=f"signsgd.{name}: flag")[0]


def pack(dev, x, out):
    """Pack bit i = (x[i] > 0) LSB-first into ``out``; return False if ``x`` holds NaN/Inf."""
    x = _bits_of(dev, x, "pack")
    nbytes = (x.size + 7) // 8
    out = _out(out, np.uint8, nbytes, "pack")
    if x.size == 0:
        return True
    return _flagged(dev, "pack", nbytes, x, np.int64(x.size), out)


def votes_scale(dev, x, out):
    """Write out[i] = 1 if x[i] > 0 else 0 and return (no NaN/Inf in x, sum |x| in float64).

    One pass over x for both the votes and the scale.
    """
    x = _bits_of(dev, x, "votes_scale")
    return _sum_abs(dev, x, _out(out, np.uint8, x.size, "votes_scale"))


def votes(dev, x, out):
    """Write out[i] = 1 if x[i] > 0 else 0; return False if ``x`` holds NaN/Inf."""
    x = _bits_of(dev, x, "votes")
    out = _out(out, np.uint8, x.size, "votes")
    if x.size == 0:
        return True
    return _flagged(dev, "votes", x.size, x, np.int64(x.size), out)


def majority(dev, counts, nranks, tie, key, offset, out):
    """Pack bit i = majority of ``nranks`` votes given ``counts[i]`` votes for +1, LSB-first.

    A tie (2*count == nranks) follows ``tie``; TIE_RANDOM draws the bit from the
    counter-based RNG at global index ``offset + i``, identical on every rank.
    Returns False (``out`` then undefined) if a count lies outside [0, nranks].
    """
    counts = dev.xp.ascontiguousarray(counts).reshape(-1)
    if counts.dtype == np.bool_:
        counts = counts.view(np.uint8)
    n = counts.size
    nbytes = (n + 7) // 8
    out = _out(out, np.uint8, nbytes, "majority")
    if n == 0:
        return True
    args = (
        counts,
        int_kind(counts, "signsgd majority: counts"),
        np.int64(n),
        np.int64(nranks),
        np.int32(tie),
    )
    args += (np.uint64(int(key) % 2**64), np.int64(offset), out)
    return _flagged(dev, "majority", nbytes, *args)


def expand(dev, bits, scale, out):
    """Write out[i] = +scale if bit i of ``bits`` is set, else -scale."""
    n = out.size
    out = _out(out, np.float32, n, "expand")
    bits = dev.xp.ascontiguousarray(bits).reshape(-1).view(np.uint8)
    if bits.size < (n + 7) // 8:
        raise ValueError(f"signsgd expand: {bits.size} bytes cannot hold {n} bits")
    if n:
        args = (bits, np.float32(scale), out.view(np.uint32), np.int64(n))
        _kernel(dev, "expand")(*_grid(dev, n), args)


def abs_sum(dev, x):
    """Return sum |x| accumulated in float64 in a fixed order (NaN/Inf propagate).

    The order is the numba twin's, so the sums are the same bits.
    """
    return _sum_abs(dev, _bits_of(dev, x, "abs_sum"), None)[1]


def launchers(dev) -> SimpleNamespace:
    """Return the ``signsgd`` launchers bound to ``dev``."""
    return bind(
        dev,
        votes=votes,
        pack=pack,
        votes_scale=votes_scale,
        abs_sum=abs_sum,
        majority=majority,
        expand=expand,
    )
