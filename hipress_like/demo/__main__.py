"""``python -m hipress_like.demo``: run the main job."""
import sys

from .cli_digits import main

sys.exit(main())
