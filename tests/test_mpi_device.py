"""CompressedComm on device arrays, across ranks: the host-backed stand-ins for CuPy arrays
(tests/_device_arrays.py) through every codec and aggregation path give the NumPy path's
results bit for bit, as device arrays, with no hidden host transfer; staging buffers stop
growing after the first calls; a bad device input on one rank raises on every rank."""

import logging
import re

import _device_arrays as D
import numpy as np
import pytest
from _devices import REQUIRE_GPU, gpu_present, place
from _seam import assert_same

import mpicomp
from mpicomp import RankError

PATHS = [(name, False) for name in mpicomp.codecs.available()] + [
    (name, True)
    for name in mpicomp.codecs.available()
    if mpicomp.codec(name).aggregation == "gather"
]


def _gradients(rank: int) -> list[np.ndarray]:
    rng = np.random.default_rng(rank)
    return [rng.standard_normal(n).astype(np.float32) * 1e-3 for n in (3001, 700, 64)]


@pytest.fixture(params=["staged", "direct"])
def transport(request, monkeypatch):
    """Both ways device bytes reach MPI: staged through host buffers, or handed to a
    CUDA-aware MPI (MPICOMP_CUDA_AWARE=1: any MPI reads these arrays, whose memory is
    host memory, through __cuda_array_interface__)."""
    from mpicomp.reduction import transport

    monkeypatch.setenv(transport.ENV, "1" if request.param == "direct" else "0")
    transport.cuda_aware.cache_clear()
    yield request.param
    transport.cuda_aware.cache_clear()


def _library_takes_gpu_buffers() -> bool:
    from mpi4py import MPI

    from mpicomp.reduction import transport

    answer, _ = transport.library_cuda_support(transport.libmpi_path(), MPI.get_vendor()[0])
    return bool(answer)


def _run(world, name, sharded, xs, to_place, caplog):
    """Two steps of one tensor (error feedback carries over), then a fused bucket; return
    the results and the device transport the CompressedComm logged that it takes."""
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="mpicomp"):
        cc = mpicomp.CompressedComm(world, name, sharded=sharded, min_numel=1, bucket_numel=1000)
    (path,) = re.findall(r"device transport (\w+)", caplog.text)
    with cc:
        out = [cc.allreduce(to_place(xs[0]), name="w") for _ in range(2)]
        out += cc.allreduce_many([to_place(x) for x in xs[1:]], ["a", "b"])
        handle = cc.iallreduce(to_place(xs[0]), name="w")
        out.append(handle.wait())
        return out, path


# The host-backed stand-ins everywhere; CuPy arrays where a GPU is present (ranks share it).
PLACES = ["host-backed"] + (["gpu"] if gpu_present() or REQUIRE_GPU else [])


@pytest.mark.mpi
@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("name,sharded", PATHS, ids=[f"{n}{'-sharded' * s}" for n, s in PATHS])
def test_device_arrays_give_the_numpy_results(name, sharded, transport, where, caplog):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size > 3 and where == "host-backed":
        # The transports do not depend on the rank count (the collectives are tested at
        # every N); the emulated kernels of 4-5 ranks on 2 cores would take minutes.
        pytest.skip("host-backed device arrays are checked at 1-3 ranks")
    if where == "gpu" and transport == "direct" and not _library_takes_gpu_buffers():
        pytest.skip("this MPI library is not CUDA-aware: GPU pointers would crash it")
    to_place, to_host, array_type = place(where)
    xs = _gradients(world.rank)
    ref, _ = _run(world, name, sharded, xs, lambda a: a, caplog)
    D.reset_syncs()
    got, path = _run(world, name, sharded, xs, to_place, caplog)
    assert path == transport
    assert D.SYNCS["implicit"] == 0, D.SYNCS
    for a, b in zip(ref, got, strict=True):
        assert isinstance(b, array_type)
        assert_same(a, to_host(b), transform_differs=name == "fft" and where == "gpu")


@pytest.mark.mpi
def test_staging_buffers_are_reused_call_after_call(monkeypatch):
    from mpi4py import MPI

    from mpicomp.reduction import transport

    monkeypatch.setenv(transport.ENV, "0")
    transport.cuda_aware.cache_clear()

    world = MPI.COMM_WORLD
    D.install()
    made = D.count_pinned(monkeypatch, mpicomp.kernels.backend(D.BACKEND).device)
    x = D.to_device(_gradients(world.rank)[0])
    with mpicomp.CompressedComm(world, "threelc", sharded=True, min_numel=1) as cc:
        for _ in range(2):  # payload lengths vary: the first calls size the buffers
            cc.allreduce(x, name="w")
        buffers = len(made)
        assert buffers >= 1
        for _ in range(4):
            cc.allreduce(x, name="w")
        assert len(made) == buffers


