"""mpicomp/call/arguments.py: what CompressedComm's keywords resolve to on one rank
before any message (the codec, the options, the schedule's plan, the transport, the
background thread) and the configuration every rank must share."""

import pytest

import mpicomp
from mpicomp.call.arguments import resolve, split, trace_attrs
from mpicomp.call.options import OPTIONS
from mpicomp.reduction import transport


@pytest.fixture
def staged(monkeypatch):
    """Device bytes staged through host memory, in chunks of 1 MiB."""
    monkeypatch.setenv(transport.ENV, "0")
    monkeypatch.setenv(transport.CHUNK_ENV, "1M")
    transport.cuda_aware.cache_clear()
    yield
    transport.cuda_aware.cache_clear()


def test_keywords_split_into_options_and_codec_parameters():
    given, params = split({"min_numel": 5, "bits": 4, "schedule": "direct", "scales": (2, 8)})
    assert given == {"min_numel": 5, "schedule": "direct"}
    assert params == {"bits": 4, "scales": (2, 8)}
    assert set(given) <= set(OPTIONS) and not set(params) & set(OPTIONS)


def test_a_codec_name_and_its_parameters_make_the_codec_and_the_plan(staged):
    args = resolve("qsgd_maxnorm", {"bits": 4}, {"schedule": "direct", "min_numel": 7})
    assert args.codec.name == "qsgd_maxnorm" and args.codec.params["bits"] == 4
    assert args.options.min_numel == 7
    assert args.schedule.name == "direct" and not args.schedule.chooses
    assert args.transport.path == "staged" and args.transport.chunk_bytes == 1 << 20
    fields = args.config.fields
    assert fields["codec"] == {"name": "qsgd_maxnorm", **args.codec.params}
    assert fields["staging_chunk"] == 1 << 20


def test_the_configuration_changes_with_what_changes_the_messages(staged):
    base = resolve("qsgd_maxnorm", {"bits": 4}, {}).config
    assert resolve("qsgd_maxnorm", {"bits": 4}, {}).config.digest == base.digest
    for other in (
        resolve("qsgd_maxnorm", {"bits": 8}, {}),  # another codec parameter
        resolve("qsgd_maxnorm", {"bits": 4}, {"min_numel": 3}),  # another threshold
    ):
        assert other.config.digest != base.digest


def test_auto_is_a_choice_and_sharded_true_is_the_sharded_plan():
    assert resolve("signsgd", {}, {"schedule": "auto"}).schedule.chooses
    assert resolve("threelc", {}, {"sharded": True}).schedule.name == "sharded"


def test_a_made_codec_is_taken_as_it_is():
    codec = mpicomp.codec("topk", ratio=0.5)
    assert resolve(codec, {}, {}).codec is codec
    with pytest.raises(TypeError, match=r"codec parameters \(ratio\) go with a codec name"):
        resolve(codec, {"ratio": 0.1}, {})
    with pytest.raises(TypeError, match="codec must be a codec name or an mpicomp codec"):
        resolve(42, {}, {})


def test_an_unknown_keyword_is_blamed_on_both_with_the_closest_names():
    with pytest.raises(TypeError) as e:
        resolve("qsgd_maxnorm", {"bitz": 4}, {})
    said = str(e.value)
    assert "unknown keyword(s) 'bitz' (did you mean 'bits'?)" in said
    assert "nor a parameter of codec 'qsgd_maxnorm'" in said


def test_background_is_refused_where_started_calls_cannot_overlap(monkeypatch):
    from mpi4py import MPI

    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(ValueError, match="background=True: MPI provides thread level"):
        resolve("none", {}, {"background": True})
    args = resolve("none", {}, {})  # the default: at once, saying why once
    assert not args.background and "not MPI_THREAD_MULTIPLE" in args.eager_why
    args = resolve("none", {}, {"background": False})  # asked for: nothing to say
    assert not args.background and args.eager_why is None


def test_a_trace_records_the_backend_transport_codec_and_traced_options(staged):
    args = resolve("topk", {"ratio": 0.25}, {"min_numel": 9})
    attrs = trace_attrs(args)
    assert attrs["codec"] == "topk" and '"ratio": 0.25' in attrs["codec_params"]
    assert attrs["device_transport"] == "staged" and attrs["cuda_aware"] is False
    assert attrs["backend"] == args.codec.kernels.name
    traced = {o.name for o in OPTIONS.values() if o.traced}
    assert "min_numel" in traced and attrs["min_numel"] == 9
    assert traced <= set(attrs)
