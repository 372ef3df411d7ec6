"""Checkpoint save/restore (the semantics of Apex's test_checkpointing): O0-O3 x num_losses 1-2.

A run saved mid-way and restored into fresh models/optimizers after a re-``initialize`` continues
bit-identically to the uninterrupted run, scaler state (scale and growth counter) included; under O2 the
fp32 master weights travel in ``optimizer.state_dict()`` (Apex lost them).
"""

import copy
import io
import re

import pytest
import torch

from ampkit.compat import amp

ITERS, SAVE_AFTER = 6, 2


def _build(level, num_losses):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)  # eps representable in fp16 (O3)
    return amp.initialize(model, optimizer, opt_level=level, num_losses=num_losses, scale_window=3, verbosity=0)


def _iteration(model, optimizer, it, num_losses, dynamic):
    generator = torch.Generator().manual_seed(100 + it)
    x = torch.randn(16, 6, generator=generator)
    target = torch.randn(16, 3, generator=generator)
    optimizer.zero_grad()
    out = model(x).float()
    losses = [(out - target).pow(2).mean(), out.abs().mean()][:num_losses]
    for loss_id, loss in enumerate(losses):
        if dynamic and it == 1 and loss_id == num_losses - 1:
            loss = loss * float("inf")
        with amp.scale_loss(loss, optimizer, loss_id=loss_id) as scaled:
            scaled.backward(retain_graph=loss_id + 1 < num_losses)
    optimizer.step()


def _save(*objects):
    buffer = io.BytesIO()
    torch.save(objects, buffer)
    return buffer.getvalue()


@pytest.mark.parametrize("num_losses", [1, 2])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_restored_run_continues_identically(level, num_losses):
    dynamic = level in ("O1", "O2")
    model, optimizer = _build(level, num_losses)
    checkpoint = None
    for it in range(ITERS):
        _iteration(model, optimizer, it, num_losses, dynamic)
        if it == SAVE_AFTER:
            checkpoint = _save(model.state_dict(), optimizer.state_dict(), amp.state_dict())
    final = [p.detach().clone() for p in model.parameters()]
    final_amp = amp.state_dict()
    if dynamic:  # overflow at iteration 1 halves, three clean updates (scale_window=3) double it back
        assert final_amp[f"loss_scaler{num_losses - 1}"] == {"loss_scale": 2.0**16, "unskipped": 1}
        if num_losses == 2:
            assert final_amp["loss_scaler0"] == {"loss_scale": 2.0**18, "unskipped": 0}

    model, optimizer = _build(level, num_losses)
    model_state, optimizer_state, amp_state = torch.load(io.BytesIO(checkpoint))
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    amp.load_state_dict(amp_state)
    for it in range(SAVE_AFTER + 1, ITERS):
        _iteration(model, optimizer, it, num_losses, dynamic)
    assert amp.state_dict() == final_amp
    for restored, uninterrupted in zip(model.parameters(), final, strict=True):
        assert torch.equal(restored, uninterrupted)
    masters = [p.detach() for p in amp.master_params(optimizer)]
    assert all(m.dtype == torch.float32 for m in masters) == (level in ("O0", "O1", "O2"))


def test_o2_weights_loaded_into_the_model_after_initialize_are_trained_from():
    """Apex built O2 masters at the first backward, so `initialize` then `model.load_state_dict(pretrained)`
    trained the pretrained weights; the masters must follow the loaded model, not the initial weights."""
    torch.manual_seed(0)
    pretrained = torch.nn.Linear(4, 2)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    model.load_state_dict(pretrained.state_dict())
    with amp.scale_loss(model(torch.randn(3, 4)).float().mean() * 0.01, optimizer) as scaled:
        scaled.backward()
    optimizer.step()  # lr 0: the weights must stay the loaded ones
    assert torch.equal(model.weight, pretrained.weight.detach().half())
    masters = list(amp.master_params(optimizer))
    assert torch.equal(masters[0], pretrained.weight.detach().half().float())


LEVELS = ["O0", "O1", "O2", "O3"]


def _bn_model():
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


@pytest.mark.parametrize("level", LEVELS)
def test_model_state_dict_holds_float32_at_every_level(level):
    """Apex's O2/O3 register a state-dict hook: checkpoints hold float32 whatever the model runs in."""
    model = _bn_model()
    model, _ = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=level, verbosity=0)
    assert (model[0].weight.dtype == torch.float16) == (level in ("O2", "O3"))
    for key, value in model.state_dict().items():
        assert value.dtype == (torch.int64 if key.endswith("num_batches_tracked") else torch.float32), key


