"""What the CaSync engine costs beyond HiPress Eq. 2, fitted to whole synchronisations.

The idea: Eq. 2 counts the transfers, encodes and decodes of one
synchronisation; the engine also runs coordination rounds, tasks per
partition and copies. ``EngineTerm`` is a three-coefficient linear model of
that extra (fixed, per partition, per byte) fitted by least squares on
relative error to timings of the real engine (``tuning.engine_timing``).
The same form, fitted with a zero base, models the CPU seconds a rank
spends on a synchronisation (``Planner.cpu_cpr``). Split from
``planner.py``, which re-exports it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence, Tuple

__all__ = ["EngineTerm"]


@dataclass(frozen=True)
class EngineTerm:
    """What a compressed synchronisation costs in the engine beyond HiPress Eq. 2.

    Not in HiPress. Eq. 2 counts ``alpha`` transfers, ``beta`` encodes and
    ``gamma`` decodes (Table 3 / Sec. 6.1). The CaSync engine also pays for
    work those counts leave out: coordinator rounds that carry no gradient
    bytes, tasks and messages per partition, and, in the co-located PS, the
    aggregator's re-encode and the workers' final decodes. Measured on this
    repository's engine, that extra cost is roughly linear in three things,
    so it is modelled as

        extra(m, K) = fixed + per_partition * (K - 1) + per_byte * m

    and fitted to whole synchronisations timed through the engine
    (``profiler.measure_engine_sync``) by least squares on the relative
    error of ``Eq. 2 + extra``, so small and large samples weigh alike.
    The fixed and per-partition coefficients may be negative where Eq. 2
    over-counts (its transfers are serial; the engine's go in bulk rounds);
    the per-byte one may not (``fit`` refits a negative slope as 0).

    Attributes:
        fixed: seconds per synchronisation.
        per_partition: seconds per partition beyond the first.
        per_byte: seconds per gradient byte.
    """

    fixed: float = 0.0
    per_partition: float = 0.0
    per_byte: float = 0.0

    def __call__(self, m: float, k: int) -> float:
        """Extra seconds for an ``m``-byte gradient in ``k`` partitions."""
        return self.fixed + self.per_partition * (k - 1) + self.per_byte * m

    def describe(self) -> str:
        """The coefficients in readable units, e.g. for the CLI and the benchmark."""
        return (f"{self.fixed * 1e3:.2f} ms + {self.per_partition * 1e3:.2f} ms per extra "
                f"partition + {self.per_byte * 1e9:.3f} ns per byte")

    @classmethod
    def fit(cls, samples: Sequence[Tuple[int, int, float]],
            eq2: Callable[[float, int], float]) -> "EngineTerm":
        """Fit to ``(bytes, K, seconds)`` samples given Eq. 2's prediction ``eq2(m, K)``.

        Minimises ``sum(((eq2 + extra) / t - 1) ** 2)``. With fewer distinct
        K than two (or sizes than two) the unidentifiable coefficient is left
        at the minimum-norm solution (0 when nothing pins it).

        Raises:
            ValueError: no samples.

        Example:
            >>> eq2 = lambda m, k: 1e-3 * k
            >>> s = [(m, k, 1e-3 * k + 2e-3 + 1e-3 * (k - 1) + 1e-9 * m)
            ...      for m in (1e6, 8e6) for k in (1, 4)]
            >>> t = EngineTerm.fit(s, eq2)
            >>> [round(x, 12) for x in (t.fixed, t.per_partition, t.per_byte)]
            [0.002, 0.001, 1e-09]
        """
        import torch

        if not samples:
            raise ValueError("EngineTerm.fit needs at least one (bytes, K, seconds) sample")
        # scale the per-byte column to O(1) so the solve is well conditioned
        scale = max(m for m, _, _ in samples)
        a = torch.tensor([[1.0 / t, (k - 1) / t, m / scale / t] for m, k, t in samples],
                         dtype=torch.float64)
        b = torch.tensor([[(t - eq2(m, k)) / t] for m, k, t in samples], dtype=torch.float64)
        x = torch.linalg.lstsq(a, b, driver="gelsd").solution[:, 0].tolist()
        if x[2] < 0:
            # The engine's work beyond Eq. 2 grows with the bytes (copies, the
            # aggregator's re-encode, final decodes); a negative slope comes from
            # weighing a few sizes' fixed costs, and extrapolated past the largest
            # timed size it prices a big gradient below its own timings (Ring +
            # onebit at 84 MB: 70 ms from samples of 113-202 ms at 32 MB). Refit
            # without it.
            x = torch.linalg.lstsq(a[:, :2], b, driver="gelsd").solution[:, 0].tolist()
            x.append(0.0)
        return cls(fixed=x[0], per_partition=x[1], per_byte=x[2] / scale)
