"""How each aggregation kind is averaged across ranks, one function per kind (``REDUCERS``).

Every path starts with an *agreement*: one small message in which each rank says
how many elements it brings and whether its local encode failed. Ranks that
disagree or fail make every rank raise the same error before any bulk data moves,
so a bad tensor on one rank never leaves the others waiting.

Every function takes the ``Call`` it serves: the communicator, the step, the recorder,
the NaN/Inf policy, the timeout, and a phase clock (``mpicomp.trace.NO_CLOCK`` when
untraced): ``clock.encoded()``, ``clock.communicated()`` and ``clock.decoded()`` charge
the time since the previous mark to local compression work, to messages (collectives
with their own packing, and waiting for other ranks), and to decoding and averaging.

A gradient on a device (a CuPy array) is encoded and decoded there. What goes to MPI
(wire arrays, codes, votes, payloads) is handed over by ``_down``: with a CUDA-aware MPI
the device arrays themselves (the collectives run on the device and synchronize it
before each MPI call), else copies in the call's staging buffers on the host, the
collectives then running on the host as for NumPy input; ``_up`` brings host results
back to the device before it decodes them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
from mpi4py import MPI

from mpicomp._arrays import all_finite, array_module, is_device_array, zero_nonfinite
from mpicomp._config import Config, disagreement
from mpicomp._transport import Transport
from mpicomp.collectives import plain
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.collectives.allgather import allgather_bytes
from mpicomp.collectives.direct import direct_allreduce_bounded
from mpicomp.collectives.float16 import allreduce_float16
from mpicomp.collectives.maxallreduce import max_allreduce
from mpicomp.collectives.ring import ring_allreduce_bounded, ring_allreduce_min
from mpicomp.collectives.sharded import alltoall_bytes, shard_bounds
from mpicomp.errors import PeerClosed, RankError
from mpicomp.kernels import backend_of
from mpicomp.trace import NO_CLOCK

POLICIES = ("raise", "skip_step", "zero")


class Skipped(Exception):  # noqa: N818 - a control-flow signal, caught by CompressedComm
    """Every rank skips this call (``nonfinite="skip_step"``): ``message`` names the ranks."""

    def __init__(self, ranks: list[int], message: str):
        super().__init__(message)
        self.ranks = ranks
        self.message = message


@dataclass(frozen=True)
class Guard:
    """How one call treats NaN/Inf in this rank's input.

    ``policy`` is one of ``POLICIES`` (the same on every rank); ``what`` names the
    tensor in messages; ``overflowed`` says that float64 values beyond float32's
    range became Inf in the conversion; ``restore`` puts error-feedback residuals
    back as they were before the call (run before re-encoding a zeroed input).
    """

    policy: str = "raise"
    what: str = "gradient"
    overflowed: bool = False
    restore: Callable[[], None] | None = None

    def error(self, cause: Exception | None = None) -> ValueError:
        """Return the ValueError the rank holding NaN/Inf raises under ``"raise"``."""
        why = "float64 values beyond float32's range" if self.overflowed else "NaN or Inf"
        extra = f" ({cause})" if cause is not None and not self.overflowed else ""
        return ValueError(f"{self.what} holds {why}{extra}")


_RAISE = Guard()


@dataclass(frozen=True)
class Call:
    """What every message of one CompressedComm call shares.

    ``step`` drives the counter-based random draws; ``recorder`` gets the collectives'
    exchange steps and ``clock`` the phase marks (``NO_CLOCK`` when untraced);
    ``layout`` is the name or bucket hash the agreement compares; ``guard`` the NaN/Inf
    policy; ``timeout`` each wait's limit in seconds (None: ``MPICOMP_TIMEOUT``);
    ``kernels`` the kernel backend of NumPy arrays (None: ``mpicomp.kernels.backend()``);
    ``transport`` how device bytes reach MPI (``mpicomp._transport``; needed for device
    input); ``schedule`` how bounded codes are summed (``"ring"`` or ``"direct"``; other
    schedules leave it unread); ``stream`` is added to the rank to number this rank's
    random draws (a hierarchical call's local ranks draw apart on their shards);
    ``config`` what every rank's configuration must match (its digest joins the
    agreement); ``label`` names the tensor or bucket where ranks disagree.
    """

    comm: object
    step: int = 0
    recorder: object = None
    clock: object = NO_CLOCK
    layout: int = 0
    guard: Guard = _RAISE
    timeout: float | None = None
    kernels: object = None
    transport: Transport | None = None
    schedule: str = "ring"
    stream: int = 0
    config: Config = Config()
    label: str = ""

    @property
    def io(self) -> dict:
        """Return the keyword arguments every collective of this call takes."""
        return {"recorder": self.recorder, "timeout": self.timeout}


def _device(a):
    """Return the backend record of device array ``a``; None for a host array."""
    return backend_of(a) if is_device_array(a) else None


def _down(call: Call, dev, a, slot: str):
    """Return what MPI is handed of ``a``: ``a`` itself on the host or with a direct
    transport, else its copy in the staging buffer ``slot`` (valid until the next use
    of that slot)."""
    if dev is None or a is None or isinstance(a, np.ndarray):
        return a
    if call.transport is None:
        raise TypeError("a device array needs a Call with a transport")
    if call.transport.direct:
        return a
    return call.transport.down(dev, a, slot)


def _up(dev, a):
    """Return what a collective gave back on the device of ``dev`` (a host result is
    copied there; a device one, or any result for host input, stays as it is)."""
    return a if dev is None or not isinstance(a, np.ndarray) else dev.xp.asarray(a)


def _agree(
    call: Call,
    n: int,
    error: Exception | None,
    value: float = 0.0,
    nonfinite: bool = False,
    closing: bool = False,
) -> float:
    """Check that all ranks bring n elements in the same layout and configuration, and
    that none failed or is closing the CompressedComm.

    One MaxAllReduce of [value, n, -n, layout, -layout, config, -config, failed_rank + 1,
    nonfinite_rank + 1, closing_rank + 1, calling_rank + 1] (float64 holds n, the 32-bit
    layout hash and the configuration digest exactly; 11 values fit the 192-byte head).
    Returns the max of ``value`` over ranks. A rank closing (``agree_close``) makes every
    rank that called raise PeerClosed. Raises the local error on the rank that failed
    and RankError elsewhere; a failure other than NaN/Inf wins. Ranks that disagree all
    raise RankError naming what differs and on which ranks (only then do descriptions
    travel). When only NaN/Inf failed, one more small Allgather names every such rank
    and under ``skip_step`` every rank raises ``Skipped``.
    """
    rank, layout, digest = call.comm.rank, call.layout, call.config.digest
    failed = rank + 1 if error is not None and not nonfinite else 0
    bad = rank + 1 if nonfinite else 0
    close, calls = (rank + 1, 0) if closing else (0, rank + 1)
    vec = np.array(
        [value, n, -n, layout, -layout, digest, -digest, failed, bad, close, calls], np.float64
    )
    top = max_allreduce(call.comm, vec, **call.io)
    if top[9]:  # a rank is closing: no call runs
        if closing:
            return float(top[10])  # a rank that called, + 1; 0 when every rank closes
        raise PeerClosed(
            f"rank {int(top[9]) - 1} closed this CompressedComm while this rank called it; "
            "it is closed on this rank too"
        ) from error
    if top[7]:
        if error is not None:
            raise error
        raise RankError(f"rank {int(top[7]) - 1} failed in the same call (see its error)")
    # Sizes first: the schedule in the configuration can follow from the size.
    if top[1] != -top[2] or top[3] != -top[4]:
        mine = {"tensor": call.label, "numel": n}
        differs = disagreement(call.comm, mine, resolve_timeout(call.timeout))
        what = "the tensor size" if top[1] != -top[2] else "the tensor (names or bucket layout)"
        raise RankError(f"ranks disagree on {what} in the same call: {differs}")
    if top[5] != -top[6]:
        differs = disagreement(call.comm, call.config.fields, resolve_timeout(call.timeout))
        raise RankError(f"ranks configured this CompressedComm differently: {differs}")
    if top[8]:
        _nonfinite(_flagged(call, nonfinite), nonfinite, call.guard, error)
    return float(top[0])


def _flagged(call: Call, flag: bool) -> list[int]:
    """Return the ranks whose ``flag`` is set (one byte per rank, Allgather; untraced)."""
    flags = np.empty(call.comm.size, dtype=np.uint8)
    plain.allgather(call.comm, np.array([flag], dtype=np.uint8), flags, timeout=call.timeout)
    return np.flatnonzero(flags).tolist()


def _nonfinite(ranks: list[int], local: bool, guard: Guard, error: Exception | None) -> None:
    """Raise, on every rank, what the policy makes of NaN/Inf on ``ranks``."""
    who = ", ".join(map(str, ranks))
    if guard.policy == "skip_step":
        raise Skipped(ranks, f"rank(s) {who}: {guard.what} holds NaN or Inf; call skipped")
    if local:
        raise error if error is not None else guard.error()
    raise RankError(f"rank(s) {who}: {guard.what} holds NaN or Inf in the same call")


def _local(fn, flat, guard: Guard):
    """Run this rank's encode ``fn(flat)``; return (result, flat used, error, nonfinite).

    Only when ``fn`` refuses the input does one extra pass tell NaN/Inf from other
    errors; under ``"zero"`` the NaN/Inf are then zeroed (a copy) and ``fn`` runs again.
    """
    out, err = _attempt(fn, flat)
    if err is None or all_finite(flat):
        return out, flat, err, False
    if guard.policy != "zero":
        return None, flat, guard.error(err), True
    if guard.restore is not None:
        guard.restore()  # a partial encode may have moved residuals
    flat = zero_nonfinite(flat)
    out, err = _attempt(fn, flat)
    return out, flat, err, False


def agree_close(call: Call) -> bool:
    """Take part, as a rank closing its CompressedComm, in the agreement that every call
    begins with; return True if every rank is closing, False if some rank called (it
    raises PeerClosed instead of waiting for this rank forever)."""
    return _agree(call, 0, None, closing=True) == 0


def fail(call: Call, error: Exception) -> None:
    """Take part in a call's agreement as the rank whose input was refused; raise ``error``.

    Every path begins with the same agreement message, so the other ranks, whichever
    path they took, receive the failure there and raise RankError.
    """
    _agree(call, 0, error)


def _attempt(fn, *args, **kwargs):
    """Return (fn(...), None), or (None, error) for a ValueError/TypeError of local input."""
    try:
        return fn(*args, **kwargs), None
    except (ValueError, TypeError) as e:
        return None, e


@dataclass(frozen=True)
class Encoders:
    """How a gather call compresses, error feedback included: ``encode(flat)`` for the
    allgather; ``push(shard, s)`` and ``pull(average)`` for the sharded path."""

    encode: Callable
    push: Callable
    pull: Callable


def reduce_sum(call: Call, codec, flat, encoders: Encoders | None = None) -> np.ndarray:
    """Average by MPI sum of ``codec.to_wire`` (float32 as it is, or float16).

    ``none`` sends its input unchecked: a NaN/Inf on any rank reaches every rank's
    sum, so one pass over the sum tells every rank the same; only then does each
    rank look at its own input (and, under ``"zero"``, the sum is made again).
    """
    comm, clock, guard = call.comm, call.clock, call.guard
    dev = _device(flat)
    wire, flat, err, bad = _local(codec.to_wire, flat, guard)
    clock.encoded()
    _agree(call, flat.size, err, nonfinite=bad)
    total = _sum(call, _down(call, dev, wire, "wire"))
    clock.communicated()
    if not _sum_finite(call, total):
        local = not all_finite(flat)
        ranks = _flagged(call, local)
        if not ranks:
            what = "float16" if wire.dtype == np.float16 else "float32"
            msg = f"{codec.name}: the sum over ranks overflows {what}"
            if guard.policy == "skip_step":
                raise Skipped([], f"{guard.what}: {msg}; call skipped")
            raise RankError(msg + ("; use codec 'none'" if what == "float16" else ""))
        if guard.policy == "zero":
            if local:
                flat = zero_nonfinite(flat)
            total = _sum(call, _down(call, dev, codec.to_wire(flat), "wire"))
            clock.communicated()
            if not _sum_finite(call, total):
                raise RankError(f"{codec.name}: the sum over ranks overflows float32")
        else:
            _nonfinite(ranks, local, guard, None)
    # The sum is this call's own buffer (on the host or just copied up): averaged in place.
    out = codec.from_wire(_up(dev, total), comm.size, reuse=True)
    clock.decoded()
    return out


def _sum(call: Call, wire) -> np.ndarray:
    """Return the MPI sum over ranks of ``wire`` (float32, or float16 summed in float32)."""
    if wire.dtype == np.float16:
        # Summed in place: ``wire`` is this call's own buffer from ``to_wire``.
        allreduce_float16(call.comm, wire, kernels=call.kernels, **call.io)
        return wire
    total = backend_of(wire, call.kernels).xp.empty_like(wire)
    # Through collectives.plain: blocking, or nonblocking under MPICOMP_TIMEOUT.
    plain.allreduce(call.comm, wire, total, MPI.SUM, **call.io)
    return total


def _sum_finite(call: Call, total) -> bool:
    """Return True if the summed wire array holds no NaN/Inf (float16: one SIMD pass)."""
    if total.dtype == np.float16:
        fp16 = backend_of(total, call.kernels).fp16
        return fp16.all_finite(total.reshape(-1).view(np.uint16))
    return all_finite(total, call.kernels)


def reduce_integer(call: Call, codec, flat, encoders: Encoders | None = None) -> np.ndarray:
    """Average QSGD-MaxNorm codes: MaxAllReduce of norms, [MinAllReduce of scale
    indices], exact sum of the codes (ring or direct), dequantize."""
    comm, clock, step = call.comm, call.clock, call.step
    dev = _device(flat)
    at = {"step": step} if codec.sparse else {}  # GlobalRandK: K coordinates drawn per step
    norm, flat, err, bad = _local(lambda f: codec.local_norm(f, **at), flat, call.guard)
    clock.encoded()
    norm = _agree(call, flat.size, err, norm or 0.0, nonfinite=bad)
    clock.communicated()
    # After the agreement every rank's codes (and scale indices) have one length and lie
    # within their bounds by construction: the rings trust it (no second agreement).
    extra = ()
    if codec.multiscale:
        sidx = codec.scale_index(flat, norm, **at)
        clock.encoded()
        if codec.index_bits:
            sidx = ring_allreduce_min(
                comm,
                _down(call, dev, sidx, "index"),
                codec.index_bits,
                dtype=codec.index_dtype,
                checked=False,
                kernels=call.kernels,
                **call.io,
            )
            clock.communicated()
        extra = (_up(dev, sidx).astype(codec.index_dtype, copy=False),)
    codes = codec.quantize(flat, norm, *extra, step=step, stream=call.stream + comm.rank)
    clock.encoded()
    # The sums stay packed as the schedule left them; dequantize_packed unpacks as it goes.
    data, n, width, offset = _BOUNDED[call.schedule](
        comm,
        _down(call, dev, codes, "codes"),
        codec.bound,
        packed=True,
        checked=False,
        kernels=call.kernels,
        **call.io,
    )
    clock.communicated()
    at = {"shape": flat.shape, "step": step} if codec.sparse else {}
    out = codec.dequantize_packed(
        _up(dev, data), n, width, offset, norm, *extra, nranks=comm.size, **at
    )
    clock.decoded()
    return out


def reduce_majority(call: Call, codec, flat, encoders: Encoders | None = None) -> np.ndarray:
    """signSGD: sum of votes (ring or direct), majority decided by each chunk's owner,
    ±mean scale."""
    comm, clock, step = call.comm, call.clock, call.step
    dev = _device(flat)
    found, flat, err, bad = _local(codec.votes_and_scale, flat, call.guard)
    votes, scale = found if err is None else (None, 0.0)
    clock.encoded()
    _agree(call, flat.size, err, nonfinite=bad)
    # Every rank's mean |x|, summed in rank order: the same float on every rank.
    scales = np.empty(comm.size, dtype=np.float64)
    plain.allgather(comm, np.array([scale], dtype=np.float64), scales, **call.io)

    def decide(counts, offset):
        return codec.majority(counts, comm.size, step=step, offset=offset)

    # The owners' majority decisions run inside the exchange: charged to comm.
    bits = _BOUNDED[call.schedule](
        comm,
        _down(call, dev, votes, "votes"),
        1,
        majority=decide,
        signed=False,
        checked=False,
        kernels=call.kernels,
        **call.io,
    )
    clock.communicated()
    out = codec.expand(_up(dev, bits), flat.size, float(scales.sum() / comm.size))
    clock.decoded()
    return out


#: How bounded codes (QSGD's, signSGD's votes) are summed, by schedule name.
_BOUNDED = {"ring": ring_allreduce_bounded, "direct": direct_allreduce_bounded}


def reduce_gather(call: Call, codec, flat, encoders: Encoders) -> np.ndarray:
    """Allgather every rank's payload; every rank decodes all and averages in rank order."""
    clock = call.clock
    dev = _device(flat)
    payload, flat, err, bad = _local(encoders.encode, flat, call.guard)
    clock.encoded()
    _agree(call, flat.size, err, nonfinite=bad)
    payloads = _exchange(call, allgather_bytes, _down(call, dev, payload, "payload"), None)
    clock.communicated()
    out = _decode_mean(codec, _up_all(dev, payloads), flat.size)
    clock.decoded()
    return out


