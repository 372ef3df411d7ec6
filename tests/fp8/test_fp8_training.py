"""Float8 training through the Trainer: config errors at construction, conversion order, skip semantics as in
float16/bfloat16, bit-identical resume, checkpoints that load into the plain model, telemetry."""

from __future__ import annotations

import math

import pytest
import torch
from fp8_trainers import BACKENDS, Fp8Trainer, fp8_cfg, fp8_model

import ampkit
from ampkit.amp.fp8 import RECIPES, Float8Linear, amax_to_scale, is_float8_linear
from ampkit.callbacks import NonFiniteError


class Recorder(ampkit.Callback):
    def __init__(self):
        self.skipped, self.scales, self.scalars, self.steps_seen = [], [], {}, []

    def on_optimizer_step_skipped(self, trainer, optimizer, loss_ids):
        self.skipped.append(trainer.state.iteration)

    def on_loss_scale_update(self, trainer, loss_id, old, new):
        if old != new:
            self.scales.append((trainer.state.iteration, old, new))

    def on_train_batch_end(self, trainer, outputs, batch):
        for tag, value, step in trainer.logged_scalars:
            if tag.startswith("fp8/"):
                self.scalars[(tag, step)] = float(value)


def fit(cfg, inf_at=None, resume=None, callbacks=()):
    trainer = Fp8Trainer(cfg, callbacks=list(callbacks))
    trainer.inf_at = inf_at
    trainer.fit(resume=resume)
    return trainer


# ------------------------------------------------------------------ bad settings, at construction
@pytest.mark.parametrize(
    ("sections", "key", "message"),
    [
        ({"fp8": {"recipe": "blockwise"}}, "precision.fp8.recipe", "tensorwise, rowwise, rowwise_with_gw_hp"),
        ({"fp8": {"backend": "te"}}, "precision.fp8.backend", "one of torchao, reference"),
        ({"fp8": {"emulate": "sometimes"}}, "precision.fp8.emulate", "auto, true or false"),
        ({"fp8": {"telemetry_every_n_steps": -1}}, "precision.fp8.telemetry_every_n_steps", "0: off"),
        ({"fp8": {"emulate": False}}, "precision.fp8.emulate", "reference backend always emulates"),
        ({"precision": {"opt_level": "O3"}}, "precision.opt_level", "without float32 master weights"),
        ({"precision": {"opt_level": "O2", "master_weights": False}}, "precision.opt_level", "master weights"),
        ({"fp8": {"fsdp_float8_all_gather": True}}, "precision.fp8.fsdp_float8_all_gather", "strategy: fsdp"),
        (
            {"fp8": {"fsdp_float8_all_gather": True, "recipe": "rowwise"}, "distributed": {"strategy": "fsdp"}},
            "precision.fp8.fsdp_float8_all_gather",
            "backend torchao and recipe tensorwise",
        ),
    ],
)
def test_invalid_fp8_settings_fail_at_construction_naming_the_key(tmp_path, sections, key, message):
    with pytest.raises(ampkit.ConfigError, match=f"config key '{key}'.*{message}"):
        Fp8Trainer(fp8_cfg(tmp_path, **sections))


def test_backend_torchao_without_torchao_names_the_install_command(tmp_path, monkeypatch):
    import ampkit.amp.fp8 as fp8

    monkeypatch.setattr(fp8, "torchao_available", lambda: False)
    with pytest.raises(ampkit.ConfigError, match=r"'precision.fp8.backend'.*pip install \"ampkit\[fp8\]\""):
        Fp8Trainer(fp8_cfg(tmp_path, backend="torchao"))


