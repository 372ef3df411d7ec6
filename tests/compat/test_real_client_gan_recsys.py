"""How a GAN toolbox, a recommender benchmark and a vision-language fine-tuner used Apex, one program per test
(written here after the projects' own code, CPU-sized):

- open-mmlab/mmgeneration's ``apex_amp`` path: one GAN module, its two optimizers from a dict through one O1
  ``initialize`` with ``num_losses=2``, ``loss_id`` per loss, an R1 gradient penalty scaled by hand with
  ``_amp_state.loss_scalers[0]``; with torch's own ``parametrizations.spectral_norm`` in the discriminator too;
- ajtulloch/sparse-ads-baselines' ``FastZeroFusedSGD``: a ``FusedSGD`` subclass zeroing gradients through
  ``amp_C.multi_tensor_scale`` by 0, and its ``amp_zero_grad`` over Apex's O2 lists installed as ``zero_grad``;
- CLIP-ViL's VQA/SNLI fine-tuning: its ``FusedOptimizer``, an ``Optimizer`` subclass that never calls ``__init__``
  and shares the param groups of an AdamW and an SGD, taken apart for ``initialize``, rebuilt after it, and
  handed whole to ``amp.master_params``.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


class _Generator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.LeakyReLU(0.2), torch.nn.Linear(16, 6))

    def forward(self, noise: torch.Tensor | None, num_batches: int = 0) -> torch.Tensor:
        if noise is None:  # mmgen's generators draw their own noise
            noise = torch.randn(num_batches, 4)
        return self.net(noise)


def _discriminator(spectral_norm=None) -> torch.nn.Module:
    wrap = spectral_norm or (lambda layer: layer)
    return torch.nn.Sequential(wrap(torch.nn.Linear(6, 16)), torch.nn.LeakyReLU(0.2), wrap(torch.nn.Linear(16, 1)))


class _StaticUnconditionalGAN(torch.nn.Module):
    """mmgen's GAN module in outline: generator, discriminator and an EMA generator deep-copied in ``__init__``."""

    def __init__(self, spectral_norm=None) -> None:
        super().__init__()
        self.generator = _Generator()
        self.discriminator = _discriminator(spectral_norm)
        self.generator_ema = copy.deepcopy(self.generator)


def _apex_amp_initialize(model, optimizers, init_args):
    """mmgen's ``apex_amp_initialize(mode='gan')``: the dict's two optimizers go through ``initialize`` as a list."""
    from apex import amp

    listed = [optimizers["generator"], optimizers["discriminator"]]
    model, listed = amp.initialize(model, listed, **init_args)
    optimizers["generator"], optimizers["discriminator"] = listed
    return model, optimizers


def _r1_gradient_penalty(discriminator, real_data, use_apex_amp: bool) -> torch.Tensor:
    """mmgen's ``r1_gradient_penalty_loss``: scale the prediction by scaler 0's scale, unscale the input gradient."""
    real_data = real_data.clone().requires_grad_()
    disc_pred = discriminator(real_data)
    if use_apex_amp:
        from apex.amp._amp_state import _amp_state

        loss_scaler = _amp_state.loss_scalers[0]
        disc_pred = loss_scaler.loss_scale() * disc_pred.float()
    gradients = torch.autograd.grad(
        outputs=disc_pred, inputs=real_data, grad_outputs=torch.ones_like(disc_pred), create_graph=True
    )[0]
    if use_apex_amp:
        gradients = gradients * (1.0 / loss_scaler.loss_scale())
    return (gradients.norm(2, dim=1) ** 2).mean()


def _mmgen_run(init_args: dict | None, steps: int = 4, spectral_norm=None) -> list[tuple[float, ...]]:
    """mmgen's ``StaticUnconditionalGAN.train_step`` with a discriminator R1 penalty, clipping each model's gradients
    through its parameters as its ``clip_grads`` does. Returns, per step, what it logs: the discriminator's loss,
    the penalty, the generator's loss, and the two gradient norms."""
    from apex import amp

    torch.manual_seed(0)
    model = _StaticUnconditionalGAN(spectral_norm)
    optimizers = {
        "generator": torch.optim.Adam(model.generator.parameters(), lr=1e-3, betas=(0.0, 0.99)),
        "discriminator": torch.optim.Adam(model.discriminator.parameters(), lr=1e-3, betas=(0.0, 0.99)),
    }
    use_apex_amp = init_args is not None
    if use_apex_amp:
        model, optimizers = _apex_amp_initialize(model, optimizers, init_args)
    history = []
    for step in range(steps):
        torch.manual_seed(100 + step)
        real_imgs = torch.randn(8, 6)
        model.discriminator.requires_grad_(True)
        optimizers["discriminator"].zero_grad()
        with torch.no_grad():
            fake_imgs = model.generator(None, num_batches=8)
        disc_pred_fake, disc_pred_real = model.discriminator(fake_imgs), model.discriminator(real_imgs)
        penalty = _r1_gradient_penalty(model.discriminator, real_imgs, use_apex_amp)
        loss_disc = F.softplus(disc_pred_fake).mean() + F.softplus(-disc_pred_real).mean() + 10.0 * penalty
        if use_apex_amp:
            with amp.scale_loss(loss_disc, optimizers["discriminator"], loss_id=0) as scaled_loss_disc:
                scaled_loss_disc.backward()
        else:
            loss_disc.backward()
        disc_norm = torch.nn.utils.clip_grad_norm_(model.discriminator.parameters(), max_norm=10.0)
        optimizers["discriminator"].step()

        model.discriminator.requires_grad_(False)
        optimizers["generator"].zero_grad()
        loss_gen = F.softplus(-model.discriminator(model.generator(None, num_batches=8))).mean()
        if use_apex_amp:
            with amp.scale_loss(loss_gen, optimizers["generator"], loss_id=1) as scaled_loss_gen:
                scaled_loss_gen.backward()
        else:
            loss_gen.backward()
        gen_norm = torch.nn.utils.clip_grad_norm_(model.generator.parameters(), max_norm=10.0)
        optimizers["generator"].step()
        history.append((loss_disc.item(), penalty.item(), loss_gen.item(), disc_norm.item(), gen_norm.item()))
    return history


