"""Compressed all-reduce against MPI_Allreduce on an emulated slow link (``make bench-netem``).

Runs ``mpicomp bench`` with ``--ranks`` ranks inside a private network namespace
whose loopback is shaped with tc tbf to each of ``--rates``, MPI forced onto TCP so
that every byte crosses the shaper, then checks and reports:

- the bytes tc counted against the bytes the HDF5 traces say the ranks received;
- MPI_Allreduce's achieved bandwidth against the shaped rate;
- each codec's speedup over MPI_Allreduce of float32 against issue 7's targets.

The ranks share one shaped loopback: the rate caps their aggregate traffic, like a
shared segment, not one link per node. The unshaped TCP path is measured first; a rate
above it is skipped and said so. Output: a table on stdout, ``OUT/netem.json`` and the
traces under ``OUT/<rate>/``. Needs root (``ip netns``, ``tc``).

``--overlap-torch`` runs jobs/overlap_torch.py at each rate instead of the bench
(backward-only, all-reduce-only, sequential and overlapped steps of a torch model).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

from jobs.netem.namespace import Namespace, NeedsRoot
from mpicomp.advise import parse_rate
from mpicomp.bench import codec_set, label, parse_count
from mpicomp.trace_report import read

# --rates entry for the loopback without a shaper (a byte-counting fifo).
UNSHAPED = "unshaped"

# Codecs of the overlap run: the float32 baseline, a ring codec and a gather codec.
OVERLAP_CODECS = "none,qsgd_maxnorm,threelc"

# Issue 7's bar at 1 Gbit/s, 4 ranks, 25.6M elements: speedup over MPI_Allreduce.
TARGET_RATE = 10**9
TARGETS = {
    ("signsgd", ""): 5.0,
    ("threelc", "sparsity=1.5"): 5.0,
    ("qsgd_maxnorm", "bits=2"): 5.0,
    ("fft", ""): 2.0,
    ("fastsgd", ""): 2.0,
    ("qsgd_maxnorm", "bits=8"): 2.0,
}

# tc counts IP/TCP headers and the MPI transport's own headers too: a few per cent at
# most for bulk messages on a 64 KiB-MTU loopback.
DEVICE_TOLERANCE = 0.05

# Codecs whose sum is MPI_Allreduce itself: their traces count the buffer handed to MPI
# (logical bytes, docs/trace-format.md), and MPI's ring moves 2(N-1)/N times that.
MPI_SUM = {"none"}


def mpi_env(vendor: str) -> dict[str, str]:
    """Environment that puts ``vendor``'s ranks on TCP over loopback, one numba thread each."""
    env = {"NUMBA_NUM_THREADS": "1"}
    if vendor == "Open MPI":
        env.update(
            OMPI_MCA_pml="ob1",
            OMPI_MCA_btl="tcp,self",
            OMPI_MCA_btl_tcp_if_include="lo",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            PRTE_MCA_rmaps_default_mapping_policy=":oversubscribe",
            OMPI_MCA_mpi_yield_when_idle="1",
        )
    else:
        # The mpich wheel's default netmod (UCX) keeps using shared memory even with
        # NOLOCAL; libfabric's tcp provider really goes through the socket.
        env.update(MPIR_CVAR_NOLOCAL="1", MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
    return env


def mpi_vendor() -> str:
    """Return the MPI library's vendor name without initializing MPI here."""
    import mpi4py

    mpi4py.rc.initialize = False
    from mpi4py import MPI

    return MPI.get_vendor()[0]


def mpiexec() -> str:
    """The mpiexec beside this Python (the venv's MPI wheel), else the one on PATH."""
    here = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = here if os.access(here, os.X_OK) else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("mpiexec not found (install the mpich wheel: make bench-netem does)")
    return found


class Runner:
    """Launch MPI programs inside a namespace; kill the whole job on interrupt."""

    def __init__(self, ns: Namespace, ranks: int, env: dict[str, str]):
        self.ns, self.ranks, self.env = ns, ranks, env

    def json(self, args: list[str], ranks: int | None = None) -> list:
        """Run ``python -m mpi4py ARGS`` on the ranks; return the JSON it printed."""
        cmd = self.ns.prefix() + ["env"] + [f"{k}={v}" for k, v in self.env.items()]
        cmd += [mpiexec(), "-n", str(ranks or self.ranks), sys.executable, "-m", "mpi4py"]
        proc = subprocess.Popen(cmd + args, stdout=subprocess.PIPE, start_new_session=True)
        try:
            out, _ = proc.communicate()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:3])} ... exited with {proc.returncode}")
        return json.loads(out)

    def bench(self, numel: int, codecs: list[str], reps: int, trace_dir: str | None) -> list:
        args = ["-m", "mpicomp", "bench", "--no-kernels", "--sizes", str(numel)]
        args += ["--allreduce-reps", str(reps), "--tc-dev", "lo", "--json", "--codecs"]
        args += [",".join(codecs)]
        if trace_dir is not None:
            args += ["--trace", trace_dir]
        return [a for row in self.json(args) for a in row["allreduce"]]


