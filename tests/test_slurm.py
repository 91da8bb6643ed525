"""jobs/slurm/*.sbatch run as written: each script runs under ``bash``, as sbatch runs
it (the ``#SBATCH`` lines are comments), with tests/slurm_stub/srun first on PATH. The
stub parses the srun options the scripts use, fails on any other, and starts the step
with the project's MPICH ``mpiexec`` (next to ``sys.executable``), the script's command
line unchanged.

The environment is the one a batch job gets, read from the script's own ``#SBATCH``
lines (``SLURM_JOB_NAME``, ``SLURM_NTASKS``, ``SLURM_CPUS_PER_TASK``...), made to fit
this machine: the scripts' all-rank steps run ``srun`` without ``-n``, so the stub takes
the task count from ``SLURM_NTASKS``, which the test sets to min(nodes x
ntasks-per-node, 2); ``SLURM_CPUS_PER_TASK`` is 1 (the scripts export it as
``NUMBA_NUM_THREADS``); one node. ``SLURM_SUBMIT_DIR`` (where the scripts ``cd`` and
write) is a temporary directory, so ``PYTHONPATH`` names the checkout, which would be
the submit directory under sbatch (``python -m jobs.train`` imports from it). The
arguments are the smallest the jobs accept, and ``CODEC_BENCH_ARGS`` shrinks
bench.sbatch's ``mpicomp bench``. Each job is killed after 120 s.

No ``pytest.mark.mpi``: the test is one process that launches its own mpiexec.
"""

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
from _session import run_in_session

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "jobs" / "slurm"
STUB = Path(__file__).resolve().parent / "slurm_stub"
MPIEXEC = Path(sys.executable).parent / "mpiexec"
RANKS = 2  # at most this many ranks on this machine, whatever the script asks for
JOB_ID = "4242"

# Per script: the job's arguments, extra environment, and what it must leave behind.
ARGS = {
    "train.sbatch": ["--steps", "2", "--codecs", "none", "--no-plot", "--out", "runs"],
    "bench.sbatch": ["--sizes", "4K", "--codecs", "none,qsgd_maxnorm", "--reps", "1"],
}
EXTRA_ENV = {
    "bench.sbatch": {
        "CODEC_BENCH_ARGS": "--numel 4K --codecs none --reps 1 --allreduce-reps 1 -q",
    },
}


def sbatch_options(script):
    """The script's ``#SBATCH`` options as {name: value}: the ``#SBATCH`` lines before
    the first command, as sbatch reads them; values without their trailing comments."""
    opts = {}
    for line in script.read_text().splitlines()[1:]:
        s = line.strip()
        if s and not s.startswith("#"):
            break  # sbatch stops reading options at the first command
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:[=\s]\s*(\S+))?", s)
        if m:
            opts[m.group(1)] = m.group(2) if m.group(2) is not None else ""
    return opts


