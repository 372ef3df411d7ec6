"""Apex's ``Properties`` and its opt-level classes ``O0`` .. ``O3`` (``apex.amp.frontend``), and ``opt_levels``.

Scripts import them from ``apex.amp.frontend`` to print an opt level's ``brief`` and ``more`` or to build the
options a level stands for (``opt_levels["O2"](Properties()).options``). The values are the table
:func:`ampkit.amp.resolve_opt_level` applies, so they agree with what ``amp.initialize`` does; ``O4`` and ``O5``
(the bfloat16 levels ampkit's ``initialize`` also takes) are served beside Apex's four.
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.amp import resolve_opt_level
from ampkit.amp.opt_levels import parse_loss_scale
from ampkit.compat.amp._amp_state import warn_or_err
from ampkit.wording import shown

_OPTION_DEFAULTS: dict[str, Any] = {
    "enabled": False,
    "opt_level": None,
    "cast_model_type": None,
    "patch_torch_functions": False,
    "keep_batchnorm_fp32": None,
    "master_weights": None,
    "loss_scale": 1.0,
}
_PATCHING_LEVELS = ("O1", "O4")  # the levels that cast around torch functions, leaving the weights float32


class Properties:
    """A level's options, held in ``options`` and read and written as attributes; a write Apex forbids at the
    level set (``cast_model_type=torch.float16`` under O1) raises RuntimeError naming the option, or only prints a
    warning while ``amp._amp_state.hard_override`` is True, as in Apex."""

    def __init__(self) -> None:
        object.__setattr__(self, "options", dict(_OPTION_DEFAULTS))

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self.options:
            object.__setattr__(self, name, value)
            return
        checks = {
            "cast_model_type": self._check_cast_model_type,
            "patch_torch_functions": self._check_patch_torch_functions,
            "keep_batchnorm_fp32": self._check_keep_batchnorm_fp32,
            "master_weights": self._check_master_weights,
            "loss_scale": lambda v: v if v == "dynamic" else parse_loss_scale(v),
        }
        self.options[name] = checks[name](value) if name in checks else value

    def _patches(self) -> bool:
        return self.opt_level in _PATCHING_LEVELS

    def _check_cast_model_type(self, value: Any) -> Any:
        if self._patches() and value not in (None, False, torch.float32):
            warn_or_err(
                f"{self.opt_level} inserts casts around torch functions rather than casting the model weights, so "
                f"the weights stay float32; use opt_level='O2' or 'O3' to cast the model. cast_model_type was {value}"
            )
        return value

    def _check_patch_torch_functions(self, value: Any) -> Any:
        if value and not self._patches():
            warn_or_err(f"patch_torch_functions=True is only valid with opt_level='O1' (opt_level is {self.opt_level})")
        return value

    def _check_keep_batchnorm_fp32(self, value: Any) -> bool | None:
        if self._patches() and value is not None:
            warn_or_err(
                f"With opt_level {self.opt_level}, batchnorm runs in float32 automatically, so keep_batchnorm_fp32 "
                f"should be None. keep_batchnorm_fp32 was {value}"
            )
        if value in ("True", "False"):
            return value == "True"
        if value is not None and value is not True and value is not False:
            raise ValueError(
                f"keep_batchnorm_fp32={shown(value)}: expected True, False, the string 'True' or 'False', or None"
            )
        return value

    def _check_master_weights(self, value: Any) -> Any:
        if self._patches() and value is not None:
            warn_or_err(
                f"master_weights makes no sense with opt_level {self.opt_level}: the model weights themselves stay "
                f"float32. master_weights was {value}"
            )
        return value


class _OptLevel:
    """Calling one sets a :class:`Properties` to the level's options, in Apex's order (``opt_level`` first, so the
    checks know the level), and returns it."""

    level: str
    brief: str
    more: str

    def __call__(self, properties: Properties) -> Properties:
        resolved = resolve_opt_level(self.level)
        properties.enabled = True
        properties.opt_level = self.level
        for name in ("cast_model_type", "patch_torch_functions", "keep_batchnorm_fp32", "master_weights"):
            setattr(properties, name, getattr(resolved, name))
        properties.loss_scale = resolved.loss_scale
        return properties


class O0(_OptLevel):
    level = "O0"
    brief = "O0:  Pure FP32 training.\n"
    more = "The model's parameters are checked to be float32 and nothing is cast: no low-precision arithmetic.\n"


class O1(_OptLevel):
    level = "O1"
    brief = "O1:  Insert automatic casts around Pytorch functions and Tensor methods.\n"
    more = (
        "The weights stay float32; functions that gain from half precision run in it, those that need the range "
        "run in float32.\nThe safest level to start mixed precision with."
    )


class O2(_OptLevel):
    level = "O2"
    brief = "O2:  FP16 training with FP32 batchnorm and FP32 master weights.\n"
    more = (
        "The model is cast to half except its batchnorms, and its inputs are cast on the way in.\n"
        "The optimizers update float32 master weights and copy them into the model."
    )


class O3(_OptLevel):
    level = "O3"
    brief = "O3:  Pure FP16 training."
    more = (
        "The whole model is cast to half, and its inputs on the way in: the speed ceiling, which may also train.\n"
        "If it does not, try a lower level."
    )


class O4(_OptLevel):
    level = "O4"
    brief = "O4:  Insert automatic casts around Pytorch functions and Tensor methods. BFLOAT16 training.\n"
    more = "O1 in bfloat16, whose float32 range needs no loss scaling (the scale is 1)."


class O5(_OptLevel):
    level = "O5"
    brief = "O5:  BFLOAT16 training with FP32 batchnorm and FP32 master weights.\n"
    more = "O2 in bfloat16, with a loss scale of 1."


opt_levels: dict[str, _OptLevel] = {cls.level: cls() for cls in (O3, O2, O1, O0, O4, O5)}
