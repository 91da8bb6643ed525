"""Compressed all-reduce against MPI_Allreduce on an emulated slow network (``make bench-netem``).

Runs ``mpicomp bench`` on an emulated network shaped with tc tbf to each of
``--rates``, MPI forced onto TCP so that every byte crosses a shaper, then checks and
reports:

- the bytes tc counted against the bytes the HDF5 traces say the ranks received;
- MPI_Allreduce's achieved bandwidth against the shaped rate;
- each codec's speedup over MPI_Allreduce of float32 against its target (``TARGETS``).

Two networks (jobs/netem/namespace.py): by default ``--ranks`` ranks share one shaped
loopback, the rate capping their aggregate traffic like a shared segment; with
``--hosts H`` each of H emulated hosts has a link of its own into a switch, shaped in
both directions (a NIC per node), ``--ranks-per-host`` ranks on each, MPI started
across them from a hostfile. The unshaped TCP path is measured first; a rate above
it is skipped and said so. Output: a table on stdout, ``OUT/netem.json`` and the
traces under ``OUT/<rate>/``. Needs root (``ip netns``, ``tc``).

``--train-steps N`` also runs the training job (jobs/train.py) at each rate.

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

from jobs._report import print_table
from jobs.netem import namespace
from jobs.netem.namespace import Hosts, Namespace, NeedsRoot
from mpicomp.tools.advise import parse_rate
from mpicomp.tools.bench import codec_set, label, parse_count
from mpicomp.tools.bench.report import chooser_verdicts, format_verdicts, schedule_label
from mpicomp.trace.report import read

# --rates entry for the loopback without a shaper (a byte-counting fifo).
UNSHAPED = "unshaped"

# Codecs of the overlap run: the float32 baseline, a ring codec and a gather codec.
OVERLAP_CODECS = "none,qsgd_maxnorm,threelc"

# The speedup over MPI_Allreduce each codec was set to reach at 1 Gbit/s, 4 ranks,
# 25.6M elements.
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

# The training run's byte check needs this many traced bytes: its untraced messages
# (MPI start-up, gathering results) come to ~100 KB.
TRAIN_CHECK_MIN = 10 * 10**6

# Codecs whose sum is MPI_Allreduce itself: their traces count the buffer handed to MPI
# (logical bytes, docs/trace-format.md), and MPI's ring moves 2(N-1)/N times that.
MPI_SUM = {"none"}


# How ranks on one emulated host talk to each other: shared memory, as an MPI library
# does on a real node, or TCP over the host's own loopback (counted, so the byte check
# covers every byte).
INTRA_HOST = ("shm", "tcp")


def mpi_env(vendor: str, hosts: bool = False, intra_host: str = "shm") -> dict[str, str]:
    """Environment that puts ``vendor``'s ranks on TCP, one numba thread each.

    On the shared loopback every rank is remote to every other (all traffic through
    ``lo``); with ``hosts`` ranks on different hosts talk TCP over the host's NIC and
    ranks on one host as ``intra_host`` says.
    """
    env = {"NUMBA_NUM_THREADS": "1"}
    local = hosts and intra_host == "shm"
    if vendor == "Open MPI":
        env.update(
            OMPI_MCA_pml="ob1",
            OMPI_MCA_btl="tcp,self,sm" if local else "tcp,self",
            OMPI_MCA_btl_tcp_if_include=namespace.NIC if hosts else "lo",
            OMPI_ALLOW_RUN_AS_ROOT="1",
            OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
            OMPI_MCA_mpi_yield_when_idle="1",
        )
        if not hosts:  # more ranks than cores on the one node (a hostfile gives slots)
            env["PRTE_MCA_rmaps_default_mapping_policy"] = ":oversubscribe"
    else:
        # The mpich wheel's default netmod (UCX) uses shared memory between processes
        # of one machine whatever the network namespace (and even with NOLOCAL);
        # libfabric's tcp provider really goes through the socket.
        env.update(MPIR_CVAR_CH4_NETMOD="ofi", FI_PROVIDER="tcp")
        if hosts:
            env["FI_TCP_IFACE"] = namespace.NIC
        if not local:
            env["MPIR_CVAR_NOLOCAL"] = "1"
    return env


def host_launch(vendor: str, hosts: Hosts, per_host: int) -> list[str]:
    """mpiexec's arguments that start ``per_host`` ranks on each emulated host.

    MPICH's hydra and Open MPI's prterun both take an ssh stand-in (``hosts.launcher``)
    and a hostfile of the hosts' addresses; their daemons call back to mpiexec at the
    switch's address.
    """
    path = os.path.join(hosts.workdir, "hostfile")
    addresses = [hosts.address(i) for i in range(hosts.count)]
    with open(path, "w") as f:
        if vendor == "Open MPI":
            f.writelines(f"{a} slots={per_host}\n" for a in addresses)
        else:
            f.writelines(f"{a}:{per_host}\n" for a in addresses)
    if vendor == "Open MPI":
        return [
            "--prtemca", "plm_ssh_agent", hosts.launcher,
            "--prtemca", "oob_tcp_if_include", f"{namespace.SUBNET}.0/24",
            "--hostfile", path,
        ]  # fmt: skip
    return [
        "-launcher", "ssh", "-launcher-exec", hosts.launcher,
        "-f", path, "-localhost", namespace.SWITCH_ADDRESS,
    ]  # fmt: skip


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
    """Launch MPI programs on an emulated network; kill the whole job on interrupt."""

    def __init__(self, net, ranks: int, env: dict[str, str], launch: list[str] = ()):
        self.net, self.ranks, self.env, self.launch = net, ranks, env, list(launch)

    def run(self, args: list[str], ranks: int | None = None, stdout=None) -> str | None:
        """Run ``python -m mpi4py ARGS`` on the ranks; return its stdout if ``stdout``
        is ``subprocess.PIPE``."""
        cmd = self.net.prefix() + ["env"] + [f"{k}={v}" for k, v in self.env.items()]
        cmd += [mpiexec(), *self.launch, "-n", str(ranks or self.ranks)]
        cmd += [sys.executable, "-m", "mpi4py"]
        proc = subprocess.Popen(cmd + args, stdout=stdout, start_new_session=True)
        try:
            out, _ = proc.communicate()
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:3])} ... exited with {proc.returncode}")
        return out

    def json(self, args: list[str], ranks: int | None = None) -> list:
        """Run ``python -m mpi4py ARGS`` on the ranks; return the JSON it printed."""
        return json.loads(self.run(args, ranks, stdout=subprocess.PIPE))

    def bench(
        self,
        numel: int,
        codecs: list[str],
        reps: int,
        trace_dir: str | None,
        schedules: str | None = None,
    ) -> list:
        args = ["-m", "mpicomp", "bench", "--no-kernels", "--sizes", str(numel)]
        args += ["--allreduce-reps", str(reps), "--tc-dev", ",".join(self.net.tc_devs())]
        args += ["--json", "--codecs"]
        args += [",".join(codecs)]
        if schedules:
            args += ["--schedules", schedules]
        if trace_dir is not None:
            args += ["--trace", trace_dir]
        return [a for row in self.json(args) for a in row["allreduce"]]


def traced_recv(path: str) -> int:
    """Bytes the ranks received, summed over every event of a trace."""
    events, _, _ = read(path)
    return int(events["bytes_recv"].sum())


def check_rows(rows: list[dict], reps: int, uncounted: str | None = None) -> list[dict]:
    """Compare tc's bytes with the traces' bytes, per codec; return one check per row.

    Every byte crosses one counted qdisc once, on its way to the rank that receives it
    (the shared loopback; or a host's download link, or its loopback between its own
    ranks), so tc should count what the traces say the ranks received (a trace's
    *sent* column counts a payload once even when an allgather relays it N - 1 times).
    For the ``MPI_SUM`` codecs (and calls that ran by ``float32``) the trace has
    MPI_Allreduce's logical 4n per rank and MPI's ring moves 2(N-1)/N times that. ``uncounted``: why some bytes cross no
    qdisc (ranks of one host over shared memory); the checks then say so, ``ok`` None.
    """
    checks = []
    for r in rows:
        calls = reps + 1
        traced = traced_recv(r["trace"]) if "trace" in r else r["recv_total"] * calls
        device = r["device_bytes"] * calls
        ratio = device / traced if traced else None
        n = r["nranks"]
        summed = r["codec"] in MPI_SUM or r.get("chosen") == "float32"  # an MPI_Allreduce
        expected = 2 * (n - 1) / n if summed and n > 1 else 1.0
        checks.append(
            {
                "codec": r["codec"],
                "params": r["params"],
                "device_bytes": device,
                "traced_bytes": traced,
                "device_over_traced": ratio,
                "expected": expected,
                "ok": None
                if uncounted
                else ratio is not None and abs(ratio / expected - 1) <= DEVICE_TOLERANCE,
            }
        )
        if uncounted:
            checks[-1]["not_checked"] = uncounted
    return checks


def report(result: dict, out=sys.stdout) -> None:
    """Print the summary table of one shaped rate."""
    rate = result["rate"]
    where = (
        f"per host link ({result['hosts']} hosts)" if result.get("hosts") else "aggregate, one lo"
    )
    print(
        f"\n{rate}: MPI_Allreduce of {result['numel']:,} float32 on {result['ranks']} ranks "
        f"{result['allreduce_s']:.2f} s, achieved {result['achieved_gbit']:.2f} Gbit/s "
        f"({100 * result['achieved_over_rate']:.0f}% of the rate; {where}: device "
        "bytes / time)",
        file=out,
    )
    head = f"{'codec':<27}{'params':<14}{'schedule':<22}{'time s':>8}{'pred s':>8}{'speedup':>9}"
    head += f"{'target':>8}  {'':<5}"
    head += (
        f"{'sent MB/rank':>13}{'tc/trace':>9}{'expect':>8}{'overhead s':>11}{'b-even Gbit/s':>14}"
    )
    at_target = result["rate"] != UNSHAPED and result["rate_bps"] == TARGET_RATE

    def line(r: dict, c: dict) -> str:
        target = TARGETS.get((r["codec"], label(r["params"]))) if at_target else None
        verdict = "" if target is None else ("met" if r["speedup"] >= target else "MISS")
        ratio = "-" if c["device_over_traced"] is None else f"{c['device_over_traced']:.3f}"
        even = "-" if r["break_even_gbit"] is None else f"{r['break_even_gbit']:.2f}"
        return (
            f"{r['codec']:<27}{label(r['params']):<14}{schedule_label(r):<22}"
            f"{r['time_s']:>8.2f}{_seconds(r.get('predicted_s')):>8}{r['speedup']:>9.2f}"
            f"{'' if target is None else f'{target:.0f}x':>8}  {verdict:<5}"
            f"{r['bytes_sent'] / 1e6:>13.2f}{ratio:>9}{c['expected']:>8.3f}"
            f"{r['overhead_s']:>11.3f}{even:>14}"
        )

    lines = (line(r, c) for r, c in zip(result["rows"], result["checks"], strict=True))
    print_table(head, lines, out)
    format_verdicts(chooser_verdicts(result["rows"]), out)
    unchecked = {c["not_checked"] for c in result["checks"] if c.get("not_checked")}
    for why in unchecked:
        print(f"tc/trace not checked: {why}", file=out)
    if "links" in result:
        report_links(result["links"], out)


def _seconds(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def report_links(links: dict, out=sys.stdout) -> None:
    """Print each host's link bytes over the whole run of one rate (both directions)."""
    print(
        f"links over the run: up {links['up'] / 1e6:,.1f} MB, down {links['down'] / 1e6:,.1f} MB "
        f"(down/up {links['down_over_up']:.3f}); per host MB up/down/lo: "
        + ", ".join(
            f"h{i} {u / 1e6:.0f}/{d / 1e6:.0f}/{lo / 1e6:.0f}"
            for i, (u, d, lo) in enumerate(links["per_host"])
        ),
        file=out,
    )


