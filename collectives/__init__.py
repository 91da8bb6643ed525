"""Hand-written mpi4py collectives on raw buffers (NumPy arrays; array types are dispatched by ``mpicomp.kernels.backend_of``)."""
