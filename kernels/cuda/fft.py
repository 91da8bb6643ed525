"""CUDA launchers of the FFT sparsification family (``fft.cu``), twins of the numba record's
``fft`` (``kernels/cpu/fft.py``, ``kernels/cpu/rfft.py``, ``kernels/cpu/checks.py``).

The launchers are the twins' in their order (those of ``fft.py``, then of ``rfft.py``, then
``all_finite``), each taking the device it launches on before the twin's arguments
(``launchers(dev)`` binds them); same outputs and return values. The transforms (``rfft``,
``irfft``) are the device's FFT library (``dev.xp.fft``: cuFFT through CuPy, NumPy's
pocketfft on the emulated device), so their bytes may differ from the numba twin's by
float32 rounding; every other launcher gives the twin's bytes for the same arrays. A
launcher that returns a value brings it to the host through ``readback.read``: one counted
``dev.to_host`` on its own, a ``readback.Later`` inside a ``readback.batch``.

The values one step of the encoder hands the next (``kth_largest``'s threshold,
``select_pack``'s largest kept value, ``choose_range``'s (m, pbase)) stay on the device
for it: where the twin takes a number, a launcher also takes a 1-element device array or a
``Later`` of one (what these launchers return in a batch), and its kernel reads the value
from memory, so an encode waits for none of them. ``unpack_dequantize`` and ``scatter``
take their parameters (pbase, shift, bits, k) the same way, for a decoder that leaves a
payload's fields on the device; ``unpack_dequantize``'s keyword ``count`` (CUDA only) is
then the code count, read from the device, with ``out.size`` its bound.
"""

from __future__ import annotations

import functools
import math
from types import SimpleNamespace

import numpy as np

from mpicomp.kernels import fft as _k
from mpicomp.kernels.cuda import bind, family_kernel
from mpicomp.kernels.readback import Later, read

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

_kernel = family_kernel("fft", DEFINES)


@functools.lru_cache(maxsize=64)
def _sum_spectra(n: int) -> bool:
    # As kernels/cpu/rfft.py's plan(n) is not None: even n from BLOCKED_MIN on whose half
    # has a divisor between _MIN_SIDE and its square root.
    if n < _SUM_SPECTRA_MIN or n % 2:
        return False
    m = n // 2
    return any(m % d == 0 for d in range(math.isqrt(m), _MIN_SIDE - 1, -1))


def _check_width(bits, shift, what: str):
    # The kernels shift by these: out of range they would be undefined, not just wrong.
    # A shift on the device (choose_range's) is not read: the kernels clamp it.
    on_device = not _is_number(shift)
    if not 1 <= int(bits) <= 32 or not (on_device or 0 <= int(shift) <= _k.MAX_MANTISSA):
        raise ValueError(
            f"fft {what}: bits must lie in [1, 32] and shift in [0, {_k.MAX_MANTISSA}], "
            f"got {bits!r} and {shift!r}"
        )
    return np.int64(bits), shift if on_device else np.int64(shift)


def _on_device(dev, value, dtype):
    """Return ``value`` as a 1-element device array of ``dtype`` that a kernel reads: a
    number is copied there; a device array (or a ``readback.Later`` of one) stays where it
    is (a float32 one is taken as its bits, for a uint32 ``dtype``)."""
    if isinstance(value, Later):
        value = value.array
    if isinstance(value, (int, float, np.generic)):
        if dtype == np.uint32 and isinstance(value, (float, np.floating)):
            value = np.float32(value).view(np.uint32)
        return dev.xp.asarray(np.array([value], dtype=dtype))
    a = value.reshape(-1)[:1]
    if a.dtype == np.float32 and dtype == np.uint32:
        return a.view(np.uint32)
    return a.astype(dtype, copy=False)


def _is_number(value) -> bool:
    return isinstance(value, (int, float, np.generic))


def _first(host) -> int:
    return int(host[0])


