"""Moving tensors between TensorFlow and the torch engine: DLPack views and staging buffers.

The CaSync engine works on torch tensors and writes each averaged gradient
back *in place* into the tensor it was given. TensorFlow tensors are
immutable (TF may share one buffer between several tensors: the gradients
of ``a + b`` with respect to ``a`` and ``b`` are one tensor), so the engine
must never write into a TF buffer. Crossing the boundary therefore costs
exactly one copy per gradient per step:

1. ``as_torch(t)``: a zero-copy torch view of an eager TF tensor
   (``tf.experimental.dlpack.to_dlpack`` -> ``torch.from_dlpack``).
2. ``Staging.take(name, ...)``: a torch buffer of the wire dtype; the view is
   copied into it (the one copy; a fp16/bf16 gradient is widened to float32
   on the way) and the buffer goes to the engine, which overwrites it with
   the average.
3. ``as_tf(buffer)``: a zero-copy TF tensor over the buffer
   (``torch.utils.dlpack.to_dlpack`` -> ``tf.experimental.dlpack.from_dlpack``).

A buffer handed to TensorFlow stays alive as long as TF holds the tensor.
The next step reuses it only when TF has let it go (the torch tensor's use
count is back to one: nothing but ``Staging`` refers to it); otherwise it
allocates a fresh one, so a gradient a user kept from an earlier step is
never overwritten.
"""
from __future__ import annotations

from typing import Dict, Optional

import tensorflow as tf
import torch
from torch.utils import dlpack as torch_dlpack

__all__ = ["to_torch_dtype", "as_torch", "as_tf", "Staging"]

_DTYPES = {
    tf.float16: torch.float16, tf.bfloat16: torch.bfloat16, tf.float32: torch.float32,
    tf.float64: torch.float64, tf.int8: torch.int8, tf.uint8: torch.uint8,
    tf.int16: torch.int16, tf.uint16: torch.uint16, tf.int32: torch.int32,
    tf.uint32: torch.uint32, tf.int64: torch.int64, tf.uint64: torch.uint64,
    tf.bool: torch.bool, tf.complex64: torch.complex64, tf.complex128: torch.complex128,
}
_BACK = {v: k for k, v in _DTYPES.items()}


def to_torch_dtype(dtype: tf.DType, what: str = "tensor") -> torch.dtype:
    """The torch dtype of a TensorFlow dtype.

    Raises:
        TypeError: a dtype with no torch counterpart (tf.string, tf.resource, ...).
    """
    dtype = tf.as_dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"{what} has dtype {dtype.name}, which cannot cross to the engine; "
                        f"expected one of {', '.join(sorted(d.name for d in _DTYPES))}")
    return _DTYPES[dtype]


def to_tf_dtype(dtype: torch.dtype) -> tf.DType:
    """The TensorFlow dtype of a torch dtype."""
    return _BACK[dtype]


def as_torch(t: tf.Tensor) -> torch.Tensor:
    """A zero-copy torch view of an eager CPU TF tensor (a copy only if DLPack refuses).

    The view must be treated as read-only: it aliases TensorFlow's buffer.
    """
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(t))
    except Exception:  # a dtype or layout DLPack cannot carry: one copy through numpy
        return torch.from_numpy(t.numpy())


def as_tf(t: torch.Tensor) -> tf.Tensor:
    """A zero-copy TF tensor over a contiguous torch tensor (kept alive by TF)."""
    if not t.is_contiguous():
        t = t.contiguous()
    try:
        return tf.experimental.dlpack.from_dlpack(torch_dlpack.to_dlpack(t))
    except Exception:  # e.g. a dtype TF's DLPack import lacks: one copy through numpy
        return tf.convert_to_tensor(t.numpy())


def _in_use(t: torch.Tensor) -> bool:
    """True when something besides ``Staging`` holds ``t`` (TF, through DLPack)."""
    use = getattr(t, "_use_count", None)
    return True if use is None else use() > 1


class Staging:
    """Per-gradient torch buffers the engine may overwrite (see the module docstring)."""

    def __init__(self) -> None:
        self._bufs: Dict[str, torch.Tensor] = {}
        self.fresh = 0  # buffers allocated because TF still held the previous one

    def take(self, name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A writable buffer of ``shape``/``dtype`` for gradient ``name``, not aliased by TF."""
        buf: Optional[torch.Tensor] = self._bufs.get(name)
        if buf is None or buf.shape != shape or buf.dtype != dtype or _in_use(buf):
            if buf is not None:
                self.fresh += 1
            buf = self._bufs[name] = torch.empty(shape, dtype=dtype)
        return buf

    def current(self, name: str) -> torch.Tensor:
        """The buffer ``take``/``stage`` last returned for gradient ``name``."""
        return self._bufs[name]

    def stage(self, name: str, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Copy ``src`` (a view of a TF gradient) into gradient ``name``'s buffer; return it."""
        buf = self.take(name, src.shape, dtype)
        buf.copy_(src)
        return buf
