"""CompLL's unified compressor API (HiPress Sec. 4.1, Fig. 4).

Every algorithm is a small object with *explicit* state, in the spirit of
optax's ``GradientTransformation(init, update)``:

    state = c.init(grad, seed=0)           # explicit, may be {}
    payload, state = c.encode(grad, state) # payload: 1-D torch.uint8, self-describing
    out = c.decode(payload)                # same shape and dtype as grad
    merged = c.merge([p0, p1, ...])        # only if capabilities.aggregatable

Payloads are bytes only: a fixed little-endian header (dtype, shape,
algorithm id, body length; ``payload.py`` has the wire format) makes each
one self-describing, so any rank can decode it and a truncated, foreign or
wrong-version payload is rejected with a clear error.

Multi-round algorithms (PowerSGD's P then Q) declare ``capabilities.rounds``
> 1, the reduction of each round (``round_reductions``: sum, max or
broadcast) and which rounds merge by a plain sum (``summable``), and
implement ``encode_round``/``decode_rounds``; the scheduler runs each round.
The run reaches a compressor only through ``init``'s keywords
(``world_size``; ``shared_seed`` when ``capabilities.shared_randomness``;
``rank`` for broadcast rounds) and one documented state field, the per-step
shared seed (``STEP_SEED``).
Fast paths live in ``compressor.kernels`` (kernels.py). A compressor never
calls a transport.
"""
from __future__ import annotations

import contextlib
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Union

import torch

from ..errors import HipressError
from .kernels import Kernels, workspace
from .payload import (
    _DTYPES,
    HEADER_VERSION,
    Header,
    PayloadError,
    PayloadPool,
    check_body_nbytes,
    header_nbytes,
    pack_payload,
    unpack_fields,
    unpack_payload,
)

__all__ = [
    "HEADER_VERSION",
    "decode_output",
    "all_finite",
    "workspace",
    "assume_finite",
    "view_as_dtype",
    "accumulator_dtype",
    "accumulate_",
    "CATEGORIES",
    "Capabilities",
    "Round",
    "REDUCTIONS",
    "STEP_SEED",
    "CONTRIBUTORS",
    "step_seed",
    "mix_seed",
    "Compressor",
    "PayloadError",
    "PayloadPool",
    "State",
    "check_gradient",
    "NonFiniteError",
    "pack_payload",
    "unpack_payload",
    "header_nbytes",
    "unpack_fields",
    "check_body_nbytes",
]


State = Dict[str, Any]

CATEGORIES = ("none", "quantization", "sparsification", "lowrank")




REDUCTIONS = ("sum", "max", "broadcast")


@dataclass(frozen=True)
class Round:
    """One communication round, as ``Capabilities.per_round`` reports it.

    Attributes:
        reduction: how the round's payloads combine across ranks: "sum",
            "max" (THC's range exchange) or "broadcast" (one owner rank's
            payload goes to all, AR-Topk's indices).
        summable: the payloads reduce elementwise, in place, through
            ``kernels.summable_view(payload)`` with ``reduction`` (keep the
            header, reduce the bodies), so the engine may reduce them with
            one allreduce of the view.
    """

    reduction: str = "sum"
    summable: bool = False


