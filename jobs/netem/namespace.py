"""Private network namespaces for the emulated-network job, shaped with tc tbf.

Two layouts, both deleted on exit, on an exception and on SIGINT/SIGTERM:

- :class:`Namespace`: one namespace whose loopback carries every rank's traffic. MPI
  over TCP on 127.0.0.1 crosses its root qdisc once per byte, so ``tc -s qdisc``
  counts every byte the ranks put on the wire, and ``tbf`` caps their *aggregate*
  rate, like a shared segment.
- :class:`Hosts`: H namespaces, one per emulated host, each with one NIC (a veth pair)
  into a bridge in a switch namespace: a link per node, shaped in both directions
  (the host's upload on its ``eth0``, its download on the switch's port), as a
  non-blocking switch and one NIC per node look to a bulk transfer.

This kernel has no netem; a token bucket is what a slow link looks like to a bulk
transfer. Traffic stays inside the namespaces the job made (their own addresses,
``SUBNET``); nothing is routed to the machine's own network.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import stat
import subprocess
import tempfile

# A loopback or a veth with GSO hands the qdisc packets of up to 64 KiB: a bucket
# smaller than one packet would drop every packet.
_MIN_BURST = 256 * 1024

# The emulated hosts' network: host i is SUBNET.(i + 1), the switch (where mpiexec runs)
# SUBNET.254. Private to the namespaces; never routed anywhere else.
SUBNET = "10.77.0"
SWITCH_ADDRESS = f"{SUBNET}.254"
MAX_HOSTS = 64

# Each host's NIC, as seen from inside its namespace (MPI is told to use it).
NIC = "eth0"

# Jumbo frames, as cluster Ethernet fabrics run: TCP/IP headers are ~0.6% of the bytes
# on the wire instead of ~4.5% at 1500, so tc's counts stay within the byte check's 5%.
MTU = 9000


class NeedsRoot(RuntimeError):
    """The job cannot create or shape a namespace here (not root, or no ip/tc)."""


def _tool(name: str) -> str:
    path = shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/sbin/{name}") if os.access(p, os.X_OK)), None
    )
    if path is None:
        raise NeedsRoot(
            f"`{name}` (iproute2) not found; install iproute2 (apt-get install iproute2)"
        )
    return path


class _Namespaces:
    """Creates namespaces by name, deletes them all on exit; Ctrl-C included."""

    def __init__(self):
        if os.geteuid() != 0:
            raise NeedsRoot(
                "jobs.netem needs root: it creates network namespaces and shapes their "
                "links with tc (CAP_NET_ADMIN). Run it as root, e.g. "
                "`sudo make bench-netem`."
            )
        self.ip, self.tc = _tool("ip"), _tool("tc")
        self._made: list[str] = []
        self._old = {}

    def __enter__(self):
        # Ctrl-C or a kill while the bench runs must still delete the namespaces.
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, _interrupt)
        try:
            self._build()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        # A second Ctrl-C during the delete must not leave a namespace behind.
        for sig in self._old:
            signal.signal(sig, signal.SIG_IGN)
        self._teardown()
        for name in reversed(self._made):
            subprocess.run([self.ip, "netns", "delete", name], capture_output=True)
        self._made = []
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def _build(self) -> None:
        raise NotImplementedError

    def _teardown(self) -> None:
        """Remove what is not inside a namespace (deleting one removes its links)."""

    def _add(self, name: str) -> None:
        out = subprocess.run([self.ip, "netns", "add", name], capture_output=True, text=True)
        if out.returncode != 0:
            raise NeedsRoot(f"ip netns add {name}: {out.stderr.strip()}")
        self._made.append(name)
        _check([self.ip, "-n", name, "link", "set", "lo", "up"])

    def _shape(self, netns: str, dev: str, rate_bps: int | None) -> None:
        """Cap ``dev``'s egress at ``rate_bps`` with tbf (None: a byte-counting fifo).

        Replacing the root qdisc also zeroes its byte counter.
        """
        base = [self.tc, "-n", netns, "qdisc", "replace", "dev", dev, "root"]
        if rate_bps is None:
            _check(base + ["pfifo", "limit", "10000"])
            return
        burst = max(rate_bps // 8 // 100, _MIN_BURST)  # 10 ms of traffic
        _check(base + ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "100ms"])

    @staticmethod
    def sent_bytes(dev: str) -> int:
        """Bytes the root qdisc of ``dev`` (``NETNS/DEV``) sent since it was last shaped."""
        from mpicomp.tools.bench.allreduce import tc_sent_bytes

        return tc_sent_bytes(dev)


class Namespace(_Namespaces):
    """``with Namespace() as ns:`` a fresh namespace with ``lo`` up, deleted on exit.

    Raises:
        NeedsRoot: not running as root, ``ip``/``tc`` missing, or ``ip netns add`` refused.
    """

    def __init__(self, name: str | None = None):
        super().__init__()
        self.name = name or f"mpicomp-netem-{os.getpid()}"

    def _build(self) -> None:
        self._add(self.name)

    def run_ip(self, *args: str) -> None:
        """Run ``ip -n NS ARGS``; raise RuntimeError with its message on failure."""
        _check([self.ip, "-n", self.name, *args])

    def shape(self, rate_bps: int | None) -> None:
        """Cap ``lo`` at ``rate_bps`` (None: unshaped, a byte-counting fifo)."""
        self._shape(self.name, "lo", rate_bps)

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return [self.ip, "netns", "exec", self.name]

    # Traffic crosses one shaped qdisc, the aggregate of all ranks.
    nlinks = 1

    def link_devs(self) -> list[str]:
        """The shaped qdiscs, each counting what it delivers (``NETNS/DEV``)."""
        return [f"{self.name}/lo"]

    def tc_devs(self) -> list[str]:
        """The qdiscs that count every byte a rank receives, once (bench --tc-dev)."""
        return self.link_devs()


class Hosts(_Namespaces):
    """``with Hosts(4) as hosts:`` 4 emulated hosts on a switch, deleted on exit.

    Host ``i`` is namespace ``<base>-h<i>`` with hostname ``h<i>`` (set per launch,
    in a UTS namespace of its own), address ``SUBNET.<i+1>`` on its ``eth0``, a veth
    whose other end ``vh<i>`` is a port of bridge ``br0`` in namespace ``<base>-sw``.
    mpiexec runs in the switch namespace (address ``SWITCH_ADDRESS``) and starts its
    daemons on the hosts through :attr:`launcher`, an ssh stand-in that enters the
    host's namespace; :attr:`workdir` holds it and the run's other files (a hostfile),
    removed on exit.

    Raises:
        NeedsRoot: not running as root, ``ip``/``tc`` missing, or ``ip netns add`` refused.
        ValueError: ``count`` outside 1..MAX_HOSTS.
    """

    def __init__(self, count: int, base: str | None = None):
        if not 1 <= count <= MAX_HOSTS:
            raise ValueError(f"hosts: {count} is outside 1..{MAX_HOSTS}")
        super().__init__()
        self.count = count
        self.base = base or f"mpicomp-netem-{os.getpid()}"
        self.switch = f"{self.base}-sw"
        self.hosts = [f"{self.base}-h{i}" for i in range(count)]
        self.launcher: str | None = None
        self.workdir: str | None = None

    @staticmethod
    def address(i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _build(self) -> None:
        ip = self.ip
        self._add(self.switch)
        _check([ip, "-n", self.switch, "link", "add", "br0", "mtu", str(MTU), "type", "bridge"])
        _check([ip, "-n", self.switch, "addr", "add", f"{SWITCH_ADDRESS}/24", "dev", "br0"])
        _check([ip, "-n", self.switch, "link", "set", "br0", "up"])
        for i, host in enumerate(self.hosts):
            self._add(host)
            port = f"vh{i}"
            _check([ip, "link", "add", NIC, "netns", host, "mtu", str(MTU), "type", "veth",
                    "peer", "name", port, "netns", self.switch, "mtu", str(MTU)])  # fmt: skip
            _check([ip, "-n", self.switch, "link", "set", port, "master", "br0"])
            _check([ip, "-n", self.switch, "link", "set", port, "up"])
            _check([ip, "-n", host, "addr", "add", f"{self.address(i)}/24", "dev", NIC])
            _check([ip, "-n", host, "link", "set", NIC, "up"])
        self.workdir = tempfile.mkdtemp(prefix="mpicomp-netem-")
        self.launcher = os.path.join(self.workdir, "enter-host")
        with open(self.launcher, "w") as f:
            f.write(self._launcher_script())
        os.chmod(self.launcher, stat.S_IRWXU)

    def _teardown(self) -> None:
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = self.launcher = None

    def _launcher_script(self) -> str:
        """An ssh stand-in: ``enter-host [-opts] HOST COMMAND...`` runs COMMAND (a shell
        command line, as sshd would) in HOST's namespace under HOST's own hostname.

        The hostname matters: MPI libraries tell nodes apart by it (Open MPI's ranks
        crash treating two namespaces as one node), and ``mpicomp info`` counts hosts.
        """
        cases = "\n".join(
            f"  {self.address(i)}|h{i}) ns={shlex.quote(ns)}; name=h{i} ;;"
            for i, ns in enumerate(self.hosts)
        )
        return f"""#!/bin/sh
