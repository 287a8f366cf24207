"""What the trainer measures at the branch point and records per generation: the lm_head
capture and prefill hooks, the first-token TV / agreement / noise-averaged TV metrics
(``noise/*``), the first-token temperature calibration, the trainer's own prompt-only pass
(:func:`prefill_only`), :class:`StepRecord`. Plain functions, called from ``NCGRPOTrainer``; those
that take the trainer say what they read and write on it."""

from __future__ import annotations

import math
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from ncgrpo.core import noise as nz
from ncgrpo.core.marginal import MarginalCurve, marginal_keys
from ncgrpo.core.plan import RowPlan

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
    trainer, gen: _LocalGen, plans: list[RowPlan], rewards: torch.Tensor, metrics: dict
) -> torch.Tensor:
    """After rewards: the clean/noisy reward metrics and what the branch point did (``reward/*``,
    ``noise/*``, ``image_noise/t``, ``control/*``), gathered over processes, added to ``metrics``; returns
    the measured relative perturbation per global row (zeros where none was measured). ``plans``: the
    global plan; ``rewards`` ``# [N_global]`` the weighted rewards. Reads ``trainer.nc_method``,
    ``.num_generations``, ``.scale_rewards``, ``.first_token_t0``, ``._nc_answers``, ``.accelerator``."""
    from ncgrpo.core.advantages import contrast_statistic

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
        from ncgrpo.core.agreement import answer_agreement

        value = answer_agreement(trainer._nc_answers, noisy.tolist(), G)
        if math.isfinite(value):
            metrics["noise/answer_agreement"] = value
    return rel


def target_metrics(gen: _LocalGen) -> dict[str, float]:
    """What the target schedule logs per generation (identical on every rank): the annealed target
    (``noise/target_marginal_tv``), the batch TV at the solved sigma (``noise/target_achieved_tv``), the
    solver's TV evaluations (``noise/target_solver_evals``) and whether ``sigma_max`` bound it
    (``noise/sigma_at_max``); ``noise/sigma_k`` is the method's (:mod:`ncgrpo.trainer.target`). Empty without ``target_marginal_tv``."""
    if gen.target_tv is None or gen.target_solve is None:
        return {}
    s = gen.target_solve
    return {
        "noise/target_marginal_tv": gen.target_tv,
        "noise/target_achieved_tv": float(s.tv),
        "noise/target_solver_evals": float(s.evals),
        "noise/sigma_at_max": float(s.at_max),
    }


@dataclass
class StepRecord:
    """What NC-GRPO did at one generation (kept in ``trainer.nc_history``; identical on every rank).

    ``rows``: the global plan (:meth:`RowPlan.as_tuple` per global row); ``local_rows``: the plan this
    rank's hook applied (its slice of ``rows``); ``rewards`` / ``advantages``: the global weighted
    rewards and the advantages TRL trains on; ``rel``: the measured relative perturbation per global
    row (0 on clean rows; on the vLLM path measured by the trainer's own prompt-only pass), all in global
    row order.
    """

    step: int
    total_steps: int
    sigma_k: float
    image_t: int | None
    rows: list[tuple]
    rewards: list[float]
    advantages: list[float]
    local_rows: list[tuple] = field(default_factory=list)
    rel: list[float] = field(default_factory=list)
    mu_norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _LocalGen:
    """Per-generation scratch filled in ``_generate_single_turn`` (local rows only)."""

    step: int
    total_steps: int
    sigma_k: float
    plans: list[RowPlan]
    schedule_k: int = 0  # k of eq. (3) in `schedule_unit`
    image_t: int | None = None
    first_token_temperature: float | None = None  # the control's T_k
    target_tv: float | None = None  # target_marginal_tv: this generation's annealed target
    target_solve: object | None = None  # target_marginal_tv: the solver's SigmaSolve
    rel: torch.Tensor | None = None  # [L]
    branch_argmax: torch.Tensor | None = None  # [L] argmax of the logits at the branch point
    branch_marginal: torch.Tensor | None = None  # [L] TV(q, q_bar) on each group's first noisy row, else NaN
    branch_tv: torch.Tensor | None = None  # [L] first-token TV vs the clean partner (NaN: clean row)
    branch_agreement: torch.Tensor | None = None  # [L] eq. (4) on first-token distributions
    first_token: torch.Tensor | None = None  # [L]
    gen_pixel_values: torch.Tensor | None = None  # what generate saw (image method; for tests)


