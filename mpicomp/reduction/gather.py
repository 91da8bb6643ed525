"""The ``"gather"`` kind (3LC, top-k, FFT, FastSGD): variable-length byte payloads,
allgathered and decoded by every rank, or pushed to shard owners who average and
re-compress their shard for everyone to pull (``"sharded"``, 3LC's push/pull)."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from mpicomp.codecs.arrays import array_module, result_range, within_later
from mpicomp.collectives import plain
from mpicomp.collectives.agreement import RANK, Form, ranks_text, settle
from mpicomp.collectives.allgather import allgather_bytes
from mpicomp.collectives.sharded import alltoall_bytes, push_pull, shard_bounds
from mpicomp.errors import RankError
from mpicomp.kernels.readback import batch, value_of
from mpicomp.reduction._cost import Cost, gathered
from mpicomp.reduction._kind import Kind, Schedule
from mpicomp.reduction.agreement import (
    Call,
    agree,
    attempt,
    device,
    down,
    encode_here,
    flagged,
    raise_overflow,
    raise_result_overflow,
)
from mpicomp.reduction.hierarchy import PREFIX
from mpicomp.reduction.residuals import Encoding, GatherState, Residuals, Stateless
from mpicomp.reduction.rows import Rows, summed

# What row owners found (one byte per field and rank, gathered): ``scatter``.
_OWNERS = Form(failed=RANK, overflowed=RANK)


@runtime_checkable
class GatherCodec(Protocol):
    """``aggregation = "gather"``: variable-length byte payloads, allgathered (or pushed
    to shard owners); ``decode_sum`` adds decoded payloads in order (``GatherCodecBase``
    gives the plain one). ``fused_feedback``: ``encode(x, residual=r)`` updates the
    error-feedback residual in its own pass; ``feedback_default``: error feedback is on
    unless asked otherwise (the biased codecs)."""

    name: str
    aggregation: str
    fused_feedback: bool
    feedback_default: bool

    def encode(self, x) -> Any: ...

    def decode(self, payload, numel: int | None = None) -> Any: ...

    def decode_sum(self, payloads, numel: int) -> Any: ...


def allgather(call: Call, codec, flat):
    """Allgather every rank's payload; every rank decodes all and averages in rank order."""
    clock = call.clock
    dev = device(flat)
    residuals: GatherState = call.residuals
    payload, flat, err, bad = encode_here(call, residuals.encode, flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    try:
        payloads = allgather_bytes(call.comm, down(call, dev, payload, "payload"), **call.io)
    except ValueError as e:  # the sizes were agreed: a rank's payload is malformed
        raise RankError(str(e)) from e
    clock.communicated()
    out = _decode_mean(codec, _up_all(dev, payloads), flat.size)
    clock.decoded()
    return out


def sharded(call: Call, codec, flat):
    """3LC's push/pull (``collectives.sharded.push_pull``): shard s is averaged by rank s,
    compressed once more, pulled by all.

    ``call.residuals.push(shard, s)`` compresses this rank's shard s (worker residual s);
    ``call.residuals.pull(avg_shard)`` the owner's average (owner residual).
    """
    residuals: GatherState = call.residuals
    comm, clock = call.comm, call.clock
    dev = device(flat)
    bounds = shard_bounds(flat.size, comm.size)

    def push(f):
        return [residuals.push(f[a:b], s) for s, (a, b) in enumerate(bounds)]

    def average(received):
        """This rank as owner: average its shard's pushes, compress that once more."""
        received = _up_all(dev, received)
        clock.communicated()
        a, b = bounds[comm.rank]
        # Its average can still be refused (a corrupt push, a float32 sum that
        # overflowed): it then takes part in the pull with None, and every rank raises.
        # The pushes' checks are read here, not with the call's end: the refusal must
        # reach the pull.
        made, err = attempt(_reencoded, codec, residuals.pull, received, b - a, clock)
        pull, refused = made or (None, None)
        overflowed[0] = refused is not None
        return down(call, dev, pull, "pull"), err or refused

    overflowed = [False]
    pushed, flat, err, bad = encode_here(call, push, flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    if pushed is not None:
        pushed = _down_all(call, dev, pushed, "pushes")
    try:
        pulled = push_pull(comm, pushed, average, **call.io)
    except Exception:
        # Every rank raises when an owner failed; one byte per rank (on this path only)
        # tells them all whether it was an overflow, for one message and skip_step.
        if flagged(call, overflowed[0]):
            raise_overflow(call, codec, "the average of a shard over ranks")
        raise
    pulled = _up_all(dev, pulled)
    clock.communicated()
    # Sizes were agreed: a payload of another size is corrupt (PayloadError everywhere,
    # read with the call's end).
    parts = [codec.decode_flat(p, b - a) for p, (a, b) in zip(pulled, bounds, strict=True)]
    xp = array_module(flat)
    out = xp.concatenate(parts) if parts else xp.zeros(0, np.float32)
    clock.decoded()
    return out


def scatter(call: Call, codec, flat, mean: bool = True):
    """Return this rank's row (``reduction.rows``) of the average (``mean``) or sum over
    ranks: ``sharded``'s push alone. Row s of every rank is compressed (worker residual
    per row, ``call.residuals.push``) and sent to rank s, which decodes the N payloads
    and adds them in rank order.

    What an owner finds wrong (a corrupt payload, a sum that overflows float32 or the
    caller's dtype) reaches every rank in one byte per rank: the owner raises its error,
    the others RankError.
    """
    residuals: GatherState = call.residuals
    comm, clock = call.comm, call.clock
    dev = device(flat)
    rows = Rows.of(comm, flat.size)

    def push(f):
        return [residuals.push(f[a:b], s) for s, (a, b) in enumerate(rows.spans())]

    pushed, flat, err, bad = encode_here(call, push, flat)
    clock.encoded()
    agree(call, flat.size, err, nonfinite=bad)
    pushed = _down_all(call, dev, pushed, "pushes")
    try:
        received = alltoall_bytes(comm, pushed, **call.io)
    except ValueError as e:  # the sizes were agreed: a rank's payload is malformed
        raise RankError(str(e)) from e
    clock.communicated()
    a, b = rows.own
    limit = result_range(call.dtype).limit
    checked, error = attempt(
        _checked_mean, codec, _up_all(dev, received), b - a, mean, call.kernels, limit
    )
    row, fits = checked or (None, True)
    overflowed = not fits
    clock.decoded()
    outcome = _OWNERS.gathered(np.uint8, failed=error is not None, overflowed=overflowed)
    table = np.empty((comm.size, outcome.size), dtype=np.uint8)
    plain.allgather(comm, outcome, table, timeout=call.timeout)
    failed = _OWNERS.tally_rows(table)
    settle(
        failed.ranks("failed"),
        error,
        lambda r: RankError(f"{ranks_text(r)} could not decode its row (see its error)"),
    )
    if failed.ranks("overflowed"):
        raise_result_overflow(call, codec, summed(mean))
    return rows.fill(array_module(row), row)


def _down_all(call: Call, dev, payloads: list, slot: str) -> list:
    """Return what MPI is handed of device ``payloads`` (``down``): staged, one copy of
    them end to end into ``slot``'s host buffer, then a view per payload (one transfer,
    not one each); else the payloads themselves."""
    if dev is None or not payloads or call.transport is None or call.transport.direct:
        return [down(call, dev, p, slot) for p in payloads]
    sizes = [p.size for p in payloads]
    whole = down(call, dev, dev.xp.concatenate(payloads), slot)
    ends = np.cumsum(sizes).tolist()
    return [whole[e - n : e] for n, e in zip(sizes, ends, strict=True)]


def _up_all(dev, payloads: list) -> list:
    """Return host ``payloads`` on the device of ``dev``: one copy of them end to end,
    then a view per payload (as they are for host input)."""
    if dev is None or not payloads or not isinstance(payloads[0], np.ndarray):
        return payloads
    sizes = [p.size for p in payloads]
    whole = dev.xp.asarray(np.concatenate(payloads))
    ends = np.cumsum(sizes).tolist()
    return [whole[e - n : e] for n, e in zip(sizes, ends, strict=True)]


def _decode_mean(codec, payloads, n: int, mean: bool = True):
    """Decode every payload (each must describe n elements) and average in rank order.

    The same on every rank. Sizes were agreed before the payloads moved, so one of
    another size is corrupt: PayloadError, checked before the decoder allocates.
    The codec's ``decode_sum`` adds them in order (FastSGD without decoding each into
    a dense array, FFT by one inverse transform of the summed spectra).
    A float32 sum that overflows becomes Inf quietly, and what follows raises on every
    rank (``check_average``; a shard's owner refuses to encode it), where NumPy's
    warning, an exception under ``-W error``, could come on the owner alone.
    """
    gathered = getattr(codec, "decode_gathered", codec.decode_sum)
    with np.errstate(over="ignore", invalid="ignore"):
        total = gathered(payloads, n)
        return total / np.float32(len(payloads)) if mean else total


def _checked_mean(codec, payloads, n: int, mean: bool, kernels, limit: float):
    """Return (``_decode_mean``, whether every |value| is at most ``limit``, hence
    finite), its deferred checks and that answer read before it returns (one read)."""
    with batch("shard owner's decode"):
        out = _decode_mean(codec, payloads, n, mean)
        fits = within_later(out, limit, kernels)
    return out, value_of(fits)


def _reencoded(codec, encode, payloads, n: int, clock):
    """Return (``encode`` of the mean of ``payloads``, None), or (None, its refusal: the
    mean, or the mean with the owner's kept error, overflows float32).

    The pushes' checks travel with the encode's own read (one transfer) and raise, a
    corrupt push's PayloadError, before its result or refusal counts.
    """
    with batch("shard owner's pushes", shared=True):
        mine = _decode_mean(codec, payloads, n)
        clock.decoded()
        try:
            made = attempt(encode, mine)
        except Exception as e:  # a corrupt push's garbage can fail it any way: a refusal
            made = None, e
    clock.encoded()
    return made


def _decode_sum_seconds(codec, speed, numel: int, count: int) -> float:
    """Seconds to add ``count`` decoded payloads of ``numel`` elements (``decode_sum``):
    one decode for a codec that sums before decoding (FFT's spectra), else one each."""
    return speed.decode * numel * (1 if getattr(codec, "sums_before_decoding", False) else count)


def _allgather_cost(codec, numel: int, nranks: int, payload: int) -> Cost:
    return gathered("allgather", nranks, payload)


def _allgather_compute(codec, speed, numel: int, nranks: int) -> float:
    return speed.encode * numel + _decode_sum_seconds(codec, speed, numel, nranks)


def _sharded_cost(codec, numel: int, nranks: int, payload: int) -> Cost:
    return gathered("sharded", nranks, payload)


def _sharded_compute(codec, speed, numel: int, nranks: int) -> float:
    # Push every shard (one encode of n), the owner sums N pushes and encodes its
    # average, then every pulled shard is decoded (n in all).
    shard = -(-numel // nranks)
    return (
        speed.encode * (numel + shard)
        + _decode_sum_seconds(codec, speed, shard, nranks)
        + speed.decode * numel
    )


def _sharded_alltoall(codec, numel: int, nranks: int, payload: int) -> int:
    return -(-(nranks - 1) * payload // nranks)


def _state(codec, options):
    """Residuals when error feedback is on (owners' too where a sharded schedule may
    run), else the codec's plain encode."""
    if not options.error_feedback:
        return Stateless(Encoding(codec))
    may_shard = options.schedule in ("sharded", PREFIX + "sharded", "auto")
    return Residuals(codec, sharded=may_shard)


KIND = Kind(
    "gather",
    GatherCodec,
    {
        "allgather": Schedule(allgather, _allgather_cost, _allgather_compute, scatter=scatter),
        "sharded": Schedule(
            sharded, _sharded_cost, _sharded_compute, _sharded_alltoall, scatter=scatter
        ),
    },
    payload=True,
    feedback=True,
    state=_state,
)
