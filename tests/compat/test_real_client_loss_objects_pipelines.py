"""Round nineteen of real Apex programs, one pattern per test (written here after the programs' own code, CPU-sized):

- kerosene (``kerosene/training/trainers.py``, 2019-20): an ``ApexLoss`` object that carries its loss id and optimizer,
  is combined by arithmetic (``+``, ``*``, ``/``, ``mean()``) and backpropagates through
  ``amp.scale_loss(loss, optimizer, loss_id=...)`` with ``scaled_loss.backward(gradient, retain_graph, create_graph)``
  positional; each model trainer calls ``amp.initialize`` on its own model with ``num_losses`` = number of trainers;
- ESPnet's ``asr.py --train-dtype O1`` updater: the loss divided by ``accum_grad``, the model's parameters clipped, and
  ``optimizer.step()`` left out when the gradient norm is nan;
- Huawei vega's trainer with ``horovod`` (``vega/trainer/trainer_torch.py``, ``_set_amp_loss``): Horovod's
  ``DistributedOptimizer`` passed to ``amp.initialize``, ``optimizer.synchronize()`` inside the ``scale_loss`` block,
  then ``optimizer.step()`` under ``optimizer.skip_synchronize()``;
- microsoft/varuna's pipeline stages call ``amp.scale_loss(..., delay_overflow_check=True, last_partition=...)``, a
  keyword of varuna's own ``apex.patch``, not of Apex.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


class _ApexLoss:
    """kerosene's ``ApexLoss``: a loss tensor with its amp loss id and optimizer, combined in place by arithmetic."""

    def __init__(self, loss_id, loss, optimizer):
        self._loss_id, self._loss, self._optimizer = loss_id, loss, optimizer

    @property
    def loss(self):
        return self._loss

    def backward(self, gradient=None, retain_graph=False, create_graph=False):
        from apex import amp

        with amp.scale_loss(self._loss, self._optimizer, loss_id=self._loss_id) as scaled_loss:
            scaled_loss.backward(gradient, retain_graph, create_graph)

    def mean(self):
        self._loss = torch.mean(self._loss)
        return self

    def __add__(self, other):
        self._loss = torch.add(self._loss, other.loss if isinstance(other, _ApexLoss) else other)
        return self

    def __mul__(self, other):
        self._loss = torch.mul(self._loss, other.loss if isinstance(other, _ApexLoss) else other)
        return self

    __rmul__ = __mul__

    def __truediv__(self, other):
        self._loss = torch.div(self._loss, other.loss if isinstance(other, _ApexLoss) else other)
        return self


class _ModelTrainer:
    """kerosene's ``ApexModule``/``ModelTrainer``: one model and its optimizer, ``initialize``d on their own."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def initialize(self, amp_id: int, num_losses: int, opt_level: str) -> None:
        from apex import amp

        self.amp_id = amp_id
        self.model, self.optimizer = amp.initialize(
            self.model, self.optimizer, opt_level=opt_level, num_losses=num_losses, verbosity=0
        )

    def compute_loss(self, loss):
        return _ApexLoss(self.amp_id, loss, self.optimizer)


def _kerosene_run(opt_level: str, iterations: int = 6):
    """A segmenter and a discriminator trained kerosene's way: an adversarial term added to the segmenter's loss,
    which keeps its graph (``retain_graph``) for the discriminator's loss on the same prediction."""
    from apex import amp

    torch.manual_seed(0)
    seg = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    disc = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    trainers = [
        _ModelTrainer(seg, torch.optim.SGD(seg.parameters(), lr=0.1)),
        _ModelTrainer(disc, torch.optim.SGD(disc.parameters(), lr=0.1)),
    ]
    for amp_id, trainer in enumerate(trainers):
        trainer.initialize(amp_id, num_losses=len(trainers), opt_level=opt_level)
    seg_t, disc_t = trainers
    losses = []
    for i in range(iterations):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        seg_t.optimizer.zero_grad()
        pred = seg_t.model(x)
        seg_loss = seg_t.compute_loss(F.cross_entropy(pred.float(), y, reduction="none")).mean()
        adv = disc_t.model(pred.softmax(-1)).float().mean()
        total = seg_loss * 0.5 + adv * 0.1
        total.backward(None, True)  # retain_graph, positional, as kerosene passes it on
        seg_t.optimizer.step()
        disc_t.optimizer.zero_grad()  # the adversarial term's gradients were scaled by loss 0's scale: dropped here
        disc_loss = disc_t.compute_loss(disc_t.model(pred.detach().softmax(-1)).float().pow(2)).mean() / 2
        disc_loss.backward()
        disc_t.optimizer.step()
        losses.append((total.loss.item(), disc_loss.loss.item()))
    weights = [p.detach().float().clone() for t in trainers for p in amp.master_params(t.optimizer)]
    return losses, weights, [s.loss_scale() for s in amp._amp_state.loss_scalers]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_kerosene_apex_loss_objects_train_two_models_as_float32(shim, opt_level):
    """Two ``initialize`` calls (one per trainer, ``num_losses=2`` each), losses built by arithmetic on ``ApexLoss``
    objects, the first backward keeping its graph through the positional ``retain_graph``: the losses and weights
    follow O0's run, and each loss id has its own dynamic scale."""
    (losses, weights, scales), (losses0, weights0, scales0) = _kerosene_run(opt_level), _kerosene_run("O0")
    assert scales0 == [1.0, 1.0] and scales == [2.0**16, 2.0**16]
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)
    for ours, full in zip(weights, weights0, strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=5e-3)


