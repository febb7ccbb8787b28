"""A BytePS-shaped face: ``import hipress_like.byteps.torch as bps`` (like ``byteps.torch``).

BytePS itself is not used: BytePS 0.2.5, the newest release, cannot be
built against torch 2.x without patching its source, and its worker always
needs CUDA and NCCL headers. This package keeps BytePS's Python API and runs
it on this project's CaSync engine (PS by default, as BytePS's parameter
servers) and the framework-neutral core in ``hipress_like.adapters``:

- ``torch``: the API (``import hipress_like.byteps.torch as bps``) and the
  ``BYTEPS_*`` variables that have a meaning here;
- ``mxnet``: BytePS's Gluon API (``import hipress_like.byteps.mxnet as bps``:
  ``DistributedTrainer(..., compression_params=...)``, ``byteps_push_pull``),
  in MXNet's own environment;
- ``params``: ``compression_params`` read as BytePS reads them;
- ``adaptive``: ``plan="adaptive"`` on both faces: BytePS's knobs' plan
  starts, the online planner re-plans from it;
- ``ops``: ``push_pull`` and its handles, compressed on the optimizer's
  CaSync-PS path (both ways, as BytePS's server compresses the sum again).
"""
