"""Sparse payload codecs: the index/value split, plain bytes, run-length code, params, errors.

(hipress_like/compressors/sparse.py, sparse_codecs.py; issue 25.)
"""
from __future__ import annotations

import json
import struct

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import PayloadError
from hipress_like.compressors.params import ParamError
from hipress_like.compressors.sparse.codecs import (
    RunLength,
    index_codec_names,
    pack_uint,
    rle_nbits,
    unpack_uint,
    value_codec_names,
)
from hipress_like.compressors.sparse.topk import unpack_sparse

SPARSIFIERS = [("topk", {"ratio": 0.02}), ("randomk", {"ratio": 0.02}),
               ("randomk", {"ratio": 0.02, "unbiased": False}),
               ("dgc", {"ratio": 0.02}), ("graddrop", {"ratio": 0.02})]
INDEX = [{}, {"index_codec": "rle"}, {"index_codec": "rle", "block_bits": 5},
         {"index_codec": "bloom"}, {"index_codec": "bloom", "policy": "random"},
         {"index_codec": "bloom", "second_eps": 0.2}]
VALUE = [{}, {"value_codec": "curvefit"}, {"value_codec": "curvefit", "fit": "dexp"}]
S_IDS = [f"{n}{'-biased' if p.get('unbiased') is False else ''}" for n, p in SPARSIFIERS]


def _ids(cases):
    return ["-".join(f"{v}" for v in c.values()) or "plain" for c in cases]


def _grad(n=3000, seed=0, shape=None):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed))
    return g.reshape(shape) if shape else g


def _word(payload):
    """k and the second header word of a sparse payload."""
    from hipress_like.compressors.base import unpack_payload

    h = unpack_payload(payload)
    return struct.unpack_from("<QQ", h.extra)


# -- plain: today's bytes --------------------------------------------------------------

def _hand_payload(algo_id, shape, idx, vals):
    """The sparse payload of before codecs, byte by byte (payload.py + sparse.py layout)."""
    k = len(idx)
    extra = struct.pack("<QQ", k, 4)
    ibytes = struct.pack(f"<{k}i", *idx)
    ibytes += b"\0" * (-len(ibytes) % 8)
    vbytes = struct.pack(f"<{k}f", *vals)
    body = ibytes + vbytes
    head = struct.pack("<2sBBBBHQ", b"HL", 1, algo_id, 1, len(shape), len(extra), len(body))
    head += struct.pack(f"<{len(shape)}q", *shape)
    return head + extra + body


@pytest.mark.parametrize("explicit", [False, True])
def test_plain_codecs_keep_the_payload_bytes_exactly(explicit):
    g = _grad(seed=3, shape=(50, 60))
    kw = {"index_codec": "plain", "value_codec": "plain"} if explicit else {}
    c = C.get("topk", ratio=0.01, **kw)
    payload, _ = c.encode(g, c.init(g))
    x = g.reshape(-1)
    idx = sorted(torch.topk(x.abs(), 30).indices.tolist())
    want = _hand_payload(20, (50, 60), idx, [float(x[i]) for i in idx])
    assert bytes(payload.numpy().tobytes()) == want
    assert c.params() == {"ratio": 0.01}


@pytest.mark.parametrize("name,params", SPARSIFIERS, ids=S_IDS)
def test_plain_sparsifiers_write_no_codec_fields(name, params):
    c = C.get(name, **params)
    g = _grad()
    payload, _ = c.encode(g, c.init(g, seed=1))
    k, word = _word(payload)
    assert word == 4  # index item size only: no codec ids
    assert len(C.base.unpack_payload(payload).extra) == 16
    if c.capabilities.fixed_size:
        assert payload.numel() == c.payload_nbytes(g.numel())


# -- any sparsifier with any codec pair --------------------------------------------------

