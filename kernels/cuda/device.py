"""Where the CUDA sources run, and how they are built: ``Device``.

A ``Device`` is a GPU through CuPy (``Device.cuda()``: ``cupy.RawModule``, one build per
family and GPU) or the CPU through ``kernels/cuda/emulated.py`` (``Device.emulated()``:
the same source compiled by g++). The launchers of ``kernels/cuda/<family>.py`` are
written once against it: ``dev.xp`` allocates, ``dev.kernel(family, name)`` returns a
kernel called as ``kernel(grid, block, args, shared_mem=0)``, ``dev.grid(n)`` sizes a
grid-stride launch (``dev.launch_shape(n)`` its ``(grid, block)``, ``dev.tile_shape(n)``
that of a block per tile), ``dev.flat(a)`` makes an input one flat array the kernels read
through a pointer, and ``dev.to_host(a, why=...)`` brings a device array to the host,
counted in ``dev.syncs`` and, under its name, in ``dev.sync_reasons`` (the host
synchronizations a launcher makes are part of its contract).

Copies that overlap other work (the staging pipeline of ``mpicomp/reduction/transport.py``) go
through ``dev.stream()``, ``dev.event()``, ``dev.download``/``dev.upload`` (asynchronous,
on a stream) and ``dev.wait(event, why=...)`` (the host waits: counted as ``to_host`` is).
On a GPU they are CUDA streams, events and ``cudaMemcpyAsync``; a device that computes on
the host (the emulation, the tests' stand-ins) has ``HostStreams``, whose copies run when
issued.

Every build uses the same options (``options(family)``): NVRTC's ``--fmad=false`` (no
``x*s+0.5f`` fused into one FMA: the numba twins round twice), C++17, the include path
of ``common.cuh``, and the shared constants of ``kernels/<family>.py`` as ``-D`` macros
(``defines``), so each lives once. CuPy appends ``-ftz=true``; the emulation flushes
float32 denormals too.
"""

from __future__ import annotations

import threading
from collections import Counter
from contextlib import nullcontext
from functools import cache
from pathlib import Path

import numpy as np

from mpicomp.kernels import rng

SOURCES = Path(__file__).parent

#: NVRTC options of every module (the emulated build takes the -I and -D ones).
BASE_OPTIONS = ("--std=c++17", "--fmad=false", f"-I{SOURCES}")


def defines() -> dict[str, str]:
    """Return the macros every module gets: the constants shared with the numba twins."""
    return {
        "MPICOMP_RNG_GOLDEN": f"{rng.GOLDEN:#x}ull",
        "MPICOMP_RNG_M1": f"{rng.M1:#x}ull",
        "MPICOMP_RNG_M2": f"{rng.M2:#x}ull",
    }


def source(family: str) -> str:
    """Return the CUDA source of ``family`` (``kernels/cuda/<family>.cu``)."""
    return (SOURCES / f"{family}.cu").read_text()


def options(family: str, extra: dict[str, str] | None = None) -> tuple[str, ...]:
    """Return the compile options of ``family``: ``BASE_OPTIONS`` and its ``-D`` macros."""
    macros = {**defines(), **(extra or {})}
    return BASE_OPTIONS + tuple(f"-D{k}={v}" for k, v in sorted(macros.items()))


def int_kind(a, what: str) -> np.int32:
    """Return the code of integer array ``a``'s dtype that ``common.cuh``'s
    ``mpicomp_load_int``/``mpicomp_store_int`` take: log2(itemsize) | 4 if unsigned (bool
    as uint8).

    Raises:
        TypeError: ``a`` is not an integer (or bool) array; the message starts with ``what``.
    """
    dt = np.dtype(a.dtype)
    if dt == np.bool_:
        dt = np.dtype(np.uint8)
    if dt.kind not in "iu":
        raise TypeError(f"{what}: need an integer array, got {dt}")
    return np.int32(int(dt.itemsize).bit_length() - 1 | (4 if dt.kind == "u" else 0))


