"""The devices the kernel-family tests (tests/test_cuda_<family>.py) run the CUDA sources on.

Always the CPU emulation at two launch geometries (results must not depend on them); on a
machine with a GPU, also the GPU through CuPy (``gpu_present``). The family tests hand
NumPy arrays to the launchers, so the GPU device is *mirrored*: its array module is NumPy,
and each kernel launch copies the host buffers its pointer arguments live in to the GPU,
runs, and copies them back. Arguments that are views of one buffer (an output written
into part of another array) share one device copy, so aliasing stays what it is on the
host. Slow, and only for tests: the codecs' device path is tested with real device arrays
(tests/test_cuda_codecs.py).
"""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from mpicomp.env import env_flag
from mpicomp.kernels.cuda.device import Device, source

#: (threads per block, blocks) of the emulated launches; "gpu" is the GPU's own geometry.
GEOMETRIES = [(64, 4), (32, 3)]

#: Set by `make test-gpu`: a GPU must be found (its tests then fail instead of skipping).
REQUIRE_GPU = env_flag("MPICOMP_TEST_GPU")


@cache
def gpu_present() -> bool:
    """Return True if CuPy imports and sees a GPU."""
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device
        return False


def params() -> list:
    """Return the ``dev`` fixture parameters: the emulated geometries, and "gpu" when one is
    present (or required)."""
    gpu = [pytest.param("gpu", id="gpu")] if gpu_present() or REQUIRE_GPU else []
    return [pytest.param(g, id=f"{g[0]}x{g[1]}") for g in GEOMETRIES] + gpu


def device(param) -> Device:
    """Return the device of a ``params()`` entry."""
    if param != "gpu":
        return Device.emulated(*param)
    if not gpu_present():
        pytest.fail("MPICOMP_TEST_GPU=1 but CuPy finds no GPU")
    return mirrored_gpu()


def place(where: str):
    """Return (to the place, back to the host, array type) of device arrays ``where``:
    ``"gpu"`` (CuPy), ``"host-backed"`` (tests/_device_arrays.py) or ``"emulated"``
    (NumPy arrays as they are)."""
    if where == "gpu":
        if not gpu_present():
            pytest.fail("MPICOMP_TEST_GPU=1 but CuPy finds no GPU")
        import cupy

        return cupy.asarray, cupy.asnumpy, cupy.ndarray
    if where == "host-backed":
        import _device_arrays as D

        D.install()
        return D.to_device, D.to_host, D.DeviceArray
    return (lambda a: a), (lambda a: a), np.ndarray


def mirrored_gpu(threads: int = 256, blocks_per_sm: int = 4) -> Device:
    """Return the current GPU as a device of NumPy arrays (module docstring)."""
    import cupy

    sms = cupy.cuda.Device().attributes["MultiProcessorCount"]
    gpu = Device.cuda(threads, blocks_per_sm)

    def build(family, code, opts):
        return _MirroredModule(gpu, family, opts)

    return Device("cuda", np, threads, blocks_per_sm * sms, build, gpu.synchronize)


class _MirroredModule:
    def __init__(self, gpu: Device, family: str, opts: tuple):
        self._gpu, self._family, self._opts = gpu, family, opts

    def get_function(self, name: str):
        gpu, family, opts = self._gpu, self._family, self._opts
        # The real module, built as Device.cuda builds it (same source and options).
        module = gpu._build(family, source(family), opts)
        return _MirroredKernel(module.get_function(name), name)


class _MirroredKernel:
    def __init__(self, kernel, name: str):
        self._kernel, self.name = kernel, name

    def __call__(self, grid, block, args, shared_mem: int = 0) -> None:
        import cupy

        roots: dict[int, tuple[np.ndarray, object]] = {}  # id(host root) -> (root, copy)
        device_args = []
        for a in args:
            if not isinstance(a, np.ndarray):
                device_args.append(a)
                continue
            if not a.flags.c_contiguous:
                raise ValueError(f"{self.name}: array arguments must be C-contiguous")
            root = _root(a)
            if id(root) not in roots:
                roots[id(root)] = (root, cupy.asarray(root.reshape(-1).view(np.uint8)))
            offset = a.ctypes.data - root.ctypes.data
            whole = roots[id(root)][1]
            view = whole[offset : offset + a.nbytes].view(a.dtype).reshape(a.shape)
            device_args.append(view)
        self._kernel(grid, block, tuple(device_args), shared_mem=shared_mem)
        cupy.cuda.Device().synchronize()
        for root, copy in roots.values():
            if root.flags.writeable:
                root.reshape(-1).view(np.uint8)[...] = copy.get()


def _root(a: np.ndarray) -> np.ndarray:
    """Return the outermost NumPy array whose memory ``a`` views (C-contiguous)."""
    while isinstance(a.base, np.ndarray) and a.base.flags.c_contiguous:
        a = a.base
    return a


def placed(a, shift):
    """Return a copy of ``a`` that starts ``shift`` elements past a 16-byte boundary (how
    the kernel tests reach every alignment of a vectorized access)."""
    buf = np.empty(a.nbytes + 64, np.uint8)
    start = (-buf.ctypes.data) % 16 + shift * a.itemsize
    view = buf[start : start + a.nbytes].view(a.dtype)
    view[...] = a
    return view
