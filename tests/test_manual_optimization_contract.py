"""Manual optimization against the contract Lightning users know: ``self.backward(loss, optimizer=opt)`` gives
only that optimizer's parameters gradients (``toggle_optimizer``), each optimizer counts its own steps, and a
direct ``opt.step()``, which Lightning routes through its loss scaler, is refused here before it bypasses ampkit's;
so is an optimizer whose step needs a closure (LBFGS), which Lightning passes and the Trainer does not."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_cfg, toy_dataset

from ampkit import Callback
from ampkit.trainer.user_code import UserCodeError

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False,
         "logging.throughput": False, "trainer.num_sanity_val_steps": 0, "trainer.val_every_n_epochs": 0}  # fmt: skip


class TwoNets(ToyTrainer):
    """A GAN-shaped pair: G's output feeds D, so D's loss reaches G's parameters unless the backward is limited."""

    automatic_optimization = False

    def configure_model(self):
        return nn.ModuleDict({"G": nn.Linear(6, 6), "D": nn.Linear(6, 1)})

    def configure_optimizers(self):
        d = torch.optim.SGD(self.module["D"].parameters(), lr=0.1)
        g = torch.optim.SGD(self.module["G"].parameters(), lr=0.1)
        schedule = torch.optim.lr_scheduler.StepLR(g, step_size=1, gamma=0.5)
        return [{"optimizer": d, "name": "D"},
                {"optimizer": g, "name": "G", "lr_scheduler": {"scheduler": schedule, "interval": "step"}}]  # fmt: skip

    def train_dataloader(self):
        return DataLoader(toy_dataset(40), batch_size=8)

    def training_step(self, batch):
        x = batch[0]
        loss_d = F.softplus(self.model["D"](self.model["G"](x))).mean()
        self.backward(loss_d, loss_id="D", optimizer="D")
        self.grads_after_d = {n: p.grad is not None for n, p in self.module.named_parameters()}
        self.step("D")
        loss_g = F.softplus(-self.model["D"](self.model["G"](x))).mean()
        self.backward(loss_g, loss_id="G", optimizer="G")
        self.step("G")
        return {"loss_d": loss_d, "loss_g": loss_g}


def test_a_backward_limited_to_an_optimizer_gives_only_its_parameters_gradients(tmp_path):
    """Lightning's toggle_optimizer(D): D's loss, which depends on G too, leaves G's gradients untouched."""
    trainer = TwoNets(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 1}))
    trainer.fit()
    assert trainer.grads_after_d == {"G.weight": False, "G.bias": False, "D.weight": True, "D.bias": True}


def test_each_optimizer_counts_its_steps_and_global_step_counts_iterations(tmp_path):
    """Lightning's manual global_step adds one per optimizer step (two per batch here); ampkit's counts iterations,
    and each optimizer's own count is in optimizer_state. A step-interval scheduler steps with its optimizer, with
    no call in training_step (Lightning's manual optimization leaves that to the step)."""
    trainer = TwoNets(toy_cfg(tmp_path, **QUIET, **{"trainer.max_epochs": 2}))
    trainer.fit()
    assert trainer.state.global_step == 10
    assert [trainer.optimizer_state[opt].steps for opt in trainer.optimizers.values()] == [10, 10]
    assert trainer.optimizers["G"].param_groups[0]["lr"] == pytest.approx(0.1 * 0.5**10)
    assert trainer.optimizers["D"].param_groups[0]["lr"] == 0.1


class ReadsTheNormBetweenBackwards(TwoNets):
    """G's gradients from two backwards, their norm read after the first (to log it, say), clipped at the step."""

    def training_step(self, batch):
        x, g = batch[0], self.optimizers["G"]
        self.backward(self.model["G"](x).square().mean(), optimizer="G")
        first = float(self.grad_norm(g))
        self.backward(self.model["G"](x).abs().mean(), optimizer="G")
        exact = float(torch.nn.utils.get_total_norm([p.grad for p in self.module["G"].parameters()]))
        second = float(self.grad_norm(g))
        self.step("G")
        clipped = float(torch.nn.utils.get_total_norm([p.grad for p in self.module["G"].parameters()]))
        self.norms.append((first, second, exact, clipped))