class Device:
    """A place to run the CUDA sources: ``name``, ``xp``, launch geometry and builds.

    Args:
        name: ``"cuda"`` or ``"cuda-emulated"``.
        xp: the array module of its arrays (CuPy, or NumPy).
        threads: threads per block of the launchers' kernels (a multiple of 32).
        max_blocks: the most blocks of a grid-stride launch.
        build: ``build(family, code, options)`` returning a module with ``get_function``.
        synchronize: waits until the device has run every launch made (benchmarks call
            it; launches on the emulated device return when they are done).
        pinned: ``pinned(nbytes)`` returns a page-locked host buffer of ``nbytes`` bytes
            (uint8) for staging copies; default an ordinary NumPy array.
        current: ``current()`` returns the id of the GPU launches go to now (CuPy's
            current device); default 0.
        on: ``on(gpu)`` returns a context manager inside which launches and allocations
            go to GPU ``gpu`` (``cupy.cuda.Device(gpu)``); default one that does nothing.
        streams: what ``stream``, ``event``, ``download``, ``upload`` and ``wait`` run on:
            ``CudaStreams()`` on a GPU; default ``HostStreams()``.
    """

    def __init__(
        self,
        name: str,
        xp,
        threads: int,
        max_blocks: int,
        build,
        synchronize=None,
        pinned=None,
        current=None,
        on=None,
        streams=None,
    ):
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"threads must be a multiple of 32 in [32, 1024], got {threads}")
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.name = name
        self.xp = xp
        self.threads = threads
        self.max_blocks = max_blocks
        self.syncs = 0  # host synchronizations made through to_host
        self.sync_reasons = Counter()  # the same, by the name each read gives
        self._build = build
        self.synchronize = synchronize or (lambda: None)
        self.pinned = pinned or (lambda nbytes: np.empty(nbytes, np.uint8))
        self.current = current or (lambda: 0)
        self.on = on or (lambda gpu: nullcontext())
        self.streams = streams or HostStreams()
        self._modules = {}
        self._lock = threading.Lock()

    @classmethod
    def emulated(cls, threads: int = 64, max_blocks: int = 4) -> Device:
        """Return the CPU device: the CUDA sources built by g++ (small default geometry:
        every CUDA thread is an OS thread)."""
        return cls("cuda-emulated", np, threads, max_blocks, _emulated_build)

    @classmethod
    def cuda(cls, threads: int = 256, blocks_per_sm: int = 4) -> Device:
        """Return the current GPU through CuPy (modules built once per GPU and family)."""
        import cupy

        sms = cupy.cuda.Device().attributes["MultiProcessorCount"]

        def build(family, code, opts):
            return cupy.RawModule(code=code, options=opts)

        def per_gpu(family, code, opts):
            return _gpu_build(cupy.cuda.Device().id, family, code, opts, build)

        def pinned(nbytes):
            memory = cupy.cuda.alloc_pinned_memory(nbytes)
            return np.frombuffer(memory, np.uint8, nbytes)  # keeps ``memory`` alive

        return cls(
            "cuda",
            cupy,
            threads,
            blocks_per_sm * sms,
            per_gpu,
            lambda: cupy.cuda.Device().synchronize(),
            pinned,
            cupy.cuda.runtime.getDevice,
            cupy.cuda.Device,  # a new one per use: its context stack is not thread-safe
            CudaStreams(),
        )

    def kernel(self, family: str, name: str, extra: dict[str, str] | None = None):
        """Return kernel ``name`` of ``family``'s module, built at first use."""
        opts = options(family, extra)
        at = (self.current(), family, opts)  # a module per GPU: kernels run where built
        with self._lock:
            module = self._modules.get(at)
            if module is None:
                module = self._modules[at] = self._build(family, source(family), opts)
        return module.get_function(name)

    def grid(self, n: int) -> int:
        """Return the blocks of a grid-stride launch over ``n`` items."""
        return int(max(1, min(self.max_blocks, -(-int(n) // self.threads))))

    def launch_shape(self, n: int) -> tuple[tuple[int], tuple[int]]:
        """Return the ``(grid, block)`` of a grid-stride launch over ``n`` items."""
        return (self.grid(n),), (self.threads,)

    def tile_shape(self, ntiles: int) -> tuple[tuple[int], tuple[int]]:
        """Return the ``(grid, block)`` of a grid-stride launch of a block per tile."""
        return (int(max(1, min(self.max_blocks, ntiles))),), (self.threads,)

    def flat(self, a, view=None, *, codes: bool = False):
        """Return ``a`` as a 1-D C-contiguous array of this device (copied only where it is
        not one), viewed as dtype ``view`` when given.

        ``codes``: ``a`` holds integer codes, and a bool array is viewed as uint8 (as
        ``int_kind`` reads it).
        """
        a = self.xp.ascontiguousarray(a).reshape(-1)
        if codes and a.dtype == np.bool_:
            return a.view(np.uint8)
        return a if view is None else a.view(view)

    def to_host(self, a, out: np.ndarray | None = None, *, why: str = "unnamed") -> np.ndarray:
        """Return device array ``a`` on the host (in ``out`` when given, of ``a``'s shape
        and dtype): one synchronization, counted in ``syncs`` and under ``why`` (what the
        value is, e.g. ``"checksum.adler32: block sums"``) in ``sync_reasons``."""
        self.syncs += 1
        self.sync_reasons[why] += 1
        if hasattr(a, "get"):
            return a.get(out=out)
        if out is None:
            return np.asarray(a)
        np.copyto(out, a)
        return out

    def stream(self):
        """Return a new stream for copies that overlap the current stream's work."""
        return self.streams.stream()

    def current_stream(self):
        """Return the stream launches go to now (CuPy's current stream)."""
        return self.streams.current()

    def event(self):
        """Return a new event (``stream.record(event)`` marks a point of a stream;
        ``other.wait_event(event)`` orders another stream's later work after it)."""
        return self.streams.event()

    def download(self, a, out: np.ndarray, stream) -> None:
        """Start copying contiguous device array ``a`` into host array ``out`` (pinned, of
        ``a``'s size and dtype) on ``stream``: ``out`` holds it once an event recorded
        on ``stream`` after this has happened (``wait``)."""
        self.streams.download(a, out, stream)

    def upload(self, host: np.ndarray, out, stream) -> None:
        """Start copying host array ``host`` (pinned) into contiguous device array
        ``out`` on ``stream``: ``host`` must not change until an event recorded on
        ``stream`` after this has happened."""
        self.streams.upload(host, out, stream)

    def wait(self, event, *, why: str = "unnamed") -> None:
        """Block the host until ``event`` has happened: one synchronization, counted in
        ``syncs`` and ``sync_reasons`` as ``to_host``'s are (a download the host then
        reads is a read from the device)."""
        self.syncs += 1
        self.sync_reasons[why] += 1
        event.synchronize()


class HostEvent:
    """The event of a ``HostStream``: its work ran when issued, so it has always happened."""

    done = True

    def synchronize(self) -> None:
        return None


class HostStream:
    """A stream of a device that computes on the host: work runs when it is issued."""

    def submit(self, work) -> None:
        work()

    def record(self, event=None):
        return event if event is not None else HostEvent()

    def wait_event(self, event) -> None:
        return None

    def synchronize(self) -> None:
        return None


class HostStreams:
    """Streams, events and copies of a device whose arrays live in host memory (the
    emulation's NumPy arrays, the tests' stand-ins): every copy runs when issued, through
    the array's own ``get``/``set`` where it has them (as ``to_host`` reads)."""

    _current = HostStream()

    def stream(self) -> HostStream:
        return HostStream()

    def current(self) -> HostStream:
        return self._current

    def event(self) -> HostEvent:
        return HostEvent()

    def download(self, a, out: np.ndarray, stream) -> None:
        stream.submit(lambda: a.get(out=out) if hasattr(a, "get") else np.copyto(out, a))

    def upload(self, host: np.ndarray, out, stream) -> None:
        stream.submit(lambda: out.set(host) if hasattr(out, "set") else np.copyto(out, host))


class CudaStreams:
    """CUDA streams (non-blocking: they do not wait for the legacy default stream),
    events without timing, and ``cudaMemcpyAsync`` between device and pinned host memory
    (asynchronous to the host only where the host side is pinned)."""

    def stream(self):
        import cupy

        return cupy.cuda.Stream(non_blocking=True)

    def current(self):
        import cupy

        return cupy.cuda.get_current_stream()

    def event(self):
        import cupy

        return cupy.cuda.Event(disable_timing=True)

    def download(self, a, out: np.ndarray, stream) -> None:
        from cupy.cuda import runtime

        _check_copy(a, out)
        runtime.memcpyAsync(
            out.ctypes.data, a.data.ptr, a.nbytes, runtime.memcpyDeviceToHost, stream.ptr
        )

    def upload(self, host: np.ndarray, out, stream) -> None:
        from cupy.cuda import runtime

        _check_copy(out, host)
        runtime.memcpyAsync(
            out.data.ptr, host.ctypes.data, host.nbytes, runtime.memcpyHostToDevice, stream.ptr
        )


def _check_copy(device_array, host: np.ndarray) -> None:
    # A raw copy of bytes: both sides contiguous and of one size, or memory is overrun.
    if not (device_array.flags.c_contiguous and host.flags.c_contiguous):
        raise ValueError("an asynchronous copy needs C-contiguous arrays")
    if device_array.nbytes != host.nbytes:
        raise ValueError(f"copy of {device_array.nbytes} bytes into {host.nbytes}")


@cache
def _emulated_build(family: str, code: str, opts: tuple):
    """Build ``family`` for the CPU once per process (and once per machine on disk)."""
    from mpicomp.kernels.cuda import emulated

    return emulated.RawModule(code, opts, name=family)


@cache
def _gpu_build(device_id: int, family: str, code: str, opts: tuple, build):
    return build(family, code, opts)
