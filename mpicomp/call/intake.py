"""What a CompressedComm call takes in and gives back: gradients read and converted to
flat float32 when the call is made (or refused, for every rank to hear of in the call),
fused into buckets, and results returned in the caller's framework, shape and dtype."""

from __future__ import annotations

import math
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import numpy as np
from mpi4py import MPI

from mpicomp.codecs._wire import MAX_NUMEL
from mpicomp.codecs.arrays import array_module, is_device_array, to_float32
from mpicomp.kernels import backend_of
from mpicomp.reduction.residuals import SHARD_MARK


def check_numel(x, limit: int, what: str = "x") -> None:
    """Refuse ``x`` if it has more than ``limit`` elements, from its shape alone (before
    anything is converted or allocated)."""
    shape = getattr(x, "shape", None)
    if shape is None and hasattr(x, "__cuda_array_interface__"):
        shape = x.__cuda_array_interface__.get("shape")
    try:
        numel = math.prod(int(d) for d in shape) if shape is not None else 0
    except TypeError:
        return  # no integer shape: to_float32 names what is wrong
    if numel > limit:
        raise ValueError(
            f"{what} has {numel} elements; one call carries at most {limit} (split the tensor)"
        )


@dataclass(frozen=True)
class Tensor:
    """One input of a call, read and converted when the call is made (or refused).

    ``flat`` is its float32 copy or view, 1-D; ``overflowed`` says float64 values
    beyond float32's range became Inf; ``dtype`` names the caller's dtype (debug
    descriptions); ``error`` is why the input was refused (then ``flat`` is empty);
    ``shapes`` the shapes of the tensors ``flat`` holds end to end (its own shape, or a
    bucket's members': codecs that work on matrices read them).
    """

    x: object
    name: str
    flat: np.ndarray
    overflowed: bool = False
    dtype: str = "float32"
    error: Exception | None = None
    shapes: tuple = ()

    @classmethod
    def refused(cls, x, name: str, error: Exception) -> Tensor:
        return cls(x, name, np.empty(0, dtype=np.float32), error=error)

    @classmethod
    def fused(cls, members: list[Tensor]) -> Tensor:
        """Return one bucket holding ``members`` end to end (all on the host, or all on
        one device)."""
        flat = array_module(members[0].flat).concatenate([t.flat for t in members])
        return cls(
            flat,
            "bucket:" + "|".join(t.name for t in members),
            flat,
            any(t.overflowed for t in members),
            "/".join(sorted({t.dtype for t in members})),
            shapes=tuple(shape for t in members for shape in t.shapes),
        )

    @property
    def what(self) -> str:
        """How messages name this tensor."""
        return f"gradient {self.name!r}" if self.name else "gradient"

    def result(self, avg):
        """Return float32 ``avg`` in this input's framework, shape and dtype."""
        return _like(self.x, avg.reshape(_shape(self.x)))

    def like(self, flat):
        """Return float32 ``flat`` (1-D: a row, or rows end to end) in this input's
        framework and dtype."""
        return _like(self.x, flat)

    def zeros(self):
        """Return zeros as ``result`` would (a skipped call's result)."""
        return self.result(array_module(self.flat).zeros(self.flat.size, dtype=np.float32))


class Gpu:
    """The one GPU a CompressedComm's device gradients live on, fixed by the first one;
    ``current()`` makes it current (CuPy's current device is per thread: a worker
    thread's starts at GPU 0)."""

    def __init__(self):
        self.id = None
        self.current = nullcontext

    def check(self, flat, what: str) -> None:
        """Check that device array ``flat`` is on this GPU (the first one seen)."""
        gpu = flat.device.id
        if self.id is None:
            device = getattr(backend_of(flat), "device", None)
            self.current = partial(device.on, gpu) if device is not None else nullcontext
            self.id = gpu
        elif gpu != self.id:
            raise TypeError(
                f"{what} is on GPU {gpu}; this CompressedComm works on GPU {self.id} "
                "(one GPU per communicator and rank)"
            )


def take(x, name: str, gpu: Gpu, named: bool, shapes=None) -> Tensor:
    """Read and convert ``x`` now; a refused input is kept with its error, for the call
    to raise (every rank then raises). ``named``: a name is required (residuals);
    ``shapes``: the tensors ``x`` holds end to end (default: ``x``'s own shape)."""
    if not isinstance(name, str):
        error = TypeError(f"name must be a str (the tensor's name), got {name!r}")
        return Tensor.refused(x, "", error)
    what = f"gradient {name!r}" if name else "gradient"
    try:
        if SHARD_MARK in name:
            raise ValueError(
                f"name {name!r} holds {SHARD_MARK!r}, which mpicomp reserves for the "
                "residuals of a tensor's shards and rows (reduce_scatter('w') keeps "
                "'w#shards#shard0'): give the tensor a name without it"
            )
        check_numel(x, _max_numel(), what)
        flat, overflowed = to_float32(x, what=what)
        if is_device_array(flat):
            gpu.check(flat, what)
        if named and not name:
            raise ValueError(
                "error feedback keeps one residual per tensor: pass name= (the same each step)"
            )
        shapes = (tuple(_shape(x)),) if shapes is None else _shapes(shapes, flat.size, what)
    except Exception as e:  # whatever converting raised, every rank must hear of it
        return Tensor.refused(x, name, e)
    return Tensor(x, name, flat.reshape(-1), overflowed, _dtype(x), shapes=shapes)


