"""MaxAllReduce / MinAllReduce of small numeric vectors: norms, scale indices, sizes.

Every call starts with one fixed-size int64 message, the *head*, reduced with MPI MAX:

    [n, -n, dtype, -dtype, op, -op, bad_low, bad_high, key(x[0]), ..., key(x[K-1])]

Its first eight values are the call's ballot (``agreement.Form``: ``_HEAD``): MAX of
``v`` and of ``-v`` is ``max v`` and ``-min v``, the two agree exactly when every rank
sent the same ``v``. So one message checks that all ranks bring the same length, the
same dtype and the same operation, names the ranks whose input is not a valid vector,
and already carries the first ``K = _INLINE`` values (as order-preserving int64 keys,
every dtype alike). A vector of at most K values (a norm, a handful of scales)
costs that one message. Longer vectors send the rest, ``x[K:]``, in a second Allreduce
in their own width, once the head has shown that every rank agrees.

NaN: MPI leaves MAX/MIN of NaN to the implementation, and a NaN gradient must not turn
into a finite norm on some ranks. Floats travel as integer keys of their IEEE bits
(order-preserving: ``-inf < ... < -0.0 < +0.0 < ... < +inf``), and a NaN gets the key
that wins the reduction. So an element is NaN in the result, on every rank, exactly
when it is NaN on some rank; otherwise it is the max/min, with ``max(-0.0, +0.0) = +0.0``
and ``min(-0.0, +0.0) = -0.0``. The NaN that comes back has an unspecified sign and payload.

With a timeout (``timeout=`` or ``MPICOMP_TIMEOUT``, see ``_wait``) both messages are
Iallreduce calls waited on by ``_wait.wait_all``; without one, blocking Allreduce calls.
"""

from __future__ import annotations

from functools import partial

import numpy as np
from mpi4py import MPI

from mpicomp.collectives._wait import issue, resolve_timeout
from mpicomp.collectives.agreement import RANKS, SAME, Form, settle
from mpicomp.kernels import backend_of

# Values carried by the head message: vectors this short cost one message. Tests shrink
# it to sweep the head/tail edge; every rank must see the same value.
_INLINE = 16

