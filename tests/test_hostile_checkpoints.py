"""Files handed to ``fit(resume=...)``, ``validate(ckpt=...)`` and ``load_model`` that are no usable ampkit
checkpoint: a bare state_dict, a Lightning ``.ckpt``, an Apex-era script's dict, NaN weights, damaged entries.
Each is refused naming the file, what it holds and how to use its weights, and the run directory is left as it
was."""

from __future__ import annotations

import os
import re

import pytest
import torch
from torn_checkpoint import tear
from toy_trainers import ToyTrainer, toy_cfg

from ampkit import consolidate_checkpoint
from ampkit.config import ConfigError
from ampkit.trainer.checkpoint_io import CheckpointError, DamagedCheckpointError, damaged_record, load_checkpoint
from ampkit.trainer.inference import load_model
from ampkit.trainer.run_life import load_with_fallback_hint
from ampkit.trainer.sharded_checkpoint import SHARD_CRCS

QUIET = {"logging.tensorboard": False, "trainer.progress_bar": False, "logging.throughput": False}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run's last.pt, and its model's weights."""
    tmp_path = tmp_path_factory.mktemp("trained")
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    trainer.fit()
    return trainer.version_dir / "checkpoints" / "last.pt", trainer.module.state_dict()


def _lightning(weights, last):
    return {"epoch": 0, "global_step": 2, "pytorch-lightning_version": "2.6.6", "optimizer_states": [],
            "state_dict": {f"model.{k}": v for k, v in weights.items()}}  # fmt: skip


def _apex(weights, last):
    return {"model": weights, "optimizer": {}, "amp": {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 3}}}


def _nan_weights(weights, last):
    checkpoint = load_checkpoint(last)
    checkpoint["model"]["3.bias"].fill_(float("nan"))
    return checkpoint


def _damaged(**entries):
    def content(weights, last):
        checkpoint = load_checkpoint(last)
        for key, value in entries.items():
            if value is None:
                del checkpoint[key]
            else:
                checkpoint[key] = value
        return checkpoint

    return content


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (lambda weights, last: weights, r"it is a bare state_dict of 4 tensors \(torch.save\(model.state_dict\(\)\)\)"),
        (
            lambda weights, last: {f"module.{k}": v for k, v in weights.items()},
            r"bare state_dict of 4 tensors .*taking the 'module.' prefix of a DDP wrapper off its keys",
        ),
        (
            lambda weights, last: {"3.bias": weights["3.bias"]},  # one layer's saved alone: '1 tensors' read
            r"it is a bare state_dict of 1 tensor \(torch.save",
        ),
        (_lightning, r"it is a Lightning checkpoint \(Lightning 2.6.6\), whose weights are under 'state_dict'"),
        (_apex, r"it is an Apex-era training script's checkpoint \(keys 'model', 'optimizer', 'amp'; 'amp' holds"),
        (lambda weights, last: torch.zeros(3), r"it holds a tensor of shape \(3,\), not a dict"),
        (_nan_weights, r"holds non-finite model weights \(3.bias holds NaN/inf\): a diverged model"),
        (_damaged(model=[1, 2]), r"has a 'model' entry of type list; expected the model's state_dict"),
        (_damaged(ampkit_checkpoint="1"), r"has checkpoint format '1'; ampkit writes a whole number"),
    ],
    ids=[
        "state_dict",
        "ddp state_dict",
        "one tensor",
        "lightning",
        "apex",
        "tensor",
        "nan weights",
        "model a list",
        "format a str",
    ],  # fmt: skip
)
@pytest.mark.parametrize("use", ["resume", "validate", "load_model"])
def test_a_file_that_is_no_usable_checkpoint_is_refused_saying_what_it_holds(tmp_path, trained, use, content, message):
    last, weights = trained
    path = tmp_path / "given.ckpt"
    torch.save(content(weights, last), path)
    run = tmp_path / "run"
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4}))
    with pytest.raises(CheckpointError, match=re.escape(f"'{path}'")) as error:
        if use == "resume":
            trainer.fit(resume=path)
        elif use == "validate":
            trainer.validate(ckpt=path)
        else:
            load_model(path, trainer_class=ToyTrainer)
    assert error.match(message)
    if "not an ampkit checkpoint" in str(error.value):
        assert error.match(r"to use its weights, load them in configure_model|not a dict")
    assert not [p for p in run.rglob("*") if p.is_file() and p.suffix in (".pt", ".yaml")]


def test_load_model_of_a_checkpoint_without_weights_says_so(tmp_path, trained):
    last, weights = trained
    path = tmp_path / "no_model.pt"
    torch.save(_damaged(model=None)(weights, last), path)
    with pytest.raises(CheckpointError, match=rf"checkpoint '{path}' has no 'model' entry: it holds no weights"):
        load_model(path, trainer_class=ToyTrainer)


def test_load_model_takes_a_sharded_checkpoint_directory_as_validate_does(tmp_path, monkeypatch):
    """An FSDP run saves directories: load_model said 'no checkpoint file' of them, where the user meant its model.
    Its trainer.pt is read once (its config, then the shard files' CRC-32s): the consolidation loaded it again."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2, "distributed.strategy": "fsdp"}))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    real_load, loads = torch.load, []

    def load(file, *args, **kwargs):
        if getattr(file, "name", None) == str(checkpoints / "step-00000002" / "trainer.pt"):
            loads.append(file)
        return real_load(file, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(torch, "load", load)
        model = load_model(checkpoints / "step-00000002", trainer_class=ToyTrainer)
    assert len(loads) == 1
    saved = consolidate_checkpoint(checkpoints / "step-00000002")
    assert model.state_dict().keys() == saved.keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, saved[key]), key
    with pytest.raises(CheckpointError, match=re.escape(f"'{trainer.version_dir}' is a directory, not a checkpoint")):
        load_model(trainer.version_dir, trainer_class=ToyTrainer)


@pytest.mark.parametrize(
    "loop",
    [{"epoch": 0, "batches_done": 2, "global_step": "2"}, {"epoch": 0, "batches_done": 0, "global_step": -5}, [0, 2]],
    ids=["step a str", "step negative", "a list"],
)
def test_a_resume_refuses_a_loop_position_that_is_no_count(tmp_path, trained, loop):
    """A string step failed deep in the limit checks as a bare TypeError, and a negative one resumed before the
    start; either is a file edited or written by other code."""
    last, weights = trained
    path = tmp_path / "edited.pt"
    torch.save(_damaged(loop=loop)(weights, last), path)
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4}))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint '{path}' has a loop position ")):
        trainer.fit(resume=path)


