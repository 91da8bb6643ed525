"""mpicomp/reduction/_kind.py: what an aggregation kind is (its schedules, the default
first, those that fit a codec; what it keeps per tensor) and the two schedules every
kind of bounded codes shares, the ring's and the direct one's."""

from mpicomp.collectives.direct import direct_allreduce_bounded, direct_reduce_scatter_bounded
from mpicomp.collectives.ring import ring_allreduce_bounded, ring_reduce_scatter_bounded
from mpicomp.model.measured import Speed
from mpicomp.reduction._kind import Kind, Schedule, bounded_schedules
from mpicomp.reduction.residuals import Stateless


def _run(call, codec, flat):
    return flat


def _cost(codec, numel, nranks, payload):
    return numel


class _Codec:
    name, wide = "test", False


def test_a_schedule_computes_an_encode_and_a_decode_and_fits_every_codec_by_default():
    s = Schedule(_run, _cost)
    assert s.compute(_Codec(), Speed(2.0, 3.0), 10, 4) == 50.0
    assert s.alltoall(_Codec(), 10, 4, 99) == 0
    assert s.fits(_Codec())


def test_the_default_is_the_first_schedule_and_a_codec_gets_those_that_fit_it():
    wide_only = Schedule(_run, _cost, fits=lambda codec: codec.wide)
    kind = Kind("test", object, {"first": Schedule(_run, _cost), "wide": wide_only})
    assert kind.default == "first"
    assert list(kind.schedules_of(_Codec())) == ["first"]
    wide = _Codec()
    wide.wide = True
    assert list(kind.schedules_of(wide)) == ["first", "wide"]


def test_a_kind_keeps_nothing_unless_it_says():
    kind = Kind("test", object, {"only": Schedule(_run, _cost)})
    kept = kind.state(_Codec(), None)
    assert isinstance(kept, Stateless) and not kept.named
    assert kind.hierarchical and not kind.shaped and not kind.payload and not kind.feedback


def test_bounded_codes_go_by_the_ring_or_the_direct_reduce_scatter():
    ran = []

    def run(call, codec, flat, *, collective):
        ran.append(collective)
        return flat

    def cost(schedule, codec, numel, nranks, payload=None):
        return (schedule, numel)

    def scatter(call, codec, flat, *, collective, mean=True):
        ran.append(collective)
        return flat[:1]

    schedules = bounded_schedules(run, cost, lambda codec, numel, nranks, payload=None: 7, scatter)
    assert list(schedules) == ["ring", "direct"]
    for name, collective, first_phase in (
        ("ring", ring_allreduce_bounded, ring_reduce_scatter_bounded),
        ("direct", direct_allreduce_bounded, direct_reduce_scatter_bounded),
    ):
        s = schedules[name]
        assert s.run(None, None, "x") == "x" and ran[-1] is collective
        assert s.scatter(None, None, "xy") == "x" and ran[-1] is first_phase
        assert s.cost(None, 100, 4) == (name, 100)
    assert schedules["ring"].alltoall(None, 100, 4, None) == 0  # neighbours only
    assert schedules["direct"].alltoall(None, 100, 4, None) == 7