@pytest.mark.parametrize("amp_before_load", [True, False])
@pytest.mark.parametrize("num_losses", [1, 2])
def test_checkpoints_restore_across_every_pair_of_levels_and_training_goes_on(num_losses, amp_before_load):
    for level in LEVELS:
        torch.manual_seed(0)
        model = _bn_model()
        model, optimizer = amp.initialize(
            model, torch.optim.SGD(model.parameters(), lr=1e-2), opt_level=level, num_losses=num_losses, verbosity=0
        )
        for it in range(2):
            _iteration(model, optimizer, it, num_losses, dynamic=False)
        saved = torch.load(io.BytesIO(_save(model.state_dict(), optimizer.state_dict())))
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        for restore_level in LEVELS:
            restored = _bn_model()
            optimizer = torch.optim.SGD(restored.parameters(), lr=1e-2)
            if amp_before_load:
                restored, optimizer = amp.initialize(
                    restored, optimizer, opt_level=restore_level, num_losses=num_losses, verbosity=0
                )
            restored.load_state_dict(saved[0])
            optimizer.load_state_dict(saved[1])
            if not amp_before_load:
                restored, optimizer = amp.initialize(
                    restored, optimizer, opt_level=restore_level, num_losses=num_losses, verbosity=0
                )
            if restore_level in ("O0", "O1"):  # float32 models take the checkpoint's values exactly
                for key, value in restored.state_dict().items():
                    assert torch.equal(value, reference[key]), (level, restore_level, key)
            before = [p.detach().clone() for p in restored.parameters()]
            _iteration(restored, optimizer, 5, num_losses, dynamic=False)
            assert any(not torch.equal(b, p) for b, p in zip(before, restored.parameters(), strict=True))
            assert all(torch.isfinite(p).all() for p in restored.parameters())


def test_o2_checkpoint_holds_the_float32_masters_not_their_fp16_rounding():
    torch.manual_seed(0)
    model = _bn_model()
    model, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=1e-2), opt_level="O2", verbosity=0)
    for it in range(3):
        _iteration(model, optimizer, it, 1, dynamic=False)
    masters = list(amp.master_params(optimizer))
    state = model.state_dict()
    assert torch.equal(state["0.weight"], masters[0]) and not torch.equal(state["0.weight"], model[0].weight.float())


def test_o2_model_deep_copied_for_an_ema_saves_its_own_weights_not_the_masters_of_the_original():
    """Jasper's and timm's EMA is ``copy.deepcopy(model)`` after ``initialize``; its checkpoint is its own."""
    model, optimizer = _build("O2", 1)
    ema = copy.deepcopy(model)
    _iteration(model, optimizer, 0, 1, dynamic=False)
    with torch.no_grad():
        for param in ema.parameters():
            param.mul_(0.5)
    own = {name: param.float() for name, param in ema.named_parameters()}
    saved = ema.state_dict()
    assert saved.keys() == own.keys()
    for name, value in saved.items():
        torch.testing.assert_close(value, own[name], rtol=0, atol=0)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_whole_model_saved_with_torch_save_loads_and_still_casts(level):
    """Scripts that ``torch.save(model)`` rather than its state dict: the cast model pickles with its hooks."""
    model, optimizer = _build(level, 1)
    _iteration(model, optimizer, 0, 1, dynamic=False)
    (loaded,) = torch.load(io.BytesIO(_save(model)), weights_only=False)
    x = torch.randn(4, 6)
    assert loaded[0].weight.dtype == torch.float16
    assert loaded(x).dtype == torch.float32 and torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_whole_model_loaded_and_cast_to_float32_runs_as_a_float32_model(level):
    """An inference script loads the pickled model and calls ``.float()``: its boundary casts stand down (Apex's
    replaced forward did not pickle at all), so float32 inputs meet float32 weights rather than being cast to half,
    and the outputs are the float32 model's own: float64 after ``.double()``."""
    model, optimizer = _build(level, 1)
    _iteration(model, optimizer, 0, 1, dynamic=False)
    (loaded,) = torch.load(io.BytesIO(_save(model)), weights_only=False)
    x = torch.randn(4, 6)
    loaded.float()
    reference = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    reference.load_state_dict(loaded.state_dict())
    torch.testing.assert_close(loaded(x), reference(x), rtol=0, atol=0)
    assert loaded.double()(x.double()).dtype == torch.float64
    loaded.half()  # cast back: its inputs are cast again
    assert loaded(x).dtype == torch.float32 and torch.equal(loaded(x), model(x))


