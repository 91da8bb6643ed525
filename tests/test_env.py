"""One rule for every yes-or-no environment variable (mpicomp/env.py, docs/environment.md)."""

import pytest
from mpi4py import MPI

import mpicomp
from mpicomp.env import env_flag
from mpicomp.reduction import transport


@pytest.mark.parametrize(
    "raw, want",
    [
        ("1", True),
        ("true", True),
        ("TRUE", True),
        (" yes ", True),
        ("On", True),
        ("0", False),
        ("false", False),
        ("No", False),
        ("OFF\n", False),
        ("", False),
        ("  ", False),
    ],
)
def test_the_words_of_the_rule(raw, want):
    assert env_flag("SOME_FLAG", environ={"SOME_FLAG": raw}) is want


@pytest.mark.parametrize("raw", ["2", "ture", "y", "enable", "-1", "1.0", "yes please"])
def test_anything_else_is_refused_naming_the_variable_and_value(raw):
    with pytest.raises(ValueError) as e:
        env_flag("SOME_FLAG", environ={"SOME_FLAG": raw})
    assert f"SOME_FLAG={raw!r} is not a boolean" in str(e.value)
    assert "1, true, yes or on" in str(e.value) and "0, false, no, off or empty" in str(e.value)


def test_unset_gives_the_default():
    assert env_flag("SOME_FLAG", environ={}) is False
    assert env_flag("SOME_FLAG", unset=None, environ={}) is None
    assert env_flag("SOME_FLAG", unset=True, environ={"SOME_FLAG": "off"}) is False


def test_mpicomp_debug_follows_the_rule(monkeypatch):
    for raw, want in (("false", False), ("off", False), ("yes", True), ("0", False)):
        monkeypatch.setenv("MPICOMP_DEBUG", raw)
        with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
            assert cc.options.debug is want, raw
    monkeypatch.setenv("MPICOMP_DEBUG", "ture")
    with pytest.raises(ValueError, match="MPICOMP_DEBUG='ture' is not a boolean"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none")


@pytest.mark.parametrize("raw, want", [("yes", True), ("Off", False), ("", False)])
def test_mpicomp_cuda_aware_follows_the_rule(monkeypatch, raw, want):
    monkeypatch.setenv(transport.ENV, raw)
    transport.cuda_aware.cache_clear()
    try:
        assert transport.cuda_aware() == (want, f"MPICOMP_CUDA_AWARE={raw}")
        monkeypatch.setenv(transport.ENV, "enable")  # an MPI library's word, not ours
        transport.cuda_aware.cache_clear()
        with pytest.raises(ValueError, match="MPICOMP_CUDA_AWARE='enable' is not a boolean"):
            transport.cuda_aware()
    finally:
        transport.cuda_aware.cache_clear()
