"""CUDA launchers of the QSGD-MaxNorm family (``qsgd.cu``), twins of ``kernels/cpu/qsgd.py``.

The launchers are the numba twin's, in its order, with its arguments: the methods of
``Qsgd``, a class rather than module functions because it keeps a per-GPU device array
(the index a dense launch passes, where the twin takes a NumPy one); ``launchers(dev)``
makes one for a device and returns its launchers. Same outputs and return values. What
comes back to the host (one counted sync each): the sum in ``sumsq``, the error mask in
``block_norms``, ``quantize``, ``multiscale_index``, ``multiscale_quantize`` and the four ``*dequantize*``
(none for an empty input). The ``grandk_*`` launchers sync nothing.

Dtypes: ``x`` float32, ``idx`` int64 (others are widened), codes int8..int64, scale
indices uint8 or int64 (other integer dtypes are widened to int64, as the twin's
``np.int64(k)``), ``mask`` one byte per element. Float32 denormals flush to zero on a GPU
(CuPy's ``-ftz=true``): values or norms below 2**-126 may give other codes than the twin's.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import qsgd as kq
from mpicomp.kernels.cuda import family_kernel
from mpicomp.kernels.families import find_launchers
from mpicomp.kernels.readback import read

#: Mask bytes per tile of ``grandk_compact`` (one block counts, then writes, one tile).
TILE = 4096

#: Threads per block of ``sumsq_lanes`` (at most): a block runs the 8 chains of each piece of
#: its group; pieces of a CHUNK (the tensor's norm) give one piece per block, and small blocks
#: let all of them be resident at once (12 blocks of 128 threads per SM).
LANE_THREADS = 128

#: 16-byte loads per thread and tile of ``sumsq_lanes`` (common.cuh: MPICOMP_LANE_VECS).
LANE_VECS = 2

DEFINES = {
    "MPICOMP_QSGD_CHUNK": str(kq.CHUNK),
    "MPICOMP_QSGD_LANE_THREADS": str(LANE_THREADS),
    "MPICOMP_LANE_VECS": str(LANE_VECS),
    "MPICOMP_QSGD_TILE": str(TILE),
    "MPICOMP_QSGD_LIMIT": f"{float(kq.LIMIT).hex()}f",  # exact: a float32 in hex
    "MPICOMP_QSGD_ERR_VALUE": f"{kq.ERR_VALUE}u",
    "MPICOMP_QSGD_ERR_RANGE": f"{kq.ERR_RANGE}u",
    "MPICOMP_QSGD_ERR_NORM": f"{kq.ERR_NORM}u",
    "MPICOMP_QSGD_ERR_OVERFLOW": f"{kq.ERR_OVERFLOW}u",
    "MPICOMP_QSGD_F32_MAX": f"{float(kq.F32_MAX).hex()}f",
}

_CODES = {
    np.dtype(t): f"i{8 * np.dtype(t).itemsize}" for t in (np.int8, np.int16, np.int32, np.int64)
}
_INDEX = {np.dtype(np.uint8): "u8", np.dtype(np.int64): "i64"}
_U32_MAX = 0xFFFFFFFF

_kernel = family_kernel("qsgd", DEFINES)


def _first_int(host) -> int:
    return int(host[0])


def _floats(x, name: str = "x"):
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32 on the cuda backends, got {x.dtype}")
    return x


def _bytes_of(mask):
    if mask.dtype.itemsize != 1:
        raise TypeError(f"mask must hold one byte per element, got {mask.dtype}")
    return mask.view(np.uint8)


def _codes_of(a):
    """Return (a, suffix): signed codes as they are; any other integers widened to int64."""
    if a.dtype not in _CODES:
        a = a.astype(np.int64)  # the twin reads every code as np.int64(c)
    return a, _CODES[a.dtype]


def _out_codes(out) -> str:
    if out.dtype not in _CODES:
        raise TypeError(f"codes must be int8, int16, int32 or int64, got {out.dtype}")
    return _CODES[out.dtype]


def _index_of(sidx):
    if sidx.dtype not in _INDEX:
        sidx = sidx.astype(np.int64)  # wraps as np.int64(k) does: outside the set either way
    return sidx, _INDEX[sidx.dtype]


def _scale_set(scales):
    return scales if scales.dtype == np.float32 else scales.astype(np.float32)


def _int64(a):
    return a if a.dtype == np.int64 else a.astype(np.int64)


def _blocks(norms, starts, regular) -> tuple:
    """Return the kernels' QSGD_BLOCKS arguments: float32 norms, int64 starts, nb, regular."""
    norms = norms if norms.dtype == np.float32 else norms.astype(np.float32)
    return norms, _int64(starts), np.int64(starts.size - 1), np.int64(regular)


