"""What every reduction shares: the call's context and the agreement it begins with.

Every path starts with an *agreement*: one small message in which each rank says
how many elements it brings and whether its local encode failed (its ballot,
``_CALL``: ``mpicomp.collectives.agreement``). Ranks that disagree or fail make every
rank raise the same error before any bulk data moves, so a bad tensor on one rank
never leaves the others waiting.

A ``Call`` carries what every message of one call shares: the communicator, the step,
the recorder, the NaN/Inf policy, the timeout, the residuals, and a phase clock
(``reduction.clock.NO_CLOCK`` when untraced): ``clock.encoded()``,
``clock.communicated()`` and ``clock.decoded()`` charge the time since the previous
mark to local compression work, to messages (collectives with their own packing, and
waiting for other ranks), and to decoding and averaging.

A gradient on a device (a CuPy array) is encoded and decoded there. What goes to MPI
(wire arrays, codes, votes, payloads) is handed over by ``down``: with a CUDA-aware MPI
the device arrays themselves (the collectives run on the device and synchronize it
before each MPI call), else copies in the call's staging buffers on the host, the
collectives then running on the host as for NumPy input; ``up`` brings host results
back to the device before it decodes them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from mpicomp.codecs.arrays import (
    CAUSES,
    FLOAT64,
    NONFINITE,
    Unencodable,
    all_finite,
    cause_code,
    is_device_array,
    result_range,
    within_later,
    zero_nonfinite,
)
from mpicomp.collectives import plain
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.collectives.agreement import (
    RANK,
    SAME,
    TOP,
    Form,
    disagreement,
    ranks_text,
    settle,
    world_ranks,
)
from mpicomp.collectives.bounded import Chunks
from mpicomp.collectives.maxallreduce import max_allreduce
from mpicomp.errors import PeerClosed, RankError
from mpicomp.kernels import backend_of
from mpicomp.kernels.readback import when
from mpicomp.reduction.clock import NO_CLOCK, Clock
from mpicomp.reduction.residuals import NO_RESIDUALS, CallState
from mpicomp.reduction.transport import Transport

POLICIES = ("raise", "skip_step", "zero")


class Configured(Protocol):
    """What every rank's configuration must match (``mpicomp.call.config.Config``): its
    ``digest`` joins each call's agreement, its ``fields`` name what differs."""

    @property
    def digest(self) -> int: ...

    @property
    def fields(self) -> dict: ...


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
    range became Inf in the conversion.
    """

    policy: str = "raise"
    what: str = "gradient"
    overflowed: bool = False

    @property
    def cause(self) -> int:
        """The number (``cause_code``) of this rank's NaN/Inf, as the other ranks hear it."""
        return cause_code(FLOAT64 if self.overflowed else NONFINITE)

    def error(self, cause: Exception | None = None) -> ValueError:
        """Return the ValueError the rank holding NaN/Inf raises under ``"raise"``, or,
        for a ``cause`` that is ``Unencodable``, the rank whose finite input its codec
        cannot encode (naming why)."""
        if isinstance(cause, Unencodable):
            return Unencodable(f"{self.what} holds {cause.cause}: {cause}", cause.cause)
        why = FLOAT64 if self.overflowed else NONFINITE
        extra = f" ({cause})" if cause is not None and not self.overflowed else ""
        return ValueError(f"{self.what} holds {why}{extra}")


RAISE = Guard()


