"""Which parameters a ``DistributedOptimizer`` wraps, checked on each rank, and what
differs among the ranks' parameters when they do not match.

``named`` turns ``named_parameters`` (or the optimizer's own parameters, named by
position) into checked (name, tensor) pairs; ``LAYOUT`` is the configuration field
whose digest (of ``describe_layout``) every rank compares; ``layout_differences``
names each parameter that differs, with its shape, dtype or requires_grad on every
rank, once the digests have differed.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

import torch

from mpicomp.call.config import Config
from mpicomp.collectives.agreement import allgather_json, disagreement, ranks_text
from mpicomp.torch.shared import kind

__all__ = ["LAYOUT", "describe_layout", "layout_differences", "named"]

#: The configuration field of the parameters' names, shapes and order (a digest).
LAYOUT = "parameter_names_and_shapes"
_SHOWN = 4  # differing parameters named in one message


def named(optimizer, named_parameters) -> list[tuple[str, torch.Tensor]]:
    """Return (name, parameter) for every parameter of ``optimizer``, checked."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if named_parameters is None:
        return [
            (f"group{g}.param{i}", p)
            for g, group in enumerate(optimizer.param_groups)
            for i, p in enumerate(group["params"])
        ]
    pairs = _pairs(named_parameters)
    tensors = check_unique(pairs)
    missing = [
        f"group{g}.param{i} {tuple(p.shape)}"
        for g, group in enumerate(optimizer.param_groups)
        for i, p in enumerate(group["params"])
        if id(p) not in tensors
    ]
    if missing:
        shown = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ValueError(
            f"{len(missing)} parameters of the optimizer are not in named_parameters "
            f"({shown}): pass model.named_parameters() of the model the optimizer trains"
        )
    mine = {id(p) for p in params}
    return [(n, p) for n, p in pairs if id(p) in mine]


_PAIRS = "named_parameters must be (name, tensor) pairs such as model.named_parameters()"


def _pairs(named_parameters) -> list[tuple[str, torch.Tensor]]:
    """Return ``named_parameters`` (pairs, or a dict of name -> tensor) as a list of
    pairs; a TypeError saying what was given instead."""
    if isinstance(named_parameters, torch.nn.Module):
        raise TypeError(f"{_PAIRS}; got {kind(named_parameters)}: pass its named_parameters()")
    if isinstance(named_parameters, str | bytes | torch.Tensor):
        hint = (
            f" (a codec? pass codec={named_parameters!r})"
            if isinstance(named_parameters, str)
            else ""
        )
        raise TypeError(f"{_PAIRS}; got {kind(named_parameters)}{hint}")
    if isinstance(named_parameters, Mapping):
        named_parameters = named_parameters.items()
    try:
        items = list(named_parameters)
    except TypeError:
        raise TypeError(f"{_PAIRS}; got {kind(named_parameters)}") from None
    pairs = []
    for item in items:
        if isinstance(item, torch.Tensor):
            raise TypeError(
                f"{_PAIRS}; got {kind(item)} (model.parameters() has no names: pass "
                "model.named_parameters(), or leave named_parameters out to name the "
                "optimizer's parameters by position)"
            )
        if not (
            isinstance(item, tuple | list)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], torch.Tensor)
        ):
            raise TypeError(f"{_PAIRS}; got an item {kind(item)}")
        pairs.append((item[0], item[1]))
    return pairs


def layout_differences(mpi, config: Config, named: list, timeout) -> str:
    """Return, on every rank, what differs among the ranks' parameters (each one named,
    with its shape, dtype or requires_grad on every rank) and other fields of
    ``config``. Collective: every rank's names and traits go to every rank, once the
    digests have differed."""
    fields = {k: v for k, v in config.fields.items() if k not in (LAYOUT, "parameters")}
    mine = {"fields": fields, "parameters": [[n, *_traits(p)] for n, p in named]}
    every = allgather_json(mpi, mine, timeout)
    parts = []
    for key in fields:
        groups = _ranks_by(json.dumps(e["fields"].get(key)) for e in every)
        if len(groups) > 1:
            parts.append(f"{key}: " + ", ".join(f"{v} on {r}" for v, r in groups))
    traits = [{n: (tuple(sh), dt, rg) for n, sh, dt, rg in e["parameters"]} for e in every]
    names = dict.fromkeys(n for e in every for n, *_ in e["parameters"])
    differ = []
    for name in names:
        theirs = [t.get(name) for t in traits]
        present = [t for t in theirs if t is not None]
        # The first trait that differs among the ranks holding it (or the shape, where
        # some ranks lack it): "shape (4, 3) on rank 0, (5, 3) on rank 1".
        at = next((i for i in range(3) if len({t[i] for t in present}) > 1), None)
        if at is None and len(present) == len(theirs):
            continue
        at = at or 0
        label = _TRAITS[at]
        sides, said = [], False
        for value, ranks in _ranks_by(None if t is None else t[at] for t in theirs):
            if value is None:
                sides.append(f"absent on {ranks}")
            else:
                sides.append(f"{'' if said else label + ' '}{value} on {ranks}")
                said = True
        differ.append(f"parameter {name!r}: " + ", ".join(sides))
    orders = [[n for n, *_ in e["parameters"]] for e in every]
    rows = enumerate(zip(*orders, strict=False))  # up to the shortest list
    at = next((i for i, row in rows if len(set(row)) > 1), None)
    if not differ and at is not None:  # the same names and shapes, in another order
        sides = ", ".join(f"{n!r} on {r}" for n, r in _ranks_by(o[at] for o in orders))
        differ.append(f"the same parameters in another order: at position {at}, {sides}")
    more = [f"and {len(differ) - _SHOWN} more parameters"] if len(differ) > _SHOWN else []
    # Digests that differ where nothing shown does: the fields, as check_same names them.
    return "; ".join(parts + differ[:_SHOWN] + more) or disagreement(mpi, config.fields, timeout)


_TRAITS = ("shape", "dtype", "requires_grad")


def _traits(p: torch.Tensor) -> list:
    """A parameter's shape, dtype and requires_grad, as JSON (``layout_differences``)."""
    return [list(p.shape), str(p.dtype).removeprefix("torch."), bool(p.requires_grad)]


def describe_layout(named) -> str:
    """Return the text whose digest ranks compare: each parameter's name, shape, dtype
    and requires_grad, in order (``layout_differences`` names what differs)."""
    return "|".join(f"{n}:{tuple(p.shape)}:{p.dtype}:{p.requires_grad}" for n, p in named)


def _ranks_by(values) -> list[tuple]:
    """Return [(value, "rank 0" or "ranks 1-3")] for each distinct value, in rank order."""
    groups: dict = {}
    for rank, v in enumerate(values):
        groups.setdefault(v, []).append(rank)
    return [(v, ranks_text(r)) for v, r in groups.items()]


def check_unique(pairs) -> dict[int, str]:
    """Return {id(tensor): name} of (name, tensor) ``pairs``, refusing pairs that name a
    tensor twice or one name twice."""
    names: dict[str, int] = {}
    tensors: dict[int, str] = {}
    for n, p in pairs:
        if n in names:
            raise ValueError(f"named_parameters names {n!r} more than once")
        names[n] = id(p)
        if id(p) in tensors:
            raise ValueError(
                f"named_parameters holds one tensor under two names, {tensors[id(p)]!r} "
                f"and {n!r} (tied weights: name each tensor once, as "
                "model.named_parameters() does)"
            )
        tensors[id(p)] = n
    return tensors