def test_mmgeneration_gan_with_an_r1_penalty_scaled_through_amp_state_tracks_float32(shim):
    """mmgen's configs: ``apex_amp = dict(mode='gan', init_args=dict(opt_level='O1', num_losses=2,
    loss_scale=512.))``. The penalty's input gradient, scaled and unscaled by hand with scaler 0's scale, and both
    losses and the gradient norms follow the float32 run to fp16's precision."""
    from apex.amp._amp_state import _amp_state

    reference = _mmgen_run(None)
    mixed = _mmgen_run(dict(opt_level="O1", num_losses=2, loss_scale=512.0, verbosity=0))
    assert len(_amp_state.loss_scalers) == 2
    assert [s.loss_scale() for s in _amp_state.loss_scalers] == [512.0, 512.0]
    for step, step_ref in zip(mixed, reference, strict=True):
        assert step[1] == pytest.approx(step_ref[1], rel=2e-2, abs=1e-4)  # the penalty
        assert step[:1] + step[2:] == pytest.approx(step_ref[:1] + step_ref[2:], rel=1e-2)


def test_torchs_parametrized_spectral_norm_runs_under_o1_as_in_float32(shim):
    """``torch.nn.utils.parametrizations.spectral_norm`` (torch's replacement for the old ``spectral_norm``) takes
    ``torch.vdot`` of its float32 ``u`` buffer and an O1-cast ``torch.mv``: Apex's lists promote ``dot`` but
    predate ``vdot``, and torch refused the mix ("dot : expected both vectors to have same dtype")."""
    from torch.nn.utils.parametrizations import spectral_norm

    reference = _mmgen_run(None, spectral_norm=spectral_norm)
    mixed = _mmgen_run(dict(opt_level="O1", num_losses=2, loss_scale=512.0, verbosity=0), spectral_norm=spectral_norm)
    for step, step_ref in zip(mixed, reference, strict=True):
        assert step[:1] + step[2:] == pytest.approx(step_ref[:1] + step_ref[2:], rel=1e-2)
    half, single = torch.randn(5).half(), torch.randn(5)
    assert torch.vdot(single, half).dtype == torch.float32
    assert single.vdot(half) == pytest.approx(torch.vdot(single, half.float()).item())
    assert torch.inner(half, single).dtype == half.inner(single).dtype == torch.float32  # dot's other kin


def _fast_zero_fused_sgd():
    """sparse-ads-baselines' ``FastZeroFusedSGD``, its zeroing kernels as in its ``sparse_embedding_cuda_ops.py``."""
    import amp_C
    import apex

    class FastZeroFusedSGD(apex.optimizers.FusedSGD):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self._overflow_buf = torch.IntTensor([0])  # torch.cuda.IntTensor in the program

        def zero_grad(self) -> None:
            grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
            if not grads:
                return
            for grad in grads:
                grad.detach_()
            apex.multi_tensor_apply.multi_tensor_applier(
                amp_C.multi_tensor_scale, self._overflow_buf, [grads, grads], 0.0
            )

        def amp_zero_grad(self) -> None:
            stash = self._amp_stash
            self._amp_lazy_init()
            groups = [stash.all_fp16_params, stash.all_fp32_from_fp32_params]
            grads = [p.grad for group in groups for p in group if p.grad is not None]
            if not grads:
                return
            for grad in grads:
                grad.detach_()
            apex.multi_tensor_apply.multi_tensor_applier(
                amp_C.multi_tensor_scale, self._overflow_buf, [grads, grads], 0.0
            )
            for param in self._amp_stash.all_fp32_from_fp16_params:
                param.grad = None

    return FastZeroFusedSGD