def _rate_bps(rate: str) -> int | None:
    return None if rate == UNSHAPED else parse_rate(rate)


def link_bytes(links: dict[str, int], net) -> float:
    """Bytes per shaped link (the mean over links) of a row's ``device_links``."""
    return sum(links[d] for d in net.link_devs()) / net.nlinks


def add_overhead(rows: list[dict], net) -> None:
    """Add each row's compute overhead and the link rate at which it breaks even.

    ``overhead_s``: the row's time less what its link bytes take at the rate
    MPI_Allreduce achieved in the same run; ``break_even_gbit``: the rate per link
    (aggregate on the shared loopback) at which the bytes it saves take exactly that
    long (compression pays below it).
    """
    for r in rows:
        ref_bytes = link_bytes(r["allreduce_device_links"], net)
        mine = link_bytes(r["device_links"], net)
        overhead = r["time_s"] - r["allreduce_s"] * mine / ref_bytes
        saved = ref_bytes - mine
        r["overhead_s"] = overhead
        pays = overhead > 0 and saved > 0.01 * ref_bytes
        r["break_even_gbit"] = 8 * saved / overhead / 1e9 if pays else None


def uncounted(args) -> str | None:
    """Why some traced bytes cross no counted qdisc in this layout, or None."""
    if args.hosts and args.ranks_per_host > 1 and args.intra_host == "shm":
        return (
            "ranks of one host talk over shared memory, which no qdisc counts "
            "(--intra-host tcp counts them on the host's loopback)"
        )
    return None


