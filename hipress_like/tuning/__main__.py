"""``python -m hipress_like.tuning``: the ``hipress-profile`` CLI."""
import sys

from .cli import main

sys.exit(main())