def test_a_grad_norm_read_between_backwards_is_not_the_one_clipping_uses_after_the_next(tmp_path):
    """trainer.grad_norm is cached for the callbacks of a step; a backward since makes it stale: the second read, and
    clipping, take the norm of the gradients of both backwards."""
    cfg = toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2, "trainer.clip_grad_norm": 0.01})
    trainer = ReadsTheNormBetweenBackwards(cfg)
    trainer.norms = []
    trainer.fit()
    assert len(trainer.norms) == 2
    for first, second, exact, clipped in trainer.norms:
        assert first != pytest.approx(exact, rel=1e-3)
        assert second == pytest.approx(exact, rel=1e-6) and clipped == pytest.approx(0.01, rel=1e-5)


class StepsItself(TwoNets):
    """A Lightning port: ``opt.step()`` and ``opt.zero_grad()`` on the optimizer itself."""

    def training_step(self, batch):
        x = batch[0]
        loss_d = F.softplus(self.model["D"](self.model["G"](x))).mean()
        self.backward(loss_d, loss_id="D", optimizer="D")
        self.optimizers["D"].step()
        self.optimizers["D"].zero_grad()


class Weights(Callback):
    def on_train_start(self, trainer) -> None:
        self.before = {k: v.clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.parametrize(
    "precision",
    [
        {},
        {"precision.opt_level": "O1", "precision.dtype": "float16"},
        {"precision.opt_level": "O2", "precision.cast_modules": "[G,D]"},
    ],
    ids=["fp32", "O1-fp16", "O2"],
)
def test_a_direct_optimizer_step_is_refused_before_it_changes_anything(tmp_path, precision):
    """It would step past the loss scaler's skip rule and clipping, and under O2 move only the fp32 masters, never
    the model: a run that trains nothing, silently. Refused at the first one, naming the call to make; the weights
    are as they started, and the optimizer steps freely again once fit() returns."""
    weights = Weights()
    trainer = StepsItself(toy_cfg(tmp_path, **QUIET, **precision), callbacks=[weights])
    expected = r"optimizer 'D' was stepped directly \(optimizer.step\(\)\); under manual optimization call "
    expected += r"self.step\('D'\)"
    with pytest.raises(UserCodeError, match=expected):
        trainer.fit()
    for key, value in weights.before.items():
        assert torch.equal(trainer.module.state_dict()[key].float(), value.float()), key
    optimizer = trainer.optimizers["D"]
    assert not optimizer._optimizer_step_pre_hooks
    optimizer.step()  # outside fit: the user's own business again


class Lbfgs(ToyTrainer):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.module.parameters(), lr=0.1)


def test_an_optimizer_whose_step_needs_a_closure_is_refused_before_training_naming_it(tmp_path):
    """LBFGS failed at the first step with torch's bare 'step() missing ... closure'; Lightning passes a closure,
    the Trainer's step (and torch's GradScaler) do not: refused at set-up, naming the optimizer."""
    with pytest.raises(UserCodeError, match=r"optimizer 'lbfgs' \(LBFGS\) needs a closure in step\(\)"):
        Lbfgs(toy_cfg(tmp_path, **QUIET)).fit()
    assert not list((tmp_path / "run").rglob("*.pt"))


class ManualSharded(ToyTrainer):
    """Manual optimization with a momentum-free SGD, which keeps no state: torch.distributed.checkpoint steps such
    an optimizer itself, at a zero learning rate, to create the state it saves or loads."""

    automatic_optimization = False

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=0.05)

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss)
        self.step(self.optimizer)
        return loss


def test_a_sharded_checkpoint_under_manual_optimization_saves_and_resumes(tmp_path):
    """The direct-step guard took torch's own state-creating step for the user's: under FSDP a manual run with
    SGD failed at its first checkpoint, and every manual run failed to resume."""
    settings = {**QUIET, "checkpoint.enabled": True, "distributed.strategy": "fsdp"}
    ManualSharded(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 1})).fit()
    trainer = ManualSharded(toy_cfg(tmp_path, **settings, **{"trainer.max_epochs": 2}))
    trainer.fit(resume="last")
    assert trainer.state.global_step == 16
    assert trainer.optimizer_state[trainer.optimizer].steps == 16
    assert not trainer.optimizer._optimizer_step_pre_hooks
