"""Setting up a run, the transformers way: model and processor loading, vision-tower freezing, the
metrics file, and ``ncgrpo train``'s pipeline from a parsed config to a trained run folder. Shared by
``ncgrpo train``, ``ncgrpo eval``, the benchmarks and the embedded demo.

Training settings are three dataclasses parsed together by :class:`ncgrpo.config.ConfigParser` (TRL's
``--config recipe.yaml`` plus one ``--flag`` per field): :class:`ScriptArguments` (data and rewards),
``NCGRPOConfig`` (the trainer) and :class:`ModelArguments` (``trl.ModelConfig`` plus the vision
settings). :func:`prepare_run` resolves the run folder, refuses one holding checkpoints unless resuming,
writes ``config.yaml`` and ``run.json`` and builds the datasets; :func:`execute_run` loads the model
and trains through :func:`train_run`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback
from trl import ModelConfig

from ncgrpo.core.plan import HIDDEN_NOISE_METHODS
from ncgrpo.eval.records import METRICS_FILE
from ncgrpo.models import (  # noqa: F401  (re-exported: the setup API)
    VISION_TOWER_PATHS,
    find_vision_tower,
    freeze_vision_tower,
    load_model_and_processor,
    resolve_device,
    resolve_dtype,
    tokenizer_of,
)

__all__ = [
    "CONFIG_FILE",
    "DATA_NAMES",
    "METRICS_FILE",
    "REWARD_NAMES",
    "VISION_TOWER_PATHS",
    "MetricsCallback",
    "ModelArguments",
    "RunPlan",
    "ScriptArguments",
    "build_datasets",
    "execute_run",
    "find_vision_tower",
    "freeze_vision_tower",
    "load_model",
    "load_model_and_processor",
    "prepare_run",
    "read_run_info",
    "resolve_device",
    "resolve_dtype",
    "train_dataclasses",
    "train_run",
]


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


class MetricsCallback(TrainerCallback):
    """Append each log call to ``path`` (``metrics.jsonl``) as one JSON line with ``"step"`` (main process).

    Each line is written, flushed and fsync'ed on its own, so a killed run leaves at most one torn
    last line, which is cut at the next start. On resume, lines logged after the checkpoint's step
    (work the restart repeats) are dropped so every step appears once.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._repair(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": int(state.global_step)}
        if state.epoch is not None:
            row["epoch"] = float(state.epoch)
        row.update({k: _jsonable(v) for k, v in logs.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=False, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _repair(self, resumed_step: int) -> None:
        if not self.path.exists():
            return
        from ncgrpo.eval.records import atomic_write_text

        text = self.path.read_text(encoding="utf-8", errors="replace")
        keep, changed = [], not text.endswith("\n") and bool(text)
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # torn last line
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):
                changed = True
                continue
            if step > resumed_step:
                changed = True
                continue
            keep.append(line)
        if changed:
            atomic_write_text(self.path, "".join(keep))


def read_run_info(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run folder's ``run.json`` (what :func:`train_run` wrote), or ``None`` if there is none."""
    from ncgrpo.eval.records import RUN_FILE

    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable run.json ({e}); move it away or fix it") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return info


def train_run(
    args,
    model,
    processor,
    train_dataset,
    *,
    reward_funcs,
    run_info: dict[str, Any],
    eval_dataset=None,
    callbacks: Sequence[Any] = (),
    resume_from_checkpoint: str | None = None,
    console_logs: bool = True,
):
    """One training run into ``args.output_dir``, the same for ``ncgrpo train`` and the demo.

    Writes ``run.json`` (``run_info`` plus ``finished: false``) before training, appends every log
    call to ``metrics.jsonl`` (:class:`MetricsCallback`), trains (from ``resume_from_checkpoint`` if
    given), saves the final model and processor to the folder and rewrites ``run.json`` with
    ``global_step`` and ``finished: true`` last, so a folder whose ``run.json`` says finished holds a
    complete model. Only the main process writes. ``console_logs=False`` removes TRL's per-step
    printing (a caller with its own progress display). Returns the trainer.
    """
    from accelerate import PartialState
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ncgrpo.eval.records import RUN_FILE, atomic_write_json
    from ncgrpo.trainer import NCGRPOTrainer

    out = Path(args.output_dir)
    state = PartialState()
    info = {**run_info, "output_dir": str(out), "finished": False}
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / RUN_FILE, info)
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
        callbacks=[MetricsCallback(out / METRICS_FILE), *callbacks],
    )
    if not console_logs:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(str(out))
    if state.is_main_process:
        processor.save_pretrained(str(out))
        atomic_write_json(
            out / RUN_FILE, {**info, "global_step": int(trainer.state.global_step), "finished": True}
        )
    return trainer


# ------------------------------------------------------------------------------ train settings
#: ``dataset_name`` values: the real Geometry3K and the synthetic suite exported in its schema.
DATA_NAMES = ("geo3k", "synthetic")
#: ``reward_funcs`` entries: reward functions of :mod:`ncgrpo.rewards`.
REWARD_NAMES = ("math_reward", "math_reward_mathruler", "accuracy_reward", "format_reward")
#: The resolved config in a run folder (flat YAML; ``ncgrpo train --config`` reads it back).
CONFIG_FILE = "config.yaml"
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
    "use_peft": (False, "PEFT/LoRA adapters"),
    "load_in_8bit": (False, "8-bit quantisation"),
    "load_in_4bit": (False, "4-bit quantisation"),
    "model_revision": ("main", "hub revisions (pass a local folder saved at the revision you want)"),
}


