"""``ncgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--resume] [--dry-run]``: one GRPO/NC-GRPO run.

As TRL's ``scripts/grpo.py``: the settings are three dataclasses parsed together by
:class:`ncgrpo.config.ConfigParser` (``--config recipe.yaml`` plus one ``--flag`` per field; flags
override the file): :class:`ScriptArguments` (data and rewards), ``NCGRPOConfig`` (the trainer) and
:class:`ModelArguments` (``trl.ModelConfig`` plus the vision settings); ``ncgrpo train --help`` lists
them. The pipeline is :func:`prepare_run` (resolve the run folder, refuse one holding checkpoints
unless resuming, check what needs no weights, write ``config.yaml`` and ``run.json``, build the
datasets) then :func:`execute_run` (load the model, train through :func:`ncgrpo.runs.driver.train_run`,
save).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig

# torch and transformers are imported inside the functions that need them: `ncgrpo --help` imports
# every command module
from ncgrpo.runs.folder import (
    CONFIG_FILE,
    RUN_FILE,
    FolderLock,
    atomic_write_json,
    atomic_write_text,
    changed_identity,
    last_complete_checkpoint,
    read_run_json,
)
from ncgrpo.runs.identity import INHERITED_IDENTITY, MAY_CHANGE_ON_RESUME

__all__ = [
    "DATA_NAMES",
    "INHERITED_IDENTITY",
    "MAY_CHANGE_ON_RESUME",
    "REWARD_NAMES",
    "ModelArguments",
    "RunPlan",
    "ScriptArguments",
    "add_parser",
    "build_datasets",
    "execute_run",
    "load_model",
    "peft_config_for",
    "prepare_run",
    "run",
    "run_identity_keys",
    "train_dataclasses",
]

# ------------------------------------------------------------------------------ train settings
#: ``dataset_name`` values: the real Geometry3K and the synthetic suite exported in its schema.
DATA_NAMES = ("geo3k", "synthetic")
#: ``reward_funcs`` entries: reward functions of :mod:`ncgrpo.rewards`.
REWARD_NAMES = ("math_reward", "math_reward_mathruler", "accuracy_reward", "format_reward")
_SYNTHETIC_SPLITS = ("train", "validation", "test")


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.expandvars(os.path.expanduser(str(path)))


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive number of rows or null (all rows), got {value!r}")


@dataclass
class ScriptArguments:
    """What ``ncgrpo train`` trains on and how it is rewarded (TRL's ``ScriptArguments`` role)."""

    dataset_name: str = field(
        default="geo3k",
        metadata={
            "help": "training data loader: geo3k (Geometry3K, hiyouga/geometry3k's schema) or synthetic "
            "(the synthetic suite exported in that schema)",
            "choices": list(DATA_NAMES),
        },
    )
    dataset_path: str | None = field(
        default=None,
        metadata={
            "help": "folder in the hub layout (data/<split>-*.parquet) or one parquet file; $VARS and ~ expand. "
            "null: geo3k reads hiyouga/geometry3k from the datasets cache; synthetic generates the suite "
            "(seeded by --seed) into OUTPUT/synthetic-data"
        },
    )
    dataset_train_split: str = field(default="train", metadata={"help": "split to train on"})
    dataset_train_limit: int | None = field(
        default=None, metadata={"help": "train on the first N rows of the split (null: all)"}
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "loader of the evaluation sets (null: dataset_name)",
            "choices": list(DATA_NAMES),
        },
    )
    eval_dataset_path: str | None = field(
        default=None,
        metadata={"help": "path of the evaluation sets (null: dataset_path when the loader is the same)"},
    )
    eval_dataset_splits: list[str] = field(
        default_factory=list,
        metadata={
            "help": "splits evaluated during training (used when --eval_strategy is set); none by default"
        },
    )
    eval_dataset_limit: int | None = field(
        default=None, metadata={"help": "first N rows of each evaluation split (null: all)"}
    )
    system_prompt: str | None = field(default=None, metadata={"help": "system message of every prompt"})
    math_prompt: str | None = field(
        default=None,
        metadata={"help": "instruction appended to each problem (null: ncgrpo.data.types.MATH_PROMPT)"},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_reward"],
        metadata={
            "help": f"reward functions of ncgrpo.rewards: {', '.join(REWARD_NAMES)} "
            "(math_reward = 0.9 * accuracy + 0.1 * format; weight several with --reward_weights)"
        },
    )

    def __post_init__(self) -> None:
        for name in ("dataset_name", "eval_dataset_name"):
            value = getattr(self, name)
            if value is not None and value not in DATA_NAMES:
                raise ValueError(f"{name} must be one of {', '.join(DATA_NAMES)}, got {value!r}")
        self.dataset_path = _expand(self.dataset_path)
        self.eval_dataset_path = _expand(self.eval_dataset_path)
        _positive_or_none("dataset_train_limit", self.dataset_train_limit)
        _positive_or_none("eval_dataset_limit", self.eval_dataset_limit)
        self.eval_dataset_splits = list(self.eval_dataset_splits or [])
        for name, splits in (
            (self.dataset_name, [self.dataset_train_split]),
            (self.eval_name, self.eval_dataset_splits),
        ):
            bad = [s for s in splits if name == "synthetic" and s not in _SYNTHETIC_SPLITS]
            if bad:
                raise ValueError(
                    f"the synthetic suite has splits {', '.join(_SYNTHETIC_SPLITS)}; got {bad[0]!r}"
                )
        self.reward_funcs = list(self.reward_funcs or [])
        if not self.reward_funcs:
            raise ValueError("reward_funcs is empty; name at least one, e.g. math_reward")
        import difflib

        for r in self.reward_funcs:
            if r not in REWARD_NAMES:
                near = difflib.get_close_matches(r, REWARD_NAMES, n=1)
                hint = f" (did you mean '{near[0]}'?)" if near else ""
                raise ValueError(f"unknown reward function '{r}'{hint}; known: {', '.join(REWARD_NAMES)}")

    @property
    def eval_name(self) -> str:
        return self.eval_dataset_name or self.dataset_name

    @property
    def eval_path(self) -> str | None:
        if self.eval_dataset_path is not None:
            return self.eval_dataset_path
        return self.dataset_path if self.eval_name == self.dataset_name else None


