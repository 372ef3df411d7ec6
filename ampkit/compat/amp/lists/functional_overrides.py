"""O1's casts of ``torch.nn.functional`` (Apex's ``apex/amp/lists/functional_overrides.py``)."""

import torch.nn.functional

MODULE = torch.nn.functional

# ``scaled_dot_product_attention`` (after Apex; matmuls, low precision as torch's autocast has it) refuses a query,
# key and value of mixed dtypes, and a float32 additive mask beside a low-precision query
FP16_FUNCS = ["conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "conv_tbc",
              "linear", "scaled_dot_product_attention"]  # fmt: skip

FP32_FUNCS = [
    "interpolate", "grid_sample", "softplus", "softmin", "log_softmax", "softmax", "gelu",
    "layer_norm", "group_norm", "local_response_norm", "normalize", "cosine_similarity",
    "poisson_nll_loss", "cosine_embedding_loss", "cross_entropy", "hinge_embedding_loss", "kl_div", "l1_loss",
    "mse_loss", "margin_ranking_loss", "multilabel_margin_loss", "multilabel_soft_margin_loss",
    "multi_margin_loss", "nll_loss", "binary_cross_entropy_with_logits", "smooth_l1_loss", "soft_margin_loss",
    "triplet_margin_loss", "ctc_loss",
]  # fmt: skip

# the widest type among the arguments: not in Apex's table; ``embedding_bag`` refuses low-precision
# ``per_sample_weights`` (an O1-cast linear's output) beside its float32 weight
CASTS = ["embedding_bag"]

# (name, the error a low-precision call raises unless banned functions are allowed)
BANNED_FUNCS = [
    (
        "binary_cross_entropy",
        "\namp does not work out-of-the-box with `F.binary_cross_entropy` or `torch.nn.BCELoss.` "
        "It requires that the output of the previous function be already a FloatTensor. \n\n"
        "Most models have a Sigmoid right before BCELoss. In that case, you can use\n"
        "    torch.nn.BCEWithLogitsLoss\nto combine Sigmoid+BCELoss into a single layer that is compatible with amp.\n"
        "Another option is to add\n    amp.register_float_function(torch, 'sigmoid')\nbefore calling `amp.init()`.\n"
        "If you _really_ know what you are doing, you can disable this warning by passing allow_banned=True to "
        "`amp.init()`.",
    )
]