class _HeadFirst(torch.nn.Module):
    """A classifier head declared before the body (its weight is the model's first tensor), run in float32."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(16, 3)
        self.body = torch.nn.Linear(6, 16)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)).float())


def test_a_layer_made_float32_after_initialize_keeps_the_models_input_casts():
    """A script that keeps its head float32 after O2 (``model.head.float()``) still has the rest in half: the
    inputs keep being cast, though the tensor first in the model is no longer half."""
    torch.manual_seed(0)
    model = amp.initialize(_HeadFirst(), opt_level="O2", verbosity=0)
    model.head.float()
    seen = []
    model.body.register_forward_pre_hook(lambda _, args: seen.append(args[0].dtype))
    assert model(torch.randn(4, 6)).dtype == torch.float32
    assert model(torch.randn(4, 6)).dtype == torch.float32
    assert seen == [torch.float16, torch.float16]


def test_load_state_dict_of_a_path_says_it_wants_the_dict():
    _build("O1", 1)
    with pytest.raises(TypeError, match=r"expects the dict from amp.state_dict\(\), got str \(load the file first"):
        amp.load_state_dict("/path/to/file.pt")


def test_each_scalers_state_goes_to_the_loss_its_key_numbers(capsys):
    """Apex went by position: a state dict reordered on its way (a sorted JSON or YAML dump puts loss_scaler10
    before loss_scaler2) gave each loss another's scale, silently. A key beyond num_losses is skipped, as in Apex."""
    _build("O1", 11)
    saved = {f"loss_scaler{i}": {"loss_scale": 2.0**i, "unskipped": i} for i in range(12)}
    amp.load_state_dict(dict(sorted(saved.items())))  # 0, 1, 10, 11, 2, 3, ...
    assert amp.state_dict() == {key: saved[key] for key in (f"loss_scaler{i}" for i in range(11))}
    out = capsys.readouterr().out
    assert "state_dict contains 12 entries, while 11 loss_scalers are used" in out
    assert "Skipping loss_scaler[11], since num_losses was set to 11" in out


def test_a_grad_scaler_state_restores_every_loss_scaler():
    """A native-AMP checkpoint's torch.amp.GradScaler state (one scale for every loss) moving to amp: its scale
    and clean-step count, not an error listing GradScaler's keys."""
    _build("O1", 2)
    native = torch.amp.GradScaler("cpu", init_scale=512.0)
    native._scale, native._growth_tracker = torch.tensor(512.0), torch.tensor(7, dtype=torch.int32)
    amp.load_state_dict(native.state_dict())
    assert amp.state_dict() == {f"loss_scaler{i}": {"loss_scale": 512.0, "unskipped": 7} for i in range(2)}


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_amp_state_loaded_before_initialize_goes_into_the_scalers_initialize_makes(level):
    """Lightning 1.x restores a checkpoint (model, optimizer, then ``amp.load_state_dict``) before its Apex plugin
    calls ``initialize``: the scales are those of the checkpoint, and the run continues as the uninterrupted one."""
    model, optimizer = _build(level, 2)
    for it in range(ITERS):
        _iteration(model, optimizer, it, 2, dynamic=True)
        if it == SAVE_AFTER:
            checkpoint = _save(model.state_dict(), optimizer.state_dict(), amp.state_dict())
    final, final_amp = [p.detach().clone() for p in model.parameters()], amp.state_dict()

    amp._amp_state.reset()  # a new process: amp not initialized yet
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-3)
    model_state, optimizer_state, amp_state = torch.load(io.BytesIO(checkpoint))
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
    amp.load_state_dict(amp_state)
    model, optimizer = amp.initialize(model, optimizer, opt_level=level, num_losses=2, scale_window=3, verbosity=0)
    assert amp.state_dict() == amp_state
    for it in range(SAVE_AFTER + 1, ITERS):
        _iteration(model, optimizer, it, 2, dynamic=True)
    assert amp.state_dict() == final_amp
    for restored, uninterrupted in zip(model.parameters(), final, strict=True):
        assert torch.equal(restored, uninterrupted)


def test_a_whole_training_checkpoint_given_to_amp_load_state_dict_names_its_amp_entry():
    """Apex's README saves {'model': ..., 'optimizer': ..., 'amp': amp.state_dict()}; handing that whole dict over is
    the usual slip, refused as Apex refused it, and now saying which entry to pass."""
    _build("O1", 1)
    checkpoint = {"model": {}, "optimizer": {}, "amp": amp.state_dict()}
    with pytest.raises(RuntimeError, match=re.escape("(a whole checkpoint: pass its 'amp' entry")):
        amp.load_state_dict(checkpoint)
    amp.load_state_dict(checkpoint["amp"])


def test_amp_state_with_foreign_keys_is_refused_before_initialize_too():
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "optimizer"'):
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0, "unskipped": 0}, "optimizer": {}})
    _build("O1", 1)
    assert amp.state_dict() == {"loss_scaler0": {"loss_scale": 2.0**16, "unskipped": 0}}