def test_a_torchao_that_fails_to_import_is_named_before_the_model_is_built(tmp_path, monkeypatch):
    """A torchao built for another torch is found by find_spec but fails on import: the run got past every check and
    died in the fp8 set-up step with torchao's ImportError traceback."""
    import sys

    broken = tmp_path / "site" / "torchao"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("undefined symbol: _ZN3c1017SymbolicShapeMeta")\n')
    monkeypatch.syspath_prepend(str(broken.parent))
    for name in [n for n in sys.modules if n == "torchao" or n.startswith("torchao.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(
        ampkit.ConfigError,
        match=r"'precision.fp8.backend': 'torchao' needs torchao, which is installed but fails to import "
        r"\(ImportError: undefined symbol: _ZN3c10.*\): install one built for torch .* or use backend 'reference'",
    ):
        Fp8Trainer(fp8_cfg(tmp_path, backend="torchao"))


def test_torchao_needs_a_float8_gpu_for_real_gemms_and_cannot_run_gw_hp_under_cpu_autocast(tmp_path):
    with pytest.raises(ampkit.ConfigError, match="'precision.fp8.emulate': false needs float8 GEMMs.*capability"):
        Fp8Trainer(fp8_cfg(tmp_path, backend="torchao", fp8={"emulate": False}))
    with pytest.raises(ampkit.ConfigError, match="'precision.fp8.recipe': torchao's rowwise_with_gw_hp fails under O1"):
        Fp8Trainer(fp8_cfg(tmp_path, backend="torchao", fp8={"recipe": "rowwise_with_gw_hp"},
                           precision={"opt_level": "O1", "dtype": "bfloat16"}))  # fmt: skip


@pytest.mark.parametrize("key", ["modules", "skip_modules"])
def test_a_modules_pattern_naming_no_linear_fails_before_training_listing_them(tmp_path, key):
    trainer = Fp8Trainer(fp8_cfg(tmp_path, fp8={key: ["decoder.*"]}))
    with pytest.raises(
        ampkit.ConfigError, match=rf"'precision.fp8': {key} \['decoder.\*'\] name no nn.Linear.*0, 2, 4"
    ):
        trainer.fit()


# ------------------------------------------------------------------ conversion
@pytest.mark.parametrize("backend", BACKENDS)
def test_conversion_precedes_the_optimizers_and_keeps_odd_layers_in_high_precision(tmp_path, backend):
    trainer = fit(fp8_cfg(tmp_path, backend, trainer={"max_steps": 1}, fp8={"recipe": "rowwise"}))
    model = trainer.module
    assert [is_float8_linear(model[i]) for i in (0, 2, 4)] == [True, True, False]  # 16 -> 1 stays high precision
    trained = {id(p) for g in trainer.optimizer.param_groups for p in g["params"]}
    assert trained == {id(p) for p in model.parameters()}  # the optimizer holds the float8 layers' parameters
    assert all(p.grad is None for p in model.parameters())


def test_fp8_describes_itself_in_the_precision_line(tmp_path):
    from ampkit.callbacks.precision_config import describe_precision

    trainer = Fp8Trainer(fp8_cfg(tmp_path, fp8={"recipe": "rowwise"}, precision={"opt_level": "O4"}))
    assert describe_precision(trainer.cfg.precision) == "O4 bfloat16, fp8 rowwise (reference)"


# ------------------------------------------------------------------ skips exactly as float16/bfloat16
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_an_inf_batch_in_fp16_skips_one_step_and_backs_the_scale_off(tmp_path, backend, opt_level):
    rec = Recorder()
    precision = {"opt_level": opt_level, "dtype": "float16"}
    trainer = fit(fp8_cfg(tmp_path, backend, precision=precision), inf_at=3, callbacks=[rec])
    assert rec.skipped == [3]
    assert rec.scales == [(3, 65536.0, 32768.0)]
    state = trainer.optimizer_state[trainer.optimizer]
    assert (state.steps, state.skipped_steps) == (5, 1)
    assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_inf_batch_in_bf16_with_skip_nonfinite_skips_one_step(tmp_path, backend):
    rec = Recorder()
    precision = {"opt_level": "O1", "dtype": "bfloat16", "skip_nonfinite": True}
    trainer = fit(fp8_cfg(tmp_path, backend, precision=precision), inf_at=2, callbacks=[rec])
    assert rec.skipped == [2] and rec.scales == []
    assert all(torch.isfinite(p).all() for p in trainer.module.parameters())


# ------------------------------------------------------------------ checkpoints
def _weights(trainer):
    return {k: v.detach().clone() for k, v in trainer.module.state_dict().items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_is_bit_identical_and_checkpoints_load_into_the_plain_model(tmp_path, backend):
    precision = {"opt_level": "O2", "dtype": "bfloat16"}
    ckpt = {"enabled": True, "every_n_steps": 3, "every_n_epochs": 0, "keep_last": 5}
    whole = fit(fp8_cfg(tmp_path / "a", backend, precision=precision, fp8={"recipe": "rowwise"}, checkpoint=ckpt))
    first = fit(fp8_cfg(tmp_path / "b", backend, precision=precision, fp8={"recipe": "rowwise"}, checkpoint=ckpt,
                        trainer={"max_steps": 3}))  # fmt: skip
    step3 = first.version_dir / "checkpoints" / "step-00000003.pt"
    resumed = fit(fp8_cfg(tmp_path / "b", backend, precision=precision, fp8={"recipe": "rowwise"}, checkpoint=ckpt),
                  resume=step3)  # fmt: skip
    assert resumed.state.global_step == 6
    for key, value in _weights(whole).items():
        assert torch.equal(value, _weights(resumed)[key]), key
    state = torch.load(whole.version_dir / "checkpoints" / "last.pt", weights_only=True)["model"]
    plain = fp8_model().to(torch.bfloat16)
    plain.load_state_dict(state)  # nn.Linear's keys: the fp8 model loads anywhere
    assert not any(isinstance(m, Float8Linear) for m in plain.modules())


# ------------------------------------------------------------------ telemetry
def test_telemetry_logs_each_layers_amax_scale_and_underflow_every_n_steps(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    rec = Recorder()
    cfg = fp8_cfg(tmp_path, fp8={"telemetry_every_n_steps": 2}, trainer={"max_steps": 5}, logging={"tensorboard": True})
    trainer = Fp8Trainer(cfg, callbacks=[rec])
    trainer.inf_at = 4
    with pytest.raises(NonFiniteError, match="step 4 applied a loss of nan"):  # nothing skipped it: a NaN model
        trainer.fit()
    steps = sorted({step for _, step in rec.scalars})
    assert steps == [2, 4]
    layers = {tag.split("/")[1] for tag, _ in rec.scalars}
    assert layers == {"0", "2"}  # the float8 layers only
    for layer in layers:
        for role in ("weight", "input", "grad_output"):
            amax, scale = rec.scalars[(f"fp8/{layer}/{role}/amax", 2)], rec.scalars[(f"fp8/{layer}/{role}/scale", 2)]
            dtype = RECIPES["tensorwise"].grad_output.dtype if role == "grad_output" else torch.float8_e4m3fn
            assert scale == float(amax_to_scale(torch.tensor(amax), dtype, False))
            assert 0 <= rec.scalars[(f"fp8/{layer}/{role}/underflow", 2)] < 0.5
    assert math.isinf(rec.scalars[("fp8/0/input/amax", 4)])  # the inf batch (a skipped step) shows in its amax
    assert rec.skipped == []  # O0 with skip_nonfinite off: nothing skips, but the telemetry saw the inf
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"), size_guidance={"histograms": 0}).Reload()
    assert {f"fp8/{role}/log2_scale" for role in ("weight", "input", "grad_output")} <= set(events.Tags()["histograms"])
    weight_scales = events.Histograms("fp8/weight/log2_scale")
    assert [h.step for h in weight_scales] == [2, 4] and weight_scales[0].histogram_value.num == 2  # one per layer
    assert [e.step for e in events.Scalars("fp8/2/input/scale")] == [2, 4]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_telemetry_records_a_compiled_model_by_running_its_telemetry_steps_eagerly(tmp_path, backend):
    rec = Recorder()
    cfg = fp8_cfg(tmp_path, backend, fp8={"recipe": "rowwise", "telemetry_every_n_steps": 2},
                  trainer={"max_steps": 3, "compile": True})  # fmt: skip
    fit(cfg, callbacks=[rec])
    assert {step for _, step in rec.scalars} == {2}
    assert len(rec.scalars) == 2 * 3 * 3  # two layers, three roles, three statistics
    assert torch.compiler.is_compiling() is False and "default" in repr(torch._dynamo.eval_frame._stance)


# ------------------------------------------------------------------ FSDP2 float8 all-gather
@pytest.mark.skipif(
    "torchao" not in BACKENDS, reason='FSDP float8 all-gather is torchao\'s (pip install "ampkit[fp8]")'
)
def test_fsdp_float8_all_gather_on_two_ranks_equals_the_high_precision_all_gather(tmp_path):
    import sys
    from pathlib import Path

    from child_env import child_env
    from rank_forkserver import ForkedPython
    from test_distributed import _free_port

    here, procs, port = Path(__file__).resolve().parent, [], str(_free_port())
    for all_gather in ("float8", "high"):
        (tmp_path / all_gather).mkdir()
    for rank in range(2):  # each rank runs both, one after the other: torchao's import, paid once per rank
        env = child_env(here, here.parent, here.parents[1], RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2",
                        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1")  # fmt: skip
        args = [sys.executable, str(here / "fsdp_fp8_worker.py"), str(tmp_path)]
        procs.append(ForkedPython(args, env=env))  # forked from a process that imported torch already
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr[-3000:]
    float8, high = ([torch.load(tmp_path / run / f"rank{r}.pt", weights_only=True) for r in range(2)]
                    for run in ("float8", "high"))  # fmt: skip
    assert float8[0]["local_weight"] == "WeightWithDynamicFloat8CastTensor" and high[0]["local_weight"] == "Tensor"
    for rank in range(2):
        assert (float8[rank]["steps"], float8[rank]["skipped"]) == (5, 1)  # the inf batch of iteration 3 skipped
        assert float8[rank]["precomputes"] == 5 and high[rank]["precomputes"] == 0  # after each taken step only
        for key, value in high[0]["model"].items():
            assert torch.equal(float8[rank]["model"][key], value), key
    # the float8 run's sharded checkpoint consolidates where torchao cannot be imported (weights_only=True)
    last, plain = tmp_path / "float8" / "run" / "version_0" / "checkpoints" / "last", tmp_path / "plain.pt"
    script = tmp_path / "consolidate.py"  # forked too: a new Python spent seconds importing torch and ampkit
    script.write_text("import sys\nassert 'torchao' not in sys.modules\nsys.modules['torchao'] = None\n"
                      "import torch, ampkit\n"
                      f"torch.save(ampkit.consolidate_checkpoint({str(last)!r}), {str(plain)!r})\n")  # fmt: skip
    consolidating = ForkedPython([sys.executable, str(script)], env=child_env(here, here.parents[1]))
    _, stderr = consolidating.communicate(timeout=240)
    assert consolidating.returncode == 0, stderr[-3000:]
    for key, value in torch.load(plain, weights_only=True).items():
        assert type(value) is torch.Tensor and torch.equal(value, float8[0]["model"][key]), key


def test_the_fp8_example_config_trains_its_first_layer_in_float8(tmp_path, monkeypatch):
    from pathlib import Path

    from ampkit.config import load_config

    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[2]
    overrides = ["precision.fp8.backend=reference", "trainer.max_epochs=1", "trainer.limit_train_batches=4",
                 "trainer.limit_val_batches=2", "trainer.progress_bar=false", "logging.tensorboard=false"]  # fmt: skip
    cls, cfg = load_config(repo / "configs" / "digits_fp8.yaml", overrides)
    trainer = cls(cfg)
    trainer.fit()
    converted = [name for name, m in trainer.module.named_modules() if is_float8_linear(m)]
    assert converted == ["0"] and math.isfinite(trainer.val_metrics["loss"])


def test_load_model_gives_the_plain_model_wherever_the_fp8_run_trained(tmp_path):
    from ampkit import load_model

    trainer = fit(fp8_cfg(tmp_path, checkpoint={"enabled": True}, trainer={"max_steps": 2}))
    path = trainer.version_dir / "checkpoints" / "last.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["config"]["precision"]["fp8"].update(backend="torchao", emulate=False)  # as on an H100
    checkpoint["config"]["trainer_class"] = "fp8_trainers:Fp8Trainer"
    torch.save(checkpoint, path)
    model = load_model(path)  # here: no float8 GPU, maybe no torchao, and no error
    assert not any(is_float8_linear(m) for m in model.modules())
    x = torch.randn(3, 16)
    assert torch.equal(model(x), nn_forward(trainer.module, x))


def nn_forward(module, x):
    """``module``'s output computed with plain high-precision Linears (its float8 layers' own weights)."""
    plain = fp8_model()
    plain.load_state_dict(module.state_dict())
    return plain.eval()(x)


def test_the_gpt_fp8_config_trains_its_blocks_linears_in_float8(tmp_path, monkeypatch):
    from pathlib import Path

    from ampkit.config import load_config

    monkeypatch.chdir(tmp_path)
    repo = Path(__file__).resolve().parents[2]
    overrides = ["precision.fp8.backend=reference", "trainer.max_steps=2", "trainer.val_every_n_steps=0",
                 "checkpoint.enabled=false", "trainer.progress_bar=false", "logging.tensorboard=false",
                 "model.layers=1", "generate.every_n_steps=0"]  # fmt: skip
    cls, cfg = load_config(repo / "configs" / "gpt_fp8.yaml", overrides)
    trainer = cls(cfg)
    trainer.fit()
    converted = sorted(name for name, m in trainer.module.named_modules() if is_float8_linear(m))
    assert converted == ["blocks.0.attn.proj", "blocks.0.attn.qkv", "blocks.0.mlp.0", "blocks.0.mlp.2"]
    assert trainer.model_setup.notes["fp8"] == (
        "4 Linear layers in float8; kept in high precision: 'head' (named by skip_modules); GEMMs emulated in "
        "float32, slower than without fp8 (float8 GEMMs need CUDA capability 8.9+)"
    )


def test_the_banner_counts_one_float8_layer_in_the_singular():
    from ampkit.amp.fp8.convert import Float8Conversion

    one = Float8Conversion(converted=["0"], skipped={"3": "128x10 not divisible by 16"})
    assert one.summary() == "1 Linear layer in float8; kept in high precision: '3' (128x10 not divisible by 16)"
    assert Float8Conversion(converted=["a", "b"]).summary() == "2 Linear layers in float8"
    assert Float8Conversion(skipped={"3": "named by skip_modules"}, emulated=True).summary() == (
        "0 Linear layers in float8; kept in high precision: '3' (named by skip_modules)"  # nothing to emulate
    )
