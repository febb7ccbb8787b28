"""Curve-fitted values (hipress_like/compressors/curvefit.py; thesis Sec. 4)."""
from __future__ import annotations

import math

import pytest
import torch

import hipress_like.compressors as C
from hipress_like.compressors import PayloadError
from hipress_like.compressors.params import ParamError
from hipress_like.compressors.sparse.codecs import ceil_log2
from hipress_like.compressors.sparse.curvefit import (
    FITS,
    CurveFit,
    eval_sorted,
    fit_rmse,
    fit_sorted,
    n_coefficients,
)


def _u(k):
    return (torch.arange(k, dtype=torch.float64) + 0.5) / k


def test_a_piecewise_cubic_is_fitted_exactly():
    k = 400
    t = torch.cat([(2 * torch.arange(200, dtype=torch.float64) + 1) / 200 - 1] * 2)
    y = torch.cat([3 - t[:200] + 0.5 * t[:200] ** 3, 1 - 0.2 * t[200:] ** 2])
    fit, seg, deg, coef = fit_sorted(y, "poly", 2, 3)
    assert (fit, seg, deg, coef.numel()) == ("poly", 2, 3, 8)
    assert torch.allclose(eval_sorted(fit, coef, k, seg, deg), y, atol=1e-9)


def test_a_logit_curve_is_fitted_exactly():
    u = _u(300)
    lg = torch.log((2 - u) / u)
    y = 0.1 + 0.5 * lg + 0.05 * lg ** 2
    fit, seg, deg, coef = fit_sorted(y, "logit", 1, 2)
    assert torch.allclose(eval_sorted(fit, coef, 300, seg, deg), y, atol=1e-9)


def test_a_double_exponential_is_recovered():
    u = _u(2000)
    y = 3.0 * torch.exp(-9.0 * u) + 0.5 * torch.exp(-1.0 * u)
    fit, seg, deg, coef = fit_sorted(y, "dexp", 1, 3)
    assert fit == "dexp"
    est = eval_sorted(fit, coef, 2000, seg, deg)
    assert float((est - y).abs().max()) < 1e-3 * float(y.max())


def test_dexp_falls_back_to_a_cubic_of_the_same_size():
    y = torch.tensor([5.0, 4.0, 1.0], dtype=torch.float64)
    fit, seg, deg, coef = fit_sorted(y, "dexp", 1, 3)
    assert (fit, seg, deg, coef.numel()) == ("poly", 1, 3, 4)


@pytest.mark.parametrize("fit", FITS)
@pytest.mark.parametrize("k", [1, 2, 5, 64, 1000])
def test_encode_decode_keeps_signs_order_and_size(fit, k):
    vals = torch.randn(k, generator=torch.Generator().manual_seed(k)) * 3
    codec = CurveFit(fit=fit)
    code = codec.encode(vals)
    fields = codec.fields.unpack(code.fields)
    assert code.section.numel() == CurveFit.section_nbytes(fields, k, vals.dtype) \
        == codec.max_section_nbytes(k, 4)
    # coefficients + ceil(log2 k) bits of rank + 1 bit of sign per value
    assert code.section.numel() == 8 * n_coefficients(FITS[fields[0]], k, fields[2], fields[1]) \
        + math.ceil(k * ceil_log2(k) / 8) + math.ceil(k / 8)
    out = CurveFit.decode(fields, code.section, k, vals.dtype)
    assert torch.equal(out, code.wire) and out.dtype == vals.dtype
    nz = out != 0
    assert torch.equal(torch.sign(out[nz]), torch.sign(vals[nz]))


def test_the_fit_is_close_on_top_k_magnitudes():
    g = torch.randn(200_000, generator=torch.Generator().manual_seed(0))
    vals = g[torch.topk(g.abs(), 2000).indices]
    scale = float(vals.abs().max())
    for fit in FITS:
        assert fit_rmse(vals, fit) < 0.05 * scale, fit


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_topk_with_fitted_values_round_trips_every_dtype(dtype):
    g = torch.randn(40, 50, generator=torch.Generator().manual_seed(1)).to(dtype)
    c = C.get("topk", ratio=0.05, value_codec="curvefit")
    out = c.decode(c.encode(g, {})[0])
    assert out.shape == g.shape and out.dtype == dtype
    nz = torch.nonzero(out.reshape(-1)).reshape(-1)
    assert nz.numel() <= 100
    assert torch.equal(torch.sign(out.reshape(-1)[nz]), torch.sign(g.reshape(-1)[nz]))


def test_error_feedback_keeps_the_fit_error():
    ef = C.get("ef", inner="topk", ratio=0.02, value_codec="curvefit", fit="dexp")
    g = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    st = ef.init(g)
    m = ef.error(st).clone()
    payload, st = ef.encode(g, st)
    assert torch.allclose(m + g, ef.decode(payload) + ef.error(st), atol=1e-6)


def test_fitted_values_cost_less_than_floats():
    c = C.get("topk", ratio=0.01, value_codec="curvefit")
    plain = C.get("topk", ratio=0.01)
    n = 1 << 20
    assert c.payload_nbytes(n) < 0.8 * plain.payload_nbytes(n)


def test_bad_parameters_are_refused():
    with pytest.raises(ParamError, match="fit must be one of"):
        C.get("topk", value_codec="curvefit", fit="spline")
    with pytest.raises(ParamError):
        C.get("topk", value_codec="curvefit", degree=9)
    with pytest.raises(ParamError):
        C.get("topk", value_codec="curvefit", segments=0)


def _code(k=100):
    vals = torch.randn(k, generator=torch.Generator().manual_seed(3))
    codec = CurveFit()
    code = codec.encode(vals)
    return list(codec.fields.unpack(code.fields)), code.section.clone()


def test_ranks_that_are_not_a_permutation_are_refused():
    fields, sec = _code()
    off = 8 * fields[3]
    sec[off: off + 4] = 0  # the first ranks all become 0
    with pytest.raises(PayloadError, match="permutation"):
        CurveFit.decode(tuple(fields), sec, 100, torch.float32)


@pytest.mark.parametrize("i,value,match", [(0, 9, "unknown fit id"), (3, 5, "inconsistent"),
                                           (4, 3, "inconsistent"), (1, 12, "inconsistent")])
def test_inconsistent_fields_are_refused(i, value, match):
    fields, sec = _code()
    fields[i] = value
    with pytest.raises(PayloadError, match=match):
        CurveFit.decode(tuple(fields), sec, 100, torch.float32)


def test_non_finite_coefficients_are_refused():
    fields, sec = _code()
    sec[:8] = torch.frombuffer(bytearray(torch.tensor([float("nan")], dtype=torch.float64)
                                         .numpy().tobytes()), dtype=torch.uint8)
    with pytest.raises(PayloadError, match="non-finite"):
        CurveFit.decode(tuple(fields), sec, 100, torch.float32)
