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
    real = device_skip.UnsettledFlag.is_set

    def recorded(self):
        reads.append((self.iteration, trainers[0].state.iteration, trainers[0].state.batches_done))
        return real(self)

    monkeypatch.setattr(device_skip.UnsettledFlag, "is_set", recorded)
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


@pytest.mark.parametrize("flag", [0.0, 1.0])
def test_an_agreed_flag_reaches_the_step_as_gradscalers_own_tensor(flag, monkeypatch):
    """Under torchrun the ranks' agreed flags view one all-reduce buffer (any_rank_on_device); handed on as a view,
    ampkit's fused step looked for it among every parameter, gradient and state tensor: ms a step at 200 params."""
    params = [torch.nn.Parameter(torch.randn(4)) for _ in range(3)]
    for p in params:
        p.grad = torch.ones_like(p)
    optimizer = ampkit.ops.FusedAdam(params, lr=0.1)
    optimizer.step()  # its state exists
    before = [p.detach().clone() for p in params]
    agreed = torch.tensor([flag, 0.0, 0.0]).unbind()  # as the all-reduce hands them back
    looks = []
    monkeypatch.setattr(ampkit.ops.optimizers._base, "shares_memory", lambda a, b: looks.append(b) or False)
    device_skip.step_with_found_inf(optimizer, agreed[0], lambda opt: opt.step())
    assert looks == []
    assert all(torch.equal(p, b) == (flag == 1.0) for p, b in zip(params, before, strict=True))
    assert not hasattr(optimizer, "found_inf")


def test_auto_keeps_verdicts_on_the_device_on_cuda_only():
    assert uses_device_verdicts("auto", torch.device("cuda", 0), sharded=False)
    assert not uses_device_verdicts("auto", torch.device("cpu"), sharded=False)
    assert uses_device_verdicts("device", torch.device("cpu"), sharded=False)
    assert not uses_device_verdicts("device", torch.device("cuda", 0), sharded=True)
    assert not uses_device_verdicts("host", torch.device("cuda", 0), sharded=False)


def test_a_bad_skip_verdict_names_itself_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.skip_verdict.*'sometimes'.*auto, host, device"):
        ScheduledNaN(toy_cfg(tmp_path, **{"trainer.skip_verdict": "sometimes"}))


# ---------------------------------------------------------------- fp16: the loss scalers' verdicts on the device
FP16 = {
    "precision.opt_level": "O1",
    "precision.dtype": "float16",
    "precision.init_scale": 256,  # the toy model does not overflow there ...
    "precision.growth_interval": 3,  # ... and grows every third clean iteration, so the rule is exercised
}


class ScaleWatch(Watch):
    """Also every scale update: (loss_id, old, new, overflowed), and the scaler states at the end."""

    def __init__(self) -> None:
        super().__init__()
        self.updates: list[tuple] = []

    def on_loss_scale_update(self, trainer, loss_id, old, new):
        self.updates.append((loss_id, old, new, trainer.loss_state[loss_id].found_inf))


class TwoLossesNaN(ScheduledNaN):
    """Manual optimization as a GAN does it: loss "A" reaches both optimizers, loss "B" only the head's, and "B"
    is NaN at iteration 6 (so only the head's step is skipped, only B's scale backs off)."""

    automatic_optimization = False

    def configure_optimizers(self):
        body = self.make_optimizer(self.module[0].parameters())
        head = self.make_optimizer(self.module[3].parameters())
        return [{"optimizer": body, "name": "body"}, {"optimizer": head, "name": "head"}]

    def training_step(self, batch):
        x, y = batch
        self.backward((self.model(x).squeeze(1) - y).square().mean(), loss_id="A")
        features = self.module[1](self.module[0](x)).detach()
        loss_b = self.module[3](features).abs().mean()
        if self.state.iteration == self.nan_at:
            loss_b = loss_b * float("nan")
        self.backward(loss_b, loss_id="B", optimizer=self.optimizers["head"])
        for optimizer in self.optimizers.values():
            self.step(optimizer)