@dataclass(frozen=True)
class Call:
    """What every message of one CompressedComm call shares.

    ``step`` drives the counter-based random draws; ``recorder`` gets the collectives'
    exchange steps and ``clock`` the phase marks (``NO_CLOCK`` when untraced);
    ``description`` is everything else the call's bytes depend on that every rank must
    bring alike (op, tensor names, member sizes, shapes where the codec reads them,
    step; ``describe``), ``digest`` its 64-bit hash the agreement compares; ``guard`` the NaN/Inf
    policy; ``timeout`` each wait's limit in seconds (None: ``MPICOMP_TIMEOUT``);
    ``kernels`` the kernel backend of NumPy arrays (None: ``mpicomp.kernels.backend()``);
    ``transport`` how device bytes reach MPI (``mpicomp.reduction.transport``; needed for device
    input); ``residuals`` what of the CompressedComm's per-tensor state the call may
    update (``mpicomp.reduction.residuals``; a gather codec encodes through them); ``shapes``
    the shapes of the tensors the flat input holds end to end; ``stream`` is added to the rank to number this rank's
    random draws (a hierarchical call's local ranks draw apart on their shards);
    ``config`` what every rank's configuration must match (its digest joins the
    agreement; None: nothing to compare); ``label`` names the tensor or bucket where ranks disagree;
    ``dtype`` the caller's dtype (a name), which the result must not overflow
    (``arrays.result_range``; a fused bucket of mixed dtypes checks float32's).
    """

    comm: object
    step: int = 0
    recorder: object = None
    clock: Clock = NO_CLOCK
    description: dict = field(default_factory=dict)
    digest: int = 0
    guard: Guard = RAISE
    timeout: float | None = None
    kernels: object = None
    transport: Transport | None = None
    residuals: CallState = NO_RESIDUALS
    shapes: tuple = ()
    stream: int = 0
    config: Configured | None = None
    label: str = ""
    dtype: str = "float32"

    @property
    def io(self) -> dict:
        """Return the keyword arguments every collective of this call takes."""
        return {"recorder": self.recorder, "timeout": self.timeout}


def device(a):
    """Return the backend record of device array ``a``; None for a host array."""
    return backend_of(a) if is_device_array(a) else None


def down(call: Call, dev, a, slot: str):
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


def down_by_chunks(call: Call, dev, a, slot: str, chunk: int | None = None):
    """Return (what MPI is handed of 1-D ``a``, ``ready`` for a bounded collective's
    ``ready=``): as ``down``, but a staged copy comes down chunk by chunk of the bounded
    schedules' layout (``Chunks``; ``chunk`` elements each, default theirs) in the order
    they read it, so the first chunk's MPI overlaps the copies of the others; ``ready``
    is None where nothing is staged."""
    if dev is None or a is None or isinstance(a, np.ndarray) or call.transport is None:
        return down(call, dev, a, slot), None  # (down says what a transport is missing)
    if call.transport.direct:
        return a, None
    spans = Chunks.of(call.comm, a.size, chunk).read_order()
    staged = call.transport.down_in_order(dev, a, slot, spans)
    return staged.host, staged.ready


def landing(call: Call, dev, slot: str):
    """Return where a bounded collective's packed result lands (its ``into=``): staged,
    a ``Landing`` that copies each chunk up as the allgather completes it, read back
    with ``landed``; None where nothing is staged (``up`` then does)."""
    if dev is None or call.transport is None or call.transport.direct:
        return None
    return call.transport.landing(dev, slot)


def landed(into, dev, a):
    """Return the device copy of a bounded collective's result ``a``: ``into``'s, else
    ``up``'s."""
    return up(dev, a) if into is None else into.result()


def up(dev, a):
    """Return what a collective gave back on the device of ``dev`` (a host result is
    copied there; a device one, or any result for host input, stays as it is)."""
    return a if dev is None or not isinstance(a, np.ndarray) else dev.xp.asarray(a)


def describe(description: dict) -> int:
    """Return the 64-bit digest of a call's ``description`` (a dict of JSON values):
    equal descriptions give equal digests on every rank and machine, and two different
    ones collide with probability 2^-64 (CRC-32 let names such as "plumless" and
    "buckeroo" pass for each other)."""
    text = json.dumps(description, sort_keys=True, separators=(",", ":")).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


# Every call's ballot: 13 float64 (exact for n, each 32-bit half of the call's digest
# and the 52-bit configuration digest), the payload of one MaxAllReduce that its head
# carries whole (docs/trace-format.md counts that message).
_CALL = Form(
    value=TOP,
    numel=SAME,
    call_high=SAME,
    call_low=SAME,
    config=SAME,
    failed=RANK,
    nonfinite=RANK,
    closing=RANK,
    calling=RANK,
)


