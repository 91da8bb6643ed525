"""How the bytes of a device array reach MPI, and whether the MPI library could take them.

``cuda_aware()`` decides once per process whether the MPI library takes GPU buffers:
``MPICOMP_CUDA_AWARE=0/1`` when set, else the library's own answer
(``MPIX_GPU_query_support``, ``MPIX_Query_cuda_support``), else the environment hints
of the common builds, else no.

``Transport`` is what a ``CompressedComm`` does with the bytes its device gradients send
(payloads, codes, votes, wire arrays): hand the device arrays to MPI once their kernels
are done (``direct``, when ``cuda_aware()``), or copy them into its staging buffers and
the results back (``staged``). The staging buffers are pinned where the device backend
can pin, one per use, grown when a call needs more and reused by every later call (no
allocation in steady state). Traces and ``mpicomp info`` say which path is taken. A
staged exchange of more than a chunk (``MPICOMP_STAGING_CHUNK``, 4 MiB) is pipelined:
``Transport.exchange_in_chunks`` overlaps one chunk's MPI with the next chunk's copy down
and the previous chunk's copy up (docs/performance.md, "Pipelined staging").
"""

from __future__ import annotations

import ctypes
import os
import re
from functools import cache

import numpy as np

from mpicomp.env import env_flag

#: The environment variable that overrides the detection: 1 (aware) or 0 (not).
ENV = "MPICOMP_CUDA_AWARE"

_MIN_BYTES = 1 << 16  # the smallest staging buffer
# The words the MPI libraries' own switches (the hints below) take; MPICOMP_CUDA_AWARE
# follows mpicomp's one rule for booleans (mpicomp.env) instead.
_TRUE = ("1", "yes", "true", "on", "enable")
_FALSE = ("0", "no", "false", "off", "disable")
# MPICH: MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA = 0, &flag) (MPICH >= 4.0);
# Open MPI and MPICH both: MPIX_Query_cuda_support() (Open MPI's mpi-ext.h).
_MPIX_GPU_SUPPORT_CUDA = 0
# libmpi.so.12 (MPICH, Intel MPI), libmpi.so.40 (Open MPI), libmpi_abi.so (the MPI-5 ABI),
# libmpich.so, libmpi_cray.so (Cray MPICH).
LIBMPI = re.compile(r"libmpi(ch|_cray|_abi)?\.so")
# Settings that switch a build's GPU support on, when the library cannot be asked.
_HINTS = {
    "OMPI_MCA_opal_cuda_support": "Open MPI",
    "MPIR_CVAR_ENABLE_GPU": "MPICH",
    "MPICH_GPU_SUPPORT_ENABLED": "Cray MPICH",
    "MV2_USE_CUDA": "MVAPICH2",
    # 1 enables GPU buffers (CUDA or Level Zero) in Intel MPI 2021; one that answers
    # MPIX_GPU_query_support (2021.19 does) is believed instead.
    "I_MPI_OFFLOAD": "Intel MPI",
}


