"""CompressedComm pieces that need no peers: options, snapshots, host reads, NaN/Inf
policies, handles and warnings, started calls at exit, checkpoints (how inputs are
taken and bucketed: tests/test_intake.py)."""

import re
import threading
import time

import numpy as np
import pytest
from _devices import REQUIRE_GPU
from _devices import gpu_present as _gpu_present

import mpicomp


def test_options_are_checked():
    from mpi4py import MPI

    with pytest.raises(ValueError, match="min_numel"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", min_numel=-1)
    with pytest.raises(ValueError, match="error_feedback"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", error_feedback=True)
    with pytest.raises(TypeError, match="codec parameters"):
        mpicomp.CompressedComm(MPI.COMM_SELF, mpicomp.codec("topk"), ratio=0.1)
    with pytest.raises(ValueError, match="unknown codec"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "zip")
    with pytest.raises(ValueError, match="sparsity"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "threelc", sparsity=3)


def test_reliability_options_are_checked(monkeypatch):
    from mpi4py import MPI

    with pytest.raises(ValueError, match="'skip'"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", nonfinite="skip")
    with pytest.raises(TypeError, match="nonfinite must be a str"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", nonfinite=None)
    with pytest.raises(TypeError, match="debug must be a bool"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", debug="yes")
    monkeypatch.setenv("MPICOMP_DEBUG", "0")
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert not cc.options.debug
    monkeypatch.setenv("MPICOMP_DEBUG", "1")
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert cc.options.debug
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", debug=False) as cc:
        assert not cc.options.debug


def test_options_are_one_frozen_record_with_resolved_defaults(monkeypatch, tmp_path):
    import dataclasses

    import numpy as np

    from mpicomp.call.options import Options

    monkeypatch.setenv("MPICOMP_DEBUG", "1")
    opts = Options.resolve(mpicomp.codec("topk"), min_numel=np.int64(8), background=np.True_)
    assert opts.error_feedback and opts.debug  # the biased codec's default; the environment
    assert type(opts.min_numel) is int and opts.background is True
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.min_numel = 0
    assert not Options.resolve(mpicomp.codec("qsgd_maxnorm")).error_feedback
    with pytest.raises(ValueError, match="sharded applies to gather codecs"):
        Options.resolve(mpicomp.codec("signsgd"), sharded=True)
    with pytest.raises(TypeError, match="sharded must be a bool"):
        Options(sharded="no")
    with pytest.raises(ValueError, match="bucket_numel"):
        Options(bucket_numel=0)
    with pytest.raises(ValueError, match="trace level must be 1 or 2"):
        Options(trace=tmp_path / "t.h5", trace_level=3)
    with pytest.raises(ValueError, match="MPICOMP_TIMEOUT|timeout"):
        Options.resolve(mpicomp.codec("none"), timeout=-1)
    assert Options.resolve(mpicomp.codec("none"), timeout=0).timeout == 0  # off, not None


def test_each_codec_takes_the_schedules_of_its_aggregation():
    from mpicomp.call.options import Options

    def schedule(name, **kw):
        return Options.resolve(mpicomp.codec(name), **kw).schedule

    assert [schedule(n) for n in ("none", "fp16", "qsgd_maxnorm", "signsgd", "fft")] == [
        "allreduce",
        "allreduce",
        "ring",
        "ring",
        "allgather",
    ]
    assert schedule("signsgd", schedule="direct") == "direct"
    assert schedule("threelc", sharded=True) == "sharded"
    opts = Options.resolve(mpicomp.codec("threelc"), schedule="sharded")
    assert opts.sharded and opts.schedule == "sharded"
    with pytest.raises(
        ValueError, match=r"codec 'threelc' \(gather\) runs 'allgather' or 'sharded'"
    ):
        schedule("threelc", schedule="direct")
    with pytest.raises(ValueError, match="sharded=True contradicts schedule='allgather'"):
        schedule("topk", sharded=True, schedule="allgather")
    with pytest.raises(TypeError, match="schedule must be a str"):
        schedule("signsgd", schedule=1)
    with pytest.raises(ValueError, match="no schedule named 'tree'"):
        Options(schedule="tree")


def test_a_bad_trace_option_fails_before_the_communicator_is_duplicated(tmp_path):
    from mpi4py import MPI

    class Untouchable(MPI.Intracomm):  # a communicator that must not be duplicated
        def Dup(self):  # noqa: N802 - mpi4py's name
            raise AssertionError("duplicated before the options were checked")

    comm = Untouchable(MPI.COMM_SELF)
    with pytest.raises(TypeError, match="flush_every must be an int"):
        mpicomp.CompressedComm(comm, "none", trace=tmp_path / "t", trace_flush_every=2.5)


def test_a_snapshot_restores_residuals_and_reuses_its_buffers():
    import numpy as np

    fb = mpicomp.codecs.ErrorFeedback(mpicomp.codec("topk", ratio=0.25))
    rng = np.random.default_rng(0)
    fb.encode(rng.standard_normal(64).astype(np.float32), "a")
    before = fb.residual("a").copy()
    snap = fb.snapshot(["a", "b"])
    fb.encode(rng.standard_normal(64).astype(np.float32), "a")
    fb.encode(rng.standard_normal(8).astype(np.float32), "b")  # born after the snapshot
    assert not np.array_equal(fb.residual("a"), before)
    snap.restore()
    np.testing.assert_array_equal(fb.residual("a"), before)
    assert fb.residual("b") is None  # dropped: a failed first call leaves nothing behind
    # The copies go to one buffer per name, reused by the next snapshot (no allocation
    # per call): restoring an older snapshot then gives what the newer one copied.
    older = fb.snapshot(["a"])
    fb.encode(rng.standard_normal(64).astype(np.float32), "a")
    newer = fb.residual("a").copy()
    fb.snapshot(["a"])
    fb.encode(rng.standard_normal(64).astype(np.float32), "a")
    older.restore()
    np.testing.assert_array_equal(fb.residual("a"), newer)
    kept = fb.snapshot(["a"], private=True)  # its own buffer: outlives the next one
    fb.snapshot(["a"])
    fb.encode(rng.standard_normal(64).astype(np.float32), "a")
    kept.restore()
    np.testing.assert_array_equal(fb.residual("a"), newer)


# Host synchronizations of one call on one rank (the counted ``to_host`` reads: payload
# headers, scalars, error flags, staging copies), per codec: (on ``cuda-emulated`` and on a
# device whose MPI is CUDA-aware, staged through host memory). They are part of a codec's
# contract: a change that adds one shows here. Staging adds its downloads and checks the
# MPI results it downloaded on the host instead of on the device. A call reads what MPI
# needs first (norms, a payload's length, with the encode's flags) in one transfer, and
# everything else it checks (kernels' flags, gathered payloads, the average's finiteness)
# in one more at its end (kernels/readback.py), FastSGD's bucket scans among them.
SYNCS = {
    "none": (1, 1),
    "fp16": (2, 2),
    "topk": (2, 3),
    "signsgd": (2, 3),
    "qsgd_maxnorm": (2, 3),  # the block norms with their error mask; the end of call
    "qsgd_maxnorm_multiscale": (2, 4),
    "grandk_maxnorm": (2, 3),
    "grandk_maxnorm_multiscale": (2, 4),
    "threelc": (2, 3),
    "fft": (2, 3),  # its encode's flags and steps' values; the end of call
    "fastsgd": (2, 3),
}


def _syncs_of_a_call(name: str, place: str, monkeypatch, **options):
    """Return (the reasons of the host reads of a second call of ``name`` at ``place``,
    its result, the NumPy path's result, the device's implicit transfers); ``options``
    go to both CompressedComms (e.g. ``schedule=``)."""
    import _device_arrays as D
    from _devices import place as placed
    from mpi4py import MPI

    from mpicomp.reduction import transport

    host = (np.random.default_rng(0).standard_normal(5000) * 1e-3).astype(np.float32)
    with mpicomp.CompressedComm(MPI.COMM_SELF, name, min_numel=1, **options) as cc:
        cc.allreduce(host, name="w")
        ref = cc.allreduce(host, name="w")  # the second call: residuals in play
    where, path = place.split("/")
    monkeypatch.setenv(transport.ENV, "1" if path == "direct" else "0")
    transport.cuda_aware.cache_clear()
    if where == "emulated":
        monkeypatch.setenv(mpicomp.kernels.ENV, "cuda-emulated")
        backend = "cuda-emulated"
    else:
        D.install()
        backend = D.BACKEND if where == "host-backed" else "cuda"
    to_place, to_host, _ = placed(where)
    dev = mpicomp.kernels.backend(backend).device
    with mpicomp.CompressedComm(MPI.COMM_SELF, name, min_numel=1, **options) as cc:
        cc.allreduce(to_place(host), name="w")  # the first call builds tables
        D.reset_syncs()
        before = dev.sync_reasons.copy()
        out = cc.allreduce(to_place(host), name="w")
    transport.cuda_aware.cache_clear()
    return dev.sync_reasons - before, to_host(out), ref, dict(D.SYNCS)


def _sync_places() -> list:
    places = ["emulated/staged", "host-backed/direct", "host-backed/staged"]
    if _gpu_present() or REQUIRE_GPU:
        from mpicomp.reduction.transport import cuda_aware

        places.append("gpu/" + ("direct" if cuda_aware()[0] else "staged"))
    return places


@pytest.mark.parametrize("place", _sync_places())
@pytest.mark.parametrize("name", sorted(SYNCS))
def test_a_call_makes_its_named_syncs_and_no_hidden_one(name, place, monkeypatch):
    reasons, out, ref, hidden = _syncs_of_a_call(name, place, monkeypatch)
    direct, staged = SYNCS[name]
    want = direct if place.startswith("emulated") or place.endswith("direct") else staged
    assert sum(reasons.values()) == want, dict(reasons)
    assert "unnamed" not in reasons
    if place.startswith("host-backed"):
        assert hidden["implicit"] == 0 and hidden["get"] == want
    if name != "fft":
        np.testing.assert_array_equal(out, ref)


# Host reads of a sharded call (``schedule="sharded"``, push/pull) on one rank, per gather
# codec, beside staging's copies down (``"staging: ..."``): each push's encode reads its
# length (N on N ranks); the owner's pushes' checks travel with its re-encode's read; the
# pulled payloads' checks (``decode_flat``) are read with the end of the call.
SHARDED_SYNCS = {"topk": 3, "threelc": 3, "fft": 3, "fastsgd": 3}


@pytest.mark.parametrize("place", ["emulated/staged", "host-backed/direct", "host-backed/staged"])
@pytest.mark.parametrize("name", sorted(SHARDED_SYNCS))
def test_a_sharded_call_makes_its_named_syncs_and_no_hidden_one(name, place, monkeypatch):
    reasons, out, ref, hidden = _syncs_of_a_call(name, place, monkeypatch, schedule="sharded")
    staging = sum(n for why, n in reasons.items() if why.startswith("staging: "))
    assert staging == (2 if place == "host-backed/staged" else 0), dict(reasons)  # push, pull
    assert sum(reasons.values()) - staging == SHARDED_SYNCS[name], dict(reasons)
    assert "unnamed" not in reasons
    # The owner's one read before the pull: its re-encode's flags and its pushes' checks.
    assert any("encode: " in why and "payload: checksum field" in why for why in reasons)
    if place.startswith("host-backed"):
        assert hidden["implicit"] == 0 and hidden["get"] == sum(reasons.values())
    if name != "fft":
        np.testing.assert_array_equal(out, ref)


def test_cuda_emulated_counts_the_reads_a_device_makes(monkeypatch):
    """The same reads, by name, on cuda-emulated (NumPy arrays) as on device arrays whose
    MPI is CUDA-aware: the emulation stands for a GPU in the count too."""
    for name in ("topk", "fft", "qsgd_maxnorm_multiscale", "none"):
        emulated = _syncs_of_a_call(name, "emulated/staged", monkeypatch)[0]
        device = _syncs_of_a_call(name, "host-backed/direct", monkeypatch)[0]
        assert emulated == device, name


def test_a_cuda_dlpack_tensor_without_cuda_is_refused_on_every_rank_by_name():
    from mpi4py import MPI

    class CudaTensor:  # what a torch CUDA tensor shows of itself
        dtype = np.float32

        def __dlpack_device__(self):
            return (2, 0)

        def __dlpack__(self, **kwargs):
            raise AssertionError("not to be read without the cuda backend")

    class OtherDevice(CudaTensor):
        def __dlpack_device__(self):
            return (14, 0)  # oneAPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        if not _gpu_present():
            with pytest.raises(TypeError, match="a CUDA CudaTensor needs the cuda kernel backend"):
                cc.allreduce(CudaTensor())
        with pytest.raises(TypeError, match="DLPack device type 14"):
            cc.allreduce(OtherDevice())
        np.testing.assert_array_equal(cc.allreduce(np.ones(8, np.float32)), np.ones(8))


def test_float64_beyond_float32_is_refused_not_made_inf():
    import numpy as np

    from mpicomp.codecs.arrays import as_gradient, to_float32

    x = np.array([1.0, -1e39, 2.0])
    with pytest.raises(ValueError, match="gradient 'w' holds float64 values beyond float32"):
        as_gradient(x, what="gradient 'w'")
    y, over = to_float32(x)
    assert over and np.isneginf(y[1]) and y[0] == 1.0
    y, over = to_float32(np.array([np.inf, np.nan, 3e38]))  # Inf stays Inf: not an overflow
    assert not over and np.isinf(y[0])
    strided = np.arange(10.0)[::3]
    y, over = to_float32(strided)
    assert y.flags.c_contiguous and y.dtype == np.float32 and not over
    np.testing.assert_array_equal(y, [0, 3, 6, 9])


@pytest.mark.parametrize("policy", ["raise", "skip_step", "zero"])
def test_one_rank_policies(policy):
    import numpy as np
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    x = np.array([1.0, np.nan, 3.0], np.float32)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=1.0, nonfinite=policy) as cc:
        if policy == "raise":
            with pytest.raises(ValueError, match="gradient 'w' holds NaN or Inf"):
                cc.allreduce(x, name="w")
        elif policy == "skip_step":
            with pytest.warns(NonFiniteWarning, match=r"rank\(s\) 0: gradient 'w'"):
                np.testing.assert_array_equal(cc.allreduce(x, name="w"), [0, 0, 0])
        else:
            np.testing.assert_array_equal(cc.allreduce(x, name="w"), [1, 0, 3])
        # A failed or skipped call takes no step.
        assert cc.state_dict()["step"] == (1 if policy == "zero" else 0)


@pytest.mark.parametrize("name", ["none", "topk"])
def test_a_skipped_call_of_device_gradients_gives_device_zeros(name):
    """The zeros of a skipped call come on the gradients' device, as an average would."""
    import _device_arrays as D
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    D.install()
    x = D.to_device(np.array([1.0, np.nan, 3.0], np.float32))
    with mpicomp.CompressedComm(MPI.COMM_SELF, name, min_numel=1, nonfinite="skip_step") as cc:
        with pytest.warns(NonFiniteWarning):
            out = cc.allreduce(x, name="w")
    assert isinstance(out, D.DeviceArray)
    np.testing.assert_array_equal(D.to_host(out), [0, 0, 0])


# --- iallreduce on one rank: handles, the eager fallback, whole jobs under mpiexec -----


def test_iallreduce_handles_and_warnings_point_at_the_caller():
    import numpy as np
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    x = np.array([1.0, np.nan, 3.0], np.float32)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=1.0, nonfinite="skip_step") as cc:
        handle = cc.iallreduce(x, name="w")
        with pytest.warns(NonFiniteWarning) as caught:
            np.testing.assert_array_equal(handle.wait(), [0, 0, 0])
        assert caught[0].filename == __file__  # raised in the waiting thread, at wait()
        with pytest.warns(NonFiniteWarning) as caught:
            cc.allreduce(x, name="w")
        assert caught[0].filename == __file__
        assert handle.wait() is handle.wait()  # warned once; the same result again
        y = np.array([1.0, 2.0, 3.0], np.float32)
        np.testing.assert_array_equal(cc.iallreduce(y, name="w").wait(), y)


def test_an_error_nobody_waited_for_is_reported_when_its_handle_is_dropped():
    import gc

    import numpy as np
    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        handle = cc.iallreduce(np.arange(4), name="w")  # integers: refused
        cc.state_dict()  # waits for it
        with pytest.warns(RuntimeWarning, match="dropped without wait.*floating-point"):
            del handle
            gc.collect()
        waited = cc.iallreduce(np.arange(4), name="w")
        with pytest.raises(TypeError, match="floating-point"):
            waited.wait()
        del waited  # seen: no warning (pytest turns one into an error)
        gc.collect()


@pytest.mark.parametrize(
    "start, said",
    [
        (lambda cc, x: cc.iallreduce(x, name="w"), "iallreduce of 'w'"),
        (lambda cc, x: cc.iallreduce_many([x], names=["w"]), "iallreduce_many of 'w'"),
        (lambda cc, x: cc.ireduce_scatter(x, name="w"), "ireduce_scatter of 'w'"),
        (lambda cc, x: cc.iallgather(x, name="w"), "iallgather of 'w'"),
        (lambda cc, x: cc.start(x, "w"), "start of 'w'"),
        (lambda cc, x: cc.start_scatter(x, "w"), "start_scatter of 'w'"),
    ],
    ids=["iallreduce", "iallreduce_many", "ireduce_scatter", "iallgather", "start", "scatter"],
)
def test_a_dropped_handle_names_the_call_that_made_it(start, said):
    import gc

    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk") as cc:
        handle = start(cc, np.arange(4))  # integers: refused
        cc.wait_all()
        warned = re.escape(f"the handle of {said} was dropped without wait() and held an error")
        with pytest.warns(RuntimeWarning, match=warned):
            del handle
            gc.collect()


def _worker_threads() -> set[threading.Thread]:
    """The background threads CompressedComms run started calls on."""
    return {t for t in threading.enumerate() if t.name.startswith("mpicomp-worker")}


def test_below_thread_multiple_iallreduce_runs_at_once_and_says_so(monkeypatch):
    import numpy as np
    from mpi4py import MPI

    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    with pytest.raises(ValueError, match="background=True: MPI provides thread level"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", background=True)
    with pytest.raises(TypeError, match="background must be a bool"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", background="yes")
    x = np.ones(2000, np.float32)
    workers = _worker_threads()
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert not cc.background
        with pytest.warns(RuntimeWarning, match="not MPI_THREAD_MULTIPLE") as warned:
            handle = cc.iallreduce(x, name="w")
        assert warned[0].filename == __file__  # the user's line, not mpicomp's
        assert handle.done and _worker_threads() <= workers  # no thread started
        np.testing.assert_array_equal(handle.wait(), x)
        assert cc.iallreduce(x, name="w").done  # warned once per communicator
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", background=False) as cc:
        assert cc.iallreduce(x).done  # asked for: no warning


def test_every_warning_of_a_public_method_points_at_the_callers_line(monkeypatch):
    """However many of mpicomp's frames lie between (thread guard, handle, fused calls)."""
    import numpy as np
    from mpi4py import MPI

    from mpicomp.comm import NonFiniteWarning

    monkeypatch.setattr(MPI, "Query_thread", lambda: MPI.THREAD_SERIALIZED)
    x = np.ones(8, np.float32)
    starts = {
        "iallreduce_many": lambda cc: cc.iallreduce_many([x], ["w"]),
        "start": lambda cc: cc.start(x, name="w"),
    }
    for method, call in starts.items():
        with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
            with pytest.warns(RuntimeWarning, match="no overlap") as warned:
                call(cc).wait()
            assert [w.filename for w in warned] == [__file__], method
    bad = np.array([1.0, np.nan], np.float32)
    with mpicomp.CompressedComm(
        MPI.COMM_SELF, "topk", nonfinite="skip_step", background=False
    ) as cc:
        with pytest.warns(NonFiniteWarning) as caught:
            cc.allreduce_many([bad], ["w"])
        with pytest.warns(NonFiniteWarning) as waited:
            cc.iallreduce_many([bad], ["w"]).wait()
    assert [w.filename for w in (*caught, *waited)] == [__file__, __file__]


def test_workqueue_threading_layer_runs_iallreduce_at_once(monkeypatch):
    # numba's workqueue layer aborts when two threads run parallel kernels together.
    import numba
    import numpy as np
    from mpi4py import MPI

    monkeypatch.setattr(numba, "threading_layer", lambda: "workqueue")
    with pytest.raises(ValueError, match="background=True: numba's threading layer"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "none", background=True)
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none") as cc:
        assert not cc.background
        with pytest.warns(RuntimeWarning, match="workqueue"):
            assert cc.iallreduce(np.ones(3, np.float32), name="w").done


OVERLAP_JOB = """
import faulthandler
import sys
import time

import numpy as np
from mpi4py import MPI

import mpicomp

mode = sys.argv[1]
rank = MPI.COMM_WORLD.rank
faulthandler.dump_traceback_later(45)  # a job still running then shows where it is
cc = mpicomp.CompressedComm(MPI.COMM_WORLD, "qsgd_maxnorm", min_numel=1)
x = np.full(3000, rank + 1.0, np.float32)
if mode == "exit_pending":  # every rank starts calls and exits without wait or close
    # A first call compiles the codec's kernels (numba: 30-50 s on 2 busy cores when this
    # rank's cache is cold) before the calls that the exit must finish.
    cc.allreduce(x, name="w")
    faulthandler.dump_traceback_later(45)  # again: the exit has EXIT_LIMIT_S from here
    handles = [cc.iallreduce(x, name="w") for _ in range(3)]
    print(f"rank {rank} started", flush=True)
elif mode == "stall_wait":  # rank 1 never starts the call: rank 0 waits for it
    if rank != 1:
        cc.iallreduce(x, name="w").wait()
    time.sleep(60)
elif mode == "stall_exit":  # ... and rank 0 exits without waiting: the exit waits
    if rank != 1:
        cc.iallreduce(x, name="w")
        print(f"rank {rank} leaves", flush=True)
    else:
        time.sleep(60)
"""


# Starting a job may take far longer than the test itself: imports, and numba compiling the
# codec's kernels wherever a rank's cache directory is cold (rank1's always during `make
# test-unit` on a fresh clone, every rank's after a kernel changed). On 2 loaded cores that
# took 30-50 s, which a single 60 s limit took for a hang. So the limits are two: until the
# job prints its ready lines, then for the part under test.
START_LIMIT_S = 300
EXIT_LIMIT_S = 60


def run_overlap_job(tmp_path, mode, timeout_env="2", ready=()):
    """Run OVERLAP_JOB on 2 ranks; return (exit code, stdout, stderr).

    The job is killed, and the test fails, when it has not printed every line of ``ready``
    START_LIMIT_S after its start or has not ended EXIT_LIMIT_S after that (without
    ``ready``: START_LIMIT_S + EXIT_LIMIT_S after its start). Its output goes to files,
    read for the ready lines while it runs.
    """
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    mpiexec = Path(sys.executable).parent / "mpiexec"
    if not mpiexec.exists():
        pytest.skip(f"no mpiexec next to {sys.executable}")
    script = tmp_path / "job.py"
    script.write_text(OVERLAP_JOB)
    env = dict(os.environ, NUMBA_NUM_THREADS="1", MPICOMP_TIMEOUT=timeout_env)
    cmd = [str(mpiexec), "-n", "2", sys.executable, "-m", "mpi4py", str(script), mode]
    out_file, err_file = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_file.open("w") as out, err_file.open("w") as err:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
    pending = list(ready)
    deadline = time.monotonic() + START_LIMIT_S + (0 if pending else EXIT_LIMIT_S)
    while proc.poll() is None:
        if pending:
            printed = out_file.read_text()
            pending = [line for line in pending if line not in printed]
            if not pending:
                deadline = time.monotonic() + EXIT_LIMIT_S
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            if pending:
                why = f"{pending} not printed {START_LIMIT_S} s after its start"
            elif ready:
                why = f"still running {EXIT_LIMIT_S} s after it printed {list(ready)}"
            else:
                why = f"still running {START_LIMIT_S + EXIT_LIMIT_S} s after its start"
            pytest.fail(
                f"the {mode!r} job hung: {why}\n{out_file.read_text()}\n{err_file.read_text()}"
            )
        time.sleep(0.2)
    return proc.returncode, out_file.read_text(), err_file.read_text()


def test_started_calls_finish_when_the_job_exits_without_waiting(tmp_path):
    code, out, err = run_overlap_job(
        tmp_path, "exit_pending", timeout_env="0", ready=("rank 0 started", "rank 1 started")
    )
    assert code == 0, err
    assert "rank 0 started" in out and "rank 1 started" in out


@pytest.mark.parametrize("mode", ["stall_wait", "stall_exit"])
def test_a_stalled_rank_aborts_a_background_call_instead_of_hanging(tmp_path, mode):
    code, out, err = run_overlap_job(tmp_path, mode)
    assert code == 14, err  # the timeout's exit code (docs/reliability.md)
    assert "mpicomp: rank 0 of 2 timed out in max_allreduce (allreduce of 'w') after " in err
    assert "aborting the job" in err


def test_cuda_array_interface_input_is_read_as_the_emulated_devices_memory(monkeypatch):
    from test_mpi_device import CaiArray

    from mpicomp.codecs.arrays import to_float32

    x = np.arange(12, dtype=np.float64).reshape(3, 4)
    if not _gpu_present():
        with pytest.raises(TypeError, match="exposing __cuda_array_interface__ needs the cuda"):
            to_float32(CaiArray(x))
    monkeypatch.setenv("MPICOMP_KERNELS", "cuda-emulated")
    y, over = to_float32(CaiArray(x))
    assert not over and y.dtype == np.float32 and y.shape == (3, 4)
    np.testing.assert_array_equal(y, x)

    class Strided(CaiArray):  # a view: its interface gives strides
        @property
        def __cuda_array_interface__(self):
            return dict(super().__cuda_array_interface__, strides=self.host.strides)

    strided = Strided(x)
    strided.host = x[:, ::2]
    np.testing.assert_array_equal(to_float32(strided)[0], x[:, ::2])
    assert to_float32(CaiArray(np.zeros((0, 5), np.float32)))[0].shape == (0, 5)


# --- misuse on one rank: threads, checkpoints, parameter types ---------------------------


def test_a_second_thread_waits_for_the_call_in_progress():
    from mpi4py import MPI

    got, order = {}, []

    def on_call(event):
        order.append(event["name"])
        if event["name"] == "x":  # inside x's call: another thread enters now
            second.start()
            entered.wait(30)
            time.sleep(0.2)  # it reaches the call and waits there

    def call_y():
        entered.set()
        got["y"] = cc.allreduce(np.full(4, 2.0, np.float32), name="y")

    entered = threading.Event()
    second = threading.Thread(target=call_y, name="second")
    with mpicomp.CompressedComm(MPI.COMM_SELF, "none", on_call=on_call) as cc:
        np.testing.assert_array_equal(cc.allreduce(np.ones(4, np.float32), name="x"), 1)
        second.join(timeout=30)
    np.testing.assert_array_equal(got["y"], 2)  # it waited, then made its call
    assert order == ["x", "y"]


def test_a_callback_calling_the_communicator_from_inside_a_call_is_refused_at_once():
    """It would wait for itself: on_call inside a blocking call (same thread), on_call of
    a started call and a handle's done callback (the background thread)."""
    from mpi4py import MPI

    seen = []
    added = threading.Event()

    def call_back(where):
        try:
            cc.allreduce(np.ones(4, np.float32), name="z")
        except RuntimeError as e:
            seen.append((where, str(e)))

    def on_call(event):
        if event["name"] == "x":
            call_back("on_call")
        elif event["name"] == "started":
            added.wait(30)  # the done callback is added while the call runs
            call_back("on_call of a started call")

    try:
        cc = mpicomp.CompressedComm(MPI.COMM_SELF, "none", on_call=on_call, background=True)
    except ValueError as e:  # below MPI_THREAD_MULTIPLE: no background thread
        pytest.skip(str(e))
    with cc:
        cc.allreduce(np.ones(4, np.float32), name="x")
        handle = cc.iallreduce(np.ones(4, np.float32), name="started")
        handle.add_done_callback(lambda h: call_back("done callback"))
        added.set()
        np.testing.assert_array_equal(handle.wait(), 1)
    # close() ended the background thread: its callbacks have run.
    assert [where for where, _ in seen] == ["on_call", "on_call of a started call", "done callback"]
    inside, *background = [message for _, message in seen]
    assert inside.startswith("CompressedComm.allreduce called from inside a call of this")
    for message in background:
        assert "from the background thread that runs this CompressedComm's started" in message


def test_a_checkpoint_refused_changes_nothing():
    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=0.25, min_numel=0) as cc:
        cc.allreduce(np.arange(8, dtype=np.float32), name="w")
        state = cc.state_dict()
        damaged = {**state, "residuals": {**state["residuals"]}}
        damaged["residuals"]["w"] = state["residuals"]["w"].copy()
        damaged["residuals"]["w"][2] = np.nan
        with pytest.raises(ValueError, match="residual 'w' of state\\['residuals'\\] holds NaN"):
            cc.load_state_dict(damaged)
        with pytest.raises(ValueError, match="step'\\] must be >= 0, got -5"):
            cc.load_state_dict({**state, "step": -5})
        with pytest.raises(TypeError, match="must be an integer"):
            cc.load_state_dict({**state, "step": 1.5})
        with pytest.raises(TypeError, match="what CompressedComm.state_dict"):
            cc.load_state_dict({"step": 3})
        after = cc.state_dict()
        assert after["step"] == state["step"] == 1
        np.testing.assert_array_equal(after["residuals"]["w"], state["residuals"]["w"])


def test_a_checkpoint_of_another_size_is_named_when_used():
    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "topk", ratio=0.25, min_numel=0) as cc:
        cc.load_state_dict(
            {"step": 0, "residuals": {"w": np.zeros(6, np.float32)}, "server_residuals": {}}
        )
        with pytest.raises(ValueError, match="'w' loaded from a checkpoint has shape \\(6,\\)"):
            cc.allreduce(np.ones(8, np.float32), name="w")


@pytest.mark.parametrize("bits", ["4", True, None])
def test_a_parameter_of_the_wrong_type_is_a_type_error(bits):
    from mpi4py import MPI

    with pytest.raises(TypeError, match="bits must be an integer"):
        mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm", bits=bits)


def test_a_checkpoint_step_saved_by_numpy_loads():
    from mpi4py import MPI

    with mpicomp.CompressedComm(MPI.COMM_SELF, "qsgd_maxnorm") as cc:
        cc.load_state_dict({"step": np.array(7), "residuals": {}, "server_residuals": {}})
        assert cc.state_dict()["step"] == 7
        avg, _ = cc.start(np.ones(4, np.float32), "w", layout=np.int64(3)).wait()
        np.testing.assert_array_equal(avg, 1)