def link_totals(before: dict[str, int], after: dict[str, int], hosts: int) -> dict:
    """Every host link's bytes between two ``Hosts.counters()`` readings; whether what
    the hosts sent up is what the switch delivered down."""
    delta = {k: after[k] - before[k] for k in before}
    per_host = [(delta[f"h{i} up"], delta[f"h{i} down"], delta[f"h{i} lo"]) for i in range(hosts)]
    up, down = sum(u for u, _, _ in per_host), sum(d for _, d, _ in per_host)
    ratio = down / up if up else None
    return {
        "per_host": per_host,
        "up": up,
        "down": down,
        "down_over_up": ratio,
        "ok": ratio is not None and abs(ratio - 1) <= DEVICE_TOLERANCE,
    }


def run_rate(runner: Runner, rate: str, args, out_dir: str) -> dict:
    """Shape to ``rate``, run the bench, check bytes; return the result record."""
    net = runner.net
    bps = _rate_bps(rate)
    net.shape(bps)
    trace_dir = os.path.join(out_dir, rate)
    before = net.counters() if args.hosts else None
    rows = runner.bench(args.numel, args.codecs, args.reps, trace_dir, args.schedules)
    add_overhead(rows, net)
    ref = rows[0]
    achieved = link_bytes(ref["allreduce_device_links"], net) * 8 / ref["allreduce_s"]
    bps = bps or achieved
    result = {
        "rate": rate,
        "rate_bps": bps,
        "ranks": args.ranks,
        "hosts": args.hosts,
        "numel": args.numel,
        "allreduce_s": ref["allreduce_s"],
        "achieved_gbit": achieved / 1e9,
        "achieved_over_rate": achieved / bps,
        "rows": rows,
        "checks": check_rows(rows, args.reps, uncounted(args)),
    }
    if before is not None:
        result["links"] = link_totals(before, net.counters(), args.hosts)
    return result