def batch_env(script, submit_dir):
    """The environment of the batch job ``script``, sized for this machine."""
    opts = sbatch_options(script)
    assert "nodes" in opts and "ntasks-per-node" in opts, f"{script.name}: {opts}"
    declared = int(opts["nodes"]) * int(opts["ntasks-per-node"])
    ntasks = min(declared, RANKS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SRUN_"))}
    env.update(
        PATH=os.pathsep.join([str(STUB), str(MPIEXEC.parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")])),
        SRUN_STUB_MPIEXEC=str(MPIEXEC),
        SLURM_JOB_ID=JOB_ID,
        SLURM_JOBID=JOB_ID,
        SLURM_JOB_NAME=opts.get("job-name", script.stem),
        SLURM_SUBMIT_DIR=str(submit_dir),
        SLURM_JOB_NUM_NODES="1",
        SLURM_NNODES="1",
        SLURM_NTASKS=str(ntasks),
        SLURM_NPROCS=str(ntasks),
        SLURM_NTASKS_PER_NODE=str(ntasks),
        SLURM_CPUS_PER_TASK="1",
        SLURM_JOB_NODELIST="localhost",
        SLURM_NODELIST="localhost",
    )
    import numba

    if numba.config.CACHE_DIR:  # the ranks load the kernels this suite compiled
        env.setdefault("NUMBA_CACHE_DIR", numba.config.CACHE_DIR)
    return env, ntasks


@pytest.fixture
def launcher():
    if shutil.which("bash") is None:
        pytest.skip("no bash to run the batch scripts with")
    if not MPIEXEC.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")


def test_every_script_has_a_case():
    assert sorted(p.name for p in SCRIPTS.glob("*.sbatch")) == sorted(ARGS)


@pytest.mark.parametrize("name", sorted(ARGS))
def test_sbatch_script_runs_as_written(launcher, tmp_path, name):
    script = SCRIPTS / name
    env, ntasks = batch_env(script, tmp_path)
    env.update(EXTRA_ENV.get(name, {}))
    rc, out, err = run_in_session(["bash", str(script), *ARGS[name]], env, cwd=ROOT)
    assert rc == 0, f"{name} exited {rc}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-5000:]}"
    # `srun --nodes=1 --ntasks=1 python -m mpicomp info`: one task, into the log.
    assert re.search(r"^MPI world size:\s+1$", out, re.M), out[-3000:]
    if name == "train.sbatch":
        results = json.loads((tmp_path / "runs" / "results.json").read_text())
        assert results["meta"]["ranks"] == ntasks
        assert [r["label"] for r in results["runs"]] == ["none"]
        assert results["runs"][0]["steps"] == 2
        assert (tmp_path / "runs" / "none.h5").is_file()
    else:
        rows = json.loads((tmp_path / f"bench-{JOB_ID}.json").read_text())
        assert {r["nranks"] for r in rows} == {ntasks}
        assert {r["numel"] for r in rows} == {4000}
        assert {r["codec"] for r in rows} == {"none", "qsgd_maxnorm"}
        kernels = json.loads((tmp_path / f"bench-codecs-{JOB_ID}.json").read_text())
        assert [(r["codec"], r["numel"]) for r in kernels] == [("none", 4000)]


def test_stub_sets_the_task_variables_per_rank(launcher, tmp_path):
    env, _ = batch_env(SCRIPTS / "train.sbatch", tmp_path)
    probe = (
        "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
        # one write per rank: print() writes its fields apart, and two ranks' lines mix
        "v = [os.environ[k] for k in ('SLURM_PROCID', 'SLURM_LOCALID', 'SLURM_NTASKS')]; "
        "os.write(1, ' '.join(map(str, [c.rank, c.size, *v])).encode() + b'\\n')"
    )
    rc, out, err = run_in_session(
        ["srun", "--cpu-bind=cores", "--mpi", "pmi2", "python", "-c", probe], env, tmp_path
    )
    assert rc == 0, err
    assert sorted(out.split("\n")[:-1]) == [f"{r} 2 {r} {r} 2" for r in range(2)], out
    rc, out, err = run_in_session(["srun", "-n", "1", "python", "-c", probe], env, tmp_path)
    assert (rc, out) == (0, "0 1 0 0 1\n"), err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--exclusive", "true"], "unknown option '--exclusive'"),
        (["--gres=gpu:1", "true"], "unknown option '--gres=...'"),
        (["--ntasks"], "option --ntasks needs a value"),
        (["--nodes=1"], "no command to run"),
    ],
)
def test_stub_refuses_what_it_does_not_understand(launcher, tmp_path, argv, message):
    env, _ = batch_env(SCRIPTS / "train.sbatch", tmp_path)
    rc, out, err = run_in_session([str(STUB / "srun"), *argv], env, tmp_path, timeout=30)
    assert rc == 2 and message in err, (rc, out, err)


def test_stub_needs_a_task_count(launcher, tmp_path):
    env, _ = batch_env(SCRIPTS / "train.sbatch", tmp_path)
    del env["SLURM_NTASKS"]
    rc, out, err = run_in_session([str(STUB / "srun"), "true"], env, tmp_path, timeout=30)
    assert rc == 2 and "no task count" in err, (rc, out, err)
