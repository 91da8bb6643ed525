"""mpicomp/reduction/clock.py: the phase marks every schedule makes on its call's clock;
an untraced call's ``NO_CLOCK`` keeps nothing, a traced call's tracer times them."""

import inspect

import numpy as np
import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.reduction.clock import NO_CLOCK, Clock
from mpicomp.trace import Tracer

MARKS = ("encoded", "communicated", "decoded")


def test_no_clock_marks_nothing_and_holds_nothing():
    for mark in MARKS:
        assert getattr(NO_CLOCK, mark)() is None
    with pytest.raises(AttributeError):
        NO_CLOCK.started = 1.0  # no state to keep: one instance serves every call


def test_the_tracer_is_a_clock():
    for mark in MARKS:
        assert inspect.signature(getattr(Tracer, mark)) == inspect.signature(getattr(Clock, mark))


def test_a_traced_call_times_its_phases():
    calls = []
    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", min_numel=1, on_call=calls.append) as cc:
        cc.allreduce(np.ones(5000, np.float32), name="w")
    (event,) = calls
    phases = [event["t_encode"], event["t_comm"], event["t_decode"]]  # one per mark
    assert all(t > 0 for t in phases), event
    assert sum(phases) <= event["t_total"], event
