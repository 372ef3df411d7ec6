"""Model set-up steps: config errors, activation checkpointing (less kept for backward, same curve), regional
compile (skips as eager under a loss scaler), and compile settings that would compile nothing."""

from __future__ import annotations

import logging
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from toy_trainers import ToyTrainer, toy_cfg, toy_model

import ampkit
from ampkit.callbacks.checkpointing_report import CheckpointingReport
from ampkit.config import load_config
from ampkit.trainer.model_setup import MODEL_STEPS
from ampkit.trainer.user_code import UserCodeError

TINY_GPT = ["model.layers=2", "model.width=32", "model.heads=2", "model.seq_len=16", "data.batch_size=4",
            "data.val_batches=1", "model.dropout=0.1", "trainer.device=cpu", "trainer.progress_bar=false",
            "precision.opt_level=O0", "logging.tensorboard=false", "checkpoint.enabled=false",
            "generate.every_n_steps=0", "trainer.val_every_n_steps=0"]  # fmt: skip


def test_the_steps_run_in_the_order_the_apis_require():
    expected = ["broadcast", "fp8", "activation_checkpointing", "compile_regions", "shard"]
    assert [name for name, _ in MODEL_STEPS] == expected


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"trainer.compile": "Block"}, "trainer.compile"),
        ({"trainer.compile": "[]"}, "trainer.compile"),
        ({"trainer.compile": 3}, "trainer.compile"),
        ({"trainer.compile": True, "trainer.compile_mode": "fastest"}, "trainer.compile_mode"),
        ({"trainer.compile_mode": "max-autotune"}, "trainer.compile_mode"),
        ({"trainer.activation_checkpointing": "['']"}, "trainer.activation_checkpointing"),
    ],
)
def test_bad_settings_fail_at_construction_naming_the_key(tmp_path, overrides, key):
    with pytest.raises(ampkit.ConfigError, match=f"'{key}'"):
        ToyTrainer(toy_cfg(tmp_path, **overrides))


@pytest.mark.parametrize("key", ["trainer.compile", "trainer.activation_checkpointing"])
def test_a_class_the_model_lacks_or_nested_names_fail_before_training(tmp_path, key):
    trainer = ToyTrainer(toy_cfg(tmp_path, **{key: "[Block]"}))
    with pytest.raises(ampkit.ConfigError, match=rf"'{key}': \['Block'\] not in the model.*Dropout, Linear"):
        trainer.fit()
    trainer = ToyTrainer(toy_cfg(tmp_path, **{key: "[Sequential,Linear]"}))
    with pytest.raises(ampkit.ConfigError, match=rf"'{key}': \['Linear'\] sit inside"):
        trainer.fit()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize(
    "key", ["trainer.compile", "trainer.activation_checkpointing", "distributed.fsdp.shard_modules"]
)
def test_a_container_class_that_is_never_called_fails_before_training_naming_what_it_holds(tmp_path, key):
    """The GPT's blocks sit in a ModuleList, which training code iterates and never calls: naming it trained a whole
    iteration before a warning said that nothing had run compiled or checkpointed, and FSDP's fully_shard raised a
    ValueError printing the whole ModuleList."""
    strategy = ["distributed.strategy=fsdp"] if key.startswith("distributed") else []
    trainer_class, cfg = load_config("gpt", [*TINY_GPT, *strategy, f"run_dir={tmp_path}", f"{key}=[ModuleList]"])
    trainer = trainer_class(cfg)
    with pytest.raises(
        ampkit.ConfigError, match=rf"'{key}': \['ModuleList'\] define no forward .* inside instead: Block"
    ):
        trainer.fit()
    assert trainer.state.global_step == 0


class SavedBytes(ampkit.Callback):
    """Bytes autograd keeps for backward during each training forward, and each iteration's loss."""

    def __init__(self):
        self.saved, self.losses = [], []

    def on_train_batch_start(self, trainer, batch):
        self.saved.append(0)

        def pack(tensor):
            self.saved[-1] += tensor.numel() * tensor.element_size()
            return tensor

        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_before_backward(self, trainer, backward):
        self._hooks.__exit__(None, None, None)

    def on_train_batch_end(self, trainer, outputs, batch):
        self.losses.append(float(outputs["loss"]))


