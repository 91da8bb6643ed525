"""Fuzz every decoder beyond tests/test_payloads.py: mutated valid payloads with a
re-computed checksum, random valid headers, and hostile length fields.

The outcome of every case is `mpicomp.PayloadError`, or a finite float32 array of
the header's shape; never another exception, a crash, a hang, a write into the
payload, a read past it, or a large allocation. ``MPICOMP_FUZZ_SCALE`` multiplies
the number of cases (default 1: about 8,000 cases in 20-30 s on one core).
"""

import faulthandler
import math
import os
import struct
import tracemalloc
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mpicomp
from conftest import gradient_like
from mpicomp.codecs import _wire

SCALE = float(os.environ.get("MPICOMP_FUZZ_SCALE", "1"))
# A decode that runs this long is a hang: dump every thread's stack and exit, so the
# suite fails loudly instead of waiting (numba loops cannot be interrupted otherwise).
HANG_S = 60
PEAK_BYTES = 64 << 20  # no hostile length field may make decode allocate more


def _decoders() -> list[str]:
    # Codecs whose payload is bytes: gather codecs, and any other with a decode (signsgd).
    return [
        name
        for name in mpicomp.codecs.available()
        if mpicomp.codec(name).aggregation == "gather" or hasattr(mpicomp.codec(name), "decode")
    ]


DECODERS = _decoders()
# Parameter sets that reach the other branches of each body format.
VARIANTS = {
    "topk": [{}, {"ratio": 0.5}, {"ratio": 1.0}],
    "threelc": [{}, {"zero_run": False}, {"sparsity": 1.9}],
    "fft": [{}, {"bits": 4, "theta": 0.5, "fp16": False}, {"bits": 16, "theta": 0.0}],
    "fastsgd": [{}, {"bucket": 7, "flag_bits": 1, "tau": 20}, {"bucket": 0, "base": 2.0}],
}
CASES: Counter = Counter()
# Decoders that may return NaN/Inf: `none` carries float32 as it is (docs/usage.md);
# fp16 should refuse them (its encoder does) but does not yet: test_fp16_refuses_inf.
NONFINITE_PASSES = {"none", "fp16"}


def _examples(n: int) -> int:
    return max(1, int(n * SCALE))


@pytest.fixture(scope="module", autouse=True)
def report_cases(request):
    """Print how many cases each kind of fuzzing ran (for docs/reliability.md)."""
    yield
    plugins = request.config.pluginmanager
    reporter = plugins.get_plugin("terminalreporter")
    capture = plugins.get_plugin("capturemanager")
    if reporter is None or capture is None or not CASES:
        return
    total = sum(CASES.values())
    detail = ", ".join(f"{k} {v}" for k, v in sorted(CASES.items()))
    with capture.global_and_fixture_disabled():  # teardown output is captured otherwise
        reporter.write_line(f"\nfuzzed {total} payloads: {detail}")


def _header_shape(payload: np.ndarray) -> tuple[int, ...]:
    return _wire.claimed_shape(payload)


# Decoders trust a header's element count (up to 2^40) unless told the expected one:
# a few bytes of a sparse payload may honestly describe a huge tensor, whose dense
# output would be allocated (and, checked for finiteness, touched: a 32 GiB shape
# was enough to get a test run killed). Like CompressedComm, pass numel= for those.
LARGE_NUMEL = 1 << 24


def _expected_numel(payload: np.ndarray) -> int | None:
    """Return LARGE_NUMEL when the header claims more elements, else None (trust it)."""
    shape = _wire.claimed_shape(payload)
    return LARGE_NUMEL if shape is not None and math.prod(shape) > LARGE_NUMEL else None


def _decode_checked(codec, payload: np.ndarray, kind: str | None) -> str:
    """Decode ``payload``; assert the outcome is allowed and return "ok" or "refused".

    ``kind`` names the case in the count printed at the end (None: not counted).
    """
    if kind is not None:
        CASES[kind] += 1
    before = payload.copy()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    try:
        y = codec.decode(payload, numel=_expected_numel(payload))
    except mpicomp.PayloadError:
        outcome = "refused"
    else:
        outcome = "ok"
        assert isinstance(y, np.ndarray) and y.dtype == np.float32
        assert y.shape == _header_shape(payload)
        assert codec.name in NONFINITE_PASSES or np.all(np.isfinite(y))
    finally:
        faulthandler.cancel_dump_traceback_later()
    np.testing.assert_array_equal(payload, before, err_msg="decode wrote into its payload")
    return outcome


