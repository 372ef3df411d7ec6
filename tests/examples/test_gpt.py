"""The GPT example: FLOPs against the hand formula, the corpus split, precision chosen for the machine, a short run,
generation into TensorBoard and through ``ampkit predict``, and model-setup keys on it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from ampkit.callbacks.throughput import count_training_flops
from ampkit.cli import main
from ampkit.config import load_config
from ampkit.examples.gpt import (
    GPT,
    GPTModelConfig,
    Windows,
    choose_precision,
    corpus_bytes,
    flops_per_token_formula,
    generate,
    split,
    unigram_entropy,
)

TINY = ["model.layers=1", "model.width=32", "model.heads=2", "model.seq_len=16", "data.batch_size=8",
        "data.val_batches=2", "trainer.device=cpu", "trainer.progress_bar=false", "precision.opt_level=O0"]  # fmt: skip


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_counted_flops_equal_six_per_matmul_parameter_plus_attention(norm):
    cfg = GPTModelConfig(layers=2, width=48, heads=3, seq_len=24, norm=norm)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.zeros(1, cfg.seq_len, dtype=torch.long)
    counted = count_training_flops(lambda: model(idx).sum())
    assert counted == flops_per_token_formula(cfg) * cfg.seq_len


def test_corpus_split_is_deterministic_and_text_has_context_to_learn():
    data = corpus_bytes()
    assert len(data) > 400_000 and int(data.max()) < 256
    train, val = split(data, 0.1)
    assert len(val) == int(len(data) * 0.1) and torch.equal(torch.cat([train, val]), data)
    assert torch.equal(split(corpus_bytes(), 0.1)[1], val)
    assert 3.0 < unigram_entropy(train) < 3.6  # English bytes: ~4.7 bits
    windows = Windows(val, 16, count=5)
    x, y = windows[4]
    assert torch.equal(x[1:], y[:-1]) and len(windows) == 5


def test_validation_windows_on_a_short_text_are_whole():
    """More windows asked than start positions (a small data.val_fraction): each start once, none cut short (a cut
    window failed the DataLoader's stack at the first validation, after training had run)."""
    windows = Windows(torch.arange(40), 16, count=64)
    assert len(windows) == 40 - 16
    assert {len(windows[i][0]) for i in range(len(windows))} == {16}
    assert torch.equal(windows[len(windows) - 1][1], torch.arange(24, 40))


def auto_cfg(**precision):
    return OmegaConf.create({"trainer": {"device": "cpu"},
                             "precision": {"opt_level": "auto", "dtype": None, **precision},
                             "model": OmegaConf.structured(GPTModelConfig(layers=1, width=32, heads=2, seq_len=16)),
                             "data": {"batch_size": 4}})  # fmt: skip


def test_auto_precision_picks_a_real_level_and_says_why(monkeypatch):
    cfg = auto_cfg()
    why = choose_precision(cfg)
    assert (cfg.precision.opt_level, cfg.precision.dtype) in (("O0", None), ("O1", "bfloat16"))
    assert "AMX" in why and why.endswith(("float32 (O0)", "bf16 autocast (O1), no loss scaler"))
    cfg.precision.opt_level, cfg.precision.dtype, cfg.trainer.device = "auto", None, "auto"  # as a user wrote it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert "GPU" in choose_precision(cfg) and cfg.precision.dtype == "bfloat16" and cfg.precision.opt_level == "O1"
    assert choose_precision(cfg) is None  # a real level stays as it is


def test_auto_precision_is_stable_where_timing_could_flip_it(monkeypatch):
    """Without AMX nothing is timed: float32. Under several ranks nothing is timed either (each rank would time
    apart, and ranks that chose differently refuse to start): float32 on CPUs."""
    import ampkit.examples.gpt as gpt

    def timed(*args, **kwargs):
        raise AssertionError("a block was built to be timed")

    monkeypatch.setattr(gpt, "Block", timed)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    cfg = auto_cfg()
    assert "without AMX" in choose_precision(cfg) and cfg.precision.opt_level == "O0"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setenv("WORLD_SIZE", "2")
    cfg = auto_cfg()
    assert "several ranks" in choose_precision(cfg) and cfg.precision.opt_level == "O0"


def test_a_resume_keeps_the_precision_auto_chose_when_the_run_started(tmp_path, monkeypatch):
    """Timed again at the resume, the choice can flip (a loaded machine, another world size): the curve would change
    mid-run. The checkpoint's precision is kept, untimed, for fit and for evaluating it; a level given by name still
    wins."""
    import ampkit.examples.gpt as gpt

    timings = []

    def run(bf16_faster: bool, *overrides: str):
        def timed(*args, **kwargs):
            timings.append(bf16_faster)
            return bf16_faster, "timed"

        monkeypatch.setattr(gpt, "faster_cpu_precision", timed)
        trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", "precision.opt_level=auto",
                                                 "trainer.val_every_n_steps=0", "checkpoint.monitor=null",
                                                 "generate.every_n_steps=0", "logging.tensorboard=false",
                                                 *overrides])  # fmt: skip
        return trainer_class(cfg)

    run(True, "trainer.max_steps=1").fit()
    assert timings == [True]
    resumed = run(False, "trainer.max_steps=2")
    resumed.fit(resume="last")
    assert (resumed.cfg.precision.opt_level, resumed.cfg.precision.dtype) == ("O1", "bfloat16")
    assert "the checkpoint's" in resumed.model_setup.notes["auto prec."]
    predicting = run(False, "generate.tokens=2")
    predicting.predict(ckpt="last")
    assert predicting.cfg.precision.dtype == "bfloat16"
    assert timings == [True]  # neither the resume nor the prediction timed the CPU again
    named = run(True, "trainer.max_steps=3", "precision.opt_level=O0")
    named.fit(resume="last")
    assert named.cfg.precision.opt_level == "O0"
    given = run(True, "trainer.max_steps=4", "precision.dtype=float16")  # auto with a dtype: the user's choice
    given.fit(resume="last")
    assert (given.cfg.precision.opt_level, given.cfg.precision.dtype) == ("O1", "float16")