def test_activation_checkpointing_keeps_less_for_backward_and_trains_the_same(tmp_path):
    """Dropout is on: the recompute replays its RNG, so the curve and the weights are bit-identical."""
    runs = {}
    for name, extra in (("plain", []), ("checkpointed", ["trainer.activation_checkpointing=[Block]"])):
        cls, cfg = load_config("gpt", [*TINY_GPT, f"run_dir={tmp_path / name}", "trainer.max_steps=4", *extra])
        probe = SavedBytes()
        trainer = cls(cfg, callbacks=[probe])
        trainer.fit()
        runs[name] = probe, trainer.module.state_dict()
    (plain, plain_state), (checkpointed, checkpointed_state) = runs["plain"], runs["checkpointed"]
    assert checkpointed.losses == plain.losses
    for key, value in plain_state.items():
        assert torch.equal(checkpointed_state[key], value), key
    assert max(checkpointed.saved) < 0.5 * min(plain.saved), (checkpointed.saved, plain.saved)
    assert "Block x2" in trainer.model_setup.notes["checkpointing"]


class InfAtStep3(ToyTrainer):
    def configure_model(self):
        return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def training_step(self, batch):
        x, y = batch
        loss = F.mse_loss(self.model(x).squeeze(1), y)
        return loss * math.inf if self.state.iteration == 3 else loss


class Skips(ampkit.Callback):
    def __init__(self):
        self.skipped, self.scales = [], []

    def on_optimizer_step_skipped(self, trainer, optimizer, culprits):
        self.skipped.append(trainer.state.iteration)

    def on_loss_scale_update(self, trainer, loss_id, old, new):
        self.scales.append(new)


@pytest.mark.slow  # torch.compile: ~15 s on 2 cores
def test_regional_compile_skips_an_injected_inf_exactly_as_eager(tmp_path):
    settings = {"trainer.max_steps": 5, "trainer.progress_bar": False, "trainer.device": "cpu",
                "logging.tensorboard": False, "checkpoint.enabled": False, "precision.opt_level": "O1",
                "precision.dtype": "float16", "precision.init_scale": 1024.0,
                "precision.growth_interval": 2}  # fmt: skip
    runs = {}
    for name, extra in (("eager", {}), ("compiled", {"trainer.compile": "[Sequential]"})):
        skips = Skips()
        trainer = InfAtStep3(toy_cfg(tmp_path / name, **settings, **extra), callbacks=[skips])
        trainer.fit()
        runs[name] = skips, trainer
    (eager, eager_trainer), (compiled, compiled_trainer) = runs["eager"], runs["compiled"]
    assert compiled.skipped == eager.skipped == [3]
    assert compiled.scales == eager.scales == [1024.0, 2048.0, 1024.0, 1024.0, 2048.0]
    assert compiled_trainer.model_setup.compiled and "regional" in compiled_trainer.model_setup.notes["compile"]
    for key, value in eager_trainer.module.state_dict().items():
        torch.testing.assert_close(compiled_trainer.module.state_dict()[key], value, rtol=1e-3, atol=1e-4)


