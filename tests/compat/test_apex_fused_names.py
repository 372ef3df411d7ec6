"""Apex's fused optimizer and norm names resolve to ampkit's ops (needs the ops branches merged)."""

import inspect

import pytest
import torch

import ampkit.compat.normalization as normalization
import ampkit.compat.optimizers as optimizers

OPTIMIZERS = list(optimizers._APEX_NAMES)  # FP16_Optimizer, a wrapper, has tests of its own
NORMS = list(normalization._MODULES)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_names_are_ampkits_fused_optimizers(name):
    import ampkit.ops.optimizers as ops

    cls = getattr(optimizers, name)  # a subclass adding Apex's attributes (and its step counting per group)
    assert issubclass(cls, getattr(ops, name)) and cls.__name__ == name
    assert cls._steps_per_group == (name in optimizers._GROUP_STEP_NAMES)
    assert issubclass(cls, torch.optim.Optimizer)


@pytest.mark.parametrize("name", NORMS)
def test_norm_names_are_ampkits_fused_norms(name):
    import ampkit.ops.norms as ops

    cls = getattr(normalization, name)
    assert cls is getattr(ops, name)
    norm = cls(8)
    out = norm(torch.randn(3, 8))
    assert out.shape == (3, 8) and torch.isfinite(out).all()


def test_fused_adam_steps_through_the_apex_shim():
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    install_apex_shim()
    try:
        from apex.normalization import FusedLayerNorm
        from apex.optimizers import FusedAdam

        model = torch.nn.Sequential(torch.nn.Linear(8, 8), FusedLayerNorm(8))
        optimizer = FusedAdam(model.parameters(), lr=1e-2)
        before = [p.detach().clone() for p in model.parameters()]
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optimizer.step()
        assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    finally:
        uninstall_apex_shim()


def test_unknown_names_are_a_clear_error():
    with pytest.raises(AttributeError, match="FusedAdamW.*FusedAdam"):
        optimizers.FusedAdamW  # noqa: B018


def test_file_named_submodules_import_through_the_shim():
    """Legacy code imports Apex's modules by file name (``apex.normalization.fused_layer_norm``,
    ``apex.optimizers.fused_adam``), where the ampkit module standing for the package is a plain module."""
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    install_apex_shim()
    try:
        from apex.normalization.fused_layer_norm import FusedLayerNorm, FusedLayerNormAffineFunction
        from apex.optimizers.fused_adam import FusedAdam
        from apex.optimizers.fused_lamb import FusedLAMB

        assert FusedLayerNorm is normalization.FusedLayerNorm
        assert FusedLayerNormAffineFunction is normalization.FusedLayerNormAffineFunction
        assert (FusedAdam, FusedLAMB) == (optimizers.FusedAdam, optimizers.FusedLAMB)
    finally:
        uninstall_apex_shim()


def test_file_named_submodules_are_attributes_of_their_package():
    """Apex's packages import their files, so ``from apex.optimizers import fused_adam`` and
    ``apex.optimizers.fused_adam.FusedAdam`` work without importing the path first; both were ImportError and
    AttributeError. The ampkit modules standing for those packages lose the names again with the shim."""
    from ampkit.compat import install_apex_shim, parallel, uninstall_apex_shim

    install_apex_shim()
    try:
        import apex
        from apex.optimizers import fp16_optimizer, fused_adam, fused_mixed_precision_lamb
        from apex.parallel import optimized_sync_batchnorm

        assert apex.optimizers.fused_lamb.FusedLAMB is fused_adam.FusedLAMB is optimizers.FusedLAMB
        assert fused_mixed_precision_lamb.FusedMixedPrecisionLamb is optimizers.FusedMixedPrecisionLamb
        assert fp16_optimizer.FP16_Optimizer is not None
        assert optimized_sync_batchnorm.SyncBatchNorm is apex.parallel.SyncBatchNorm
        assert apex.parallel.LARC is parallel.LARC  # a class of the file's name stays the class
    finally:
        uninstall_apex_shim()
    assert not hasattr(optimizers, "fused_adam") and not hasattr(parallel, "optimized_sync_batchnorm")
    assert parallel.distributed.DistributedDataParallel is parallel.DistributedDataParallel  # a real submodule stays