def run_fp16(tmp_path, verdict, trainer_class, make_optimizer=fused_adamw, **overrides):
    watch = ScaleWatch()
    settings = {
        **QUIET,
        **FP16,
        "trainer.clip_grad_norm": 0.5,
        "trainer.max_epochs": 2,
        "trainer.skip_verdict": verdict,
    }
    cfg = toy_cfg(tmp_path / verdict, **{**settings, **overrides})
    trainer = type("T", (trainer_class,), {"make_optimizer": staticmethod(make_optimizer)})(cfg, callbacks=[watch])
    trainer.fit()
    return trainer, watch


def assert_same_run(host, device) -> None:
    for key, value in host.module.state_dict().items():
        assert torch.equal(value, device.module.state_dict()[key]), key
    for name, optimizer in host.optimizers.items():
        ours = device.optimizers[name].state_dict()["state"]
        for index, state in optimizer.state_dict()["state"].items():
            for key, value in state.items():
                assert torch.equal(value, ours[index][key]), (name, index, key)
    counts = {st.name: (st.steps, st.skipped_steps, st.epoch_steps) for st in host.optimizer_state.values()}
    assert {st.name: (st.steps, st.skipped_steps, st.epoch_steps) for st in device.optimizer_state.values()} == counts
    host_scalers = {k: s.scaler.state_dict() for k, s in host.loss_state.items() if s.scaler is not None}
    assert {k: s.scaler.state_dict() for k, s in device.loss_state.items() if s.scaler is not None} == host_scalers


O2 = {"precision.opt_level": "O2", "precision.cast_modules": "[0,3]"}  # fp16 Linears, fp32 masters in the optimizer


@pytest.mark.parametrize("make_optimizer", [fused_adamw, ampkit_adam], ids=["torch_fused_adamw", "ampkit_fused_adam"])
@pytest.mark.parametrize(("accumulate", "o2"), [(1, False), (2, False), (1, True)], ids=["O1", "O1_accumulate", "O2"])
def test_fp16_with_the_scaler_on_the_device_trains_the_run_of_the_host_read(tmp_path, make_optimizer, accumulate, o2):
    overrides = {"trainer.accumulate_grad_batches": accumulate, **(O2 if o2 else {})}
    host, host_watch = run_fp16(tmp_path, "host", ScheduledNaN, make_optimizer, **overrides)
    device, device_watch = run_fp16(tmp_path, "device", ScheduledNaN, make_optimizer, **overrides)
    assert device.facts_on_device and not host.facts_on_device
    assert device.loss_state[0].scaler.on_device and not host.loss_state[0].scaler.on_device
    assert_same_run(host, device)
    assert host.optimizer_state[host.optimizer].skipped_steps == 1
    assert device_watch.updates == host_watch.updates  # the same updates, told an iteration later
    assert any(overflowed for *_, overflowed in host_watch.updates)
    assert {256.0, 512.0} <= {new for _, _, new, _ in host_watch.updates}  # grew, and backed off
    assert device_watch.lrs == host_watch.lrs
    assert [loss_ids for _, loss_ids in device_watch.skips] == [loss_ids for _, loss_ids in host_watch.skips] == [[0]]


def test_two_losses_two_optimizers_skip_and_scale_apart_on_the_device(tmp_path):
    host, host_watch = run_fp16(tmp_path, "host", TwoLossesNaN)
    device, device_watch = run_fp16(tmp_path, "device", TwoLossesNaN)
    assert device.facts_on_device
    assert_same_run(host, device)
    skipped = {st.name: st.skipped_steps for st in device.optimizer_state.values()}
    assert skipped == {"body": 0, "head": 1}
    assert [loss_ids for _, loss_ids in device_watch.skips] == [loss_ids for _, loss_ids in host_watch.skips] == [["B"]]
    assert device_watch.updates == host_watch.updates
    assert {loss_id for loss_id, _, _, overflowed in host_watch.updates if overflowed} == {"B"}


