"""Host-backed stand-ins for CuPy arrays, so the codecs' device path is tested without a GPU.

On the ``cuda-emulated`` backend the CUDA sources compute on NumPy arrays, so code that
treats a device array as a host one (``np.asarray``, ``struct.unpack_from``, ``zlib`` on it,
a NumPy operand in arithmetic with a device array, a host array passed to a kernel) passes
on the CPU and fails on a GPU. ``DeviceArray`` keeps its data in a private NumPy array and
refuses what ``cupy.ndarray`` (CuPy 14) refuses; ``xp`` stands for the ``cupy`` module;
``install()`` registers the ``cuda-host-backed`` kernel backend, the CUDA sources built by
the emulation behind kernels that refuse host pointers. Allowed but hidden device-to-host
transfers (``int(a)``, ``a.item()``, iteration's conversions, ...) are counted in ``SYNCS``
so a test can assert that a codec made none.

Several GPUs are simulated: an array is on the GPU that was current in its thread when it
was made (``gpu(i)`` works as ``cupy.cuda.Device(i)``: ``with gpu(1): ...``), and kernels
and operations refuse an array of another GPU than the current one, as CuPy does where
GPUs have no peer access.
"""

from __future__ import annotations

import functools
import importlib
import threading
import warnings
from types import ModuleType

import numpy as np

__all__ = [
    "BACKEND",
    "SYNCS",
    "DeviceArray",
    "count_pinned",
    "current_gpu",
    "device_record",
    "gpu",
    "install",
    "reset_syncs",
    "to_device",
    "to_host",
    "xp",
]

#: The name the host-backed backend is registered under.
BACKEND = "cuda-host-backed"

#: Host transfers made through the arrays: ``get`` (``.get()``, ``xp.asnumpy``),
#: ``implicit`` (conversions CuPy allows but that copy device to host behind the caller's
#: back: ``int``, ``float``, ``bool``, ``item``, ``tolist``, ``tobytes``, ``bytes``,
#: ``format``) and ``h2d`` (host data copied to the device).
SYNCS = {"get": 0, "implicit": 0, "h2d": 0}

# What CuPy takes as a scalar operand (its kernels' scalar types).
_SCALARS = (bool, int, float, complex, np.generic)
# A GPU sets no floating-point status: CuPy never warns (nor raises under np.errstate) on
# division by zero, overflow or invalid values, so the host computation must not either.
_quiet = functools.partial(np.errstate, all="ignore")
# The comparisons for which CuPy's __array_ufunc__ turns a 0-d NumPy array into a scalar.
_COMPARISONS = frozenset(["greater", "greater_equal", "less", "less_equal", "equal", "not_equal"])


def reset_syncs() -> None:
    """Zero every counter of ``SYNCS``."""
    for key in SYNCS:
        SYNCS[key] = 0


def _unsupported(x) -> TypeError:
    # CuPy's own words when a kernel argument is neither a device array nor a scalar.
    return TypeError(f"Unsupported type {type(x)}")


class _Flags:
    """``cupy.ndarray.flags``: read-only, and without ``writeable`` (device memory always is)."""

    __slots__ = ("_array",)

    def __init__(self, array: DeviceArray):
        self._array = array

    @property
    def c_contiguous(self) -> bool:
        return bool(self._array._host.flags.c_contiguous)

    @property
    def f_contiguous(self) -> bool:
        return bool(self._array._host.flags.f_contiguous)

    @property
    def owndata(self) -> bool:
        return self._array.base is None

    def __getitem__(self, key: str) -> bool:
        if key not in ("C_CONTIGUOUS", "F_CONTIGUOUS", "OWNDATA"):
            raise KeyError(f"{key} is not defined for cupy.ndarray.flags")
        return getattr(self, key.lower())

    def __repr__(self) -> str:
        return (
            f"  C_CONTIGUOUS : {self.c_contiguous}\n  F_CONTIGUOUS : {self.f_contiguous}\n"
            f"  OWNDATA : {self.owndata}"
        )


# The GPU new arrays are allocated on and launches go to, per thread (as CuPy's current
# device): tests simulate several GPUs with it (``gpu``).
_current = threading.local()


def current_gpu() -> int:
    """Return the id of this thread's current (simulated) GPU: 0 unless changed."""
    return getattr(_current, "id", 0)


