"""What a CompressedComm keeps per tensor across calls, and the part one call may move.

Each aggregation kind says what it keeps (``Kind.state``): nothing (``Stateless``); a
gather codec with error feedback, residuals (``Residuals``: it encodes
``x + residual`` and keeps what the payload failed to carry,
``mpicomp.codecs.ErrorFeedback``; the sharded schedule keeps one residual per (tensor,
shard) on every rank and one per tensor on the shard's owner); a low-rank codec, arrays
by name (``Memory``: PowerSGD's error and its factor Q). What a call may move is
snapshot when it starts: a call that fails or is skipped, or an optimizer step an
adapter rolls back, restores it, so it moves nothing on any rank.

Typed by protocols: what a CompressedComm keeps is a ``Kept``; what one call may move, a
``CallState``, which a gather kind reads as a ``GatherState`` and a low-rank kind as a
``LowRankState``.
"""

from __future__ import annotations

import operator
from typing import Protocol

from mpicomp.codecs import ErrorFeedback
from mpicomp.codecs.arrays import all_finite, as_gradient


class CallState(Protocol):
    """What one call may move of its tensor's state (``reduction.agreement.Call.residuals``);
    each kind reads it through its own protocol below."""

    def restore(self) -> None:
        """Put back what the call moved: it failed, was skipped or is rolled back."""


class GatherState(CallState, Protocol):
    """A gather codec's call: it encodes through these (``Encoding``), so error feedback,
    when on, adds and keeps the residuals."""

    def encode(self, flat): ...

    def push(self, shard, s: int): ...

    def pull(self, average): ...


class LowRankState(CallState, Protocol):
    """A low-rank codec's call: ``arrays`` it kept for the tensor (replaced, never written
    into) and whether it keeps its error (``feedback``); ``Remembered``."""

    arrays: dict
    feedback: bool


class Kept(Protocol):
    """What a CompressedComm keeps per tensor across calls (``Kind.state`` makes it):
    ``Stateless``, ``Residuals`` or ``Memory``."""

    named: bool  # whether calls need a tensor name

    def encoding(self, name: str, owners: int = 0, private: bool = False) -> CallState: ...

    def forget(self, name: str) -> None: ...

    def state_dict(self) -> tuple[dict, dict]: ...

    def load_state_dict(self, workers: dict, owners: dict) -> None: ...


class Encoding:
    """How one call compresses: ``encode(flat)`` for the allgather, ``push(shard, s)`` and
    ``pull(average)`` for the sharded schedule; ``restore()`` undoes what they moved."""

    def __init__(self, codec):
        self._codec = codec

    def encode(self, flat):
        return self._codec.encode(flat)

    def push(self, shard, s: int):
        return self._codec.encode(shard)

    def pull(self, average):
        return self._codec.encode(average)

    def restore(self) -> None:
        """Nothing to restore: no residual was read or written."""


#: What a call of a codec that encodes no payload carries (``reduction.agreement.Call``).
NO_RESIDUALS = Encoding(None)


class Stateless:
    """Nothing kept across calls: every call encodes as ``encoding`` (``NO_RESIDUALS``,
    or a gather codec's plain encode when error feedback is off)."""

    named = False  # calls need no tensor name

    def __init__(self, encoding: Encoding = NO_RESIDUALS):
        self._encoding = encoding

    def encoding(self, name: str, owners: int = 0, private: bool = False) -> Encoding:
        return self._encoding

    def forget(self, name: str) -> None:
        """Nothing to drop."""

    def state_dict(self) -> tuple[dict, dict]:
        return {}, {}

    def load_state_dict(self, workers: dict, owners: dict) -> None:
        """Nothing to restore."""


class _Fed(Encoding):
    """One call's encoding through error feedback, its residuals snapshot when made."""

    def __init__(self, residuals: Residuals, name: str, owners: int, private: bool = False):
        self._residuals = residuals
        self.name = name
        workers, server = residuals.workers, residuals.owners
        if owners:
            shards = [shard_key(name, s) for s in range(owners)]
            self._snapshots = [workers.snapshot(shards, private)]
            if server is not None:  # a reduce-scatter's rows have no owner residual
                self._snapshots.append(server.snapshot([name], private))
        else:
            self._snapshots = [workers.snapshot([name], private)]

    def encode(self, flat):
        return self._residuals.workers.encode(flat, self.name)

    def push(self, shard, s: int):
        return self._residuals.workers.encode(shard, shard_key(self.name, s))

    def pull(self, average):
        return self._residuals.owners.encode(average, self.name)

    def restore(self) -> None:
        """Put the residuals this call may have moved back as they were when it started."""
        for snapshot in self._snapshots:
            snapshot.restore()


#: What the residual keys of a tensor's shards and rows add to its name (``w#shard0``,
#: ``w#shard@0/2``, ``w#shards#shard1``): reserved, so that no tensor's own residual is
#: one of another tensor's (``mpicomp.call.intake.take`` refuses names holding it).
SHARD_MARK = "#shard"


def shard_key(name: str, shard: int) -> str:
    """Return the residual name of shard ``shard`` of tensor ``name`` (a worker's)."""
    return f"{name}{SHARD_MARK}{shard}"


