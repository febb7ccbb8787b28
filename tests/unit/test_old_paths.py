"""The flat layout's module paths (before the algorithm folders) still resolve.

Users' imports and pickled compressors and plans name the old paths
(``hipress_like.compressors.tbq``, ``.sparse_codecs``, ``.error_feedback``, ...):
``compressors/__init__.py`` aliases each to the module now holding its code, and
the packages that kept an old module's name re-export its public names. The
pickles below are ``base64(pickle.dumps(compressors.get(...), protocol=4))`` run on
commit c15359e (the flat layout), so they carry the old class paths.
"""
import base64
import importlib
import pickle

import pytest
import torch

import hipress_like.compressors as C

TBQ = (
    "gASVRAAAAAAAAACMHGhpcHJlc3NfbGlrZS5jb21wcmVzc29ycy50YnGUjANUQlGUk5QpgZR9lIwJdGhyZXNo"
    "b2xklEc/qZmZmZmZmnNiLg=="
)
TOPK = (
    "gASV0wEAAAAAAACMH2hpcHJlc3NfbGlrZS5jb21wcmVzc29ycy5zcGFyc2WUjARUb3BLlJOUKYGUfZQojAVy"
    "YXRpb5RHP4R64UeuFHuMC2luZGV4X2NvZGVjlIwmaGlwcmVzc19saWtlLmNvbXByZXNzb3JzLnNwYXJzZV9j"
    "b2RlY3OUjApQbGFpbkluZGV4lJOUKYGUjAt2YWx1ZV9jb2RlY5RoB4wLUGxhaW5WYWx1ZXOUk5QpgZSMDGNh"
    "cGFiaWxpdGllc5SMHWhpcHJlc3NfbGlrZS5jb21wcmVzc29ycy5iYXNllIwMQ2FwYWJpbGl0aWVzlJOUKYGU"
    "fZQojAhjYXRlZ29yeZSMDnNwYXJzaWZpY2F0aW9ulIwMYWdncmVnYXRhYmxllImMCmZpeGVkX3NpemWUiIwG"
    "cm91bmRzlEsBjAh1bmJpYXNlZJSJjAhzdGF0ZWZ1bJSJjBByb3VuZF9yZWR1Y3Rpb25zlIwDc3VtlIWUjAhz"
    "dW1tYWJsZZSJhZSMDG1lcmdlX3dpZGVuc5SJjBFzaGFyZWRfcmFuZG9tbmVzc5SJjAxrZWVwc19tZW1vcnmU"
    "iYwKb3duX2RlY29kZZSJjA1hYnNlbnRfcm91bmRzlIl1YnViLg=="
)
EF_ONEBIT = (
    "gASVDgIAAAAAAACMJ2hpcHJlc3NfbGlrZS5jb21wcmVzc29ycy5lcnJvcl9mZWVkYmFja5SMDUVycm9yRmVl"
    "ZGJhY2uUk5QpgZR9lCiMBWlubmVylIwfaGlwcmVzc19saWtlLmNvbXByZXNzb3JzLm9uZWJpdJSMBk9uZUJp"
    "dJSTlCmBlIwEYmV0YZRHP/AAAAAAAACMBWdhbW1hlEc/8AAAAAAAAIwHYWxnb19pZJRLCowNa2VybmVsc19j"
    "bGFzc5SMIGhpcHJlc3NfbGlrZS5jb21wcmVzc29ycy5rZXJuZWxzlIwMSW5uZXJLZXJuZWxzlJOUjAxjYXBh"
    "YmlsaXRpZXOUjB1oaXByZXNzX2xpa2UuY29tcHJlc3NvcnMuYmFzZZSMDENhcGFiaWxpdGllc5STlCmBlH2U"
    "KIwIY2F0ZWdvcnmUjAxxdWFudGl6YXRpb26UjAxhZ2dyZWdhdGFibGWUiYwKZml4ZWRfc2l6ZZSIjAZyb3Vu"
    "ZHOUSwGMCHVuYmlhc2VklImMCHN0YXRlZnVslIiMEHJvdW5kX3JlZHVjdGlvbnOUjANzdW2UhZSMCHN1bW1h"
    "YmxllImFlIwMbWVyZ2Vfd2lkZW5zlImMEXNoYXJlZF9yYW5kb21uZXNzlImMDGtlZXBzX21lbW9yeZSIjApv"
    "d25fZGVjb2RllImMDWFic2VudF9yb3VuZHOUiXVidWIu"
)

OLD_TO_NEW = {
    "tbq": "quantizers.tbq",
    "terngrad": "quantizers.terngrad",
    "dithering": "natural.dithering",
    "thc_kernels": "thc.kernels",
    "thc_payload": "thc.payload",
    "thc_tables": "thc.tables",
    "_fused_lowrank": "powersgd.lowrank",
    "artopk": "sparse.artopk",
    "bloom": "sparse.bloom",
    "bloom_filter": "sparse.bloom_filter",
    "curvefit": "sparse.curvefit",
    "dgc": "sparse.dgc",
    "graddrop": "sparse.graddrop",
    "sparse_codecs": "sparse.codecs",
    "compose": "wrappers.compose",
    "error_feedback": "wrappers.error_feedback",
    "_native": "_build.native",
    "_fused": "_build.fused",
}

