"""CUDA launchers of the signSGD family (``signsgd.cu``), twins of ``kernels/cpu/signsgd.py``.

The launchers are the numba twin's, in its order, each taking the device it launches on
before the twin's arguments (``launchers(dev)`` binds them); same outputs and return
values. The launchers that return a flag or a sum bring it to the host once
(``dev.to_host``), ``majority`` with ``readback.read`` (later, with its batch, inside
one); ``expand`` brings nothing back.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels.cuda import bind, contiguous, family_kernel
from mpicomp.kernels.cuda.device import int_kind
from mpicomp.kernels.readback import read
from mpicomp.kernels.signsgd import CHUNK, TIE_POSITIVE, TIE_RANDOM

#: Threads per block of the lane-sum kernels (at most): a block holds one chunk at a time and
#: its four chains run the length of the chunk, so small blocks let all chunks be resident at
#: once (12 blocks of 128 threads per SM: 1,584 chunks on an H100, 100M elements).
LANE_THREADS = 128

#: 16-byte loads per thread and tile of the lane-sum kernels (common.cuh: MPICOMP_LANE_VECS).
LANE_VECS = 2

DEFINES = {
    "MPICOMP_SIGNSGD_CHUNK": str(CHUNK),
    "MPICOMP_SIGNSGD_LANE_THREADS": str(LANE_THREADS),
    "MPICOMP_LANE_VECS": str(LANE_VECS),
    "MPICOMP_SIGNSGD_TIE_POSITIVE": str(TIE_POSITIVE),
    "MPICOMP_SIGNSGD_TIE_RANDOM": str(TIE_RANDOM),
}

_kernel = family_kernel("signsgd", DEFINES)


def _bits_of(dev, x, what: str):
    x = dev.flat(x)
    if x.dtype != np.float32:
        raise TypeError(f"signsgd {what}: x must be float32, got {x.dtype}")
    return x.view(np.uint32)  # the kernels read bit patterns (denormals survive -ftz)


def _lane_shape(dev, ngroups: int) -> tuple[tuple[int], tuple[int], int]:
    """Return the (grid, block, shared_mem) of ``common.cuh``'s ``mpicomp_lane_sums`` over
    ``ngroups`` groups of pieces: up to twice the device's grid-stride blocks' threads, in
    blocks of at most ``LANE_THREADS``, and a tile of 16 * LANE_VECS bytes per thread."""
    threads = min(dev.threads, LANE_THREADS)
    most = 2 * dev.max_blocks * max(1, dev.threads // threads)
    return (int(max(1, min(ngroups, most))),), (threads,), 16 * LANE_VECS * threads


def _sum_abs(dev, x, out):
    """Return (no NaN/Inf, sum |x|) of the bits ``x``; write the votes too when ``out`` is given."""
    n = x.size
    if n == 0:
        return True, 0.0
    nchunks = (n + CHUNK - 1) // CHUNK
    lanes = dev.xp.empty(4 * nchunks, np.float64)
    res = dev.xp.zeros(2, np.uint64)  # the bits of the sum, the NaN/Inf flag
    grid, block, smem = _lane_shape(dev, nchunks)
    if out is None:
        _kernel(dev, "abs_lanes")(grid, block, (x, np.int64(n), lanes, res), shared_mem=smem)
    else:
        args = (x, np.int64(n), out, lanes, res)
        _kernel(dev, "votes_lanes")(grid, block, args, shared_mem=smem)
    _kernel(dev, "total")((1,), (32,), (lanes, np.int64(nchunks), res))
    res = dev.to_host(res, why="signsgd.sum_abs: sum and non-finite flag")
    return not res[1], float(res[:1].view(np.float64)[0])


def _flagged(dev, name: str, n_items: int, *args, later: bool = False):
    """Launch ``name`` over ``n_items`` with ``args`` and a flag; return not flag (``later``:
    as ``readback.read`` returns it, a ``Later`` in a batch)."""
    flags = dev.xp.zeros(1, np.uint64)
    _kernel(dev, name)(*dev.launch_shape(n_items), (*args, flags))
    if later:
        return read(dev, flags, f"signsgd.{name}: flag", _clear)
    return _clear(dev.to_host(flags, why=f"signsgd.{name}: flag"))


def _clear(flags) -> bool:
    return not flags[0]


def pack(dev, x, out):
    """Pack bit i = (x[i] > 0) LSB-first into ``out``; return False if ``x`` holds NaN/Inf."""
    x = _bits_of(dev, x, "pack")
    nbytes = (x.size + 7) // 8
    out = contiguous(out, "signsgd pack", size=nbytes, dtype=np.uint8)
    if x.size == 0:
        return True
    warps = -(-x.size // 256)  # a warp packs 256 elements at a time
    return _flagged(dev, "pack", 32 * warps, x, np.int64(x.size), out)


def votes_scale(dev, x, out):
    """As ``kernels.cpu.signsgd.mpicomp_signsgd_votes_scale``: the votes of ``x`` into ``out``
    and (no NaN/Inf in x, sum |x| in float64), in one pass."""
    x = _bits_of(dev, x, "votes_scale")
    return _sum_abs(dev, x, contiguous(out, "signsgd votes_scale", size=x.size, dtype=np.uint8))


def votes(dev, x, out):
    """Write out[i] = 1 if x[i] > 0 else 0; return False if ``x`` holds NaN/Inf."""
    x = _bits_of(dev, x, "votes")
    out = contiguous(out, "signsgd votes", size=x.size, dtype=np.uint8)
    if x.size == 0:
        return True
    return _flagged(dev, "votes", x.size, x, np.int64(x.size), out)


def majority(dev, counts, nranks, tie, key, offset, out):
    """As ``kernels.cpu.signsgd.mpicomp_signsgd_majority``: pack the majority bits of
    ``counts`` (ties by ``tie``, TIE_RANDOM's bit drawn at ``offset + i``); False if a
    count lies outside [0, nranks]."""
    counts = dev.flat(counts, codes=True)
    n = counts.size
    nbytes = (n + 7) // 8
    out = contiguous(out, "signsgd majority", size=nbytes, dtype=np.uint8)
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
    return _flagged(dev, "majority", nbytes, *args, later=True)


def expand(dev, bits, scale, out):
    """Write out[i] = +scale if bit i of ``bits`` is set, else -scale."""
    n = out.size
    out = contiguous(out, "signsgd expand", size=n, dtype=np.float32)
    bits = dev.flat(bits, np.uint8)
    if bits.size < (n + 7) // 8:
        raise ValueError(f"signsgd expand: {bits.size} bytes cannot hold {n} bits")
    if n:
        args = (bits, np.float32(scale), out.view(np.uint32), np.int64(n))
        _kernel(dev, "expand")(*dev.launch_shape(-(-n // 4)), args)  # 4 elements a thread


def abs_sum(dev, x):
    """Return sum |x| accumulated in float64 in a fixed order (NaN/Inf propagate).

    The order is the numba twin's, so the sums are the same bits.
    """
    return _sum_abs(dev, _bits_of(dev, x, "abs_sum"), None)[1]


def launchers(dev) -> SimpleNamespace:
    """Return the ``signsgd`` launchers bound to ``dev``."""
    return bind(dev, "signsgd")
