"""onebit's native C loops (compressors/onebit/onebit.c) against the torch kernels.

The contract is bit equality with the eager torch path (itself pinned
against the compiled one in test_quantizers.py) for every entry point the
engine uses: encode, encode with error feedback's accumulation, decode,
decode-add, decode-divide, the aggregator's decode-add-many and the
residual; for sizes around the byte boundaries, magnitudes that stress the
fixed-point sums, signed zeros, and calls split over threads. Plus the
machinery: the build cache, the fallback when no compiler works, and the
GIL being released during a call.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from test_quantizers import _assert_releases_gil  # tests/unit is on sys.path (rootdir import)

import hipress_like.compressors as C
from hipress_like.compressors._build import native as _native
from hipress_like.compressors.onebit import native as onebit_native

pytestmark = pytest.mark.skipif(not _native.available(),
                                reason="no working C compiler: the torch kernels are used")

SIZES = [1, 7, 8, 9, 17, 1001, 8 * 1021 + 5, (1 << 16) + 3]
SCALES = [1e-40, 1e-33, 1e-20, 1.0, 1e30]  # denormal, below the native sums' range, normal, huge


def _grad(n, seed, scale=1.0):
    g = torch.randn(n, generator=torch.Generator().manual_seed(seed)) * scale
    if n > 4:
        g[::5] = 0.0
        g[1::7] = -0.0
    return g


def _all_paths(g, mem, acc, count=3):
    """Every onebit entry point the engine calls, on copies of the inputs."""
    c = C.get("onebit")
    p, _ = c.encode(g, {})
    m2 = mem.clone()
    p2, _ = c.kernels.encode_accumulated_(m2, g, {})
    res = m2.clone()
    c.kernels.subtract_decoded_(res, p2)
    add = acc.clone()
    c.kernels.decode_add_(p, add)
    div = acc.clone()
    c.kernels.decode_div_(p2, div, 3)
    many = acc.clone()
    c.kernels.decode_add_many_([p, p2, p][:count], many)
    # error feedback's deferred residual: taken out in the next accumulation sweep
    tok = c.kernels.deferred_residual(p2, m2)
    applied = c.kernels.apply_residual_(m2.clone(), tok)
    m3 = m2.clone()
    p3, _ = c.kernels.encode_accumulated_(m3, g, {}, residual=tok)
    return {"payload": p, "payload_acc": p2, "mem": m2, "residual": res,
            "decode": c.decode(p), "decode_add": add, "decode_div": div, "add_many": many,
            "residual_applied": applied, "payload_deferred": p3, "mem_deferred": m3}


def _torch_paths(monkeypatch, *args, **kw):
    with monkeypatch.context() as m:
        m.setenv("HIPRESS_NO_NATIVE", "1")
        m.setenv("HIPRESS_NO_COMPILE", "1")
        return _all_paths(*args, **kw)


def _assert_same_bits(a, b, what):
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape, (what, k)
        xb = x if x.dtype == torch.uint8 else x.view(torch.int32)
        yb = y if y.dtype == torch.uint8 else y.view(torch.int32)
        assert torch.equal(xb, yb), f"{what}: {k} differs between native and torch"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES)
def test_native_matches_torch_bit_for_bit(n, scale, monkeypatch):
    g, mem, acc = _grad(n, 1, scale), _grad(n, 2, scale), _grad(n, 3)
    native = _all_paths(g, mem, acc)
    _assert_same_bits(native, _torch_paths(monkeypatch, g, mem, acc), f"n={n} scale={scale}")


@pytest.mark.parametrize("n", SIZES)
def test_deferred_residual_is_the_two_steps(n):
    """The native sweep that takes a deferred residual out, adds the gradient and
    packs gives the payload and memory of subtract_decoded_ followed by the
    accumulating encode, and apply_residual_ is subtract_decoded_."""
    c = C.get("onebit")
    g, mem = _grad(n, 11), _grad(n, 12)
    p, _ = c.kernels.encode_accumulated_(mem, _grad(n, 13), {})
    tok = c.kernels.deferred_residual(p, mem)
    two = c.kernels.subtract_decoded_(mem.clone(), p)
    assert torch.equal(c.kernels.apply_residual_(mem.clone(), tok).view(torch.int32),
                       two.view(torch.int32))
    p_two, _ = c.kernels.encode_accumulated_(two, g, {})
    one = mem.clone()
    p_one, _ = c.kernels.encode_accumulated_(one, g, {}, residual=tok)
    assert torch.equal(p_one, p_two)
    assert torch.equal(one.view(torch.int32), two.view(torch.int32))


@pytest.mark.parametrize("count", [1, 2, 3])
def test_add_many_any_count(count, monkeypatch):
    n = 8 * 4099 + 3
    g, mem, acc = _grad(n, 4), _grad(n, 5), _grad(n, 6)
    _assert_same_bits(_all_paths(g, mem, acc, count),
                      _torch_paths(monkeypatch, g, mem, acc, count), f"count={count}")


def test_calls_split_over_threads_give_the_same_bits(monkeypatch):
    """A process that gives torch several threads splits each call into byte
    ranges on a pool; the sums and bytes must not depend on that."""
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 1024)
    n = 8 * 50_000 + 5
    g, mem, acc = _grad(n, 7), _grad(n, 8), _grad(n, 9)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _all_paths(g, mem, acc)
        torch.set_num_threads(3)
        assert len(_native.ranges(n // 8, n)) == 3
        many = _all_paths(g, mem, acc)
    finally:
        torch.set_num_threads(threads)
    _assert_same_bits(one, many, "threads")
    _assert_same_bits(one, _torch_paths(monkeypatch, g, mem, acc), "threads vs torch")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_input_is_rejected(bad):
    g = _grad(1001, 1)
    g[17] = bad
    c = C.get("onebit")
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.encode(g, {})
    with pytest.raises(ValueError, match="NaN or Inf"):
        c.kernels.encode_accumulated_(torch.zeros(1001), g, {})


def test_other_dtypes_and_layouts_keep_the_torch_path():
    x16 = torch.zeros(64, dtype=torch.float16)
    assert not _native.usable(torch.zeros(64)[::2])  # not contiguous
    assert not _native.usable(torch.zeros(64, dtype=torch.float64))
    assert not _native.usable(x16)
    assert _native.usable(torch.zeros(64), torch.zeros(8, dtype=torch.uint8))
    c = C.get("onebit")
    g = _grad(1001, 3).to(torch.bfloat16)
    out = c.decode(c.encode(g, {})[0])
    assert out.dtype == torch.bfloat16 and out.shape == g.shape


def _fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(_native, "_lib", None)
    monkeypatch.setattr(_native, "_tried", False)
    monkeypatch.setenv("HIPRESS_CACHE_DIR", str(tmp_path))


def test_build_is_cached_per_source_and_machine(monkeypatch, tmp_path):
    _fresh(monkeypatch, tmp_path)
    assert _native.available()
    built = list((tmp_path / "native").glob("kernels_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    _fresh(monkeypatch, tmp_path)
    assert _native.available()  # loads the cached library, no rebuild
    assert built[0].stat().st_mtime_ns == stamp
    assert list((tmp_path / "native").iterdir()) == built  # no temporary files left


def test_a_broken_compiler_falls_back_to_torch_with_one_warning(monkeypatch, tmp_path, caplog):
    _fresh(monkeypatch, tmp_path)
    monkeypatch.setenv("CC", "false")  # exists, fails every build
    monkeypatch.setattr(_native, "_compiler", lambda: "/bin/false")
    g = _grad(8 * 1021 + 5, 2)
    with caplog.at_level(logging.WARNING, logger=_native.__name__):
        assert not _native.available()
        c = C.get("onebit")
        p = c.encode(g, {})[0]
        out = c.decode(p)
        c.decode(c.encode(g, {})[0])
    warnings = [r for r in caplog.records if r.name == _native.__name__]
    assert len(warnings) == 1 and "torch kernels" in warnings[0].getMessage()
    assert not list((tmp_path / "native").glob("*"))  # no half-built files left
    with monkeypatch.context() as m:
        m.setenv("HIPRESS_NO_COMPILE", "1")
        ref = c.decode(c.encode(g, {})[0])
    assert torch.equal(out, ref)


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("HIPRESS_NO_NATIVE", "1")
    assert not _native.available()
    assert not _native.usable(torch.zeros(8))


def test_a_long_call_releases_the_gil():
    """ctypes drops the GIL for the call, so the engine's planner and round
    executor threads keep running during a large encode (as they do with
    inductor's cpp_wrapper; see _fused)."""
    x = _grad(1 << 25, 2)  # 128 MB: a call takes tens of milliseconds
    body = torch.empty((1 << 25) // 8, dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        _assert_releases_gil(lambda: onebit_native.onebit_pack(x, body), "native")
    finally:
        torch.set_num_threads(threads)


def test_cache_dir_defaults_under_home(monkeypatch):
    monkeypatch.delenv("HIPRESS_CACHE_DIR", raising=False)
    assert _native._cache_dir() == (
        Path(os.path.expanduser("~")) / ".cache" / "hipress_like" / "native")


# -- natural compression (C_nat) ------------------------------------------------------

def _natural_edge_inputs():
    """Inputs for each rule of natural.py's module docstring."""
    f32 = torch.finfo(torch.float32)
    pw = torch.tensor([2.0 ** k for k in range(-126, 128)])
    sub = torch.tensor([k * 2.0 ** -149 for k in (1, 2, 3, 5, 1000, 2 ** 23 - 1)])
    return {
        "powers": torch.cat([pw, -pw]),
        "subnormals": torch.cat([sub, -sub, torch.tensor([1.0, -3.5, 0.0, -0.0])]),
        "below_code_range": torch.cat([sub, torch.tensor([2.0 ** 127, 0.75 * 2.0 ** -127])]),
        "overflow": torch.tensor([f32.max, -f32.max, 1.5 * 2.0 ** 127, 1.0, 1e-30]),
        "zeros": torch.zeros(17),
        "negative_zeros": -torch.zeros(17),
        "just_above_powers": torch.nextafter(pw, torch.tensor(float("inf"))),
        "float16": torch.tensor([65504.0, -6e-8, 1e-5, 0.0, 3.0] * 5).half(),
        "bfloat16": (_grad(1001, 4) * 1e30).bfloat16(),
    }


def _natural_paths(g, seed=1, step=0):
    """Every natural entry point the engine calls: payload, decode, decode-add, decode-div."""
    c = C.get("natural")
    p, _ = c.encode(g, {"seed": seed, "step": step})
    acc = _grad(g.numel(), 9).to(g.dtype)
    return {"payload": p, "decode": c.decode(p),
            "decode_add": c.kernels.decode_add_(p, acc.clone()),
            "decode_div": c.kernels.decode_div_(p, torch.empty_like(g), 3)}


def _as_bits(t):
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(ints[t.element_size()])


def _assert_natural_same_bits(a, b, what):
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (what, k)
        assert torch.equal(_as_bits(a[k]), _as_bits(b[k])), f"{what}: {k} differs"


def _natural_torch_paths(monkeypatch, *args):
    with monkeypatch.context() as m:
        m.setenv("HIPRESS_NO_NATIVE", "1")
        return _natural_paths(*args)


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("scale", SCALES)
def test_natural_native_matches_torch_bit_for_bit(n, scale, monkeypatch):
    g = _grad(n, 1, scale)
    _assert_natural_same_bits(_natural_paths(g, 5, 2),
                              _natural_torch_paths(monkeypatch, g, 5, 2), f"n={n} scale={scale}")


@pytest.mark.parametrize("kind", list(_natural_edge_inputs()))
def test_natural_native_matches_torch_on_edge_inputs(kind, monkeypatch):
    g = _natural_edge_inputs()[kind]
    for seed in range(3):
        _assert_natural_same_bits(_natural_paths(g, seed),
                                  _natural_torch_paths(monkeypatch, g, seed), f"{kind} seed={seed}")


def test_natural_calls_split_over_threads_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(_native, "PARALLEL_NUMEL", 1024)
    n = 8 * 50_000 + 5
    g = _grad(n, 7)
    g_sub = g.clone()
    g_sub[123] = 1e-40  # a subnormal: the general two-pass path
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = [_natural_paths(g), _natural_paths(g_sub)]
        torch.set_num_threads(3)
        assert len(_native.ranges(n // 8, n)) == 3
        many = [_natural_paths(g), _natural_paths(g_sub)]
    finally:
        torch.set_num_threads(threads)
    for a, b, x in zip(one, many, (g, g_sub)):
        _assert_natural_same_bits(a, b, "threads")
        _assert_natural_same_bits(a, _natural_torch_paths(monkeypatch, x), "threads vs torch")
