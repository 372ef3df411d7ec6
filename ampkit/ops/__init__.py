"""Fused kernels (C++/CUDA) with a pure-PyTorch reference for every op.

Each family (multi-tensor math, optimizers, norms) is a C++ extension compiled on first use and cached;
``AMPKIT_OPS=reference`` forces the pure-PyTorch references, ``AMPKIT_OPS=kernel`` makes a failed build an
error, and ``python -m ampkit.ops.build`` compiles everything ahead of time. Where torch has a fused form of the same
op (Adam/AdamW/SGD/Adagrad, LayerNorm/RMSNorm), ``AMPKIT_FUSED_BACKEND`` (or an optimizer's ``backend=``) chooses
whose kernel runs: ``auto`` (torch's on a GPU, the measured faster on the CPU), ``torch`` or ``ampkit``.
"""

from ampkit.ops.multi_tensor import L2Norm, axpby_, combine_, l2norm, scale_, unscale_l2norm
from ampkit.ops.norms import (
    FusedLayerNorm,
    FusedRMSNorm,
    MixedFusedLayerNorm,
    MixedFusedRMSNorm,
    fused_layer_norm,
    fused_rms_norm,
)
from ampkit.ops.optimizers import (
    FusedAdadelta,
    FusedAdagrad,
    FusedAdam,
    FusedAdamP,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedRMSprop,
    FusedRMSpropTF,
    FusedSGD,
)
from ampkit.ops.pipeline import fused_unscale_clip_step_
from ampkit.ops.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

__all__ = [
    "FusedAdadelta",
    "FusedAdagrad",
    "FusedAdam",
    "FusedAdamP",
    "FusedLAMB",
    "FusedLayerNorm",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedRMSNorm",
    "FusedRMSprop",
    "FusedRMSpropTF",
    "FusedSGD",
    "L2Norm",
    "MixedFusedLayerNorm",
    "MixedFusedRMSNorm",
    "SyncBatchNorm",
    "axpby_",
    "combine_",
    "convert_sync_batchnorm",
    "fused_layer_norm",
    "fused_rms_norm",
    "fused_unscale_clip_step_",
    "l2norm",
    "scale_",
    "unscale_l2norm",
]