class Residuals:
    """The residuals of one CompressedComm: ``workers`` per tensor (and per shard of
    the sharded schedule), ``owners`` per tensor a shard owner re-compresses (None when
    no sharded schedule can run)."""

    named = True  # one residual per tensor name

    def __init__(self, codec, sharded: bool):
        self._codec = codec
        self.workers = ErrorFeedback(codec)
        self.owners = ErrorFeedback(codec) if sharded else None

    def encoding(self, name: str, owners: int = 0, private: bool = False) -> Encoding:
        """Return how a call of tensor ``name`` encodes, its residuals snapshot now;
        ``owners``: the shard owners of a sharded call (0: not sharded); ``private``:
        snapshot into new buffers (an earlier snapshot of ``name`` is still needed)."""
        return _Fed(self, name, owners, private)

    def forget(self, name: str) -> None:
        """Drop the residuals of tensor ``name`` (and of its shards)."""
        for feedback in (self.workers, self.owners):
            if feedback is not None:
                feedback.forget(name)

    def state_dict(self) -> tuple[dict, dict]:
        """Return (workers', owners') residuals by name, copied, for a checkpoint."""
        return self.workers.state_dict(), self.owners.state_dict() if self.owners else {}

    def load_state_dict(self, workers: dict, owners: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self.workers.load_state_dict(workers)
        if self.owners is not None:
            self.owners.load_state_dict(owners)


class Remembered(Encoding):
    """The arrays one call of tensor ``name`` may change (``arrays``, a dict the call
    updates by putting new arrays in, never by writing into the old ones), as they were
    when the call started."""

    def __init__(self, memory: dict, name: str, feedback: bool):
        self.arrays = memory.setdefault(name, {})
        self.feedback = feedback  # whether the codec keeps its error (error feedback)
        self._before = dict(self.arrays)

    def restore(self) -> None:
        """Put the arrays back as they were when the call started."""
        self.arrays.clear()
        self.arrays.update(self._before)


class Memory:
    """Arrays kept per tensor name across calls (a low-rank codec's error and factors),
    as ``{name: {key: array}}``; checkpoints name them ``name#key``."""

    named = True

    def __init__(self, feedback: bool):
        self.feedback = feedback
        self._arrays: dict[str, dict] = {}

    def encoding(self, name: str, owners: int = 0, private: bool = False) -> Remembered:
        return Remembered(self._arrays, name, self.feedback)

    def forget(self, name: str) -> None:
        """Drop the arrays of tensor ``name``."""
        self._arrays.pop(name, None)

    def state_dict(self) -> tuple[dict, dict]:
        """Return ({``name#key``: a copy of the array}, {}) for a checkpoint."""
        flat = {f"{n}#{k}": a.copy() for n, kept in self._arrays.items() for k, a in kept.items()}
        return flat, {}

    def load_state_dict(self, workers: dict, owners: dict) -> None:
        """Restore what ``state_dict`` returned."""
        self._arrays = {}
        for key, array in workers.items():
            name, _, part = key.rpartition("#")
            self._arrays.setdefault(name, {})[part] = as_gradient(array, what=key).copy()


def rollback(encodings) -> None:
    """Restore the residuals of ``encodings`` (the calls of a failed, skipped or rolled-back
    step)."""
    # Latest first: a name moved twice in one step ends as it was before the first.
    for encoding in reversed(encodings):
        encoding.restore()


def check_state(state) -> tuple[int, dict, dict]:
    """Return (step, workers' residuals, owners' residuals) of a checkpoint ``state``
    (what ``CompressedComm.state_dict`` returned), every array converted and checked
    before anything is loaded: loading a state refused changes nothing.

    Raises:
        TypeError: not such a dict, a step that is not an integer, a residual that is
            not an array of real numbers.
        ValueError: a negative step; a residual holding NaN or Inf (named).
    """
    if not hasattr(state, "keys") or not {"step", "residuals", "server_residuals"} <= set(state):
        raise TypeError(
            "state must be what CompressedComm.state_dict() returned: a dict with 'step', "
            f"'residuals' and 'server_residuals', got {type(state).__name__}"
        )
    step = state["step"]
    try:  # an int, or what np.load gives back of one (a 0-d integer array)
        if isinstance(step, bool):
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"state['step'] must be an integer, got {step!r}") from None
    if step < 0:
        raise ValueError(f"state['step'] must be >= 0, got {step}")
    parts = []
    for key in ("residuals", "server_residuals"):
        arrays = state[key]
        if not hasattr(arrays, "items"):
            raise TypeError(f"state[{key!r}] must be a dict of arrays by name, got {arrays!r}")
        checked = {}
        for name, array in arrays.items():
            what = f"residual {name!r} of state[{key!r}]"
            r = as_gradient(array, what=what)
            if not all_finite(r):
                raise ValueError(
                    f"{what} holds NaN or Inf: the checkpoint is damaged (or was saved "
                    "after a non-finite gradient reached it); nothing was loaded"
                )
            checked[name] = r
        parts.append(checked)
    return int(step), parts[0], parts[1]
