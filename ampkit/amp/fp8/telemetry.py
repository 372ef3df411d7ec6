"""What float8 does to a layer's tensors: per-layer amax, scale and the fraction of values lost to underflow.

:class:`Float8Recorder` hooks the float8 Linears of a model (either backend) while armed: each training forward
records its input's and weight's statistics, and the backward its output gradient's, as device tensors (nothing
is read to the host here). Each is cast as the recipe casts it for its first GEMM (input and weight for the
output, the output gradient for the input gradient), with the same arithmetic, so the scale is the one used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ampkit.amp.fp8.casts import scaled_cast
from ampkit.amp.fp8.recipes import Float8Recipe, OperandCast

ROLES = ("weight", "input", "grad_output")
"""The operands a float8 layer casts, as telemetry names them (fp8/<layer>/<role>/...)."""


@dataclass
class OperandStats:
    """One tensor's float8 statistics (device tensors): ``amax`` its largest magnitude, ``scale`` the scale (the
    smallest one for rowwise scaling, ``scales`` all of them), ``underflow`` the fraction of its values that are
    non-zero but cast to zero."""

    amax: torch.Tensor
    scale: torch.Tensor
    scales: torch.Tensor
    underflow: torch.Tensor


@torch.no_grad()
def operand_stats(x: torch.Tensor, cast: OperandCast, dim: int, power_of_2: bool) -> OperandStats:
    """The statistics of ``x`` (2-D) cast as ``cast`` says, rowwise along ``dim``."""
    data, scale, x_amax = scaled_cast(x, cast, dim, power_of_2)
    lost = (data.float() == 0) & (x != 0)
    underflow = lost.sum(dtype=torch.float32) / max(x.numel(), 1)
    return OperandStats(x_amax.max().float(), scale.min(), scale.reshape(-1), underflow)


class Float8Recorder:
    """Records :class:`OperandStats` per float8 layer and role while armed (between :meth:`arm` and :meth:`disarm`).

    Only forwards with gradients enabled are recorded (not validation); a layer called twice keeps the last.
    While armed, compiled code runs eagerly (``torch.compiler.set_stance("force_eager")``): compiled graphs do not
    call hooks added after compiling. Under FSDP's float8 all-gather a layer holds only float8 weight data, so
    its weight statistics are not recorded.
    """

    def __init__(self, layers: dict[str, nn.Module], recipe: Float8Recipe) -> None:
        self.layers = layers
        self.recipe = recipe
        self.stats: dict[str, dict[str, OperandStats]] = {}
        self._handles: list[Any] = []
        self._eager: Any = None

    @property
    def armed(self) -> bool:
        """Whether the recorder's hooks are installed for this step."""
        return bool(self._handles)

    def arm(self) -> None:
        """Start recording (hooks are only installed while armed: an unarmed step pays nothing)."""
        if self.armed:
            return
        self.stats = {}
        for name, layer in self.layers.items():
            self._handles.append(layer.register_forward_hook(self._forward_hook(name)))
        self._eager = torch.compiler.set_stance("force_eager")  # set now; restored on exit

    def disarm(self) -> dict[str, dict[str, OperandStats]]:
        """Stop recording; returns what was recorded since :meth:`arm`."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self._eager is not None:
            self._eager.__exit__(None, None, None)
            self._eager = None
        stats, self.stats = self.stats, {}
        return stats

    def _forward_hook(self, name: str) -> Any:
        recipe = self.recipe
        pow2 = recipe.power_of_2_scales

        def hook(layer: nn.Module, args: tuple, output: torch.Tensor) -> None:
            if not torch.is_grad_enabled():
                return
            x = args[0].detach()
            record = self.stats.setdefault(name, {})
            record["input"] = operand_stats(x.reshape(-1, x.shape[-1]), recipe.input, -1, pow2)
            weight = layer.weight
            if type(weight) in (torch.Tensor, nn.Parameter):  # FSDP's float8 all-gather hands it float8 data only
                record["weight"] = operand_stats(weight.detach().t(), recipe.weight, 0, pow2)
            if output.requires_grad:

                def grad_hook(grad: torch.Tensor) -> None:
                    g = grad.detach().reshape(-1, grad.shape[-1])
                    record["grad_output"] = operand_stats(g, recipe.grad_output, -1, pow2)

                output.register_hook(grad_hook)

        return hook
