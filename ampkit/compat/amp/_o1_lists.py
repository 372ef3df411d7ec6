"""Apex O1's cast tables: which torch functions run in low precision, in float32, or in the widest type.

These are Apex's lists (``apex/amp/lists``) restated as data, because under the compat API Apex's
behaviour is the spec, not ``torch.autocast``'s own lists (they differ: autocast runs ``sum`` and
``pow`` in the input type, Apex in float32; autocast leaves ``atan2`` and ``cat`` to torch's type
promotion, Apex promotes explicitly and casts in-place ops to ``self``'s type). Names a torch build
lacks are skipped when the casts are installed.
"""

from __future__ import annotations

import torch
import torch.nn.functional

FUNCTIONAL = torch.nn.functional
TORCH = torch
TENSOR = torch.Tensor

# torch.nn.functional
FUNCTIONAL_LOW = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                  "conv_tbc", "linear"]  # fmt: skip
FUNCTIONAL_FP32 = [
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss",
]  # fmt: skip
BANNED_MESSAGE = (
    "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
    "It requires that the output of the previous function be already a FloatTensor. \n\n"
    "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
    "    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single layer that is compatible with amp.\n"
    "Another option is to add\n    amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`.\n"
    "If you _really_ know what you are doing, you can disable this warning by passing allow_banned=True to "
    "`amp.init()`."
)
FUNCTIONAL_BANNED = ["binary_cross_entropy"]

# torch.*
TORCH_LOW = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
             "prelu", "addmm", "addmv", "addr", "matmul", "mm", "mv", "addbmm", "baddbmm", "bmm"]  # fmt: skip
TORCH_FP32 = ["acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "reciprocal", "rsqrt",
              "sinh", "tan", "pow", "cumprod", "cumsum", "dist", "norm", "prod", "std", "sum", "var",
              "renorm"]  # fmt: skip
TORCH_PROMOTE = ["addcdiv", "addcmul", "atan2", "cross", "bilinear", "dot", "add", "div", "mul",
                 "eq", "equal", "ge", "gt", "le", "lt", "ne"]  # fmt: skip
TORCH_SEQUENCE_PROMOTE = ["cat", "stack"]

# torch.Tensor methods: Apex's own entries plus every torch.* entry that is also a Tensor method.
TENSOR_LOW = ["__matmul__", *(n for n in TORCH_LOW if hasattr(TENSOR, n))]
TENSOR_FP32 = ["__ipow__", "__pow__", "__rpow__", *(n for n in TORCH_FP32 if hasattr(TENSOR, n))]
# Apex's float32 cast "before transfer to CPU": only a tensor that is not on the CPU already is cast.
TENSOR_FP32_BEFORE_TRANSFER = ["cpu"]
TENSOR_PROMOTE = [
    "__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__", "__idiv__", "__imul__", "__isub__",
    "__itruediv__", "__le__", "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__", "__rsub__",
    "__rtruediv__", "__sub__", "__truediv__",
    *(n for n in TORCH_PROMOTE if hasattr(TENSOR, n)),
]  # fmt: skip

# RNNs: the backend functions torch.nn's RNN modules and cells call through ``torch.nn.modules.rnn._VF``.
RNN_BACKEND_FUNCTIONS = ["rnn_tanh", "rnn_relu", "lstm", "gru",
                         "rnn_tanh_cell", "rnn_relu_cell", "lstm_cell", "gru_cell"]  # fmt: skip
