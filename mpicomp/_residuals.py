"""Error-feedback residuals of one CompressedComm, and the part of them one call may move.

A gather codec with error feedback encodes ``x + residual`` and keeps what the payload
failed to carry (``mpicomp.codecs.ErrorFeedback``). The sharded schedule keeps one
residual per (tensor, shard) on every rank and one per tensor on the shard's owner.
A call's residuals are snapshot when it starts: a call that fails or is skipped, or an
optimizer step an adapter rolls back, restores them, so it moves no residual on any rank.
"""

from __future__ import annotations

from mpicomp.codecs import ErrorFeedback


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


class _Fed(Encoding):
    """One call's encoding through error feedback, its residuals snapshot when made."""

    def __init__(self, residuals: Residuals, name: str, owners: int):
        self._residuals = residuals
        self._name = name
        workers, server = residuals.workers, residuals.owners
        if owners:
            shards = [shard_key(name, s) for s in range(owners)]
            self._snapshots = [workers.snapshot(shards), server.snapshot([name])]
        else:
            self._snapshots = [workers.snapshot([name])]

    def encode(self, flat):
        return self._residuals.workers.encode(flat, self._name)

    def push(self, shard, s: int):
        return self._residuals.workers.encode(shard, shard_key(self._name, s))

    def pull(self, average):
        return self._residuals.owners.encode(average, self._name)

    def restore(self) -> None:
        """Put the residuals this call may have moved back as they were when it started."""
        for snapshot in self._snapshots:
            snapshot.restore()


def shard_key(name: str, shard: int) -> str:
    """Return the residual name of shard ``shard`` of tensor ``name`` (a worker's)."""
    return f"{name}#shard{shard}"


class Residuals:
    """The residuals of one CompressedComm: ``workers`` per tensor (and per shard of
    the sharded schedule), ``owners`` per tensor a shard owner re-compresses (None when
    no sharded schedule can run)."""

    def __init__(self, codec, sharded: bool):
        self._codec = codec
        self.workers = ErrorFeedback(codec)
        self.owners = ErrorFeedback(codec) if sharded else None

    def encoding(self, name: str, owners: int = 0) -> Encoding:
        """Return how a call of tensor ``name`` encodes, its residuals snapshot now;
        ``owners``: the shard owners of a sharded call (0: not sharded)."""
        return _Fed(self, name, owners)

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


def rollback(encodings) -> None:
    """Restore the residuals of ``encodings`` (the calls of a failed, skipped or rolled-back
    step)."""
    for encoding in encodings:
        encoding.restore()
