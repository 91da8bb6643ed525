"""Marks in an Nsight Compute profile of the CUDA kernels (``mpicomp.tools.bench.profile``).

``marker(dev)`` returns ``mark(number)``, which launches an empty kernel,
``mpicomp_profile_mark``, on ``number`` blocks: ncu lists it among the kernels it
measures, so its grid size says where a phase begins. ``window(dev)`` returns (start,
stop) of the CUDA profiler: ``ncu --profile-from-start off`` measures what lies between.
Off a GPU (another device, or none) they do nothing.
"""

from __future__ import annotations

MARK = "mpicomp_profile_mark"
_SOURCE = f'extern "C" __global__ void {MARK}() {{}}'


def _on_gpu(dev) -> bool:
    return dev is not None and dev.name == "cuda"


def marker(dev):
    """Return ``mark(number)``: an empty launch of ``number`` blocks on ``dev``'s GPU."""
    if not _on_gpu(dev):
        return lambda number: None
    import cupy

    kernel = cupy.RawKernel(_SOURCE, MARK)
    return lambda number: kernel((int(number),), (32,), ())


def window(dev):
    """Return (start, stop) of the CUDA profiler on ``dev``'s GPU."""
    if not _on_gpu(dev):
        return (lambda: None), (lambda: None)
    from cupy.cuda import profiler

    return profiler.start, profiler.stop
