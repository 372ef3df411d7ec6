"""Device-side skip verdicts (``trainer.skip_verdict``): a clipped run without a loss scaler hands the gradient
norm's finiteness to the optimizer's step as GradScaler's ``found_inf`` instead of reading it, and settles the
verdict on the host one iteration later. Run here on the CPU with ``skip_verdict=device`` (what ``auto`` picks on
CUDA): the run must be the one the host read gives, bit for bit, with the counts, skip events, LR schedule and
checkpoints of a host-read run, and no flag may be read in the iteration that made it."""

from __future__ import annotations

import pytest
import torch
from toy_trainers import NaNLossToyTrainer, toy_cfg

import ampkit
from ampkit import Callback
from ampkit.config import ConfigError
from ampkit.trainer import device_skip
from ampkit.trainer.checkpoint_io import load_checkpoint
from ampkit.trainer.device_skip import takes_device_found_inf, uses_device_verdicts

QUIET = {"checkpoint.enabled": False, "logging.tensorboard": False, "trainer.progress_bar": False}


def fused_adamw(params):
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1, fused=True)


def ampkit_adam(params):
    return ampkit.ops.FusedAdam(params, lr=0.01, weight_decay=0.1)


class ScheduledNaN(NaNLossToyTrainer):
    """A NaN loss at iteration 6 (so a non-finite clipping norm), a fused optimizer and a per-step LR schedule."""

    make_optimizer = staticmethod(fused_adamw)

    def configure_optimizers(self):
        optimizer = self.make_optimizer(self.module.parameters())
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


class Watch(Callback):
    """The learning rate each optimizer step ran with (read just before it: a device-verdict run steps its
    schedulers late, but before the next optimizer step), and every skip event with the iteration it arrived in."""

    def __init__(self) -> None:
        self.lrs: list[float] = []
        self.skips: list[tuple[int, list]] = []

    def on_before_optimizer_step(self, trainer, optimizer):
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skips.append((trainer.state.iteration, loss_ids))


def run(tmp_path, verdict: str, make_optimizer=fused_adamw, **overrides):
    watch = Watch()
    settings = {**QUIET, "trainer.clip_grad_norm": 0.5, "trainer.max_epochs": 2, "trainer.skip_verdict": verdict}
    cfg = toy_cfg(tmp_path / verdict, **{**settings, **overrides})
    trainer = type("T", (ScheduledNaN,), {"make_optimizer": staticmethod(make_optimizer)})(cfg, callbacks=[watch])
    trainer.fit()
    return trainer, watch


@pytest.mark.parametrize("make_optimizer", [fused_adamw, ampkit_adam], ids=["torch_fused_adamw", "ampkit_fused_adam"])
def test_a_device_verdict_trains_the_run_a_host_read_trains(tmp_path, make_optimizer):
    host, host_watch = run(tmp_path, "host", make_optimizer)
    device, device_watch = run(tmp_path, "device", make_optimizer)
    assert device.skips_on_device(device.optimizer) and not host.skips_on_device(host.optimizer)
    for key, value in host.module.state_dict().items():
        assert torch.equal(value, device.module.state_dict()[key]), key
    host_state, device_state = host.optimizer.state_dict()["state"], device.optimizer.state_dict()["state"]
    for index, state in host_state.items():
        for name, value in state.items():
            assert torch.equal(value, device_state[index][name]), (index, name)
    assert device_watch.lrs == host_watch.lrs  # the skipped step does not advance the schedule in either
    assert host.optimizer_state[host.optimizer].skipped_steps == 1
    for name in ("steps", "skipped_steps", "epoch_steps"):
        assert getattr(device.optimizer_state[device.optimizer], name) == getattr(
            host.optimizer_state[host.optimizer], name
        )
    assert host_watch.skips == [(6, [])]  # no loss was checked: clipping's verdict blames none
    assert device_watch.skips == [(7, [])]  # the same step, told at the next iteration's step
    assert [sc.scheduler.last_epoch for spec in device._specs for sc in spec.schedulers] == [
        sc.scheduler.last_epoch for spec in host._specs for sc in spec.schedulers
    ]


