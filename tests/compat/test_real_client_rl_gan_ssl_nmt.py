"""How a reinforcement-learning, a GAN, a self-supervised and a translation program used Apex, one program per test
(written here after the projects' own code, CPU-sized): kanachan's implicit Q-learning (three O2 ``initialize``
calls, target networks updated from the masters), lucidrains' stylegan2-pytorch before it moved to native AMP
(gradient and path-length penalties through ``torch.autograd.grad(create_graph=True)`` under O1, three losses),
SwAV's training loop (LARC at O1, prototypes' gradients dropped, its ``restart_from_checkpoint``) and OpenNMT-py's
``-apex_opt_level`` path (the model and its own generator submodule passed to ``initialize`` as two models). Their
two-rank parts (Apex DDP around kanachan's frozen target networks) are in ``test_apex_parallel.py``."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


class _QModel(torch.nn.Module):
    """kanachan's encoder-decoder value and Q models in outline: integer features, a transformer layer, a head."""

    def __init__(self, outputs: int) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(10, 8)
        self.encoder = torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.decoder = torch.nn.Linear(8, outputs)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.encoder(self.embedding(features)).mean(1))


def _iql_networks(seed: int):
    from apex import amp
    from apex.optimizers import FusedLAMB

    torch.manual_seed(seed)
    value, q_source = _QModel(1), _QModel(4)
    q_target = _QModel(4)
    q_target.requires_grad_(False)
    q_target.load_state_dict(q_source.state_dict())
    value_optimizer = FusedLAMB(value.parameters(), lr=1e-3, eps=1e-6)
    q_optimizer = FusedLAMB(q_source.parameters(), lr=1e-3, eps=1e-6)
    # one initialize per model, as kanachan: each replaces amp's scalers, so the last one's serves every loss
    value, value_optimizer = amp.initialize(value, value_optimizer, opt_level="O2", verbosity=0)
    q_source, q_optimizer = amp.initialize(q_source, q_optimizer, opt_level="O2", verbosity=0)
    return value, q_source, q_target, value_optimizer, q_optimizer


def _iql_steps(networks, first: int, count: int) -> list[float]:
    """kanachan's ``_training``: an expectile value loss against the frozen target, a Q loss against the value, each
    in its own ``scale_loss``, accumulated over two batches; clipping through the masters; the target moved towards
    the source's fp32 masters in place."""
    from apex import amp

    value, q_source, q_target, value_optimizer, q_optimizer = networks
    losses = []
    for step in range(first, first + count):
        g = torch.Generator().manual_seed(step)
        features, actions = torch.randint(0, 10, (6, 5), generator=g), torch.randint(0, 4, (6,), generator=g)
        reward, rows = torch.randn(6, generator=g), torch.arange(6)
        with torch.no_grad():
            q = q_target(features)[rows, actions]
        error = q - value(features)[:, 0]
        value_loss = torch.where(error < 0.0, 0.3 * error**2, 0.7 * error**2).mean() / 2
        with amp.scale_loss(value_loss, value_optimizer) as scaled:
            scaled.backward()
        with torch.no_grad():
            next_value = value(features)[:, 0] * 0.9
        q_loss = ((reward + next_value - q_source(features)[rows, actions]) ** 2).mean() / 2
        with amp.scale_loss(q_loss, q_optimizer) as scaled:
            scaled.backward()
        losses += [value_loss.item(), q_loss.item()]
        if step % 2 == 1:
            for optimizer in (value_optimizer, q_optimizer):
                grads = [p.grad.flatten() for p in amp.master_params(optimizer) if p.grad is not None]
                losses.append(torch.linalg.vector_norm(torch.cat(grads)).item())
                torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0, error_if_nonfinite=False)
                optimizer.step()
                optimizer.zero_grad()
            for source, target in zip(amp.master_params(q_optimizer), q_target.parameters(), strict=True):
                target *= 0.9
                target += 0.1 * source
    return losses