#: ModelConfig features ncgrpo does not implement: field -> the value that means "off".
_UNSUPPORTED_MODEL_FEATURES = {
    "load_in_8bit": (False, "8-bit quantisation"),
    "load_in_4bit": (False, "4-bit quantisation"),
    "model_revision": ("main", "hub revisions (pass a local folder saved at the revision you want)"),
}


@dataclass
class ModelArguments(ModelConfig):
    """``trl.ModelConfig`` plus the vision settings of the paper's recipe (section 4.1).

    ncgrpo trains the whole language model, or with ``use_peft`` a LoRA adapter on it (TRL's fields:
    ``lora_r``, ``lora_alpha``, ``lora_dropout``, ``lora_target_modules``, ... made into a ``LoraConfig``
    by ``trl.get_peft_config``, as TRL's scripts do; :func:`peft_config_for`). ``load_in_8bit`` /
    ``load_in_4bit`` and a ``model_revision`` other than ``main`` are refused (the bitsandbytes settings
    only matter with them).
    """

    dtype: str | None = field(
        default="bfloat16",
        metadata={
            "help": "dtype the weights are loaded in (auto: bfloat16 on a GPU that has it, else float32)",
            "choices": ["auto", "bfloat16", "float16", "float32"],
        },
    )
    freeze_vision_tower: bool = field(
        default=True,
        metadata={
            "help": "freeze the vision encoder (requires_grad=False), as the paper and NoisyRollout do"
        },
    )
    min_pixels: int | None = field(
        default=None,
        metadata={
            "help": "image processor's minimum pixels per image (NoisyRollout: 262144; null: the processor's)"
        },
    )
    max_pixels: int | None = field(
        default=None,
        metadata={
            "help": "image processor's maximum pixels per image (NoisyRollout: 1000000; null: the processor's)"
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.model_name_or_path:
            raise ValueError(
                "model_name_or_path is required: a folder written by save_pretrained or a hub id in the cache "
                "(set it in the config file or pass --model_name_or_path)"
            )
        self.model_name_or_path = _expand(self.model_name_or_path)
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"dtype must be one of auto, bfloat16, float16, float32; got {self.dtype!r}")
        for name, (off, what) in _UNSUPPORTED_MODEL_FEATURES.items():
            if getattr(self, name) != off:
                raise ValueError(
                    f"{name}={getattr(self, name)!r}: ncgrpo does not support {what}; remove it from the config"
                )
        if self.use_peft:
            self._check_lora()
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of pixels or null, got {value!r}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")

    def _check_lora(self) -> None:
        """``use_peft``: the LoRA settings checked before anything loads (peft installed, sizes valid)."""
        import importlib.util

        if importlib.util.find_spec("peft") is None:
            raise ValueError(
                "use_peft=true needs the peft package, which is not installed here: "
                "pip install 'ncgrpo[peft]' (or pip install 'peft>=0.21,<1')"
            )
        r, alpha, dropout = self.lora_r, self.lora_alpha, self.lora_dropout
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise ValueError(f"lora_r must be a positive integer (the adapter's rank), got {r!r}")
        if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not alpha > 0:
            raise ValueError(f"lora_alpha must be a positive number, got {alpha!r}")
        if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
            raise ValueError(f"lora_dropout must be in [0, 1), got {dropout!r}")
        if self.lora_task_type != "CAUSAL_LM":
            raise ValueError(
                f"lora_task_type={self.lora_task_type!r}: NC-GRPO trains causal (vision-)language models; "
                "use CAUSAL_LM (the default)"
            )


def train_dataclasses() -> tuple[type, type, type]:
    """``(ScriptArguments, NCGRPOConfig, ModelArguments)``, the order TRL's GRPO script parses."""
    from ncgrpo.trainer import NCGRPOConfig

    return ScriptArguments, NCGRPOConfig, ModelArguments


# ------------------------------------------------------------------------------------ pipeline
def _questions(
    name: str, path: str | None, split: str, limit: int | None, seed: int, output_dir: Path, synthetic
):
    from ncgrpo.data.geometry3k import load_geometry3k

    if name == "synthetic" and path is None:
        folder = output_dir / "synthetic-data"
        if not (folder / "data").is_dir():
            if synthetic is None:
                raise ValueError(
                    "dataset_name synthetic with no dataset_path needs a suite generator; pass dataset_path "
                    "(a folder written by ncgrpo.toy.synthetic.export_geo3k)"
                )
            synthetic(folder, seed)
        path = str(folder)
    return load_geometry3k(path, split, limit=limit)


def build_datasets(
    script_args: ScriptArguments,
    output_dir: str | os.PathLike,
    *,
    seed: int = 42,
    synthetic: Callable[[Path, int], Any] | None = None,
):
    """(train dataset, eval dataset / dict of them / None) in the form ``to_trl_dataset`` makes.

    ``synthetic(folder, seed)`` writes the synthetic suite (geo3k layout) into ``folder``; it is called
    when ``dataset_name`` is synthetic and no path is given (``ncgrpo train`` passes the toy suite's).
    """
    from ncgrpo.data.geometry3k import to_trl_dataset

    out = Path(output_dir)
    kwargs: dict[str, Any] = {"system_prompt": script_args.system_prompt}
    if script_args.math_prompt is not None:
        kwargs["math_prompt"] = script_args.math_prompt

    def build(name, path, split, limit):
        return to_trl_dataset(_questions(name, path, split, limit, seed, out, synthetic), **kwargs)

    s = script_args
    train = build(s.dataset_name, s.dataset_path, s.dataset_train_split, s.dataset_train_limit)
    evals = {
        f"{s.eval_name}_{split}": build(s.eval_name, s.eval_path, split, s.eval_dataset_limit)
        for split in dict.fromkeys(s.eval_dataset_splits)
    }
    if not evals:
        return train, None
    return train, (next(iter(evals.values())) if len(evals) == 1 else evals)


@dataclass
class RunPlan:
    """A resolved run, ready to train: what :func:`prepare_run` returns."""

    name: str
    method: str
    seed: int
    output_dir: Path
    checkpoint: str | None  # resume from here (None: from scratch)
    script_args: ScriptArguments
    model_args: ModelArguments
    training_args: Any  # NCGRPOConfig; None for a dry run
    train_dataset: Any
    eval_dataset: Any
    run_info: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    main_process: bool = True  # this process writes files and prints
    lock: Any = None  # the folder's FolderLock, held by the main process until release()

    def release(self) -> None:
        """Let go of the run folder (:func:`execute_run` does at its end); idempotent."""
        if self.lock is not None:
            self.lock.release()

    @property
    def n_eval(self) -> int:
        ev = self.eval_dataset
        if ev is None:
            return 0
        return sum(map(len, ev.values())) if isinstance(ev, dict) else len(ev)


def run_identity_keys(dataclass_types: Sequence[type] | None = None) -> list[str]:
    """The settings that make a run what it is: resuming with any of them changed is refused unless
    forced (:func:`ncgrpo.runs.identity.run_identity_keys`: every field ncgrpo's dataclasses declare
    but :data:`MAY_CHANGE_ON_RESUME`, plus :data:`INHERITED_IDENTITY`). ``dataclass_types``: default
    :func:`train_dataclasses`."""
    from ncgrpo.runs.identity import run_identity_keys as keys_of

    return keys_of(dataclass_types if dataclass_types is not None else train_dataclasses())


def _check_before_the_model(plan_args, model_args: ModelArguments, train_dataset) -> None:
    """Checks that need no weights: the noise site against the model's config, and the dataset
    against one generation batch (TRL would otherwise train 0 steps and save the base weights)."""
    from ncgrpo.core.plan import HIDDEN_NOISE_METHODS
    from ncgrpo.models import check_noise_site

    a = plan_args
    if a.rollout_method in HIDDEN_NOISE_METHODS:
        check_noise_site(a.noise_site, model_args.model_name_or_path)
    per_generation = a.per_device_train_batch_size * a.world_size * a.steps_per_generation
    prompts_needed = per_generation // a.num_generations
    if len(train_dataset) < prompts_needed:
        raise ValueError(
            f"the training set has {len(train_dataset)} prompts but one generation batch takes "
            f"{prompts_needed} (per_device_train_batch_size {a.per_device_train_batch_size} x "
            f"{a.world_size} processes x steps_per_generation {a.steps_per_generation} / num_generations "
            f"{a.num_generations}); use more data or a smaller batch"
        )


def prepare_run(
    parsed,
    *,
    resume: bool = False,
    dry_run: bool = False,
    force: bool = False,
    overwrite: bool = False,
    synthetic: Callable[[Path, int], Any] | None = None,
) -> RunPlan:
    """Everything before the model: from a :class:`ncgrpo.config.ParsedConfig` of
    :func:`train_dataclasses` to a :class:`RunPlan`.

    ``run_name`` defaults to the config file's stem and ``output_dir`` to ``runs/<run_name>``; both are
    recorded in the resolved config. Refused before anything is written:

    - a folder another process is writing (its lock, :class:`ncgrpo.runs.folder.FolderLock`, names the
      holder), a file, or a folder of another kind (an evaluation, a demo's root, a saved model:
      :func:`ncgrpo.runs.folder.folder_kind`);
    - a folder holding ``checkpoint-*`` without ``resume`` (or ``dry_run``);
    - a folder whose ``run.json`` says the run finished, unless ``overwrite``;
    - ``resume`` with settings that change the run (:func:`run_identity_keys`) unless ``force``;
    - trainer settings ``NCGRPOConfig`` rejects (not built in a dry run, which needs no accelerator);
    - a noise site past the model's layers (read from its config, before the weights) and a training
      set smaller than one generation batch.

    ``resume`` continues from the newest COMPLETE checkpoint
    (:func:`ncgrpo.runs.folder.last_complete_checkpoint`); newer incomplete ones are named in the notes.
    Then the main process takes the folder's lock (held until :meth:`RunPlan.release`, which
    :func:`execute_run` calls), builds the datasets and writes ``config.yaml`` and ``run.json`` (a dry
    run into a folder that already holds a run leaves both as they are).
    """
    from accelerate import PartialState

    from ncgrpo.trainer import NCGRPOConfig

    script_args = parsed.build(ScriptArguments)
    model_args = parsed.build(ModelArguments)
    name = parsed.get("run_name") or (Path(parsed.config).stem if parsed.config else "ncgrpo")
    if "/" in name or "\\" in name or name in (".", "..") or not name.strip():
        raise ValueError(
            f"run_name {name!r} is not a name: it becomes the folder runs/<run_name>, so it may hold no path "
            "separator and may not be '.' or '..' (to write elsewhere, set --output_dir)"
        )
    output_dir = Path(parsed.get("output_dir") or Path("runs") / name)
    parsed.set("run_name", name)
    parsed.set("output_dir", str(output_dir))
    method, seed = str(parsed.get("rollout_method")), int(parsed.get("seed"))
    lock = FolderLock(output_dir, "ncgrpo train", kind="train")
    if os.environ.get("RANK", "0") == "0":  # the main process (PartialState is made below, once configured)
        lock.check()  # a file, another kind, another writer: refused before any other check reads it

    import yaml

    notes = []
    any_checkpoint = sorted(output_dir.glob("checkpoint-*")) if output_dir.is_dir() else []
    if any_checkpoint and not resume and not dry_run:
        raise ValueError(
            f"{output_dir} already holds {any_checkpoint[-1].name}; pass --resume or another --output_dir"
        )
    previous = read_run_json(output_dir, hint="move it away or fix it")
    if previous is not None and previous.get("finished") and not overwrite and not dry_run:
        raise ValueError(
            f"{output_dir} holds a finished run ({previous.get('name')!r}, {previous.get('global_step')} steps); "
            "use another --output_dir, or --overwrite to train it again from scratch"
        )
    checkpoint = None
    if resume:
        checkpoint, skipped = last_complete_checkpoint(output_dir, method)
        notes += [f"skipping incomplete {s}" for s in skipped]
        if checkpoint is None:
            notes.append(f"no complete checkpoint in {output_dir}; starting from scratch")
        old_config = output_dir / CONFIG_FILE
        if checkpoint is not None and old_config.exists():
            try:
                old = yaml.safe_load(old_config.read_text(encoding="utf-8")) or {}
            except (OSError, yaml.YAMLError) as e:
                raise ValueError(f"{old_config}: cannot read the run's config to compare ({e})") from None
            new = yaml.safe_load(parsed.to_yaml()) or {}
            changed = changed_identity(old, new, run_identity_keys())
            if changed and not force:
                raise ValueError(
                    f"--resume with settings that change the run in {output_dir}: {'; '.join(changed)}. "
                    "Resume with the run's own settings, use another --output_dir, or pass --force"
                )
            if changed:
                notes.append("resuming with changed settings (--force): " + "; ".join(changed))

    training_args = None
    if not dry_run:
        try:
            training_args = parsed.build(NCGRPOConfig)
        except (TypeError, ValueError) as e:
            where = parsed.config or "the command line"
            raise ValueError(f"{where}: trainer settings rejected by NCGRPOConfig: {e}") from None
        # initialise the distributed state with the config's settings (backend, timeout) before the
        # PartialState below shares it
        _ = training_args.device

    run_info = {
        "kind": "train",
        "name": name,
        "method": method,
        "seed": seed,
        "model": model_args.model_name_or_path,
        "recipe": parsed.config,
        "output_dir": str(output_dir),
    }
    state = PartialState()
    if state.is_main_process:
        lock.acquire()
    try:
        with state.main_process_first():
            train_ds, eval_ds = build_datasets(script_args, output_dir, seed=seed, synthetic=synthetic)
        if training_args is not None:
            _check_before_the_model(training_args, model_args, train_ds)
        # a dry run leaves a folder that already holds a run as it found it (its config.yaml and run.json
        # say what that run was, finished or not); into a new folder it writes the resolved config
        keep = dry_run and (previous is not None or bool(any_checkpoint))
        if keep:
            notes.append(
                f"dry run: {output_dir} holds a run; its {CONFIG_FILE} and {RUN_FILE} are left as they are"
            )
        if state.is_main_process and not keep:
            atomic_write_text(output_dir / CONFIG_FILE, parsed.to_yaml())
            atomic_write_json(output_dir / RUN_FILE, run_info)
    except BaseException:
        lock.release()
        raise
    return RunPlan(
        name=name,
        method=method,
        seed=seed,
        output_dir=output_dir,
        checkpoint=checkpoint,
        script_args=script_args,
        model_args=model_args,
        training_args=training_args,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        run_info=run_info,
        notes=notes,
        main_process=state.is_main_process,
        lock=lock,
    )


def reward_functions(names: Sequence[str]) -> list:
    from ncgrpo import rewards

    return [getattr(rewards, name) for name in names]


def load_model(model_args: ModelArguments) -> tuple[Any, Any]:
    """(model, processor or tokenizer) as :class:`ModelArguments` say, left where ``from_pretrained``
    put it (the Trainer places it). With ``use_peft`` a local folder is loaded by its absolute path, so
    the adapter saved at the end names a base model (``adapter_config.json``'s ``base_model_name_or_path``)
    that loads from any working directory."""
    from ncgrpo.models import load_model_and_processor

    m = model_args
    path = m.model_name_or_path
    if m.use_peft and os.path.isdir(path):
        path = os.path.abspath(path)
    return load_model_and_processor(
        path,
        dtype=m.dtype,
        device=None,
        attn_implementation=m.attn_implementation,
        min_pixels=m.min_pixels,
        max_pixels=m.max_pixels,
        freeze_vision=m.freeze_vision_tower,
    )


def peft_config_for(model_args: ModelArguments, model: Any) -> Any:
    """The ``peft.LoraConfig`` of ``use_peft`` (None without it), made by ``trl.get_peft_config`` as TRL's
    scripts make it. Two ncgrpo additions: with ``freeze_vision_tower`` the vision tower is excluded
    (``exclude_modules``), so the adapter trains the language model only, as the full-weight run does
    (Qwen2.5-VL's vision blocks have ``gate_proj``/``up_proj``/``down_proj`` too); and a model type peft
    has no default target modules for (the Qwen-VL family) is an error naming ``--lora_target_modules``
    here, before the trainer starts, instead of peft's."""
    if not model_args.use_peft:
        return None
    import re

    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS
    from trl import get_peft_config

    from ncgrpo.models import find_vision_tower

    config = get_peft_config(model_args)
    model_type = getattr(model.config, "model_type", None)
    if config.target_modules is None and not config.target_parameters and model_type not in DEFAULT_TARGETS:
        raise ValueError(
            f"use_peft: peft has no default LoRA target modules for model type {model_type!r}; set "
            "lora_target_modules (e.g. --lora_target_modules all-linear, or q_proj k_proj v_proj o_proj)"
        )
    tower = find_vision_tower(model) if model_args.freeze_vision_tower else None
    if tower is not None:
        config.exclude_modules = rf"{re.escape(tower[0])}(\..*)?"
    return config


def execute_run(plan: RunPlan):
    """Load the model (vision tower frozen if asked) and train the plan through
    :func:`ncgrpo.runs.driver.train_run` (with ``use_peft``: a LoRA adapter, :func:`peft_config_for`; the
    folder then holds the adapter, not full weights); the run folder's lock is released at the end."""
    from ncgrpo.runs.driver import train_run

    if plan.training_args is None:
        raise ValueError("a dry-run plan has no trainer settings; prepare it with dry_run=False")
    try:
        model, processor = load_model(plan.model_args)
        return train_run(
            plan.training_args,
            model,
            processor,
            plan.train_dataset,
            reward_funcs=reward_functions(plan.script_args.reward_funcs),
            run_info=plan.run_info,
            eval_dataset=plan.eval_dataset,
            resume_from_checkpoint=plan.checkpoint,
            peft_config=peft_config_for(plan.model_args, model),
        )
    finally:
        plan.release()


# ------------------------------------------------------------------------------------ the command
HELP = "train with GRPO / NC-GRPO from a recipe (recipes/*.yaml)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help=HELP,
        description=HELP + ". Multi-GPU: accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml "
        "-m ncgrpo.cli train --config RECIPE ...",
        dataclass_types=train_dataclasses,
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in the run folder"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: resume even if settings that change the run differ from the run's config.yaml",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="train into a folder whose run.json says the run finished (it is replaced)",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        help="resolve the config, write it and build the dataset, then stop (no model)",
    )
    p.set_defaults(func=run)
    return p


def _synthetic_suite(folder, seed: int) -> None:
    from ncgrpo.toy.synthetic import build_suite, export_geo3k

    export_geo3k(build_suite(seed=seed), folder)


def run(args: argparse.Namespace) -> int:
    plan = prepare_run(
        args.parsed_config,
        resume=args.resume,
        dry_run=args.dry_run,
        force=args.force,
        overwrite=args.overwrite,
        synthetic=_synthetic_suite,
    )
    if plan.main_process:
        for note in plan.notes:
            print(f"ncgrpo train: {note}", file=sys.stderr)
        print(
            f"ncgrpo train: {plan.name} ({plan.method}), {len(plan.train_dataset)} training prompts, "
            f"{plan.n_eval} eval prompts -> {plan.output_dir}"
        )
    try:
        if not args.dry_run:
            execute_run(plan)
    finally:
        plan.release()
    return 0
