"""The target schedule per prompt (``target_scope: prompt``): each prompt's own noise scale ``sigma_i``, so
that ITS noise-averaged first-token TV is the target,

    TV(q_i, q_bar_i(sigma_i)) = target        for every prompt i of the batch,

where the batch scope (``target_scope: batch``) holds only the batch mean at one shared sigma. At one
sigma the prompts' TVs spread widely (0.0009 to 0.026 at sigma 0.2 on the embedded base), so holding the
mean leaves one prompt's noisy half many times stronger than another's.

Pure tensor code: :func:`~ncgrpo.core.sigma_solve.secant_steps` is the solver of
:func:`~ncgrpo.core.sigma_solve.solve_sigma_for_marginal_tv` written as a generator (it yields the next
sigma to evaluate and receives its TV), so one prompt or a whole batch in lockstep run the same
iterations; :func:`solve_per_prompt` drives one per prompt against
a :class:`~ncgrpo.core.marginal.MarginalCurve` (common random numbers: the keyed draws of each prompt),
evaluating every unfinished prompt at its own sigma in one round. Deterministic: the same curve (the
same clean states, keys and head) gives the same sigmas on any engine, rank or resume.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ncgrpo.core.marginal import MarginalCurve
from ncgrpo.core.sigma_solve import SigmaSolve, secant_steps

__all__ = ["PromptSolve", "curve_tv_at", "secant_steps", "solve_per_prompt"]


def curve_tv_at(curve: MarginalCurve, sigmas: dict[int, float]) -> dict[int, float]:
    """``{prompt: TV}`` of the curve's prompts ``i`` at their own ``sigmas[i]``, each prompt estimated on
    its own (its draws through the LM head alone, its control variate and jackknife: the estimator is
    per prompt), so a prompt's value does not depend on which prompts share its batch, not even by the
    float rounding a larger matrix product would change. It equals ``curve(sigma).tv[i]`` up to that
    rounding."""
    return {i: float(curve.prompts(float(s), i, i + 1).tv[0]) for i, s in sigmas.items()}


@dataclass(frozen=True)
class PromptSolve:
    """The per-prompt solve of a batch: ``sigma``, ``tv`` ``# [P]`` (float64) each prompt's solved sigma
    and its TV there, ``at_max`` ``# [P]`` (bool) where ``sigma_max`` bound it, ``prompt_evals`` ``# [P]``
    (int) each prompt's evaluations, ``evals``: the prompts' evaluations in all, ``rounds``: the lockstep
    rounds (LM-head passes over the unfinished prompts)."""

    sigma: torch.Tensor
    tv: torch.Tensor
    at_max: torch.Tensor
    prompt_evals: torch.Tensor
    evals: int
    rounds: int

    def summary(self) -> dict[str, float]:
        """What the trainer logs: the sigmas' mean, min and max, the mean TV, the evaluations and the
        prompts bound by ``sigma_max``."""
        return {
            "sigma_mean": float(self.sigma.mean()),
            "sigma_min": float(self.sigma.min()),
            "sigma_max": float(self.sigma.max()),
            "tv_mean": float(self.tv.mean()),
            "evals": float(self.evals),
            "at_max": float(self.at_max.sum()),
        }


def solve_per_prompt(
    curve: MarginalCurve,
    target: float,
    *,
    start: float,
    sigma_max: float,
    rtol: float = 0.02,
    max_evals: int = 12,
) -> PromptSolve:
    """Each prompt's sigma whose TV is ``target`` within ``rtol``: :func:`secant_steps` per prompt, all
    prompts in lockstep (each round one evaluation of every unfinished prompt at its own sigma,
    :func:`curve_tv_at`). A prompt's result depends on its own curve only, so it is the same whichever
    other prompts share the batch."""
    steps = [
        secant_steps(target, start=start, sigma_max=sigma_max, rtol=rtol, max_evals=max_evals)
        for _ in range(curve.P)
    ]
    done: dict[int, SigmaSolve] = {}
    pending: dict[int, float] = {}
    for i, g in enumerate(steps):
        try:
            pending[i] = next(g)
        except StopIteration as stop:
            done[i] = stop.value
    rounds = 0
    while pending:
        rounds += 1
        tvs = curve_tv_at(curve, pending)
        nxt: dict[int, float] = {}
        for i in pending:
            try:
                nxt[i] = steps[i].send(tvs[i])
            except StopIteration as stop:
                done[i] = stop.value
        pending = nxt
    order = [done[i] for i in range(curve.P)]
    return PromptSolve(
        sigma=torch.tensor([r.sigma for r in order], dtype=torch.float64),
        tv=torch.tensor([r.tv for r in order], dtype=torch.float64),
        at_max=torch.tensor([r.at_max for r in order]),
        prompt_evals=torch.tensor([r.evals for r in order]),
        evals=sum(r.evals for r in order),
        rounds=rounds,
    )