def _decode_guarded(codec, payload: np.ndarray, kind: str) -> None:
    """Decode ``payload`` as a view between guard bytes of 0x00, then of 0xFF.

    A decoder that read past its view would see different bytes the second time;
    both outcomes and results must be the same.
    """
    results = []
    for fill, counted in ((0x00, kind), (0xFF, None)):
        buf = np.full(payload.size + 128, fill, dtype=np.uint8)
        view = buf[64 : 64 + payload.size]
        view[:] = payload
        outcome = _decode_checked(codec, view, counted)
        decoded = codec.decode(view, numel=_expected_numel(view)) if outcome == "ok" else None
        results.append((outcome, b"" if decoded is None else decoded.tobytes()))
        assert np.all(buf[:64] == fill) and np.all(buf[64 + payload.size :] == fill)
    assert results[0] == results[1], "decode depends on bytes outside its payload"


def _codec_params(name: str):
    return st.sampled_from(VARIANTS.get(name, [{}]))


# Shapes up to 3-D, at most a few hundred elements: every branch, fast.
shapes = st.lists(st.integers(0, 9), max_size=3).filter(lambda s: math.prod(s) <= 729)


@st.composite
def gradients(draw):
    """Draw an input: gradient-like, all zero, sparse, constant or wide-ranged values."""
    shape = tuple(draw(shapes))
    n = math.prod(shape)
    kind = draw(st.sampled_from(["gradient", "zeros", "sparse", "constant", "wide"]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    if kind == "gradient":
        x = gradient_like(n, seed=seed)
    elif kind == "zeros":
        x = np.zeros(n, np.float32)
    elif kind == "sparse":
        x = np.where(rng.random(n) < 0.05, rng.standard_normal(n), 0).astype(np.float32)
    elif kind == "constant":
        x = np.full(n, draw(st.sampled_from([1e-30, -3.0, 0.5, 1e4])), np.float32)
    else:  # magnitudes from 1e-38 to 1e4, within float16 for fp16 where it matters
        x = (rng.standard_normal(n) * 10.0 ** rng.uniform(-38, 4, n)).astype(np.float32)
    return x.reshape(shape)


# A mutation: (op, position in [0, 1), byte value, length).
mutations = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "truncate", "extend", "insert", "delete"]),
        st.floats(0, 1, exclude_max=True),
        st.integers(0, 255),
        st.integers(1, 16),
    ),
    min_size=1,
    max_size=4,
)


def _mutate(p: np.ndarray, ops) -> np.ndarray:
    b = bytearray(p.tobytes())
    for op, where, value, length in ops:
        pos = int(where * len(b)) if b else 0
        if op == "flip" and b:
            b[pos] ^= 1 << (value % 8)
        elif op == "set" and b:
            b[pos] = value
        elif op == "truncate":
            del b[pos:]
        elif op == "extend":
            b += bytes([value]) * length
        elif op == "insert":
            b[pos:pos] = bytes([value]) * length
        elif op == "delete":
            del b[pos : pos + length]
    return np.frombuffer(bytes(b), dtype=np.uint8).copy()


@pytest.mark.parametrize("name", DECODERS)
@settings(max_examples=_examples(500))
@given(params=st.data(), x=gradients(), ops=mutations, fix=st.booleans())
def test_mutated_valid_payloads(name, params, x, ops, fix):
    # With the header repaired (most cases), the mutation reaches the codec's body checks.
    codec = mpicomp.codec(name, **params.draw(_codec_params(name)))
    if name == "fp16" and np.abs(x).max(initial=0) > 65504:
        x = x / np.float32(1e4)
    p = _mutate(codec.encode(x), ops)
    if fix or p.size < _wire.FIXED_SIZE:
        p = _wire.reseal(p)
    _decode_guarded(codec, p, "mutated")


@pytest.mark.parametrize("name", DECODERS)
@settings(max_examples=_examples(300))
@given(
    shape=st.lists(
        st.sampled_from([0, 1, 2**40, 2**63, 2**64 - 1])
        | st.integers(0, 2**64 - 1)
        | st.integers(0, 40),
        max_size=_wire.MAX_NDIM,
    ),
    flags=st.integers(0, 255),
    body=st.binary(max_size=400),
)
def test_random_valid_headers(name, shape, flags, body):
    # Any shape, including 0 beside 2^64 - 1, behind a correct magic, id and checksum.
    codec = mpicomp.codec(name)
    p = _wire.pack(name, tuple(shape), np.frombuffer(body, dtype=np.uint8), flags=flags)
    _decode_checked(codec, p, "random header")


@pytest.mark.parametrize("name", DECODERS)
def test_empty_shape_beside_a_huge_dim(name):
    body = mpicomp.codec(name).encode(np.zeros((0, 3), np.float32))[_wire.header_size(2) :]
    p = _wire.pack(name, (0, 2**64 - 1), body)
    assert _decode_checked(mpicomp.codec(name), p, "hostile length") == "refused"


@pytest.mark.parametrize("name", DECODERS)
@settings(max_examples=_examples(150))
@given(data=st.binary(min_size=_wire.FIXED_SIZE, max_size=600))
def test_random_bytes_after_the_magic(name, data):
    # Random bytes given the right magic, version and codec id, checksum repaired.
    p = np.frombuffer(data, dtype=np.uint8).copy()
    p[:4] = [*_wire.MAGIC, _wire.VERSION, _wire.CODEC_IDS[name]]
    _decode_checked(mpicomp.codec(name), _wire.reseal(p), "random bytes")


