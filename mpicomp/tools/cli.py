"""The ``mpicomp`` command: ``info``, ``bench``, ``advise``, ``trace summary`` and ``trace plot``."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import textwrap

from mpicomp._version import __version__
from mpicomp.codecs import available as available_codecs
from mpicomp.collectives import plain
from mpicomp.tools import bench, diagnostics
from mpicomp.tools.bench.workload import parse_counts
from mpicomp.tools.diagnostics import info
from mpicomp.tools.table import WIDTH, plural

#: How the docs launch the all-reduce part of ``mpicomp bench`` (it needs several ranks).
ALLREDUCE_LAUNCH = "mpiexec -n N python -m mpi4py -m mpicomp bench"

EXAMPLES = """\
examples:
  mpicomp info                          what this machine and MPI library offer
  mpiexec -n 4 mpicomp info --all-ranks one line per rank, and warnings
  mpicomp compile                       fill the numba kernel cache ahead of a job
  mpicomp bench --numel 4M              codec GB/s beside memcpy, on one process
  mpiexec -n 4 python -m mpi4py -m mpicomp bench --no-kernels --sizes 1M    (the all-reduce)
  mpicomp advise 1gbit                  which codecs pay on a 1 Gbit/s link
  mpicomp trace summary run.h5          a trace written by CompressedComm(trace=...)

