"""A gradient reaches the MPI library in at most six Python frames from
``CompressedComm.allreduce``, for every codec and flat schedule, never returning to a
module it left (docs/architecture.md, "The path of one gradient"); from
``mpicomp.torch.DistributedOptimizer`` in at most eleven (twelve from ``step()``)."""

import os
import sys

import numpy as np
import pytest

import mpicomp
from conftest import world
from mpicomp.collectives import _wait

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mpicomp.__file__)))
MOST = 6

CASES = [(name, None) for name in mpicomp.codecs.available()] + [
    ("qsgd_maxnorm", "direct"),
    ("signsgd", "direct"),
    ("threelc", "sharded"),
    ("qsgd_maxnorm", "float32"),
]


def _is_allreduce(code) -> bool:
    return code.co_name == "allreduce" and code.co_filename.endswith("comm.py")


def _watching(paths: list, monkeypatch, root=_is_allreduce) -> None:
    """Append to ``paths`` the Python stack from ``CompressedComm.allreduce`` (or the
    outermost frame whose code ``root`` accepts) down to each frame that calls MPI,
    then ``"MPI"``. Those frames are ``collectives/_wait.py``'s
    (``tests/test_architecture.py`` fails on an MPI call anywhere else), and each calls
    ``_wait.ready`` on its buffers just before the MPI function it was handed: the
    caller of ``ready`` is the frame that calls MPI."""
    original = _wait.ready

    def ready(*buffers):
        frame, stack, start = sys._getframe(1), [], None
        while frame is not None:
            stack.append(frame)
            if root(frame.f_code):
                start = len(stack)
            frame = frame.f_back
        if start is not None:
            paths.append([f"{_where(f)}" for f in reversed(stack[:start])] + ["MPI"])
        return original(*buffers)

    monkeypatch.setattr(_wait, "ready", ready)


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
def test_a_gradient_reaches_mpi_in_six_frames(codec, schedule, monkeypatch):
    paths: list = []
    _watching(paths, monkeypatch)
    comm = world()
    x = np.random.default_rng(comm.rank).standard_normal(5000).astype(np.float32)
    with mpicomp.CompressedComm(comm, codec, schedule=schedule, min_numel=1) as cc:
        cc.allreduce(x, name="w")
    assert paths, "no MPI call seen"
    deepest = max(paths, key=len)
    assert len(deepest) - 1 <= MOST, " > ".join(deepest)
    for path in paths:
        assert not _revisits(path), " > ".join(path)


# DistributedOptimizer: its gradient hook, then start's thread guard, start, the Runner
# and the Handle that runs _average, which stands where allreduce stands above.
# step() (overlap=False) adds itself.
TORCH_MOST = MOST + 5


def _in_the_torch_adapter(code) -> bool:
    return os.path.join("mpicomp", "torch", "") in code.co_filename


@pytest.mark.mpi
@pytest.mark.parametrize("overlap", [True, False], ids=["from-the-hook", "from-step"])
def test_a_distributed_optimizers_gradient_reaches_mpi_in_bounded_frames(overlap, monkeypatch):
    """From ``mpicomp.torch``'s first frame (the gradient hook during backward, or
    ``step()``), for every codec and flat schedule. The calls run in the caller's thread
    (``background=False``) so that one stack holds the whole path; on the background
    thread it begins at the Handle instead."""
    torch = pytest.importorskip("torch", reason="mpicomp.torch needs PyTorch")
    import mpicomp.torch as mt

    paths: list = []
    _watching(paths, monkeypatch, root=_in_the_torch_adapter)
    most = TORCH_MOST if overlap else TORCH_MOST + 1
    for codec, schedule in CASES:
        model = torch.nn.Sequential(
            torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 3)
        )
        opt = mt.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            world(),
            model.named_parameters(),
            codec,
            overlap=overlap,
            schedule=schedule,
            min_numel=1,
            background=False,
        )
        paths.clear()  # the construction's own messages
        model(torch.randn(8, 12)).square().mean().backward()
        opt.step()
        seen = list(paths)
        opt.close()
        buckets = [p for p in seen if any(s.endswith("comm.py:start") for s in p)]
        assert buckets, f"{codec}: no bucket call seen"
        deepest = max(seen, key=len)
        assert len(deepest) - 1 <= most, f"{codec}: " + " > ".join(deepest)
        for path in seen:
            # start() hands the call to the Runner (call/worker.py), which runs it back
            # in comm.py; nothing else is entered twice.
            assert _revisits(path) in ([], ["mpicomp/comm.py"]), " > ".join(path)


def test_the_revisit_finder_sees_one():
    assert _revisits(["a.py:f", "b.py:g", "a.py:h", "MPI"]) == ["a.py"]
    assert _revisits(["a.py:f", "a.py:g", "b.py:h", "MPI"]) == []
