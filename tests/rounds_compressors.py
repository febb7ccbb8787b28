"""Two small multi-round compressors that exercise the engine's round seams.

They are real algorithms, cut down to what the seams need, so the engine's
routing can be checked against a hand computation:

* ``RangeQuant`` (rounds: max, then sum): round 0 reduces every rank's
  max|x| to the global range (THC's range round, THC Alg. 1 lines 2-4);
  round 1 sends integer levels ``floor(x / range * L + u)`` with a dither
  ``u`` drawn from the engine's per-step shared seed (equal on every
  rank), summed exactly as integers in float32.
* ``OwnerTopk`` (rounds: broadcast, then sum): round 0 broadcasts the
  owner rank's top-k indices (owner = the step seed mod N, as STAR-Topk's
  i mod N, AR-Topk Alg. 1); non-owners send an empty payload and the
  reduction keeps the one non-empty payload; round 1 sums every rank's
  values at those indices.

Both record the step seeds they saw in their state (``seen``), so tests can
check that every rank drew the same one and that it changes per step.
"""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from hipress_like.casync.engine import Engine, EngineConfig
from hipress_like.compressors.base import Capabilities, State, step_seed
from hipress_like.compressors.kernels import Kernels
from hipress_like.compressors.payload import pack_payload, unpack_payload
from hipress_like.compressors.rounds import MultiRoundCompressor
from hipress_like.cost_model.plan import Plan, SizeRule

LEVELS = 7
SHAPES = [(24, 10), (7, 3), (2, 40), (301,)]  # (2, 40): fewer rows than ranks


def grads_of(rank: int):
    """Rank ``rank``'s gradients (one per shape of ``SHAPES``)."""
    g = torch.Generator().manual_seed(70 + rank)
    return {f"w{i}": torch.randn(s, generator=g) for i, s in enumerate(SHAPES)}


def run_rounds(tr, comp, strategy: str, k: int = 1, steps: int = 2,
               raw_collective: bool = False, threads: bool = True, collective=None):
    """Synchronise ``grads_of(rank)`` for ``steps`` steps with every gradient
    compressed by ``comp`` in up to ``k`` partitions (travelling by
    ``collective``, ``EngineConfig.collective``); return (the averages of each
    step, the layout, the compressor states)."""
    plan = Plan(compressor="identity", rule=SizeRule(min_compress_bytes=0, bytes_per_partition=1,
                                                     max_partitions=k))
    eng = Engine(tr, EngineConfig(compressor=comp, plan=plan, strategy=strategy, timeout=30,
                                  raw_collective=raw_collective, threads=threads,
                                  collective=collective))
    try:
        gs = grads_of(tr.rank)
        eng.register([(n, tuple(v.shape), v.dtype) for n, v in gs.items()])
        outs = []
        for _ in range(steps):
            work = {n: v.clone() for n, v in gs.items()}
            for n, v in work.items():
                eng.submit(n, v)
            eng.synchronize()
            outs.append(work)
        return outs, eng.layout(), eng.state_dict()["states"]
    finally:
        eng.close()


class _BodyView(Kernels):
    """The summable view: the body as float32 (header kept)."""

    def summable_view(self, payload: torch.Tensor) -> Optional[torch.Tensor]:
        h = unpack_payload(payload)
        return h.body.view(torch.float32) if h.body.numel() % 4 == 0 else None


def _payload(algo: int, x: torch.Tensor, body: torch.Tensor) -> torch.Tensor:
    raw = body.reshape(-1).contiguous().view(torch.uint8)
    p, b = pack_payload(algo, torch.float32, tuple(x.shape), b"", raw.numel())
    b.copy_(raw)
    return p


def dither(seed: int, n: int) -> torch.Tensor:
    """The shared dither of a step: uniform [0, 1) from ``seed``."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


def levels(x: torch.Tensor, rng: float, seed: int) -> torch.Tensor:
    """RangeQuant's integer levels of ``x`` for the global range ``rng``."""
    return torch.floor(x.reshape(-1).float() / rng * LEVELS + dither(seed, x.numel()))