def train(runner: Runner, rate: str, args, out_dir: str) -> dict:
    """jobs/train.py (every codec against float32) on the network shaped to ``rate``;
    return its results.json with tc's bytes against the traced ones over the run."""
    net = runner.net
    net.shape(_rate_bps(rate))
    out = os.path.join(out_dir, f"train-{rate}")
    devs = net.tc_devs()
    before = {d: net.sent_bytes(d) for d in devs}
    # --warmup rank: nothing on the links but the traced steps (the byte check below).
    argv = ["-m", "jobs.train", "--steps", str(args.train_steps), "--out", out, "--no-plot"]
    argv += ["--warmup", "rank"]
    runner.run(argv + ["--hidden", args.train_hidden])
    device = sum(net.sent_bytes(d) - before[d] for d in devs)
    with open(os.path.join(out, "results.json")) as f:
        result = json.load(f)
    n = args.ranks
    ring = 2 * (n - 1) / n if n > 1 else 1.0
    # what tc should count: the traced bytes, MPI_Allreduce's logical ones times its ring's
    expected = sum(
        traced_recv(r["trace"]) * (ring if r["codec"] in MPI_SUM else 1.0) for r in result["runs"]
    )
    result.update(rate=rate, device_bytes=device, expected_bytes=expected)
    why = uncounted(args)
    if expected < TRAIN_CHECK_MIN:
        why = (
            f"under {TRAIN_CHECK_MIN / 1e6:.0f} MB traced: the job's untraced messages "
            "(start-up, results) are too large a share"
        )
    result["ok"] = None if why else abs(device / expected - 1) <= DEVICE_TOLERANCE
    if why:
        result["not_checked"] = why
    return result


