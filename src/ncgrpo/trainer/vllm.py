"""The vLLM adapter of the trainer: one noise spec per request in TRL's colocate and server
generation, the plugin check, and the trainer's own prompt-only pass that measures the branch
point the engine does not report (``ncgrpo.engines.vllm`` is the engine side)."""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import numpy as np
import torch

from ncgrpo.trainer.metrics import _LocalGen


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


class VLLMRollouts:
    """The vLLM leg of :class:`~ncgrpo.trainer.NCGRPOTrainer` (a mixin)."""

    def _nc_measure_branch_point(
        self, gen: _LocalGen, rows: list, prompt_ids, images, multimodal_fields
    ) -> None:
        """vLLM path: the engine returns no hidden states or full first-token distributions, so the
        branch point is measured with the trainer's own model: one no-grad prompt-only forward of the
        local rows (``generate`` with ``max_new_tokens=1``, greedy: the same left padding, position ids
        and multimodal inputs as TRL's transformers path, and no RNG drawn) under the same ``rows``
        (keys, sigma, ``mu``), then :meth:`_nc_record_branch_point`, as on the transformers path. So
        ``noise/first_token_tv`` (the inert-noise warning's input), ``noise/agreement`` and
        ``noise/rel_perturbation`` are logged on vLLM too. They describe the trainer's policy (the
        engine's copy holds the same weights, in its own dtype). Image method: the noisy rows' pixels
        are the distorted ones (:meth:`_distort_images`, the copy vLLM got as PIL images); the control:
        its first-token temperature, as on the transformers path."""
        fields = multimodal_fields
        if self.method == "image":
            fields = self._distort_images(images, multimodal_fields, gen.plans, gen.image_t)
        model = self.accelerator.unwrap_model(self.model)
        with self._nc_branch_point_hooks(model, rows, partial(self._branch_point_marginal, gen)) as branch:
            self._nc_prefill_only(prompt_ids, fields)
        self._nc_record_branch_point(gen, *branch)

    def _nc_generate_vllm(self, generate, gen: _LocalGen, rows: list, prompt_ids, images, multimodal_fields):
        """The vLLM leg of :meth:`_nc_generate`: one request per row (TRL's colocate mode already sends
        one ``n=1`` request per row), each with its row's ``SamplingParams.extra_args`` from
        :func:`ncgrpo.engines.vllm.noise_extra_args` (SPSA: ``mu`` as ``steer``); the ncgrpo plugin applies
        eq. (2) in the engine. Image method: the noisy rows' images are replaced by their distorted copies
        (one per prompt, as on the transformers path); TRL builds the loss inputs from the clean ones.
        Then the branch point is measured with the trainer's model (:meth:`_nc_measure_branch_point`)."""
        gen_images = images
        if self.method == "image":
            k, K = self.schedule_position()
            gen.image_t = self.image_noise_t(k, K)
            gen_images = self._distorted_row_images(images, gen.plans, gen.image_t)
        scales = None
        if self.method == "first_token_temperature":
            k, K = self.schedule_position()
            if self.args.first_token_temperature_auto and self.first_token_t0 is None:
                self.first_token_t0 = self._calibrate_first_token_t0(gen.plans, prompt_ids, multimodal_fields)
            gen.first_token_temperature = self.first_token_temperature_at(k, K)
            scale = float(self.temperature) / gen.first_token_temperature
            scales = [scale if p.noisy else None for p in gen.plans]
        with self._nc_vllm_requests(rows, steer=self.spsa_mu, logit_scales=scales):
            completion_ids, logprobs = generate(multimodal_fields, gen_images)
        self._nc_measure_branch_point(gen, rows, prompt_ids, images, multimodal_fields)
        gen.first_token = torch.tensor([c[0] if len(c) else -1 for c in completion_ids], dtype=torch.long)
        self._nc_gen = gen
        return completion_ids, logprobs

    def _nc_check_vllm_plugin(self) -> list[dict] | None:
        """The start-up check of the ncgrpo vLLM plugin on the engine TRL built (colocate: ``.llm``) or
        connected to (server mode: through the server's ``/collective_rpc``, from the main process, the one
        holding TRL's client; ``None`` on the others)."""
        from ncgrpo.engines.vllm import check_plugin_active, check_server_plugin_active

        if self.args.vllm_mode == "server":
            client = getattr(self.vllm_generation, "vllm_client", None)
            return None if client is None else check_server_plugin_active(client.base_url)
        return check_plugin_active(self.vllm_generation.llm)

    @contextmanager
    def _nc_vllm_requests(self, rows: list, steer: torch.Tensor | None = None, logit_scales=None):
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
        ``vllm_xargs``; each prompt's clean rows in one ``n=k`` request)."""
        if self.args.vllm_mode == "server":
            with self._nc_vllm_server_requests(rows, steer, logit_scales):
                yield
            return
        from ncgrpo.engines.vllm import sampling_params_for_rows

        llm = self.vllm_generation.llm
        orig = llm.generate
        calls = []
        rows, logit_scales = _tp_group_rows(self.vllm_generation, rows, logit_scales)

        def generate(prompts, sampling_params=None, *args, **kwargs):
            if calls:
                raise RuntimeError("NC-GRPO: TRL called vLLM's generate twice in one generation")
            calls.append(1)
            if (
                len(prompts) != len(rows)
                or isinstance(sampling_params, list | tuple)
                or sampling_params is None
            ):
                raise RuntimeError(
                    f"NC-GRPO: expected one request per row ({len(rows)} rows) sharing one SamplingParams, got "
                    f"{len(prompts)} prompts and {type(sampling_params).__name__}"
                )
            return orig(
                prompts,
                sampling_params_for_rows(sampling_params, rows, steer=steer, logit_scales=logit_scales),
                *args,
                **kwargs,
            )

        llm.generate = generate
        try:
            yield
        finally:
            del llm.generate
        if not calls:
            raise RuntimeError(
                "NC-GRPO: TRL's vLLM generation did not call llm.generate; noise was not applied"
            )

    @contextmanager
    def _nc_vllm_server_requests(self, rows: list, steer, logit_scales):
        from accelerate.utils import gather_object

        from ncgrpo.engines.vllm import generate_rows_on_server

        all_rows = gather_object(list(rows))
        all_scales = None if logit_scales is None else gather_object(list(logit_scales))
        client = getattr(self.vllm_generation, "vllm_client", None)
        if not self.accelerator.is_main_process or client is None:
            yield
            return
        orig = client.generate
        calls = []
        G = self.num_generations

        def generate(prompts, features=None, n=1, generation_kwargs=None, **sampling):
            if calls:
                raise RuntimeError("NC-GRPO: TRL called the vLLM server's generate twice in one generation")
            calls.append(1)
            if n != G:
                raise RuntimeError(
                    f"NC-GRPO: expected TRL's server call with n=num_generations={G}, got n={n}"
                )
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

    def _nc_prefill_only(self, prompt_ids, multimodal_fields) -> None:
        """One prompt-only ``generate`` (``max_new_tokens=1``, greedy, no grad) of the trainer's model on
        these rows, with the inputs TRL's transformers path builds (left padding to
        ``pad_to_multiple_of``, its multimodal fields) inside TRL's generation context (ZeRO-3 gather,
        FSDP full parameters, no gradient checkpointing). Only its prefill matters: the caller's hooks
        read the branch point there; the one greedy token is discarded."""
        from transformers import GenerationConfig, Trainer
        from trl.models import unwrap_model_for_generation
        from trl.trainer.utils import pad

        tensors = [torch.tensor(ids) for ids in prompt_ids]
        kw = dict(padding_side="left", pad_to_multiple_of=self.pad_to_multiple_of)
        inputs = {
            "input_ids": pad(tensors, padding_value=self._tokenizer.pad_token_id, **kw),
            "attention_mask": pad([torch.ones_like(t) for t in tensors], padding_value=0, **kw),
        }
        for k, v in multimodal_fields.items():  # as GRPOTrainer._generate_single_turn does
            if isinstance(v, torch.Tensor):
                inputs[k] = v
            elif isinstance(v, list) and v and isinstance(v[0], list):
                inputs[k] = pad([torch.tensor(x) for x in v], padding_value=0, **kw)
            else:
                inputs[k] = torch.tensor(np.array(v))
        inputs = Trainer._prepare_inputs(self, inputs)  # GRPOTrainer overrides it with its buffering
        config = GenerationConfig(
            max_new_tokens=1,
            do_sample=False,
            pad_token_id=self._tokenizer.pad_token_id,
            eos_token_id=self.eos_token_ids,
            disable_compile=True,
        )
        with (
            unwrap_model_for_generation(
                self.model_wrapped,
                self.accelerator,
                gather_deepspeed3_params=self.args.ds3_gather_for_generation,
                gradient_checkpointing_kwargs=self.args.gradient_checkpointing_kwargs,
            ) as unwrapped_model,
            torch.no_grad(),
            self._dist.summon_full_params(self.model_wrapped, recurse=False),
        ):
            unwrapped_model.generate(**inputs, generation_config=config)
