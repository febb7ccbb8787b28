"""Compressors that wrap others: error feedback (``error_feedback.py``) and
composition (``compose.py``)."""
from . import compose, error_feedback  # noqa: F401  (registers ef and compose)
