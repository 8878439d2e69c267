"""`diagnose`'s correction shares say what a correction the recipe leaves off *would* mask, not
what the run masks."""

from __future__ import annotations

import torch

from moe_rl.diagnostics.measure import MeasureParams, correction_shares
from moe_rl.diagnostics.results import NotAvailable


def test_an_off_correction_is_said_as_what_it_would_mask():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(40, generator=g)
    rollout = logp + 0.3 * torch.randn(40, generator=g)  # far apart: every band masks something
    seq_ids = torch.arange(40) // 10
    on = correction_shares(logp, rollout, seq_ids, 4, torch.ones(4), MeasureParams())
    off = correction_shares(logp, rollout, seq_ids, 4, torch.ones(4), MeasureParams(off=frozenset({"mis"})))
    assert on["mis_masked_seq_frac"] > 0
    assert isinstance(off["mis_masked_seq_frac"], NotAvailable)
    assert (
        off["mis_masked_seq_frac"].reason
        == f"MIS is off in the recipe (it would mask {on['mis_masked_seq_frac']:.1%})"
    )
    assert off["icepop_masked_frac"] == on["icepop_masked_frac"]  # IcePop is on: a share the run masks