def gather(accelerator, t: torch.Tensor) -> torch.Tensor:
    """``t`` of every process, concatenated, on the CPU (one process: its own rows)."""
    if accelerator.num_processes == 1:  # nothing to gather: the rank's own rows
        return t.cpu()
    return accelerator.gather(t.to(accelerator.device)).cpu()


def unwrapped_model(trainer):
    """``accelerator.unwrap_model(trainer.model)``, looked up again only when ``trainer.model`` is another
    object (cached in ``trainer._nc_unwrap_cache``): accelerate walks every submodule (and asks importlib
    about DeepSpeed) on each call, ~0.1 ms of every generation at the tiny sizes."""
    cached = getattr(trainer, "_nc_unwrap_cache", None)
    if cached is None or cached[0] is not trainer.model:
        cached = trainer._nc_unwrap_cache = (trainer.model, trainer.accelerator.unwrap_model(trainer.model))
    return cached[1]


def calibrate_first_token_t0(trainer, plans: list[RowPlan], prompt_ids, multimodal_fields) -> float:
    """``first_token_temperature_auto``: one clean prompt-only pass of the local rows, then per prompt the
    noise-averaged first-token TV of latent noise at ``sigma0`` (:func:`marginal_curve`: the estimator of
    ``noise/first_token_marginal_tv``, with ``max(marginal_tv_draws, 64)`` draws through the LM head, keys
    of step 0) and the ``T0`` whose first-token TV on those prompts equals its mean
    (:func:`ncgrpo.core.agreement.match_first_token_temperature`). Each process calibrates on its own
    prompts; the values are averaged over processes so every rank uses one T0.
    Reads ``trainer.args``, ``.temperature``, ``.noise_base_seed``; runs :func:`prefill_only`."""
    from ncgrpo.core.agreement import match_first_token_temperature

    a = trainer.args
    T = float(trainer.temperature)
    first = {}
    for i, p in enumerate(plans):
        first.setdefault(p.group, i)
    rows = sorted(first.values())

    def marginal_tvs(head, logits, states) -> list[float]:  # inside the head's forward (ZeRO-3)
        idx = torch.tensor(rows)
        curve = marginal_curve(
            trainer, head, states[idx.to(states.device)], logits[idx.to(logits.device)],
            [plans[i].prompt_id for i in rows], 0, draws=max(a.marginal_tv_draws, 64), mode="independent",
            steer=None,
        )  # fmt: skip
        return curve(a.sigma0).tv.tolist()

    model = unwrapped_model(trainer)
    rows_clean = [nz.RowNoise()] * len(plans)
    with branch_point_hooks(model, rows_clean, trainer.args, trainer.spsa_mu, marginal_tvs) as (_, point):
        prefill_only(trainer, prompt_ids, multimodal_fields)
    logits, tvs = point.logits, point.extra
    target = min(max(sum(tvs) / len(tvs), 0.0), 1.0)
    t0 = match_first_token_temperature(logits[rows].float().cpu(), target, temperature=T)
    both = gather(trainer.accelerator, torch.tensor([[t0, target]], dtype=torch.float64))  # [processes, 2]
    t0, target = (float(x) for x in both.mean(0))
    if trainer.accelerator.is_main_process:
        print(
            f"ncgrpo: first_token_temperature_auto: T0 = {t0:.4f} (noise-averaged first-token TV {target:.4f} "
            f"of latent noise at sigma0 = {a.sigma0:g} on {len(rows)} prompts per process)"
        )
    return t0


