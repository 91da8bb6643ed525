"""How each aggregation kind is averaged across ranks, one function per kind.

Every path starts with an *agreement*: one small message in which each rank says
how many elements it brings and whether its local encode failed. Ranks that
disagree or fail make every rank raise the same error before any bulk data moves,
so a bad tensor on one rank never leaves the others waiting.

Every function takes a phase ``clock`` (``mpicomp.trace.NO_CLOCK`` when untraced):
``clock.encoded()``, ``clock.communicated()`` and ``clock.decoded()`` charge the time
since the previous mark to local compression work, to messages (collectives with their
own packing, and waiting for other ranks), and to decoding and averaging.
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from mpicomp.collectives.allgather import allgather_bytes
from mpicomp.collectives.maxallreduce import max_allreduce, min_allreduce
from mpicomp.collectives.ring import ring_allreduce_bounded
from mpicomp.collectives.sharded import alltoall_bytes, shard_bounds
from mpicomp.trace import NO_CLOCK


class RankError(RuntimeError):
    """Another rank failed, or ranks disagree, in the same collective call."""


def _agree(
    comm, n: int, error: Exception | None, value: float = 0.0, layout: int = 0, tracer=None
) -> float:
    """Check that all ranks bring n elements in the same layout and none failed.

    One MaxAllReduce of [value, n, -n, layout, -layout, failed_rank + 1] (float64
    holds n and a 32-bit layout hash exactly). Returns the max of ``value`` over
    ranks. Raises the local error on the rank that failed and RankError elsewhere.
    """
    failed = comm.rank + 1 if error is not None else 0
    vec = np.array([value, n, -n, layout, -layout, failed], dtype=np.float64)
    top = max_allreduce(comm, vec, tracer=tracer)
    if top[5]:
        if error is not None:
            raise error
        raise RankError(f"rank {int(top[5]) - 1} failed in the same call (see its error)")
    if top[1] != -top[2]:
        raise RankError(
            f"ranks disagree on the tensor size: from {int(-top[2])} to {int(top[1])} "
            f"elements (this rank: {n})"
        )
    if top[3] != -top[4]:
        raise RankError("ranks disagree on the tensors fused into this bucket (names or sizes)")
    return float(top[0])


def fail(comm, error: Exception, layout: int = 0, tracer=None) -> None:
    """Take part in a call's agreement as the rank whose input was refused; raise ``error``.

    Every path begins with the same agreement message, so the other ranks, whichever
    path they took, receive the failure there and raise RankError.
    """
    _agree(comm, 0, error, layout=layout, tracer=tracer)


def _attempt(fn, *args, **kwargs):
    """Return (fn(...), None), or (None, error) for a ValueError/TypeError of local input."""
    try:
        return fn(*args, **kwargs), None
    except (ValueError, TypeError) as e:
        return None, e


def reduce_sum(comm, codec, flat, tracer=None, clock=NO_CLOCK, layout: int = 0) -> np.ndarray:
    """Average by MPI sum of ``codec.to_wire`` (float32 as it is, or float16)."""
    wire, err = _attempt(codec.to_wire, flat)
    clock.encoded()
    _agree(comm, flat.size, err, layout=layout, tracer=tracer)
    if wire.dtype == np.float16:
        total = np.empty_like(wire)
        comm.Allreduce([wire, MPI.UINT16_T], [total, MPI.UINT16_T], op=_float16_sum())
        clock.communicated()
        if not np.all(np.isfinite(total)):
            raise RankError("fp16: the sum over ranks overflows float16; use codec 'none'")
    else:
        total = np.empty_like(wire)
        comm.Allreduce(wire, total, op=MPI.SUM)
        clock.communicated()
    if tracer is not None:
        tracer.record("mpi.allreduce", 1, wire.nbytes, wire.nbytes, 8 * wire.itemsize)
    out = codec.from_wire(total, comm.size)
    clock.decoded()
    return out


_F16_SUM = None


def _float16_sum():
    # MPI has no float16 type: sum 2-byte words as float16, accumulating in float32.
    global _F16_SUM
    if _F16_SUM is None:

        def add(inbuf, inoutbuf, datatype):
            a = np.frombuffer(inbuf, dtype=np.float16)
            b = np.frombuffer(inoutbuf, dtype=np.float16)
            b[...] = (a.astype(np.float32) + b.astype(np.float32)).astype(np.float16)

        _F16_SUM = MPI.Op.Create(add, commute=True)
    return _F16_SUM


def reduce_integer(
    comm, codec, flat, step: int, tracer=None, clock=NO_CLOCK, layout: int = 0
) -> np.ndarray:
    """Average QSGD-MaxNorm codes: MaxAllReduce of norms, [MinAllReduce of scale
    indices], exact ring sum of the codes, dequantize."""
    sparse = hasattr(codec, "coordinates")  # GlobalRandK: K coordinates drawn per step
    at = {"step": step} if sparse else {}
    norm, err = _attempt(codec.local_norm, flat, **at)
    clock.encoded()
    norm = _agree(comm, flat.size, err, value=norm or 0.0, layout=layout, tracer=tracer)
    clock.communicated()
    extra = ()
    if hasattr(codec, "scale_index"):
        sidx = codec.scale_index(flat, norm, **at)
        clock.encoded()
        if codec.index_bits:
            sidx = min_allreduce(comm, sidx, bits=codec.index_bits, tracer=tracer)
            clock.communicated()
        extra = (sidx.astype(codec.index_dtype, copy=False),)
    codes = codec.quantize(flat, norm, *extra, step=step, stream=comm.rank)
    clock.encoded()
    total = ring_allreduce_bounded(comm, codes, codec.bound, tracer=tracer)
    clock.communicated()
    if sparse:
        out = codec.dequantize(total, norm, *extra, nranks=comm.size, shape=flat.shape, step=step)
    else:
        out = codec.dequantize(total, norm, *extra, nranks=comm.size)
    clock.decoded()
    return out


def reduce_majority(
    comm, codec, flat, step: int, tracer=None, clock=NO_CLOCK, layout: int = 0
) -> np.ndarray:
    """signSGD: ring sum of votes, majority decided by each chunk's owner, ±mean scale."""
    votes, err = _attempt(codec.votes, flat)
    scale = codec.scale(flat) if err is None else 0.0
    clock.encoded()
    _agree(comm, flat.size, err, layout=layout, tracer=tracer)
    # Every rank's mean |x|, summed in rank order: the same float on every rank.
    scales = np.empty(comm.size, dtype=np.float64)
    comm.Allgather(np.array([scale], dtype=np.float64), scales)
    if tracer is not None:
        tracer.record("mpi.allgather", 1, 8, 8 * (comm.size - 1), 64)

    def decide(counts, offset):
        return codec.majority(counts, comm.size, step=step, offset=offset)

    # The owners' majority decisions run inside the ring: charged to comm.
    bits = ring_allreduce_bounded(comm, votes, 1, majority=decide, signed=False, tracer=tracer)
    clock.communicated()
    out = codec.expand(bits, flat.size, float(scales.sum() / comm.size))
    clock.decoded()
    return out


