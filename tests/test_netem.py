"""jobs/netem: rate parsing, the byte check, the root requirement, and one small shaped run."""

import json
import os
import signal
import subprocess
import sys
import time
import types

import pytest

from jobs.netem import job
from jobs.netem.namespace import NIC, SUBNET, SWITCH_ADDRESS, Hosts, Namespace, NeedsRoot
from mpicomp.tools.advise import parse_rate


def test_parse_rate_units():
    assert parse_rate("1gbit") == 10**9
    assert parse_rate("10Gbit") == 10**10
    assert parse_rate("500mbit") == 5 * 10**8
    assert parse_rate("2.5gbit") == 2_500_000_000
    for bad in ("", "fast", "1gb", "0gbit", "-1mbit", "gbit"):
        with pytest.raises(ValueError, match="not a rate"):
            parse_rate(bad)


def test_mpi_env_forces_tcp():
    mpich = job.mpi_env("MPICH")
    assert mpich["MPIR_CVAR_CH4_NETMOD"] == "ofi" and mpich["FI_PROVIDER"] == "tcp"
    assert mpich["MPIR_CVAR_NOLOCAL"] == "1"
    ompi = job.mpi_env("Open MPI")
    assert ompi["OMPI_MCA_btl"] == "tcp,self" and ompi["OMPI_MCA_btl_tcp_if_include"] == "lo"


def test_mpi_env_per_host_uses_the_nic_and_shares_memory_within_a_host_unless_told():
    shm = job.mpi_env("MPICH", hosts=True, intra_host="shm")
    assert shm["FI_TCP_IFACE"] == NIC and "MPIR_CVAR_NOLOCAL" not in shm
    assert job.mpi_env("MPICH", hosts=True, intra_host="tcp")["MPIR_CVAR_NOLOCAL"] == "1"
    ompi = job.mpi_env("Open MPI", hosts=True, intra_host="shm")
    assert ompi["OMPI_MCA_btl"] == "tcp,self,sm" and ompi["OMPI_MCA_btl_tcp_if_include"] == NIC
    assert job.mpi_env("Open MPI", hosts=True, intra_host="tcp")["OMPI_MCA_btl"] == "tcp,self"


def test_host_launch_writes_each_vendors_hostfile_and_names_the_launcher(tmp_path):
    hosts = types.SimpleNamespace(
        workdir=str(tmp_path), count=3, launcher="/x/enter-host", address=Hosts.address
    )
    mpich = job.host_launch("MPICH", hosts, 2)
    assert mpich[mpich.index("-launcher-exec") + 1] == "/x/enter-host"
    assert mpich[mpich.index("-localhost") + 1] == SWITCH_ADDRESS
    lines = (tmp_path / "hostfile").read_text().split()
    assert lines == [f"{SUBNET}.1:2", f"{SUBNET}.2:2", f"{SUBNET}.3:2"]
    ompi = job.host_launch("Open MPI", hosts, 1)
    assert ompi[ompi.index("plm_ssh_agent") + 1] == "/x/enter-host"
    text = (tmp_path / "hostfile").read_text()
    assert text.splitlines() == [f"{SUBNET}.{i} slots=1" for i in (1, 2, 3)]


def test_hosts_options_give_the_rank_count_and_refuse_a_rank_count_beside_them():
    args = job._parse(["--hosts", "3", "--ranks-per-host", "2", "--rates", "1gbit"])
    assert args.ranks == 6 and args.scheme_ranks == [6]
    assert job._parse(["--rates", "1gbit"]).ranks == 4
    for bad in (["--hosts", "2", "--ranks", "4"], ["--hosts", "0x"], ["--hosts", "99"]):
        with pytest.raises(SystemExit):
            job._parse(bad)