def test_auto_keeps_a_dtype_the_user_gave():
    cfg = auto_cfg(dtype="float16")
    assert "precision.dtype=float16 was given" in choose_precision(cfg)
    assert (cfg.precision.opt_level, cfg.precision.dtype) == ("O1", "float16")


def test_the_fused_norms_build_and_count_their_flops_on_the_meta_device(tmp_path):
    """model.fused_norm=true: the FLOP count runs the model on ``meta``, where autocast does not exist."""
    for norm in ("layernorm", "rmsnorm"):
        trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}/{norm}", "model.fused_norm=true",
                                                 f"model.norm={norm}", "trainer.max_steps=2",
                                                 "trainer.val_every_n_steps=0", "checkpoint.enabled=false",
                                                 "generate.every_n_steps=0"])  # fmt: skip
        trainer = trainer_class(cfg)
        trainer.fit()
        plain = GPTModelConfig(layers=1, width=32, heads=2, seq_len=16, norm=norm)
        assert trainer.flops_per_sample == flops_per_token_formula(plain) * 16


def test_gpt_trains_logs_throughput_and_samples_then_predict_generates(tmp_path, monkeypatch, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)  # the built-in config, found by name from any directory
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}/run", "trainer.max_steps=6",
                                             "trainer.val_every_n_steps=3", "checkpoint.every_n_steps=3",
                                             "logging.log_every_n_steps=2", "generate.every_n_steps=3",
                                             "generate.tokens=12"])  # fmt: skip
    trainer = trainer_class(cfg)
    trainer.fit()
    assert trainer.tokens_per_sample == 16 and trainer.flops_per_sample > 0
    events = EventAccumulator(str(trainer.version_dir / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    assert {"perf/tokens_per_sec", "perf/tflops", "val/loss"} <= set(events.Tags()["scalars"])
    samples = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors("samples/text_summary")]
    assert [step for step, _ in samples] == [3, 6] and all(text.startswith("The ") for _, text in samples)

    capsys.readouterr()
    code = main(["predict", "--config", "gpt", "--ckpt", "best", "--output", str(tmp_path / "p.pt"), *TINY,
                 f"run_dir={tmp_path}/run", "generate.tokens=12", "generate.prompt=Python"])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    generated = torch.load(tmp_path / "p.pt", weights_only=True)
    assert generated[0].startswith("Python") and len(generated[0].encode()) >= len("Python") + 12 - 3  # utf-8 runs
    assert printed.startswith(generated[0])

    # As the issue and the config's header give it, without --output: the text is printed, nothing is written
    code = main(["predict", "--config", "gpt", "--ckpt", "best", *TINY, f"run_dir={tmp_path}/run",
                 "generate.tokens=12", "generate.prompt=Python"])  # fmt: skip
    assert code == 0
    assert (
        capsys.readouterr().out
        == f"{generated[0]}\nampkit: predictions of 1 batch not saved (--output FILE saves them)\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.pt", "run"]


def test_a_training_iteration_reads_no_config_node(tmp_path, monkeypatch):
    """An OmegaConf read costs microseconds (0.3 ms a step for the schedule's ~15 on a loaded 2-core machine, 15%
    of a tiny model's step): the schedule and the per-batch hook read plain values, as the Trainer's loop does."""
    from omegaconf import DictConfig

    import ampkit

    reads = []
    read = DictConfig.__getattr__

    class Window(ampkit.Callback):  # counts from iteration 3's start to iteration 5's: two whole iterations
        counting = False

        def on_train_batch_start(self, trainer, batch) -> None:
            Window.counting = trainer.state.global_step in (2, 3)

    def counted(node, key):
        if Window.counting:
            reads.append(key)
        return read(node, key)

    monkeypatch.setattr(DictConfig, "__getattr__", counted)
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", "trainer.max_steps=5",
                                             "trainer.val_every_n_steps=0", "checkpoint.enabled=false",
                                             "logging.log_every_n_steps=1", "generate.every_n_steps=0"])  # fmt: skip
    trainer_class(cfg, callbacks=[Window()]).fit()
    assert reads == []