class RangeQuant(MultiRoundCompressor):
    """Range round (max) then dithered levels (sum); see the module docstring."""

    name = "test-rangequant"
    algo_id = 251
    kernels_class = _BodyView
    capabilities = Capabilities("quantization", aggregatable=True, rounds=2, stateful=True,
                                round_reductions=("max", "sum"), summable=(True, True),
                                shared_randomness=True)

    def init(self, grad, seed=0, *, world_size=1, shared_seed=0) -> State:
        return {"seed": seed, "world_size": world_size, "shared_seed": shared_seed, "seen": []}

    def encode_round(self, r: int, grad: torch.Tensor, state: State,
                     aggregate: Optional[torch.Tensor]) -> Tuple[torch.Tensor, State]:
        if r == 0:
            m = grad.detach().abs().max().float().reshape(1)
            return _payload(self.algo_id, grad, m), state
        rng = float(unpack_payload(aggregate).body.view(torch.float32)[0])
        s = step_seed(state)
        lv = levels(grad, max(rng, 1e-30), s)
        return _payload(self.algo_id, grad, lv), {**state, "range": rng,
                                                  "seen": [*state["seen"], s]}

    def merge_round(self, r: int, payloads: List[torch.Tensor]) -> torch.Tensor:
        out = payloads[0].clone()
        acc = unpack_payload(out).body.view(torch.float32)
        for p in payloads[1:]:
            v = unpack_payload(p).body.view(torch.float32)
            torch.maximum(acc, v, out=acc) if r == 0 else acc.add_(v)
        return out

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        return self.merge_round(1, payloads)

    def decode_rounds(self, grad, state, aggregate, out=None, average=False):
        lv = unpack_payload(aggregate).body.view(torch.float32)
        res = (lv * (max(state["range"], 1e-30) / LEVELS)).view(grad.shape)
        if average:
            res = res / state["world_size"]
        if out is not None:
            out.copy_(res.to(out.dtype))
            res = out
        return res, state

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        return 2 * (16 + 8 * ndim) + 4 + 4 * numel


class OwnerTopk(MultiRoundCompressor):
    """The owner's top-k indices (broadcast) then values at them (sum)."""

    name = "test-ownertopk"
    algo_id = 252
    kernels_class = _BodyView
    capabilities = Capabilities("sparsification", aggregatable=True, rounds=2, stateful=True,
                                fixed_size=False, round_reductions=("broadcast", "sum"),
                                summable=(False, True), shared_randomness=True)

    def __init__(self, ratio: float = 0.25):
        self.ratio = ratio

    def params(self):
        return {"ratio": self.ratio}

    def init(self, grad, seed=0, *, world_size=1, shared_seed=0, rank=0) -> State:
        return {"seed": seed, "world_size": world_size, "rank": rank, "seen": []}

    @staticmethod
    def owner(state: State) -> int:
        """STAR-Topk's owner: the step's shared seed mod N."""
        return step_seed(state) % state["world_size"]

    def encode_round(self, r, grad, state, aggregate):
        flat = grad.detach().reshape(-1).float()
        if r == 0:
            s = step_seed(state)
            state = {**state, "seen": [*state["seen"], s]}
            if self.owner(state) != state.get("rank"):
                return _payload(self.algo_id, grad, torch.empty(0, dtype=torch.int64)), state
            k = max(1, math.ceil(self.ratio * flat.numel()))
            idx = torch.sort(torch.topk(flat.abs(), k).indices).values
            return _payload(self.algo_id, grad, idx), state
        idx = unpack_payload(aggregate).body.view(torch.int64)
        return _payload(self.algo_id, grad, flat[idx]), {**state, "idx": idx.clone()}

    def merge_round(self, r, payloads):
        if r == 1:
            out = payloads[0].clone()
            acc = unpack_payload(out).body.view(torch.float32)
            for p in payloads[1:]:
                acc.add_(unpack_payload(p).body.view(torch.float32))
            return out
        full = [p for p in payloads if unpack_payload(p).body.numel()]
        if len(full) > 1:
            raise ValueError("two owners in one broadcast round")
        return full[0] if full else payloads[0]

    def merge(self, payloads):
        return self.merge_round(1, payloads)

    def decode_rounds(self, grad, state, aggregate, out=None, average=False):
        vals = unpack_payload(aggregate).body.view(torch.float32)
        res = torch.zeros(grad.numel(), dtype=torch.float32)
        res[state["idx"]] = vals / (state["world_size"] if average else 1)
        res = res.view(grad.shape)
        if out is not None:
            out.copy_(res.to(out.dtype))
            res = out
        return res, state

    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        return 2 * (16 + 8 * ndim) + 12 * max(1, math.ceil(self.ratio * numel))