def _varuna_stages(opt_level: str, last_partition_keyword: bool):
    """Two pipeline stages in one process, varuna's way: the last stage backpropagates its loss, the first the
    activations it sent, with the gradient the last stage sent back (``delay_overflow_check=True`` on both)."""
    from apex import amp

    torch.manual_seed(0)
    first, last = torch.nn.Linear(6, 16), torch.nn.Sequential(torch.nn.Tanh(), torch.nn.Linear(16, 3))
    opt_first = torch.optim.SGD(first.parameters(), lr=0.1)
    opt_last = torch.optim.SGD(last.parameters(), lr=0.1)
    [first, last], [opt_first, opt_last] = amp.initialize(
        [first, last], [opt_first, opt_last], opt_level=opt_level, verbosity=0
    )
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
    sent = first(x)
    received = sent.detach().requires_grad_()
    loss = F.cross_entropy(last(received).float(), y)
    extra = {"last_partition": True} if last_partition_keyword else {}
    with amp.scale_loss(loss, opt_last, delay_overflow_check=True, **extra) as scaled_loss:
        scaled_loss.backward()
    grad_back = received.grad  # scaled by the loss scale: the next stage's backward multiplied it
    scale = amp._amp_state.loss_scalers[0].loss_scale()
    with amp.scale_loss(sent, opt_first, delay_overflow_check=True) as scaled_sent:
        scaled_sent.backward(grad_back.to(scaled_sent.dtype) / scale)
    return [p.grad.float().clone() for p in (*first.parameters(), *last.parameters())]


def test_varuna_last_partition_keyword_is_refused_naming_what_to_write_instead(shim):
    """``last_partition`` is varuna's patch of Apex, not Apex's: a ``TypeError`` (as stock Apex raised) that names
    varuna's patch and the rewrite. The rewrite, the received gradient divided by the scale, gives the first stage
    the gradients of the whole float32 model."""
    with pytest.raises(TypeError, match=r"last_partition.*varuna.*apex\.patch.*loss_scale\(\)"):
        _varuna_stages("O1", last_partition_keyword=True)
    grads, grads0 = _varuna_stages("O1", last_partition_keyword=False), _varuna_stages("O0", False)
    for ours, full in zip(grads, grads0, strict=True):
        assert math.isfinite(ours.abs().max().item())
        torch.testing.assert_close(ours, full, rtol=0, atol=2e-3)


class _NoamOpt:
    """ESPnet's ``NoamOpt``: sets the learning rate from its own step count, then steps ``self.optimizer``."""

    def __init__(self, model_size: int, factor: float, warmup: int, optimizer) -> None:
        self.optimizer, self._step, self.warmup, self.factor, self.model_size = optimizer, 0, warmup, factor, model_size

    def rate(self) -> float:
        return self.factor * self.model_size**-0.5 * min(self._step**-0.5, self._step * self.warmup**-1.5)

    def step(self) -> None:
        self._step += 1
        for p in self.optimizer.param_groups:
            p["lr"] = self.rate()
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()


