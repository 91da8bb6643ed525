"""How every rank hears of what must hold on every rank: one agreement for every check.

MPI tells a rank nothing of the others but their messages: a rank that raises alone
leaves the others waiting in the next collective, and ranks that bring different sizes
or configurations send messages the others do not expect. So each such check of
mpicomp (a CompressedComm's configuration, every call's agreement, the arguments of a
bounded ring, the MaxAllReduce head, the debug same-call check, the adapters') is one
*ballot* each rank fills, combined so that every rank reads the same result and raises
the same error:

- a ``Form`` declares a check's fields once, in the order they travel; each field is
  ``SAME`` (a value every rank must bring alike), ``SPAN`` (a range, ``(lo, hi)``),
  ``TOP`` (the largest wins), ``RANK`` or ``RANKS`` (raised by the ranks at fault);
- ``Form.reduced`` writes a rank's ballot for one MAX reduction: ``SAME`` and ``SPAN``
  as ``(hi, -lo)``, whose MAX is ``(max, -min)`` over the ranks, equal halves exactly
  when every rank brought the same value; ``RANK`` as ``rank + 1`` (MAX names the
  highest rank at fault), ``RANKS`` as ``(size - rank, rank + 1)`` (the lowest and the
  highest). A field a rank leaves out is the identity of MAX: the dtype's least value
  (0 for the flags), so a rank with nothing to compare does not disturb the others. The
  caller sends it, standalone (one Allreduce) or inside a message it sends anyway (the
  MaxAllReduce head, the per-call agreement's MaxAllReduce);
- ``Form.gathered`` writes one row per rank instead, for a check that gathers the rows
  (an Allgather) to name every rank at fault; ``RANK`` and ``RANKS`` are then 0 or 1;
- ``Form.tally`` and ``Form.tally_rows`` read the result as a ``Tally``, the same on
  every rank: ``agrees``, ``span``, ``top``, ``ranks``;
- ``settle`` raises it: nothing when no rank is at fault, else this rank's own error
  where it failed and the caller's error (``RankError`` or ``ValueError`` naming the
  ranks: ``ranks_text``, ``world_ranks``) on the others;
- what differs is named only when it does: ``disagreement`` gathers every rank's fields
  (``allgather_json``) and says which differ on which ranks.

A check's ballot travels in its caller's own message. The messages sent here,
``gather_rows`` and ``allgather_json``, go through ``_wait`` nonblocking whatever the
timeout: a CompressedComm's check runs before the ranks have agreed on their timeouts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache

import numpy as np

from mpicomp.collectives._wait import issue_nonblocking

SAME = "same"
SPAN = "span"
TOP = "top"
RANK = "rank"
RANKS = "ranks"
_WIDTH = {SAME: 2, SPAN: 2, TOP: 1, RANK: 1, RANKS: 2}
_KINDS = {kind: kind for kind in _WIDTH}  # a kind as the one object ``is`` compares


@cache
def _least(dtype) -> int | float:
    """Return the identity of MAX in ``dtype``: its least value."""
    dtype = np.dtype(dtype)
    return -np.inf if dtype.kind == "f" else int(np.iinfo(dtype).min)


class Form:
    """The fields of one check, declared once, in the order they travel.

    ``Form(numel=SAME, failed=RANK)``: a ballot for one MAX reduction is ``Form.size``
    values wide (two for ``SAME``, ``SPAN`` and ``RANKS``, one for ``TOP`` and
    ``RANK``); a gathered row, one value per field.
    """

    __slots__ = ("fields", "size", "_at", "_row", "_kinds")

    def __init__(self, **fields: str):
        bad = {name: kind for name, kind in fields.items() if kind not in _WIDTH}
        if bad:
            raise ValueError(f"unknown field kinds {bad}; one of {', '.join(_WIDTH)}")
        self.fields = {name: _KINDS[kind] for name, kind in fields.items()}
        self._kinds = tuple(self.fields.items())
        self._at, at = {}, 0
        for name, kind in fields.items():
            self._at[name] = at
            at += _WIDTH[kind]
        self.size = at
        self._row = {name: i for i, name in enumerate(fields)}

    def _unknown(self, entries) -> None:
        extra = set(entries) - set(self.fields)
        if extra:
            raise TypeError(
                f"no field {', '.join(sorted(extra))} in this form ({list(self.fields)})"
            )

    def reduced(self, rank: int, size: int, dtype=np.int64, /, **entries) -> np.ndarray:
        """Return rank ``rank``'s ballot (of ``size`` ranks) for one MAX reduction.

        ``entries``: a number for ``SAME`` and ``TOP``, ``(lo, hi)`` for ``SPAN``, a
        bool for ``RANK`` and ``RANKS`` (this rank raises it); None or left out: the
        identity (nothing to compare, not raised). Every value must fit ``dtype`` with
        its negation.
        """
        least, out, get = _least(dtype), [], entries.get
        for name, kind in self._kinds:
            v = get(name)
            if kind is SAME:
                out += (least, least) if v is None else (v, -v)
            elif kind is RANK:
                out.append(rank + 1 if v else 0)
            elif kind is TOP:
                out.append(least if v is None else v)
            elif kind is SPAN:
                out += (least, least) if v is None else (v[1], -v[0])
            else:
                out += (size - rank, rank + 1) if v else (0, 0)
        if not entries.keys() <= self._at.keys():
            self._unknown(entries)
        return np.array(out, dtype=dtype)

    def gathered(self, dtype=np.int64, /, **entries) -> np.ndarray:
        """Return this rank's row for a check that gathers every rank's row: one value
        per field (``SPAN``: not gathered; ``RANK``/``RANKS``: 1 if raised, else 0)."""
        self._unknown(entries)
        least = _least(dtype)
        out = []
        for name, kind in self.fields.items():
            v = entries.get(name)
            if kind == SPAN:
                raise TypeError(f"{name}: a SPAN travels only in a reduced ballot")
            if kind in (RANK, RANKS):
                out.append(1 if v else 0)
            else:
                out.append(least if v is None else v)
        return np.array(out, dtype=dtype)

    def tally(self, reduced, size: int) -> Tally:
        """Read a ballot reduced by MAX over ``size`` ranks (its first ``self.size``
        values: it may lead a longer message; NumPy or device memory, read once)."""
        head = reduced[: self.size]
        return Tally(self, head.tolist(), size, _least(head.dtype))

    def tally_rows(self, table) -> Tally:
        """Read every rank's gathered row (``table``: one row per rank, in rank order)."""
        rows = np.asarray(table).reshape(-1, len(self.fields))
        return _RowTally(self, rows, len(rows), _least(rows.dtype))


