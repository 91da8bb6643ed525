"""atheris harness: feed libFuzzer's bytes to one codec's decode.

Usage: ``python fuzz/decoders.py CODEC [CORPUS_DIR] [libFuzzer flags, e.g. -max_total_time=60]``.
The first input byte picks the mode: even, the bytes go to decode as they are; odd, the
rest gets the codec's magic, version and id, a consistent body length and a correct
checksum, so libFuzzer's mutations reach the codec's own body checks. Any exception
but ``mpicomp.PayloadError`` (or a result that is not a finite float32 array of the
header's shape) is a crash: libFuzzer saves the input and exits non-zero.
"""

import math
import os
import struct
import sys

import atheris
import numpy as np

import mpicomp
from mpicomp.codecs import _wire


def _instrument(codec) -> None:
    # Coverage of the Python checks only: numba compiles its kernels from their
    # bytecode, which atheris' instrumentation would change (instrument_imports breaks them).
    cls = type(codec)
    cls.decode = atheris.instrument_func(cls.decode)
    _wire.unpack = atheris.instrument_func(_wire.unpack)


def _seeds(name: str) -> list[bytes]:
    """Return valid payloads of a few shapes, each behind the odd mode byte."""
    codec = mpicomp.codec(name)
    rng = np.random.default_rng(0)
    out = []
    for shape in [(0,), (1,), (7,), (3, 5), (200,), (1000,)]:
        x = (rng.standard_normal(shape) * 1e-2).astype(np.float32)
        x[x.size // 3 :] = 0 if x.ndim == 1 else x[x.size // 3 :]
        out.append(b"\x01" + codec.encode(x).tobytes())
    return out


def _repair(name: str, data: bytes) -> np.ndarray:
    p = np.frombuffer(data.ljust(_wire.FIXED_SIZE, b"\0"), dtype=np.uint8).copy()
    p[:4] = [*_wire.MAGIC, _wire.VERSION, _wire.CODEC_IDS[name]]
    p[4] %= _wire.MAX_NDIM + 1
    body = p.size - _wire.header_size(int(p[4]))
    if body >= 0:
        struct.pack_into("<I", p, 12, body)
    struct.pack_into("<I", p, 8, _wire._checksum(p))
    return p


# MPICOMP_FUZZ_SKIP_KNOWN=1 steps over the two gaps tests/test_fuzz.py marks xfail (a 0
# dimension beside a huge one; a tiny sparse payload claiming a huge shape), so a run can
# look past them until they are fixed. Off by default: they are real failures.
SKIP_KNOWN = os.environ.get("MPICOMP_FUZZ_SKIP_KNOWN") == "1"
KNOWN_NUMEL = 1 << 26
# `none` carries float32 as it is, NaN included (docs/usage.md); fp16 should refuse
# NaN/Inf (a known gap) and is let through only with MPICOMP_FUZZ_SKIP_KNOWN=1.
NONFINITE_PASSES = {"none", "fp16"} if SKIP_KNOWN else {"none"}


def _known_gap(p: np.ndarray) -> bool:
    if p.size < _wire.FIXED_SIZE or p[4] > _wire.MAX_NDIM or p.size < _wire.header_size(p[4]):
        return False
    shape = [int(d) for d in p[16 : _wire.header_size(int(p[4]))].view("<u8")]
    nonzero = math.prod(d for d in shape if d)
    return nonzero > KNOWN_NUMEL or any(d > KNOWN_NUMEL for d in shape)


def main() -> None:
    """Fuzz the decoder named by the first argument until libFuzzer's limits stop it."""
    name, args = sys.argv[1], [sys.argv[0], *sys.argv[2:]]
    codec = mpicomp.codec(name)
    _instrument(codec)
    corpus = [a for a in args[1:] if not a.startswith("-")]
    if corpus:  # start from valid payloads, so mutations stay near real ones
        from pathlib import Path

        for i, seed in enumerate(_seeds(name)):
            Path(corpus[0]).mkdir(parents=True, exist_ok=True)
            (Path(corpus[0]) / f"seed{i}").write_bytes(seed)

    def one_input(data: bytes) -> None:
        if not data:
            return
        p = _repair(name, data[1:]) if data[0] & 1 else np.frombuffer(data[1:], dtype=np.uint8)
        if SKIP_KNOWN and _known_gap(p):
            return
        try:
            y = codec.decode(p)
        except mpicomp.PayloadError:
            return
        shape = tuple(int(d) for d in p[16 : _wire.header_size(int(p[4]))].view("<u8"))
        if not (y.dtype == np.float32 and y.shape == shape):
            raise AssertionError(f"{name} decoded to {y.dtype} {y.shape}, header says {shape}")
        if not (name in NONFINITE_PASSES or np.all(np.isfinite(y))):
            raise AssertionError(f"{name} decoded to NaN or Inf")

    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
