"""Mixed precision through the Trainer: skip semantics, per-loss scalers, parity, resume, logging."""

import math
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from omegaconf import OmegaConf
from torch import nn

import ampkit
from ampkit.callbacks import LossScaling, MixedPrecision, NonFiniteError
from ampkit.callbacks.precision_config import describe_precision
from ampkit.config import Float8Config, PrecisionConfig

DTYPES = ["float16", "bfloat16"]


def make_batches(n, seed=0, batch=8):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 4, generator=gen), torch.randn(batch, 2, generator=gen)) for _ in range(n)]


class Recorder(ampkit.Callback):
    """Records the mixed-precision hooks and snapshots parameters around every batch."""

    def __init__(self):
        self.skipped, self.scale_updates, self.unscaled = [], [], []
        self.before = {}
        self.changed = []

    @staticmethod
    def tensors(trainer, name, optimizer):
        """The optimizer's tensors (fp32 masters under O2) and the model's parameters it trains."""
        owned = [p for g in optimizer.param_groups for p in g["params"]]
        return owned + list(trainer.module.get_submodule(name).parameters())

    def on_train_batch_start(self, trainer, batch):
        self.before = {
            name: [t.detach().clone() for t in self.tensors(trainer, name, opt)]
            for name, opt in trainer.optimizers.items()
        }

    def on_train_batch_end(self, trainer, outputs, batch):
        changed = {}
        for name, opt in trainer.optimizers.items():
            now = self.tensors(trainer, name, opt)
            changed[name] = [not torch.equal(a, b) for a, b in zip(self.before[name], now, strict=True)]
        self.changed.append({name: any(flags) for name, flags in changed.items()})

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skipped.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name))

    def on_loss_scale_update(self, trainer, loss_id, old, new):
        self.scale_updates.append((trainer.state.iteration, loss_id, old, new))

    def on_after_unscale(self, trainer, optimizer, found_inf):
        self.unscaled.append((trainer.state.iteration, trainer.optimizer_state[optimizer].name, found_inf))


class TwoHeadNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh())
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def _halving_lr_each_iteration(**optimizers: torch.optim.Optimizer) -> list[dict]:
    """configure_optimizers' dicts: each named optimizer with a schedule halving its lr every iteration it steps."""
    return [
        {
            "optimizer": optimizer,
            "name": name,
            "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.5), "interval": "step"},
        }
        for name, optimizer in optimizers.items()
    ]


class SharedBackwardTrainer(ampkit.Trainer):
    """One loss, two optimizers (body and head) stepped from one backward: Lightning's failing case."""

    def configure_model(self):
        torch.manual_seed(0)
        return TwoHeadNet()

    def configure_optimizers(self):
        body = torch.optim.SGD(self.module.body.parameters(), lr=0.1)
        head = torch.optim.SGD(self.module.head.parameters(), lr=0.1)
        return _halving_lr_each_iteration(body=body, head=head)

    def train_dataloader(self):
        return make_batches(self.cfg.trainer.limit_train_batches or 6)

    def training_step(self, batch):
        x, y = batch
        loss = (self.model(x) - y).square().mean()
        inject = getattr(self, "inject", {})
        if inject.get(0) == self.state.iteration:
            loss = loss * math.inf
        return loss


class TwoLossTrainer(ampkit.Trainer):
    """Manual optimization with two losses: "A" reaches both optimizers, "B" only the head's."""

    automatic_optimization = False
    loss_ids = ("A", "B")  # the loss_id each backward passes (injections stay keyed "A" and "B")

    def configure_model(self):
        torch.manual_seed(0)
        return TwoHeadNet()

    def configure_optimizers(self):
        body = torch.optim.Adam(self.module.body.parameters(), lr=1e-2)
        head = torch.optim.Adam(self.module.head.parameters(), lr=1e-2)
        return _halving_lr_each_iteration(body=body, head=head)

    def train_dataloader(self):
        return make_batches(6)

    def training_step(self, batch):
        x, y = batch
        inject = getattr(self, "inject", {})
        out = self.model(x)
        loss_a = (out - y).square().mean()
        if inject.get("A") == self.state.iteration:
            loss_a = loss_a * math.inf
        self.backward(loss_a, loss_id=self.loss_ids[0])
        feats = self.module.body(x).detach()
        loss_b = self.module.head(feats).abs().mean()
        if inject.get("B") == self.state.iteration:
            loss_b = loss_b * math.nan
        self.backward(loss_b, loss_id=self.loss_ids[1], optimizer=self.optimizers["head"])
        for optimizer in self.optimizers.values():
            self.step(optimizer)
        return {"loss_a": loss_a.detach(), "loss_b": loss_b.detach()}


def config(run_dir, **precision):
    return {
        "trainer_class": "tests:unused",
        "run_dir": str(run_dir),
        "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu", "seed": 0},
        "checkpoint": {"enabled": False},
        "logging": {"tensorboard": False, "log_every_n_steps": 1},
        "precision": precision,
    }


def fit(trainer_class, run_dir, inject=None, resume=None, trainer_cfg=None, checkpoint=None, logging=None, **precision):
    cfg = config(run_dir, **precision)
    cfg["trainer"].update(trainer_cfg or {})
    cfg["checkpoint"].update(checkpoint or {})
    cfg["logging"].update(logging or {})
    recorder = Recorder()
    trainer = trainer_class(cfg, callbacks=[recorder])
    trainer.inject = inject or {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(resume=resume)
    trainer.caught = [str(w.message) for w in caught]
    return trainer, recorder


def params_of(trainer):
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


# ---------------------------------------------------------------------- parity


def hand_loop_two_optimizers(steps, clip=None, autocast_dtype=None):
    torch.manual_seed(0)
    model = TwoHeadNet()
    body = torch.optim.SGD(model.body.parameters(), lr=0.1)
    head = torch.optim.SGD(model.head.parameters(), lr=0.1)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in (body, head)]
    for x, y in make_batches(steps):
        for o in (body, head):
            o.zero_grad()
        with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
            loss = (model(x) - y).square().mean()
        loss.backward()
        for o in (body, head):
            if clip is not None:
                torch.nn.utils.clip_grad_norm_([p for g in o.param_groups for p in g["params"]], clip, foreach=True)
            o.step()
        for s in scheds:
            s.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("precision", [{}, {"loss_scale": 1.0}, {"loss_scale": "dynamic", "growth_interval": 1}])
def test_two_optimizers_sharing_one_backward_equal_fp32_reference(tmp_path, precision):
    # With growth_interval=1 the scale doubles after every iteration. Updating the scaler after the
    # first optimizer's step (Lightning, Accelerate) would unscale the second optimizer's gradients with
    # the doubled scale; here both use the scale of the backward, so the result is exactly fp32's.
    trainer, recorder = fit(SharedBackwardTrainer, tmp_path, **precision)
    reference = hand_loop_two_optimizers(6)
    for key, value in params_of(trainer).items():
        assert torch.equal(value, reference[key]), key
    if precision.get("growth_interval") == 1:
        assert [new for *_, new in recorder.scale_updates] == [2.0**17, 2.0**18, 2.0**19, 2.0**20, 2.0**21, 2.0**22]
        assert [u[1:] for u in recorder.unscaled[:2]] == [("body", False), ("head", False)]
    elif precision:
        assert [u[2:] for u in recorder.scale_updates] == [(1.0, 1.0)] * 6  # static: never changes
    else:
        assert recorder.scale_updates == []  # O0 installs no precision callbacks at all