@pytest.mark.parametrize("name,params", SPARSIFIERS, ids=S_IDS)
@pytest.mark.parametrize("index", INDEX, ids=_ids(INDEX))
@pytest.mark.parametrize("value", VALUE, ids=_ids(VALUE))
def test_every_sparsifier_runs_every_codec_pair(name, params, index, value):
    c = C.get(name, **params, **index, **value)
    g = _grad(seed=5, shape=(30, 100))
    st = c.init(g, seed=2)
    for _ in range(2):
        payload, st = c.encode(g, st)
        out = c.decode(payload)
        assert out.shape == g.shape and out.dtype == g.dtype
        _, word = _word(payload)
        ids = (word >> 8 & 0xFF, word >> 16 & 0xFF)
        assert ids == (c.index_codec.codec_id, c.value_codec.codec_id)
        assert payload.numel() <= c.payload_nbytes(g.numel(), g.dim())
        if c.capabilities.fixed_size:
            assert payload.numel() == c.payload_nbytes(g.numel(), g.dim())
    # the header names the codecs: another instance (plain) decodes it the same
    assert torch.equal(C.get(name, **params).decode(payload), out)


@pytest.mark.parametrize("index", [{"index_codec": "rle"}, {"index_codec": "bloom"}],
                         ids=["rle", "bloom-fpaware"])
def test_exact_index_codecs_place_every_value_at_its_own_index(index):
    g = _grad(n=20000, seed=7)
    c = C.get("topk", ratio=0.01, **index)
    out = c.decode(c.encode(g, c.init(g))[0])
    nz = torch.nonzero(out).reshape(-1)
    assert nz.numel() == 200
    assert torch.equal(out[nz], g[nz])
    if index["index_codec"] == "rle":  # lossless: exactly the plain top-k
        assert torch.equal(out, C.get("topk", ratio=0.01).decode(
            C.get("topk", ratio=0.01).encode(g, {})[0]))


@pytest.mark.parametrize("name", ["dgc", "graddrop"])
@pytest.mark.parametrize("extra", [{"index_codec": "bloom"}, {"value_codec": "curvefit"},
                                   {"index_codec": "rle", "value_codec": "curvefit"}],
                         ids=["bloom", "curvefit", "rle+curvefit"])
def test_memory_keeping_sparsifiers_lose_nothing_through_codecs(name, extra):
    """What the payload decodes to plus the kept memory is the accumulation: the
    positions a false-positive-aware filter sends and a fit's error stay local."""
    c = C.get(name, ratio=0.02, **extra)
    g = _grad(n=5000, seed=11).double()
    st = c.init(g, seed=4)
    for _ in range(3):
        key = "v" if name == "dgc" else "residual"
        before = st[key].clone()
        u_new = None
        if name == "dgc":
            u_new = st["u"].clone() * c.momentum + g
        payload, st = c.encode(g, st)
        acc = before + (u_new if name == "dgc" else g)
        assert torch.allclose(c.decode(payload) + st[key], acc, atol=1e-12)


def test_randomk_scales_the_values_it_sends_through_a_filter():
    g = _grad(n=10000, seed=2)
    c = C.get("randomk", ratio=0.01, index_codec="bloom")
    out = c.decode(c.encode(g, c.init(g, seed=3))[0])
    nz = torch.nonzero(out).reshape(-1)
    assert torch.allclose(out[nz], g[nz] * (10000 / 100))
    assert not c.capabilities.unbiased
    assert C.get("randomk", ratio=0.01, index_codec="rle").capabilities.unbiased


def test_capabilities_follow_the_codecs():
    assert C.get("topk", index_codec="bloom").capabilities.fixed_size
    assert not C.get("topk", index_codec="bloom", second_eps=0.1).capabilities.fixed_size
    assert not C.get("topk", index_codec="rle").capabilities.fixed_size
    assert C.get("topk", value_codec="curvefit").capabilities.fixed_size


def test_reselect_uses_the_codecs():
    g = _grad(n=4000, seed=9)
    c = C.get("topk", ratio=0.01, index_codec="rle", value_codec="curvefit")
    payload = c.reselect(g, k=25)
    assert _word(payload)[0] == 25
    assert torch.count_nonzero(c.decode(payload)) <= 25


