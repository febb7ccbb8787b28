"""``import hipress_like.mxnet as hvd``: the MXNet face, shaped like ``horovod.mxnet``.

A thin re-export of ``hipress_like.adapters.mxnet``; see that package for
what each name does. Needs MXNet, which needs numpy 1.23.5: create its
environment with ``scripts/env_mxnet.sh``. Example::

    import hipress_like.mxnet as hvd
    hvd.init()
    net.initialize(mx.init.Xavier())
    hvd.broadcast_parameters(net.collect_params(), root_rank=0)
    trainer = hvd.DistributedTrainer(net.collect_params(), "sgd",
                                     {"learning_rate": 0.05 * hvd.size()},
                                     compression=hvd.Compression.onebit, strategy="ps")
"""
from ..adapters.mxnet import *  # noqa: F401,F403
from ..adapters.mxnet import __all__  # noqa: F401
