"""O1's casts of ``torch.*`` (Apex's ``apex/amp/lists/torch_overrides.py``; the batched matmuls are low precision,
as Apex had them with CUDA 9.1 or later)."""

import torch

MODULE = torch

FP16_FUNCS = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
              "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm"]  # fmt: skip

FP32_FUNCS = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
              "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
              "renorm"]  # fmt: skip

# the widest type among the arguments (Apex's promote); ``vdot`` and ``inner``, ``dot``'s kin that joined torch
# after Apex's lists were written, are promoted alike: torch's ``parametrizations.spectral_norm`` takes ``vdot`` of
# its float32 ``u`` and an O1-cast ``mv``, which torch refuses for mixed dtypes
CASTS = ["addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "vdot", "inner", "add", "div", "mul",
         "eq", "equal", "ge", "gt", "le", "lt", "ne"]  # fmt: skip

SEQUENCE_CASTS = ["cat", "stack"]