@pytest.mark.parametrize(
    "limits", [["trainer.max_steps=-1"], ["trainer.max_steps=100"]], ids=["no step limit", "epochs first"]
)
def test_the_schedule_reaches_min_lr_when_epochs_end_the_run(tmp_path, limits):
    """max_steps -1 (epochs only) kept the peak rate after warm-up, and a max_steps beyond max_epochs' worth ended
    the run before the decay did: the cosine now spans the iterations the run trains (2 epochs x 4 here)."""
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", "trainer.max_epochs=2", *limits,
                                             "trainer.limit_train_batches=4", "trainer.val_every_n_steps=0",
                                             "checkpoint.enabled=false", "generate.every_n_steps=0",
                                             "logging.tensorboard=false", "optim.warmup_steps=2"])  # fmt: skip
    trainer = trainer_class(cfg)
    trainer.fit()
    assert trainer.state.global_step == 8
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(cfg.optim.min_lr)


def test_without_tensorboard_samples_go_to_the_console(tmp_path, capsys):
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}/run", "trainer.max_steps=2",
                                             "trainer.val_every_n_steps=0", "checkpoint.enabled=false",
                                             "logging.tensorboard=false", "generate.every_n_steps=2",
                                             "generate.tokens=4"])  # fmt: skip
    trainer_class(cfg).fit()
    assert "sample at step 2: 'The " in capsys.readouterr().out


def test_a_checkpoint_of_another_size_or_trainer_names_the_keys_it_was_saved_with(tmp_path):
    """predict of a checkpoint trained at another size said only "size mismatch for head.weight: copying a param with
    shape [256, 32] ...": which key to set, and to what, was left to the user."""
    from toy_trainers import ToyTrainer, toy_cfg

    from ampkit.trainer.checkpoint_io import CheckpointError

    quiet = ["trainer.val_every_n_steps=0", "checkpoint.monitor=null", "logging.tensorboard=false",
             "generate.every_n_steps=0"]  # fmt: skip
    trainer_class, cfg = load_config("gpt", [*TINY, *quiet, f"run_dir={tmp_path}/run", "trainer.max_steps=1"])
    trainer_class(cfg).fit()
    for override, said in (("model.width=64", "size mismatch for .*model.width: 32 -> 64"),
                           ("model.layers=2", r"Missing key\(s\) .*model.layers: 1 -> 2")):  # fmt: skip
        _, cfg = load_config("gpt", [*TINY, *quiet, f"run_dir={tmp_path}/run", override, "generate.tokens=1"])
        with pytest.raises(CheckpointError, match=rf"does not fit this run's model: {said}: set them as it had"):
            trainer_class(cfg).predict(ckpt="last")
    toy = ToyTrainer(toy_cfg(tmp_path / "toy", **{"trainer.max_steps": 1, "logging.tensorboard": False}))
    toy.fit()
    with pytest.raises(CheckpointError, match="saved by trainer_class toy_trainers:ToyTrainer, not this run's ampkit"):
        trainer_class(cfg).predict(ckpt=toy.version_dir / "checkpoints" / "last.pt")


