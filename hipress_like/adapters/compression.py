"""The ``Compression`` namespace: Horovod's names, backed by CompLL's registry.

Horovod scripts write ``compression=hvd.Compression.fp16``; here
``Compression.none`` and ``Compression.fp16`` mean the same, and every
registered CompLL algorithm is there too (``Compression.onebit``,
``Compression.terngrad``, ``Compression.dgc``, ``Compression.powersgd``,
...). A spec is only a name plus parameters; calling it sets parameters:

    hpt.Compression.topk(ratio=0.01)
    hpt.Compression.powersgd(rank=4)

Specs keep Horovod's ``compress(tensor) -> (tensor, ctx)`` /
``decompress(tensor, ctx)`` pair so code that calls them directly still
works. The algorithms themselves live once, in ``hipress_like.compressors``;
nothing here re-implements them.
"""
from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

__all__ = ["Compression", "CompressionSpec", "resolve_compression", "is_auto"]

_ALIASES = {"none": "identity", "noop": "identity"}


def _fp16_array(arr: Any) -> Tuple[Any, Any]:
    """``Compression.fp16.compress`` of an array with numpy dtypes (an MXNet NDArray, as
    ``horovod.mxnet``'s face passes): floats other than float16 cast to float16, the
    original dtype as the context; anything else unchanged."""
    import numpy as np

    if np.issubdtype(np.dtype(arr.dtype), np.floating) and np.dtype(arr.dtype) != np.float16:
        return arr.astype("float16"), arr.dtype
    return arr, None


def _is_tf(tensor: Any) -> bool:
    """A TensorFlow tensor or variable (known without importing TensorFlow)."""
    return type(tensor).__module__.startswith(("tensorflow", "keras"))


def _fp16_tf(tensor: Any) -> Tuple[Any, Any]:
    """``Compression.fp16.compress`` of a TensorFlow tensor, as ``horovod.tensorflow``'s:
    floats other than float16 cast to float16, the original dtype as the context."""
    import tensorflow as tf

    if tensor.dtype.is_floating and tensor.dtype != tf.float16:
        return tf.cast(tensor, tf.float16), tensor.dtype
    return tensor, None


class CompressionSpec:
    """A compressor name and its parameters (a Horovod ``Compressor`` look-alike).

    Args:
        name: registry name (``hipress_like.compressors.available()``).
        params: constructor parameters.
    """

    def __init__(self, name: str, params: Optional[Mapping[str, Any]] = None):
        self.name = _ALIASES.get(name, name)
        self.params: Dict[str, Any] = dict(params or {})

    def __call__(self, **params: Any) -> "CompressionSpec":
        """A copy with ``params`` set, e.g. ``Compression.topk(ratio=0.01)``."""
        return CompressionSpec(self.name, {**self.params, **params})

    def __repr__(self) -> str:
        ps = ", ".join(f"{k}={v!r}" for k, v in sorted(self.params.items()))
        return f"Compression.{self.name}({ps})" if ps else f"Compression.{self.name}"

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, CompressionSpec) and other.name == self.name
                and other.params == self.params)

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.params.items()))))

    def build(self) -> Any:
        """Instantiate the compressor (``ValueError`` lists the known names)."""
        from .. import compressors

        return compressors.get(self.name, **self.params)

    # Horovod's Compressor interface -------------------------------------------------
    def compress(self, tensor: Any) -> Tuple[Any, Any]:
        """Horovod-style: return (wire tensor, context for ``decompress``)."""
        import torch

        if self.name == "identity":
            return tensor, None
        if self.name == "fp16":
            if _is_tf(tensor):
                return _fp16_tf(tensor)
            if not isinstance(tensor, torch.Tensor) and hasattr(tensor, "astype"):
                return _fp16_array(tensor)  # an MXNet NDArray (or numpy array)
            if tensor.dtype.is_floating_point and tensor.dtype != torch.float16:
                return tensor.to(torch.float16), tensor.dtype
            return tensor, None
        c = self.build()
        payload, _ = c.encode(tensor, c.init(tensor))
        return payload, tensor.dtype

    def decompress(self, tensor: Any, ctx: Any) -> Any:
        """Horovod-style inverse of ``compress``."""
        if self.name == "identity" or ctx is None:
            return tensor
        if self.name == "fp16":
            if _is_tf(tensor):
                import tensorflow as tf

                return tf.cast(tensor, ctx)
            return tensor.astype(ctx) if hasattr(tensor, "astype") else tensor.to(ctx)
        return self.build().decode(tensor).to(ctx)


class _CompressionNamespace:
    """``Compression.<name>`` for every registered compressor."""

    Compressor = CompressionSpec  # Horovod exposes the base class under this name

    def __init__(self) -> None:
        self.none = CompressionSpec("identity")
        self.fp16 = CompressionSpec("fp16")

    def __getattr__(self, name: str) -> CompressionSpec:
        if name.startswith("_"):
            raise AttributeError(name)
        from .. import compressors

        known = compressors.available()
        if name.lower() not in known:
            raise AttributeError(f"Compression has no compressor {name!r}; available: "
                                 f"{', '.join(['none', *known])}")
        return CompressionSpec(name.lower())

    def get(self, name: str, **params: Any) -> CompressionSpec:
        """``Compression.get("topk", ratio=0.01)``: a spec by name."""
        return CompressionSpec(name.lower(), params)

    def __dir__(self) -> list:
        from .. import compressors

        return sorted({"none", "fp16", "get", "Compressor", *compressors.available()})


Compression = _CompressionNamespace()


def is_auto(compression: Any) -> bool:
    """True for ``"auto"`` and ``Compression.get("auto")``: the cost model picks per gradient.

    Raises:
        ValueError: ``Compression.get("auto", ...)`` with parameters (each
            candidate compressor takes its own).

    Example:
        >>> is_auto("auto"), is_auto(Compression.get("AUTO")), is_auto(Compression.none)
        (True, True, False)
    """
    if isinstance(compression, str):
        return compression.lower() == "auto"
    if isinstance(compression, CompressionSpec) and compression.name == "auto":
        if compression.params:
            raise ValueError(f"Compression.get('auto') takes no parameters, found "
                             f"{dict(compression.params)}; the cost model picks each "
                             "gradient's compressor with its default parameters")
        return True
    return False


def resolve_compression(compression: Any) -> Tuple[Any, Dict[str, Any]]:
    """Turn what a user passed as ``compression=`` into (registry name, params), or
    (the instance, {}) for a ``Compressor`` instance.

    Accepts ``None`` (no compression), a name, a ``CompressionSpec`` or a
    CompLL ``Compressor`` instance.

    Raises:
        TypeError: a Horovod-style custom class (compress/decompress on
            tensors) or anything else; its message says how to plug a
            compressor in.
        ValueError: an unknown name (lists the known ones).
    """
    from ..compressors import Compressor

    if compression is None:
        return "identity", {}
    if isinstance(compression, str):
        spec = CompressionSpec(compression.lower())
    elif isinstance(compression, CompressionSpec):
        spec = compression
    elif isinstance(compression, Compressor):
        # the instance itself (wrapped ones included): the engine takes it as it is
        return compression, {}
    else:
        raise TypeError(
            f"compression must be a name, a Compression.<name> spec or a "
            f"hipress_like Compressor, found {compression!r}. Custom Horovod-style "
            "compressors (compress/decompress on tensors) cannot be pipelined by CaSync; "
            "register a CompLL compressor with hipress_like.compressors.register(name)")
    spec.build()  # validate name and params now, with the registry's clear message
    return spec.name, dict(spec.params)
