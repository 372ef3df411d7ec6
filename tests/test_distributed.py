"""Two gloo ranks on CPU, launched the way torchrun launches them (RANK/WORLD_SIZE/MASTER_* env vars), each forked
from a process that has imported torch already (tests/rank_forkserver.py), so a launch costs no import."""

from __future__ import annotations

import errno
import re
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from checkpoint_compare import assert_same_checkpoint
from child_env import child_env
from omegaconf import OmegaConf
from rank_forkserver import ForkedPython
from torch import nn
from torch.utils.data import DataLoader
from toy_trainers import ToyTrainer, toy_dataset

import ampkit
from ampkit.trainer.checkpoint_io import CheckpointError, load_checkpoint

TESTS = Path(__file__).resolve().parent
WORKER = TESTS / "dist_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(scenario: str, out: Path, extra_env: dict | None = None, timeout: float = 180) -> list:
    port = _free_port()
    out.mkdir(parents=True, exist_ok=True)
    procs = []
    for rank in range(2):
        ranks = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2"}
        rendezvous = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        env = child_env(TESTS, TESTS.parent, **ranks, **rendezvous, **(extra_env or {}))
        procs.append(ForkedPython([sys.executable, str(WORKER), scenario, str(out)], env=env))
    results = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return results


def _ok(results) -> list[dict]:
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return [torch.load(Path(r.args[3]) / f"rank{i}.pt", weights_only=True) for i, r in enumerate(results)]


def _equal(a: dict, b: dict) -> None:
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("scenario", ["ddp", "ddp_accumulate"])
def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(tmp_path, scenario):
    rank0, rank1 = _ok(launch(scenario, tmp_path))
    _equal(rank0["model"], rank1["model"])
    from dist_worker import Plain

    accumulate = 2 if scenario == "ddp_accumulate" else 1
    single = Plain({"trainer_class": "x:y", "run_dir": str(tmp_path / "single"), "data": {"batch_size": 8},
                    "logging": {"tensorboard": False}, "checkpoint": {"enabled": False},
                    "trainer": {"max_epochs": 2, "accumulate_grad_batches": accumulate, "device": "cpu"}})  # fmt: skip
    single.fit()
    for key, value in single.module.state_dict().items():
        torch.testing.assert_close(rank0["model"][key], value, rtol=1e-5, atol=1e-6)
    assert rank0["val"]["mse"] == pytest.approx(single.val_metrics["mse"], rel=1e-5)


def test_a_loss_of_the_bare_module_under_ddp_is_refused_on_every_rank(tmp_path):
    """self.module's forward bypasses DDP: its backward averages nothing, and each rank trained its own model."""
    for result in launch("bare_module", tmp_path):
        assert result.returncode != 0
        assert "training_step's loss did not come from self.model: under DDP only self.model" in result.stderr