# -- hostile length fields -------------------------------------------------------------

HUGE_DIMS = [(1 << 40,), ((1 << 40) + 1,), (1 << 32, 1 << 32), (2**64 - 1,), (1 << 20,) * 3]


def _u64(*v):
    return np.array(v, dtype="<u8").view(np.uint8)


def _hostile(name: str):
    """Yield (label, payload) pairs whose length fields promise far more than they hold."""
    small = mpicomp.codec(name).encode(gradient_like(100, seed=1))
    body = small[_wire.header_size(1) :]
    flags = int(small[5])
    for shape in HUGE_DIMS:
        yield f"shape {shape}", _wire.pack(name, shape, body, flags=flags)
    long_len = small.copy()
    struct.pack_into("<I", long_len, 12, 0xFFFFFFFF)
    yield "body length 2^32-1", _wire.reseal(long_len, length=False)
    if name == "topk":
        for k in (2**64 - 1, 2**63, 2**32, 101):
            b = body.copy()
            b[:8] = _u64(k)
            yield f"k={k}", _wire.pack(name, (100,), b)
    if name == "fft":
        for k in (2**64 - 1, 2**32, 52):
            b = body.copy()
            struct.pack_into("<Q", b, 8, k)
            yield f"k={k}", _wire.pack(name, (100,), b)
    if name == "fastsgd":
        for field, offset in (("d", 4), ("key_bytes", 8)):
            b = body.copy()
            struct.pack_into("<I", b, 16 + offset, 0xFFFFFFFF)
            yield f"{field}=2^32-1", _wire.pack(name, (100,), b)
        b = body.copy()
        struct.pack_into("<I", b, 8, 1)  # bucket 1: 2^40 buckets for a 2^40 shape
        yield "bucket=1 for 2^40 elements", _wire.pack(name, (1 << 40,), b)
    if name == "threelc":
        # 243 + 12 expands to 14 bytes: a body that would expand far past its shape.
        b = np.concatenate([body[:4], np.full(4096, 255, np.uint8)])
        yield "zero runs past the shape", _wire.pack(name, (100,), b, flags=1)


# A few bytes that honestly describe a 2^40-element sparse tensor: a sparse format
# allows that, and decode then allocates the dense 4 TiB output (MemoryError).
_SPARSE_HUGE = {
    "topk": lambda: _wire.pack("topk", (1 << 40,), _u64(0)),
    "fastsgd": lambda: _wire.pack(
        "fastsgd",
        (1 << 40,),
        np.concatenate(
            [
                np.array([(1.1, 1 << 29, 127, 2, 0)], dtype=mpicomp.codecs.fastsgd._PREFIX).view(
                    np.uint8
                ),
                np.zeros(13 * 2048, np.uint8),  # 2048 empty buckets of 2^29
            ]
        ),
    ),
}


def _hostile_cases():
    for name in DECODERS:
        for label, payload in _hostile(name):
            yield pytest.param(name, payload, id=f"{name}-{label}")


@pytest.mark.parametrize(("name", "payload"), list(_hostile_cases()))
def test_huge_length_fields_are_refused_without_allocating(name, payload):
    codec = mpicomp.codec(name)
    tracemalloc.start()
    try:
        outcome = _decode_checked(codec, payload, "hostile length")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert outcome == "refused"
    assert peak < PEAK_BYTES, f"decode peaked at {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("bits", [0x7C00, 0xFC00, 0x7E00])
def test_fp16_refuses_inf_and_nan(bits):
    p = _wire.pack("fp16", (2,), np.array([0x3C00, bits], dtype="<u2").view(np.uint8))
    assert _decode_checked(mpicomp.codec("fp16"), p, "hostile length") == "refused"


def test_every_decoder_is_fuzzed():
    # A codec added later with a decode joins the fuzzing by itself; its name must not be lost.
    assert set(DECODERS) >= {"none", "fp16", "topk", "signsgd", "threelc", "fft", "fastsgd"}
    assert all(mpicomp.codec(n).name == n for n in DECODERS)


@pytest.mark.parametrize("name", sorted(_SPARSE_HUGE))
def test_a_sparse_payload_of_a_huge_tensor_is_refused_given_the_expected_size(name):
    # ~40 honest bytes can describe 2^40 elements; a caller that knows the size
    # (CompressedComm does, from its agreement) passes numel= and nothing is allocated.
    payload = _SPARSE_HUGE[name]()
    tracemalloc.start()
    try:
        with pytest.raises(mpicomp.PayloadError, match="expected 1000"):
            mpicomp.codec(name).decode(payload, numel=1000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < PEAK_BYTES
