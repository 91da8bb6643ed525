"""What ranks must agree on, and the message that names what differs on which ranks.

A ``Config`` is everything about a CompressedComm that changes what goes on the wire
(codec and its parameters, schedule, thresholds, policies): its 32-bit digest rides in
every call's agreement, so ranks configured differently raise there instead of sending
messages the others do not expect. The fields themselves travel only when digests
differ, to say which field differs and on which ranks.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass, field

import numpy as np

from mpicomp.collectives._wait import resolve_timeout, wait_all
from mpicomp.errors import RankError


@dataclass(frozen=True)
class Config:
    """Named values all ranks must share; ``digest`` is a 32-bit hash of them (exact in
    the float64 agreement), never 0."""

    fields: dict = field(default_factory=dict)

    @property
    def digest(self) -> int:
        return zlib.crc32(_canonical(self.fields)) | 1

    def with_fields(self, **more) -> Config:
        return Config({**self.fields, **more})


def _canonical(fields: dict) -> bytes:
    return json.dumps(fields, sort_keys=True, default=_plain).encode()


def _plain(value):
    """JSON for what json does not know: NumPy scalars as their Python values (3 and
    np.int64(3) are the same configuration), anything else by repr."""
    return value.item() if isinstance(value, np.generic) else repr(value)


def disagreement(comm, mine: dict | None, timeout: float | None) -> str:
    """Return, on every rank, what differs among the ranks' ``mine`` (collective: every
    rank's fields go to every rank; None for a rank with nothing to compare).

    E.g. ``"codec.bits: 8 on rank 0, 4 on ranks 1-2"``.
    """
    every = _allgather_json(comm, mine, timeout)
    flat = [None if d is None else _flatten(d) for d in every]
    keys = list(dict.fromkeys(k for d in flat if d is not None for k in d))
    parts, renamed = [], []
    for key in keys:
        if any(key.startswith(prefix) for prefix in renamed):
            continue  # another codec: its own parameters differ of course
        groups: dict[str, list[int]] = {}
        for rank, d in enumerate(flat):
            if d is not None:
                groups.setdefault(json.dumps(d.get(key, "(not set)")), []).append(rank)
        if len(groups) > 1:
            sides = ", ".join(f"{value} on {ranks_text(r)}" for value, r in groups.items())
            parts.append(f"{key}: {sides}")
            if key.endswith(".name"):
                renamed.append(key.removesuffix("name"))
    return "; ".join(parts) or "the configurations differ"


def _allgather_json(comm, mine, timeout: float | None) -> list:
    """Return every rank's ``mine`` (JSON; None travels as nothing), in rank order."""
    payload = np.frombuffer(_canonical(mine) if mine is not None else b"", dtype=np.uint8)
    sizes = np.empty(comm.size, dtype=np.int64)
    _gather(comm, [np.array([payload.size], np.int64), sizes], timeout, "sizes")
    ends = np.cumsum(sizes)
    whole = np.empty(int(ends[-1]), dtype=np.uint8)
    _gather(comm, [payload, [whole, (sizes, ends - sizes)]], timeout, "descriptions", "v")
    return [
        json.loads(bytes(whole[e - n : e])) if n else None for n, e in zip(sizes, ends, strict=True)
    ]


def check_same(comm, config: Config | None, error: BaseException | None, what: str, timeout):
    """Raise on every rank if some rank failed (``error``) or the configurations differ.

    Collective on ``comm``: one Allgather of two int64 per rank; the fields travel only
    when digests differ. The rank that failed raises its own error, the others RankError.
    """
    mine = np.array([error is not None, 0 if config is None else config.digest], np.int64)
    every = np.empty((comm.size, 2), dtype=np.int64)
    _gather(comm, [mine, every], timeout, "configuration digests")
    failed = np.flatnonzero(every[:, 0]).tolist()
    if failed:
        why = None if error is None else f"{type(error).__name__}: {error}"
        first = _allgather_json(comm, why, timeout)[failed[0]]
        if error is not None:
            raise error
        raise RankError(f"{ranks_text(failed)} failed making {what}: {first}")
    if (every[:, 1] != every[0, 1]).any():
        differs = disagreement(comm, config.fields, timeout)
        raise RankError(f"ranks configured {what} differently: {differs}")


def _gather(comm, args: list, timeout, what: str, v: str = "") -> None:
    """``MPI_Iallgather[v]`` waited on (with ``timeout`` if set): nonblocking whatever the
    timeout, because a blocking collective never matches a nonblocking one, and ranks
    may differ in their timeout here."""
    request = getattr(comm, "Iallgather" + v)(*args)
    detail = f"an Iallgather{v} of {what} from each of {comm.size} ranks"
    wait_all(comm, [request], resolve_timeout(timeout), "check_same", detail)


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