def test_clipping_sees_unscaled_grads_with_two_optimizers(tmp_path):
    # Scale 2**16 and growing: clipping the still-scaled gradients (Lightning #18089) would clip far harder.
    trainer, _ = fit(
        SharedBackwardTrainer, tmp_path, trainer_cfg={"clip_grad_norm": 0.05}, loss_scale="dynamic", growth_interval=1
    )
    reference = hand_loop_two_optimizers(6, clip=0.05)
    for key, value in params_of(trainer).items():
        assert torch.equal(value, reference[key]), key
    unclipped = hand_loop_two_optimizers(6)
    assert not torch.equal(reference["head.weight"], unclipped["head.weight"])  # the clip did bite


def test_o0_accumulation_equals_hand_loop(tmp_path):
    trainer, _ = fit(SharedBackwardTrainer, tmp_path, trainer_cfg={"accumulate_grad_batches": 2}, loss_scale=8.0)
    torch.manual_seed(0)
    model = TwoHeadNet()
    opts = [torch.optim.SGD(model.body.parameters(), lr=0.1), torch.optim.SGD(model.head.parameters(), lr=0.1)]
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, 0.5) for o in opts]
    for i, (x, y) in enumerate(make_batches(6)):
        ((model(x) - y).square().mean() / 2).backward()
        if i % 2 == 1:
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            for o in opts:
                o.zero_grad()
    for key, value in params_of(trainer).items():
        assert torch.equal(value, model.state_dict()[key]), key


# ---------------------------------------------------------------------- injected overflows


@settings(max_examples=10, deadline=None)
@given(
    loss=st.sampled_from(["A", "B"]),
    step=st.integers(1, 6),
    opt_level=st.sampled_from(["O1", "O2"]),
    dtype=st.sampled_from(DTYPES),
    combine_grad=st.booleans(),
)
def test_injected_overflow_skips_exactly_the_reached_optimizers(loss, step, opt_level, dtype, combine_grad):
    with tempfile.TemporaryDirectory() as run_dir:
        trainer, rec = fit(
            TwoLossTrainer,
            run_dir,
            inject={loss: step},
            opt_level=opt_level,
            dtype=dtype,
            growth_interval=2,
            init_scale=2.0**10,
            combine_grad=combine_grad,
            cast_modules=["body", "head"],  # training_step calls both submodules directly
            skip_nonfinite=True,  # bfloat16 has no scaler: its check skips the step (float16's scalers always do)
        )
    expected = {"body", "head"} if loss == "A" else {"head"}  # loss A reaches both, B only the head
    assert sorted(rec.skipped) == sorted((step, name) for name in expected)
    assert {name for name, changed in rec.changed[step - 1].items() if changed} == {"body", "head"} - expected
    for name, changed in rec.changed[step - 1].items():
        if name in expected:
            assert not changed  # skipped: bit-unchanged parameters (and masters)
    for it in range(6):
        if it + 1 != step:
            assert all(rec.changed[it].values()), it
    for name in ("body", "head"):
        opt_state = trainer.optimizer_state[trainer.optimizers[name]]
        assert opt_state.skipped_steps == (name in expected)
        assert opt_state.steps == 6 - (name in expected)
        # schedulers step only after real steps: gamma 0.5 per step
        assert trainer.optimizers[name].param_groups[0]["lr"] == pytest.approx(
            (1e-2) * 0.5**opt_state.steps, rel=0, abs=0
        )
    assert not [w for w in trainer.caught if "lr_scheduler.step()" in w]
    # only the overflowing loss's scaler backed off; growth after exactly 2 clean updates
    for loss_id in ("A", "B"):
        scale, clean = 2.0**10, 0
        for it, lid, old, new in [u for u in rec.scale_updates if u[1] == loss_id]:
            assert old == scale
            if lid == loss and it == step:
                scale, clean = scale / 2, 0
            else:
                clean += 1
                if clean == 2:
                    scale, clean = scale * 2, 0
            assert new == scale, (loss_id, it)


def test_every_scaler_knob_of_the_config_shapes_the_scale(tmp_path):
    """precision.init_scale, backoff_factor, growth_factor, growth_interval and max_scale each move the scale away
    from where the defaults would put it: a knob lost on its way to the scalers trained on with the default."""
    _, rec = fit(
        SharedBackwardTrainer, tmp_path, inject={0: 1}, loss_scale="dynamic", init_scale=2.0**10, backoff_factor=0.25,
        growth_factor=4.0, growth_interval=2, max_scale=2.0**11,
    )  # fmt: skip
    assert [(it, old, new) for it, _, old, new in rec.scale_updates] == [
        (1, 2.0**10, 2.0**8),  # the overflow: x0.25
        (2, 2.0**8, 2.0**8),
        (3, 2.0**8, 2.0**10),  # two clean updates: x4
        (4, 2.0**10, 2.0**10),
        (5, 2.0**10, 2.0**11),  # x4 capped at max_scale
        (6, 2.0**11, 2.0**11),
    ]


class IntegerLossIds(TwoLossTrainer):
    loss_ids = (0, 1)  # Apex's convention (num_losses)


def test_integer_loss_ids_each_get_a_scaler_of_their_own(tmp_path):
    """Loss 1's overflow backs off loss 1's scaler alone; loss 0 keeps its scale."""
    trainer, _ = fit(IntegerLossIds, tmp_path, inject={"B": 2}, opt_level="O1", init_scale=2.0**10, growth_interval=100)
    (scaling,) = [cb for cb in trainer.callbacks if isinstance(cb, LossScaling)]
    assert scaling.scales == {0: 2.0**10, 1: 2.0**9}


def test_skip_warning_and_min_scale_error(tmp_path):
    trainer, _ = fit(
        TwoLossTrainer,
        tmp_path / "warn",
        inject={"B": 2},
        opt_level="O1",
        warn_consecutive_skips=1,
        max_overflows_at_min_scale=0,
    )
    assert any("optimizer 'head' skipped 1 step in a row" in w and "'B'" in w for w in trainer.caught)

    class AlwaysNan(SharedBackwardTrainer):
        def training_step(self, batch):
            return super().training_step(batch) * math.nan

    # A run that skips on is said at 1, 2, 4, 8... skips in a row (once a step, it drowned every other line).
    trainer, _ = fit(AlwaysNan, tmp_path / "often", opt_level="O1", warn_consecutive_skips=1)
    said = [w for w in trainer.caught if "optimizer 'head' skipped" in w]
    counts = [int(re.search(r"skipped (\d+) steps? in a row", w)[1]) for w in said]
    skipped = trainer.optimizer_state[trainer.optimizers["head"]].skipped_steps
    assert skipped >= 5 and counts == [2**k for k in range(skipped.bit_length())]
    with pytest.raises(
        NonFiniteError, match="loss_id 0 overflowed in every iteration since step 1, the last 3 at min_scale=4.0"
    ):
        fit(AlwaysNan, tmp_path / "err", opt_level="O1", init_scale=16.0, min_scale=4.0, max_overflows_at_min_scale=3)
    # Without min_scale the scale halves down to 2**-126 (1/scale must stay a float32), then the same error.
    with pytest.raises(NonFiniteError, match=r"since step 1, the last 2 at its floor 1\.17\d*e-38"):
        fit(AlwaysNan, tmp_path / "err2", opt_level="O1", init_scale=2.0**-125, max_overflows_at_min_scale=2)


# ---------------------------------------------------------------------- casting


