"""Gradient-size presets: the models of HiPress Table 6, rebuilt from their layers.

The planner needs only each gradient's name and size. These presets rebuild
them from the published architectures (float32, 4 bytes per parameter) so
that plans can be made without the frameworks, and optionally scale every
gradient by a factor to fit a small machine:

    preset       Table 6: total / max / count    rebuilt here
    vgg19        548.05 / 392 MB / 38            548.05 / 392 MB / 38 (exact)
    resnet50     97.46 / 9 MB / 155              97.46 / 9 MB / 155 (MXNet v2 layout)
    bert-base    420.02 / 89.42 MB / 207         417.65 / 89.42 MB / 201 (2-class head)
    bert-large   1282.60 / 119.23 MB / 399       1278.47 / 119.23 MB / 393

(MB are MiB, as in the paper.) Two synthetic presets mirror the paper's
experiments: ``table7`` (the 4 MB, 16 MB and 392 MB gradients of Table 7)
and ``fig14`` (one gradient per power of two from 32 KB to 128 MB, Fig. 14).
"""
from __future__ import annotations

import difflib
from typing import Any, Callable, Dict, List, Tuple

__all__ = ["PRESETS", "preset", "available", "from_module", "from_json", "load_module"]

Sizes = List[Tuple[str, int]]
_F32 = 4


def _vgg19() -> Sizes:
    out: Sizes = []
    cin, i = 3, 0
    for ch, reps in [(64, 2), (128, 2), (256, 4), (512, 4), (512, 4)]:
        for _ in range(reps):
            out += [(f"features.{i}.weight", ch * cin * 9 * _F32),
                    (f"features.{i}.bias", ch * _F32)]
            cin, i = ch, i + 1
    for j, (fin, fout) in enumerate([(512 * 7 * 7, 4096), (4096, 4096), (4096, 1000)]):
        out += [(f"classifier.{j}.weight", fin * fout * _F32),
                (f"classifier.{j}.bias", fout * _F32)]
    return out


def _resnet50() -> Sizes:
    """MXNet's ResNet-50 v2 symbol (pre-activation), without the frozen data BN."""
    out: Sizes = [("conv0.weight", 64 * 3 * 49 * _F32), ("bn0.gamma", 64 * _F32),
                  ("bn0.beta", 64 * _F32)]
    cin = 64
    for s, (f, units) in enumerate([(256, 3), (512, 4), (1024, 6), (2048, 3)], start=1):
        b = f // 4
        for u in range(1, units + 1):
            p = f"stage{s}.unit{u}."
            out += [(p + "bn1.gamma", cin * _F32), (p + "bn1.beta", cin * _F32),
                    (p + "conv1.weight", b * cin * _F32),
                    (p + "bn2.gamma", b * _F32), (p + "bn2.beta", b * _F32),
                    (p + "conv2.weight", b * b * 9 * _F32),
                    (p + "bn3.gamma", b * _F32), (p + "bn3.beta", b * _F32),
                    (p + "conv3.weight", f * b * _F32)]
            if u == 1:
                out.append((p + "sc.weight", f * cin * _F32))
            cin = f
    out += [("bn1.gamma", 2048 * _F32), ("bn1.beta", 2048 * _F32),
            ("fc1.weight", 1000 * 2048 * _F32), ("fc1.bias", 1000 * _F32)]
    return out


def _bert(layers: int, hidden: int) -> Callable[[], Sizes]:
    def build() -> Sizes:
        h, ffn = hidden, 4 * hidden
        out: Sizes = [("embeddings.word.weight", 30522 * h * _F32),
                      ("embeddings.position.weight", 512 * h * _F32),
                      ("embeddings.token_type.weight", 2 * h * _F32),
                      ("embeddings.ln.gamma", h * _F32), ("embeddings.ln.beta", h * _F32)]
        for i in range(layers):
            p = f"encoder.{i}."
            for m in ("query", "key", "value", "attn_out"):
                out += [(p + m + ".weight", h * h * _F32), (p + m + ".bias", h * _F32)]
            out += [(p + "attn_ln.gamma", h * _F32), (p + "attn_ln.beta", h * _F32),
                    (p + "ffn1.weight", ffn * h * _F32), (p + "ffn1.bias", ffn * _F32),
                    (p + "ffn2.weight", h * ffn * _F32), (p + "ffn2.bias", h * _F32),
                    (p + "ffn_ln.gamma", h * _F32), (p + "ffn_ln.beta", h * _F32)]
        out += [("pooler.weight", h * h * _F32), ("pooler.bias", h * _F32),
                ("classifier.weight", 2 * h * _F32), ("classifier.bias", 2 * _F32)]
        return out
    return build