def test_compiling_a_model_training_code_never_calls_is_an_error_or_a_warning(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pathlib import Path

    gan = Path(__file__).resolve().parents[1] / "configs" / "gan.yaml"
    cls, cfg = load_config(gan, [f"run_dir={tmp_path}", "trainer.compile=true", "trainer.device=cpu"])
    with pytest.raises(ampkit.ConfigError, match=r"'trainer.compile'.*Gan has none.*trainer.compile=\[Sequential\]"):
        cls(cfg).fit()

    class Bypasses(ToyTrainer):  # Tanh is compiled, then never called: the first iteration compiles nothing
        def training_step(self, batch):
            x, y = batch
            net = self.module
            return F.mse_loss(net[3](net[2](torch.tanh(net[0](x)))).squeeze(1), y)

    # The sanity validation (on by default) calls the whole model, Tanh included, before training starts: the
    # check counts only training's calls, so it still warns.
    quiet = {"trainer.max_steps": 2, "trainer.progress_bar": False, "logging.tensorboard": False}
    trainer = Bypasses(toy_cfg(tmp_path / "regional", **{"trainer.compile": "[Tanh]"}, **quiet))
    with pytest.warns(UserWarning, match=r"'trainer.compile'=\['Tanh'\]: training code called none of the"):
        trainer.fit()
    # The root has a forward but training code calls its children: compiling the root compiles nothing.
    trainer = Bypasses(toy_cfg(tmp_path / "whole", **{"trainer.compile": True}, **quiet))
    with pytest.warns(UserWarning, match=r"'trainer.compile'=true: .*trainer.compile=\[BlockClass\]"):
        trainer.fit()


def test_the_compile_report_stays_quiet_when_training_runs_the_compiled_code(tmp_path, recwarn):
    quiet = {"trainer.max_steps": 2, "trainer.progress_bar": False, "logging.tensorboard": False}
    for name, setting in (("whole", True), ("regional", "[Tanh]")):
        trainer = ToyTrainer(toy_cfg(tmp_path / name, **{"trainer.compile": setting}, **quiet))
        trainer.fit()
        assert trainer.state.global_step == 2
    assert not [w for w in recwarn if "trainer.compile" in str(w.message)]


class _NeverCompiled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = toy_model()

    @torch.compiler.disable
    def forward(self, x):
        return self.net(x)


class _DynamoSkips(ToyTrainer):
    def configure_model(self):
        return _NeverCompiled()


def test_the_compile_report_tells_a_frame_dynamo_skipped_from_graphs_its_cache_had(tmp_path, capsys):
    """Both said "compiled 0 graphs" with no warning: code that ran eagerly (dynamo looked at the frame and compiled
    nothing: here a torch.compiler.disable) is warned of, naming the setting and dynamo's reason; a second fit's
    compiled model, served from this process's cache, is said to be. Dynamo's caches are reset first: the earlier
    compiles of this process (other tests') count against its per-code recompile limit, past which it no longer
    looks at a frame at all."""
    torch._dynamo.reset()
    quiet = {"trainer.max_steps": 1, "trainer.progress_bar": False, "logging.tensorboard": False}
    with pytest.warns(UserWarning, match=r"'trainer.compile'=true: compiled code ran .* dynamo compiled no graph of it "
                      r"\(Skip inlining `torch.compiler.disable\(\)`d function\), so it ran eagerly"):  # fmt: skip
        _DynamoSkips(toy_cfg(tmp_path / "skipped", **{"trainer.compile": True}, **quiet)).fit()
    with warnings.catch_warnings(record=True) as heard:
        warnings.simplefilter("always")
        for name in ("first", "again"):
            ToyTrainer(toy_cfg(tmp_path / name, **{"trainer.compile": True}, **quiet)).fit()
    said = capsys.readouterr()
    assert "compiled 0 graphs (none new: this process's cache had them" in said.out + said.err
    assert not [w for w in heard if "dynamo compiled no graph" in str(w.message)]


class _Tempered(nn.Module):
    """A model whose forward reads a Python float the training step changes: dynamo guards on its value, so each
    new value compiles again until the recompile limit."""

    def __init__(self) -> None:
        super().__init__()
        self.net = toy_model()
        self.temperature = 1.0

    def forward(self, x):
        return self.net(x) * self.temperature


class _Retempers(ToyTrainer):
    def configure_model(self):
        return _Tempered()

    def training_step(self, batch):
        self.module.temperature = 1.0 + self.state.global_step / 10
        return super().training_step(batch)


def test_the_compile_report_names_the_frame_that_reached_the_recompile_limit(tmp_path, monkeypatch):
    """Past torch._dynamo.config.recompile_limit dynamo stops compiling a frame and runs it eagerly, which the
    report said nothing of: it now names the frame, the limit and its config key, the guard that failed and the
    usual cause, once, at the step it happened. The eager backend (inductor builds C++ for minutes on a CPU)."""
    torch._dynamo.reset()  # earlier compiles in this process count against the limit
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, mode=None, **kw: compile_(model, **{**kw, "backend": "eager"}))
    quiet = {"trainer.max_steps": 5, "trainer.progress_bar": False, "logging.tensorboard": False,
             "trainer.val_every_n_steps": 0, "checkpoint.enabled": False}  # fmt: skip
    dynamo_log = logging.getLogger("torch._dynamo.convert_frame")
    handlers_before = list(dynamo_log.handlers)
    limit_reached = r"dynamo reached torch\._dynamo\.config\.recompile_limit = 2 recompiling 'forward' \("
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning) as caught:
        _Retempers(toy_cfg(tmp_path, **{"trainer.compile": True}, **quiet)).fit()
    said = [str(w.message) for w in caught if "recompile" in str(w.message)]
    assert len(said) == 1, said
    assert re.search(limit_reached, said[0]), said[0]
    assert "test_model_setup.py" in said[0] and "the guard that failed last:" in said[0]
    assert "temperature" in said[0] and "the usual cause is a shape or a Python value" in said[0]
    assert dynamo_log.handlers == handlers_before  # the report listened for this fit only

    # With dynamo's warnings silenced the report still counts the hit (dynamo's counters), without the frame.
    torch._dynamo.reset()
    monkeypatch.setattr(dynamo_log, "disabled", True)
    with torch._dynamo.config.patch(recompile_limit=2), pytest.warns(UserWarning) as caught:
        _Retempers(toy_cfg(tmp_path / "silenced", **{"trainer.compile": True}, **quiet)).fit()
    said = [str(w.message) for w in caught if "recompile" in str(w.message)]
    assert len(said) == 1, said
    assert "reached its recompile limit (torch._dynamo.config.recompile_limit = 2) 1 time in this fit" in said[0]
    assert 'TORCH_LOGS="recompiles" names the frames' in said[0]