def reduce_sharded(call: Call, codec, flat, encoders: Encoders) -> np.ndarray:
    """3LC's push/pull: shard s is averaged by rank s, compressed once more, pulled by all.

    ``encoders.push(shard, s)`` compresses this rank's shard s (worker residual s);
    ``encoders.pull(avg_shard)`` compresses the owner's average (server residual).
    """
    encode_push, encode_pull = encoders.push, encoders.pull
    comm, clock = call.comm, call.clock
    dev = _device(flat)
    bounds = shard_bounds(flat.size, comm.size)

    def push(f):
        return [encode_push(f[a:b], s) for s, (a, b) in enumerate(bounds)]

    pushed, flat, err, bad = _local(push, flat, call.guard)
    clock.encoded()
    _agree(call, flat.size, err, nonfinite=bad)
    if pushed is not None:
        pushed = [_down(call, dev, p, f"push{s}") for s, p in enumerate(pushed)]
    received = _up_all(dev, _exchange(call, alltoall_bytes, pushed, None))
    clock.communicated()
    a, b = bounds[comm.rank]
    # Only this owner decodes its pushes, and its average can still be refused (a
    # corrupt push, a float32 sum that overflowed): it then takes part in the pull
    # allgather with None, so every rank raises instead of waiting for it.
    mine, err = _attempt(_decode_mean, codec, received, b - a)
    clock.decoded()
    pull, err = (None, err) if err is not None else _attempt(encode_pull, mine)
    clock.encoded()
    pulled = _up_all(dev, _exchange(call, allgather_bytes, _down(call, dev, pull, "pull"), err))
    clock.communicated()
    # Sizes were agreed: a payload of another size is corrupt (PayloadError everywhere).
    parts = [
        codec.decode(p, numel=b - a).reshape(-1) for p, (a, b) in zip(pulled, bounds, strict=True)
    ]
    xp = array_module(flat)
    out = xp.concatenate(parts) if parts else xp.zeros(0, np.float32)
    clock.decoded()
    return out


