"""``ncgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--resume] [--dry-run]``: one GRPO/NC-GRPO run.

As TRL's ``scripts/grpo.py``: the settings are three dataclasses parsed together by
:class:`ncgrpo.config.ConfigParser` (``--config recipe.yaml`` plus one ``--flag`` per field; flags
override the file): :class:`ScriptArguments` (data and rewards), ``NCGRPOConfig`` (the trainer) and
:class:`ModelArguments` (``trl.ModelConfig`` plus the vision settings); ``ncgrpo train --help`` lists
them. The pipeline is :func:`prepare_run` (resolve the run folder, refuse one holding checkpoints
unless resuming, build the trainer's settings and the datasets, check everything that needs no weights;
a dry run then writes ``config.yaml`` and ``run.json`` and stops) then :func:`execute_run` (load the
model, then write the run folder, train through :func:`ncgrpo.runs.driver.train_run`, save). ``--smoke``
shrinks any recipe to a CPU minute on the embedded base (:func:`apply_smoke`).
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
    "SMOKE_GENERATIONS",
    "SMOKE_SETTINGS",
    "ModelArguments",
    "RunPlan",
    "ScriptArguments",
    "add_parser",
    "apply_smoke",
    "build_datasets",
    "check_model_source",
    "command_line_keys",
    "execute_run",
    "load_model",
    "peft_config_for",
    "prepare_run",
    "resolve_derived",
    "run",
    "run_identity_keys",
    "smoke_settings",
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
                    "(a folder written by ncgrpo.toy.suite.export_geo3k)"
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
    training_args: Any  # NCGRPOConfig
    train_dataset: Any
    eval_dataset: Any
    run_info: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    main_process: bool = True  # this process writes files and prints
    lock: Any = None  # the folder's FolderLock, taken by write_folder(), held until release()
    config_text: str = ""  # the resolved config.yaml
    staging: Path | None = None  # a generated synthetic suite, moved into the folder by write_folder()
    dry_run: bool = False
    keep: bool = False  # a dry run into a folder that holds a run: its files are left as they are
    seen: Any = None  # the folder's run.json and checkpoints as prepare_run checked them (_folder_state)

    def write_folder(self) -> None:
        """Take the folder's lock and write ``config.yaml``, ``run.json`` and the generated data (the
        main process; :func:`prepare_run` calls it at the end of a dry run, :func:`execute_run` once the
        model has loaded). The lock stays held until :meth:`release`. A folder whose ``run.json`` or
        checkpoints changed since :func:`prepare_run` checked them (another run wrote it while this one
        loaded its model) is refused, so its checks hold under the lock."""
        import shutil

        try:
            if self.main_process and not self.keep:
                self.lock.acquire()
                if self.seen is not None and _folder_state(self.output_dir) != self.seen:
                    raise ValueError(
                        f"{self.output_dir} changed while the model loaded (another process wrote its "
                        f"{RUN_FILE} or checkpoints); check what is there, then rerun (or use another --output_dir)"
                    )
                if self.staging is not None:
                    target = self.output_dir / "synthetic-data"
                    if not target.exists():
                        # moved beside its place first (a copy when /tmp is another filesystem), then
                        # renamed: a kill mid-copy leaves only the partial folder, which the next run clears
                        partial = self.output_dir / ".synthetic-data.partial"
                        shutil.rmtree(partial, ignore_errors=True)
                        shutil.move(str(self.staging / "synthetic-data"), str(partial))
                        os.replace(partial, target)
                atomic_write_text(self.output_dir / CONFIG_FILE, self.config_text)
                atomic_write_json(self.output_dir / RUN_FILE, self.run_info)
        except BaseException:
            self.release()
            raise
        finally:
            if self.staging is not None:
                shutil.rmtree(self.staging, ignore_errors=True)
                self.staging = None

    def release(self) -> None:
        """Let go of the run folder (:func:`execute_run` does at its end) and of a staged suite never
        written; idempotent."""
        if self.staging is not None:
            import shutil

            shutil.rmtree(self.staging, ignore_errors=True)
            self.staging = None
        if self.lock is not None:
            self.lock.release()

    @property
    def n_eval(self) -> int:
        ev = self.eval_dataset
        if ev is None:
            return 0
        return sum(map(len, ev.values())) if isinstance(ev, dict) else len(ev)


def _folder_state(output_dir: Path) -> tuple[bytes | None, tuple[str, ...]]:
    """What :func:`prepare_run`'s folder checks read: ``run.json``'s bytes and the checkpoint names."""
    run_json = output_dir / RUN_FILE
    data = run_json.read_bytes() if run_json.is_file() else None
    return data, tuple(sorted(p.name for p in output_dir.glob("checkpoint-*")))


def run_identity_keys(dataclass_types: Sequence[type] | None = None) -> list[str]:
    """The settings that make a run what it is: resuming with any of them changed is refused unless
    forced (:func:`ncgrpo.runs.identity.run_identity_keys`: every field ncgrpo's dataclasses declare
    but :data:`MAY_CHANGE_ON_RESUME`, plus :data:`INHERITED_IDENTITY`). ``dataclass_types``: default
    :func:`train_dataclasses`."""
    from ncgrpo.runs.identity import run_identity_keys as keys_of

    return keys_of(dataclass_types if dataclass_types is not None else train_dataclasses())


# ------------------------------------------------------------------------ --smoke, derived settings
#: What ``--smoke`` sets (each unless given on the command line): the embedded base and the synthetic
#: suite instead of the recipe's model and data, one prompt's group per micro-batch, two rollout
#: batches, 48-token answers, float32 on the transformers engine, and ``branch_prefix '<think>'`` (on the
#: embedded base the first token after the generation prompt is ``<think>`` with probability ~1, which
#: leaves the paper's final-norm noise inert; the prefix moves the branch point to the first reasoning
#: token: README, "Read marginal TV"). Kept from the recipe: the method and its settings, G, the
#: reward, the optimizer, the ratio ``steps_per_generation / gradient_accumulation_steps`` (updates per
#: rollout batch) and eq. (3)'s schedule scaled to the shorter run. ``model_name_or_path`` is filled in
#: by :func:`smoke_settings`; ``per_device_train_batch_size``, ``max_steps``, ``schedule_k_mid`` and a
#: layer ``noise_site`` are derived from the recipe there.
SMOKE_SETTINGS: dict[str, Any] = {
    "dataset_name": "synthetic",
    "dataset_path": None,
    "dataset_train_limit": 16,
    "eval_dataset_name": None,
    "eval_dataset_path": None,
    "eval_dataset_limit": 12,
    "min_pixels": None,
    "max_pixels": None,
    "gradient_accumulation_steps": 1,
    "max_completion_length": 48,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "branch_prefix": "<think>",
    "logging_steps": 1,
    "report_to": ["none"],
}
#: Rollout batches a smoke run trains (the schedule's K in generations).
SMOKE_GENERATIONS = 2


def command_line_keys(parsed) -> set[str]:
    """The fields the command line gave (``--x``, ``--x=v``, ``--x-y``, ``--no_x``), from ``parsed.argv``."""
    fields = {k for t in parsed.types for k in parsed.values[t]}
    given = set()
    for tok in parsed.argv:
        if not tok.startswith("--"):
            continue
        name = tok[2:].split("=", 1)[0].replace("-", "_")
        if name in fields:
            given.add(name)
        elif name.startswith("no_") and name[3:] in fields:
            given.add(name[3:])
    return given


def _file_values(parsed) -> dict[str, Any]:
    """The config file's values (its ``base:`` chain merged), as written."""
    if not parsed.config:
        return {}
    from ncgrpo.config import load_config_file

    return dict(load_config_file(parsed.config).values)