@pytest.mark.parametrize(
    "scenario",
    [
        "ddp_unfreeze",
        "ddp_unfreeze_fp16",
        "ddp_unfreeze_o2",
        "ddp_unfreeze_between_fp16",
        "ddp_unfreeze_between_o2",
        "ddp_unfreeze_refreeze_between_o2",
    ],
)
def test_a_layer_unfrozen_after_ddp_wrapped_the_model_is_averaged_across_ranks(tmp_path, scenario):
    """DDP's reducer averages only the parameters trainable when it wrapped the model: a layer unfrozen at epoch 1
    trained on each rank's own gradients, and the ranks drifted apart without a word. Under O2 the layer gets its fp32
    master when it is unfrozen: the master's gradient is averaged. ``_between_``: unfrozen between the two backwards of
    an iteration, its gradients of the second were averaged from the next iteration on only; ``_refreeze_``:
    frozen again there, its gradients of the first still are."""
    rank0, rank1 = _ok(launch(scenario, tmp_path))
    _equal(rank0["model"], rank1["model"])
    from dist_worker import UNFREEZE_PRECISION, unfreeze_run

    precision, (trainer_class, options) = UNFREEZE_PRECISION[scenario], unfreeze_run(scenario)
    options = {"max_epochs": 2, "device": "cpu", **options}
    single = trainer_class({"trainer_class": "x:y", "run_dir": str(tmp_path / "single"), "data": {"batch_size": 8},
                            "logging": {"tensorboard": False}, "checkpoint": {"enabled": False},
                            "trainer": options, "precision": precision})  # fmt: skip
    single.fit()
    tolerance = 2e-2 if precision else 1e-5  # float16: equal up to its rounding
    for key, value in single.module.state_dict().items():
        torch.testing.assert_close(rank0["model"][key], value, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("scenario", ["ddp_accumulate_fp16", "ddp_accumulate_o2"])
def test_accumulating_with_loss_scaling_or_masters_keeps_ranks_identical_and_equal_to_one_process(tmp_path, scenario):
    """Loss scaling and fp32 masters take each backward's gradients out of ``.grad``; DDP must then average every
    micro-batch, or only the last one is averaged and each rank adds its own earlier ones back (the ranks had
    drifted apart at the first step)."""
    rank0, rank1 = _ok(launch(scenario, tmp_path))
    _equal(rank0["model"], rank1["model"])
    from dist_worker import Plain

    precision = {"opt_level": "O1", "dtype": "float16", "init_scale": 256.0}
    if scenario == "ddp_accumulate_o2":
        precision = {"opt_level": "O2", "dtype": "bfloat16"}
    single = Plain({"trainer_class": "x:y", "run_dir": str(tmp_path / "single"), "data": {"batch_size": 8},
                    "logging": {"tensorboard": False}, "checkpoint": {"enabled": False}, "precision": precision,
                    "trainer": {"max_epochs": 2, "accumulate_grad_batches": 2, "device": "cpu"}})  # fmt: skip
    single.fit()
    for key, value in single.module.state_dict().items():  # equal up to the low precision's rounding
        torch.testing.assert_close(rank0["model"][key].float(), value.float(), rtol=2e-2, atol=2e-2)


def test_step_sync_gives_every_forward_rank_0s_buffers_as_ddp_does(tmp_path):
    """``grad_sync: step`` has no DDP to broadcast buffers before each forward: it does so itself, so BatchNorm
    statistics do not drift apart between ranks (they had, each rank updating its own from its own batches)."""
    rank0, rank1 = _ok(launch("step_buffers", tmp_path))
    assert len(rank0["buffers"]) == len(rank1["buffers"]) == 3
    for mine, theirs in zip(rank1["buffers"], rank0["buffers"], strict=True):
        _equal(mine, theirs)
    assert not torch.equal(rank0["buffers"][1]["1.running_mean"], rank0["buffers"][0]["1.running_mean"])


def test_a_layer_only_one_rank_reaches_is_averaged_by_the_step_sync_on_every_rank(tmp_path):
    """``grad_sync: step`` all-reduced the gradients each rank had: with a routed expert only rank 1 reached, the
    ranks sent buffers of different sizes. Every optimizer parameter now takes part (a zero where a rank has no
    gradient), as DDP does: the expert gets rank 1's gradient over two on both ranks, and the ranks stay equal."""
    rank0, rank1 = _ok(launch("expert_on_rank_1", tmp_path))
    _equal(rank0["model"], rank1["model"])
    assert not torch.equal(rank0["model"]["expert.weight"], rank0["initial_expert"])  # trained on rank 0 too


def test_validate_and_predict_on_two_ranks_shard_the_data_and_agree_with_one_process(tmp_path):
    from dist_worker import Evaluated

    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu"}}  # fmt: skip
    single = Evaluated(cfg)
    single.fit()
    expected_val = single.validate()
    expected_predictions = torch.cat(single.predict())
    results = launch("evaluate", tmp_path)
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{i}.pt", weights_only=True) for i in range(2)]
    for rank in ranks:
        assert rank["val"]["mse"] == pytest.approx(expected_val["mse"], rel=1e-6)
    shards = [torch.load(tmp_path / f"predictions.rank{i}.pt", weights_only=True) for i in range(2)]
    assert [torch.cat(shard).shape[0] for shard in shards] == [12, 12]
    torch.testing.assert_close(torch.cat(ranks[1]["predictions"]), torch.cat(shards[1]))
    interleaved = torch.stack([torch.cat(shards[0]), torch.cat(shards[1])], dim=1).reshape(-1, 1)
    torch.testing.assert_close(interleaved, expected_predictions)  # DistributedSampler deals rank = index % 2


def test_fit_then_validate_and_predict_in_one_script_each_get_a_working_process_group(tmp_path):
    """Each run's new process group met the one before's rendezvous keys: a rank connected to a stale address and
    the other hung in set-up (2 of 3 runs under torchrun; here always, as rank 0 is slowed down)."""
    rank0, rank1 = _ok(launch("fit_then_evaluate", tmp_path, timeout=120))
    assert rank0["runs"] == rank1["runs"]
    assert rank0["runs"][0] == 2  # 12 of the 24 samples: batches of 8 and 4


def test_validate_called_from_a_hook_of_a_fit_leaves_the_fit_its_process_group(tmp_path):
    """validate() inside a fit's hook took the fit's process group as one it did not own: the fit then ended without
    its closing barrier and left the group behind, initialised, for the script's next run to adopt."""
    rank0, rank1 = _ok(launch("validate_in_a_hook", tmp_path, timeout=120))
    assert rank0["left"] and rank1["left"]
    assert rank0["hook"] == rank1["hook"] == rank0["after"]  # the final weights, validated within and after the fit


def test_a_stop_asked_on_some_ranks_stops_every_rank_at_one_step_with_one_checkpoint(tmp_path):
    """``state.should_stop`` set on one rank only left the other waiting in its next collective until
    ``distributed.timeout_s``, then failing. The ranks agree on it where they meet anyway: in the next iteration's
    collective of loss facts, so a stop asked after step 3 takes effect at 4, mid-epoch (8 batches), not at the next
    iteration that logs (every 100 here) or validates (step 6, where it waited before); after a validation, so early
    stopping takes effect at once (at the second validation, step 6)."""
    results = launch("stop", tmp_path, timeout=120)
    rank0, rank1 = _ok(results)
    # rank 0 says where every rank stopped, also when its own rule asked (a step earlier)
    assert "ampkit: stopping every rank at step 4: rank 0: rank 0's rule" in results[0].stderr
    expected = {"rank 1": (4, "rank 1: rank 1's rule"), "rank 0": (4, "rank 0: rank 0's rule"),
                "both": (4, "rank 0: rank 0's rule; rank 1: rank 1's rule"),
                "validation rule on rank 1": (6, "rank 1: rank 1's validation rule"),
                "max_time on rank 1": (2, "rank 1: trainer.max_time=0.001s reached")}  # fmt: skip
    for name, (step, reason) in expected.items():
        ended, loop, stopped = rank0["runs"][name]
        assert ended == rank1["runs"][name][0] == step, name
        assert loop == {"epoch": 0, "batches_done": step, "global_step": step}, name
        assert stopped.startswith(reason), (name, stopped)
    # Asked in on_train_epoch_start on rank 1 alone: both ranks trained a step of that epoch (the one process trains
    # none) before the stop was agreed at its end. They agree as the epoch starts, and train none of it.
    ended, loop, stopped = rank0["runs"]["epoch start on rank 1"]
    assert ended == rank1["runs"]["epoch start on rank 1"][0] == 8
    assert loop["global_step"] == 8 and stopped.startswith("rank 1: rank 1's epoch rule"), (loop, stopped)


def test_a_callback_that_joins_collectives_on_rank_zero_alone_is_refused_on_every_rank_at_set_up(tmp_path):
    """Lightning's ``callbacks=[ModelCheckpoint()] if rank == 0 else []``: rank 0 waited in the checkpoint's first
    save (rank zero decides it) for a rank that never joined, until distributed.timeout_s (10 s here). Every rank now
    refuses it as callbacks are set up, naming it and the rank that lacks it; a plain logging callback on rank 0 alone
    takes part in no collective and trains as before, and so does a subclass of ModelCheckpoint on rank 0 beside a
    ModelCheckpoint on rank 1 (matched by name, it was refused though both take the same collectives)."""
    outcomes = [r for r in _ok(launch("callbacks_on_rank_zero", tmp_path, timeout=120))]
    for name in ("checkpoint", "early_stopping"):
        kind = {"checkpoint": "ModelCheckpoint", "early_stopping": "EarlyStopping"}[name]
        for rank, outcome in enumerate(outcomes):
            error, message, seconds = outcome[name]
            assert error == "CallbacksDifferAcrossRanksError", (rank, name, message)
            assert message.startswith(f"{kind} is given on rank(s) 0 but not on rank(s) 1: "), message
            assert "Give it on every rank" in message and "trainer.is_global_zero" in message, message
            assert seconds < 5, (rank, name, seconds)
    assert outcomes[0]["logging"][:2] == outcomes[1]["logging"][:2] == ("trained", 2)
    assert outcomes[0]["logging"][2] == [1, 2]
    assert outcomes[0]["subclass"] == outcomes[1]["subclass"] == ("trained", 2)


def test_collective_callbacks_that_differ_across_ranks_are_named_with_the_ranks_lacking_them(monkeypatch):
    """Three ranks: rank 2 has one of rank 0's and 1's two EarlyStoppings, rank 1 lacks the TensorBoardLogger; a plain
    callback on rank 0 alone is no collective's, and one process gathers nothing."""
    from ampkit.callbacks import EarlyStopping, TensorBoardLogger
    from ampkit.trainer import rank_callbacks
    from ampkit.trainer.distributed import DistributedEnv

    stoppers = [EarlyStopping("val/mse"), EarlyStopping("val/acc", "max")]
    ranks = [[*stoppers, TensorBoardLogger(), ampkit.Callback()], stoppers, [stoppers[0], TensorBoardLogger()]]
    gathered = [rank_callbacks.collective_callback_kinds(callbacks) for callbacks in ranks]
    monkeypatch.setattr(rank_callbacks, "gather_object", lambda value, env: gathered)
    with pytest.raises(rank_callbacks.CallbacksDifferAcrossRanksError) as refused:
        rank_callbacks.check_collective_callbacks_on_every_rank(ranks[0], DistributedEnv(rank=0, world_size=3))
    assert str(refused.value).startswith(
        "EarlyStopping is given 2 times on rank(s) 0, 1 but fewer times on rank(s) 2; TensorBoardLogger is given on "
        "rank(s) 0, 2 but not on rank(s) 1: these callbacks take part in collectives"
    )
    gathered = [gathered[0], [*gathered[0]], [*gathered[0]]]  # the plain callback on rank 0 alone is no one's concern
    rank_callbacks.check_collective_callbacks_on_every_rank([ampkit.Callback()], DistributedEnv(rank=1, world_size=3))
    monkeypatch.setattr(rank_callbacks, "gather_object", lambda value, env: pytest.fail("one process gathers"))
    rank_callbacks.check_collective_callbacks_on_every_rank(ranks[0], DistributedEnv())


def test_collective_callbacks_are_matched_across_ranks_by_the_class_whose_collectives_they_take(monkeypatch):
    """A subclass of ModelCheckpoint (or two differently named ones) lines up with a ModelCheckpoint on another rank:
    they take the same collectives. Still refused: one on some ranks only (named by the class it extends and the name
    given), another count, a subclass that says it joins collectives of its own beside the plain class, and an
    unrelated class that only shares the name (named in full then)."""
    from ampkit.callbacks import EarlyStopping, ModelCheckpoint
    from ampkit.trainer import rank_callbacks
    from ampkit.trainer.distributed import DistributedEnv

    class BestOnly(ModelCheckpoint):
        pass

    class Periodic(ModelCheckpoint):
        pass

    class Gathering(ModelCheckpoint):  # an all_gather of its own in a hook: matched by its own name
        takes_part_in_collectives = True

    def check(*ranks):
        gathered = [rank_callbacks.collective_callback_kinds(callbacks) for callbacks in ranks]
        monkeypatch.setattr(rank_callbacks, "gather_object", lambda value, env: gathered)
        env = DistributedEnv(rank=0, world_size=len(ranks))
        rank_callbacks.check_collective_callbacks_on_every_rank(ranks[0], env)

    check([BestOnly(), EarlyStopping("val/mse")], [ModelCheckpoint(), EarlyStopping("val/mse")])
    check([BestOnly()], [Periodic()], [ModelCheckpoint()])
    with pytest.raises(rank_callbacks.CallbacksDifferAcrossRanksError) as refused:
        check([BestOnly(), EarlyStopping("val/mse")], [EarlyStopping("val/mse")])
    assert str(refused.value).startswith("ModelCheckpoint (as BestOnly) is given on rank(s) 0 but not on rank(s) 1: ")
    with pytest.raises(rank_callbacks.CallbacksDifferAcrossRanksError) as refused:
        check([BestOnly(), Periodic()], [ModelCheckpoint()])
    assert str(refused.value).startswith(
        "ModelCheckpoint (as BestOnly, Periodic) is given 2 times on rank(s) 0 but fewer times on rank(s) 1: "
    )
    with pytest.raises(rank_callbacks.CallbacksDifferAcrossRanksError) as refused:
        check([Gathering()], [ModelCheckpoint()])
    assert str(refused.value).startswith(
        "Gathering is given on rank(s) 0 but not on rank(s) 1; "
        "ModelCheckpoint is given on rank(s) 1 but not on rank(s) 0"
    )
    own = type("ModelCheckpoint", (ampkit.Callback,), {"takes_part_in_collectives": True, "__module__": "mine"})
    with pytest.raises(rank_callbacks.CallbacksDifferAcrossRanksError) as refused:  # a class of the same name only
        check([own()], [ModelCheckpoint()])
    assert str(refused.value).startswith(
        "ampkit.callbacks.checkpoint.ModelCheckpoint is given on rank(s) 1 but not on rank(s) 0; "
        "mine.ModelCheckpoint is given on rank(s) 0 but not on rank(s) 1: "
    )


@pytest.mark.parametrize("scenario", ["train_monitor", "train_monitor_rank_zero_only"])
def test_a_train_monitor_ranks_and_stops_on_rank_zero_s_epoch_mean_on_every_rank(tmp_path, scenario):
    """Each rank logs an epoch mean of its own; ranking, early stopping and a plateau scheduler use rank zero's, the
    one TensorBoard shows, on every rank: the run stops where rank zero's values say (step 16), not where rank 1's
    would (12), and the learning rate halved twice on every rank (rank 1's values alone would halve it thrice).
    best_model_path names rank zero's file on every rank (rank 1, without a version_dir, read ''), as Lightning's, so
    a test(ckpt=...) every rank runs gets one path.

    The same where rank 0 alone logs it with Lightning's rank_zero_only=True (which was refused), batch_size and
    add_dataloader_idx; sync_dist=True, taken in one process, is refused on both ranks, naming what to do instead."""
    rank0, rank1 = _ok(launch(scenario, tmp_path, timeout=120))
    if scenario == "train_monitor_rank_zero_only":
        for rank in (rank0, rank1):
            assert rank["sync_refused"].startswith("log('train/synced') got sync_dist=True, which it does not take")
            assert "under torchrun each rank logs its own value and rank zero's is written" in rank["sync_refused"]
    reason = "early stopping: train/score did not improve on 0.2 for 2 epochs"
    assert rank0["stopped"] == rank1["stopped"] == (16, reason)
    assert rank0["lr"] == rank1["lr"] == pytest.approx(0.05 / 4)
    best = torch.load(Path(rank0["version_dir"]) / "checkpoints" / "best.pt", weights_only=True)
    assert best["loop"]["global_step"] == 8
    named = str(Path(rank0["version_dir"]) / "checkpoints" / "best-00000008.pt")
    assert rank0["best_model_path"] == rank1["best_model_path"] == named


@pytest.mark.parametrize("scenario", ["val_end_monitor", "val_end_monitor_rank_zero"])
def test_a_tag_each_rank_logs_in_on_validation_end_ranks_stops_and_schedules_on_rank_zero_s_value(tmp_path, scenario):
    """Each rank's on_validation_end logs a value of its own: early stopping, best-k and a plateau scheduler read rank
    zero's on every rank, so the run stops where rank zero's values say (step 12), not where rank 1's would (8), and
    every rank's learning rate halved once (rank 1's own values would halve it at step 8, rank 0's not); a validate()
    after it returns rank zero's value on every rank too. Logged by rank 0 alone, it is monitored the same: the sanity
    validation refused it on rank 1 only, which left rank 0 training alone."""
    rank0, rank1 = _ok(launch(scenario, tmp_path, timeout=120))
    reason = "early stopping: val_auc did not improve on 0.2 for 1 validation"
    assert rank0["stopped"] == rank1["stopped"] == (12, reason)
    assert rank0["lr"] == rank1["lr"] == pytest.approx(0.05 / 2)
    assert rank0["validated"]["val_auc"] == rank1["validated"]["val_auc"] == 10.0
    best = torch.load(Path(rank0["version_dir"]) / "checkpoints" / "best.pt", weights_only=True)
    assert best["loop"]["global_step"] == 8


def test_a_metric_only_some_ranks_return_is_averaged_over_those_ranks_on_every_rank(tmp_path):
    from dist_worker import Plain

    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu"}}  # fmt: skip
    expected_mse = Plain(cfg).validate()["mse"]
    rank0, rank1 = _ok(launch("metrics_per_rank", tmp_path))
    assert rank0["val"] == rank1["val"] == pytest.approx({"mse": expected_mse, "only0": 1.0, "only1": 3.0})


def test_a_validation_set_not_divisible_by_the_ranks_averages_each_sample_once(tmp_path):
    """25 samples on 2 sharded ranks: the metric equals one process's. A DistributedSampler pads rank 1's share
    with a repeat of sample 0, which then counted twice; rank 1 runs a filler batch instead (its FSDP forward
    keeps step with rank 0's fourth) and drops its metrics."""
    from dist_worker import UnevenValidation

    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "trainer": {"progress_bar": False, "device": "cpu"}}  # fmt: skip
    expected_mse = UnevenValidation(cfg).validate()["mse"]
    rank0, rank1 = _ok(launch("validate_uneven_fsdp", tmp_path))
    assert rank0["val"]["mse"] == rank1["val"]["mse"] == pytest.approx(expected_mse, rel=1e-6)


