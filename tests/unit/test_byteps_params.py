"""BytePS's ``compression_params`` and ``BYTEPS_*`` knobs, mapped onto this project."""
import pytest

import hipress_like as hp
from hipress_like.byteps.torch import Knobs, map_compression_params, read_knobs


@pytest.mark.parametrize("params,name,kw,count,seed", [
    ({"compressor": "onebit"}, "onebit", {}, None, None),
    ({"compressor": "onebit", "ef": "vanilla", "scaling": True}, "ef", {"inner": "onebit"},
     None, None),
    ({"compressor": "onebit", "scaling": "false"}, "onebit", {}, None, None),
    ({"compressor": "TopK", "k": 0.01}, "topk", {"ratio": 0.01}, None, None),
    ({"compressor": "topk", "k": "0.25", "ef": "vanilla"}, "ef",
     {"inner": "topk", "ratio": 0.25}, None, None),
    ({"compressor": "randomk", "k": 8, "seed": 3}, "randomk", {}, 8, 3),
    ({"compressor": "dithering", "k": 4}, "dithering", {"s": 4}, None, None),
    ({"compressor": "dithering", "k": 2, "partition": "natural", "normalize": "l2"},
     "natural_dithering", {"s": 2, "normalize": "l2"}, None, None),
    ({"compressor": "dithering", "k": 2, "partition": 1, "normalize": 0},
     "natural_dithering", {"s": 2, "normalize": "max"}, None, None),
    ({"compressor": "onebit", "ef": None, "momentum": "", "k": None}, "onebit", {}, None, None),
])
def test_compression_params_map_onto_this_projects_compressors(params, name, kw, count, seed):
    m = map_compression_params(params)
    assert (m.spec.name, m.spec.params, m.count, m.seed) == (name, kw, count, seed)
    if count is None:
        m.spec.build()  # a real compressor with those parameters


def test_dithering_levels_and_norm_reach_the_compressor():
    c = map_compression_params({"compressor": "dithering", "k": 3, "normalize": "l2"}).spec
    built = c.build()
    assert built.params() == {"s": 3, "p": 2.0}
    assert isinstance(built, type(hp.compressors.get("dithering", s=3)))


@pytest.mark.parametrize("params,match", [
    ({"compressor": "onebit", "bogus": 1}, r"unknown compression_params key\(s\) \['bogus'\]; "
     "accepted: compressor, ef, momentum"),
    ({"compressor": "signsgd"}, "'signsgd' is not accepted; accepted: 'onebit', 'topk'"),
    ({"ef": "vanilla"}, "needs 'compressor'"),
    ({"compressor": "onebit", "ef": "corrected"}, "accepted: 'vanilla'"),
    ({"compressor": "onebit", "momentum": "nesterov"}, "nesterov=True"),
    ({"compressor": "onebit", "momentum": "heavy"}, "accepted: 'nesterov'"),
    ({"compressor": "topk"}, "needs 'k'"),
    ({"compressor": "topk", "k": 2.5}, "ratio in \\(0, 1\\) or a whole count"),
    ({"compressor": "topk", "k": "lots"}, "must be a number"),
    ({"compressor": "dithering", "k": 0.5}, "whole number of levels"),
    ({"compressor": "dithering", "k": 2, "partition": "cubic"}, "accepted: 'linear'"),
    ({"compressor": "dithering", "k": 2, "normalize": "l1"}, "accepted: 'max'"),
    ({"compressor": "onebit", "k": 3}, r"\['k'\] do not apply to compressor 'onebit'"),
    ({"compressor": "topk", "k": 0.1, "scaling": True}, "do not apply"),
    ({"compressor": "onebit", "scaling": "maybe"}, "accepted: True, False"),
    ({"compressor": "onebit", "seed": -1}, "whole number >= 0"),
])
def test_bad_compression_params_name_what_is_accepted(params, match):
    with pytest.raises(ValueError, match=match):
        map_compression_params(params)


def test_knobs_read_partition_and_min_compress_bytes():
    k = read_knobs({"BYTEPS_PARTITION_BYTES": "1024", "BYTEPS_MIN_COMPRESS_BYTES": "0",
                    "BYTEPS_TRACE_ON": "1"})
    assert k == Knobs(partition_bytes=1024, min_compress_bytes=0)
    rule = k.rule()
    assert (rule.bytes_per_partition, rule.min_compress_bytes) == (1024, 0)
    assert read_knobs({}) == Knobs(partition_bytes=4096000, min_compress_bytes=65536)


@pytest.mark.parametrize("env,match", [
    ({"BYTEPS_PARTITION_BYTES": "0"}, "BYTEPS_PARTITION_BYTES must be an integer >= 1"),
    ({"BYTEPS_MIN_COMPRESS_BYTES": "4k"}, "BYTEPS_MIN_COMPRESS_BYTES must be an integer"),
    ({"BYTEPS_ENABLE_ASYNC": "1"}, "asynchronous training"),
])
def test_bad_knobs_are_errors(env, match):
    with pytest.raises(ValueError, match=match):
        read_knobs(env)