def _check_device(a: DeviceArray) -> None:
    # CuPy's own words, for a kernel given an array of a GPU that is not the current one.
    if a._gpu != current_gpu():
        raise ValueError(
            "Array device must be same as the current device: "
            f"array device = {a._gpu} while current = {current_gpu()}"
        )


class _Device:
    """``cupy.cuda.Device(id)``: a context manager that makes GPU ``id`` current."""

    def __init__(self, id: int = 0):
        self.id = int(id)
        self._before: list[int] = []

    def __enter__(self) -> _Device:
        self._before.append(current_gpu())
        _current.id = self.id
        return self

    def __exit__(self, *exc) -> None:
        _current.id = self._before.pop()

    def use(self) -> None:
        _current.id = self.id

    def synchronize(self) -> None:
        return None

    def __eq__(self, other) -> bool:
        return isinstance(other, _Device) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("cuda", self.id))

    def __repr__(self) -> str:
        return f"<CUDA Device {self.id}>"


gpu = _Device


class _MemoryPointer:
    """``cupy.ndarray.data``: ``ptr`` is the first element's address (host memory here, so
    alignment checks see what they would on a GPU)."""

    __slots__ = ("device", "ptr")

    def __init__(self, ptr: int, gpu: int):
        self.ptr = ptr
        self.device = _Device(gpu)

    def __int__(self) -> int:
        return self.ptr


