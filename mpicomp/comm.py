"""CompressedComm: the one call a training loop makes instead of its all-reduce."""

from __future__ import annotations

import sys

import numpy as np

from mpicomp import _reduce
from mpicomp._backend import as_gradient, get_array_module
from mpicomp.codecs import Codec, ErrorFeedback
from mpicomp.codecs._base import check_number
from mpicomp.codecs._base import make as make_codec

# Biased gather codecs lose what they do not send unless it is fed back next step.
_FEEDBACK_DEFAULT = {"threelc", "topk", "fft", "fastsgd"}


class CompressedComm:
    """Average gradients over the ranks of ``comm`` through a compressing codec.

    Args:
        comm: an ``mpi4py.MPI.Comm``; a duplicate is kept, so mpicomp's messages never
            match the caller's.
        codec: a codec name (with ``**codec_params``) or a made codec.
        min_numel: tensors with fewer elements are averaged uncompressed (float32 MPI
            sum): headers and extra messages would cost more than they save.
        bucket_numel: ``allreduce_many`` fuses consecutive tensors smaller than this
            into buckets of up to this many elements, one collective call each.
        error_feedback: keep per-tensor residuals (default: on for the biased gather
            codecs 3LC, top-k, FFT and FastSGD, off otherwise).
        sharded: gather codecs only: reduce through shard owners (3LC's push/pull,
            an alltoallv then an allgather) instead of allgathering whole payloads;
            each rank receives O(1) compressed tensors instead of N - 1. With error
            feedback, workers keep a residual per shard and owners one per tensor.
        **codec_params: parameters of the codec when ``codec`` is a name.

    Every rank must make the same calls in the same order with tensors of the same
    sizes (as with any MPI collective); sizes that differ, or a NaN/Inf that a codec
    refuses on one rank, raise an error on every rank instead of hanging.
    """

    def __init__(
        self,
        comm,
        codec: str | Codec = "none",
        *,
        min_numel: int = 1024,
        bucket_numel: int = 1 << 22,
        error_feedback: bool | None = None,
        sharded: bool = False,
        **codec_params,
    ):
        if isinstance(codec, str):
            codec = make_codec(codec, **codec_params)
        elif codec_params:
            raise TypeError("codec parameters go with a codec name, not a made codec")
        if not isinstance(codec, Codec):
            raise TypeError(f"codec must be a name or an mpicomp codec, got {codec!r}")
        self.codec = codec
        self.min_numel = check_number("min_numel", min_numel, 0, None, integer=True)
        self.bucket_numel = check_number("bucket_numel", bucket_numel, 1, None, integer=True)
        if error_feedback is None:
            error_feedback = codec.name in _FEEDBACK_DEFAULT
        if error_feedback and codec.aggregation != "gather":
            raise ValueError(
                f"error_feedback applies to gather codecs; {codec.name!r} is {codec.aggregation!r}"
            )
        if sharded and codec.aggregation != "gather":
            raise ValueError(
                f"sharded applies to gather codecs; {codec.name!r} is {codec.aggregation!r}"
            )
        self.sharded = bool(sharded)
        self._feedback = ErrorFeedback(codec) if error_feedback else None
        self._server_feedback = ErrorFeedback(codec) if error_feedback and sharded else None
        self._plain = make_codec("none")
        self._comm = comm.Dup()
        self.rank = self._comm.rank
        self.size = self._comm.size
        self._calls = 0  # the step of the counter-based RNG: the same on every rank
        self.tracer = None

    # -- the API ---------------------------------------------------------------

    def allreduce(self, x, name: str = ""):
        """Return the average over ranks of ``x``, with ``x``'s backend, shape and dtype.

        Args:
            x: the local gradient: a NumPy array, or any ``__dlpack__`` object (a
                PyTorch CPU tensor is taken without a copy).
            name: the tensor's name; keys its error-feedback residual, so use the same
                name for the same tensor every step.
        """
        self._check_open()
        flat = as_gradient(x, what=f"gradient {name!r}" if name else "gradient").reshape(-1)
        return _like(x, self._average(flat, name).reshape(np.shape(x)))

    def allreduce_many(self, arrays, names=None) -> list:
        """Return the averages of ``arrays``, fusing small tensors into buckets.

        Consecutive tensors smaller than ``bucket_numel`` share one buffer and one
        collective call; larger ones go alone. Pass the same list structure every step
        (bucket residuals are keyed by position and names).
        """
        self._check_open()
        arrays = list(arrays)
        names = [f"#{i}" for i in range(len(arrays))] if names is None else list(names)
        if len(names) != len(arrays):
            raise ValueError(f"{len(names)} names for {len(arrays)} arrays")
        flats = [
            as_gradient(a, what=f"gradient {n!r}").reshape(-1)
            for a, n in zip(arrays, names, strict=True)
        ]
        out: list = [None] * len(arrays)
        for members in _buckets([f.size for f in flats], self.bucket_numel):
            if len(members) == 1:
                (i,) = members
                avg = self._average(flats[i], names[i])
                out[i] = _like(arrays[i], avg.reshape(np.shape(arrays[i])))
                continue
            fused = np.concatenate([flats[i] for i in members])
            avg = self._average(fused, "bucket:" + "|".join(names[i] for i in members))
            start = 0
            for i in members:
                part = avg[start : start + flats[i].size]
                out[i] = _like(arrays[i], part.reshape(np.shape(arrays[i])))
                start += flats[i].size
        return out

    def state_dict(self) -> dict:
        """Return the error-feedback residuals and the step, for a checkpoint."""
        residuals = self._feedback.state_dict() if self._feedback else {}
        server = self._server_feedback.state_dict() if self._server_feedback else {}
        return {"step": self._calls, "residuals": residuals, "server_residuals": server}

    def load_state_dict(self, state: dict) -> None:
        """Restore what ``state_dict`` returned (same codec, same tensor names)."""
        self._calls = int(state["step"])
        if self._feedback is not None:
            self._feedback.load_state_dict(state["residuals"])
        if self._server_feedback is not None:
            self._server_feedback.load_state_dict(state["server_residuals"])

    def close(self) -> None:
        """Release the duplicated communicator. Safe to call twice."""
        if self._comm is not None:
            self._comm.Free()
            self._comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        return f"CompressedComm(size={self.size}, codec={self.codec!r})"

    # -- internals -------------------------------------------------------------

    def _check_open(self):
        if self._comm is None:
            raise RuntimeError("CompressedComm is closed")

    def _average(self, flat: np.ndarray, name: str) -> np.ndarray:
        step = self._calls
        self._calls += 1
        comm, codec, tracer = self._comm, self.codec, self.tracer
        if flat.size < self.min_numel or codec.aggregation == "sum":
            small = codec if codec.aggregation == "sum" else self._plain
            return _reduce.reduce_sum(comm, small, flat, tracer)
        if codec.aggregation == "integer_sum":
            return _reduce.reduce_integer(comm, codec, flat, step, tracer)
        if codec.aggregation == "majority":
            return _reduce.reduce_majority(comm, codec, flat, step, tracer)
        if self.sharded:
            if self._feedback is not None:
                push = lambda f, s: self._feedback.encode(f, f"{name}#shard{s}")  # noqa: E731
                pull = lambda f: self._server_feedback.encode(f, name)  # noqa: E731
            else:
                push, pull = (lambda f, s: codec.encode(f)), codec.encode
            return _reduce.reduce_sharded(comm, codec, flat, push, pull, tracer)
        encode = codec.encode
        if self._feedback is not None:
            encode = lambda f: self._feedback.encode(f, name)  # noqa: E731
        return _reduce.reduce_gather(comm, codec, flat, encode, tracer)


def _buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Group consecutive indices of tensors smaller than ``limit`` into buckets <= limit."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if n >= limit:
            if current:
                out.append(current)
                current, total = [], 0
            out.append([i])
            continue
        if total + n > limit and current:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def _like(x, avg: np.ndarray):
    """Return float32 ``avg`` in ``x``'s dtype and framework (NumPy, or the DLPack producer's)."""
    dtype = getattr(x, "dtype", None)
    if isinstance(x, np.ndarray) or get_array_module(x) is not np:
        return avg.astype(x.dtype, copy=False)
    if isinstance(x, np.generic):
        return avg.astype(dtype).reshape(())[()]
    # A DLPack producer (PyTorch, JAX): hand the result back through its own from_dlpack.
    lib = sys.modules.get(type(x).__module__.split(".")[0])
    from_dlpack = getattr(lib, "from_dlpack", None)
    result = from_dlpack(avg) if from_dlpack is not None else avg
    if dtype is not None and hasattr(result, "to"):
        result = result.to(dtype)
    return result
