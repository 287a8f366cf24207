"""``ncgrpo train``'s settings: the argument dataclasses TRL's ``scripts/grpo.py`` parses
(:class:`ScriptArguments`, ``NCGRPOConfig``, :class:`ModelArguments`: :func:`train_dataclasses`), the
run's identity (:func:`run_identity_keys`), and the settings ``--smoke`` and the derived settings change
(:func:`apply_smoke`, :func:`resolve_derived`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig

from ncgrpo.data.prompts import MATH_PROMPT_HELP
from ncgrpo.rewards.loading import BUILTIN_REWARDS

__all__ = [
    "DATA_HASH_KEY",
    "DATA_NAMES",
    "REWARD_NAMES",
    "SMOKE_GENERATIONS",
    "SMOKE_SETTINGS",
    "ModelArguments",
    "ScriptArguments",
    "apply_smoke",
    "command_line_keys",
    "data_file_hash",
    "recorded_identity",
    "resolve_derived",
    "run_identity",
    "run_identity_keys",
    "smoke_settings",
    "train_dataclasses",
]

# ------------------------------------------------------------------------------ train settings
#: ``dataset_name`` values besides a data file of one's own: the real Geometry3K, the synthetic suite
#: exported in its schema, and the text benchmarks GSM8K and MATH-500.
DATA_NAMES = ("geo3k", "synthetic", "gsm8k", "math500")
#: ``reward_funcs`` entries besides a dotted import path: reward functions of :mod:`ncgrpo.rewards`.
REWARD_NAMES = BUILTIN_REWARDS
_SYNTHETIC_SPLITS = ("train", "validation", "test")
_DATA_HELP = (
    "geo3k (Geometry3K, hiyouga/geometry3k's schema), synthetic (the synthetic suite exported in that "
    "schema), gsm8k or math500 (their test files: GSM8K's number after ####, MATH-500's answer), or a data "
    "file of your own (.jsonl, .json or .parquet; $VARS and ~ expand) whose "
    "--prompt_column holds each prompt, a string or chat messages, as TRL's prompt column; its other "
    "columns reach the reward functions as keyword arguments"
)


def _expand(path: str | None) -> str | None:
    return None if path is None else os.path.expandvars(os.path.expanduser(str(path)))


def _positive_or_none(name: str, value: Any) -> None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise ValueError(f"{name} must be a positive number of rows or null (all rows), got {value!r}")


def _data_source(name: str, value: str | None) -> str | None:
    """A ``dataset_name`` value: a built-in name as is, a data file's path expanded; else refused."""
    from ncgrpo.data.files import DATA_FILE_SUFFIXES, is_data_file

    if value is None or value in DATA_NAMES:
        return value
    if is_data_file(value):
        return _expand(value)
    import difflib

    near = difflib.get_close_matches(str(value), DATA_NAMES, n=1)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    raise ValueError(
        f"{name} {value!r}{hint}: not a built-in dataset ({', '.join(DATA_NAMES)}) nor a data file "
        f"(a path ending in {', '.join(DATA_FILE_SUFFIXES)})"
    )


