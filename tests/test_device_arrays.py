"""The host-backed device arrays (tests/_device_arrays.py) refuse and allow what CuPy's do,
so a codec test on them fails on the CPU where the codec would fail on a GPU: host
conversions and NumPy operands are TypeErrors, results stay device arrays, views write
through, hidden host transfers are counted, and the ``cuda-host-backed`` kernels refuse
host pointers while computing what the emulated CUDA sources compute."""

import struct
import zlib

import _device_arrays as D
import numpy as np
import pytest
from _device_arrays import SYNCS, DeviceArray, to_device, to_host, xp

import mpicomp.kernels as K
from mpicomp.kernels.cuda.checksum import DEFINES as CHECKSUM_DEFINES

UNSUPPORTED = "Unsupported type <class 'numpy.ndarray'>"


@pytest.fixture(autouse=True)
def _fresh_counters():
    D.reset_syncs()
    yield
    D.reset_syncs()


@pytest.fixture
def dev():
    return to_device(np.arange(6, dtype=np.float32))


@pytest.fixture(scope="module")
def host_backed():
    D.install()
    return K.backend(D.BACKEND)


# ---------------------------------------------------------------------- host conversions


@pytest.mark.parametrize(
    "convert",
    [
        np.asarray,
        np.array,
        np.ascontiguousarray,
        lambda a: np.asarray(a, dtype=np.float32),
        lambda a: struct.unpack_from("<f", a),
        zlib.adler32,
        zlib.crc32,
        memoryview,
        np.frombuffer,
        lambda a: np.float32(1) + np.zeros(6, np.float32) + np.asarray(a),
    ],
    ids=[
        "asarray",
        "array",
        "ascontiguousarray",
        "asarray-dtype",
        "struct",
        "adler32",
        "crc32",
        "memoryview",
        "frombuffer",
        "asarray-in-expression",
    ],
)
def test_a_device_array_is_not_host_memory(dev, convert):
    with pytest.raises(TypeError):
        convert(dev)
    assert SYNCS == {"get": 0, "implicit": 0, "h2d": 0}


def test_implicit_conversion_gives_cupys_message(dev):
    with pytest.raises(TypeError, match=r"Implicit conversion to a NumPy array is not allowed"):
        np.asarray(dev)


def test_a_device_array_is_not_a_numpy_array_or_an_index(dev):
    assert not isinstance(dev, np.ndarray)
    with pytest.raises(TypeError):
        [1, 2, 3][dev[1]]  # CuPy has no __index__: a device value is no Python index
    with pytest.raises(TypeError):
        range(dev[2])


# ---------------------------------------------------------------------- mixed operands


@pytest.mark.parametrize(
    "mix",
    [
        lambda d, h: d + h,
        lambda d, h: h + d,
        lambda d, h: d * h,
        lambda d, h: h - d,
        lambda d, h: d < h,
        lambda d, h: h == d,
        lambda d, h: d.astype(np.int64) & h.astype(np.int64),
        lambda d, h: np.add(d, h),
        lambda d, h: np.add(h, d),
        lambda d, h: np.maximum(d, h),
        lambda d, h: np.add(d, d, out=h),
        lambda d, h: xp.add(d, h),
        lambda d, h: xp.where(d > 2, d, h),
        lambda d, h: xp.concatenate([d, h]),
        lambda d, h: np.concatenate([d, h]),
    ],
    ids=[
        "dev+np",
        "np+dev",
        "dev*np",
        "np-dev",
        "dev<np",
        "np==dev",
        "dev&np",
        "np.add(dev,np)",
        "np.add(np,dev)",
        "np.maximum",
        "out=np",
        "xp.add",
        "xp.where",
        "xp.concatenate",
        "np.concatenate",
    ],
)
def test_a_numpy_operand_is_refused(dev, mix):
    with pytest.raises(TypeError, match="Unsupported type"):
        mix(dev, np.ones(6, np.float32))
    assert to_host(dev).tolist() == [0, 1, 2, 3, 4, 5]


