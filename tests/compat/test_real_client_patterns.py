"""How real programs use Apex, one usage pattern per test (written here after the projects' own code, CPU-sized):
transformers' availability check, apex loop and Trainer resume, the try-block of imports NVIDIA's BERT and TAPE
scripts guard apex with, NVIDIA BERT's LAMB on ``amp_C``'s two stages and its resume through the masters, the 2019
LAMB calls of ``amp_C`` (NVIDIA BERT's stage 2 with ``lr`` last, copies of that year's FusedLAMB), fairseq's total
norm and FusedLayerNorm subclass, Megatron's gradient clipping and fp32-to-fp16 copies through ``amp_C``, DPR's
clipping after every accumulated micro-batch, GPT2-Chinese's clipping inside the ``scale_loss`` block, UER-py's
adversarial backwards after it, pytext's export of its O2 model cast back to float32, LF-Font's aux loss scaled into
two optimizers, ``@amp.float_function`` where programs placed it, and optional Apex parts behind
``except ImportError``."""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import importlib.util
import math
import warnings

import pytest
import torch

from ampkit.compat import install_apex_shim, uninstall_apex_shim


@pytest.fixture
def shim():
    install_apex_shim()
    yield
    uninstall_apex_shim()


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))


# The first steps overflow and are skipped, so torch's scheduler warns that it stepped first, as under Apex.
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before `optimizer.step\\(\\)`")
def test_transformers_sees_apex_and_its_apex_loop_trains(shim):
    """transformers counts a package available when ``find_spec`` and ``importlib.metadata.version`` both answer;
    its apex path is initialize, scale_loss, clip through ``amp.master_params``, step, scheduler, zero_grad."""
    available = importlib.util.find_spec("apex") is not None
    try:
        importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        available = False
    assert available
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.1 * step))
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    y = x.sum(1, keepdim=True)
    losses = []
    for _ in range(20):
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)  # inf at an overflow: step is skipped
        optimizer.step()
        scheduler.step()
        model.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert amp._amp_state.loss_scalers[0].loss_scale() < 2.0**16, "the first steps overflowed and were skipped"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(5e-2 / 3)


def test_scripts_importing_apex_amps_amp_module_register_casts_initialize_twice_and_train(shim, monkeypatch):
    """Inpainting GANs and WaveGlow forks write ``from apex.amp import amp, scale_loss``: Apex's ``amp.py`` module,
    on which they register sigmoid as float32 (so ``BCELoss`` is allowed under O1) and initialize each
    model/optimizer pair in its own call."""
    from apex.amp import amp, scale_loss

    monkeypatch.setattr("ampkit.compat.amp.functions._registry", {})  # the registration stays in this test
    amp.register_float_function(torch, "sigmoid")
    generator = _mlp()
    discriminator = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Sigmoid())
    g_opt = torch.optim.Adam(generator.parameters(), lr=1e-2)
    generator, g_opt = amp.initialize(generator, g_opt, opt_level="O1", verbosity=0)
    d_opt = torch.optim.Adam(discriminator.parameters(), lr=1e-2)
    discriminator, d_opt = amp.initialize(discriminator, d_opt, opt_level="O1", verbosity=0)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(1))
    target = x.sum(1, keepdim=True)
    bce, losses = torch.nn.BCELoss(), []
    for _ in range(30):
        g_opt.zero_grad()
        fake = generator(x)
        loss = torch.nn.functional.mse_loss(fake.float(), target) + 0.01 * bce(discriminator(fake), torch.ones(32, 1))
        with scale_loss(loss, g_opt) as scaled_loss:
            scaled_loss.backward()
        g_opt.step()
        d_opt.zero_grad()
        d_loss = bce(discriminator(target), torch.ones(32, 1)) + bce(discriminator(fake.detach()), torch.zeros(32, 1))
        with scale_loss(d_loss, d_opt) as scaled_loss:
            scaled_loss.backward()
        d_opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert list(amp.state_dict()) == ["loss_scaler0"]
    with pytest.raises(AttributeError, match="apex.amp itself has scale_loss"):
        amp.scale_loss  # noqa: B018 - Apex's amp.py never had it


def test_tacotron2_moves_softmax_to_apexs_fp16_list_before_initialize(shim, monkeypatch):
    """NVIDIA's Tacotron 2 and WaveGlow scripts (DeepLearningExamples) edit Apex's O1 tables at import,
    ``amp.lists.functional_overrides.FP32_FUNCS.remove('softmax')`` then ``FP16_FUNCS.append('softmax')``, so
    that attention's softmax runs in half precision; the next ``initialize`` applies the edit."""
    from apex import amp
    from apex.amp.lists import functional_overrides

    for name in ("FP16_FUNCS", "FP32_FUNCS"):  # the tables are process-wide: this test edits copies
        monkeypatch.setattr(functional_overrides, name, list(getattr(functional_overrides, name)))
    amp.lists.functional_overrides.FP32_FUNCS.remove("softmax")
    amp.lists.functional_overrides.FP16_FUNCS.append("softmax")
    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(1))
    attention = torch.nn.functional.softmax(model(x), dim=0)  # over the 6 rows: one weight each
    assert attention.dtype == torch.float16
    assert torch.nn.functional.log_softmax(x, dim=-1).dtype == torch.float32  # the rest of the table is Apex's
    loss = (attention * x).sum(0).float().pow(2).mean()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    assert all(torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0 for p in model.parameters())


