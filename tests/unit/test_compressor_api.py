"""The unified compressor API (HiPress Sec. 4.1) checked for every registered compressor.

Each compressor registered when the tests run is built with its default
parameters and put through the same contract: shape/dtype round trip,
exact payload size, reproducible payloads, rejection of malformed payloads
and of bad input. Multi-round compressors (``capabilities.rounds > 1``)
skip the single-call round trip; their own tests cover encode_round.
"""
import struct

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import PayloadError, pack_payload, unpack_payload


def _distinct_names():
    """Registered names, one per factory (aliases like "none" dropped)."""
    from hipress_like.compressors.registry import _REGISTRY

    seen, names = set(), []
    for name in C.available():
        f = _REGISTRY.get(name)
        if f is not None and id(f) in seen:
            continue
        seen.add(id(f))
        names.append(name)
    return names


NAMES = _distinct_names()
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SHAPES = [(1,), (7,), (1001,), (7, 13)]


def _single_round(name):
    c = C.get(name)
    if c.capabilities.rounds > 1:
        pytest.skip(f"{name} has {c.capabilities.rounds} rounds; its own tests cover them")
    return c


def _grad(shape, dtype=torch.float32, seed=0):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return g.to(dtype)


def _encode(c, g, seed=0):
    return c.encode(g, c.init(g, seed=seed))[0]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_keeps_shape_and_dtype(name, dtype, shape):
    c = _single_round(name)
    g = _grad(shape, dtype)
    payload = _encode(c, g)
    assert payload.dtype == torch.uint8 and payload.dim() == 1
    out = c.decode(payload)
    assert out.shape == g.shape and out.dtype == g.dtype
    assert bool(torch.isfinite(out).all())


@pytest.mark.parametrize("name", NAMES)
def test_decode_into_out_writes_the_buffer_and_checks_it(name):
    """decode(payload, out=...) fills the caller's buffer (any shape, same numel)."""
    c = _single_round(name)
    g = _grad((7, 13), seed=2)
    payload = _encode(c, g)
    want = c.decode(payload)
    flat = torch.full((91,), float("nan"))
    got = c.decode(payload, out=flat)
    assert got.shape == g.shape and got.data_ptr() == flat.data_ptr()
    assert torch.equal(got, want)
    for bad in (torch.empty(90), torch.empty(91, dtype=torch.float64),
                torch.empty(13, 7).t()):
        with pytest.raises(ValueError, match="out must be"):
            c.decode(payload, out=bad)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("shape", SHAPES)
def test_payload_size_matches_payload_nbytes(name, shape):
    c = _single_round(name)
    g = _grad(shape)
    payload = _encode(c, g)
    bound = c.payload_nbytes(g.numel(), g.dim())
    if c.capabilities.fixed_size:
        assert payload.numel() == bound
    else:
        assert payload.numel() <= bound


@pytest.mark.parametrize("name", NAMES)
def test_same_seed_same_payload_bytes(name):
    _single_round(name)
    g = _grad((1001,), seed=1)
    assert torch.equal(_encode(C.get(name), g, seed=5), _encode(C.get(name), g, seed=5))


@pytest.mark.parametrize("name", NAMES)
def test_truncated_payload_is_rejected(name):
    c = _single_round(name)
    payload = _encode(c, _grad((1001,)))
    for cut in (3, 16, payload.numel() - 1):
        with pytest.raises(PayloadError):
            c.decode(payload[:cut].clone())


@pytest.mark.parametrize("name", NAMES)
def test_wrong_header_version_is_rejected(name):
    c = _single_round(name)
    payload = _encode(c, _grad((33,))).clone()
    payload[2] = payload[2] + 1
    with pytest.raises(PayloadError, match="version"):
        c.decode(payload)


@pytest.mark.parametrize("name", NAMES)
def test_payload_of_another_algorithm_is_rejected(name):
    c = _single_round(name)
    other = "fp16" if c.algo_id != C.get("fp16").algo_id else "identity"
    payload = _encode(C.get(other), _grad((33,)))
    with pytest.raises(PayloadError):
        c.decode(payload)


