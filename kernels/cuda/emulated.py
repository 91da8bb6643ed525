"""Run mpicomp's CUDA sources on the CPU: ``RawModule`` and ``RawKernel`` as in CuPy, on NumPy.

``RawModule(code=src, options=...)`` compiles ``src`` with g++ (C++20, ``-ffp-contract=off``)
and ``emulated.h`` force-included, which maps CUDA's built-ins to C++ threads (one
``std::thread`` per CUDA thread, blocks one after another). ``get_function(name)`` returns a
kernel called like ``cupy.RawKernel``: ``kernel(grid, block, args, shared_mem=0)``, with
NumPy arrays for pointers and NumPy scalars (exactly the parameter's size) for values.
Launch geometry is checked against a GPU's limits; a barrier that cannot complete raises
``EmulatedLaunchError`` naming the kernel and the line.

Built libraries are cached under ``MPICOMP_EMULATED_CACHE`` (default
``~/.cache/mpicomp/cuda-emulated``), keyed by a hash of the source, the header, the
``.cuh`` headers of its include path and the flags, so each module compiles once per
machine and again when any of them changes. ``MPICOMP_EMULATED_SANITIZE`` set to
``thread``, ``address`` or ``undefined`` builds with that sanitizer (``make
test-sanitize``; the process must preload the sanitizer's runtime). Each launch reads
``MPICOMP_EMULATED_NO_FTZ`` (on: keep float32 denormals) and ``MPICOMP_EMULATED_TIMEOUT``
(seconds a barrier waits, default 10) and hands them to the library.

Why by hand: no library runs CUDA C++ on a CPU with real threads per CUDA thread and
barrier checks (the CUDA toolkit's own emulation left years ago); this is about 300 lines.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from mpicomp.env import env_flag

HEADER = Path(__file__).with_name("emulated.h")

#: g++ flags of every build: no contraction into FMA (NVRTC builds with --fmad=false).
CXXFLAGS = (
    "-std=c++20",
    "-O1",
    "-g",
    "-fPIC",
    "-shared",
    "-pthread",
    "-ffp-contract=off",
    "-fno-fast-math",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
)

SANITIZE_ENV = "MPICOMP_EMULATED_SANITIZE"
SANITIZERS = ("thread", "address", "undefined")
CACHE_ENV = "MPICOMP_EMULATED_CACHE"
#: On: float32 denormals are kept (a GPU under CuPy flushes them, and so does the default).
NO_FTZ_ENV = "MPICOMP_EMULATED_NO_FTZ"
#: Seconds a barrier of an emulated launch waits before the launch fails (default 10).
TIMEOUT_ENV = "MPICOMP_EMULATED_TIMEOUT"
TIMEOUT_S = 10

# GPU limits a launch must respect (compute capability 8.0 and later).
MAX_THREADS = 1024
MAX_BLOCK = (1024, 1024, 64)
MAX_GRID = (2**31 - 1, 65535, 65535)
MAX_SHARED = 48 * 1024  # dynamic shared memory without opting in (CuPy's default)

_KERNEL = re.compile(
    r'extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+(\w+)\s*\('
)
_DYNAMIC_SHARED = re.compile(
    r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w\s]+?)\s+(\w+)\s*\[\s*\]\s*;"
)
# Launches of one process run one at a time: `__shared__` storage is static.
_LAUNCH = threading.Lock()


class EmulatedLaunchError(RuntimeError):
    """A launch failed: bad geometry, or a barrier that could not complete."""


class CompileError(RuntimeError):
    """g++ refused a source; the message holds its diagnostics."""


def _headers(flags) -> list[Path]:
    """Return the ``.cuh`` headers of the ``-I`` folders in ``flags``, in a fixed order."""
    dirs = [Path(f[2:]) for f in flags if f.startswith("-I")]
    return sorted(h for d in dirs for h in d.glob("*.cuh"))


def cache_dir() -> Path:
    """Return where built modules are kept (``MPICOMP_EMULATED_CACHE``)."""
    root = os.environ.get(CACHE_ENV)
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "mpicomp/cuda-emulated"


def _flags(options) -> list[str]:
    """Return the g++ flags: the fixed ones, the sanitizer's, and ``-I``/``-D`` of ``options``."""
    flags = list(CXXFLAGS)
    sanitize = os.environ.get(SANITIZE_ENV, "")
    if sanitize:
        if sanitize not in SANITIZERS:
            raise ValueError(f"{SANITIZE_ENV} must be one of {SANITIZERS}, got {sanitize!r}")
        flags += [f"-fsanitize={sanitize}", "-fno-omit-frame-pointer"]
        if sanitize == "undefined":
            flags.append("-fno-sanitize-recover=all")
    for opt in options:  # NVRTC options that mean something to g++ too
        if opt.startswith(("-I", "-D")):
            flags.append(opt)
    return flags


