"""What a call costs, so ``schedule="auto"`` can choose: the cost model (``cost``: messages
and bytes into seconds), the network and codec speeds it uses (``measured``: a ``Model``,
given or read from a file) and their measurement on the job's own ranks (``probe``).

``CompressedComm(model=...)`` takes a ``Model``; :func:`predict` and :func:`choose` are
what ``schedule="auto"`` runs (docs/collectives.md, "Choosing a schedule").
"""

from mpicomp.model.cost import Cost, Network, Topology, choose, predict, schedules_of
from mpicomp.model.measured import MODEL_ENV, Model, Speed

__all__ = [
    "MODEL_ENV",
    "Cost",
    "Model",
    "Network",
    "Speed",
    "Topology",
    "choose",
    "predict",
    "schedules_of",
]