def _table7() -> Sizes:
    return [("grad_4MB", 4 << 20), ("grad_16MB", 16 << 20), ("grad_392MB", 392 << 20)]


def _fig14() -> Sizes:
    return [(f"grad_{1 << e}", 1 << e) for e in range(15, 28)]  # 32 KB .. 128 MB


PRESETS: Dict[str, Tuple[Callable[[], Sizes], str]] = {
    "vgg19": (_vgg19, "VGG19, ImageNet (HiPress Table 6: 548 MB, max 392 MB, 38 gradients)"),
    "resnet50": (_resnet50, "ResNet-50 v2 (Table 6: 97 MB, max 9 MB, 155 gradients)"),
    "bert-base": (_bert(12, 768), "BERT-base with a 2-class head (Table 6: 420 MB, max 89 MB)"),
    "bert-large": (_bert(24, 1024), "BERT-large with a 2-class head (Table 6: 1283 MB, max "
                                    "119 MB)"),
    "table7": (_table7, "the gradient sizes of HiPress Table 7: 4 MB, 16 MB, 392 MB"),
    "fig14": (_fig14, "one gradient per power of two, 32 KB .. 128 MB (HiPress Fig. 14)"),
}


def available() -> List[str]:
    """Sorted preset names."""
    return sorted(PRESETS)


def preset(name: str, scale: float = 1.0) -> Sizes:
    """(gradient name, bytes) pairs of a preset, each size times ``scale``.

    Args:
        name: a preset name (see ``available()``).
        scale: factor applied to every gradient (> 0); sizes are rounded to
            whole float32 elements, at least one.

    Raises:
        ValueError: unknown preset (lists the known ones) or scale <= 0.

    Example:
        >>> len(preset("vgg19")), max(s for _, s in preset("vgg19")) >> 20
        (38, 392)
    """
    key = name.strip().lower()
    if key not in PRESETS:
        close = difflib.get_close_matches(key, PRESETS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown preset {name!r}{hint}; available: {', '.join(available())}")
    if not scale > 0:
        raise ValueError(f"scale must be > 0, found {scale!r}")
    sizes = PRESETS[key][0]()
    if scale == 1.0:
        return sizes
    return [(n, max(_F32, int(round(s * scale / _F32)) * _F32)) for n, s in sizes]


def load_module(spec: str) -> Any:
    """Import and build the torch module of ``"package.module:attr"``.

    ``attr`` may be an ``nn.Module`` instance, or a class or function called
    without arguments to build one.

    Raises:
        ValueError: the spec is malformed, cannot be imported, or is not a module.
    """
    import importlib

    mod_name, _, attr = spec.partition(":")
    if not mod_name or not attr:
        raise ValueError(f"a module spec is 'package.module:attr', found {spec!r}")
    try:
        obj: Any = importlib.import_module(mod_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot import {spec!r}: {e}") from e
    import torch

    if not isinstance(obj, torch.nn.Module) and callable(obj):
        try:
            obj = obj()
        except TypeError as e:
            raise ValueError(f"{spec!r} must build a module without arguments: {e}") from e
    if not isinstance(obj, torch.nn.Module):
        raise ValueError(f"{spec!r} is a {type(obj).__name__}, not a torch.nn.Module")
    return obj


def from_module(spec: str) -> Sizes:
    """Gradient sizes of an importable torch module, ``"package.module:attr"``
    (``load_module``): every parameter that requires a gradient counts, at its
    own dtype's size.

    Raises:
        ValueError: the spec is malformed, cannot be imported, or is not a module.
    """
    obj = load_module(spec)
    sizes = [(n, p.numel() * p.element_size()) for n, p in obj.named_parameters()
             if p.requires_grad and p.numel() > 0]
    if not sizes:
        raise ValueError(f"{spec!r} has no parameter that requires a gradient")
    return sizes


def from_json(path: str) -> Sizes:
    """Gradient sizes from a JSON file: ``[bytes, ...]`` or ``{name: bytes}``.

    Raises:
        ValueError: unreadable file or not one of the two forms with positive integers.
    """
    import json

    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read model sizes {path!r}: {e}") from e
    if isinstance(data, list):
        data = {f"grad{i}": v for i, v in enumerate(data)}
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: expected a non-empty list of byte sizes or an object "
                         "{name: bytes}")
    out = []
    for k, v in data.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{path}: gradient {k!r} has size {v!r}; sizes are integers >= 1")
        out.append((str(k), v))
    return out
