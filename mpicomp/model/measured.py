"""What the schedule chooser predicts with: the networks, and each codec's compute.

A :class:`Model` holds two ``mpicomp.model.cost.Network`` s, ``intra`` (between ranks of one
host, shared memory for MPI) and ``inter`` (between hosts), and one :class:`Speed` per
codec and parameters (encode and decode seconds per element, payload bits per element),
and ``mpi_allreduce``: the MPI library's all-reduce time over its latency-bandwidth
prediction between hosts (1 where it reaches the links as the model says; above 1
where its algorithm does worse than mpicomp's ring, which the chooser then prefers).
``mpicomp.model.cost.predict`` turns them into seconds per call. A model is

- **measured**: by ``mpicomp.model.probe`` when a ``CompressedComm(schedule="auto")`` is made
  and has none (the network's latency and bandwidth, one rank's encode and decode of a
  synthetic gradient);
- **stored**: ``mpicomp bench --save-model FILE`` writes both as JSON, :meth:`Model.load`
  reads it;
- **given**: ``Model(intra=Network(alpha, beta), inter=..., speeds=...)``.

This module is the data alone: no MPI, no timing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import numpy as np

from mpicomp.codecs import codec as make_codec
from mpicomp.model.cost import Network

#: A file a model is read from when ``CompressedComm(schedule="auto")`` is given none.
MODEL_ENV = "MPICOMP_MODEL"

#: The ``format`` of the JSON files :meth:`Model.save` writes.
FORMAT = "mpicomp-model-1"


@dataclass(frozen=True)
class Speed:
    """One codec's compute: ``encode`` and ``decode`` seconds per element of one rank's
    share of a call, and ``bits`` per element of its payload (gather codecs).

    Raises:
        ValueError: a field negative or not finite.
    """

    encode: float
    decode: float
    bits: float = 32.0

    def __post_init__(self):
        for name in ("encode", "decode", "bits"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and np.isfinite(v) and v >= 0):
                raise ValueError(f"Speed.{name} must be a finite number >= 0, got {v!r}")


#: ``none`` computes nothing and sends float32.
UNCOMPRESSED = Speed(0.0, 0.0, 32.0)


def codec_key(codec) -> str:
    """Return the key of ``codec``'s speed in a model: its name and parameters."""
    return f"{codec.name}:{json.dumps(codec.params, sort_keys=True, default=str)}"


@dataclass(frozen=True)
class Model:
    """The parameters of the schedule chooser (see the module's docstring).

    Args:
        intra: ranks of one host (what a hierarchical schedule reduces over first).
        inter: between hosts (what a flat schedule crosses when there are several
            hosts); default ``intra``.
        speeds: ``codec_key(codec)`` to its ``Speed``.
        source: where the figures came from (a file, ``"measured"``, ``"given"``).
        mpi_allreduce: MPI_Allreduce's measured time over its prediction on ``inter``
            (``mpicomp.model.probe.measure_mpi_allreduce``); 1 if not measured.
    """

    intra: Network
    inter: Network | None = None
    speeds: dict = field(default_factory=dict)
    source: str = "given"
    mpi_allreduce: float = 1.0

    def __post_init__(self):
        if not isinstance(self.intra, Network):
            raise TypeError(f"intra must be a mpicomp.model.cost.Network, got {self.intra!r}")
        if self.inter is None:
            object.__setattr__(self, "inter", self.intra)
        elif not isinstance(self.inter, Network):
            raise TypeError(f"inter must be a mpicomp.model.cost.Network, got {self.inter!r}")
        if not (np.isfinite(self.mpi_allreduce) and self.mpi_allreduce > 0):
            raise ValueError(
                f"mpi_allreduce must be a finite ratio > 0, got {self.mpi_allreduce!r}"
            )
        for key, s in self.speeds.items():
            if not isinstance(s, Speed):
                raise TypeError(f"speeds[{key!r}] must be a Speed, got {s!r}")
        object.__setattr__(self, "speeds", dict(self.speeds))  # a copy: the caller's stays theirs

    def speed(self, codec) -> Speed:
        """Return ``codec``'s speed.

        Raises:
            ValueError: the model has none for this codec and parameters.
        """
        if not codec.compresses:
            return UNCOMPRESSED
        try:
            return self.speeds[codec_key(codec)]
        except KeyError:
            raise ValueError(
                f"the model ({self.source}) has no speed for {codec_key(codec)}: measure it "
                "(`mpicomp bench --save-model FILE` with this codec) or let CompressedComm do"
            ) from None

    def with_speeds(self, speeds: dict) -> Model:
        """Return this model with ``speeds`` added (replacing those of the same key)."""
        return Model(
            self.intra, self.inter, {**self.speeds, **speeds}, self.source, self.mpi_allreduce
        )

    def to_json(self) -> dict:
        """Return the model as the JSON object ``save`` writes."""
        return {
            "format": FORMAT,
            "intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
            "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
            "mpi_allreduce": self.mpi_allreduce,
            "speeds": {k: vars(s) for k, s in sorted(self.speeds.items())},
        }

    @classmethod
    def from_json(cls, obj, source: str = "given") -> Model:
        """Return the model of a JSON object ``to_json`` made.

        Raises:
            ValueError: not such an object, or a value out of range (named).
        """
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            raise ValueError(f"not an mpicomp model (expected format {FORMAT!r})")
        try:
            nets = [
                Network(float(obj[k]["alpha"]), float(obj[k]["beta"])) for k in ("intra", "inter")
            ]
            speeds = {
                str(k): Speed(float(v["encode"]), float(v["decode"]), float(v["bits"]))
                for k, v in obj.get("speeds", {}).items()
            }
            factor = float(obj.get("mpi_allreduce", 1.0))  # files saved before it: 1
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"a malformed mpicomp model: missing or wrong {e}") from None
        return cls(nets[0], nets[1], speeds, source, factor)

    def save(self, path) -> None:
        """Write the model to ``path`` as JSON."""
        with open(path, "w") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")

    @classmethod
    def load(cls, path) -> Model:
        """Read a model ``save`` wrote.

        Raises:
            OSError: the file cannot be read.
            ValueError: it is not a model (named with the path).
        """
        with open(path) as f:
            try:
                return cls.from_json(json.load(f), source=os.fspath(path))
            except ValueError as e:
                raise ValueError(f"{os.fspath(path)}: {e}") from None


def speeds_from_bench(rows) -> dict[str, Speed]:
    """Return the speeds of ``mpicomp bench --json`` rows that have kernel figures."""
    out = {}
    for r in rows:
        if r.get("encode_gbps") and r.get("decode_gbps"):
            codec = make_codec(r["codec"], **r["params"])
            out[codec_key(codec)] = Speed(
                4 / (r["encode_gbps"] * 1e9), 4 / (r["decode_gbps"] * 1e9), r["bits_per_element"]
            )
    return out