@pytest.mark.parametrize("setting", [True, "[Tanh]"])
def test_reduce_overhead_off_a_gpu_warns_that_it_compiles_as_the_default_mode(tmp_path, setting):
    """reduce-overhead is the default mode plus CUDA graphs, which torch leaves out on a CPU without a word."""
    quiet = {"trainer.max_steps": 1, "trainer.progress_bar": False, "logging.tensorboard": False}
    compile_keys = {"trainer.compile": setting, "trainer.compile_mode": "reduce-overhead"}
    trainer = ToyTrainer(toy_cfg(tmp_path, **compile_keys, **quiet))
    with pytest.warns(UserWarning, match=r"'trainer.compile_mode': 'reduce-overhead' adds CUDA graphs .* on cpu"):
        trainer.fit()
    assert trainer.state.global_step == 1


@pytest.mark.parametrize("sharded", [False, True])
def test_checkpointing_modules_training_code_never_calls_warns_naming_what_ran(tmp_path, sharded):
    """Tanh is checkpointed, then training code calls torch.tanh instead: nothing is recomputed, no memory saved.
    Under FSDP the modules are named by their own classes, not fully_shard's FSDP<Name> subclasses."""

    class Bypasses(ToyTrainer):
        def training_step(self, batch):
            x, y = batch
            net = self.module
            return F.mse_loss(net[3](net[2](torch.tanh(net[0](x)))).squeeze(1), y)

    quiet = {"trainer.max_steps": 2, "trainer.progress_bar": False, "logging.tensorboard": False}
    fsdp = {"distributed.strategy": "fsdp", "distributed.fsdp.shard_modules": "[Linear]"} if sharded else {}
    trainer = Bypasses(toy_cfg(tmp_path, **{"trainer.activation_checkpointing": "[Tanh]"}, **quiet, **fsdp))
    with pytest.warns(UserWarning) as caught:
        trainer.fit()
    said = [str(w.message) for w in caught if "activation_checkpointing" in str(w.message)]
    assert len(said) == 1, said  # once, not per step
    assert "'trainer.activation_checkpointing'=['Tanh']: training code called none of the checkpointed" in said[0]
    assert "it ran Dropout, Linear instead" in said[0]
    assert trainer.state.global_step == 2
    hooks = [hook for m in trainer.module.modules() for hook in m._forward_pre_hooks.values()]
    assert not [hook for hook in hooks if isinstance(getattr(hook, "__self__", None), CheckpointingReport)]  # gone


def test_checkpointing_that_runs_is_quiet_and_leaves_no_hooks(tmp_path, recwarn):
    quiet = {"trainer.max_steps": 2, "trainer.progress_bar": False, "logging.tensorboard": False}
    trainer = ToyTrainer(toy_cfg(tmp_path, **{"trainer.activation_checkpointing": "[Tanh]"}, **quiet))
    trainer.fit()
    assert trainer.state.global_step == 2
    assert not [w for w in recwarn if "activation_checkpointing" in str(w.message)]
    assert not any(m._forward_pre_hooks for m in trainer.module.modules())


class _StrictAttributes(torch.nn.Module):
    """A module whose __getattr__ raises a KeyError for a name it lacks (a config-backed module), not AttributeError."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            raise KeyError(name) from None

    def forward(self, x):
        return self.body(x)


class _StrictAttributesTrainer(ToyTrainer):
    def configure_model(self):
        return _StrictAttributes()


@pytest.mark.parametrize("setting", [{"trainer.compile": True}, {"distributed.strategy": "fsdp"}])
def test_a_getattr_raising_no_attribute_error_is_named_before_compile_or_fsdp_run(tmp_path, setting):
    """torch's compile and FSDP's state dicts look attributes up with hasattr(), which lets only AttributeError
    through: compile failed inside torch naming _torchdynamo_orig_callable, and FSDP trained, then failed at its first
    checkpoint naming _fqn_modifiers."""
    quiet = {"logging.tensorboard": False, "trainer.progress_bar": False, "trainer.max_steps": 1}
    trainer = _StrictAttributesTrainer(toy_cfg(tmp_path, **quiet, **setting))
    message = r"_StrictAttributes.__getattr__ raises KeyError \('_ampkit_attribute.*'\) for an attribute it lacks"
    with pytest.raises(UserCodeError, match=message + r".*Raise AttributeError there"):
        trainer.fit()
