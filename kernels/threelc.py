"""What the 3LC family's twins share: the quartic and zero-run byte codes, error codes and
the quartic length (the 3LC paper §3.2-3.3)."""

#: Quartic byte of five zero trits (digits 1, 1, 1, 1, 1): the byte zero-run encoding shortens.
ZERO_BYTE = 121
#: Largest quartic byte (digits 2, 2, 2, 2, 2); 243..255 are zero-run codes.
MAX_QUARTIC = 242
#: Zero-run code of a run of k >= 2 zero bytes: RUN_BASE + (k - 2), k <= MAX_RUN.
RUN_BASE = 243
MAX_RUN = 14

# Error codes of the quartic decoder.
OK = 0
ERR_BYTE = 1  # a quartic byte above MAX_QUARTIC
ERR_PAD = 2  # a non-zero digit in a pad position
ERR_ZERO_SCALE = 3  # M = 0 but non-zero trits


def quartic_length(n: int) -> int:
    """Return the number of quartic bytes of ``n`` trits, ceil(n / 5)."""
    return (n + 4) // 5
