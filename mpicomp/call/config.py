"""What ranks must agree on, and the message that names what differs on which ranks.

A ``Config`` is everything about a CompressedComm that changes what goes on the wire
(codec and its parameters, schedule, thresholds, policies): its 52-bit digest rides in
every call's agreement, so ranks configured differently raise there instead of sending
messages the others do not expect. The fields themselves travel only when digests
differ, to say which field differs and on which ranks.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from mpicomp.collectives._wait import issue_nonblocking, resolve_timeout
from mpicomp.errors import RankError


@dataclass(frozen=True)
class Config:
    """Named values all ranks must share; ``digest`` is a 52-bit hash of them (BLAKE2b:
    exact in the float64 agreement, where CRC-32 let different values collide), never 0."""

    fields: dict = field(default_factory=dict)

    @cached_property
    def digest(self) -> int:  # computed once: every call's agreement carries it
        digest = hashlib.blake2b(_canonical(self.fields), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 12 | 1

    def with_fields(self, **more) -> Config:
        return Config({**self.fields, **more})


def _canonical(fields) -> bytes:
    return json.dumps(_plain(fields), sort_keys=True, default=repr).encode()


def _plain(value):
    """Return ``value`` with what means the same written the same: NumPy scalars as
    Python numbers, integral floats as ints (``ratio=1`` is ``ratio=1.0``), tuples as
    lists."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def disagreement(comm, mine: dict | None, timeout: float | None) -> str:
    """Return, on every rank, what differs among the ranks' ``mine`` (collective: every
    rank's fields go to every rank; None for a rank with nothing to compare).

    E.g. ``"codec.bits: 8 on rank 0, 4 on ranks 1-2"``. ``timeout``: seconds or None,
    resolved (the same on every rank).
    """
    every = allgather_json(comm, mine, timeout)
    flat = [None if d is None else _flatten(d) for d in every]
    keys = list(dict.fromkeys(k for d in flat if d is not None for k in d))

    def sides(key: str) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(flat):
            if d is not None:
                value = json.dumps(d[key]) if key in d else "(not set)"
                groups.setdefault(value, []).append(rank)
        return groups

    # Where the codecs differ, their own parameters differ of course: left unsaid.
    renamed = [k.removesuffix("name") for k in keys if k.endswith(".name") and len(sides(k)) > 1]
    parts = []
    for key in keys:
        groups = sides(key)
        if len(groups) > 1 and (key.endswith(".name") or not key.startswith(tuple(renamed))):
            values = ", ".join(f"{_short(value)} on {ranks_text(r)}" for value, r in groups.items())
            parts.append(f"{key}: {values}")
    if not parts:  # digests differ where the fields agree: a rank refused to describe
        return "the configurations differ"
    # A list shifted by one tensor differs at every later index: the first say enough.
    more = f"; and {len(parts) - _PARTS} more" if len(parts) > _PARTS else ""
    return "; ".join(parts[:_PARTS]) + more + world_ranks(comm)


_PARTS = 6  # differing fields named in one message


def _short(value: str, limit: int = 120) -> str:
    return value if len(value) <= limit else value[: limit - 5] + " ...]"


def world_ranks(comm) -> str:
    """Return, for a communicator that is not the world (in order), how its ranks map to
    the world's ("" for the world or a duplicate of it): messages number ranks in
    ``comm``."""
    from mpi4py import MPI

    try:
        group, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        try:
            ranks = MPI.Group.Translate_ranks(group, list(range(comm.size)), world)
        finally:
            group.Free()
            world.Free()
    except Exception:  # a stand-in communicator (tests), or MPI gone
        return ""
    if list(ranks) == list(range(MPI.COMM_WORLD.size)):
        return ""
    shown = ", ".join(f"{r}->{w}" for r, w in enumerate(ranks[:16]))
    more = ", ..." if len(ranks) > 16 else ""
    return f" (ranks of this communicator; in MPI.COMM_WORLD: {shown}{more})"


def allgather_json(comm, mine, timeout: float | None) -> list:
    """Return every rank's ``mine`` (JSON; None travels as nothing), in rank order."""
    payload = np.frombuffer(_canonical(mine) if mine is not None else b"", dtype=np.uint8)
    sizes = np.empty(comm.size, dtype=np.int64)
    _gather(comm, [np.array([payload.size], np.int64), sizes], timeout, "sizes")
    ends = np.cumsum(sizes)
    whole = np.empty(int(ends[-1]), dtype=np.uint8)
    _gather(comm, [payload, [whole, (sizes, ends - sizes)]], timeout, "descriptions", v=True)
    return [
        json.loads(bytes(whole[e - n : e])) if n else None for n, e in zip(sizes, ends, strict=True)
    ]


def check_same(
    comm, config: Config | None, error: BaseException | None, what: str, timeout, differences=None
):
    """Raise on every rank if some rank failed (``error``) or the configurations differ.

    Collective on ``comm``: one Allgather of two int64 per rank; the fields travel only
    when digests differ. The rank that failed raises its own error, the others RankError.
    ``differences(timeout)``: what the message says differs (collective; default: the
    fields of ``config`` that differ, ``disagreement``).
    """
    try:
        timeout = resolve_timeout(timeout)
    except (TypeError, ValueError) as e:  # a bad MPICOMP_TIMEOUT: still take part
        error, timeout = error or e, None
    digest = 0
    if error is None and config is not None:
        try:
            digest = config.digest
        except Exception as e:  # a codec parameter JSON cannot write: still take part
            error = e
    mine = np.array([error is not None, digest], np.int64)
    every = np.empty((comm.size, 2), dtype=np.int64)
    _gather(comm, [mine, every], timeout, "configuration digests")
    failed = np.flatnonzero(every[:, 0]).tolist()
    if failed:
        why = None if error is None else f"{type(error).__name__}: {error}"
        first = allgather_json(comm, why, timeout)[failed[0]]
        if error is not None:
            raise error
        raise RankError(f"{ranks_text(failed)} failed making {what}: {first}{world_ranks(comm)}")
    if (every[:, 1] != every[0, 1]).any():
        if differences is None:
            differs = disagreement(comm, config.fields, timeout)
        else:
            differs = differences(timeout)
        raise RankError(f"ranks configured {what} differently: {differs}")


def _gather(comm, args: list, timeout, what: str, v: bool = False) -> None:
    """``MPI_Iallgather`` (``MPI_Iallgatherv`` with ``v``) waited on (with ``timeout`` if
    set): nonblocking whatever the timeout, because a blocking collective never matches
    a nonblocking one, and ranks may differ in their timeout here."""
    from mpi4py import MPI

    call = MPI.Comm.Iallgatherv if v else MPI.Comm.Iallgather
    detail = f"an {call.__name__} of {what} from each of {comm.size} ranks"
    issue_nonblocking(comm, call, *args, timeout=timeout, name="check_same", detail=detail)


def ranks_text(ranks: list[int]) -> str:
    """Return ``"rank 3"`` or ``"ranks 0-2, 5"``."""
    runs, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            runs.append(str(start) if start == r else f"{start}-{r}")
            start = None
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