def _shapes(shapes, numel: int, what: str) -> tuple:
    """Return ``shapes`` as a tuple of tuples of ints, checked to hold ``numel`` elements."""
    try:
        out = tuple(tuple(int(d) for d in shape) for shape in shapes)
    except TypeError:
        raise TypeError(f"shapes of {what} must be a sequence of shapes, got {shapes!r}") from None
    held = sum(math.prod(shape) for shape in out)
    if held != numel or any(d < 0 for shape in out for d in shape):
        raise ValueError(f"shapes {list(out)} hold {held} elements; {what} has {numel}")
    return out


def take_many(arrays, names, gpu: Gpu, named: bool) -> tuple[list, Tensor | None]:
    """Return (``arrays`` taken one by one, None), or ([], a refused input) when one
    of them, or the names, is refused."""
    try:
        arrays = _sequence("arrays", arrays, "gradients")
        if names is None:
            names = [f"#{i}" for i in range(len(arrays))]
        names = _sequence("names", names, "str")
    except TypeError as e:
        return [], Tensor.refused(arrays, "", e)
    if len(names) != len(arrays):
        error = ValueError(f"{len(names)} names for {len(arrays)} arrays")
        return [], Tensor.refused(arrays, "", error)
    if len(set(map(str, names))) < len(names):  # one name, one residual: errors would mix
        twice = sorted({str(n) for n, k in Counter(map(str, names)).items() if k > 1})
        error = ValueError(f"names must differ within one call; given more than once: {twice}")
        return [], Tensor.refused(arrays, "", error)
    tensors = [take(a, n, gpu, named) for a, n in zip(arrays, names, strict=True)]
    refused = next((t for t in tensors if t.error is not None), None)
    if refused is None and len({array_module(t.flat) for t in tensors}) > 1:
        # A fused bucket lives in one place: host and device arrays do not mix.
        error = TypeError("allreduce_many takes host arrays or device arrays, not both")
        refused = Tensor.refused(arrays, "", error)
    return ([], refused) if refused else (tensors, None)


def buckets(sizes: list[int], limit: int) -> list[list[int]]:
    """Group consecutive indices of tensors smaller than ``limit`` into buckets <= limit."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if n >= limit:
            if current:
                out.append(current)
                current, total = [], 0
            out.append([i])
            continue
        if total + n > limit and current:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def _sequence(what: str, items, of: str) -> list:
    """Return ``items`` as a list, refusing one array, a str or a mapping in its place."""
    if isinstance(items, (str, bytes)) or hasattr(items, "shape") or hasattr(items, "keys"):
        hint = " (for one array use allreduce)" if hasattr(items, "shape") else ""
        if hasattr(items, "keys"):
            hint = " (for a dict d: list(d.values()), names=list(d))"
        raise TypeError(f"{what} must be a list or tuple of {of}, got {type(items).__name__}{hint}")
    try:
        return list(items)
    except TypeError:
        raise TypeError(
            f"{what} must be a list or tuple of {of}, got {type(items).__name__}"
        ) from None


def _max_numel() -> int:
    """Return the most elements one call carries: what a payload header describes, and
    what an MPI count (a C int) holds before MPI 4."""
    return MAX_NUMEL if MPI.Get_version() >= (4, 0) else 2**31 - 1


def _shape(x) -> tuple:
    """Return the shape of input ``x``: an array's, a tensor's, or its CUDA array interface's."""
    shape = getattr(x, "shape", None)
    if shape is not None:
        return tuple(shape)
    if hasattr(x, "__cuda_array_interface__"):
        return tuple(x.__cuda_array_interface__["shape"])
    return np.shape(x)


def _dtype(x) -> str:
    """Return the name of ``x``'s dtype as the caller passed it (for debug descriptions)."""
    dt = getattr(x, "dtype", None)
    return str(dt).removeprefix("torch.") if dt is not None else type(x).__name__


def _like(x, avg):
    """Return float32 ``avg`` in ``x``'s dtype and framework (NumPy, or the DLPack producer's)."""
    dtype = getattr(x, "dtype", None)
    if isinstance(x, np.ndarray) or is_device_array(x):
        return avg.astype(x.dtype, copy=False)
    if hasattr(x, "__cuda_array_interface__") and not hasattr(x, "__dlpack__"):
        # No framework to return it in: a CuPy array (or NumPy under cuda-emulated).
        return avg.astype(np.dtype(x.__cuda_array_interface__["typestr"]), copy=False)
    if isinstance(x, np.generic):
        return avg.astype(dtype).reshape(())[()]
    jax = sys.modules.get("jax")  # never imported here: a jax.Array means JAX already is
    if jax is not None and isinstance(x, jax.Array):
        # Its type lives in jaxlib, which has no from_dlpack: put it back where x was.
        return jax.device_put(jax.numpy.from_dlpack(avg).astype(x.dtype), x.sharding)
    # A DLPack producer (PyTorch): hand the result back through its own from_dlpack.
    lib = sys.modules.get(type(x).__module__.split(".")[0])
    from_dlpack = getattr(lib, "from_dlpack", None)
    result = from_dlpack(avg) if from_dlpack is not None else avg
    if dtype is not None and hasattr(result, "to"):
        result = result.to(dtype)
    return result
