"""``import hipress_like.torch as hpt``: the PyTorch face, shaped like ``horovod.torch``.

A thin re-export of ``hipress_like.adapters.torch``, plus the atomic
checkpoint files of ``adapters.torch.checkpoints``; see those modules for
what each name does. Example::

    import hipress_like.torch as hpt
    hpt.init()
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hpt.Compression.onebit, plan="auto")
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
    hpt.save_checkpoint("ck.pt", model, opt, epoch=1)   # collective; rank 0 writes
    state = hpt.elastic.TorchState(model, opt, step=0)  # torchrun restarts: elastic.py
"""
from .adapters.torch import *  # noqa: F401,F403
from .adapters.torch import __all__ as _FACE
from .adapters.torch import elastic
from .adapters.torch.checkpoints import CheckpointError, load_checkpoint, save_checkpoint

__all__ = [*_FACE, "save_checkpoint", "load_checkpoint", "CheckpointError", "elastic"]