def test_a_sharded_checkpoint_of_another_model_is_a_misfit_not_a_damaged_shard_or_a_silent_load(tmp_path):
    """Under FSDP, predict of a checkpoint with fewer blocks said "a shard file is damaged or missing", and one saved
    with LayerNorm's biases loaded into an RMSNorm model without a word, the biases dropped."""
    from ampkit.trainer.checkpoint_io import CheckpointError

    fsdp = ["distributed.strategy=fsdp", "trainer.val_every_n_steps=0", "checkpoint.monitor=null",
            "logging.tensorboard=false", "generate.every_n_steps=0", "generate.tokens=1"]  # fmt: skip
    trainer_class, cfg = load_config("gpt", [*TINY, *fsdp, f"run_dir={tmp_path}", "trainer.max_steps=1"])
    trainer_class(cfg).fit()
    for override, said in (("model.layers=2", r"Missing key\(s\) in the checkpoint: blocks\.1\.norm1\.weight.*"
                                              r"model.layers: 1 -> 2"),
                           ("model.norm=rmsnorm", r"Unexpected key\(s\) in the checkpoint: blocks\.0\.norm1\.bias.*"
                                                  r"model.norm"),
                           ("model.width=64", r"size mismatch for embed\.weight: shape \[256, 32\] in the checkpoint, "
                                              r"\[256, 64\] in this run's model.*model.width: 32 -> 64")):  # fmt: skip
        _, cfg = load_config("gpt", [*TINY, *fsdp, f"run_dir={tmp_path}", override])
        with pytest.raises(CheckpointError, match=rf"sharded checkpoint .* does not fit this run's model: {said}"):
            trainer_class(cfg).predict(ckpt="last")


def test_an_empty_prompt_is_refused_not_an_index_error():
    """Predict and the samples during fit would fail on the first byte: no position to continue from."""
    model = GPT(GPTModelConfig(layers=1, width=32, heads=2, seq_len=16))
    with pytest.raises(ValueError, match="prompt is empty"):
        generate(model, torch.tensor([], dtype=torch.long), 4)
    assert generate(model, torch.tensor([], dtype=torch.long), 0).numel() == 0  # nothing asked, nothing to continue
    assert torch.equal(generate(model, torch.tensor([7]), 0), torch.tensor([7]))


class Ranked(torch.nn.Module):
    """A stand-in model whose next-byte logits rank the bytes 255 > 254 > ... > 0, a step of 1 apart."""

    seq_len = 4

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return torch.arange(256.0).expand(*idx.shape, 256)


@pytest.mark.parametrize("temperature", [1e39, 1e-39])
def test_top_k_samples_among_the_k_likeliest_whatever_the_temperature(temperature):
    """The temperature divided the logits before top-k chose: 1e39 rounded every logit to 0, so top_k=2 sampled among
    all 256 bytes; 1e-39 made them inf, and the nan probabilities failed multinomial."""
    out = generate(Ranked(), torch.tensor([1]), 64, top_k=2, temperature=temperature, generator=torch.manual_seed(0))
    assert set(out[1:].tolist()) <= {254, 255}
    if temperature > 1:  # so flat that both of the two are drawn
        assert set(out[1:].tolist()) == {254, 255}


def test_generate_refuses_what_it_cannot_sample_by_name():
    model = Ranked()
    for kwargs, named in (({"tokens": -1}, "tokens=-1"), ({"tokens": 2, "top_k": -3}, "top_k=-3"),
                          ({"tokens": 2, "top_k": 5, "temperature": float("inf")}, "temperature=inf"),
                          ({"tokens": 2.5}, "tokens=2.5"), ({"tokens": 2, "top_k": 2.5}, "top_k=2.5"),  # were: torch's
                          ({"tokens": True}, "tokens=True"),
                          ({"tokens": 2, "temperature": None}, "temperature=None")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"generate: {named} is invalid; expected"):
            generate(model, torch.tensor([1]), **kwargs)


