"""O2's float32 master weights, kept inside the optimizer so ``optimizer.step()`` updates them.

The optimizer's ``param_groups`` hold fp32 copies of the model's low-precision parameters (fp32
parameters stay as they are). Gradients reach the masters through :class:`GradientCombiner`
(``params=model_params, grad_owners=master_params``); after each step :meth:`copy_to_model` writes
the masters back into the model. :meth:`state_dict` saves the masters themselves (Apex did not, and
resumed O2 runs spiked), so a resumed run continues bit-identically.
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.amp.trainable import any_requires_grad
from ampkit.wording import shown

__all__ = ["MasterWeights"]


def _is_low(param: torch.Tensor) -> bool:
    """Whether ``param`` is a low-precision floating tensor, one that an fp32 master stands for."""
    return param.is_floating_point() and param.dtype != torch.float32


class MasterWeights:
    """Float32 master copies of an optimizer's low-precision parameters.

    Args:
        optimizer: a ``torch.optim.Optimizer`` already built on the (cast) model's parameters; its
            low-precision parameters are replaced by fp32 masters in its ``param_groups`` and any
            optimizer state moves with them. One ``MasterWeights`` per optimizer.
        frozen_masters: whether a low-precision parameter that does not require a gradient gets a master too. With
            False (Apex's O2 rule) it stays in the groups as it is until it requires one: :meth:`adopt_unfrozen`
            (or :meth:`refresh`) gives it its master then, from its current value.

    Attributes:
        model_params: every parameter of the optimizer as the model holds it.
        master_params: for each of ``model_params``, the tensor the optimizer updates (its fp32
            master, or the parameter itself when it is already fp32).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, *, frozen_masters: bool = True) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not isinstance(frozen_masters, bool):
            raise TypeError(f"frozen_masters must be True or False, got {shown(frozen_masters)}")
        self.optimizer = optimizer
        self.frozen_masters = frozen_masters
        self._awaiting: dict[int, torch.Tensor] = {}  # id -> low-precision param left without a master while frozen
        self.model_params: list[torch.Tensor] = []
        self.master_params: list[torch.Tensor] = []
        self._low: list[torch.Tensor] = []  # model params that have a separate master
        self._low_masters: list[torch.Tensor] = []
        self.refresh()

    def refresh(self) -> None:
        """Create masters for parameters added to the optimizer since (``add_param_group``) and, without
        ``frozen_masters``, for those unfrozen since."""
        known = {id(t) for t in self.master_params}
        unfrozen: list[torch.Tensor] = []
        for group in self.optimizer.param_groups:
            params = group["params"]
            self.check_new_params(params)  # a group added without the check (the Trainer's mid-run groups)
            for k, param in enumerate(params):
                if id(param) in self._awaiting:
                    if param.requires_grad:
                        unfrozen.append(param)
                    continue
                if id(param) in known:
                    continue
                master = param
                if self._wants_master(param):
                    master = params[k] = self._make_master(param)
                    self._low.append(param)
                    self._low_masters.append(master)
                elif _is_low(param):
                    self._awaiting[id(param)] = param
                self.model_params.append(param)
                self.master_params.append(master)
                known.add(id(master))
        for param in unfrozen:
            self._give_master(param)

    def _make_master(self, param: torch.Tensor) -> torch.Tensor:
        """``param``'s fp32 master, with its gradient; any optimizer state ``param`` has moves to it."""
        master = param.detach().to(torch.float32, copy=True).requires_grad_(param.requires_grad)
        if param.grad is not None:
            master.grad = param.grad.detach().float()
        state = self.optimizer.state
        if param in state:
            state[master] = state.pop(param)
        return master

    def release_frozen(self) -> bool:
        """Without ``frozen_masters``, put each frozen parameter back in its master's place where the master holds
        nothing it cannot give back (equal to it, no gradient, no optimizer state): one frozen after the masters were
        made but before it trained (a fine-tuning hook at the start of a run) then costs no fp32 copy, and the master
        made when it is unfrozen is the same. True when one was released."""
        if self.frozen_masters:
            return False
        state = self.optimizer.state
        pairs = [
            (p, m)
            for p, m in zip(self._low, self._low_masters, strict=True)
            if not p.requires_grad and m.grad is None and not state.get(m) and torch.equal(m, p.to(m.dtype))
        ]
        if not pairs:
            return False
        released = {id(m): p for p, m in pairs}
        for group in self.optimizer.param_groups:
            params = group["params"]
            for k, held in enumerate(params):
                if id(held) in released:
                    params[k] = released[id(held)]
        for _, master in pairs:
            state.pop(master, None)
        self.master_params = [released.get(id(m), m) for m in self.master_params]
        self._awaiting.update({id(p): p for p in released.values()})
        pairs = [(p, m) for p, m in zip(self.model_params, self.master_params, strict=True) if m is not p]
        self._low, self._low_masters = [p for p, _ in pairs], [m for _, m in pairs]
        return True

    def _give_master(self, param: torch.Tensor) -> torch.Tensor:
        """A master for ``param``, left without one while frozen, in its place in the groups; its optimizer state (held
        in ``param``'s dtype: torch's ``load_state_dict`` casts state to its parameter's) is recast to the master's."""
        del self._awaiting[id(param)]
        master = self._make_master(param)
        for group in self.optimizer.param_groups:
            params = group["params"]
            for k, held in enumerate(params):
                if held is param:
                    params[k] = master
        state = self.optimizer.state.get(master)
        if state:
            for key, value in state.items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    state[key] = value.to(torch.float32)
        self.master_params[next(i for i, p in enumerate(self.model_params) if p is param)] = master
        pairs = [(p, m) for p, m in zip(self.model_params, self.master_params, strict=True) if m is not p]
        self._low, self._low_masters = [p for p, _ in pairs], [m for _, m in pairs]
        return master

    def adopt_unfrozen(self) -> bool:
        """Give a master to each low-precision parameter left without one while frozen that requires a gradient now
        (a layer unfrozen for fine-tuning); True when there was one. Asked before each backward, it reads only the
        parameters left without a master (about 47 ns each) when there is none."""
        if not any_requires_grad(self._awaiting.values()):
            return False
        self.refresh()
        return True

    def _wants_master(self, param: torch.Tensor) -> bool:
        return _is_low(param) and (self.frozen_masters or param.requires_grad)

    def _trained_before_frozen(self, param: torch.Tensor, saved: torch.Tensor) -> bool:
        """Whether the master ``saved`` for ``param`` (frozen, without one here) holds what the parameter cannot give
        back: bits below its low precision, or optimizer state made while it trained (loaded onto it)."""
        return bool(self.optimizer.state.get(param)) or not torch.equal(saved.to(param.dtype).to(saved.dtype), saved)

    def check_new_params(self, params: list[torch.Tensor]) -> None:
        """Refuse model parameters that already have a master here: torch's check for a parameter in two groups
        compares the group's tensors with the masters, not with the model's, so a second master was made and the
        two groups' updates overwrote each other."""
        held = {id(p) for p in self._low}
        for i, param in enumerate(params):
            if id(param) in held:
                raise ValueError(
                    f"some parameters appear in more than one parameter group: params[{i}] (shape "
                    f"{tuple(param.shape)}) is already in the optimizer, as its fp32 master"
                )

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Write the masters into the model's low-precision parameters (after ``optimizer.step()``)."""
        if self._low:
            torch._foreach_copy_(self._low, self._low_masters)

    def _low_precision_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each low-precision model parameter, in the groups' order, with its master (None while it has none)."""
        return [
            (p, None if m is p else m)
            for p, m in zip(self.model_params, self.master_params, strict=True)
            if m is not p or id(p) in self._awaiting
        ]

    def state_dict(self) -> dict[str, Any]:
        """The masters' values, one entry per low-precision parameter in ``param_groups`` order (None for one left
        without a master while frozen), for checkpoints."""
        return {"master_params": [None if m is None else m.detach().clone() for _, m in self._low_precision_pairs()]}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the masters and copy them into the model where it does not hold their rounding already: a load
        between a forward and its backward (a script's wrapper of Apex's lazy init reloads its checkpoint there)
        leaves the weights that the forward saved for the backward untouched. A master saved as None starts from its
        parameter. A frozen parameter without a master here gets the saved one back where it trained before it was
        frozen (its master holds more than its half value, or the optimizer holds state for it), so a resumed run
        unfreezing it later continues bit-identically; otherwise it keeps its value (the model's own state holds it:
        a checkpoint from before frozen parameters went without masters saved one for each)."""
        if "master_params" not in state:
            raise KeyError(f"master weights state needs 'master_params'; got keys {sorted(state)}")
        saved = state["master_params"]
        pairs = self._low_precision_pairs()
        if len(saved) != len(pairs):
            raise ValueError(
                f"checkpoint holds {len(saved)} master weights but the optimizer has {len(pairs)} low-precision "
                "parameters"
            )
        for i, ((param, _), value) in enumerate(zip(pairs, saved, strict=True)):  # all, before any copy
            if value is None:
                continue
            if not isinstance(value, torch.Tensor) or value.shape != param.shape:
                got = f"shape {tuple(value.shape)}" if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"
                raise ValueError(f"master_params[{i}] is {got}, expected a tensor of shape {tuple(param.shape)}")
        for (param, master), value in zip(pairs, saved, strict=True):
            if master is None and value is not None and self._trained_before_frozen(param, value):
                master = self._give_master(param)
            if master is not None:
                master.copy_(param if value is None else value)
        stale = [(p, m) for p, m in zip(self._low, self._low_masters, strict=True) if not torch.equal(p, m.to(p.dtype))]
        if stale:
            torch._foreach_copy_([p for p, _ in stale], [m for _, m in stale])
