"""jobs/overlap_torch.py across ranks: the model's size, and every codec's row of the
backward / allreduce / sequential / overlapped step timings (structure and sanity only:
no timing ratio is asserted, the cores are shared)."""

import json
import math

import pytest

from conftest import world

torch = pytest.importorskip("torch", reason="jobs.overlap_torch needs PyTorch")

from jobs import overlap_torch  # noqa: E402

pytestmark = pytest.mark.mpi

TIMES = ("t_forward", "t_backward", "t_allreduce", "t_sequential", "t_overlapped", "t_max")


def _count(w, layers):
    """Parameters of the job's MLP of width ``w``."""
    return (layers - 1) * (w * w + w) + (w + 1) * overlap_torch.CLASSES


@pytest.mark.parametrize("params, layers", [(10_000_000, 8), (20_000, 4), (5_000, 1), (50, 3)])
def test_model_has_about_the_requested_parameters(params, layers):
    model = overlap_torch.make_model(params, layers)
    linears = [m for m in model if isinstance(m, torch.nn.Linear)]
    assert len(linears) == layers and linears[-1].out_features == overlap_torch.CLASSES
    w = linears[0].in_features
    assert w == overlap_torch.width_for(params, layers)
    got = sum(p.numel() for p in model.parameters())
    assert got == _count(w, layers)
    # the nearest width: one more (or one less, down to 1) is no nearer the target
    assert abs(got - params) <= abs(_count(w + 1, layers) - params)
    assert w == 1 or abs(got - params) <= abs(_count(w - 1, layers) - params)


def test_main_prints_a_row_per_codec_with_sane_times(capsys):
    comm = world()
    argv = ["--params", "30K", "--layers", "4", "--batch", "4", "--reps", "1"]
    argv += ["--bucket-numel", "2000", "--codecs", "none,qsgd_maxnorm_bits4,threelc:sparsity=1.5"]
    assert overlap_torch.main(argv + ["--json"]) == 0
    out = capsys.readouterr().out
    if comm.rank != 0:
        assert out == ""
        return
    rows = json.loads(out)
    assert [(r["codec"], r["params"]) for r in rows] == [
        ("none", ""),
        ("qsgd_maxnorm", "bits=4"),
        ("threelc", "sparsity=1.5"),
    ]
    for r in rows:
        assert r["ranks"] == comm.size and r["batch"] == 4 and r["background"]
        assert abs(r["model_params"] - 30_000) < 2_000
        assert r["buckets"] >= 3  # several buckets: layers of ~10K elements, 2K per bucket
        for k in TIMES:
            assert math.isfinite(r[k]) and r[k] > 0, (k, r)
        assert r["t_max"] == max(r["t_backward"], r["t_allreduce"])
        assert r["overhead_s"] == pytest.approx(r["t_overlapped"] - r["t_max"])
        assert r["overhead"] == pytest.approx(r["overhead_s"] / r["t_max"])
        assert r["speedup"] == pytest.approx(r["t_sequential"] / r["t_overlapped"])


def test_main_prints_the_table(capsys):
    comm = world()
    argv = ["--params", "2K", "--layers", "2", "--batch", "2", "--reps", "1", "--codecs", "none"]
    assert overlap_torch.main(argv) == 0
    out = capsys.readouterr().out
    assert ("overlap_torch bench" in out and "seq/ovl" in out and "\nnone" in out) == (
        comm.rank == 0
    )


def test_bad_arguments_exit_with_a_usage_error():
    for argv in (["--codecs", "nosuchcodec"], ["--params", "ten"], ["--reps", "0"]):
        with pytest.raises(SystemExit) as e:
            overlap_torch.main(argv)
        assert e.value.code == 2
