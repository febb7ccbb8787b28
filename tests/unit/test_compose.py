"""``compose``: a sparsifier then a quantizer of the kept values (compressors/compose.py).

The composition must equal its parts applied by hand, decode to the decoded
values at their indices and zeros elsewhere, declare its capabilities from
its parts, refuse what cannot be composed, reject malformed payloads before
scattering anything, and train under error feedback.
"""
import doctest
import json
import logging
import struct

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import (
    Capabilities,
    ErrorFeedback,
    ParamError,
    ParamTypeError,
    PayloadError,
    needs_error_feedback,
    pack_payload,
    unpack_payload,
    with_error_feedback,
)
from hipress_like.compressors.quantizers.terngrad import TernGrad
from hipress_like.compressors.sparse.topk import TopK, num_selected, unpack_sparse
from hipress_like.compressors.wrappers import compose as compose_module
from hipress_like.compressors.wrappers.compose import Compose, compose

SPARSIFIERS = [("topk", {"ratio": 0.1}), ("randomk", {"ratio": 0.1}),
               ("dgc", {"ratio": 0.1}), ("graddrop", {"ratio": 0.1})]
QUANTIZERS = [("terngrad", {"bitwidth": 2}), ("onebit", {}), ("tbq", {"threshold": 0.5}),
              ("natural", {})]
EXTRA = struct.Struct("<QQQ")  # compose's header extra: k, index item size, inner length