class RawKernel:
    """One ``extern "C" __global__`` function of a ``RawModule``, launched like CuPy's."""

    def __init__(self, lib, name: str):
        self.name = name
        self._launch = getattr(lib, f"emu_launch_{name}")
        self._launch.restype = ctypes.c_int
        self._launch.argtypes = [ctypes.c_uint] * 6 + [
            ctypes.c_size_t,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self.nargs = getattr(lib, f"emu_nargs_{name}")()
        size, kind = getattr(lib, f"emu_argsize_{name}"), getattr(lib, f"emu_argkind_{name}")
        size.restype = ctypes.c_size_t
        kind.restype = ctypes.c_char
        self._sizes = [size(i) for i in range(self.nargs)]
        self._kinds = [kind(i).decode() for i in range(self.nargs)]

    def __call__(self, grid, block, args, *, shared_mem: int = 0) -> None:
        grid, block = _dims(grid, "grid"), _dims(block, "block")
        self._check_geometry(grid, block, shared_mem)
        if len(args) != self.nargs:
            raise TypeError(
                f"{self.name}: {len(args)} arguments given, the kernel takes {self.nargs}"
            )
        keep, pointers = [], (ctypes.c_void_p * max(self.nargs, 1))()
        for i, a in enumerate(args):
            if self._kinds[i] == "p":
                if not isinstance(a, np.ndarray):
                    raise TypeError(
                        f"{self.name}: argument {i} is a pointer: pass an array, not {a!r}"
                    )
                if not a.flags.c_contiguous:
                    raise ValueError(f"{self.name}: argument {i} must be C-contiguous")
                buf = ctypes.c_void_p(a.ctypes.data)
            else:
                if not isinstance(a, np.generic):
                    raise TypeError(
                        f"{self.name}: argument {i} must be a NumPy scalar of the parameter's "
                        f"type ({self._sizes[i]} bytes), not {type(a).__name__}"
                    )
                kind = "f" if np.issubdtype(a.dtype, np.floating) else "i"
                if a.itemsize != self._sizes[i] or kind != self._kinds[i]:
                    raise TypeError(
                        f"{self.name}: argument {i} is {a.dtype}, the parameter is "
                        f"{'a float' if self._kinds[i] == 'f' else 'an integer'} of "
                        f"{self._sizes[i]} bytes"
                    )
                buf = ctypes.create_string_buffer(a.tobytes(), a.itemsize)
            keep.append(buf)
            pointers[i] = ctypes.addressof(buf)
        ftz, timeout_s = not env_flag(NO_FTZ_ENV), barrier_timeout()
        error = ctypes.create_string_buffer(1024)
        with _LAUNCH:
            failed = self._launch(
                *grid, *block, shared_mem, pointers, ftz, timeout_s, error, len(error)
            )
        if failed:
            raise EmulatedLaunchError(error.value.decode(errors="replace"))

    def _check_geometry(self, grid, block, shared_mem) -> None:
        threads = block[0] * block[1] * block[2]
        bad = (
            threads == 0
            or threads > MAX_THREADS
            or any(b > m for b, m in zip(block, MAX_BLOCK, strict=True))
            or 0 in grid
            or any(g > m for g, m in zip(grid, MAX_GRID, strict=True))
        )
        if bad:
            raise EmulatedLaunchError(
                f"{self.name}: invalid launch, grid {grid} block {block} (at most "
                f"{MAX_THREADS} threads a block, block {MAX_BLOCK}, grid {MAX_GRID})"
            )
        if not 0 <= shared_mem <= MAX_SHARED:
            raise EmulatedLaunchError(
                f"{self.name}: {shared_mem} bytes of dynamic shared memory (at most {MAX_SHARED})"
            )


def barrier_timeout() -> int:
    """Return the seconds a barrier waits: ``MPICOMP_EMULATED_TIMEOUT``, else ``TIMEOUT_S``.

    Raises:
        ValueError: the variable is not a whole number of seconds >= 1.
    """
    raw = os.environ.get(TIMEOUT_ENV, "").strip()
    if not raw:
        return TIMEOUT_S
    if not raw.isdigit() or not 1 <= int(raw) < 2**31:
        raise ValueError(f"{TIMEOUT_ENV} must be a whole number of seconds >= 1, got {raw!r}")
    return int(raw)


def _dims(value, what: str) -> tuple[int, int, int]:
    dims = (value,) if isinstance(value, (int, np.integer)) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, (int, np.integer)) for d in dims):
        raise TypeError(f"{what} must be an int or up to 3 ints, got {value!r}")
    return tuple(int(d) for d in dims) + (1,) * (3 - len(dims))