@dataclass(frozen=True)
class Capabilities:
    """What a compressor is and what the engine must do for it, declared, never inferred.

    Strategies and the engine read these at setup; nothing is detected from
    method overrides, names or state keys. The flags come in four groups,
    by what they are for.

    What the compressor does to the values (HiPress Table 3, the cost model):
        category: one of "none", "quantization", "sparsification", "lowrank"
            (HiPress Table 3 groups alpha/beta/gamma by this). "none" (the
            default) means the values travel as they are, so the engine's
            default size rule and ``plan="auto"`` keep such gradients on the
            allreduce lane; a compressor that saves bytes must declare its
            category.
        unbiased: E[decode(encode(g))] == g.

    How payloads travel and combine (the strategies, ``casync``):
        aggregatable: payloads can be summed with ``merge`` without decoding
            (homomorphic: identity, PowerSGD's P/Q, THC).
        fixed_size: payload size depends only on the number of elements
            (``payload_nbytes`` is exact); False for data-dependent sizes.
        merge_widens: ``merge`` of n payloads may return a larger payload than
            its inputs (integers widened to hold the sum, THC-style); its size
            is ``kernels.merged_nbytes(nbytes, n)``. False: the merged payload
            has the inputs' layout and size.

    The rounds (``rounds.py``; one ``Round`` record per round in ``per_round``):
        rounds: number of communication rounds per synchronisation.
        round_reductions: per round (``len == rounds``), ``Round.reduction``;
            default "sum" for every round.
        summable: per round (``len == rounds``), ``Round.summable``; default
            False for every round. Implies ``aggregatable``; a broadcast
            round cannot be.
        shared_randomness: encode draws randomness that must be equal on every
            rank (PowerSGD's first Q): the engine passes ``shared_seed`` to
            ``init`` (``Compressor.init`` says how).
        own_decode: a multi-round compressor whose rank's own last-round
            payload, merged alone, decodes (``decode_rounds``, not averaged)
            to that rank's own compressed gradient, as THC's X_i (THC Alg. 3
            l. 22). Error feedback then keeps each rank's own compression
            error and automatic wrapping applies; without it the residual is
            taken against the decoded average.
        absent_rounds: a multi-round compressor a rank may sit a step out of
            (partial aggregation, ``hipress_like.partial``): ``absent_round`` gives
            that rank, from each round's aggregate of the others' payloads,
            the state with which ``decode_rounds`` decodes the last one (THC:
            the merged range). Single-round payloads decode without state,
            so they need no declaration.

    The state (checkpoints, error feedback):
        stateful: encode reads/writes per-gradient state (error feedback,
            momentum, warm start); such state must be checkpointed.
        keeps_memory: the compressor keeps its own error memory / residual
            (error feedback, DGC, GradDrop, PowerSGD); wrapping it in error
            feedback adds a second one, so automatic wrapping skips it.

    The input (``casync.nonfinite``, issue 50):
        checks_finite: ``encode`` (and round 0 of ``encode_round``) finds
            NaN/Inf in the pass that already reads every value (a native or
            fused kernel) and raises ``NonFiniteError`` even inside
            ``assume_finite``, so the engine skips its own scan of the
            gradient. The compressor raises before it changes the state it
            was given, or the engine's undo copy restores it.
    """

    category: str
    unbiased: bool = False

    aggregatable: bool = False
    fixed_size: bool = True
    merge_widens: bool = False

    rounds: int = 1
    round_reductions: Tuple[str, ...] = ()
    summable: Tuple[bool, ...] = ()
    shared_randomness: bool = False
    own_decode: bool = False
    absent_rounds: bool = False

    stateful: bool = False
    keeps_memory: bool = False

    checks_finite: bool = False

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category must be one of {CATEGORIES}, got {self.category!r}")
        if isinstance(self.rounds, bool) or not isinstance(self.rounds, int) or self.rounds < 1:
            raise ValueError(f"rounds must be an integer >= 1, got {self.rounds!r}")
        # defaults: one "sum" and one False per round, so existing declarations hold
        if not self.round_reductions:
            object.__setattr__(self, "round_reductions", ("sum",) * self.rounds)
        if not self.summable:
            object.__setattr__(self, "summable", (False,) * self.rounds)
        object.__setattr__(self, "round_reductions", tuple(self.round_reductions))
        object.__setattr__(self, "summable", tuple(bool(x) for x in self.summable))
        for field_name in ("round_reductions", "summable"):
            v = getattr(self, field_name)
            if len(v) != self.rounds:
                raise ValueError(f"{field_name} must have one entry per round ({self.rounds}), "
                                 f"got {v!r}")
        bad = [r for r in self.round_reductions if r not in REDUCTIONS]
        if bad:
            raise ValueError(f"round_reductions must be among {REDUCTIONS}, got {bad!r}")
        if any(s and r == "broadcast" for s, r in zip(self.summable, self.round_reductions)):
            raise ValueError("a broadcast round has no elementwise reduction: it cannot be "
                             "summable")
        if any(self.summable) and not self.aggregatable:
            raise ValueError("summable rounds merge without decoding: declare aggregatable=True")
        if self.merge_widens and not self.aggregatable:
            raise ValueError("merge_widens describes merge: declare aggregatable=True")
        if self.own_decode and self.rounds == 1:
            raise ValueError("own_decode describes a multi-round compressor (a single-round "
                             "payload always decodes alone)")
        if self.keeps_memory and not self.stateful:
            raise ValueError("a compressor that keeps memory is stateful: declare stateful=True")

    @property
    def per_round(self) -> Tuple[Round, ...]:
        """One ``Round`` record (reduction, summable) per round, in order."""
        return tuple(Round(r, s) for r, s in zip(self.round_reductions, self.summable))

    @property
    def all_summable(self) -> bool:
        """Every round's payloads merge by an in-place sum of their summable view."""
        return all(self.summable)