def _tiles(dev, nbins: int):
    """Return (ntiles, (grid, block)) of a pass over ``nbins`` bins, a block per tile."""
    ntiles = -(-nbins // TILE)
    return ntiles, dev.tile_shape(ntiles)


def _one(dev):
    """Return the (grid, block) of a one-block pass over per-tile totals or a small table."""
    return (1,), (dev.threads,)


def round_fp16(dev, x, out):
    """As ``kernels.cpu.fft.mpicomp_fft_round_fp16``: float32 bits ``x`` rounded to float16
    precision into ``out``; FP16_OK, FP16_NONFINITE or FP16_OVERFLOW, as the twin returns."""
    n = x.size
    if n == 0:
        return _k.FP16_OK
    chunk_err = dev.xp.full(-(-n // FP16_CHUNK), _NONE, dtype=np.uint64)
    bad = dev.xp.full(1, _NONE, dtype=np.uint64)
    result = dev.xp.zeros(1, dtype=np.int64)
    _kernel(dev, "round_fp16")(*dev.launch_shape(n), (x, out, np.int64(n), chunk_err, bad))
    _kernel(dev, "round_fp16_result")((1,), (32,), (chunk_err, bad, result))
    return read(dev, result, "fft.round_fp16: error", _first)


def _magnitude_ok(dev, spec, mag2):
    """Write |X|^2 of interleaved ``spec`` into ``mag2``; return False on NaN/Inf (the
    twin's ``mpicomp_fft_magnitude``)."""
    flag = dev.xp.zeros(1, dtype=np.uint32)
    if mag2.size:
        args = (spec, mag2, np.int64(mag2.size), flag)
        _kernel(dev, "magnitude")(*dev.launch_shape(mag2.size), args)
    return read(dev, flag, "fft.magnitude_ok: overflow flag", _flag_clear)


def kth_largest(dev, mag2, k):
    """As ``kernels.cpu.fft.mpicomp_fft_kth_largest``: the k-th largest of float32 ``mag2`` >= 0, by
    the same two-level radix select (each level a histogram kernel and a one-block choice)."""
    n = mag2.size
    if not 1 <= int(k) <= n:
        raise ValueError(f"fft kth_largest: k must lie in [1, {n}], got {k!r}")
    u = mag2.view(np.uint32)
    hist = dev.xp.zeros((2, 1 << 16), dtype=np.uint64)
    state = dev.xp.zeros(3, dtype=np.int64)
    for level in (0, 1):
        args = (u, np.int64(n), np.int64(level), state, hist[level])
        _kernel(dev, "kth_histogram")(*dev.launch_shape(n), args)
        args = (hist[level], np.int64(level), np.int64(k), state)
        _kernel(dev, "kth_select")(*_one(dev), args)
    return read(dev, state[2:3], "fft.kth_largest: threshold bits", _float_of_bits)


def select_pack(dev, spec, mag2, thresh, k, bitmap, dense, hist):
    """As ``kernels.cpu.fft.mpicomp_fft_select_pack``: keep k bins by ``thresh`` (ties by index) in
    ``bitmap`` and ``dense``; the bits of the largest kept |part|.

    Tiles of TILE bins (the twin's chunks) run in parallel: a first pass counts each tile's
    bins above and at the threshold, a one-block prefix sum over the tiles gives each its
    first dense slot and the ties before it (the lowest indices are taken first), a second
    pass packs.
    """
    nbins = mag2.size
    if nbins == 0:
        return 0
    t = _on_device(dev, thresh, np.uint32)
    ntiles, launch = _tiles(dev, nbins)
    tile_g = dev.xp.empty(ntiles, dtype=np.int64)
    tile_e = dev.xp.empty(ntiles, dtype=np.int64)
    tile_first = dev.xp.empty(ntiles, dtype=np.int64)
    tile_ebefore = dev.xp.empty(ntiles, dtype=np.int64)
    state = dev.xp.zeros(1, dtype=np.int64)
    vmax = dev.xp.zeros(1, dtype=np.uint32)
    u = mag2.view(np.uint32)
    _kernel(dev, "select_count")(*launch, (u, np.int64(nbins), t, tile_g, tile_e))
    args = (tile_g, tile_e, np.int64(ntiles), np.int64(k), tile_first, tile_ebefore, state)
    _kernel(dev, "select_scan")(*_one(dev), args)
    args = (spec, u, np.int64(nbins), t, np.int64(k), tile_first, tile_ebefore, state)
    _kernel(dev, "select_pack")(*launch, (*args, bitmap, dense, hist, vmax))
    return read(dev, vmax, "fft.select_pack: largest kept value", _first)


def choose_range(dev, hist, vmax, bits):
    """As ``kernels.cpu.fft.mpicomp_fft_choose_range``: (m, pbase) of the N-bit float for
    ``vmax`` and the exponent counts ``hist``, chosen by one warp."""
    if not 1 <= int(bits) <= 32:
        raise ValueError(f"fft choose_range: bits must lie in [1, 32], got {bits!r}")
    out = dev.xp.zeros(2, dtype=np.int64)
    args = (hist, _on_device(dev, vmax, np.uint32), np.int64(bits), out)
    _kernel(dev, "choose_range")((1,), (32,), args)
    return read(dev, out, "fft.choose_range: range and base", _pair)


def quantize_pack(dev, values, vmax, pbase, shift, bits, out):
    """As ``kernels.cpu.fft.mpicomp_fft_quantize_pack``: ``values`` as N-bit codes packed LSB-first
    into ``out``, a thread per group of eight codes (N bytes)."""
    b, s = _check_width(bits, shift, "quantize_pack")
    n = values.size
    if out.size < (n * int(b) + 7) // 8:
        raise ValueError(f"fft quantize_pack: out has {out.size} bytes, codes need more")
    if n:
        args = (values, np.int64(n), _on_device(dev, vmax, np.uint32))
        args += (_on_device(dev, pbase, np.int64), _on_device(dev, s, np.int64), b, out)
        _kernel(dev, "quantize_pack")(*dev.launch_shape(-(-n // 8)), args)


def unpack_dequantize(dev, stream, pbase, shift, bits, out, *, count=None):
    """As ``kernels.cpu.fft.mpicomp_fft_unpack_dequantize``: ``out.size`` N-bit codes of ``stream``
    into the uint32 view ``out``; DECODE_OK or the first bad code's error.

    ``pbase``, ``shift`` and ``bits`` may be 1-element device arrays (a payload's fields,
    clamped by the kernel to widths it can shift by), and ``count`` one holding the code
    count (at most ``out.size``; default ``out.size``): nothing is read from the device
    before the kernels run.
    """
    if _is_number(bits) and _is_number(shift):
        bits, shift = _check_width(bits, shift, "unpack_dequantize")
    n = out.size
    count = np.int64(n) if count is None else count
    args = [_on_device(dev, v, np.int64) for v in (pbase, shift, bits, count)]
    pbase, shift, bits, count = args
    err = dev.xp.full(1, _NONE, dtype=np.uint64)
    result = dev.xp.zeros(1, dtype=np.int64)
    ns = np.int64(stream.size)
    if n:
        args = (stream, ns, pbase, shift, bits, out, np.int64(n), count, err)
        _kernel(dev, "unpack_dequantize")(*dev.launch_shape(-(-n // 8)), args)
    args = (stream, ns, bits, np.int64(n), count, err, result)
    _kernel(dev, "unpack_result")((1,), (32,), args)
    return read(dev, result, "fft.unpack_dequantize: error count", _first)


def scatter(dev, bitmap, dense, k, spec):
    """As ``kernels.cpu.fft.mpicomp_fft_scatter``: add ``dense``'s k kept bins to ``spec`` where
    ``bitmap`` is set; DECODE_OK (else ``spec`` untouched), DECODE_COUNT or DECODE_PADDING.

    ``k`` may be a 1-element device array (a payload's field): ``dense`` must then hold
    ``2 * nbins`` values, and a k beyond nbins is a DECODE_COUNT.
    """
    nbins = spec.size // 2
    on_device = not _is_number(k)
    need = 2 * nbins if on_device else 2 * int(k)
    if bitmap.size != (nbins + 7) // 8 or dense.size < need:
        raise ValueError(
            f"fft scatter: a bitmap of {bitmap.size} bytes and {dense.size} dense values "
            f"for {nbins} bins and k={k}; need {(nbins + 7) // 8} bytes and >= {2 * int(k)}"
        )
    if nbins == 0 and not on_device:
        return _k.DECODE_OK if int(k) == 0 else _k.DECODE_COUNT
    k = _on_device(dev, k, np.int64)
    state = dev.xp.zeros(1, dtype=np.int64)
    if nbins == 0:  # no bins: only k = 0 is whole
        state[...] = (k != 0).astype(np.int64) * _k.DECODE_COUNT
        return read(dev, state, "fft.scatter: bad-bitmap count", _first)
    ntiles, launch = _tiles(dev, nbins)
    tile_n = dev.xp.empty(ntiles, dtype=np.int64)
    tile_first = dev.xp.empty(ntiles, dtype=np.int64)
    _kernel(dev, "scatter_count")(*launch, (bitmap, np.int64(nbins), tile_n))
    args = (bitmap, np.int64(nbins), tile_n, np.int64(ntiles), k, tile_first, state)
    _kernel(dev, "scatter_scan")(*_one(dev), args)
    args = (bitmap, dense, k, tile_first, state, spec, np.int64(nbins))
    _kernel(dev, "scatter_add")(*launch, args)
    return read(dev, state, "fft.scatter: bad-bitmap count", _first)


# Error feedback in the frequency domain: the residual of an n-value gradient is its half
# spectrum packed into n float32 values, in kernels/cpu/fft.py's layout (the interleaved
# spectrum without the imaginary parts the real FFT makes 0).


def add_residual(dev, spec, r, mag2):
    """As ``kernels.cpu.fft.mpicomp_fft_add_residual``: the packed residual ``r`` (layout above)
    added to the half spectrum ``spec``, |sum|^2 into ``mag2``; False when a sum is NaN or Inf."""
    n = r.size
    flag = dev.xp.zeros(1, dtype=np.uint32)
    if n:
        args = (spec, r, mag2, np.int64(n), flag)
        _kernel(dev, "add_residual")(*dev.launch_shape(n // 2 + 1), args)
    return read(dev, flag, "fft.add_residual: non-finite flag", _flag_clear)


def residual(dev, spec, bitmap, vmax, pbase, shift, bits, r):
    """As ``kernels.cpu.fft.mpicomp_fft_residual``: the new packed residual (layout above) of
    ``spec`` into ``r``, so that residual + decoded payload = ``spec``."""
    b, s = _check_width(bits, shift, "residual")
    n = r.size
    if n:
        args = (spec.view(np.uint32), bitmap, _on_device(dev, vmax, np.uint32))
        args += (_on_device(dev, pbase, np.int64), _on_device(dev, s, np.int64), b)
        args += (r.view(np.uint32), np.int64(n))
        _kernel(dev, "residual")(*dev.launch_shape(n // 2 + 1), args)


# --- the transforms: the twins of kernels/cpu/rfft.py, through dev.xp.fft ---


def sum_spectra(dev, n):
    """Return True if a sum of ``n``-element decodes should add spectra and invert once.

    The numba twin's answer (where its blocked transform runs), so decoding a sum takes
    the same path on every backend.
    """
    return _sum_spectra(int(n))


def rfft(dev, flat, own):
    """As ``kernels.cpu.rfft.rfft``: (interleaved float32 half spectrum, |X|^2, all finite)
    of ``flat``, through ``dev.xp.fft``, which leaves ``flat`` as it is whatever ``own``."""
    with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are caught below
        spec = dev.xp.fft.rfft(flat).astype(np.complex64, copy=False).view(np.float32)
    mag2 = dev.xp.empty(spec.size // 2, dtype=np.float32)
    return spec, mag2, _magnitude_ok(dev, spec, mag2)


def irfft(dev, spec, n):
    """Return the ``n`` float32 values of the interleaved float32 half spectrum ``spec``."""
    with np.errstate(invalid="ignore", over="ignore"):  # overflow is caught by callers
        x = dev.xp.fft.irfft(spec.view(np.complex64), n=n)
    return x.astype(np.float32, copy=False)


def all_finite(dev, x):
    """Return True if every element of float32 ``x`` is finite."""
    flag = dev.xp.zeros(1, dtype=np.uint32)
    if x.size:
        u = x.reshape(-1).view(np.uint32)
        _kernel(dev, "all_finite")(*dev.launch_shape(u.size), (u, np.int64(u.size), flag))
    return read(dev, flag, "fft.all_finite: flag", _flag_clear)


def _flag_clear(host) -> bool:
    return bool(host[0] == 0)


def _float_of_bits(host) -> float:
    return float(np.uint32(host[0]).view(np.float32))


def _pair(host) -> tuple[int, int]:
    return int(host[0]), int(host[1])


def launchers(dev) -> SimpleNamespace:
    """Return the ``fft`` launchers bound to ``dev``."""
    return bind(dev, "fft")