@dataclass
class ModelArguments(ModelConfig):
    """``trl.ModelConfig`` plus the vision settings of the paper's recipe (section 4.1).

    ncgrpo trains the whole language model: ``use_peft``, ``load_in_8bit``/``load_in_4bit`` and a
    ``model_revision`` other than ``main`` are refused (the LoRA and bitsandbytes settings only matter
    with them).
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
        for name in ("min_pixels", "max_pixels"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive number of pixels or null, got {value!r}")
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels={self.min_pixels} is above max_pixels={self.max_pixels}")


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

    @property
    def n_eval(self) -> int:
        ev = self.eval_dataset
        if ev is None:
            return 0
        return sum(map(len, ev.values())) if isinstance(ev, dict) else len(ev)


#: Settings that make a run what it is: resuming with any of them changed is refused unless forced.
#: (Logging, saving, batch layout and the output folder may change between a run and its resume.)
RUN_IDENTITY_KEYS = (
    "model_name_or_path",
    "dtype",
    "freeze_vision_tower",
    "min_pixels",
    "max_pixels",
    "dataset_name",
    "dataset_path",
    "dataset_train_split",
    "dataset_train_limit",
    "system_prompt",
    "math_prompt",
    "reward_funcs",
    "rollout_method",
    "sigma0",
    "sigma_schedule",
    "schedule_gamma",
    "schedule_k_mid",
    "schedule_unit",
    "noise_site",
    "noise_layer_decay",
    "noise_positions",
    "noise_seed",
    "antithetic_grouping",
    "spsa_lr",
    "spsa_mu_max",
    "spsa_min_sigma_ratio",
    "spsa_max_step_ratio",
    "first_token_temperature",
    "first_token_temperature_auto",
    "first_token_marginal_draws",
    "image_noise_step",
    "noisy_importance_sampling",
    "branch_prefix",
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


def changed_identity(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """``key: old -> new`` for every :data:`RUN_IDENTITY_KEYS` entry that differs between two resolved
    configs (flat mappings as ``config.yaml`` holds them)."""
    out = []
    for k in RUN_IDENTITY_KEYS:
        a, b = old.get(k), new.get(k)
        if a != b and not (a is None and k not in old and b is None):
            out.append(f"{k}: {a!r} -> {b!r}")
    return out


def _text_layers(model_name_or_path: str) -> int | None:
    """Decoder layers of the model's language stack, from its config alone (no weights); None if the
    config cannot be read here (then the trainer checks once the model is loaded)."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model_name_or_path)
    except Exception:  # noqa: BLE001 - not readable without the model: the trainer checks later
        return None
    n = getattr(cfg.get_text_config(), "num_hidden_layers", None)
    return int(n) if n is not None else None


