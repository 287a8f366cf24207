"""The vLLM adapter of the trainer: one noise spec per request in TRL's colocate and server
generation, the plugin check, and the trainer's own prompt-only pass that measures the branch
point the engine does not report (``ncgrpo.engines.vllm`` is the engine side). Plain functions of the
trainer, called from ``NCGRPOTrainer._nc_generate`` and ``__init__``."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch

from ncgrpo.engines import (
    vllm as vllm_engine,  # sampling_params_for_rows looked up at the call (tests record it)
)
from ncgrpo.engines.vllm import (
    check_plugin_active,
    check_server_plugin_active,
    generate_rows_on_server,
    target_solves,
    target_spec,
)
from ncgrpo.methods.base import Generation, GenerationPlan
from ncgrpo.trainer.generation import (
    branch_point_hooks,
    branch_point_marginal,
    prefill_only,
    record_branch_point,
    unwrapped_model,
)
from ncgrpo.trainer.target import PromptScopeSolve, prefill_resolver, record_solve


def _tp_group_rows(vllm_generation, rows: list, logit_scales: list | None) -> tuple[list, list | None]:
    """Colocated vLLM with tensor parallelism: TRL all-gathers the prompts of the TP group, in rank order
    (``torch.distributed.all_gather_object`` over ``vllm_generation.tp_group``), and every rank of the group
    calls ``llm.generate`` on all of them. The rows' noise specs are gathered the same way, so request ``i``
    of that call carries the spec of the row whose prompt is ``i`` (each rank planned its own rows on global
    row indices, so the keys stay distinct). TP 1: the rows as they are."""
    tp = int(getattr(vllm_generation, "tensor_parallel_size", 1) or 1)
    if tp <= 1:
        return rows, logit_scales
    gathered: list = [None] * tp
    local = (list(rows), None if logit_scales is None else list(logit_scales))
    torch.distributed.all_gather_object(gathered, local, group=vllm_generation.tp_group)
    all_rows = [r for part, _ in gathered for r in part]
    if logit_scales is None:
        return all_rows, None
    return all_rows, [x for _, part in gathered for x in part]


def measure_branch_point(trainer, gen: Generation, plan: GenerationPlan, prompt_ids, resolve=None) -> None:
    """vLLM path: the engine returns no hidden states or full first-token distributions, so the
    branch point is measured with the trainer's own model: one no-grad prompt-only forward of the
    local rows (``generate`` with ``max_new_tokens=1``, greedy: the same left padding, position ids
    and multimodal inputs as TRL's transformers path, and no RNG drawn) under the generation's ``plan``
    (its rows' keys and sigma, its steering vector ``mu``, its ``inputs``: the image method's distorted
    pixels, the copy vLLM got as PIL images), then :func:`~ncgrpo.trainer.generation.record_branch_point`,
    as on the transformers path (the control: at its first-token temperature, ``gen.plan``'s). So
    ``noise/first_token_tv`` (the inert-noise warning's input), ``noise/agreement`` and
    ``noise/rel_perturbation`` are logged on vLLM too. They describe the trainer's policy (the engine's
    copy holds the same weights, in its own dtype). ``resolve``: the target schedule's batch solve
    (:func:`~ncgrpo.trainer.target.prefill_resolver`), run in this same pass on its clean states before the
    rows are perturbed at the solved sigma (so it runs before the engine generates). Reads
    ``trainer.args``, ``.temperature``, the model."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    marginal = partial(branch_point_marginal, trainer, gen)
    with branch_point_hooks(model, plan.rows, trainer.args, plan.steer, marginal, resolve=resolve) as branch:
        prefill_only(trainer, prompt_ids, plan.inputs)
    record_branch_point(gen, *branch, temperature=trainer.temperature)


def _row_targets(trainer, gen: Generation) -> list | None:
    """``target_scope='prompt'`` (a positive annealed target): each noisy row's ``"target"`` spec
    (:func:`ncgrpo.engines.vllm.target_spec`: the solve the transformers engine runs in its prefill, with the
    trainer's draws, temperature, first guess, bound and noise mode), None on clean rows; None otherwise."""
    a = trainer.args
    if gen.target_tv is None or a.target_scope != "prompt" or gen.target_tv <= 0:
        return None
    spec = target_spec(
        gen.target_tv,
        draws=int(a.marginal_tv_draws),
        temperature=float(trainer.temperature),
        start=float(a.sigma0),
        sigma_max=float(a.sigma_max),
        mode=trainer.nc_method.noise_mode or "independent",
    )
    return [spec if p.noisy else None for p in gen.plans]


def _read_back_solves(trainer, gen: Generation) -> None:
    """After the engine generated with per-prompt targets: its solves of this step (:func:`target_solves`)
    give each local row its prompt's sigma (``gen.row_sigma``; 0 on the clean rows of a prompt with no noisy
    row here) and the logged summary (:class:`~ncgrpo.trainer.target.PromptScopeSolve` over every process's
    prompts, each counted once). Colocate: each rank reads its own engine (with TP > 1 the group's shared
    one); server: the main process reads the server and sends the solves to the others. A solve the engine
    could not do (its ``error``) is an error here, not a silently clean row."""
    from accelerate.utils import broadcast_object_list, gather_object

    seed, step = int(trainer.noise_base_seed), int(gen.step)
    if trainer.args.vllm_mode == "server":
        client = getattr(trainer.vllm_generation, "vllm_client", None)
        box = [target_solves(client, seed, step) if trainer.accelerator.is_main_process and client else None]
        if trainer.accelerator.num_processes > 1:
            broadcast_object_list(box, from_process=0)
        solves = box[0] or []
    else:
        solves = target_solves(trainer.vllm_generation.llm, seed, step)
    tv = float(gen.target_tv)
    by_pid = {s["prompt_id"]: s for s in solves if abs(float(s["target_tv"]) - tv) <= 1e-12 * max(1.0, tv)}
    bad = [s for s in by_pid.values() if s.get("error")]
    if bad:
        raise RuntimeError(
            f"target_marginal_tv (target_scope='prompt'): the vLLM engine could not solve sigma for "
            f"{len(bad)} prompt(s) at step {step}: {bad[0]['error']}"
        )
    mine = {p.prompt_id for p in gen.plans if p.noisy}
    missing = sorted(mine - set(by_pid))
    if missing:
        raise RuntimeError(
            f"target_marginal_tv (target_scope='prompt'): the vLLM engine reports no solve for prompt ids "
            f"{missing[:4]} at step {step} (is the ncgrpo plugin of this version in its workers?)"
        )
    gen.row_sigma = [float(by_pid[p.prompt_id]["sigma"]) if p.prompt_id in by_pid else 0.0 for p in gen.plans]
    local = [by_pid[q] for q in sorted(mine)]
    everyone = gather_object(local) if trainer.accelerator.num_processes > 1 else local
    unique = {s["prompt_id"]: s for s in everyone}  # a prompt split over ranks: counted once
    sig = [float(s["sigma"]) for s in unique.values()]
    n = max(len(unique), 1)
    found = PromptScopeSolve(
        sigma=sum(sig) / n,
        sigma_min=min(sig, default=0.0),
        sigma_max=max(sig, default=0.0),
        tv=sum(float(s["tv"]) for s in unique.values()) / n,
        evals=sum(float(s["evals"]) for s in unique.values()) / n,
        at_max=sum(float(bool(s["at_max"])) for s in unique.values()) / n,
        prompts=len(unique),
    )
    record_solve(trainer, gen, found)


def _annealed_away(trainer, gen: Generation) -> None:
    """``target_scope='prompt'`` at an annealed target of 0: every noisy row clean, nothing to solve."""
    gen.row_sigma = [0.0] * len(gen.plans)
    record_solve(trainer, gen, PromptScopeSolve(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0))


def generate_vllm(trainer, generate, gen: Generation, plan: GenerationPlan, prompt_ids, multimodal_fields):
    """The vLLM leg of ``NCGRPOTrainer._nc_generate``: one request per row (TRL's colocate mode already
    sends one ``n=1`` request per row), each with its row's ``SamplingParams.extra_args`` from
    :func:`ncgrpo.engines.vllm.noise_extra_args` (the plan's rows and steering vector, SPSA's ``mu``); the
    ncgrpo plugin applies eq. (2) in the engine. What else a request carries is the method's plan: its
    ``images`` (the image method's distorted copies, one per prompt, as on the transformers path; TRL builds
    the loss inputs from the clean ones) and its ``logit_scales`` (the temperature control's ``T / T_k``).
    Then the branch point is measured with the trainer's model (:func:`measure_branch_point`). ``plan``:
    what :meth:`~ncgrpo.methods.RolloutMethod.plan_generation` returned for ``gen``.

    ``target_marginal_tv`` (one trainer pass in all, the measurement's): ``target_scope='batch'``: the
    measurement pass runs first and solves sigma_k on its clean states before it perturbs the rows
    (:func:`~ncgrpo.trainer.target.prefill_resolver`, as the transformers engine's prefill does); the engine
    then generates at it. ``target_scope='prompt'``: each noisy request carries a ``"target"``
    (:func:`_row_targets`); the engine solves each prompt's sigma in its own prefill and perturbs there, the
    trainer reads the solves back (:func:`_read_back_solves`) and measures each row at its prompt's sigma.
    Either way ``plan.rows`` ends as the rows were generated. Reads ``trainer.nc_method`` (``row_noise``);
    writes ``trainer._nc_gen``."""
    method = trainer.nc_method
    pending = gen.target_tv is not None and gen.target_solve is None
    prompt_scope = pending and trainer.args.target_scope == "prompt"
    if pending and not prompt_scope:  # batch: the solve folded into the measurement pass, before generation
        resolve = prefill_resolver(trainer, gen, unwrapped_model(trainer))
        measure_branch_point(trainer, gen, plan, prompt_ids, resolve=resolve)
        if gen.target_solve is None:
            raise RuntimeError(
                "target_marginal_tv: the measurement pass did not reach the final-norm hook that solves sigma_k; "
                "the rows would have used sigma0"
            )
        plan.rows = [method.row_noise(p, gen.sigma_k) for p in gen.plans]
    targets = _row_targets(trainer, gen) if prompt_scope else None
    if prompt_scope and targets is None:  # annealed to 0
        _annealed_away(trainer, gen)
        plan.rows = [method.row_noise(p, 0.0) for p in gen.plans]
    with vllm_requests(trainer, plan.rows, steer=plan.steer, logit_scales=plan.logit_scales, targets=targets):
        completion_ids, logprobs = generate(multimodal_fields, plan.images)
    if targets is not None:
        _read_back_solves(trainer, gen)
        plan.rows = [method.row_noise(p, s) for p, s in zip(gen.plans, gen.row_sigma, strict=True)]
    if not pending or prompt_scope:
        measure_branch_point(trainer, gen, plan, prompt_ids)
    gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
    trainer._nc_gen = gen
    return completion_ids, logprobs


def check_vllm_plugin(trainer) -> list[dict] | None:
    """The start-up check of the ncgrpo vLLM plugin on the engine TRL built (colocate: ``.llm``) or
    connected to (server mode: through the server's ``/collective_rpc``, from the main process, the one
    holding TRL's client; ``None`` on the others). With ``target_marginal_tv`` and ``target_scope='prompt'``
    it also refuses an engine whose workers cannot solve sigma (their status' ``target_solve``: tensor
    parallelism > 1, a quantized or soft-capped head). Reads ``trainer.args``, ``.vllm_generation``."""
    a = trainer.args
    if a.vllm_mode == "server":
        client = getattr(trainer.vllm_generation, "vllm_client", None)
        status = None if client is None else check_server_plugin_active(client.base_url)
    else:
        status = check_plugin_active(trainer.vllm_generation.llm)
    if a.target_marginal_tv is not None and a.target_scope == "prompt":
        why = sorted({s["target_solve"] for s in status or [] if s.get("target_solve")})
        if why or any("target_solve" not in s for s in status or []):
            raise ValueError(
                "target_scope='prompt' solves each prompt's sigma inside the vLLM engine, whose workers cannot: "
                f"{'; '.join(why) or 'their ncgrpo plugin is older than this trainer'}. Use target_scope='batch' "
                "(the trainer solves one sigma_k) or fix the engine"
            )
    return status


@contextmanager
def vllm_requests(trainer, rows: list, steer: torch.Tensor | None = None, logit_scales=None, targets=None):
    """During TRL's vLLM generation, give every row its own noise spec.

    Colocate: TRL calls ``llm.generate(prompts, sampling_params=<one n=1 params>)`` with one prompt
    per row, in row order (with TP > 1: the TP group's rows, gathered in rank order; the specs are
    gathered the same way, :func:`_tp_group_rows`); that one params object is replaced by
    :func:`ncgrpo.engines.vllm.sampling_params_for_rows` (clones with ``extra_args["ncgrpo"]``).

    Server: TRL gathers every process's prompts and the main process calls
    ``vllm_client.generate(unique prompts, n=num_generations, ...)`` once (global rows, prompt-major,
    i.e. ``plan_rows``' global order); the rows' specs are gathered here (a collective on every rank)
    and that call is replaced on the main process by
    :func:`ncgrpo.engines.vllm.generate_rows_on_server` (one request per noisy row, with its spec in
    ``vllm_xargs``; each prompt's clean rows in one ``n=k`` request). ``targets``: per row, the spec's
    ``"target"`` (None: none), gathered as the rows are. Reads ``trainer.args.vllm_mode``,
    ``.vllm_generation``, ``.accelerator``, ``.num_generations``."""
    if trainer.args.vllm_mode == "server":
        with _vllm_server_requests(trainer, rows, steer, logit_scales, targets):
            yield
        return
    llm = trainer.vllm_generation.llm
    orig = llm.generate
    calls = []
    rows, logit_scales = _tp_group_rows(trainer.vllm_generation, rows, logit_scales)
    if targets is not None:
        targets, _ = _tp_group_rows(trainer.vllm_generation, targets, None)

    def generate(prompts, sampling_params=None, *args, **kwargs):
        if calls:
            raise RuntimeError("NC-GRPO: TRL called vLLM's generate twice in one generation")
        calls.append(1)
        if len(prompts) != len(rows) or isinstance(sampling_params, list | tuple) or sampling_params is None:
            raise RuntimeError(
                f"NC-GRPO: expected one request per row ({len(rows)} rows) sharing one SamplingParams, got "
                f"{len(prompts)} prompts and {type(sampling_params).__name__}"
            )
        return orig(
            prompts,
            vllm_engine.sampling_params_for_rows(
                sampling_params, rows, steer=steer, logit_scales=logit_scales, targets=targets
            ),
            *args,
            **kwargs,
        )

    llm.generate = generate
    try:
        yield
    finally:
        del llm.generate
    if not calls:
        raise RuntimeError("NC-GRPO: TRL's vLLM generation did not call llm.generate; noise was not applied")


@contextmanager
def _vllm_server_requests(trainer, rows: list, steer, logit_scales, targets=None):
    from accelerate.utils import gather_object

    all_rows = gather_object(list(rows))
    all_scales = None if logit_scales is None else gather_object(list(logit_scales))
    all_targets = None if targets is None else gather_object(list(targets))
    client = getattr(trainer.vllm_generation, "vllm_client", None)
    if not trainer.accelerator.is_main_process or client is None:
        yield
        return
    orig = client.generate
    calls = []
    G = trainer.num_generations

    def generate(prompts, features=None, n=1, generation_kwargs=None, **sampling):
        if calls:
            raise RuntimeError("NC-GRPO: TRL called the vLLM server's generate twice in one generation")
        calls.append(1)
        if n != G:
            raise RuntimeError(f"NC-GRPO: expected TRL's server call with n=num_generations={G}, got n={n}")
        return generate_rows_on_server(
            orig,
            prompts,
            n,
            all_rows,
            steer=steer,
            logit_scales=all_scales,
            targets=all_targets,
            features=features,
            generation_kwargs=generation_kwargs,
            **sampling,
        )

    client.generate = generate
    try:
        yield
    finally:
        del client.generate
    if not calls:
        raise RuntimeError(
            "NC-GRPO: TRL's vLLM server generation did not call vllm_client.generate; noise was not applied"
        )