# The ballot the head begins with; a rank whose x is invalid leaves n and dtype out.
_HEAD = Form(n=SAME, dtype=SAME, op=SAME, bad=RANKS)
_HEADER = _HEAD.size  # 8: n, -n, dtype, -dtype, op, -op, bad_low, bad_high
_I64 = np.iinfo(np.int64)
_DTYPES = tuple(
    np.dtype(name)
    for name in (
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
)
_CODE = {dt: code for code, dt in enumerate(_DTYPES, start=1)}
_OPS = {"max_allreduce": (1, MPI.MAX), "min_allreduce": (2, MPI.MIN)}
# Largest signed integer of each float width: every bit but the sign.
_LOW_BITS = {w: (1 << (8 * w - 1)) - 1 for w in (2, 4, 8)}


def _as_vector(x):
    """Return (vector, scalar_type, problem): a contiguous 1-D array, the Python/NumPy
    scalar type to return (None for arrays), and why ``x`` is invalid (None if it is not)."""
    if isinstance(x, (bool, np.bool_)):
        return None, None, TypeError(f"x must be a number or a numeric array, got {x!r}")
    if isinstance(x, int):
        if not _I64.min <= x <= _I64.max:
            return None, None, ValueError(f"x={x!r} does not fit in int64")
        return np.array([x], dtype=np.int64), int, None
    if isinstance(x, float):
        return np.array([x], dtype=np.float64), float, None
    if isinstance(x, np.generic):
        if x.dtype not in _CODE:
            return None, None, TypeError(f"x must have a real numeric dtype, got {x.dtype}")
        return np.array([x]), type(x), None
    try:
        xp = backend_of(x).xp
    except TypeError:
        return None, None, TypeError(f"x must be a number or a 1-D array, got {type(x).__name__}")
    if x.dtype not in _CODE:
        names = ", ".join(dt.name for dt in _DTYPES)
        return None, None, TypeError(f"x must have one of the dtypes {names}; got {x.dtype}")
    if x.ndim != 1:
        return None, None, ValueError(f"x must be 1-D, got shape {x.shape}")
    return xp.ascontiguousarray(x), None, None


def _float_keys(v, nan_key: int, out):
    """Write into ``out`` (signed integers of ``v``'s width) keys of ``v``'s bits whose
    order is the float order; NaN gets ``nan_key``. Return ``out``."""
    xp = backend_of(v).xp
    b = v.view(out.dtype)
    # Negative floats count down as their bits count up: flip all but the sign bit.
    xp.right_shift(b, 8 * b.itemsize - 1, out=out)
    out &= _LOW_BITS[b.itemsize]
    out ^= b
    xp.copyto(out, nan_key, where=xp.isnan(v))
    return out


def _float_from_keys(k, dtype):
    """Invert ``_float_keys`` in place; return the floats of ``dtype`` (same width)."""
    flip = k >> (8 * k.itemsize - 1)
    flip &= _LOW_BITS[k.itemsize]
    k ^= flip
    return k.view(dtype)


def _head_keys(v, op_code: int):
    """Return int64 keys of ``v`` whose MAX is the reduction ``op_code`` asks for."""
    dt = v.dtype
    if dt.kind == "f":
        # Widening to float64 is exact; NaN takes the key that wins this reduction.
        nan = _I64.max if op_code == 1 else _I64.min
        k = _float_keys(v.astype(np.float64), nan, backend_of(v).xp.empty(v.size, np.int64))
    elif dt == np.uint64:
        k = (v ^ np.uint64(1 << 63)).view(np.int64)  # order-preserving shift into int64
    else:
        k = v.astype(np.int64)
    # MIN is MAX of the order-reversed keys: ~k = -k-1 reverses order without overflow.
    return k if op_code == 1 else ~k


def _head_values(w, op_code: int, dtype):
    """Invert ``_head_keys``: return the values of ``dtype`` encoded in int64 ``w``."""
    k = w.copy() if op_code == 1 else ~w
    if dtype.kind == "f":
        return _float_from_keys(k, np.float64).astype(dtype)
    if dtype == np.uint64:
        return k.view(np.uint64) ^ np.uint64(1 << 63)
    return k.astype(dtype)


def _check_head(comm, head, name: str, problem: Exception | None) -> None:
    """Raise the same ValueError on every rank if the reduced head shows a disagreement."""
    tally = _HEAD.tally(head, comm.size)
    settle(tally.ranks("bad"), problem, partial(_invalid, name), own=False)
    if not tally.agrees("op"):
        raise ValueError(
            f"{name}: ranks disagree on the operation: some call max_allreduce, others min_allreduce"
        )
    if not tally.agrees("n"):
        low, high = tally.span("n")
        raise ValueError(f"{name}: ranks disagree on the length of x: from {low} to {high}")
    if not tally.agrees("dtype"):
        low, high = tally.span("dtype")
        lo, hi = _DTYPES[low - 1], _DTYPES[high - 1]
        raise ValueError(f"{name}: ranks disagree on the dtype of x: {lo} and {hi} among them")


def _invalid(name: str, ranks: list[int]) -> ValueError:
    """The error of every rank when ``ranks`` (the lowest and the highest) passed a bad x."""
    who = (
        f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]} to {ranks[-1]} (at least two)"
    )
    return ValueError(f"{name}: {who} passed an invalid x (not a number or a 1-D numeric array)")


def _waiting(comm, message: str, buf) -> str:
    """Return what an Iallreduce of ``buf`` waits for, for the timeout report."""
    return f"{message} (an Iallreduce of {buf.nbytes} bytes over all {comm.size} ranks)"


