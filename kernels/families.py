"""The kernel families and each one's launchers, named once for every backend.

A backend's record has one attribute per family of ``FAMILIES``, holding the launchers
``LAUNCHERS`` names; the numba and CUDA records are built from this table by
``find_launchers``, each backend spelling a launcher its own way.
"""

from __future__ import annotations

from collections.abc import Callable

#: Each kernel family's launchers, by the names every backend gives them: the one list
#: of them, from which the numba and CUDA records are built (``find_launchers``).
LAUNCHERS = {
    "bits": (
        "pack",
        "unpack",
        "pack_shifted",
        "unpack_shifted",
        "add_repack",
        "add_unpack",
        "min_repack",
    ),
    "checksum": ("adler32", "adler32_into"),
    "fastsgd": ("powers", "encode", "assemble", "scan", "decode"),
    "fft": (
        "round_fp16",
        "rfft",
        "irfft",
        "sum_spectra",
        "add_residual",
        "kth_largest",
        "select_pack",
        "choose_range",
        "quantize_pack",
        "residual",
        "unpack_dequantize",
        "scatter",
        "all_finite",
    ),
    "fp16": ("encode", "decode", "add", "all_finite"),
    "qsgd": (
        "sumsq",
        "block_norms",
        "quantize",
        "multiscale_index",
        "multiscale_quantize",
        "dequantize",
        "dequantize_packed",
        "multiscale_dequantize",
        "multiscale_dequantize_packed",
        "grandk_select",
        "grandk_sort",
        "grandk_compact",
        "grandk_scatter",
    ),
    "signsgd": ("votes", "pack", "votes_scale", "abs_sum", "majority", "expand"),
    "threelc": (
        "max",
        "quartic_encode",
        "zero_run_encode",
        "zero_run_length",
        "zero_run_decode",
        "quartic_decode",
    ),
    "topk": ("select", "scatter", "all_finite"),
}

#: The kernel families every backend provides, one attribute of the record each.
FAMILIES = tuple(LAUNCHERS)


def find_launchers(family: str, sources, spellings: tuple[str, ...]) -> dict[str, Callable]:
    """Return ``family``'s launchers (``LAUNCHERS[family]``) by name, as a backend defines
    them: each the first attribute of ``sources`` (modules or objects, searched in order)
    spelled as the first of ``spellings`` found (``str.format`` patterns of ``family`` and
    ``name``, e.g. ``"mpicomp_{family}_{name}"``).

    Raises:
        AttributeError: a launcher is under none of the spellings in any of the sources.
    """
    found = {}
    for name in LAUNCHERS[family]:
        tried = [s.format(family=family, name=name) for s in spellings]
        fn = next(
            (f for t in tried for src in sources if (f := getattr(src, t, None)) is not None),
            None,
        )
        if fn is None:
            where = ", ".join(getattr(src, "__name__", type(src).__name__) for src in sources)
            raise AttributeError(
                f"no launcher {family}.{name}: none of {', '.join(tried)} in {where}"
            )
        found[name] = fn
    return found