@contextmanager
def branch_point_hooks(model, rows: list, args, steer: torch.Tensor | None, on_branch=None, resolve=None):
    """Around one prefill of ``model`` (``generate``'s first forward): eq. (2) on ``rows``
    (:func:`ncgrpo.engines.transformers.prefill_noise` with ``args``' site, positions and ``steer``, SPSA's ``mu``)
    and the last-position logits of that forward (the branch point), read by an ``lm_head`` hook
    inside the forward so it also works where weights are only gathered during generate (ZeRO-3).
    Yields ``(hook, point)``: after the prefill ``point.logits`` holds ``[L, V]`` float32 logits and
    ``point.states`` the LM head's input at that position ``[L, d]`` (model dtype; the clean
    final-norm state on clean rows), and ``point.extra`` what ``on_branch(head, logits, states)`` returned
    inside the head's forward; see :func:`ncgrpo.engines.branch_point.branch_point_capture`. ``resolve``:
    the rows' noise decided on the prefill's clean states (:func:`~ncgrpo.engines.transformers.prefill_noise`)."""
    from ncgrpo.engines.branch_point import branch_point_capture
    from ncgrpo.engines.transformers import prefill_noise

    a = args
    with ExitStack() as stack:
        point = stack.enter_context(branch_point_capture(model, on_branch))
        hook = stack.enter_context(
            prefill_noise(
                model,
                rows,
                site=a.noise_site_parsed,
                layer_decay=a.noise_layer_decay,
                steer=steer,
                positions=a.noise_positions,
                resolve=resolve,
            )
        )
        yield hook, point


def record_branch_point(gen: _LocalGen, hook, point, *, temperature: float, control=None) -> None:
    """Fill ``gen.rel`` / ``branch_argmax`` / ``branch_tv`` / ``branch_agreement`` /
    ``branch_marginal`` from one prefill under :func:`branch_point_hooks` (both engines' paths go
    through here); ``temperature``: the sampling temperature. ``control``: the ``first_token_marginal``
    hook, whose rewritten rows are what its noisy rows sampled from."""
    if hook.records:
        gen.rel = hook.records[0].rel.float()  # the prefill
    if point.logits is not None:
        logits = point.logits
        gen.branch_argmax = logits.argmax(-1).cpu()
        noisy_logits = None
        if control is not None and control.last_logits is not None:
            noisy_logits = control.last_logits.to(logits.device)
        gen.branch_tv, gen.branch_agreement = branch_point_stats(
            gen.plans, logits, gen.first_token_temperature, temperature=temperature, noisy_logits=noisy_logits
        )
        gen.branch_marginal = point.extra  # branch_point_marginal, run inside the head's forward


def branch_point_marginal(
    trainer, gen: _LocalGen, head, logits: torch.Tensor, states: torch.Tensor
) -> torch.Tensor | None:
    """``TV(q, q_bar)`` per group with a clean row on this rank, on the group's first noisy row (NaN
    elsewhere): the distribution the noisy half's first tokens are sampled from
    (:mod:`ncgrpo.core.marginal`). Hidden-noise methods at the final-norm site and
    ``first_token_marginal``: ``marginal_tv_draws`` draws ``NoiseKey(seed, step, prompt_id, -1 - m)``
    (the row's own noise mode and SPSA's ``mu``) through the LM head on the clean partner's state,
    bootstrap bias-corrected; the temperature control: exact (its q_bar is ``softmax(z / T_k)``).
    None where it is not defined this way (image method, layer sites) or ``marginal_tv_draws=0``.
    Runs inside the LM head's forward (``on_branch`` of :func:`branch_point_hooks`; ``head`` its
    weights as a function), where ZeRO-3 has them gathered. Reads ``trainer.args``, ``.temperature``,
    ``.nc_method`` (its ``marginal``, ``noise_mode`` and steering vector)."""
    from ncgrpo.core.agreement import first_token_tv

    a = trainer.args
    T = float(trainer.temperature)
    out = torch.full((len(gen.plans),), float("nan"))
    clean_of: dict[int, int] = {}
    first_noisy: dict[int, int] = {}
    for i, p in enumerate(gen.plans):
        (first_noisy if p.noisy else clean_of).setdefault(p.group, i)
    pairs = [(i, clean_of[g]) for g, i in first_noisy.items() if g in clean_of]
    if not pairs:
        return None
    method = trainer.nc_method
    if method.marginal == "temperature":  # the control's q_bar is softmax(z / T_k): exact
        idx, cidx = [i for i, _ in pairs], [c for _, c in pairs]
        z = logits[cidx]
        out[idx] = first_token_tv(z, z, t_a=gen.first_token_temperature, t_b=T).cpu()
        return out
    final_norm = a.noise_site_parsed == "final_norm"
    if method.marginal != "draws" or not final_norm or a.marginal_tv_draws < 1:
        return None
    if gen.sigma_k <= 0:
        out[[i for i, _ in pairs]] = 0.0
        return out
    noisy = [gen.plans[i] for i, _ in pairs]
    cidx = torch.tensor([c for _, c in pairs])
    pids = [p.prompt_id for p in noisy]
    curve = marginal_curve(
        trainer, head, states[cidx.to(states.device)], logits[cidx.to(logits.device)], pids, gen.step
    )
    tv = curve(gen.sigma_k).tv  # [P]
    out[[i for i, _ in pairs]] = tv.float()
    return out


