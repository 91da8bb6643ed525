"""What the benchmarks measure: the codecs with their parameters, and how the command
lines spell counts and parameters. The gradient is ``mpicomp._probe.gradient``, the one
``CompressedComm(schedule="auto")`` times codecs on."""

from __future__ import annotations

import math
from collections.abc import Sequence

from mpicomp import codecs

# One representative parameter set per codec (two for QSGD-MaxNorm: 8 and 2 bits, the
# ends of its useful range), in the order the tables print them.
BENCH_SET: list[tuple[str, dict]] = [
    ("none", {}),
    ("fp16", {}),
    ("topk", {"ratio": 0.01}),
    ("signsgd", {}),
    ("qsgd_maxnorm", {"bits": 8}),
    ("qsgd_maxnorm", {"bits": 2}),
    ("qsgd_maxnorm_multiscale", {"bits": 2}),
    ("grandk_maxnorm", {"bits": 4}),
    ("grandk_maxnorm_multiscale", {"bits": 2}),
    ("threelc", {"sparsity": 1.5}),
    ("fft", {}),
    ("fastsgd", {}),
]


def codec_set(names: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """Return the (name, params) pairs of ``BENCH_SET`` for ``names`` (all when None).

    A name outside ``BENCH_SET`` but registered gets its default parameters.

    Raises:
        ValueError: a name is not a codec.
    """
    if names is None:
        return list(BENCH_SET)
    known = codecs.available()
    out: list[tuple[str, dict]] = []
    for name in names:
        if name not in known:
            raise ValueError(f"unknown codec {name!r}; available: {', '.join(known)}")
        out += [(n, p) for n, p in BENCH_SET if n == name] or [(name, {})]
    return out


def parse_count(text: str) -> int:
    """Return the integer that ``text`` spells: ``1000``, ``1e6``, ``4K``, ``1M``, ``25.6M``.

    Suffixes are decimal: K = 1e3, M = 1e6, G = 1e9.

    Raises:
        ValueError: ``text`` is not a whole, non-negative count.
    """
    s = str(text).strip()
    scale = {"k": 10**3, "m": 10**6, "g": 10**9}.get(s[-1:].lower(), 1)
    body = s[:-1] if scale != 1 else s
    try:
        value = float(body) * scale
    except ValueError:
        raise ValueError(f"not a count: {text!r}") from None
    if not math.isfinite(value) or not value.is_integer() or value < 0:
        raise ValueError(f"not a whole non-negative count: {text!r}")
    return int(value)


def label(params: dict) -> str:
    """Return ``params`` as ``k=v,k=v`` (empty for defaults)."""
    return ",".join(f"{k}={v}" for k, v in params.items())