def test_fused_layer_norm_module_path_keeps_the_function_of_its_name():
    """Apex's ``fused_layer_norm.py`` defines ``fused_layer_norm()``, which Megatron-style code imports from that
    path: importing the path rebound the name to a module, so the call failed ('module' object is not callable)."""
    from ampkit.compat import install_apex_shim, uninstall_apex_shim

    x = torch.randn(3, 8)
    expected = torch.nn.functional.layer_norm(x, (8,), eps=1e-6)
    install_apex_shim()
    try:
        import apex.normalization.fused_layer_norm as by_path
        from apex.normalization.fused_layer_norm import FusedRMSNorm, fused_layer_norm, fused_layer_norm_affine

        torch.testing.assert_close(fused_layer_norm(x, (8,)), expected)
        torch.testing.assert_close(normalization.fused_layer_norm(x, (8,)), expected)  # ampkit's own name
        assert by_path.FusedRMSNorm is FusedRMSNorm is normalization.FusedRMSNorm  # the module's names, as in Apex
        assert fused_layer_norm_affine is normalization.fused_layer_norm_affine
    finally:
        uninstall_apex_shim()
    assert normalization.fused_layer_norm is fused_layer_norm  # the function again once the shim is gone


@pytest.mark.parametrize("scale", [1.0, 1e20], ids=["unit", "beyond_float32_squares"])
def test_manual_rms_norm_keeps_float64_input_in_float64(scale):
    """Float64 input gets its mean square in float64, as torch's rms_norm: in float32 the result was off by 1e-7
    (relative), and by all of it once the squares overflow float32."""
    x = (torch.randn(3, 2, 8, dtype=torch.float64) * scale).requires_grad_()
    reference_x = x.detach().clone().requires_grad_()
    weight = torch.linspace(0.5, 1.5, 8, dtype=torch.float64)
    out = normalization.manual_rms_norm(x, (8,), weight, 1e-6)
    expected = torch.nn.functional.rms_norm(reference_x, (8,), weight, 1e-6)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    cotangent = torch.randn_like(out)
    out.backward(cotangent)
    expected.backward(cotangent)
    torch.testing.assert_close(x.grad * scale, reference_x.grad * scale, rtol=1e-11, atol=1e-12)


