"""The parity reference: the digits MLP trained by a plain PyTorch loop, no ampkit."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def digits_split(val_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_val = int(len(x) * val_fraction)
    return TensorDataset(x[order[n_val:]], y[order[n_val:]]), TensorDataset(x[order[:n_val]], y[order[:n_val]])


def hand_loop(
    steps: int,
    seed: int = 0,
    batch_size: int = 32,
    lr: float = 1e-3,
    weight_decay: float = 1e-2,
    hidden: int = 128,
    dropout: float = 0.1,
    accumulate: int = 1,
    clip: float | None = None,
) -> nn.Module:
    """Train for ``steps`` optimizer steps and return the model."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    train, _ = digits_split()
    # The Trainer's order for a shuffled loader: one permutation per epoch keyed by (seed, epoch), the same one
    # that any number of ranks deals round-robin (a sampler of one replica, reseeded each epoch).
    order = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    loader = DataLoader(train, batch_size=batch_size, sampler=order)
    done, epoch = 0, 0
    while done < steps:
        model.train()
        order.set_epoch(epoch)
        epoch += 1
        batches = list(loader)
        for i, (x, y) in enumerate(batches):
            loss = F.cross_entropy(model(x), y)
            (loss / accumulate if accumulate > 1 else loss).backward()
            if (i + 1) % accumulate == 0 or i + 1 == len(batches):
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip, foreach=True)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                done += 1
                if done == steps:
                    return model
    return model