@pytest.mark.parametrize("name", NAMES)
def test_wrong_body_size_is_rejected(name):
    c = _single_round(name)
    payload = _encode(c, _grad((1001,)))
    h = unpack_payload(payload)
    for delta in (-1, 1):
        n = h.body.numel() + delta
        bad, body = pack_payload(h.algo_id, h.dtype, h.shape, h.extra, n)
        k = min(n, h.body.numel())
        body[:k] = h.body[:k]
        if delta > 0:
            body[k:] = 0
        with pytest.raises(PayloadError):
            c.decode(bad)


@pytest.mark.parametrize("name", NAMES)
def test_not_a_payload_is_rejected(name):
    c = _single_round(name)
    with pytest.raises(PayloadError):
        c.decode(torch.zeros(40, dtype=torch.float32))
    with pytest.raises(PayloadError, match="magic"):
        c.decode(torch.zeros(40, dtype=torch.uint8))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", ["int", "empty", "nan", "inf"])
def test_bad_gradients_raise_clear_errors(name, bad):
    c = _single_round(name)
    g = {
        "int": torch.arange(10),
        "empty": torch.zeros(0),
        "nan": torch.tensor([1.0, float("nan"), 2.0]),
        "inf": torch.tensor([1.0, 2.0, -float("inf")] * 40),
    }[bad]
    with pytest.raises((TypeError, ValueError)) as e:
        c.encode(g, c.init(torch.zeros(max(1, g.numel()))))
    assert str(e.value)


def test_unknown_name_lists_the_known_ones():
    with pytest.raises(ValueError) as e:
        C.get("tern_grad")
    msg = str(e.value)
    assert "unknown compressor" in msg
    for name in ("onebit", "tbq", "terngrad", "identity"):
        assert name in msg


@pytest.mark.parametrize("name,params", [
    ("terngrad", {"bitwidth": 3}),
    ("terngrad", {"bitwidth": 0}),
    ("terngrad", {"bitwidth": 2.5}),
    ("terngrad", {"bitwidth": True}),
    ("tbq", {"threshold": 0}),
    ("tbq", {"threshold": -0.1}),
    ("tbq", {"threshold": float("nan")}),
    ("tbq", {"threshold": "big"}),
    ("onebit", {"error_feedback": True}),
    ("tbq", {"tau": 0.1}),
    ("terngrad", {"bits": 2}),
])
def test_invalid_params_raise_value_error(name, params):
    with pytest.raises(ValueError):
        C.get(name, **params)


def test_header_fields_are_little_endian_and_versioned():
    c = C.get("onebit")
    payload = _encode(c, _grad((3, 5)))
    magic, version, algo, _, ndim, _, body_len = struct.unpack(
        "<2sBBBBHQ", payload[:16].numpy().tobytes())
    assert (magic, algo, ndim) == (b"HL", c.algo_id, 2)
    assert version == C.HEADER_VERSION
    assert body_len == 2  # 15 bits


def test_registration_rejects_a_duplicate_algorithm_id():
    class Clash(C.Compressor):
        name = "clash"
        algo_id = 10  # onebit's

    with pytest.raises(ValueError, match=r"'clash' .*algorithm id 10, already used by 'onebit'"):
        C.register("clash")(Clash)
    assert "clash" not in C.available()


def test_a_subclass_must_declare_its_own_algorithm_id():
    from hipress_like.compressors.sparse.topk import TopK

    class MyTopK(TopK):
        pass

    with pytest.raises(ValueError, match="already used by 'topk'.*inherits its parent's id"):
        C.register("mytopk")(MyTopK)


def test_registered_algorithm_ids_are_unique():
    from hipress_like.compressors.registry import _REGISTRY, _algo_id

    ids = {}
    for name, f in _REGISTRY.items():
        if _algo_id(f):
            assert ids.setdefault(_algo_id(f), f) is f, name