class AutocastProbe(ampkit.Callback):
    """Whether autocast is on at the optimizer step and at the end of each batch."""

    def __init__(self) -> None:
        self.step_autocast: list[bool] = []
        self.batch_end_autocast: list[bool] = []

    def on_before_optimizer_step(self, trainer, optimizer):
        self.step_autocast.append(torch.is_autocast_enabled("cpu"))

    def on_train_batch_end(self, trainer, outputs, batch):
        self.batch_end_autocast.append(torch.is_autocast_enabled("cpu"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_o1_autocasts_forward_not_backward(tmp_path, dtype):
    class Probe(SharedBackwardTrainer):
        forward_dtypes, backward_autocast, val_dtypes = [], [], []

        def training_step(self, batch):
            out = self.model(batch[0])
            self.forward_dtypes.append(out.dtype)
            out.register_hook(lambda grad: self.backward_autocast.append(torch.is_autocast_enabled("cpu")))
            return (out.float() - batch[1]).square().mean()

        def val_dataloader(self):
            return make_batches(1)

        def validation_step(self, batch):
            self.val_dtypes.append(self.model(batch[0]).dtype)
            return {}

    probe = AutocastProbe()
    trainer = Probe(config(tmp_path, opt_level="O1", dtype=dtype), callbacks=[probe])
    trainer.fit()
    assert set(trainer.forward_dtypes) == set(trainer.val_dtypes) == {getattr(torch, dtype)}
    assert trainer.backward_autocast and not any(trainer.backward_autocast)
    assert probe.step_autocast and not any(probe.step_autocast)  # the optimizer step runs in full precision
    assert probe.batch_end_autocast and not any(probe.batch_end_autocast)
    assert not torch.is_autocast_enabled("cpu")
    assert all(p.dtype == torch.float32 for p in trainer.module.parameters())


def test_o1_manual_optimization_autocasts_a_forward_after_a_backward(tmp_path):
    class SecondForward(TwoLossTrainer):
        second_forward_dtypes = []

        def training_step(self, batch):
            out = super().training_step(batch)  # backward of loss A and B, then the steps
            self.second_forward_dtypes.append(self.module.head(self.module.body(batch[0])).dtype)
            return out

    probe = AutocastProbe()
    trainer = SecondForward(config(tmp_path, opt_level="O1", dtype="bfloat16"), callbacks=[probe])
    trainer.fit()
    assert set(trainer.second_forward_dtypes) == {torch.bfloat16}
    assert probe.batch_end_autocast and not any(probe.batch_end_autocast)  # ended with the training step
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("dtype", DTYPES)
def test_o2_casts_model_keeps_batchnorm_and_masters(tmp_path, dtype):
    trainer, _ = fit(SharedBackwardTrainer, tmp_path, opt_level="O2", dtype=dtype)
    low = getattr(torch, dtype)
    assert trainer.module.head.weight.dtype == trainer.module.body[0].weight.dtype == low
    assert trainer.module.body[1].weight.dtype == torch.float32
    for opt in trainer.optimizers.values():
        masters = [p for g in opt.param_groups for p in g["params"]]
        assert all(m.dtype == torch.float32 for m in masters)
    head_master = trainer.optimizers["head"].param_groups[0]["params"][0]
    assert torch.equal(head_master.to(low), trainer.module.head.weight)


def test_config_errors_name_the_option(tmp_path):
    with pytest.raises(ampkit.ConfigError, match="'precision.opt_level': '01' is invalid; expected one of O0, O1, O2"):
        fit(SharedBackwardTrainer, tmp_path, opt_level="01")
    with pytest.raises(ampkit.ConfigError, match="master_weights"):
        fit(SharedBackwardTrainer, tmp_path, opt_level="O1", master_weights=True)
    with pytest.raises(ampkit.ConfigError, match="precision.scale_window"):
        fit(SharedBackwardTrainer, tmp_path, opt_level="O1", growth_interval=10, scale_window=20)
    with pytest.raises(ampkit.ConfigError, match="'precision.backoff_factor': 2.0 is invalid; expected a number in"):
        fit(SharedBackwardTrainer, tmp_path, opt_level="O1", backoff_factor=2.0)
    with pytest.raises(ampkit.ConfigError, match="cast_modules names \\['decoder'\\].*children: body, head"):
        fit(SharedBackwardTrainer, tmp_path, opt_level="O2", cast_modules=["decoder"])
    with pytest.raises(ValueError, match="loss_id=2 is out of range for precision.num_losses=2"):
        LossScaling(num_losses=2).scaler(2)


def test_a_loss_id_is_an_int_or_a_name_whether_its_scaler_exists_or_not():
    """True and 1.0 hash as 1: once loss 1's scaler existed (num_losses=2) they took it silently, before that they
    were refused; numpy's int64 (an index from an array) was refused unless its scaler existed."""
    scaling = LossScaling(num_losses=2)
    for bad in (True, False, 1.0, 0.0, None):
        with pytest.raises(TypeError, match=f"loss_id={bad!r}: expected an int or a str"):
            scaling.scaler(bad)
    assert scaling.scaler(np.int64(1)) is scaling.scaler(1)
    fresh = LossScaling()
    fresh.scaler(np.int64(3))  # made under a plain int: its tags and checkpoint key read loss_scaler3
    assert [type(loss_id) for loss_id in fresh.scales] == [int]


def test_num_losses_is_counted_by_amp_initialize_s_rule():
    """One rule with amp.initialize's num_losses: numpy's integers count (LossScaling refused np.int64(2), which
    Apex's range() took); a bool, 2.0 and "2" do not, as Apex's range() refused them."""
    scaling = LossScaling(num_losses=np.int64(2))
    assert sorted(scaling.scales) == [0, 1] and type(scaling.num_losses) is int
    from ampkit.compat import amp

    for bad in (True, 2.0, "2", 0, 1025):
        with pytest.raises(ValueError, match=rf"^num_losses={re.escape(repr(bad))}: expected None or an integer"):
            LossScaling(num_losses=bad)
        if bad == 0:  # Apex's range(0): no scaler, for a model-only initialize (a Trainer always scales a loss)
            continue
        with pytest.raises(ValueError, match=rf"^num_losses={re.escape(repr(bad))}: expected an integer in"):
            amp.initialize(nn.Linear(2, 2), None, opt_level="O1", num_losses=bad, verbosity=0)


# ---------------------------------------------------------------------- resume and logging


@pytest.mark.parametrize("combine_grad", [False, True])
@pytest.mark.parametrize("opt_level, dtype", [("O2", "float16"), ("O2", "bfloat16"), ("O3", "bfloat16")])
def test_resumed_run_continues_bit_identically(tmp_path, opt_level, dtype, combine_grad):
    # float16 at 2**17 overflows in iterations 1 and 4 and trains in 3: the checkpoint at 3 holds trained masters
    # and a backed-off scale (at 2**20 every iteration up to 4 overflowed: the masters saved were the initial ones).
    kwargs = dict(opt_level=opt_level, dtype=dtype, combine_grad=combine_grad, growth_interval=2, init_scale=2.0**17)
    kwargs["cast_modules"] = ["body", "head"]
    kwargs["skip_nonfinite"] = True  # the NaN of step 2 is skipped in bfloat16 too (float16's scalers always skip)
    full, recorded = fit(TwoLossTrainer, tmp_path / "full", inject={"B": 2}, **kwargs)
    assert all(recorded.changed[2].values())  # both optimizers stepped in iteration 3, before the checkpoint
    first, _ = fit(
        TwoLossTrainer,
        tmp_path / "part",
        inject={"B": 2},
        checkpoint={"enabled": True, "every_n_steps": 3, "every_n_epochs": 0},
        trainer_cfg={"max_steps": 3},
        **kwargs,
    )
    checkpoint = next(Path(first.version_dir, "checkpoints").glob("step-00000003.pt"))
    resumed, _ = fit(TwoLossTrainer, tmp_path / "part", inject={"B": 2}, resume=checkpoint, **kwargs)
    for key, value in params_of(full).items():
        assert torch.equal(value, params_of(resumed)[key]), key
    for name in ("body", "head"):
        a = [p for g in full.optimizers[name].param_groups for p in g["params"]]
        b = [p for g in resumed.optimizers[name].param_groups for p in g["params"]]
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    scaling = [cb.state_dict() for cb in resumed.callbacks if isinstance(cb, LossScaling)]
    assert scaling == [cb.state_dict() for cb in full.callbacks if isinstance(cb, LossScaling)]
    assert len(scaling) == (opt_level == "O2")  # O2 combines onto masters; O3 bf16 has nothing to combine
    assert any(isinstance(cb, MixedPrecision) for cb in resumed.callbacks)


def test_an_o0_checkpoint_resumed_at_o2_warns_and_trains_on(tmp_path):
    """A run that switches to O2 on resume finds no masters in its checkpoint: a warning, not a traceback, and it
    trains on, its masters made from the restored weights as a fresh O2 run's are made from its model."""
    first, _ = fit(TwoLossTrainer, tmp_path, opt_level="O0", trainer_cfg={"max_steps": 3},
                   checkpoint={"enabled": True, "every_n_steps": 3, "every_n_epochs": 0})  # fmt: skip
    checkpoint = next(Path(first.version_dir, "checkpoints").glob("step-00000003.pt"))
    o2 = dict(opt_level="O2", dtype="bfloat16", cast_modules=["body", "head"])
    resumed, _ = fit(TwoLossTrainer, tmp_path, resume=checkpoint, trainer_cfg={"max_steps": 4}, **o2)
    assert resumed.state.global_step == 4
    assert any("has no fp32 master weights for optimizer 'body'" in w for w in resumed.caught)
    assert all(torch.isfinite(v.float()).all() for v in params_of(resumed).values())


class StartWeights(TwoLossTrainer):
    def on_train_start(self):
        self.start = {
            n: [p.detach().clone() for g in o.param_groups for p in g["params"]] for n, o in self.optimizers.items()
        }


@pytest.mark.parametrize("opt_level", ["O1", "O0"])
def test_an_o2_checkpoint_resumed_without_masters_starts_from_its_fp32_masters(tmp_path, opt_level):
    """An O2 checkpoint's model entry holds the half weights; the trained weights are its fp32 masters. A run that
    switches to O1 or O0 on resume starts from the masters, not from their half-precision rounding."""
    o2 = dict(opt_level="O2", dtype="bfloat16", cast_modules=["body", "head"])
    first, _ = fit(TwoLossTrainer, tmp_path, trainer_cfg={"max_steps": 3},
                   checkpoint={"enabled": True, "every_n_steps": 3, "every_n_epochs": 0}, **o2)  # fmt: skip
    masters = {
        n: [p.detach().clone() for g in o.param_groups for p in g["params"]] for n, o in first.optimizers.items()
    }
    assert any(not torch.equal(m, m.bfloat16().float()) for ms in masters.values() for m in ms)
    checkpoint = next(Path(first.version_dir, "checkpoints").glob("step-00000003.pt"))
    resumed, _ = fit(StartWeights, tmp_path, resume=checkpoint, trainer_cfg={"max_steps": 4}, opt_level=opt_level)
    for name, expected in masters.items():
        assert all(torch.equal(a, b) for a, b in zip(resumed.start[name], expected, strict=True)), name


def test_tensorboard_amp_tags(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer, _ = fit(
        TwoLossTrainer, tmp_path, inject={"A": 3}, logging={"tensorboard": True}, opt_level="O1", init_scale=1024.0
    )
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"amp/loss_scale/A", "amp/loss_scale/B", "amp/overflow/A", "amp/skipped_steps/body"} <= tags
    assert {"train/grad_norm/body", "train/grad_norm/head"} <= tags
    scale_a = [(e.step, e.value) for e in events.Scalars("amp/loss_scale/A")]
    assert scale_a[:4] == [(1, 1024.0), (2, 1024.0), (3, 512.0), (4, 512.0)]
    assert [e.value for e in events.Scalars("amp/loss_scale/B")][:4] == [1024.0] * 4
    assert [(e.step, e.value) for e in events.Scalars("amp/overflow/A")][:4] == [(1, 0), (2, 0), (3, 1), (4, 0)]
    assert [e.value for e in events.Scalars("amp/skipped_steps/body")] == [0, 0, 1, 1, 1, 1]
    norms = [e.value for e in events.Scalars("train/grad_norm/head")]
    assert all(math.isfinite(v) and v < 100 for v in norms[:2])  # unscaled: not ~65536 times too big


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        ({"opt_level": "O9"}, "'precision.opt_level': 'O9' is invalid"),
        ({"opt_level": "O1", "dtype": "float8"}, "'precision.dtype': 'float8' is not a low-precision dtype"),
        ({"opt_level": "O1", "growth_factor": 0.5}, "'precision.growth_factor': 0.5 is invalid"),
        ({"opt_level": "O1", "clip_grad_norm": -1.0}, "'precision.clip_grad_norm': -1.0"),
        # the scaler's knobs at O0 too: the typo would surface only when O1 is tried, as the run's own key
        ({"opt_level": "O0", "init_scale": -1.0}, "'precision.init_scale': -1.0 is invalid"),
        ({"opt_level": "O0", "scale_window": 0}, "'precision.scale_window': 0 is invalid"),
        ({"opt_level": "O0", "max_scale": math.inf}, "'precision.max_scale': inf is invalid"),
    ],
)
def test_precision_is_validated_at_construction_before_user_code(tmp_path, precision, message):
    class Untouchable(SharedBackwardTrainer):
        def configure_model(self):
            raise AssertionError("user code ran before the precision config was checked")

    with pytest.raises(ampkit.ConfigError, match=message):
        Untouchable(config(tmp_path, **precision))