class Tally:
    """The result of one check, the same on every rank: ``agrees``, ``span``, ``top``
    and ``ranks`` of its fields (here of a reduced ballot)."""

    __slots__ = ("form", "values", "nranks", "least")

    def __init__(self, form: Form, values, nranks: int, least):
        self.form, self.values, self.nranks, self.least = form, values, nranks, least

    def agrees(self, name: str) -> bool:
        """Return True if every rank that brought ``name`` brought the same value."""
        lo, hi = self.span(name)
        return lo == hi

    def span(self, name: str) -> tuple:
        """Return (least, greatest) of ``name`` over the ranks that brought it ((None,
        None) when none did)."""
        at = self.form._at[name]
        hi, neg_lo = self.values[at], self.values[at + 1]
        if hi == self.least:  # only identities: no rank brought it
            return None, None
        return -neg_lo, hi

    def top(self, name: str):
        """Return the largest ``name`` over the ranks (the identity when none gave one)."""
        return self.values[self.form._at[name]]

    def ranks(self, name: str) -> list[int]:
        """Return the ranks that raised ``name``, in order: the highest (``RANK``), or
        the lowest and the highest (``RANKS``; one rank when they are the same) of a
        reduced ballot; every one of gathered rows; [] when none did."""
        at = self.form._at[name]
        high = int(self.values[at + (self.form.fields[name] is not RANK)])
        if not high:
            return []
        if self.form.fields[name] is RANK:
            return [high - 1]
        low = self.nranks - int(self.values[at])
        return [low] if low == high - 1 else [low, high - 1]


