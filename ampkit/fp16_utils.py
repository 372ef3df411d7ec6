"""``ampkit.fp16_utils``: Apex's ``apex.fp16_utils`` (``FP16_Optimizer``, ``FP16Model``, ...)."""

from ampkit.compat.fp16_utils import *  # noqa: F403
from ampkit.compat.fp16_utils import __all__  # noqa: F401