def report_train(result: dict, out=sys.stdout) -> None:
    """Print the training job's figures at one rate."""
    print(f"\n{result['rate']}: jobs.train, {result['meta']['steps']} steps", file=out)
    head = f"{'run':<36}{'test acc':>9}{'ms/step':>9}{'comm ms':>9}{'x float32':>10}"
    base = next((r for r in result["runs"] if r["codec"] == "none"), None)

    def line(r: dict) -> str:
        speed = base["ms_step"] / r["ms_step"] if base else float("nan")
        return (
            f"{r['label']:<36}{100 * r['test_accuracy']:>8.1f}%{r['ms_step']:>9.1f}"
            f"{r['ms_comm']:>9.1f}{speed:>10.2f}"
        )

    print_table(head, map(line, result["runs"]), out)
    print(
        f"tc counted {result['device_bytes'] / 1e6:,.1f} MB over the run, the traces say "
        f"{result['expected_bytes'] / 1e6:,.1f} MB"
        + (f" (not checked: {result['not_checked']})" if result.get("not_checked") else ""),
        file=out,
    )


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
    lines = (
        f"{r['scheme']:<20}{r['ranks']:>3}{r['bytes_recv_per_rank']:>14,}"
        f"{r['recv_bits_per_element']:>9.2f}{str(r['bytes_match']):>10}{r['seconds']:>8.2f}"
        for r in rows
    )
    print_table(head, lines, out)


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
    lines = (
        f"{r['codec']:<16}{r['params']:<10}{r['t_sequential']:>13.2f}{r['t_overlapped']:>13.2f}"
        f"{100 * r['saving']:>7.1f}%{100 * r['bound_saving']:>6.1f}%"
        for r in rows
    )
    print_table(head, lines, out)


def overlap_torch(runner: Runner, rate: str, args) -> dict:
    """jobs/overlap_torch.py on the network shaped to ``rate``: a torch model of about
    ``--numel`` parameters, backward-only, all-reduce-only, sequential and overlapped
    steps; return the result record."""
    runner.net.shape(_rate_bps(rate))
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


def probe(runner: Runner, numel: int, groups: int) -> float:
    """Return the unshaped TCP path's rate (bit/s, per link) as MPI_Allreduce achieves it.

    ``groups``: the ranks, or the hosts (whose own ranks may share memory): a float32
    all-reduce moves at least 2(groups - 1) 4n bytes across the counted qdiscs.

    Raises:
        RuntimeError: tc saw (almost) none of the all-reduce's bytes: MPI is not on TCP
            over the emulated network, so a shaper would be bypassed and figures fiction.
    """
    net = runner.net
    net.shape(None)
    ref = runner.bench(numel, ["none"], 1, None)[0]
    expected = 2 * (groups - 1) * 4 * numel
    if ref["allreduce_device_bytes"] < 0.5 * expected:
        raise RuntimeError(
            f"tc counted {ref['allreduce_device_bytes']:,} bytes on the emulated links for an "
            f"all-reduce that moves about {expected:,}: the MPI library is not using TCP over "
            "them, so the shaper would be bypassed (for MPICH set MPIR_CVAR_CH4_NETMOD=ofi "
            "FI_PROVIDER=tcp)"
        )
    return link_bytes(ref["allreduce_device_links"], net) * 8 / ref["allreduce_s"]