def test_the_import_block_bert_and_tape_scripts_guard_apex_with_succeeds_whole(shim):
    try:
        import amp_C
        import apex_C
        from apex import amp
        from apex.amp import _amp_state
        from apex.multi_tensor_apply import multi_tensor_applier
        from apex.optimizers import FusedLAMB
        from apex.parallel.distributed import DistributedDataParallel, flat_dist_call

        apex_found = True
    except ImportError:
        apex_found = False
    assert apex_found
    assert amp.initialize and _amp_state is amp._amp_state and apex_C.flatten and amp_C.multi_tensor_l2norm
    assert multi_tensor_applier.available and FusedLAMB and DistributedDataParallel and flat_dist_call


class _BertStyleLamb(torch.optim.Optimizer):
    """NVIDIA BERT's LAMB as its optimization.py drives ``amp_C``: the global norm, the per-parameter norms,
    stage 1 into an update buffer with a per-parameter decay, the update norms, stage 2."""

    def __init__(self, params, lr, weight_decay=0.01, max_global_grad_norm=1.0):
        super().__init__(params, dict(lr=lr))
        import amp_C

        self.l2norm, self.stage1, self.stage2 = (
            amp_C.multi_tensor_l2norm,
            amp_C.multi_tensor_lamb_stage1_cuda,
            amp_C.multi_tensor_lamb_stage2_cuda,
        )
        self.weight_decay, self.max_global_grad_norm, self.step_count = weight_decay, max_global_grad_norm, 0

    @torch.no_grad()
    def step(self, closure=None):
        from apex.multi_tensor_apply import multi_tensor_applier

        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        for p in params:
            if not self.state[p]:
                self.state[p] = {k: torch.zeros_like(p) for k in ("momentum", "velocity", "update")}
        grads = [p.grad for p in params]
        state = [[self.state[p][k] for p in params] for k in ("momentum", "velocity", "update")]
        flag = torch.zeros(1, dtype=torch.int32)
        global_norm = multi_tensor_applier(self.l2norm, flag, [grads], False)[0].item()
        param_norms = multi_tensor_applier(self.l2norm, flag, [params], True)[1]
        decay = torch.full((len(params),), self.weight_decay)
        multi_tensor_applier(self.stage1, flag, [grads, params, *state], decay, self.step_count, 0.9, 0.999, 1e-6,
                             global_norm, self.max_global_grad_norm)  # fmt: skip
        update_norms = multi_tensor_applier(self.l2norm, flag, [state[2]], True)[1]
        multi_tensor_applier(self.stage2, flag, [params, state[2]], param_norms, update_norms,
                             self.param_groups[0]["lr"], self.weight_decay)  # fmt: skip
        self.step_count += 1


def test_bert_style_lamb_on_amp_c_stages_matches_fused_lamb(shim):
    from apex.optimizers import FusedLAMB

    ours, theirs = _mlp(), _mlp()
    bert = _BertStyleLamb(ours.parameters(), lr=0.02)
    fused = FusedLAMB(theirs.parameters(), lr=0.02, weight_decay=0.01, max_grad_norm=1.0)
    for i in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        for model, optimizer in ((ours, bert), (theirs, fused)):
            model.zero_grad()
            (model(x) ** 2).mean().mul(10).backward()  # large gradients: the global-norm clip is active
            optimizer.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _lamb_2019_stages(params, state, lr, step, max_grad_norm=1.0):
    """NVIDIA BERT's 2019 ``BertLAMB.apply_gradients``: stage 2 called as Apex had it then, ``lr`` last."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    flag = torch.zeros(1, dtype=torch.int32)
    grads = [p.grad for p in params]
    global_norm = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [grads], False)[0].item()
    param_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [params], True)[1]
    multi_tensor_applier(amp_C.multi_tensor_lamb_stage1_cuda, flag, [grads, params, *state], torch.zeros(len(params)),
                         step, 0.9, 0.999, 1e-6, global_norm, max_grad_norm)  # fmt: skip
    update_norms = multi_tensor_applier(amp_C.multi_tensor_l2norm, flag, [state[2]], True)[1]
    multi_tensor_applier(amp_C.multi_tensor_lamb_stage2_cuda, flag, [params, state[2]], param_norms, update_norms, lr)


def _lamb_2019_fused(params, state, lr, step, max_grad_norm=1.0):
    """Apex's FusedLAMB of August 2019 to April 2020, as projects copied it: ``max_grad_norm`` right after the
    mode and no global norm."""
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    multi_tensor_applier(amp_C.multi_tensor_lamb, torch.zeros(1, dtype=torch.int32),
                         [[p.grad for p in params], params, state[0], state[1]],
                         lr, 0.9, 0.999, 1e-6, step + 1, 1, 0.0, 1, 1, max_grad_norm)  # fmt: skip


@pytest.mark.parametrize("lamb_2019", [_lamb_2019_stages, _lamb_2019_fused])
def test_2019_lamb_calls_of_amp_c_step_as_fused_lamb_with_nvlamb(shim, lamb_2019):
    """Both 2019 LAMBs applied the trust ratio to every tensor, weight decay or not: FusedLAMB's ``use_nvlamb``."""
    from apex.optimizers import FusedLAMB

    ours, theirs = _mlp(), _mlp()
    params = [p for p in ours.parameters()]
    state = [[torch.zeros_like(p) for p in params] for _ in range(3)]
    fused = FusedLAMB(theirs.parameters(), lr=0.02, weight_decay=0.0, max_grad_norm=1.0, use_nvlamb=True)
    for i in range(3):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
        for model in (ours, theirs):
            model.zero_grad()
            (model(x) ** 2).mean().mul(10).backward()  # large gradients: the global-norm clip is active
        with torch.no_grad():
            lamb_2019(params, state, 0.02, i)
        fused.step()
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fairseq_total_norm_and_fused_layer_norm_subclass(shim):
    from amp_C import multi_tensor_l2norm
    from apex.normalization import FusedLayerNorm as _FusedLayerNorm

    grads = [torch.randn(7, 3), torch.randn(11), torch.randn(2, 2, 2)]
    has_inf = torch.zeros((1, 1), dtype=torch.int)  # fairseq's flag shape
    norm = multi_tensor_l2norm(2048 * 32, has_inf, [grads], False)[0]
    torch.testing.assert_close(norm, torch.norm(torch.stack([g.norm() for g in grads])).reshape(1))
    grads[1][4] = math.inf
    multi_tensor_l2norm(2048 * 32, has_inf, [grads], False)
    assert has_inf.item() == 1

    class FusedLayerNorm(_FusedLayerNorm):  # fairseq.modules.layer_norm
        def forward(self, x):
            if not x.is_cuda:
                return super().forward(x)
            with torch.cuda.device(x.device):
                return super().forward(x)

    x = torch.randn(4, 6)
    torch.testing.assert_close(FusedLayerNorm(6)(x), torch.nn.functional.layer_norm(x, (6,)), rtol=1e-5, atol=1e-5)