# Written by jobs.netem for this run; removed with its namespaces.
while [ $# -gt 0 ]; do case $1 in -*) shift ;; *) break ;; esac; done
host=$1; shift
case $host in
{cases}
  *) echo "enter-host: unknown host '$host'" >&2; exit 255 ;;
esac
exec {shlex.quote(self.ip)} netns exec "$ns" unshare --uts sh -c "hostname $name && $*"
"""

    def shape(self, rate_bps: int | None) -> None:
        """Cap every host's upload and download at ``rate_bps`` (None: unshaped); count
        each host's loopback too (traffic between its own ranks)."""
        for i, host in enumerate(self.hosts):
            self._shape(host, NIC, rate_bps)
            self._shape(self.switch, f"vh{i}", rate_bps)
            self._shape(host, "lo", None)

    def prefix(self) -> list[str]:
        """The command prefix that runs mpiexec in the switch namespace."""
        return [self.ip, "netns", "exec", self.switch]

    def links(self) -> dict[str, tuple[str, str]]:
        """``{"h<i> up"|"h<i> down"|"h<i> lo": (netns, dev)}``: every counted qdisc."""
        out = {}
        for i, host in enumerate(self.hosts):
            out[f"h{i} up"] = (host, NIC)
            out[f"h{i} down"] = (self.switch, f"vh{i}")
            out[f"h{i} lo"] = (host, "lo")
        return out

    @property
    def nlinks(self) -> int:
        return self.count

    def link_devs(self) -> list[str]:
        """The hosts' download links (switch ports), each counting what its host receives."""
        return [f"{self.switch}/vh{i}" for i in range(self.count)]

    def tc_devs(self) -> list[str]:
        """The qdiscs that count every byte a rank receives, once (bench --tc-dev):
        each host's download and its loopback (between its own ranks over TCP)."""
        return self.link_devs() + [f"{host}/lo" for host in self.hosts]

    def counters(self) -> dict[str, int]:
        """Bytes each link's qdisc sent since it was last shaped."""
        return {label: self.sent_bytes(f"{ns}/{dev}") for label, (ns, dev) in self.links().items()}


def _check(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