def _sharded_with_nan(source, target):
    """A copy of sharded checkpoint ``source`` at ``target`` whose first model weight holds a NaN, written by other
    code than ampkit's save."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save, torch_save_to_dcp

    whole = target.parent / "whole.pt"
    dcp_to_torch_save(source, whole)
    state = torch.load(whole, weights_only=False)
    next(v for v in state["model"].values() if v.is_floating_point()).view(-1)[0] = float("nan")
    torch.save(state, whole)
    torch_save_to_dcp(whole, target)
    trainer_part = load_checkpoint(source / "trainer.pt")
    del trainer_part[SHARD_CRCS]  # its shard files are others: as an older ampkit's, it records none to check
    torch.save(trainer_part, target / "trainer.pt")


@pytest.mark.parametrize("sharded_run", [True, False], ids=["into fsdp", "consolidated"])
def test_evaluating_a_sharded_checkpoint_with_nan_weights_is_refused(tmp_path, sharded_run):
    """validate(ckpt=) of a sharded directory loaded its shards (straight into an FSDP model, or consolidated into a
    plain one) without the finite check a .pt file gets, and evaluated NaN."""
    cfg = {"trainer.max_steps": 2, "distributed.strategy": "fsdp"}
    trainer = ToyTrainer(toy_cfg(tmp_path / "saved", **QUIET, **cfg))
    trainer.fit()
    damaged = tmp_path / "damaged"
    _sharded_with_nan(trainer.version_dir / "checkpoints" / "step-00000002", damaged)
    evaluator = ToyTrainer(toy_cfg(tmp_path / "eval", **QUIET, **(cfg if sharded_run else {})))
    with pytest.raises(CheckpointError, match=re.escape(f"checkpoint '{damaged}' holds non-finite model weights")):
        evaluator.validate(ckpt=damaged)


def test_load_model_of_last_or_best_without_a_run_here_names_where_it_looked(tmp_path, trained, monkeypatch):
    """'last' resolves among the runs under the current directory: with none there it was a bare TypeError; and a
    run_dir handed over names its newest run's last checkpoint as the one to pass."""
    monkeypatch.chdir(tmp_path)
    for name in ("last", "best"):
        with pytest.raises(CheckpointError, match=rf"load_model\('{name}'\): no run under the current directory"):
            load_model(name, trainer_class=ToyTrainer)
    last, _ = trained
    run_dir = last.parents[2]
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"is a directory, not a checkpoint: pass a checkpoint file in it (e.g. '{last}')"),
    ):
        load_model(run_dir, trainer_class=ToyTrainer)
    monkeypatch.chdir(run_dir)
    assert isinstance(load_model("last", trainer_class=ToyTrainer), torch.nn.Module)