def _up_all(dev, payloads: list) -> list:
    """Return host ``payloads`` on the device of ``dev``: one copy of them end to end,
    then a view per payload (as they are for host input)."""
    if dev is None or not payloads or not isinstance(payloads[0], np.ndarray):
        return payloads
    sizes = [p.size for p in payloads]
    whole = dev.xp.asarray(np.concatenate(payloads))
    ends = np.cumsum(sizes).tolist()
    return [whole[e - n : e] for n, e in zip(sizes, ends, strict=True)]


def _exchange(call: Call, collective, data, err):
    """Run a byte collective; a rank whose encode failed takes part with None."""
    try:
        return collective(call.comm, data, **call.io)
    except ValueError as e:
        if err is not None:
            raise err from None
        raise RankError(str(e)) from e


def _decode_mean(codec, payloads, n: int) -> np.ndarray:
    """Decode every payload (each must describe n elements) and average in rank order.

    The same on every rank. Sizes were agreed before the payloads moved, so one of
    another size is corrupt: PayloadError, checked before the decoder allocates.
    The codec's ``decode_sum`` adds them in order (FastSGD without decoding each into
    a dense array, FFT by one inverse transform of the summed spectra).
    """
    return codec.decode_sum(payloads, numel=n) / np.float32(len(payloads))


