"""The real FFT of the numba backend's ``fft`` family: NumPy's below ``BLOCKED_MIN``
elements, a blocked float32 transform from it on.

Below ``BLOCKED_MIN`` the transforms are NumPy's (pocketfft, one call; its float32
bytes are those of numpy.fft.rfft). From it on: batched, multi-threaded scipy.fft
passes over an (n1, n2) matrix of the signal, with the numba kernels of ``fft.py``
between them (twiddles, and the real-FFT split that also transposes).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numba
import numpy as np
import scipy.fft

from mpicomp.kernels.cpu import fft as _k

# From this many elements on, the blocked transform runs: below it one pocketfft call is
# a millisecond or two.
BLOCKED_MIN = 1 << 18
# Both sides of the blocked matrix are at least this long (else one NumPy call is used).
_MIN_SIDE = 64


@dataclass(frozen=True)
class Plan:
    """How the blocked transform splits n = 2 * n1 * n2, and its table of unit roots.

    ``w_hi[:, h]`` and ``w_lo[:, l]`` hold the real and imaginary parts of
    exp(-2 pi i h 2**shift / n) and exp(-2 pi i l / n): their product is that of
    j = h * 2**shift + l.
    """

    n1: int
    n2: int
    shift: int
    w_hi: np.ndarray
    w_lo: np.ndarray


@functools.lru_cache(maxsize=8)
def plan(n: int) -> Plan | None:
    """Return the blocked-transform plan of an ``n``-element rfft, or None for NumPy's.

    None below ``BLOCKED_MIN``, for odd n, and when n/2 has no divisor between
    ``_MIN_SIDE`` and its square root (n/2 prime, say).
    """
    if n < BLOCKED_MIN or n % 2:
        return None
    m = n // 2
    n1 = next((d for d in range(math.isqrt(m), _MIN_SIDE - 1, -1) if m % d == 0), None)
    if n1 is None:
        return None
    shift = (n.bit_length() + 1) // 2
    lo = np.arange(1 << shift)
    hi = np.arange(((n - 1) >> shift) + 1) << shift
    w_hi, w_lo = (np.exp(-2j * np.pi * j / n) for j in (hi, lo))
    return Plan(
        n1, m // n1, shift, np.stack([w_hi.real, w_hi.imag]), np.stack([w_lo.real, w_lo.imag])
    )


def sum_spectra(n: int) -> bool:
    """Return True if a sum of ``n``-element decodes should add spectra and invert once.

    Where the blocked transform runs it dominates decoding, and one inverse beats one
    per payload; below, decoding each and adding keeps the sum bit-identical to it.
    """
    return plan(n) is not None


def rfft(flat: np.ndarray, own: bool) -> tuple[np.ndarray, np.ndarray, bool]:
    """Return (interleaved float32 half spectrum, |X|^2 in float32, all finite) of ``flat``.

    ``own``: ``flat`` is a scratch copy the transform may overwrite.
    """
    nbins = flat.size // 2 + 1 if flat.size else 0
    mag2 = np.empty(nbins, dtype=np.float32)
    p = plan(flat.size)
    if p is None:
        with np.errstate(invalid="ignore", over="ignore"):  # NaN/Inf are caught below
            spec = np.fft.rfft(flat).astype(np.complex64, copy=False).view(np.float32)
        return spec, mag2, _k.mpicomp_fft_magnitude(spec, mag2)
    workers = numba.get_num_threads()
    # Columns of the (n1, n2) matrix, twiddle, then rows: the rows' transform reads the
    # matrix transposed, so the spectrum comes out in natural frequency order.
    z = flat.view(np.complex64).reshape(p.n1, p.n2)
    z = scipy.fft.fft(z, axis=0, workers=workers, overwrite_x=own)
    _k.mpicomp_fft_twiddle(z, p.w_hi, p.w_lo, p.shift, False)
    z = scipy.fft.fft(z.T, axis=0, workers=workers)
    spec = np.empty(2 * nbins, dtype=np.float32)
    ok = _k.mpicomp_fft_real_post(z.reshape(-1), p.w_hi, p.w_lo, p.shift, spec, mag2)
    return spec, mag2, ok


def irfft(spec: np.ndarray, n: int) -> np.ndarray:
    """Return the ``n`` float32 values of the interleaved float32 half spectrum ``spec``."""
    p = plan(n)
    if p is None:
        with np.errstate(invalid="ignore", over="ignore"):  # overflow is caught by callers
            return np.fft.irfft(spec.view(np.complex64), n=n).astype(np.float32, copy=False)
    workers = numba.get_num_threads()
    # The forward steps backwards: Z in natural order is the (n2, n1) transpose of the
    # row transforms' output.
    z = np.empty(n // 2, dtype=np.complex64)
    _k.mpicomp_fft_real_pre(spec, p.w_hi, p.w_lo, p.shift, z)
    z = scipy.fft.ifft(z.reshape(p.n2, p.n1), axis=0, workers=workers, overwrite_x=True)
    _k.mpicomp_fft_twiddle(z, p.w_hi, p.w_lo, p.shift, True)
    # Not in place: that would leave the result in the transposed (Fortran) order.
    z = scipy.fft.ifft(z.T, axis=0, workers=workers)
    return np.ascontiguousarray(z).view(np.float32).reshape(-1)
