"""atheris harness: feed libFuzzer's bytes to one codec's decode.

Usage: ``python fuzz/decoders.py CODEC [CORPUS_DIR] [libFuzzer flags, e.g. -max_total_time=60]``.
The first input byte picks the mode: even, the bytes go to decode as they are; odd, the
rest gets the codec's magic, version and id, a consistent body length and a correct
checksum, so libFuzzer's mutations reach the codec's own body checks. Any exception
but ``mpicomp.PayloadError`` (or a result that is not a finite float32 array of the
header's shape) is a crash: libFuzzer saves the input and exits non-zero.
"""

import math
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
    return _wire.reseal(p)


# Decoders trust a header's element count (up to 2^40) unless the caller passes the
# expected one (numel=, as CompressedComm does): a few honest bytes of a sparse codec
# can describe a huge tensor. The harness passes a numel when the header claims more
# than this, so such payloads must be refused, never allocated.
LARGE_NUMEL = 1 << 26
# `none` carries float32 as it is, NaN included (docs/usage.md).
NONFINITE_PASSES = {"none"}


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
        claimed = _wire.claimed_shape(p)
        numel = LARGE_NUMEL if claimed is not None and math.prod(claimed) > LARGE_NUMEL else None
        try:
            y = codec.decode(p, numel=numel)
        except mpicomp.PayloadError:
            return
        shape = _wire.claimed_shape(p)
        if not (y.dtype == np.float32 and y.shape == shape):
            raise AssertionError(f"{name} decoded to {y.dtype} {y.shape}, header says {shape}")
        if not (name in NONFINITE_PASSES or np.all(np.isfinite(y))):
            raise AssertionError(f"{name} decoded to NaN or Inf")

    atheris.Setup(args, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
