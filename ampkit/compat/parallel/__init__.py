"""Apex's ``apex.parallel`` on torch.distributed: DDP, SyncBatchNorm, LARC, Reducer.

Apex's own implementations (CUDA streams, flat allreduce buffers, a CUDA-only SyncBatchNorm) were removed
in May 2025; these keep its constructors and behaviour on top of ``torch.nn.parallel`` so legacy scripts run
unchanged on CPU (gloo) or CUDA (NCCL).
"""

from typing import Any

import torch.distributed

from ampkit.compat._exported_names import keep_exported_names
from ampkit.compat.parallel.distributed import DistributedDataParallel, Reducer
from ampkit.compat.parallel.larc import LARC
from ampkit.compat.parallel.sync_batchnorm import SyncBatchNorm, convert_syncbn_model, create_syncbn_process_group
from ampkit.missing_name import missing_name

ReduceOp = torch.distributed.ReduceOp  # Apex re-exported torch's

__all__ = [
    "DistributedDataParallel",
    "LARC",
    "ReduceOp",
    "Reducer",
    "SyncBatchNorm",
    "convert_syncbn_model",
    "create_syncbn_process_group",
]


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.parallel (ampkit.compat.parallel) has no attribute {name!r}; it provides {', '.join(__all__)}",
        "apex.parallel",
        name,
    )


keep_exported_names(__name__)  # parallel.LARC stays the class when apex.parallel.LARC (the module) is imported