def test_kanachan_iql_three_o2_models_one_scaler_and_targets_moved_from_the_masters_resume_exactly(shim):
    """Each ``initialize`` replaced Apex's scalers, so both losses share the last call's; the frozen target follows
    the source's fp32 masters (in the model's parameter order); snapshots of the models, optimizers and amp, loaded
    after ``initialize`` into networks built from another seed, continue bit for bit."""
    from apex import amp

    networks = _iql_networks(seed=0)
    assert len(amp._amp_state.loss_scalers) == 1
    first = _iql_steps(networks, 0, 4)
    snapshot = io.BytesIO()
    value, q_source, q_target, value_optimizer, q_optimizer = networks
    torch.save(
        {
            "value": value.state_dict(),
            "q_source": q_source.state_dict(),
            "q_target": q_target.state_dict(),
            "value_optimizer": value_optimizer.state_dict(),
            "q_optimizer": q_optimizer.state_dict(),
            "amp": amp.state_dict(),
        },
        snapshot,
    )
    straight = _iql_steps(networks, 4, 4)
    want = [p.detach().clone() for m in networks[:3] for p in m.parameters()]
    assert all(v.dtype == torch.float32 for v in value.state_dict().values() if v.is_floating_point())
    assert first[0] != first[4], "training moved the value network"

    snapshot.seek(0)
    saved = torch.load(snapshot, weights_only=True)
    resumed = _iql_networks(seed=1)
    for model, key in zip(resumed[:3], ("value", "q_source", "q_target"), strict=True):
        model.load_state_dict(saved[key])
    resumed[3].load_state_dict(saved["value_optimizer"])
    resumed[4].load_state_dict(saved["q_optimizer"])
    amp.load_state_dict(saved["amp"])
    assert _iql_steps(resumed, 4, 4) == straight
    got = [p.detach() for m in resumed[:3] for p in m.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


class _Generator(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.to_image = torch.nn.Linear(8, 3 * 8 * 8)

    def forward(self, styles: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.to_image(styles)).view(-1, 3, 8, 8)


def _discriminator() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1), torch.nn.LeakyReLU(0.2), torch.nn.Flatten(), torch.nn.Linear(256, 1)
    )


def _discriminator_loss(discriminator, generated, real):
    """stylegan2-pytorch's hinge loss with its gradient penalty, taken with ``create_graph=True``."""
    real_output, fake_output = discriminator(real), discriminator(generated.clone().detach())
    divergence = (F.relu(1 + real_output) + F.relu(1 - fake_output)).mean()
    (gradients,) = torch.autograd.grad(
        outputs=real_output,
        inputs=real,
        grad_outputs=torch.ones(real_output.size()),
        create_graph=True,
        retain_graph=True,
        only_inputs=True,
    )
    penalty = 10 * ((gradients.reshape(real.shape[0], -1).norm(2, dim=1) - 1) ** 2).mean()
    return divergence + penalty


def _path_length_loss(generator, discriminator, styles):
    images = generator(styles)
    noise = torch.randn(images.shape, generator=torch.Generator().manual_seed(3)) / 8
    (pl_grads,) = torch.autograd.grad(
        outputs=(images * noise).sum(), inputs=styles, grad_outputs=torch.ones(()), create_graph=True
    )
    pl_lengths = (pl_grads**2).sum(dim=1).sqrt()
    return discriminator(images).mean() + ((pl_lengths - 0.5) ** 2).mean()