def test_an_uneven_stream_of_evaluation_batches_under_fsdp_is_padded_on_the_shorter_rank(tmp_path):
    """A validation IterableDataset with 3 batches on rank 0 and 1 on rank 1: every FSDP forward is a collective, so
    rank 0's second forward met rank 1's metric all-reduce and both aborted on gloo's size mismatch. Rank 1 now runs
    filler batches, dropped from the metric (equal to one process's) and the predictions; a rank with none at all
    is refused on every rank, naming it, also in a fit (whose set-up dropped an empty list on that rank alone, and
    the other waited in its sanity pass until the timeout). A fit refuses it at set-up, before its first training
    step, with num_sanity_val_steps=0 too (it trained up to its first validation, which refused it)."""
    from dist_worker import Plain

    class AllThirteen(Plain):
        def val_dataloader(self):
            return DataLoader(toy_dataset(13, seed=7), batch_size=4)

    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "trainer": {"progress_bar": False, "device": "cpu"}}  # fmt: skip
    expected_mse = AllThirteen(cfg).validate()["mse"]
    rank0, rank1 = _ok(launch("validate_stream_fsdp", tmp_path))
    assert rank0["val"]["mse"] == rank1["val"]["mse"] == pytest.approx(expected_mse, rel=1e-6)
    assert [rank0["predictions"], rank1["predictions"]] == [3, 1]
    for rank in (rank0, rank1):
        assert rank["refused"].startswith("val_dataloader() gives rank(s) 1 no batch while other ranks have 1 or more")
        for refused in rank["fit_refused"]:
            assert refused.startswith("val_dataloader() gives rank(s) 1 no batch while other ranks have 3 or more: "
                                      "under distributed.strategy=fsdp"), refused  # fmt: skip
        assert rank["trained"] == [0, 0]


@pytest.mark.parametrize(("size", "drop_last"), [(25, False), (25, True), (1, False), (24, False)])
def test_evaluation_batches_cover_each_sample_once_in_as_many_steps_on_every_rank(size, drop_last):
    from ampkit.trainer.distributed import DistributedEnv, EvaluationBatches

    ranks = [EvaluationBatches(size, 4, drop_last, DistributedEnv(rank, 2)) for rank in range(2)]
    assert len({len(list(batches)) for batches in ranks}) == 1
    real = sorted(i for batches in ranks for batch in list(batches)[: batches.real_batches] for i in batch)
    assert real == list(range(24 if drop_last else size))


def test_ranks_with_unequal_batches_never_wait_for_the_timeout(tmp_path):
    """Rank 0 has 10 batches, rank 1 6: rank 0's 7th step waited in the gradient all-reduce until
    ``distributed.timeout_s``, then failed blaming a live rank. Counts known up front are refused at set-up naming
    them; a stream (an IterableDataset) ends every rank's epoch where the shortest runs out, with a warning. A
    stream giving every rank the same batches is named, for training and for evaluation.

    A validation stream with no batch on rank 1, under DDP with a BatchNorm: rank 0's first validation forward
    broadcast the buffers (DDP does at the first forward after a training one), which rank 1 never ran, and the fit
    failed after the timeout; every rank syncs them before the pass now, and both get rank 0's model's mean.

    A per-rank validation list empty on rank 1: fit() dropped it there alone, and rank 0 waited in the sanity pass's
    gather until the timeout; rank 1 now runs each pass with no batch (as validate() did), and both ranks get rank
    0's mean. A val_dataloader() returning None on rank 1 only is refused on both at set-up, naming the ranks; a fit
    that never validates gathers no counts and names none."""
    results = launch("uneven_batches", tmp_path, timeout=120)
    rank0, rank1 = _ok(results)
    refused = "train_dataloader() gives the ranks different numbers of batches per epoch (rank 0: 10, rank 1: 6)"
    for rank in (rank0, rank1):
        assert refused in rank["refused"]
        assert "trainer.limit_train_batches=6" in rank["refused"]
        assert rank["global_step"] == 12  # 6 steps in each of 2 epochs
    _equal(rank0["model"], rank1["model"])
    assert any("epoch 0: the training data of rank(s) 1 ran out after 6 batches" in w for w in rank0["sharded"])
    assert not any("ran out" in w for w in rank1["sharded"])  # rank zero alone warns
    # A stream that is not sharded gave both ranks every sample, silently: named once, by rank zero. The one that
    # shards itself by rank is not.
    same = [
        [w for w in rank[run] if "same first batch" in w]
        for rank in (rank0, rank1)
        for run in ("sharded", "duplicated")
    ]
    assert same[0] == same[2] == same[3] == []
    assert len(same[1]) == 1
    assert same[1][0].startswith(
        "train_dataloader() gave each of the 2 ranks the same first batch: its WholeStream is not sharded across ranks"
    )

    from dist_worker import NormedUnevenValidation

    assert rank0["normed_val"] == rank1["normed_val"]
    _equal(rank0["normed_model"], rank1["normed_model"])  # rank 0's buffers, synced before validation
    model = NormedUnevenValidation.configure_model(None)
    model.load_state_dict(rank0["normed_model"])
    x, y = toy_dataset(13, seed=7)[:9]  # rank 0's share, the only one
    with torch.no_grad():
        expected = nn.functional.mse_loss(model.eval()(x).squeeze(1), y).item()
    assert rank0["normed_val"]["mse"] == pytest.approx(expected, rel=1e-5)
    assert not any("same first batch" in w for rank in (rank0, rank1) for w in rank["normed_warned"])  # its own
    for call, said in rank0["evaluated"].items():
        same = [w for w in said if "same first batch" in w]
        assert len(same) == 1, (call, same)  # a fit: its sanity pass compares, its two validations do not again
        source = {"fit": "val", "validate": "val"}.get(call, call)
        assert same[0].startswith(f"{source}_dataloader() gave each of the 2 ranks the same first batch: its Whole")
        outcome = "every rank predicts every sample" if call == "predict" else "every rank evaluates every sample"
        assert outcome in same[0]
    assert not any("same first batch" in w for said in rank1["evaluated"].values() for w in said)  # rank zero's
    # Validation batches per rank known up front and unequal (3 and 1): a collective of the user's in
    # validation_step cannot line up across the ranks, and nothing said so; rank zero does as each pass is set up
    # (a fit's, a validate()'s). Streams (counts unknown) and evenly sharded data are not named.
    uneven = "val_dataloader() gives the ranks different numbers of batches (rank 0: 3, rank 1: {})"
    cases = (("fit", 1), ("validate", 1), ("fit, empty on rank 1", 0), ("validate, empty on rank 1", 0))
    for call, rank1_count in cases:
        said = [w for w in rank0["uneven_lists"][call] if "different numbers of batches" in w]
        assert len(said) == 1 and said[0].startswith(uneven.format(rank1_count)), (call, said)
        assert "collective of your own in validation_step" in said[0] and "gather in on_validation_end" in said[0]
    quiet = [*rank1["uneven_lists"].values(), rank0["normed_warned"], *rank0["evaluated"].values()]
    quiet.append(rank0["uneven_lists"]["fit, never validates"])
    assert not any("different numbers of batches (" in w for warned in quiet for w in warned)
    # Rank 1's list empty: both ranks validated (fit's last validation, then validate()), with rank 0's 12 samples.
    from dist_worker import EmptyValidationListOnRank1

    _equal(rank0["empty_on_1_model"], rank1["empty_on_1_model"])
    model = EmptyValidationListOnRank1.configure_model(None)
    model.load_state_dict(rank0["empty_on_1_model"])
    x, y = toy_dataset(16, seed=7)[:12]
    with torch.no_grad():
        expected = nn.functional.mse_loss(model(x).squeeze(1), y).item()
    assert len(rank0["empty_on_1_val"]) == len(rank1["empty_on_1_val"]) == 2
    for val in (*rank0["empty_on_1_val"], *rank1["empty_on_1_val"]):
        assert val["mse"] == pytest.approx(expected, rel=1e-5)
    assert not any("validation is skipped" in w for w in rank0["uneven_lists"]["fit, empty on rank 1"])
    for rank in (rank0, rank1):
        for refused in (rank["loader_refused"], rank["validate_refused"]):
            assert refused.startswith("val_dataloader() returned None on rank(s) 1 but a loader on rank(s) 0"), refused


