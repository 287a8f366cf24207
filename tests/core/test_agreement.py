"""Agreement statistics (issue: eq. (4) fed the displacements alone is a constant of G)."""

from __future__ import annotations

import math

import pytest
import torch

from ncgrpo.core.agreement import (
    answer_agreement,
    branch_point_agreement,
    first_token_tv,
    match_first_token_temperature,
)
from ncgrpo.core.noise import NoiseKey, RowNoise, agreement_kernel, perturb_rows


def test_first_token_tv_basics():
    z = torch.randn(5, 11)
    assert torch.allclose(first_token_tv(z, z), torch.zeros(5))
    one_hot_a = torch.tensor([[50.0, 0.0, 0.0]])
    one_hot_b = torch.tensor([[0.0, 50.0, 0.0]])
    assert first_token_tv(one_hot_a, one_hot_b).item() == pytest.approx(1.0, abs=1e-6)
    # a higher temperature on one side moves the distribution
    assert (first_token_tv(z, z, t_a=3.0) > 0).all()


def test_branch_point_agreement_is_one_without_change_and_falls_with_distance():
    torch.manual_seed(0)
    z = torch.randn(64, 20)
    assert torch.allclose(branch_point_agreement(z, z), torch.ones(64))
    small = branch_point_agreement(z, z + 0.1 * torch.randn_like(z)).mean()
    large = branch_point_agreement(z, z + 3.0 * torch.randn_like(z)).mean()
    assert 1.0 > small > large
    # a deterministic clean policy: 1 if the noisy one is the same, 0 if it moved
    det = torch.tensor([[100.0, 0.0, 0.0]])
    assert branch_point_agreement(det, det).item() == 1.0
    assert branch_point_agreement(det, torch.tensor([[0.0, 100.0, 0.0]])).item() == pytest.approx(
        0.0, abs=1e-12
    )


def test_branch_point_agreement_mean_over_draws_is_its_value_at_the_mixture():
    """Linear in q: averaging it over noisy draws gives the agreement of the noise-averaged q_bar, so the
    logged mean describes what the rollouts are sampled from (a per-draw TV does not: it is larger)."""
    g = torch.Generator().manual_seed(3)
    clean = torch.randn(1, 40, generator=g)
    draws = clean + 1.5 * torch.randn(500, 40, generator=g)
    per_draw = branch_point_agreement(clean.expand(500, -1), draws).mean()
    q_bar = torch.softmax(draws, -1).mean(0, keepdim=True)
    at_mixture = branch_point_agreement(clean, q_bar.log())[0]
    assert per_draw.item() == pytest.approx(at_mixture.item(), rel=1e-5)
    assert per_draw < 1.0
    tv_per_draw = first_token_tv(clean.expand(500, -1), draws).mean()
    tv_mixture = first_token_tv(clean, q_bar.log())[0]
    assert tv_per_draw > 1.5 * tv_mixture  # the per-draw distance overstates the mixture's


def test_agreement_moves_with_sigma_where_the_old_metric_did_not():
    """On a linear 'lm_head' over calibrated noise: the old kernel (RMS bandwidth, displacement states)
    is the same at every sigma; the branch-point agreement falls and the TV rises with sigma."""
    g = torch.Generator().manual_seed(1)
    d, V, G = 64, 30, 8
    head = torch.randn(V, d, generator=g) / math.sqrt(d) * 4
    h = torch.randn(1, 1, d, generator=g).expand(G, 1, d).contiguous()
    mask = torch.ones(G, 1, dtype=torch.long)
    old, new, tvs = [], [], []
    for sigma in (0.05, 0.3, 1.5):
        rows = [RowNoise()] * (G // 2) + [RowNoise(sigma, NoiseKey(0, 1, 7, j)) for j in range(G // 2)]
        h_tilde, _ = perturb_rows(h, rows, attention_mask=mask)
        states = (h_tilde - h)[:, -1]
        kern = agreement_kernel(states)
        old.append(float(kern[~torch.eye(G, dtype=torch.bool)].mean()))
        logits = h_tilde[:, -1] @ head.T
        clean, noisy = logits[: G // 2], logits[G // 2 :]
        new.append(float(branch_point_agreement(clean, noisy).mean()))
        tvs.append(float(first_token_tv(noisy, clean).mean()))
    assert max(old) - min(old) < 0.02  # scale-free: uninformative
    assert new[0] > new[1] > new[2]
    assert tvs[0] < tvs[1] < tvs[2]


def test_answer_agreement():
    answers = ["3", "3", "4", "3", "3", "5", "5", None]
    noisy = [False, False, True, True] * 2
    # group 1: clean majority "3"; noisy "4", "3" -> 1/2. group 2: clean majority "3"; noisy "5", None -> 0/2
    assert answer_agreement(answers, noisy, 4) == pytest.approx(1 / 4)
    assert math.isnan(answer_agreement([None] * 4, [False, False, True, True], 4))
    with pytest.raises(ValueError, match="groups of"):
        answer_agreement(["1"] * 3, [False] * 3, 2)


def test_match_first_token_temperature_recovers_a_known_temperature():
    torch.manual_seed(3)
    z = torch.randn(32, 50) * 3
    target = float(first_token_tv(z, z, t_a=2.5).mean())
    assert match_first_token_temperature(z, target) == pytest.approx(2.5, rel=1e-4)
    assert match_first_token_temperature(z, 0.0) == 1.0
    with pytest.raises(ValueError, match="target_tv"):
        match_first_token_temperature(z, 1.5)
