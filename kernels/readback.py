"""Reads from a device that a call makes together: ``batch``, ``read`` and ``when``.

On a GPU every small value a launcher brings back (an error mask, a NaN/Inf flag, the
block norms MPI must send) costs a host synchronization: the host waits for every
kernel before it, then for the copy. A call that read each one where it was made waited
3 to 14 times. Inside ``with batch(name):`` the reads that can wait (``read`` in the
launchers) return a ``Later`` instead, and the batch brings all of them to the host in
one transfer when it closes (one ``to_host``, counted once under ``name`` and the reads'
own names). ``when(value, fn)`` runs ``fn`` on a value now, or on a ``Later`` when its
batch is read, in the order they were registered: the first check that fails raises
there, as it would have where the value was made.

Without a batch, or on the host (NumPy arrays of the numba backend), ``read`` returns the
value at once, so a launcher called on its own (tests, benchmarks, a codec used alone)
behaves as before. Batches are per thread and nest: a read goes to the innermost one.
A batch made with ``shared=True`` lends its values to the transfer of a batch inside it
(a codec's encode that must read now takes the caller's checks along: one transfer for
both); their checks still run, in order, when it closes. Inside ``with ignored():``
reads are dropped (a flag the caller does not need).
"""

from __future__ import annotations

import threading

import numpy as np

_local = threading.local()


class Later:
    """A value of a device array that its batch brings to the host when it closes."""

    __slots__ = ("_array", "_batch", "_convert", "_device", "_done", "_lent", "_value", "why")

    def __init__(self, batch, device, array, convert, why: str):
        self._batch = batch
        self._device = device
        self._array = array
        self._convert = convert
        self._done = False
        self._lent = False  # read by a batch inside its own, which is still open
        self._value = None
        self.why = why

    @property
    def array(self):
        """The device array it reads: a launcher may pass it on to the next kernel,
        which reads the value where it lies."""
        return self._array

    @property
    def value(self):
        """The converted value, once the batch was read."""
        if not self._done:
            raise RuntimeError(f"{self.why}: read before its batch closed")
        return self._value

    def __bool__(self):
        # A caller that branches on a deferred value must register with ``when`` instead.
        raise TypeError(f"{self.why}: a deferred device value has no truth value yet")

    def _set(self, host: np.ndarray) -> None:
        self._value = self._convert(host)
        self._done = True


def _stack() -> list:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


class batch:
    """Defer the ``read``s of this thread until the block ends; then read them in one
    transfer and run their ``when`` callbacks in order. An exception leaving the block
    drops them unread (the call failed anyway).

    Args:
        name: what the combined read is counted as in ``sync_reasons``, with the names
            of the reads it holds, e.g. ``"end of call"``.
        shared: the first transfer of a batch opened inside this one also brings this
            one's pending values (of the same device), instead of a transfer of their
            own when this one closes.
    """

    def __init__(self, name: str, shared: bool = False):
        self.name = name
        self.shared = shared
        self._pending: list[Later] = []
        self._lent: list[Later] = []
        self._callbacks: list[tuple[Later, object]] = []

    def __enter__(self) -> batch:
        _stack().append(self)
        return self

    def __exit__(self, kind, error, tb) -> None:
        stack = _stack()
        stack.remove(self)
        if kind is None:
            self.read()
        else:  # its values are dropped: none stays lent to it
            for later in self._lent:
                later._lent = False
            self._lent = []

    def read(self) -> None:
        """Bring every pending value to the host in one transfer, then run the checks
        registered on them in order (the first that raises stops the rest)."""
        pending, self._pending = self._pending, []
        callbacks, self._callbacks = self._callbacks, []
        for later in self._lent:
            later._lent = False
        self._lent = []
        if pending:
            _read_together(pending + self._borrowed(pending[0]._device), self.name)
        for later, fn in callbacks:
            fn(later.value)

    def _borrowed(self, device) -> list[Later]:
        """Take the pending values of ``device`` from the ``shared`` batches around this
        one: this transfer brings them, their batches keep their checks."""
        stack = _stack()
        outer = stack[: stack.index(self)] if self in stack else stack
        taken = []
        for b in outer:
            if not b.shared:
                continue
            mine = [p for p in b._pending if p._device is device]
            b._pending = [p for p in b._pending if p._device is not device]
            for p in mine:
                p._lent = True
            b._lent += mine
            taken += mine
        return taken

    def _add(self, later: Later) -> None:
        self._pending.append(later)

    def _when(self, later: Later, fn) -> None:
        self._callbacks.append((later, fn))


class ignored(batch):
    """Drop the ``read``s of this thread until the block ends: nothing is transferred,
    for a launcher's flag its caller has no use for (a ``Later`` made here has no value)."""

    def __init__(self):
        super().__init__("ignored")

    def read(self) -> None:
        self._pending = []

    def _when(self, later: Later, fn) -> None:
        raise TypeError(f"{later.why}: a value read inside readback.ignored() is never read")


def _read_together(pending: list[Later], name: str) -> None:
    device = pending[0]._device
    xp = device.xp
    parts = [xp.ascontiguousarray(p._array).reshape(-1).view(np.uint8) for p in pending]
    whys = ", ".join(dict.fromkeys(p.why for p in pending))
    joined = parts[0] if len(parts) == 1 else xp.concatenate(parts)
    host = device.to_host(joined, why=f"{name}: {whys}")
    at = 0
    for p, part in zip(pending, parts, strict=True):
        a = p._array
        p._set(host[at : at + part.size].view(a.dtype).reshape(a.shape))
        at += part.size


def read(device, array, why: str, convert=None):
    """Return ``convert(host copy of array)`` (default the copy itself): at once, or as
    a ``Later`` when this thread is in a ``batch``.

    Args:
        device: the ``kernels.cuda.device.Device`` the array lives on (its ``to_host``
            and ``xp``); None for a host array, read at once.
        array: the device array (a few bytes: flags, norms, lengths).
        why: what the value is, for ``sync_reasons`` (e.g. ``"qsgd.quantize: error mask"``).
        convert: a function of the host copy (a NumPy array of ``array``'s shape).
    """
    convert = convert or (lambda host: host)
    stack = _stack()
    if device is None or not stack:
        host = array if device is None else device.to_host(array, why=why)
        return convert(np.asarray(host))
    later = Later(stack[-1], device, array, convert, why)
    stack[-1]._add(later)
    return later


def when(value, fn) -> None:
    """Run ``fn(value)`` now, or, for a ``Later``, when its batch has read it (a value
    lent to an inner batch's transfer is still checked when its own batch closes)."""
    if isinstance(value, Later) and (not value._done or value._lent):
        value._batch._when(value, fn)
    else:
        fn(value_of(value))


def value_of(value):
    """Return ``value``, or a ``Later``'s value (its batch must have been read)."""
    return value.value if isinstance(value, Later) else value
