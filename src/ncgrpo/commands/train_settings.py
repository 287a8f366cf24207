"""``ncgrpo train``'s settings: the argument dataclasses TRL's ``scripts/grpo.py`` parses
(:class:`ScriptArguments`, ``NCGRPOConfig``, :class:`ModelArguments`: :func:`train_dataclasses`) and the
run's identity (:func:`run_identity_keys`, :func:`run_identity`, :func:`recorded_identity`). The
settings ``--smoke`` and the derived settings change (:func:`apply_smoke`, :func:`resolve_derived`)
live in :mod:`ncgrpo.commands.train_smoke` and are re-exported here."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trl import ModelConfig

from ncgrpo.commands.train_smoke import (
    SMOKE_GENERATIONS,
    SMOKE_SETTINGS,
    apply_smoke,
    command_line_keys,
    resolve_derived,
    smoke_settings,
)
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


def _config_yaml_settings(path: Path) -> dict[str, Any] | None:
    """A run's ``config.yaml`` as a mapping of settings (``env`` left out), or None where there is none;
    a file that does not parse is a ``ValueError`` naming it."""
    import yaml

    if not path.is_file():
        return None
    try:
        recorded = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise ValueError(
            f"{path}: cannot read the run's settings to compare ({e}); move the folder away or fix the file"
        ) from None
    if not isinstance(recorded, dict):
        raise ValueError(f"{path}: holds no mapping of settings; move the folder away or fix the file")
    recorded.pop("env", None)
    return recorded


def recorded_identity(output_dir: str | os.PathLike) -> tuple[dict[str, Any] | None, str]:
    """``(identity, where it was read)`` of the run in ``output_dir``: ``run.json``'s ``identity``, a
    setting it lacks read from ``config.yaml`` (explicit values, the rest at their defaults), else
    ``(None, "")`` where neither file records the run. A setting neither records (one added to ncgrpo
    or TRL since) is taken at its default. A record that does not parse is a ``ValueError`` naming the
    file."""
    from ncgrpo.runs.folder import CONFIG_FILE, RUN_FILE, read_run_json

    out = Path(output_dir)
    info = read_run_json(out, hint="move it away or fix it") or {}
    recorded = info.get("identity")
    if not isinstance(recorded, dict):
        recorded = None
    defaults = _identity_defaults()
    config = None
    if recorded is None or any(k not in recorded for k in defaults):
        config = _config_yaml_settings(out / CONFIG_FILE)
    if recorded is None and config is None:
        return None, ""
    where = [str(out / RUN_FILE)] if recorded is not None else []
    if config is not None and (recorded is None or any(k in config for k in defaults if k not in recorded)):
        where.append(str(out / CONFIG_FILE))
    identity = {}
    for k, default in defaults.items():
        if k == DATA_HASH_KEY and (recorded is None or k not in recorded):
            continue  # the data file's hash only where recorded (run.json): config.yaml holds settings
        if recorded is not None and k in recorded:
            identity[k] = _plain(recorded[k])
        elif config is not None and k in config:
            identity[k] = _plain(config[k])
        else:
            identity[k] = default
    return identity, " and ".join(where)
