"""A GAN on the classic 2-D "8 Gaussians" ring, written exactly as Apex users wrote it.

Nothing here knows about ampkit: run it unchanged with

    python -m ampkit.legacy examples/legacy_apex/train_gan.py --opt_level O1

Two models, two optimizers, ``num_losses=2`` (the discriminator's loss is ``loss_id=0``, the
generator's ``loss_id=1``), and the loss scales logged through ``amp._amp_state`` as legacy scripts did.
"""

# ruff: noqa: UP031  (%-formatting kept as the Apex-era script had it)
import argparse
import math

import torch
import torch.nn as nn
from apex import amp

parser = argparse.ArgumentParser()
parser.add_argument("--opt_level", default="O1")
parser.add_argument("--iters", type=int, default=600)
parser.add_argument("--batch_size", type=int, default=256)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--print_every", type=int, default=100)
parser.add_argument("--checkpoint", default="")
opt = parser.parse_args()

torch.manual_seed(opt.seed)
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
MODES = torch.tensor([[math.cos(2 * math.pi * k / 8), math.sin(2 * math.pi * k / 8)] for k in range(8)]) * 2.0


def real_batch(n):
    centers = MODES[torch.randint(0, 8, (n,))]
    return (centers + 0.05 * torch.randn(n, 2)).to(device)


def quality(samples):
    """Fraction of samples within 0.25 of a mode, and how many modes got at least 2% of them."""
    dist = torch.cdist(samples.float().cpu(), MODES)
    nearest, which = dist.min(dim=1)
    good = nearest < 0.25
    counts = torch.bincount(which[good], minlength=8)
    return good.float().mean().item(), int((counts > 0.02 * len(samples)).sum())


netG = nn.Sequential(nn.Linear(8, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 2)).to(device)
netD = nn.Sequential(nn.Linear(2, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
criterion = nn.BCEWithLogitsLoss()
optimizerD = torch.optim.Adam(netD.parameters(), lr=opt.lr, betas=(0.5, 0.999))
optimizerG = torch.optim.Adam(netG.parameters(), lr=opt.lr, betas=(0.5, 0.999))

[netD, netG], [optimizerD, optimizerG] = amp.initialize(
    [netD, netG], [optimizerD, optimizerG], opt_level=opt.opt_level, num_losses=2
)

fixed_noise = torch.randn(2000, 8, device=device)
with torch.no_grad():
    start_quality = quality(netG(fixed_noise))
print("start: fraction near a mode %.3f, modes covered %d" % start_quality)

for it in range(1, opt.iters + 1):
    # (1) Update D: maximize log(D(x)) + log(1 - D(G(z)))
    real = real_batch(opt.batch_size)
    noise = torch.randn(opt.batch_size, 8, device=device)
    fake = netG(noise)
    optimizerD.zero_grad()
    out_real = netD(real)
    out_fake = netD(fake.detach())
    errD = criterion(out_real, torch.ones_like(out_real)) + criterion(out_fake, torch.zeros_like(out_fake))
    with amp.scale_loss(errD, optimizerD, loss_id=0) as errD_scaled:
        errD_scaled.backward()
    optimizerD.step()

    # (2) Update G: maximize log(D(G(z)))
    optimizerG.zero_grad()
    out = netD(fake)
    errG = criterion(out, torch.ones_like(out))
    with amp.scale_loss(errG, optimizerG, loss_id=1) as errG_scaled:
        errG_scaled.backward()
    optimizerG.step()

    if it % opt.print_every == 0:
        print(
            "[%d/%d] Loss_D: %.4f Loss_G: %.4f loss_scale D: %g G: %g"
            % (
                it,
                opt.iters,
                errD.item(),
                errG.item(),
                amp._amp_state.loss_scalers[0].loss_scale(),
                amp._amp_state.loss_scalers[1].loss_scale(),
            )
        )

with torch.no_grad():
    end_quality = quality(netG(fixed_noise))
print("end: fraction near a mode %.3f, modes covered %d" % end_quality)

if opt.checkpoint:
    checkpoint = {
        "netD": netD.state_dict(),
        "netG": netG.state_dict(),
        "optimizerD": optimizerD.state_dict(),
        "optimizerG": optimizerG.state_dict(),
        "amp": amp.state_dict(),
    }
    torch.save(checkpoint, opt.checkpoint)
    restored = torch.load(opt.checkpoint)
    amp.load_state_dict(restored["amp"])
    assert amp.state_dict() == checkpoint["amp"]
    print("saved and reloaded checkpoint with amp state %s" % dict(restored["amp"]))