# ---------------------------------------------------------------------- bfloat16: no loss scaler


def test_bf16_o1_has_no_loss_scaler_and_equals_the_raw_autocast_hand_loop(tmp_path):
    trainer, recorder = fit(SharedBackwardTrainer, tmp_path, opt_level="O1", dtype="bfloat16")
    names = [cb.name for cb in trainer.callbacks]
    assert "NonFiniteCheck" not in names and "LossScaling" not in names  # by default: torch's recipe, no check
    assert recorder.scale_updates == [] and recorder.unscaled == []  # nothing scaled, nothing unscaled
    assert all(state.scale is None for state in trainer.loss_state.values())
    reference = hand_loop_two_optimizers(6, autocast_dtype=torch.bfloat16)
    for key, value in params_of(trainer).items():
        assert torch.equal(value, reference[key]), key


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_bf16_skip_nonfinite_guards_the_step_when_asked(tmp_path, opt_level):
    guarded, recorder = fit(
        TwoLossTrainer,
        tmp_path / "on",
        inject={"B": 2},
        opt_level=opt_level,
        dtype="bfloat16",
        cast_modules=["body", "head"],
        skip_nonfinite=True,
    )
    assert recorder.skipped == [(2, "head")] and recorder.scale_updates == []
    assert all(torch.isfinite(p).all() for p in guarded.module.parameters())
    # By default bf16 checks nothing (torch's recipe, Lightning's bf16-mixed, Apex's O4/O5): the NaN step is
    # applied, and NonFiniteGuard stops the run before a NaN model is checkpointed.
    for name, option in (("default", {}), ("off", {"skip_nonfinite": False})):
        with pytest.raises(NonFiniteError, match="step 2 applied a loss of nan"):
            fit(
                TwoLossTrainer,
                tmp_path / name,
                inject={"B": 2},
                opt_level=opt_level,
                dtype="bfloat16",
                cast_modules=["body", "head"],
                **option,
            )


