"""The CPU execution of CUDA sources (kernels/cuda/emulated.py): results, and the errors it
must report instead of hanging or computing garbage."""

import re
from pathlib import Path

import numpy as np
import pytest

from mpicomp.kernels import rng
from mpicomp.kernels.cpu.rng import uniform_array
from mpicomp.kernels.cuda import emulated
from mpicomp.kernels.cuda.device import Device, options

SOURCE = (Path(__file__).parent / "cuda" / "harness.cu").read_text()


@pytest.fixture(scope="module")
def module():
    return emulated.RawModule(SOURCE, options("harness"), name="harness")


@pytest.mark.parametrize("blocks, threads", [(1, 32), (3, 64), (2, 256)])
def test_counter_draws_match_the_numba_twin_for_any_grid(module, blocks, threads):
    n = 1000
    out = np.zeros(n, np.float32)
    key = rng.key(7, 3, 1)
    module.get_function("mpicomp_smoke_uniform")((blocks,), (threads,), (key, out, np.int64(n)))
    assert out.tobytes() == uniform_array(7, 3, 1, n).tobytes()


@pytest.mark.parametrize("blocks, threads", [(1, 32), (3, 96), (2, 1024)])
def test_block_scan_matches_numpy(module, blocks, threads):
    x = np.random.default_rng(threads).integers(0, 1000, blocks * threads - 5, dtype=np.uint32)
    out = np.zeros_like(x)
    totals = np.zeros(blocks, np.uint32)
    scan = module.get_function("mpicomp_smoke_scan")
    scan((blocks,), (threads,), (x, out, totals, np.int64(x.size)))
    padded = np.pad(x, (0, 5)).reshape(blocks, threads)
    expected = (np.cumsum(padded, axis=1) - padded).ravel()[: x.size]
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(totals, padded.sum(axis=1))


