"""Torch DDP and its communication hooks, FSDP2 and ZeRO against mpicomp, side by side
(jobs/peers/driver.py)."""
