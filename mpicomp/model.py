"""What the schedule chooser predicts with: the networks, and each codec's compute.

A :class:`Model` holds two ``mpicomp.schedules.Network`` s, ``intra`` (between ranks of one
host, shared memory for MPI) and ``inter`` (between hosts), and one :class:`Speed` per
codec and parameters (encode and decode seconds per element, payload bits per element).
``mpicomp.schedules.predict`` turns them into seconds per call. A model is

- **measured**: :func:`measure_network` times ring-neighbour ``Sendrecv`` s of 8 bytes and
  of 1 MiB on a communicator (latency, then bandwidth), :func:`measure_speed` one rank's
  encode and decode of a synthetic gradient (``mpicomp.bench.workload.gradient``);
- **stored**: ``mpicomp bench --save-model FILE`` writes both as JSON, :meth:`Model.load`
  reads it;
- **given**: ``Model(intra=Network(alpha, beta), inter=..., speeds=...)``.

:func:`resolve` is what ``CompressedComm(schedule="auto")`` calls: the model it was
given (a ``Model`` or a file), else the file ``MPICOMP_MODEL`` names, else the networks
measured now; speeds the model lacks are measured now. Every rank then holds rank 0's
model, so every rank makes the same choice.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from mpicomp.schedules import Network, Topology

#: A file a model is read from when ``CompressedComm(schedule="auto")`` is given none.
MODEL_ENV = "MPICOMP_MODEL"

#: The ``format`` of the JSON files :meth:`Model.save` writes.
FORMAT = "mpicomp-model-1"

#: Elements of the synthetic gradient a speed is measured on by default (16 MiB of
#: float32: past the caches, where FFT and top-k cost more per element than on 4 MiB;
#: tens of milliseconds per codec on a CPU core).
SPEED_NUMEL = 1 << 22

#: The large message of the network probe starts here, well past the latency-bound
#: sizes, and grows 8-fold while it takes under PROBE_SECONDS, up to PROBE_MAX_BYTES: on
#: shared memory a small message stays in the caches and shows a bandwidth that a
#: gradient of 100 MB never sees.
PROBE_BYTES = 1 << 20
PROBE_SECONDS = 5e-3
PROBE_MAX_BYTES = 1 << 25


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
_UNCOMPRESSED = Speed(0.0, 0.0, 32.0)


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
    """

    intra: Network
    inter: Network | None = None
    speeds: dict = field(default_factory=dict)
    source: str = "given"

    def __post_init__(self):
        if not isinstance(self.intra, Network):
            raise TypeError(f"intra must be a mpicomp.schedules.Network, got {self.intra!r}")
        if self.inter is None:
            object.__setattr__(self, "inter", self.intra)
        elif not isinstance(self.inter, Network):
            raise TypeError(f"inter must be a mpicomp.schedules.Network, got {self.inter!r}")
        for key, s in self.speeds.items():
            if not isinstance(s, Speed):
                raise TypeError(f"speeds[{key!r}] must be a Speed, got {s!r}")
        object.__setattr__(self, "speeds", dict(self.speeds))  # a copy: the caller's stays theirs

    def speed(self, codec) -> Speed:
        """Return ``codec``'s speed.

        Raises:
            ValueError: the model has none for this codec and parameters.
        """
        if codec.name == "none":
            return _UNCOMPRESSED
        try:
            return self.speeds[codec_key(codec)]
        except KeyError:
            raise ValueError(
                f"the model ({self.source}) has no speed for {codec_key(codec)}: measure it "
                "(`mpicomp bench --save-model FILE` with this codec) or let CompressedComm do"
            ) from None

    def with_speeds(self, speeds: dict) -> Model:
        """Return this model with ``speeds`` added (replacing those of the same key)."""
        return Model(self.intra, self.inter, {**self.speeds, **speeds}, self.source)

    def to_json(self) -> dict:
        """Return the model as the JSON object ``save`` writes."""
        return {
            "format": FORMAT,
            "intra": {"alpha": self.intra.alpha, "beta": self.intra.beta},
            "inter": {"alpha": self.inter.alpha, "beta": self.inter.beta},
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
        except (KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"a malformed mpicomp model: missing or wrong {e}") from None
        return cls(nets[0], nets[1], speeds, source)

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


def measure_network(comm, reps: int = 5, nbytes: int = PROBE_BYTES) -> Network | None:
    """Return the latency-bandwidth model of ``comm`` as its ranks use it together: every
    rank ``Sendrecv`` s to its right neighbour from its left, 8 bytes then n bytes,
    ``reps`` times each after a warm-up; the slowest rank's median times t_8 and t_n give
    alpha = t_8 and beta = (n - 8) / (t_n - t_8) (n / t_n when t_n < 2 t_8: busy cores).
    n starts at ``nbytes`` and grows 8-fold while t_n < ``PROBE_SECONDS`` (up to
    ``PROBE_MAX_BYTES``). Collective; None on one rank."""
    from mpi4py import MPI

    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    right, left = (rank + 1) % size, (rank - 1) % size

    def median_time(n: int) -> float:
        send, recv = np.zeros(n, np.uint8), np.empty(n, np.uint8)
        times = []
        for i in range(reps + 1):
            comm.Barrier()
            t0 = time.perf_counter()
            comm.Sendrecv(send, right, 0x90D, recv, left, 0x90D)
            if i:  # the first is a warm-up (connections, registration)
                times.append(time.perf_counter() - t0)
        return comm.allreduce(statistics.median(times), op=MPI.MAX)

    t_small, t_large = median_time(8), median_time(nbytes)
    while t_large < PROBE_SECONDS and nbytes < PROBE_MAX_BYTES:  # the same on every rank
        nbytes *= 8
        t_large = median_time(nbytes)
    # On busy cores the 8-byte time is scheduling noise that can rival the large one:
    # then n / t_n, a bandwidth the link reaches at least, instead of a slope near 0.
    spread = t_large - t_small if t_large > 2 * t_small else t_large
    return Network(t_small, (nbytes - 8) / max(spread, 1e-9))


def measure_speed(codec, numel: int = SPEED_NUMEL, reps: int = 3) -> Speed:
    """Return ``codec``'s speed on this rank: medians of ``reps`` one-rank encodes and
    decodes of a synthetic gradient of ``numel`` elements after a warm-up (what
    ``mpicomp bench`` times, on ``codec``'s kernel backend), and its payload bits."""
    from mpicomp.bench.kernels import median_seconds
    from mpicomp.bench.roundtrip import one_rank_round_trip
    from mpicomp.bench.workload import gradient

    if codec.name == "none":
        return _UNCOMPRESSED
    x = gradient(numel)
    enc, dec, wire = one_rank_round_trip(codec, x)
    t_enc = median_seconds(enc, reps)
    t_dec = median_seconds(dec, reps)
    return Speed(t_enc / numel, t_dec / numel, 8 * wire() / numel)


def speeds_from_bench(rows) -> dict[str, Speed]:
    """Return the speeds of ``mpicomp bench --json`` rows that have kernel figures."""
    import mpicomp

    out = {}
    for r in rows:
        if r.get("encode_gbps") and r.get("decode_gbps"):
            codec = mpicomp.codec(r["codec"], **r["params"])
            out[codec_key(codec)] = Speed(
                4 / (r["encode_gbps"] * 1e9), 4 / (r["decode_gbps"] * 1e9), r["bits_per_element"]
            )
    return out


def host_comm(comm, local_comm=None):
    """Return the ranks of ``comm`` on this rank's host, as a new communicator split from
    ``comm`` (collective): those of ``local_comm`` (default
    ``comm.Split_type(COMM_TYPE_SHARED)``: the ranks that share memory)."""
    from mpi4py import MPI

    local = comm.Split_type(MPI.COMM_TYPE_SHARED, comm.rank) if local_comm is None else local_comm
    try:
        first = local.allreduce(comm.rank, op=MPI.MIN)  # the host's first rank names it
    finally:
        if local_comm is None:
            local.Free()
    return comm.Split(first, comm.rank)


def topology(comm, node) -> Topology:
    """Return the ``Topology`` of ``comm`` whose host communicator is ``node`` (collective)."""
    counts = comm.allgather((node.Get_rank() == 0, node.Get_size()))
    sizes = [n for leader, n in counts if leader]
    return Topology(len(sizes), max(sizes), len(set(sizes)) == 1, comm.Get_size())


def measure(comm, node, codecs=(), numel: int = SPEED_NUMEL) -> Model:
    """Return the model of ``comm`` measured now (collective): the network within a host
    on ``node`` (all hosts at once), between hosts on one rank per host, and the speed
    of every codec of ``codecs`` (the slowest rank's).

    One host: ``inter`` is ``intra``. One rank per host: ``intra`` is ``inter``."""
    from mpi4py import MPI

    topo = topology(comm, node)
    if topo.hosts == 1:
        intra = inter = measure_network(comm) or Network(0.0, 1e12)
    else:
        leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, comm.Get_rank())
        inter = measure_network(leaders) if leaders != MPI.COMM_NULL else None
        if leaders != MPI.COMM_NULL:
            leaders.Free()
        inter = comm.bcast(inter, root=0)  # rank 0 leads its host
        intra = measure_network(node) if topo.per_host > 1 else None
        intra = comm.bcast(intra, root=0) or inter
    model = Model(intra, inter, source="measured")
    return model.with_speeds(measured_speeds(comm, codecs, numel))