def test_a_prompt_outside_the_byte_vocabulary_is_named_and_a_text_is_taken():
    """A prompt of token ids >= 256 failed in the embedding with "index out of range in self", a float or 2-D one with
    torch's own words; a str is encoded as the config's generate.prompt is."""
    model = GPT(GPTModelConfig(layers=1, width=32, heads=2, seq_len=16))
    for prompt, error, said in ((torch.tensor([72, 300]), ValueError, "holds values from 72 to 300"),
                                (torch.tensor([-1]), ValueError, "holds values from -1 to -1"),
                                (torch.tensor([65.0]), TypeError, "is a 1-D torch.float32 tensor"),
                                (torch.tensor([[65, 66]]), TypeError, "is a 2-D torch.int64 tensor"),
                                (None, TypeError, "is NoneType None")):  # fmt: skip
        with pytest.raises(error, match=rf"generate: the prompt {re.escape(said)}; expected one text's bytes"):
            generate(model, prompt, 2)
    as_text = generate(model, "Thé", 2)
    assert torch.equal(as_text[:4], torch.tensor(list("Thé".encode()))) and len(as_text) == 6
    assert torch.equal(generate(model, torch.tensor([84, 104], dtype=torch.uint8), 2), generate(model, [84, 104], 2))


@pytest.mark.parametrize("top_k", [0, 5], ids=["greedy", "sampled"])
def test_a_diverged_model_is_named_not_a_multinomial_error_or_a_silent_argmax(top_k):
    """Logits gone nan (weights diverged, or overflowing in low precision): sampling failed in torch.multinomial with
    "probability tensor contains either inf, nan or element < 0" (the samples during fit, and predict), and greedy
    decoding's argmax returned a byte as if nothing were wrong."""
    from ampkit.callbacks.nonfinite_guard import NonFiniteError

    model = GPT(GPTModelConfig(layers=1, width=32, heads=2, seq_len=16))
    with torch.no_grad():
        model.blocks[0].mlp[2].weight.fill_(float("nan"))
    with pytest.raises(NonFiniteError, match=r"generate: the model's logits are not finite \(nan or inf\)"):
        generate(model, torch.tensor([1, 2]), 3, top_k=top_k, generator=torch.manual_seed(0))


@pytest.mark.parametrize(("setting", "shown"), [("true", "true"), ("[Block]", r"\['Block'\]")])
def test_predict_under_a_compile_setting_warns_that_generation_runs_eagerly(tmp_path, setting, shown):
    """Generation forces eager mode (each new length would compile a graph): a compile key on predict did nothing,
    silently."""
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", f"trainer.compile={setting}",
                                             "generate.tokens=2"])  # fmt: skip
    with pytest.warns(UserWarning, match=rf"'trainer.compile'={shown}: predict generates eagerly .* nothing runs"):
        (text,) = trainer_class(cfg).predict()
    assert text.startswith("The ")


def test_an_input_longer_than_the_context_is_refused_by_name():
    """A loaded model called on more than seq_len tokens: the position table's IndexError named nothing."""
    model = GPT(GPTModelConfig(layers=1, width=32, heads=2, seq_len=16))
    assert model(torch.zeros(2, 16, dtype=torch.long)).shape == (2, 16, 256)
    with pytest.raises(ValueError, match=r"17 tokens is longer than model.seq_len=16"):
        model(torch.zeros(2, 17, dtype=torch.long))
    assert len(generate(model, torch.arange(40), 3)) == 43  # generate crops to the context itself


def test_model_config_errors_name_the_key(tmp_path):
    import ampkit

    for override, key in (("model.width=31", "model.width"), ("model.norm=batchnorm", "model.norm"),
                          ("model.heads=0", "model.heads"), ("model.layers=-1", "model.layers"),
                          ("data.batch_size=-4", "data.batch_size"), ("data.val_fraction=1.5", "data.val_fraction"),
                          ("generate.top_k=-1", "generate.top_k"), ("optim.lr=-1", "optim.lr"),
                          ("generate.temperature=-0.5", "generate.temperature"),
                          ("generate.temperature=inf", "generate.temperature"),
                          ("generate.prompt=''", "generate.prompt"),
                          # an infinite rate or decay: nan weights after one step, found only by sampling's multinomial
                          ("optim.lr=inf", "optim.lr"), ("optim.weight_decay=inf", "optim.weight_decay"),
                          ("optim.min_lr=inf", "optim.min_lr"), ("optim.min_lr=0.1", "optim.min_lr"),  # above lr
                          ("data.val_fraction=0.00001", "model.seq_len"),  # a held-out text shorter than a window
                          ("data.batch_size=100000", "data.batch_size"),  # a text shorter than one batch
                          # more float32 weights than any machine's memory: building it ran for hours
                          ("model.layers=1000000000", "model.layers"),
                          ("model.width=10000000", "model.width")):  # fmt: skip
        trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", override, "precision.opt_level=auto"])
        with pytest.raises(ampkit.ConfigError, match=f"'{key}'"):  # before the auto precision times anything
            trainer_class(cfg)
    assert (
        Path(ampkit.config.builtin_configs()["gpt"]).read_text()
        == (Path(__file__).resolve().parents[2] / "configs" / "gpt.yaml").read_text()
    )


