"""A BytePS-shaped face: ``import hipress_like.byteps.torch as bps`` (like ``byteps.torch``).

BytePS itself is not used: BytePS 0.2.5, the newest release, cannot be
built against torch 2.x without patching its source, and its worker always
needs CUDA and NCCL headers. This package keeps BytePS's Python API and runs
it on this project's CaSync engine (PS by default, as BytePS's parameter
servers) and the framework-neutral core in ``hipress_like.adapters``. See
``hipress_like.byteps.torch`` for the API, the ``compression_params``
mapping and the ``BYTEPS_*`` variables that have a meaning here.
"""