def reduce_gather(
    comm, codec, flat, encode, tracer=None, clock=NO_CLOCK, layout: int = 0
) -> np.ndarray:
    """Allgather every rank's payload; every rank decodes all and averages in rank order."""
    payload, err = _attempt(encode, flat)
    clock.encoded()
    _agree(comm, flat.size, err, layout=layout, tracer=tracer)
    payloads = _exchange(allgather_bytes, comm, payload, None, tracer)
    clock.communicated()
    out = _decode_mean(codec, payloads, flat.size)
    clock.decoded()
    return out


def reduce_sharded(
    comm, codec, flat, encode_push, encode_pull, tracer=None, clock=NO_CLOCK, layout: int = 0
) -> np.ndarray:
    """3LC's push/pull: shard s is averaged by rank s, compressed once more, pulled by all.

    ``encode_push(shard, s)`` compresses this rank's shard s (worker residual s);
    ``encode_pull(avg_shard)`` compresses the owner's average (server residual).
    """
    bounds = shard_bounds(flat.size, comm.size)
    pushed, err = _attempt(lambda: [encode_push(flat[a:b], s) for s, (a, b) in enumerate(bounds)])
    clock.encoded()
    _agree(comm, flat.size, err, layout=layout, tracer=tracer)
    received = _exchange(alltoall_bytes, comm, pushed, None, tracer)
    clock.communicated()
    a, b = bounds[comm.rank]
    mine = _decode_mean(codec, received, b - a)
    clock.decoded()
    # The owner's average can still be refused (e.g. a float32 sum that overflowed):
    # it then takes part in the allgather with None, so every rank raises.
    pull, err = _attempt(encode_pull, mine)
    clock.encoded()
    pulled = _exchange(allgather_bytes, comm, pull, err, tracer)
    clock.communicated()
    parts = [codec.decode(p).reshape(-1) for p in pulled]
    for (a, b), part in zip(bounds, parts, strict=True):
        if part.size != b - a:
            raise RankError(
                f"ranks disagree on the tensor size: shard of {part.size}, expected {b - a}"
            )
    out = np.concatenate(parts) if parts else np.zeros(0, np.float32)
    clock.decoded()
    return out


def _exchange(collective, comm, data, err, tracer):
    """Run a byte collective; a rank whose encode failed takes part with None."""
    try:
        return collective(comm, data, tracer=tracer)
    except ValueError as e:
        if err is not None:
            raise err from None
        raise RankError(str(e)) from e


def _decode_mean(codec, payloads, n: int) -> np.ndarray:
    """Decode every payload, check its size, and average in rank order (the same on every rank)."""
    total = np.zeros(n, dtype=np.float32)
    for rank, p in enumerate(payloads):
        y = codec.decode(p).reshape(-1)
        if y.size != n:
            raise RankError(
                f"ranks disagree on the tensor size: rank {rank} sent {y.size} elements, "
                f"this rank has {n}"
            )
        total += y
    return total / np.float32(len(payloads))