def smoke_settings(parsed) -> dict[str, Any]:
    """:data:`SMOKE_SETTINGS` for this recipe, with what is derived from it: the embedded base as the
    model, ``per_device_train_batch_size`` = G (one prompt's group per micro-batch), ``max_steps`` =
    :data:`SMOKE_GENERATIONS` rollout batches at the recipe's updates per rollout batch,
    ``schedule_k_mid`` scaled by the same factor as ``max_steps`` (eq. (3) anneals at the same point of
    the run), a layer ``noise_site`` past the embedded base's layers moved to its middle layer, and
    ``run_name`` + ``-smoke`` (so the default output folder is not the full run's)."""
    from ncgrpo.core.noise import parse_noise_site
    from ncgrpo.models import text_layers
    from ncgrpo.toy.base_model import ensure_base_model

    base = ensure_base_model()
    out = dict(SMOKE_SETTINGS)
    out["model_name_or_path"] = str(base)
    g = int(parsed.get("num_generations") or 2)
    ga = int(parsed.get("gradient_accumulation_steps") or 1)
    spg = parsed.get("steps_per_generation")
    file, given = _file_values(parsed), command_line_keys(parsed)
    file_spg, file_ga = file.get("steps_per_generation"), file.get("gradient_accumulation_steps")
    if "steps_per_generation" not in given and file_spg and file_ga:
        # the file's ratio: resolve_derived keeps it when gradient_accumulation_steps is overridden
        spg, ga = int(file_spg), int(file_ga)
    updates = spg // ga if spg is not None and spg % ga == 0 and spg >= ga else 1
    out["per_device_train_batch_size"] = g
    # TRL's eval batch must hold whole groups too (its default 8 refuses G = 12 once eval is turned on)
    out["per_device_eval_batch_size"] = g
    out["max_steps"] = SMOKE_GENERATIONS * updates
    # k_mid scaled from the recipe's length to the run's (--max_steps given here wins over the smoke's)
    full_steps = file.get("max_steps") if "max_steps" in given else parsed.get("max_steps")
    steps = parsed.get("max_steps") if "max_steps" in given else out["max_steps"]
    if full_steps and full_steps > 0 and steps and steps > 0 and parsed.get("schedule_k_mid") is not None:
        out["schedule_k_mid"] = round(float(parsed.get("schedule_k_mid")) * steps / full_steps, 4)
    site = parse_noise_site(str(parsed.get("noise_site")))
    layers = text_layers(base)
    if site != "final_norm" and layers is not None and max(site) >= layers:
        out["noise_site"] = str(layers // 2)
    name = parsed.get("run_name") or (Path(parsed.config).stem if parsed.config else "ncgrpo")
    out["run_name"] = f"{name}-smoke"
    return out


def apply_smoke(parsed, given: set[str]) -> tuple[list[str], set[str]]:
    """Overlay :func:`smoke_settings` on the recipe (a flag given on the command line still wins);
    returns the notes (what changed) and the keys it set."""
    notes = []
    settings = smoke_settings(parsed)
    applied = set()
    for key, value in settings.items():
        if key in given:
            continue
        before = parsed.get(key)
        parsed.set(key, value)
        applied.add(key)
        if key in ("noise_site", "schedule_k_mid") and before != value:
            why = (
                "the embedded base has no such layer; its middle one"
                if key == "noise_site"
                else "scaled with max_steps"
            )
            notes.append(f"--smoke: {key} {before} -> {value} ({why})")
    notes.append(
        f"--smoke: {parsed.get('rollout_method')} on the embedded base ({settings['model_name_or_path']}), "
        f"{parsed.get('max_steps')} steps, G={parsed.get('num_generations')}, "
        f"branch_prefix {parsed.get('branch_prefix')!r}, the synthetic suite"
    )
    return notes, applied


def resolve_derived(parsed, overridden: set[str], file_values: dict[str, Any]) -> list[str]:
    """Settings a file states as functions of others follow an override of those others, or the run is
    refused naming both values; returns notes. ``overridden``: the keys the command line (or
    ``--smoke``) set over the file.

    - ``steps_per_generation`` (micro-batches per rollout batch): a file that sets it with
      ``gradient_accumulation_steps`` sets the updates per rollout batch (the recipes: 192 / 48 = 4); an
      override of ``gradient_accumulation_steps`` alone keeps that ratio. Where the file's value is no
      multiple of it, or the file sets ``steps_per_generation`` alone, the override is refused.
    - ``dtype`` (the weights as loaded) follows ``bf16`` / ``fp16`` when those are overridden and
      ``dtype`` is not: ``--bf16 false`` on a bf16 recipe loads float32 weights.
    """
    notes = []
    ga_key, spg_key = "gradient_accumulation_steps", "steps_per_generation"
    file_spg = file_values.get(spg_key)
    if ga_key in overridden and spg_key not in overridden and file_spg is not None:
        ga = parsed.get(ga_key)
        file_ga = file_values.get(ga_key)
        where = parsed.config
        if file_ga is None or file_spg % file_ga != 0:
            stated = f"with gradient_accumulation_steps {file_ga}" if file_ga is not None else "alone"
            raise ValueError(
                f"gradient_accumulation_steps {ga} overrides {where}, but its steps_per_generation {file_spg} "
                f"(set {stated}) was not: TRL would generate {file_spg} micro-batches per rollout batch, "
                f"{file_spg / ga:g} updates of {ga} micro-batches each; pass --steps_per_generation too"
            )
        new = file_spg // file_ga * ga
        if new != parsed.get(spg_key):
            notes.append(
                f"steps_per_generation {file_spg} -> {new}: {where} sets it to {file_spg // file_ga} x "
                f"gradient_accumulation_steps ({file_spg // file_ga} updates per rollout batch), which is "
                f"now {ga}; pass --steps_per_generation to set it yourself"
            )
            parsed.set(spg_key, new)
    if "dtype" not in overridden and {"bf16", "fp16"} & overridden:
        dtype = parsed.get("dtype")
        bf16, fp16 = parsed.get("bf16"), parsed.get("fp16")
        mixed = "bfloat16" if bf16 else "float16" if fp16 else "float32"
        if dtype in ("bfloat16", "float16", "float32") and dtype != mixed:
            flag = "bf16" if "bf16" in overridden else "fp16"
            notes.append(
                f"dtype {dtype} -> {mixed}: the weights follow {flag}={parsed.get(flag)}; "
                "pass --dtype to load them otherwise"
            )
            parsed.set("dtype", mixed)
    return notes


# --------------------------------------------------------------------- checks before the model
def _looks_like_a_path(name: str) -> bool:
    """Whether a missing ``model_name_or_path`` is meant as a local folder (not a hub id ORG/NAME)."""
    if name.startswith(("/", ".", "~")) or "\\" in name or name.endswith("/") or name.count("/") > 1:
        return True
    if "/" in name and Path(name.split("/", 1)[0]).is_dir():
        return True  # runs/my-model with a local runs/: a folder, not the hub namespace "runs"
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def check_model_source(name: str) -> None:
    """Refuse, with no hub lookup, a ``model_name_or_path`` that names a folder that is not there (or a
    file, or a folder with no ``config.json``). A name shaped like a hub id ``ORG/NAME`` that is no local
    folder must be in the hub cache or answer one request to the hub (refused at once where the hub
    says no such model or cannot be reached, or ``HF_HUB_OFFLINE`` is set)."""
    p = Path(name)
    if p.exists():
        if not p.is_dir():
            raise ValueError(
                f"model_name_or_path {name}: is a file; pass the folder save_pretrained wrote (or a hub id)"
            )
        if not (p / "config.json").is_file():
            raise ValueError(
                f"model_name_or_path {name}: the folder holds no config.json, so it is not a model saved with "
                "save_pretrained"
            )
        return
    if _looks_like_a_path(name):
        raise ValueError(
            f"model_name_or_path {name}: no such folder ({p.absolute()}); pass a folder written by "
            "save_pretrained, or a hub id ORG/NAME"
        )
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ValueError(
            f"model_name_or_path {name}: no local folder {p.absolute()}, and not in the hub cache "
            f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set"
        )
    # one request, no retries: transformers' own lookup retries for ~30 s where the hub cannot be reached
    try:
        model_info(name, timeout=10)
    except GatedRepoError:
        return  # it exists; the config lookup says what access it needs
    except RepositoryNotFoundError:
        raise ValueError(
            f"model_name_or_path {name}: no local folder {p.absolute()}, and no model {name} on the hub "
            "(or a private one: log in with `hf auth login`)"
        ) from None
    except Exception as e:  # noqa: BLE001 - the hub cannot be reached: the run could not load it either
        raise ValueError(
            f"model_name_or_path {name}: no local folder {p.absolute()}, and the hub cannot be reached to look "
            f"it up as a hub id ({type(e).__name__}: {e}); pass a local folder"
        ) from None


def _model_config(name: str):
    """The model's config (no weights): the first thing ``from_pretrained`` reads."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name)
    except Exception as e:  # noqa: BLE001 - any reason it does not load is the user's to see, named
        where = "folder" if Path(name).is_dir() else "hub id (not a local folder)"
        raise ValueError(f"model_name_or_path {name}: its config does not load as a {where}: {e}") from None


def _check_before_the_model(plan_args, model_args: ModelArguments, train_dataset, script_args=None) -> None:
    """Checks that need no weights, the ones the trainer would otherwise make after the model loads:
    the model's config (its source is checked first, by the caller: :func:`check_model_source`), the
    noise site against its layers (:func:`ncgrpo.models.check_noise_site`), the
    dataset against one generation batch (TRL would otherwise train 0 steps and save the base weights),
    and what ``GRPOTrainer.__init__`` / ``NCGRPOTrainer.__init__`` refuse before they generate (vLLM
    installed for ``use_vllm``, one weight per reward, continuous batching with a processor,
    ``share_prompt_loss`` against the model and attention, several GPUs in one process)."""
    from ncgrpo.core.plan import HIDDEN_NOISE_METHODS
    from ncgrpo.models import check_noise_site

    a = plan_args
    name = model_args.model_name_or_path
    config = _model_config(name)  # the caller checked the source (check_model_source) before the data
    if a.rollout_method in HIDDEN_NOISE_METHODS:
        check_noise_site(a.noise_site, name, config)
    per_generation = a.per_device_train_batch_size * a.world_size * a.steps_per_generation
    prompts_needed = per_generation // a.num_generations
    if len(train_dataset) < prompts_needed:
        raise ValueError(
            f"the training set has {len(train_dataset)} prompts but one generation batch takes "
            f"{prompts_needed} (per_device_train_batch_size {a.per_device_train_batch_size} x "
            f"{a.world_size} processes x steps_per_generation {a.steps_per_generation} / num_generations "
            f"{a.num_generations}); use more data or a smaller batch"
        )
    if model_args.use_peft:
        _check_lora_targets(_lora_config(model_args), config.model_type)
        if a.use_vllm and a.rollout_method != "vanilla":
            raise ValueError(
                f"use_peft with use_vllm and rollout_method={a.rollout_method!r}: NCGRPOTrainer refuses an "
                "NC-GRPO method on vLLM with an adapter (TRL's merged-adapter sync is untested with the noise); "
                "set --use_vllm false (the noise acts through the adapter there)"
            )
    if a.use_vllm:
        from trl.import_utils import is_vllm_available

        if not is_vllm_available():
            raise ValueError(
                "use_vllm=true, but vLLM is not installed here: pip install -e '.[vllm]' (a GPU wheel), "
                "or --use_vllm false for the transformers engine"
            )
    if script_args is not None and a.reward_weights is not None:
        if len(a.reward_weights) != len(script_args.reward_funcs):
            raise ValueError(
                f"reward_weights has {len(a.reward_weights)} weights but reward_funcs names "
                f"{len(script_args.reward_funcs)} functions ({', '.join(script_args.reward_funcs)})"
            )
    from ncgrpo.models import is_vision_language

    if a.use_transformers_continuous_batching and is_vision_language(config):
        raise ValueError(
            "use_transformers_continuous_batching does not support vision-language models (TRL); set it false"
        )
    if a.share_prompt_loss:
        from ncgrpo.trainer.shared_loss import SUPPORTED_ATTENTION, SUPPORTED_MODEL_TYPES

        attn = model_args.attn_implementation or "sdpa"
        if config.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"share_prompt_loss=True: {name}'s model_type {config.model_type!r} is not one it is tested on "
                f"({', '.join(SUPPORTED_MODEL_TYPES)}); set share_prompt_loss=False."
            )
        if attn not in SUPPORTED_ATTENTION:
            raise ValueError(
                f"share_prompt_loss=True needs a 4-D attention mask, which attn_implementation={attn!r} does "
                "not take; use sdpa (or eager), or set share_prompt_loss=False."
            )
    if a.n_gpu > 1:
        raise ValueError(
            f"{a.n_gpu} GPUs are visible to one process, which the trainer refuses (nn.DataParallel); launch "
            "with accelerate launch (recipes/accelerate/) or make one GPU visible with CUDA_VISIBLE_DEVICES"
        )


def _trainer_config(parsed):
    """``NCGRPOConfig`` from the parsed settings, as the real run builds it (in a dry run too)."""
    from ncgrpo.trainer import NCGRPOConfig

    where = parsed.config or "the command line"
    try:
        return parsed.build(NCGRPOConfig)
    except (TypeError, ValueError, NotImplementedError) as e:
        hint = ""
        if "bf16" in str(e) or "fp16" in str(e):
            hint = (
                " (a recipe for GPUs on a machine without one: --smoke tries it small on the CPU; "
                "--bf16 false --use_cpu true runs it as is)"
            )
        raise ValueError(f"{where}: trainer settings rejected by NCGRPOConfig: {e}{hint}") from None


def _needs_generated_suite(script_args: ScriptArguments) -> bool:
    s = script_args
    return (s.dataset_name == "synthetic" and s.dataset_path is None) or (
        bool(s.eval_dataset_splits) and s.eval_name == "synthetic" and s.eval_path is None
    )


def prepare_run(
    parsed,
    *,
    resume: bool = False,
    dry_run: bool = False,
    force: bool = False,
    overwrite: bool = False,
    smoke: bool = False,
    synthetic: Callable[[Path, int], Any] | None = None,
) -> RunPlan:
    """Everything before the model: from a :class:`ncgrpo.config.ParsedConfig` of
    :func:`train_dataclasses` to a :class:`RunPlan`. Nothing is written into the run folder here but by
    a dry run once every check has passed; a real run writes it in :func:`execute_run`, once the model
    has loaded (:meth:`RunPlan.write_folder`).

    ``smoke``: the recipe shrunk to a CPU minute (:func:`apply_smoke`). Then settings derived from
    others follow their overrides (:func:`resolve_derived`). ``run_name`` defaults to the config file's
    stem and ``output_dir`` to ``runs/<run_name>``; both are recorded in the resolved config. Refused,
    each in a dry run too:

    - a folder another process is writing (its lock, :class:`ncgrpo.runs.folder.FolderLock`, names the
      holder), a file, or a folder of another kind (an evaluation, a demo's root, a saved model:
      :func:`ncgrpo.runs.folder.folder_kind`);
    - a folder holding ``checkpoint-*`` without ``resume`` (not in a dry run, which writes no run);
    - a folder whose ``run.json`` says the run finished, unless ``overwrite`` (idem);
    - ``resume`` with settings that change the run (:func:`run_identity_keys`) unless ``force``;
    - trainer settings ``NCGRPOConfig`` rejects (TRL's batch arithmetic, bf16 without a GPU, ...);
    - the checks of :func:`_check_before_the_model`: a model path that is not there (at once, no hub
      lookup), a config that does not load, a noise site past the model's layers, a training set
      smaller than one generation batch, what the trainer's constructor refuses.

    ``resume`` continues from the newest COMPLETE checkpoint
    (:func:`ncgrpo.runs.folder.last_complete_checkpoint`); newer incomplete ones are named in the notes.
    A synthetic suite the run generates (``dataset_name synthetic``, no path) is built in a temporary
    folder and moved to ``OUTPUT/synthetic-data`` when the folder is written.
    """
    import shutil
    import tempfile

    from accelerate import PartialState

    notes: list[str] = []
    given = command_line_keys(parsed)
    file_values = _file_values(parsed)
    overridden = set(given)
    if smoke:
        smoke_notes, applied = apply_smoke(parsed, given)
        notes += smoke_notes
        overridden |= applied
    notes += resolve_derived(parsed, overridden, file_values)
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

    seen = _folder_state(output_dir)  # what the checks below read; write_folder compares it under the lock
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

    training_args = _trainer_config(parsed)
    # initialise the distributed state with the config's settings (backend, timeout) before the
    # PartialState below shares it
    _ = training_args.device
    state = PartialState()
    run_info = {
        "kind": "train",
        "name": name,
        "method": method,
        "seed": seed,
        "model": model_args.model_name_or_path,
        "recipe": parsed.config,
        "output_dir": str(output_dir),
    }
    # a dry run leaves a folder that already holds a run as it found it (its config.yaml and run.json
    # say what that run was, finished or not); into a new folder it writes the resolved config
    keep = dry_run and (previous is not None or bool(any_checkpoint))
    staging = None
    data_dir = output_dir
    if _needs_generated_suite(script_args) and not (output_dir / "synthetic-data" / "data").is_dir():
        staging = Path(tempfile.mkdtemp(prefix="ncgrpo-train-data-"))
        data_dir = staging
    try:
        check_model_source(model_args.model_name_or_path)  # before the data: a typo costs no suite
        train_ds, eval_ds = build_datasets(script_args, data_dir, seed=seed, synthetic=synthetic)
        _check_before_the_model(training_args, model_args, train_ds, script_args)
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if keep:
        notes.append(
            f"dry run: {output_dir} holds a run; its {CONFIG_FILE} and {RUN_FILE} are left as they are"
        )
    plan = RunPlan(
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
        config_text=parsed.to_yaml(),
        staging=staging,
        dry_run=dry_run,
        keep=keep,
        seen=seen,
    )
    if dry_run:
        try:
            plan.write_folder()
        finally:
            plan.release()
    return plan


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


def _lora_config(model_args: ModelArguments) -> Any:
    """``trl.get_peft_config(model_args)``, with one fix: TRL's ``ModelConfig`` turns a one-item
    ``lora_target_modules`` into a string, which peft reads as a regex matched against whole module names,
    so ``--lora_target_modules q_proj`` targeted nothing (peft: "No modules were targeted"). A single
    plain module name (letters, digits, ``_``) is kept as the one-name list the user gave; ``all-linear``
    and patterns (``.*\\.q_proj``) stay as they are."""
    import re

    from trl import get_peft_config

    config = get_peft_config(model_args)
    target = config.target_modules
    if isinstance(target, str) and target != "all-linear" and re.fullmatch(r"[A-Za-z_]\w*", target):
        config.target_modules = {target}
    return config


def _check_lora_targets(config: Any, model_type: str | None) -> None:
    """A model type peft has no default LoRA target modules for (the Qwen-VL family) needs
    ``lora_target_modules``: said with the flag's name, from the model's config alone (``--dry-run`` too)."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as DEFAULT_TARGETS

    if config.target_modules is None and not config.target_parameters and model_type not in DEFAULT_TARGETS:
        raise ValueError(
            f"use_peft: peft has no default LoRA target modules for model type {model_type!r}; set "
            "lora_target_modules (e.g. --lora_target_modules all-linear, or q_proj k_proj v_proj o_proj)"
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

    from ncgrpo.models import find_vision_tower

    config = _lora_config(model_args)
    _check_lora_targets(config, getattr(model.config, "model_type", None))
    tower = find_vision_tower(model) if model_args.freeze_vision_tower else None
    if tower is not None:
        config.exclude_modules = rf"{re.escape(tower[0])}(\..*)?"
    return config


def execute_run(plan: RunPlan):
    """Load the model (vision tower frozen if asked) and train the plan through
    :func:`ncgrpo.runs.driver.train_run` (with ``use_peft``: a LoRA adapter, :func:`peft_config_for`; the
    folder then holds the adapter, not full weights); the run folder's lock is released at the end."""
    from ncgrpo.runs.driver import train_run

    if plan.dry_run:
        raise ValueError("a dry-run plan is not trained; prepare it with dry_run=False")
    try:
        model, processor = load_model(plan.model_args)
        peft_config = peft_config_for(plan.model_args, model)  # refusals before anything is written
        plan.write_folder()  # nothing is written before the model has loaded
        return train_run(
            plan.training_args,
            model,
            processor,
            plan.train_dataset,
            reward_funcs=reward_functions(plan.script_args.reward_funcs),
            run_info=plan.run_info,
            eval_dataset=plan.eval_dataset,
            resume_from_checkpoint=plan.checkpoint,
            peft_config=peft_config,
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
        help="every check the run makes before it loads the model (settings, the model's config, the data "
        "against the batch), then write the resolved config and stop (no weights loaded)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the recipe shrunk to a CPU minute: same method and settings, on the embedded base and the "
        "synthetic suite, two rollout batches, G kept (recipes/README.md, 'Trying a recipe small'); "
        "flags given here still override",
    )
    p.set_defaults(func=run)
    return p


def _synthetic_suite(folder, seed: int) -> None:
    from ncgrpo.toy.suite import build_suite, export_geo3k

    export_geo3k(build_suite(seed=seed), folder)


def run(args: argparse.Namespace) -> int:
    plan = prepare_run(
        args.parsed_config,
        resume=args.resume,
        dry_run=args.dry_run,
        force=args.force,
        overwrite=args.overwrite,
        smoke=args.smoke,
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
