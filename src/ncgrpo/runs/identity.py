"""A training run's identity: the settings that make a run what it is.

Resuming a run folder, or reusing a finished one, with any of them changed is refused (``ncgrpo train
--resume`` unless ``--force``; a demo rerun into the same folder). The identity is EVERY field of the
run's settings dataclasses (ncgrpo's own, TRL's ``GRPOConfig`` and transformers' ``TrainingArguments``
fields inherited by ``NCGRPOConfig``, ``trl.ModelConfig``'s) but a short explicit list of settings that
may change on resume (:data:`MAY_CHANGE_ON_RESUME`, each with its reason in
:data:`MAY_CHANGE_REASONS`), so a new field, ncgrpo's or TRL's, is covered with no edit here.
``ncgrpo train`` holds it in ``run.json`` (``identity``) as well as in ``config.yaml``, so one lost
file cannot switch the check off. Two settings mappings are compared by
:func:`changed_identity` (also importable from :mod:`ncgrpo.runs.folder`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "MAY_CHANGE_ON_RESUME",
    "MAY_CHANGE_REASONS",
    "MODEL_IDENTITY",
    "changed_identity",
    "own_fields",
    "run_identity_keys",
]

#: Settings that may change between a run and its resume, grouped by the one reason they do not change
#: what is trained (docs/cli.md, "What --resume compares", lists the same). Everything else is identity.
_MAY_CHANGE_GROUPS: dict[str, tuple[str, ...]] = {
    # where the results go and what they are called: the folder itself is the run
    "output paths and names, not what is computed": (
        "output_dir", "run_name", "project", "trackio_space_id", "trackio_bucket_id", "trackio_static_space_id",
    ),
    "logging cadence, log levels and progress display: what is printed, not what is trained": (
        "logging_strategy", "logging_steps", "logging_first_step", "log_on_each_node",
        "logging_nan_inf_filter", "include_num_input_tokens_seen", "log_level", "log_level_replica",
        "disable_tqdm", "report_to", "skip_memory_metrics", "log_completions", "log_multimodal",
        "num_completions_to_print", "log_unique_prompts", "log_completions_hub_repo", "marginal_tv_draws",
    ),
    "saving cadence and where copies go: when a checkpoint is written, not what is in it": (
        "save_strategy", "save_steps", "save_on_each_node", "save_total_limit", "save_only_model",
        "enable_jit_checkpoint", "push_to_hub", "hub_token", "hub_private_repo", "hub_model_id",
        "hub_strategy", "hub_always_push", "hub_revision",
    ),
    "evaluation along the way: what is measured, never a term of the loss": (
        "eval_dataset_name", "eval_dataset_path", "eval_dataset_splits", "eval_dataset_limit",
        "eval_strategy", "eval_steps", "eval_delay", "per_device_eval_batch_size", "prediction_loss_only",
        "eval_on_start", "eval_do_concat_batches", "eval_use_gather_object", "eval_accumulation_steps",
        "include_for_metrics", "batch_eval_metrics", "num_generations_eval", "bf16_full_eval",
        "fp16_full_eval",
    ),
    "data loader workers: how batches are fetched, not which": (
        "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers",
        "dataloader_prefetch_factor", "dataloader_multiprocessing_context",
    ),
    "resuming itself and the launcher's bookkeeping": (
        "resume_from_checkpoint", "restore_callback_states_from_checkpoint", "do_train", "do_eval",
        "do_predict", "local_rank", "debug",
    ),
    "memory and process plumbing with the same arithmetic": (
        "torch_empty_cache_steps", "ddp_timeout", "ddp_backend", "ddp_find_unused_parameters",
        "ddp_bucket_cap_mb", "ddp_static_graph", "vllm_server_base_url", "vllm_server_host",
        "vllm_server_port", "vllm_server_timeout", "vllm_group_port", "vllm_gpu_memory_utilization",
        "vllm_enable_sleep_mode",
    ),
    # issue 24: one prefill per group or one per row, one loss forward per shared prompt or one per row
    "the same rollouts and the same step up to float rounding (issue 24)": (
        "share_prompt_prefill", "share_prompt_loss",
    ),
}  # fmt: skip
#: ``{setting: why it may change on resume}``: the settings left out of a run's identity.
MAY_CHANGE_REASONS: dict[str, str] = {k: why for why, keys in _MAY_CHANGE_GROUPS.items() for k in keys}
#: The settings that may change between a run and its resume (the keys of :data:`MAY_CHANGE_REASONS`).
MAY_CHANGE_ON_RESUME = frozenset(MAY_CHANGE_REASONS)

#: What is trained, part of every run's identity whichever settings dataclass holds it (``ncgrpo
#: train``'s ModelArguments; the demo names its base model and dtype beside an ``NCGRPOConfig``).
MODEL_IDENTITY = ("model_name_or_path", "dtype")

_UPSTREAM = ("trl", "transformers")


def own_fields(cls: type) -> list[str]:
    """The fields ``cls`` and its non-TRL, non-transformers bases declare (what ncgrpo adds)."""
    ours = [c for c in cls.__mro__ if c is not object and c.__module__.split(".")[0] not in _UPSTREAM]
    declared = {name for c in ours for name in c.__dict__.get("__annotations__", {})}
    return [f.name for f in dataclasses.fields(cls) if f.name in declared]


def run_identity_keys(dataclass_types: Sequence[type]) -> list[str]:
    """The settings that make a run of these settings dataclasses what it is: :data:`MODEL_IDENTITY`,
    then every field of each (inherited ones included: TRL's, transformers') but
    :data:`MAY_CHANGE_ON_RESUME`, ncgrpo's own first, in declaration order without repeats."""
    keys: dict[str, None] = dict.fromkeys(MODEL_IDENTITY)
    for cls in dataclass_types:
        keys.update(dict.fromkeys(own_fields(cls)))
    for cls in dataclass_types:
        keys.update(dict.fromkeys(f.name for f in dataclasses.fields(cls)))
    return [k for k in keys if k not in MAY_CHANGE_ON_RESUME]


def changed_identity(old: Mapping[str, Any], new: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    """``key: old -> new`` for every identity key whose value differs between two settings mappings
    (a key absent from ``old`` and ``None`` in ``new`` counts as unchanged: a setting added since)."""
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if a != b and not (a is None and k not in old and b is None):
            out.append(f"{k}: {a!r} -> {b!r}")
    return out
