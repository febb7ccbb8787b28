"""The main job (``./run.sh`` = ``python -m hipress_like.demo``): digits, CaSync vs. none.

The code lives in ``cli_digits`` because it prints progress and tables (it is
a command-line program); this package re-exports its public names.
"""
from .cli_digits import DigitsConfig, DigitsNet, load_digits_split, main, train_digits

__all__ = ["DigitsConfig", "DigitsNet", "load_digits_split", "train_digits", "main"]