@pytest.mark.mpi
@pytest.mark.parametrize("bad", ["int32", "mixed"])
def test_a_bad_device_input_on_one_rank_raises_on_every_rank(bad):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    D.install()
    xs = [D.to_device(x) for x in _gradients(world.rank)[1:]]
    culprit = world.size - 1
    if world.rank == culprit:
        if bad == "int32":
            xs[0] = D.to_device(np.arange(700, dtype=np.int32))
        else:
            xs[0] = D.to_host(xs[0])  # one host array among device ones
    with mpicomp.CompressedComm(world, "qsgd_maxnorm", min_numel=1) as cc:
        if world.rank == culprit:
            with pytest.raises(TypeError, match="floating-point|host arrays or device arrays"):
                cc.allreduce_many(xs, ["a", "b"])
        elif world.size > 1:
            with pytest.raises(RankError, match=f"rank {culprit} failed"):
                cc.allreduce_many(xs, ["a", "b"])
        # Every rank is still in step: the next call works.
        ok = [D.to_device(x) for x in _gradients(world.rank)[1:]]
        assert len(cc.allreduce_many(ok, ["a", "b"])) == 2


@pytest.mark.mpi
def test_a_gradient_on_another_gpu_raises_on_every_rank():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    D.install()
    x = _gradients(world.rank)[1]
    culprit = world.size - 1
    with mpicomp.CompressedComm(world, "signsgd", min_numel=1) as cc:
        cc.allreduce(D.to_device(x))  # fixes this communicator's GPU: 0
        mine = D.to_device(x, gpu=1 if world.rank == culprit else 0)
        if world.rank == culprit:
            with pytest.raises(TypeError, match="is on GPU 1.*works on GPU 0"):
                cc.allreduce(mine)
        elif world.size > 1:
            with pytest.raises(RankError, match=f"rank {culprit} failed"):
                cc.allreduce(mine)
        assert cc.allreduce(D.to_device(x)).shape == x.shape  # still in step


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["topk", "qsgd_maxnorm"])
def test_a_rank_computes_on_the_gpu_its_gradients_live_on(codec):
    """Rank r's gradients on (simulated) GPU r % 2 while GPU 0 stays current: the calls,
    blocking and started on the worker thread, run on the gradients' GPU (the stand-ins
    refuse any launch or operation on another one) and match the NumPy path."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    D.install()
    gpu = world.rank % 2
    xs = _gradients(world.rank)[:2]
    with mpicomp.CompressedComm(world, codec, min_numel=1) as cc:
        want = [cc.allreduce(x, name=f"w{i}") for i, x in enumerate(xs)]
    assert D.current_gpu() == 0
    with mpicomp.CompressedComm(world, codec, min_numel=1) as cc:
        got = [cc.allreduce(D.to_device(xs[0], gpu=gpu), name="w0")]
        got.append(cc.iallreduce(D.to_device(xs[1], gpu=gpu), name="w1").wait())
        fused = cc.allreduce_many([D.to_device(x, gpu=gpu) for x in xs], ["a", "b"])
    assert D.current_gpu() == 0
    for g, w in zip(got, want, strict=True):
        assert g.device.id == gpu
        np.testing.assert_array_equal(D.to_host(g), w)
    assert [f.device.id for f in fused] == [gpu, gpu]


@pytest.mark.mpi
def test_info_all_ranks_reports_every_rank(capsys):
    import json

    from mpi4py import MPI

    from mpicomp.tools import cli

    world = MPI.COMM_WORLD
    assert cli.main(["info", "--all-ranks", "--json"]) == 0
    out = capsys.readouterr().out
    if world.rank != 0:
        assert out == ""
        return
    ranks = json.loads(out)["ranks"]
    assert [r["rank"] for r in ranks] == list(range(world.size))
    assert all(0 <= r["local rank"] < world.size for r in ranks)
    for r in ranks:
        assert r["GPU"] and r["host"] and r["CUDA-aware MPI"].startswith(("yes (", "no ("))


class CaiArray:
    """An array type exposing host memory through ``__cuda_array_interface__`` only, as
    mpi4py's tests of GPU buffers use: under MPICOMP_KERNELS=cuda-emulated its memory is
    the emulated device's."""

    def __init__(self, a: np.ndarray):
        self.host = np.ascontiguousarray(a)

    @property
    def __cuda_array_interface__(self) -> dict:
        return D.cuda_array_interface(self.host)


