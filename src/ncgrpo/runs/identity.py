"""A training run's identity: the settings that make a run what it is.

Resuming a run folder, or reusing a finished one, with any of them changed is refused (``ncgrpo train
--resume`` unless ``--force``; a demo rerun into the same folder). Every setting ncgrpo declares is
part of it but a short explicit list of what may change on resume (:data:`MAY_CHANGE_ON_RESUME`), plus
the few inherited from TRL and transformers that change a run (:data:`INHERITED_IDENTITY`), so a new
field is covered with no edit here. Two settings mappings are compared by
:func:`ncgrpo.runs.folder.changed_identity`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

__all__ = ["INHERITED_IDENTITY", "MAY_CHANGE_ON_RESUME", "own_fields", "run_identity_keys"]

#: ncgrpo's own settings that may change between a run and its resume (which splits are evaluated and
#: how, and how many draws the logged noise-averaged TV takes). Every other setting ncgrpo defines (the
#: fields of ``ncgrpo train``'s ScriptArguments, those its ModelArguments and NCGRPOConfig add to TRL's,
#: the demo's own) is part of the run's identity, so a new field is covered with no edit here.
MAY_CHANGE_ON_RESUME = frozenset(
    {
        "eval_dataset_name",
        "eval_dataset_path",
        "eval_dataset_splits",
        "eval_dataset_limit",
        "marginal_tv_draws",
        # one prefill per group or one per row: the same rollouts up to float rounding (issue 24)
        "share_prompt_prefill",
        # one forward per shared prompt on the loss side or one per row: the same step within float rounding
        "share_prompt_loss",
    }
)
#: Settings inherited from TRL / transformers that change a run (the rest of theirs: logging, saving,
#: batch layout, the output folder, ... may change on resume).
INHERITED_IDENTITY = (
    "model_name_or_path",
    "dtype",
    "seed",
    "num_generations",
    "max_steps",
    "learning_rate",
    "lr_scheduler_type",
    "temperature",
    "top_p",
    "beta",
    "epsilon",
    "loss_type",
    "scale_rewards",
    "max_completion_length",
    "max_prompt_length",
)

_UPSTREAM = ("trl", "transformers")


def own_fields(cls: type) -> list[str]:
    """The fields ``cls`` and its non-TRL, non-transformers bases declare (what ncgrpo adds)."""
    ours = [c for c in cls.__mro__ if c is not object and c.__module__.split(".")[0] not in _UPSTREAM]
    declared = {name for c in ours for name in c.__dict__.get("__annotations__", {})}
    return [f.name for f in dataclasses.fields(cls) if f.name in declared]


def run_identity_keys(dataclass_types: Sequence[type]) -> list[str]:
    """The settings that make a run of these settings dataclasses what it is: every field ncgrpo's
    dataclasses declare (what they add to TRL's) but :data:`MAY_CHANGE_ON_RESUME`, plus
    :data:`INHERITED_IDENTITY`, in that order without repeats."""
    keys = dict.fromkeys(INHERITED_IDENTITY)
    for cls in dataclass_types:
        keys.update(dict.fromkeys(own_fields(cls)))
    return [k for k in keys if k not in MAY_CHANGE_ON_RESUME]
