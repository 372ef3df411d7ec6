"""The digits example lives in the package (``ampkit/examples/digits.py``) so a wheel install can run it;
this module keeps the ``examples.digits:DigitsTrainer`` import path of a source checkout working."""

from ampkit.examples.digits import DigitsConfig, DigitsTrainer, load_digits_split, make_mlp

__all__ = ["DigitsConfig", "DigitsTrainer", "load_digits_split", "make_mlp"]