def agree(
    call: Call,
    n: int | None,
    error: Exception | None,
    value: float = 0.0,
    nonfinite: int = 0,
    closing: bool = False,
) -> float:
    """Check that all ranks bring n elements in the same call and configuration, and
    that none failed or is closing the CompressedComm.

    One MaxAllReduce of the ballot ``_CALL``: [value, n, -n, digest_high, -digest_high,
    digest_low, -digest_low, config, -config, failed_rank + 1, nonfinite_rank + 1,
    closing_rank + 1, calling_rank + 1] (13 values fit the MaxAllReduce's one-message
    head); ``n`` None: this rank's input was refused and has no size to compare.
    Returns the max of ``value`` over ranks; for a rank closing, 1.0 if some rank
    called and 0.0 if every rank closes. A rank closing (``agree_close``) makes every
    rank that called raise PeerClosed. Ranks that bring different sizes all raise
    RankError naming them, whatever failed; then a failure raises the local error on
    the rank that failed and RankError elsewhere (a failure other than NaN/Inf wins).
    Ranks that disagree all raise RankError naming what differs and on which ranks
    (only then do descriptions travel). When only NaN/Inf or input a codec cannot
    encode failed (``nonfinite``: this rank's cause number, ``cause_code``; True for
    NaN/Inf), one more small Allgather names every such rank and its cause, and under
    ``skip_step`` every rank raises ``Skipped``.
    """
    comm, config = call.comm, call.config
    high, low = divmod(call.digest, 1 << 32)
    ballot = _CALL.reduced(
        comm.rank,
        comm.size,
        np.float64,
        value=value,
        numel=n,
        call_high=high,
        call_low=low,
        config=0 if config is None else config.digest,
        failed=error is not None and not nonfinite,
        nonfinite=nonfinite,
        closing=closing,
        calling=not closing,
    )
    tally = _CALL.tally(max_allreduce(comm, ballot, **call.io), comm.size)
    if closer := tally.ranks("closing"):  # a rank is closing: no call runs
        if closing:
            return float(bool(tally.ranks("calling")))
        raise PeerClosed(
            f"{ranks_text(closer)} closed this CompressedComm while this "
            f"rank called it; it is closed on this rank too{world_ranks(comm)}"
        ) from error
    # Sizes first, among the ranks that brought one (a refused input brings none): a rank
    # whose size changed is named as such everywhere, also where the change failed its
    # encode (an error-feedback residual of the old size). The schedule in the
    # configuration can follow from the size.
    if not tally.agrees("numel"):
        _differ(call, n, "the tensor size", error)
    settle(
        tally.ranks("failed"),
        error,
        lambda r: RankError(
            f"{ranks_text(r)} failed in the same call (see its error){world_ranks(comm)}"
        ),
    )
    if not (tally.agrees("call_high") and tally.agrees("call_low")):
        _differ(call, n, "the tensor (names, sizes, shapes, buckets or step)", error)
    if not tally.agrees("config"):
        differs = disagreement(comm, config.fields, resolve_timeout(call.timeout))
        raise RankError(f"ranks configured this CompressedComm differently: {differs}")
    if tally.ranks("nonfinite"):
        raise_nonfinite(causes(call, nonfinite), nonfinite, call.guard, error, call.comm)
    return tally.top("value")


def _differ(call: Call, n: int | None, what: str, error: Exception | None) -> None:
    """Raise, on every rank, the RankError naming how the ranks' calls differ in ``what``
    (collective: every rank's description travels; none from a rank whose input was
    refused, which raises it from its own error)."""
    mine = None if n is None else {"numel": n, **call.description}
    differs = disagreement(call.comm, mine, resolve_timeout(call.timeout))
    raise RankError(f"ranks disagree on {what} in the same call: {differs}") from error


def causes(call: Call, cause: int) -> list[int]:
    """Return every rank's ``cause``, a number below 256 (one byte per rank, Allgather;
    untraced)."""
    every = np.empty(call.comm.size, dtype=np.uint8)
    plain.allgather(call.comm, np.array([cause], np.uint8), every, timeout=call.timeout)
    return every.tolist()


def flagged(call: Call, flag: bool) -> list[int]:
    """Return the ranks whose ``flag`` is set (``causes``)."""
    return [r for r, raised in enumerate(causes(call, int(bool(flag)))) if raised]


def raise_nonfinite(
    every: list[int], local: int, guard: Guard, error: Exception | None, comm=None
) -> None:
    """Raise, on every rank, what the policy makes of the inputs refused for NaN/Inf or
    as ``Unencodable``: ``every`` holds each rank's cause number (``cause_code``; 0: its
    input was fine), ``local`` this rank's. Nothing can zero an unencodable input:
    ``"zero"`` raises it as ``"raise"`` does."""
    ranks = [r for r, code in enumerate(every) if code]
    said = "; ".join(
        f"rank(s) {', '.join(str(r) for r in ranks if every[r] == code)}: "
        f"{guard.what} holds {CAUSES[code - 1]}"
        for code in sorted(set(every) - {0})
    ) + (world_ranks(comm) if comm is not None else "")
    if guard.policy == "skip_step":
        raise Skipped(ranks, f"{said}; call skipped")
    if local:
        raise error if error is not None else guard.error()
    raise RankError(f"{said} in the same call")