@pytest.mark.parametrize(
    ("options", "line"),
    [
        ({"opt_level": "O1", "dtype": "bfloat16"}, "O1 bfloat16"),  # no scaler, no check: torch's recipe
        ({"opt_level": "O4", "skip_nonfinite": True}, "O4 bfloat16, skip_nonfinite"),
        ({"opt_level": "O1", "loss_scale": "none"}, "O1 float16, skip_nonfinite"),  # float16's default: checked
        ({"opt_level": "O1", "loss_scale": "none", "skip_nonfinite": False}, "O1 float16"),
        ({"opt_level": "O2", "dtype": "bfloat16", "loss_scale": "dynamic"}, "O2 bfloat16, loss scale dynamic"),
        ({"opt_level": "O0"}, "O0 (float32)"),  # no low precision at all: no dtype or scale to name
        # a scale asked for at O0 scales a float32 loss: "O0 float16" named a dtype that never ran
        ({"opt_level": "O0", "loss_scale": "dynamic"}, "O0 (float32), loss scale dynamic"),
        ({"opt_level": "O0", "dtype": "bfloat16", "loss_scale": 128}, "O0 (float32), loss scale 128.0"),
        ({"opt_level": "O2", "loss_scale": 128}, "O2 float16, loss scale 128.0"),
        (
            {"opt_level": "O5", "fp8": Float8Config(enabled=True, backend="reference")},
            "O5 bfloat16, fp8 tensorwise (reference)",
        ),
    ],
)
def test_the_console_line_says_whether_steps_are_checked(options, line):
    assert describe_precision(OmegaConf.structured(PrecisionConfig(**options))) == line


def test_bf16_loss_scaling_on_request_and_fp16_needs_its_scaler(tmp_path):
    trainer, recorder = fit(SharedBackwardTrainer, tmp_path, opt_level="O1", dtype="bfloat16", loss_scale="dynamic")
    assert "LossScaling" in [cb.name for cb in trainer.callbacks]
    assert len(recorder.scale_updates) == 6 and trainer.loss_state[0].scale == 2.0**16
    fp16, _ = fit(SharedBackwardTrainer, tmp_path, opt_level="O1", loss_scale="none", skip_nonfinite=False)
    assert {"LossScaling", "NonFiniteCheck"}.isdisjoint(cb.name for cb in fp16.callbacks)
    checked, _ = fit(SharedBackwardTrainer, tmp_path, opt_level="O1", loss_scale="none")  # float16's default: on
    assert "NonFiniteCheck" in [cb.name for cb in checked.callbacks]
    with pytest.raises(ampkit.ConfigError, match="'precision.skip_nonfinite': False needs loss_scale: none"):
        SharedBackwardTrainer(config(tmp_path, opt_level="O1", dtype="float16", skip_nonfinite=False))


@pytest.mark.parametrize(("opt_level", "combines"), [("O4", False), ("O5", True)])
def test_apex_bf16_levels_train_in_bfloat16_without_a_scaler(tmp_path, opt_level, combines):
    trainer, recorder = fit(SharedBackwardTrainer, tmp_path, opt_level=opt_level, cast_modules=["body", "head"])
    names = [cb.name for cb in trainer.callbacks]
    assert ("LossScaling" in names) == combines  # O5's fp32 masters still receive the gradients
    assert recorder.scale_updates == [] and trainer.loss_state[0].scale is None
    low = [p.dtype for p in trainer.module.head.parameters()]
    assert low == ([torch.bfloat16] * 2 if combines else [torch.float32] * 2)  # O4 autocasts, O5 casts the model


class UnfreezeTrainer(ampkit.Trainer):
    """Fine-tuning: the first layer starts frozen (in the optimizer) and is unfrozen at epoch 1; ``poison`` makes its
    gradient inf at the iteration of that number."""

    poison: int | None = None

    def configure_model(self):
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        model[0].requires_grad_(False)
        return model

    def configure_optimizers(self):
        return torch.optim.SGD(self.module.parameters(), lr=0.05)

    def train_dataloader(self):
        return make_batches(4)

    def on_train_start(self):
        self.first_layer_at_start = self.module[0].weight.detach().clone()

    def on_train_epoch_start(self):
        if self.state.epoch == 1:
            self.module[0].requires_grad_(True)
            if self.poison is not None:
                self.module[0].weight.register_hook(
                    lambda g: g * math.inf if self.state.iteration == self.poison else g
                )

    def training_step(self, batch):
        x, y = batch
        return nn.functional.mse_loss(self.model(x), y)


def _fit_unfreeze(path, poison=None, trainer_class=UnfreezeTrainer, **precision):
    trainer = trainer_class(
        {
            "run_dir": str(path),
            "trainer": {"max_epochs": 2, "device": "cpu", "progress_bar": False},
            "precision": precision,
            "checkpoint": {"enabled": False},
            "logging": {"tensorboard": False},
        }
    )
    trainer.poison = poison
    trainer.fit()
    return trainer


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_parameter_unfrozen_mid_run_is_unscaled_like_the_others(tmp_path, opt_level):
    # The unscale list was built at the first backward: the layer unfrozen at epoch 1 stepped on gradients still
    # multiplied by the loss scale (65536x the learning rate under SGD), or under O2 did not train at all.
    scaled = _fit_unfreeze(tmp_path / "dynamic", opt_level=opt_level, dtype="float16")
    unscaled = _fit_unfreeze(tmp_path / "one", opt_level=opt_level, dtype="float16", loss_scale=1.0)
    assert not torch.equal(scaled.module[0].weight, scaled.first_layer_at_start)  # it trained once unfrozen
    assert torch.equal(scaled.module[0].weight, unscaled.module[0].weight)


class AddsGroupTrainer(UnfreezeTrainer):
    """The same fine-tuning with the first layer outside the optimizer until epoch 1, then added as a param group."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.module[2].parameters(), lr=0.05)

    def on_train_epoch_start(self):
        if self.state.epoch == 1:
            self.module[0].requires_grad_(True)
            self.optimizer.add_param_group({"params": list(self.module[0].parameters())})


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_param_group_added_mid_run_is_unscaled_and_gets_fp32_masters(tmp_path, opt_level):
    # O2's masters were made at the start: the added half-precision group stepped itself, on gradients still
    # multiplied by the loss scale.
    precision = {"opt_level": opt_level, "dtype": "float16"}
    scaled = _fit_unfreeze(tmp_path / "dynamic", trainer_class=AddsGroupTrainer, **precision)
    unscaled = _fit_unfreeze(tmp_path / "one", trainer_class=AddsGroupTrainer, loss_scale=1.0, **precision)
    assert not torch.equal(scaled.module[0].weight, scaled.first_layer_at_start)
    assert torch.equal(scaled.module[0].weight, unscaled.module[0].weight)
    if opt_level == "O2":
        assert all(p.dtype == torch.float32 for group in scaled.optimizer.param_groups for p in group["params"])


class _SpareHead(nn.Sequential):
    """Linear, Tanh, Linear, and a spare Linear the forward leaves out."""

    def forward(self, x):
        return self[2](self[1](self[0](x)))


class ReplacesGroupTrainer(UnfreezeTrainer):
    """The first layer trains from the start outside the optimizer, whose second group holds a spare head; at epoch 1
    that group is removed and the first layer added as one of the same size (two tensors)."""

    def configure_model(self):
        return _SpareHead(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2), nn.Linear(8, 2))

    def configure_optimizers(self):
        sgd = torch.optim.SGD(self.module[2].parameters(), lr=0.05)
        sgd.add_param_group({"params": list(self.module[3].parameters())})
        return sgd

    def on_train_epoch_start(self):
        if self.state.epoch == 1:
            self.module[0].zero_grad(set_to_none=True)  # its gradients of epoch 0 differ with the scale
            del self.optimizer.param_groups[1]
            self.optimizer.add_param_group({"params": list(self.module[0].parameters())})


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_a_param_group_replaced_mid_run_by_one_of_its_size_is_unscaled(tmp_path, opt_level):
    # Only the count of tensors the optimizer held was watched: the same count kept the unscale lists of the spare
    # head, and the layer added stepped on gradients still multiplied by the loss scale.
    precision = {"opt_level": opt_level, "dtype": "float16"}
    scaled = _fit_unfreeze(tmp_path / "dynamic", trainer_class=ReplacesGroupTrainer, **precision)
    unscaled = _fit_unfreeze(tmp_path / "one", trainer_class=ReplacesGroupTrainer, loss_scale=1.0, **precision)
    assert not torch.equal(scaled.module[0].weight, scaled.first_layer_at_start)
    assert torch.equal(scaled.module[0].weight, unscaled.module[0].weight)


class ManualAddsGroupTrainer(AddsGroupTrainer):
    """The same, under manual optimization: ``backward(loss, optimizer=...)`` names the optimizer's tensors."""

    automatic_optimization = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss, optimizer=self.optimizer)
        self.step(self.optimizer)
        return loss.detach()


