"""The HDF5 trace format, written once for its writer and its readers.

``mpicomp.trace`` (the ``Tracer``, which writes) and ``mpicomp.trace.report`` (``read``,
``summarize``, ``plot``) both import this module and never each other. What the
columns and attributes mean is in docs/trace-format.md.
"""

from __future__ import annotations

import numpy as np

# The version written; readers take every version of READABLE (docs/trace-format.md,
# Versioning). Version 2 added t_start (events) and t_end (steps): a timeline; version 3
# the schedule of each call and its predicted time.
FORMAT_VERSION = 3
READABLE = (1, 2, 3)

# Root attribute holding FORMAT_VERSION: its presence marks a file as an mpicomp trace.
VERSION_ATTR = "mpicomp_trace_version"

# The two tables: one row per call per rank, and (level 2) one per exchange step.
EVENTS, STEPS = "events", "steps"

# Fixed-length byte fields: longer values are cut to these many bytes (at a UTF-8
# character boundary), so every row has the same size and Gatherv moves raw bytes.
OP_LEN, CODEC_LEN, NAME_LEN, STEP_OP_LEN, SCHEDULE_LEN = 40, 32, 128, 32, 16

EVENT_DTYPE = np.dtype(
    [
        ("call", "<i8"),
        ("step", "<i8"),
        ("rank", "<i4"),
        ("op", f"S{OP_LEN}"),
        ("codec", f"S{CODEC_LEN}"),
        ("name", f"S{NAME_LEN}"),
        ("numel", "<i8"),
        ("bytes_in", "<i8"),
        ("bytes_sent", "<i8"),
        ("bytes_recv", "<i8"),
        ("t_encode", "<f8"),
        ("t_comm", "<f8"),
        ("t_decode", "<f8"),
        ("t_total", "<f8"),
        # seconds since the ranks' common epoch (a barrier when the trace was made)
        ("t_start", "<f8"),
        # how the call moved its bytes, and the model's prediction of t_total (NaN: none)
        ("schedule", f"S{SCHEDULE_LEN}"),
        ("t_predicted", "<f8"),
    ]
)

STEP_DTYPE = np.dtype(
    [
        ("call", "<i8"),
        ("rank", "<i4"),
        ("op", f"S{STEP_OP_LEN}"),
        ("substep", "<i4"),
        ("sent", "<i8"),
        ("recv", "<i8"),
        ("bits", "<i4"),
        ("t_end", "<f8"),  # when the step's messages were done, on the events' clock
    ]
)


def upgraded(rows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Return rows of an older version in ``dtype``: columns it lacks are NaN (times) or
    empty (text)."""
    if rows.dtype == dtype:
        return rows
    out = np.zeros(rows.shape, dtype=dtype)
    for name in dtype.names:
        if name in rows.dtype.names:
            out[name] = rows[name]
        elif dtype[name].kind != "S":
            out[name] = np.nan
    return out


def import_h5py():
    """Return the h5py module, imported on first use."""
    # Not at module level: importing mpicomp.comm (which imports the tracer) must stay fast.
    import h5py

    return h5py


__all__ = [
    "CODEC_LEN",
    "EVENTS",
    "EVENT_DTYPE",
    "FORMAT_VERSION",
    "NAME_LEN",
    "READABLE",
    "OP_LEN",
    "SCHEDULE_LEN",
    "STEPS",
    "STEP_DTYPE",
    "STEP_OP_LEN",
    "VERSION_ATTR",
    "import_h5py",
    "upgraded",
]
