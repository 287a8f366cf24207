"""Solving for the noise scale whose noise-averaged first-token TV is a target: :func:`secant_steps`,
the solver's iterations as a generator (it yields the next sigma to evaluate and is sent its TV), and
:func:`solve_sigma_for_marginal_tv`, which drives it with a TV function (the target schedule's batch
scope, ``ncgrpo probe --target_marginal_tv``). The per-prompt scope drives one generator per prompt in
lockstep (:mod:`ncgrpo.core.prompt_solve`). Pure Python: the TV comes from the caller
(:class:`~ncgrpo.core.marginal.MarginalCurve`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator
from dataclasses import dataclass

__all__ = ["TARGET_DRAWS", "TARGET_SCOPES", "SigmaSolve", "secant_steps", "solve_sigma_for_marginal_tv"]

#: the fewest draws per prompt the target schedule solves on: three antithetic pairs, the fewest the
#: estimate's jackknife bias correction runs on (:func:`ncgrpo.core.marginal.estimate_marginal_tv`)
TARGET_DRAWS = 6
#: ``target_scope``: what the target schedule holds (the batch mean, or each prompt); one list for the TRL
#: config and verl's ``ncgrpo:`` block
TARGET_SCOPES = ("batch", "prompt")


@dataclass(frozen=True)
class SigmaSolve:
    """What :func:`solve_sigma_for_marginal_tv` found: ``sigma``, the TV there (``tv``), how many TV
    evaluations it took (``evals``) and whether ``sigma_max`` bounded it short of the target (``at_max``)."""

    sigma: float
    tv: float
    evals: int
    at_max: bool = False


def secant_steps(
    target: float, *, start: float, sigma_max: float, rtol: float = 0.02, max_evals: int = 12
) -> Generator[float, float, SigmaSolve]:
    """The noise scale whose marginal TV is ``target`` within ``rtol`` (relative): yields each sigma to
    evaluate, is sent its TV, returns the :class:`SigmaSolve`. From ``start``
    (clamped into ``(0, sigma_max]``) it extrapolates on ``TV ~ sigma**2`` (the law near 0) until the
    target is bracketed, then takes the secant of ``log TV`` on ``log sigma`` between the bracket's ends,
    falling back to the bracket's geometric middle where the secant leaves it. Returns the closest
    evaluation after ``max_evals``; ``sigma_max`` (``at_max``) where even it stays below the target;
    ``sigma`` 0 for a target of 0 (no evaluation)."""
    if not (math.isfinite(target) and 0 <= target <= 1):
        raise ValueError(f"target marginal TV must be in [0, 1], got {target}")
    if not (math.isfinite(sigma_max) and sigma_max > 0):
        raise ValueError(f"sigma_max must be a finite number > 0, got {sigma_max}")
    if target <= 0:
        return SigmaSolve(0.0, 0.0, 0)
    s = min(max(float(start), 1e-3 * sigma_max), sigma_max) if math.isfinite(start) else sigma_max / 10
    lo_s, lo_tv = 0.0, 0.0  # largest sigma seen below the target
    hi: tuple[float, float] | None = None  # smallest sigma seen at or above it
    best = SigmaSolve(s, float("nan"), 0)
    for evals in range(1, max_evals + 1):
        tv = float((yield s))
        if not math.isfinite(tv):
            raise ValueError(f"the marginal TV at sigma {s:g} is {tv}: check the model's logits")
        if not math.isfinite(best.tv) or abs(tv - target) < abs(best.tv - target):
            best = SigmaSolve(s, tv, evals)
        if abs(tv - target) <= rtol * target:
            return SigmaSolve(s, tv, evals)
        if tv < target:
            lo_s, lo_tv = s, tv
        elif hi is None or s < hi[0]:
            hi = (s, tv)
        if hi is None:  # not bracketed yet: grow on TV ~ sigma^2, at most 4x per step
            if s >= sigma_max:
                return SigmaSolve(sigma_max, tv, evals, at_max=True)
            grow = math.sqrt(target / tv) if tv > 0 else 4.0
            s = min(s * min(max(grow, 1.1), 4.0), sigma_max)
            continue
        hs, htv = hi
        if lo_s > 0 and lo_tv > 0:  # the secant of log TV on log sigma
            slope = math.log(htv / lo_tv) / math.log(hs / lo_s) if htv > lo_tv else 0.0
            nxt = math.exp(math.log(lo_s) + math.log(target / lo_tv) / slope) if slope > 0 else -1.0
        else:
            nxt = hs * math.sqrt(target / htv)
        if not lo_s < nxt < hs:
            nxt = math.sqrt(lo_s * hs) if lo_s > 0 else hs / 2
        s = nxt
    return SigmaSolve(best.sigma, best.tv, max_evals, at_max=best.sigma >= sigma_max and best.tv < target)


def solve_sigma_for_marginal_tv(
    tv_at: Callable[[float], float],
    target: float,
    *,
    start: float,
    sigma_max: float,
    rtol: float = 0.02,
    max_evals: int = 12,
) -> SigmaSolve:
    """The noise scale whose marginal TV is ``target`` within ``rtol`` (relative), in few evaluations:
    the target schedule calls it once per generation, each evaluation ``P * draws`` rows through the LM
    head.

    ``tv_at`` must use common random numbers (:class:`MarginalCurve`), so it is a deterministic,
    continuous function that grows with ``sigma``; near 0 the marginal TV grows as ``sigma**2`` (the
    first-order term of ``q_eps - q`` averages out over eps). From ``start`` (clamped into
    ``(0, sigma_max]``) the solver extrapolates on that law until the target is bracketed, then
    interpolates in log-log between the bracket's ends (a secant on ``log TV = a + b log sigma``),
    falling back to the bracket's geometric middle where the secant leaves the bracket. Deterministic:
    the same ``tv_at`` and arguments give the same result (a resumed run solves the same sigma_k).
    Returns the closest evaluation after ``max_evals``; ``sigma_max`` (``at_max``) where even it stays
    below the target; ``sigma`` 0 for a target of 0.
    """
    steps = secant_steps(target, start=start, sigma_max=sigma_max, rtol=rtol, max_evals=max_evals)
    try:
        s = next(steps)
        while True:
            s = steps.send(tv_at(s))
    except StopIteration as done:
        return done.value
