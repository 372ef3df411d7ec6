"""The parameter lists Apex's lazy init left in ``optimizer._amp_stash``, rebuilt from the optimizer's groups each
time they are read, so they follow ``add_param_group``. Code outside amp reads them: weight-averaging wrappers
(local SGD, gossip) write the averaged fp16 weights into their fp32 masters through ``fp16_groups`` and
``fp32_from_fp16_groups``, and fall back to the parameters themselves where ``hasattr`` finds no such list."""

from __future__ import annotations

import torch

from ampkit.amp import MasterWeights


class MasterGroups:
    """Apex's O2 lists, one entry per param group: ``fp16`` (the model's low-precision parameters),
    ``fp32_from_fp16`` (their float32 masters, which the optimizer steps) and ``fp32_from_fp32`` (trainable parameters
    that were float32 already, batch norm's, their own masters)."""

    def __init__(self, master_weights: MasterWeights) -> None:
        model_of = {
            id(master): param
            for param, master in zip(master_weights.model_params, master_weights.master_params, strict=True)
            if master is not param
        }
        self.fp16: list[list[torch.Tensor]] = []
        self.fp32_from_fp16: list[list[torch.Tensor]] = []
        self.fp32_from_fp32: list[list[torch.Tensor]] = []
        for group in master_weights.optimizer.param_groups:
            tensors = [t for t in group["params"] if t.is_floating_point()]
            self.fp16.append([model_of[id(t)] for t in tensors if id(t) in model_of])
            self.fp32_from_fp16.append([t for t in tensors if id(t) in model_of])
            # as Apex's lazy init: a frozen parameter (one left without a master, a float32 one) is in none of the lists
            self.fp32_from_fp32.append(
                [t for t in tensors if id(t) not in model_of and t.dtype == torch.float32 and t.requires_grad]
            )


def params_of_dtype(optimizer: torch.optim.Optimizer, low: bool) -> list[torch.Tensor]:
    """Apex's O1/O3 lists: the optimizer's low-precision (``low``) or float32 parameters, in group order."""
    params = (p for group in optimizer.param_groups for p in group["params"] if p.is_floating_point())
    if low:
        return [p for p in params if p.dtype in (torch.float16, torch.bfloat16)]
    return [p for p in params if p.dtype == torch.float32]
