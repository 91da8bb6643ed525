"""The debug check that every rank makes the same call (``CompressedComm(debug=True)``).

MPI matches collectives by order alone: a rank that averages ``"fc.weight"`` while
another averages ``"fc.bias"`` of the same size mixes them silently, and the size
agreement of the reduce paths cannot see it. With the check on, each call costs one
more 8-byte Allgather of a hash of its description (each rank's row of ``_SAME_CALL``),
and ranks that differ are named.
"""

from __future__ import annotations

import hashlib

import numpy as np

from mpicomp.collectives import plain
from mpicomp.collectives._wait import resolve_timeout
from mpicomp.collectives.agreement import SAME, Form, allgather_json
from mpicomp.errors import PeerClosed, RankError

#: The description a rank closing its CompressedComm takes part with.
CLOSING = "close()"

# A hash of the call and configuration; a rank that refused its input brings none (0,
# the identity of uint64): it is left out, the agreement that follows reports it.
_SAME_CALL = Form(call=SAME)


def check_same_call(comm, call: str | None, config: str, timeout: float | None) -> None:
    """Raise RankError on every rank unless all ranks describe the same call.

    Args:
        comm: the communicator (one Allgather of 8 bytes per rank; the descriptions
            themselves travel only when hashes differ).
        call: this rank's call, e.g. ``"allreduce('w', 4096 float32)"``; None when this
            rank refused its input: it is left out, the agreement that follows
            reports it.
        config: what else must match (codec, policy), named only where it differs.
        timeout: each wait's limit in seconds (None: ``MPICOMP_TIMEOUT``).
    """
    desc = None if call is None else f"{call}\n{config}"
    h = None
    if desc is not None:
        h = int.from_bytes(hashlib.blake2b(desc.encode(), digest_size=8).digest(), "little")
        h |= 1  # 0 means "refused"
    hashes = np.empty(comm.size, dtype=np.uint64)
    plain.allgather(comm, _SAME_CALL.gathered(np.uint64, call=h), hashes, timeout=timeout)
    if _SAME_CALL.tally_rows(hashes).agrees("call"):
        return
    descs = allgather_json(comm, desc, resolve_timeout(timeout))
    live = [r for r, d in enumerate(descs) if d is not None]
    closing = [r for r in live if descs[r].split("\n", 1)[0] == CLOSING]
    if closing and call != CLOSING:
        raise PeerClosed(
            f"rank {closing[0]} closed this CompressedComm while this rank called {call}; "
            "it is closed on this rank too"
        )
    ref = live[0]
    ref_call, ref_conf = descs[ref].split("\n", 1)
    parts = []
    for r in live:
        if hashes[r] == hashes[ref]:
            continue
        r_call, r_conf = descs[r].split("\n", 1)
        parts.append(
            f"rank {r} called {r_call}" + (f" with {r_conf}" if r_conf != ref_conf else "")
        )
    same_conf = all(descs[r].split("\n", 1)[1] == ref_conf for r in live)
    raise RankError(
        f"{'; '.join(parts)} while rank {ref} called {ref_call}"
        + ("" if same_conf else f" with {ref_conf}")
    )
