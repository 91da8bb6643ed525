"""The kernel backend seam: records, selection, and every codec through a second backend."""

import ast
import inspect
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from _seam import counting_record, poison, round_trip

import mpicomp
import mpicomp.kernels as K
from conftest import gradient_like

ROOT = Path(__file__).resolve().parents[1]
# Codec parameters that reach every kernel path: multi-scale, error feedback, blocked FFT.
# Codecs on mpicomp's kernels (not PowerSGD's BLAS products, which no twin computes).
KERNEL_CODECS = [n for n in mpicomp.codecs.available() if mpicomp.codec(n).on_kernels]
CASES = [(name, {}) for name in KERNEL_CODECS] + [
    ("threelc", {"zero_run": False}),
    ("fastsgd", {"bucket": 1000}),
    ("grandk_maxnorm_multiscale", {"k": 0.3}),
]


def test_numba_record_has_every_family_and_launchers_of_the_same_name_as_documented():
    rec = K.backend("numba")
    assert rec.name == "numba" and rec.xp is np
    assert K.available() == ["numba"] or "numba" in K.available()
    for fam in K.FAMILIES:
        launchers = K.launchers(rec, fam)
        assert launchers, fam
        assert sorted(launchers) == sorted(K.LAUNCHERS[fam]), fam
        for name, fn in launchers.items():
            inspect.signature(fn)  # every launcher has an inspectable signature
            assert not name.startswith("mpicomp_"), f"{fam}.{name}: launchers drop the prefix"


def test_a_launcher_missing_from_a_backend_is_named():
    from mpicomp.kernels.families import find_launchers

    spellings = ("{name}", "mpicomp_{family}_{name}")
    kernels = SimpleNamespace(mpicomp_checksum_adler32=len, adler32_into=abs)
    with pytest.raises(
        AttributeError,
        match="no launcher checksum.adler32: none of adler32, mpicomp_checksum_adler32 in SimpleNamespace",
    ):
        find_launchers("checksum", (SimpleNamespace(),), spellings)
    assert find_launchers("checksum", (kernels,), spellings) == {
        "adler32": len,
        "adler32_into": abs,
    }


def test_selection_by_environment_and_clear_errors(monkeypatch):
    monkeypatch.setenv(K.ENV, "nope")
    with pytest.raises(ValueError, match="unknown kernel backend 'nope'.*MPICOMP_KERNELS"):
        mpicomp.codec("topk")
    monkeypatch.delenv(K.ENV)
    assert mpicomp.codec("topk").kernels.name == "numba"
    with pytest.raises(TypeError, match="lacks"):
        K.register_backend("broken", SimpleNamespace(name="broken", xp=np))
    with pytest.raises(TypeError, match="expected a NumPy or CuPy array, got builtins.list"):
        K.backend_of([1.0, 2.0])


def test_device_array_types_go_to_their_backend():
    class Arrays:  # a device array type, and one derived from it
        pass

    class MoreArrays(Arrays):
        pass

    K.register_backend("arrays", counting_record(Counter(), "arrays"))
    K.register_array_type(Arrays, "arrays")
    try:
        assert K.backend_of(MoreArrays()).name == "arrays"
        assert K.backend_of(np.zeros(1)).name == K.backend().name  # NumPy: as before
        with pytest.raises(TypeError, match="device array class"):
            K.register_array_type(np.ndarray, "arrays")
    finally:
        K._ARRAY_TYPES.pop(Arrays)
        K._REGISTRY.pop("arrays")


def test_a_lazy_registration_is_built_once_at_first_use():
    made = []

    def factory():
        made.append(1)
        return counting_record(Counter(), "lazy")

    K.register_backend("lazy", factory)
    try:
        assert not made
        assert K.backend("lazy") is K.backend("lazy") and made == [1]
    finally:
        K._REGISTRY.pop("lazy")


