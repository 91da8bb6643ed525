"""The numba backend: NumPy arrays on the CPU, one module of ``@njit`` kernels per family.

``record()`` builds the backend record ``mpicomp.kernels.backend("numba")`` returns: per
family, its launchers under the names every backend shares. Codecs and collectives
reach these kernels only through that record.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np


def numba_threadsafe() -> bool:
    """Return True if numba's parallel kernels may run on two threads at once.

    numba's ``workqueue`` layer (the fallback without OpenMP or TBB) aborts the process
    when two threads launch parallel kernels concurrently; ``omp`` and ``tbb`` do not.
    The layer is chosen at the first parallel launch, so this launches a tiny one.
    """
    import numba

    from mpicomp.kernels.cpu.checks import mpicomp_parallel_probe

    mpicomp_parallel_probe(2)
    return numba.threading_layer() != "workqueue"


def _on_host(a, out=None, *, why: str = ""):
    """The record's ``to_host``: NumPy arrays are on the host already (nothing counted)."""
    if out is None:
        return np.asarray(a)
    np.copyto(out, a)
    return out


def record() -> SimpleNamespace:
    """Return the numba backend's record: ``name``, ``xp`` and its launchers by family."""
    from mpicomp.kernels.cpu import (
        bits,
        checks,
        checksum,
        fastsgd,
        fft,
        fp16,
        qsgd,
        rfft,
        signsgd,
        threelc,
        topk,
    )

    family = SimpleNamespace
    return SimpleNamespace(
        name="numba",
        xp=np,
        to_host=_on_host,
        threadsafe=numba_threadsafe,
        bits=family(
            pack=bits.mpicomp_bits_pack,
            unpack=bits.mpicomp_bits_unpack,
            pack_shifted=bits.mpicomp_bits_pack_shifted,
            unpack_shifted=bits.mpicomp_bits_unpack_shifted,
            add_repack=bits.mpicomp_bits_add_repack,
            add_unpack=bits.mpicomp_bits_add_unpack,
            min_repack=bits.mpicomp_bits_min_repack,
        ),
        checksum=family(adler32=checksum.adler32, adler32_into=checksum.adler32_into),
        fastsgd=family(
            powers=fastsgd.mpicomp_fastsgd_powers,
            encode=fastsgd.encode,
            assemble=fastsgd.mpicomp_fastsgd_assemble,
            scan=fastsgd.mpicomp_fastsgd_scan,
            decode=fastsgd.mpicomp_fastsgd_decode,
        ),
        fft=family(
            round_fp16=fft.mpicomp_fft_round_fp16,
            rfft=rfft.rfft,
            irfft=rfft.irfft,
            sum_spectra=rfft.sum_spectra,
            add_residual=fft.mpicomp_fft_add_residual,
            kth_largest=fft.mpicomp_fft_kth_largest,
            select_pack=fft.mpicomp_fft_select_pack,
            choose_range=fft.mpicomp_fft_choose_range,
            quantize_pack=fft.mpicomp_fft_quantize_pack,
            residual=fft.mpicomp_fft_residual,
            unpack_dequantize=fft.unpack_dequantize,
            scatter=fft.mpicomp_fft_scatter,
            all_finite=checks.mpicomp_all_finite,
        ),
        fp16=family(
            encode=fp16.encode,
            decode=fp16.decode,
            add=fp16.add,
            all_finite=fp16.mpicomp_fp16_all_finite,
        ),
        qsgd=family(
            sumsq=qsgd.sumsq,
            block_norms=qsgd.block_norms,
            quantize=qsgd.quantize,
            multiscale_index=qsgd.multiscale_index,
            multiscale_quantize=qsgd.multiscale_quantize,
            dequantize=qsgd.dequantize,
            dequantize_packed=qsgd.dequantize_packed,
            multiscale_dequantize=qsgd.multiscale_dequantize,
            multiscale_dequantize_packed=qsgd.multiscale_dequantize_packed,
            grandk_select=qsgd.mpicomp_qsgd_grandk_select,
            grandk_sort=qsgd.mpicomp_qsgd_grandk_sort,
            grandk_compact=qsgd.mpicomp_qsgd_grandk_compact,
            grandk_scatter=qsgd.mpicomp_qsgd_grandk_scatter,
        ),
        signsgd=family(
            votes=signsgd.mpicomp_signsgd_votes,
            pack=signsgd.mpicomp_signsgd_pack,
            votes_scale=signsgd.mpicomp_signsgd_votes_scale,
            abs_sum=signsgd.mpicomp_signsgd_abs_sum,
            majority=signsgd.mpicomp_signsgd_majority,
            expand=signsgd.mpicomp_signsgd_expand,
        ),
        threelc=family(
            max=threelc.mpicomp_threelc_max,
            quartic_encode=threelc.mpicomp_threelc_quartic_encode,
            zero_run_encode=threelc.mpicomp_threelc_zero_run_encode,
            zero_run_length=threelc.mpicomp_threelc_zero_run_length,
            zero_run_decode=threelc.mpicomp_threelc_zero_run_decode,
            quartic_decode=threelc.mpicomp_threelc_quartic_decode,
        ),
        topk=family(
            select=topk.select,
            scatter=topk.mpicomp_topk_scatter,
            all_finite=checks.mpicomp_all_finite,
        ),
    )
