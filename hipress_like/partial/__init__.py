"""Partial aggregation: a step closes once a quorum of ranks has contributed.

THC Sec. 6.1 and 8.3's answer to stragglers, kept beside the engine rather
than inside it: the engine's every collective waits for every rank, while
here a lane thread of each rank agrees with the others, through the
transport's key-value store (``Transport.store``), on which ranks a step
closes with, and exchanges their payloads over the transport. This package
sits on the floor above ``casync``: it uses a transport and a compressor,
and imports no torch.distributed.

    settings.py   Quorum (what a user asks for), check_compressor
    lane.py       QuorumLane (the protocol, its thread), QuorumError

The optimizer front end is ``adapters/torch/quorum``.
"""
from .lane import QuorumError, QuorumLane
from .settings import Quorum, check_compressor

__all__ = ["Quorum", "QuorumLane", "QuorumError", "check_compressor"]