def test_no_flag_is_read_in_the_iteration_that_made_it(tmp_path, monkeypatch):
    """Every verdict is read after its iteration: at the next one's step, or at the epoch's end for the last."""
    reads: list[tuple[int, int]] = []
    trainers: list = []
    real = device_skip.UnsettledStep.skipped

    def recorded(self):
        reads.append((self.iteration, trainers[0].state.iteration, trainers[0].state.batches_done))
        return real(self)

    monkeypatch.setattr(device_skip.UnsettledStep, "skipped", recorded)
    original_init = ScheduledNaN.__init__

    def keep(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        trainers.append(self)

    monkeypatch.setattr(ScheduledNaN, "__init__", keep)
    trainer, _ = run(tmp_path, "device")
    assert trainer.state.global_step == 16
    assert [made for made, *_ in reads] == list(range(1, 17))
    for made, read_in, batches_done in reads:
        assert read_in > made or batches_done == 8  # a later iteration, or the epoch's end (8 batches an epoch)


def test_the_clipping_callback_reads_no_norm_with_a_device_verdict(tmp_path, monkeypatch):
    import math
    from types import SimpleNamespace

    from ampkit.callbacks import clipping

    calls = []
    monkeypatch.setattr(clipping, "math", SimpleNamespace(isfinite=lambda v: calls.append(v) or math.isfinite(v)))
    run(tmp_path, "device")
    assert calls == []
    run(tmp_path / "host", "host")
    assert len(calls) == 16  # the host read it checks against: once a step


def test_a_checkpoint_saves_settled_counts_and_schedules(tmp_path):
    """A checkpoint at the NaN iteration itself holds the skip and the schedule of a host-read run: resuming it
    ends where the uninterrupted run ends."""
    every = {"checkpoint.enabled": True, "checkpoint.every_n_steps": 6, "checkpoint.keep_last": 10}
    host, _ = run(tmp_path, "host", **every)
    device, _ = run(tmp_path, "device", **every)
    saved = {}
    for trainer in (host, device):
        saved[trainer] = load_checkpoint(trainer.version_dir / "checkpoints" / "step-00000006.pt")
    assert saved[device]["optimizer_counts"] == saved[host]["optimizer_counts"]
    assert [counts["skipped_steps"] for counts in saved[device]["optimizer_counts"].values()] == [1]
    assert saved[device]["schedulers"] == saved[host]["schedulers"]
    settings = {**QUIET, "trainer.clip_grad_norm": 0.5, "trainer.max_epochs": 2, "trainer.skip_verdict": "device"}
    resumed_cfg = toy_cfg(tmp_path / "resumed", **{**settings, **every})
    resumed = ScheduledNaN(resumed_cfg)
    resumed.fit(resume=device.version_dir / "checkpoints" / "step-00000006.pt")
    for key, value in device.module.state_dict().items():
        assert torch.equal(value, resumed.module.state_dict()[key]), key


def test_which_optimizers_take_a_device_verdict():
    params = [torch.nn.Parameter(torch.randn(3))]
    assert takes_device_found_inf(torch.optim.AdamW(params, fused=True))
    assert takes_device_found_inf(torch.optim.Adagrad(params, fused=True))
    assert takes_device_found_inf(torch.optim.SGD(params, lr=0.1, fused=True))
    assert takes_device_found_inf(ampkit.ops.FusedSGD(params, lr=0.1, momentum=0.9))
    assert not takes_device_found_inf(torch.optim.AdamW(params))  # foreach/for-loop Adam refuse found_inf
    assert not takes_device_found_inf(torch.optim.SGD(params, lr=0.1, momentum=0.9, fused=True))
    assert not takes_device_found_inf(torch.optim.RMSprop(params))

    class Custom(torch.optim.AdamW):  # may not pass found_inf on
        pass

    assert not takes_device_found_inf(Custom(params, fused=True))


def test_auto_keeps_verdicts_on_the_device_on_cuda_only():
    assert uses_device_verdicts("auto", torch.device("cuda", 0), sharded=False)
    assert not uses_device_verdicts("auto", torch.device("cpu"), sharded=False)
    assert uses_device_verdicts("device", torch.device("cpu"), sharded=False)
    assert not uses_device_verdicts("device", torch.device("cuda", 0), sharded=True)
    assert not uses_device_verdicts("host", torch.device("cuda", 0), sharded=False)


def test_a_bad_skip_verdict_names_itself_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.skip_verdict.*'sometimes'.*auto, host, device"):
        ScheduledNaN(toy_cfg(tmp_path, **{"trainer.skip_verdict": "sometimes"}))
