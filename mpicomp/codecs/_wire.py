"""The fixed header every mpicomp payload starts with, and its validation.

Layout (little-endian), 16 bytes then one uint64 per dimension::

    0  2s   magic b"MC"
    2  u8   format version (1)
    3  u8   codec id (see CODEC_IDS)
    4  u8   ndim (0..8)
    5  u8   flags (codec-specific)
    6  u16  reserved, 0
    8  u32  Adler-32 of every other byte of the payload (bytes 0-7, then 12-end)
    12 u32  body length in bytes
    16 u64  x ndim: the shape

The body (codec-specific) follows. Adler-32 is used because it is in the
standard library (zlib) and, unlike CRC-32, is a sum that a GPU can compute
with two parallel reductions.
"""

from __future__ import annotations

import struct
import zlib

import numpy as np

from mpicomp.codecs.arrays import is_array
from mpicomp.errors import PayloadError
from mpicomp.kernels import backend_of
from mpicomp.kernels.checksum import combine
from mpicomp.kernels.readback import batch, read, value_of, when

MAGIC = b"MC"
VERSION = 1
MAX_NDIM = 8
# Refuse shapes whose decode would allocate more than 2^40 elements: a corrupted
# length field must not turn into an unbounded allocation.
MAX_NUMEL = 1 << 40

CODEC_IDS = {
    "none": 0,
    "fp16": 1,
    "qsgd_maxnorm": 2,
    "qsgd_maxnorm_multiscale": 3,
    "grandk_maxnorm": 4,
    "grandk_maxnorm_multiscale": 5,
    "threelc": 6,
    "fft": 7,
    "signsgd": 8,
    "fastsgd": 9,
    "topk": 10,
}

_FIXED = struct.Struct("<2sBBBBHII")
FIXED_SIZE = _FIXED.size  # 16


def _checksum(payload: np.ndarray, kernels=None) -> int:
    # Chained over the two spans around the checksum field: no copy of the body.
    return _adler32_now(backend_of(payload, kernels), payload[12:], zlib.adler32(payload[:8]))


def _adler32_now(k, src, value: int, dst=None) -> int:
    """Return ``k``'s Adler-32 of ``src`` continued from ``value``, read at once even
    inside a caller's ``readback.batch``."""
    with batch("checksum"):
        found = k.checksum.adler32(src, value, dst=dst)
    return value_of(found)


def _head_checksum(head: np.ndarray, start: int) -> int:
    """Return Adler-32 of the header bytes the checksum covers (0-7, then 12 to ``start``)
    of ``head``, the header on the host."""
    return zlib.adler32(head[12:start], zlib.adler32(head[:8]))


def _read_head(payload, kernels) -> np.ndarray:
    """Return the payload's first bytes (as many as the largest header) on the host: one
    read of a device payload (counted on ``cuda-emulated`` too, as it would be on a GPU)."""
    head = payload[: header_size(MAX_NDIM)]
    return backend_of(payload, kernels).to_host(head, why="payload header")


def header_size(ndim: int) -> int:
    """Return the header size in bytes for an array of ``ndim`` dimensions."""
    return FIXED_SIZE + 8 * ndim


def empty(shape: tuple[int, ...], body_size: int, xp=np) -> tuple[np.ndarray, np.ndarray]:
    """Return (payload, body): an unsealed payload of ``body_size`` body bytes (an array of
    ``xp``, where the encoder's input lives), and the view of its body, for an encoder that
    writes its body in place; then ``seal`` it."""
    start = header_size(len(shape))
    out = xp.empty(start + body_size, dtype=np.uint8)
    return out, out[start:]


def seal(
    codec: str,
    payload: np.ndarray,
    shape: tuple[int, ...],
    flags: int = 0,
    body_sum=None,
    *,
    kernels=None,
) -> np.ndarray:
    """Write the header of a payload from ``empty`` whose body is written; return it.

    ``body_sum``, when the encoder computed it while writing the body, is the body's
    Adler-32 from 0 (``zlib.adler32(body, 0)``): the body is then not read again.
    ``kernels``: the backend record of host arrays (default ``mpicomp.kernels.backend()``).
    The header is made on the host and written with one copy; without ``body_sum`` the
    checksum is summed and written where the payload lies (``adler32_into``: on a GPU,
    nothing comes back to the host).
    """
    head, start = _head(codec, payload.size, shape, flags)
    k = backend_of(payload, kernels)
    if body_sum is not None:
        checksum = combine(_head_checksum(head, start), body_sum, payload.size - start)
        struct.pack_into("<I", head, 8, checksum)
    payload[:start] = k.xp.asarray(head)
    if body_sum is None:
        k.checksum.adler32_into(payload[start:], _head_checksum(head, start), payload[8:12])
    return payload