def test_a_param_group_added_mid_run_trains_under_manual_optimization_like_automatic(tmp_path):
    # The masters-to-parameters map was made at the start: from the group's second iteration on, backward() was
    # given its fp32 masters, which are not in the graph, so the added layer silently stopped training.
    precision = {"opt_level": "O2", "dtype": "float16", "loss_scale": 1.0}
    manual = _fit_unfreeze(tmp_path / "manual", trainer_class=ManualAddsGroupTrainer, **precision)
    automatic = _fit_unfreeze(tmp_path / "automatic", trainer_class=AddsGroupTrainer, **precision)
    assert torch.equal(manual.module[0].weight, automatic.module[0].weight)


def test_a_param_group_replaced_by_one_of_its_size_is_seen_as_a_change():
    # Only the count of tensors the optimizers held was compared: a group removed and another of the same size added
    # (or a group's list replaced) kept the count, so the unscale and inf-check lists went on without the new tensors.
    from ampkit.trainer.param_groups import TrainableParams

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    sgd = torch.optim.SGD(model[0].parameters(), lr=0.1)
    sgd.add_param_group({"params": list(model[1].parameters())})
    trainable = TrainableParams(model, [sgd])
    assert trainable.changed() and not trainable.changed() and not trainable.grew()
    del sgd.param_groups[1]
    sgd.add_param_group({"params": list(model[2].parameters())})
    assert trainable.grew() and not trainable.changed()
    sgd.param_groups[1]["params"] = list(model[1].parameters())
    assert trainable.changed() and not trainable.grew()
    sgd.param_groups[1]["params"].append(model[2].weight)  # the same list, longer
    assert trainable.grew() and not trainable.grew()


def test_a_parameter_unfrozen_mid_run_is_checked_for_inf_without_a_scaler(tmp_path):
    trainer = _fit_unfreeze(tmp_path, poison=6, opt_level="O1", dtype="bfloat16", skip_nonfinite=True)
    assert trainer.optimizer_state[trainer.optimizer].skipped_steps == 1
    assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


def _master_bytes(trainer) -> int:
    """The bytes of the fp32 master copies the optimizers hold: their tensors that are not the model's parameters."""
    model = {id(p) for p in trainer.module.parameters()}
    held = [t for opt in trainer.optimizers.values() for group in opt.param_groups for t in group["params"]]
    return sum(t.untyped_storage().nbytes() for t in held if id(t) not in model)


class MasterBytes(ampkit.Callback):
    """:func:`_master_bytes` as training starts (after a resume's restore) and at the end of each epoch."""

    def __init__(self):
        self.at_start, self.at_epoch_end = None, []

    def on_train_start(self, trainer):
        self.at_start = _master_bytes(trainer)

    def on_train_epoch_end(self, trainer):
        self.at_epoch_end.append(_master_bytes(trainer))


def _fit_fine_tuning(path, trainer_class=UnfreezeTrainer, resume=None, trainer_cfg=None, checkpoint=None, **precision):
    cfg = {
        "run_dir": str(path),
        "trainer": {"max_epochs": 2, "device": "cpu", "progress_bar": False, **(trainer_cfg or {})},
        "precision": precision,
        "checkpoint": {"enabled": False, **(checkpoint or {})},
        "logging": {"tensorboard": False},
    }
    sizes = MasterBytes()
    trainer = trainer_class(cfg, callbacks=[sizes])
    trainer.fit(resume=resume)
    assert trainer.optimizer_state[trainer.optimizer].skipped_steps == 0  # the runs compared skip nothing
    return trainer, sizes


_HEAD_MASTER_BYTES = 4 * (8 * 2 + 2)  # the fp32 masters of UnfreezeTrainer's last layer
_ALL_MASTER_BYTES = _HEAD_MASTER_BYTES + 4 * (4 * 8 + 8)


def _optimizer_tensors(trainer) -> list[torch.Tensor]:
    return [t.detach().clone() for group in trainer.optimizer.param_groups for t in group["params"]]


class UnfreezesBetweenBackwardsTrainer(UnfreezeTrainer):
    """UnfreezeTrainer's fine-tuning with two batches an iteration (``trainer.accumulate_grad_batches=2``), the first
    layer unfrozen in training_step at batch 3: the second batch of iteration 2, between its two backwards."""

    def on_train_epoch_start(self):
        pass

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.module[0].requires_grad_(True)
        return super().training_step(batch)


class AddsGroupBetweenBackwardsTrainer(UnfreezesBetweenBackwardsTrainer):
    """The same with the first layer outside the optimizer until then, added to it as a param group."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.module[2].parameters(), lr=0.05)

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.optimizer.add_param_group({"params": list(self.module[0].parameters())})
        return super().training_step(batch)


class FreezesBetweenBackwardsTrainer(UnfreezesBetweenBackwardsTrainer):
    """The first layer trains from the start and is frozen at batch 3, between the backwards of iteration 2: its
    gradient of batch 2 stays, and it steps on it once more."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.module[0].requires_grad_(False)
        return UnfreezeTrainer.training_step(self, batch)


class SwapsBetweenBackwardsTrainer(UnfreezesBetweenBackwardsTrainer):
    """At batch 3, between the backwards of iteration 2, the first layer is unfrozen and the last frozen: the unscale
    lists are rebuilt without the last, which steps on its gradient of batch 2."""

    def training_step(self, batch):
        if self.state.epoch == 0 and self.state.batch_idx == 3:
            self.module[2].requires_grad_(False)
        return super().training_step(batch)


class ManualUnfreezesBetweenBackwardsTrainer(UnfreezeTrainer):
    """Manual optimization with one backward per half batch, the first layer unfrozen at batch 3 between its two
    backwards."""

    automatic_optimization = False

    def on_train_epoch_start(self):
        pass

    def training_step(self, batch):
        x, y = batch
        for half in (slice(0, 4), slice(4, 8)):
            if self.state.epoch == 0 and self.state.batch_idx == 3 and half.start == 4:
                self.module[0].requires_grad_(True)
            loss = nn.functional.mse_loss(self.model(x[half]), y[half]) / 2
            self.backward(loss)
        self.step(self.optimizer)
        return loss.detach()


