"""A gradient reaches the MPI library in at most six Python frames from
``CompressedComm.allreduce``, for every codec and flat schedule, never returning to a
module it left (docs/architecture.md, "The path of one gradient")."""

import os
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from conftest import world

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mpicomp.__file__)))
MOST = 6

CASES = [(name, None) for name in mpicomp.codecs.available()] + [
    ("qsgd_maxnorm", "direct"),
    ("signsgd", "direct"),
    ("threelc", "sharded"),
    ("qsgd_maxnorm", "float32"),
]


def _watching(paths: list) -> type:
    """Return a subclass of MPI.Intracomm whose MPI calls append the Python stack from
    ``CompressedComm.allreduce`` down to their caller to ``paths`` (``Dup`` and ``Split``
    keep the subclass, so CompressedComm's own communicators are watched too)."""

    def watched(name):
        method = getattr(MPI.Intracomm, name)

        def call(self, *args, **kwargs):
            frame, stack = sys._getframe(1), []
            while frame is not None:
                stack.append(frame)
                code = frame.f_code
                if code.co_name == "allreduce" and code.co_filename.endswith("comm.py"):
                    paths.append([f"{_where(f)}" for f in reversed(stack)] + [name])
                    break
                frame = frame.f_back
            return method(self, *args, **kwargs)

        return call

    names = [
        n
        for n in dir(MPI.Intracomm)
        if n[:1].isupper()
        and n[:1].isalpha()
        and callable(getattr(MPI.Intracomm, n))
        and not n.startswith(("Get_", "Set_", "Is_", "Create", "Free", "Dup", "Split", "Clone"))
        and n not in ("Call_errhandler", "Fromint", "Toint", "f2py", "py2f")
    ]
    return type("Watched", (MPI.Intracomm,), {n: watched(n) for n in names})


def _where(frame) -> str:
    return f"{os.path.relpath(frame.f_code.co_filename, ROOT)}:{frame.f_code.co_name}"


def _revisits(path: list[str]) -> list[str]:
    """Return the modules ``path`` enters again after leaving them."""
    runs = []
    for step in path[:-1]:
        module = step.split(":")[0]
        if not runs or runs[-1] != module:
            runs.append(module)
    return sorted({m for i, m in enumerate(runs) if m in runs[:i]})


@pytest.mark.mpi
@pytest.mark.parametrize(("codec", "schedule"), CASES)
def test_a_gradient_reaches_mpi_in_six_frames(codec, schedule):
    paths: list = []
    base = world().Dup()
    comm = _watching(paths)(base)  # the same communicator, watched
    x = np.random.default_rng(comm.rank).standard_normal(5000).astype(np.float32)
    with mpicomp.CompressedComm(comm, codec, schedule=schedule, min_numel=1) as cc:
        cc.allreduce(x, name="w")
    base.Free()
    assert paths, "no MPI call seen"
    deepest = max(paths, key=len)
    assert len(deepest) - 1 <= MOST, " > ".join(deepest)
    for path in paths:
        assert not _revisits(path), " > ".join(path)


def test_the_revisit_finder_sees_one():
    assert _revisits(["a.py:f", "b.py:g", "a.py:h", "MPI"]) == ["a.py"]
    assert _revisits(["a.py:f", "a.py:g", "b.py:h", "MPI"]) == []