def all_finite(x: torch.Tensor) -> bool:
    """True when ``x`` holds no NaN and no Inf, in one allocation-free pass.

    A NaN or Inf makes the sum NaN or Inf, so a finite sum proves every
    entry finite: one vectorised reduction (~1.5 ms for 16 M floats here)
    instead of ``isfinite(x).all()`` (~45 ms: it writes a bool tensor as
    large as a quarter of ``x``). Only a non-finite sum (a NaN/Inf, or
    finite values whose sum overflows) pays for the exact ``isfinite`` scan.
    """
    s = x.sum()
    if bool(torch.isfinite(s)):
        return True
    return bool(torch.isfinite(x).all())


class NonFiniteError(HipressError, ValueError):
    """A gradient holds NaN or Inf (``check_gradient``): a ``ValueError``, so callers
    that catch that keep working; the engine catches this one from a compressor
    that checks in its own first pass (``Capabilities.checks_finite``)."""


_vouch = threading.local()


@contextlib.contextmanager
def assume_finite(on: bool = True) -> Iterator[None]:
    """Within this block ``check_gradient(..., nonfinite="raise")`` skips its NaN/Inf scan.

    For a caller that has already scanned the tensors it passes to a
    compressor (the engine scans every submitted gradient once), so the
    compressor does not sweep them a second time. Kernels that notice a
    non-finite value on their own (the quantizers' max|x|) still raise,
    through ``nonfinite="always"``. Thread-local; nests.

    Args:
        on: False makes the block a no-op (convenient for conditional use).
    """
    prev = getattr(_vouch, "on", False)
    _vouch.on = prev or bool(on)
    try:
        yield
    finally:
        _vouch.on = prev