@dataclass
class ScriptArguments:
    """What ``ncgrpo train`` trains on and how it is rewarded (TRL's ``ScriptArguments`` role)."""

    dataset_name: str = field(
        default="geo3k",
        metadata={"help": f"training data: {_DATA_HELP}"},
    )
    dataset_path: str | None = field(
        default=None,
        metadata={
            "help": "geo3k / synthetic: folder in the hub layout (data/<split>-*.parquet) or one parquet file; "
            "$VARS and ~ expand. null: geo3k reads hiyouga/geometry3k from the datasets cache; synthetic "
            "generates the suite (seeded by --seed) into OUTPUT/synthetic-data. Not with a data file "
            "(dataset_name is its path)"
        },
    )
    dataset_train_split: str = field(
        default="train", metadata={"help": "split to train on (a data file is one split: train)"}
    )
    dataset_train_limit: int | None = field(
        default=None, metadata={"help": "train on the first N rows of the split (null: all)"}
    )
    prompt_column: str = field(
        default="prompt",
        metadata={
            "help": "data file: the column holding each prompt (a string: the user's message, rendered "
            "with the model's chat template; or a list of chat messages, used as written)"
        },
    )
    answer_column: str | None = field(
        default=None,
        metadata={
            "help": "data file: the column the built-in rewards read as the gold answer (passed to them as "
            "answer; null: the column answer). Your own reward functions get every column by its own name"
        },
    )
    eval_dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "evaluation data: geo3k, synthetic or a data file of your own (the whole file is one "
            "evaluation set; no --eval_dataset_splits then); null: dataset_name's loader, with "
            "--eval_dataset_splits",
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
        metadata={"help": MATH_PROMPT_HELP},
    )
    reward_funcs: list[str] = field(
        default_factory=lambda: ["math_reward"],
        metadata={
            "help": f"reward functions: built-in ({', '.join(REWARD_NAMES)}; math_reward = 0.9 * accuracy "
            "+ 0.1 * format) or a dotted import path of your own, as TRL's (my_rewards.exact: def "
            "exact(prompts, completions, **kwargs) -> list[float], imported from the current directory or "
            "PYTHONPATH, the data's columns as keyword arguments); weight several with --reward_weights"
        },
    )

    def __post_init__(self) -> None:
        from ncgrpo.data.files import is_data_file
        from ncgrpo.rewards.loading import resolve_reward

        self.dataset_name = _data_source("dataset_name", self.dataset_name)
        self.eval_dataset_name = _data_source("eval_dataset_name", self.eval_dataset_name)
        self.dataset_path = _expand(self.dataset_path)
        self.eval_dataset_path = _expand(self.eval_dataset_path)
        _positive_or_none("dataset_train_limit", self.dataset_train_limit)
        _positive_or_none("eval_dataset_limit", self.eval_dataset_limit)
        self.eval_dataset_splits = list(self.eval_dataset_splits or [])
        if is_data_file(self.dataset_name):
            if self.dataset_path is not None:
                raise ValueError(
                    f"dataset_path {self.dataset_path!r} is for geo3k / synthetic; dataset_name "
                    f"{self.dataset_name} is a data file, which is the path itself: drop dataset_path"
                )
            if self.dataset_train_split != "train":
                raise ValueError(
                    f"dataset_train_split {self.dataset_train_split!r}: dataset_name {self.dataset_name} is a "
                    "data file, one split (train); give each split its own file"
                )
        if self.eval_dataset_name is not None and is_data_file(self.eval_dataset_name):
            if self.eval_dataset_splits:
                raise ValueError(
                    f"eval_dataset_splits {self.eval_dataset_splits}: eval_dataset_name {self.eval_dataset_name} "
                    "is a data file, evaluated whole; drop eval_dataset_splits (give each split its own file)"
                )
            if self.eval_dataset_path is not None:
                raise ValueError(
                    f"eval_dataset_path {self.eval_dataset_path!r} is for geo3k / synthetic; eval_dataset_name "
                    "is a data file, the path itself: drop eval_dataset_path"
                )
        elif is_data_file(self.dataset_name) and self.eval_dataset_splits:
            raise ValueError(
                f"eval_dataset_splits {self.eval_dataset_splits}: dataset_name is a data file (one split); "
                "evaluate on a file of your own with --eval_dataset_name FILE"
            )
        if not isinstance(self.prompt_column, str) or not self.prompt_column.strip():
            raise ValueError(f"prompt_column must name a column, got {self.prompt_column!r}")
        if self.answer_column is not None and not str(self.answer_column).strip():
            raise ValueError(f"answer_column must name a column or be null, got {self.answer_column!r}")
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
        for r in self.reward_funcs:
            resolve_reward(str(r))  # a dotted path is imported now: not importable / not callable refused

    @property
    def uses_data_file(self) -> bool:
        """Whether the training data is a data file of one's own."""
        from ncgrpo.data.files import is_data_file

        return is_data_file(self.dataset_name)

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
    by ``trl.get_peft_config``, as TRL's scripts do; :func:`ncgrpo.driver.peft_config_for`).
    ``load_in_8bit`` / ``load_in_4bit`` and a ``model_revision`` other than ``main`` are refused (the
    bitsandbytes settings only matter with them).
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