class _RowTally(Tally):
    """The result of a check that gathered every rank's row."""

    __slots__ = ()

    def _column(self, name: str):
        return self.values[:, self.form._row[name]]

    def span(self, name: str) -> tuple:
        column = self._column(name)
        present = column[column != self.least]
        if present.size == 0:
            return None, None
        return present.min().item(), present.max().item()

    def top(self, name: str):
        return self._column(name).max().item()

    def ranks(self, name: str) -> list[int]:
        return np.flatnonzero(self._column(name)).tolist()


def settle(
    failed: list[int],
    error: BaseException | None,
    others: Callable[[list[int]], BaseException],
    own: bool = True,
) -> None:
    """Raise, on every rank, what ranks at fault mean; nothing when ``failed`` is empty.

    Where this rank failed (``error``), that error itself; elsewhere ``others(failed)``.
    With ``own=False`` every rank raises ``others(failed)``, from ``error`` where it is
    set (a check whose every rank must raise the same type, e.g. ``ValueError``).
    """
    if not failed:
        return
    if own and error is not None:
        raise error
    raise others(failed) from error


# --- naming ranks and what differs ----------------------------------------------------


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


def canonical(value) -> bytes:
    """Return ``value`` as JSON, what means the same written the same: NumPy scalars as
    Python numbers, integral floats as ints (``ratio=1`` is ``ratio=1.0``), tuples as
    lists, keys sorted, anything else by its repr."""
    return json.dumps(_plain(value), sort_keys=True, default=repr).encode()


def _plain(value):
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def allgather_json(comm, mine, timeout: float | None) -> list:
    """Return every rank's ``mine`` (JSON, ``canonical``; None travels as nothing), in
    rank order. Collective: an Iallgather of the sizes, an Iallgatherv of the bytes."""
    payload = np.frombuffer(canonical(mine) if mine is not None else b"", dtype=np.uint8)
    sizes = np.empty(comm.size, dtype=np.int64)
    _gather(comm, [np.array([payload.size], np.int64), sizes], timeout, "sizes")
    ends = np.cumsum(sizes)
    whole = np.empty(int(ends[-1]), dtype=np.uint8)
    _gather(comm, [payload, [whole, (sizes, ends - sizes)]], timeout, "descriptions", v=True)
    return [
        json.loads(bytes(whole[e - n : e])) if n else None for n, e in zip(sizes, ends, strict=True)
    ]


def gather_rows(comm, row, timeout: float | None, what: str):
    """Return every rank's ``row`` (a ``Form.gathered`` row), one row per rank: an
    Iallgather, nonblocking whatever the timeout (``allgather_json``)."""
    table = np.empty((comm.size, row.size), dtype=row.dtype)
    _gather(comm, [row, table], timeout, what)
    return table


def _gather(comm, args: list, timeout, what: str, v: bool = False) -> None:
    """``MPI_Iallgather`` (``MPI_Iallgatherv`` with ``v``) waited on (with ``timeout`` if
    set): nonblocking whatever the timeout, because a blocking collective never matches
    a nonblocking one, and ranks may differ in their timeout here."""
    from mpi4py import MPI

    call = MPI.Comm.Iallgatherv if v else MPI.Comm.Iallgather
    detail = f"an {call.__name__} of {what} from each of {comm.size} ranks"
    issue_nonblocking(comm, call, *args, timeout=timeout, name="check_same", detail=detail)


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


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
