"""What the algorithm folders share to build their kernels: the C builder and its
compile cache (``native.py``) and the torch.compile ``Kernel`` machinery (``fused.py``)."""