def test_apex_norm_functions_take_apex_arguments():
    """``Fused*Function.apply`` and the functional forms with Apex's argument order, against torch's norms."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    out = normalization.FusedLayerNormAffineFunction.apply(x, w, b, (8,), 1e-5)
    expected = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    torch.testing.assert_close(out, expected)
    grads = torch.autograd.grad(out.sum(), (x, w, b))
    torch.testing.assert_close(grads, torch.autograd.grad(expected.sum(), (x, w, b)))
    torch.testing.assert_close(
        normalization.FusedLayerNormFunction.apply(x, (8,), 1e-5), torch.nn.functional.layer_norm(x, (8,), eps=1e-5)
    )
    rms = normalization.FusedRMSNormAffineFunction.apply(x, w, (8,), 1e-5)
    torch.testing.assert_close(rms, normalization.manual_rms_norm(x, (8,), w, 1e-5))
    torch.testing.assert_close(rms, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w)
    low = torch.randn(4, 8, dtype=torch.bfloat16)
    weight, bias = torch.ones(8), torch.zeros(8)
    assert normalization.FusedLayerNormAffineMixedDtypesFunction.apply(low, weight, bias, (8,), 1e-5).dtype == (
        torch.float32
    )
    assert normalization.FusedRMSNormAffineMixedDtypesFunction.apply(low, weight, (8,), 1e-5).dtype == torch.float32
    assert normalization.fused_rms_norm_affine(low, weight, (8,), 1e-5).dtype == torch.bfloat16


@pytest.mark.parametrize(
    ("name", "arguments"),
    [
        ("FusedLayerNormAffineFunction", "input weight bias normalized_shape eps memory_efficient"),
        ("FusedLayerNormAffineMixedDtypesFunction", "input weight bias normalized_shape eps memory_efficient"),
        ("FusedLayerNormFunction", "input normalized_shape eps memory_efficient"),
        ("FusedRMSNormAffineFunction", "input weight normalized_shape eps memory_efficient"),
        ("FusedRMSNormAffineMixedDtypesFunction", "input weight normalized_shape eps memory_efficient"),
        ("FusedRMSNormFunction", "input normalized_shape eps memory_efficient"),
    ],
)
def test_apex_norm_functions_have_apex_forward_arguments(name, arguments):
    """Megatron-core's FusedLayerNorm (and its forks) picks its call by ``"memory_efficient" in
    inspect.getfullargspec(FusedLayerNormAffineFunction.forward).args`` on every forward: an AttributeError here."""
    assert inspect.getfullargspec(getattr(normalization, name).forward).args == ["ctx", *arguments.split()]


def test_megatron_fused_layer_norm_forward_runs_both_of_its_calls():
    """Its call with ``memory_efficient`` (Apex from mid-2023) and without, against torch's layer norm."""
    function = normalization.FusedLayerNormAffineFunction
    torch.manual_seed(0)
    x = torch.randn(2, 3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    expected = torch.nn.functional.layer_norm(x, (8,), w, b, 1e-5)
    expected_grads = torch.autograd.grad(expected.sum(), (x, w, b))
    assert "memory_efficient" in inspect.getfullargspec(function.forward).args
    for out in (function.apply(x, w, b, 8, 1e-5, True), function.apply(x, w, b, 8, 1e-5)):
        torch.testing.assert_close(out, expected)
        torch.testing.assert_close(torch.autograd.grad(out.sum(), (x, w, b)), expected_grads)


def test_apex_positional_argument_order_is_kept():
    """Legacy code passes Apex's options positionally; each lands where Apex's signature puts it (ampkit's own
    options, such as ``maximize``, are keyword-only and cannot be reached that way)."""
    p = [torch.nn.Parameter(torch.randn(4))]
    adam = optimizers.FusedAdam(p, 0.1, False, (0.8, 0.9), 1e-7, False, 0.01, False, False)
    expected = {"lr": 0.1, "bias_correction": False, "betas": (0.8, 0.9), "eps": 1e-7, "adam_w_mode": False}
    expected |= {"weight_decay": 0.01, "maximize": False}
    assert {key: adam.param_groups[0][key] for key in expected} == expected
    assert adam.set_grad_none is False
    sgd = optimizers.FusedSGD(p, 0.1, 0.9, 0.0, 0.01, True, False, True, False)
    group = sgd.param_groups[0]
    assert (group["lr"], group["momentum"], group["weight_decay"], group["nesterov"], group["maximize"]) == (
        0.1,
        0.9,
        0.01,
        True,
        False,
    )
    assert sgd.set_grad_none is False and not sgd.master_weights
    lamb = optimizers.FusedLAMB(p, 0.1, True, (0.9, 0.99), 1e-6, 0.02, False, True, True, False, 5.0, True)
    group = lamb.param_groups[0]
    assert (group["weight_decay"], group["max_grad_norm"], group["use_nvlamb"], lamb.set_grad_none) == (
        0.02,
        5.0,
        True,
        False,
    )
    novograd = optimizers.FusedNovoGrad(p, 0.1, True, (0.9, 0.99), 1e-8, 0.0, False, True, False, 2, True, False)
    assert novograd.param_groups[0]["init_zero"] is True and novograd.set_grad_none is False
    adagrad = optimizers.FusedAdagrad(p, 0.1, 1e-8, 1e-4, False)
    group = adagrad.param_groups[0]
    assert (group["eps"], group["weight_decay"], group["lr_decay"], group["initial_accumulator_value"]) == (
        1e-8,
        1e-4,
        0.0,
        0.0,
    )
    assert adagrad.set_grad_none is False
    mixed = optimizers.FusedMixedPrecisionLamb(p, 0.1, 7, False, (0.8, 0.9))
    assert mixed.param_groups[0]["bias_correction"] is False and mixed.param_groups[0]["betas"] == (0.8, 0.9)
    with pytest.raises(TypeError):
        optimizers.FusedAdam(p, 0.1, True, (0.9, 0.999), 1e-8, True, 0.0, False, True, False, False, True)


def test_mixed_precision_lamb_starts_from_the_step_it_is_given():
    """Apex's ``step`` argument: a resumed schedule's bias correction continues from that count."""
    torch.manual_seed(0)
    grad = torch.randn(6)
    fresh, resumed = torch.nn.Parameter(torch.ones(6)), torch.nn.Parameter(torch.ones(6))
    for param, step in ((fresh, 0), (resumed, 100)):
        optimizer = optimizers.FusedMixedPrecisionLamb([param], lr=0.1, step=step, weight_decay=0.0)
        param.grad = grad.clone()
        optimizer.step()
        assert float(optimizer.state[param]["step"]) == step + 1
    assert not torch.equal(fresh, resumed)  # bias corrections of step 1 and step 101 differ


@pytest.mark.parametrize("name", ["FusedAdam", "FusedLAMB"])
def test_apex_names_count_steps_per_group(name):
    """Apex's FusedAdam/FusedLAMB counted steps per param group: a parameter that sat out five steps without a
    gradient takes the group's bias correction (step 6) at its first update, where torch's counting (ampkit's own
    class) starts it at 1."""
    import ampkit.ops.optimizers as ops

    counts = {}
    for source in (optimizers, ops):
        torch.manual_seed(0)
        always, late = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.ones(3))
        optimizer = getattr(source, name)([always, late], lr=0.1, weight_decay=0.0)
        for step in range(6):
            always.grad = torch.randn(4)
            late.grad = torch.full((3,), 0.5) if step == 5 else None
            optimizer.step()
        counts[source.__name__] = (float(optimizer.state[late]["step"]), late.detach().clone())
    (group_step, grouped), (param_step, per_param) = counts["ampkit.compat.optimizers"], counts["ampkit.ops.optimizers"]
    assert (group_step, param_step) == (6.0, 1.0)
    if name == "FusedAdam":  # Adam's first update at step t, with bias corrections 1 - beta**t
        b1, b2, t, g = 0.9, 0.999, 6, 0.5
        m, v = (1 - b1) * g / (1 - b1**t), (1 - b2) * g * g / (1 - b2**t)
        torch.testing.assert_close(grouped, torch.full((3,), 1 - 0.1 * m / (v**0.5 + 1e-8)))
    assert not torch.equal(grouped, per_param)