@pytest.mark.parametrize("name,params", CASES, ids=[f"{n}{p or ''}" for n, p in CASES])
def test_every_codec_runs_through_a_second_backend_with_the_same_bytes(monkeypatch, name, params):
    x = gradient_like(300_006, seed=3).reshape(7, -1) if name != "fft" else gradient_like(600_000)
    ref = round_trip(mpicomp.codec(name, **params), x)
    calls = Counter()
    K.register_backend("counting", counting_record(calls))
    try:
        monkeypatch.setenv(K.ENV, "counting")
        codec = mpicomp.codec(name, **params)
        assert codec.kernels.name == "counting"
        poison(monkeypatch, K.backend("numba"))
        got = round_trip(codec, x)
    finally:
        K._REGISTRY.pop("counting")
    assert sum(calls.values()) > 0
    for a, b in zip(ref, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("name", mpicomp.codecs.available())
def test_every_codec_meets_the_protocol_of_its_aggregation_kind(name):
    from mpicomp.reduction import integer_sum, kind_of

    codec = mpicomp.codec(name)
    protocol = kind_of(codec).protocol
    assert isinstance(codec, protocol), f"{name} does not implement {protocol.__name__}"
    if codec.aggregation == "integer_sum":
        assert isinstance(codec, integer_sum.ScaleIndexCodec) or not codec.multiscale
        assert isinstance(codec, integer_sum.SparseCoordinatesCodec) or not codec.sparse
        takes_step = "step" in inspect.signature(codec.local_norm).parameters
        assert takes_step == codec.sparse
        takes_index = "scale_index" in inspect.signature(codec.quantize).parameters
        assert takes_index == codec.multiscale
    for member in ("to_wire", "quantize", "votes_and_scale", "encode", "decode_sum"):
        if member in protocol.__dict__ and codec.aggregation != "integer_sum":
            want = inspect.signature(protocol.__dict__[member]).parameters
            have = inspect.signature(getattr(codec, member)).parameters
            assert list(have)[: len(want) - 1] == list(want)[1:], (name, member)


def _sources(*dirs):
    for d in dirs:
        yield from sorted((ROOT / d).rglob("*.py"))


def test_nothing_outside_kernels_imports_a_backend_or_looks_at_array_types():
    for path in _sources("mpicomp", "collectives", "jobs"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("mpicomp.kernels.cpu"), (
                    f"{path.relative_to(ROOT)}:{node.lineno} imports {node.module}: use the "
                    "launchers of mpicomp.kernels.backend_of(x)"
                )
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("mpicomp.kernels.cpu"), path
                    # `mpicomp info` (its facts: mpicomp/tools/diagnostics.py) may list the GPUs
                    # CuPy sees; nothing else touches CuPy.
                    if path.relative_to(ROOT).as_posix() not in (
                        "mpicomp/tools/cli.py",
                        "mpicomp/tools/diagnostics.py",
                    ):
                        assert alias.name != "cupy", f"{path.relative_to(ROOT)} imports cupy"
    # The one function that looks at array types: mpicomp.kernels.backend_of.
    lookers = [
        str(p.relative_to(ROOT))
        for p in _sources("mpicomp", "collectives", "kernels")
        if 'startswith("cupy")' in p.read_text() or "def get_array_module" in p.read_text()
    ]
    assert lookers == [], lookers


def _is_private(name: str) -> bool:
    """Return True for a private module of mpicomp outside kernels/ and collectives/."""
    parts = name.split(".")
    own = parts[:2] in (["mpicomp", "kernels"], ["mpicomp", "collectives"])
    return parts[0] == "mpicomp" and not own and any(p.startswith("_") for p in parts[1:])


def private_imports(source: str) -> list[str]:
    """Return the private modules of mpicomp outside kernels/ and collectives/ that
    ``source`` imports (``mpicomp._log``, ``from mpicomp import _log``), as ``line: name``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            whole = _is_private(node.module)
            names = [node.module] if whole else [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue  # a relative import stays in its own package
        found += [f"{node.lineno}: {name}" for name in names if _is_private(name)]
    return found


def test_the_private_import_check_sees_each_spelling():
    wrong = [
        "import mpicomp._log",
        "from mpicomp import _env, errors",
        "from mpicomp._x.y import z",
    ]
    assert private_imports("\n".join(wrong)) == [
        "1: mpicomp._log",
        "2: mpicomp._env",
        "3: mpicomp._x.y",
    ]
    fine = [
        "from mpicomp.kernels import _k",
        "from mpicomp.collectives import _wait",
        "from . import _a",
        "from mpicomp.errors import PayloadError",
    ]
    assert private_imports("\n".join(fine)) == []


def test_kernels_and_collectives_import_nothing_private_of_mpicomp():
    """They sit below mpicomp's own modules (loggers by name, the numba cache in kernels/)."""
    found = {
        path.relative_to(ROOT).as_posix(): hits
        for path in _sources("kernels", "collectives")
        if (hits := private_imports(path.read_text()))
    }
    assert found == {}, f"private modules of mpicomp imported: {found}"