class DeviceArray:
    """A ``cupy.ndarray`` look-alike over a private NumPy array (not a subclass of it).

    ``DeviceArray(shape, dtype)`` allocates like ``cupy.ndarray(shape, dtype)``; tests make
    one from host data with ``to_device``.
    """

    # NumPy defers to __array_ufunc__ (defined below) for mixed operands; the priority is
    # what CuPy reports, for code that compares priorities.
    __array_priority__ = 100

    def __init__(self, shape, dtype=float, memptr=None, strides=None, order="C"):
        if memptr is not None or strides is not None:
            raise NotImplementedError("DeviceArray(memptr=, strides=) is not emulated")
        self._host = np.empty(shape, dtype, order=order)
        self._gpu = current_gpu()
        self.base: DeviceArray | None = None

    @classmethod
    def _wrap(cls, host: np.ndarray, base: DeviceArray | None = None) -> DeviceArray:
        """Return a DeviceArray over ``host`` (no copy); ``base``: the array it views (and
        whose GPU it is on; a new array is on the current GPU)."""
        a = object.__new__(cls)
        a._host = host
        a._gpu = current_gpu() if base is None else base._gpu
        a.base = None if base is None else (base.base if base.base is not None else base)
        return a

    # ------------------------------------------------------------------ attributes
    dtype = property(lambda self: self._host.dtype)
    shape = property(lambda self: self._host.shape)
    ndim = property(lambda self: self._host.ndim)
    size = property(lambda self: self._host.size)
    nbytes = property(lambda self: self._host.nbytes)
    itemsize = property(lambda self: self._host.itemsize)
    strides = property(lambda self: self._host.strides)
    flags = property(lambda self: _Flags(self))
    device = property(lambda self: _Device(self._gpu))
    data = property(lambda self: _MemoryPointer(self._host.ctypes.data, self._gpu))

    @property
    def T(self) -> DeviceArray:
        return _from_host(self._host.T, [self])

    @property
    def real(self) -> DeviceArray:
        return _from_host(self._host.real, [self])

    @property
    def imag(self) -> DeviceArray:
        return _from_host(self._host.imag, [self])

    @property
    def __cuda_array_interface__(self) -> dict:
        # How mpi4py reads a device buffer (a CUDA-aware MPI gets this pointer: host memory).
        return cuda_array_interface(self._host)

    # ------------------------------------------------------------------ refusals
    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. "
            "Please use `.get()` to construct a NumPy array explicitly."
        )

    # No __dlpack__: a CUDA capsule cannot be made without a GPU. MPI (mpi4py) reads these
    # arrays through __cuda_array_interface__, whose pointer is host memory here, as
    # mpi4py's own tests of GPU buffers do; np.from_dlpack refuses them, as CuPy's.

    # ------------------------------------------------------------------ host transfers
    def get(self, stream=None, order="C", out=None, blocking=True) -> np.ndarray:
        """Return a NumPy copy (counted in ``SYNCS["get"]``)."""
        SYNCS["get"] += 1
        if out is None:
            return np.array(self._host, order=order, copy=True)
        if not isinstance(out, np.ndarray):
            raise TypeError("Only numpy.ndarray can be obtained from cupy.ndarray")
        if out.dtype != self.dtype:
            raise TypeError(f"{out.dtype} array cannot be obtained from {self.dtype} array")
        if out.shape != self.shape:
            raise ValueError(
                f"Shape mismatch. Expected shape: {self.shape}, actual shape: {out.shape}"
            )
        np.copyto(out, self._host)
        return out

    def set(self, arr, stream=None) -> None:
        """Copy the NumPy array ``arr`` (same shape and dtype) in (counted in ``h2d``)."""
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype:
            raise TypeError(f"{arr.dtype} array cannot be set to {self.dtype} array")
        if arr.shape != self.shape:
            raise ValueError(f"Shape mismatch. Old shape: {self.shape}, new shape: {arr.shape}")
        SYNCS["h2d"] += 1
        np.copyto(self._host, arr)

    def _implicit(self) -> np.ndarray:
        SYNCS["implicit"] += 1
        return self._host

    def __int__(self) -> int:
        return int(self._implicit())

    def __float__(self) -> float:
        return float(self._implicit())

    def __complex__(self) -> complex:
        return complex(self._implicit())

    def __bool__(self) -> bool:
        return bool(self._implicit())

    def __bytes__(self) -> bytes:
        return np.ascontiguousarray(self._implicit()).tobytes()

    def __format__(self, spec: str) -> str:
        return format(self._implicit(), spec)

    def item(self):
        return self._implicit().item()

    def tolist(self):
        return self._implicit().tolist()

    def tobytes(self, order="C") -> bytes:
        return self._implicit().tobytes(order)

    # CuPy prints through a host copy too; not counted: reprs are for people and failures.
    def __repr__(self) -> str:
        return f"DeviceArray({self._host!r})"

    def __str__(self) -> str:
        return str(self._host)

    # ------------------------------------------------------------------ container
    def __len__(self) -> int:
        if self._host.ndim == 0:
            raise TypeError("len() of unsized object")
        return len(self._host)

    def __iter__(self):
        # Yields device arrays: no transfer until a yielded value is converted.
        if self._host.ndim == 0:
            raise TypeError("iteration over a 0-d array")
        return (self[i] for i in range(len(self._host)))

    def __getitem__(self, key):
        key, advanced = _index(key)
        return _from_host(self._host[key], [self])

    def __setitem__(self, key, value) -> None:
        with _quiet():
            self._assign(key, value)

    def _assign(self, key, value) -> None:
        key, advanced = _index(key)
        _check_device(self)
        if isinstance(value, DeviceArray):
            _check_device(value)
            self._host[key] = value._host
        elif isinstance(value, _SCALARS):
            self._host[key] = value
        elif advanced:
            # CuPy copies the values of an advanced-index assignment to the device.
            SYNCS["h2d"] += 1
            self._host[key] = np.asarray(value)
        else:
            # Basic indexing fills the view with a scalar: CuPy's ``fill`` takes no host array.
            view = self[key]
            view.fill(value)

    def fill(self, value) -> None:
        if isinstance(value, np.ndarray):
            if value.shape != ():
                raise ValueError("non-scalar numpy.ndarray cannot be used for fill")
            value = value.item()
        elif isinstance(value, DeviceArray):
            value = value._host
        elif not isinstance(value, _SCALARS):
            raise _unsupported(value)
        with _quiet():
            self._host[...] = value

    # ------------------------------------------------------------------ methods
    def astype(self, dtype, order="K", casting=None, subok=None, copy=True) -> DeviceArray:
        _check_device(self)
        extra = {} if casting is None else {"casting": casting}
        with _quiet():
            out = self._host.astype(dtype, order=order, copy=copy, **extra)
        return self if out is self._host else DeviceArray._wrap(out)

    def copy(self, order="C") -> DeviceArray:
        _check_device(self)
        return DeviceArray._wrap(self._host.copy(order=order))

    def __copy__(self) -> DeviceArray:
        return self.copy()

    def __deepcopy__(self, memo) -> DeviceArray:
        return self.copy()

    # ------------------------------------------------------------------ NumPy protocols
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return _apply_ufunc(ufunc, method, inputs, kwargs, strict=False)

    def __array_function__(self, func, types, args, kwargs):
        # As CuPy: run the same-named function of the array module, else NumPy says which
        # function has no implementation.
        if not all(issubclass(t, (DeviceArray, np.ndarray)) for t in types):
            return NotImplemented
        module = xp
        for part in func.__module__.split(".")[1:]:
            module = getattr(module, part, None)
            if module is None:
                return NotImplemented
        impl = getattr(module, func.__name__, None)
        if impl is None:
            return NotImplemented
        return impl(*args, **kwargs)


