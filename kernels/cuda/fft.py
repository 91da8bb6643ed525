"""CUDA launchers of the FFT sparsification family (``fft.cu``), twins of the numba record's
``fft`` (``kernels/cpu/fft.py``, ``kernels/cpu/rfft.py``, ``kernels/cpu/checks.py``).

Same names, arguments, outputs and return values. The transforms (``rfft``, ``irfft``) are
the device's FFT library (``dev.xp.fft``: cuFFT through CuPy, NumPy's pocketfft on the
emulated device), so their bytes may differ from the numba twin's by float32 rounding;
every other launcher gives the twin's bytes for the same arrays. A launcher that returns
a value brings it to the host with one counted ``dev.to_host``.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import fft as _k

#: Elements per chunk of the float16 rounding's error rule: must equal kernels/cpu/fft.py's
#: ``_CHUNK`` (its error is that of the first chunk holding a rounding beyond 65504).
FP16_CHUNK = 1 << 16
#: Bins per tile of the selection and scatter passes (a multiple of 8; no result depends on it).
TILE = 1 << 12
#: kernels/cpu/rfft.py's BLOCKED_MIN and _MIN_SIDE: ``sum_spectra`` answers as the twin does,
#: so decoding a sum takes the same path on every backend.
_SUM_SPECTRA_MIN = 1 << 18
_MIN_SIDE = 64

DEFINES = {
    "MPICOMP_FFT_MAX_MANTISSA": str(_k.MAX_MANTISSA),
    "MPICOMP_FFT_FP16_OK": str(_k.FP16_OK),
    "MPICOMP_FFT_FP16_NONFINITE": str(_k.FP16_NONFINITE),
    "MPICOMP_FFT_FP16_OVERFLOW": str(_k.FP16_OVERFLOW),
    "MPICOMP_FFT_DECODE_OK": str(_k.DECODE_OK),
    "MPICOMP_FFT_DECODE_NEGATIVE_ZERO": str(_k.DECODE_NEGATIVE_ZERO),
    "MPICOMP_FFT_DECODE_OVERFLOW": str(_k.DECODE_OVERFLOW),
    "MPICOMP_FFT_DECODE_PADDING": str(_k.DECODE_PADDING),
    "MPICOMP_FFT_DECODE_COUNT": str(_k.DECODE_COUNT),
    "MPICOMP_FFT_CHUNK": f"{FP16_CHUNK}ll",
    "MPICOMP_FFT_TILE": f"{TILE}ll",
}

_NONE = np.iinfo(np.uint64).max  # "no error yet" of the kernels' atomicMin keys


@functools.lru_cache(maxsize=64)
def _sum_spectra(n: int) -> bool:
    # As kernels/cpu/rfft.py's plan(n) is not None: even n from BLOCKED_MIN on whose half
    # has a divisor between _MIN_SIDE and its square root.
    if n < _SUM_SPECTRA_MIN or n % 2:
        return False
    m = n // 2
    return any(m % d == 0 for d in range(math.isqrt(m), _MIN_SIDE - 1, -1))


def _check_width(bits, shift, what: str) -> tuple[np.int64, np.int64]:
    # The kernels shift by these: out of range they would be undefined, not just wrong.
    if not 1 <= int(bits) <= 32 or not 0 <= int(shift) <= _k.MAX_MANTISSA:
        raise ValueError(
            f"fft {what}: bits must lie in [1, 32] and shift in [0, {_k.MAX_MANTISSA}], "
            f"got {bits!r} and {shift!r}"
        )
    return np.int64(bits), np.int64(shift)


def launchers(dev) -> SimpleNamespace:
    """Return the ``fft`` launchers bound to ``dev``."""
    xp = dev.xp

    def kernel(name):
        return dev.kernel("fft", f"mpicomp_fft_{name}", DEFINES)

    def grid(n):
        return (dev.grid(n),), (dev.threads,)

    def tiles(nbins):
        ntiles = -(-nbins // TILE)
        return ntiles, ((max(1, min(dev.max_blocks, ntiles)),), (dev.threads,))

    one = ((1,), (dev.threads,))  # a one-block pass over per-tile totals or a small table

    def round_fp16(x, out):
        """Round float32 bits ``x`` to float16 precision into ``out`` (uint32); return the
        twin's FP16_OK / FP16_NONFINITE / FP16_OVERFLOW."""
        n = x.size
        if n == 0:
            return _k.FP16_OK
        chunk_err = xp.full(-(-n // FP16_CHUNK), _NONE, dtype=np.uint64)
        bad = xp.full(1, _NONE, dtype=np.uint64)
        result = xp.zeros(1, dtype=np.int64)
        kernel("round_fp16")(*grid(n), (x, out, np.int64(n), chunk_err, bad))
        kernel("round_fp16_result")((1,), (32,), (chunk_err, bad, result))
        return int(dev.to_host(result, why="fft.tiles: tile count")[0])

    def magnitude_ok(spec, mag2):
        # |X|^2 into mag2; True when every part of spec is finite.
        flag = xp.zeros(1, dtype=np.uint32)
        if mag2.size:
            kernel("magnitude")(*grid(mag2.size), (spec, mag2, np.int64(mag2.size), flag))
        return bool(dev.to_host(flag, why="fft.magnitude_ok: overflow flag")[0] == 0)

    def rfft(flat, own):
        """Return (interleaved float32 half spectrum, |X|^2 in float32, all finite) of
        ``flat`` through ``dev.xp.fft`` (``own`` is accepted for the twin's signature)."""
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are caught below
            spec = xp.fft.rfft(flat).astype(np.complex64, copy=False).view(np.float32)
        mag2 = xp.empty(spec.size // 2, dtype=np.float32)
        return spec, mag2, magnitude_ok(spec, mag2)

    def irfft(spec, n):
        """Return the ``n`` float32 values of the interleaved float32 half spectrum ``spec``."""
        with np.errstate(invalid="ignore", over="ignore"):  # overflow is caught by callers
            x = xp.fft.irfft(spec.view(np.complex64), n=n)
        return x.astype(np.float32, copy=False)

    def sum_spectra(n):
        """Return True if a sum of ``n``-element decodes should add spectra and invert once
        (the numba twin's answer)."""
        return _sum_spectra(int(n))

    def all_finite(x):
        """Return True if every element of float32 ``x`` is finite."""
        flag = xp.zeros(1, dtype=np.uint32)
        if x.size:
            u = x.reshape(-1).view(np.uint32)
            kernel("all_finite")(*grid(u.size), (u, np.int64(u.size), flag))
        return bool(dev.to_host(flag, why="fft.all_finite: flag")[0] == 0)

    def add_residual(spec, r, mag2):
        """Add the packed residual ``r`` to the half spectrum ``spec``, |X|^2 into ``mag2``;
        return False when a sum is NaN or Inf."""
        n = r.size
        flag = xp.zeros(1, dtype=np.uint32)
        if n:
            kernel("add_residual")(*grid(n // 2 + 1), (spec, r, mag2, np.int64(n), flag))
        return bool(dev.to_host(flag, why="fft.add_residual: non-finite flag")[0] == 0)

    def kth_largest(mag2, k):
        """Return the k-th largest of non-negative float32 ``mag2`` (1 <= k <= size)."""
        n = mag2.size
        if not 1 <= int(k) <= n:
            raise ValueError(f"fft kth_largest: k must lie in [1, {n}], got {k!r}")
        u = mag2.view(np.uint32)
        hist = xp.zeros((2, 1 << 16), dtype=np.uint64)
        state = xp.zeros(3, dtype=np.int64)
        for level in (0, 1):
            args = (u, np.int64(n), np.int64(level), state, hist[level])
            kernel("kth_histogram")(*grid(n), args)
            kernel("kth_select")(*one, (hist[level], np.int64(level), np.int64(k), state))
        bits = np.uint32(dev.to_host(state, why="fft.kth_largest: threshold bits")[2])
        return float(bits.view(np.float32))

    def select_pack(spec, mag2, thresh, k, bitmap, dense, hist):
        """Keep the k bins above ``thresh`` then at it by index; bitmap, dense parts,
        exponent counts added into ``hist``; return the largest kept |part| bits."""
        nbins = mag2.size
        if nbins == 0:
            return 0
        t = np.float32(thresh).view(np.uint32)
        ntiles, launch = tiles(nbins)
        tile_g = xp.empty(ntiles, dtype=np.int64)
        tile_e = xp.empty(ntiles, dtype=np.int64)
        tile_first = xp.empty(ntiles, dtype=np.int64)
        tile_ebefore = xp.empty(ntiles, dtype=np.int64)
        state = xp.zeros(1, dtype=np.int64)
        vmax = xp.zeros(1, dtype=np.uint32)
        u = mag2.view(np.uint32)
        kernel("select_count")(*launch, (u, np.int64(nbins), t, tile_g, tile_e))
        args = (tile_g, tile_e, np.int64(ntiles), np.int64(k), tile_first, tile_ebefore, state)
        kernel("select_scan")(*one, args)
        args = (spec, u, np.int64(nbins), t, np.int64(k), tile_first, tile_ebefore, state)
        kernel("select_pack")(*launch, (*args, bitmap, dense, hist, vmax))
        return int(dev.to_host(vmax, why="fft.select_pack: largest kept value")[0])

    def choose_range(hist, vmax, bits):
        """Return (m, pbase) of the N-bit float: the largest code covers ``vmax``."""
        if not 1 <= int(bits) <= 32:
            raise ValueError(f"fft choose_range: bits must lie in [1, 32], got {bits!r}")
        out = xp.zeros(2, dtype=np.int64)
        kernel("choose_range")((1,), (32,), (hist, np.int64(vmax), np.int64(bits), out))
        m, pbase = dev.to_host(out, why="fft.choose_range: range and base")
        return int(m), int(pbase)

    def quantize_pack(values, vmax, pbase, shift, bits, out):
        """Encode float32 bits ``values`` as N-bit codes packed LSB-first into ``out``."""
        b, s = _check_width(bits, shift, "quantize_pack")
        n = values.size
        if out.size < (n * int(b) + 7) // 8:
            raise ValueError(f"fft quantize_pack: out has {out.size} bytes, codes need more")
        if n:
            args = (values, np.int64(n), np.int64(vmax), np.int64(pbase), s, b, out)
            kernel("quantize_pack")(*grid(-(-n // 8)), args)

    def unpack_dequantize(stream, pbase, shift, bits, out):
        """Decode ``out.size`` N-bit codes of ``stream`` into uint32 ``out``; return
        DECODE_OK or the twin's error code."""
        b, s = _check_width(bits, shift, "unpack_dequantize")
        n = out.size
        err = xp.full(1, _NONE, dtype=np.uint64)
        result = xp.zeros(1, dtype=np.int64)
        ns = np.int64(stream.size)
        if n:
            args = (stream, ns, np.int64(pbase), s, b, out, np.int64(n), err)
            kernel("unpack_dequantize")(*grid(-(-n // 8)), args)
        kernel("unpack_result")((1,), (32,), (stream, ns, b, np.int64(n), err, result))
        return int(dev.to_host(result, why="fft.unpack_dequantize: error count")[0])

    def scatter(bitmap, dense, k, spec):
        """Add dense[0:k] / dense[k:2k] to the bins set in ``bitmap``; return DECODE_OK,
        DECODE_COUNT or DECODE_PADDING (``spec`` untouched unless DECODE_OK)."""
        nbins = spec.size // 2
        if bitmap.size != (nbins + 7) // 8 or dense.size < 2 * int(k):
            raise ValueError(
                f"fft scatter: a bitmap of {bitmap.size} bytes and {dense.size} dense values "
                f"for {nbins} bins and k={k}; need {(nbins + 7) // 8} bytes and >= {2 * int(k)}"
            )
        if nbins == 0:
            return _k.DECODE_OK if int(k) == 0 else _k.DECODE_COUNT
        ntiles, launch = tiles(nbins)
        tile_n = xp.empty(ntiles, dtype=np.int64)
        tile_first = xp.empty(ntiles, dtype=np.int64)
        state = xp.zeros(1, dtype=np.int64)
        kernel("scatter_count")(*launch, (bitmap, np.int64(nbins), tile_n))
        args = (bitmap, np.int64(nbins), tile_n, np.int64(ntiles), np.int64(k), tile_first, state)
        kernel("scatter_scan")(*one, args)
        args = (bitmap, dense, np.int64(k), tile_first, state, spec, np.int64(nbins))
        kernel("scatter_add")(*launch, args)
        return int(dev.to_host(state, why="fft.scatter: bad-bitmap count")[0])

    def residual(spec, bitmap, vmax, pbase, shift, bits, r):
        """Write the packed residual of ``spec`` (kept bins: their N-bit float errors) into ``r``."""
        b, s = _check_width(bits, shift, "residual")
        n = r.size
        if n:
            args = (spec.view(np.uint32), bitmap, np.int64(vmax), np.int64(pbase), s, b)
            kernel("residual")(*grid(n // 2 + 1), (*args, r.view(np.uint32), np.int64(n)))

    return SimpleNamespace(
        round_fp16=round_fp16,
        rfft=rfft,
        irfft=irfft,
        sum_spectra=sum_spectra,
        add_residual=add_residual,
        kth_largest=kth_largest,
        select_pack=select_pack,
        choose_range=choose_range,
        quantize_pack=quantize_pack,
        residual=residual,
        unpack_dequantize=unpack_dequantize,
        scatter=scatter,
        all_finite=all_finite,
    )