def test_a_damaged_copy_is_found_by_its_records_crcs_which_torch_load_does_not_check(tmp_path, trained):
    """A copy torn in a tensor's bytes loads through torch.load without an error, with other values (it checks no
    CRC-32), and its zip directory is the whole file's; a copy cut short has no directory. Whole files, and the
    legacy format (no CRCs to check), pass. load_checkpoint refuses the torn copy, naming its record."""
    last, _ = trained
    torn = tmp_path / "torn.pt"
    record = tear(last, torn)
    assert torch.load(torn, weights_only=True)["loop"] == load_checkpoint(last)["loop"]  # torch.load takes it
    name = record.partition("/")[2]
    assert damaged_record(torn) == f"its record '{name}' is not as written (BadZipFile: Bad CRC-32 for file " \
        f"'{record}')"  # fmt: skip
    with pytest.raises(DamagedCheckpointError, match=re.escape(f"checkpoint '{torn}' is damaged: its record '{name}'")):
        load_checkpoint(torn)
    cut = tmp_path / "cut.pt"
    cut.write_bytes(last.read_bytes()[: last.stat().st_size // 2])
    assert damaged_record(cut).startswith("its zip archive's directory cannot be read, so the file was cut short")
    legacy = tmp_path / "legacy.pt"
    torch.save({"a": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    assert damaged_record(last) is damaged_record(legacy) is damaged_record(tmp_path / "absent.pt") is None


@pytest.mark.parametrize("use", ["resume", "validate", "load_model"])
def test_a_torn_last_pt_is_refused_in_one_process_naming_its_record_and_the_newest_whole_file(tmp_path, use):
    """A single process loaded a copy torn in a tensor's bytes without a word (torch.load checks no CRC-32) and
    trained or evaluated other weights. Each load reads its records against their CRC-32s, and the way back skips
    a newest step file torn too."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 6, "checkpoint.every_n_steps": 2}))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    last = checkpoints / "last.pt"
    record = tear(checkpoints / "step-00000006.pt", last)
    tear(checkpoints / "step-00000006.pt", checkpoints / "step-00000006.pt")
    resumed = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 8, "checkpoint.every_n_steps": 2}))
    with pytest.raises(DamagedCheckpointError) as error:
        if use == "resume":
            resumed.fit(resume="last")
        elif use == "validate":
            resumed.validate(ckpt="last")
        else:
            load_model(last, trainer_class=ToyTrainer)
    assert error.match(re.escape(f"checkpoint '{last}' is damaged: its record '{record.partition('/')[2]}' is not"))
    assert error.match(re.escape(f"the newest whole checkpoint beside it is '{checkpoints / 'step-00000004.pt'}'"))
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["version_0"]  # nothing written: no version_1


@pytest.mark.parametrize("use", ["resume", "validate into fsdp", "validate consolidated"])
def test_a_sharded_checkpoint_torn_in_a_shard_is_refused_naming_the_shard_file(tmp_path, use):
    """DCP keeps no checksum, and a shard file torn in a tensor's bytes (its layout intact) loaded without an error,
    with other weights. The CRC-32 of each shard file, recorded in trainer.pt at the save, is checked at the load."""
    sharded = {**QUIET, "distributed.strategy": "fsdp", "trainer.max_steps": 2}
    trainer = ToyTrainer(toy_cfg(tmp_path, **sharded))
    trainer.fit()
    last = (trainer.version_dir / "checkpoints" / "last").resolve()
    weight = consolidate_checkpoint(last)["0.weight"].numpy().tobytes()
    shard = next(f for f in last.glob("*.distcp") if weight in f.read_bytes())
    data = shard.read_bytes()
    start = data.index(weight)
    shard.write_bytes(data[:start] + bytes(len(weight)) + data[start + len(weight) :])
    named = rf"sharded checkpoint '{last.parent}/(last|{last.name})': shard file\(s\) {shard.name} are not as written"
    with pytest.raises(CheckpointError, match=named):
        if use == "resume":
            ToyTrainer(toy_cfg(tmp_path, **{**sharded, "trainer.max_steps": 4})).fit(resume="last")
        elif use == "validate into fsdp":
            ToyTrainer(toy_cfg(tmp_path / "eval", **sharded)).validate(ckpt=last)
        else:
            ToyTrainer(toy_cfg(tmp_path / "eval", **QUIET)).validate(ckpt=last)


@pytest.mark.parametrize(
    ("given", "named"),
    [(10**5000, "an integer of 5001 digits, of type int"), (list(range(10**6)), "[0, 1, 2, 3, ")],
    ids=["5001 digits", "a million items"],
)
def test_a_checkpoint_given_as_a_huge_non_path_is_named_by_its_start_and_length(tmp_path, given, named):
    """repr() of an integer of 5001 digits raised its own ValueError, and a list was repeated whole."""
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET))
    with pytest.raises(TypeError, match=f"^the checkpoint given is {re.escape(named)}") as err:
        trainer.validate(ckpt=given)
    assert len(str(err.value)) < 400


@pytest.mark.parametrize("given", [True, 5, b"last"], ids=["True", "an int", "bytes"])
@pytest.mark.parametrize("call", ["fit", "validate", "predict", "load_model"])
def test_a_checkpoint_given_as_no_path_names_its_type_and_writes_nothing(tmp_path, trained, monkeypatch, call, given):
    """str() of it was taken as a file name: fit(resume=True) looked for a file 'True', and resume=5 resumed
    whatever run './5' held."""
    monkeypatch.chdir(tmp_path)
    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 2}))
    run = {"fit": lambda: trainer.fit(resume=given), "validate": lambda: trainer.validate(ckpt=given),
           "predict": lambda: trainer.predict(ckpt=given),
           "load_model": lambda: load_model(given, trainer_class=ToyTrainer)}[call]  # fmt: skip
    expected = rf"the checkpoint given is {re.escape(repr(given))}, of type {type(given).__name__}; expected a path"
    with pytest.raises(TypeError, match=expected):
        run()
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("device", "message"),
    [("gpu", "'gpu' is not a device; use auto, cpu, cuda or cuda:N"), (5, "5 is not a device; use auto, cpu, cuda")]
    + [("cuda:0", "'cuda:0' requested but CUDA is not available; use auto or cpu")] * (not torch.cuda.is_available()),
)
def test_load_model_to_a_device_there_is_not_names_the_argument_before_reading_the_checkpoint(
    tmp_path, monkeypatch, device, message
):
    """torch's own error came once the checkpoint was read and the model built: 'Expected one of cpu, cuda, ipu, xpu,
    ... device type at start of device string: gpu', or an AssertionError 'Torch not compiled with CUDA enabled'."""
    monkeypatch.setattr("ampkit.trainer.inference.resolve_checkpoint", lambda *args: pytest.fail("read a checkpoint"))
    with pytest.raises(ConfigError, match=re.escape(f"load_model(device=...): {message}")):
        load_model("runs/version_0/checkpoints/last.pt", trainer_class=ToyTrainer, device=device)


def test_a_distributed_evaluation_of_a_torn_rank_zero_copy_names_the_newest_whole_file_as_one_process_does(
    tmp_path, monkeypatch
):
    """Under torchrun, validate/test/predict with rank 0's copy torn named the damaged record only; a single process
    names the newest whole checkpoint beside it too. Rank 1 (whole copy) is played by the gather's answer."""
    from ampkit.trainer import agreed_start
    from ampkit.trainer.distributed import DistributedEnv

    trainer = ToyTrainer(toy_cfg(tmp_path, **QUIET, **{"trainer.max_steps": 4, "checkpoint.every_n_steps": 2}))
    trainer.fit()
    checkpoints = trainer.version_dir / "checkpoints"
    last = checkpoints / "last.pt"
    tear(checkpoints / "step-00000004.pt", last)
    tear(checkpoints / "step-00000004.pt", checkpoints / "step-00000004.pt")
    with pytest.raises(DamagedCheckpointError) as alone:
        load_with_fallback_hint(last)
    whole = f"the newest whole checkpoint beside it is '{checkpoints / 'step-00000002.pt'}'"
    assert whole in str(alone.value)

    def gather(mine, env):
        return [mine, ("n2", *[None] * (len(mine) - 1))]  # rank 1 found nothing wrong

    monkeypatch.setattr(agreed_start, "gather_object", gather)
    monkeypatch.setattr(agreed_start, "decided_by_rank_zero", lambda decide, env: decide())
    with pytest.raises(CheckpointError) as raised:
        agreed_start.agreed_checkpoint(lambda: last, DistributedEnv(0, 2), "run", "validate: loading")
    message = str(raised.value)
    assert "rank 0 (host " in message and ") has a damaged copy: its record 'data/" in message, message
    assert message.endswith(f"or resume an older checkpoint; {whole}. Nothing was trained or written"), message


@pytest.mark.parametrize("sharded", [False, True], ids=["file", "fsdp"])
def test_the_other_ranks_are_checked_against_the_checkpoint_rank_zero_read_not_one_put_at_its_path_since(
    tmp_path, monkeypatch, sharded
):
    """Rank 0 planned a resume from one reading of the checkpoint and fingerprinted the file for the other ranks in a
    second: a file put at its path between the two was what they were checked against and loaded, while rank 0 held
    the first. The view rank 0 sends is of what its plan read. Rank 1 is played in this process with rank 0's answer;
    validate's rank 0 checks its own load against the view it sent."""
    from ampkit.trainer import agreed_start
    from ampkit.trainer.distributed import DistributedEnv
    from ampkit.trainer.run_life import plan_fit

    settings = {**QUIET, "trainer.max_steps": 4, "checkpoint.every_n_steps": 2}
    settings.update({"distributed.strategy": "fsdp"} if sharded else {})
    ToyTrainer(toy_cfg(tmp_path, **settings)).fit()
    checkpoints = tmp_path / "run" / "version_0" / "checkpoints"
    path, older = (checkpoints / f"step-0000000{step}{'' if sharded else '.pt'}" for step in (4, 2))
    part, older_part = (p / "trainer.pt" if sharded else p for p in (path, older))
    kept = part.read_bytes()
    cfg = ToyTrainer(toy_cfg(tmp_path, **{**settings, "trainer.max_steps": 6})).cfg

    def replace_it() -> None:  # as a copy does: the whole file renamed into place
        (tmp_path / "new").write_bytes(older_part.read_bytes())
        (tmp_path / "new").replace(part)

    def plan():
        start = plan_fit(tmp_path / "run", str(path), path, cfg)
        replace_it()  # after the plan read it, before anything else
        return start

    answers = []
    monkeypatch.setattr(
        agreed_start, "decided_by_rank_zero", lambda decide, env: answers.append(decide()) or answers[0]
    )
    monkeypatch.setattr(agreed_start, "gather_object", lambda mine, env: [mine, ("n2", None, None, None)])
    start = agreed_start.agreed_fit_start(plan, DistributedEnv(0, 2), "run")
    assert start.loop["global_step"] == 4
    monkeypatch.setattr(agreed_start, "decided_by_rank_zero", lambda decide, env: answers[0])  # rank 1
    monkeypatch.setattr(agreed_start, "gather_object", lambda mine, env: [("n1", None, None, None), mine])
    with pytest.raises(CheckpointError, match=r"\(epoch \d+, step 4 on rank 0\): rank 1 \(host .*\) has another "):
        agreed_start.agreed_fit_start(lambda: pytest.fail("rank 1 planned"), DistributedEnv(1, 2), "run")

    part.write_bytes(kept)
    monkeypatch.setattr(agreed_start, "decided_by_rank_zero", lambda decide, env: (decide(), replace_it())[0])
    monkeypatch.setattr(agreed_start, "gather_object", lambda mine, env: [mine, ("n2", None, None, None)])
    replaced = r"\) read another file there than the one it showed the others \(replaced meanwhile\): run it again\. "
    with pytest.raises(CheckpointError, match=rf"rank 0 \(host .*{replaced}Nothing was trained or written$"):
        agreed_start.agreed_checkpoint(lambda: path, DistributedEnv(0, 2), "run", "validate: loading")


def test_load_fingerprinted_digests_the_file_it_loaded_not_one_put_at_its_path_meanwhile(tmp_path, monkeypatch):
    """The digest the other ranks' copies are checked against is of the file rank zero loaded: read again by path, a
    newer save put there during the load gave the digest of a file no rank had loaded."""
    from ampkit.trainer.checkpoint_io import FORMAT_KEY, file_fingerprint, load_fingerprinted

    loaded, newer = tmp_path / "last.pt", tmp_path / ".last.pt.tmp"
    torch.save({FORMAT_KEY: 1, "loop": {"global_step": 4}, "w": torch.ones(8)}, loaded)
    torch.save({FORMAT_KEY: 1, "loop": {"global_step": 6}, "w": torch.zeros(8)}, newer)
    expected, other = file_fingerprint(loaded), file_fingerprint(newer)
    load = torch.load

    def load_then_replace(*args, **kwargs):
        checkpoint = load(*args, **kwargs)
        os.replace(newer, loaded)  # a save moved into place while the load ran
        return checkpoint

    monkeypatch.setattr(torch, "load", load_then_replace)
    checkpoint, fingerprint = load_fingerprinted(loaded)
    assert checkpoint["loop"]["global_step"] == 4
    assert fingerprint == expected != other


def test_a_legacy_format_checkpoint_is_fingerprinted_by_every_byte(tmp_path):
    """A file of torch's pre-zip format holds no archive to read record by record: its digest is of all its bytes,
    read from its start (after the zip reader has moved through it), so two such files of other values differ."""
    from ampkit.trainer.checkpoint_io import file_fingerprint

    one, other = tmp_path / "one.pt", tmp_path / "other.pt"
    torch.save({"w": torch.ones(4)}, one, _use_new_zipfile_serialization=False)
    torch.save({"w": torch.zeros(4)}, other, _use_new_zipfile_serialization=False)
    assert file_fingerprint(one) != file_fingerprint(other)
    (tmp_path / "copy.pt").write_bytes(one.read_bytes())
    assert file_fingerprint(one) == file_fingerprint(tmp_path / "copy.pt")


def test_a_sharded_copy_that_fails_part_way_leaves_neither_its_temp_folder_nor_a_partial_copy(tmp_path, monkeypatch):
    """A best-k alias of a sharded checkpoint is copied file by file into a temp folder: a full disk part way left
    that folder, its shards' worth of space held until the next run."""
    import errno

    from ampkit.trainer import sharded_checkpoint

    source = tmp_path / "step-00000004"
    source.mkdir()
    for name in (".metadata", "__0_0.distcp", "trainer.pt"):
        (source / name).write_bytes(b"x" * 64)
    copy = sharded_checkpoint.copy_atomic
    copied = []

    def fills_the_disk(src, dst):
        if copied:
            raise OSError(errno.ENOSPC, "No space left on device")
        copied.append(copy(src, dst))

    monkeypatch.setattr(sharded_checkpoint, "copy_atomic", fills_the_disk)
    with pytest.raises(OSError, match="No space left on device"):
        sharded_checkpoint.copy_sharded(source, tmp_path / "best-00000004")
    assert copied and sorted(p.name for p in tmp_path.iterdir()) == ["step-00000004"]
