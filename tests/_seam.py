"""A kernel backend that forwards every launcher of the numba backend and counts calls,
registered by the documented mechanism (``mpicomp.kernels.register_backend``); a poison
for the numba record; a codec's round trip through every kernel path."""

from collections import Counter
from types import SimpleNamespace

import numpy as np

import mpicomp
import mpicomp.kernels as K


def counting_record(calls: Counter, name: str = "counting") -> SimpleNamespace:
    """Return a record whose launchers call the numba ones and count ``family.launcher``."""
    numba = K.backend("numba")

    def forward(key, fn):
        def launcher(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return launcher

    families = {
        fam: SimpleNamespace(
            **{k: forward(f"{fam}.{k}", fn) for k, fn in K.launchers(numba, fam).items()}
        )
        for fam in K.FAMILIES
    }
    return SimpleNamespace(name=name, xp=numba.xp, to_host=numba.to_host, **families)


def poison(monkeypatch, record) -> None:
    """Make every launcher of ``record`` raise: a call that bypasses the seam fails."""

    def refuse(key):
        def launcher(*args, **kwargs):
            raise AssertionError(f"{key} of the numba record was called around the seam")

        return launcher

    for fam in K.FAMILIES:
        family = getattr(record, fam)
        for k in K.launchers(record, fam):
            monkeypatch.setattr(family, k, refuse(f"{fam}.{k}"))


def round_trip(codec, x):
    """Return the arrays a codec makes of ``x`` on its reduction path, one rank."""
    kind = codec.aggregation
    if kind == "sum":
        wire = codec.to_wire(x)
        return [codec.encode(x), codec.decode(codec.encode(x)), codec.from_wire(wire, 1)]
    if kind == "majority":
        votes, scale = codec.votes_and_scale(x)
        bits = codec.majority(votes.astype(np.int64), 1, step=2)
        return [codec.encode(x), codec.decode(codec.encode(x)), bits, codec.expand(bits, x.size)]
    if kind == "integer_sum":
        at = {"step": 5} if codec.sparse else {}
        flat = x.reshape(-1)
        norm = codec.local_norm(flat, **at)
        extra = (codec.scale_index(flat, norm, **at),) if codec.multiscale else ()
        codes = codec.quantize(flat, norm, *extra, step=5, stream=1)
        width = 2 * codec.bound
        k = K.backend_of(codes, codec.kernels)
        packed = k.xp.empty((codes.size * width.bit_length() + 7) // 8, np.uint8)
        k.bits.pack_shifted(codes, codec.bound, width.bit_length(), packed)
        more = {"shape": flat.shape, "step": 5} if codec.sparse else {}
        out = codec.dequantize_packed(
            packed, codes.size, width.bit_length(), codec.bound, norm, *extra, **more
        )
        return [codes, out, *extra]
    payload = codec.encode(x)
    fb = mpicomp.codecs.ErrorFeedback(codec)
    p1, p2 = fb.encode(x, "w"), fb.encode(x, "w")
    return [payload, codec.decode(payload), codec.decode_sum([payload, p1, p2], x.size), p2]


#: The one exception to byte identity (docs/codecs.md, the fft codec's transforms): the fft codec on a GPU transforms with
#: cuFFT where numba uses pocketfft. Spectra differ in the last bits, so a code at a
#: rounding edge or a bin at the edge of the kept set can differ; decodes stay within this
#: norm-wise relative distance of numba's.
FFT_RTOL = 1e-2


def assert_same(a, b, *, transform_differs: bool = False) -> None:
    """Assert host arrays ``a`` and ``b`` hold the same bytes, or, where ``transform_differs``
    (fft on a GPU), payloads of one length and float arrays within ``FFT_RTOL``."""
    assert a.dtype == b.dtype and a.shape == b.shape
    if not transform_differs or a.dtype == np.uint8:
        if not transform_differs:
            assert a.tobytes() == b.tobytes()
        return
    assert np.isfinite(b).all()
    assert np.linalg.norm(b - a) <= FFT_RTOL * np.linalg.norm(a)