class OnOtherDevice:
    """A tensor on a device DLPack names but mpicomp does not compute on (Metal)."""

    dtype = np.float32

    def __dlpack_device__(self):
        return (8, 0)

    def __dlpack__(self, **kwargs):
        raise AssertionError("never read")


def _unsupported_device(kind: str):
    """A float32 tensor on a device mpicomp does not compute on."""
    if kind == "metal":
        return OnOtherDevice()
    torch = pytest.importorskip("torch")
    return torch.zeros(700, device="meta")  # says it is on no device DLPack knows


@pytest.mark.mpi
@pytest.mark.parametrize("codec", ["qsgd_maxnorm", "topk"])
@pytest.mark.parametrize("bad", ["metal", "torch meta"])
def test_cuda_array_interface_objects_under_cuda_emulated(codec, bad, monkeypatch):
    from mpi4py import MPI

    import mpicomp.kernels as K

    world = MPI.COMM_WORLD
    if world.size > 3:
        pytest.skip("emulated kernels are checked at 1-3 ranks")
    xs = _gradients(world.rank)
    with mpicomp.CompressedComm(world, codec, min_numel=1) as cc:
        ref = [cc.allreduce(xs[0], name="w"), *cc.allreduce_many(xs[1:])]
    monkeypatch.setenv(K.ENV, "cuda-emulated")
    with mpicomp.CompressedComm(world, codec, min_numel=1) as cc:
        got = [cc.allreduce(CaiArray(xs[0]), name="w")]
        got += cc.allreduce_many([CaiArray(x) for x in xs[1:]])
        culprit = world.size - 1
        mine = _unsupported_device(bad) if world.rank == culprit else CaiArray(xs[0])
        if world.rank == culprit:
            with pytest.raises(TypeError, match="DLPack device type 8|Unknown device type meta"):
                cc.allreduce(mine, name="w")
        elif world.size > 1:
            with pytest.raises(RankError, match=f"rank {culprit} failed"):
                cc.allreduce(mine, name="w")
        assert cc.allreduce(CaiArray(xs[0]), name="v").shape == xs[0].shape  # still in step
    for a, b in zip(ref, got, strict=True):
        assert a.tobytes() == np.asarray(b).tobytes()


@pytest.mark.mpi
@pytest.mark.parametrize(
    "name,schedule", [("qsgd_maxnorm", "hier:ring"), ("threelc", "hier:sharded")]
)
def test_hierarchical_calls_on_device_arrays_give_the_numpy_results(name, schedule, transport):
    """The reduce-scatter and allgather within the host take the device buffers (direct)
    or their staged copies, and the exchange between hosts computes on the device."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size != 4:
        pytest.skip("hosts of two ranks are emulated at 4 ranks")
    local = world.Split(world.rank // 2, world.rank)
    to_place, to_host, array_type = place("host-backed")
    x = _gradients(world.rank)[0]
    out = {}
    for where, put in (("host", lambda a: a), ("device", to_place)):
        with mpicomp.CompressedComm(
            world, name, schedule=schedule, local_comm=local, min_numel=1
        ) as cc:
            out[where] = [cc.allreduce(put(x), name="w") for _ in range(2)]
    local.Free()
    for a, b in zip(out["host"], out["device"], strict=True):
        assert isinstance(b, array_type)
        assert a.tobytes() == to_host(b).tobytes()


SCATTERED = [name for name in mpicomp.codecs.available() if name != "powersgd"]


@pytest.mark.mpi
@pytest.mark.parametrize("where", PLACES)
@pytest.mark.parametrize("name", SCATTERED)
def test_device_rows_and_gathers_give_the_numpy_results(name, transport, where):
    """reduce_scatter (twice: residuals per row) and allgather at both precisions."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size > 3 and where == "host-backed":
        pytest.skip("host-backed device arrays are checked at 1-3 ranks")
    if where == "gpu" and transport == "direct" and not _library_takes_gpu_buffers():
        pytest.skip("this MPI library is not CUDA-aware: GPU pointers would crash it")
    to_place, to_host, array_type = place(where)
    x = _gradients(world.rank)[0]

    def run(put):
        with mpicomp.CompressedComm(world, name, min_numel=1) as cc:
            rows = [cc.reduce_scatter(put(x), name="w") for _ in range(2)]
            rows += [
                cc.allgather(rows[-1], numel=x.size, precision=p) for p in ("float32", "bfloat16")
            ]
            return rows

    ref = run(lambda a: a)
    D.reset_syncs()
    got = run(to_place)
    assert D.SYNCS["implicit"] == 0, D.SYNCS
    for a, b in zip(ref, got, strict=True):
        assert isinstance(b, array_type)
        assert_same(a, to_host(b), transform_differs=name == "fft" and where == "gpu")