def _width_of(width) -> np.int32:
    if not 1 <= int(width) <= 32:
        raise ValueError(f"width must be in 1..32, got {width}")
    return np.int32(width)


def _group_shape(dev, n: int) -> tuple[tuple[int], tuple[int]]:
    """Return the (grid, block) of the element kernels over ``n`` elements: a thread per group
    of 4, up to twice the device's grid-stride blocks (on a GPU, 8 blocks of 256 threads per
    SM: every thread it can hold)."""
    groups = -(-n // 4)
    blocks = -(-groups // dev.threads)
    return (int(max(1, min(blocks, 2 * dev.max_blocks))),), (dev.threads,)


def _lane_shape(dev, n: int, npieces: int) -> tuple[tuple[int], tuple[int], int, np.int64]:
    """Return the (grid, block, shared_mem, group) of ``sumsq_lanes`` over ``npieces`` pieces of
    ``n`` elements in all: pieces per block group so that a group holds about one tile (pieces
    of 128 elements: 8 a group; a CHUNK: 1), 8 threads (chains) per piece."""
    threads = min(dev.threads, LANE_THREADS)
    span = 4 * LANE_VECS * threads  # elements per tile
    group = max(1, min(threads // 8, span // max(1, -(-n // npieces))))
    most = 2 * dev.max_blocks * max(1, dev.threads // threads)
    grid = int(max(1, min(-(-npieces // group), most)))
    return (grid,), (threads,), 16 * LANE_VECS * threads, np.int64(group)


class Qsgd:
    """The ``qsgd`` launchers on ``dev`` (a ``device.Device``)."""

    def __init__(self, dev):
        self._dev = dev
        self._no_index = {}  # per GPU: a device array where the twin gets a NumPy one

    def _launch(self, name: str, n: int, *args) -> None:
        _kernel(self._dev, name)(*self._dev.launch_shape(n), args)

    def _launch_groups(self, name: str, n: int, *args) -> None:
        """Launch element kernel ``name`` over ``n`` elements, a thread per group of 4."""
        _kernel(self._dev, name)(*_group_shape(self._dev, n), args)

    def _index(self, idx, dense):
        if dense:
            gpu = self._dev.current()
            if gpu not in self._no_index:
                self._no_index[gpu] = self._dev.xp.empty(0, dtype=np.int64)
            return self._no_index[gpu]
        return idx if idx.dtype == np.int64 else idx.astype(np.int64)

    def _flags(self):
        return self._dev.xp.zeros(1, dtype=np.uint32)

    def _result(self, err, launcher: str):
        """Return the error mask ``err`` (an int, or a ``readback.Later`` in a batch)."""
        return read(self._dev, err, f"qsgd.{launcher}: error mask", _first_int)

    def grandk_scatter(self, vals, idx, ratio, out) -> None:
        """Write out[idx[j]] = vals[j] * ratio (float32); out is zero elsewhere already."""
        k = idx.size
        if k:
            self._launch(
                "grandk_scatter",
                k,
                _floats(vals, "vals"),
                self._index(idx, False),
                np.float32(ratio),
                out,
                np.int64(k),
            )

    def grandk_select(self, n, k, key, mask, picks) -> None:
        """As ``kernels.cpu.qsgd.mpicomp_qsgd_grandk_select``: k distinct coordinates of
        [0, n) by Floyd's algorithm into ``mask`` and ``picks``.

        Scratch: a table of the first step drawing each value, direct (4n bytes) or hashed
        (12 bytes a slot, at least 2k slots), the smaller.
        """
        n, k = int(n), int(k)
        if k <= 0:
            return
        if k > n or k > _U32_MAX:
            raise ValueError(f"k must be in [0, min(n, 2**32 - 1)], got k={k} for n={n}")
        if picks.dtype != np.int64:
            raise TypeError(f"picks must be int64, got {picks.dtype}")
        mask8 = _bytes_of(mask)
        cap = 1 << max(6, (2 * k - 1).bit_length())
        direct = 4 * n <= 12 * cap
        xp = self._dev.xp
        table = xp.full(n if direct else cap, _U32_MAX, dtype=np.uint32)
        keys = xp.full(1 if direct else cap, np.uint64(2**64 - 1), dtype=np.uint64)
        geo = (np.int64(n), np.int64(k), np.uint64(key))
        hashed = (np.int32(direct), table, keys, np.uint64(cap - 1))
        self._launch("grandk_draw", k, *geo, *hashed)
        self._launch("grandk_resolve", k, *geo, mask8, *hashed, picks)
        self._launch("grandk_mark", k, picks, np.int64(k), mask8)

    def grandk_compact(self, mask, out) -> None:
        """Write the positions of the nonzero bytes of mask, in increasing order, to out."""
        n = mask.size
        if n == 0 or out.size == 0:
            return
        if out.dtype != np.int64:
            raise TypeError(f"out must be int64, got {out.dtype}")
        mask8 = _bytes_of(mask)
        ntiles = -(-n // TILE)
        counts = self._dev.xp.empty(ntiles, dtype=np.int64)
        launch, dev = self._dev.tile_shape(ntiles), self._dev
        _kernel(dev, "grandk_count")(*launch, (mask8, np.int64(n), counts))
        _kernel(dev, "grandk_offsets")((1,), (dev.threads,), (counts, np.int64(ntiles)))
        args = (mask8, np.int64(n), counts, out, np.int64(out.size))
        _kernel(dev, "grandk_compact")(*launch, args)

    def grandk_sort(self, picks) -> None:
        """Sort the coordinates ``picks`` in place (the short path when k is far below n).

        ``picks`` must be int64; merge passes ping-pong with a scratch array.
        """
        if picks.dtype != np.int64:
            raise TypeError(f"picks must be int64, got {picks.dtype}")
        n = picks.size
        if n < 2:
            return
        src, dst = picks, self._dev.xp.empty_like(picks)
        w = 1
        while w < n:
            self._launch("grandk_merge", n, src, dst, np.int64(n), np.int64(w))
            src, dst = dst, src
            w *= 2
        if src is not picks:
            picks[...] = src

    def _lanes(self, x, idx, dense, pieces):
        """Return the 8 lanes of every piece (``pieces``: int64 starts and the end)."""
        npieces = pieces.size - 1
        lanes = self._dev.xp.empty(8 * npieces, dtype=np.float64)
        index = self._index(idx, dense)
        n = x.size if dense else idx.size
        grid, block, smem, group = _lane_shape(self._dev, n, npieces)
        args = (_floats(x), index, np.int32(bool(dense)), pieces, np.int64(npieces), group, lanes)
        _kernel(self._dev, "sumsq_lanes")(grid, block, args, shared_mem=smem)
        return lanes

    def sumsq(self, x, idx, dense) -> float:
        """Return the float64 sum of squares of x (``dense``) or of x[idx], in CHUNK order."""
        n = x.size if dense else idx.size
        if n == 0:
            return 0.0
        nchunks = -(-n // kq.CHUNK)
        xp = self._dev.xp
        pieces = xp.minimum(xp.arange(nchunks + 1, dtype=np.int64) * kq.CHUNK, n)
        lanes = self._lanes(x, idx, dense, pieces)
        total = xp.empty(1, dtype=np.float64)
        args = (lanes, np.int64(nchunks), total)
        _kernel(self._dev, "sumsq_total")((1,), (self._dev.threads,), args)
        return float(self._dev.to_host(total, why="qsgd.sumsq: sum of squares")[0])

    def block_norms(self, x, idx, dense, pieces, first, out) -> int:
        """As ``kernels.cpu.qsgd.block_norms``: the float32 norm of each block into ``out``;
        return an error mask. ``pieces`` and ``first`` are int64 device arrays."""
        nb = out.size
        if nb == 0:
            return 0
        if out.dtype != np.float32:
            raise TypeError(f"norms are written as float32, got {out.dtype}")
        lanes = self._lanes(x, idx, dense, _int64(pieces))
        err = self._flags()
        self._launch("block_norms", nb, lanes, _int64(first), np.int64(nb), out, err)
        return self._result(err, "block_norms")

    def quantize(self, x, idx, dense, norms, starts, regular, levels, key, out) -> int:
        """Write the codes of x (``dense``) or x[idx] into ``out``, each against its block's
        norm (norms[b] for starts[b] <= i < starts[b + 1]); return an error mask."""
        n = out.size
        name = f"quantize_{_out_codes(out)}"
        if n == 0:
            return 0
        err = self._flags()
        self._launch_groups(
            name,
            n,
            _floats(x),
            self._index(idx, dense),
            np.int32(bool(dense)),
            *_blocks(norms, starts, regular),
            np.int64(levels),
            np.uint64(key),
            out,
            np.int64(n),
            err,
        )
        return self._result(err, "quantize")

    def multiscale_index(self, x, idx, dense, norms, starts, regular, scales, out) -> int:
        """Write each element's scale index into uint8 ``out``; return an error mask."""
        if out.dtype != np.uint8:
            raise TypeError(f"scale indices are written as uint8, got {out.dtype}")
        n = out.size
        if n == 0:
            return 0
        scales, err = _scale_set(scales), self._flags()
        self._launch_groups(
            "multiscale_index",
            n,
            _floats(x),
            self._index(idx, dense),
            np.int32(bool(dense)),
            *_blocks(norms, starts, regular),
            scales,
            np.int64(scales.size),
            out,
            np.int64(n),
            err,
        )
        return self._result(err, "multiscale_index")

    def multiscale_quantize(
        self, x, idx, dense, norms, starts, regular, scales, sidx, key, out
    ) -> int:
        """Write the codes at the shared scale indices ``sidx`` into ``out``; return an error mask."""
        n = out.size
        name = f"multiscale_quantize_{_out_codes(out)}"
        if n == 0:
            return 0
        sidx, kind = _index_of(sidx)
        scales, err = _scale_set(scales), self._flags()
        self._launch_groups(
            f"{name}_{kind}",
            n,
            _floats(x),
            self._index(idx, dense),
            np.int32(bool(dense)),
            *_blocks(norms, starts, regular),
            scales,
            np.int64(scales.size),
            sidx,
            np.uint64(key),
            out,
            np.int64(n),
            err,
        )
        return self._result(err, "multiscale_quantize")

    def dequantize(self, codes, norms, starts, regular, levels, nranks, limit, out, base=0) -> int:
        """Write out = ((codes * norm) / levels) / nranks in float32, norm each block's; return an error mask.

        codes[i] and out[i] are element ``base`` + i of the coded vector (its block's norm).
        """
        n = out.size
        if n == 0:
            return 0
        codes, _ = _codes_of(codes)
        err = self._flags()
        self._launch_groups(
            "dequantize",
            n,
            codes,
            np.int32(codes.dtype.itemsize),
            *_blocks(norms, starts, regular),
            np.int64(levels),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(base),
            np.int64(n),
            err,
        )
        return self._result(err, "dequantize")

    def dequantize_packed(
        self, stream, width, shift, norms, starts, regular, levels, nranks, limit, out, base=0
    ) -> int:
        """As ``dequantize`` for codes[i] = (the ``width``-bit code i of ``stream``) - shift."""
        n = out.size
        width = _width_of(width)
        if n == 0:
            return 0
        err = self._flags()
        self._launch_groups(
            "dequantize_packed",
            n,
            stream,
            np.int64(stream.nbytes),
            width,
            np.int64(shift),
            *_blocks(norms, starts, regular),
            np.int64(levels),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(base),
            np.int64(n),
            err,
        )
        return self._result(err, "dequantize_packed")

    def multiscale_dequantize(
        self, codes, sidx, norms, starts, regular, scales, nranks, limit, out, base=0
    ) -> int:
        """Write out = ((codes * norm) / scales[sidx]) / nranks in float32, element i of them
        element ``base`` + i of the coded vector; return an error mask."""
        n = out.size
        if n == 0:
            return 0
        codes, ckind = _codes_of(codes)
        sidx, kind = _index_of(sidx)
        scales, err = _scale_set(scales), self._flags()
        self._launch_groups(
            f"multiscale_dequantize_{ckind}_{kind}",
            n,
            codes,
            sidx,
            *_blocks(norms, starts, regular),
            scales,
            np.int64(scales.size),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(base),
            np.int64(n),
            err,
        )
        return self._result(err, "multiscale_dequantize")

    def multiscale_dequantize_packed(
        self, stream, width, shift, sidx, norms, starts, regular, scales, nranks, limit, out, base=0
    ):
        """As ``multiscale_dequantize`` for codes read from a packed ``stream`` (less ``shift``)."""
        n = out.size
        width = _width_of(width)
        if n == 0:
            return 0
        sidx, kind = _index_of(sidx)
        scales, err = _scale_set(scales), self._flags()
        self._launch_groups(
            f"multiscale_dequantize_packed_{kind}",
            n,
            stream,
            np.int64(stream.nbytes),
            width,
            np.int64(shift),
            sidx,
            *_blocks(norms, starts, regular),
            scales,
            np.int64(scales.size),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(base),
            np.int64(n),
            err,
        )
        return self._result(err, "multiscale_dequantize_packed")


def launchers(dev) -> SimpleNamespace:
    """Return the ``qsgd`` launchers bound to ``dev``: the methods of its ``Qsgd``."""
    return SimpleNamespace(**find_launchers("qsgd", (Qsgd(dev),), ("{name}",)))
