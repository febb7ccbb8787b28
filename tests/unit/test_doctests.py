"""The docstring examples of the self-contained modules run as written.

Examples that need a process group (adapters, transports over sockets) are
illustrations and are not collected here; these modules' examples compute
their results by hand (cost-model formulas, compressor round trips), so a
formula change that breaks one breaks this test.
"""
import doctest
import importlib

import pytest

MODULES = [
    "hipress_like.adapters.agreement",
    "hipress_like.adapters.consistency",
    "hipress_like.casync.chunks",
    "hipress_like.casync.config",
    "hipress_like.casync.lane",
    "hipress_like.casync.nonfinite",
    "hipress_like.casync.replay",
    "hipress_like.casync.transport.inproc",
    "hipress_like.compressors._build.fused",
    "hipress_like.compressors.double_buffer",
    "hipress_like.compressors.sparse.accumulators",
    "hipress_like.compressors.sparse.artopk",
    "hipress_like.compressors.sparse.dgc",
    "hipress_like.compressors.wrappers.error_feedback",
    "hipress_like.compressors.sparse.graddrop",
    "hipress_like.compressors.onebit.onebit",
    "hipress_like.compressors.powersgd.powersgd",
    "hipress_like.compressors.sparse.topk",
    "hipress_like.compressors.quantizers.tbq",
    "hipress_like.compressors.quantizers.terngrad",
    "hipress_like.cost_model.collectives",
    "hipress_like.cost_model.engine_term",
    "hipress_like.cost_model.model",
    "hipress_like.cost_model.planner",
    "hipress_like.cost_model.presets",
    "hipress_like.cost_model.profile",
    "hipress_like.tuning.advise",
    "hipress_like.errors",
    "hipress_like.tuning.engine_timing",
    "hipress_like.tuning.link",
    "hipress_like.tuning.step_model",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0, f"{name} has no examples to run"
    assert result.failed == 0