def test_megatron_clips_grads_and_copies_masters_through_amp_c(shim):
    import amp_C
    from apex.multi_tensor_apply import multi_tensor_applier

    model, reference = _mlp(), _mlp()
    x = torch.randn(16, 8)
    for m in (model, reference):
        (m(x) ** 2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    dummy_overflow_buf = torch.zeros(1, dtype=torch.int)
    grad_norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, dummy_overflow_buf, [grads], False)
    total_norm = grad_norm.item()
    clip_coeff = 1.0 / (total_norm + 1.0e-6)
    multi_tensor_applier(amp_C.multi_tensor_scale, dummy_overflow_buf, [grads, grads], clip_coeff)
    expected_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    assert total_norm == pytest.approx(expected_norm.item(), rel=1e-6)
    for p, r in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, r.grad, rtol=1e-6, atol=1e-7)
    # _multi_tensor_copy_this_to_that: fp32 main params into the fp16 model params, in one call.
    main = [p.detach() for p in model.parameters()]
    model_half = [torch.empty_like(p, dtype=torch.float16) for p in main]
    multi_tensor_applier(amp_C.multi_tensor_scale, dummy_overflow_buf, [main, model_half], 1.0)
    assert all(torch.equal(h, m.half()) for h, m in zip(model_half, main, strict=True))
    assert dummy_overflow_buf.item() == 0


@pytest.mark.parametrize(
    "statement",
    [
        "from apex.contrib.sparsity import ASP",
        "from apex.transformer.functional import fused_apply_rotary_pos_emb",
        "from apex.contrib.layer_norm.layer_norm import FastLayerNormFN",
        "import fused_dense_cuda",
        "from apex.amp.opt import OptimWrapper",
    ],
)
def test_optional_apex_parts_fall_back_through_import_error_with_a_clear_message(shim, statement):
    """Projects import optional Apex parts in ``try: ... except ImportError:`` and fall back; the message names
    what the shim has."""
    with pytest.raises(ImportError) as raised:
        exec(statement, {})
    message = str(raised.value)
    assert "ampkit's apex shim" in message or "No module named 'fused_dense_cuda'" in message


