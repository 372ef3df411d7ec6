"""``ampkit.parallel``: Apex's ``apex.parallel`` (DDP, SyncBatchNorm, LARC) on torch.distributed."""

from ampkit.compat.parallel import *  # noqa: F403
from ampkit.compat.parallel import __all__  # noqa: F401