def _sparse_ads_run(opt_level: str | None, steps: int = 4) -> list[float]:
    """Its benchmark's ``forward_backward_update``: dense and over arches, a BCE criterion, ``zero_grad`` first."""
    from apex import amp

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    optimizer = _fast_zero_fused_sgd()(net.parameters(), lr=0.05)
    if opt_level is not None:
        net, optimizer = amp.initialize(net, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)
        optimizer.zero_grad = optimizer.amp_zero_grad
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        dense_features, labels = torch.randn(16, 6, generator=g), torch.rand(16, 1, generator=g)
        optimizer.zero_grad()
        loss = F.binary_cross_entropy_with_logits(net(dense_features).float(), labels)
        if opt_level is not None:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_sparse_ads_amp_zero_grad_over_apexs_o2_lists_trains_as_float32(shim):
    """At O2 its ``amp_zero_grad`` zeroes the fp16 and the batch norm's fp32 gradients in place through
    ``multi_tensor_scale`` by 0 and drops the masters' (Apex's lists), and the run follows float32's."""
    reference = _sparse_ads_run(None)
    assert _sparse_ads_run("O2") == pytest.approx(reference, rel=2e-3)


@pytest.mark.parametrize("opt_level", ["O1", "O3"])
def test_sparse_ads_amp_zero_grad_without_masters_is_apexs_attribute_error(shim, opt_level):
    """Without masters Apex's stash had no ``all_fp32_from_fp32_params`` (nor ``all_fp32_from_fp16_params``): the
    program's ``amp_zero_grad`` stopped there. An empty list instead let it zero nothing at O1, so every step added
    its gradients to the earlier ones'."""
    with pytest.raises(
        AttributeError, match=r"all_fp32_from_fp32_params .*\(O2\).*all_fp16_params and all_fp32_params"
    ):
        _sparse_ads_run(opt_level)
    from apex import amp

    model = torch.nn.Linear(2, 2)
    _, optimizer = amp.initialize(model, torch.optim.SGD(model.parameters(), lr=0.1), opt_level=opt_level, verbosity=0)
    stash = optimizer._amp_stash
    assert not hasattr(stash, "all_fp32_from_fp16_params")
    assert hasattr(stash, "all_fp16_params") and hasattr(stash, "all_fp32_params")


class _FusedOptimizer(torch.optim.Optimizer):
    """CLIP-ViL's ``lxrt.visual_transformers.FusedOptimizer``: the param groups of several optimizers, one ``step``."""

    def __init__(self, optimizers) -> None:  # no Optimizer.__init__, as in the program
        self.optimizers = optimizers
        param_groups = []
        for optimizer in self.optimizers:
            param_groups += optimizer.param_groups
        self.param_groups = param_groups

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()


class _VisualQA(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.visual_model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
        )  # fmt: skip
        self.head = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 3))

    def forward(self, feats: torch.Tensor) -> torch.Tensor:
        return self.head(self.visual_model(feats))


def _clip_vil_run(opt_level: str | None, steps: int = 4, accumulation: int = 2) -> list[tuple[float, float]]:
    """CLIP-ViL's ``--use_separate_optimizer_for_visual`` path: AdamW over the language side's decay groups, SGD over
    the visual model, a warmup schedule built on the AdamW before ``initialize``, accumulation, clipping through
    ``amp.master_params`` of the rebuilt wrapper, ``model.zero_grad()``. Returns (loss, grad norm) per step."""
    from apex import amp

    torch.manual_seed(0)
    model = _VisualQA()
    no_decay = ["bias", "LayerNorm.weight"]
    named = [(n, p) for n, p in model.named_parameters() if "visual_model" not in n]
    groups = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optim = torch.optim.AdamW(groups, lr=1e-3, eps=1e-6)
    sgd = torch.optim.SGD(model.visual_model.parameters(), 0.05, momentum=0.9, weight_decay=1e-4)
    fused = _FusedOptimizer([optim, sgd])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: min(1.0, (step + 1) / 3))
    if opt_level is not None:
        model, [optim, sgd] = amp.initialize(model, fused.optimizers, enabled=True, opt_level=opt_level,
                                             loss_scale=128.0, verbosity=0)  # fmt: skip
        fused = _FusedOptimizer([optim, sgd])
    criterion = torch.nn.CrossEntropyLoss(ignore_index=-1)
    history = []
    for i in range(steps * accumulation):
        g = torch.Generator().manual_seed(i)
        feats, target = torch.randn(4, 3, 8, 8, generator=g), torch.randint(0, 3, (4,), generator=g)
        loss = criterion(model(feats).float(), target) / accumulation
        if opt_level is not None:
            with amp.scale_loss(loss, fused.optimizers) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        if (i + 1) % accumulation == 0:
            params = amp.master_params(fused) if opt_level is not None else model.parameters()
            total_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            fused.step()
            scheduler.step()
            model.zero_grad()
            history.append((loss.item() * accumulation, total_norm.item()))
    return history


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_clip_vil_two_optimizers_behind_its_fused_wrapper_track_float32(shim, opt_level):
    """The wrapper rebuilt after ``initialize`` shares the amp optimizers' param groups, so ``amp.master_params``
    of it yields the masters at O2 (as Apex's, which read ``param_groups``): the clipped norm and the losses
    follow the float32 run."""
    reference = _clip_vil_run(None)
    mixed = _clip_vil_run(opt_level)
    for step, step_ref in zip(mixed, reference, strict=True):
        assert step == pytest.approx(step_ref, rel=2e-3)