def test_link_totals_check_that_the_switch_delivers_what_the_hosts_sent():
    before = {f"h{i} {d}": 100 for i in range(2) for d in ("up", "down", "lo")}
    after = {"h0 up": 1100, "h0 down": 2100, "h0 lo": 100, "h1 up": 2100, "h1 down": 1100}
    after["h1 lo"] = 600
    links = job.link_totals(before, after, 2)
    assert links["per_host"] == [(1000, 2000, 0), (2000, 1000, 500)] and links["ok"]
    after["h1 down"] = 900  # 200 bytes lost between the hosts: a bypass or a leak
    assert not job.link_totals(before, after, 2)["ok"]


def test_byte_checks_are_skipped_and_said_so_where_shared_memory_hides_bytes():
    two_per_host = job._parse(["--hosts", "2", "--ranks-per-host", "2"])
    why = job.uncounted(two_per_host)
    assert "shared memory" in why
    assert job.uncounted(job._parse(["--hosts", "2"])) is None
    assert job.uncounted(job._parse(["--hosts", "2", "--ranks-per-host", "2",
                                     "--intra-host", "tcp"])) is None  # fmt: skip
    (check,) = job.check_rows([_row("signsgd", 1000, 700)], reps=1, uncounted=why)
    assert check["ok"] is None and check["not_checked"] == why
    summary = {"rates": [{"rate": "1gbit", "checks": [check]}]}
    assert job.failed_checks(summary) == []
    check = dict(check, ok=False, traced_bytes=2e6)
    summary["rates"][0].update(checks=[check], train={"ok": False, "device_bytes": 3,
                                                      "expected_bytes": 2})  # fmt: skip
    assert len(job.failed_checks(summary)) == 2


def _row(codec, recv_total, device_bytes, nranks=4):
    return {
        "codec": codec,
        "params": {},
        "nranks": nranks,
        "recv_total": recv_total,
        "device_bytes": device_bytes,
    }


def test_check_rows_expects_1x_for_own_collectives_and_a_ring_for_mpi_sum():
    rows = [
        _row("signsgd", 1000, 1010),  # 1% headers: fine
        _row("signsgd", 1000, 1200),  # 20% more than traced: a leak (or bypass)
        _row("none", 1000, 1500),  # MPI's ring: 2(N-1)/N = 1.5 at N = 4
        _row("none", 1000, 1000),  # MPI moved less than a ring would: suspicious
    ]
    checks = job.check_rows(rows, reps=1)
    assert [c["ok"] for c in checks] == [True, False, True, False]
    assert checks[0]["traced_bytes"] == 2000 and checks[0]["device_bytes"] == 2020
    assert checks[2]["expected"] == pytest.approx(1.5)