def cuda_array_interface(host: np.ndarray) -> dict:
    """Return the ``__cuda_array_interface__`` (version 3) of the memory of ``host``."""
    return {
        "shape": host.shape,
        "typestr": host.dtype.str,
        "data": (host.ctypes.data, False),
        "strides": None if host.flags.c_contiguous else host.strides,
        "version": 3,
    }


def _forward_method(name: str):
    """Return a DeviceArray method running NumPy's ``name`` on the wrapped array."""

    def method(self, *args, **kwargs):
        views = [self]
        args, kwargs = _to_host(args, views), _to_host(kwargs, views)
        with _quiet():
            return _from_host(getattr(self._host, name)(*args, **kwargs), views)

    method.__name__ = method.__qualname__ = name
    return method


# Methods whose results (arrays, 0-d arrays for reductions, views where NumPy's are) come
# straight from NumPy's; argument arrays must be device arrays.
for _name in (
    "reshape ravel view flatten squeeze swapaxes transpose diagonal repeat take put "
    "sum prod min max any all mean var std cumsum cumprod argmax argmin clip round "
    "dot conj conjugate sort argsort partition argpartition nonzero searchsorted "
    "compress choose trace"
).split():
    setattr(DeviceArray, _name, _forward_method(_name))


def _operators() -> None:
    """Give DeviceArray CuPy's operators: ufuncs whose operands are device arrays or
    scalars; a NumPy array (either side) is refused as CuPy refuses it."""

    def binary(uf):
        def op(self, other):
            return _apply_ufunc(uf, "__call__", (self, other), {}, strict=True)

        def rop(self, other):
            return _apply_ufunc(uf, "__call__", (other, self), {}, strict=True)

        def iop(self, other):
            _apply_ufunc(uf, "__call__", (self, other), {"out": (self,)}, strict=True)
            return self

        return op, rop, iop

    arithmetic = {
        "add": np.add,
        "sub": np.subtract,
        "mul": np.multiply,
        "truediv": np.true_divide,
        "floordiv": np.floor_divide,
        "mod": np.remainder,
        "pow": np.power,
        "matmul": np.matmul,
        "lshift": np.left_shift,
        "rshift": np.right_shift,
        "and": np.bitwise_and,
        "or": np.bitwise_or,
        "xor": np.bitwise_xor,
    }
    for name, uf in arithmetic.items():
        op, rop, iop = binary(uf)
        setattr(DeviceArray, f"__{name}__", op)
        setattr(DeviceArray, f"__r{name}__", rop)
        setattr(DeviceArray, f"__i{name}__", iop)
    op, rop, _ = binary(np.divmod)
    DeviceArray.__divmod__, DeviceArray.__rdivmod__ = op, rop
    comparisons = {"lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal}
    for name, uf in comparisons.items():
        setattr(DeviceArray, f"__{name}__", binary(uf)[0])

    def equality(uf):
        def op(self, other):
            # An object that is no operand at all compares by identity, as Python's default.
            if not isinstance(other, (DeviceArray, np.ndarray, *_SCALARS)):
                return NotImplemented
            return _apply_ufunc(uf, "__call__", (self, other), {}, strict=True)

        return op

    DeviceArray.__eq__ = equality(np.equal)
    DeviceArray.__ne__ = equality(np.not_equal)
    DeviceArray.__hash__ = None  # as cupy.ndarray: mutable, compared elementwise

    def unary(uf):
        def op(self):
            return _apply_ufunc(uf, "__call__", (self,), {}, strict=True)

        return op

    unaries = {"neg": np.negative, "pos": np.positive, "abs": np.absolute, "invert": np.invert}
    for name, uf in unaries.items():
        setattr(DeviceArray, f"__{name}__", unary(uf))


# ---------------------------------------------------------------------- conversions


def _index(key):
    """Return ``(key for the wrapped array, advanced?)``; host index arrays and lists
    are copied to the device as CuPy does (counted in ``h2d``)."""
    parts = list(key) if isinstance(key, tuple) else [key]
    advanced = host = False
    for i, k in enumerate(parts):
        if k is None or k is Ellipsis or isinstance(k, slice):
            continue
        if isinstance(k, DeviceArray):
            parts[i], advanced = k._host, True
        elif isinstance(k, (np.ndarray, list, tuple)) or isinstance(k, (bool, np.bool_)):
            parts[i], advanced, host = np.asarray(k), True, True
            if isinstance(k, (list, tuple)) and parts[i].size == 0:
                parts[i] = parts[i].astype(np.int32)  # an empty list picks nothing
        elif not isinstance(k, (int, np.integer)):
            raise IndexError(
                "only integers, slices (`:`), ellipsis (`...`), numpy.newaxis (`None`) "
                f"and integer or boolean arrays are valid indices, got {type(k).__name__}"
            )
    if host:
        SYNCS["h2d"] += 1
    if not advanced and Ellipsis not in parts:
        # Integer indices give a 0-d view in CuPy, not a copied scalar: a trailing
        # Ellipsis makes NumPy do the same.
        parts.append(Ellipsis)
    return tuple(parts), advanced


def _to_host(obj, views: list):
    """Return ``obj`` with device arrays replaced by their wrapped arrays (noted in
    ``views``), through lists, tuples and dicts; a NumPy array is refused."""
    if isinstance(obj, DeviceArray):
        _check_device(obj)
        views.append(obj)
        return obj._host
    if isinstance(obj, np.ndarray):
        raise _unsupported(obj)
    if isinstance(obj, (list, tuple)):
        items = [_to_host(x, views) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    if isinstance(obj, dict):
        return {k: _to_host(v, views) for k, v in obj.items()}
    return obj


def _from_host(obj, views: list):
    """Return ``obj`` with NumPy arrays wrapped as device arrays (views of the inputs
    they share memory with) and NumPy scalars as 0-d device arrays, as CuPy returns them."""
    if isinstance(obj, np.ndarray):
        for v in views:
            if obj is v._host:
                return v
        base = next((v for v in views if np.may_share_memory(obj, v._host)), None)
        return DeviceArray._wrap(obj, base)
    if isinstance(obj, np.generic):
        return DeviceArray._wrap(np.asarray(obj))
    if isinstance(obj, (list, tuple)):
        items = [_from_host(x, views) for x in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _apply_ufunc(ufunc, method: str, inputs, kwargs: dict, *, strict: bool):
    """Run ``ufunc.method`` on the wrapped arrays and wrap what it returns.

    ``strict``: refuse an operand that is neither a device array nor a scalar (CuPy's ufuncs
    and operators); else return NotImplemented for it (CuPy's ``__array_ufunc__``, so
    NumPy raises). A NumPy array is refused either way.
    """
    if method not in ("__call__", "reduce", "accumulate", "reduceat", "outer", "at"):
        return NotImplemented
    views: list = []
    hosts = []
    for i, x in enumerate(inputs):
        if method == "at" and i == 1:
            hosts.append(_index(x)[0])  # the indices, host ones copied like __getitem__'s
        elif isinstance(x, DeviceArray):
            views.append(x)
            hosts.append(x._host)
        elif isinstance(x, np.ndarray):
            if not strict and x.ndim == 0 and ufunc.__name__ in _COMPARISONS:
                hosts.append(x.item())  # CuPy's workaround of numpy/numpy#12142
            else:
                raise _unsupported(x)
        elif isinstance(x, _SCALARS):
            hosts.append(x)
        elif strict:
            raise _unsupported(x)
        else:
            return NotImplemented
    kwargs = dict(kwargs)
    outs = kwargs.get("out")
    if outs is not None:
        outs = outs if isinstance(outs, tuple) else (outs,)
        for o in outs:
            if o is not None and not isinstance(o, DeviceArray):
                raise _unsupported(o)
        kwargs["out"] = tuple(None if o is None else o._host for o in outs)
    if isinstance(kwargs.get("where"), (DeviceArray, np.ndarray)):
        kwargs["where"] = _to_host(kwargs["where"], views)
    with _quiet():
        result = getattr(ufunc, method)(*hosts, **kwargs)
    if outs is not None:
        return outs[0] if len(outs) == 1 else outs
    return _from_host(result, views)


_operators()


# ---------------------------------------------------------------------- the array module


@functools.cache
def _cupy_names(path: str) -> frozenset | None:
    """Return the names of ``cupy.<path>`` (None when CuPy cannot be imported here), so
    a NumPy function CuPy lacks is refused as on a GPU."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module("cupy" + (f".{path}" if path else ""))
    except Exception:  # no CuPy (or a broken one): only NumPy's names are checked
        return None
    return frozenset(dir(module))


class _Ufunc:
    """A NumPy ufunc as CuPy's: device arrays and scalars in, device arrays out."""

    def __init__(self, ufunc: np.ufunc):
        self._ufunc = ufunc
        self.__name__ = ufunc.__name__
        self.__doc__ = ufunc.__doc__

    def __call__(self, *inputs, **kwargs):
        return _apply_ufunc(self._ufunc, "__call__", inputs, kwargs, strict=True)

    def __getattr__(self, name: str):
        if name in ("reduce", "accumulate", "reduceat", "outer", "at"):
            return functools.partial(self._method, name)
        return getattr(self._ufunc, name)

    def _method(self, name: str, *inputs, **kwargs):
        return _apply_ufunc(self._ufunc, name, inputs, kwargs, strict=True)

    def __repr__(self) -> str:
        return f"<ufunc {self.__name__!r} (host-backed)>"


def _function(func):
    """Wrap NumPy function ``func``: device arrays in (NumPy arrays refused), device arrays
    out; Python values it returns (dtypes, shapes, bools) pass through."""

    @functools.wraps(func)
    def call(*args, **kwargs):
        views: list = []
        args, kwargs = _to_host(args, views), _to_host(kwargs, views)
        with _quiet():
            return _from_host(func(*args, **kwargs), views)

    return call


class _ArrayModule:
    """The ``cupy`` module (or one of its submodules, ``path``), over NumPy's functions."""

    def __init__(self, module: ModuleType, path: str = "", **explicit):
        self._module = module
        self._path = path
        self.__dict__.update(explicit)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        where = "cupy" + (f".{self._path}" if self._path else "")
        names = _cupy_names(self._path)
        if not hasattr(self._module, name) or (names is not None and name not in names):
            raise AttributeError(f"module {where!r} has no attribute {name!r}")
        obj = getattr(self._module, name)
        if isinstance(obj, type):  # dtypes, finfo, iinfo: the same classes in CuPy
            wrapped = obj
        elif isinstance(obj, np.ufunc):
            wrapped = _Ufunc(obj)
        elif isinstance(obj, ModuleType):
            wrapped = _ArrayModule(obj, f"{self._path}.{name}".lstrip("."))
        elif callable(obj):
            wrapped = _function(obj)
        else:
            wrapped = obj  # constants: pi, nan, newaxis
        setattr(self, name, wrapped)  # once per name
        return wrapped

    def __repr__(self) -> str:
        return f"<host-backed {'cupy' + ('.' + self._path if self._path else '')}>"


def _host_data(obj) -> tuple[object, bool]:
    """Return ``(obj with device arrays unwrapped, whether host data was in it)``."""
    if isinstance(obj, DeviceArray):
        return obj._host, False
    if isinstance(obj, (list, tuple)):
        pairs = [_host_data(x) for x in obj]
        return [p[0] for p in pairs], any(p[1] for p in pairs) or not pairs
    return obj, True


def array(obj, dtype=None, copy=True, order="K", subok=False, ndmin=0) -> DeviceArray:
    """``cupy.array``: a device copy of a device array, or of host data (counted in ``h2d``)."""
    if isinstance(obj, DeviceArray):
        with _quiet():
            out = np.array(obj._host, dtype=dtype, copy=copy, order=order, ndmin=ndmin)
        return obj if out is obj._host else DeviceArray._wrap(out)
    data, host = _host_data(obj)
    if host:
        SYNCS["h2d"] += 1
    with _quiet():
        return DeviceArray._wrap(np.array(data, dtype=dtype, order=order, ndmin=ndmin))


def asarray(a, dtype=None, order=None, *, copy=None) -> DeviceArray:
    """``cupy.asarray``: a device array as it is when dtype and order fit, else a copy."""
    if isinstance(a, DeviceArray):
        with _quiet():
            out = np.asarray(a._host, dtype=dtype, order=order, copy=copy)
        return a if out is a._host else DeviceArray._wrap(out)
    return array(a, dtype=dtype, order=order or "K")


def ascontiguousarray(a, dtype=None) -> DeviceArray:
    """``cupy.ascontiguousarray``: takes device arrays only (a host one is a TypeError)."""
    if not isinstance(a, DeviceArray):
        raise TypeError(
            "Argument 'a' has incorrect type (expected cupy._core.core._ndarray_base, "
            f"got {type(a).__module__}.{type(a).__name__})"
        )
    with _quiet():
        out = np.ascontiguousarray(a._host, dtype=dtype)
    return a if out is a._host else DeviceArray._wrap(out)


def asnumpy(a, stream=None, order="C", out=None, *, blocking=True) -> np.ndarray:
    """``cupy.asnumpy``: a device array through ``get`` (counted), anything else as NumPy's."""
    if isinstance(a, DeviceArray):
        return a.get(stream, order, out)
    return np.asarray(a, order=order)


def frombuffer(*args, **kwargs) -> DeviceArray:
    """``cupy.frombuffer``: a host buffer copied to the device (counted in ``h2d``)."""
    SYNCS["h2d"] += 1
    return DeviceArray._wrap(np.frombuffer(*args, **kwargs).copy())


def count_nonzero(a, axis=None) -> DeviceArray:
    """``cupy.count_nonzero``: a device array even for the whole array (NumPy's is an int)."""
    views: list = []
    out = np.count_nonzero(_to_host(a, views), axis=axis)
    return _from_host(np.asarray(out, dtype=np.intp) if np.isscalar(out) else out, views)


def get_array_module(*args):
    """``cupy.get_array_module``: this module if any argument is a device array, else NumPy."""
    return xp if any(isinstance(a, DeviceArray) for a in args) else np


#: The ``cupy`` module of host-backed arrays. Functions not defined above are NumPy's,
#: wrapped (``_function``), and only those CuPy has where CuPy can be imported.
xp = _ArrayModule(
    np,
    ndarray=DeviceArray,
    array=array,
    asarray=asarray,
    ascontiguousarray=ascontiguousarray,
    asnumpy=asnumpy,
    frombuffer=frombuffer,
    count_nonzero=count_nonzero,
    get_array_module=get_array_module,
)
xp.fft = _ArrayModule(np.fft, "fft")


def to_device(a, gpu: int | None = None) -> DeviceArray:
    """Return a device copy of host data ``a`` on GPU ``gpu`` (default: the current one;
    for tests: not counted in ``SYNCS``)."""
    with _Device(current_gpu() if gpu is None else gpu):
        return DeviceArray._wrap(np.array(a, copy=True, order="C"))


def to_host(a: DeviceArray) -> np.ndarray:
    """Return a NumPy copy of device array ``a`` (for tests: not counted in ``SYNCS``)."""
    if not isinstance(a, DeviceArray):
        raise TypeError(f"expected a DeviceArray, got {type(a).__name__}")
    return a._host.copy()


# ---------------------------------------------------------------------- the kernel backend


class _Kernel:
    """An emulated kernel launched like ``cupy.RawKernel``, on device arrays only."""

    def __init__(self, kernel, name: str):
        self._kernel = kernel
        self.name = name

    def __call__(self, grid, block, args, *, shared_mem: int = 0) -> None:
        host = []
        for i, a in enumerate(args):
            if isinstance(a, np.ndarray):
                raise TypeError(
                    f"{self.name}: argument {i} is a NumPy array: a GPU kernel cannot read "
                    "host memory"
                )
            if isinstance(a, DeviceArray):
                _check_device(a)
            host.append(a._host if isinstance(a, DeviceArray) else a)
        self._kernel(grid, block, tuple(host), shared_mem=shared_mem)


class _Module:
    """An emulated ``RawModule`` whose kernels are ``_Kernel``s."""

    def __init__(self, module):
        self._module = module

    def get_function(self, name: str) -> _Kernel:
        return _Kernel(self._module.get_function(name), name)


def device_record():
    """Return the ``cuda-host-backed`` backend record: the CUDA launchers on host-backed
    device arrays, the sources built by the emulation (``kernels/cuda/emulated.py``)."""
    import mpicomp.kernels as K
    from mpicomp.kernels.cuda import record
    from mpicomp.kernels.cuda.device import Device, _emulated_build

    def build(family, code, opts):
        return _Module(_emulated_build(family, code, opts))

    dev = Device(BACKEND, xp, 64, 4, build, current=current_gpu, on=_Device)
    return record(dev, K.FAMILIES)


def count_pinned(monkeypatch, device) -> list[int]:
    """Return the list that gets the size of every host buffer ``device`` pins from now
    on (the staging buffers a CompressedComm makes: ``device.pinned``), for the test."""
    made, pin = [], device.pinned

    def pinned(nbytes):
        made.append(nbytes)
        return pin(nbytes)

    monkeypatch.setattr(device, "pinned", pinned)
    return made


def install() -> None:
    """Register the ``cuda-host-backed`` backend (built at first use) and make
    ``backend_of`` send DeviceArrays to it. Calling it again changes nothing."""
    import mpicomp.kernels as K

    if BACKEND not in K.available():
        K.register_backend(BACKEND, device_record)
    K.register_array_type(DeviceArray, BACKEND)


# ---------------------------------------------------------------------- deferred copies


class DeferredEvent:
    """An event of ``DeferredStreams``: a point in one stream's queue (``at``), or None
    where it was never recorded or was recorded on the current stream (it has happened)."""

    def __init__(self):
        self.at: tuple[DeferredStream, int] | None = None

    @property
    def done(self) -> bool:
        return self.at is None or self.at[0]._ran >= self.at[1]

    def synchronize(self) -> None:
        if self.at is not None:
            stream, position = self.at
            stream.run_to(position)


class DeferredStream:
    """A copy stream that runs its work as late as a GPU may: only when the host waits
    for one of its events, or another stream runs work that waits for one. A copy the
    code forgot to wait for has then not happened when the host reads its bytes."""

    def __init__(self, log: list, name: str):
        self.log, self.name = log, name
        self._queue: list = []  # (work, label), or (None, (stream, position)) to wait for
        self._ran = 0

    def submit(self, work, label) -> None:
        self._queue.append((work, label))

    def record(self, event: DeferredEvent | None = None) -> DeferredEvent:
        event = event if event is not None else DeferredEvent()
        event.at = (self, len(self._queue))
        return event

    def wait_event(self, event: DeferredEvent) -> None:
        if event.at is not None:  # CUDA waits for the event as recorded now
            self._queue.append((None, event.at))

    def run_to(self, position: int) -> None:
        while self._ran < position:
            work, what = self._queue[self._ran]
            self._ran += 1
            if work is None:
                stream, at = what
                stream.run_to(at)
            else:
                work()
                self.log.append(("ran", *what))

    def synchronize(self) -> None:
        self.run_to(len(self._queue))


class _ImmediateStream:
    """The current stream of the stand-ins: their kernels run when launched, so what it
    waits for must have run by then."""

    def record(self, event: DeferredEvent | None = None) -> DeferredEvent:
        event = event if event is not None else DeferredEvent()
        event.at = None
        return event

    def wait_event(self, event: DeferredEvent) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        return None


class DeferredStreams:
    """``Device.streams`` for the stand-ins (set it on the ``cuda-host-backed`` device):
    copies run only when waited for (``DeferredStream``) and ``log`` gets, in order,
    ``("download", pointer)`` and ``("upload", pointer)`` when a copy is issued (the
    device array's first byte) and ``("ran", "download", pointer)`` ... when it runs."""

    def __init__(self):
        self.log: list = []
        self._current = _ImmediateStream()
        self._made = 0

    def stream(self) -> DeferredStream:
        self._made += 1
        return DeferredStream(self.log, f"copies {self._made}")

    def current(self) -> _ImmediateStream:
        return self._current

    def event(self) -> DeferredEvent:
        return DeferredEvent()

    def download(self, a: DeviceArray, out: np.ndarray, stream: DeferredStream) -> None:
        self.log.append(("download", a.data.ptr))
        stream.submit(lambda: a.get(out=out), ("download", a.data.ptr))

    def upload(self, host: np.ndarray, out: DeviceArray, stream: DeferredStream) -> None:
        self.log.append(("upload", out.data.ptr))
        stream.submit(lambda: out.set(host), ("upload", out.data.ptr))
