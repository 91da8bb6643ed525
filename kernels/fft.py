"""What the FFT family's twins share: the range-based float's widths and the error codes
(the FFT sparsification paper §3.2.1)."""

#: Mantissa bits of float32: a code keeps the top m of them (shift = MAX_MANTISSA - m).
MAX_MANTISSA = 23

# Results of the float16 rounding pass.
FP16_OK = 0
FP16_NONFINITE = 1
FP16_OVERFLOW = 2

# Error codes of the decoders.
DECODE_OK = 0
DECODE_NEGATIVE_ZERO = 1
DECODE_OVERFLOW = 2
DECODE_PADDING = 3
DECODE_COUNT = 4