def _fit_between_backwards(path, trainer_class, accumulate=2, **precision):
    trainer, _ = _fit_fine_tuning(path, trainer_class, trainer_cfg={"accumulate_grad_batches": accumulate}, **precision)
    return trainer


# (trainer, batches an iteration): manual optimization's two backwards a batch, also in one-batch iterations
_BETWEEN_BACKWARDS = [
    (UnfreezesBetweenBackwardsTrainer, 2),
    (AddsGroupBetweenBackwardsTrainer, 2),
    (ManualUnfreezesBetweenBackwardsTrainer, 2),
    (ManualUnfreezesBetweenBackwardsTrainer, 1),
]
_SCALED_LEVELS = [("O1", "float16", False), ("O2", "float16", False), ("O1", "bfloat16", False),
                  ("O2", "bfloat16", False), ("O1", "float16", True), ("O2", "float16", True)]  # fmt: skip


@pytest.mark.parametrize(("trainer_class", "accumulate"), _BETWEEN_BACKWARDS)
@pytest.mark.parametrize(("opt_level", "dtype", "combine_grad"), _SCALED_LEVELS)
def test_a_layer_unfrozen_between_the_backwards_of_an_iteration_is_unscaled_like_the_others(
    tmp_path, trainer_class, accumulate, opt_level, dtype, combine_grad
):
    """The gradients of a layer unfrozen (or added as a param group) between two backwards of one iteration are
    unscaled and checked from the next backward on, the others' already combined kept: the run is the one without a
    loss scale. The unscale lists were rebuilt at an iteration's start only, so it stepped on gradients still
    multiplied by the loss scale (SGD moved it by hundreds)."""
    precision = {"opt_level": opt_level, "dtype": dtype, "combine_grad": combine_grad, "loss_scale": "dynamic"}
    scaled = _fit_between_backwards(tmp_path / "dynamic", trainer_class, accumulate, **precision)
    float32 = _fit_between_backwards(tmp_path / "float32", trainer_class, accumulate, opt_level="O0")
    moved = (scaled.module[0].weight.float() - scaled.first_layer_at_start.float()).abs().max()
    assert 1e-2 < moved < 1.0  # it trained once unfrozen, at SGD's pace
    for key, value in params_of(float32).items():
        torch.testing.assert_close(params_of(scaled)[key].float(), value, rtol=0, atol=2e-3)
    if opt_level == "O2":  # the layer got its fp32 master before its first step
        assert all(p.dtype == torch.float32 for group in scaled.optimizer.param_groups for p in group["params"])
    if combine_grad:  # the flat buffers replaced at the unfreeze took their hooks with them (each ran per backward)
        assert len(scaled.module[2].weight._post_accumulate_grad_hooks) == 1


@pytest.mark.parametrize("trainer_class", [FreezesBetweenBackwardsTrainer, SwapsBetweenBackwardsTrainer])
@pytest.mark.parametrize(("opt_level", "dtype", "combine_grad"), _SCALED_LEVELS)
def test_a_layer_frozen_between_the_backwards_of_an_iteration_steps_on_what_it_had(
    tmp_path, trainer_class, opt_level, dtype, combine_grad
):
    """A layer frozen between two backwards keeps the gradient the iteration's earlier backward gave it, unscaled,
    and steps on it as the run without a loss scale does, also when another layer unfrozen at that backward has the
    unscale lists rebuilt without it; the others' are kept too."""
    precision = {"opt_level": opt_level, "dtype": dtype, "combine_grad": combine_grad, "loss_scale": "dynamic"}
    scaled = _fit_between_backwards(tmp_path / "dynamic", trainer_class, **precision)
    float32 = _fit_between_backwards(tmp_path / "float32", trainer_class, opt_level="O0")
    for key, value in params_of(float32).items():
        torch.testing.assert_close(params_of(scaled)[key].float(), value, rtol=0, atol=2e-3)


class StaysFrozenTrainer(UnfreezesBetweenBackwardsTrainer):
    """UnfreezesBetweenBackwardsTrainer's run with the first layer never unfrozen."""

    def training_step(self, batch):
        return UnfreezeTrainer.training_step(self, batch)


class NeverFrozenTrainer(FreezesBetweenBackwardsTrainer):
    """FreezesBetweenBackwardsTrainer's run with the first layer never frozen."""

    def training_step(self, batch):
        return UnfreezeTrainer.training_step(self, batch)


@pytest.mark.parametrize(
    ("changes", "stays"),
    [(UnfreezesBetweenBackwardsTrainer, StaysFrozenTrainer), (FreezesBetweenBackwardsTrainer, NeverFrozenTrainer)],
)
@pytest.mark.parametrize(("opt_level", "dtype", "combine_grad"), _SCALED_LEVELS)
def test_a_change_between_backwards_keeps_the_gradients_the_others_combined(
    tmp_path, changes, stays, opt_level, dtype, combine_grad
):
    """The unscale lists rebuilt at a layer's unfreeze or freeze, between two backwards, take over the gradients the
    iteration's first backward combined for the other layer: at that iteration's end its weights have the bits of a
    run whose first layer did not change."""
    precision = {"opt_level": opt_level, "dtype": dtype, "combine_grad": combine_grad, "loss_scale": "dynamic"}
    two_steps = {"accumulate_grad_batches": 2, "max_steps": 2}  # the change is in step 2
    changed, _ = _fit_fine_tuning(tmp_path / "changes", changes, trainer_cfg=two_steps, **precision)
    kept, _ = _fit_fine_tuning(tmp_path / "stays", stays, trainer_cfg=two_steps, **precision)
    assert not torch.equal(changed.module[0].weight, kept.module[0].weight)
    for key in ("2.weight", "2.bias"):
        assert torch.equal(params_of(changed)[key], params_of(kept)[key]), key