def test_espnet_updater_nan_guard_leaves_apex_skip_for_the_next_update(shim, capsys):
    """ESPnet's ``--train-dtype O1 --opt noam --accum-grad 2``: ``amp.initialize`` on ``NoamOpt.optimizer``, each
    micro-batch's loss divided by ``accum_grad`` in its own ``scale_loss``, the model's parameters clipped, and no
    ``step()`` when the norm is nan. A nan input overflows: ESPnet skips that update itself, so the one-shot skip amp
    installed stays for the next update, which Apex skipped too (printing its overflow message then). The loss scale
    halves once, and every later update steps."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    optimizer = _NoamOpt(8, 1.0, 25, torch.optim.Adam(model.parameters(), lr=0, betas=(0.9, 0.98), eps=1e-9))
    model, optimizer.optimizer = amp.initialize(model, optimizer.optimizer, opt_level="O1", verbosity=0)
    accum_grad, changed, skipped_by_guard = 2, [], []
    for update in range(5):
        before = [p.detach().clone() for p in model.parameters()]
        for micro in range(accum_grad):
            g = torch.Generator().manual_seed(10 * update + micro)
            x, y = torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g)
            if update == 1 and micro == 0:
                x[0, 0] = float("nan")
            loss = F.cross_entropy(model(x).float(), y) / accum_grad
            with amp.scale_loss(loss, optimizer.optimizer) as scaled_loss:
                scaled_loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
        skipped_by_guard.append(math.isnan(grad_norm))
        if not math.isnan(grad_norm):
            amp._amp_state.verbosity = 1 if update == 2 else 0  # the message of the pending skip, where it fires
            optimizer.step()
        optimizer.zero_grad()
        changed.append(any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True)))
    assert skipped_by_guard == [False, True, False, False, False]
    assert changed == [True, False, False, True, True]
    assert "Gradient overflow.  Skipping step, loss scaler 0 reducing loss scale to 32768.0" in capsys.readouterr().out
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
    assert optimizer._step == 4  # NoamOpt counted the update amp skipped, as under Apex


class _HorovodDistributedOptimizer(torch.optim.Optimizer):
    """horovod.torch's ``_DistributedOptimizer`` in outline: a hook on each parameter's gradient accumulator starts
    an allreduce of ``p.grad``; ``synchronize()`` starts one for each parameter whose hook did not fire, waits for
    them and writes each result into ``p.grad`` with ``set_``. Here one rank averages with a rank whose gradients are
    zero, so a synchronized gradient is half the local one."""

    def __init__(self, params, named_parameters):
        super(self.__class__, self).__init__(params)
        self._parameter_names = {v: k for k, v in named_parameters}
        self._handles, self._grad_accs, self._should_synchronize = {}, [], True
        self._requires_update = {p for group in self.param_groups for p in group["params"] if p.requires_grad}
        for group in self.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                    grad_acc.register_hook(self._make_hook(p))
                    self._grad_accs.append(grad_acc)

    def _allreduce_grad_async(self, p):
        return p.grad.detach().clone() / 2  # allreduce_async_(op=Average) over two ranks

    def _make_hook(self, p):
        def hook(*ignore):
            self._handles[p] = self._allreduce_grad_async(p)

        return hook

    def synchronize(self):
        for p in self._requires_update - set(self._handles):
            if p.grad is not None:
                self._handles[p] = self._allreduce_grad_async(p)
        for p, output in self._handles.items():
            p.grad.set_(output)
        self._handles.clear()

    @contextlib.contextmanager
    def skip_synchronize(self):
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            self.synchronize()
        return super(self.__class__, self).step(closure)


def _horovod_distributed_optimizer(optimizer, named_parameters):
    """``hvd.DistributedOptimizer``: a class made on the fly from the optimizer's own and Horovod's methods."""
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), dict(_HorovodDistributedOptimizer.__dict__))
    return cls(optimizer.param_groups, named_parameters)


def _vega_horovod_run(opt_level: str, iterations: int = 6):
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    optimizer = _horovod_distributed_optimizer(optimizer, model.named_parameters())
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, verbosity=0)
    losses = []
    for i in range(iterations):
        g = torch.Generator().manual_seed(i)
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
            optimizer.synchronize()
        with optimizer.skip_synchronize():
            optimizer.step()
        losses.append(loss.item())
    return losses, [p.detach().float().clone() for p in amp.master_params(optimizer)]


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_vega_horovod_synchronize_inside_scale_loss_steps_on_the_averaged_gradients(shim, opt_level):
    """Horovod writes the averaged gradients into ``p.grad`` inside the ``scale_loss`` block; the block's exit
    unscales those, and the step (its own synchronize skipped) uses them: O1 and O2 follow O0's run, which steps on
    the averaged (halved) gradients. At O2 the hooks Horovod put on the float32 parameters' accumulators no longer
    fire once the model is cast (torch makes new ones for the half parameters, with Apex too):
    ``synchronize()`` allreduces those parameters itself, as Horovod does for any parameter its hooks missed."""
    (losses, weights), (losses0, weights0) = _vega_horovod_run(opt_level), _vega_horovod_run("O0")
    torch.testing.assert_close(losses, losses0, rtol=0, atol=5e-3)
    for ours, full in zip(weights, weights0, strict=True):
        torch.testing.assert_close(ours, full, rtol=0, atol=5e-3)