class _MMEngineStyleApexWrapper:
    """mmengine's ApexOptimWrapper: ``initialize`` inside the first ``optim_context`` (every override passed,
    ``None`` where not set), ``hasattr(optimizer, "_amp_stash")`` as "already initialized", the amp state saved
    under ``"apex_amp"`` in the optimizer's state dict and, on resume, held until ``initialize`` ran."""

    def __init__(self, optimizer, opt_level):
        self.optimizer, self.opt_level, self._apex_amp_state_dict = optimizer, opt_level, None

    def optim_context(self, model):
        from apex import amp

        if not hasattr(self.optimizer, "_amp_stash"):
            _, self.optimizer = amp.initialize(
                model, self.optimizer, opt_level=self.opt_level, loss_scale="dynamic", enabled=True,
                cast_model_type=None, patch_torch_functions=None, keep_batchnorm_fp32=None, master_weights=None,
                cast_model_outputs=None, num_losses=1, verbosity=0, min_loss_scale=None, max_loss_scale=2.0**24,
            )  # fmt: skip
            if self._apex_amp_state_dict is not None:
                amp.load_state_dict(self._apex_amp_state_dict)
                self._apex_amp_state_dict = None

    def update_params(self, loss):
        from apex import amp

        with amp.scale_loss(loss, self.optimizer) as scaled_loss:
            scaled_loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def state_dict(self):
        from apex import amp

        state_dict = self.optimizer.state_dict()
        state_dict["apex_amp"] = amp.state_dict()
        return state_dict

    def load_state_dict(self, state_dict):
        from apex import amp

        if "apex_amp" in state_dict:
            if hasattr(self.optimizer, "_amp_stash"):
                amp.load_state_dict(state_dict.pop("apex_amp"))
            else:
                self._apex_amp_state_dict = state_dict.pop("apex_amp")
        self.optimizer.load_state_dict(state_dict)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_mmengine_style_wrapper_resumes_exactly(shim, opt_level):
    from apex import amp

    def train(model, wrapper, steps):
        for i in steps:
            wrapper.optim_context(model)
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i))
            x = x.half() if opt_level == "O2" else x
            wrapper.update_params((model(x).float() ** 2).mean() * (2.0**12 if i == 0 else 1.0))

    model = _mlp()
    wrapper = _MMEngineStyleApexWrapper(torch.optim.Adam(model.parameters(), lr=1e-2), opt_level)
    train(model, wrapper, range(3))
    checkpoint = copy.deepcopy({"model": model.state_dict(), "optim": wrapper.state_dict()})  # as torch.save
    assert checkpoint["optim"]["apex_amp"]["loss_scaler0"]["loss_scale"] < 2.0**16, "step 0 overflowed"
    train(model, wrapper, range(3, 6))
    final_scale = amp._amp_state.loss_scalers[0].loss_scale()
    amp._amp_state.reset()  # a new process resumes from the checkpoint
    resumed = _mlp()
    resumed.load_state_dict(checkpoint["model"])
    resumed_wrapper = _MMEngineStyleApexWrapper(torch.optim.Adam(resumed.parameters(), lr=1e-2), opt_level)
    resumed_wrapper.load_state_dict(checkpoint["optim"])  # before initialize: the amp part waits
    train(resumed, resumed_wrapper, range(3, 6))
    assert amp._amp_state.loss_scalers[0].loss_scale() == final_scale
    for a, b in zip(model.state_dict().values(), resumed.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _bert_pretraining_run(steps, checkpoint=None):
    """NVIDIA BERT run_pretraining.py's O2 FusedLAMB run; resumes its way (TAPE's resume_from_checkpoint too):
    load the optimizer, build the masters by hand, load again, copy the saved ``master params`` into them."""
    from apex import amp
    from apex.optimizers import FusedLAMB

    model = _mlp()
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
    optimizer = FusedLAMB(groups, lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic", verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2**10  # the script's --init_loss_scale
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        optimizer._lazy_init_maybe_master_weights()
        optimizer._amp_stash.lazy_init_called = True
        optimizer.load_state_dict(checkpoint["optimizer"])
        for param, saved_param in zip(amp.master_params(optimizer), checkpoint["master params"], strict=True):
            param.data.copy_(saved_param.data)
    for i in steps:
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(i)).half()
        for micro_batch in x.chunk(2):  # accumulation: each backward unscales into the masters
            with amp.scale_loss((model(micro_batch).float() ** 2).mean() / 2, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        for param in model.parameters():
            param.grad = None
    saved = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "master params": list(amp.master_params(optimizer)),
    }
    return copy.deepcopy(saved)  # as torch.save


def test_bert_pretraining_resume_through_lazy_init_and_master_params_continues_exactly(shim):
    uninterrupted = _bert_pretraining_run(range(6))
    checkpoint = _bert_pretraining_run(range(3))
    # As Apex wrote it: the model's weights are the fp16 ones upcast, the masters only in "master params".
    checkpoint["model"] = {name: tensor.half().float() for name, tensor in checkpoint["model"].items()}
    del checkpoint["optimizer"]["ampkit_master_weights"]
    resumed = _bert_pretraining_run(range(3, 6), checkpoint)
    for a, b in zip(uninterrupted["master params"], resumed["master params"], strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    for a, b in zip(uninterrupted["model"].values(), resumed["model"].values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_espnet_registers_a_float_function_after_initialize_and_calls_init_again(shim):
    """ESPnet's ASR trainer: ``amp.initialize``, then ``amp.register_float_function(CTC, "loss_fn")`` and
    ``amp.init()`` so that the CTC loss runs in float32 under O1, then the usual scale_loss loop."""
    from apex import amp

    class CTC(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 5)
            self.seen_dtypes = []

        def loss_fn(self, logits):
            self.seen_dtypes.append(logits.dtype)
            return logits.logsumexp(-1).mean()

        def forward(self, x):
            return self.loss_fn(self.proj(x))

    encoder, ctc = _mlp()[0], CTC()
    optimizer = torch.optim.SGD([*encoder.parameters(), *ctc.parameters()], lr=0.1)
    (encoder, ctc), optimizer = amp.initialize([encoder, ctc], optimizer, opt_level="O1", verbosity=0)
    amp.register_float_function(CTC, "loss_fn")
    amp.init()
    x = torch.randn(4, 8)
    assert encoder(x).dtype == torch.float16, "O1 is still on after the second init"
    loss = ctc(encoder(x)[:, :8])
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
    assert ctc.seen_dtypes == [torch.float32]
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in ctc.parameters())


@pytest.mark.parametrize(
    ("expression", "provided"),
    [
        ("apex.amp._initialized", "initialize, load_state_dict"),
        ("apex.parallel.DistributedFusedAdam", "DistributedDataParallel"),
        ("apex.fp16_utils.FP16_Module", "FP16_Optimizer"),
        ("apex.multi_tensor_apply.MultiTensorApplier", "multi_tensor_applier"),
        ("apex.amp_C", "amp, fp16_utils, parallel"),  # amp_C is a top-level module
        ("amp_C.multi_tensor_fused_adam", "multi_tensor_lamb_mp"),
    ],
)
def test_a_name_apex_never_had_here_is_an_attribute_error_naming_what_is_provided(shim, expression, provided):
    import amp_C
    import apex

    with pytest.raises(AttributeError, match=provided):
        eval(expression, {"apex": apex, "amp_C": amp_C})
    assert not hasattr(apex.amp, "_initialized")


def test_nvidia_transformer_reads_every_fp16_model_grad_after_an_o2_backward(shim):
    """NVIDIA's Transformer (DeepLearningExamples' fairseq fork, ``--amp --amp-level O2``) flattens each model
    parameter's ``.grad`` with ``apex_C.flatten`` after ``amp.scale_loss`` and raises "Model parameter did not
    receive gradient" on a None; grad-norm loggers read them too. Apex left each fp16 param its scaled gradient
    until the next backward, while the step used the fp32 masters' unscaled copy."""
    import apex_C
    from apex import amp
    from apex.optimizers import FusedAdam

    model = _mlp()
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(
        model, optimizer, opt_level="O2", keep_batchnorm_fp32=False, loss_scale=128.0, verbosity=0
    )
    for _ in range(2):
        loss = model(torch.randn(4, 8)).float().pow(2).mean()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        missing = [name for name, p in model.named_parameters() if p.grad is None]
        assert not missing, f"Model parameter did not receive gradient: {missing}"
        flat = apex_C.flatten([p.grad for p in model.parameters()])
        masters = torch.cat([m.grad.flatten() for m in amp.master_params(optimizer)])
        assert flat.dtype == torch.float16 and torch.equal(flat.float(), masters * 128.0)
        optimizer.step()


def test_a_scheduler_built_before_initialize_still_counts_the_steps(shim):
    """transformers 2.x's run_glue (and NVIDIA's SSD and GNMT) build the LR scheduler, then call
    ``amp.initialize``: torch's scheduler then warned at its first step that the optimizer's step "has been
    overridden", in the right order too; the wrong order must still get torch's own warning."""
    from apex import amp

    for scheduler_first, expected in ((False, []), (True, ["Detected call of `lr_scheduler.step()` before"])):
        model = _mlp()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(2):
                loss = model(torch.randn(4, 8)).float().pow(2).mean()
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                if scheduler_first:
                    scheduler.step()
                optimizer.step()
                if not scheduler_first:
                    scheduler.step()
                optimizer.zero_grad()
        said = [str(w.message) for w in caught if "lr_scheduler" in str(w.message) or "overridden" in str(w.message)]
        assert [m for m in said if not any(m.startswith(e) for e in expected)] == []
        assert len(said) == len(expected)


def _freeze_then_unfreeze_run(opt_level: str | None, combine_grad: bool = False) -> torch.Tensor:
    """ultralytics yolov3's ``--freeze-layers`` (and staged fine-tuning): the first layer is in the optimizer but
    frozen (``requires_grad_(False)``) when amp is set up, and unfrozen after a few steps."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for param in model[0].parameters():
        param.requires_grad_(False)
    if opt_level is not None:
        model, optimizer = amp.initialize(
            model, optimizer, opt_level=opt_level, loss_scale=128.0, combine_grad=combine_grad, verbosity=0
        )
    generator = torch.Generator().manual_seed(2)
    for step in range(6):
        if step == 3:
            for param in model[0].parameters():
                param.requires_grad_(True)
        x = torch.randn(16, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("combine_grad", [False, True])
@pytest.mark.parametrize("opt_level", ["O1", "O2", "O3"])
def test_a_layer_frozen_at_initialize_and_unfrozen_later_trains_on_unscaled_gradients(shim, opt_level, combine_grad):
    """Its gradients were left scaled (O1, O3: steps 128 times too large) or never reached its master (O2: it did not
    train), because the parameters amp unscales were those trainable at ``initialize``."""
    reference = _freeze_then_unfreeze_run(None)
    trained = _freeze_then_unfreeze_run(opt_level, combine_grad)
    torch.testing.assert_close(trained, reference, atol=2e-3, rtol=0)


def _nan_batch_dropped_inside_scale_loss_run(opt_level: str | None, combine_grad: bool = False) -> torch.Tensor:
    """NeMo 0.x's training loop: two batches accumulated per step (the first with ``delay_unscale=True``), the
    backward given a gradient tensor, and a nan loss found inside the ``scale_loss`` block answered by
    ``zero_grad()`` and ``continue`` (the batch dropped, the accumulation going on)."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    if opt_level is not None:
        model, optimizer = amp.initialize(
            min_loss_scale=1.0,
            max_loss_scale=128.0,  # dynamic, starting low enough that no step overflows: the runs compare
            models=model,
            optimizers=optimizer,
            opt_level=opt_level,
            combine_grad=combine_grad,
        )
    per_step, pending = 2, 0
    weight = torch.tensor(1.0 / per_step)
    generator = torch.Generator().manual_seed(3)
    for batch in range(9):
        x = torch.randn(16, 8, generator=generator)
        loss = torch.nn.functional.mse_loss(model(x).float(), x.sum(1, keepdim=True))
        if batch == 3:  # the second batch of an accumulation: a non-delayed block after a delayed one
            loss = loss * float("nan")
        if opt_level is None:
            if torch.isnan(loss):
                optimizer.zero_grad()
                continue
            loss.backward(weight)
        else:
            with amp.scale_loss(loss, optimizer, delay_unscale=pending < per_step - 1) as scaled_loss:
                if torch.isnan(scaled_loss).any():
                    optimizer.zero_grad()
                    continue
                scaled_loss.backward(weight)
        pending += 1
        if pending == per_step:
            optimizer.step()
            optimizer.zero_grad()
            pending = 0
    if opt_level is not None:
        assert amp._amp_state.loss_scalers[0].loss_scale() == 128.0  # the zeroed gradients were no overflow
    return torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("combine_grad", [False, True])
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_nemo_zeroes_the_gradients_of_a_nan_loss_inside_scale_loss_and_trains_on(shim, opt_level, combine_grad):
    """The block's exit raised "combine() called without prepare_backward()" (O2, and O1 with combine_grad):
    ``zero_grad`` dropped the backward the block had prepared, so the unscale Apex did there had nothing to do."""
    reference = _nan_batch_dropped_inside_scale_loss_run(None)
    trained = _nan_batch_dropped_inside_scale_loss_run(opt_level, combine_grad)
    torch.testing.assert_close(trained, reference, atol=2e-3, rtol=0)


def test_dlrm_function_calling_mlp_function_forward_and_backward_under_autocast(shim):
    """NVIDIA DLRM's AmpMlpFunction calls ``apex.mlp.MlpFunction.forward``/``.backward`` with its own ctx. Under a
    CPU autocast (its CUDA-only ``custom_fwd`` casts nothing there) Apex's kernel computed in the inputs' dtype: the
    output is float32 and the gradients those of the plain float32 layers, not a dtype error in backward."""
    import apex.mlp

    class Delegating(torch.autograd.Function):
        @staticmethod
        def forward(*args):
            return apex.mlp.MlpFunction.forward(*args)

        @staticmethod
        def backward(*args):
            return apex.mlp.MlpFunction.backward(*args)

    torch.manual_seed(0)
    mlp = apex.mlp.MLP([8, 16, 4], activation="relu")
    x = torch.randn(5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = Delegating.apply(mlp.bias, mlp.activation, x, *mlp.weights, *mlp.biases)
    out.square().sum().backward()
    got = [p.grad.clone() for p in mlp.parameters()]
    mlp.zero_grad()
    with torch.autocast("cpu", enabled=False):
        apex.mlp.MlpFunction.apply(mlp.bias, mlp.activation, x, *mlp.weights, *mlp.biases).square().sum().backward()
    assert out.dtype == torch.float32
    for g, want in zip(got, (p.grad for p in mlp.parameters()), strict=True):
        torch.testing.assert_close(g, want)


def _clip_every_micro_batch_run(opt_level: str | None) -> tuple[list[float], torch.Tensor]:
    """DPR's loop: each micro-batch's backward is followed by clipping ``amp.master_params`` (so the gradients
    accumulated so far are clipped in place), and every second micro-batch steps, steps the scheduler and zeroes the
    model's gradients (``model.zero_grad()``, not the optimizer's)."""
    from apex import amp

    model = _mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if opt_level is not None:
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=128.0, verbosity=0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=100)
    generator = torch.Generator().manual_seed(5)
    norms = []
    for batch in range(6):
        x = torch.randn(16, 8, generator=generator)
        inputs = x.to(next(model.parameters()).dtype)
        loss = torch.nn.functional.mse_loss(model(inputs).float(), x.sum(1, keepdim=True)) / 2
        if opt_level is None:
            loss.backward()
        else:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        params = amp.master_params(optimizer) if opt_level is not None else model.parameters()
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, 1e-2)))
        if batch % 2 == 1:
            optimizer.step()
            scheduler.step()
            model.zero_grad()
    return norms, torch.cat([p.detach().float().flatten() for p in model.parameters()])


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_dpr_clips_the_masters_after_every_micro_batch_and_the_next_backward_adds_to_the_clipped_gradients(
    shim, opt_level
):
    """The second micro-batch's norm is that of the first's clipped gradients plus its own: the clip between the two
    backwards is kept (it is lost if the accumulated gradients are held anywhere but in the masters' ``.grad``)."""
    want_norms, want = _clip_every_micro_batch_run(None)
    norms, trained = _clip_every_micro_batch_run(opt_level)
    assert norms == pytest.approx(want_norms, rel=5e-3)
    torch.testing.assert_close(trained, want, atol=1e-3, rtol=0)


