"""The verl integration's metrics, pure (plain arrays and the engines' read-back rows in, floats out; no
verl, no Ray): the per-half rewards and contrast of a batch (:func:`half_metrics`) and the target
schedule's per-prompt solves read back from verl's vLLM servers (:func:`target_metrics`). Re-exported by
:mod:`ncgrpo.integrations.verl.config`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ncgrpo.core.advantages import contrast_statistic
from ncgrpo.core.prompt_solve import PromptSolve

__all__ = ["VERL_EPS", "half_metrics", "target_metrics"]

#: verl's GRPO denominator guard, ``(r - mean) / (std + 1e-6)`` (``core_algos.compute_grpo_outcome_advantage``).
VERL_EPS = 1e-6


def half_metrics(
    rewards: Sequence[float] | torch.Tensor,
    groups: Sequence[Any],
    noisy: Sequence[bool] | torch.Tensor,
    sigmas: Sequence[float] | torch.Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = VERL_EPS,
) -> dict[str, float]:
    """``reward/clean``, ``reward/noisy``, ``reward/contrast`` and ``noise/sigma_k`` of one verl step
    (the TRL trainer's names), from one row per session.

    ``reward/contrast`` is the mean over groups with both halves of eq. (5)'s clean-row contrast
    ``(r_c - r_eta) / (2 s)`` (:func:`ncgrpo.core.advantages.contrast_statistic`) with verl's ``s``
    (group std + 1e-6, or 1 with ``norm_adv_by_std_in_grpo=False``). Groups may be incomplete or
    unordered (verl drops a failed session); each is taken as it came.
    """
    r = torch.as_tensor(rewards, dtype=torch.float32).flatten()
    m = torch.as_tensor(noisy, dtype=torch.bool).flatten()
    s = torch.as_tensor(sigmas, dtype=torch.float32).flatten()
    if not (len(groups) == r.numel() == m.numel() == s.numel()):
        raise ValueError(
            f"one group, noisy flag and sigma per reward: {len(groups)}, {m.numel()}, {s.numel()}, {r.numel()}"
        )
    out: dict[str, float] = {}
    if (~m).any():
        out["reward/clean"] = float(torch.nanmean(r[~m]))
    if m.any():
        out["reward/noisy"] = float(torch.nanmean(r[m]))
        if torch.isfinite(s[m]).all():  # NaN under target_marginal_tv: the engine's sigmas (target_metrics)
            out["noise/sigma_k"] = float(s[m].mean())
    by_group: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        by_group.setdefault(g, []).append(i)
    contrasts = []
    for rows in by_group.values():
        gm = m[rows]
        if gm.all() or not gm.any():
            continue
        c = contrast_statistic(r[rows][None, :], gm, scale="group" if norm_by_std else "none", eps=eps)
        contrasts.append(c)
    if contrasts:
        c = torch.cat(contrasts)
        out["reward/contrast"] = float(torch.nanmean(c)) if torch.isfinite(c).any() else 0.0
    return out


def target_metrics(
    solves: Sequence[Mapping[str, Any]], *, target: float, step: int, prompt_ids: Sequence[int]
) -> dict[str, float]:
    """The target schedule's metrics of one verl step (the TRL trainer's names) from the vLLM plugin's
    per-prompt solves read back from the servers (:func:`ncgrpo.engines.vllm.target_solves`' dicts,
    ``{"prompt_id", "sigma", "tv", "evals", "at_max", "target_tv", "error", ...}``, one per prompt and
    engine worker).

    ``noise/sigma_k`` (the mean of the prompts' sigmas), ``noise/sigma_k_min`` / ``_max``,
    ``noise/target_marginal_tv`` (``target``, the annealed target), ``noise/target_achieved_tv`` (the mean
    TV at the solved sigmas), ``noise/target_solver_evals`` (evaluations per prompt, mean) and
    ``noise/sigma_at_max`` (the fraction of prompts bound by ``sigma_max``), from
    :meth:`~ncgrpo.core.prompt_solve.PromptSolve.summary`, over the step's noisy prompts ``prompt_ids``.
    A prompt solved by several workers (replicas its sessions reached) counts once. As on the TRL
    trainer's vLLM path, a prompt the engine reports no solve for, or could not solve (its ``error``: its
    rows were generated clean), is a RuntimeError naming it. ``target`` 0 (annealed away): sigma 0.
    """
    if not target > 0:
        keys = (
            "sigma_k",
            "sigma_k_min",
            "sigma_k_max",
            "target_achieved_tv",
            "target_solver_evals",
            "sigma_at_max",
        )
        return {"noise/target_marginal_tv": float(target), **{f"noise/{k}": 0.0 for k in keys}}
    wanted = {int(i) for i in prompt_ids}
    by_pid: dict[int, Mapping[str, Any]] = {}
    for s in solves:
        pid, tv = int(s["prompt_id"]), s.get("target_tv")
        if pid in wanted and (tv is None or abs(float(tv) - target) <= 1e-12 * max(1.0, target)):
            by_pid.setdefault(pid, s)
    bad = [s for s in by_pid.values() if s.get("error")]
    if bad:
        raise RuntimeError(
            f"target_marginal_tv (target_scope='prompt'): the vLLM engine could not solve sigma for {len(bad)} "
            f"prompt(s) at step {step} (their rows were generated clean): {bad[0]['error']}"
        )
    missing = sorted(wanted - set(by_pid))
    if missing:
        raise RuntimeError(
            f"target_marginal_tv (target_scope='prompt'): the vLLM servers report no solve for prompt ids "
            f"{missing[:4]} ({len(missing)} of the step's {len(wanted)} noisy prompts) at step {step} (is the "
            "ncgrpo plugin of this version in their workers?)"
        )
    rows = [by_pid[i] for i in sorted(by_pid)]
    solve = PromptSolve(
        sigma=torch.tensor([float(r["sigma"]) for r in rows], dtype=torch.float64),
        tv=torch.tensor([float(r["tv"]) for r in rows], dtype=torch.float64),
        at_max=torch.tensor([bool(r["at_max"]) for r in rows]),
        prompt_evals=torch.tensor([int(r["evals"]) for r in rows]),
        evals=sum(int(r["evals"]) for r in rows),
        rounds=0,
    )
    summary, P = solve.summary(), len(rows)
    return {
        "noise/target_marginal_tv": float(target),
        "noise/sigma_k": summary["sigma_mean"],
        "noise/sigma_k_min": summary["sigma_min"],
        "noise/sigma_k_max": summary["sigma_max"],
        "noise/target_achieved_tv": summary["tv_mean"],
        "noise/target_solver_evals": summary["evals"] / P,
        "noise/sigma_at_max": summary["at_max"] / P,
    }
