"""What ``CompressedComm(schedule="auto")`` measures when it is made: the hosts, the network
and the codecs' compute, into a ``mpicomp.model.Model``.

- the hosts: :func:`host_comm` splits a communicator by shared memory, :func:`topology`
  counts hosts and ranks per host;
- the network: :func:`measure_network` times ring-neighbour ``Sendrecv`` s of 8 bytes and
  of 1 MiB or more (latency, then bandwidth), :func:`measure_mpi_allreduce` the MPI
  library's all-reduce against what that network predicts for it;
- the compute: :func:`measure_speed` times one rank's encode and decode of a synthetic
  gradient (:func:`gradient`), the closures of :func:`one_rank_round_trip`, by
  :func:`median_seconds`;
- :func:`resolve` puts them together: the model given, else the file ``MPICOMP_MODEL``
  names, else the networks measured now; speeds the model lacks are measured now.

``mpicomp bench`` times codecs with the same closures and the same clock; it imports
this module, never the reverse.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from mpicomp.collectives import plain
from mpicomp.collectives._wait import Exchange, no_expiry, resolve_timeout, split, split_type
from mpicomp.kernels import backend_of
from mpicomp.kernels.bits import packed_size
from mpicomp.model.cost import Network, Topology
from mpicomp.model.measured import MODEL_ENV, UNCOMPRESSED, Model, Speed, codec_key
from mpicomp.reduction import kind_of

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
#: MPI_Allreduce's efficiency is timed on a message of about this many seconds of the
#: measured link (between 1 and 32 MiB).
ALLREDUCE_SECONDS = 20e-3
#: MPI_Allreduce's time over its prediction is taken as 1 up to this ratio.
MPI_ALLREDUCE_SLACK = 1.25

# Elements per output channel of a ResNet-50 3x3 conv with 512 input channels.
_CHANNEL = 512 * 3 * 3


# -- the hosts -------------------------------------------------------------------------


def host_comm(comm, local_comm=None, *, timeout=None):
    """Return the ranks of ``comm`` on this rank's host, as a new communicator split from
    ``comm`` (collective): those of ``local_comm`` (default
    ``comm.Split_type(COMM_TYPE_SHARED)``: the ranks that share memory).

    ``timeout``, here and below: seconds each message may wait (the collectives'
    ``timeout``; None: ``MPICOMP_TIMEOUT``). Under one, the probe's messages are waited
    on as every call's are, so what it times is the network as the calls use it.
    """
    from mpi4py import MPI

    timeout = resolve_timeout(timeout)
    local = local_comm
    if local is None:
        local = split_type(comm, MPI.COMM_TYPE_SHARED, comm.rank, timeout=timeout, name="hosts")
    try:
        first = np.array([comm.rank], np.int64)  # the host's first rank names it
        plain.allreduce(local, MPI.IN_PLACE, first, MPI.MIN, timeout=timeout)
    finally:
        if local_comm is None:
            local.Free()
    return split(comm, int(first[0]), comm.rank, timeout=timeout, name="hosts")


def topology(comm, node, *, timeout=None) -> Topology:
    """Return the ``Topology`` of ``comm`` whose host communicator is ``node`` (collective)."""
    counts = plain.allgather_object(comm, (node.Get_rank() == 0, node.Get_size()), timeout=timeout)
    sizes = [n for leader, n in counts if leader]
    return Topology(len(sizes), max(sizes), len(set(sizes)) == 1, comm.Get_size())


# -- the network -----------------------------------------------------------------------


def measure_network(
    comm, reps: int = 5, nbytes: int = PROBE_BYTES, *, timeout=None
) -> Network | None:
    """Return the latency-bandwidth model of ``comm`` as its ranks use it together: every
    rank ``Sendrecv`` s to its right neighbour from its left, 8 bytes then n bytes,
    ``reps`` times each after a warm-up; the slowest rank's median times t_8 and t_n give
    alpha = t_8 and beta = (n - 8) / (t_n - t_8) (n / t_n when t_n < 2 t_8: busy cores).
    n starts at ``nbytes`` and grows 8-fold while t_n < ``PROBE_SECONDS`` (up to
    ``PROBE_MAX_BYTES``). Collective; None on one rank."""
    size, rank = comm.Get_size(), comm.Get_rank()
    if size == 1:
        return None
    timeout = resolve_timeout(timeout)
    right, left = (rank + 1) % size, (rank - 1) % size
    exchange = Exchange(comm, timeout, "network probe", 0x90D)

    def median_time(n: int) -> float:
        send, recv = np.zeros(n, np.uint8), np.empty(n, np.uint8)
        times = []
        for i in range(reps + 1):
            plain.barrier(comm, timeout=timeout)
            t0 = time.perf_counter()
            exchange(send, right, recv, left, f"the {n}-byte probe", 1)
            if i:  # the first is a warm-up (connections, registration)
                times.append(time.perf_counter() - t0)
        return _slowest(comm, statistics.median(times), timeout)

    t_small, t_large = median_time(8), median_time(nbytes)
    while t_large < PROBE_SECONDS and nbytes < PROBE_MAX_BYTES:  # the same on every rank
        nbytes *= 8
        t_large = median_time(nbytes)
    # On busy cores the 8-byte time is scheduling noise that can rival the large one:
    # then n / t_n, a bandwidth the link reaches at least, instead of a slope near 0.
    spread = t_large - t_small if t_large > 2 * t_small else t_large
    return Network(t_small, (nbytes - 8) / max(spread, 1e-9))


def measure_mpi_allreduce(comm, network: Network | None, reps: int = 3, *, timeout=None) -> float:
    """Return MPI_Allreduce's time over its prediction on ``network`` (Hockney's model of
    ``mpicomp.model.cost``): float32 sums of about ALLREDUCE_SECONDS of the link's bytes
    (1 to 32 MiB), the slowest rank's median of ``reps`` after a warm-up. Above 1: the
    library reaches less of the link than a ring of ``Sendrecv`` s (what
    ``measure_network`` timed). Collective; 1.0 on one rank."""
    from mpi4py import MPI

    from mpicomp.reduction._cost import mpi_allreduce

    size = comm.Get_size()
    if size == 1 or network is None:
        return 1.0
    timeout = resolve_timeout(timeout)
    nbytes = int(min(PROBE_MAX_BYTES, max(PROBE_BYTES, network.beta * ALLREDUCE_SECONDS)))
    agreed = np.array([nbytes - nbytes % 4], np.int64)
    plain.bcast(comm, agreed, 0, timeout=timeout)  # one size on every rank
    nbytes = int(agreed[0])
    send, recv = np.ones(nbytes // 4, np.float32), np.empty(nbytes // 4, np.float32)
    times = []
    for i in range(reps + 1):
        plain.barrier(comm, timeout=timeout)
        t0 = time.perf_counter()
        plain.allreduce(comm, send, recv, MPI.SUM, timeout=timeout)
        if i:  # the first is a warm-up
            times.append(time.perf_counter() - t0)
    measured = _slowest(comm, statistics.median(times), timeout)
    ratio = max(measured, 1e-9) / max(network.time(mpi_allreduce(nbytes, size)), 1e-9)
    # Within the model's noise, keep the library's own all-reduce (its fewer messages,
    # no copies in Python): only a clear loss makes the ring look cheaper.
    return ratio if ratio > MPI_ALLREDUCE_SLACK else 1.0


# -- the compute -----------------------------------------------------------------------


def median_seconds(fn: Callable[[], object], reps: int, sync=None) -> float:
    """Return the median wall time of ``reps`` calls of ``fn`` after one warm-up call;
    ``sync`` (a GPU's synchronize) is called before the clock starts and before it stops."""
    sync = sync or (lambda: None)
    fn()  # warm-up: compilation and first-touch allocation
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def conv_gradient(shape: tuple[int, ...] = (512, 512, 3, 3), seed: int = 0) -> np.ndarray:
    """Return a float32 tensor shaped like a ResNet-50 3x3 conv gradient.

    Real conv gradients are heavy-tailed and their scale varies by output channel:
    Laplace values times a log-normal scale per channel, times 1e-3.
    """
    rng = np.random.default_rng(seed)
    scale = rng.lognormal(0.0, 1.0, size=(shape[0],) + (1,) * (len(shape) - 1))
    return (rng.laplace(size=shape) * scale * 1e-3).astype(np.float32)


def gradient(numel: int, seed: int = 0) -> np.ndarray:
    """Return ``numel`` float32 values drawn as :func:`conv_gradient` draws them, flat."""
    channels = max(1, -(-numel // _CHANNEL))
    return conv_gradient((channels, 512, 3, 3), seed).reshape(-1)[:numel].copy()


def _ring_width(bound: int) -> int:
    # One rank's codes in [-bound, bound] as unsigned offsets: ceil(log2(2*bound + 1)) bits.
    return math.ceil(math.log2(2 * bound + 1))


def one_rank_round_trip(codec, x: np.ndarray):
    """Return (encode, decode, wire_bytes) closures for one rank of ``codec``.

    They run the kernels ``CompressedComm`` runs for one rank's share of an all-reduce.
    For byte-payload codecs these are encode/decode. For the summable codecs the
    wire is the codes bit-packed at the ring's first-step width (plus the shared
    scale indices for multi-scale); for signSGD, one sign bit per element.
    ``decode`` returns what this rank alone would get back; ``wire_bytes`` is valid
    after ``encode`` has run.
    """
    alone = kind_of(codec).alone
    if alone is not None:  # a kind that says what one rank's share is (low_rank)
        return alone(codec, x)
    if hasattr(codec, "encode"):  # a payload of its own (sum, majority, gather)
        state = {}

        def enc():
            state["p"] = codec.encode(x)

        def dec():
            return codec.decode(state["p"])

        return enc, dec, lambda: state["p"].size

    # QSGD's codes: what the ring sends of them.
    width = _ring_width(codec.bound)
    multiscale = hasattr(codec, "scale_index")
    sparse = hasattr(codec, "coordinates")
    state = {}

    def enc():
        norm = codec.local_norms(x)
        extra = (codec.scale_index(x, norm),) if multiscale else ()
        codes = codec.quantize(x, norm, *extra, step=0, stream=0)
        # The ring's first step: codes shifted into [0, 2*bound] and packed by one kernel.
        k = backend_of(codes, codec.kernels)
        packed = k.xp.empty(packed_size(codes.size, width), np.uint8)
        k.bits.pack_shifted(codes, codec.bound, width, packed)
        state.update(norm=norm, extra=extra, packed=packed, ncodes=codes.size)

    def dec():
        # As reduce_integer: the packed sums go straight to the codec, unpacked as it reads.
        packed = (state["packed"], state["ncodes"], width, codec.bound)
        at = {"step": 0} if sparse else {}
        return codec.dequantize_packed(*packed, state["norm"], *state["extra"], shape=x.shape, **at)

    def wire():
        index_bytes = state["ncodes"] * codec.index_bits / 8 if multiscale else 0
        return state["packed"].size + index_bytes + 4 * state["norm"].size

    return enc, dec, wire


def measure_speed(codec, numel: int = SPEED_NUMEL, reps: int = 3) -> Speed:
    """Return ``codec``'s speed on this rank: medians of ``reps`` one-rank encodes and
    decodes of a synthetic gradient of ``numel`` elements after a warm-up (what
    ``mpicomp bench`` times, on ``codec``'s kernel backend), and its payload bits."""
    if not codec.compresses:
        return UNCOMPRESSED
    x = gradient(numel)
    enc, dec, wire = one_rank_round_trip(codec, x)
    t_enc = median_seconds(enc, reps)
    t_dec = median_seconds(dec, reps)
    return Speed(t_enc / numel, t_dec / numel, 8 * wire() / numel)


def measured_speeds(comm, codecs, numel: int = SPEED_NUMEL, *, timeout=None) -> dict[str, Speed]:
    """Return the speeds of ``codecs`` measured on every rank, the slowest rank's
    (collective: every rank passes the same codecs)."""
    from mpi4py import MPI

    out = {}
    for codec in codecs:
        s = measure_speed(codec, numel)
        worst = np.empty(2)
        # Waits for every rank's compile and timing (seconds on a cold cache): no expiry.
        plain.allreduce(
            comm, np.array([s.encode, s.decode]), worst, MPI.MAX, timeout=no_expiry(timeout)
        )
        out[codec_key(codec)] = Speed(float(worst[0]), float(worst[1]), s.bits)
    return out


# -- the model -------------------------------------------------------------------------


def measure(comm, node, codecs=(), numel: int = SPEED_NUMEL, *, timeout=None) -> Model:
    """Return the model of ``comm`` measured now (collective): the network within a host
    on ``node`` (all hosts at once), between hosts on one rank per host (with
    MPI_Allreduce's efficiency there), and the speed of every codec of ``codecs`` (the
    slowest rank's).

    One host: ``inter`` is ``intra``. One rank per host: ``intra`` is ``inter``."""
    from mpi4py import MPI

    timeout = resolve_timeout(timeout)
    within = {"timeout": timeout}
    topo = topology(comm, node, **within)
    if topo.hosts == 1:
        intra = inter = measure_network(comm, **within) or Network(0.0, 1e12)
        factor = measure_mpi_allreduce(comm, inter, **within)
    else:
        color = 0 if node.Get_rank() == 0 else MPI.UNDEFINED
        leaders = split(comm, color, comm.Get_rank(), timeout=timeout, name="hosts")
        inter, factor = None, None
        if leaders != MPI.COMM_NULL:
            inter = measure_network(leaders, **within)
            factor = measure_mpi_allreduce(leaders, inter, **within)
            leaders.Free()
        # Rank 0 leads its host.
        inter, factor = plain.bcast_object(comm, (inter, factor), 0, **within)
        intra = measure_network(node, **within) if topo.per_host > 1 else None
        intra = plain.bcast_object(comm, intra, 0, **within) or inter
    model = Model(intra, inter, source="measured", mpi_allreduce=factor)
    return model.with_speeds(measured_speeds(comm, codecs, numel, **within))


def resolve(comm, node, codec, given=None, *, timeout=None) -> Model:
    """Return the model a ``CompressedComm(schedule="auto")`` of ``codec`` predicts with
    (collective): ``given`` (a ``Model`` or a file), else the file ``MPICOMP_MODEL``
    names, else the networks measured now; a speed it lacks for ``codec`` is measured
    now. Rank 0's model, on every rank.

    Raises:
        ValueError, TypeError, OSError: ``given`` or the file is not a model (on every
            rank, with rank 0's reason).
    """
    timeout = resolve_timeout(timeout)
    problem, model = None, None
    if comm.Get_rank() == 0:
        try:
            model = _given(given)
        except (ValueError, TypeError, OSError) as e:
            problem = e
    model, problem = plain.bcast_object(comm, (model, problem), 0, timeout=timeout)
    if problem is not None:
        raise problem
    if model is None:
        model = measure(comm, node, timeout=timeout)
    if codec.compresses and codec_key(codec) not in model.speeds:
        model = model.with_speeds(measured_speeds(comm, [codec], timeout=timeout))
    return plain.bcast_object(comm, model, 0, timeout=timeout)


def _slowest(comm, seconds: float, timeout) -> float:
    """Return the largest of every rank's ``seconds`` (collective)."""
    from mpi4py import MPI

    most = np.array([seconds])
    plain.allreduce(comm, MPI.IN_PLACE, most, MPI.MAX, timeout=timeout)
    return float(most[0])


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