def _hf_trainer_apex_run(opt_level: str, checkpoint: dict | None, stop_after: int | None) -> tuple[torch.Tensor, dict]:
    """transformers' Trainer with ``_use_apex``: the checkpoint's weights are loaded into the new float32 model before
    ``amp.initialize`` (``_load_from_checkpoint``), the optimizer and scheduler after it; no amp state is saved.
    Two micro-batches a step (loss divided by 2), clipping through ``amp.master_params``, ``model.zero_grad()``."""
    from apex import amp

    model = _mlp()
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / 10)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, max_loss_scale=2.0**10, verbosity=0)
    start = 0
    if checkpoint is not None:
        optimizer.load_state_dict(checkpoint["optimizer"])
        scheduler.load_state_dict(checkpoint["scheduler"])
        start = checkpoint["step"]
    for step in range(start, 8 if stop_after is None else stop_after):
        for micro in range(2):
            x = torch.randn(16, 8, generator=torch.Generator().manual_seed(10 * step + micro))
            output = model(x.to(next(model.parameters()).dtype)).float()
            loss = torch.nn.functional.mse_loss(output, x.sum(1, keepdim=True))
            with amp.scale_loss(loss / 2, optimizer) as scaled_loss:
                scaled_loss.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        scheduler.step()
        model.zero_grad()
    saved = {
        "model": copy.deepcopy(model.state_dict()),
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "scheduler": scheduler.state_dict(),
        "step": stop_after,
    }
    return torch.cat([p.detach().float().flatten() for p in model.parameters()]), saved


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_hf_trainer_resumed_with_the_weights_loaded_before_initialize_continues_exactly(shim, opt_level):
    """The Trainer's order (weights into the float32 model, ``initialize``, then the optimizer) with no amp state in
    the checkpoint goes on bit for bit: at O2 the masters come back exactly, from the float32 weights the model saves
    or from the optimizer's state (with neither, they would restart from the fp16 rounding of the weights)."""
    from apex import amp

    uninterrupted, _ = _hf_trainer_apex_run(opt_level, None, None)
    amp._amp_state.reset()
    _, checkpoint = _hf_trainer_apex_run(opt_level, None, stop_after=4)
    amp._amp_state.reset()
    resumed, _ = _hf_trainer_apex_run(opt_level, checkpoint, None)
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_gpt2_chinese_clips_the_masters_inside_the_scale_loss_block_as_apex_did(shim, opt_level):
    """GPT2-Chinese calls ``clip_grad_norm_(amp.master_params(optimizer))`` inside the ``scale_loss`` block. There,
    as in Apex, O1's gradients hold only this backward's part, still scaled (the earlier micro-batch is stashed), so
    the clip shrinks it to ``max_norm / scale``; O2's masters hold the earlier micro-batches, unscaled, and the new
    part arrives on exit, unclipped."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1, bias=False)
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level, loss_scale=1024.0, verbosity=0)
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
    reference(x).pow(2).mean().backward()
    grad = reference.weight.grad
    optimizer.zero_grad()
    for clip in (False, True):  # two micro-batches of the same loss; the second clips inside its block
        with amp.scale_loss(model(x.to(next(model.parameters()).dtype)).float().pow(2).mean(), optimizer) as scaled:
            scaled.backward()
            if clip:
                norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
    master_grad = next(iter(amp.master_params(optimizer))).grad.float()
    if opt_level == "O1":
        torch.testing.assert_close(norm, 1024.0 * grad.norm(), rtol=2e-3, atol=0)
        expected = grad + grad / (1024.0 * grad.norm())
    else:
        torch.testing.assert_close(norm, grad.norm(), rtol=2e-3, atol=0)
        expected = grad / grad.norm() + grad
    torch.testing.assert_close(master_grad, expected, rtol=0, atol=2e-3 * expected.norm().item())  # fp16 model


@pytest.mark.parametrize("attack", ["fgm", "pgd"])
def test_uer_adversarial_backwards_after_the_block_and_a_restored_grad_reach_the_step(shim, attack):
    """UER-py's ``--use_adv`` at O1: after the ``scale_loss`` block, plain ``backward()`` calls of losses on
    perturbed embeddings add unscaled gradients (FGM), and PGD backs the gradients up, zeroes them, and puts the
    backups back by assigning ``param.grad`` before its last backward. The step uses exactly what ``.grad`` holds,
    as under Apex, whose O1 only replaced a step after an overflow."""
    from apex import amp

    torch.manual_seed(0)
    embedding = torch.nn.Embedding(20, 8)
    model = torch.nn.Sequential(embedding, torch.nn.Flatten(), torch.nn.Linear(40, 3))
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
    ids = torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(2))
    labels = torch.tensor([0, 1, 2, 1])

    def run(net, scaled_backward):
        def loss():
            return torch.nn.functional.cross_entropy(net(ids).float(), labels)

        weight = net[0].weight
        scaled_backward(loss())
        backup = weight.data.clone()
        grads = [p.grad.clone() for p in net.parameters()]
        weight.data.add_(0.5 * weight.grad / weight.grad.norm())
        if attack == "pgd":
            net.zero_grad()
            loss().backward()
            weight.data.add_(0.3 * weight.grad / weight.grad.norm())
            for p, g in zip(net.parameters(), grads, strict=True):
                p.grad = g
        loss().backward()
        weight.data = backup

    def scaled(loss):
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()

    run(model, scaled)
    run(reference, lambda loss: loss.backward())
    before = [p.detach().clone() for p in model.parameters()]
    grads = [p.grad.clone() for p in model.parameters()]
    for g, ref in zip(grads, reference.parameters(), strict=True):
        torch.testing.assert_close(g, ref.grad, rtol=1e-2, atol=2e-3)  # O1 ran the Linear in fp16
    optimizer.step()
    for p, b, g in zip(model.parameters(), before, grads, strict=True):
        torch.testing.assert_close(p.detach(), b - 0.5 * g, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_pytext_exports_its_o2_model_after_casting_it_back_to_float32(shim):
    """pytext's FP16OptimizerApex: micro-batches accumulated with ``delay_unscale`` on all but the last, clipping
    through ``amp.master_params``, step; then ``pre_export`` calls ``model.float()`` and traces the model with float32
    inputs. The model is float32 again, so its casts stand down and the trace runs the float32 weights."""
    from apex import amp

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
    generator = torch.Generator().manual_seed(1)
    for _ in range(2):
        optimizer.zero_grad()
        for index in range(3):
            x, y = torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            with amp.scale_loss(loss, optimizer, delay_unscale=index < 2) as scaled:
                scaled.backward()
        norm = torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        assert math.isfinite(norm)
        optimizer.step()
    model.float()
    x = torch.randn(2, 6)
    traced = torch.jit.trace(model.eval(), (x,))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(traced(x), plain(x), rtol=0, atol=0)


def test_lffont_aux_losses_scaled_into_two_optimizers_skip_both_after_an_overflow(shim, capsys):
    """LF-Font: four models (one a deep-copied EMA with no optimizer) and num_losses=4. The aux-classifier loss is
    scaled into ``[ac_optim, g_optim]`` (loss_id 2), ``ac_optim`` steps at once and ``g_optim`` after the generator's
    own loss (loss_id 1). An inf in loss 2 replaces the next step of both, each printing scaler 2's message, and
    backs off scaler 2 only; the EMA, accumulated on the half weights, keeps following the generator."""
    from apex import amp

    torch.manual_seed(0)
    gen, aux = torch.nn.Linear(4, 6), torch.nn.Linear(6, 3)
    ema = copy.deepcopy(gen)
    g_optim = torch.optim.SGD(gen.parameters(), lr=0.1)
    ac_optim = torch.optim.SGD(aux.parameters(), lr=0.1)
    [gen, ema, aux], [g_optim, ac_optim] = amp.initialize(
        [gen, ema, aux], [g_optim, ac_optim], opt_level="O2", num_losses=4, verbosity=1
    )
    generator = torch.Generator().manual_seed(3)
    moved = []
    for iteration in range(3):
        before = [p.detach().clone() for p in (*gen.parameters(), *aux.parameters())]
        x, comp = torch.randn(5, 4, generator=generator), torch.randint(0, 3, (5,), generator=generator)
        feats = gen(x)
        g_optim.zero_grad()
        ac_loss = torch.nn.functional.cross_entropy(aux(feats), comp) * (float("inf") if iteration == 1 else 1.0)
        ac_optim.zero_grad()
        with amp.scale_loss(ac_loss, [ac_optim, g_optim], loss_id=2) as scaled:
            scaled.backward(retain_graph=True)
        ac_optim.step()
        with amp.scale_loss(feats.pow(2).mean(), g_optim, loss_id=1) as scaled:
            scaled.backward()
        g_optim.step()
        with torch.no_grad():
            for e, g in zip(ema.parameters(), gen.parameters(), strict=True):
                e.mul_(0.5).add_(g, alpha=0.5)
        after = [p.detach() for p in (*gen.parameters(), *aux.parameters())]
        moved.append(all(not torch.equal(a, b) for a, b in zip(after, before, strict=True)))
    assert moved == [True, False, True]
    assert capsys.readouterr().out.count("Skipping step, loss scaler 2 reducing loss scale to 32768.0") == 2
    assert [s.loss_scale() for s in amp._amp_state.loss_scalers] == [65536.0, 65536.0, 32768.0, 65536.0]
    assert ema.weight.dtype == torch.float16 and ema(torch.randn(2, 4)).dtype == torch.float32


def test_float_function_decorates_where_real_programs_put_it(shim):
    """``@amp.float_function`` as programs placed it: under ``@staticmethod`` on an autograd Function's
    ``forward(ctx, *args)`` (insightface's partial-FC cross entropy), under ``@abc.abstractmethod`` on a loss base
    class, on a module's ``forward`` taking a list and keywords, and around a compiled op, as maskrcnn-benchmark's
    ``nms = amp.float_function(_C.nms)``. Each casts the half tensors of an O1 forward to float32, and the abstract
    method stays abstract."""
    import abc

    from apex import amp

    class CrossEntropy(torch.autograd.Function):
        @staticmethod
        @amp.float_function
        def forward(ctx, *args):
            ctx.save_for_backward(args[1])
            return args[1].float().sum() if args[1].dtype == torch.float32 else None

        @staticmethod
        def backward(ctx, grad):
            (logits,) = ctx.saved_tensors
            return None, torch.ones_like(logits) * grad

    class Loss(abc.ABC):
        @abc.abstractmethod
        @amp.float_function
        def compute(self, prediction, target):
            """Implemented by each loss."""

    class L2(Loss):
        @amp.float_function
        def compute(self, prediction, target):
            return (prediction - target).pow(2).mean()

    class Normalise(torch.nn.Module):
        @amp.float_function
        def forward(self, xs, scale=None, **kwargs):
            return [x / x.norm(dim=1, keepdim=True) * scale for x in xs]

    topk = amp.float_function(torch.topk)
    layer = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer, optimizer = amp.initialize(layer, optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
    hidden = layer(torch.randn(3, 4))
    assert hidden.dtype == torch.float16
    with pytest.raises(TypeError, match="abstract"):
        Loss()
    loss = CrossEntropy.apply(torch.tensor(1.0), hidden) + L2().compute(hidden, torch.zeros(3, 4))
    assert loss.dtype == torch.float32
    outputs = Normalise()([hidden, hidden], scale=hidden[:1], extra=hidden)
    assert [out.dtype for out in outputs] == [torch.float32] * 2 and topk(hidden, 2).values.dtype == torch.float32
    with amp.scale_loss(loss, optimizer) as scaled:
        scaled.backward()
    assert layer.weight.grad.dtype == torch.float32 and torch.isfinite(layer.weight.grad).all()