def _check_before_the_model(plan_args, model_args: ModelArguments, train_dataset) -> None:
    """Checks that need no weights: the noise site against the model's config, and the dataset
    against one generation batch (TRL would otherwise train 0 steps and save the base weights)."""
    a = plan_args
    site = a.noise_site_parsed
    if site != "final_norm" and a.rollout_method in HIDDEN_NOISE_METHODS:
        n_layers = _text_layers(model_args.model_name_or_path)
        if n_layers is not None and max(site) >= n_layers:
            raise ValueError(
                f"noise_site={a.noise_site!r} names layer {max(site)} but {model_args.model_name_or_path} has "
                f"{n_layers} decoder layers (0..{n_layers - 1})"
            )
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

    - a folder holding ``checkpoint-*`` without ``resume`` (or ``dry_run``);
    - a folder whose ``run.json`` says the run finished, unless ``overwrite``;
    - ``resume`` with settings that change the run (:data:`RUN_IDENTITY_KEYS`) unless ``force``;
    - trainer settings ``NCGRPOConfig`` rejects (not built in a dry run, which needs no accelerator);
    - a noise site past the model's layers (read from its config, before the weights) and a training
      set smaller than one generation batch.

    ``resume`` continues from the newest COMPLETE checkpoint
    (:func:`ncgrpo.trainer.last_complete_checkpoint`); newer incomplete ones are named in the notes.
    Then the main process builds the datasets and writes ``config.yaml`` and ``run.json``.
    """
    from accelerate import PartialState

    from ncgrpo.eval.records import RUN_FILE, atomic_write_json, atomic_write_text
    from ncgrpo.trainer import NCGRPOConfig

    script_args = parsed.build(ScriptArguments)
    model_args = parsed.build(ModelArguments)
    name = parsed.get("run_name") or (Path(parsed.config).stem if parsed.config else "ncgrpo")
    output_dir = Path(parsed.get("output_dir") or Path("runs") / name)
    parsed.set("run_name", name)
    parsed.set("output_dir", str(output_dir))
    method, seed = str(parsed.get("rollout_method")), int(parsed.get("seed"))

    import yaml

    from ncgrpo.trainer import last_complete_checkpoint

    notes = []
    any_checkpoint = sorted(output_dir.glob("checkpoint-*")) if output_dir.is_dir() else []
    if any_checkpoint and not resume and not dry_run:
        raise ValueError(
            f"{output_dir} already holds {any_checkpoint[-1].name}; pass --resume or another --output_dir"
        )
    previous = read_run_info(output_dir)
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
            changed = changed_identity(old, new)
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
        "name": name,
        "method": method,
        "seed": seed,
        "model": model_args.model_name_or_path,
        "recipe": parsed.config,
        "output_dir": str(output_dir),
    }
    state = PartialState()
    with state.main_process_first():
        train_ds, eval_ds = build_datasets(script_args, output_dir, seed=seed, synthetic=synthetic)
    if training_args is not None:
        _check_before_the_model(training_args, model_args, train_ds)
    if state.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output_dir / CONFIG_FILE, parsed.to_yaml())
        atomic_write_json(output_dir / RUN_FILE, run_info)
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
    )


def reward_functions(names: Sequence[str]) -> list:
    from ncgrpo import rewards

    return [getattr(rewards, name) for name in names]


def load_model(model_args: ModelArguments) -> tuple[Any, Any]:
    """(model, processor or tokenizer) as :class:`ModelArguments` say, left where ``from_pretrained``
    put it (the Trainer places it)."""
    m = model_args
    return load_model_and_processor(
        m.model_name_or_path,
        dtype=m.dtype,
        device=None,
        attn_implementation=m.attn_implementation,
        min_pixels=m.min_pixels,
        max_pixels=m.max_pixels,
        freeze_vision=m.freeze_vision_tower,
    )


def execute_run(plan: RunPlan):
    """Load the model (vision tower frozen if asked) and train the plan through :func:`train_run`."""
    if plan.training_args is None:
        raise ValueError("a dry-run plan has no trainer settings; prepare it with dry_run=False")
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
    )
