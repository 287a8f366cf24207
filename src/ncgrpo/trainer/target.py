"""The target schedule (``target_marginal_tv``): each generation's ``sigma_k`` solved on that batch so that
the noise-averaged first-token TV of the noisy half equals the annealed target.

The paper's eq. (2) calibration fixes the perturbation's Euclidean size, ``sigma ||h||``; what the noisy
half samples from is ``q_bar`` (Proposition M, :mod:`ncgrpo.core.marginal`), and ``TV(q, q_bar)`` at a
fixed sigma differs between models and moves as RL changes the policy. With ``target_marginal_tv`` the
trainer holds that distance instead: it solves

    mean over the batch's prompts of TV(q_i, q_bar_i(sigma)) = target_marginal_tv * decay_k

for ``sigma`` in ``(0, sigma_max]`` (:func:`ncgrpo.core.marginal.solve_sigma_for_marginal_tv`) on the
batch's clean branch-point states, before any row is sampled (``target_scope='batch'``), or, with
``target_scope='prompt'``, each prompt's own

    TV(q_i, q_bar_i(sigma_i)) = target_marginal_tv * decay_k

(:func:`ncgrpo.core.prompt_solve.solve_per_prompt`; ``gen.row_sigma`` holds each row's sigma). Where:

- **inside the generation's own prefill** (transformers engine, every method that takes the target:
  :func:`prefill_resolver`): the final-norm hook hands the prefill's clean last-position states to the
  solve before it perturbs the noisy rows with the solved sigma (no extra forward). The
  ``first_token_marginal`` control reads the solved sigma in its LM-head hook, later in the same forward;
- **in the trainer's measurement pass on vLLM** (batch scope: :func:`ncgrpo.trainer.vllm.generate_vllm`
  runs its branch-point measurement before the engine generates, with this same resolver); the prompt
  scope on vLLM solves inside the engine (the ncgrpo plugin, :mod:`ncgrpo.engines.vllm_worker`).

Batch scope: each prompt counts once, on the rank that holds its group's first row; each evaluation sums
the ranks' TVs over processes, so every rank runs the same evaluations and gets the same ``sigma_k``.
Prompt scope: each prompt is solved alone on its own state and keys (no collective but the logged
summary's), so the same prompt at the same step gets the same sigma on any rank or process count. The TV
is the logged metric's own estimator (:func:`ncgrpo.trainer.generation.marginal_curve`: the same keyed
draws ``NoiseKey(seed, k, prompt_id, -1 - m)`` and bootstrap correction). No random state is drawn (keyed
draws; vLLM's measurement pass is greedy): a resumed run solves the same sigma from the same weights and batch,
and the sampling that follows is unchanged.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ncgrpo.core.marginal import SigmaSolve, solve_sigma_for_marginal_tv
from ncgrpo.core.prompt_solve import solve_per_prompt
from ncgrpo.engines.branch_point import find_text_stack, head_function
from ncgrpo.methods.base import Generation
from ncgrpo.trainer.generation import marginal_curve
from ncgrpo.trainer.metrics import gather


class SigmaAtMaxWarning(UserWarning):
    """The target schedule could not reach its target TV below ``sigma_max``."""


def _solve(trainer, gen: Generation, head, states: torch.Tensor, logits: torch.Tensor) -> SigmaSolve:
    """The solve on one rank's clean branch-point ``states`` ``# [L, d]`` and ``logits`` ``# [L, V]`` (its
    local rows), a collective: each TV evaluation is summed over processes."""
    a = trainer.args
    owners = [i for i, p in enumerate(gen.plans) if p.branch == 0]  # each group's first row: one per prompt
    curve = None
    if owners:
        idx = torch.tensor(owners)
        h, z = states[idx.to(states.device)], logits[idx.to(logits.device)]
        curve = marginal_curve(trainer, head, h, z, [gen.plans[i].prompt_id for i in owners], gen.step)

    def batch_tv(sigma: float) -> float:
        local = curve(sigma).tv if curve is not None else torch.zeros(0, dtype=torch.float64)
        both = gather(trainer.accelerator, torch.stack([local.sum(), torch.tensor(float(len(owners)))])[None])
        total = both.sum(0)  # [sum of TVs, prompts] over processes, summed in rank order on every rank
        return float(total[0] / total[1])

    return solve_sigma_for_marginal_tv(batch_tv, gen.target_tv, start=a.sigma0, sigma_max=a.sigma_max)


@dataclass(frozen=True)
class PromptScopeSolve:
    """``target_scope='prompt'``: the per-prompt solve of one generation over every process's prompts (each
    counted once): the prompts' mean sigma (``sigma``, logged ``noise/sigma_k``), ``sigma_min`` / ``sigma_max``,
    their mean achieved TV (``tv``), mean solver evaluations per prompt (``evals``), the fraction of prompts
    ``sigma_max`` bound (``at_max``) and the number of ``prompts``."""

    sigma: float
    sigma_min: float
    sigma_max: float
    tv: float
    evals: float
    at_max: float
    prompts: int


def _solve_prompts(
    trainer, gen: Generation, head, states: torch.Tensor, logits: torch.Tensor
) -> tuple[list[float], PromptScopeSolve]:
    """``target_scope='prompt'``: each prompt's own sigma on this rank's clean branch-point ``states``
    ``# [L, d]`` / ``logits`` ``# [L, V]``. Returns every local row's sigma (its prompt's; 0 on a clean row
    of a prompt without a noisy row here) and the summary over processes (a collective: one gather). Each
    prompt with a noisy row here, or whose group's first row is here (it is counted here), is solved on its
    first local row (:func:`ncgrpo.core.prompt_solve.solve_per_prompt`: each prompt's TV estimated alone on
    its own keyed draws), so its sigma depends on its own state and keys only, not on the other prompts of
    the batch, the rank or the process count."""
    a = trainer.args
    first: dict[int, int] = {}  # prompt_id -> its first local row
    owned: set[int] = set()  # prompts whose group's first row is here: counted in the summary here
    for i, p in enumerate(gen.plans):
        if p.noisy or p.branch == 0:
            first.setdefault(p.prompt_id, i)
        if p.branch == 0:
            owned.add(p.prompt_id)
    pids = list(first)
    sigma_of: dict[int, float] = {}
    stats = torch.zeros(5, dtype=torch.float64)  # sums of sigma, TV, evaluations, at sigma_max; prompts
    lo, hi = float("inf"), float("-inf")
    if pids:
        idx = torch.tensor([first[q] for q in pids])
        h, z = states[idx.to(states.device)], logits[idx.to(logits.device)]
        curve = marginal_curve(trainer, head, h, z, pids, gen.step)
        found = solve_per_prompt(curve, gen.target_tv, start=a.sigma0, sigma_max=a.sigma_max)
        sigma_of = {q: float(found.sigma[j]) for j, q in enumerate(pids)}
        mine = [j for j, q in enumerate(pids) if q in owned]
        if mine:
            m = torch.tensor(mine)
            sig = found.sigma[m]
            parts = [
                sig.sum(),
                found.tv[m].sum(),
                found.prompt_evals[m].sum(),
                found.at_max[m].sum(),
                len(mine),
            ]
            stats = torch.tensor([float(x) for x in parts], dtype=torch.float64)
            lo, hi = float(sig.min()), float(sig.max())
    both = gather(trainer.accelerator, torch.cat([stats, torch.tensor([lo, -hi], dtype=torch.float64)])[None])
    total = both[:, :5].sum(0)  # summed in rank order on every rank: every rank logs the same values
    n = max(float(total[4]), 1.0)
    summary = PromptScopeSolve(
        sigma=float(total[0] / n),
        sigma_min=float(both[:, 5].min()),
        sigma_max=float(-both[:, 6].min()),
        tv=float(total[1] / n),
        evals=float(total[2] / n),
        at_max=float(total[3] / n),
        prompts=int(total[4]),
    )
    return [sigma_of.get(p.prompt_id, 0.0) for p in gen.plans], summary


def _solve_scoped(trainer, gen: Generation, head, states: torch.Tensor, logits: torch.Tensor):
    """The solve of ``trainer.args.target_scope`` (a collective): ``batch``, one sigma (:func:`_solve`);
    ``prompt``, each prompt's (:func:`_solve_prompts`, which sets ``gen.row_sigma``)."""
    if trainer.args.target_scope == "prompt":
        gen.row_sigma, found = _solve_prompts(trainer, gen, head, states, logits)
        return found
    return _solve(trainer, gen, head, states, logits)