def test_error_feedback_with_decay_over_a_bloom_filter():
    """Memory compensation with decay (thesis Sec. 2.2.2) is ErrorFeedback's beta/gamma:
    p = beta m + gamma g; m' = p - decode(C(p))."""
    ef = C.get("ef", inner="topk", ratio=0.02, index_codec="bloom", beta=0.7, gamma=1.0)
    g = _grad(n=3000, seed=4)
    st = ef.init(g)
    for _ in range(3):
        m = ef.error(st).clone()
        payload, st = ef.encode(g, st)
        assert torch.allclose(0.7 * m + g, ef.decode(payload) + ef.error(st), atol=1e-6)
    assert ef.params()["inner_params"]["index_codec"] == "bloom"


# -- parameters ----------------------------------------------------------------------------

PARAM_CASES = [("topk", {"ratio": 0.01, "index_codec": "bloom", "eps": 0.02,
                         "policy": "random", "fpaware": False}),
               ("topk", {"ratio": 0.01, "index_codec": "bloom", "policy": "fpaware"}),
               ("randomk", {"ratio": 0.05, "index_codec": "rle", "block_bits": 7,
                            "value_codec": "curvefit", "fit": "logit", "degree": 2}),
               ("dgc", {"ratio": 0.01, "index_codec": "bloom", "second_eps": 0.1}),
               ("graddrop", {"ratio": 0.01, "value_codec": "curvefit", "segments": 3})]


@pytest.mark.parametrize("name,params", PARAM_CASES, ids=[n for n, _ in PARAM_CASES])
def test_params_round_trip_through_the_registry_and_json(name, params):
    c = C.get(name, **params)
    p = c.params()
    again = C.get(name, **json.loads(json.dumps(p)))
    assert again.params() == p and again.capabilities == c.capabilities
    g = _grad(n=2000, seed=1)
    a, _ = c.encode(g, c.init(g, seed=3))
    b, _ = again.encode(g, again.init(g, seed=3))
    assert torch.equal(a, b)


def test_fpaware_policy_is_conflict_sets_with_fp_awareness():
    p = C.get("topk", index_codec="bloom", policy="fpaware").params()
    assert p["policy"] == "conflict" and p["fpaware"] is True


def test_unknown_codec_names_list_the_known_ones():
    with pytest.raises(ValueError, match="unknown index_codec 'blom'.*bloom.*plain.*rle"):
        C.get("topk", index_codec="blom")
    with pytest.raises(ValueError, match="unknown value_codec 'fit'.*curvefit.*plain"):
        C.get("dgc", value_codec="fit")
    assert set(index_codec_names()) >= {"plain", "rle", "bloom"}
    assert set(value_codec_names()) >= {"plain", "curvefit"}


def test_codec_parameters_without_their_codec_are_refused():
    with pytest.raises(ParamError, match="unexpected parameter.*eps.*index_codec='plain'"):
        C.get("topk", eps=0.01)
    with pytest.raises(ParamError, match="block_bits"):
        C.get("graddrop", index_codec="bloom", block_bits=4)
    with pytest.raises(ValueError, match="block_bits"):
        C.get("topk", index_codec="rle", block_bits=33)


# -- run-length code ------------------------------------------------------------------------

@pytest.mark.parametrize("bits", [1, 2, 3, 5, 7, 8, 11, 16, 17, 31, 32])
def test_pack_uint_round_trips(bits):
    gen = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2**bits, (1000,), generator=gen, dtype=torch.int64)
    packed = pack_uint(codes, bits)
    assert packed.numel() == (1000 * bits + 7) // 8
    assert torch.equal(unpack_uint(packed, bits, 1000), codes)


def test_run_length_code_of_a_small_bitmap_by_hand():
    """Thesis Sec. 2.3.1, Fig. 1 (counting zeros): positions 2, 3, 10 of 16 in 2-bit
    blocks (M = 3): runs 2, 0, 6 -> blocks 2 | 0 | 3 3 0."""
    idx = torch.tensor([2, 3, 10])
    code = RunLength(block_bits=2).encode(idx, 16, 0)
    w, count = RunLength.fields.unpack(code.fields)
    assert (w, count) == (2, 5)
    assert unpack_uint(code.section, 2, 5).tolist() == [2, 0, 3, 3, 0]
    assert torch.equal(RunLength.decode((w, count), code.section, 16, 3), idx)
    assert rle_nbits(torch.tensor([2, 0, 6]), 2) == 10