#: Packages that kept an old module's name, and public names of that module.
KEPT = {
    "identity": ["Identity", "FP16"],
    "onebit": ["OneBit"],
    "natural": ["Natural"],
    "powersgd": ["PowerSGD", "matrix_shape", "power_iteration", "ROUND_P"],
    "thc": ["THC", "BLOCK", "randomized_hadamard", "sum_width"],
    "sparse": ["TopK", "RandomK", "Sparsifier", "num_selected", "pack_sparse", "unpack_sparse"],
}


@pytest.mark.parametrize("old", sorted(OLD_TO_NEW))
def test_an_old_module_path_imports_the_new_module(old):
    new = importlib.import_module(f"hipress_like.compressors.{OLD_TO_NEW[old]}")
    assert importlib.import_module(f"hipress_like.compressors.{old}") is new
    assert getattr(C, old) is new  # `from hipress_like.compressors import tbq` too


@pytest.mark.parametrize("package", sorted(KEPT))
def test_a_kept_name_re_exports_the_old_module(package):
    mod = importlib.import_module(f"hipress_like.compressors.{package}")
    for name in KEPT[package]:
        assert hasattr(mod, name), f"hipress_like.compressors.{package}.{name} is gone"


def test_old_from_imports_resolve():
    from hipress_like.compressors.error_feedback import ErrorFeedback
    from hipress_like.compressors.sparse_codecs import PlainIndex
    from hipress_like.compressors.tbq import TBQ

    from hipress_like.compressors.wrappers.error_feedback import ErrorFeedback as New
    assert ErrorFeedback is New and TBQ is C.get("tbq").__class__
    assert PlainIndex.__module__ == "hipress_like.compressors.sparse.codecs"


@pytest.mark.parametrize("blob, old_path, name, params", [
    (TBQ, b"compressors.tbq", "tbq", {"threshold": 0.05}),
    (TOPK, b"compressors.sparse_codecs", "topk", {"ratio": 0.01}),
    (EF_ONEBIT, b"compressors.error_feedback", "ef", {"inner": "onebit"}),
])
def test_a_compressor_pickled_with_its_old_class_path_loads_and_works(blob, old_path, name,
                                                                        params):
    raw = base64.b64decode(blob)
    assert old_path in raw
    old = pickle.loads(raw)
    new = C.get(name, **params)
    assert type(old) is type(new)
    assert old.capabilities == new.capabilities
    g = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    p_old, _ = old.encode(g, old.init(g))
    p_new, _ = new.encode(g, new.init(g))
    assert torch.equal(p_old, p_new)
    assert torch.equal(old.decode(p_old), new.decode(p_new))


def test_the_old_command_line_path_still_runs():
    """``python -m hipress_like.compressors.thc_tables_cli`` (the README's command)."""
    import subprocess
    import sys

    for mod in ("thc_tables_cli", "thc.cli_tables"):
        res = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m",
                              f"hipress_like.compressors.{mod}", "list"],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        assert "b=4 g=30" in res.stdout


# ``base64(pickle.dumps(Quorum(fraction=0.5, deadline=0.02, missing="zeros",
# resync_every=4), protocol=4))`` run on commit 52eca8b, when partial aggregation
# lived in ``hipress_like.casync.quorum``.
QUORUM = (
    "gASVjAAAAAAAAACMGmhpcHJlc3NfbGlrZS5jYXN5bmMucXVvcnVtlIwGUXVvcnVtlJOUKYGUfZQojAhmcmFj"
    "dGlvbpRHP+AAAAAAAACMCGRlYWRsaW5llEc/lHrhR64Ue4wHbWlzc2luZ5SMBXplcm9zlIwMcmVzeW5jX2V2"
    "ZXJ5lEsEjARwb2xslEc/UGJN0vGp/HViLg=="
)


def test_partial_aggregation_keeps_its_old_path_and_pickles():
    """``hipress_like.casync.quorum`` moved to ``hipress_like.partial`` (issue 44)."""
    import hipress_like.partial as P
    import hipress_like.torch as hpt

    old = importlib.import_module("hipress_like.casync.quorum")
    assert old is importlib.import_module("hipress_like.partial.lane")
    for name in ("Quorum", "QuorumLane", "QuorumError", "check_compressor"):
        assert getattr(old, name) is getattr(P, name)
    assert hpt.Quorum is P.Quorum
    raw = base64.b64decode(QUORUM)
    assert b"hipress_like.casync.quorum" in raw
    q = pickle.loads(raw)
    assert q == P.Quorum(fraction=0.5, deadline=0.02, missing="zeros", resync_every=4)
    assert q.needed(4) == 2
