"""Hand-written mpi4py collectives on raw buffers (numpy or cupy)."""
