"""O1's casts of ``torch.linalg`` (not in Apex, whose lists predate the namespace): ``linalg.matmul`` is a function
of its own, not ``torch.matmul``, so the patch of ``torch.matmul`` misses it, and ``multi_dot`` is a chain of
matmuls: both low precision; the rest refuse mixed float16/float32 inputs, as ``torch.dot`` and ``torch.cross``
do, and are promoted alike."""

import torch

MODULE = torch.linalg

FP16_FUNCS = ["matmul", "multi_dot"]

CASTS = ["vecdot", "cross", "solve", "solve_ex", "lstsq", "lu_solve", "ldl_solve", "householder_product"]
