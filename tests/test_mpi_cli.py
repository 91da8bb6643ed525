"""``mpicomp bench``'s all-reduce from the command line on every world size: the backend
it is given, a bad device counter, and its table within 120 columns; on one rank it is
skipped with a note."""

import json

import pytest
from _devices import gpu_present

from conftest import world

LAUNCH = "mpiexec -n N python -m mpi4py -m mpicomp bench"


@pytest.mark.mpi
def test_bench_backend_applies_to_the_allreduce_too(capsys):
    from mpicomp.tools.cli import main

    comm = world()
    argv = ["bench", "--json", "--no-kernels", "--sizes", "2K", "--codecs", "signsgd", "-q"]
    argv += ["--allreduce-reps", "1"]
    if comm.size == 1:  # nothing to all-reduce with, and nothing else asked for
        assert main([*argv, "--backend", "cuda-emulated"]) == 2
        assert f"launch with `{LAUNCH} ...`" in capsys.readouterr().err
        return
    assert main([*argv, "--backend", "cuda-emulated"]) == 0
    out = capsys.readouterr().out
    if comm.rank == 0:
        (row,) = json.loads(out)
        (a,) = row["allreduce"]
        assert a["backend"] == "cuda-emulated" and "transport" not in a  # host arrays
        assert all(a[k] >= 0 for k in ("encode_s", "exchange_s", "decode_s"))
    if not gpu_present():  # the all-reduce alone fails the same way the kernels do
        assert main([*argv, "--backend", "cuda"]) == 1
        err = capsys.readouterr().err
        assert comm.rank != 0 or "kernel backend 'cuda' is not available here" in err


@pytest.mark.mpi
def test_a_bad_device_counter_fails_on_every_rank_instead_of_hanging(capsys):
    from mpicomp.tools.cli import main

    comm = world()
    argv = ["bench", "--no-kernels", "--sizes", "1K", "--codecs", "none", "--allreduce-reps"]
    argv += ["1", "--tc-dev", "mpicomp-no-such-dev", "-q"]
    if comm.size == 1:
        return  # skipped with the all-reduce: test_cli.py
    assert main(argv) == 1
    assert comm.rank != 0 or "mpicomp bench: error: " in capsys.readouterr().err


@pytest.mark.mpi
def test_the_allreduce_table_fits_120_columns(capsys):
    from mpicomp.tools.cli import main

    comm = world()
    argv = ["bench", "--numel", "4K", "--reps", "1", "--allreduce-reps", "1", "-q"]
    argv += ["--codecs", "signsgd,grandk_maxnorm_multiscale,threelc"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    if comm.rank != 0:
        assert out == ""
        return
    lines = out.splitlines()
    assert max(map(len, lines)) <= 120, max(lines, key=len)
    if comm.size == 1:
        assert lines[-1].startswith(f"all-reduce: skipped on one rank; `{LAUNCH}`")
        return
    assert any(ln.split()[1:3] == ["MPI_Allreduce", "float32"] for ln in lines if ln.strip())
    rows = [ln.split() for ln in lines if ln.split()[:1] == ["4K"]]
    labels = ["signsgd", "grandk_maxnorm_multiscale:bits=2", "threelc:sparsity=1.5"]
    # Where the timings' columns come out wide (a loaded machine), the table squeezes a
    # long label to its head and tail around "~": still each row, in order.
    assert len(rows[1:]) == len(labels)
    for r, label in zip(rows[1:], labels, strict=True):
        head, _, tail = r[1].partition("~")
        assert r[1] == label or (label.startswith(head) and label.endswith(tail)), r[1]
