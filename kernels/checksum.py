"""The checksum family's arithmetic, shared by its twins: Adler-32 (zlib's rule)."""

#: Adler-32's modulus.
BASE = 65521


def combine(value: int, span: int, m: int) -> int:
    """Return Adler-32 ``value`` continued over m bytes whose checksum from 0 is ``span``.

    ``combine(adler32(a), adler32(b, 0), b.size) == adler32(b, adler32(a))``.
    """
    a, b = value & 0xFFFF, value >> 16
    b = (b + (m % BASE) * a + (span >> 16)) % BASE
    a = (a + (span & 0xFFFF)) % BASE
    return (b << 16) | a
