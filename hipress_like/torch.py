"""``import hipress_like.torch as hpt``: the PyTorch face, shaped like ``horovod.torch``.

A thin re-export of ``hipress_like.adapters.torch``; see that module for
what each name does. Example::

    import hipress_like.torch as hpt
    hpt.init()
    opt = hpt.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hpt.Compression.onebit, plan="auto")
    hpt.broadcast_parameters(model.state_dict(), root_rank=0)
"""
from .adapters.torch import *  # noqa: F401,F403
from .adapters.torch import __all__  # noqa: F401
