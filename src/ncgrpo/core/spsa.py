"""SPSA's update of the steering vector ``mu`` from one step's antithetic rollouts, eq. (6).

The pieces (:func:`~ncgrpo.core.noise.spsa_gradient`, :func:`~ncgrpo.core.noise.spsa_update`) are in
:mod:`ncgrpo.core.noise`; this module pairs the rows of the one row plan and weights their reward gaps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ncgrpo.core import noise as nz
from ncgrpo.core.plan import RowPlan

__all__ = ["spsa_step"]


def spsa_step(
    mu: torch.Tensor,
    plans: Sequence[RowPlan],
    rewards: torch.Tensor,
    sigma_k: float,
    *,
    seed: int,
    step: int,
    lr: float,
    mu_max: float,
    max_step: float | None = None,
) -> torch.Tensor | None:
    """``Pi(mu + lr * g)`` with ``g`` from this step's antithetic pairs, or ``None`` when no pair has
    two finite rewards.

    ``rewards`` ``# [N_global]`` is indexed by each plan's ``global_row``. Pair ``p``'s branch-point
    displacement is ``sigma_k * r_p * u_k`` (+ the shared ``mu``), with ``u_k`` the step's direction
    (``draw_direction(seed, step, d)``) and ``r_p`` the rank-one scalar of its key at the last prompt
    token, so its gap is weighted by ``r_p`` (``spsa_gradient(..., r=...)``); NaN-reward pairs are
    dropped. ``max_step`` bounds the step's norm (:func:`~ncgrpo.core.noise.spsa_update`).
    """
    d = mu.numel()
    u = nz.draw_direction(seed, step, d)  # [d]
    plus: dict[tuple, float] = {}
    minus: dict[tuple, float] = {}
    for p in plans:
        if p.noisy and p.key is not None:
            (plus if p.sign > 0 else minus)[(p.group, p.key)] = float(rewards[p.global_row])
    rp, rm, r = [], [], []
    uu = float(u @ u)
    for gk, vp in plus.items():
        vm = minus.get(gk)
        if vm is None or math.isnan(vp) or math.isnan(vm):
            continue
        eps0 = nz.draw_eps(gk[1], [0], d, mode="rank_one")[0]  # r_p * u
        rp.append(vp)
        rm.append(vm)
        r.append(float(eps0 @ u) / uu)
    if not rp:
        return None
    g = nz.spsa_gradient(rp, rm, sigma_k, u, r=r)
    return nz.spsa_update(mu, g, lr, mu_max, max_step=max_step).float()
