"""Compile every CUDA source as CuPy compiles it, and with nvcc, without a GPU.

- NVRTC through CuPy's own ``compile_with_cache`` with the modules' options, for an explicit
  architecture. CuPy asks the device for its architecture first, which fails without a
  GPU: that one query (``cupy.cuda.compiler._get_arch_for_options_for_nvrtc``, a private
  function, hence the pinned CuPy version in setup.py) is replaced; the cubin is built and
  only loading it fails. NVRTC rejects ``-Werror``, so any warning in its log is an error.
- ``nvcc -cubin -Werror all-warnings -Xptxas -v``: an error on any warning, and on any
  register spill ptxas reports.

``python -m mpicomp.kernels.cuda.compile_check [--arch 80 90] [family ...]``; the tests
(tests/test_cuda_build.py) call ``nvrtc`` and ``nvcc`` for every family and architecture.
"""

from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import shutil
import subprocess
import sys

from mpicomp.kernels.cuda import device

#: Architectures checked by default: A100 (sm_80) and H100/H200 (sm_90).
ARCHS = ("80", "90")

_IN_MEMORY = "CUPY_CACHE_IN_MEMORY"
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


class CompileFailed(RuntimeError):
    """A source did not compile cleanly; the message holds the compiler's log."""


def families() -> list[str]:
    """Return the families with a CUDA source (``kernels/cuda/<family>.cu``)."""
    return sorted(p.stem for p in device.SOURCES.glob("*.cu"))


def family_options(family: str) -> tuple[str, ...]:
    """Return the options the family's launchers build with (its ``DEFINES`` included)."""
    try:
        module = importlib.import_module(f"mpicomp.kernels.cuda.{family}")
    except ImportError:
        module = None
    return device.options(family, getattr(module, "DEFINES", None))


def nvrtc(family: str, arch: str = "90") -> None:
    """Compile ``family`` through CuPy's NVRTC path for ``sm_<arch>``.

    Raises:
        CompileFailed: an error or a warning (the log).
        ImportError: CuPy is not installed (``pip install mpicomp[cuda-compile]``).
    """
    from cupy._core import core
    from cupy.cuda import compiler

    def explicit_arch(arch=None):
        return f"-arch=sm_{arch}", "cubin"

    log = io.StringIO()
    saved = compiler._get_arch_for_options_for_nvrtc
    compiler._get_arch_for_options_for_nvrtc = explicit_arch
    in_memory = os.environ.get(_IN_MEMORY)
    # A cubin from CuPy's disk cache would be loaded without compiling: no log to read.
    os.environ[_IN_MEMORY] = "1"
    try:
        core.compile_with_cache(
            device.source(family),
            options=family_options(family),
            arch=arch,
            prepend_cupy_headers=False,
            log_stream=log,
        )
    except compiler.CompileException as e:
        raise CompileFailed(f"NVRTC sm_{arch}, {family}.cu:\n{e}") from None
    except Exception:  # the cubin was built; loading it needs a driver
        pass
    finally:
        compiler._get_arch_for_options_for_nvrtc = saved
        if in_memory is None:
            os.environ.pop(_IN_MEMORY, None)
        else:
            os.environ[_IN_MEMORY] = in_memory
    if "warning" in log.getvalue():
        raise CompileFailed(f"NVRTC sm_{arch}, {family}.cu warns:\n{log.getvalue()}")


def nvcc(family: str, arch: str = "90") -> str:
    """Compile ``family`` with ``nvcc -cubin`` for ``sm_<arch>``; return ptxas's report.

    Raises:
        CompileFailed: an error, a warning or a register spill.
        FileNotFoundError: no nvcc on PATH.
    """
    exe = shutil.which("nvcc")
    if exe is None:
        raise FileNotFoundError("nvcc is not on PATH")
    opts = [o for o in family_options(family) if not o.startswith("--std")]
    cmd = [exe, f"-arch=sm_{arch}", "-cubin", "-std=c++17", *opts]
    cmd += ["-Werror", "all-warnings", "-Xptxas", "-v", "-o", os.devnull]
    done = subprocess.run(
        [*cmd, str(device.SOURCES / f"{family}.cu")], capture_output=True, text=True
    )
    report = done.stdout + done.stderr
    if done.returncode:
        raise CompileFailed(f"nvcc sm_{arch}, {family}.cu:\n{report}")
    if any(int(m[1]) or int(m[2]) for m in _SPILLS.finditer(report)):
        raise CompileFailed(f"nvcc sm_{arch}, {family}.cu spills registers:\n{report}")
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("families", nargs="*", help="default: every kernels/cuda/*.cu")
    parser.add_argument("--arch", nargs="+", default=list(ARCHS))
    args = parser.parse_args(argv)
    failed = 0
    for family in args.families or families():
        for arch in args.arch:
            for check in (nvrtc, nvcc):
                try:
                    check(family, arch)
                    print(f"{family}.cu sm_{arch} {check.__name__}: ok")
                except (CompileFailed, FileNotFoundError, ImportError) as e:
                    failed += 1
                    print(f"{family}.cu sm_{arch} {check.__name__}: {e}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
