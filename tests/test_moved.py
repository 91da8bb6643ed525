"""The flat layout's public module paths still import, as the module at its new path,
with a DeprecationWarning pointing at the importing line (mpicomp/_moved.py)."""

import importlib
import sys

import pytest

from mpicomp import _moved


@pytest.mark.parametrize(("old", "new"), sorted(_moved.MOVED.items()))
def test_an_old_path_is_the_module_at_its_new_one(old, new):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}") as caught:
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert caught[0].filename == __file__  # this line, not importlib's
    sys.modules.pop(old, None)


def test_names_from_an_old_path_and_its_submodules():
    sys.modules.pop("mpicomp.trace_report", None)
    with pytest.deprecated_call():
        from mpicomp.trace_report import read
    from mpicomp.trace.report import read as now

    assert read is now
    assert _moved.new_name("mpicomp.bench.lane") == "mpicomp.tools.bench.lane"
    assert _moved.new_name("mpicomp.benchmark") is None  # a prefix is not a parent
    assert _moved.new_name("mpicomp.comm") is None
    sys.modules.pop("mpicomp.trace_report", None)


def test_every_new_path_exists():
    for new in _moved.MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
