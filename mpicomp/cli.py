"""The ``mpicomp`` command: ``info``, ``bench``, ``advise``, ``trace summary`` and ``trace plot``."""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import mpicomp
from mpicomp import _transport, bench


def main(argv: list[str] | None = None) -> int:
    """Run the ``mpicomp`` command line; return its exit status (2 for bad arguments)."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        return args.run(args, parser)
    except SystemExit as e:  # usage errors and --help: a status, not an exception
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C in a long bench: the shell's status, no traceback
        print("mpicomp: interrupted", file=sys.stderr)
        return 130


# -- arguments -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpicomp",
        description="Compressed gradient all-reduce over MPI: environment, benchmarks, traces.",
    )
    parser.add_argument("--version", action="version", version=f"mpicomp {mpicomp.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "info",
        help="versions, the MPI library in use, CUDA-aware MPI, GPUs, backends, codecs",
        description="Print what mpicomp runs on: versions, the MPI library mpi4py loaded, "
        "CUDA-aware MPI, GPUs, backends and codecs.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument(
        "--all-ranks",
        action="store_true",
        help="under mpiexec/srun: also one line per rank (host, local rank, CPU affinity, "
        "visible GPUs, the MPI library, CUDA-aware MPI, kernel backend, numba threads), "
        "then warnings about settings that cost speed; rank 0 prints",
    )
    p.set_defaults(run=_cmd_info)

    p = sub.add_parser(
        "bench",
        help="codec throughput beside memcpy, and compressed all-reduce against MPI_Allreduce",
        description="Encode and decode throughput (GB/s of float32 input) of each codec on "
        "one gradient-shaped tensor beside np.copyto of the same buffer, the bits per element "
        "one rank sends, then CompressedComm.allreduce against MPI_Allreduce of float32 on "
        "MPI.COMM_WORLD (launch with mpiexec/srun for more than one rank), with its "
        "encode/exchange/decode split; both on --backend's arrays. Medians of --reps "
        "after a warm-up; the kernels are timed on rank 0 alone.",
    )
    p.add_argument(
        "--codecs",
        type=_codec_list,
        default=None,
        metavar="NAMES",
        help="comma-separated codec names (default: all; see `mpicomp info`)",
    )
    p.add_argument(
        "--numel",
        type=_positive_count,
        default=None,
        metavar="N",
        help="elements of the gradient; suffixes K, M, G (default: 25.6M, ResNet-50's "
        "gradient, for the kernels; also the all-reduce size when --sizes is not given)",
    )
    p.add_argument(
        "--sizes",
        type=_count_list,
        default=None,
        metavar="N,N",
        help="all-reduce sizes (default: 1M,25.6M, or --numel when given)",
    )
    p.add_argument(
        "--reps", type=_positive_count, default=5, metavar="R", help="timed repetitions (5)"
    )
    p.add_argument(
        "--allreduce-reps",
        type=_positive_count,
        default=3,
        metavar="R",
        help="timed all-reduces per codec and size (3)",
    )
    p.add_argument("--no-kernels", action="store_true", help="skip the encode/decode timings")
    p.add_argument("--no-allreduce", action="store_true", help="skip the all-reduce timings")
    p.add_argument(
        "--trace", metavar="DIR", default=None, help="write an HDF5 trace per codec and size"
    )
    p.add_argument(
        "--tc-dev",
        metavar="DEV[,DEV...]",
        default=None,
        help="also count the bytes these devices' root qdiscs sent (tc -s qdisc) per "
        "all-reduce, summed; NETNS/DEV names one in another network namespace",
    )
    p.add_argument(
        "--schedules",
        type=_schedule_list,
        default=None,
        metavar="NAMES|all",
        help="the all-reduce schedules each codec runs (CompressedComm(schedule=...)): "
        "'all' its every one, or names among ring, direct, allgather, sharded, allreduce "
        "(default: its default; a codec with none of the names runs its default)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the gradient (0)")
    p.add_argument(
        "--backend",
        metavar="NAME",
        default=None,
        help="kernel backend of the encode/decode timings and of the all-reduces: numba, "
        "cuda (CuPy arrays on the current GPU: kernels beside a device-to-device copy, "
        "all-reduces of device arrays against MPI_Allreduce of the same buffer, staged and, "
        "where MPI is CUDA-aware, direct) or cuda-emulated (default: MPICOMP_KERNELS, else "
        "numba)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print a JSON list of rows (one per codec and backend) alone on stdout",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.set_defaults(run=_cmd_bench)

    p = sub.add_parser(
        "advise",
        help="for a link bandwidth, which codecs pay (paper 002 Eq. 4, measured kernels)",
        description="Paper 002's Eq. 4 with measured encode/decode throughput: the smallest "
        "compression ratio that pays on a link, whether each codec reaches it, the modelled "
        "all-reduce speedup at --ranks, and the link rate below which each codec is faster. "
        "Kernel figures come from --bench (a `mpicomp bench --json` file) or are measured now.",
    )
    p.add_argument("bandwidth", help="each rank's link: 1gbit, 10gbit, 100mbit, ...")
    p.add_argument("--ranks", type=_positive_count, default=4, metavar="N", help="ranks (4)")
    p.add_argument("--bench", metavar="FILE", default=None, help="`mpicomp bench --json` output")
    p.add_argument("--codecs", type=_codec_list, default=None, metavar="NAMES", help="codecs (all)")
    p.add_argument(
        "--numel",
        type=_positive_count,
        default=25_600_000,
        metavar="N",
        help="gradient size when measuring now (25.6M)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list alone on stdout")
    p.set_defaults(run=_cmd_advise)

    p = sub.add_parser("trace", help="read an HDF5 trace written by CompressedComm(trace=...)")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    t = tsub.add_parser("summary", help="print a table of a trace", description="Print a table.")
    t.add_argument("file", metavar="FILE", help="an HDF5 trace file")
    t.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object ({"run": attributes, "rows": one per codec and tensor})',
    )
    t.set_defaults(run=_cmd_trace_summary, sub_parser=t)
    t = tsub.add_parser("plot", help="draw a trace to an image", description="Draw a trace.")
    t.add_argument("file", metavar="FILE", help="an HDF5 trace file")
    t.add_argument(
        "-o", "--output", metavar="OUT", help="image file to write (default: FILE with .png)"
    )
    t.set_defaults(run=_cmd_trace_plot, sub_parser=t)
    t = tsub.add_parser(
        "export",
        help="write a trace as a timeline (Chrome/Perfetto JSON)",
        description="Write a trace as a timeline that ui.perfetto.dev or chrome://tracing "
        "opens: one process per rank; calls, their phases and (level 2) exchange steps.",
    )
    t.add_argument("file", metavar="FILE", help="an HDF5 trace file (format 2)")
    t.add_argument("--format", default="chrome", choices=["chrome"], help="output format")
    t.add_argument("-o", "--output", metavar="OUT", help="file to write (default: FILE with .json)")
    t.set_defaults(run=_cmd_trace_export, sub_parser=t)
    return parser


def _positive_count(text: str) -> int:
    try:
        value = bench.parse_count(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a whole number >= 1 (suffixes K, M, G allowed), got {text!r}"
        )
    return value


def _count_list(text: str) -> list[int]:
    try:
        counts = [bench.parse_count(t) for t in text.split(",") if t.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, got {text!r}")
    return counts


def _codec_list(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no codec names in {text!r}")
    known = mpicomp.codecs.available()
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"unknown codec {name!r}; available: {', '.join(known)}"
            )
    return names


def _schedule_list(text: str):
    if text.strip() == "all":
        return "all"
    from mpicomp.options import SCHEDULES

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = sorted({n for group in SCHEDULES.values() for n in group})
    for name in names or [""]:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"unknown schedule {name!r}; 'all' or names among: {', '.join(known)}"
            )
    return names


# -- info ----------------------------------------------------------------------------


def info() -> dict[str, str]:
    """Return what ``mpicomp info`` prints, as an ordered {field: text} dict.

    Initializes MPI (through ``mpi4py.MPI``) if it is not initialized yet.
    """
    import numba
    import numpy
    from mpi4py import MPI

    out = {"mpicomp": mpicomp.__version__, "python": platform.python_version()}
    out["numpy"] = numpy.__version__
    out["numba"] = numba.__version__
    out["mpi4py"] = _version("mpi4py")
    out["h5py"] = _version("h5py")
    vendor, vversion = MPI.get_vendor()
    # Open MPI's string ends in a NUL; MPICH pads with runs of spaces.
    text = MPI.Get_library_version().replace("\0", "").strip()
    out["MPI library"] = " ".join(text.splitlines()[0].split())
    out["MPI vendor"] = f"{vendor} {'.'.join(map(str, vversion))}"
    out["MPI standard"] = "{}.{}".format(*MPI.Get_version())
    libpath = _transport.libmpi_path()
    out["MPI library file"] = libpath or "unknown"
    out["mpi4py ABI"] = _mpi4py_abi(MPI)
    out["MPI world size"] = str(MPI.COMM_WORLD.size)
    out["MPI CUDA support"] = _transport.describe(_transport.library_cuda_support(libpath, vendor))
    try:
        aware, how = _transport.cuda_aware()
        path = "handed to MPI directly" if aware else "staged through host memory"
        decided = f"{'yes' if aware else 'no'} ({how}); device arrays are {path}"
    except ValueError as e:  # a bad MPICOMP_CUDA_AWARE: info still reports the rest
        decided = f"unknown ({e})"
    out["CUDA-aware MPI"] = decided
    out["GPUs"] = _gpus()
    out["backends"] = _backends(numba.config.NUMBA_NUM_THREADS)
    out["codecs"] = ", ".join(mpicomp.codecs.available())
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
            threads = f"; {numba_threads} threads" if name == "numba" else ""
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
    except Exception as e:  # CUDARuntimeError and friends: no driver, no device
        return f"none (CuPy {cupy.__version__}: {e})"
    if n == 0:
        return f"none (CuPy {cupy.__version__} sees no device)"
    return f"{n} ({', '.join(names)})"


def _cmd_info(args, parser) -> int:
    fields = info()
    from mpi4py import MPI

    from mpicomp import diagnostics

    ranks = diagnostics.gather(MPI.COMM_WORLD) if args.all_ranks else None
    if MPI.COMM_WORLD.rank != 0:  # under mpiexec: one report, not one per rank
        return 0
    warnings = diagnostics.warnings(ranks) if ranks is not None else None
    if args.json:
        extra = {} if ranks is None else {"ranks": ranks, "warnings": warnings}
        print(json.dumps({**fields, **extra}, indent=1))
        return 0
    width = max(map(len, fields)) + 2
    for key, value in fields.items():
        print(f"{key + ':':<{width}}{value}")
    if ranks is not None:
        print()
        print("\n".join(diagnostics.table(ranks)))
        print()
        print("warnings:" if warnings else "warnings: none")
        for w in warnings:
            print(f"  - {w}")
    return 0


# -- bench ---------------------------------------------------------------------------


def _cmd_bench(args, parser) -> int:
    if args.no_kernels and args.no_allreduce:
        parser.error("bench: --no-kernels and --no-allreduce leave nothing to measure")
    numel = args.numel or 25_600_000
    sizes = args.sizes or ([args.numel] if args.numel else [1_000_000, 25_600_000])
    progress = None if args.quiet else sys.stderr
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    try:
        report = bench.full_run(
            comm,
            args.codecs,
            None if args.no_kernels else numel,
            [] if args.no_allreduce else sizes,
            reps=args.reps,
            allreduce_reps=args.allreduce_reps,
            seed=args.seed,
            trace_dir=args.trace,
            tc_dev=args.tc_dev and args.tc_dev.split(","),
            progress=progress,
            backend=args.backend,
            schedules=args.schedules,
        )
    except (RuntimeError, OSError) as e:  # raised on every rank: each exits, none hangs
        if comm.rank == 0:
            print(f"mpicomp bench: error: {e}", file=sys.stderr)
        return 1
    if comm.rank != 0:
        return 0
    if args.json:
        bench.print_json(report.rows)
    else:
        report.print(args.reps, args.allreduce_reps)
    return 0


def _cmd_advise(args, parser) -> int:
    from mpicomp import advise

    try:
        link = advise.parse_rate(args.bandwidth)
    except ValueError as e:
        parser.error(str(e))
    if args.ranks < 2:
        parser.error("advise: --ranks must be >= 2")
    if args.bench is not None:
        try:
            with open(args.bench) as f:
                rows = json.load(f)
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise ValueError("expected a JSON list of rows, as `mpicomp bench --json` prints")
            if args.codecs:
                rows = [r for r in rows if r.get("codec") in args.codecs]
            result = advise.advise(rows, link, args.ranks)
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"mpicomp advise: error: {args.bench}: {e}", file=sys.stderr)
            return 2
    else:
        rows = bench.run(args.codecs, args.numel, 5, progress=sys.stderr)
        result = advise.advise(rows, link, args.ranks)
    if args.json:
        bench.print_json(result)
    else:
        advise.format_table(result, link, args.ranks, sys.stdout)
    return 0


# -- trace ---------------------------------------------------------------------------


def _trace_module(args):
    if not os.path.isfile(args.file):
        args.sub_parser.error(f"no such file: {args.file!r}")
    try:
        from mpicomp import trace_report
    except ImportError as e:
        raise RuntimeError(f"mpicomp.trace_report is not available ({e})") from e
    return trace_report


def _trace_error(args, e: Exception) -> int:
    print(f"mpicomp trace {args.trace_command}: error: {e}", file=sys.stderr)
    return 2


def _cmd_trace_summary(args, parser) -> int:
    try:
        module = _trace_module(args)
        if args.json:
            text = json.dumps(_trace_summary_json(module, args.file), indent=1)
        else:
            text = module.summarize(args.file)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        return _trace_error(args, e)
    print(text)
    return 0


#: The columns of `mpicomp trace summary`'s table, as its --json names them.
_TRACE_COLUMNS = ("codec", "tensor", "calls", "sent/call", "recv/call", "ratio",
                  "p50 ms", "p90 ms", "p99 ms", "encode", "comm", "decode")  # fmt: skip


def _trace_summary_json(trace_report, path) -> dict:
    """Return the data of `mpicomp trace summary`'s table: the run's attributes and one
    row per (codec, tensor) plus an "all" row, keyed by the table's column names."""
    events, steps, attrs = trace_report.read(path)
    rows = []
    if events.size:
        nranks = max(int(attrs.get("world_size", 0)), len({int(r) for r in events["rank"]}))
        groups = [(c, n or "(unnamed)", events[m]) for c, n, m in trace_report._groups(events)]
        for codec, name, ev in [*groups, ("all", "", events)]:
            row = trace_report._summary_row(codec, name, ev, nranks)
            rows.append(dict(zip(_TRACE_COLUMNS, row, strict=True)))
    run = {k: v for k, v in attrs.items() if isinstance(v, (str, int, float, bool))}
    run["events"] = int(events.size)
    run["steps"] = None if steps is None else int(steps.size)
    return {"file": os.fspath(path), "run": run, "rows": rows}


def _cmd_trace_export(args, parser) -> int:
    out = args.output or os.path.splitext(args.file)[0] + ".json"
    try:
        _trace_module(args)  # checks the file exists
        from mpicomp.trace_export import export

        n = export(args.file, out, args.format)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        return _trace_error(args, e)
    print(f"wrote {out} ({n} trace events)", file=sys.stderr)
    return 0


def _cmd_trace_plot(args, parser) -> int:
    out = args.output or os.path.splitext(args.file)[0] + ".png"
    try:
        _trace_module(args).plot(args.file, out)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        return _trace_error(args, e)
    print(f"wrote {out}", file=sys.stderr)
    return 0