def test_the_first_batch_fingerprint_tells_contents_and_the_check_leaves_sampled_loaders_alone(monkeypatch):
    """Batches alike in contents (not identity) share a fingerprint; another shape or dtype does not; a tensor with no
    plain bytes gives none (never named). A loader a DistributedSampler deals is not compared at all (no gather), nor
    an evaluation loader ampkit shards."""
    from lightning_utilities.core.rank_zero import rank_zero_only
    from torch.utils.data.distributed import DistributedSampler

    from ampkit.trainer.distributed import DistributedEnv, evaluation_loader
    from ampkit.trainer.duplicated_data import EvaluationFirstBatch, FirstBatchComparison, batch_fingerprint

    batch = {"x": torch.arange(6.0).reshape(2, 3).bfloat16(), "ids": ["a", "b"], "w": torch.tensor(1.0)}
    assert batch_fingerprint(batch) == batch_fingerprint({**batch, "x": batch["x"].clone()})
    assert batch_fingerprint(batch) != batch_fingerprint({**batch, "ids": ["a", "c"]})  # what is no tensor counts too
    assert batch_fingerprint(torch.zeros(2, 3)) != batch_fingerprint(torch.zeros(3, 2))
    assert batch_fingerprint(torch.zeros(2, 3)) != batch_fingerprint(torch.zeros(2, 3, dtype=torch.float64))
    assert batch_fingerprint([torch.eye(3).to_sparse()]) is None
    two = DistributedEnv(rank=0, world_size=2)
    data = toy_dataset(8)
    dealt = DataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0))
    assert not FirstBatchComparison(dealt, two).pending
    assert FirstBatchComparison(iter([1, 2]), two).pending
    assert not FirstBatchComparison(iter([1, 2]), DistributedEnv()).pending
    # an evaluation loader ampkit shards (each sample on one rank) is not compared either; a stream is, and the
    # ranks' fingerprints come from the pass's closing gather: the first batch is noted, not gathered at once
    sharded = evaluation_loader(DataLoader(data, batch_size=2), two)
    assert not EvaluationFirstBatch(sharded, two).pending and not EvaluationFirstBatch(dealt, two).pending
    stream = EvaluationFirstBatch(iter([1, 2]), two, "predict_dataloader()")
    assert stream.note(batch) == batch_fingerprint(batch)
    stream.judge([stream.note(batch), None])  # rank 1 had no batch: nothing to say, and nothing more to compare
    assert not stream.pending and stream.note(batch) is None
    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        EvaluationFirstBatch(iter([1, 2]), two, "val_dataloader()").judge([None, None])  # no plain bytes: unknown
        EvaluationFirstBatch(iter([1, 2]), two, "val_dataloader()").judge(["same", "same"])
    alike = "val_dataloader() gave each of the 2 ranks the same first batch"
    assert [str(w.message).split(":")[0] for w in said] == [alike]


def test_a_stream_on_one_rank_and_a_list_on_another_accumulate_to_the_same_steps(tmp_path):
    """Rank 0 streams 10 batches, rank 1 lists 6, accumulating 4: rank 0 alone fetched one ahead (to mark the end of
    a stream), so its batch agreement for the next batch waited on rank 1 while rank 1 waited in the step's gradient
    all-reduce, until distributed.timeout_s. Each epoch is 6 batches: a step of 4 and its last, short window of 2."""
    rank0, rank1 = _ok(launch("uneven_stream_accumulate", tmp_path, timeout=120))
    assert rank0["global_step"] == rank1["global_step"] == 4
    _equal(rank0["model"], rank1["model"])


@pytest.mark.parametrize(
    "message, transport",
    [
        ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234", True),
        ("Timed out waiting 1800000ms for recv operation to complete", True),
        ("DataLoader timed out after 5 seconds.", False),  # the user's loader, whose own timeout ran out
        ("DataLoader worker (pid 123) exited unexpectedly", False),
        ("mat1 and mat2 shapes cannot be multiplied (4x3 and 4x1)", False),
    ],
)
def test_a_dataloaders_own_timeout_is_not_taken_for_a_failed_collective(message, transport):
    """A failed collective gets the rank diagnosis (who died); a DataLoader timeout is the user's data and keeps its
    own message, not a claim that some rank stopped responding."""
    from ampkit.trainer.distributed import is_communication_failure

    assert is_communication_failure(RuntimeError(message)) is transport


def test_ddps_unused_parameter_error_names_the_parameters_and_the_config_key(tmp_path):
    """A step that leaves some parameters without a gradient failed the next forward with DDP's advice to pass
    ``find_unused_parameters=True`` to a constructor the user never calls; the line names ampkit's key instead.
    A batch norm given one sample per rank (one process at twice the batch trains) names sync_batchnorm."""
    rank0, rank1 = _ok(launch("unused_parameters", tmp_path))
    for rank, result in enumerate((rank0, rank1)):
        assert result["batch_norm"].startswith(f"rank {rank}: a batch norm in training got one value per channel")
        assert (
            "distributed.sync_batchnorm=true computes the statistics over every rank's batch" in (result["batch_norm"])
        )
        assert result["explained"] == (
            f"rank {rank}: parameters 'b.weight', 'b.bias' got no gradient in the step before, so DDP never finished "
            "reducing them: set distributed.find_unused_parameters=true for a model whose steps leave some parameters "
            "out (or make every step's loss use all of them)"
        )
        assert result["global_step"] == 2  # with the key set, the same model trains
        assert result["after_unfreezing"].startswith(f"rank {rank}: parameters 'b.weight' got no gradient")


def test_overflow_on_one_rank_in_one_loss_skips_the_same_optimizer_everywhere(tmp_path):
    rank0, rank1 = _ok(launch("overflow", tmp_path))
    assert rank0["skips"] == rank1["skips"] == [(3, "G")]
    _equal(rank0["model"], rank1["model"])


def test_real_loss_scalers_agree_when_only_rank_1_overflows_in_loss_1(tmp_path):
    """The skip is agreed, so the warning of skips in a row (here after 1) is one line, from rank 0: each rank
    printed its own."""
    results = launch("overflow_amp", tmp_path)
    rank0, rank1 = _ok(results)
    assert rank0["skips"] == rank1["skips"] == [(3, "G")]
    assert rank0["scales"] == rank1["scales"] == {"0": 1024.0, "1": 512.0}
    _equal(rank0["model"], rank1["model"])
    warned = [r.stderr.count("optimizer 'G' skipped 1 step in a row") for r in results]
    assert warned == [1, 0]


@pytest.mark.parametrize("scenario", ["overflow", "overflow_amp"])
def test_verdicts_kept_on_the_device_are_agreed_by_an_all_reduce_there(tmp_path, scenario):
    """Fused optimizers and ``skip_verdict=device``: the flags (and a callback's host verdict) are agreed by an
    all-reduce on the device and never read per step. The ranks skip and scale as the host-read run does, and
    hear of the skip at the next iteration."""
    fused = {"FUSED": "1"}
    host = _ok(launch(scenario, tmp_path / "host", {**fused, "SKIP_VERDICT": "host"}))
    device = _ok(launch(scenario, tmp_path / "device", {**fused, "SKIP_VERDICT": "device"}))
    assert [r["facts_on_device"] for r in host + device] == [False, False, True, True]
    assert host[0]["skips"] == host[1]["skips"] == [(3, "G")]
    assert device[0]["skips"] == device[1]["skips"] == [(4, "G")]
    if scenario == "overflow_amp":
        assert device[0]["scales"] == device[1]["scales"] == host[0]["scales"] == {"0": 1024.0, "1": 512.0}
    for rank in device:
        _equal(rank["model"], host[0]["model"])