def _head(codec: str, size: int, shape: tuple[int, ...], flags: int):
    """Return (the header of a payload of ``size`` bytes, checksum 0, on the host; its size)."""
    ndim = len(shape)
    start = header_size(ndim)
    head = np.empty(start, dtype=np.uint8)
    _FIXED.pack_into(head, 0, MAGIC, VERSION, CODEC_IDS[codec], ndim, flags, 0, 0, size - start)
    if ndim:
        head[FIXED_SIZE:] = np.asarray(shape, dtype="<u8").view(np.uint8)
    return head, start


def pack(
    codec: str, shape: tuple[int, ...], body: np.ndarray, flags: int = 0, *, kernels=None
) -> np.ndarray:
    """Return header + ``body`` (a 1-D uint8 array) as one 1-D uint8 payload of its backend."""
    k = backend_of(body, kernels)
    body = k.xp.ascontiguousarray(body, dtype=np.uint8).reshape(-1)
    out, dst = empty(shape, body.size, k.xp)
    head, start = _head(codec, out.size, shape, flags)
    out[:start] = k.xp.asarray(head)
    # One pass copies the body and sums it; the checksum is written where the payload is.
    k.checksum.adler32_into(body, _head_checksum(head, start), out[8:12], dst=dst)
    return out


def verify(codec: str, payload: np.ndarray, body_sum: int, *, kernels=None) -> None:
    """Check the checksum of a payload that ``unpack(..., verify=False)`` accepted, given
    its body's Adler-32 from 0 (computed by a decoder in its own pass over the body).

    ``body_sum`` may be a ``readback.Later``: the check then runs when it is read.

    Raises:
        PayloadError: the payload does not match its checksum.
    """
    head = _read_head(payload, kernels)
    start = header_size(int(head[4]))

    def check(body_sum) -> None:
        value = combine(_head_checksum(head, start), body_sum, payload.size - start)
        if value != struct.unpack_from("<I", head, 8)[0]:
            raise PayloadError(f"{codec} payload fails its checksum (corrupted in transit?)")

    when(body_sum, check)


def unpack(
    codec: str,
    payload,
    known_flags: int = 0,
    numel: int | None = None,
    verify: bool = True,
    *,
    kernels=None,
) -> tuple[tuple[int, ...], int, np.ndarray]:
    """Validate a payload made by ``codec``; return (shape, flags, body view).

    ``known_flags`` is the mask of flag bits the codec defines; any other set bit
    is corruption. ``numel``, when the caller knows it (a collective does, from its
    agreement), is the element count the payload must describe: checked before any
    decoder allocates, since a few honest bytes of a sparse codec can describe a
    tensor of 2^40 elements. ``verify=False`` skips the checksum, for a decoder that
    sums the body in its own pass and then calls ``verify``. A payload on a device is
    validated there; only its header comes to the host (one read).

    Raises:
        PayloadError: wrong type, truncated, wrong magic, version or codec id,
            inconsistent body length, bad checksum or an impossible shape.
    """
    if not is_array(payload) or payload.dtype != np.uint8 or payload.ndim != 1:
        raise PayloadError(
            f"{codec} payload must be a 1-D uint8 array, got {type(payload).__name__}"
            + (
                f" of dtype {payload.dtype} and ndim {payload.ndim}"
                if hasattr(payload, "dtype")
                else ""
            )
        )
    if payload.size < FIXED_SIZE:
        raise PayloadError(
            f"{codec} payload truncated: {payload.size} bytes < {FIXED_SIZE}-byte header"
        )
    head = _read_head(payload, kernels)
    magic, version, codec_id, ndim, flags, reserved, checksum, body_len = _FIXED.unpack_from(
        head, 0
    )
    if magic != MAGIC:
        raise PayloadError(f"not an mpicomp payload: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(
            f"unsupported payload format version {version}, this build reads {VERSION}"
        )
    if codec_id != CODEC_IDS[codec]:
        names = {v: k for k, v in CODEC_IDS.items()}
        raise PayloadError(
            f"payload was made by codec {names.get(codec_id, codec_id)!r}, not {codec!r}"
        )
    if ndim > MAX_NDIM or reserved != 0 or flags & ~known_flags:
        raise PayloadError(
            f"{codec} payload header corrupted: ndim={ndim}, flags={flags:#x}, reserved={reserved}"
        )
    start = header_size(ndim)
    if payload.size != start + body_len:
        raise PayloadError(
            f"{codec} payload length {payload.size} does not match header "
            f"({start}-byte header + {body_len}-byte body)"
        )
    shape = tuple(int(d) for d in head[FIXED_SIZE:start].view("<u8")) if ndim else ()
    # The non-zero dimensions too: a zero-size shape like (0, 2**64 - 1), or (0, 2**38,
    # 2**38), is empty yet cannot be reshaped to.
    if numel_of(tuple(d for d in shape if d)) > MAX_NUMEL:
        raise PayloadError(f"{codec} payload shape {shape} is implausibly large")
    if numel is not None and numel_of(shape) != numel:
        raise PayloadError(
            f"{codec} payload describes {numel_of(shape)} elements, expected {numel}"
        )
    if verify:
        found = _adler32_now(backend_of(payload, kernels), payload[12:], zlib.adler32(head[:8]))
        if found != checksum:
            raise PayloadError(f"{codec} payload fails its checksum (corrupted in transit?)")
    return shape, flags, payload[start:]


