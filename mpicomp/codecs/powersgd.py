"""PowerSGD (Vogels, Karimireddy and Jaggi, NeurIPS 2019), as PyTorch's DDP hook ships it.

Each matrix-shaped gradient M (a tensor viewed as ``shape[0]`` rows) is sent as two thin
factors: P = M Q (n x r), summed over ranks and orthogonalized, then Q = Mᵀ P (m x r),
averaged over ranks; every rank rebuilds P Qᵀ. Q starts from the previous step's average
(warm start), or from Gaussian draws every rank makes alike. Tensors of one dimension, and
matrices whose factors would not be ``min_compression_rate`` times smaller, go
uncompressed in the same messages. Error feedback keeps what the factors missed; the
first ``start_iter`` calls of each tensor are plain float32 averages (no error kept).

The codec holds the algorithm, one method per step of the paper's Algorithms 1 and 2
(``begin``, ``add_error``, ``compress``, ``project``, ``decompress``, ``memorize``);
``mpicomp.reduction.low_rank`` runs them around the agreement and the two sums. It is
array code: its matrix products run on the gradient's device (BLAS on the CPU, cuBLAS
through CuPy), so, unlike the kernel codecs, its bits follow the BLAS library's
summation order.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from mpicomp.codecs._base import Codec, check_number, register
from mpicomp.codecs.arrays import array_module


@dataclass(frozen=True)
class Member:
    """One tensor of a flat buffer: elements [start, stop), as an n x m matrix factored
    at rank r, or sent as it is (``r == 0``)."""

    start: int
    stop: int
    n: int = 0
    m: int = 0
    r: int = 0


@dataclass(frozen=True)
class Layout:
    """How a flat buffer of ``members`` travels: the P factors end to end (``p_size``
    floats), then the uncompressed members (``u_size``); the Q factors (``q_size``)."""

    members: tuple[Member, ...]
    p_size: int
    q_size: int
    u_size: int

    @property
    def compressed(self) -> tuple[Member, ...]:
        return tuple(k for k in self.members if k.r)

    @property
    def uncompressed(self) -> tuple[Member, ...]:
        return tuple(k for k in self.members if not k.r)


@dataclass
class Work:
    """One call of PowerSGD on a tensor or bucket, as its steps pass it on.

    ``kept`` holds the tensor's arrays across calls (``"error"``, ``"q"``, ``"calls"``;
    None: one rank's share alone, nothing kept); ``factored``: this call sends factors
    (False: one of the first ``start_iter`` calls, a plain float32 average); ``x`` is Δ,
    the gradient plus its kept error; ``q`` the averaged Q factors once decompressed.
    """

    kept: dict | None
    layout: Layout
    name: str
    feedback: bool
    done: int
    factored: bool
    x: Any = None
    q: Any = None


@register
class PowerSGD(Codec):
    """PowerSGD: rank-``rank`` factors of every matrix, by one step of power iteration.

    Args:
        rank: the factors' rank r (``matrix_approximation_rank`` of PyTorch's hook).
        start_iter: the first calls of each tensor average it uncompressed
            (``start_powerSGD_iter``).
        min_compression_rate: a matrix is factored only when n·m > rate · (n + m)·r.
        warm_start: start Q from the previous step's (else from fresh draws each step).
        epsilon: added to each column's norm when orthogonalizing (0: a zero column
            stays zero).
        seed: the draws of the first Q, the same on every rank.
    """

    name = "powersgd"
    aggregation = "low_rank"
    feedback_default = True
    on_kernels = False

    def __init__(
        self,
        rank: int = 1,
        start_iter: int = 1000,
        min_compression_rate: float = 2.0,
        warm_start: bool = True,
        epsilon: float = 0.0,
        seed: int = 0,
    ):
        rank = check_number("rank", rank, 1, 1 << 16, integer=True)
        start_iter = check_number("start_iter", start_iter, 0, None, integer=True)
        min_compression_rate = check_number("min_compression_rate", min_compression_rate, 0)
        if not isinstance(warm_start, (bool, np.bool_)):
            raise ValueError(f"warm_start must be a bool, got {warm_start!r}")
        epsilon = check_number("epsilon", epsilon, 0)
        seed = check_number("seed", seed, 0, 2**63 - 1, integer=True)
        super().__init__(
            rank=rank,
            start_iter=start_iter,
            min_compression_rate=min_compression_rate,
            warm_start=bool(warm_start),
            epsilon=epsilon,
            seed=seed,
        )
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.epsilon = float(epsilon)
        self.seed = seed

    def layout(self, shapes) -> Layout:
        """Return how a flat buffer of tensors of ``shapes`` (end to end) travels."""
        members, start, p, q, u = [], 0, 0, 0, 0
        for shape in shapes:
            size = math.prod(shape)
            n = shape[0] if len(shape) > 1 else 0
            m = size // n if n else 0
            r = min(n, m, self.rank)
            if n and m and n * m > self.min_compression_rate * (n + m) * r:
                members.append(Member(start, start + size, n, m, r))
                p, q = p + n * r, q + m * r
            else:
                members.append(Member(start, start + size))
                u += size
            start += size
        return Layout(tuple(members), p, q, u)

    def orthogonalize(self, matrix) -> None:
        """Make the columns of the n x r ``matrix`` orthonormal, in place (Gram-Schmidt,
        as PyTorch's hook does at rank <= 2; a zero column stays zero).

        The squares of entries beyond 1.8e19 overflow float32 (and of entries below
        1e-19 underflow), which would make their columns zero: the matrix is first
        scaled by the power of two that brings its largest entry near 1. That scaling is
        exact, so the result is the same bits as without it wherever the squares fit.
        """
        xp = array_module(matrix)
        scale = _inverse_power_of_two(xp, matrix)
        matrix *= scale
        if self.epsilon:
            with np.errstate(over="ignore"):  # a huge epsilon to a tiny matrix: Inf, col 0
                epsilon = np.float32(self.epsilon) * scale  # to the columns' scale
        for i in range(matrix.shape[1]):
            col = matrix[:, i]
            norm = xp.sqrt(xp.sum(col * col))
            if self.epsilon:
                col /= norm + epsilon
            else:
                col *= xp.where(norm > 0, 1 / xp.maximum(norm, np.float32(1e-30)), 0)
            if i + 1 < matrix.shape[1]:
                rest = matrix[:, i + 1 :]
                rest -= (col @ rest)[None, :] * col[:, None]

    def first_q(self, name: str, layout: Layout, xp):
        """Return the first Q factors of tensor ``name`` (end to end, ``layout.q_size``
        floats): Gaussian draws seeded by ``seed`` and the name, alike on every rank."""
        rng = np.random.default_rng([self.seed, zlib.crc32(name.encode())])
        return xp.asarray(rng.standard_normal(layout.q_size, dtype=np.float32))

    # -- The steps of one call, in the order mpicomp.reduction.low_rank runs them --------
    # (Vogels et al., Algorithm 1: P = M Q, all-reduce P, P̂ = orthogonalize(P), Q = Mᵀ P̂,
    # all-reduce Q, decompress P̂ Qᵀ; Algorithm 2: Δ = g + e, e = Δ - decompress.)

    def begin(self, kept: dict | None, shapes, name: str, feedback: bool) -> Work:
        """Return the work of one call of tensor ``name`` (the tensors of ``shapes`` end
        to end) whose arrays kept across calls are ``kept`` (None: nothing kept, the
        call factored; ``feedback``: error feedback)."""
        done = int(kept["calls"][0]) if kept is not None and "calls" in kept else 0
        factored = kept is None or done >= self.start_iter
        return Work(kept, self.layout(shapes), name, feedback, done, factored)

    def add_error(self, work: Work, gradient):
        """Return Δ = ``gradient`` + its kept error (Algorithm 2: error feedback), or
        ``gradient`` itself where nothing is kept (a plain call, the first one, no
        error feedback); refuse kept arrays of another layout than this call's."""
        if not work.factored or work.kept is None:
            return gradient
        error = work.kept.get("error") if work.feedback else None
        q = work.kept.get("q")
        if (error is not None and error.size != gradient.size) or (
            q is not None and q.size != work.layout.q_size
        ):
            raise ValueError(
                f"{self.name}: tensor {work.name!r} had another layout (sizes or shapes) "
                "before; give each tensor its own name, or forget(name) after changing it"
            )
        return gradient + error if error is not None else gradient

    def compress(self, work: Work, x):
        """Return what ranks sum first of Δ = ``x``: P = Δ Q of every factored matrix
        (its Q orthogonalized: the previous average under ``warm_start``, else first
        draws), then the members sent as they are; a plain call's ``x`` itself."""
        work.x = x
        if not work.factored:
            return x
        layout, xp = work.layout, array_module(x)
        q = work.kept.get("q") if work.kept is not None else None
        q = q.copy() if q is not None and self.warm_start else self.first_q(work.name, layout, xp)
        wire = xp.empty(layout.p_size + layout.u_size, np.float32)
        p_at, q_at = 0, 0
        for k in layout.compressed:
            factor = q[q_at : q_at + k.m * k.r].reshape(k.m, k.r)
            self.orthogonalize(factor)
            matrix = x[k.start : k.stop].reshape(k.n, k.m)
            wire[p_at : p_at + k.n * k.r] = (matrix @ factor).reshape(-1)
            p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
        for k in layout.uncompressed:
            wire[p_at : p_at + k.stop - k.start] = x[k.start : k.stop]
            p_at += k.stop - k.start
        return wire

    def project(self, work: Work, p_sum):
        """Orthogonalize each P of ``p_sum`` (the first sum over ranks) in place, as it is
        (no division: the columns' scale goes), and return what ranks sum second:
        Q = Δᵀ P̂ of every factored matrix."""
        layout, x = work.layout, work.x
        qs = array_module(p_sum).empty(layout.q_size, np.float32)
        p_at, q_at = 0, 0
        for k in layout.compressed:
            p = p_sum[p_at : p_at + k.n * k.r].reshape(k.n, k.r)
            self.orthogonalize(p)
            matrix = x[k.start : k.stop].reshape(k.n, k.m)
            qs[q_at : q_at + k.m * k.r] = (matrix.T @ p).reshape(-1)
            p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
        return qs

    def decompress(self, work: Work, p_sum, q_sum, nranks: int):
        """Return the average over ``nranks``: P̂ Qᵀ of every factored matrix, Q the mean
        of ``q_sum`` (kept for the warm start), and the mean of the members sent as they
        are; a plain call's mean of ``p_sum``. Divides the sums in place."""
        if not work.factored:
            p_sum /= np.float32(nranks)
            return p_sum
        layout = work.layout
        out = array_module(p_sum).empty(work.x.size, np.float32)
        p_at = layout.p_size
        for k in layout.uncompressed:
            out[k.start : k.stop] = p_sum[p_at : p_at + k.stop - k.start] / np.float32(nranks)
            p_at += k.stop - k.start
        q_sum /= np.float32(nranks)
        p_at, q_at = 0, 0
        for k in layout.compressed:
            p = p_sum[p_at : p_at + k.n * k.r].reshape(k.n, k.r)
            factor = q_sum[q_at : q_at + k.m * k.r].reshape(k.m, k.r)
            out[k.start : k.stop] = (p @ factor.T).reshape(-1)
            p_at, q_at = p_at + k.n * k.r, q_at + k.m * k.r
        work.q = q_sum
        return out

    def memorize(self, work: Work, out) -> None:
        """Keep what the next call of the tensor needs: the error e = Δ - ``out``
        (Algorithm 2, under error feedback), the averaged Q, the count of calls. New
        arrays, never written into the kept ones: a rolled-back call puts those back."""
        kept = work.kept
        if kept is None:
            return
        if work.factored:
            if work.feedback:
                kept["error"] = work.x - out
            kept["q"] = work.q
        kept["calls"] = np.array([work.done + 1], np.float32)


def _inverse_power_of_two(xp, matrix):
    """Return the float32 power of two 2^-e where max |``matrix``| = f·2^e (0.5 <= f < 1),
    e kept within [-126, 126] so that 2^-e and 2^e are normal floats (1 where ``matrix``
    is 0 or not finite), on ``matrix``'s device."""
    if xp is np:  # two SIMD passes without a temporary, then Python's frexp
        top = max(float(matrix.max()), -float(matrix.min()))
        e = math.frexp(top)[1] if math.isfinite(top) else 0
        return np.float32(2.0 ** -min(max(e, -126), 126))
    exponent = xp.clip(xp.frexp(xp.max(xp.abs(matrix)))[1], -126, 126)  # no host sync
    return xp.ldexp(np.float32(1), -exponent).astype(np.float32, copy=False)
