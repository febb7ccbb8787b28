"""Live measurement above the engine: profiles, ``plan="auto"``, the ``hipress-profile`` CLI.

- ``profiler``: time compressors, links and engine synchronisations on this
  machine and fill a ``cost_model.Profile``;
- ``link``: the one link measurement (``measure_link``), and
  ``collective_links``, the link source the front ends pass to the engine
  for ``collective="auto"``;
- ``auto``: ``AutoPlanner`` and the plan source ``auto_plan`` the front ends
  pass to the engine for ``plan="auto"``;
- ``cli``: ``hipress-profile profile|plan|report|advise``.

This layer imports the engine (it drives it); the engine never imports it.
"""
from .auto import AutoPlanner, auto_plan
from .link import collective_links, measure_link
from .profiler import profile_compressor, profile_transport

__all__ = ["AutoPlanner", "auto_plan", "collective_links", "measure_link", "profile_compressor",
           "profile_transport"]