def libmpi_path() -> str | None:
    """Return the file of the MPI library this process has mapped (Linux), else None."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:  # not Linux: no cheap way to ask the loader
        return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and LIBMPI.match(os.path.basename(parts[5])):
            return parts[5]
    return None


def library_cuda_support(libpath: str | None, vendor: str) -> tuple[bool | None, str]:
    """Return (True, False or None for unknown; how that was found) from the MPI library."""
    # A build with GPU support answers yes even where this run switched it off (Open MPI
    # 4.1's MPIX_Query_cuda_support returns how it was built).
    off = {"MPICH": "MPIR_CVAR_ENABLE_GPU", "Open MPI": "OMPI_MCA_opal_cuda_support"}.get(vendor)
    env = os.environ.get(off) if off else None
    if env is not None and env.strip().lower() in _FALSE:
        return False, f"{off}={env}"
    if libpath is None:
        return None, "MPI library file not found"
    try:
        lib = ctypes.CDLL(libpath)  # already loaded: this returns the same handle
    except OSError as e:
        return None, str(e)
    query = getattr(lib, "MPIX_GPU_query_support", None)
    if query is not None:
        flag = ctypes.c_int(0)
        query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
        if query(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag)) == 0:
            return bool(flag.value), "MPIX_GPU_query_support"
    query = getattr(lib, "MPIX_Query_cuda_support", None)
    if query is not None:
        query.restype = ctypes.c_int
        return bool(query()), "MPIX_Query_cuda_support"
    return None, "the library has no MPIX_Query_cuda_support"


def describe(answer: tuple[bool | None, str]) -> str:
    """Return ``(value, how)`` as ``mpicomp info`` prints it: "yes (how)", "no (how)"..."""
    value, how = answer
    word = "unknown" if value is None else ("yes" if value else "no")
    return f"{word} ({how})"


@cache
def cuda_aware() -> tuple[bool, str]:
    """Return (whether the MPI library takes GPU buffers, how that was decided).

    Raises:
        ValueError: ``MPICOMP_CUDA_AWARE`` is set to neither on nor off (``mpicomp.env``).
    """
    forced = env_flag(ENV, unset=None)
    if forced is not None:
        return forced, f"{ENV}={os.environ[ENV]}"
    from mpi4py import MPI

    value, how = library_cuda_support(libmpi_path(), MPI.get_vendor()[0])
    if value is not None:
        return value, how
    for var, build in _HINTS.items():
        hint = os.environ.get(var, "").strip().lower()
        if hint in _TRUE:
            return True, f"{var}={os.environ[var]} ({build})"
    return False, f"{how}; no environment hint"


#: The environment variable that sets the staging chunk, in bytes (``K``, ``M``, ``G``:
#: KiB, MiB, GiB; 0: no chunks). Read when a CompressedComm is made; every rank must set
#: it alike, since it splits the float32 sum's messages on every path.
CHUNK_ENV = "MPICOMP_STAGING_CHUNK"

#: The default staging chunk: MPI runs near its bandwidth on 4 MiB messages, and a 100 MB
#: gradient still has 25 chunks whose copies can hide behind each other's MPI.
CHUNK_BYTES = 4 << 20

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
# Chunks in flight: one coming down, one in MPI, one going up (pinned buffers each).
_DEPTH = 3
_STAGING_WAIT = "staging: device to host"  # the name of the host's wait for a download


def staging_chunk() -> int:
    """Return the staging chunk in bytes: ``MPICOMP_STAGING_CHUNK``, else ``CHUNK_BYTES``.

    Raises:
        ValueError: the variable is not a whole number of bytes >= 0 (with K, M or G).
    """
    raw = os.environ.get(CHUNK_ENV, "").strip()
    if not raw:
        return CHUNK_BYTES
    match = re.fullmatch(r"(\d+)\s*([KMG]?)(?:i?B)?", raw, re.IGNORECASE)
    if match is None:
        raise ValueError(f"{CHUNK_ENV} must be bytes >= 0, e.g. 4194304 or 4M; got {raw!r}")
    return int(match[1]) * _UNITS[match[2].upper()]


def chunk_bounds(n: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Return the ``(lo, hi)`` element ranges that split ``n`` values of ``itemsize``
    bytes into chunks of ``chunk_bytes`` (whole values, one at least): one range when
    ``chunk_bytes`` is 0 or they fit in one chunk."""
    step = max(1, chunk_bytes // itemsize) if chunk_bytes else n
    if n <= step:
        return [(0, n)]
    return [(lo, min(lo + step, n)) for lo in range(0, n, step)]


class _Lanes:
    """The streams and events of one device's pipeline, made once and reused by every
    call (``down``: copies to the host; ``up``: copies back)."""

    def __init__(self, dev):
        self.down, self.up = dev.stream(), dev.stream()
        self.ready, self.drained, self.done = dev.event(), dev.event(), dev.event()
        self.downloaded = [dev.event() for _ in range(_DEPTH)]
        self.uploaded = [dev.event() for _ in range(_DEPTH)]
        self._dev, self._spans = dev, []  # one event per span of ``Transport.down_in_order``

    def span_events(self, count: int) -> list:
        """Return ``count`` events for ``down_in_order``'s spans (made once, reused)."""
        while len(self._spans) < count:
            self._spans.append(self._dev.event())
        return self._spans[:count]


class Staged:
    """A device array coming down into a host buffer span by span (``down_in_order``):
    ``host`` holds span [lo, hi) once ``ready(lo, hi)`` has returned."""

    def __init__(self, dev, host: np.ndarray, spans: list, events: list):
        self.host, self._dev = host, dev
        self._pending = list(zip(spans, events, strict=True))  # in the order issued

    def ready(self, lo: int, hi: int) -> None:
        """Block the host until every span that meets [lo, hi) is down: one wait (counted
        as ``"staging: device to host"``) for the last of them issued, which covers the
        spans issued before it on the same stream."""
        meets = (i for i, ((a, b), _) in enumerate(self._pending) if a < hi and lo < b)
        last = max(meets, default=None) if hi > lo else None
        if last is not None:
            self._dev.wait(self._pending[last][1], why=_STAGING_WAIT)
            del self._pending[: last + 1]


class Landing:
    """Where a bounded collective's packed result lands when staged (its ``into=``): a
    host buffer of ``slot`` (``buffer``) whose byte regions go up to a device array on
    the copy stream as each is complete (``landed``), so the allgather's later steps
    overlap the earlier chunks' copies; ``result()`` is that device array, ordered
    before what the current stream runs next."""

    def __init__(self, transport: Transport, record, slot: str):
        self._transport, self._record, self._slot = transport, record, slot
        self._dev = record.device
        self._lanes = transport._lanes_of(self._dev)
        self._host = self._device = None

    def buffer(self, nbytes: int) -> np.ndarray:
        """Return the host buffer of ``nbytes`` the collective writes its result into.

        The collective writes it only after this call's first chunk is down
        (``Staged.ready``), and the copies down wait for every earlier upload
        (``down_in_order``): the previous call's uploads from it are done by then."""
        dev, lanes = self._dev, self._lanes
        self._host = self._transport.host(self._record, self._slot, np.uint8, nbytes)
        self._device = dev.xp.empty(nbytes, dtype=np.uint8)
        # The uploads start after the current stream's last use of that memory.
        lanes.up.wait_event(dev.current_stream().record(lanes.ready))
        return self._host

    def landed(self, start: int, stop: int) -> None:
        """Start copying bytes [start, stop) of the buffer, now final, to the device."""
        if stop > start:
            self._dev.upload(self._host[start:stop], self._device[start:stop], self._lanes.up)

    def result(self):
        """Return the device copy of the whole buffer (every region ``landed``)."""
        lanes = self._lanes
        self._dev.current_stream().wait_event(lanes.up.record(lanes.done))
        return self._device


class Transport:
    """How one CompressedComm hands device bytes to MPI: ``direct`` (the device arrays
    themselves, to a CUDA-aware library, after their device work is done) or staged
    through host buffers, one per ``slot``.

    A slot's buffer is made at the first request and grows (by half again at least) when
    a larger one comes; every later call reuses it, so a training loop allocates only in
    its first steps. Buffers are pinned (page-locked)
    where the device backend can pin (``record.device.pinned``), which makes the copies
    asynchronous-capable and about twice as fast as pageable ones on a GPU.

    ``chunk_bytes`` (default ``staging_chunk()``) is the chunk of ``exchange_in_chunks``.
    """

    def __init__(self, direct: bool = False, chunk_bytes: int | None = None):
        self.direct = bool(direct)
        self.chunk_bytes = staging_chunk() if chunk_bytes is None else int(chunk_bytes)
        if self.chunk_bytes < 0:
            raise ValueError(f"chunk_bytes must be >= 0, got {chunk_bytes}")
        self._buffers: dict[str, np.ndarray] = {}
        self._lanes: dict[tuple, _Lanes] = {}  # per device and GPU
        self.allocations = 0  # buffers made so far (tests check it stops growing)

    @property
    def path(self) -> str:
        """``"direct"`` or ``"staged"``: what traces and ``mpicomp info`` report."""
        return "direct" if self.direct else "staged"

    def host(self, record, slot: str, dtype, n: int) -> np.ndarray:
        """Return a host array of ``n`` ``dtype`` values in ``slot``'s buffer (a view)."""
        dtype = np.dtype(dtype)
        nbytes = n * dtype.itemsize
        buf = self._buffers.get(slot)
        if buf is None or buf.nbytes < nbytes:
            pinned = getattr(getattr(record, "device", None), "pinned", None)
            # Exact the first time (most slots hold one size), 64 KiB at least (small
            # payloads vary most); half again more when a slot must grow, so growth stops
            # after a few calls.
            size = max(nbytes, _MIN_BYTES if buf is None else buf.nbytes * 3 // 2)
            buf = pinned(size) if pinned is not None else np.empty(size, np.uint8)
            self._buffers[slot] = buf
            self.allocations += 1
        return buf[:nbytes].view(dtype)

    def down(self, record, a, slot: str) -> np.ndarray:
        """Return device array ``a`` copied into ``slot``'s host buffer (same shape)."""
        out = self.host(record, slot, a.dtype, a.size).reshape(a.shape)
        record.to_host(a, out=out, why=_STAGING_WAIT)
        return out

    def down_in_order(self, record, a, slot: str, spans) -> Staged:
        """Start copying 1-D device array ``a`` into ``slot``'s host buffer span by span,
        in the order of ``spans`` (the order a collective reads them: ``Chunks.read_order``),
        on the copy stream; return the ``Staged`` whose ``ready(lo, hi)`` the collective
        calls before it reads [lo, hi). The first span's MPI then overlaps the next
        spans' copies, where ``down`` copied the whole array before MPI began."""
        dev = record.device
        lanes = self._lanes_of(dev)
        host = self.host(record, slot, a.dtype, a.size)
        spans = [(lo, hi) for lo, hi in spans if hi > lo]
        events = lanes.span_events(len(spans))
        # The copies start after the kernels that wrote ``a``, and after every upload
        # issued so far (a ``Landing``'s of the previous call, even one that failed
        # before its decode waited): once a chunk is down, no upload reads a host buffer.
        lanes.down.wait_event(dev.current_stream().record(lanes.ready))
        lanes.down.wait_event(lanes.up.record(lanes.drained))
        for (lo, hi), event in zip(spans, events, strict=True):
            dev.download(a[lo:hi], host[lo:hi], lanes.down)
            lanes.down.record(event)
        return Staged(dev, host, spans, events)

    def landing(self, record, slot: str) -> Landing:
        """Return a ``Landing`` in ``slot``'s host buffer, for one collective's result."""
        return Landing(self, record, slot)

    def _lanes_of(self, dev) -> _Lanes:
        """Return the streams and events of ``dev``'s current GPU, made at first use."""
        where = (dev.name, dev.current())
        lanes = self._lanes.get(where)
        if lanes is None:
            lanes = self._lanes[where] = _Lanes(dev)
        return lanes

    def exchange_in_chunks(self, record, a, bounds, exchange, check) -> tuple[object, bool]:
        """Return (a new device array holding what ``exchange`` made of each chunk of
        contiguous device array ``a``; whether ``check`` held for every chunk).

        For each chunk ``a[lo:hi]`` of ``bounds`` (``chunk_bounds``, in order): its copy
        comes down into a pinned buffer, ``exchange(send, recv, step=i + 1)`` fills a
        second one (an MPI collective: every rank calls it in the same order),
        ``check(recv)`` reads the result (until it is False once) and the result goes up
        into the chunk's place. Copies run on two streams of their own, so that while
        chunk i is in MPI chunk i + 1 comes down and chunk i - 1 goes up; events order
        them, and the host waits once per chunk, for its download (counted, as
        ``"staging: device to host"``). Buffers and streams are reused by every call.
        """
        dev = record.device
        lanes = self._lanes_of(dev)
        step = bounds[0][1] - bounds[0][0]
        sends = self.host(record, "chunks down", a.dtype, _DEPTH * step)
        recvs = self.host(record, "chunks up", a.dtype, _DEPTH * step)
        out = dev.xp.empty_like(a)
        down, up = lanes.down, lanes.up
        # The copies start after what the current stream has issued (the kernels that
        # wrote a; the last use of out's memory) and after the previous call's uploads.
        dev.current_stream().record(lanes.ready)
        up.record(lanes.drained)
        for stream in (down, up):
            stream.wait_event(lanes.ready)
        down.wait_event(lanes.drained)

        def fetch(i: int) -> None:
            lo, hi = bounds[i]
            k = i % _DEPTH
            if i >= _DEPTH:
                # Chunk i - DEPTH has gone up from buffer k: once chunk i is down, the
                # host may let MPI write there again.
                down.wait_event(lanes.uploaded[k])
            dev.download(a[lo:hi], sends[k * step : k * step + hi - lo], down)
            down.record(lanes.downloaded[k])

        for i in range(min(_DEPTH - 1, len(bounds))):
            fetch(i)
        ok = True
        for i, (lo, hi) in enumerate(bounds):
            k = i % _DEPTH
            send = sends[k * step : k * step + hi - lo]
            recv = recvs[k * step : k * step + hi - lo]
            dev.wait(lanes.downloaded[k], why=_STAGING_WAIT)
            exchange(send, recv, step=i + 1)
            dev.upload(recv, out[lo:hi], up)
            up.record(lanes.uploaded[k])
            if i + _DEPTH - 1 < len(bounds):
                fetch(i + _DEPTH - 1)  # its buffers' last chunk, i - 1, is going up
            ok = ok and check(recv)  # while the copies run
        # What the current stream runs next (the decode) reads out.
        dev.current_stream().wait_event(up.record(lanes.done))
        return out, ok
