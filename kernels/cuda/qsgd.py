"""CUDA launchers of the QSGD-MaxNorm family (``qsgd.cu``), twins of ``kernels/cpu/qsgd.py``.

Same names, arguments, outputs and return values as the numba record's ``qsgd``. What
comes back to the host (one counted sync each): the sum in ``sumsq``, the error mask in
``quantize``, ``multiscale_index``, ``multiscale_quantize`` and the four ``*dequantize*``
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

#: Mask bytes per tile of ``grandk_compact`` (one block counts, then writes, one tile).
TILE = 4096

DEFINES = {
    "MPICOMP_QSGD_CHUNK": str(kq.CHUNK),
    "MPICOMP_QSGD_TILE": str(TILE),
    "MPICOMP_QSGD_LIMIT": f"{float(kq.LIMIT).hex()}f",  # exact: a float32 in hex
    "MPICOMP_QSGD_ERR_VALUE": f"{kq.ERR_VALUE}u",
    "MPICOMP_QSGD_ERR_RANGE": f"{kq.ERR_RANGE}u",
}

_CODES = {
    np.dtype(t): f"i{8 * np.dtype(t).itemsize}" for t in (np.int8, np.int16, np.int32, np.int64)
}
_INDEX = {np.dtype(np.uint8): "u8", np.dtype(np.int64): "i64"}
_U32_MAX = 0xFFFFFFFF


def launchers(dev) -> SimpleNamespace:
    """Return the ``qsgd`` launchers bound to ``dev``."""
    xp = dev.xp
    no_index = {}  # per GPU: a device array where the twin gets a NumPy one

    def kernel(name):
        return dev.kernel("qsgd", f"mpicomp_qsgd_{name}", DEFINES)

    def launch(name, n, *args):
        kernel(name)((dev.grid(n),), (dev.threads,), args)

    def floats(x, name="x"):
        if x.dtype != np.float32:
            raise TypeError(f"{name} must be float32 on the cuda backends, got {x.dtype}")
        return x

    def bytes_of(mask):
        if mask.dtype.itemsize != 1:
            raise TypeError(f"mask must hold one byte per element, got {mask.dtype}")
        return mask.view(np.uint8)

    def index(idx, dense):
        if dense:
            gpu = dev.current()
            if gpu not in no_index:
                no_index[gpu] = xp.empty(0, dtype=np.int64)
            return no_index[gpu]
        return idx if idx.dtype == np.int64 else idx.astype(np.int64)

    def codes_of(a):
        """Return (a, suffix): signed codes as they are; any other integers widened to int64."""
        if a.dtype not in _CODES:
            a = a.astype(np.int64)  # the twin reads every code as np.int64(c)
        return a, _CODES[a.dtype]

    def out_codes(out):
        if out.dtype not in _CODES:
            raise TypeError(f"codes must be int8, int16, int32 or int64, got {out.dtype}")
        return _CODES[out.dtype]

    def index_of(sidx):
        if sidx.dtype not in _INDEX:
            sidx = sidx.astype(np.int64)  # wraps as np.int64(k) does: outside the set either way
        return sidx, _INDEX[sidx.dtype]

    def flags():
        return xp.zeros(1, dtype=np.uint32)

    def result(err, launcher: str) -> int:
        return int(dev.to_host(err, why=f"qsgd.{launcher}: error mask")[0])

    def scale_set(scales):
        return scales if scales.dtype == np.float32 else scales.astype(np.float32)

    def width_of(width) -> np.int32:
        if not 1 <= int(width) <= 32:
            raise ValueError(f"width must be in 1..32, got {width}")
        return np.int32(width)

    def sumsq(x, idx, dense) -> float:
        """Return the float64 sum of squares of x (``dense``) or of x[idx], in CHUNK order."""
        x = floats(x)
        n = x.size if dense else idx.size
        if n == 0:
            return 0.0
        nchunks = -(-n // kq.CHUNK)
        lanes = xp.empty(8 * nchunks, dtype=np.float64)
        total = xp.empty(1, dtype=np.float64)
        launch(
            "sumsq_lanes",
            8 * nchunks,
            x,
            index(idx, dense),
            np.int32(bool(dense)),
            np.int64(n),
            lanes,
        )
        kernel("sumsq_total")((1,), (dev.threads,), (lanes, np.int64(nchunks), total))
        return float(dev.to_host(total, why="qsgd.sumsq: sum of squares")[0])

    def quantize(x, idx, dense, norm, levels, key, out) -> int:
        """Write the codes of x (``dense``) or x[idx] into ``out``; return an error mask."""
        n = out.size
        name = f"quantize_{out_codes(out)}"
        if n == 0:
            return 0
        err = flags()
        launch(
            name,
            n,
            floats(x),
            index(idx, dense),
            np.int32(bool(dense)),
            np.float32(norm),
            np.int64(levels),
            np.uint64(key),
            out,
            np.int64(n),
            err,
        )
        return result(err, "quantize")

    def multiscale_index(x, idx, dense, norm, scales, out) -> int:
        """Write each element's scale index into uint8 ``out``; return an error mask."""
        if out.dtype != np.uint8:
            raise TypeError(f"scale indices are written as uint8, got {out.dtype}")
        n = out.size
        if n == 0:
            return 0
        scales, err = scale_set(scales), flags()
        launch(
            "multiscale_index",
            n,
            floats(x),
            index(idx, dense),
            np.int32(bool(dense)),
            np.float32(norm),
            scales,
            np.int64(scales.size),
            out,
            np.int64(n),
            err,
        )
        return result(err, "multiscale_index")

    def multiscale_quantize(x, idx, dense, norm, scales, sidx, key, out) -> int:
        """Write the codes at the shared scale indices ``sidx`` into ``out``; return an error mask."""
        n = out.size
        name = f"multiscale_quantize_{out_codes(out)}"
        if n == 0:
            return 0
        sidx, kind = index_of(sidx)
        scales, err = scale_set(scales), flags()
        launch(
            f"{name}_{kind}",
            n,
            floats(x),
            index(idx, dense),
            np.int32(bool(dense)),
            np.float32(norm),
            scales,
            np.int64(scales.size),
            sidx,
            np.uint64(key),
            out,
            np.int64(n),
            err,
        )
        return result(err, "multiscale_quantize")

    def dequantize(codes, norm, levels, nranks, limit, out) -> int:
        """Write out = ((codes * norm) / levels) / nranks in float32; return an error mask."""
        n = out.size
        if n == 0:
            return 0
        codes, kind = codes_of(codes)
        err = flags()
        launch(
            f"dequantize_{kind}",
            n,
            codes,
            np.float32(norm),
            np.int64(levels),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(n),
            err,
        )
        return result(err, "dequantize")

    def dequantize_packed(stream, width, shift, norm, levels, nranks, limit, out) -> int:
        """As ``dequantize`` for codes[i] = (the ``width``-bit code i of ``stream``) - shift."""
        n = out.size
        width = width_of(width)
        if n == 0:
            return 0
        err = flags()
        launch(
            "dequantize_packed",
            n,
            stream,
            width,
            np.int64(shift),
            np.float32(norm),
            np.int64(levels),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(n),
            err,
        )
        return result(err, "dequantize_packed")

    def multiscale_dequantize(codes, sidx, norm, scales, nranks, limit, out) -> int:
        """Write out = ((codes * norm) / scales[sidx]) / nranks in float32; return an error mask."""
        n = out.size
        if n == 0:
            return 0
        codes, ckind = codes_of(codes)
        sidx, kind = index_of(sidx)
        scales, err = scale_set(scales), flags()
        launch(
            f"multiscale_dequantize_{ckind}_{kind}",
            n,
            codes,
            sidx,
            np.float32(norm),
            scales,
            np.int64(scales.size),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(n),
            err,
        )
        return result(err, "multiscale_dequantize")

    def multiscale_dequantize_packed(stream, width, shift, sidx, norm, scales, nranks, limit, out):
        """As ``multiscale_dequantize`` for codes read from a packed ``stream`` (less ``shift``)."""
        n = out.size
        width = width_of(width)
        if n == 0:
            return 0
        sidx, kind = index_of(sidx)
        scales, err = scale_set(scales), flags()
        launch(
            f"multiscale_dequantize_packed_{kind}",
            n,
            stream,
            width,
            np.int64(shift),
            sidx,
            np.float32(norm),
            scales,
            np.int64(scales.size),
            np.int64(nranks),
            np.int64(limit),
            out,
            np.int64(n),
            err,
        )
        return result(err, "multiscale_dequantize_packed")

    def grandk_scatter(vals, idx, ratio, out) -> None:
        """Write out[idx[j]] = vals[j] * ratio (float32); out is zero elsewhere already."""
        k = idx.size
        if k:
            launch(
                "grandk_scatter",
                k,
                floats(vals, "vals"),
                index(idx, False),
                np.float32(ratio),
                out,
                np.int64(k),
            )

    def grandk_select(n, k, key, mask, picks) -> None:
        """Draw k distinct coordinates of [0, n) (Floyd's algorithm) into mask and picks.

        picks[j - (n-k)] is step j's choice, exactly the twin's; ``mask`` (n bytes, zero)
        marks the chosen ones. Scratch: a table of the first step drawing each value,
        direct (4n bytes) or hashed (12 bytes a slot, at least 2k slots), the smaller.
        """
        n, k = int(n), int(k)
        if k <= 0:
            return
        if k > n or k > _U32_MAX:
            raise ValueError(f"k must be in [0, min(n, 2**32 - 1)], got k={k} for n={n}")
        if picks.dtype != np.int64:
            raise TypeError(f"picks must be int64, got {picks.dtype}")
        mask8 = bytes_of(mask)
        cap = 1 << max(6, (2 * k - 1).bit_length())
        direct = 4 * n <= 12 * cap
        table = xp.full(n if direct else cap, _U32_MAX, dtype=np.uint32)
        keys = xp.full(1 if direct else cap, np.uint64(2**64 - 1), dtype=np.uint64)
        geo = (np.int64(n), np.int64(k), np.uint64(key))
        hashed = (np.int32(direct), table, keys, np.uint64(cap - 1))
        launch("grandk_draw", k, *geo, *hashed)
        launch("grandk_resolve", k, *geo, mask8, *hashed, picks)
        launch("grandk_mark", k, picks, np.int64(k), mask8)

    def grandk_sort(picks) -> None:
        """Sort the int64 coordinates ``picks`` in place (merge passes, ping-pong)."""
        if picks.dtype != np.int64:
            raise TypeError(f"picks must be int64, got {picks.dtype}")
        n = picks.size
        if n < 2:
            return
        src, dst = picks, xp.empty_like(picks)
        w = 1
        while w < n:
            launch("grandk_merge", n, src, dst, np.int64(n), np.int64(w))
            src, dst = dst, src
            w *= 2
        if src is not picks:
            picks[...] = src

    def grandk_compact(mask, out) -> None:
        """Write the positions of the nonzero bytes of mask, in increasing order, to out."""
        n = mask.size
        if n == 0 or out.size == 0:
            return
        if out.dtype != np.int64:
            raise TypeError(f"out must be int64, got {out.dtype}")
        mask8 = bytes_of(mask)
        ntiles = -(-n // TILE)
        counts = xp.empty(ntiles, dtype=np.int64)
        blocks = (max(1, min(dev.max_blocks, ntiles)),)
        kernel("grandk_count")(blocks, (dev.threads,), (mask8, np.int64(n), counts))
        kernel("grandk_offsets")((1,), (dev.threads,), (counts, np.int64(ntiles)))
        kernel("grandk_compact")(
            blocks, (dev.threads,), (mask8, np.int64(n), counts, out, np.int64(out.size))
        )

    return SimpleNamespace(
        sumsq=sumsq,
        quantize=quantize,
        multiscale_index=multiscale_index,
        multiscale_quantize=multiscale_quantize,
        dequantize=dequantize,
        dequantize_packed=dequantize_packed,
        multiscale_dequantize=multiscale_dequantize,
        multiscale_dequantize_packed=multiscale_dequantize_packed,
        grandk_select=grandk_select,
        grandk_sort=grandk_sort,
        grandk_compact=grandk_compact,
        grandk_scatter=grandk_scatter,
    )