@dataclass(frozen=True)
class Hosts:
    """The communicators of the hierarchical schedules: ``node`` the ranks of this host,
    ``cross`` the ranks holding the same local rank on every host (one per host)."""

    node: object
    cross: object

    def free(self) -> None:
        self.node.Free()
        self.cross.Free()


# What a local rank's exchange between hosts ended with, the worst one decides.
_DONE, _SKIPPED, _FAILED = 0, 1, 2


def reduce_hierarchical(
    call: Call, codec, flat, encoders: Encoders | None, *, inner: str, hosts: Hosts
) -> np.ndarray:
    """Reduce within the host, compress between hosts, share within the host.

    After the agreement over every rank (NaN/Inf and sizes, as every path), the R ranks
    of a host sum their float32 gradients by one ``MPI_Reduce_scatter``: local rank i
    holds shard i of the host's sum. Local rank i then runs the compressed path
    ``inner`` (a key of ``REDUCERS``) on that shard with local rank i of every other
    host (``hosts.cross``): R exchanges between hosts at once, each of 1/R of the tensor.
    Their average over H hosts, times H/N, is the average over all N ranks; an
    ``MPI_Allgatherv`` within the host gives every rank the whole tensor.

    Raises:
        as every path; a host's sum that overflows float32 raises on every rank (RankError,
        or a skip under ``"skip_step"``), and a failure or skip in one exchange between
        hosts reaches every rank (one byte per rank within each host, before the
        allgather).
    """
    comm, clock, guard = call.comm, call.clock, call.guard
    dev = _device(flat)
    bad = not all_finite(flat, call.kernels)
    if bad and guard.policy == "zero":
        flat, bad = zero_nonfinite(flat), False
    clock.encoded()
    _agree(call, flat.size, guard.error() if bad else None, nonfinite=bad)
    node = hosts.node
    bounds = shard_bounds(flat.size, node.size)
    counts = [b - a for a, b in bounds]
    a, b = bounds[node.rank]
    src = _down(call, dev, flat, "hier.in")
    mine = array_module(src).empty(b - a, dtype=np.float32)
    plain.reduce_scatter(node, src, mine, counts, **call.io)
    # Finite inputs can still sum past float32 on a host: every rank must know before any
    # shard goes between hosts (one byte over all ranks), as the flat float32 sum does.
    overflowed = np.empty(1, dtype=np.int8)
    flag = np.array([not all_finite(mine, call.kernels)], dtype=np.int8)
    plain.allreduce(comm, flag, overflowed, MPI.MAX, **call.io)
    clock.communicated()
    if overflowed[0]:
        message = f"{codec.name}: the sum over a host's ranks overflows float32"
        if guard.policy == "skip_step":
            raise Skipped([], f"{guard.what}: {message}; call skipped")
        raise RankError(message)
    inner_call = replace(call, comm=hosts.cross, stream=node.rank * hosts.cross.size)
    status, error, avg = _DONE, None, None
    try:
        avg = REDUCERS[inner](inner_call, codec, _up(dev, mine), encoders)
    except Skipped as e:
        status, error = _SKIPPED, e
    except Exception as e:  # whatever it is, this host's other ranks must hear of it
        status, error = _FAILED, e
    # Each exchange between hosts ends alike on every host: the worst outcome within the
    # host is the same on every rank, and decides for all.
    worst = np.empty(1, dtype=np.int8)
    plain.allreduce(node, np.array([status], dtype=np.int8), worst, MPI.MAX, **call.io)
    if worst[0] == _FAILED:
        if status == _FAILED:
            raise error
        raise RankError("another rank of this host failed between hosts (see its error)")
    if worst[0] == _SKIPPED:
        raise error if status == _SKIPPED else Skipped([], f"{guard.what}: call skipped")
    # The mean over hosts of the hosts' sums, times H/N: the mean over all ranks.
    avg *= np.float32(hosts.cross.size / comm.size)
    part = _down(call, dev, avg, "hier.out")
    out = array_module(part).empty(flat.size, dtype=np.float32)
    plain.allgatherv(node, part, out, counts, **call.io)
    out = _up(dev, out)
    clock.communicated()
    return out


#: The reduction path of each aggregation kind; ``"sharded"`` is the gather kind through
#: shard owners (``CompressedComm(sharded=True)``).
REDUCERS: dict[str, Callable] = {
    "sum": reduce_sum,
    "integer_sum": reduce_integer,
    "majority": reduce_majority,
    "gather": reduce_gather,
    "sharded": reduce_sharded,
}