def test_not_root_says_so(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(NeedsRoot, match="needs root"):
        Namespace()


def _netns_usable() -> bool:
    if os.geteuid() != 0:
        return False
    try:
        with Namespace(f"mpicomp-probe-{os.getpid()}"):
            return True
    except (NeedsRoot, RuntimeError):
        return False


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


_REPO = os.path.dirname(os.path.dirname(__file__))


def _shaped_run(tmp_path, *argv) -> dict:
    """Run jobs.netem with ``argv`` at 1 Gbit/s, one rep, into ``tmp_path``; return the
    one rate's record, once the run succeeded and left no namespace behind."""
    before = _namespaces()
    argv = [*argv, "--reps", "1", "--rates", "1gbit", "--out", str(tmp_path)]
    out = subprocess.run(
        [sys.executable, "-m", "jobs.netem", *argv],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=_REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert _namespaces() - before == set()
    summary = json.loads((tmp_path / "netem.json").read_text())
    (rate,) = summary["rates"]
    assert rate["rate"] == "1gbit"
    # tc counts TCP/IP headers and pure ACKs too: a few percent of a large transfer (the
    # job's own 5% check), up to ~20% of one made of many small messages.
    for c in rate["checks"]:
        if c["traced_bytes"] >= 1e6:
            assert c["ok"], c
        else:
            assert 0.95 <= c["device_over_traced"] / c["expected"] <= 1.25, c
    return summary


@pytest.mark.skipif(not _netns_usable(), reason="needs root and network namespaces")
def test_small_shaped_run_counts_what_the_traces_say(tmp_path):
    # 2 ranks, 400k elements, 1 Gbit/s: a few seconds. tc must see the bytes the traces
    # report (the shaper is not bypassed), and the namespace must be gone afterwards.
    summary = _shaped_run(
        tmp_path, "--ranks", "2", "--numel", "400K", "--codecs", "none,signsgd,qsgd_maxnorm",
        "--scheme-ranks", "2", "--overlap-buckets", "2",
    )  # fmt: skip
    (rate,) = summary["rates"]
    # The shaper holds (never above the rate); below it, CPU contention decides how close.
    assert 0.1 < rate["achieved_over_rate"] < 1.2
    assert {r["codec"] for r in rate["rows"]} == {"none", "signsgd", "qsgd_maxnorm"}
    assert all(os.path.isfile(r["trace"]) for r in rate["rows"])
    assert {r["scheme"] for r in rate["signsgd_schemes"]} >= {"ring", "alltoall_allgather"}
    assert all(r["bytes_match"] and r["decisions_match"] for r in rate["signsgd_schemes"])
    assert {r["codec"] for r in rate["overlap"]} == {"none", "qsgd_maxnorm", "threelc"}


@pytest.mark.skipif(not _netns_usable(), reason="needs root and network namespaces")
def test_hosts_with_links_of_their_own_count_what_the_traces_say(tmp_path):
    # 2 hosts, 1 rank each, 1 Gbit/s per link: the bench and 4 training steps, a few
    # seconds. Every link's bytes must match the traces and the namespaces must go.
    summary = _shaped_run(
        tmp_path, "--hosts", "2", "--numel", "400K", "--codecs", "none,signsgd,threelc",
        "--overlap-buckets", "0", "--train-steps", "4", "--train-hidden", "512,512",
    )  # fmt: skip
    assert summary["hosts"] == 2 and summary["ranks"] == 2
    (rate,) = summary["rates"]
    links = rate["links"]
    assert links["ok"] and all(up > 0 and down > 0 for up, down, _ in links["per_host"])
    assert rate["train"]["ok"] and {r["codec"] for r in rate["train"]["runs"]} >= {"none"}
    assert all(r["bytes_match"] for r in rate["signsgd_schemes"])


@pytest.mark.skipif(not _netns_usable(), reason="needs root and network namespaces")
def test_each_emulated_host_is_a_host_to_mpi_and_to_mpicomp_info(tmp_path):
    vendor = job.mpi_vendor()
    with Hosts(2, base=f"mpicomp-test-{os.getpid()}") as hosts:
        hosts.shape(None)
        env = job.mpi_env(vendor, hosts=True, intra_host="shm")
        runner = job.Runner(hosts, 4, env, job.host_launch(vendor, hosts, 2))
        ranks = runner.json(["-m", "mpicomp", "info", "--all-ranks", "--json"])["ranks"]
        assert [r["host"] for r in ranks] == ["h0", "h0", "h1", "h1"]
        assert [r["local rank"] for r in ranks] == [0, 1, 0, 1]
    assert not os.path.exists(hosts.launcher or "/nonexistent")


@pytest.mark.skipif(not _netns_usable(), reason="needs root and network namespaces")
def test_ctrl_c_removes_every_namespace(tmp_path):
    before = _namespaces()
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobs.netem", "--hosts", "3", "--numel", "400K",
         "--rates", "1gbit", "--reps", "50", "--out", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=_REPO,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_namespaces() - before) < 4 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(_namespaces() - before) == 4  # the switch and three hosts
        time.sleep(1)  # let it start MPI inside them
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err[-2000:]
    assert _namespaces() - before == set()
