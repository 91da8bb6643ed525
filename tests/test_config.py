"""mpicomp/call/config.py on one rank: what ranks must agree on (a ``Config`` and its
digest, the same for values that mean the same) and the check every rank takes part in
when an object is made (several ranks: tests/test_mpi_config.py; how messages name ranks
and fields: tests/test_agreement.py)."""

import numpy as np
import pytest
from mpi4py import MPI

from mpicomp.call.config import Config, check_same


def test_values_that_mean_the_same_have_one_digest():
    a = Config({"codec": {"name": "topk", "ratio": 1}, "scales": (2, 8)})
    b = Config({"scales": [2, 8], "codec": {"ratio": np.float64(1.0), "name": "topk"}})
    assert a.digest == b.digest
    assert Config({"codec": {"name": "topk", "ratio": 0.5}}).digest != a.digest
    assert Config({"x": True}).digest != Config({"x": 1.5}).digest


def test_a_digest_is_52_bits_and_never_0():
    for fields in ({}, {"a": 1}, {"b": "text"}, {"c": [1, 2, 3]}):
        d = Config(fields).digest
        assert 0 < d < 2**52 and d & 1  # exact in the float64 agreement
        assert float(d) == d


def test_with_fields_adds_and_replaces_without_changing_the_original():
    base = Config({"codec": "none", "run": "ring"})
    more = base.with_fields(run="direct", step=3)
    assert more.fields == {"codec": "none", "run": "direct", "step": 3}
    assert base.fields == {"codec": "none", "run": "ring"}
    assert more.digest != base.digest


def test_one_rank_agrees_with_itself_and_raises_its_own_error():
    config = Config({"codec": "none"})
    check_same(MPI.COMM_SELF, config, None, "this CompressedComm", None)  # no error
    mine = ValueError("min_numel must be >= 0")
    with pytest.raises(ValueError, match="min_numel must be >= 0"):
        check_same(MPI.COMM_SELF, config, mine, "this CompressedComm", None)


def test_a_bad_timeout_in_the_environment_is_raised_after_taking_part(monkeypatch):
    monkeypatch.setenv("MPICOMP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="MPICOMP_TIMEOUT"):
        check_same(MPI.COMM_SELF, Config({}), None, "this CompressedComm", None)


def test_fields_json_cannot_write_are_an_error_of_this_rank():
    class Opaque:
        def __repr__(self):
            raise RuntimeError("no text for this value")

    with pytest.raises(RuntimeError, match="no text for this value"):
        check_same(MPI.COMM_SELF, Config({"x": Opaque()}), None, "this CompressedComm", None)
