"""BytePS's ``compression_params`` and ``BYTEPS_*`` knobs, mapped onto this project."""
import logging

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
    ({"compressor": "randomk", "k": 8, "seed": 3}, "randomk", {"seed": 3}, 8, 3),
    ({"compressor": "dithering", "k": 4}, "dithering", {"s": 4}, None, None),
    ({"compressor": "dithering", "k": 2, "partition": "natural", "normalize": "l2"},
     "natural_dithering", {"s": 2, "normalize": "l2"}, None, None),
    ({"compressor": "onebit", "ef": None, "momentum": "", "k": None}, "onebit", {}, None, None),
    # BytePS's examples pass every key whatever the compressor: accepted, as BytePS does
    ({"compressor": "onebit", "k": 0.01, "partition": "linear", "normalize": "max",
      "ef": "vanilla", "scaling": True, "fp16": False, "momentum": ""}, "ef",
     {"inner": "onebit"}, None, None),
    ({"compressor": "topk", "k": 0.1, "scaling": True, "normalize": "l2"}, "topk",
     {"ratio": 0.1}, None, None),
    ({"compressor": "randomk", "k": 0.5, "partition": "natural", "bogus": 1}, "randomk",
     {"ratio": 0.5}, None, None),
    ({"compressor": "dithering", "k": 2, "partition": 0, "normalize": ""}, "dithering",
     {"s": 2}, None, None),  # falsy values count as absent (BytePS's .get())
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
    ({"compressor": "signsgd"}, "'signsgd' is not a BytePS compressor; known: onebit, topk, "
     "randomk, dithering"),
    ({"compressor": "onebit", "ef": "corrected"}, "accepted: 'vanilla'"),
    ({"compressor": "onebit", "momentum": "nesterov"}, "nesterov=True"),
    ({"compressor": "onebit", "momentum": "heavy"}, "accepted: 'nesterov'"),
    ({"compressor": "topk"}, "needs 'k'"),
    ({"compressor": "topk", "k": 2.5}, "ratio in \\(0, 1\\) or a whole count"),
    ({"compressor": "topk", "k": "lots"}, "must be a number"),
    ({"compressor": "dithering", "k": 0.5}, "whole number of levels"),
    ({"compressor": "dithering", "k": 2, "partition": "cubic"}, "accepted: 'linear'"),
    ({"compressor": "dithering", "k": 2, "normalize": "l1"}, "accepted: 'max'"),
    # validated whatever the compressor, as BytePS does
    ({"compressor": "onebit", "partition": 1}, r"\['partition'\] = 1 is not accepted"),
    ({"compressor": "topk", "k": 0.1, "normalize": "L2"}, "accepted: 'max', 'l2'"),
    ({"compressor": "onebit", "seed": -1}, "whole number >= 0"),
])
def test_bad_compression_params_name_what_is_accepted(params, match):
    with pytest.raises(ValueError, match=match):
        map_compression_params(params)


@pytest.mark.parametrize("params,match", [
    ({"compressor": 1}, "'compressor'.* must be a str"),
    ({"compressor": "onebit", "ef": True}, "'ef'.* must be a str"),
    ({"compressor": "onebit", "momentum": 0.9}, "'momentum'.* must be a str"),
])
def test_compressor_ef_and_momentum_must_be_strings_as_in_byteps(params, match):
    with pytest.raises(TypeError, match=match):
        map_compression_params(params)


def test_no_compressor_means_no_compression_as_in_byteps():
    assert map_compression_params({"ef": "vanilla"}).spec == hp_compression().none
    assert map_compression_params({"fp16": True, "k": 0.1}).spec == hp_compression().fp16
    assert not map_compression_params({}).compresses


def hp_compression():
    from hipress_like.byteps.torch import Compression

    return Compression


def test_keys_that_do_not_apply_are_logged_once_at_debug_level(caplog):
    from hipress_like.byteps import params as module

    module._logged.clear()  # a fresh process's state
    params = {"compressor": "onebit", "k": 0.25, "normalize": "l2", "seed": 7}
    with caplog.at_level(logging.DEBUG, logger="hipress_like.byteps.params"):
        for _ in range(3):
            map_compression_params(params)
    said = [r for r in caplog.records if "do not apply" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.DEBUG
    assert "['k', 'normalize']" in said[0].getMessage()


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


def test_params_docstring_examples():
    import doctest

    from hipress_like.byteps import params as module

    res = doctest.testmod(module)
    assert res.attempted >= 2 and res.failed == 0