def test_a_bare_omegaconf_config_or_a_path_is_taken_or_refused_as_the_trainer_does():
    """OmegaConf.create({...}) (no defaults merged) failed the recipe's checks with "'>=' not supported between
    NoneType and int", and a YAML path with OmegaConf's "Invalid input"; the Trainer itself merges the one and names
    the other."""
    import ampkit
    from ampkit.examples.gpt import GPTTrainer

    with pytest.raises(ampkit.ConfigError, match=r"config key 'model.layers': 0 is invalid; expected an integer >= 1"):
        GPTTrainer(OmegaConf.create({"model": {"layers": 0}}))
    assert GPTTrainer(OmegaConf.create({"model": {"layers": 2}, "trainer": {"device": "cpu"}})).cfg.model.width == 128
    with pytest.raises(ampkit.ConfigError, match=r"GPTTrainer\(cfg=...\): got str 'configs/gpt.yaml'; expected a dict"):
        GPTTrainer("configs/gpt.yaml")


def test_validation_windows_are_the_same_on_any_world_size_at_one_global_batch():
    """Two ranks x batch 4 train as one process x batch 8; they validated on half its windows (val_batches *
    batch_size), so the same model reported another val/loss, and a resume on another world size ranked best-k
    checkpoints on another set. The set is val_batches global batches, each rank validating its share."""
    from ampkit.trainer.distributed import DistributedEnv

    def windows(batch_size: int, world_size: int, accumulate: int = 1) -> Windows:
        overrides = [f"data.batch_size={batch_size}", f"trainer.accumulate_grad_batches={accumulate}"]
        trainer_class, cfg = load_config("gpt", [*TINY, *overrides])
        trainer = trainer_class(cfg)
        trainer.dist = DistributedEnv(rank=0, world_size=world_size)
        return trainer.val_dataloader().dataset

    one, two = windows(8, 1), windows(4, 2)
    # Two ranks resumed on one keep their global batch by accumulating: it validated on half the windows, so the
    # val/loss curve jumped at the resume and best-k checkpoints were ranked on another set.
    accumulated = windows(4, 1, accumulate=2)
    assert len(one) == len(two) == len(accumulated) == 16
    assert all(torch.equal(one[i][0], two[i][0]) for i in range(len(one)))
    assert all(torch.equal(one[i][0], accumulated[i][0]) for i in range(len(one)))


@pytest.mark.parametrize(
    ("bf16_faster", "said"),
    [
        (False, "precision.opt_level=auto chose O0, which trains in float32, with no loss scaler, so this run does "
                "not read "
                "precision.init_scale=1024.0, precision.growth_factor=3.0"),
        (True, "bfloat16 has no loss scaler unless precision.loss_scale asks for one, so this run does not read "
               "precision.init_scale=1024.0, precision.growth_factor=3.0"),
    ],
)  # fmt: skip
def test_keys_written_beside_auto_that_its_choice_leaves_unread_are_named_at_fit_start(
    tmp_path, monkeypatch, bf16_faster, said
):
    """auto's float32 (O0) or bf16 (no scaler) leaves a loss scaler's knobs unread, as the level named would: the
    keys written beside auto were named only for an explicit O0."""
    import ampkit.examples.gpt as gpt

    monkeypatch.setattr(gpt, "faster_cpu_precision", lambda *args, **kwargs: (bf16_faster, "timed"))
    trainer_class, cfg = load_config("gpt", [*TINY, f"run_dir={tmp_path}", "precision.opt_level=auto",
                                             "precision.growth_factor=3", "precision.init_scale=1024",
                                             "trainer.max_steps=1", "trainer.val_every_n_steps=0",
                                             "checkpoint.enabled=false", "generate.every_n_steps=0",
                                             "logging.tensorboard=false"])  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        trainer_class(cfg).fit()
    assert [str(w.message) for w in caught if "does not read" in str(w.message)] == [said]
