"""Float32 <-> uint32 bit-pattern casts for numba kernels (an LLVM bitcast, no memory).

NumPy's ``view`` works on arrays only; these work on scalars inside a loop, so the
codecs' exponent tricks (FFT's range-based floats, FastSGD's log quantization) stay
vectorizable.
"""

from llvmlite import ir
from numba import types
from numba.extending import intrinsic


@intrinsic
def float_bits(typingctx, v):
    """The IEEE bit pattern of a float32 as a uint32 (an LLVM bitcast)."""
    sig = types.uint32(types.float32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return sig, codegen


@intrinsic
def bits_float(typingctx, v):
    """The float32 whose IEEE bit pattern is the uint32 ``v`` (an LLVM bitcast)."""
    sig = types.float32(types.uint32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen
