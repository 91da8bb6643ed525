"""signSGD with majority vote (the all-reducible signSGD paper): one bit per element on the wire.

Ranks vote bit = (x > 0); a ring reduce sums the votes (bit widths growing with
the step) and the chunk owner decides the majority, which then travels as 1 bit
per element. The result is ±scale, where the collective layer supplies the scale
(by default the mean over ranks of mean |x|, so the magnitude of the update is
that of the gradient).
"""

from __future__ import annotations

import numpy as np

from mpicomp.codecs import _wire
from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.codecs.arrays import as_gradient
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels import signsgd as _k
from mpicomp.kernels.readback import when
from mpicomp.kernels.rng import key as _rng_key


def _counts_in_range(ok: bool, nranks: int) -> None:
    if not ok:
        raise ValueError(f"vote counts must lie in [0, {nranks}]")


_TIES = {"negative": _k.TIE_NEGATIVE, "positive": _k.TIE_POSITIVE, "random": _k.TIE_RANDOM}


@register
class SignSGD(Codec):
    """signSGD with majority vote across ranks.

    Args:
        tie: what a tie of votes (even number of ranks, half for +1) decides:
            ``"random"`` (default; a counter-based draw per element and step, the
            same on every rank, so ties are unbiased), ``"negative"`` (the paper's
            rule: not more than half -> -1) or ``"positive"``.
        seed: seed of the tie-breaking draws.
    """

    name = "signsgd"
    trains_adaptive = False  # under AdamW: docs/choosing.md
    aggregation = "majority"
    bound = 1  # one vote per rank and element

    def __init__(self, tie: str = "random", seed: int = 0):
        if tie not in _TIES:
            raise ValueError(f"tie must be one of {sorted(_TIES)}, got {tie!r}")
        seed = check_number("seed", seed, 0, 2**64 - 1, integer=True)
        super().__init__(tie=tie, seed=seed)

    def votes(self, x) -> np.ndarray:
        """Return one uint8 vote per element: 1 where x > 0, else 0 (zero votes -1).

        Raises:
            ValueError: ``x`` holds NaN or Inf.
        """
        flat = as_gradient(x).reshape(-1)
        k = backend_of(flat, self.kernels)
        out = k.xp.empty(flat.size, dtype=np.uint8)
        if not k.signsgd.votes(flat, out):
            raise ValueError("signsgd: input holds NaN or Inf")
        return out

    def signs(self, x) -> np.ndarray:
        """Return the votes of ``x`` packed 8 per byte, LSB-first (ceil(n/8) bytes).

        Raises:
            ValueError: ``x`` holds NaN or Inf.
        """
        flat = as_gradient(x).reshape(-1)
        k = backend_of(flat, self.kernels)
        out = k.xp.empty((flat.size + 7) // 8, dtype=np.uint8)
        if not k.signsgd.pack(flat, out):
            raise ValueError("signsgd: input holds NaN or Inf")
        return out

    def scale(self, x) -> float:
        """Return mean |x| of this rank (0 for an empty array), the magnitude of its update."""
        flat = as_gradient(x).reshape(-1)
        if not flat.size:
            return 0.0
        return backend_of(flat, self.kernels).signsgd.abs_sum(flat) / flat.size

    def votes_and_scale(self, x) -> tuple[np.ndarray, float]:
        """Return ``votes(x)`` and ``scale(x)`` from one pass over ``x``.

        Raises:
            ValueError: ``x`` holds NaN or Inf.
        """
        flat = as_gradient(x).reshape(-1)
        k = backend_of(flat, self.kernels)
        out = k.xp.empty(flat.size, dtype=np.uint8)
        ok, total = k.signsgd.votes_scale(flat, out)
        if not ok:
            raise ValueError("signsgd: input holds NaN or Inf")
        return out, (total / flat.size if flat.size else 0.0)

    def majority(self, counts, nranks: int, step: int = 0, offset: int = 0) -> np.ndarray:
        """Return the majority decisions of vote ``counts``, packed LSB-first.

        Args:
            counts: votes for +1 per element, each in [0, nranks] (any integer dtype).
            nranks: how many ranks voted.
            step: the training step (varies the random tie-breaks).
            offset: global index of ``counts[0]`` in the whole tensor, so every chunk
                owner draws the tie-breaks of its own elements.

        Raises:
            ValueError: ``nranks`` < 1, or a count outside [0, nranks].
        """
        k = backend_of(counts, self.kernels)
        counts = k.xp.ascontiguousarray(counts).reshape(-1)
        nranks = check_number("nranks", nranks, 1, None, integer=True)
        out = k.xp.empty((counts.size + 7) // 8, dtype=np.uint8)
        key = _rng_key(self.params["seed"], step, 0)
        tie = _TIES[self.params["tie"]]
        ok = k.signsgd.majority(counts, nranks, tie, key, offset, out)
        when(ok, lambda ok: _counts_in_range(ok, nranks))
        return out

    def expand(self, bits, n: int, scale: float = 1.0) -> np.ndarray:
        """Return ``n`` float32 values: +scale where the bit is set, -scale elsewhere.

        Raises:
            ValueError: ``bits`` holds fewer than ceil(n/8) bytes.
        """
        k = backend_of(bits, self.kernels)
        bits = k.xp.ascontiguousarray(bits, dtype=np.uint8).reshape(-1)
        if bits.size < (n + 7) // 8:
            raise ValueError(f"{bits.size} bytes of sign bits cannot hold {n} elements")
        out = k.xp.empty(n, dtype=np.float32)
        k.signsgd.expand(bits, np.float32(scale), out)
        return out

    def encode(self, x) -> np.ndarray:
        """Return the payload of ``x`` for the allgather path: float32 mean |x|, then its sign bits."""
        x = as_gradient(x)
        xp = backend_of(x, self.kernels).xp
        bits = self.signs(x)
        body = xp.empty(4 + bits.size, dtype=np.uint8)
        body[:4] = xp.asarray(np.array([self.scale(x)], dtype="<f4").view(np.uint8))
        body[4:] = bits
        return _wire.pack(self.name, x.shape, body, kernels=self.kernels)

    def decode(self, payload, numel: int | None = None) -> np.ndarray:
        """Return ±(mean |x|) per element, with the signs the payload carries."""
        shape, _, body = _wire.unpack(self.name, payload, numel=numel, kernels=self.kernels)
        n = _wire.numel_of(shape)
        if body.size != 4 + (n + 7) // 8:
            raise PayloadError(
                f"signsgd payload body is {body.size} bytes, {n} elements need {4 + (n + 7) // 8}"
            )
        to_host = backend_of(body, self.kernels).to_host
        scale = float(to_host(body[:4], why="signsgd decode: scale").view("<f4")[0])
        if not np.isfinite(scale) or scale < 0:
            raise PayloadError(
                f"signsgd payload scale {scale!r} is not a finite non-negative number"
            )
        if n % 8 and int(to_host(body[-1:], why="signsgd decode: padding bits")[0]) >> (n % 8):
            raise PayloadError("signsgd payload has bits set past its last element")
        return self.expand(body[4:], n, scale).reshape(shape)