def record_solve(trainer, gen: Generation, found: SigmaSolve | PromptScopeSolve) -> None:
    """``gen.sigma_k`` / ``gen.target_solve`` from the solve; warns once per run where ``sigma_max`` bound it."""
    gen.target_solve, gen.sigma_k = found, float(found.sigma)
    if found.at_max and not getattr(trainer, "_nc_warned_sigma_max", False):
        trainer._nc_warned_sigma_max = True
        if trainer.accelerator.is_main_process:
            what = (
                f"{found.at_max:.0%} of the batch's prompts stay below the annealed target {gen.target_tv:.4g} "
                f"(noise-averaged first-token TV) at sigma_max={trainer.args.sigma_max:g} and are generated there "
                "(noise/sigma_at_max logs the fraction)"
                if isinstance(found, PromptScopeSolve)
                else f"the batch's noise-averaged first-token TV is {found.tv:.4g} at sigma_max="
                f"{trainer.args.sigma_max:g}, below the annealed target {gen.target_tv:.4g}; generating at "
                "sigma_max (noise/sigma_at_max = 1)"
            )
            warnings.warn(
                f"target_marginal_tv: at step {gen.step} {what}. Raise sigma_max or lower the target (said once "
                "per run).",
                SigmaAtMaxWarning,
                stacklevel=3,
            )


def prefill_resolver(trainer, gen: Generation, model) -> Callable[[torch.Tensor], list]:
    """The ``resolve`` of :func:`~ncgrpo.engines.transformers.prefill_noise` for this generation: given the
    prefill's clean branch-point states ``# [L, d]``, solve sigma_k for ``gen.target_tv`` (the clean
    logits through the LM head's weights, gathered for generation under ZeRO-3), record it on ``gen`` and
    return the rows' noise at it. Reads ``trainer.nc_method`` (``row_noise``)."""

    def resolve(states: torch.Tensor) -> list:
        head = head_function(
            find_text_stack(model)[0].lm_head,
            "target_marginal_tv (the solve of sigma_k at the prefill)",
            "or unset target_marginal_tv",
        )
        with torch.no_grad():
            found = _solve_scoped(trainer, gen, head, states, head(states).float())
        record_solve(trainer, gen, found)
        sigmas = gen.row_sigma or [found.sigma] * len(gen.plans)
        return [trainer.nc_method.row_noise(p, s) for p, s in zip(gen.plans, sigmas, strict=True)]

    return resolve
