"""The options of CompressedComm are declared once (mpicomp.call.options.OPTIONS): the
signature, the docstring, the record, the agreed configuration, the trace's attributes
and docs/usage.md's table all come from the declarations."""

import dataclasses
import inspect
from pathlib import Path

import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.call import arguments, options
from mpicomp.call.options import OPTIONS, Options

USAGE = Path(__file__).resolve().parents[1] / "docs" / "usage.md"
BEGIN = "<!-- The signature and table below are mpicomp.call.options.table()"
END = "<!-- end of mpicomp.call.options.table() -->"


def test_the_docs_table_is_the_declarations():
    page = USAGE.read_text(encoding="utf-8")
    start = page.index("\n", page.index(BEGIN)) + 1
    shown = page[start : page.index(END)].strip("\n") + "\n"
    assert shown == options.table(), (
        "docs/usage.md's table of CompressedComm's arguments differs from the options' "
        f"declarations; put this between its markers:\n\n{options.table()}"
    )


def test_the_signature_lists_every_option_with_its_default():
    params = inspect.signature(mpicomp.CompressedComm).parameters
    assert list(params) == ["comm", "codec", *OPTIONS, "codec_params"]
    for name, option in OPTIONS.items():
        assert params[name].kind is inspect.Parameter.KEYWORD_ONLY
        assert params[name].default == option.default, name
    assert params["min_numel"].default == 1024 and params["nonfinite"].default == "raise"
    assert params["codec_params"].kind is inspect.Parameter.VAR_KEYWORD


def test_the_docstring_documents_every_option():
    doc = inspect.getdoc(mpicomp.CompressedComm)
    args = doc[doc.index("Args:") : doc.index("Every rank must make")]
    for name in ["comm", "codec", *OPTIONS, "**codec_params"]:
        assert f"\n    {name}: " in args, name
    assert "[" not in args  # Markdown links written as the page they point to


def test_the_record_has_a_field_per_option_with_its_default():
    assert [f.name for f in dataclasses.fields(Options)] == list(OPTIONS)
    made = Options()
    assert all(getattr(made, n) == o.default for n, o in OPTIONS.items())
    with pytest.raises(TypeError, match="on_call must be callable"):
        Options(on_call="print")
    with pytest.raises(TypeError, match="local_comm must be an mpi4py"):
        Options(local_comm=3)
    assert Options(trace_level=3).trace_level == 3  # checked only with a trace file


def test_the_agreed_configuration_and_the_trace_come_from_the_declarations(tmp_path):
    given = {"min_numel": 7, "trace": str(tmp_path / "t.h5"), "on_call": print}
    args = arguments.resolve("topk", {"ratio": 0.5}, given)
    fields = args.config.fields
    agreed = {o.agreed_as or o.name for o in OPTIONS.values() if o.agreed is not None}
    assert set(fields) == agreed | {"codec", "staging_chunk"}
    assert fields["min_numel"] == 7 and fields["trace_file"] and fields["traced"]
    assert fields["timeout"] == "off" and fields["codec"] == {"name": "topk", "ratio": 0.5}
    assert not {"model", "background"} & set(fields)  # ranks may differ in these
    attrs = arguments.trace_attrs(args)
    traced = [o.name for o in OPTIONS.values() if o.traced]
    assert traced == ["min_numel", "bucket_numel", "error_feedback", "sharded", "schedule"]
    assert {k: attrs[k] for k in traced} == {
        "min_numel": 7,
        "bucket_numel": 1 << 22,
        "error_feedback": True,
        "sharded": False,
        "schedule": "allgather",
    }


def test_sharded_is_the_sharded_schedule_from_the_boundary_on():
    opts, asked = options.resolve(mpicomp.codec("threelc"), sharded=True)
    assert opts.schedule == "sharded" and opts.sharded and asked.sharded
    opts, asked = options.resolve(mpicomp.codec("threelc"), schedule="sharded")
    assert opts.sharded and asked.name == "sharded"
    opts, asked = options.resolve(mpicomp.codec("threelc"), schedule="hier:sharded")
    assert not opts.sharded and asked.hierarchical  # the attribute keeps its meaning
    opts, asked = options.resolve(mpicomp.codec("qsgd_maxnorm"), schedule="auto")
    assert opts.schedule == "auto" and asked.chooses and not opts.sharded
    with pytest.raises(ValueError, match="sharded=True contradicts schedule='hier:sharded'"):
        options.resolve(mpicomp.codec("threelc"), sharded=True, schedule="hier:sharded")


def test_a_misspelled_option_is_named_with_the_closest_option():
    with pytest.raises(TypeError, match=r"'bucket_numl' \(did you mean 'bucket_numel'\?\)"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", bucket_numl=5)
    with pytest.raises(TypeError, match=r"'trace_flush' \(did you mean 'trace_flush_every'\?\)"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", trace_flush=5)
