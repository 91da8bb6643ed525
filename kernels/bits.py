"""The bit-packing family's stream layout, shared by its twins.

Element i of a stream of ``width``-bit codes occupies bits [i*width, (i+1)*width),
LSB-first; bit b lives in byte b // 8 at position b % 8. Eight elements fill exactly
``width`` bytes, so a run of elements that starts at a multiple of 8 starts on a byte.
"""

#: Widest code the packing kernels take.
MAX_WIDTH = 32


def packed_size(n: int, width: int) -> int:
    """Return the bytes of a stream of ``n`` codes of ``width`` bits."""
    return (n * width + 7) // 8
