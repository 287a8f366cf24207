"""The target schedule (``target_marginal_tv``): each generation's ``sigma_k`` solved on that batch so that
the noise-averaged first-token TV of the noisy half equals the annealed target.

The paper's eq. (2) calibration fixes the perturbation's Euclidean size, ``sigma ||h||``; what the noisy
half samples from is ``q_bar`` (Proposition M, :mod:`ncgrpo.core.marginal`), and ``TV(q, q_bar)`` at a
fixed sigma differs between models and moves as RL changes the policy. With ``target_marginal_tv`` the
trainer holds that distance instead: before each generation it runs one clean, no-grad prompt-only pass
of the rank's rows (the trainer's own model, whatever engine then generates: transformers, vLLM colocate
or server), and inside the LM head's forward (where ZeRO-3 has its weights gathered) solves

    mean over the batch's prompts of TV(q_i, q_bar_i(sigma)) = target_marginal_tv * decay_k

for ``sigma`` in ``(0, sigma_max]`` (:func:`ncgrpo.core.marginal.solve_sigma_for_marginal_tv`). Each
prompt counts once, on the rank that holds its group's first row; the TV is the logged metric's own
estimator (:func:`ncgrpo.trainer.metrics.marginal_curve`: the same keyed draws
``NoiseKey(seed, k, prompt_id, -1 - m)`` and bootstrap correction), and each evaluation sums the ranks'
TVs over processes, so every rank runs the same evaluations and gets the same ``sigma_k``. No random
state is drawn (greedy pass, keyed draws): a resumed run solves the same ``sigma_k`` from the same
weights and batch, and the sampling that follows is unchanged.
"""

from __future__ import annotations

import warnings

import torch

from ncgrpo.core import noise as nz
from ncgrpo.core.marginal import SigmaSolve, solve_sigma_for_marginal_tv
from ncgrpo.trainer.metrics import (
    _LocalGen,
    branch_point_hooks,
    gather,
    marginal_curve,
    prefill_only,
    unwrapped_model,
)


class SigmaAtMaxWarning(UserWarning):
    """The target schedule could not reach its target TV below ``sigma_max``."""


def solve_target_sigma(trainer, gen: _LocalGen, target: float, prompt_ids, multimodal_fields) -> SigmaSolve:
    """Set ``gen.sigma_k`` (and ``gen.target_tv``, ``gen.target_solve``) to the sigma whose batch-mean
    noise-averaged first-token TV is ``target`` (see the module docstring). Collective: every process
    calls it once per generation. Reads ``trainer.args`` (``sigma0``: the first guess, ``sigma_max``,
    ``marginal_tv_draws``, ``share_prompt_prefill``), ``.nc_method``, ``.accelerator``; runs
    :func:`~ncgrpo.trainer.metrics.prefill_only`."""
    from ncgrpo.engines.shared_prefill import share_prompt_prefill

    a = trainer.args
    owners = [i for i, p in enumerate(gen.plans) if p.branch == 0]  # each group's first row: one per prompt
    pids = [gen.plans[i].prompt_id for i in owners]

    def solve(head, logits, states) -> SigmaSolve:  # inside the LM head's forward (ZeRO-3)
        curve = None
        if owners:
            idx = torch.tensor(owners)
            h, z = states[idx.to(states.device)], logits[idx.to(logits.device)]
            curve = marginal_curve(trainer, head, h, z, pids, gen.step)

        def batch_tv(sigma: float) -> float:
            local = curve(sigma).double() if curve is not None else torch.zeros(0, dtype=torch.float64)
            both = gather(trainer.accelerator, torch.stack([local.sum(), torch.tensor(float(len(owners)))])[None])
            total = both.sum(0)  # [sum of TVs, prompts] over processes, summed in rank order on every rank
            return float(total[0] / total[1])

        return solve_sigma_for_marginal_tv(batch_tv, target, start=a.sigma0, sigma_max=a.sigma_max)

    gen.target_tv = float(target)
    if target <= 0:  # annealed away: no pass needed
        gen.target_solve, gen.sigma_k = SigmaSolve(0.0, 0.0, 0), 0.0
        return gen.target_solve
    model = unwrapped_model(trainer)
    clean = [nz.RowNoise()] * len(gen.plans)
    # the forward the rows' branch point is measured in: the transformers engine's generate (shared
    # prefill where on), vLLM's measurement pass (one prefill per row, measure_branch_point); the same
    # computation gives the same states, so the logged TV reads back the solved one
    shared = a.share_prompt_prefill and not getattr(trainer, "use_vllm", False)
    with (
        branch_point_hooks(model, clean, a, None, solve) as (_, point),
        share_prompt_prefill(model, shared),
    ):
        prefill_only(trainer, prompt_ids, multimodal_fields)
    found: SigmaSolve = point.extra
    gen.target_solve, gen.sigma_k = found, float(found.sigma)
    if found.at_max and not getattr(trainer, "_nc_warned_sigma_max", False):
        trainer._nc_warned_sigma_max = True
        if trainer.accelerator.is_main_process:
            warnings.warn(
                f"target_marginal_tv: at step {gen.step} the batch's noise-averaged first-token TV is {found.tv:.4g} "
                f"at sigma_max={a.sigma_max:g}, below the annealed target {target:.4g}; generating at sigma_max "
                "(noise/sigma_at_max = 1). Raise sigma_max or lower the target (said once per run).",
                SigmaAtMaxWarning,
                stacklevel=2,
            )
    return found

