"""O1's casts of ``torch.*`` (Apex's ``apex/amp/lists/torch_overrides.py``; the batched matmuls are low precision,
as Apex had them with CUDA 9.1 or later; ``chain_matmul``, after Apex, is a chain of them)."""

import torch

MODULE = torch

FP16_FUNCS = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
              "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm",
              "chain_matmul"]  # fmt: skip

FP32_FUNCS = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
              "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
              "renorm"]  # fmt: skip

# the widest type among the arguments (Apex's promote). Apex's list ends at ``ne``; the rest are functions that
# refuse mixed float16/float32 inputs on current torch and that Apex's lists predate or missed: ``dot``'s kin
# (``vdot``: torch's ``parametrizations.spectral_norm`` takes ``vdot`` of its float32 ``u`` and an O1-cast ``mv``),
# comparisons beside ``eq``, and the ops that write a source into ``self`` (``index_add`` of O1-cast messages into a
# float32 buffer); their in-place methods (``index_add_``) cast to ``self``'s type, as ``add_`` does
CASTS = ["addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul",
         "eq", "equal", "ge", "gt", "le", "lt", "ne",
         "vdot", "inner", "tensordot", "cdist", "lerp", "heaviside", "isclose", "allclose",
         "cholesky_solve", "triangular_solve", "complex", "polar", "binomial", "histogram", "meshgrid",
         "cartesian_prod",
         "index_add", "index_copy", "index_put", "index_reduce", "scatter", "scatter_add", "scatter_reduce",
         "masked_scatter", "put"]  # fmt: skip

SEQUENCE_CASTS = ["cat", "stack"]
