"""The trainer's per-row first-token TV / agreement (one softmax of every row, shared by both statistics)
equal :func:`first_token_tv` / :func:`branch_point_agreement` on each noisy row and its clean partner,
bit for bit, on the three paths: sampled logits, the temperature control, rewritten noisy logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from ncgrpo.core.agreement import branch_point_agreement, first_token_tv
from ncgrpo.trainer.metrics import branch_point_stats


@pytest.mark.parametrize("path", ["sampled", "control", "rewritten"])
def test_branch_point_stats_match_the_logit_functions(path):
    torch.manual_seed(0)
    G, groups, V, T = 8, 3, 517, 0.7
    # group 2 has no clean row on this rank: its noisy rows stay NaN
    plans = [SimpleNamespace(group=g, noisy=b >= G // 2 or g == 2) for g in range(groups) for b in range(G)]
    logits = torch.randn(len(plans), V) * 4
    noisy_t = 1.9 if path == "control" else None
    rewritten = torch.randn(len(plans), V) * 3 if path == "rewritten" else None
    tv, agree = branch_point_stats(plans, logits, noisy_t, temperature=T, noisy_logits=rewritten)
    for i, p in enumerate(plans):
        if not p.noisy or p.group == 2:
            assert torch.isnan(tv[i]) and torch.isnan(agree[i])
            continue
        c = p.group * G  # the group's first clean row
        z, zc = logits[i : i + 1], logits[c : c + 1]
        if path == "control":
            z = zc * (T / noisy_t)
        if path == "rewritten":
            z = rewritten[i : i + 1]
        assert torch.equal(tv[i : i + 1], first_token_tv(z, zc, t_a=T, t_b=T))
        assert torch.equal(agree[i : i + 1], branch_point_agreement(zc, z, temperature=T))
