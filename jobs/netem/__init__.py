"""Emulated-network benchmark: a tc-shaped loopback in a private namespace (jobs/netem/job.py)."""