def measured_speeds(comm, codecs, numel: int = SPEED_NUMEL) -> dict[str, Speed]:
    """Return the speeds of ``codecs`` measured on every rank, the slowest rank's
    (collective: every rank passes the same codecs)."""
    from mpi4py import MPI

    out = {}
    for codec in codecs:
        s = measure_speed(codec, numel)
        worst = np.empty(2)
        comm.Allreduce(np.array([s.encode, s.decode]), worst, op=MPI.MAX)
        out[codec_key(codec)] = Speed(float(worst[0]), float(worst[1]), s.bits)
    return out


def resolve(comm, node, codec, given=None) -> Model:
    """Return the model a ``CompressedComm(schedule="auto")`` of ``codec`` predicts with
    (collective): ``given`` (a ``Model`` or a file), else the file ``MPICOMP_MODEL``
    names, else the networks measured now; a speed it lacks for ``codec`` is measured
    now. Rank 0's model, on every rank.

    Raises:
        ValueError, TypeError, OSError: ``given`` or the file is not a model (on every
            rank, with rank 0's reason).
    """
    problem, model = None, None
    if comm.Get_rank() == 0:
        try:
            model = _given(given)
        except (ValueError, TypeError, OSError) as e:
            problem = e
    model, problem = comm.bcast((model, problem), root=0)
    if problem is not None:
        raise problem
    if model is None:
        model = measure(comm, node)
    if codec.name != "none" and codec_key(codec) not in model.speeds:
        model = model.with_speeds(measured_speeds(comm, [codec]))
    return comm.bcast(model, root=0)


def _given(given) -> Model | None:
    """Return the model of ``given`` (a Model, a path, or None for ``MPICOMP_MODEL``)."""
    if isinstance(given, Model):
        return given
    if given is None:
        path = os.environ.get(MODEL_ENV, "")
        return Model.load(path) if path else None
    if isinstance(given, (str, os.PathLike)):
        return Model.load(given)
    raise TypeError(f"model must be a mpicomp.model.Model, a path or None, got {given!r}")
