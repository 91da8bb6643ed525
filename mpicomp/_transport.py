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
allocation in steady state). Traces and ``mpicomp info`` say which path is taken.
"""

from __future__ import annotations

import ctypes
import os
import re
from functools import cache

import numpy as np

#: The environment variable that overrides the detection: 1 (aware) or 0 (not).
ENV = "MPICOMP_CUDA_AWARE"

_MIN_BYTES = 1 << 16  # the smallest staging buffer
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
        ValueError: ``MPICOMP_CUDA_AWARE`` is set to something else than 0/1 (yes/no...).
    """
    raw = os.environ.get(ENV)
    if raw is not None and raw.strip():
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"{ENV} must be 0 or 1, got {raw!r}")
        return word in _TRUE, f"{ENV}={raw}"
    from mpi4py import MPI

    value, how = library_cuda_support(libmpi_path(), MPI.get_vendor()[0])
    if value is not None:
        return value, how
    for var, build in _HINTS.items():
        hint = os.environ.get(var, "").strip().lower()
        if hint in _TRUE:
            return True, f"{var}={os.environ[var]} ({build})"
    return False, f"{how}; no environment hint"


class Transport:
    """How one CompressedComm hands device bytes to MPI: ``direct`` (the device arrays
    themselves, to a CUDA-aware library, after their device work is done) or staged
    through host buffers, one per ``slot``.

    A slot's buffer is made at the first request and grows (by half again at least) when
    a larger one comes; every later call reuses it, so a training loop allocates only in
    its first steps. Buffers are pinned (page-locked)
    where the device backend can pin (``record.device.pinned``), which makes the copies
    asynchronous-capable and about twice as fast as pageable ones on a GPU.
    """

    def __init__(self, direct: bool = False):
        self.direct = bool(direct)
        self._buffers: dict[str, np.ndarray] = {}
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
        record.to_host(a, out=out, why="staging: device to host")
        return out