def test_in_place_with_a_numpy_operand_is_refused_and_leaves_the_array(dev):
    with pytest.raises(TypeError, match=UNSUPPORTED):
        dev += np.ones(6, np.float32)
    assert to_host(dev).tolist() == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize(
    "op,want",
    [
        (lambda d: d + 1, [1, 2, 3, 4, 5, 6]),
        (lambda d: 1 + d, [1, 2, 3, 4, 5, 6]),
        (lambda d: d * np.float32(2), [0, 2, 4, 6, 8, 10]),
        (lambda d: np.float32(2) * d, [0, 2, 4, 6, 8, 10]),
        (lambda d: 10 - d, [10, 9, 8, 7, 6, 5]),
        (lambda d: -d, [0, -1, -2, -3, -4, -5]),
        (lambda d: abs(d - 3), [3, 2, 1, 0, 1, 2]),
        (lambda d: d // 2, [0, 0, 1, 1, 2, 2]),
        (lambda d: d**2, [0, 1, 4, 9, 16, 25]),
        (lambda d: d + d, [0, 2, 4, 6, 8, 10]),
        (lambda d: (d > 2) & (d < 5), [0, 0, 0, 1, 1, 0]),
        (lambda d: ~(d.astype(np.int32)), [-1, -2, -3, -4, -5, -6]),
        (lambda d: np.sqrt(d * d), [0, 1, 2, 3, 4, 5]),
        (lambda d: xp.where(d > 2, d, 0), [0, 0, 0, 3, 4, 5]),
        (lambda d: xp.minimum(d, np.float32(2)), [0, 1, 2, 2, 2, 2]),
    ],
)
def test_device_and_scalar_operands_give_device_arrays(dev, op, want):
    out = op(dev)
    assert isinstance(out, DeviceArray)
    assert to_host(out).tolist() == want
    assert SYNCS == {"get": 0, "implicit": 0, "h2d": 0}


def test_no_floating_point_warnings_as_on_a_gpu():
    # pytest turns warnings into errors here: each line would fail on NumPy's warning.
    big = to_device(np.array([1e300, -1e300, 1.0]))
    narrow = xp.asarray(big, dtype=np.float32)
    assert to_host(narrow).tolist() == [np.inf, -np.inf, 1.0]
    assert to_host(big.astype(np.float32))[0] == np.inf
    cut = to_device(np.zeros(3, np.float32))
    cut[:] = big
    assert to_host(cut)[1] == -np.inf
    assert np.isnan(to_host(xp.zeros(1, np.float32) / 0)[0])


def test_in_place_operators_write_the_array_itself(dev):
    alias = dev
    dev += 1
    dev *= np.float32(2)
    assert dev is alias
    assert to_host(dev).tolist() == [2, 4, 6, 8, 10, 12]


def test_numpy_ufuncs_run_on_the_device(dev):
    finite = np.isfinite(1 / dev)  # no RuntimeWarning: a GPU sets no FP flags
    assert isinstance(finite, DeviceArray) and to_host(finite).tolist() == [False] + [True] * 5
    out = DeviceArray((6,), np.float32)
    assert np.add(dev, dev, out=out) is out
    assert to_host(out).tolist() == [0, 2, 4, 6, 8, 10]
    total = np.add.reduce(dev)
    assert isinstance(total, DeviceArray) and total.shape == ()


# ---------------------------------------------------------------------- results stay on device


@pytest.mark.parametrize(
    "reduce",
    [
        lambda d: d.sum(),
        lambda d: d.min(),
        lambda d: d.max(),
        lambda d: d.any(),
        lambda d: d.all(),
        lambda d: d.mean(),
        lambda d: d.argmax(),
        lambda d: d.argmin(),
        lambda d: np.sum(d),
        lambda d: np.max(d),
        lambda d: xp.sum(d),
        lambda d: xp.count_nonzero(d),
        lambda d: d[3],
        lambda d: d.reshape(2, 3)[1, 2],
    ],
    ids=[
        "sum",
        "min",
        "max",
        "any",
        "all",
        "mean",
        "argmax",
        "argmin",
        "np.sum",
        "np.max",
        "xp.sum",
        "count_nonzero",
        "d[3]",
        "d[1,2]",
    ],
)
def test_reductions_and_integer_indices_give_0d_device_arrays(dev, reduce):
    out = reduce(dev)
    assert isinstance(out, DeviceArray) and out.shape == () and out.ndim == 0
    assert SYNCS == {"get": 0, "implicit": 0, "h2d": 0}


def test_other_results_stay_device_arrays(dev):
    assert all(isinstance(i, DeviceArray) for i in (dev > 2).nonzero())
    assert to_host((dev > 2).nonzero()[0]).tolist() == [3, 4, 5]
    assert isinstance(dev.cumsum(), DeviceArray)
    assert isinstance(xp.fft.rfft(dev), DeviceArray)
    with pytest.raises(TypeError, match=UNSUPPORTED):
        xp.fft.rfft(np.ones(6, np.float32))


# ---------------------------------------------------------------------- host transfers


def test_scalar_conversions_are_counted_implicit_syncs(dev):
    assert int(dev.sum()) == 15
    assert SYNCS == {"get": 0, "implicit": 1, "h2d": 0}
    assert float(dev[2]) == 2.0 and bool(dev[1]) and dev[4].item() == 4.0
    assert f"{dev[5]:.1f}" == "5.0"
    assert SYNCS["implicit"] == 5
    assert dev.tolist() == [0, 1, 2, 3, 4, 5] and dev.tobytes() == to_host(dev).tobytes()
    assert bytes(dev) == to_host(dev).tobytes()  # CuPy's __bytes__ copies to the host
    assert SYNCS == {"get": 0, "implicit": 8, "h2d": 0}


def test_conversions_refuse_arrays_of_more_than_one_value(dev):
    with pytest.raises(TypeError):
        int(dev)
    with pytest.raises(ValueError):
        bool(dev)


def test_get_and_asnumpy_are_counted_gets(dev):
    got = dev.get()
    assert isinstance(got, np.ndarray) and got.tolist() == [0, 1, 2, 3, 4, 5]
    got[0] = 99  # a copy
    assert xp.asnumpy(dev)[0] == 0
    assert SYNCS == {"get": 2, "implicit": 0, "h2d": 0}


def test_iteration_yields_device_values_without_a_sync(dev):
    items = list(dev)
    assert all(isinstance(i, DeviceArray) and i.shape == () for i in items)
    assert SYNCS["implicit"] == 0
    assert [int(i) for i in items] == [0, 1, 2, 3, 4, 5]
    assert SYNCS["implicit"] == 6


def test_the_test_helpers_copy_and_count_nothing():
    host = np.arange(4, dtype=np.int32)
    d = to_device(host)
    host[0] = 7
    back = to_host(d)
    back[1] = 7
    assert to_host(d).tolist() == [0, 1, 2, 3]
    assert SYNCS == {"get": 0, "implicit": 0, "h2d": 0}


def test_asarray_copies_host_data_to_the_device_and_keeps_device_arrays(dev):
    host = np.arange(3, dtype=np.int64)
    d = xp.asarray(host)
    host[0] = 9
    assert isinstance(d, DeviceArray) and to_host(d).tolist() == [0, 1, 2]
    assert SYNCS == {"get": 0, "implicit": 0, "h2d": 1}
    assert xp.asarray(dev) is dev and xp.ascontiguousarray(dev) is dev
    assert xp.asarray(dev, dtype=np.float64).dtype == np.float64
    with pytest.raises(TypeError, match="incorrect type"):
        xp.ascontiguousarray(host)  # CuPy's takes device arrays only


# ---------------------------------------------------------------------- views and indexing


def test_slices_and_integer_indices_are_views_that_write_through(dev):
    part = dev[1:4]
    part[0] = 10
    part[1:] = dev[4:]
    one = dev[5]
    one[...] = 50
    assert to_host(dev).tolist() == [0, 10, 4, 5, 4, 50]
    assert part.base is dev and one.base is dev and not part.flags.owndata
    assert dev.base is None and dev.flags.owndata


def test_view_reshape_ravel_and_transpose_share_memory(dev):
    words = dev.view(np.uint32)
    grid = dev.reshape(2, 3)
    grid.T[2, 1] = 7
    assert to_host(dev)[5] == 7 and to_host(words)[5] == np.float32(7).view(np.uint32)
    assert words.base is dev and grid.base is dev and grid.ravel().base is dev
    assert dev.copy().base is None and dev.flatten().base is None
    assert dev.astype(np.float32, copy=False) is dev


def test_host_and_device_index_arrays_are_accepted(dev):
    assert to_host(dev[np.array([0, 2])]).tolist() == [0, 2]
    assert to_host(dev[[1, 3]]).tolist() == [1, 3]
    assert SYNCS["h2d"] == 2  # CuPy copies host indices to the device
    assert to_host(dev[to_device(np.array([5, 4]))]).tolist() == [5, 4]
    assert to_host(dev[dev > 3]).tolist() == [4, 5]
    assert SYNCS["h2d"] == 2
    picked = dev[np.array([0, 1])]
    picked[0] = 100  # advanced indexing copies
    assert to_host(dev)[0] == 0


def test_setitem_takes_device_arrays_scalars_and_host_arrays_where_cupy_does(dev):
    dev[0] = np.float32(9)
    dev[1:3] = to_device(np.array([7, 8], np.float32))
    dev[3] = np.array(6.0)  # a 0-d host array is a scalar to CuPy's fill
    assert SYNCS["h2d"] == 0
    host = np.array([1, 2], np.float32)
    dev[np.array([4, 5])] = host  # advanced assignment copies host values over
    host[:] = 0
    assert to_host(dev).tolist() == [9, 7, 8, 6, 1, 2]
    assert SYNCS["h2d"] == 2  # the index and the values
    dev.set(np.zeros(6, np.float32))
    assert to_host(dev).tolist() == [0] * 6 and SYNCS["h2d"] == 3


@pytest.mark.parametrize("key", [slice(None), slice(1, 3), Ellipsis], ids=["[:]", "[1:3]", "[...]"])
def test_setitem_of_a_slice_refuses_a_host_array(dev, key):
    # CuPy fills a basic-index view with a scalar; a host array there is its ValueError.
    with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
        dev[key] = np.ones(6, np.float32)[key]
    with pytest.raises(TypeError, match="Unsupported type"):
        dev[key] = [1.0] * 6
    assert to_host(dev).tolist() == [0, 1, 2, 3, 4, 5]


def test_flags_are_cupys(dev):
    assert dev.flags.c_contiguous and dev.flags["C_CONTIGUOUS"]
    assert not dev[::2].flags.c_contiguous
    assert not hasattr(dev.flags, "writeable")  # device memory has no read-only flag
    with pytest.raises(AttributeError):
        dev.flags.writeable = False
    assert dev.device.id == 0 and dev.nbytes == 24 and dev.itemsize == 4
    assert dev[1:].data.ptr - dev.data.ptr == 4  # launchers check alignment by it


def test_numpy_functions_dispatch_to_the_array_module(dev):
    both = np.concatenate([dev, dev])
    assert isinstance(both, DeviceArray) and both.shape == (12,)
    assert isinstance(np.where(dev > 1, dev, 0), DeviceArray)
    if D._cupy_names("") is None:
        pytest.skip("CuPy cannot be imported here: NumPy's names stand for CuPy's")
    # np.insert has no CuPy twin: NumPy names the function it could not run
    with pytest.raises(TypeError, match="insert"):
        np.insert(dev, 0, 1)
    assert not hasattr(xp, "insert")


# ---------------------------------------------------------------------- the kernel backend


def test_install_registers_the_backend_and_the_array_type(host_backed):
    D.install()  # again: the same record
    assert K.backend(D.BACKEND) is host_backed
    assert host_backed.name == D.BACKEND and host_backed.xp is xp
    assert K.backend_of(to_device(np.zeros(3, np.float32))) is host_backed
    assert K.backend_of(np.zeros(3, np.float32)) is not host_backed
    emulated = K.backend("cuda-emulated")
    for fam in K.FAMILIES:
        assert sorted(K.launchers(host_backed, fam)) == sorted(K.launchers(emulated, fam))


def test_a_launcher_computes_on_device_arrays(host_backed):
    data = np.random.default_rng(3).integers(0, 256, 1001, dtype=np.uint8)
    src = to_device(data)
    assert host_backed.checksum.adler32(src, 1) == zlib.adler32(data.tobytes())
    assert SYNCS == {"get": 1, "implicit": 0, "h2d": 0}  # the launcher's one, counted
    dst = DeviceArray((1001,), np.uint8)
    assert host_backed.checksum.adler32(src, 7, dst) == zlib.adler32(data.tobytes(), 7)
    assert to_host(dst).tobytes() == data.tobytes()


def test_a_launcher_refuses_host_arrays(host_backed):
    data = np.arange(64, dtype=np.uint8)
    with pytest.raises(TypeError):
        host_backed.checksum.adler32(data, 1)
    with pytest.raises(TypeError, match="argument 1 is a NumPy array: a GPU kernel cannot"):
        host_backed.checksum.adler32(to_device(data), 1, np.empty(64, np.uint8))


def test_a_kernel_refuses_a_host_pointer_and_takes_device_views(host_backed):
    dev = host_backed.device
    kernel = dev.kernel("checksum", "mpicomp_checksum_adler32", CHECKSUM_DEFINES)
    src = to_device(np.arange(100, dtype=np.uint8))
    partials = xp.zeros(2, np.uint64)
    args = (src[10:], src[10:], np.int32(0), np.int64(90), partials)
    with pytest.raises(TypeError, match="argument 4 is a NumPy array"):
        kernel((1,), (dev.threads,), (*args[:4], np.zeros(2, np.uint64)))
    kernel((1,), (dev.threads,), args)
    s1 = int(to_host(partials)[0])
    assert s1 == sum(range(10, 100)) % 65521
