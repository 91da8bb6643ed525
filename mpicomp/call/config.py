"""What ranks must agree on, and the check every rank takes part in when it is made.

A ``Config`` is everything about a CompressedComm that changes what goes on the wire
(codec and its parameters, schedule, thresholds, policies): its 52-bit digest rides in
every call's agreement, so ranks configured differently raise there instead of sending
messages the others do not expect. The fields themselves travel only when digests
differ, to say which field differs and on which ranks (``agreement.disagreement``).
``check_same`` is that agreement when a CompressedComm (or an adapter's object) is made.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property

from mpicomp.collectives._wait import resolve_timeout
from mpicomp.collectives.agreement import (
    RANK,
    SAME,
    Form,
    allgather_json,
    canonical,
    disagreement,
    gather_rows,
    ranks_text,
    settle,
    world_ranks,
)
from mpicomp.errors import RankError


@dataclass(frozen=True)
class Config:
    """Named values all ranks must share; ``digest`` is a 52-bit hash of them (BLAKE2b:
    exact in the float64 agreement, where CRC-32 let different values collide), never 0."""

    fields: dict = field(default_factory=dict)

    @cached_property
    def digest(self) -> int:  # computed once: every call's agreement carries it
        digest = hashlib.blake2b(canonical(self.fields), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 12 | 1

    def with_fields(self, **more) -> Config:
        return Config({**self.fields, **more})


# Each rank's row of the check when an object is made (one Iallgather of two int64 per
# rank, so every rank that failed is named); a rank that failed brings no digest.
_MADE = Form(failed=RANK, config=SAME)


def check_same(
    comm,
    config: Config | None,
    error: BaseException | None,
    what: str,
    timeout,
    differences=None,
    failure=None,
):
    """Raise on every rank if some rank failed (``error``) or the configurations differ.

    Collective on ``comm``: one Allgather of two int64 per rank; the fields travel only
    when digests differ. The rank that failed raises its own error, the others RankError
    naming the ranks that failed and the first one's error: ``failure(ranks)`` begins
    the message (default "rank k failed making {what}"). ``config`` None: nothing to
    compare. ``differences(timeout)``: what the message says differs (collective;
    default: the fields of ``config`` that differ, ``disagreement``).
    """
    try:
        timeout = resolve_timeout(timeout)
    except (TypeError, ValueError) as e:  # a bad MPICOMP_TIMEOUT: still take part
        error, timeout = error or e, None
    digest = None
    if error is None and config is not None:
        try:
            digest = config.digest
        except Exception as e:  # a codec parameter JSON cannot write: still take part
            error = e
    row = _MADE.gathered(failed=error is not None, config=digest)
    tally = _MADE.tally_rows(gather_rows(comm, row, timeout, "configuration digests"))
    if failed := tally.ranks("failed"):
        why = None if error is None else f"{type(error).__name__}: {error}"
        first = allgather_json(comm, why, timeout)[failed[0]]
        said = f"{ranks_text(failed)} failed making {what}" if failure is None else failure(failed)
        settle(failed, error, lambda r: RankError(f"{said}: {first}{world_ranks(comm)}"))
    if not tally.agrees("config"):
        if differences is None:
            differs = disagreement(comm, config.fields, timeout)
        else:
            differs = differences(timeout)
        raise RankError(f"ranks configured {what} differently: {differs}")