def _extreme_allreduce(comm, x, *, name: str, recorder=None, timeout=None):
    """Reduce ``x`` elementwise over ranks with the operation of ``name``: head, then tail.

    The one core of both public functions; it makes its MPI calls through ``issue``
    itself, so a call reaches MPI in two frames (``max_allreduce`` is this core with its
    name bound, a ``partial``: no frame of its own) or three (``min_allreduce``).
    """
    timeout = resolve_timeout(timeout)
    # Both messages of a call: an Allreduce on comm, under the timeout, named ``name``.
    allreduce = partial(
        issue, comm, MPI.Comm.Allreduce, MPI.Comm.Iallreduce, timeout=timeout, name=name
    )
    op_code, mpi_op = _OPS[name]
    v, scalar, problem = _as_vector(x)
    xp = np if v is None else backend_of(v).xp
    inline = _INLINE
    n = k = 0
    head = xp.full(_HEADER + inline, _I64.min, dtype=np.int64)
    if problem is None:
        n = v.size
        head[:_HEADER] = _HEAD.reduced(comm.rank, comm.size, n=n, dtype=_CODE[v.dtype], op=op_code)
        k = min(n, inline)
        head[_HEADER : _HEADER + k] = _head_keys(v[:k], op_code)
    else:  # no length or dtype to compare: the report below names this rank
        head[:_HEADER] = _HEAD.reduced(comm.rank, comm.size, op=op_code, bad=True)
    allreduce(
        MPI.IN_PLACE, head, op=MPI.MAX, detail=lambda: _waiting(comm, "the head message", head)
    )
    if recorder is not None:
        wire = head.nbytes if comm.size > 1 else 0  # one rank sends nothing
        recorder.record(f"{name}.head", 1, wire, wire, 64)
    _check_head(comm, head, name, problem)

    out = xp.empty(n, dtype=v.dtype)
    out[:k] = _head_values(head[_HEADER : _HEADER + k], op_code, v.dtype)
    if n > inline:
        rest, tail = v[inline:], out[inline:]
        floats = v.dtype.kind == "f"
        if floats:
            # The keys are built, reduced and decoded in the result's own memory.
            keys = tail.view(f"i{v.dtype.itemsize}")
            top = _LOW_BITS[keys.itemsize]
            _float_keys(rest, top if op_code == 1 else -top - 1, keys)
            send, recv = MPI.IN_PLACE, keys
        else:  # MPI's integer MAX/MIN are exact
            send, recv = rest, tail
        allreduce(send, recv, op=mpi_op, detail=lambda: _waiting(comm, "the tail message", recv))
        if floats:
            _float_from_keys(keys, v.dtype)
        if recorder is not None:
            wire = rest.nbytes if comm.size > 1 else 0
            recorder.record(f"{name}.tail", 1, wire, wire, 8 * v.dtype.itemsize)
    return out if scalar is None else scalar(out[0])


#: ``max_allreduce(comm, x, *, recorder=None, timeout=None)``
max_allreduce = partial(_extreme_allreduce, name="max_allreduce")
max_allreduce.__doc__ = """Return the elementwise maximum over the ranks of ``comm`` of ``x``, on every rank.

    Args:
        comm: an ``mpi4py.MPI.Intracomm``; every rank calls with the same length and dtype.
        x: a 1-D array of int8..int64, uint8..uint64 or float16/32/64 (any strides), or a
            Python int/float or NumPy scalar. It is not modified.
        recorder: gets ``record("max_allreduce.head", ...)`` and, for vectors longer than
            the head holds, ``record("max_allreduce.tail", ...)`` (bytes at the API level).
        timeout: seconds each message may wait before this rank reports what it waits
            for and aborts the job (``comm.Abort``); None: ``MPICOMP_TIMEOUT``, unset or
            0: off.

    Returns:
        A new array of ``x``'s dtype and length, or a scalar of ``x``'s type. An element
        is NaN wherever it is NaN on any rank.

    Raises:
        ValueError: on every rank, when some rank's ``x`` is not a number or a 1-D
            numeric array (that rank is named; there the local TypeError/ValueError is
            the cause), or ranks disagree on the length, the dtype or max vs min.
    """


def min_allreduce(comm, x, *, bits=None, recorder=None, timeout=None):
    """Return the elementwise minimum over the ranks of ``comm`` of ``x``, on every rank.

    The same contract as ``max_allreduce``, with ``"min_allreduce.*"`` trace records.
    With ``bits`` (the multi-scale codecs' shared scale indices: unsigned codes below
    2**bits, one per coordinate of a long vector) the minimum travels packed at
    ``bits`` bits per element through the ring (``ring_allreduce_min``) and comes back
    as int64.
    """
    if bits is not None:
        from mpicomp.collectives.ring import ring_allreduce_min

        return ring_allreduce_min(comm, x, bits, recorder=recorder, timeout=timeout)
    return _extreme_allreduce(comm, x, name="min_allreduce", recorder=recorder, timeout=timeout)
