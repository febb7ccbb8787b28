"""Capabilities are declared: rounds and their reductions, summable rounds, shared
randomness, own memory; and a compressor instance works wherever a name does."""
import pytest
import torch

from hipress_like import compressors as C
from hipress_like.compressors import (
    Capabilities,
    ErrorFeedback,
    needs_error_feedback,
    with_error_feedback,
)
from hipress_like.compressors.kernels import InnerKernels, Kernels


def test_defaults_give_one_sum_and_no_summable_per_round():
    caps = Capabilities("quantization", rounds=3)
    assert caps.round_reductions == ("sum", "sum", "sum")
    assert caps.summable == (False, False, False) and not caps.all_summable
    assert not caps.shared_randomness and not caps.keeps_memory and not caps.merge_widens


@pytest.mark.parametrize("kwargs, message", [
    ({"rounds": 2, "round_reductions": ("sum",)}, "one entry per round"),
    ({"round_reductions": ("mean",)}, "round_reductions must be among"),
    ({"summable": (True,)}, "declare aggregatable=True"),
    ({"merge_widens": True}, "declare aggregatable=True"),
    ({"keeps_memory": True}, "declare stateful=True"),
    ({"rounds": 0}, "rounds must be an integer >= 1"),
    ({"rounds": 2, "aggregatable": True, "summable": (True,)}, "one entry per round"),
])
def test_inconsistent_declarations_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Capabilities("quantization", **kwargs)


def test_max_and_broadcast_rounds_can_be_declared():
    caps = Capabilities("sparsification", rounds=2, round_reductions=("max", "broadcast"))
    assert caps.round_reductions == ("max", "broadcast")


@pytest.mark.parametrize("name", sorted(set(C.available()) - {"ef"}))
def test_summable_is_declared_exactly_when_summable_view_is_overridden(name):
    """A round is declared summable exactly when a summable view exists: in the
    compressor's ``kernels_class``, as base.Compressor asks (a wrapper's
    ``InnerKernels`` forwards to the inner compressor's)."""
    c = C.get(name)
    overridden = type(c.kernels).summable_view not in (Kernels.summable_view,
                                                       InnerKernels.summable_view)
    assert any(c.capabilities.summable) == overridden  # AR-Topk: some rounds only


def test_powersgd_declares_its_rounds_seed_and_memory():
    caps = C.get("powersgd").capabilities
    assert caps.rounds == 2 and caps.round_reductions == ("sum", "sum")
    assert caps.summable == (True, True) and caps.shared_randomness and caps.keeps_memory


@pytest.mark.parametrize("name, keeps", [("dgc", True), ("graddrop", True), ("powersgd", True),
                                         ("onebit", False), ("topk", False), ("ef", True)])
def test_own_memory_is_declared(name, keeps):
    assert C.get(name).capabilities.keeps_memory is keeps


def test_shared_seed_and_world_size_arrive_through_init():
    c = C.get("powersgd")
    st = c.init(torch.zeros(8, 4), seed=3, world_size=5, shared_seed=11)
    assert st["world_size"] == 5 and st["shared_seed"] == 11 and st["seed"] == 3
    # every compressor accepts the keywords (the engine passes world_size to all)
    for name in C.available():
        C.get(name).init(torch.zeros(8, 4), seed=1, world_size=2, shared_seed=0)


def test_error_feedback_passes_the_run_to_its_inner_compressor():
    class Seeded(C.get("topk").__class__):
        capabilities = Capabilities("sparsification", stateful=True, shared_randomness=True)

        def init(self, grad, seed=0, *, world_size=1, shared_seed=0):
            return {"seed": seed, "step": 0, "ws": world_size, "ss": shared_seed}

    st = ErrorFeedback(Seeded()).init(torch.zeros(4), 2, world_size=3, shared_seed=7)
    assert st["inner"] == {"seed": 2, "step": 0, "ws": 3, "ss": 7}


def test_get_returns_an_instance_as_is_wrapped_ones_included():
    ef = ErrorFeedback(C.get("topk", ratio=0.1))
    assert C.get(ef) is ef
    top = C.get("topk")
    assert C.get(top) is top
    with pytest.raises(ValueError, match="parameters cannot be given"):
        C.get(ef, ratio=0.2)


def test_automatic_error_feedback_never_double_wraps():
    ef = ErrorFeedback(C.get("onebit"))
    assert not needs_error_feedback(ef)
    assert with_error_feedback(ef) is ef
    wrapped = with_error_feedback(C.get("onebit"))
    assert isinstance(wrapped, ErrorFeedback) and needs_error_feedback(C.get("onebit"))
    for name in ("dgc", "graddrop", "powersgd", "terngrad", "identity"):
        assert not needs_error_feedback(C.get(name)), name
    # a biased random-k keeps an RNG step, not the lost part: it is wrapped
    assert needs_error_feedback(C.get("randomk", unbiased=False))