@pytest.mark.parametrize("block_bits", [0, 1, 3, 8, 32])
@pytest.mark.parametrize("case", ["random", "edges", "dense", "one", "empty"])
def test_run_length_code_is_lossless(block_bits, case):
    n = 5000
    gen = torch.Generator().manual_seed(len(case) + block_bits)
    idx = {"random": torch.sort(torch.randperm(n, generator=gen)[:77]).values,
           "edges": torch.tensor([0, 1, 2, 4998, 4999]),
           "dense": torch.arange(100, 4000),
           "one": torch.tensor([4321]),
           "empty": torch.zeros(0, dtype=torch.int64)}[case]
    codec = RunLength(block_bits=block_bits)
    code = codec.encode(idx, n, 0)
    fields = RunLength.fields.unpack(code.fields)
    assert code.section.numel() == RunLength.section_nbytes(fields, n, idx.numel())
    assert code.section.numel() <= codec.max_section_nbytes(n, idx.numel())
    assert torch.equal(RunLength.decode(fields, code.section, n, idx.numel()), idx)


def test_run_length_width_is_the_smallest_code():
    idx = torch.sort(torch.randperm(100000, generator=torch.Generator().manual_seed(0))[:1000]
                     ).values
    code = RunLength().encode(idx, 100000, 0)
    w, _ = RunLength.fields.unpack(code.fields)
    sizes = {b: RunLength(block_bits=b).encode(idx, 100000, 0).section.numel()
             for b in range(1, 33)}
    assert code.section.numel() == min(sizes.values()) == sizes[w]


# -- bad payloads -----------------------------------------------------------------------------

def _patched_word(payload, word):
    """A copy of ``payload`` with the second header word replaced."""
    from hipress_like.compressors.base import header_nbytes, unpack_payload

    h = unpack_payload(payload)
    p = payload.clone()
    off = header_nbytes(len(h.shape), 0) + 8
    p[off: off + 8] = torch.frombuffer(bytearray(struct.pack("<Q", word)), dtype=torch.uint8)
    return p


@pytest.mark.parametrize("codec", ["index", "value"])
def test_unknown_codec_ids_are_refused(codec):
    c = C.get("topk", ratio=0.01)
    g = _grad()
    payload, _ = c.encode(g, {})
    _, word = _word(payload)
    bad = _patched_word(payload, word | (0x77 << (8 if codec == "index" else 16)))
    with pytest.raises(PayloadError, match=f"{codec} codec id 119.*known: 0 \\(plain\\)"):
        c.decode(bad)


def test_reserved_bits_and_extra_length_are_checked():
    c = C.get("topk", ratio=0.01, index_codec="rle")
    g = _grad()
    payload, _ = c.encode(g, {})
    _, word = _word(payload)
    with pytest.raises(PayloadError, match="reserved bits"):
        c.decode(_patched_word(payload, word | 1 << 40))
    with pytest.raises(PayloadError, match="extra has 32 bytes"):  # rle fields declared plain
        c.decode(_patched_word(payload, 4))


@pytest.mark.parametrize("extra", INDEX[1:] + VALUE[1:], ids=_ids(INDEX[1:] + VALUE[1:]))
def test_truncated_payloads_are_refused(extra):
    c = C.get("topk", ratio=0.01, **extra)
    g = _grad(n=5000)
    payload, _ = c.encode(g, {})
    for cut in (1, 8, payload.numel() // 3):
        with pytest.raises(PayloadError):
            c.decode(payload[:-cut])


def test_a_corrupted_run_length_code_is_refused():
    c = C.get("topk", ratio=0.01, index_codec="rle", block_bits=8)
    g = _grad(n=5000)
    payload, _ = c.encode(g, {})
    h, idx, vals = unpack_sparse(payload, c.algo_id)
    from hipress_like.compressors.base import header_nbytes

    body = header_nbytes(1, 32)
    bad = payload.clone()
    bad[body + 5] = 255  # a terminating block becomes an escape: one run short
    with pytest.raises(PayloadError, match="rle payload"):
        c.decode(bad)
