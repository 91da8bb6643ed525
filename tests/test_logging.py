"""The library reports through logging.getLogger("mpicomp"), each record with its rank,
and never prints: the timeout report, failing abort hooks and done-callbacks, what a
CompressedComm chose."""

import ast
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import mpicomp
from mpicomp.collectives import _wait

ROOT = Path(__file__).resolve().parents[1]
# Modules whose job is to print: the CLI and the reports it renders into a stream it
# passes, the scripts run from a shell.
PRINTERS = {
    "mpicomp/tools/cli.py",
    "mpicomp/tools/advise.py",  # render(out): the table of `mpicomp advise`
    "mpicomp/tools/bench/__init__.py",  # what bench will measure, into the CLI's stream
    "mpicomp/tools/bench/_countdown.py",  # progress lines, likewise
    "mpicomp/tools/bench/report.py",
    "kernels/cuda/compile_check.py",  # python -m mpicomp.kernels.cuda.compile_check
    "mpicomp/tools/bench/profile.py",  # python -m mpicomp.tools.bench.profile (the GPU lane's ncu step)
    "mpicomp/tools/bench/lane.py",  # python -m mpicomp.tools.bench.lane: the GPU lane's table
}


def _self():
    from mpi4py import MPI

    return MPI.COMM_SELF


def test_every_record_carries_the_rank(caplog):
    with caplog.at_level(logging.INFO, logger="mpicomp"):
        mpicomp.CompressedComm(_self(), "qsgd_maxnorm", bits=4).close()
    (record,) = [r for r in caplog.records if r.name == "mpicomp"]
    assert record.rank == 0 and record.levelno == logging.INFO
    assert "codec mpicomp.codec('qsgd_maxnorm'" in record.getMessage()
    assert "kernels" in record.getMessage() and "iallreduce" in record.getMessage()


class _AbortingComm:
    def __init__(self):
        self.aborted = None

    def Get_rank(self):  # noqa: N802 - mpi4py's names
        return 1

    def Get_size(self):  # noqa: N802
        return 3

    def Abort(self, code):  # noqa: N802
        self.aborted = code


def test_a_timeout_is_logged_critical_hooks_run_and_a_failing_hook_is_logged(caplog, monkeypatch):
    comm, ran = _AbortingComm(), []
    monkeypatch.setattr(_wait.os, "_exit", lambda code: None)  # this Abort returns

    def bad():
        raise OSError("disk full")

    def good():
        ran.append(True)

    _wait.on_abort(bad)
    _wait.on_abort(good)
    try:
        with caplog.at_level(logging.INFO, logger="mpicomp"):
            _wait.expire(comm, "allreduce", "the ring's step 2 from rank 0", 5.0, 5.2)
    finally:
        _wait.remove_abort_hook(bad)
        _wait.remove_abort_hook(good)
    assert comm.aborted == _wait.ABORT_CODE and ran == [True]
    critical, failed = [r for r in caplog.records if r.name == "mpicomp"]
    assert critical.levelno == logging.CRITICAL
    assert "rank 1 of 3 timed out in allreduce" in critical.getMessage()
    assert failed.levelno == logging.ERROR and "OSError: disk full" in caplog.text


def test_without_logging_setup_warnings_reach_stderr(capsys):
    """Python's last-resort handler prints WARNING and worse: the abort report is seen."""
    root = logging.getLogger()
    saved, root.handlers = root.handlers, []
    try:
        logging.getLogger("mpicomp").critical("mpicomp: rank %s test report", 0)
    finally:
        root.handlers = saved
    assert "rank 0 test report" in capsys.readouterr().err


# A process that imports only the kernels' and the collectives' modules, which take
# their loggers by name: the rank reaches their records all the same.
BY_NAME = """
import logging, sys
from mpicomp.collectives import _wait
from mpicomp.kernels import numba_cache
logging.basicConfig(stream=sys.stdout, format="rank %(rank)s %(name)s: %(message)s")
numba_cache.log.warning("compiling")
_wait.log.warning("timed out")
"""


def test_records_of_the_loggers_taken_by_name_carry_the_rank():
    done = subprocess.run(
        [sys.executable, "-c", BY_NAME], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and "Logging error" not in done.stderr, done.stderr
    # The rank is 0 where importing mpi4py started MPI, "-" where it did not.
    lines = [line.replace("rank - ", "rank 0 ", 1) for line in done.stdout.splitlines()]
    assert lines == ["rank 0 mpicomp.compile: compiling", "rank 0 mpicomp: timed out"]


def _prints(path: Path) -> list[int]:
    """Return the lines of ``path`` that call print() or write to sys.stdout/stderr."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        if isinstance(f, ast.Name) and f.id == "print":
            lines.append(node.lineno)
        elif (
            isinstance(f, ast.Attribute)
            and f.attr == "write"
            and isinstance(f.value, ast.Attribute)
            and f.value.attr in ("stdout", "stderr")
        ):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("package", ["mpicomp", "collectives", "kernels"])
def test_the_library_never_prints(package):
    found = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel not in PRINTERS and (lines := _prints(path)):
            found[rel] = lines
    assert found == {}, f"print or stdout/stderr writes in the library (use mpicomp._log): {found}"
