"""``python -m hipress_like.cost_model``: the ``hipress-profile`` CLI."""
import sys

from .cli import main

sys.exit(main())
