"""A private network namespace whose loopback is shaped by a token bucket (tc tbf).

Everything the job sends stays on that namespace's ``lo``: MPI over TCP on 127.0.0.1
crosses the root qdisc once per byte, so ``tc -s qdisc`` counts every byte the ranks
put on the wire, and ``tbf`` caps their aggregate rate (this kernel has no netem; a
token bucket is what a slow link looks like to a bulk transfer). The namespace is
deleted on exit, on an exception and on SIGINT/SIGTERM.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess

# Loopback's MTU is 64 KiB: a bucket smaller than one packet would drop every packet.
_MIN_BURST = 256 * 1024


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


class Namespace:
    """``with Namespace() as ns:`` a fresh namespace with ``lo`` up, deleted on exit.

    Raises:
        NeedsRoot: not running as root, ``ip``/``tc`` missing, or ``ip netns add`` refused.
    """

    def __init__(self, name: str | None = None):
        if os.geteuid() != 0:
            raise NeedsRoot(
                "jobs.netem needs root: it creates a network namespace and shapes its "
                "loopback with tc (CAP_NET_ADMIN). Run it as root, e.g. "
                "`sudo make bench-netem`."
            )
        self.ip, self.tc = _tool("ip"), _tool("tc")
        self.name = name or f"mpicomp-netem-{os.getpid()}"
        self._made = False
        self._old = {}

    def __enter__(self) -> Namespace:
        # Ctrl-C or a kill while the bench runs must still delete the namespace.
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, _interrupt)
        try:
            out = subprocess.run(
                [self.ip, "netns", "add", self.name], capture_output=True, text=True
            )
            if out.returncode != 0:
                raise NeedsRoot(f"ip netns add {self.name}: {out.stderr.strip()}")
            self._made = True
            self.run_ip("link", "set", "lo", "up")
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        # A second Ctrl-C during the delete must not leave the namespace behind.
        for sig in self._old:
            signal.signal(sig, signal.SIG_IGN)
        if self._made:
            subprocess.run([self.ip, "netns", "delete", self.name], capture_output=True)
            self._made = False
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}

    def run_ip(self, *args: str) -> None:
        """Run ``ip -n NS ARGS``; raise RuntimeError with its message on failure."""
        _check([self.ip, "-n", self.name, *args])

    def shape(self, rate_bps: int | None) -> None:
        """Cap ``lo`` at ``rate_bps`` with tbf (None: unshaped, a byte-counting fifo).

        Replacing the root qdisc also zeroes its byte counter.
        """
        base = [self.tc, "-n", self.name, "qdisc", "replace", "dev", "lo", "root"]
        if rate_bps is None:
            _check(base + ["pfifo", "limit", "10000"])
            return
        burst = max(rate_bps // 8 // 100, _MIN_BURST)  # 10 ms of traffic
        _check(base + ["tbf", "rate", f"{rate_bps}bit", "burst", str(burst), "latency", "100ms"])

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace."""
        return [self.ip, "netns", "exec", self.name]


def _check(cmd: list[str]) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {out.stderr.strip() or out.returncode}")


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")