def test_stylegan2_penalties_through_autograd_grad_under_o1_give_the_float32_gradients(shim):
    """lucidrains' stylegan2-pytorch (2020): five models (two frozen EMA copies) and two optimizers in one O1
    ``initialize`` with ``num_losses=3``; ``amp.scale_loss(loss, optimizer, loss_id)`` with the id positional; a
    gradient penalty and a path-length penalty differentiated twice under the casts; a NaN hook on the loss, which
    sees the scaled gradient as under Apex. The unscaled gradients are the float32 ones, to fp16's precision."""
    from apex import amp

    torch.manual_seed(0)
    style, generator, discriminator = torch.nn.Linear(8, 8), _Generator(), _discriminator()
    style_ema, generator_ema = copy.deepcopy(style), copy.deepcopy(generator)
    for ema in (style_ema, generator_ema):
        ema.requires_grad_(False)
    z = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    real = torch.rand(4, 3, 8, 8, generator=torch.Generator().manual_seed(2)).requires_grad_()

    reference = [copy.deepcopy(m) for m in (style, generator, discriminator)]
    _discriminator_loss(reference[2], reference[1](reference[0](z)), real).backward()
    want_d = [p.grad.clone() for p in reference[2].parameters()]
    _path_length_loss(reference[1], reference[2], reference[0](z)).backward()
    want_g = [p.grad.clone() for m in reference[:2] for p in m.parameters()]

    g_opt = torch.optim.Adam([*generator.parameters(), *style.parameters()], lr=1e-3, betas=(0.5, 0.9))
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=2e-3, betas=(0.5, 0.9))
    models, (g_opt, d_opt) = amp.initialize(
        [style, generator, discriminator, style_ema, generator_ema], [g_opt, d_opt], opt_level="O1", num_losses=3
    )
    style, generator, discriminator = models[:3]

    def first_clean_backward(loss_of, optimizer, loss_id, hook=None):
        """The program's step until a backward does not overflow (the first ones do, at 2**16, and are skipped)."""
        for _ in range(10):
            scaler = amp._amp_state.loss_scalers[loss_id]
            scale = scaler.loss_scale()
            optimizer.zero_grad()
            loss = loss_of()
            if hook is not None:
                loss.register_hook(hook)
            with amp.scale_loss(loss, optimizer, loss_id) as scaled:
                scaled.backward()
            if scaler.loss_scale() == scale:
                return scale
            optimizer.step()  # skipped, as Apex skipped it
        raise AssertionError("every backward overflowed")

    seen = []
    scale = first_clean_backward(
        lambda: _discriminator_loss(discriminator, generator(style(z)), real), d_opt, 1, seen.append
    )
    assert seen[-1].item() == scale
    for got, want in zip([p.grad for p in discriminator.parameters()], want_d, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    first_clean_backward(lambda: _path_length_loss(generator, discriminator, style(z)), g_opt, 2)
    got_g = [p.grad for m in (style, generator) for p in m.parameters()]
    for got, want in zip(got_g, want_g, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-3)
    assert sorted(amp.state_dict()) == ["loss_scaler0", "loss_scaler1", "loss_scaler2"]


class _SwAVNet(torch.nn.Module):
    """SwAV's ResNet in outline: a trunk, a projection head with batch norm, L2-normalised embeddings and the
    prototypes, a bias-free linear layer the loop renormalises itself."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU())
        self.projection_head = torch.nn.Sequential(
            torch.nn.Linear(16, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 8)
        )
        self.prototypes = torch.nn.Linear(8, 6, bias=False)

    def forward(self, crops: list[torch.Tensor]):
        embedding = F.normalize(self.projection_head(self.trunk(torch.cat(crops))), dim=1, p=2)
        return embedding, self.prototypes(embedding)


def _sinkhorn(scores: torch.Tensor, iterations: int = 3) -> torch.Tensor:
    """SwAV's ``distributed_sinkhorn`` on one rank."""
    q = scores / scores.sum()
    rows, cols = q.shape
    for _ in range(iterations):
        q *= (1 / rows / q.sum(dim=1)).unsqueeze(1)
        q *= (1 / cols / q.sum(dim=0)).unsqueeze(0)
    return (q / q.sum(dim=0, keepdim=True)).t().float()


def _swav_restart_from_checkpoint(checkpoint: dict, loaded: list[str], **objects) -> None:
    """SwAV's ``restart_from_checkpoint``: ``load_state_dict(..., strict=False)``, and without ``strict`` where that
    is a TypeError (Apex's ``amp.load_state_dict`` and LARC's took the state only)."""
    for key, value in objects.items():
        try:
            value.load_state_dict(checkpoint[key], strict=False)
            loaded.append(f"{key} with strict=False")
        except TypeError:
            value.load_state_dict(checkpoint[key])
            loaded.append(key)


def _swav_setup(seed: int):
    from apex import amp
    from apex.parallel.LARC import LARC

    torch.manual_seed(seed)
    model = _SwAVNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-6)
    optimizer = LARC(optimizer=optimizer, trust_coefficient=0.001, clip=False)
    return amp.initialize(model, optimizer, opt_level="O1", verbosity=0)


