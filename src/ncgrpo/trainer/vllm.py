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
)
from ncgrpo.methods.base import Generation, GenerationPlan
from ncgrpo.trainer.generation import (
    branch_point_hooks,
    branch_point_marginal,
    prefill_only,
    record_branch_point,
)


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


def measure_branch_point(trainer, gen: Generation, plan: GenerationPlan, prompt_ids) -> None:
    """vLLM path: the engine returns no hidden states or full first-token distributions, so the
    branch point is measured with the trainer's own model: one no-grad prompt-only forward of the
    local rows (``generate`` with ``max_new_tokens=1``, greedy: the same left padding, position ids
    and multimodal inputs as TRL's transformers path, and no RNG drawn) under the generation's ``plan``
    (its rows' keys and sigma, its steering vector ``mu``, its ``inputs``: the image method's distorted
    pixels, the copy vLLM got as PIL images), then :func:`~ncgrpo.trainer.generation.record_branch_point`,
    as on the transformers path (the control: at its first-token temperature, ``gen.plan``'s). So
    ``noise/first_token_tv`` (the inert-noise warning's input), ``noise/agreement`` and
    ``noise/rel_perturbation`` are logged on vLLM too. They describe the trainer's policy (the engine's
    copy holds the same weights, in its own dtype). Reads ``trainer.args``, ``.temperature``, the model."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    marginal = partial(branch_point_marginal, trainer, gen)
    with branch_point_hooks(model, plan.rows, trainer.args, plan.steer, marginal) as branch:
        prefill_only(trainer, prompt_ids, plan.inputs)
    record_branch_point(gen, *branch, temperature=trainer.temperature)


def generate_vllm(trainer, generate, gen: Generation, plan: GenerationPlan, prompt_ids, multimodal_fields):
    """The vLLM leg of ``NCGRPOTrainer._nc_generate``: one request per row (TRL's colocate mode already
    sends one ``n=1`` request per row), each with its row's ``SamplingParams.extra_args`` from
    :func:`ncgrpo.engines.vllm.noise_extra_args` (the plan's rows and steering vector, SPSA's ``mu``); the
    ncgrpo plugin applies eq. (2) in the engine. What else a request carries is the method's plan: its
    ``images`` (the image method's distorted copies, one per prompt, as on the transformers path; TRL builds
    the loss inputs from the clean ones) and its ``logit_scales`` (the temperature control's ``T / T_k``).
    Then the branch point is measured with the trainer's model (:func:`measure_branch_point`). ``plan``:
    what :meth:`~ncgrpo.methods.RolloutMethod.plan_generation` returned for ``gen``. Writes
    ``trainer._nc_gen``."""
    with vllm_requests(trainer, plan.rows, steer=plan.steer, logit_scales=plan.logit_scales):
        completion_ids, logprobs = generate(multimodal_fields, plan.images)
    measure_branch_point(trainer, gen, plan, prompt_ids)
    gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
    trainer._nc_gen = gen
    return completion_ids, logprobs


def check_vllm_plugin(trainer) -> list[dict] | None:
    """The start-up check of the ncgrpo vLLM plugin on the engine TRL built (colocate: ``.llm``) or
    connected to (server mode: through the server's ``/collective_rpc``, from the main process, the one
    holding TRL's client; ``None`` on the others). Reads ``trainer.args.vllm_mode``, ``.vllm_generation``."""
    if trainer.args.vllm_mode == "server":
        client = getattr(trainer.vllm_generation, "vllm_client", None)
        return None if client is None else check_server_plugin_active(client.base_url)
    return check_plugin_active(trainer.vllm_generation.llm)


@contextmanager
def vllm_requests(trainer, rows: list, steer: torch.Tensor | None = None, logit_scales=None):
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
    ``vllm_xargs``; each prompt's clean rows in one ``n=k`` request). Reads ``trainer.args.vllm_mode``,
    ``.vllm_generation``, ``.accelerator``, ``.num_generations``."""
    if trainer.args.vllm_mode == "server":
        with _vllm_server_requests(trainer, rows, steer, logit_scales):
            yield
        return
    llm = trainer.vllm_generation.llm
    orig = llm.generate
    calls = []
    rows, logit_scales = _tp_group_rows(trainer.vllm_generation, rows, logit_scales)

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
                sampling_params, rows, steer=steer, logit_scales=logit_scales
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
def _vllm_server_requests(trainer, rows: list, steer, logit_scales):
    from accelerate.utils import gather_object

    all_rows = gather_object(list(rows))
    all_scales = None if logit_scales is None else gather_object(list(logit_scales))
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
