"""What partial aggregation is asked to do: ``Quorum``, and the compressors it takes.

A user writes ``DistributedOptimizer(stragglers=Quorum(fraction=0.75))``: a
step may close once ceil(fraction * N) ranks contributed (THC Sec. 8.3,
../shared/papers/000_43c153e10c254c2a.txt, waits for the top 90%), and
what the missing ranks count as. The lane that carries it out is
``partial.lane``; these settings are compared across ranks there, and a
multi-round compressor must be able to sit a step out
(``capabilities.absent_rounds``) to take part.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

from ..compressors.base import Compressor
from ..compressors.params import check_int, check_real

__all__ = ["Quorum", "MISSING", "check_compressor"]

MISSING = ("rescale", "zeros")


@dataclasses.dataclass(frozen=True)
class Quorum:
    """Partial aggregation settings (``DistributedOptimizer(stragglers=Quorum(...))``).

    Attributes:
        fraction: a step may close once ceil(fraction * N) ranks contributed
            (THC Sec. 8.3 waits for the top 90%); 1.0 waits for every rank.
        deadline: seconds to wait, after the quorum is in, for the rest.
            None: a quarter of the median of the last steps' durations
            (every rank is waited for during the first three steps).
        missing: "rescale" divides the sum by the number of contributors;
            "zeros" divides by N, as if the missing ranks sent zeros.
        resync_every: every that many steps all ranks take rank 0's
            parameters (THC Sec. 6.1's periodic synchronisation; a barrier
            that also waits for late ranks). 0: never.
        poll: seconds between the lane's looks at the store while it waits.
    """

    fraction: float = 0.75
    deadline: Optional[float] = None
    missing: str = "rescale"
    resync_every: int = 0
    poll: float = 0.001

    def __post_init__(self) -> None:
        check_real("Quorum", "fraction", self.fraction, low=0.0, low_open=True, high=1.0,
                   example=0.75)
        if self.deadline is not None:
            check_real("Quorum", "deadline", self.deadline, low=0.0, example=0.05)
        if self.missing not in MISSING:
            raise ValueError(f"Quorum: missing must be one of {MISSING}, found "
                             f"{self.missing!r}")
        check_int("Quorum", "resync_every", self.resync_every, low=0, example=100)
        check_real("Quorum", "poll", self.poll, low=0.0, low_open=True, high=1.0, example=0.001)

    def needed(self, world_size: int) -> int:
        """q = ceil(fraction * N), at least 1."""
        return max(1, math.ceil(self.fraction * world_size - 1e-9))


def check_compressor(comp: Compressor) -> None:
    """Refuse a multi-round compressor that cannot sit a step out.

    Raises:
        ValueError: naming the compressors partial aggregation takes.
    """
    caps = comp.capabilities
    if caps.rounds > 1 and not caps.absent_rounds:
        raise ValueError(
            f"stragglers: {comp.name} has {caps.rounds} rounds and cannot sit a step out "
            "(capabilities.absent_rounds); partial aggregation takes THC or any "
            "single-round compressor (onebit, terngrad, topk, none, ...)")
