"""A loss's found_inf flag is reused while its iterations are clean and replaced after one that overflowed."""

from __future__ import annotations

import torch

from ampkit.callbacks.found_inf_flags import FoundInfFlags
from ampkit.trainer.state import LossState


def test_flag_is_reused_while_clean_and_renewed_after_an_overflow():
    flags, device = FoundInfFlags(), torch.device("cpu")
    losses = {"A": LossState("A"), "B": LossState("B")}
    a, b = flags.get("A", device), flags.get("B", device)
    assert flags.get("A", device) is a and a.tolist() == [0.0]
    a.fill_(1.0)  # a check of loss A found inf; the Trainer read and agreed it
    losses["A"].found_inf = True
    flags.renew(losses)
    fresh = flags.get("A", device)
    assert fresh is not a and fresh.tolist() == [0.0]  # the next iteration starts clean
    assert flags.get("B", device) is b  # B's iteration was clean: same flag, no allocation


def test_a_flag_reported_by_several_checks_counts_once():
    loss, flag = LossState(0), torch.zeros(1)
    loss.report_found_inf(flag)
    loss.report_found_inf(flag)
    loss.report_found_inf(torch.zeros(1))
    assert len(loss.reported) == 2 and loss.reported[0] is flag