class HeldThenTrainedTrainer(UnfreezeTrainer):
    """UnfreezeTrainer's fine-tuning never frozen: the first layer trains from the start, at learning rate 0 until
    epoch 1 (SGD without momentum leaves it exactly as it was), then at the other layer's rate."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def configure_optimizers(self):
        groups = [{"params": self.module[0].parameters(), "lr": 0.0}, {"params": self.module[2].parameters()}]
        return torch.optim.SGD(groups, lr=0.05)

    def on_train_epoch_start(self):
        if self.state.epoch == 1:
            self.optimizer.param_groups[0]["lr"] = 0.05


def test_o2_gives_a_frozen_layer_no_fp32_master_until_it_is_unfrozen_and_then_trains_as_one_never_frozen(tmp_path):
    """Apex's O2 made masters only for parameters that require a gradient; the Trainer made one for every fp16
    parameter, so a fine-tuned model's frozen backbone cost an fp32 copy (4 bytes a parameter) for nothing. Unfrozen,
    the layer gets its master then, from its value, and trains exactly as a run that never froze it."""
    precision = {"opt_level": "O2", "dtype": "float16"}
    frozen, frozen_sizes = _fit_fine_tuning(tmp_path / "frozen", **precision)
    assert frozen_sizes.at_start == _HEAD_MASTER_BYTES
    assert frozen_sizes.at_epoch_end == [_HEAD_MASTER_BYTES, _ALL_MASTER_BYTES]  # unfrozen at epoch 1
    assert not torch.equal(frozen.module[0].weight, frozen.first_layer_at_start)
    never, never_sizes = _fit_fine_tuning(tmp_path / "never", trainer_class=HeldThenTrainedTrainer, **precision)
    assert never_sizes.at_epoch_end == [_ALL_MASTER_BYTES] * 2
    assert torch.equal(never.first_layer_at_start, frozen.first_layer_at_start)
    for key, value in params_of(frozen).items():
        assert torch.equal(value, params_of(never)[key]), key
    for a, b in zip(_optimizer_tensors(frozen), _optimizer_tensors(never), strict=True):
        assert a.dtype == b.dtype == torch.float32 and torch.equal(a, b)


class FrozenAtFitStartTrainer(UnfreezeTrainer):
    """UnfreezeTrainer's fine-tuning with the first layer frozen in on_fit_start (Lightning's BackboneFinetuning
    freezes there), after the precision callback made the masters."""

    def configure_model(self):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def on_fit_start(self):
        self.module[0].requires_grad_(False)


def test_a_layer_frozen_in_on_fit_start_gives_back_the_master_it_got(tmp_path):
    """The masters are made when the fit starts, before the Trainer's own on_fit_start: a layer frozen there kept its
    fp32 copy for nothing. It is released before training, and the run is the one frozen in configure_model."""
    precision = {"opt_level": "O2", "dtype": "float16"}
    hooked, sizes = _fit_fine_tuning(tmp_path / "hook", FrozenAtFitStartTrainer, **precision)
    assert sizes.at_start == _HEAD_MASTER_BYTES
    assert sizes.at_epoch_end == [_HEAD_MASTER_BYTES, _ALL_MASTER_BYTES]
    at_configure, _ = _fit_fine_tuning(tmp_path / "configure", **precision)
    for key, value in params_of(at_configure).items():
        assert torch.equal(value, params_of(hooked)[key]), key


@pytest.mark.parametrize("older", [False, True])
def test_an_o2_checkpoint_of_a_frozen_layer_resumes_bit_identically_without_its_master(tmp_path, older):
    """A checkpoint saves None in place of the master a frozen layer does not have; one of an ampkit that gave every
    fp16 parameter a master (``older``: a frozen one's equal to its value) resumes as well. Either way the resumed run
    is bit-identical to one never interrupted, and its frozen layer has no fp32 copy until it is unfrozen."""
    precision = {"opt_level": "O2", "dtype": "float16"}
    full, _ = _fit_fine_tuning(tmp_path / "full", **precision)
    every_2 = {"enabled": True, "every_n_steps": 2, "every_n_epochs": 0}
    part, _ = _fit_fine_tuning(tmp_path / "part", trainer_cfg={"max_steps": 2}, checkpoint=every_2, **precision)
    path = Path(part.version_dir, "checkpoints", "step-00000002.pt")
    checkpoint = torch.load(path, weights_only=True)
    (masters,) = checkpoint["callbacks"]["MixedPrecision"]["master_weights"].values()
    assert [m is None for m in masters["master_params"]] == [True, True, False, False]
    if older:
        masters["master_params"][:2] = [checkpoint["model"][name].float() for name in ("0.weight", "0.bias")]
        torch.save(checkpoint, path)
    resumed, sizes = _fit_fine_tuning(tmp_path / "part", resume=path, checkpoint=every_2, **precision)
    assert sizes.at_start == _HEAD_MASTER_BYTES
    assert sizes.at_epoch_end == [_HEAD_MASTER_BYTES, _ALL_MASTER_BYTES]
    for key, value in params_of(full).items():
        assert torch.equal(value, params_of(resumed)[key]), key
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(full), _optimizer_tensors(resumed), strict=True))


class RefreezeTrainer(UnfreezeTrainer):
    """The first layer trains in epoch 0, is frozen for epoch 1 and trains again from epoch 2."""

    optimizer_class = torch.optim.SGD

    def configure_model(self):
        return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def configure_optimizers(self):
        return self.optimizer_class(self.module.parameters(), lr=0.01)

    def on_train_epoch_start(self):
        self.module[0].requires_grad_(self.state.epoch != 1)


class AdamRefreezeTrainer(RefreezeTrainer):
    optimizer_class = torch.optim.Adam


class ManualRefreezeTrainer(RefreezeTrainer):
    """The same under manual optimization, ``backward(loss, optimizer=...)`` naming the optimizer's tensors."""

    automatic_optimization = False

    def training_step(self, batch):
        loss = super().training_step(batch)
        self.backward(loss, optimizer=self.optimizer)
        self.step(self.optimizer)
        return loss.detach()


@pytest.mark.parametrize("trainer_class", [RefreezeTrainer, AdamRefreezeTrainer, ManualRefreezeTrainer])
def test_a_layer_frozen_after_it_trained_keeps_its_master_through_a_resume(tmp_path, trainer_class):
    """A layer frozen after it trained keeps its fp32 master (its bits below fp16, Adam's fp32 state). A resume while
    it is frozen gives it back from the checkpoint, so the run unfreezing it later continues bit-identically. Under
    manual optimization, ``backward(optimizer=...)`` named the frozen layer through its master (a RuntimeError in
    autograd), and after the resume left the unfrozen layer out (its master, made while it was frozen, did not ask)."""
    precision = {"opt_level": "O2", "dtype": "float16"}
    three = {"max_epochs": 3}
    full, _ = _fit_fine_tuning(tmp_path / "full", trainer_class, trainer_cfg=three, **precision)
    every_6 = {"enabled": True, "every_n_steps": 6, "every_n_epochs": 0}  # step 6: in epoch 1, the layer frozen
    part, _ = _fit_fine_tuning(
        tmp_path / "part", trainer_class, trainer_cfg={**three, "max_steps": 6}, checkpoint=every_6, **precision
    )
    path = Path(part.version_dir, "checkpoints", "step-00000006.pt")
    resumed, sizes = _fit_fine_tuning(
        tmp_path / "part", trainer_class, resume=path, trainer_cfg=three, checkpoint=every_6, **precision
    )
    assert sizes.at_start == _ALL_MASTER_BYTES
    for key, value in params_of(full).items():
        assert torch.equal(value, params_of(resumed)[key]), key
    assert all(torch.equal(a, b) for a, b in zip(_optimizer_tensors(full), _optimizer_tensors(resumed), strict=True))


class SparseEmbeddingTrainer(ampkit.Trainer):
    """An ``Embedding(sparse=True)`` under SGD: its gradients are sparse tensors with repeated rows."""

    def configure_model(self):
        torch.manual_seed(0)
        return nn.ModuleDict({"emb": nn.Embedding(10, 4, sparse=True), "head": nn.Linear(4, 1)})

    def configure_optimizers(self):
        # named after a submodule, as the Recorder expects; it trains the whole model
        return [{"optimizer": torch.optim.SGD(self.module.parameters(), lr=0.1), "name": "emb"}]

    def train_dataloader(self):
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, 10, (6, 8), generator=gen)
        return [(i, torch.randn(8, generator=gen) / 4) for i in ids]

    def training_step(self, batch):
        ids, y = batch
        return nn.functional.mse_loss(self.model["head"](self.model["emb"](ids)).squeeze(-1).float(), y)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_sparse_embedding_gradients_are_unscaled_clipped_and_logged(tmp_path, opt_level):
    """Sparse gradients through the loss scaler, clipping and the logged grad norm: the run follows float32. torch's
    unscale op and norm kernels take no sparse tensor, so the first backward raised NotImplementedError."""
    clip = {"clip_grad_norm": 0.05, "max_epochs": 2}
    reference, _ = fit(SparseEmbeddingTrainer, tmp_path / "fp32", trainer_cfg=clip, opt_level="O0")
    trainer, recorder = fit(
        SparseEmbeddingTrainer, tmp_path / opt_level, trainer_cfg=clip, opt_level=opt_level, dtype="float16",
        init_scale=1024.0, logging={"tensorboard": True},
    )  # fmt: skip
    assert recorder.skipped == []
    for name, value in params_of(reference).items():
        torch.testing.assert_close(params_of(trainer)[name].float(), value, rtol=0, atol=2e-3)
