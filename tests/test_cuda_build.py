"""Every CUDA source compiles as CuPy compiles it (NVRTC) and with nvcc -Werror, no GPU needed."""

import pytest

from mpicomp.kernels.cuda import compile_check, device

FAMILIES = compile_check.families()
ARCHS = compile_check.ARCHS

CLEAN = '#include "common.cuh"\nextern "C" __global__ void k(float* x) { x[threadIdx.x] *= 2.f; }\n'
WARNS = 'extern "C" __global__ void k(float* x) { int unused; x[0] = 1.f; }\n'
BROKEN = 'extern "C" __global__ void k(float* x) { x[0] = undefined_name; }\n'


def _cupy():
    return pytest.importorskip("cupy", reason="pip install mpicomp[cuda-compile] for NVRTC")


def _nvcc():
    import shutil

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH (the CUDA toolkit compiles the sources with -Werror)")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_source_compiles_through_cupys_nvrtc_without_warnings(family, arch):
    _cupy()
    compile_check.nvrtc(family, arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_source_compiles_with_nvcc_werror_and_no_spills(family, arch):
    _nvcc()
    report = compile_check.nvcc(family, arch)
    assert "Used" in report and "registers" in report  # ptxas reported every kernel


@pytest.mark.parametrize("check", ["nvrtc", "nvcc"])
def test_the_checks_refuse_warnings_and_errors(monkeypatch, check):
    _cupy() if check == "nvrtc" else _nvcc()
    run = getattr(compile_check, check)
    sources = {"clean": CLEAN, "warns": WARNS, "broken": BROKEN}
    monkeypatch.setattr(device, "source", lambda family: sources[family])
    if check == "nvcc":  # nvcc reads the file: give it one
        import pathlib
        import tempfile

        tmp = pathlib.Path(tempfile.mkdtemp())
        for name, text in sources.items():
            (tmp / f"{name}.cu").write_text(text)
        (tmp / "common.cuh").write_text((device.SOURCES / "common.cuh").read_text())
        monkeypatch.setattr(device, "SOURCES", tmp)
        monkeypatch.setattr(device, "BASE_OPTIONS", ("--std=c++17", "--fmad=false", f"-I{tmp}"))
    run("clean", "90")
    for bad in ("warns", "broken"):
        with pytest.raises(compile_check.CompileFailed, match=bad):
            run(bad, "90")