def test_sync_batchnorm_with_unequal_batches_equals_one_process_on_the_concatenation(tmp_path):
    rank0, rank1 = _ok(launch("syncbn", tmp_path))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    x = toy_dataset(8).tensors[0]
    ((model(x) ** 2).sum() / 8).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(rank0["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank1["grads"][name], p.grad, rtol=1e-5, atol=1e-6)
    single_stats = _one_forward_stats(x)
    for key, value in single_stats.items():
        torch.testing.assert_close(rank0["model"][f"1.{key}"], value, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(rank1["model"][f"1.{key}"], value, rtol=1e-5, atol=1e-6)


def test_a_compiled_model_under_ddp_compiles_and_its_validations_recompile_nothing(tmp_path):
    """trainer.compile=true under DDP compiles the model's forward: torch.compile of the DDP wrapper compiled no graph
    (dynamo stops at DDP's forward and ran the model eagerly). DistributedSync gives every rank rank 0's BatchNorm
    buffers as each validation starts and tells DDP its forwards need no sync; no switch between training and
    validation may recompile: the first validation compiles the no-grad case once, the later two reuse it."""
    ranks = _ok(launch("ddp_compile_switches", tmp_path))
    for rank in ranks:
        assert rank["compiled"] >= 1
        first, *later = rank["recompiles"]  # at each validation's end (3 epochs), then at the fit's
        assert later == [first] * 3, rank["recompiles"]
    _equal(ranks[0]["model"], ranks[1]["model"])


def _one_forward_stats(x: torch.Tensor) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    model.train()(x)
    return {k: v for k, v in model[1].state_dict().items() if k.startswith("running")}


def test_unseeded_ranks_start_from_rank_0s_weights_before_o2_copies_them(tmp_path):
    """With ``trainer.seed: null`` every rank initialises a different model; the Trainer gives all of them rank
    0's weights before O2's fp32 masters are made, so the replicas stay identical (they had drifted apart: the
    masters of rank 1 still held its own initialisation after DDP's broadcast)."""
    rank0, rank1 = _ok(launch("o2_unseeded", tmp_path))
    _equal(rank0["model"], rank1["model"])


def test_killing_one_rank_makes_the_other_exit_naming_it(tmp_path):
    start = time.monotonic()
    rank0, rank1 = launch("kill", tmp_path, timeout=120)
    elapsed = time.monotonic() - start
    assert rank1.returncode == -9
    assert rank0.returncode != 0
    assert "rank(s) 1 died or stopped responding" in rank0.stderr, rank0.stderr[-2000:]
    assert _raised(rank0.stderr).startswith("rank 0: a collective during training failed: rank(s) 1 died")
    assert elapsed < 60


def test_a_rank_failing_during_set_up_is_named_by_the_others(tmp_path):
    """Rank 1's configure_optimizers raises: rank 0, already in a set-up collective, failed with gloo's bare
    "Connection closed by peer", since the callbacks that name a dead rank are set up later."""
    rank0, rank1 = launch("set_up_fails_on_rank_1", tmp_path)
    assert "ValueError: rank 1's optimizer settings are wrong" in rank1.stderr
    assert rank0.returncode != 0
    assert (
        "rank 0: a collective while setting up fit failed: rank 1 failed with ValueError: rank 1's optimizer "
        "settings are wrong" in rank0.stderr
    )


def test_an_exception_on_one_rank_is_named_with_its_error_by_the_others_at_once(tmp_path):
    """Rank 1's training_step raises at step 3: rank 0 said rank 1 "died or stopped responding", after waiting
    5 s for it to check in; rank 1 leaves its error on the store before it leaves the group."""
    start = time.monotonic()
    rank0, rank1 = launch("step_fails_on_rank_1", tmp_path)
    assert "ValueError: rank 1's batch 3 is corrupt" in rank1.stderr
    assert rank0.returncode != 0
    assert _raised(rank0.stderr).startswith(  # the error raised, not a note on gloo's or a "setting up fit" one
        "rank 0: a collective during training failed: rank 1 failed with ValueError: rank 1's batch 3 is corrupt"
    ), rank0.stderr[-2000:]
    assert "while setting up fit" not in rank0.stderr
    assert time.monotonic() - start < 50  # distributed.timeout_s is 60


def _raised(stderr: str) -> str:
    """The message of the exception a traceback in ``stderr`` ends with (the last ``DistributedError: ...``)."""
    return stderr.rpartition("ampkit.trainer.distributed.DistributedError: ")[2]


@pytest.mark.slow  # a torchrun agent, a kill and a restart: ~20 s on 2 cores
def test_a_torchrun_restart_continues_the_run_its_first_attempt_saved(tmp_path):
    """``torchrun --max-restarts 1``, a script of two fits, rank 1 SIGKILLed after step 4 of the second: in the
    restarted group the first fit finds its run finished and the second continues version_1 from its step-3
    checkpoint (it had started over in a new version_2). Its process group had read the dead attempt's addresses
    from the agent's store (kept across restarts) and failed to connect."""
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--max-restarts",
         "1", str(WORKER), "restart", str(tmp_path)],
        env=child_env(TESTS, TESTS.parent, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "ampkit: torchrun restart 1 continues this launch's run from" in result.stderr
    ranks = [torch.load(tmp_path / f"rank{rank}.pt", weights_only=True) for rank in range(2)]
    for rank in ranks:
        assert (rank["attempt"], rank["started_at"], rank["global_step"]) == (1, 3, 8)
        assert rank["first_stage_started_at"] is None  # finished: nothing to train, on_train_start never fired
    _equal(ranks[0]["model"], ranks[1]["model"])
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["version_0", "version_1"]
    from dist_worker import Plain

    single = Plain({"trainer_class": "x:y", "run_dir": str(tmp_path / "single"), "data": {"batch_size": 8},
                    "logging": {"tensorboard": False}, "checkpoint": {"enabled": False},
                    "trainer": {"max_epochs": 1, "device": "cpu", "progress_bar": False}})  # fmt: skip
    single.fit()  # the uninterrupted run, as one process at the global batch
    for key, value in single.module.state_dict().items():
        torch.testing.assert_close(ranks[0]["model"][key], value, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory) -> list[dict]:
    """Two ranks x batch 4 of the shuffled ToyTrainer, a checkpoint every 3 steps (8 steps an epoch)."""
    return _ok(launch("resume", tmp_path_factory.mktemp("two_rank_run")))


def test_resumed_two_rank_run_equals_uninterrupted(two_rank_run, tmp_path):
    middle = Path(two_rank_run[0]["version_dir"]) / "checkpoints" / "step-00000009.pt"
    assert middle.is_file()
    resumed = _ok(launch("resume", tmp_path / "resumed", {"RESUME_FROM": str(middle)}))
    _equal(two_rank_run[0]["model"], resumed[0]["model"])
    _equal(resumed[0]["model"], resumed[1]["model"])
    # Every key of the final checkpoint (optimizers, RNG, loop): on as many ranks, bit-identical.
    final, reference = (
        load_checkpoint(Path(r[0]["version_dir"]) / "checkpoints" / "last.pt") for r in (resumed, two_rank_run)
    )
    assert_same_checkpoint(final, reference)


def test_a_sigterm_on_one_rank_saves_the_step_every_rank_stops_at_and_resume_continues_the_run(two_rank_run, tmp_path):
    """A scheduler's preemption (SIGTERM, passed on by torchrun's agent, which kills the ranks 30 s later) killed the
    rank at once and lost the steps since the last checkpoint. The ranks now agree on it where they agree on a stop
    (the next iteration's collective of loss facts: step 4), save that step, unwind, and --resume last continues the
    same run."""
    rank0, rank1 = _ok(launch("sigterm", tmp_path))
    for rank in (rank0, rank1):
        assert rank["preempted"] == "Preempted: SIGTERM: stopped at step 4"
        assert rank["saved"] == rank["resumed_at"] == {"epoch": 0, "batches_done": 4, "global_step": 4}
        assert rank["stopped_early"] is None  # a preemption is no early stop: its resume trains
        assert rank["continued"] == str(tmp_path / "run" / "version_0")
    _equal(rank0["model"], two_rank_run[0]["model"])
    _equal(rank1["model"], two_rank_run[0]["model"])


@pytest.mark.slow  # a torchrun launch of two ranks with two loader workers each: ~15 s on 2 cores
@pytest.mark.parametrize("verdicts", ["host", "device"])
def test_a_sigterm_is_agreed_within_an_iteration_or_two_however_rarely_the_run_logs(tmp_path, verdicts):
    """With the facts kept on the device (CUDA's default with a fused optimizer) the ask had no collective to ride
    in, so the ranks agreed it only at a logging iteration or an epoch's end: here step 8, and with a long logging
    interval minutes after the SIGTERM, past the grace before the scheduler's SIGKILL. It now rides in the facts'
    all-reduce on the device and is read with that iteration's verdicts, at the next iteration's end (step 5)."""
    env = {"SKIP_VERDICT": verdicts}
    rank0, rank1 = _ok(launch("sigterm_logging_rarely", tmp_path, env))
    stop = 4 if verdicts == "host" else 5
    for rank in (rank0, rank1):
        assert rank["facts_on_device"] is (verdicts == "device")
        assert rank["preempted"] == f"Preempted: SIGTERM: stopped at step {stop}"
        assert rank["saved"] == rank["resumed_at"] == {"epoch": 0, "batches_done": stop, "global_step": stop}
        assert rank["final_step"] == 16  # the resume trains on to the end of the second epoch
    _equal(rank0["model"], rank1["model"])


def test_a_sigterm_torchrun_passes_on_spares_the_ranks_loader_workers_and_saves_the_step(tmp_path):
    """torchrun's agent passes a SIGTERM on to each rank's whole process group, so the ranks' DataLoader workers died
    of it and the ranks failed with 'DataLoader worker (pid N) is killed by signal: Terminated', saving nothing. Now
    the ranks agree on the stop (at step 4, the next iteration that logs), save it and exit 143 (torchrun itself
    exits 1 for the signal it got); --resume last then continues as in one process."""
    settings = {"trainer_class": "toy_trainers:WorkersToyTrainer", "run_dir": str(tmp_path / "run"),
                "data": {"batch_size": 4}, "logging": {"tensorboard": False, "log_every_n_steps": 1},
                "trainer": {"max_epochs": 2, "device": "cpu", "progress_bar": False}}  # fmt: skip
    cfg_path = tmp_path / "toy.yaml"
    OmegaConf.save(OmegaConf.create(settings), cfg_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "ampkit",
                "fit", "--config", str(cfg_path)]  # fmt: skip
    env = child_env(TESTS, TESTS.parent, OMP_NUM_THREADS="1", AMPKIT_TEST_GROUP_SIGTERM="torchrun")
    cut = subprocess.run(torchrun, env=env, capture_output=True, text=True, timeout=180, start_new_session=True)
    assert cut.returncode != 0 and "DataLoader worker" not in cut.stderr, cut.stderr[-3000:]
    assert cut.stderr.count("ampkit: terminated (SIGTERM) (--resume last continues from") == 2, cut.stderr[-3000:]
    last = tmp_path / "run" / "version_0" / "checkpoints" / "last.pt"
    assert load_checkpoint(last)["loop"] == {"epoch": 0, "batches_done": 4, "global_step": 4}


class SampleRecorder(ampkit.Callback):
    """The dataset indices of each training batch (ToyTrainer's 64 samples)."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int]]] = []
        self.inputs = toy_dataset(64).tensors[0]

    def on_train_batch_start(self, trainer, batch):
        rows = (batch[0][:, None, :] == self.inputs[None]).all(-1).nonzero()[:, 1]
        self.seen.append((trainer.state.epoch, rows.tolist()))


def test_a_mid_epoch_checkpoint_of_two_ranks_resumes_in_one_process_at_the_same_sample(two_rank_run, tmp_path):
    """Resumed by one process at the same per-rank batch, the step-3 checkpoint (3 global batches of 2 x 4 = 24
    samples into epoch 0) continues with the epoch's 25th sample: it had skipped only 3 x 4, so 12 samples were
    trained on twice in that epoch. Its batch count is this run's, as the closing line says."""
    step_3 = Path(two_rank_run[0]["version_dir"]) / "checkpoints" / "step-00000003.pt"
    recorder = SampleRecorder()
    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "one"), "logging": {"tensorboard": False},
           "data": {"batch_size": 4}, "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu"}}  # fmt: skip
    trainer = ToyTrainer(cfg, callbacks=[recorder])
    trainer.fit(resume=step_3)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()  # the sampler's, seed 0 epoch 0
    assert [rows for _, rows in recorder.seen] == [order[i : i + 4] for i in range(24, 64, 4)]
    # A stop in that epoch one step on (step 4, 7 batches in) counts this run's batches, naming the checkpoint's:
    # "4 steps in 7 batches" read as if 3 batches had not stepped.
    from ampkit.cli import _trained_span

    assert _trained_span(0, 7, trainer.rescaled_resume) == (
        "7 batches of 4 samples (1 rank x 4), the first 6 of them the resumed checkpoint's 3 batches of 8 samples "
        "(2 ranks x 4)"
    )


