"""What the FastSGD family's twins share: the body layout, parameter limits and error codes
(the FastSGD paper §3).

Body layout (little-endian; see docs/codecs.md)::

    prefix  0 f64 base | 8 u32 bucket | 12 u8 tau | 13 u8 flag_bits | 14 u16 reserved (0)
    bucket  0 f32 sum | 4 u32 d | 8 u32 key_bytes | 12 u8 W | 13 d x u8 L code | key bit stream
"""

PREFIX_BYTES = 16
BUCKET_HEAD_BYTES = 13
SIGN_BIT = 0x80
MAX_TAU = 127
MAX_FLAG_BITS = 5
# Largest bucket: keys and counts fit u32 and the worst-case key stream,
# bucket * (flag_bits + 29) bits, fits the u32 key_bytes field.
MAX_BUCKET = 1 << 29

# Error codes of the scan and the decoder (0 = valid).
OK = 0
ERR_TRUNCATED = 1  # a bucket header or its codes/key bytes run past the body
ERR_TRAILING = 2  # bytes left after the last bucket
ERR_SUM = 3  # sum is negative, NaN, Inf, or 0 with values kept
ERR_COUNT = 4  # more values kept than the bucket holds
ERR_WIDTH = 5  # W too large for the bucket, or inconsistent with the count / key bytes
ERR_CODE = 6  # an L code above tau
ERR_KEY_BITS = 7  # the key stream ends before the last key
ERR_KEY_ORDER = 8  # a key outside the bucket or not strictly increasing
ERR_KEY_FLAG = 9  # a length flag that is not the smallest one for its delta
ERR_KEY_TAIL = 10  # key stream longer than needed, non-zero padding, or W not the widest delta


def bucket_capacity(blen: int, flag_bits: int) -> int:
    """Return the most bytes one bucket of ``blen`` values can take (every value kept, widest keys)."""
    wmax = max(blen - 1, 0).bit_length()
    return BUCKET_HEAD_BYTES + blen + (blen * (flag_bits + wmax) + 7) // 8