def test_nothing_is_read_or_agreed_per_iteration_with_the_facts_on_the_device(tmp_path, monkeypatch):
    """The host reads of a host-verdict run (the found_inf agreement, the scaler's own read) never run."""
    import ampkit.trainer.trainer as trainer_module
    from ampkit.amp.scaler import LossScaler

    def refuse(*args, **kwargs):
        raise AssertionError("a host read in a device-verdict run")

    monkeypatch.setattr(trainer_module, "any_rank", refuse)
    real_update = LossScaler.update

    def update(self, found_inf):
        assert not isinstance(found_inf, torch.Tensor), "the scaler read a device flag"
        return real_update(self, found_inf)

    monkeypatch.setattr(LossScaler, "update", update)
    device, _ = run_fp16(tmp_path, "device", ScheduledNaN)
    assert device.optimizer_state[device.optimizer].skipped_steps == 1


def test_an_optimizer_without_a_device_verdict_keeps_every_fact_on_the_host(tmp_path):
    def sgd_momentum(params):
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)

    device, _ = run_fp16(tmp_path, "device", ScheduledNaN, sgd_momentum)
    assert not device.facts_on_device and not device.skips_on_device(device.optimizer)
    assert not device.loss_state[0].scaler.on_device
    assert device.optimizer_state[device.optimizer].skipped_steps == 1


def test_a_callback_that_needs_verdicts_at_once_keeps_them_on_the_host(tmp_path):
    """Gradient histograms name a skipped step's culprits from that iteration's gradients: with them on, the
    verdicts are read on the host, in their own iteration."""
    overrides = {"logging.grad_histograms_every_n_steps": 4, "logging.tensorboard": True}
    trainer, watch = run_fp16(tmp_path, "device", ScheduledNaN, **overrides)
    assert any(type(cb).__name__ == "GradientHistograms" for cb in trainer.callbacks)
    assert not trainer.facts_on_device and not trainer.skips_on_device(trainer.optimizer)
    assert watch.skips == [(6, [0])]


def test_an_fp16_checkpoint_at_the_overflow_holds_the_host_runs_scalers(tmp_path):
    every = {"checkpoint.enabled": True, "checkpoint.every_n_steps": 6, "checkpoint.keep_last": 10}
    host, _ = run_fp16(tmp_path, "host", ScheduledNaN, **every)
    device, _ = run_fp16(tmp_path, "device", ScheduledNaN, **every)
    saved = [load_checkpoint(t.version_dir / "checkpoints" / "step-00000006.pt") for t in (host, device)]
    for key in ("optimizer_counts", "schedulers", "callbacks"):
        assert saved[1][key] == saved[0][key], key
    settings = {**QUIET, **FP16, **every, "trainer.clip_grad_norm": 0.5, "trainer.max_epochs": 2}
    resumed = ScheduledNaN(toy_cfg(tmp_path / "resumed", **{**settings, "trainer.skip_verdict": "device"}))
    resumed.fit(resume=device.version_dir / "checkpoints" / "step-00000006.pt")
    assert_same_run(device, resumed)


def test_what_a_settled_verdict_logs_goes_to_its_own_iteration(tmp_path):
    """``amp/overflow`` and ``amp/skipped_steps`` land on the TensorBoard steps of a host-read run."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logged = {}
    for verdict in ("host", "device"):
        trainer, _ = run_fp16(tmp_path, verdict, ScheduledNaN, **{"logging.tensorboard": True})
        events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
        events.Reload()
        logged[verdict] = {
            tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in ("amp/overflow/0", "amp/loss_scale/0")
        }
    assert (6, 1.0) in logged["host"]["amp/overflow/0"]
    assert logged["device"]["amp/overflow/0"] == logged["host"]["amp/overflow/0"]
