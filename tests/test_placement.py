"""mpicomp/call/placement.py on one rank: where the ranks are (nothing is measured where
nothing is chosen), the hierarchical schedules refused on one host, and the plan of a
call by its size: the one asked, the float32 sum uncompressed, the cheapest under auto."""

import math

import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.call.config import Config
from mpicomp.call.placement import Placement, Planner, place
from mpicomp.model.cost import Network, Topology
from mpicomp.model.measured import Model, Speed, codec_key
from mpicomp.reduction import parse, plan

GBIT = 1e9 / 8  # bytes per second


def _model(codec) -> Model:
    return Model(
        Network(1e-6, 100 * GBIT), Network(50e-6, GBIT), {codec_key(codec): Speed(1e-10, 1e-10)}
    )


def test_a_flat_schedule_without_a_model_finds_nothing_out():
    codec = mpicomp.codec("signsgd")
    placement = place(MPI.COMM_SELF, None, None, codec, plan(codec, "ring"))
    assert placement.model is None and placement.hosts is None
    assert placement.topology.hosts == 1 and placement.topology.per_host == 1
    placement.free()  # nothing to free


def test_a_hierarchical_schedule_needs_several_hosts():
    codec = mpicomp.codec("signsgd")
    with pytest.raises(ValueError, match="schedule='hier:ring' needs several hosts"):
        place(MPI.COMM_SELF, None, None, codec, plan(codec, "hier:ring"))


def test_a_call_runs_the_plan_asked_and_its_float32_sum_uncompressed():
    codec = mpicomp.codec("qsgd_maxnorm")
    asked = plan(codec, "direct")
    placement = Placement(Topology(1, 1))
    planner = Planner(codec, asked, placement, Config({"codec": "qsgd_maxnorm"}))
    planned = planner.plan(1000)
    assert planned.plan == asked and planned.run is asked.schedule.run
    assert math.isnan(planned.predicted)  # no model: nothing predicted
    assert planned.config.fields == {"codec": "qsgd_maxnorm", "run": "direct"}
    assert planner.plan(1000) is planned  # planned once per size
    plain = planner.plan(1000, compress=False)
    assert plain.plan.name == "float32" and not plain.plan.compressed
    assert plain.config.fields["run"] == "float32"


def test_a_codec_that_does_not_compress_runs_its_own_schedule_uncompressed():
    codec = mpicomp.codec("none")
    asked = plan(codec, "ring")
    planner = Planner(codec, asked, Placement(Topology(1, 1)), Config({}))
    assert planner.plan(10, compress=False).plan == asked


def test_auto_with_a_model_plans_the_cheapest_and_says_its_time():
    codec = mpicomp.codec("signsgd")
    auto = parse(codec, "auto")
    model = _model(codec)
    placement = place(MPI.COMM_SELF, None, model, codec, auto)
    assert placement.model is model
    planned = Planner(codec, auto, placement, Config({})).plan(100_000)
    # One rank sends nothing: the float32 sum, which computes nothing, costs nothing.
    assert planned.plan.name == "float32" and planned.predicted == 0.0
    assert planned.config.fields == {"run": "float32"}