class RawModule:
    """CUDA source compiled for the CPU; ``get_function(name)`` as ``cupy.RawModule``'s."""

    def __init__(self, code: str, options=(), name: str = "module"):
        self.name = name
        self.kernels = _KERNEL.findall(code)
        # `extern __shared__ T x[];` becomes a pointer to the launch's dynamic buffer.
        source = _DYNAMIC_SHARED.sub(
            lambda m: f"{m.group(1)}* {m.group(2)} = ({m.group(1)}*)::emu::dyn_smem();", code
        )
        exports = "".join(f"MPICOMP_EMULATED_EXPORT({k})\n" for k in self.kernels)
        # Diagnostics and barrier errors cite the .cu file's own lines.
        source = f'#line 1 "{name}.cu"\n{source}\n{exports}'
        flags = _flags(options)
        # The headers the source may include (common.cuh) are part of what it builds from.
        included = [h.read_text() for h in _headers(flags)]
        key = hashlib.sha256(
            "\0".join(
                [source, HEADER.read_text(), *included, *flags, shutil.which("g++") or ""]
            ).encode()
        ).hexdigest()[:20]
        self.path = cache_dir() / f"{name}-{key}.so"
        if not self.path.exists():
            _build(source, flags, self.path, name)
        self._lib = ctypes.CDLL(str(self.path))
        self._functions = {}

    def get_function(self, name: str) -> RawKernel:
        if name not in self.kernels:
            raise AttributeError(f"{self.name}: no kernel {name!r} (has {self.kernels})")
        if name not in self._functions:
            self._functions[name] = RawKernel(self._lib, name)
        return self._functions[name]


def _build(source: str, flags: list[str], path: Path, name: str) -> None:
    """Compile ``source`` into ``path``; concurrent builders each write their own temporary."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        cu = Path(tmp) / f"{name}.cu"
        cu.write_text(source)
        out = Path(tmp) / path.name
        cmd = ["g++", *flags, "-include", str(HEADER), "-x", "c++", str(cu), "-o", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise CompileError(f"g++ could not build {name} for cuda-emulated:\n{done.stderr}")
        os.replace(out, path)
