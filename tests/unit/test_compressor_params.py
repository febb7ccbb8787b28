"""Every compressor validates its parameters: a wrong type is a TypeError, a wrong value a
ValueError, and the message says what was expected, what was found and how to fix it."""
import pytest

from hipress_like import compressors as C
from hipress_like.compressors.params import ParamError, ParamTypeError

BAD_TYPES = [
    ("randomk", {"ratio": "0.1"}, "ratio must be a number, found str '0.1'"),
    ("topk", {"ratio": None}, "ratio must be a number, found NoneType"),
    ("randomk", {"unbiased": "yes"}, "unbiased must be True or False, found str"),
    ("dgc", {"momentum": "0.9"}, "momentum must be a number"),
    ("dgc", {"warmup_steps": 2.0}, "warmup_steps must be an integer, found float"),
    ("dgc", {"clip_norm": "1"}, "clip_norm must be a number"),
    ("dgc", {"sample_ratio": [0.1]}, "sample_ratio must be a number"),
    ("graddrop", {"max_ratio": "0.5"}, "max_ratio must be a number"),
    ("powersgd", {"rank": "2"}, "rank must be an integer, found str"),
    ("powersgd", {"rank": True}, "rank must be an integer, found bool"),
    ("powersgd", {"warm_start": 1}, "warm_start must be True or False, found int"),
    ("tbq", {"threshold": "big"}, "threshold must be a number"),
    ("terngrad", {"bitwidth": 2.5}, "bitwidth must be an integer, found float"),
    ("ef", {"inner": "topk", "beta": "1"}, "beta must be a number"),
]

BAD_VALUES = [
    ("randomk", {"ratio": 0.0}, r"ratio must be a finite number in \(0, 1\]"),
    ("topk", {"ratio": 1.5}, r"ratio must be a finite number in \(0, 1\], found 1.5"),
    ("topk", {"ratio": float("nan")}, "ratio must be a finite number"),
    ("dgc", {"momentum": 1.0}, r"momentum must be a finite number in \[0, 1\)"),
    ("dgc", {"warmup_steps": -1}, "warmup_steps must be an integer >= 0"),
    ("dgc", {"clip_norm": 0}, r"clip_norm must be a finite number in \(0, inf\)"),
    ("graddrop", {"ratio": 0.1, "max_ratio": 0.05}, r"max_ratio must be in \[ratio=0.1, 1\]"),
    ("powersgd", {"rank": 0}, "rank must be an integer >= 1"),
    ("tbq", {"threshold": -0.1}, "threshold must be a finite number"),
    ("terngrad", {"bitwidth": 3}, r"bitwidth must be one of \(1, 2, 4, 8\)"),
    ("ef", {"inner": "topk", "gamma": 0}, "gamma must be a finite number"),
]


@pytest.mark.parametrize("name,params,message", BAD_TYPES,
                         ids=[f"{n}-{sorted(p.items())}" for n, p, _ in BAD_TYPES])
def test_a_parameter_of_the_wrong_type_raises_type_error(name, params, message):
    with pytest.raises(TypeError, match=message) as e:
        C.get(name, **params)
    assert isinstance(e.value, ParamTypeError)
    assert "pass" in str(e.value)  # the fix


@pytest.mark.parametrize("name,params,message", BAD_VALUES,
                         ids=[f"{n}-{sorted(p.items())}" for n, p, _ in BAD_VALUES])
def test_a_parameter_out_of_range_raises_value_error(name, params, message):
    with pytest.raises(ValueError, match=message) as e:
        C.get(name, **params)
    assert isinstance(e.value, ParamError) and not isinstance(e.value, TypeError)


def test_valid_parameters_are_kept_with_their_types():
    assert C.get("randomk", ratio=1).params()["ratio"] == 1.0
    assert C.get("dgc", warmup_steps=3, clip_norm=2).params()["warmup_steps"] == 3
    assert C.get("powersgd", rank=2, warm_start=False).params() == {"rank": 2,
                                                                    "warm_start": False}
