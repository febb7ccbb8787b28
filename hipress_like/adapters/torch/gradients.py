"""Gradient bookkeeping for DistributedOptimizer: parameter names and sparse gradients.

``resolve_names`` validates ``named_parameters`` the way Horovod does
(duplicates and unnamed parameters are errors; ``None`` gives positional
names). ``sparse_average`` reduces a sparse gradient (``nn.Embedding(sparse=
True)``) by allgathering its indices and values, which is what sparse
gradients need instead of compression.
"""
from __future__ import annotations

from typing import Any, Dict, List, Tuple

import torch

from ..collectives import _allgather_uint8

__all__ = ["resolve_names", "sparse_average"]


def sparse_average(grad: torch.Tensor, name: str, average: bool) -> torch.Tensor:
    """Allgather a sparse gradient's indices and values; sum (and average) them."""
    import torch.distributed as dist

    g = grad.coalesce()
    idx = _allgather_uint8(_as_bytes(g.indices()), f"sparse gradient {name!r}")
    val = _allgather_uint8(_as_bytes(g.values()), f"sparse gradient {name!r}")
    indices = torch.cat([_from_bytes(b, g.indices().dtype, (g.indices().shape[0], -1))
                         for b in idx], dim=1)
    values = torch.cat([_from_bytes(b, g.values().dtype, (-1,) + tuple(g.values().shape[1:]))
                        for b in val])
    out = torch.sparse_coo_tensor(indices, values, g.shape, check_invariants=False).coalesce()
    return out / dist.get_world_size() if average else out


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    return b.clone().view(dtype).reshape(shape)


def resolve_names(params: List[torch.Tensor], named_parameters: Any,
                   param_groups: List[Dict[str, Any]]) -> Dict[int, str]:
    """id(p) -> name, validated like Horovod."""
    if named_parameters is None:
        return {id(v): f"allreduce.noname.{i}.{j}" for i, g in enumerate(param_groups)
                for j, v in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("named_parameters should be a sequence of tuples (name, parameter), "
                         "usually produced by model.named_parameters()")
    seen, dups = set(), []
    for k, _ in named:
        if k in seen:
            dups.append(str(k))
        seen.add(k)
    if dups:
        raise ValueError("Parameter names in named_parameters must be unique. Found "
                         f"duplicates: {', '.join(sorted(set(dups)))}")
    names = {id(v): str(k) for k, v in named}
    unnamed = [p for p in params if id(p) not in names]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were not "
            f"named ({len(unnamed)} of {len(params)}, shapes "
            f"{[tuple(p.shape) for p in unnamed[:5]]}). Pass model.named_parameters() of the "
            "model the optimizer was built from, or named_parameters=None")
    return names