def unpack_flat(
    codec: str, payload, numel: int, body_head: bytes = b"", *, flags: int = 0, kernels=None
):
    """Return the body of a payload that a rank's ``codec`` made from a flat tensor of
    ``numel`` elements (what the collectives send), validated without reading it here.

    Every byte of its header but the checksum is known from its length (ndim 1, the
    ``flags`` its encoder sets), and ``body_head`` are bytes its body must start with
    (top-k's k): on a
    device the comparison and the checksum run there and are read with the caller's
    ``readback.batch`` (at once without one), and what fails raises when it is read,
    with ``unpack``'s message. The checks are registered before anything the caller
    decodes from the body, so a corrupt payload reports its corruption first.

    Raises:
        PayloadError: too short for the header, or (when read) corrupt.
    """
    start = header_size(1)
    known = start + len(body_head)
    if payload.size < known:
        raise PayloadError(f"{codec} payload truncated: {payload.size} bytes < {known}")
    head = np.empty(known, dtype=np.uint8)
    body_len = payload.size - start
    _FIXED.pack_into(head, 0, MAGIC, VERSION, CODEC_IDS[codec], 1, flags, 0, 0, body_len)
    struct.pack_into("<Q", head, FIXED_SIZE, numel)
    head[start:] = np.frombuffer(body_head, np.uint8)
    k = backend_of(payload, kernels)
    device = getattr(k, "device", None)
    differs = k.xp.asarray(head) != payload[:known]
    differs[8:12] = False  # the checksum: compared below
    differs = read(device, differs.any(), f"{codec} payload: header", bool)
    field = read(device, payload[8:12], f"{codec} payload: checksum field")
    found = k.checksum.adler32(payload[12:], zlib.adler32(head[:8]))

    def check(found) -> None:
        if value_of(differs):
            # What is wrong (the expected flags are known ones there).
            shape, _, _ = unpack(codec, payload, flags, numel=numel, kernels=kernels)
            raise PayloadError(
                f"{codec} payload of shape {shape} is not what the collectives send: a flat "
                "array's, made with this codec's parameters"
            )
        if found != int(value_of(field).view("<u4")[0]):
            raise PayloadError(f"{codec} payload fails its checksum (corrupted in transit?)")

    when(found, check)
    return payload[start:]


def claimed_shape(payload: np.ndarray) -> tuple[int, ...] | None:
    """Return the shape a payload's header states, unvalidated; None without a readable header.

    For tools that inspect or forge payloads (fuzzers, tests); decoders use ``unpack``.
    """
    if payload.size < FIXED_SIZE or payload[4] > MAX_NDIM:
        return None
    end = header_size(int(payload[4]))
    if payload.size < end:
        return None
    return tuple(int(d) for d in payload[FIXED_SIZE:end].view("<u8"))


def reseal(payload: np.ndarray, *, length: bool = True) -> np.ndarray:
    """Rewrite an edited payload's checksum (and body length) in place; return it.

    With ``length=False`` a deliberately wrong body length is kept. A payload without
    a readable fixed header (too short, ndim > 8) is returned as it is.
    """
    if payload.size < FIXED_SIZE or payload[4] > MAX_NDIM:
        return payload
    body = payload.size - header_size(int(payload[4]))
    if length and body >= 0:
        struct.pack_into("<I", payload, 12, body)
    struct.pack_into("<I", payload, 8, _checksum(payload))
    return payload


def numel_of(shape: tuple[int, ...]) -> int:
    """Return the number of elements of ``shape`` (1 for a 0-d shape)."""
    n = 1
    for d in shape:
        n *= d
    return n
