"""Every fused optimizer, built as a user swapping one in for its torch.optim counterpart usually builds it (weight
decay on), keyed by a short name: the cases the torch-contract suites (optimizer, lr scheduler, GradScaler) share."""

from ampkit.ops import optimizers
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

# Every fused optimizer class the package exports (its base class aside), for checks of what each constructor takes:
# one added to ampkit.ops.optimizers is checked without a list here to extend
ALL_FUSED = [getattr(optimizers, name) for name in optimizers.__all__ if name != "FusedOptimizer"]
OPTIMIZERS = {
    "adamw": lambda p, **kw: FusedAdam(p, lr=1e-2, weight_decay=0.01, **kw),
    "adam_l2": lambda p, **kw: FusedAdam(p, lr=1e-2, weight_decay=0.01, adam_w_mode=False, **kw),
    "sgd": lambda p, **kw: FusedSGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, **kw),
    "adagrad": lambda p, **kw: FusedAdagrad(p, lr=0.1, weight_decay=0.01, **kw),
    "adadelta": lambda p, **kw: FusedAdadelta(p, lr=1.0, weight_decay=0.01, **kw),
    "adamp": lambda p, **kw: FusedAdamP(p, lr=1e-2, weight_decay=0.01, **kw),
    "lamb": lambda p, **kw: FusedLAMB(p, lr=1e-2, weight_decay=0.01, **kw),
    "mixed_precision_lamb": lambda p, **kw: FusedMixedPrecisionLamb(p, lr=1e-2, weight_decay=0.01, **kw),
    "novograd": lambda p, **kw: FusedNovoGrad(p, lr=1e-2, weight_decay=0.01, **kw),
    "rmsprop": lambda p, **kw: FusedRMSprop(p, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw),
    "rmsprop_tf": lambda p, **kw: FusedRMSpropTF(p, lr=1e-2, momentum=0.9, weight_decay=0.01, **kw),
}
SHAPES = [(5, 4), (7,), (3, 3)]
