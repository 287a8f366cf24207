"""Group advantages and the mixed-group decomposition (paper section 3.2): pure torch, no TRL import.

- :func:`group_advantages` -- GRPO's ``A_i = (r_i - mean_g) / (std_g + 1e-4)`` exactly as TRL 1.16
  computes it (NaN-aware mean, Bessel-corrected std, ``scale_rewards`` in group/batch/none), but
  over an arbitrary group id per row, so a trainer can regroup rows (``antithetic_grouping=
  "separate"``) without re-implementing TRL's arithmetic.
- :func:`decompose_advantages` -- Proposition 2 (eq. 5): every advantage of a mixed clean/noisy group
  is a within-half advantage plus a contrast term that is equal and opposite across the halves.
- :func:`contrast_statistic` -- the per-group contrast ``(r_c - r_eta) / (2 s)`` logged as
  ``reward/contrast``.
- :func:`even_odd_parts` -- Lemma 1: the antithetic pair mean is the even part of the reward response.

Shapes: ``B`` prompts (groups), ``G`` rollouts per group (``G = 2n`` for two-pass methods).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch

__all__ = [
    "ADV_EPS",
    "contrast_statistic",
    "decompose_advantages",
    "even_odd_parts",
    "group_advantages",
    "nanstd",
]

#: TRL 1.16's denominator guard: ``advantages / (std + 1e-4)``.
ADV_EPS = 1e-4

Scale = Literal["group", "batch", "none"]


def nanstd(x: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Bessel-corrected standard deviation ignoring NaNs, as TRL's ``nanstd``; NaN with < 2 values."""
    if dim is None:
        x, dim = x.flatten(), 0
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim)
    count = (~torch.isnan(x)).sum(dim=dim).to(var.dtype)
    corr = torch.where(count > 1, count / (count - 1).clamp(min=1), torch.full_like(count, float("nan")))
    return torch.sqrt(var * corr)


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    *,
    scale: Scale = "group",
    eps: float = ADV_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO advantages over arbitrary groups, TRL 1.16's arithmetic (``sum_then_normalize``).

    ``rewards`` ``# [N]`` (NaN = unscorable, excluded from its group's statistics and given advantage
    0, as TRL does); ``group_ids`` ``# [N]`` int, rows sharing an id form one group (any order).
    ``scale``: ``"group"`` divides by the group's std + eps, ``"batch"`` by the std of all rewards +
    eps, ``"none"`` not at all. Returns ``(advantages, std)`` ``# [N]`` where ``std`` is the std the
    row was scaled by (the group std for ``"none"`` too: TRL uses it for ``frac_reward_zero_std``).

    With ``group_ids = arange(N) // G`` this equals TRL's ``view(-1, G)`` computation bit for bit.
    """
    if rewards.dim() != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_ids must be 1-D of equal length, got {rewards.shape}, {group_ids.shape}"
        )
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")
    mean = torch.empty_like(rewards)
    std = torch.empty_like(rewards)
    for g in torch.unique(group_ids):
        sel = group_ids == g
        r = rewards[sel]
        mean[sel] = torch.nanmean(r)
        std[sel] = nanstd(r) if r.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
    if scale == "batch":
        std = (nanstd(rewards) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)).expand_as(
            rewards
        )
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + eps)
    return torch.nan_to_num(adv, nan=0.0), std


def _halves(rewards: torch.Tensor, noisy_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be [B, G], got {tuple(rewards.shape)}")
    noisy = torch.as_tensor(noisy_mask, dtype=torch.bool, device=rewards.device)
    if noisy.shape != (rewards.shape[1],):
        raise ValueError(f"noisy_mask must be [G]={rewards.shape[1]}, got {tuple(noisy.shape)}")
    n_eta = int(noisy.sum())
    n_c = rewards.shape[1] - n_eta
    if n_eta == 0 or n_c == 0:
        raise ValueError("a mixed group needs at least one clean and one noisy rollout")
    return noisy, ~noisy, n_c, n_eta


def decompose_advantages(
    rewards: torch.Tensor,
    noisy_mask: torch.Tensor,
    *,
    scale: Scale = "group",
    eps: float = ADV_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposition 2 (eq. 5): ``A = within + contrast`` for a mixed clean/noisy group.

    ``rewards`` ``# [B, G]`` (one row per prompt), ``noisy_mask`` ``# [G]`` bool (which branches are
    noisy). With ``s`` the scale of :func:`group_advantages` (group std + eps for ``"group"``; batch
    std + eps for ``"batch"``; 1 for ``"none"``), and half means ``r_c``, ``r_eta``:

    - ``within_i = (r_i - r_half(i)) / s``;
    - ``contrast_i = + n_eta / G * (r_c - r_eta) / s`` on clean rows and
      ``- n_c / G * (r_c - r_eta) / s`` on noisy rows; with equal halves (``G = 2n``, the paper's
      setting) both are ``+-(r_c - r_eta) / (2 s)``, the form printed in eq. (5).

    ``within + contrast`` equals :func:`group_advantages` of the same group exactly (up to float
    rounding), and ``contrast`` sums to zero over every group. Returns ``(within, contrast)``
    ``# [B, G]``. Rewards must be finite.
    """
    noisy, clean, n_c, n_eta = _halves(rewards, noisy_mask)
    r = rewards.float()
    G = r.shape[1]
    r_c = r[:, clean].mean(1, keepdim=True)  # [B, 1]
    r_eta = r[:, noisy].mean(1, keepdim=True)  # [B, 1]
    s = _scale(r, scale, eps)  # [B, 1]
    half_mean = torch.where(noisy[None, :], r_eta, r_c)  # [B, G]
    within = (r - half_mean) / s
    gap = (r_c - r_eta) / s  # [B, 1]
    contrast = torch.where(noisy[None, :], -(n_c / G) * gap, (n_eta / G) * gap)
    return within, contrast