def _swav_iterations(model, optimizer, queue, first: int, count: int, freeze_prototypes_niters: int = 2):
    """SwAV's ``train``: the learning rate set on the groups, prototypes renormalised, two crops, codes from the
    queue and the batch through ``exp`` and Sinkhorn, a swapped prediction loss, the prototypes' gradients
    cancelled for the first iterations, LARC's step."""
    from apex import amp

    record = []
    for iteration in range(first, first + count):
        for group in optimizer.param_groups:
            group["lr"] = 0.1 / (1 + iteration)
        with torch.no_grad():
            w = F.normalize(model.prototypes.weight.data.clone(), dim=1, p=2)
            model.prototypes.weight.copy_(w)
        g = torch.Generator().manual_seed(iteration)
        crops = [torch.randn(4, 12, generator=g) for _ in range(2)]
        embedding, output = model(crops)
        embedding = embedding.detach()
        loss = 0
        for crop_id in range(2):
            with torch.no_grad():
                out = output[4 * crop_id : 4 * (crop_id + 1)]
                out = torch.cat((torch.mm(queue[crop_id], model.prototypes.weight.t()), out))
                queue[crop_id, 4:] = queue[crop_id, :-4].clone()
                queue[crop_id, :4] = embedding[crop_id * 4 : (crop_id + 1) * 4]
                codes = torch.exp(out / 0.05).t()  # exp(20) is inf in fp16: Apex's O1 ran exp in float32
                record.append((codes.dtype, bool(torch.isfinite(codes).all())))
                q = _sinkhorn(codes)[-4:]
            p = F.softmax(output[4 * (1 - crop_id) : 4 * (2 - crop_id)] / 0.1, dim=1)
            loss = loss - torch.mean(torch.sum(q * torch.log(p), dim=1))
        loss = loss / 2
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        if iteration < freeze_prototypes_niters:
            for name, p in model.named_parameters():
                if "prototypes" in name:
                    p.grad = None
        optimizer.step()
        record.append(loss.item())
    return record