def test_a_two_rank_checkpoint_resumed_at_the_same_global_batch_warns_of_the_key_but_not_of_skipped_batches(
    two_rank_run, tmp_path
):
    """2 ranks x 4 resumed as 1 x 8: the changed data.batch_size is named, but the warning added that a data setting
    changes which batches a mid-epoch resume skips, and the sample order continues (the 25th sample next)."""
    step_3 = Path(two_rank_run[0]["version_dir"]) / "checkpoints" / "step-00000003.pt"
    recorder = SampleRecorder()
    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "one"), "logging": {"tensorboard": False},
           "data": {"batch_size": 8}, "trainer": {"max_epochs": 1, "progress_bar": False, "device": "cpu"}}  # fmt: skip
    with pytest.warns(UserWarning) as caught:
        ToyTrainer(cfg, callbacks=[recorder]).fit(resume=step_3)
    said = [str(w.message) for w in caught if "resuming" in str(w.message)]
    assert any(line.endswith("data.batch_size: 4 -> 8") for line in said), said
    assert not [line for line in said if "skip" in line], said
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0)).tolist()
    assert [rows for _, rows in recorder.seen] == [order[i : i + 8] for i in range(24, 64, 8)]


def test_only_a_map_style_loaders_position_is_rescaled_to_another_batch_layout():
    """An IterableDataset orders (and shards) its own samples: its batch count is resumed as saved."""
    from torch.utils.data import IterableDataset

    from ampkit.trainer.batch_layout import batch_layout, batches_done_here

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(64))

    saved = batch_layout(DataLoader(toy_dataset(64), batch_size=4), 2, 8)
    one_process = batch_layout(DataLoader(toy_dataset(64), batch_size=4), 1, 16)
    assert batches_done_here(saved, one_process, 3, 1, Path("ck.pt")) == 6
    assert batch_layout(DataLoader(Stream(), batch_size=4), 1, 16) is None
    assert batches_done_here(saved, None, 3, 1, Path("ck.pt")) == 3


def test_a_mid_epoch_resume_between_this_runs_batches_is_refused_naming_both_layouts(tmp_path):
    """24 samples into the epoch fall inside a 16-sample batch: no batch count continues there."""
    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "checkpoint": {"every_n_steps": 3}, "data": {"batch_size": 8},
           "trainer": {"max_steps": 3, "progress_bar": False, "device": "cpu"}}  # fmt: skip
    ToyTrainer(cfg).fit()
    version_dir = tmp_path / "run" / "version_0"
    before = sorted(p.name for p in version_dir.rglob("*"))
    larger = {**cfg, "data": {"batch_size": 16}, "trainer": {**cfg["trainer"], "max_steps": 6}}
    layouts = (
        r"3 batches of 8 samples \(1 rank x 8\) into its epoch; this run.s batches take 16 samples \(1 rank x 16\)"
    )
    with pytest.raises(CheckpointError, match=layouts):
        ToyTrainer(larger).fit(resume=version_dir / "checkpoints" / "step-00000003.pt")
    assert sorted(p.name for p in version_dir.rglob("*")) == before  # refused before anything was written


def test_a_resume_at_another_ranks_x_batch_size_says_so_in_the_banner(tmp_path, capsys):
    """Allowed (the sample order continues), but the curve then follows another batch: a 2-rank checkpoint resumed on
    one process at the same data.batch_size halved every step's samples without a word."""
    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "checkpoint": {"every_n_steps": 3}, "data": {"batch_size": 8},
           "trainer": {"max_steps": 3, "device": "cpu"}}  # fmt: skip
    ToyTrainer(cfg).fit()
    step_3 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000003.pt"
    ToyTrainer({**cfg, "trainer": {**cfg["trainer"], "max_steps": 4}}).fit(resume=step_3)
    assert "  batch" not in capsys.readouterr().out  # the same layout: nothing to say
    smaller = {**cfg, "data": {"batch_size": 4}, "trainer": {**cfg["trainer"], "max_steps": 8}}
    ToyTrainer(smaller).fit(resume=step_3)
    banner = capsys.readouterr().out.splitlines()
    assert "  batch       samples a step: 8 (1 rank x 8) then, 4 (1 rank x 4) now; the loss curve follows another " \
        "batch size" in banner  # fmt: skip


def test_the_banners_samples_a_step_count_the_batches_each_step_accumulates(tmp_path, capsys):
    """Fewer ranks (or a smaller batch) with more accumulation keep each optimizer step's samples, the usual way to
    resume on fewer GPUs: the banner said the loss curve followed another batch size; a changed accumulation alone
    changes them and was not named."""
    cfg = {"trainer_class": "x:y", "run_dir": str(tmp_path / "run"), "logging": {"tensorboard": False},
           "checkpoint": {"every_n_steps": 2}, "data": {"batch_size": 8},
           "trainer": {"max_steps": 2, "device": "cpu"}}  # fmt: skip
    ToyTrainer(cfg).fit()
    step_2 = tmp_path / "run" / "version_0" / "checkpoints" / "step-00000002.pt"
    capsys.readouterr()
    accumulating = {**cfg["trainer"], "max_steps": 3, "accumulate_grad_batches": 2}
    ToyTrainer({**cfg, "data": {"batch_size": 4}, "trainer": accumulating}).fit(resume=step_2)
    assert "  batch" not in capsys.readouterr().out  # 8 samples a step then and now
    ToyTrainer({**cfg, "trainer": accumulating}).fit(resume=step_2)
    assert "  batch       samples a step: 8 (1 rank x 8) then, 16 (1 rank x 8 x 2 batches accumulated) now; the " \
        "loss curve follows another batch size" in capsys.readouterr().out.splitlines()  # fmt: skip