def run_identity_keys(dataclass_types: Sequence[type] | None = None) -> list[str]:
    """The settings that make a run what it is: resuming with any of them changed is refused unless
    forced (:func:`ncgrpo.runs.identity.run_identity_keys`: every field ncgrpo's dataclasses declare
    but :data:`~ncgrpo.runs.identity.MAY_CHANGE_ON_RESUME`, plus
    :data:`~ncgrpo.runs.identity.INHERITED_IDENTITY`). ``dataclass_types``: default
    :func:`train_dataclasses`."""
    from ncgrpo.runs.identity import run_identity_keys as keys_of

    return keys_of(dataclass_types if dataclass_types is not None else train_dataclasses())


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists, enums and other objects as their text), so the
    identity written to ``run.json`` compares equal to the one computed again."""
    import json

    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


#: The identity key of a data file's content (``dataset_name`` names its path): a resume on a file
#: whose bytes changed is refused as a resume on another file is. None for the built-in datasets.
DATA_HASH_KEY = "dataset_sha256"


def data_file_hash(dataset_name: Any) -> str | None:
    """sha256 of the training data file ``dataset_name`` names (None: a built-in dataset, or no such
    file yet; reading it then says why)."""
    from ncgrpo.data.files import file_sha256, is_data_file

    if not isinstance(dataset_name, str) or not is_data_file(dataset_name):
        return None
    path = Path(_expand(dataset_name))
    return file_sha256(path) if path.is_file() else None


def run_identity(parsed) -> dict[str, Any]:
    """``{setting: value}`` for every :func:`run_identity_keys` setting of a parsed ``ncgrpo train``
    config, defaults included (what ``run.json``'s ``identity`` records and ``--resume`` compares), and
    :data:`DATA_HASH_KEY`, the content hash of a data file of one's own."""
    out = {k: _plain(parsed.get(k)) for k in run_identity_keys()}
    out[DATA_HASH_KEY] = data_file_hash(parsed.get("dataset_name"))
    return out


def _identity_defaults() -> dict[str, Any]:
    from ncgrpo.commands.parser import ConfigParser

    return run_identity(ConfigParser(train_dataclasses).parse_args([]).parsed_config)


def recorded_identity(output_dir: str | os.PathLike) -> tuple[dict[str, Any] | None, str]:
    """``(identity, where it was read)`` of the run in ``output_dir``: ``run.json``'s ``identity``,
    else its ``config.yaml`` (explicit values, the rest at their defaults), else ``(None, "")``. A
    setting the record lacks (one added to ncgrpo or TRL since) is taken at its default. A record
    that does not parse is a ``ValueError`` naming the file."""
    import yaml

    from ncgrpo.runs.folder import CONFIG_FILE, RUN_FILE, read_run_json

    out = Path(output_dir)
    info = read_run_json(out, hint="move it away or fix it") or {}
    recorded = info.get("identity")
    where = str(out / RUN_FILE)
    if not isinstance(recorded, dict):
        path = out / CONFIG_FILE
        if not path.is_file():
            return None, ""
        try:
            recorded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
            raise ValueError(
                f"{path}: cannot read the run's settings to compare ({e}); move the folder away or fix the file"
            ) from None
        if not isinstance(recorded, dict):
            raise ValueError(f"{path}: holds no mapping of settings; move the folder away or fix the file")
        recorded.pop("env", None)
        where = str(path)
    defaults = _identity_defaults()
    # the data file's hash only where recorded (run.json): config.yaml holds settings, not the hash
    return {
        k: _plain(recorded[k]) if k in recorded else defaults[k]
        for k in defaults
        if k != DATA_HASH_KEY or k in recorded
    }, where


# ------------------------------------------------------------------------ --smoke, derived settings
#: What ``--smoke`` sets (each unless given on the command line): the embedded base and the synthetic
#: suite instead of the recipe's model and data (a text recipe, one whose data is a data file: the
#: embedded base's language model as a text-only Qwen2 and addition word problems in the recipe's
#: prompt / answer columns, :mod:`ncgrpo.toy.text_base`), one prompt's group per micro-batch, two rollout
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
    from ncgrpo.commands.config_file import load_config_file

    return dict(load_config_file(parsed.config).values)


def smoke_settings(parsed) -> dict[str, Any]:
    """:data:`SMOKE_SETTINGS` for this recipe, with what is derived from it: the embedded base as the
    model, ``per_device_train_batch_size`` = G (one prompt's group per micro-batch), ``max_steps`` =
    :data:`SMOKE_GENERATIONS` rollout batches at the recipe's updates per rollout batch,
    ``schedule_k_mid`` scaled by the same factor as ``max_steps`` (eq. (3) anneals at the same point of
    the run), a layer ``noise_site`` past the embedded base's layers moved to its middle layer, and
    ``run_name`` + ``-smoke`` (so the default output folder is not the full run's)."""
    from ncgrpo.core.noise import parse_noise_site
    from ncgrpo.data.files import is_data_file
    from ncgrpo.models import text_layers
    from ncgrpo.toy.base_model import ensure_base_model

    out = dict(SMOKE_SETTINGS)
    if is_data_file(parsed.get("dataset_name")):
        # a text recipe: text-only on both sides, the recipe's columns kept (ncgrpo.toy.text_base)
        from ncgrpo.toy.text_base import ensure_text_base_model, ensure_text_smoke_data

        base = ensure_text_base_model()
        prompt_column, answer_column = parsed.get("prompt_column"), parsed.get("answer_column")
        out["dataset_name"] = str(ensure_text_smoke_data(prompt_column or "prompt", answer_column))
    else:
        base = ensure_base_model()
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
    text = settings["dataset_name"] != "synthetic"
    notes.append(
        f"--smoke: {parsed.get('rollout_method')} on the embedded base"
        + ("'s language model (text-only)" if text else "")
        + f" ({settings['model_name_or_path']}), {parsed.get('max_steps')} steps, "
        f"G={parsed.get('num_generations')}, branch_prefix {parsed.get('branch_prefix')!r}, "
        + (
            f"addition word problems in the recipe's columns ({settings['dataset_name']})"
            if text
            else "the synthetic suite"
        )
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
