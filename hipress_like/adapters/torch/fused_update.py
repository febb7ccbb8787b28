"""``step()``'s fused update: PowerSGD's decode and ``torch.optim.SGD``'s step in one sweep.

Idea: when ``optimizer.step()`` runs the synchronization itself, the averaged
gradient of a PowerSGD layer is written by the decode and read straight back
by SGD, which reads and writes the momentum and the parameter in passes of its
own. Here ``synchronize`` arms those gradients (``compressors/powersgd/deferred.py``),
the decodes leave their factors, and ``step`` applies each with
``native.psgd_lowrank_sgd``: the gradient is still written (``p.grad`` holds
what it held), the parameter and the momentum buffer get ``_single_tensor_sgd``'s
bits (``tests/unit/test_fused_update.py`` compares them), and the layer costs
one sweep instead of four. The other parameters step as before, in the wrapped
optimizer's own ``step``, with the fused ones' gradients hidden for that call.

It applies only where nothing could tell the difference: the wrapped optimizer
is ``torch.optim.SGD`` itself (no subclass, no step hooks, the default
for-loop implementation: ``foreach`` and ``fused`` off, a float ``lr``, not
``differentiable``), the parameter and its gradient are contiguous float32 on
the CPU, the engine averaged into the gradient itself (no wire buffer, no
scale), and no closure. ``optimizer.synchronize()`` called by hand arms
nothing, so clipping between it and ``step()`` sees the decoded gradients as
always.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Sequence, Tuple

import torch
from torch.autograd.graph import increment_version
from torch.optim import optimizer as _torch_optimizer

from ...compressors.powersgd import deferred
from ...compressors.powersgd import native as _c

__all__ = ["eligible", "synchronize", "step", "write"]

Candidates = Dict[int, Tuple[torch.nn.Parameter, Dict[str, Any]]]


def _plain_sgd(opt: torch.optim.Optimizer) -> bool:
    """``opt`` steps exactly as ``torch.optim.SGD``'s for-loop: that class, no hooks."""
    base = type(opt).__bases__[-1]  # _wrapped: (mixin, the wrapped class)
    return (base is torch.optim.SGD
            and not getattr(opt, "_optimizer_step_pre_hooks", None)
            and not getattr(opt, "_optimizer_step_post_hooks", None)
            and not getattr(_torch_optimizer, "_global_optimizer_pre_hooks", None)
            and not getattr(_torch_optimizer, "_global_optimizer_post_hooks", None))


def _plain_group(group: Dict[str, Any]) -> bool:
    lr = group.get("lr")
    return (isinstance(lr, (int, float)) and not isinstance(lr, bool)
            and not group.get("foreach") and not group.get("fused")
            and not group.get("differentiable"))


def _f32_cpu(t: torch.Tensor) -> bool:
    return (t.device.type == "cpu" and t.dtype == torch.float32 and t.layout == torch.strided
            and t.is_contiguous())


def eligible(opt: torch.optim.Optimizer, params: Sequence[torch.nn.Parameter]
             ) -> Candidates:
    """The parameters among ``params`` (whose gradients the engine averages in place)
    that ``step`` may update in a fused sweep, keyed by their gradient's address."""
    if not _plain_sgd(opt):
        return {}
    group_of = {id(p): g for g in opt.param_groups if _plain_group(g) for p in g["params"]}
    out: Candidates = {}
    for p in params:
        g, group = p.grad, group_of.get(id(p))
        if group is None or g is None or not (_f32_cpu(p) and _f32_cpu(g)) or (
                g.numel() != p.numel()):
            continue
        buf = opt.state.get(p, {}).get("momentum_buffer")
        if group["momentum"] and buf is not None and not (
                _f32_cpu(buf) and buf.numel() == p.numel()):
            continue
        out[g.data_ptr()] = (p, group)
    return out


def synchronize(sync: Callable[[], bool], candidates: Candidates
                ) -> Tuple[bool, Dict[int, deferred.Factors]]:
    """``sync()`` with the candidates' decodes deferred; returns its result and the
    decodes it left (the caller applies them with ``step``, or writes them)."""
    keys = deferred.arm(p.grad for p, _ in candidates.values())
    try:
        ok = sync()
    except BaseException:
        deferred.release(keys)  # what was left, written as before
        raise
    return ok, deferred.take(keys)


def write(taken: Dict[int, deferred.Factors]) -> None:
    """Write the deferred decodes ``taken`` into their gradients, as the decode would
    have (a step that is skipped still leaves the averaged gradients)."""
    for f in taken.values():
        deferred.write(f)


def step(opt: torch.optim.Optimizer, candidates: Candidates,
         taken: Dict[int, deferred.Factors], inner: Callable[[], Any]) -> Any:
    """Apply the deferred decodes ``taken`` to their parameters in one sweep each, then
    ``inner()`` (the wrapped optimizer's step) for the rest; returns its result."""
    hidden: List[Tuple[torch.nn.Parameter, torch.Tensor]] = []
    try:
        for key, (p_fac, qt, out) in taken.items():
            prm, group = candidates[key]
            mom = group["momentum"]
            buf, init = None, False
            if mom:
                state = opt.state[prm]
                buf = state.get("momentum_buffer")
                if buf is None:  # the first step: torch clones the gradient into it
                    buf, init = torch.empty_like(prm, memory_format=torch.contiguous_format), True
            with torch.no_grad():
                _c.psgd_lowrank_sgd(p_fac, qt, out, prm, buf, lr=float(group["lr"]),
                                    momentum=mom, dampening=group["dampening"],
                                    weight_decay=group["weight_decay"],
                                    nesterov=group["nesterov"], maximize=group["maximize"],
                                    init=init)
            increment_version(prm)  # as param.add_ would: autograd sees the change
            if init:
                state["momentum_buffer"] = buf
            hidden.append((prm, prm.grad))
            prm.grad = None  # the wrapped step leaves it alone
        return inner()
    finally:
        for prm, g in hidden:
            prm.grad = g