def encode_here(call: Call, fn, flat):
    """Run this rank's encode ``fn(flat)``; return (result, flat used, error, cause).

    ``cause`` is 0, or the number (``cause_code``) of why the input was refused: NaN/Inf,
    or finite values ``fn`` cannot encode (``Unencodable``), which the agreement treats
    by the NaN/Inf policy. Only when ``fn`` refuses the input does one extra pass tell
    NaN/Inf from other errors; under ``"zero"`` the NaN/Inf are then zeroed (a copy) and
    ``fn`` runs again.
    """
    out, err = attempt(fn, flat)
    if err is not None and not all_finite(flat):
        if call.guard.policy != "zero":
            return None, flat, call.guard.error(err), call.guard.cause
        call.residuals.restore()  # a partial encode may have moved residuals
        flat = zero_nonfinite(flat)
        out, err = attempt(fn, flat)
    if isinstance(err, Unencodable):
        return None, flat, call.guard.error(err), err.code
    return out, flat, err, 0


def agree_close(call: Call) -> bool:
    """Take part, as a rank closing its CompressedComm, in the agreement that every call
    begins with; return True if every rank is closing, False if some rank called (it
    raises PeerClosed instead of waiting for this rank forever)."""
    return not agree(call, 0, None, closing=True)


def fail(call: Call, error: Exception) -> None:
    """Take part in a call's agreement as the rank whose input was refused; raise ``error``.

    Every path begins with the same agreement message, so the other ranks, whichever
    path they took, receive the failure there and raise RankError. A refused input has
    no size: this rank leaves the agreement's size comparison to the others.
    """
    agree(call, None, error)


def check_average(call: Call, codec, avg) -> None:
    """Raise on every rank when a codec made an average of finite inputs that is not
    finite (its float32 scale or sum overflowed) or that the caller's dtype
    (``call.dtype``) cannot hold: the average is the same bits on every rank, so each
    rank's own pass over it (the same ``min`` and ``max`` either way) decides alike,
    with no message. Under ``"skip_step"`` the call is skipped instead. ``none``'s and
    fp16's sums check themselves (``float_sum``), and their average never exceeds the
    largest |x|, which the caller's dtype holds."""
    if codec.aggregation == "sum":
        return
    when(
        within_later(avg, result_range(call.dtype).limit, call.kernels),
        lambda fits: fits or raise_result_overflow(call, codec, "the average over ranks"),
    )


def raise_overflow(
    call: Call, codec, what: str, msg: str | None = None, dtype: str = "float32"
) -> None:
    """Raise, on every rank, what finite inputs whose ``what`` overflows ``dtype`` (in
    the codec's arithmetic: float32, or fp16's float16 wire) get: RankError, or
    ``Skipped`` under ``"skip_step"``, naming the tensor; ``msg`` says it (default: the
    codec's name, ``what`` and what to do)."""
    if msg is None:
        other = " or use codec 'none'" if codec.compresses else ""
        msg = (
            f"{codec.name}: {what} overflows {dtype} although every input was finite "
            f"(values near {dtype}'s limit, {result_range(dtype).largest}); scale the "
            f"gradients down (e.g. a loss scale){other}"
        )
    if call.guard.policy == "skip_step":
        raise Skipped([], f"{call.guard.what}: {msg}; call skipped")
    raise RankError(f"{call.guard.what}: {msg}")


def raise_result_overflow(call: Call, codec, what: str) -> None:
    """``raise_overflow`` for a result ``what`` (of finite inputs) that is Inf, or that the
    caller's dtype (``call.dtype``) cannot hold."""
    held, msg = result_range(call.dtype), None
    if held.dtype != "float32":  # the caller's dtype: codec 'none' would not help
        msg = (
            f"{codec.name}: {what} overflows {held.dtype}, the dtype it is returned in "
            f"(largest {held.largest}), although every input was finite; scale the "
            "gradients down (e.g. a loss scale) or pass them in float32"
        )
    raise_overflow(call, codec, what, msg)


def attempt(fn, *args, **kwargs):
    """Return (fn(...), None), or (None, error) for a ValueError/TypeError of local input."""
    try:
        return fn(*args, **kwargs), None
    except (ValueError, TypeError) as e:
        return None, e