def test_a_step_skipped_on_the_device_does_not_count():
    """Under GradScaler the skip is decided inside the kernel; the group's count moves only with steps taken."""
    param = torch.nn.Parameter(torch.ones(3))
    optimizer = optimizers.FusedAdam([param], lr=0.1)
    for found_inf, expected in ((0.0, 1), (1.0, 1), (0.0, 2)):
        param.grad = torch.full((3,), 0.5)
        optimizer.step(grad_scale=torch.tensor(1.0), found_inf=torch.tensor(found_inf))
        assert int(optimizer.param_groups[0]["step"]) == expected == float(optimizer.state[param]["step"])


def test_fused_adam_refuses_the_first_fused_adams_step_arguments_with_apexs_message():
    """Old fairseq/BERT code stepped ``optimizer.step(grads=..., output_params=..., scale=...)``: Apex's last
    FusedAdam refused it with a message saying what to do, not a TypeError."""
    from ampkit.compat.optimizers import FusedAdam

    param = torch.nn.Parameter(torch.ones(3))
    param.grad = torch.ones(3)
    optimizer = FusedAdam([param], lr=0.1)
    for call in (lambda: optimizer.step(grads=[param.grad], scale=1.0), lambda: optimizer.step(None, [param.grad])):
        with pytest.raises(RuntimeError, match="call step\\(\\) with no arguments"):
            call()
    assert torch.equal(param.detach(), torch.ones(3))
    optimizer.step(grads=None, output_params=None)  # Nones are what Apex's own wrappers passed: a normal step
    assert (param.detach() < 1).all()
