"""numba CPU kernels, one module per codec family; twins of the CUDA kernels."""