def test_swav_larc_at_o1_with_prototypes_frozen_and_its_restart_from_checkpoint_resumes_exactly(shim):
    """SwAV (before its move to native AMP): LARC over SGD passed to ``initialize`` at O1, the learning rate set
    through LARC's groups and read from ``optimizer.optim``, the prototypes renormalised in place and their
    gradients set to None for the first iterations (the step leaves them alone), ``exp`` of half scores in float32,
    ``{"state_dict", "optimizer", "amp"}`` checkpoints, and ``restart_from_checkpoint``, whose ``strict=False`` is a
    TypeError for amp and LARC, as it was with Apex, so it loads them without it: the resumed run is bit-identical."""
    from apex import amp

    model, optimizer = _swav_setup(seed=0)
    queue = torch.zeros(2, 8, 8)
    frozen = model.prototypes.weight.detach().clone()
    record = _swav_iterations(model, optimizer, queue, 0, 2)
    renormalised = F.normalize(F.normalize(frozen, dim=1, p=2), dim=1, p=2)
    assert torch.equal(model.prototypes.weight, renormalised)  # the step left them alone
    assert all(entry == (torch.float32, True) for entry in record if isinstance(entry, tuple))
    assert optimizer.optim.param_groups[0]["lr"] == pytest.approx(0.1 / 2)
    checkpoint = io.BytesIO()
    torch.save(
        {"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), "amp": amp.state_dict()}, checkpoint
    )
    saved_queue = queue.clone()
    straight = _swav_iterations(model, optimizer, queue, 2, 3)
    want = [p.detach().clone() for p in model.parameters()]
    assert model.prototypes.weight.grad is not None  # trained once unfrozen

    model, optimizer = _swav_setup(seed=1)
    checkpoint.seek(0)
    loaded = []
    _swav_restart_from_checkpoint(
        torch.load(checkpoint, weights_only=True), loaded, state_dict=model, optimizer=optimizer, amp=amp
    )
    assert loaded == ["state_dict with strict=False", "optimizer", "amp"]
    assert _swav_iterations(model, optimizer, saved_queue, 2, 3) == straight
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), want, strict=True))


class _NMTModel(torch.nn.Module):
    """OpenNMT-py's ``NMTModel`` in outline: an encoder and decoder whose forward returns the decoder's states; the
    generator (a linear layer and log-softmax) is a submodule the loss calls itself."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(20, 8)
        self.decoder = torch.nn.LSTM(8, 8, batch_first=True)
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 20), torch.nn.LogSoftmax(dim=-1))

    def forward(self, src: torch.Tensor):
        states, _ = self.decoder(self.encoder(src))
        return states, {"std": states}


def _nmt_losses(opt_level: str | None, steps: int = 6):
    """OpenNMT-py's ``Optimizer`` with ``-apex_opt_level``: ``initialize([model, model.generator], ...)``, its
    ``backward`` through ``scale_loss``, and its ``step``: the learning rate and ``clip_grad_norm_`` per group."""
    from apex import amp

    torch.manual_seed(0)
    model = _NMTModel()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if opt_level is not None:
        (model, generator), optimizer = amp.initialize(
            [model, model.generator], optimizer, opt_level=opt_level, loss_scale=128.0, keep_batchnorm_fp32=None
        )
        assert generator is model.generator
    losses, dtypes = [], set()
    for step in range(steps):
        src = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))
        states, _ = model(src)
        scores = model.generator(states.reshape(-1, 8))
        dtypes.add((states.dtype, scores.dtype))
        loss = F.nll_loss(scores, src.reshape(-1), reduction="sum")
        optimizer.zero_grad()
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        for group in optimizer.param_groups:
            group["lr"] = 1e-2 / (1 + step)
            torch.nn.utils.clip_grad_norm_(group["params"], 5.0)
        optimizer.step()
        losses.append(loss.item())
    return model, optimizer, losses, dtypes


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_opennmt_passes_the_model_and_its_own_generator_as_two_models_and_tracks_float32(shim, opt_level):
    """At O2 the generator, a submodule of the model, is cast with it and gets casts of its own: called by the loss it
    takes the model's float32 states and returns float32 scores, as Apex's did. Both levels track the float32 run,
    and the O2 model's state dict is float32, its generator's weights the masters the optimizer steps."""
    from apex import amp

    _, _, want, _ = _nmt_losses(None)
    model, optimizer, got, dtypes = _nmt_losses(opt_level)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=2e-2, atol=0)
    state = model.state_dict()
    assert all(value.dtype == torch.float32 for value in state.values())
    if opt_level == "O2":
        assert dtypes == {(torch.float32, torch.float32)}
        assert model.generator[0].weight.dtype == torch.float16
        index = next(i for i, p in enumerate(model.parameters()) if p is model.generator[0].weight)
        master = list(amp.master_params(optimizer))[index]
        assert torch.equal(state["generator.0.weight"], master)