def _grad(shape, dtype=torch.float32, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _by_hand(c, g, st):
    """The parts applied one after the other: (decoded tensor, indices, inner payload)."""
    sparse_payload, _ = c.sparsifier.encode(g, st["sparsifier"])
    _, idx, vals = unpack_sparse(sparse_payload, c.sparsifier.algo_id)
    inner, _ = c.quantizer.encode(vals, st["quantizer"])
    want = torch.zeros(g.numel(), dtype=g.dtype)
    want[idx] = c.quantizer.decode(inner)
    return want.view(g.shape), idx, inner


# -- round trips ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(1000,), (20, 30)])
@pytest.mark.parametrize("q", QUANTIZERS, ids=[n for n, _ in QUANTIZERS])
@pytest.mark.parametrize("s", SPARSIFIERS, ids=[n for n, _ in SPARSIFIERS])
def test_composition_equals_its_parts_applied_by_hand(s, q, shape, dtype):
    c = compose(s, q)
    g = _grad(shape, dtype, seed=1)
    payload, _ = c.encode(g, c.init(g, seed=3))
    want, idx, inner = _by_hand(c, g, c.init(g, seed=3))  # a fresh state: DGC's is updated in place
    out = c.decode(payload)
    assert out.shape == g.shape and out.dtype == dtype
    assert torch.equal(out, want)
    # each decoded value at its index, zeros everywhere else
    off = torch.ones(g.numel(), dtype=torch.bool)
    off[idx] = False
    assert not bool(out.reshape(-1)[off].any())
    # the payload is the sparse indices and the quantizer's payload of the values
    assert payload[-inner.numel():].tolist() == inner.tolist()
    bound = c.payload_nbytes(g.numel(), g.dim())
    assert payload.numel() == bound if c.capabilities.fixed_size else payload.numel() <= bound


@pytest.mark.parametrize("s", SPARSIFIERS[:2], ids=[n for n, _ in SPARSIFIERS[:2]])
def test_decode_into_out_and_the_kernels_give_the_bits_of_decode(s):
    c = compose(s, "terngrad")
    g = _grad((7, 13), seed=2)
    payload, _ = c.encode(g, c.init(g, seed=1))
    want = c.decode(payload)
    buf = torch.full((91,), float("nan"))
    got = c.decode(payload, out=buf)
    assert got.data_ptr() == buf.data_ptr() and torch.equal(got, want)
    acc = _grad((7, 13), seed=3)
    assert torch.equal(c.kernels.decode_add_(payload, acc.clone()), acc + want)
    assert torch.equal(c.kernels.decode_div_(payload, torch.empty(7, 13), 3), want / 3)


def test_a_sparsifier_that_keeps_nothing_sends_no_values():
    c = compose(("dgc", {"ratio": 0.1}), "terngrad")
    g = torch.zeros(500)
    payload, st = c.encode(g, c.init(g))
    h = unpack_payload(payload)
    assert EXTRA.unpack_from(h.extra) == (0, 4, 0) and h.body.numel() == 0
    assert torch.equal(c.decode(payload), g)
    assert st["sparsifier"]["step"] == 1


# -- statistics, state and determinism --------------------------------------------
def test_randomk_unbiased_then_terngrad_is_unbiased():
    """E[decode(encode(g))] = g: with T draws each coordinate's mean is within 5 standard
    errors (estimated from the draws themselves) of g; a fixed seed keeps it repeatable."""
    c = compose(("randomk", {"ratio": 0.25, "unbiased": True}), ("terngrad", {"bitwidth": 2}))
    assert c.capabilities.unbiased
    g = _grad((64,), torch.float64, seed=4)
    st = c.init(g, seed=11)
    draws = []
    for _ in range(2000):
        p, st = c.encode(g, st)
        draws.append(c.decode(p))
    d = torch.stack(draws)
    stderr = d.std(dim=0) / d.shape[0] ** 0.5
    z = (d.mean(dim=0) - g).abs() / stderr
    assert float(z.max()) < 5.0, float(z.max())
    assert float(stderr.max()) < 0.2 * float(g.abs().max())  # the check has power


def test_state_advances_both_parts_and_same_seeds_give_the_same_bytes():
    g = _grad((1000,), seed=5)
    a, b = compose("randomk", "terngrad"), compose("randomk", "terngrad")
    sa, sb = a.init(g, seed=7), b.init(g, seed=7)
    assert set(sa) == {"sparsifier", "quantizer"}
    payloads = []
    for step in range(3):
        pa, sa = a.encode(g, sa)
        pb, sb = b.encode(g, sb)
        assert torch.equal(pa, pb)
        assert sa["sparsifier"]["step"] == sa["quantizer"]["step"] == step + 1
        payloads.append(pa)
    assert not torch.equal(payloads[0], payloads[1])  # a new subset and new rounding each step
    other, _ = a.encode(g, a.init(g, seed=8))
    assert not torch.equal(other, payloads[0])


def test_a_memory_keeping_sparsifier_carries_its_memory_in_the_nested_state():
    c = compose(("dgc", {"ratio": 0.05}), "onebit")
    g = _grad((400,), seed=6)
    st = c.init(g, seed=1)
    _, st = c.encode(g, st)
    v = st["sparsifier"]["v"]
    assert st["sparsifier"]["step"] == 1 and int((v == 0).sum()) == num_selected(0.05, 400)


def test_bad_state_says_how_to_make_one():
    c = compose("topk", "terngrad")
    with pytest.raises(ValueError, match="Compose.init"):
        c.encode(_grad((10,)), {"seed": 0, "step": 0})


# -- construction and parameters ---------------------------------------------------
@pytest.mark.parametrize("s", SPARSIFIERS, ids=[n for n, _ in SPARSIFIERS])
@pytest.mark.parametrize("q", QUANTIZERS[:2], ids=[n for n, _ in QUANTIZERS[:2]])
def test_params_round_trip_through_the_registry(s, q):
    c = C.get("compose", sparsifier=s[0], quantizer=q[0], sparsifier_params=s[1],
              quantizer_params=q[1])
    again = C.get(c.name, **json.loads(json.dumps(c.params())))  # plans store them as JSON
    assert again.params() == c.params() and repr(again) == repr(c)
    assert again.capabilities == c.capabilities
    g = _grad((300,), seed=9)
    assert torch.equal(c.encode(g, c.init(g, seed=2))[0], again.encode(g, again.init(g, seed=2))[0])


def test_every_way_of_naming_the_parts_builds_the_same_composition():
    want = Compose(TopK(ratio=0.01), TernGrad(bitwidth=2)).params()
    assert want == {"sparsifier": "topk", "sparsifier_params": {"ratio": 0.01},
                    "quantizer": "terngrad", "quantizer_params": {"bitwidth": 2}}
    assert C.get("compose", sparsifier="topk", quantizer="terngrad",
                 sparsifier_params={"ratio": 0.01}, quantizer_params={"bitwidth": 2}
                 ).params() == want
    assert compose(("topk", {"ratio": 0.01}), ("terngrad", {"bitwidth": 2})).params() == want
    assert Compose("topk", TernGrad(), sparsifier_params={"ratio": 0.01}).params() == want
    assert C.get("compose").params() == want  # the defaults
    assert "TopK" in repr(C.get("compose")) and "TernGrad" in repr(C.get("compose"))


class _MemoryQuantizer(TernGrad):
    capabilities = Capabilities("quantization", stateful=True, keeps_memory=True)


@pytest.mark.parametrize("args, kwargs, error, message", [
    (("topk", "randomk"), {}, ValueError, "second part must be a quantizer.*two sparsifiers"),
    (("topk", "compose"), {}, ValueError, "second part must be a quantizer"),
    (("topk", "identity"), {}, ValueError, r"quantizer \(category 'quantization'.*'none'"),
    (("terngrad", "onebit"), {}, ValueError, "first part must be a sparsifier.*'terngrad'"),
    (("terngrad", "topk"), {}, ValueError, "first part must be a sparsifier.*did you swap"),
    (("topk", "powersgd"), {}, ValueError, "'powersgd' has 2 communication rounds"),
    (("powersgd", "terngrad"), {}, ValueError, "'powersgd' has 2 communication rounds"),
    (("tpok", "terngrad"), {}, ValueError, "sparsifier: unknown compressor 'tpok'.*available"),
    (("topk", "terngrd"), {}, ValueError, "quantizer: unknown compressor 'terngrd'"),
    ((ErrorFeedback("topk"), "onebit"), {}, ValueError, "wrap the composition instead"),
    (("topk", ("ef", {"inner": "onebit"})), {}, ValueError, "wrap the composition instead"),
    (("topk", _MemoryQuantizer()), {}, ValueError, "keeps its own memory"),
    (("topk", "terngrad"), {"quantizer_params": {"bitwidth": 3}}, ParamError, "bitwidth"),
    (("topk", "terngrad"), {"sparsifier_params": {"ratio": "0.1"}}, ParamTypeError, "ratio"),
    (("topk", "terngrad"), {"sparsifier_params": {"nonsense": 1}}, ValueError, "nonsense"),
    ((TopK(), "terngrad"), {"sparsifier_params": {"ratio": 0.1}}, ValueError, "instance"),
    ((("topk", {"ratio": 0.1}), "terngrad"), {"sparsifier_params": {"ratio": 0.2}},
     ValueError, "given twice"),
    ((("topk",), "terngrad"), {}, TypeError, r"pair must be \(name, params dict\)"),
    ((42, "terngrad"), {}, TypeError, "registry name, a Compressor"),
    ((("topk", {"index_codec": "bloom", "eps": 0.01}), "terngrad"), {}, ValueError,
     "index_codec='bloom'.*plain codecs"),
    ((TopK(value_codec="curvefit"), "onebit"), {}, ValueError, "value_codec='curvefit'"),
    (("topk", "terngrad"), {"quantizer_params": [2]}, TypeError, "quantizer_params must be"),
])
def test_what_cannot_be_composed_is_refused_at_construction(args, kwargs, error, message):
    with pytest.raises(error, match=message):
        Compose(*args, **kwargs)


def test_registry_errors_keep_their_types():
    with pytest.raises(ParamTypeError):  # a TypeError and a ValueError, as for any compressor
        C.get("compose", sparsifier="topk", sparsifier_params={"ratio": None})
    with pytest.raises(ValueError, match="unknown compressor 'tpok'"):
        C.get("compose", sparsifier="tpok")


# -- capabilities ---------------------------------------------------------------
@pytest.mark.parametrize("s, q, fixed, unbiased, memory", [
    ("topk", "terngrad", True, False, False),
    (("randomk", {"unbiased": True}), "terngrad", True, True, False),
    (("randomk", {"unbiased": True}), "onebit", True, False, False),
    (("randomk", {"unbiased": False}), "terngrad", True, False, False),
    ("dgc", "terngrad", False, False, True),
    ("graddrop", "onebit", False, False, True),
])
def test_capabilities_are_declared_from_the_parts(s, q, fixed, unbiased, memory):
    caps = compose(s, q).capabilities
    assert (caps.fixed_size, caps.unbiased, caps.keeps_memory) == (fixed, unbiased, memory)
    assert caps.category == "sparsification" and not caps.aggregatable and caps.rounds == 1
    assert caps.stateful and not caps.shared_randomness


class _SharedQuantizer(TernGrad):
    capabilities = Capabilities("quantization", stateful=True, shared_randomness=True)

    def init(self, grad, seed=0, *, world_size=1, shared_seed=0):
        return {"seed": seed, "step": 0, "ws": world_size, "ss": shared_seed}


def test_shared_randomness_of_a_part_is_declared_and_its_seeds_arrive_through_init():
    c = Compose("topk", _SharedQuantizer())
    assert c.capabilities.shared_randomness
    st = c.init(torch.zeros(100), seed=2, world_size=3, shared_seed=7)
    q = st["quantizer"]
    assert q["ws"] == 3 and q["ss"] != 0 and q["seed"] != 2  # streams of their own
    assert q == Compose("topk", _SharedQuantizer()).init(torch.zeros(100), seed=2,
                                                          world_size=3, shared_seed=7)["quantizer"]


def test_bits_per_kept_value_at_a_million_entries():
    d = 1 << 20
    k = num_selected(0.01, d)
    # natural: 9 bits a value, C_nat o top-k (the paper counts 10 + log2(d) = 30 bits here)
    for q, params, b in [("terngrad", {"bitwidth": 2}, 2), ("onebit", {}, 1), ("natural", {}, 9)]:
        c = compose(("topk", {"ratio": 0.01}), (q, params))
        g = _grad((d,), seed=10)
        payload, _ = c.encode(g, c.init(g))
        assert payload.numel() == c.payload_nbytes(d)
        assert c.bits_per_value(d) == pytest.approx(8 * payload.numel() / k)
        # 32-bit indices plus b bits a value, headers amortised over k = 10486
        assert 32 + b < c.bits_per_value(d) < 32 + b + 0.1


# -- malformed payloads ---------------------------------------------------------
def _payload(c=None, n=200):
    c = c or compose(("topk", {"ratio": 0.1}), "terngrad")
    g = _grad((n,), seed=12)
    return c, c.encode(g, c.init(g))[0]


def _repack(payload, fields, body=None):
    """``payload`` with its header extra replaced by ``fields`` (and its body by ``body``)."""
    h = unpack_payload(payload)
    body = h.body if body is None else body
    out, b = pack_payload(h.algo_id, h.dtype, h.shape, EXTRA.pack(*fields), body.numel())
    b.copy_(body)
    return out


def _rejected(c, payload, match=None):
    buf = torch.full((200,), float("nan"))
    with pytest.raises(PayloadError, match=match):
        c.decode(payload, out=buf)
    assert bool(buf.isnan().all())  # nothing decoded from garbage


def test_truncated_payloads_are_rejected():
    c, p = _payload()
    for cut in (3, 16, 60, p.numel() - 1):
        _rejected(c, p[:cut].clone())


def test_payloads_of_another_algorithm_are_rejected():
    c, p = _payload()
    g = _grad((200,), seed=12)
    for other in ("topk", "terngrad"):
        o = C.get(other)
        _rejected(c, o.encode(g, o.init(g))[0], "algorithm id")
    bad = p.clone()
    bad[3] = 20
    _rejected(c, bad, "algorithm id 20, expected 43")


def test_an_index_out_of_range_or_out_of_order_is_rejected():
    c, p = _payload()
    h = unpack_payload(p)
    k = EXTRA.unpack_from(h.extra)[0]
    bad = p.clone()
    unpack_payload(bad).body[: 4 * k].view(torch.int32)[-1] = 200
    _rejected(c, bad, r"index out of range \[0, 200\)")
    bad = p.clone()
    idx = unpack_payload(bad).body[: 4 * k].view(torch.int32)
    idx[0], idx[1] = int(idx[1]), int(idx[0])
    _rejected(c, bad, "not strictly increasing")


def test_inconsistent_fields_are_rejected():
    c, p = _payload()
    h = unpack_payload(p)
    k, isz, qn = EXTRA.unpack_from(h.extra)
    _rejected(c, _repack(p, (k, isz, qn + 8)), "body has")           # length mismatch
    _rejected(c, _repack(p, (k, 8, qn)), "index size 8")
    _rejected(c, _repack(p, (201, isz, qn)), "k=201")
    _rejected(c, _repack(p, (0, isz, qn)), "k=0 values in an inner payload")
    # an inner payload cut short, its length field made to match
    _rejected(c, _repack(p, (k, isz, qn - 1), h.body[:-1].clone()), "not a 'terngrad' payload")


def test_an_inner_payload_of_another_quantizer_dtype_or_length_is_rejected():
    c, p = _payload()
    _, p1 = _payload(compose(("topk", {"ratio": 0.1}), "onebit"))
    _rejected(c, p1, "not a 'terngrad' payload")
    k = num_selected(0.1, 200)
    ipad = 4 * k
    h = unpack_payload(p)
    vals = _grad((k + 1,), seed=1)
    tg = TernGrad()
    for inner in (tg.encode(vals, tg.init(vals))[0],                         # k + 1 values
                  tg.encode(vals[:k].double(), tg.init(vals[:k]))[0]):     # float64 values
        body = torch.cat([h.body[:ipad], inner])
        _rejected(c, _repack(p, (k, 4, inner.numel()), body), "expected torch.float32 of shape")
    # the inner payload's own body corrupted in length: the quantizer's check, prefixed
    inner = h.body[ipad:].clone()
    ih = unpack_payload(inner)
    short, b = pack_payload(ih.algo_id, ih.dtype, ih.shape, ih.extra, ih.body.numel() - 1)
    b.copy_(ih.body[:-1])
    body = torch.cat([h.body[:ipad], short])
    _rejected(c, _repack(p, (k, 4, short.numel()), body), "compose payload's values")


# -- error feedback, re-selection -----------------------------------------------
def test_error_feedback_wraps_the_composition_and_keeps_the_rest():
    inner = compose(("topk", {"ratio": 0.1}), "terngrad")
    ef = ErrorFeedback(inner)
    g = _grad((30, 40), seed=13)
    payload, st = ef.encode(g, ef.init(g, seed=1))
    assert torch.equal(ef.error(st), g - inner.decode(payload))
    assert ef.algo_id == Compose.algo_id and ef.capabilities.keeps_memory
    # by name, with the composition's parameters flattened (ErrorFeedback's constructor)
    by_name = C.get("ef", inner="compose", sparsifier="topk", quantizer="terngrad",
                    sparsifier_params={"ratio": 0.1})
    assert by_name.inner.params() == inner.params()
    p = by_name.params()
    again = C.get("ef", **p)  # params() round-trips through the registry, nested as it is
    assert again.params() == p
    with pytest.raises(ValueError, match="both in inner_params and as keywords"):
        C.get("ef", inner="topk", inner_params={"ratio": 0.1}, ratio=0.2)
    assert torch.equal(again.encode(g, again.init(g, seed=1))[0], payload)


def test_automatic_error_feedback_wraps_a_biased_composition_once(caplog):
    assert needs_error_feedback(compose("topk", "onebit"))  # biased, no memory of its own
    assert not needs_error_feedback(compose(("randomk", {"unbiased": True}), "terngrad"))
    own = compose("dgc", "onebit")
    assert not needs_error_feedback(own)
    assert with_error_feedback(own) is own
    plain = compose("topk", "onebit")
    wrapped = with_error_feedback(plain)
    assert isinstance(wrapped, ErrorFeedback) and wrapped.inner is plain
    ef_logger = "hipress_like.compressors.wrappers.error_feedback"
    with caplog.at_level(logging.WARNING, logger=ef_logger):
        ErrorFeedback(compose("graddrop", "terngrad"))
    assert "own residual" in caplog.text


def test_error_feedback_topk_then_terngrad_trains_least_squares():
    gen = torch.Generator().manual_seed(0)
    m, d = 400, 100
    a = torch.randn(m, d, generator=gen) / m ** 0.5
    b = a @ torch.randn(d, generator=gen)
    x = torch.zeros(d)
    c = ErrorFeedback(compose(("topk", {"ratio": 0.1}), ("terngrad", {"bitwidth": 2})))
    st = c.init(x, seed=1)

    def loss(x):
        return 0.5 * float(((a @ x - b) ** 2).sum())

    start = loss(x)
    for _ in range(400):
        payload, st = c.encode(a.t() @ (a @ x - b), st)
        x -= 0.3 * c.decode(payload)
    assert loss(x) < 1e-3 * start, (loss(x), start)


def test_reselect_keeps_the_top_k_of_a_merged_tensor_and_touches_no_state():
    c = compose(("dgc", {"ratio": 0.05}), "terngrad")
    merged = _grad((400,), seed=14)
    payload = c.reselect(merged, seed=3)
    out = c.decode(payload)
    top = torch.topk(merged.abs(), num_selected(0.05, 400)).indices
    assert set(out.nonzero().reshape(-1).tolist()) <= set(top.tolist())
    assert torch.equal(c.reselect(merged, seed=3), payload)
    assert int((c.decode(c.reselect(merged, 7)) != 0).sum()) <= 7
    ef = ErrorFeedback(compose(("topk", {"ratio": 0.05}), "terngrad"))
    assert torch.equal(ef.decode(ef.reselect(merged, 5)),
                       ef.inner.decode(ef.inner.reselect(merged, 5)))


def test_docstring_examples_run():
    result = doctest.testmod(compose_module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