def traced_recv(path: str) -> int:
    """Bytes the ranks received, summed over every event of a trace."""
    events, _, _ = read(path)
    return int(events["bytes_recv"].sum())


def check_rows(rows: list[dict], reps: int) -> list[dict]:
    """Compare tc's bytes with the traces' bytes, per codec; return one check per row.

    Every byte crosses the loopback once, on its way to the rank that receives it, so
    tc should count what the traces say the ranks received (a trace's *sent* column
    counts a payload once even when an allgather relays it N - 1 times). For the
    ``MPI_SUM`` codecs the trace has MPI_Allreduce's logical 4n per rank and MPI's ring
    moves 2(N-1)/N times that.
    """
    checks = []
    for r in rows:
        calls = reps + 1
        traced = traced_recv(r["trace"]) if "trace" in r else r["recv_total"] * calls
        device = r["device_bytes"] * calls
        ratio = device / traced if traced else None
        n = r["nranks"]
        expected = 2 * (n - 1) / n if r["codec"] in MPI_SUM and n > 1 else 1.0
        checks.append(
            {
                "codec": r["codec"],
                "params": r["params"],
                "device_bytes": device,
                "traced_bytes": traced,
                "device_over_traced": ratio,
                "expected": expected,
                "ok": ratio is not None and abs(ratio / expected - 1) <= DEVICE_TOLERANCE,
            }
        )
    return checks


def report(result: dict, out=sys.stdout) -> None:
    """Print the summary table of one shaped rate."""
    rate = result["rate"]
    print(
        f"\n{rate}: MPI_Allreduce of {result['numel']:,} float32 on {result['ranks']} ranks "
        f"{result['allreduce_s']:.2f} s, achieved {result['achieved_gbit']:.2f} Gbit/s "
        f"({100 * result['achieved_over_rate']:.0f}% of the rate; aggregate device "
        "bytes / time)",
        file=out,
    )
    head = f"{'codec':<27}{'params':<14}{'time s':>8}{'speedup':>9}{'target':>8}  {'':<5}"
    head += (
        f"{'sent MB/rank':>13}{'tc/trace':>9}{'expect':>8}{'overhead s':>11}{'b-even Gbit/s':>14}"
    )
    print(head, file=out)
    print("-" * len(head), file=out)
    at_target = result["rate"] != UNSHAPED and result["rate_bps"] == TARGET_RATE
    for r, c in zip(result["rows"], result["checks"], strict=True):
        target = TARGETS.get((r["codec"], label(r["params"]))) if at_target else None
        verdict = "" if target is None else ("met" if r["speedup"] >= target else "MISS")
        ratio = "-" if c["device_over_traced"] is None else f"{c['device_over_traced']:.3f}"
        even = "-" if r["break_even_gbit"] is None else f"{r['break_even_gbit']:.2f}"
        print(
            f"{r['codec']:<27}{label(r['params']):<14}{r['time_s']:>8.2f}{r['speedup']:>9.2f}"
            f"{'' if target is None else f'{target:.0f}x':>8}  {verdict:<5}"
            f"{r['bytes_sent'] / 1e6:>13.2f}{ratio:>9}{c['expected']:>8.3f}"
            f"{r['overhead_s']:>11.3f}{even:>14}",
            file=out,
        )