def test_warp_votes_shuffles_and_barrier_counts(module):
    blocks, threads = 2, 64
    x = np.random.default_rng(1).integers(0, 100, blocks * threads, dtype=np.uint32)
    ballots = np.zeros(blocks * threads // 32, np.uint32)
    firsts = np.zeros_like(x)
    counts = np.zeros(blocks, np.int32)
    module.get_function("warp_ops")((blocks,), (threads,), (x, ballots, firsts, counts))
    warps = x.reshape(-1, 32)
    bits = ((warps & 1).astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1)
    np.testing.assert_array_equal(ballots, bits.astype(np.uint32))
    np.testing.assert_array_equal(firsts, np.repeat(warps[:, 0], 32))
    np.testing.assert_array_equal(counts, (x.reshape(blocks, -1) & 1).sum(axis=1))


def test_dynamic_shared_memory(module):
    x = np.arange(3 * 128, dtype=np.float32)
    y = np.zeros_like(x)
    module.get_function("reverse_block")((3,), (128,), (x, y), shared_mem=128 * 4)
    np.testing.assert_array_equal(y, x.reshape(3, -1)[:, ::-1].ravel())


def test_float32_denormals_flush_to_zero_as_under_cupy(module):
    x = np.zeros(32, np.float32)
    x[:3] = [1e-38, 3e-39, 1.0]
    y = np.ones_like(x)
    module.get_function("halve")((1,), (32,), (x, y))
    assert y[0] == 0 and y[1] == 0 and y[2] == 0.5  # 5e-39 and 1.5e-39 are denormal


@pytest.mark.parametrize("value, kept", [("1", True), (" Yes ", True), ("0", False), ("", False)])
def test_no_ftz_follows_the_boolean_rule(module, monkeypatch, value, kept):
    monkeypatch.setenv(emulated.NO_FTZ_ENV, value)
    x = np.zeros(32, np.float32)
    x[0] = 1e-38
    y = np.ones_like(x)
    module.get_function("halve")((1,), (32,), (x, y))
    denormal = x[0] * np.float32(0.5)  # NumPy keeps denormals
    assert denormal != 0 and y[0] == (denormal if kept else 0)


def test_bad_emulation_settings_are_refused_naming_the_variable(module, monkeypatch):
    halve = module.get_function("halve")
    x, y = np.zeros(32, np.float32), np.zeros(32, np.float32)
    monkeypatch.setenv(emulated.NO_FTZ_ENV, "keep")
    with pytest.raises(ValueError, match="MPICOMP_EMULATED_NO_FTZ='keep' is not a boolean"):
        halve((1,), (32,), (x, y))
    monkeypatch.delenv(emulated.NO_FTZ_ENV)
    monkeypatch.delenv(emulated.TIMEOUT_ENV, raising=False)
    assert emulated.barrier_timeout() == emulated.TIMEOUT_S == 10
    for bad in ("0", "-1", "2.5", "ten"):
        monkeypatch.setenv(emulated.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=f"MPICOMP_EMULATED_TIMEOUT must be .* got '{bad}'"):
            halve((1,), (32,), (x, y))
    monkeypatch.setenv(emulated.TIMEOUT_ENV, " 3 ")
    assert emulated.barrier_timeout() == 3
    halve((1,), (32,), (x, y))


@pytest.mark.parametrize(
    "kernel, message",
    [
        # Which thread notices first depends on timing; each report names the divergence.
        ("divergent_barrier", "__syncthreads.*divergent barrier|divergent barrier.*__syncthreads"),
        ("two_barriers", "reached at two places"),
        ("partial_shuffle", "warp.*divergent barrier|divergent barrier.*warp"),
    ],
)
def test_a_barrier_that_cannot_complete_fails_naming_kernel_and_line(module, kernel, message):
    out = np.zeros(32, np.float32 if kernel != "partial_shuffle" else np.uint32)
    with pytest.raises(emulated.EmulatedLaunchError, match=message) as e:
        module.get_function(kernel)((1,), (32,), (out,))
    assert kernel in str(e.value)
    assert re.search(r"line \d+|harness\.cu:\d+", str(e.value))
    # The module still works after a failed launch.
    test_float32_denormals_flush_to_zero_as_under_cupy(module)


def test_arguments_and_geometry_are_checked(module):
    n = 64
    x, out, totals = np.zeros(n, np.uint32), np.zeros(n, np.uint32), np.zeros(1, np.uint32)
    scan = module.get_function("mpicomp_smoke_scan")
    with pytest.raises(TypeError, match="4 arguments given, the kernel takes 4|takes 4"):
        scan((1,), (64,), (x, out, totals))
    with pytest.raises(TypeError, match="argument 3 is int32, the parameter is an integer of 8"):
        scan((1,), (64,), (x, out, totals, np.int32(n)))
    with pytest.raises(TypeError, match="must be a NumPy scalar"):
        scan((1,), (64,), (x, out, totals, n))
    with pytest.raises(TypeError, match="argument 0 is a pointer"):
        scan((1,), (64,), (np.uint32(1), out, totals, np.int64(n)))
    with pytest.raises(ValueError, match="C-contiguous"):
        scan((1,), (32,), (np.zeros(128, np.uint32)[::2], out, totals, np.int64(n)))
    with pytest.raises(emulated.EmulatedLaunchError, match="invalid launch"):
        scan((1,), (2048,), (x, out, totals, np.int64(n)))
    with pytest.raises(emulated.EmulatedLaunchError, match="dynamic shared memory"):
        scan((1,), (64,), (x, out, totals, np.int64(n)), shared_mem=64 * 1024)
    with pytest.raises(AttributeError, match="no kernel 'missing'"):
        module.get_function("missing")


def test_a_source_g_plus_plus_refuses_names_its_line(tmp_path, monkeypatch):
    monkeypatch.setenv(emulated.CACHE_ENV, str(tmp_path))
    bad = 'extern "C" __global__ void k(float* x) {\n  x[0] = undefined_name;\n}\n'
    with pytest.raises(emulated.CompileError, match=r"broken\.cu:2"):
        emulated.RawModule(bad, name="broken")


def test_device_geometry_is_validated():
    with pytest.raises(ValueError, match="multiple of 32"):
        Device.emulated(threads=48)
    dev = Device.emulated(threads=64, max_blocks=4)
    assert (dev.grid(0), dev.grid(64), dev.grid(65), dev.grid(10**9)) == (1, 1, 2, 4)


def test_families_with_the_same_options_get_their_own_modules():
    from mpicomp.kernels.cuda import checksum, fp16

    same = fp16.DEFINES  # fp16's macros hold checksum's (the Adler base) and more
    assert checksum.DEFINES.items() <= same.items()
    dev = Device.emulated()
    assert dev.kernel("checksum", "mpicomp_checksum_adler32", same) is not None
    assert dev.kernel("fp16", "mpicomp_fp16_all_finite", same) is not None
