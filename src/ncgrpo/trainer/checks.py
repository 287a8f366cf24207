"""What ``NCGRPOTrainer`` refuses or warns about, with the reason: a PEFT adapter on vLLM, a training set
smaller than one generation batch, LoRA dropout in the rollouts (at construction), a prompt over
``max_prompt_length`` (at every generation). Plain functions
of explicit values, called from the trainer."""

from __future__ import annotations

import warnings

import torch

from ncgrpo.methods import get_method
from ncgrpo.trainer.config import NCGRPOConfig

#: GRPOTrainer's positional parameters after ``args``, up to ``peft_config`` (TRL 1.16's order).
_PEFT_CONFIG_POSITION = 7  # train_dataset, eval_dataset, processing_class, reward_processing_classes,
# callbacks, optimizers, quantization_config, peft_config


def check_peft(model, args: NCGRPOConfig, rest: tuple, kwargs: dict) -> None:
    """PEFT (``peft_config=`` or a ``PeftModel``): the noise hooks find the language-model stack through
    the adapter wrapper (:func:`ncgrpo.engines.branch_point.unwrap_model`; LoRA layers are injected into
    the base model's own modules, so every forward of it, generate's and the shared paths', runs the
    adapter), and TRL's reference pass (adapter disabled) runs outside the generation hooks. Refused:
    an NC-GRPO method on vLLM with an adapter. TRL merges the adapter into the weights it sends to vLLM
    on every sync (``VLLMGeneration._iter_named_params``), which ncgrpo's vLLM tests do not cover (the
    vLLM test environment has no peft); generate with transformers (``use_vllm=False``) instead."""
    peft_config = kwargs.get(
        "peft_config", rest[_PEFT_CONFIG_POSITION] if len(rest) > _PEFT_CONFIG_POSITION else None
    )
    from accelerate.utils import is_peft_model

    if peft_config is None and (isinstance(model, str) or not is_peft_model(model)):  # a path: TRL loads it
        return
    if args.use_vllm and get_method(args.rollout_method).two_pass:  # vanilla: TRL's own path
        raise NotImplementedError(
            f"rollout_method={args.rollout_method!r} with a PEFT adapter on vLLM (use_vllm=True) is not supported: "
            "TRL syncs the merged adapter into vLLM, a path ncgrpo's vLLM tests do not cover. Generate with "
            "transformers (use_vllm=False; the noise acts through the adapter there), or merge the adapter "
            "(PeftModel.merge_and_unload) and train the merged model."
        )


def check_train_dataset_size(args: NCGRPOConfig, rest: tuple, kwargs: dict) -> None:
    """A training set smaller than one generation batch (``generation_batch_size / num_generations``
    prompts, i.e. ``per_device_train_batch_size x world_size x steps_per_generation / num_generations``)
    is refused before the model loads. TRL's sampler (``RepeatSampler``) drops an incomplete batch, so
    such a run would train 0 steps, save the base weights and report success. ``ncgrpo train`` makes
    the same check before the model (``ncgrpo.commands.train_prepare``); this is the library's.
    A dataset without a length (an ``IterableDataset``) or no dataset is left to TRL."""
    dataset = kwargs.get("train_dataset", rest[0] if rest else None)
    try:
        n = len(dataset)
    except TypeError:  # None, or an IterableDataset: no length to compare
        return
    prompts_needed = args.generation_batch_size // args.num_generations
    if n < prompts_needed:
        raise ValueError(
            f"the training set has {n} prompts but one generation batch takes {prompts_needed} "
            f"(per_device_train_batch_size {args.per_device_train_batch_size} x {args.world_size} processes x "
            f"steps_per_generation {args.steps_per_generation} / num_generations {args.num_generations}), so "
            "TRL's sampler would yield no batch and the run would train 0 steps; use more data or a smaller batch"
        )


def warn_lora_dropout(model) -> None:
    """TRL generates with the model in training mode, so LoRA dropout (TRL's default ``lora_dropout=0.05``)
    perturbs every rollout row, the clean half included: a second, unkeyed noise source beside eq. (2)."""
    rates = [
        m.p for n, m in model.named_modules() if ".lora_dropout." in n and isinstance(m, torch.nn.Dropout)
    ]
    if any(p > 0 for p in rates):
        warnings.warn(
            f"LoRA dropout {max(rates)} is active in the rollouts (TRL generates in training mode), so the clean "
            "half is not the clean policy: every row gets a random dropout mask besides the noisy half's eq. (2) "
            "noise. Set lora_dropout=0 (or disable_dropout=True) for NC-GRPO's clean/noisy contrast.",
            stacklevel=3,
        )


def check_prompt_lengths(prompt_ids, limit: int | None, inputs: list[dict] | None) -> None:
    """A prompt longer than ``limit`` (``max_prompt_length``) is an error naming its row and, from
    ``inputs`` (the batch's dataset rows, NC-GRPO's generation only), its ``question_id``."""
    if limit is None:
        return
    for i, ids in enumerate(prompt_ids):
        if len(ids) > limit:
            qid = None
            if inputs is not None and i < len(inputs):
                qid = inputs[i].get("question_id")
            raise ValueError(
                f"prompt {i} of this batch{f' (question_id {qid!r})' if qid is not None else ''} has {len(ids)} "
                f"tokens, more than max_prompt_length={limit}; drop or shorten that row, or raise the limit"
            )