def _rate_bps(rate: str) -> int | None:
    return None if rate == UNSHAPED else parse_rate(rate)


def add_overhead(rows: list[dict]) -> None:
    """Add each row's compute overhead and the aggregate link rate at which it breaks even.

    ``overhead_s``: the row's time less what its device bytes take at the rate
    MPI_Allreduce achieved in the same run; ``break_even_gbit``: the aggregate rate at
    which the bytes it saves take exactly that long (compression pays below it).
    """
    for r in rows:
        ref_bytes, ref_s = r["allreduce_device_bytes"], r["allreduce_s"]
        overhead = r["time_s"] - ref_s * r["device_bytes"] / ref_bytes
        saved = ref_bytes - r["device_bytes"]
        r["overhead_s"] = overhead
        pays = overhead > 0 and saved > 0.01 * ref_bytes
        r["break_even_gbit"] = 8 * saved / overhead / 1e9 if pays else None


def run_rate(runner: Runner, ns: Namespace, rate: str, args, out_dir: str) -> dict:
    """Shape to ``rate``, run the bench, check bytes; return the result record."""
    bps = _rate_bps(rate)
    ns.shape(bps)
    trace_dir = os.path.join(out_dir, rate)
    rows = runner.bench(args.numel, args.codecs, args.reps, trace_dir)
    add_overhead(rows)
    ref = rows[0]
    achieved = ref["allreduce_device_bytes"] * 8 / ref["allreduce_s"]
    bps = bps or achieved
    result = {
        "rate": rate,
        "rate_bps": bps,
        "ranks": args.ranks,
        "numel": args.numel,
        "allreduce_s": ref["allreduce_s"],
        "achieved_gbit": achieved / 1e9,
        "achieved_over_rate": achieved / bps,
        "rows": rows,
        "checks": check_rows(rows, args.reps),
    }
    return result


def schemes(runner: Runner, args) -> list[dict]:
    """signSGD's ring against an allgather and an alltoall+allgather, per rank count."""
    rows = []
    for ranks in args.scheme_ranks:
        argv = ["-m", "jobs.signsgd_compare", "--numel", str(args.numel), "--json"]
        rows += runner.json(argv + ["--reps", str(args.reps)], ranks=ranks)
    return rows


def report_schemes(rows: list[dict], rate: str, out=sys.stdout) -> None:
    """Print the signSGD scheme comparison (jobs/signsgd_compare.py) at one rate."""
    print(
        f"\n{rate}: signSGD majority vote; ranks beyond the "
        f"{os.cpu_count()} cores oversubscribe them (bytes exact, times contention-bound)",
        file=out,
    )
    head = f"{'scheme':<20}{'N':>3}{'recv B/rank':>14}{'bit/elem':>9}{'= formula':>10}{'s':>8}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(
            f"{r['scheme']:<20}{r['ranks']:>3}{r['bytes_recv_per_rank']:>14,}"
            f"{r['recv_bits_per_element']:>9.2f}{str(r['bytes_match']):>10}{r['seconds']:>8.2f}",
            file=out,
        )


