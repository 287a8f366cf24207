"""What the trainer measures per generation: the importance-sampling policy and its logged ratios, the
after-rewards metrics (``reward/*``, ``noise/*``, the method's own), the first-token TV / agreement
statistics of the branch point (:func:`branch_point_stats`) and :func:`gather`. The machinery that
produces what they read (hooks, prompt-only pass, calibration) is :mod:`ncgrpo.trainer.generation`; the
per-generation record is :class:`ncgrpo.methods.base.Generation`. Plain functions, called from
``NCGRPOTrainer``; those that take the trainer say what they read on it."""

from __future__ import annotations

import math

import torch

from ncgrpo.core.advantages import contrast_statistic
from ncgrpo.core.agreement import agreement_of_probs, answer_agreement, tv_of_probs
from ncgrpo.core.plan import RowPlan
from ncgrpo.methods.base import Generation

IS_RATIO_USED = "sampling/importance_sampling_ratio_used"


def importance_ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, *, sequence_level: bool) -> torch.Tensor:
    """``[min, mean, max]`` of the importance-sampling ratios the loss multiplies by (after NC-GRPO's
    noisy-row policy), over the entries TRL's ``sampling/importance_sampling_ratio/*`` take: every row
    of a sequence-level ratio (``# [B, 1]``), the ``mask``-ed completion tokens of a token-level one
    (``# [B, T]``). Zeros when there is none (TRL's convention). ``# [3]``"""
    flat = ratio.flatten() if sequence_level else ratio[mask.bool()]
    flat = flat.detach().float()
    if flat.numel() == 0:
        return torch.zeros(3)
    return torch.stack([flat.min(), flat.mean(), flat.max()]).cpu()


def apply_noisy_importance_sampling(
    ratio: torch.Tensor, noisy: torch.Tensor, mode: str = "exclude"
) -> torch.Tensor:
    """TRL's sampler/trainer importance ratio with NC-GRPO's policy for the noisy rows.

    ``ratio`` ``# [B, 1]`` (sequence modes) or ``# [B, T]`` (token modes), as TRL's vLLM path builds
    it (already truncated or masked to 0); ``noisy`` ``# [B]`` bool. ``"exclude"``: noisy rows get ratio
    1 -- the perturbed half is an off-policy proposal with no density correction (section 3.1), and
    a ratio computed against the *clean* policy would mask it as a sampler mismatch. ``"apply"``:
    returned unchanged (TRL's behaviour).
    """
    if mode == "apply":
        return ratio
    if mode != "exclude":
        raise ValueError(f"noisy_importance_sampling must be 'exclude' or 'apply', got {mode!r}")
    noisy = torch.as_tensor(noisy, dtype=torch.bool, device=ratio.device)
    if noisy.shape != ratio.shape[:1]:
        raise ValueError(
            f"noisy mask {tuple(noisy.shape)} does not match the ratio's rows {tuple(ratio.shape)}"
        )
    return torch.where(noisy.view(-1, *([1] * (ratio.dim() - 1))), torch.ones_like(ratio), ratio)


def importance_sampling_metrics(
    output: dict, noisy: torch.Tensor, mode: str, sequence_level: bool, accelerator
) -> dict[str, float]:
    """TRL's vLLM path: NC-GRPO's policy for the noisy rows (:func:`apply_noisy_importance_sampling`,
    ``mode``) applied to ``output["importance_sampling_ratio"]`` in place (``noisy`` ``# [B]``: this rank's
    rows), and the ratios the loss then uses, as metrics. TRL logged
    ``sampling/importance_sampling_ratio/*`` before the policy; these are logged beside them, reduced over
    processes as TRL reduces its own."""
    output["importance_sampling_ratio"] = apply_noisy_importance_sampling(
        output["importance_sampling_ratio"], noisy, mode
    )
    mask = output["completion_mask"]
    if output.get("tool_mask") is not None:
        mask = mask * output["tool_mask"]
    stats = importance_ratio_stats(output["importance_sampling_ratio"], mask, sequence_level=sequence_level)
    used = gather(
        accelerator, stats[None]
    )  # [P, 3]: each rank's min, mean, max, reduced as TRL reduces its own
    return {
        f"{IS_RATIO_USED}/min": float(used[:, 0].min()),
        f"{IS_RATIO_USED}/mean": float(used[:, 1].mean()),
        f"{IS_RATIO_USED}/max": float(used[:, 2].max()),
    }