def _parse(argv):
    ap = argparse.ArgumentParser(prog="jobs.netem", description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=None, help="MPI ranks on the shared lo (4)")
    ap.add_argument(
        "--hosts",
        type=int,
        default=0,
        help="emulate this many hosts, each with a link of its own into a switch, shaped "
        "to the rate in both directions (0: every rank on one shared loopback; 0)",
    )
    ap.add_argument(
        "--ranks-per-host", type=int, default=1, help="with --hosts: ranks on each host (1)"
    )
    ap.add_argument(
        "--intra-host",
        choices=INTRA_HOST,
        default="shm",
        help="with --hosts: how ranks of one host talk, shared memory as on a cluster node "
        "or TCP over the host's loopback, which tc counts (shm)",
    )
    ap.add_argument("--numel", default="25.6M", help="gradient elements (25.6M)")
    ap.add_argument(
        "--rates",
        default=f"1gbit,10gbit,{UNSHAPED}",
        help=f"tbf rates, and {UNSHAPED!r} for none (1gbit,10gbit,{UNSHAPED})",
    )
    ap.add_argument("--codecs", default=None, help="comma-separated codec names (all)")
    ap.add_argument("--reps", type=int, default=3, help="timed all-reduces per codec (3)")
    ap.add_argument(
        "--schedules",
        default=None,
        help="the schedules each codec runs, as `mpicomp bench --schedules` (its default)",
    )
    ap.add_argument("--out", default="netem-out", help="output directory (netem-out)")
    ap.add_argument(
        "--scheme-ranks",
        default="4,8",
        help="at 1gbit, also compare signSGD's ring, allgather and alltoall+allgather at "
        "these rank counts ('' to skip; 4,8; with --hosts the job's ranks only)",
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
    ap.add_argument(
        "--train-steps",
        type=int,
        default=0,
        help="also run the training job (jobs.train, every codec) for this many steps at "
        "each rate (0: not; 0)",
    )
    ap.add_argument(
        "--train-hidden",
        default="1024,1024",
        help="hidden widths of the training job's MLP (1024,1024: 1.1M parameters)",
    )
    args = ap.parse_args(argv)
    try:
        args.numel = parse_count(args.numel)
        args.rates = [r.strip() for r in args.rates.split(",") if r.strip()]
        for r in args.rates:
            _rate_bps(r)
        args.scheme_ranks = [int(r) for r in args.scheme_ranks.split(",") if r.strip()]
        names = args.codecs.split(",") if args.codecs else None
        args.codecs = list(dict.fromkeys(n for n, _ in codec_set(names)))
    except ValueError as e:
        ap.error(str(e))
    if args.hosts:
        if args.ranks is not None:
            ap.error("--ranks is for the shared loopback; with --hosts give --ranks-per-host")
        if not 1 <= args.hosts <= namespace.MAX_HOSTS or args.ranks_per_host < 1:
            ap.error(f"--hosts must be 1..{namespace.MAX_HOSTS}, --ranks-per-host >= 1")
        args.ranks = args.hosts * args.ranks_per_host
        args.scheme_ranks = [args.ranks] if args.scheme_ranks else []
    elif args.ranks is None:
        args.ranks = 4
    if args.ranks < 1 or args.reps < 1 or args.numel < 1 or args.train_steps < 0:
        ap.error("--ranks, --reps and --numel must be >= 1, --train-steps >= 0")
    return args


def _network(args, vendor: str):
    """The emulated network of ``args`` (a context manager) and its Runner's factory."""
    if not args.hosts:
        ns = Namespace()
        return ns, lambda: Runner(ns, args.ranks, mpi_env(vendor))
    hosts = Hosts(args.hosts)
    env = mpi_env(vendor, hosts=True, intra_host=args.intra_host)
    return hosts, lambda: Runner(
        hosts, args.ranks, env, host_launch(vendor, hosts, args.ranks_per_host)
    )


def _describe(args, vendor: str, net) -> str:
    if not args.hosts:
        return f"jobs.netem: namespace {net.name}, {vendor} over TCP on lo"
    return (
        f"jobs.netem: {args.hosts} hosts ({net.base}-h0..) on a switch, "
        f"{args.ranks_per_host} rank(s) each, {vendor} over TCP on {namespace.NIC}, "
        f"within a host over {args.intra_host}"
    )


def main(argv=None) -> int:
    """Run the emulated-network benchmark; return 0, 1 (a check failed) or 2 (cannot run)."""
    args = _parse(argv)
    os.makedirs(args.out, exist_ok=True)
    vendor = mpi_vendor()
    summary = {
        "ranks": args.ranks,
        "hosts": args.hosts,
        "ranks_per_host": args.ranks_per_host if args.hosts else None,
        "intra_host": args.intra_host if args.hosts else None,
        "numel": args.numel,
        "mpi": vendor,
        "rates": [],
    }
    started = time.time()
    try:
        net, make_runner = _network(args, vendor)
        with net:
            runner = make_runner()
            print(_describe(args, vendor, net), file=sys.stderr)
            unshaped = probe(runner, args.numel, args.hosts or args.ranks)
            summary["unshaped_gbit"] = unshaped / 1e9
            print(
                f"unshaped TCP {'links' if args.hosts else 'loopback'}: MPI_Allreduce "
                f"achieves {unshaped / 1e9:.2f} Gbit/s "
                f"({'per host link' if args.hosts else 'aggregate'} device bytes / time)"
            )
            for rate in args.rates:
                if rate != UNSHAPED and parse_rate(rate) > unshaped:
                    note = (
                        f"skipped: the unshaped path reaches {unshaped / 1e9:.2f} Gbit/s, "
                        f"below {rate}; shaping to it would measure the CPU, not the link"
                    )
                    print(f"\n{rate}: {note}")
                    summary["rates"].append({"rate": rate, "skipped": note})
                    continue
                if args.overlap_torch:
                    result = overlap_torch(runner, rate, args)
                    summary["rates"].append(result)
                    report_overlap_torch(result)
                    continue
                result = run_rate(runner, rate, args, args.out)
                summary["rates"].append(result)
                report(result)
                if result["rate_bps"] == TARGET_RATE and rate != UNSHAPED:
                    if args.scheme_ranks:
                        result["signsgd_schemes"] = schemes(runner, args)
                        report_schemes(result["signsgd_schemes"], rate)
                    if args.overlap_buckets:
                        result["overlap"] = overlap(runner, args)
                        report_overlap(result["overlap"], rate)
                if args.train_steps:
                    result["train"] = train(runner, rate, args, args.out)
                    report_train(result["train"])
    except NeedsRoot as e:
        print(f"jobs.netem: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("jobs.netem: interrupted; namespaces removed", file=sys.stderr)
        return 130
    summary["seconds"] = time.time() - started
    path = os.path.join(args.out, "netem.json")
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)
    bad = failed_checks(summary)
    for line in bad:
        print(f"check failed: {line}", file=sys.stderr)
    print(f"\nwrote {path} ({summary['seconds']:.0f} s)")
    return 1 if bad else 0


def failed_checks(summary: dict) -> list[str]:
    """Every byte check of the run that failed, said in a line each."""
    bad = []
    for r in summary["rates"]:
        for c in r.get("checks", []):
            if c["ok"] is False and c["traced_bytes"] > 1e6:
                bad.append(
                    f"{r['rate']} {c['codec']} {label(c['params'])}: tc counted "
                    f"{c['device_over_traced']:.3f}x the traced bytes"
                )
        links = r.get("links")
        if links and not links["ok"]:
            bad.append(
                f"{r['rate']}: the switch delivered {links['down_over_up']}x what the hosts sent"
            )
        run = r.get("train")
        if run and run["ok"] is False:
            bad.append(
                f"{r['rate']} jobs.train: tc counted "
                f"{run['device_bytes'] / run['expected_bytes']:.3f}x the traced bytes"
            )
    return bad


if __name__ == "__main__":
    sys.exit(main())