def overlap(runner: Runner, args) -> list[dict]:
    """jobs/overlap.py on the shaped link: sequential against overlapped buckets."""
    per_bucket = max(1, args.numel // args.overlap_buckets)
    argv = ["-m", "jobs.overlap", "--numel", str(per_bucket), "--json"]
    argv += ["--buckets", str(args.overlap_buckets), "--reps", str(args.reps)]
    return runner.json(argv + ["--codecs", OVERLAP_CODECS])


def report_overlap(rows: list[dict], rate: str, out=sys.stdout) -> None:
    """Print the overlap comparison (jobs/overlap.py) at one rate."""
    r0 = rows[0]
    print(
        f"\n{rate}: backward pass of {r0['buckets']} buckets x {r0['numel']:,} elements on "
        f"{r0['ranks']} ranks, compute per bucket ~ one bucket's all-reduce; "
        "bound: max(compute, reduce) + min(one each)",
        file=out,
    )
    head = f"{'codec':<16}{'params':<10}{'sequential s':>13}{'overlapped s':>13}{'saving':>8}"
    head += f"{'bound':>7}"
    print(head, file=out)
    print("-" * len(head), file=out)
    for r in rows:
        print(
            f"{r['codec']:<16}{r['params']:<10}{r['t_sequential']:>13.2f}{r['t_overlapped']:>13.2f}"
            f"{100 * r['saving']:>7.1f}%{100 * r['bound_saving']:>6.1f}%",
            file=out,
        )


def overlap_torch(runner: Runner, ns: Namespace, rate: str, args) -> dict:
    """jobs/overlap_torch.py on the link shaped to ``rate``: a torch model of about
    ``--numel`` parameters, backward-only, all-reduce-only, sequential and overlapped
    steps; return the result record."""
    ns.shape(_rate_bps(rate))
    argv = ["-m", "jobs.overlap_torch", "--params", str(args.numel), "--reps", str(args.reps)]
    return {"rate": rate, "overlap_torch": runner.json(argv + ["--json"])}


def report_overlap_torch(result: dict, out=sys.stdout) -> None:
    """Print jobs/overlap_torch.py's table for one rate."""
    from jobs.overlap_torch import format_table  # imports torch: only in this mode

    rows = result["overlap_torch"]
    print(
        f"\n{result['rate']}: torch MLP of {rows[0]['model_params']:,} parameters on "
        f"{rows[0]['ranks']} ranks, batch {rows[0]['batch']} per rank, {rows[0]['buckets']} "
        "buckets; ms per step (the slowest rank's, median)",
        file=out,
    )
    format_table(rows, out)


def probe(runner: Runner, ns: Namespace, numel: int) -> float:
    """Return the unshaped TCP path's rate (bit/s) as MPI_Allreduce achieves it.

    Raises:
        RuntimeError: tc saw (almost) none of the all-reduce's bytes: MPI is not on TCP
            over this loopback, so a shaper would be bypassed and figures fiction.
    """
    ns.shape(None)
    ref = runner.bench(numel, ["none"], 1, None)[0]
    expected = 2 * (runner.ranks - 1) * 4 * numel  # float32 ring, all ranks together
    if ref["allreduce_device_bytes"] < 0.5 * expected:
        raise RuntimeError(
            f"tc counted {ref['allreduce_device_bytes']:,} bytes on lo for an all-reduce that "
            f"moves about {expected:,}: the MPI library is not using TCP over loopback, so the "
            "shaper would be bypassed (for MPICH set MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp)"
        )
    return ref["allreduce_device_bytes"] * 8 / ref["allreduce_s"]


def main(argv=None) -> int:
    """Run the emulated-network benchmark; return 0, 1 (a check failed) or 2 (cannot run)."""
    ap = argparse.ArgumentParser(prog="jobs.netem", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="MPI ranks (4)")
    ap.add_argument("--numel", default="25.6M", help="gradient elements (25.6M)")
    ap.add_argument(
        "--rates",
        default=f"1gbit,10gbit,{UNSHAPED}",
        help=f"tbf rates, and {UNSHAPED!r} for none (1gbit,10gbit,{UNSHAPED})",
    )
    ap.add_argument("--codecs", default=None, help="comma-separated codec names (all)")
    ap.add_argument("--reps", type=int, default=3, help="timed all-reduces per codec (3)")
    ap.add_argument("--out", default="netem-out", help="output directory (netem-out)")
    ap.add_argument(
        "--scheme-ranks",
        default="4,8",
        help="at 1gbit, also compare signSGD's ring, allgather and alltoall+allgather at "
        "these rank counts ('' to skip; 4,8)",
    )
    ap.add_argument(
        "--overlap-buckets",
        type=int,
        default=8,
        help="at 1gbit, also time a backward pass of this many buckets (together --numel) "
        "with blocking all-reduces against iallreduce overlapping the next bucket's compute "
        "(0 to skip; 8)",
    )
    ap.add_argument(
        "--overlap-torch",
        action="store_true",
        help="instead of the bench, run jobs.overlap_torch (a torch model of --numel "
        "parameters: backward-only, all-reduce-only, sequential and overlapped steps) at "
        "each rate",
    )
    args = ap.parse_args(argv)
    try:
        args.numel = parse_count(args.numel)
        rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for r in rates:
            _rate_bps(r)
        args.scheme_ranks = [int(r) for r in args.scheme_ranks.split(",") if r.strip()]
        names = args.codecs.split(",") if args.codecs else None
        args.codecs = list(dict.fromkeys(n for n, _ in codec_set(names)))
    except ValueError as e:
        ap.error(str(e))
    if args.ranks < 1 or args.reps < 1 or args.numel < 1:
        ap.error("--ranks, --reps and --numel must be >= 1")
    os.makedirs(args.out, exist_ok=True)
    vendor = mpi_vendor()
    summary = {"ranks": args.ranks, "numel": args.numel, "mpi": vendor, "rates": []}
    started = time.time()
    try:
        with Namespace() as ns:
            runner = Runner(ns, args.ranks, mpi_env(vendor))
            print(f"jobs.netem: namespace {ns.name}, {vendor} over TCP on lo", file=sys.stderr)
            unshaped = probe(runner, ns, args.numel)
            summary["unshaped_gbit"] = unshaped / 1e9
            print(
                f"unshaped TCP loopback: MPI_Allreduce achieves {unshaped / 1e9:.2f} Gbit/s "
                "(aggregate device bytes / time)"
            )
            for rate in rates:
                if rate != UNSHAPED and parse_rate(rate) > unshaped:
                    note = (
                        f"skipped: the unshaped path reaches {unshaped / 1e9:.2f} Gbit/s, "
                        f"below {rate}; shaping to it would measure the CPU, not the link"
                    )
                    print(f"\n{rate}: {note}")
                    summary["rates"].append({"rate": rate, "skipped": note})
                    continue
                if args.overlap_torch:
                    result = overlap_torch(runner, ns, rate, args)
                    summary["rates"].append(result)
                    report_overlap_torch(result)
                    continue
                result = run_rate(runner, ns, rate, args, args.out)
                summary["rates"].append(result)
                report(result)
                if result["rate_bps"] == TARGET_RATE and rate != UNSHAPED:
                    result["signsgd_schemes"] = schemes(runner, args)
                    report_schemes(result["signsgd_schemes"], rate)
                    if args.overlap_buckets:
                        result["overlap"] = overlap(runner, args)
                        report_overlap(result["overlap"], rate)
    except NeedsRoot as e:
        print(f"jobs.netem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jobs.netem: interrupted; namespace removed", file=sys.stderr)
        return 130
    summary["seconds"] = time.time() - started
    path = os.path.join(args.out, "netem.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    bad = [
        c
        for r in summary["rates"]
        for c in r.get("checks", [])
        if not c["ok"] and c["traced_bytes"] > 1e6
    ]
    for c in bad:
        print(
            f"check failed: {c['codec']} {label(c['params'])}: tc counted "
            f"{c['device_over_traced']:.3f}x the traced bytes",
            file=sys.stderr,
        )
    print(f"\nwrote {path} ({summary['seconds']:.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