def noise_metrics(
    trainer, gen: Generation, plans: list[RowPlan], rewards: torch.Tensor, metrics: dict
) -> torch.Tensor:
    """After rewards: the clean/noisy reward metrics and what the branch point did (``reward/*``,
    ``noise/*``, ``image_noise/t``, ``control/*``), gathered over processes, added to ``metrics``; returns
    the measured relative perturbation per global row (zeros where none was measured). ``plans``: the
    global plan; ``rewards`` ``# [N_global]`` the weighted rewards. Reads ``trainer.nc_method``,
    ``.num_generations``, ``.scale_rewards``, ``._nc_answers``, ``.accelerator``."""
    G = trainer.num_generations
    B = rewards.numel() // G
    noisy = torch.tensor([p.noisy for p in plans])
    rg = rewards.view(B, G)
    noisy_mask_g = noisy.view(B, G)[0]
    metrics["reward/clean"] = float(torch.nanmean(rewards[~noisy]))
    metrics["reward/noisy"] = float(torch.nanmean(rewards[noisy]))
    contrast = contrast_statistic(rg, noisy_mask_g, scale=trainer.scale_rewards)
    metrics["reward/contrast"] = float(torch.nanmean(contrast)) if torch.isfinite(contrast).any() else 0.0
    rel = gather(trainer.accelerator, gen.rel) if gen.rel is not None else torch.zeros(len(plans))
    method = trainer.nc_method
    metrics.update(method.metrics(trainer, gen))  # noise/sigma_k, image_noise/t, control/*: the method's own
    metrics.update(target_metrics(gen))  # target_marginal_tv: the solve's target, TV, evaluations
    if method.uses_sigma and gen.rel is not None:
        # measured by the prefill hook (on vLLM: the trainer's measurement pass)
        metrics["noise/rel_perturbation"] = float(rel[noisy].mean())
    if gen.branch_argmax is not None:
        argmax = gather(trainer.accelerator, gen.branch_argmax)
        first = gather(trainer.accelerator, gen.first_token)
        clean_argmax = argmax.view(B, G)[:, ~noisy_mask_g][:, 0]  # [B] clean branch point's argmax
        differs = first.view(B, G) != clean_argmax[:, None]  # [B, G]
        metrics["noise/first_token_divergence"] = float(differs[:, noisy_mask_g].float().mean())
        metrics["noise/first_token_divergence_clean"] = float(differs[:, ~noisy_mask_g].float().mean())
        tv = gather(trainer.accelerator, gen.branch_tv)
        agree = gather(trainer.accelerator, gen.branch_agreement)
        if torch.isfinite(tv).any():
            metrics["noise/first_token_tv"] = float(torch.nanmean(tv))
            metrics["noise/agreement"] = float(torch.nanmean(agree))
    if gen.branch_marginal is not None:
        marginal = gather(trainer.accelerator, gen.branch_marginal)
        if torch.isfinite(marginal).any():
            metrics["noise/first_token_marginal_tv"] = float(torch.nanmean(marginal))
    if trainer._nc_answers is not None and len(trainer._nc_answers) == len(plans):
        value = answer_agreement(trainer._nc_answers, noisy.tolist(), G)
        if math.isfinite(value):
            metrics["noise/answer_agreement"] = value
    return rel


def target_metrics(gen: Generation) -> dict[str, float]:
    """What the target schedule logs per generation (identical on every rank): the annealed target
    (``noise/target_marginal_tv``), the batch TV at the solved sigma (``noise/target_achieved_tv``), the
    solver's TV evaluations (``noise/target_solver_evals``) and whether ``sigma_max`` bound it
    (``noise/sigma_at_max``); ``noise/sigma_k`` is the method's (:mod:`ncgrpo.trainer.target`). With
    ``target_scope='prompt'`` the same names over the batch's prompts (their mean TV, mean evaluations per
    prompt, the fraction at ``sigma_max``; ``noise/sigma_k`` their mean sigma) and ``noise/sigma_k_min`` /
    ``noise/sigma_k_max``. Empty without ``target_marginal_tv``."""
    if gen.target_tv is None or gen.target_solve is None:
        return {}
    s = gen.target_solve
    out = {
        "noise/target_marginal_tv": gen.target_tv,
        "noise/target_achieved_tv": float(s.tv),
        "noise/target_solver_evals": float(s.evals),
        "noise/sigma_at_max": float(s.at_max),
    }
    if hasattr(s, "sigma_min"):  # target_scope='prompt': the prompts' range (sigma_k: their mean)
        out["noise/sigma_k_min"], out["noise/sigma_k_max"] = float(s.sigma_min), float(s.sigma_max)
    return out


def gather(accelerator, t: torch.Tensor) -> torch.Tensor:
    """``t`` of every process, concatenated, on the CPU (one process: its own rows)."""
    if accelerator.num_processes == 1:  # nothing to gather: the rank's own rows
        return t.cpu()
    return accelerator.gather(t.to(accelerator.device)).cpu()


def branch_point_stats(
    plans: list[RowPlan],
    logits: torch.Tensor,
    noisy_temperature: float | None,
    *,
    temperature: float,
    noisy_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per local row: TV between its first-token distribution and its clean partner's, and eq. (4)'s
    kernel on the two (:mod:`ncgrpo.core.agreement`); NaN on clean rows and on noisy rows whose
    group has no clean row on this rank. The control's noisy rows sample at their first-token
    temperature, the rest at the sampling ``temperature``; ``noisy_logits`` (``first_token_marginal``): the
    rows' rewritten logits, what they sampled from."""
    T = float(temperature)
    tv = torch.full((len(plans),), float("nan"))
    agree = torch.full((len(plans),), float("nan"))
    clean_of: dict[int, int] = {}
    for i, p in enumerate(plans):
        if not p.noisy:
            clean_of.setdefault(p.group, i)
    pairs = [(i, clean_of[p.group]) for i, p in enumerate(plans) if p.noisy and p.group in clean_of]
    if not pairs:
        return tv, agree
    idx = torch.tensor([i for i, _ in pairs])
    cidx = torch.tensor([c for _, c in pairs])
    # one softmax of every row at T (row-wise: each row's values are those of its own softmax), read
    # by both statistics: the clean partners' p and, unless rewritten, the noisy rows' q
    probs = torch.softmax(logits.float() / T, -1)
    p, q = probs[cidx.to(probs.device)], probs[idx.to(probs.device)]
    if noisy_temperature is not None:  # the control: the noisy rows' logits are the clean ones, rescaled
        clean_z = logits[cidx.to(logits.device)]
        q = torch.softmax((clean_z * (T / noisy_temperature)).float() / T, -1)
    if noisy_logits is not None:
        q = torch.softmax(noisy_logits[idx.to(noisy_logits.device)].float() / T, -1)
    tv[idx] = tv_of_probs(q, p).cpu()  # first_token_tv(noisy, clean) at T
    agree[idx] = agreement_of_probs(p, q).cpu()  # branch_point_agreement(clean, noisy) at T
    return tv, agree