def check_gradient(grad: Any, *, nonfinite: str = "raise", name: str = "gradient") -> None:
    """Validate a tensor before compression; raise a clear error on bad input.

    Args:
        grad: the tensor to check.
        nonfinite: "raise" rejects NaN/Inf (unless inside ``assume_finite``);
            "always" rejects them even there; "ignore" skips the (costly) scan.
        name: how to call the tensor in messages.

    Raises:
        TypeError: not a tensor, or not a floating dtype we can encode.
        ValueError: empty tensor; ``NonFiniteError`` (a ``ValueError``) for
            NaN/Inf when ``nonfinite`` is "raise" or "always".
    """
    if not isinstance(grad, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, found {type(grad).__name__}")
    if grad.dtype not in _DTYPES:
        raise TypeError(
            f"{name}: expected a floating tensor (float32/float16/bfloat16/float64), "
            f"found {grad.dtype}; cast it with .float() before compressing"
        )
    if grad.numel() == 0:
        raise ValueError(f"{name}: empty tensor (shape {tuple(grad.shape)}) cannot be compressed")
    scan = nonfinite == "always" or (nonfinite == "raise" and not getattr(_vouch, "on", False))
    if scan and not all_finite(grad):
        raise NonFiniteError(
            f"{name}: contains NaN or Inf; fix the loss/learning rate, or configure "
            "nonfinite='skip' to drop such steps"
        )


class Compressor:
    """Base class of every CompLL algorithm: a single-round compressor.

    What an algorithm writes: ``encode`` and ``decode`` (payloads are 1-D
    uint8 tensors with the self-describing header of ``payload.py``),
    ``params`` (its constructor parameters), ``init`` when it keeps state
    beyond the default seed and step, and the class attributes ``name``,
    ``algo_id`` (a unique small int; the registry rejects a duplicate) and
    ``capabilities`` (declared: nothing is inferred from overrides). It
    validates its parameters in ``__init__`` with ``params.check_*``
    (``ParamTypeError``/``ParamError``). Optional: ``merge`` when it declares
    ``aggregatable``, ``payload_nbytes`` for an exact size (the default
    encodes a zero gradient of that size), ``detach_state`` for double
    buffering, and faster fused paths (decode-add, decode-div, the
    error-feedback residual, a summable view) in a ``kernels.Kernels``
    subclass named by ``kernels_class``; callers reach them as
    ``compressor.kernels``, whose defaults are built from ``decode``.

    The engine drives every compressor through the rounds protocol
    (``encode_round``, ``merge_round``, ``decode_rounds``); here it is the
    one round of ``encode``/``merge``/``decode``. Algorithms with several
    rounds (PowerSGD, AR-Topk, THC's range round, anything with a broadcast
    round) derive from ``rounds.MultiRoundCompressor`` instead, which holds
    the rest of that protocol. Wrappers (error feedback) derive from
    ``wrappers.wrapper.Wrapper``, which forwards all of it to the wrapped
    compressor.
    """

    name: str = "base"
    algo_id: int = 0
    capabilities: Capabilities = Capabilities("none")
    # the fast paths' class (kernels.py); built lazily as ``self.kernels``
    kernels_class: type = Kernels

    # -- state -----------------------------------------------------------
    def init(self, grad: torch.Tensor, seed: int = 0, *, world_size: int = 1,
             shared_seed: int = 0) -> State:
        """Return the initial explicit state for ``grad`` (default: just the RNG seed).

        This is how a compressor learns about the run; nothing is injected
        into its state afterwards. The engine calls it once per gradient,
        partition and site, on every rank, as
        ``init(grad, seed=s, world_size=N)``, adding ``shared_seed=S`` when
        ``capabilities.shared_randomness`` and ``rank=R`` when a round's
        reduction is "broadcast" (the owner must know itself); a compressor
        that needs one stores it in its state. Every override accepts
        ``world_size`` and ``shared_seed``; one with broadcast rounds also
        ``rank``.

        Args:
            grad: a tensor of the gradient's (partition's) shape and dtype.
            seed: this rank's seed (differs between ranks: stochastic rounding).
            world_size: N, the number of ranks whose payloads are merged
                (``decode_rounds(average=True)`` divides by it).
            shared_seed: a seed equal on every rank for this gradient and
                partition (derived from its name), constant over steps. For
                per-step draws read ``step_seed(state)``: the engine writes
                ``state[STEP_SEED]`` before each step's encodes.
        """
        return {"seed": int(seed), "step": 0}

    # -- single round ----------------------------------------------------
    def encode(self, grad: torch.Tensor, state: State) -> Tuple[torch.Tensor, State]:
        """Compress ``grad``; return (1-D uint8 payload, new state)."""
        raise NotImplementedError

    def decode(self, payload: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Decompress a payload into a tensor of the original shape and dtype.

        ``out`` (optional): a contiguous tensor of the original dtype and
        number of elements to write into instead of allocating (see
        ``decode_output``); the result is then a view of ``out``.
        """
        raise NotImplementedError

    def merge(self, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Sum payloads in the compressed domain (aggregatable compressors only).

        The order of ``payloads`` is the summation order; callers pass a fixed
        order (by rank) so every rank computes bitwise-identical sums.
        """
        raise TypeError(
            f"compressor {self.name!r} is not aggregatable: decode, sum, then encode instead"
        )

    # -- the payload framing (payload.py): the header around every body ----------
    def frame_payload(self, grad: torch.Tensor, extra: bytes, body_nbytes: int,
                      pool: Optional[PayloadPool] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """A new payload for ``grad`` with this algorithm's header written: (payload, body view).

        The header (``payload.py``) carries ``algo_id``, ``grad``'s dtype and
        shape, ``extra`` (the algorithm's fixed fields, zero-padded to 8
        bytes) and ``body_nbytes``; the encoder writes its compressed data
        into the returned body, a 1-D uint8 view of the payload (no copy).
        ``grad`` is the checked input (``check_gradient``), any shape.

        Args:
            grad: the gradient being encoded (dtype, shape, device).
            extra: the algorithm's fixed fields, packed (``struct``).
            body_nbytes: bytes of compressed data that follow the header.
            pool: take the bytes from this ``PayloadPool`` instead of a
                fresh allocation.

        Returns:
            (payload, body): the whole 1-D uint8 payload and its body view.
        """
        return pack_payload(self.algo_id, grad.dtype, tuple(grad.shape), extra, body_nbytes,
                            grad.device, pool)

    def unframe_payload(
        self, payload: torch.Tensor, fields: struct.Struct, body_nbytes: Callable[..., int],
        out: Optional[torch.Tensor] = None, detail: Union[str, Callable[..., str]] = "",
    ) -> Tuple[Header, Tuple[Any, ...], torch.Tensor, torch.Tensor]:
        """Check a payload of this algorithm; (header, extra fields, body, output buffer).

        The inverse of ``frame_payload``: parses the header (``unpack_fields``:
        magic, version, this ``algo_id``, ``fields`` at the start of the
        extra), checks the body has ``body_nbytes(header, *fields)`` bytes, and
        gives the buffer the decode writes into (``decode_output``: ``out``
        checked, or a new tensor of the header's shape and dtype). Views
        only: nothing is copied.

        Args:
            payload: a payload from this algorithm's ``encode``.
            fields: the ``struct`` layout of the algorithm's fixed fields
                (``struct.Struct("<")`` when it has none).
            body_nbytes: ``(header, *field values) -> int``, the body size
                the header (``numel``, ``dtype``) and the fields imply; it may
                raise ``PayloadError`` for field values out of range (checked
                before the size).
            out: optional preallocated result (``decode_output``).
            detail: appended to the size error (what the size was made of);
                a callable gets the field values.

        Returns:
            (header, field values, body view, output tensor in the header's shape).

        Raises:
            PayloadError: malformed, foreign or wrongly sized payload.
            ValueError: ``out`` does not fit the header (``decode_output``).
        """
        h, values = self.check_payload(payload, fields, body_nbytes, detail)
        return h, values, h.body, decode_output(h, out, payload.device)

    def check_payload(
        self, payload: torch.Tensor, fields: struct.Struct, body_nbytes: Callable[..., int],
        detail: Union[str, Callable[..., str]] = "",
    ) -> Tuple[Header, Tuple[Any, ...]]:
        """``unframe_payload`` without the output buffer: (header, extra fields).

        For paths that decode into a buffer of their own (a fused sum of many
        payloads); the arguments are ``unframe_payload``'s.

        Raises:
            PayloadError: malformed, foreign or wrongly sized payload.
        """
        h, values = unpack_fields(payload, self.algo_id, fields, self.name)
        expected = body_nbytes(h, *values)
        if h.body.numel() != expected:
            check_body_nbytes(h, expected, self.name,
                              detail(*values) if callable(detail) else detail)
        return h, values

    # -- fast paths: compressor.kernels (kernels.py) ---------------------------
    @property
    def kernels(self) -> Kernels:
        """This compressor's fast paths (``kernels.Kernels``; built once per instance)."""
        k = self.__dict__.get("_kernels")
        if k is None:
            k = self.__dict__["_kernels"] = self.kernels_class(self)
        return k

    def state_tensor(self, state: State, key: str, grad: torch.Tensor) -> torch.Tensor:
        """``state[key]``, a memory the compressor keeps shaped like ``grad`` (a
        residual, an error, DGC's velocity), checked before it is used.

        Raises:
            ValueError: missing, not a tensor, or of another shape (a state made
                for another gradient or partition).
        """
        t = state.get(key)
        if not isinstance(t, torch.Tensor) or t.shape != grad.shape:
            raise ValueError(
                f"{self.name}: state[{key!r}] must be a tensor of shape {tuple(grad.shape)}, "
                f"found {getattr(t, 'shape', type(t).__name__)}; create the state with "
                f"{type(self).__name__}.init(grad) for this gradient (or partition)")
        return t

    def detach_state(self, state: State, spare: Optional[State]) -> Optional[State]:
        """``state`` for a step that writes none of its tensors in place (double
        buffering): the caller may then keep ``state`` itself to undo the step
        (``casync.nonfinite``). ``spare``: a state of this compressor the caller
        discarded, whose buffers may be reused. None (the default): the step
        updates the state in place, so the caller copies it."""
        return None

    # -- the rounds protocol, for one round ---------------------------------
    def encode_round(
        self, r: int, grad: torch.Tensor, state: State, aggregate: Optional[torch.Tensor]
    ) -> Tuple[torch.Tensor, State]:
        """Payload of round ``r``; ``aggregate`` is the merged payload of round r-1.

        A single-round compressor has round 0 only: ``encode``.
        """
        if r == 0 and self.capabilities.rounds == 1:
            return self.encode(grad, state)
        raise NotImplementedError(f"{self.name} declares {self.capabilities.rounds} round(s); "
                                  "a multi-round compressor derives from "
                                  "rounds.MultiRoundCompressor and writes encode_round")

    def decode_rounds(
        self, grad: torch.Tensor, state: State, aggregate: torch.Tensor,
        out: Optional[torch.Tensor] = None, average: bool = False,
    ) -> Tuple[torch.Tensor, State]:
        """Turn the merged payload of the last round into the summed gradient (into ``out``).

        ``average=True`` returns the sum divided by ``state["world_size"]``
        (or 1 when the state does not hold it: ``init(world_size=...)``).
        """
        if self.capabilities.rounds == 1:
            res = self.decode(aggregate, out=out)
            if average:
                res.div_(int(state.get("world_size") or 1))
            return res, state
        raise NotImplementedError

    def merge_round(self, r: int, payloads: List[torch.Tensor]) -> torch.Tensor:
        """Reduce round ``r``'s payloads (one per rank, in rank order) by the
        round's declared reduction (``capabilities.round_reductions[r]``).

        The engine calls this wherever a multi-round compressor's round meets
        at one place: a CaSync-PS aggregator (all N payloads) or a Ring hop
        (two partial results). The default is ``merge`` (a sum). A "max"
        round returns the elementwise maximum; a "broadcast" round returns
        the owner's payload, which every compressor can recognise without
        its state: non-owners encode an empty contribution (``encode_round``
        knows the owner from shared information: the step seed, the previous
        round's aggregate), so the reduction keeps the one non-empty payload.
        Merging is associative and gives the same bytes in any grouping the
        workflows use.
        """
        return self.merge(payloads)

    # -- sizes -------------------------------------------------------------
    def payload_nbytes(self, numel: int, ndim: int = 1) -> int:
        """Exact payload size for a ``numel``-element float32 tensor of ``ndim`` dims.

        For data-dependent sizes (``capabilities.fixed_size`` False) this is an
        upper bound. The default encodes a zero gradient of that size, which is
        exact for a compressor whose payload size depends only on the shape;
        override it when that is not so or when encoding is costly.
        """
        if not self.capabilities.fixed_size:
            raise NotImplementedError(f"{self.name}: a payload of data-dependent size needs "
                                      "payload_nbytes (an upper bound) written by the algorithm")
        grad = torch.zeros((numel,) + (1,) * (ndim - 1), dtype=torch.float32)
        return int(self.encode(grad, self.init(grad))[0].numel())

    def compression_ratio(self, numel: int, itemsize: int = 4) -> float:
        """Payload bytes over original bytes (the ``r`` of HiPress Eq. 2)."""
        return self.payload_nbytes(numel) / float(numel * itemsize)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params().items()))
        return f"{type(self).__name__}({params})"

    def params(self) -> Dict[str, Any]:
        """Constructor parameters (for reprs, plans and checkpoints)."""
        return {}


# The one field the engine writes into a compressor's state, documented here:
# for a compressor declaring ``capabilities.shared_randomness``, before every
# step's first ``encode``/``encode_round`` of a gradient partition, the engine
# sets ``state[STEP_SEED]`` to an int in [0, 2**31) that is equal on every
# rank for that partition and step and differs between steps (it mixes the
# partition's shared seed with the engine's step count, which checkpoints
# carry, so a resumed run draws what an uninterrupted one would).
STEP_SEED = "step_seed"
# Partial aggregation (``hipress_like.partial``) sets ``state[CONTRIBUTORS]`` before a
# step's rounds: how many ranks' payloads that step's merged aggregates hold,
# when fewer than ``world_size`` contributed. Absent, every rank did.
CONTRIBUTORS = "contributors"


def step_seed(state: State) -> int:
    """This step's shared seed: ``state[STEP_SEED]`` when the engine set it, else
    a mix of the state's ``shared_seed`` and ``step`` (for calls outside the
    engine, e.g. tests and benchmarks that drive a compressor by hand)."""
    v = state.get(STEP_SEED)
    if v is not None:
        return int(v)
    return mix_seed(int(state.get("shared_seed", 0)), int(state.get("step", 0)))


def mix_seed(seed: int, step: int) -> int:
    """A well-spread 31-bit seed from (``seed``, ``step``): SplitMix64's finaliser
    (Steele et al., "Fast splittable pseudorandom number generators", 2014)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFF


def decode_output(h: Header, out: Optional[torch.Tensor], device: Any) -> torch.Tensor:
    """The buffer a ``decode`` writes into: ``out`` checked against header ``h``, or a new one.

    A fresh large tensor can cost more in page faults than the decode
    itself, so callers that decode every step (the engine)
    pass the gradient's own storage. ``out`` may have any shape with the
    header's number of elements; the result is viewed in the header's shape.

    Raises:
        ValueError: ``out`` has another dtype, element count or device, or is
            not contiguous.
    """
    if out is None:
        return torch.empty(h.shape, dtype=h.dtype, device=device)
    if out.numel() != h.numel or out.dtype != h.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {h.dtype} tensor of {h.numel} elements "
                         f"(shape {tuple(h.shape)}), found {out.dtype} {tuple(out.shape)}"
                         f"{'' if out.is_contiguous() else ' (not contiguous)'}")
    if out.device != torch.device(device):
        raise ValueError(f"out is on {out.device}, the payload on {device}")
    return out if tuple(out.shape) == tuple(h.shape) else out.view(h.shape)


def view_as_dtype(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """View uint8 bytes as ``dtype``; copy first when the bytes are not aligned for it.

    A payload sliced out of a larger receive buffer may start at any byte
    offset, and ``Tensor.view(dtype)`` refuses misaligned storage.
    """
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.clone().view(dtype)


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of compressor memories: float64 stays float64, everything else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def accumulate_(buf: torch.Tensor, grad: torch.Tensor, scale: float = 1.0,
                weight: float = 1.0) -> torch.Tensor:
    """``buf = scale * buf + weight * grad`` as a flat tensor, in ``buf`` when it can be.

    Compressor states own their accumulators (error feedback's memory, DGC's
    ``u``/``v``, GradDrop's residual, PowerSGD's error); updating them in
    place avoids a fresh allocation per step, whose page faults cost more
    than the addition. A buffer that is not a contiguous accumulator-dtype
    tensor (e.g. a state loaded with another dtype) gets a new one.
    """
    acc = accumulator_dtype(grad.dtype)
    g = grad.detach().reshape(-1)
    if buf.dtype == acc and buf.is_contiguous():
        flat = buf.view(-1)
        if weight == 1.0:
            return flat.add_(g) if scale == 1.0 else torch.add(g, flat, alpha=scale, out=flat)
        if scale != 1.0:
            flat.mul_(scale)
        return flat.add_(g, alpha=weight)
    return buf.reshape(-1).to(acc) * scale + g.to(acc) * weight
