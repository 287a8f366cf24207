"""Agreement statistics that carry information: how much the noise moved the branch point and the answers.

Eq. (4)'s kernel with ``tau`` the RMS of within-group distances is scale-free, and fed the injected
displacements alone it is a constant of ``G`` (0.632 for ``G = 4``, 0.642 for ``G = 12``) whatever
``sigma_k`` is. The statistics here depend on the model and fall to "full agreement" as the noise
stops acting:

- :func:`first_token_tv`: total-variation distance between the clean and the noisy first-token
  distributions (the branch point's own output, ``softmax(lm_head(h~) / T)``);
- :func:`branch_point_agreement`: how often a noisy branch's first token coincides with a clean
  branch's, relative to two clean branches: ``sum_v p(v) q(v) / sum_v p(v)^2`` (``p`` clean, ``q`` the
  noisy row's distribution). 1 when the noise leaves the distribution unchanged; below 1 when it moves
  mass off the clean policy's likely tokens. It is LINEAR in ``q``, so its mean over noisy rows equals
  its value at the noise-averaged ``q_bar`` (:mod:`ncgrpo.core.marginal`): unlike a per-draw distance
  it describes what the rollouts are sampled from. (It replaces eq. (4)'s kernel with a bandwidth from
  the clean spread, which saturated: 1.00000 -> 0.99987 while the per-draw TV went 0.003 -> 0.062.)
- :func:`answer_agreement`: the fraction of noisy rollouts whose extracted answer equals the clean
  half's majority answer;
- :func:`match_first_token_temperature`: the first-token temperature whose mean TV equals a target
  (the matched control of section 3.1, calibrated to the latent noise's TV).

Pure torch; no engine imports.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import torch

__all__ = [
    "agreement_of_probs",
    "answer_agreement",
    "branch_point_agreement",
    "first_token_tv",
    "match_first_token_temperature",
    "tv_of_probs",
]


def first_token_tv(
    logits_a: torch.Tensor, logits_b: torch.Tensor, *, t_a: float = 1.0, t_b: float = 1.0
) -> torch.Tensor:
    """``TV(softmax(a / t_a), softmax(b / t_b))`` per row. ``logits_*`` ``# [B, V]`` -> ``# [B]``."""
    if logits_a.shape != logits_b.shape:
        raise ValueError(f"logits shapes differ: {tuple(logits_a.shape)} vs {tuple(logits_b.shape)}")
    if not (t_a > 0 and t_b > 0):
        raise ValueError(f"temperatures must be > 0, got {t_a}, {t_b}")
    p = torch.softmax(logits_a.float() / t_a, dim=-1)
    q = torch.softmax(logits_b.float() / t_b, dim=-1)
    return tv_of_probs(p, q)


def tv_of_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """:func:`first_token_tv` on distributions already computed: ``0.5 * sum_v |p - q|``. ``# [B, V]`` -> ``# [B]``"""
    return 0.5 * (p - q).abs().sum(-1)


def branch_point_agreement(
    clean_logits: torch.Tensor, noisy_logits: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """First-token agreement of each noisy row with its clean partner: ``sum_v p q / sum_v p^2``.

    ``clean_logits`` / ``noisy_logits`` ``# [B, V]`` (row ``i`` of each belongs to the same prompt);
    ``p = softmax(clean / T)``, ``q = softmax(noisy / T)``. The probability that a noisy branch and a
    clean branch sample the same first token, over the probability that two clean branches do: 1 when
    ``q = p``, ``q(argmax p)`` for a deterministic clean policy, and (linear in ``q``) its mean over
    draws is its value at ``q_bar``. It can exceed 1 when the noise concentrates mass on the clean
    policy's likely tokens. Returns ``# [B]``.
    """
    p = torch.softmax(clean_logits.float() / temperature, dim=-1)
    q = torch.softmax(noisy_logits.float() / temperature, dim=-1)
    return agreement_of_probs(p, q)


def agreement_of_probs(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """:func:`branch_point_agreement` on distributions already computed (``p`` clean, ``q`` noisy):
    ``sum_v p q / sum_v p^2``. ``# [B, V]`` -> ``# [B]``"""
    return (p * q).sum(-1) / p.pow(2).sum(-1).clamp_min(1e-30)


def answer_agreement(answers: Sequence[str | None], noisy: Sequence[bool], group_size: int) -> float:
    """Fraction of noisy rows whose answer equals their group's clean-half majority answer.

    ``answers``: one extracted answer per row (``None``: no answer), rows grouped by ``group_size``.
    Groups whose clean half gave no answer at all are skipped; ``nan`` if none is left.
    """
    if len(answers) != len(noisy) or len(answers) % group_size:
        raise ValueError(f"{len(answers)} answers and {len(noisy)} flags do not form groups of {group_size}")
    hits = total = 0
    for g in range(0, len(answers), group_size):
        ans, flags = answers[g : g + group_size], noisy[g : g + group_size]
        clean = Counter(a for a, f in zip(ans, flags, strict=True) if not f and a is not None)
        if not clean:
            continue
        top = clean.most_common(1)[0][0]
        for a, f in zip(ans, flags, strict=True):
            if f:
                total += 1
                hits += a == top
    return hits / total if total else math.nan


def match_first_token_temperature(
    clean_logits: torch.Tensor,
    target_tv: float,
    *,
    temperature: float = 1.0,
    max_temperature: float = 1e3,
    iters: int = 60,
) -> float:
    """The first-token temperature ``T0 >= temperature`` whose mean ``TV(softmax(z/T0), softmax(z/T))``
    over the rows of ``clean_logits`` ``# [B, V]`` equals ``target_tv`` (bisection; TV grows with T0).

    Returns ``temperature`` for ``target_tv <= 0`` and ``max_temperature`` if even that is not enough.
    """
    if not 0 <= target_tv <= 1 or not math.isfinite(target_tv):
        raise ValueError(f"target_tv must be in [0, 1], got {target_tv}")

    def tv(t0: float) -> float:
        return float(first_token_tv(clean_logits, clean_logits, t_a=t0, t_b=temperature).mean())

    if target_tv <= 0:
        return float(temperature)
    if tv(max_temperature) < target_tv:
        return float(max_temperature)
    lo, hi = math.log(temperature), math.log(max_temperature)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if tv(math.exp(mid)) < target_tv:
            lo = mid
        else:
            hi = mid
    return float(math.exp(0.5 * (lo + hi)))
