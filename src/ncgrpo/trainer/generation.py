"""The generation machinery of ``NCGRPOTrainer`` (transformers engine, and the trainer's own passes on
vLLM): the branch-point hooks around one prefill (eq. (2) and the ``lm_head`` capture), what they record
on the :class:`~ncgrpo.methods.base.Generation`, the noise-averaged first-token TV
(:func:`branch_point_marginal`, :func:`marginal_curve`), the trainer's own prompt-only pass
(:func:`prefill_only`), :func:`unwrapped_model` and the control's T0 calibration. Plain functions; those
that take the trainer say what they read on it."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import numpy as np
import torch
from transformers import GenerationConfig, Trainer
from trl.models import unwrap_model_for_generation
from trl.trainer.utils import pad

from ncgrpo.core import noise as nz
from ncgrpo.core.agreement import first_token_tv, match_first_token_temperature
from ncgrpo.core.marginal import MarginalCurve, marginal_keys
from ncgrpo.core.plan import RowPlan
from ncgrpo.core.prompt_solve import curve_tv_at
from ncgrpo.engines.branch_point import branch_point_capture
from ncgrpo.engines.transformers import prefill_noise
from ncgrpo.methods.base import Generation
from ncgrpo.trainer.metrics import branch_point_stats, gather


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
    with branch_point_hooks(
        model, rows_clean, trainer.args, trainer.nc_method.steer(trainer), marginal_tvs
    ) as (_, point):
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


def record_branch_point(gen: Generation, hook, point, *, temperature: float, control=None) -> None:
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
    trainer, gen: Generation, head, logits: torch.Tensor, states: torch.Tensor
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
    if gen.sigma_k <= 0 and gen.row_sigma is None:
        out[[i for i, _ in pairs]] = 0.0
        return out
    noisy = [gen.plans[i] for i, _ in pairs]
    cidx = torch.tensor([c for _, c in pairs])
    pids = [p.prompt_id for p in noisy]
    curve = marginal_curve(
        trainer, head, states[cidx.to(states.device)], logits[cidx.to(logits.device)], pids, gen.step
    )
    if gen.row_sigma is None:
        tv = curve(gen.sigma_k).tv  # [P]
    else:  # target_scope='prompt': each prompt at its own sigma, as the solve estimated it
        at = curve_tv_at(curve, {j: gen.row_sigma[i] for j, (i, _) in enumerate(pairs)})
        tv = torch.tensor([at[j] for j in range(len(pairs))])
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


def prefill_only(trainer, prompt_ids, multimodal_fields) -> None:
    """One prompt-only ``generate`` (``max_new_tokens=1``, greedy, no grad) of the trainer's model on
    these rows, with the inputs TRL's transformers path builds (left padding to
    ``pad_to_multiple_of``, its multimodal fields) inside TRL's generation context (ZeRO-3 gather,
    FSDP full parameters, no gradient checkpointing). Only its prefill matters: the caller's hooks
    read the branch point there; the one greedy token is discarded. Used by the vLLM path's measurement
    (:func:`ncgrpo.trainer.vllm.measure_branch_point`) and :func:`calibrate_first_token_t0`."""
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
