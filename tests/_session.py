"""Run a command in a session of its own, so that a hung one is killed with every process
it started (mpiexec's ranks included)."""

import os
import signal
import subprocess

import pytest


def run_in_session(cmd, env, cwd=None, timeout: float = 120, what: str | None = None):
    """Run ``cmd``; return (exit code, stdout, stderr). Still running after ``timeout``
    seconds, it is killed and the test fails, naming ``what`` (default: ``cmd``) and the
    ends of what it printed."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{what or cmd} still running after {timeout} s\n{out[-2000:]}\n{err[-4000:]}")
    return proc.returncode, out, err