def marginal_curve(
    trainer, head, h: torch.Tensor, logits: torch.Tensor, prompt_ids: list[int], step: int, **override
) -> MarginalCurve:
    """``sigma -> TV(q, q_bar(sigma))`` per prompt (``prompt_ids``; their clean branch-point states ``h``
    ``# [P, d]`` and logits ``# [P, V]``) at generation ``step`` (the optimizer step the noise keys
    name): :class:`ncgrpo.core.marginal.MarginalCurve` on ``marginal_tv_draws`` draws per prompt
    (antithetic pairs of ``NoiseKey(seed, step, prompt_id, -1 - m)``) through the LM head ``head``, in the
    method's noise mode (``independent`` for the ``first_token_marginal`` control) with its steering
    vector. What ``noise/first_token_marginal_tv`` logs, what the target schedule solves on
    (:mod:`ncgrpo.trainer.target`) and what ``first_token_temperature_auto`` calibrates on, so the three
    agree. ``override``: ``draws``, ``mode`` or ``steer`` in place of the run's. Reads ``trainer.args``,
    ``.temperature``, ``.noise_base_seed``, ``.nc_method``."""
    method = trainer.nc_method
    M = int(override.get("draws", trainer.args.marginal_tv_draws))
    seed = trainer.noise_base_seed
    keys = [k for pid in prompt_ids for k in marginal_keys(seed, step, pid, M // 2)]
    return MarginalCurve(
        head,
        h,
        logits,
        keys,
        temperature=float(trainer.temperature),
        # first_token_marginal: latent noise's independent draws
        mode=override.get("mode", method.noise_mode or "independent"),
        steer=override["steer"] if "steer" in override else method.steer(trainer),
    )


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
    from ncgrpo.core.agreement import agreement_of_probs, tv_of_probs

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


def prefill_only(trainer, prompt_ids, multimodal_fields) -> None:
    """One prompt-only ``generate`` (``max_new_tokens=1``, greedy, no grad) of the trainer's model on
    these rows, with the inputs TRL's transformers path builds (left padding to
    ``pad_to_multiple_of``, its multimodal fields) inside TRL's generation context (ZeRO-3 gather,
    FSDP full parameters, no gradient checkpointing). Only its prefill matters: the caller's hooks
    read the branch point there; the one greedy token is discarded. Used by the vLLM path's measurement
    (:func:`ncgrpo.trainer.vllm.measure_branch_point`) and :func:`calibrate_first_token_t0`."""
    from transformers import GenerationConfig, Trainer
    from trl.models import unwrap_model_for_generation
    from trl.trainer.utils import pad

    tensors = [torch.tensor(ids) for ids in prompt_ids]
    kw = dict(padding_side="left", pad_to_multiple_of=trainer.pad_to_multiple_of)
    inputs = {
        "input_ids": pad(tensors, padding_value=trainer._tokenizer.pad_token_id, **kw),
        "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, **kw),
    }
    for k, v in multimodal_fields.items():  # as GRPOTrainer._generate_single_turn does
        if isinstance(v, torch.Tensor):
            inputs[k] = v
        elif isinstance(v, list) and v and isinstance(v[0], list):
            inputs[k] = pad([torch.tensor(x) for x in v], padding_value=0, **kw)
        else:
            inputs[k] = torch.tensor(np.array(v))
    inputs = Trainer._prepare_inputs(trainer, inputs)  # GRPOTrainer overrides it with its buffering
    config = GenerationConfig(
        max_new_tokens=1,
        do_sample=False,
        pad_token_id=trainer._tokenizer.pad_token_id,
        eos_token_id=trainer.eos_token_ids,
        disable_compile=True,
    )
    with (
        unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=trainer.args.gradient_checkpointing_kwargs,
        ) as unwrapped_model,
        torch.no_grad(),
        trainer._dist.summon_full_params(trainer.model_wrapped, recurse=False),
    ):
        unwrapped_model.generate(**inputs, generation_config=config)
