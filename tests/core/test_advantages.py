"""Group advantages (TRL's arithmetic), Proposition 2 (eq. 5) and Lemma 1 -- pure torch."""

from __future__ import annotations

import pytest
import torch
from trl.trainer.utils import nanstd as trl_nanstd

from ncgrpo.core.advantages import (
    contrast_statistic,
    decompose_advantages,
    even_odd_parts,
    group_advantages,
    nanstd,
)


def _trl_advantages(rewards: torch.Tensor, G: int, scale: str) -> torch.Tensor:
    """TRL 1.16 GRPOTrainer._generate_and_score_completions, sum_then_normalize branch, verbatim."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = trl_nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = trl_nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def _rewards(B: int, G: int, seed: int, binary: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if binary:
        return (torch.rand(B, G, generator=g) < 0.4).float()
    return torch.randn(B, G, generator=g) * 3 + 1


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("seed", range(4))
def test_group_advantages_equal_trl(scale: str, seed: int) -> None:
    B, G = 5, 6
    r = _rewards(B, G, seed, binary=seed % 2 == 0).flatten()
    r[3] = float("nan")  # an unscorable completion
    ids = torch.arange(B * G) // G
    adv, _ = group_advantages(r, ids, scale=scale)
    assert torch.equal(adv, _trl_advantages(r, G, scale))


def test_group_ids_need_not_be_contiguous() -> None:
    r = _rewards(3, 4, 0, binary=False).flatten()
    ids = torch.arange(12) // 4
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(1))
    a, _ = group_advantages(r, ids)
    b, _ = group_advantages(r[perm], ids[perm])
    torch.testing.assert_close(b, a[perm], rtol=0, atol=0)


def test_nanstd_matches_trl() -> None:
    x = torch.tensor([[1.0, 2.0, float("nan"), 4.0], [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(nanstd(x, dim=1), trl_nanstd(x, dim=1))
    torch.testing.assert_close(nanstd(x), trl_nanstd(x))


# ---------------------------------------------------------------------------------------------
# Proposition 2 (eq. 5): A = within-half + contrast, contrast sums to 0 over the group
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_proposition_2_identity(seed: int, scale: str) -> None:
    n = 1 + seed % 6
    G, B = 2 * n, 7
    r = _rewards(B, G, seed, binary=seed % 2 == 1)
    noisy = torch.arange(G) >= n
    within, contrast = decompose_advantages(r, noisy, scale=scale)
    adv = _trl_advantages(r.flatten(), G, scale).view(B, G)
    torch.testing.assert_close(within + contrast, adv, rtol=0, atol=1e-5)
    torch.testing.assert_close(contrast.sum(1), torch.zeros(B), rtol=0, atol=1e-5)
    # equal halves: contrast is +-(r_c - r_eta) / (2 s), as printed in eq. (5)
    s = {"group": r.std(1) + 1e-4, "batch": (r.flatten().std() + 1e-4).expand(B), "none": torch.ones(B)}[
        scale
    ]
    gap = (r[:, ~noisy].mean(1) - r[:, noisy].mean(1)) / (2 * s)
    torch.testing.assert_close(contrast[:, 0], gap, rtol=0, atol=1e-5)
    torch.testing.assert_close(contrast[:, -1], -gap, rtol=0, atol=1e-5)
    torch.testing.assert_close(contrast_statistic(r, noisy, scale=scale), gap, rtol=0, atol=1e-5)
    # the within-half term sums to zero inside each half
    torch.testing.assert_close(within[:, noisy].sum(1), torch.zeros(B), rtol=0, atol=1e-5)
    torch.testing.assert_close(within[:, ~noisy].sum(1), torch.zeros(B), rtol=0, atol=1e-5)


def test_proposition_2_unequal_halves_and_any_layout() -> None:
    r = _rewards(4, 7, 3, binary=False)
    noisy = torch.tensor([0, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    within, contrast = decompose_advantages(r, noisy)
    adv = _trl_advantages(r.flatten(), 7, "group").view(4, 7)
    torch.testing.assert_close(within + contrast, adv, rtol=0, atol=1e-5)
    torch.testing.assert_close(contrast.sum(1), torch.zeros(4), rtol=0, atol=1e-5)


def test_contrast_vanishes_iff_halves_agree() -> None:
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    noisy = torch.tensor([False, False, True, True])
    _, contrast = decompose_advantages(r, noisy)
    assert torch.all(contrast[0] == 0)
    assert torch.all(contrast[1, :2] > 0) and torch.all(contrast[1, 2:] < 0)


def test_decompose_rejects_unmixed_group() -> None:
    with pytest.raises(ValueError, match="clean and one noisy"):
        decompose_advantages(torch.zeros(2, 4), torch.zeros(4, dtype=torch.bool))


# ---------------------------------------------------------------------------------------------
# Lemma 1: the antithetic pair mean is the even part; the odd (first-order) part is removed exactly
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(5))
def test_lemma_1_pair_mean_is_even_part(seed: int) -> None:
    d = 16
    g = torch.Generator().manual_seed(seed)
    c = torch.randn((), generator=g)
    a = torch.randn(d, generator=g)  # first-order response (odd)
    M = torch.randn(d, d, generator=g)
    M = (M + M.T) / 2  # curvature (even)
    v = torch.randn(d, generator=g)

    def phi(e: torch.Tensor) -> torch.Tensor:  # reward response: constant + odd + even + odd cubic
        return c + e @ a + torch.einsum("...i,ij,...j->...", e, M, e) + (e @ v) ** 3

    eps = torch.randn(64, d, generator=g) * 0.3  # 64 pairs
    even, odd = even_odd_parts(phi, eps)
    pair_mean = (phi(eps) + phi(-eps)) / 2
    torch.testing.assert_close(pair_mean, even, rtol=0, atol=0)
    torch.testing.assert_close(even + odd, phi(eps), rtol=1e-6, atol=1e-5)
    # the even part is exactly c + e^T M e: the linear and cubic (odd) terms are gone
    torch.testing.assert_close(even, c + torch.einsum("ni,ij,nj->n", eps, M, eps), rtol=1e-6, atol=1e-5)
    # ... and the odd part is exactly them
    torch.testing.assert_close(odd, eps @ a + (eps @ v) ** 3, rtol=1e-5, atol=1e-5)
    # so the noisy-half mean over pairs does not depend on the first-order response at all
    a2 = a * 100

    def phi2(e: torch.Tensor) -> torch.Tensor:
        return c + e @ a2 + torch.einsum("...i,ij,...j->...", e, M, e) + (e @ v) ** 3

    torch.testing.assert_close(even_odd_parts(phi2, eps)[0].mean(), even.mean(), rtol=1e-6, atol=1e-5)
    # whereas the mean of independent draws does
    assert not torch.allclose(phi2(eps).mean(), phi(eps).mean(), atol=1e-3)
