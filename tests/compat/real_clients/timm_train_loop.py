"""timm's ``train.py`` loop, trimmed to what an Apex user exercises, built from timm's own pieces.

Run as a user runs a legacy script: ``python -m ampkit.legacy timm_train_loop.py --amp-impl apex OUT`` (or
``--amp-impl native`` under plain ``python``; ``torchrun`` for several ranks). It does what timm's train.py
does with ``--amp --amp-impl apex``: ``amp.initialize(..., opt_level="O1")`` and timm's ``ApexScaler``,
``apex.parallel.DistributedDataParallel(delay_allreduce=True)``, apex's ``convert_syncbn_model`` under
``--sync-bn``, timm's optimizer factory (``fused*`` names are Apex's), ``model.no_sync()`` around every
micro-batch but the last when the model has it, timm's ``dispatch_clip_grad`` through the scaler, and
``timm.models.resume_checkpoint``. timm's CUDA asserts (train.py's two, the optimizer factory's for ``fused*``)
are what a CPU user patches: train.py's are left out, the factory's is answered below.
Writes ``OUT`` (JSON): the loss of every update, the final loss scale and a checksum of the weights.
"""

import argparse
import contextlib
import functools
import json
import os
from unittest import mock

import torch
import torch.nn.functional as F
from timm.models import create_model, resume_checkpoint
from timm.optim import create_optimizer_v2
from timm.utils import ApexScaler

RANK = int(os.environ.get("RANK", 0))
WORLD_SIZE = int(os.environ.get("WORLD_SIZE", 1))


def batches(count: int, micro_batch: int):
    """The same global batches for any world size: rank r takes its slice of each."""
    g = torch.Generator().manual_seed(0)
    for _ in range(count):
        images = torch.randn(micro_batch * WORLD_SIZE, 3, 32, 32, generator=g)
        labels = torch.randint(0, 5, (micro_batch * WORLD_SIZE,), generator=g)
        mine = slice(RANK * micro_batch, (RANK + 1) * micro_batch)
        yield images[mine], labels[mine]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--amp-impl", choices=["apex", "native"], default="apex")
    parser.add_argument("--opt", default="fusedadamw")
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--grad-accum-steps", type=int, default=1)
    parser.add_argument("--clip-grad", type=float, default=None)
    parser.add_argument("--sync-bn", action="store_true")
    parser.add_argument("--save-after", type=int, default=None, help="write a timm checkpoint after this update")
    parser.add_argument("--resume", default="")
    args = parser.parse_args()

    torch.manual_seed(42)
    if WORLD_SIZE > 1:
        torch.distributed.init_process_group("gloo")
    model = create_model("test_resnet", num_classes=5)
    if args.sync_bn:
        from apex.parallel import convert_syncbn_model

        model = convert_syncbn_model(model)
    # timm's factory asserts CUDA before it hands out an Apex optimizer; on CPU that one question is answered yes
    # (the user's patch, as for train.py's two device asserts).
    with mock.patch("torch.cuda.is_available", return_value=True):
        optimizer = create_optimizer_v2(model, opt=args.opt, lr=1e-3, weight_decay=0.05)
    autocast, loss_scaler = contextlib.nullcontext, None
    if args.amp_impl == "apex":
        from apex import amp

        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        loss_scaler = ApexScaler()
    else:  # timm's native path on CPU: autocast, and no GradScaler off CUDA
        autocast = functools.partial(torch.autocast, device_type="cpu", dtype=torch.float16)
    start = 0
    if args.resume:
        start = resume_checkpoint(model, args.resume, optimizer=optimizer, loss_scaler=loss_scaler, log_info=False)
    if WORLD_SIZE > 1:
        from apex.parallel import DistributedDataParallel as ApexDDP

        model = ApexDDP(model, delay_allreduce=True)

    has_no_sync = hasattr(model, "no_sync")
    accum = args.grad_accum_steps
    losses = []
    data = batches(args.updates * accum, micro_batch=4)
    for _ in range(start * accum):
        next(data)
    model.train()
    for update in range(start, args.updates):
        total = 0.0
        for micro in range(accum):
            images, labels = next(data)
            need_update = micro == accum - 1
            with model.no_sync() if has_no_sync and not need_update else contextlib.nullcontext():
                with autocast():
                    loss = F.cross_entropy(model(images), labels) / accum
                if loss_scaler is not None:
                    loss_scaler(loss, optimizer, clip_grad=args.clip_grad, parameters=model.parameters(),
                                need_update=need_update)  # fmt: skip
                else:
                    loss.backward()
                    if need_update:
                        if args.clip_grad is not None:
                            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
                        optimizer.step()
            total += loss.item()
        optimizer.zero_grad()
        losses.append(total)
        if args.save_after == update + 1 and RANK == 0:
            checkpoint = {"epoch": update + 1, "state_dict": model.state_dict(), "optimizer": optimizer.state_dict()}
            if loss_scaler is not None:
                checkpoint[loss_scaler.state_dict_key] = loss_scaler.state_dict()
            torch.save(checkpoint, args.out + ".ckpt")

    scale = None
    if args.amp_impl == "apex":
        from apex import amp

        scale = amp._amp_state.loss_scalers[0].loss_scale()
    weights = torch.cat([p.detach().double().flatten() for p in model.parameters()])
    result = {
        "losses": losses,
        "loss_scale": scale,
        "checksum": weights.sum().item(),
        "abs_sum": weights.abs().sum().item(),
    }
    with open(f"{args.out}.rank{RANK}", "w") as f:
        json.dump(result, f)
    if WORLD_SIZE > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