docs: docs/running.md (commands), docs/usage.md (the API), docs/install.md
"""


def main(argv: list[str] | None = None) -> int:
    """Run the ``mpicomp`` command line; return its exit status: 0, 1 for a failure at
    run time, 2 for bad arguments (with the subcommand's usage), 130 on Ctrl-C, 141
    when the reader of the output went away (``| head``), as Unix tools end."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
        # Each command's usage errors print its own usage, not the top level's.
        return args.run(args, getattr(args, "sub_parser", parser))
    except SystemExit as e:  # usage errors and --help: a status, not an exception
        return e.code if isinstance(e.code, int) else 2
    except KeyboardInterrupt:  # Ctrl-C in a long bench: the shell's status, no traceback
        print("mpicomp: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # Python's advice: point stdout at /dev/null so the flush at exit cannot fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


# -- arguments -----------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mpicomp",
        description="Compressed gradient all-reduce over MPI: environment, kernel cache, "
        "benchmarks, traces.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    parser.add_argument("--version", action="version", version=f"mpicomp {__version__}")
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
    p.set_defaults(run=_cmd_info, sub_parser=p)

    p = sub.add_parser(
        "compile",
        help="compile the codecs' numba kernels into the cache ahead of a job",
        description="Compile (or load) the numba kernels of each codec by reducing a small "
        "and a large gradient through CompressedComm, as a job's first calls would, so "
        "the job's ranks load them from the cache instead. Run it on a login node or in "
        "a Slurm prolog; under mpiexec -n N it also compiles what N ranks' reductions "
        "need. The cache: $MPICOMP_NUMBA_CACHE, else ~/.cache/mpicomp/numba "
        "(docs/install.md).",
    )
    p.add_argument(
        "--codecs", type=_codec_names, default=None, metavar="NAMES", help="codecs (default: all)"
    )
    p.set_defaults(run=_cmd_compile, sub_parser=p)

    p = sub.add_parser(
        "bench",
        help="codec throughput beside memcpy, and compressed all-reduce against MPI_Allreduce",
        description="Encode and decode throughput (GB/s of float32 input) of each codec on "
        "one gradient-shaped tensor beside np.copyto of the same buffer, the bits per element "
        "one rank sends, then CompressedComm.allreduce against MPI_Allreduce of float32 on "
        "MPI.COMM_WORLD, with its encode/exchange/decode split; both on --backend's arrays. "
        "Medians of --reps after a warm-up; the kernels are timed on rank 0 alone. The "
        f"all-reduce needs several ranks (`{ALLREDUCE_LAUNCH}`): on one it is skipped. "
        "--reduce-scatter adds the sharded collectives: CompressedComm.reduce_scatter and "
        "allgather against MPI_Reduce_scatter and MPI_Allgather of float32.",
    )
    p.add_argument(
        "--codecs",
        type=_codec_list,
        default=None,
        metavar="NAMES",
        help="comma-separated codec names, or name:key=value[:key=value] for other "
        "parameters, e.g. qsgd_maxnorm:bits=4 (default: all, at the parameters of "
        "docs/running.md; see `mpicomp info`)",
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
        "--reduce-scatter",
        action="store_true",
        help="also time CompressedComm.reduce_scatter of every codec that has one against "
        "MPI_Reduce_scatter of float32, and CompressedComm.allgather (float32, bfloat16) "
        "against MPI_Allgather, at --sizes (with --no-allreduce: these alone)",
    )
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
        "'all' every candidate of schedule='auto' on these hosts and 'auto' itself, or "
        "names among ring, direct, allgather, sharded, allreduce, hier:NAME, auto "
        "(default: its default; a codec with none of the names runs its default). With "
        "schedules, every row carries the model's prediction (measured now, or --model)",
    )
    p.add_argument(
        "--model",
        metavar="FILE",
        default=None,
        help="with --schedules: predict with this model (`mpicomp bench --save-model`) "
        "instead of measuring one",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the gradient (0)")
    p.add_argument(
        "--backend",
        type=_backend_name,
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
    p.add_argument(
        "--save-model",
        metavar="FILE",
        default=None,
        help="then measure the network (latency and bandwidth, within and between hosts) "
        "and write it with the codecs' speeds (the kernel timings; measured on every rank "
        "under --no-kernels) as a model for CompressedComm(schedule='auto', model=FILE) "
        "and `mpicomp advise --model FILE`; rank 0 writes",
    )
    p.set_defaults(run=_cmd_bench, sub_parser=p)

    p = sub.add_parser(
        "advise",
        help="for a link bandwidth, which codecs pay (measured kernels in Eq. 4 of the FFT "
        "sparsification paper, docs/bibliography.md)",
        description="Eq. 4 of the FFT sparsification paper (Wang et al., HPDC '20; "
        "docs/bibliography.md) with measured encode/decode throughput: the smallest "
        "compression ratio that pays on a link, whether each codec reaches it, the modelled "
        "all-reduce speedup at --ranks, and the link rate below which each codec is faster. "
        "Kernel figures come from --bench (a `mpicomp bench --json` file) or are measured now. "
        "With --sizes or --model: instead, per codec and tensor size, every schedule's "
        "predicted time on --hosts x --ranks-per-host and the one schedule='auto' picks.",
    )
    p.add_argument(
        "bandwidth",
        nargs="?",
        default=None,
        help="each rank's link (between hosts): 1gbit, 10gbit, 100mbit, ... (not with --model)",
    )
    p.add_argument("--ranks", type=_positive_count, default=None, metavar="N", help="ranks (4)")
    p.add_argument("--bench", metavar="FILE", default=None, help="`mpicomp bench --json` output")
    p.add_argument(
        "--codecs",
        type=_codec_list,
        default=None,
        metavar="NAMES",
        help="codecs, as bench's --codecs: names or name:key=value[:key=value] (all)",
    )
    p.add_argument(
        "--numel",
        type=_positive_count,
        default=25_600_000,
        metavar="N",
        help="gradient size when measuring now (25.6M)",
    )
    p.add_argument(
        "--sizes",
        type=_count_list,
        default=None,
        metavar="N,N",
        help="tensor sizes of the schedule table (default with --model: 4K,64K,1M,25.6M)",
    )
    p.add_argument(
        "--hosts",
        type=_positive_count,
        default=None,
        metavar="H",
        help="hosts (--ranks / --ranks-per-host)",
    )
    p.add_argument(
        "--ranks-per-host",
        type=_positive_count,
        default=None,
        metavar="R",
        help="ranks on each host (1)",
    )
    p.add_argument(
        "--alpha",
        type=_seconds,
        default=None,
        metavar="TIME",
        help="latency per message, within and between hosts: 50us, 0.5ms, 5e-5 (50us)",
    )
    p.add_argument(
        "--intra",
        type=_rate,
        default=None,
        metavar="RATE",
        help="each rank's bandwidth within a host (100gbit)",
    )
    p.add_argument(
        "--model",
        metavar="FILE",
        default=None,
        help="a model `mpicomp bench --save-model` wrote: its networks and codec speeds "
        "instead of BANDWIDTH, --alpha, --intra and --bench",
    )
    p.add_argument("--json", action="store_true", help="print a JSON list alone on stdout")
    p.set_defaults(run=_cmd_advise, sub_parser=p)

    p = sub.add_parser("trace", help="read an HDF5 trace written by CompressedComm(trace=...)")
    tsub = p.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    t = tsub.add_parser(
        "summary",
        help="print a table of a trace, or of every trace in a directory",
        description="Print the run's attributes and a table: per codec, tensor and schedule, "
        "bytes, ratio, latency and phases. The first call of each row (it compiles "
        "kernels and allocates buffers) is left out of the latencies and phases unless "
        "--all-calls. A directory (e.g. `mpicomp bench --trace DIR`'s) is read file by file.",
    )
    t.add_argument(
        "file", metavar="FILE|DIR", help="an HDF5 trace file, or a directory of them (.h5 files)"
    )
    t.add_argument(
        "--all-calls", action="store_true", help="count each row's first (warm-up) call too"
    )
    t.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object ({"file", "run": attributes, "rows": one per codec, '
        'tensor and schedule, then "all"}); for a directory a list of them',
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
    t.add_argument("file", metavar="FILE", help="an HDF5 trace file (formats 1 to 3)")
    t.add_argument("--format", default="chrome", choices=["chrome"], help="output format")
    t.add_argument("-o", "--output", metavar="OUT", help="file to write (default: FILE with .json)")
    t.set_defaults(run=_cmd_trace_export, sub_parser=t)
    return parser


def _backend_name(text: str) -> str:
    import mpicomp.kernels as K

    if text not in K.available():
        raise argparse.ArgumentTypeError(
            f"unknown backend {text!r}; known: {', '.join(K.available())}"
        )
    return text


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
        counts = parse_counts(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"expected counts >= 1, got {text!r}")
    return counts


def _seconds(text: str) -> float:
    from mpicomp.tools.advise import parse_seconds

    try:
        return parse_seconds(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _rate(text: str) -> int:
    from mpicomp.tools.advise import parse_rate

    try:
        return parse_rate(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _codec_names(text: str) -> list[str]:
    """``--codecs`` of ``compile``: codec names alone (kernels do not depend on parameters)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"no codec names in {text!r}")
    known = available_codecs()
    for name in names:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"unknown codec {name!r}; available: {', '.join(known)}"
            )
    return names


def _codec_list(text: str) -> list[str]:
    """``--codecs`` of ``bench`` and ``advise``: names or ``name:key=value[:key=value]``
    entries (``mpicomp.tools.bench.codec_set``), checked here so a typo is a usage error."""
    entries = bench.split_codecs(text)
    if not entries:
        raise argparse.ArgumentTypeError(f"no codec names in {text!r}")
    try:
        bench.codec_set(entries)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return entries


def _schedule_list(text: str):
    if text.strip() == "all":
        return "all"
    from mpicomp.reduction import all_schedule_names

    names = [n.strip() for n in text.split(",") if n.strip()]
    known = sorted(all_schedule_names())
    for name in names or [""]:
        if name not in known:
            raise argparse.ArgumentTypeError(
                f"unknown schedule {name!r}; 'all' or names among: {', '.join(known)}"
            )
    return names


# -- info ----------------------------------------------------------------------------


def _cmd_info(args, parser) -> int:
    fields = info()
    from mpi4py import MPI

    ranks = diagnostics.gather(MPI.COMM_WORLD) if args.all_ranks else None
    if MPI.COMM_WORLD.rank != 0:  # under mpiexec: one report, not one per rank
        return 0
    warnings = diagnostics.warnings(ranks) if ranks is not None else None
    if args.json:
        extra = {} if ranks is None else {"ranks": ranks, "warnings": warnings}
        print(json.dumps({**fields, **extra}, indent=1))
        return 0
    width = max(map(len, fields)) + 2
    for key, value in fields.items():  # long values (the codecs) go on below, indented
        print(_wrapped(f"{key + ':':<{width}}{value}", " " * width))
    if ranks is not None:
        print()
        print("\n".join(diagnostics.table(ranks)))
        print()
        print("warnings:" if warnings else "warnings: none")
        for w in warnings:
            print(_wrapped(f"  - {w}", "    "))
    return 0


def _wrapped(text: str, indent: str) -> str:
    """``text`` wrapped to the tables' width, its later lines indented by ``indent``."""
    return textwrap.fill(
        text, WIDTH, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False
    )


def _cmd_compile(args, parser) -> int:
    from mpi4py import MPI

    from mpicomp.kernels import numba_cache
    from mpicomp.tools import warmup

    warmup.log_compiles()
    rank0 = MPI.COMM_WORLD.rank == 0
    names = args.codecs or available_codecs()
    if rank0:
        where = numba_cache.cache_root() or "numba's choice (NUMBA_CACHE_DIR)"
        told = plural(len(names), "codec")
        print(f"compiling (or loading) the kernels of {told}: {where}", flush=True)

    def done(name, seconds):
        if rank0:
            print(f"  {name}: {seconds:.1f} s", flush=True)

    warmup.warm(names, on_codec=done)
    return 0


# -- bench ---------------------------------------------------------------------------


def _cmd_bench(args, parser) -> int:
    if args.no_kernels and args.no_allreduce and not args.reduce_scatter:
        parser.error("--no-kernels and --no-allreduce leave nothing to measure")
    if args.reduce_scatter and args.backend == "cuda":
        parser.error(
            "--reduce-scatter times host arrays; give a host --backend (numba, cuda-emulated)"
        )
    if args.model and args.schedules is None:
        parser.error("--model predicts the times of --schedules; give --schedules")
    if args.save_model and args.no_kernels and args.backend is not None:
        parser.error(
            "--save-model --no-kernels measures the codecs' speeds on the default "
            "backend, not --backend's; leave out --no-kernels to save --backend's"
        )
    numel = args.numel or 25_600_000
    sizes = args.sizes or ([args.numel] if args.numel else [1_000_000, 25_600_000])
    progress = None if args.quiet else sys.stderr
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    # One rank has nothing to all-reduce with: its "speedup" and bytes would be noise and 0.
    alone = comm.size == 1 and (not args.no_allreduce or args.reduce_scatter)
    unused = [
        flag
        for flag, value in (
            ("--sizes", args.sizes),
            ("--schedules", args.schedules),
            ("--trace", args.trace),
            ("--tc-dev", args.tc_dev),
            ("--reduce-scatter", args.reduce_scatter),
        )
        if value and alone
    ]
    if alone and args.no_kernels and not args.save_model:
        parser.error(
            "--no-kernels on one rank leaves nothing to measure: the all-reduce needs "
            f"several ranks; launch with `{ALLREDUCE_LAUNCH} ...`"
        )
    if alone:
        sizes = []
    if args.save_model:
        # Before the run, not after it: a mistyped directory should not cost a whole bench.
        where = os.path.dirname(os.path.abspath(args.save_model))
        if not plain.bcast_object(comm, os.path.isdir(where) if comm.rank == 0 else None):
            if comm.rank == 0:
                print(
                    f"mpicomp bench: error: --save-model: no directory {where!r}", file=sys.stderr
                )
            return 2
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
            model=args.model,
            with_model=bool(args.save_model),
            model_numel=args.numel,
            sharded_sizes=sizes if args.reduce_scatter else [],
        )
    except (RuntimeError, OSError) as e:  # raised on every rank: each exits, none hangs
        if comm.rank == 0:
            print(f"mpicomp bench: error: {e}", file=sys.stderr)
        return 1
    if comm.rank != 0:
        return 0
    if args.json:
        bench.print_json(report.json_rows())
    else:
        report.print(args.reps, args.allreduce_reps)
    if alone and not (args.json and args.quiet):
        part, mpi = ("all-reduce", "MPI_Allreduce")
        if args.no_allreduce:  # --reduce-scatter alone
            part, mpi = ("reduce-scatter", "MPI_Reduce_scatter")
        print(
            f"\n{part}: skipped on one rank; `{ALLREDUCE_LAUNCH}` measures it against {mpi}"
            + (f" ({', '.join(unused)}: for the {part}, unused)" if unused else ""),
            file=sys.stderr if args.json else sys.stdout,
        )
    return _save_model(report.model, args.save_model) if args.save_model else 0


def _save_model(model, path: str) -> int:
    """Write ``model`` to ``path`` and say so on stderr; return the exit status."""
    try:
        model.save(path)
    except OSError as e:
        print(f"mpicomp bench: error: --save-model: {e}", file=sys.stderr)
        return 1

    def net(n) -> str:
        return f"alpha {n.alpha * 1e6:.4g} us, beta {n.beta * 8 / 1e9:.4g} Gbit/s"

    print(
        f"mpicomp bench: wrote the model to {path}: within a host {net(model.intra)}; "
        f"between hosts {net(model.inter)}; {plural(len(model.speeds), 'codec speed')}",
        file=sys.stderr,
    )
    return 0


def _cmd_advise(args, parser) -> int:
    table = (
        _advise_schedules if args.sizes is not None or args.model is not None else _advise_codecs
    )
    try:
        rows, print_table = table(args, parser)
    except (OSError, ValueError, KeyError, TypeError) as e:
        print(f"mpicomp advise: error: {'' if args.model else _where(args)}{e}", file=sys.stderr)
        return 2
    if args.json:
        bench.print_json(rows)
    else:
        print_table(sys.stdout)
    return 0


def _advise_codecs(args, parser):
    """``mpicomp advise BANDWIDTH``: which codecs pay on the link; return the rows and
    what prints them as a table."""
    from mpicomp.tools import advise

    for flag, value in (
        ("--hosts", args.hosts),
        ("--ranks-per-host", args.ranks_per_host),
        ("--alpha", args.alpha),
        ("--intra", args.intra),
    ):
        if value is not None:
            parser.error(f"{flag} is for the schedule table: give --sizes too")
    link = _advise_link(args, parser)
    ranks = 4 if args.ranks is None else args.ranks
    if ranks < 2:
        parser.error("--ranks must be >= 2")
    result = advise.advise(_bench_rows(args), link, ranks)
    return result, lambda out: advise.format_table(result, link, ranks, out)


def _advise_schedules(args, parser):
    """``mpicomp advise --sizes/--model``: the schedule table; return its rows and what
    prints them."""
    from mpicomp.model.measured import Model
    from mpicomp.tools import advise

    topology = _advise_topology(args, parser)
    if args.model is not None:
        given = [
            flag
            for flag, value in (
                ("BANDWIDTH", args.bandwidth),
                ("--alpha", args.alpha),
                ("--intra", args.intra),
                ("--bench", args.bench),
            )
            if value is not None
        ]
        if given:
            parser.error(f"--model brings the networks and speeds; leave out {', '.join(given)}")
        model = Model.load(args.model)  # its errors name the file
    else:
        link = _advise_link(args, parser)
        alpha = 50e-6 if args.alpha is None else args.alpha
        intra = 100 * 10**9 if args.intra is None else args.intra
        where = args.bench or "kernels measured now"
        model = advise.rate_model(link, intra, alpha, _bench_rows(args), where)
    codecs = advise.codecs_of(model.speeds)
    codecs = [c for c in codecs if args.codecs is None or c.name in args.codecs]
    if not codecs:
        raise ValueError("no codec has kernel figures (encode and decode speeds) to predict with")
    rows = advise.schedule_table(model, topology, codecs, args.sizes or advise.DEFAULT_SIZES)
    return rows, lambda out: advise.format_schedule_table(rows, model, topology, out)


def _advise_link(args, parser) -> int:
    """Return the bits per second of advise's BANDWIDTH (a usage error when missing or bad)."""
    from mpicomp.tools import advise

    if args.bandwidth is None:
        parser.error("give the link's bandwidth (e.g. 1gbit) or --model FILE")
    try:
        return advise.parse_rate(args.bandwidth)
    except ValueError as e:
        parser.error(str(e))


def _advise_topology(args, parser):
    """Return the ``Topology`` of advise's --hosts, --ranks-per-host and --ranks."""
    from mpicomp.model.cost import Topology

    per_host = args.ranks_per_host or 1
    if args.hosts is None:
        ranks = 4 if args.ranks is None else args.ranks
        if ranks % per_host:
            parser.error(f"--ranks {ranks} is not a multiple of --ranks-per-host {per_host}")
        hosts = ranks // per_host
    else:
        hosts = args.hosts
        if args.ranks is not None and args.ranks != hosts * per_host:
            parser.error(
                f"--ranks {args.ranks} is not --hosts x --ranks-per-host ({hosts} x {per_host})"
            )
    if hosts * per_host < 2:
        parser.error("the schedule table needs >= 2 ranks (--hosts x --ranks-per-host)")
    return Topology(hosts, per_host)


def _bench_rows(args) -> list[dict]:
    """Return the kernel rows advise predicts with: --bench's, or measured now; --codecs'."""
    if args.bench is None:
        print(
            f"advise: measuring each codec's encode/decode on {args.numel:,} elements here "
            "first (--bench FILE reuses a `mpicomp bench --json` run)",
            file=sys.stderr,
            flush=True,
        )
        return bench.run(args.codecs, args.numel, 5, progress=sys.stderr)
    with open(args.bench) as f:
        rows = json.load(f)
    if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
        raise ValueError("expected a JSON list of rows, as `mpicomp bench --json` prints")
    if not args.codecs:
        return rows
    picked = []
    for entry in args.codecs:
        name, params = bench.parse_codec(entry)
        hits = [
            r
            for r in rows
            if r.get("codec") == name
            and all((r.get("params") or {}).get(k) == v for k, v in (params or {}).items())
        ]
        if not hits:
            raise ValueError(
                f"no row of {name}{'' if params is None else ' with ' + entry.partition(':')[2]}; "
                f"`mpicomp bench --json --codecs {entry}` measures it"
            )
        picked += [r for r in hits if not any(r is p for p in picked)]
    return picked


def _where(args) -> str:
    """The prefix of advise's errors about its kernel rows: the --bench file, if any."""
    return f"{args.bench}: " if args.bench is not None else ""


# -- trace ---------------------------------------------------------------------------


def _trace_module(args, directory: bool = False):
    """Return ``mpicomp.trace.report`` once ``args.file`` is a file (or, with
    ``directory``, a directory); otherwise a usage error saying what is expected."""
    if os.path.isdir(args.file) and not directory:
        args.sub_parser.error(
            f"{args.file!r} is a directory: trace {args.trace_command} takes one trace file "
            "(trace summary reads a directory)"
        )
    if not (os.path.isfile(args.file) or (directory and os.path.isdir(args.file))):
        args.sub_parser.error(f"no such file: {args.file!r}")
    try:
        from mpicomp.trace import report
    except ImportError as e:
        raise RuntimeError(f"mpicomp.trace.report is not available ({e})") from e
    return report


def _trace_error(args, e: Exception) -> int:
    print(f"mpicomp trace {args.trace_command}: error: {e}", file=sys.stderr)
    return 2


def _cmd_trace_summary(args, parser) -> int:
    try:
        module = _trace_module(args, directory=True)
        if args.json:
            docs = [module.summary(f, args.all_calls) for f in module.trace_files(args.file)]
            one = not os.path.isdir(args.file)
            text = json.dumps(docs[0] if one else docs, indent=1)
        else:
            text = module.summarize(args.file, all_calls=args.all_calls)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        return _trace_error(args, e)
    print(text)
    return 0


def _cmd_trace_export(args, parser) -> int:
    out = args.output or os.path.splitext(args.file)[0] + ".json"
    try:
        _trace_module(args)  # checks the file exists
        from mpicomp.trace.export import export

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
