"""Apex's ``apex.fp16_utils``: manual mixed precision with fp32 master weights, keyed on dtype not CUDA types."""

from typing import Any

from ampkit.compat.fp16_utils.fp16_optimizer import FP16_Optimizer
from ampkit.compat.fp16_utils.fp16util import (
    BN_convert_float,
    FP16Model,
    clip_grad_norm,
    convert_module,
    convert_network,
    master_params_to_model_params,
    model_grads_to_master_grads,
    network_to_half,
    prep_param_lists,
    to_python_float,
    tofp16,
)
from ampkit.compat.fp16_utils.loss_scaler import DynamicLossScaler, LossScaler
from ampkit.missing_name import missing_name

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]


def __getattr__(name: str) -> Any:
    raise missing_name(
        f"apex.fp16_utils (ampkit.compat.fp16_utils) has no attribute {name!r}; it provides {', '.join(__all__)}",
        "apex.fp16_utils",
        name,
    )
