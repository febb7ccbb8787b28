"""A compressor written by a user, with only the narrow interface, trains for real.

``ScaledSign`` below is what a user writes: ``init``, ``encode``, ``decode``,
``params`` and declared ``capabilities`` (scaled sign compression, Bernstein et
al. 2018's signSGD with the mean magnitude as the scale: one bit per element).
No merge, no kernels, no rounds, no payload size: the base class and the engine
supply the rest. It trains digits on 4 ranks over PS and over Ring, every
rank ending with bitwise-identical parameters; error feedback wraps it (it is
biased) with no code of the user's: the engine does so by itself, and
``get("ef", inner=...)`` by name. One 4-rank launch trains both runs (the
user's compressor over PS and over Ring) one after the other, and each
strategy's test reads its run. The uncompressed baseline is the one
``test_torch_digits`` trains (``train_digits`` with identity over PS, the same
epochs; identity over PS and over Ring reach the same accuracy, 96.1% both):
in a whole suite it is trained once for both modules.
A user registers at import; this test registers only while its own tests run
(the ``users_compressor`` fixture, and ``_train_all`` in each worker), so the
suite's tests that enumerate every registered compressor never meet it.
"""
import functools
import struct
from dataclasses import asdict

import pytest
import torch
from test_torch_digits import EPOCHS, _accuracy  # tests/multiprocess is on sys.path (rootdir)

from hipress_like.compressors import Capabilities, Compressor, ErrorFeedback, get, register
from hipress_like.compressors.ops import pack_bits, unpack_bits
from hipress_like.compressors.payload import pack_payload, unpack_fields
from hipress_like.compressors.registry import _REGISTRY
from hipress_like.demo import DigitsConfig, train_digits
from hipress_like.launch.launch import run_workers

# the first 4-rank test trains all three runs in its launch (``_runs``)
pytestmark = pytest.mark.timeout(1800)
STRATEGIES = ("ps", "ring")
_SCALE = struct.Struct("<d")


class ScaledSign(Compressor):
    """sign(g) * mean|g|: one bit per element plus one float64 (a user's compressor)."""

    name = "user_scaled_sign"
    algo_id = 201
    capabilities = Capabilities("quantization")

    def init(self, grad, seed=0, **run):
        return {}

    def encode(self, grad, state):
        g = grad.detach().reshape(-1)
        scale = float(g.abs().to(torch.float64).mean()) if g.numel() else 0.0
        bits = pack_bits((g >= 0).to(torch.uint8), 1)
        payload, body = pack_payload(self.algo_id, grad.dtype, grad.shape, _SCALE.pack(scale),
                                     bits.numel(), grad.device)
        body.copy_(bits)
        return payload, state

    def decode(self, payload, out=None):
        h, (scale,) = unpack_fields(payload, self.algo_id, _SCALE, self.name)
        signs = unpack_bits(h.body, 1, h.numel).to(h.dtype) * 2 - 1
        res = (signs * scale).view(h.shape)
        if out is None:
            return res
        return out.view(h.shape).copy_(res)

    def params(self):
        return {}


def _register():
    register("user_scaled_sign")(ScaledSign)  # the same factory again is a no-op


@pytest.fixture(autouse=True)
def users_compressor():
    """``ScaledSign`` registered for this module's tests only."""
    _register()
    yield
    _REGISTRY.pop("user_scaled_sign", None)


def _train_all(ctx, cfgs):
    """Every run of ``cfgs`` in turn on these ranks (one launch, fresh engines each)."""
    _register()
    return [train_digits(ctx, cfg) for cfg in cfgs]


def _cfg(compressor, strategy):
    return asdict(DigitsConfig(compressor=compressor, params={}, strategy=strategy, plan=None,
                               compress_all=True, epochs=EPOCHS, progress=False))


@functools.lru_cache(maxsize=None)
def _runs():
    """{(compressor, strategy): rank 0's result} of one 4-rank launch; every run's ranks
    end with the same parameter digest."""
    keys = [("user_scaled_sign", s) for s in STRATEGIES]
    res = run_workers(_train_all, 4, args=([_cfg(*k) for k in keys],), timeout=900)
    for i, (compressor, strategy) in enumerate(keys):
        assert len({r[i]["param_digest"] for r in res}) == 1, \
            f"{compressor} {strategy}: ranks differ"
    return {k: res[0][i] for i, k in enumerate(keys)}


def test_the_narrow_interface_is_enough_for_a_round_trip():
    c = get("user_scaled_sign")
    g = torch.randn(1001, generator=torch.Generator().manual_seed(0))
    p, st = c.encode(g, c.init(g))
    assert c.payload_nbytes(g.numel()) == p.numel()  # the base class measures it
    want = torch.sign(g + (g == 0)) * g.abs().double().mean().float()
    assert torch.allclose(c.decode(p), want)
    acc = torch.ones(1001)
    assert torch.equal(c.kernels.decode_add_(p, acc.clone()), acc + c.decode(p))
    ef = get("ef", inner="user_scaled_sign")
    assert isinstance(ef, ErrorFeedback) and ef.inner.name == "user_scaled_sign"
    p2, st2 = ef.encode(g, ef.init(g))
    assert torch.equal(p2, p)  # the first step has an empty memory
    assert torch.equal(ef.error(st2), g - c.decode(p))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_users_compressor_trains_digits_on_4_ranks_with_identical_replicas(strategy):
    run = _runs()[("user_scaled_sign", strategy)]  # _runs checks the ranks' digests
    assert run["compressed"], "no gradient went through the user's compressor"
    # biased, so the engine wraps it in error feedback by itself: no code of the user's
    assert all(how.startswith("ErrorFeedback(ScaledSign()") for how in run["how"].values()), \
        run["how"]
    base = _accuracy("identity", "ps")  # test_torch_digits' baseline, the same epochs
    print(f"digits {strategy}: scaled sign + error feedback {run['acc']:.1f}%, "
          f"uncompressed {base:.1f}%")
    assert run["acc"] >= base - 2.0  # one bit per element costs at most 2 points
