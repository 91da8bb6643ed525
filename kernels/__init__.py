"""Device code of mpicomp: numba CPU kernels (``cpu``) and CUDA sources (``cuda``)."""
