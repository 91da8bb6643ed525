"""Torch DDP and its communication hooks against mpicomp, side by side (jobs/peers/driver.py)."""
