"""Whose kernels run an op that torch also fuses: torch's or ampkit's own (``auto | torch | ampkit``).

torch ships fused multi-tensor kernels for Adam, AdamW, SGD and Adagrad (``torch._fused_adam_`` and kin) and
its own LayerNorm/RMSNorm kernels. Where they exist for a device and compute the same thing, ``auto`` hands the
work to them on every device but the CPU: on a GPU they are the tuned ones (ampkit's per-tensor CUDA optimizer
kernels measured 0.34-0.93x torch's on an H100, its norms 0.31-1.0x), so picking ampkit's op never loses there.
On the CPU, ``auto`` keeps whichever measured faster (each optimizer states its rule and figure in
``_cpu_prefers_torch``; the norms in ``ampkit.ops.norms``). The choice is a fused optimizer's ``backend=``
keyword, else the environment variable ``AMPKIT_FUSED_BACKEND``, else ``auto``.
"""

from __future__ import annotations

import functools
import os

import torch

from ampkit.wording import shown

BACKENDS = ("auto", "torch", "ampkit")
ENV_VAR = "AMPKIT_FUSED_BACKEND"

# The dispatch key torch registers a device type's kernels under.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU"}


def resolve_backend(backend: str | None, owner: str) -> str:
    """``backend`` if given, else ``$AMPKIT_FUSED_BACKEND``, else ``auto``; anything else is a ValueError that
    names the value, where it came from and the valid ones."""
    given = backend is not None
    if not given:  # every norm call and optimizer step asks: the message is built only for a bad value
        backend = os.environ.get(ENV_VAR) or "auto"
    if backend not in BACKENDS:
        source = f"{owner}(backend=...)" if given else ENV_VAR
        raise ValueError(f"{source}: invalid fused backend {shown(backend)}; expected one of {', '.join(BACKENDS)}")
    return backend


@functools.cache
def torch_has_fused_op(op_name: str, device_type: str) -> bool:
    """Whether torch has a kernel of ``aten::<op_name>`` for ``device_type`` (``_fused_adagrad_`` has none on
    CUDA in torch 2.11-2.13, for example)."""
    key = _DISPATCH_KEYS.get(device_type)
    if key is None or not hasattr(torch, op_name):
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{op_name}", key)


def lr_for_torch_op(lr: float | torch.Tensor, device: torch.device) -> float | torch.Tensor:
    """``lr`` as torch's fused ops take it: a number, or a tensor on the parameters' device (a CPU tensor is
    read as a number there, as ``torch.optim`` does, which costs no device sync); an integer or bool tensor, which
    the groups take as its number, as a float32 one."""
    if not isinstance(lr, torch.Tensor):
        return float(lr)
    if lr.device.type == "cpu":
        return float(lr)
    return lr.to(device, dtype=lr.dtype if lr.is_floating_point() else torch.float32, non_blocking=True)