def test_an_fsdp_run_dir_that_rank_1_cannot_write_fails_on_every_rank_before_training(tmp_path):
    """Every FSDP rank writes its own shards into the version_N rank 0 made: a rank that cannot was found out only
    by the first checkpoint's save, after training up to it. (os.access is faked: root may write anywhere.)"""
    results = launch("fsdp_rank_1_cannot_write", tmp_path)
    for rank, result in enumerate(results):
        assert result.returncode != 0
        assert "config key 'run_dir': under distributed.strategy=fsdp every rank writes" in result.stderr
        assert "on rank 1 it is not writable there" in result.stderr, result.stderr[-2000:]
        assert torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)["global_step"] == 0
    assert not (tmp_path / "run" / "version_0").exists()  # made for a run that never trained: removed again


def test_what_rank_zero_decides_or_refuses_at_a_fit_s_start_and_saves_every_rank_does_at_once(tmp_path):
    """Each rank looked at run_dir itself: where rank 1's node-local disk held no checkpoint, rank 1 alone failed;
    where it held an older one at last.pt's path, rank 1 resumed that one (step 2, rank 0 step 4) and the ranks
    diverged. Rank zero now decides, and every rank refuses with one line naming the rank, its host and the fix (a
    validate too); a copy of rank 0's checkpoint on rank 1's disk resumes. A resume rank 0 refuses (a live run holds
    the lock), a resume whose pruning fails on rank 0 (a best-k file's deletion, run_dir's check, TensorBoard's
    events), a predict output rank 0 refuses (a user's file in the way on its disk) and a save that fails on rank 0
    (a full disk) stop rank 1 with the same error at once, not in a later
    collective with another (a DistributedError, exit status 1 where rank 0's is 2; under NCCL maybe a wait for
    distributed.timeout_s)."""
    outcomes = [r["outcomes"] for r in _ok(launch("rank_zero_decides", tmp_path))]
    host = socket.gethostname()
    cases = [("none", "resuming", "no checkpoint there"), ("validate", "validate: loading", "no checkpoint there"),
             ("older", "resuming", "another checkpoint there (epoch 0, step 2)")]  # fmt: skip
    for case, doing, seen in cases:
        assert outcomes[0][case][:3] == outcomes[1][case][:3], case
        kind, message, storage, _ = outcomes[0][case]
        assert storage is None
        assert kind == "CheckpointError"
        assert message.startswith(f"{doing} 'run/version_0/checkpoints/last.pt' (epoch 1, step 4 on rank 0): rank 1 ")
        assert f"rank 1 (host {host}) has {seen}. Every rank reads" in message
        assert "must be on a file system every node shares (NFS, Lustre, GPFS), not a node-local disk" in message
    # A copy whose tensor bytes were torn (its zip directory intact: the fingerprint is rank 0's) was loaded by
    # rank 1 without a word, its optimizer state other than rank 0's; its records are now read against their CRC-32s.
    assert outcomes[0]["torn"][:3] == outcomes[1]["torn"][:3]
    kind, message, _, _ = outcomes[1]["torn"]
    assert kind == "CheckpointError"
    assert f"(epoch 1, step 4 on rank 0): rank 1 (host {host}) has a damaged copy: its record 'data/" in message
    assert "is not as written (BadZipFile: Bad CRC-32 for file" in message
    assert "copy the checkpoint there again from a whole one, or resume an older checkpoint" in message
    assert "not a node-local disk" not in message
    (_, step0, model0), (_, step1, model1) = outcomes[0]["copied"], outcomes[1]["copied"]
    assert step0 == step1 == 6
    _equal(model0, model1)
    full, locked = "step-00000002.pt' (No space left on device)", "is in use by pid"
    no_events = "cannot write TensorBoard events under 'events/version_0/tensorboard' (No space left on device)"
    in_the_way = "predict --output 'preds.pt': 'preds.rank0.pt' exists already; pass --overwrite"
    for case, kind, said in [("locked", "RunDirectoryError", locked), ("disk_full", "CheckpointError", full),
                             ("predict_refused", "RunDirectoryError", in_the_way),
                             ("prune_refused", "CheckpointError", "could not delete 'checkpoints' (older than the"),
                             ("drop_refused", "CheckpointError", "(out of the save_top_k=1 best: Permission denied)"),
                             ("look_refused", "PermissionError", "Permission denied"),
                             ("events_refused", "RunDirectoryError", no_events)]:  # fmt: skip
        assert outcomes[0][case][:3] == outcomes[1][case][:3], case
        assert outcomes[1][case][0] == kind and said in outcomes[1][case][1]
        assert outcomes[1][case][3] < 5
    # Rank 1 cannot write its shard of the predictions (a full disk): rank 0 returned as if the output were whole.
    unwritten = "cannot write predictions to 'unwritten.rank1.pt' (No space left on device)"
    unwritten_outcome = ("RunDirectoryError", unwritten, errno.ENOSPC)
    assert outcomes[0]["predict_unwritten"][:3] == outcomes[1]["predict_unwritten"][:3] == unwritten_outcome
    # A full disk on one rank is a storage failure on every rank (ampkit fit's status 74: retry once there is room),
    # its errno carried with the error; a refused permission is none. Through the CLI, both ranks exit 74 with the
    # one line of the rank whose disk filled (rank 1 exited 2, as for bad input, where the mark was lost on the way).
    full_disk = {"disk_full", "events_refused", "events_fail_mid_run", "events_fail_at_the_end", "predict_unwritten"}
    kinds = ("CheckpointError", "RunDirectoryError", "PermissionError")
    failed = {case for case, outcome in outcomes[0].items() if outcome and outcome[0] in kinds}
    assert full_disk < failed and {"prune_refused", "drop_refused", "look_refused"} < failed
    for case in failed:
        assert outcomes[0][case][2] == outcomes[1][case][2] == (errno.ENOSPC if case in full_disk else None), case
    said = "ampkit: error: could not write checkpoint 'clirun/version_0/checkpoints/step-00000002.pt' (No space left"
    for status, lines in (outcomes[0]["disk_full_cli"], outcomes[1]["disk_full_cli"]):
        assert status == 74 and len(lines) == 1 and lines[0].startswith(said), (status, lines)
    # Rank 0's event files fail mid-run (a full disk): every rank stops with its error within an iteration or two,
    # where rank 1 trained on into the next step's all-reduce and failed there with a DistributedError; the newest
    # checkpoint (saved before the ranks met) resumes to the end on both. Where they fail as the fit ends (closing
    # the writer), after the loop's last agreement, every rank raises it as its fit returns.
    mid_run = "cannot write TensorBoard events under 'midrun/version_0/tensorboard' (No space left on device)"
    for case, run in [("events_fail_mid_run", "midrun"), ("events_fail_at_the_end", "endrun")]:
        assert outcomes[0][case][:3] == outcomes[1][case][:3], case
        assert outcomes[1][case][0] == "RunDirectoryError"
        assert mid_run.replace("midrun", run) in outcomes[1][case][1]
    (step0, *resumed0), (step1, *resumed1) = outcomes[0]["resumed_after_events"], outcomes[1]["resumed_after_events"]
    assert 4 <= step0 == step1 < 8 and resumed0[:2] == resumed1[:2] == ["trained", 8]
    _equal(resumed0[2], resumed1[2])
    # A failed step's note names the checkpoint --resume last continues from: rank 1's disk, which holds none, said
    # "no checkpoint was saved before it" while rank 0 had one. It is rank zero's, the rank that writes them.
    kept = "the newest checkpoint, 'failing/version_0/checkpoints/last.pt', is intact"
    notes = [outcome["failed_at_step_3"] for outcome in outcomes]
    assert all(any(kept in note for note in noted) for noted in notes), notes


def test_ranks_launched_with_different_configs_fail_at_start_up(tmp_path):
    results = launch("mismatch", tmp_path)
    for r in results:
        assert r.returncode != 0
        assert "ranks were launched with different configs" in r.stderr
        assert "trainer.max_steps: rank 0 has 1, rank 1 has 2" in r.stderr


def test_ranks_whose_max_time_dicts_differ_are_named_by_the_setting_as_written(monkeypatch):
    """max_time {hours: 1} on rank 0 and {minutes: 90} on rank 1: one setting named with both values as written, where
    the message listed trainer.max_time.hours and trainer.max_time.minutes, one unit each (a pretend gather of the
    two ranks' configs, in one process)."""
    import torch.distributed as dist

    from ampkit import ConfigError
    from ampkit.config import Config
    from ampkit.trainer.distributed import DistributedEnv, check_same_config

    def config(max_time):
        cfg = OmegaConf.structured(Config)
        cfg.trainer.max_time = max_time
        return cfg

    sent = []

    def all_gather_object(out, value):  # two ranks: rank 1 sends what this process sent first
        sent.append(value)
        out[:] = [value, sent[0]]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    env = DistributedEnv(rank=0, world_size=2)
    check_same_config(config({"minutes": 90}), env)  # rank 1's config, alike on both ranks
    shown = "trainer.max_time: rank 0 has \"{'hours': 1}\", rank 1 has \"{'minutes': 90}\")"
    with pytest.raises(ConfigError, match=re.escape(f"ranks were launched with different configs ({shown}")):
        check_same_config(config({"hours": 1}), env)


