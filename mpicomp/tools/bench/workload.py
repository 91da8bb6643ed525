"""What the benchmarks measure: the codecs with their parameters, and how the command
lines spell counts and parameters. The gradient is ``mpicomp.model.probe.gradient``, the one
``CompressedComm(schedule="auto")`` times codecs on."""

from __future__ import annotations

import ast
import math
import re
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
    # compressing from the first call (by default it waits 1000 calls, as torch's hook)
    ("powersgd", {"start_iter": 0}),
]


def split_codecs(text: str) -> list[str]:
    """Return the entries of a comma list of codecs, empty ones dropped; a comma inside
    parentheses belongs to a value (``scales=(2,8)``)."""
    return [e.strip() for e in re.split(r",(?![^()]*\))", text) if e.strip()]


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a plain word, e.g. tie=negative


def parse_codec(entry: str) -> tuple[str, dict | None]:
    """Return the name and parameters of ``name`` or ``name:key=value[:key=value...]``
    (the spelling of ``--codecs`` in ``mpicomp`` and the jobs); values are Python
    literals (``bits=4``, ``scales=(2,8)``) or plain words (``tie=negative``).
    Parameters are None for a bare name (the caller's defaults).

    Raises:
        ValueError: a part after the name that is not ``key=value``.
    """
    name, *pairs = entry.strip().split(":")
    if not pairs:
        return name, None
    params = {}
    for pair in pairs:
        key, sep, val = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"codec parameters are key=value, got {pair!r} in {entry!r}")
        params[key] = _value(val)
    return name, params


def codec_set(names: Sequence[str] | None = None) -> list[tuple[str, dict]]:
    """Return the (name, params) pairs of ``BENCH_SET`` for ``names`` (all when None).

    Each entry is a codec name, or ``name:key=value[:key=value...]`` (:func:`parse_codec`)
    for exactly those parameters. A name outside ``BENCH_SET`` but registered gets its
    default parameters.

    Raises:
        ValueError: a name is not a codec, or the codec refuses the parameters.
    """
    if names is None:
        return list(BENCH_SET)
    known = codecs.available()
    out: list[tuple[str, dict]] = []
    for entry in names:
        name, params = parse_codec(entry)
        if name not in known:
            raise ValueError(f"unknown codec {name!r}; available: {', '.join(known)}")
        if params is None:
            out += [(n, p) for n, p in BENCH_SET if n == name] or [(name, {})]
            continue
        try:
            codecs.codec(name, **params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{entry!r}: {e}") from None
        out.append((name, params))
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


def parse_counts(text: str) -> list[int]:
    """Return the counts of a comma list (``1M,25.6M``), empty entries dropped.

    Raises:
        ValueError: an entry is not a count (:func:`parse_count`).
    """
    return [parse_count(t) for t in text.split(",") if t.strip()]


def format_count(n: int) -> str:
    """Return ``n`` as the command line spells it: ``4K``, ``25.6M`` (:func:`parse_count`
    reads it back) where three digits say it exactly, else ``2,048``."""
    for scale, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "K")):
        if n >= scale and n % (scale // 100 if n < 10 * scale else scale // 10) == 0:
            if n < 1000 * scale:
                return f"{n / scale:g}{suffix}"
    return f"{n:,}"


def codec_label(name: str, params: dict) -> str:
    """Return a codec and its parameters as ``--codecs`` spells them:
    ``qsgd_maxnorm:bits=2`` (the name alone without parameters)."""

    def value(v) -> str:  # (2,6), not (2, 6): one word on a command line
        return re.sub(r",\s+", ",", repr(v)) if isinstance(v, (tuple, list)) else str(v)

    return ":".join([name, *(f"{k}={value(v)}" for k, v in params.items())])


def label(params: dict) -> str:
    """Return ``params`` as ``k=v,k=v`` (empty for defaults)."""
    return ",".join(f"{k}={v}" for k, v in params.items())
