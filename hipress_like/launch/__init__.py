"""Process launching: the floor above the scheduler (DESIGN.md, Layout).

Starting ranks is not scheduling, so it lives beside ``tuning`` above
``casync``: ``launch`` (``run_workers``: N local ranks with a ready
transport), ``cli_launch`` (its command line), ``netem`` (ranks inside
network namespaces over ``tc``-shaped links) and ``procs`` (the one
``Popen`` helper both share). The package index imports nothing, so that
``netem``'s command line starts without torch.

The old names (``hipress_like.casync.launch`` and friends) still import, as
compatibility names for users' scripts (``hipress_like/_compat.py``).
"""