def test_plain_dataloaders_are_sharded_and_reseeded_per_epoch():
    from ampkit.trainer.distributed import DistributedEnv, distributed_loader

    loader = DataLoader(toy_dataset(10), batch_size=2, shuffle=True)
    shards = [distributed_loader(loader, 0, DistributedEnv(rank=r, world_size=2), True) for r in range(2)]
    seen = []
    for epoch in range(2):
        order = []
        for shard in shards:
            shard.sampler.set_epoch(epoch)
            order.append([i for batch in shard.sampler for i in [batch]])
        assert sorted(order[0] + order[1]) == list(range(10))
        seen.append(order)
    assert seen[0] != seen[1]


@pytest.mark.parametrize(("world_size", "message"), [
    (2, "its 1 sample dealt to 2 ranks, 1 per rank, fewer than batch_size=2 with drop_last=True (fewer ranks, "),
    (1, "1 sample per epoch, fewer than batch_size=2 with drop_last=True (a smaller batch_size, or drop_last="),
])  # fmt: skip
def test_a_loader_without_a_full_batch_per_rank_is_refused_naming_the_per_rank_share(world_size, message):
    # The error guessed "a batch size above its length?" while the dataset held as many samples as one batch wants
    # under torchrun: the per-rank share is what fell short.
    from ampkit.trainer.distributed import DistributedEnv, distributed_loader
    from ampkit.trainer.user_code import UserCodeError, check_batches

    loader = DataLoader(toy_dataset(1), batch_size=2, shuffle=True, drop_last=True)
    shard = distributed_loader(loader, 0, DistributedEnv(rank=0, world_size=world_size), True)
    with pytest.raises(UserCodeError, match=re.escape(f"train_dataloader() yields no batches: {message}")):
        check_batches(len(shard), "train_dataloader", shard, world_size)


@pytest.mark.parametrize("sampler", ["subset", "weighted"])
def test_a_loader_whose_sampler_chooses_samples_is_refused_under_two_ranks_naming_it(sampler):
    """A DistributedSampler over the whole dataset would replace it: a SubsetRandomSampler's train split trained on
    the samples it had held out for validation, a WeightedRandomSampler's zero-weight samples were drawn."""
    from torch.utils.data import SubsetRandomSampler, WeightedRandomSampler

    from ampkit.trainer.distributed import DistributedEnv, distributed_loader, evaluation_loader

    chosen = SubsetRandomSampler(range(48)) if sampler == "subset" else WeightedRandomSampler([1.0] * 64, 64)
    loader = DataLoader(toy_dataset(64), batch_size=4, sampler=chosen)
    name = type(chosen).__name__
    instead = "Subset" if sampler == "subset" else "draws this rank's share with the weights"  # a Subset has no weights
    with pytest.raises(
        ValueError, match=f"train_dataloader\\(\\)'s sampler {name} cannot be sharded across ranks.*{instead}"
    ):
        distributed_loader(loader, 0, DistributedEnv(rank=0, world_size=2), True)
    with pytest.raises(ValueError, match=f"test_dataloader\\(\\)'s sampler {name} cannot be sharded"):
        evaluation_loader(loader, DistributedEnv(rank=1, world_size=2), "test_dataloader()")
    assert distributed_loader(loader, 0, DistributedEnv(), True) is loader  # one process: used as it is


def test_a_shuffled_loader_draws_the_same_global_batches_in_one_process_as_on_two_ranks():
    """The order is a function of (seed, epoch) and the world size only: one process at batch 2B steps through
    the samples two ranks at batch B do, so a checkpoint resumes on either along the same sequence."""
    from ampkit.trainer.distributed import DistributedEnv, distributed_loader

    dataset = toy_dataset(12)
    one = distributed_loader(DataLoader(dataset, batch_size=4, shuffle=True), 5, DistributedEnv(), True)
    two = [distributed_loader(DataLoader(dataset, batch_size=2, shuffle=True), 5, DistributedEnv(r, 2), True)
           for r in range(2)]  # fmt: skip
    for epoch in range(2):
        for loader in (one, *two):
            loader.sampler.set_epoch(epoch)
        torch.manual_seed(epoch)  # the global RNG plays no part
        steps = [sorted(x.tolist()) for x, _ in one]
        shards = [[x for x, _ in rank] for rank in two]
        assert steps == [sorted(torch.cat(pair).tolist()) for pair in zip(*shards, strict=True)]
    unshuffled = DataLoader(dataset, batch_size=4)
    assert distributed_loader(unshuffled, 5, DistributedEnv(), True) is unshuffled


def test_more_nccl_ranks_than_gpus_is_a_clear_error_before_any_collective(monkeypatch):
    """Two ranks on a one-GPU machine would hang in NCCL's init (seen on an H100 box); they fail at once."""
    from omegaconf import OmegaConf

    from ampkit import ConfigError
    from ampkit.config import Config
    from ampkit.trainer.distributed import setup_distributed

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    cfg = OmegaConf.structured(Config)
    with pytest.raises(ConfigError, match=r"LOCAL_RANK 1 needs cuda:1, but this machine has 1 GPU\(s\)"):
        setup_distributed(cfg)


def test_agreeing_on_each_streamed_batch_exchanges_one_number_whatever_the_world_size(monkeypatch):
    """Under torchrun a stream's every batch is agreed on: a gather of one flag per rank (64 tensors and 64 host
    reads a batch at 64 ranks) where one summed number says whether all have one; the ranks are named, by a
    gather, only once some ran out. Here rank 0 of 64 has 4 batches and every other rank 2."""
    from lightning_utilities.core.rank_zero import rank_zero_only

    from ampkit.trainer import distributed
    from ampkit.trainer.distributed import DistributedEnv, while_every_rank_has_a_batch

    monkeypatch.setattr(rank_zero_only, "rank", 0, raising=False)  # what a Trainer sets under torchrun
    world, calls = 64, []

    def all_reduce(tensor, group=None):  # this rank's flag, plus the other ranks': a batch each for their first two
        calls.append("all_reduce")
        tensor += (world - 1) * (len(calls) <= 2)

    def all_gather(out, tensor, group=None):
        calls.append("all_gather")
        out[0].copy_(tensor)
        for other in out[1:]:
            other.fill_(0)

    monkeypatch.setattr(distributed.dist, "all_reduce", all_reduce)
    monkeypatch.setattr(distributed.dist, "all_gather", all_gather)
    with pytest.warns(UserWarning, match=r"epoch 3: the training data of rank\(s\) 1, 2, .*, 63 ran out after 2 "):
        batches = list(while_every_rank_has_a_batch(iter("abcd"), DistributedEnv(0, world), None, epoch=3))
    assert batches == ["a", "b"]
    assert calls == ["all_reduce", "all_reduce", "all_reduce", "all_gather"]


@pytest.mark.parametrize(
    ("failure", "left"),
    [
        (KeyboardInterrupt(), "KeyboardInterrupt: interrupted (Ctrl-C or SIGINT)"),  # was 'KeyboardInterrupt: '
        (MemoryError(), "MemoryError"),
        (ValueError("bad batch\nmore"), "ValueError: bad batch"),
    ],
)
def test_what_a_failed_rank_leaves_for_the_others_to_name_is_never_an_empty_message(tmp_path, failure, left):
    from types import SimpleNamespace

    import torch.distributed as dist

    from ampkit.trainer.distributed import _leave_failure

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        _leave_failure(failure, SimpleNamespace(rank=0))
        assert dist.distributed_c10d._get_default_store().get("ampkit/failed/0").decode() == left
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("clean", [True, False], ids=["clean", "after-an-error"])
def test_a_gloo_rank_leaving_its_group_frees_the_gil_before_the_destroy(tmp_path, monkeypatch, clean):
    """fit()'s teardown after an exception destroyed the group and ran gc.collect with the GIL held, with no barrier
    to let a gloo worker thread take the GIL to free a finished collective's tensor: its join could hang. A clean
    exit's barrier ends when the collectives are done, not when the threads have let go of them: it sleeps too."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from ampkit.trainer import distributed as trainer_dist

    events: list[str] = []
    destroy = dist.destroy_process_group
    monkeypatch.setattr(trainer_dist, "time", SimpleNamespace(sleep=lambda s: events.append(f"sleep {s}")))
    monkeypatch.setattr(dist, "destroy_process_group", lambda: (events.append("destroy"), destroy())[1])
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        trainer_dist.teardown_distributed(trainer_dist.DistributedEnv(owns_group=True), clean=clean)
    finally:
        if dist.is_initialized():
            destroy()
    assert events == [f"sleep {trainer_dist.GLOO_RELEASE_GRACE_S}", "destroy"]


def test_the_rank_that_arrives_after_its_peers_gave_up_on_it_is_told_it_was_the_slow_one(monkeypatch):
    """Rank 0's collective timed out waiting for a stuck rank 1, named it and left; rank 1, reaching its own collective
    later, found rank 0 checked in and was told 'all ranks are alive; a collective timed out or the ranks diverged'."""
    import torch.distributed as dist

    from ampkit.trainer.distributed import diagnose_failure

    store = dist.HashStore()
    monkeypatch.setattr(dist.distributed_c10d, "_get_default_store", lambda: store)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    timed_out = RuntimeError("[gloo] Timed out waiting 10000ms for recv operation to complete")
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    first = str(diagnose_failure("the all-reduce", timed_out, wait_s=0.2))
    assert first.startswith("rank 0: the all-reduce failed: rank(s) 1 died or stopped responding (RuntimeError: ")
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    late = str(diagnose_failure("the all-reduce", RuntimeError("[gloo] Connection closed by peer"), wait_s=0.2))
    assert late.startswith(
        "rank 1: the all-reduce failed: rank(s) 0 stopped waiting for this rank at an earlier collective and left: "
        "this rank was slower than distributed.timeout_s there"
    ), late
