"""Fused optimizers: ``torch.optim.Optimizer`` subclasses whose step is one multi-tensor C++ kernel.

Each honours torch's GradScaler contract (``_step_supports_amp_scaling``), keeps the state layout of its
``torch.optim`` counterpart where one exists, and can keep fp32 master copies of fp16/bf16 parameters
(``master_weights=True``). Without a C++ compiler they run the pure-PyTorch reference of each op.
"""

from ampkit.ops.optimizers._base import FusedOptimizer
from ampkit.ops.optimizers.adadelta import FusedAdadelta
from ampkit.ops.optimizers.adagrad import FusedAdagrad
from ampkit.ops.optimizers.adam import FusedAdam
from ampkit.ops.optimizers.adamp import FusedAdamP
from ampkit.ops.optimizers.lamb import FusedLAMB, FusedMixedPrecisionLamb
from ampkit.ops.optimizers.novograd import FusedNovoGrad
from ampkit.ops.optimizers.rmsprop import FusedRMSprop, FusedRMSpropTF
from ampkit.ops.optimizers.sgd import FusedSGD

__all__ = [
    "FusedAdadelta",
    "FusedAdagrad",
    "FusedAdam",
    "FusedAdamP",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedOptimizer",
    "FusedRMSprop",
    "FusedRMSpropTF",
    "FusedSGD",
]