def _scale(r: torch.Tensor, scale: Scale, eps: float) -> torch.Tensor:
    if scale == "group":
        return r.std(1, unbiased=True, keepdim=True) + eps
    if scale == "batch":
        return (r.flatten().std(unbiased=True) + eps).expand(r.shape[0], 1)
    if scale == "none":
        return torch.ones(r.shape[0], 1, dtype=r.dtype)
    raise ValueError(f"scale must be 'group', 'batch' or 'none', got {scale!r}")


def contrast_statistic(
    rewards: torch.Tensor, noisy_mask: torch.Tensor, *, scale: Scale = "group", eps: float = ADV_EPS
) -> torch.Tensor:
    """Per-group ``(r_c - r_eta) / (2 s)``: the clean row's contrast term of eq. (5). ``# [B]``

    Logged (mean over groups) as ``reward/contrast``. NaN rewards are ignored in the half means and
    the std; a group whose halves cannot be compared gives NaN.
    """
    noisy, clean, _, _ = _halves(rewards, noisy_mask)
    r = rewards.float()
    r_c = torch.nanmean(r[:, clean], dim=1)
    r_eta = torch.nanmean(r[:, noisy], dim=1)
    if scale == "group":
        s = nanstd(r, dim=1) + eps
    elif scale == "batch":
        s = (nanstd(r.flatten()) + eps).expand(r.shape[0])
    else:
        s = torch.ones(r.shape[0])
    return (r_c - r_eta) / (2.0 * s)


def even_odd_parts(
    phi: Callable[[torch.Tensor], torch.Tensor], eps: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Lemma 1: ``(phi_even(eps), phi_odd(eps))`` with ``phi_even = (phi(e) + phi(-e)) / 2`` -- the
    mean of an antithetic pair -- and ``phi_odd = (phi(e) - phi(-e)) / 2``; ``phi = even + odd``."""
    plus, minus = phi(eps), phi(-eps)
    return (plus + minus) / 2.0, (plus - minus) / 2.0
