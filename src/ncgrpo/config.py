"""Training recipes: YAML files that resolve to ``NCGRPOConfig`` keyword arguments plus model/data settings.

A recipe is flat and TRL-like::

    base: _geo3k_qwen2_5_vl_7b.yaml     # optional: a recipe this one extends (path relative to this file)
    name: ncgrpo-sigma0.2               # run name (run.json); defaults to the file's stem
    model:
      name_or_path: Qwen/Qwen2.5-VL-7B-Instruct
      torch_dtype: bfloat16
      freeze_vision_tower: true
      attn_implementation: sdpa
    data:
      train: {name: geo3k, path: data/geometry3k, split: train}
      eval: [{name: geo3k, path: data/geometry3k, split: validation, limit: 64}]
    rewards: [math_reward]              # functions of ncgrpo.rewards
    trainer:                            # NCGRPOConfig fields (TRL's GRPOConfig + config_names.md)
      rollout_method: latent
      sigma0: 0.2
      learning_rate: 1.0e-6

``base:`` chains are merged depth-first: mappings merge key by key, anything else (lists included)
is replaced by the extending file. ``key=value`` overrides from the command line use dotted keys
(``trainer.sigma0=0.5``, ``model.freeze_vision_tower=false``, ``data.train.path=/data/geo3k``) and
YAML-typed values. Files and overrides read YAML 1.2 scalars: ``1e-6`` is a float and only
true/false are booleans (``no``/``off`` stay strings), unlike PyYAML's YAML 1.1 defaults.

Every key is checked: an unknown one is an error naming the file (or the override) and the key,
with the nearest known key as a suggestion. Trainer keys are checked against
``dataclasses.fields(NCGRPOConfig)`` (``ncgrpo.trainer``); where that class cannot be imported, against
``trl.GRPOConfig``'s fields plus :data:`NCGRPO_FIELDS`.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "DATA_NAMES",
    "NCGRPO_FIELDS",
    "REWARD_NAMES",
    "DataSource",
    "ModelSettings",
    "Recipe",
    "RecipeError",
    "apply_overrides",
    "load_recipe",
    "parse_override",
    "parse_value",
    "trainer_field_types",
]

#: The ncgrpo fields NCGRPOConfig adds to trl.GRPOConfig, with their defaults (.notes/config_names.md).
#: Used to validate recipes only where ``ncgrpo.trainer.NCGRPOConfig`` cannot be imported.
NCGRPO_FIELDS: dict[str, Any] = {
    "rollout_method": "latent",
    "sigma0": 0.2,
    "sigma_schedule": "sigmoid",
    "schedule_gamma": 30.0,
    "schedule_k_mid": 40.0,
    "noise_site": "final_norm",
    "noise_layer_decay": 0.5,
    "noise_positions": "auto",
    "noise_seed": None,
    "antithetic_grouping": "joint",
    "spsa_lr": 0.1,
    "spsa_mu_max": 1.0,
    "first_token_temperature": 2.0,
    "image_noise_step": 500,
    "noisy_importance_sampling": "exclude",
    "branch_prefix": "",
}

#: ``data.*.name`` values: the real Geometry3K and the synthetic suite exported in its schema.
DATA_NAMES = ("geo3k", "synthetic")
#: ``rewards`` entries: reward functions of :mod:`ncgrpo.rewards`.
REWARD_NAMES = ("math_reward", "accuracy_reward", "format_reward")

_TOP_KEYS = ("base", "name", "model", "data", "rewards", "trainer")


class RecipeError(ValueError):
    """A recipe or override that does not validate; the message names the file and the key."""


# ----------------------------------------------------------------------------------- YAML typing
class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 scalars: ``1e-6`` is a float (PyYAML needs a dot), and only
    true/false are booleans (PyYAML 1.1 also reads yes/no/on/off, so ``save_strategy: no`` would be
    False)."""


_BOOL = "tag:yaml.org,2002:bool"
_Loader.yaml_implicit_resolvers = {
    k: [(tag, rx) for tag, rx in v if tag != _BOOL]
    for k, v in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def _yaml_load(text: str, where: str) -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        raise RecipeError(f"{where}: invalid YAML: {e}") from e


def parse_value(text: str) -> Any:
    """A command-line value as YAML: ``3`` int, ``1e-6`` float, ``true`` bool, ``[1, 2]`` list, ``null``.

    Anything that does not parse as YAML stays a string.
    """
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506
    except yaml.YAMLError:
        return text


def parse_override(item: str) -> tuple[list[str], Any]:
    """``"trainer.sigma0=0.5"`` -> ``(["trainer", "sigma0"], 0.5)``."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise RecipeError(f"override {item!r}: expected KEY=VALUE (e.g. trainer.sigma0=0.5)")
    parts = key.split(".")
    if any(not p for p in parts):
        raise RecipeError(f"override {item!r}: empty component in key {key!r}")
    return parts, parse_value(value)


# ------------------------------------------------------------------------------- trainer fields
#: Types of the NCGRPO_FIELDS for the fallback path (NCGRPOConfig's own annotations win once it exists).
_NCGRPO_TYPES: dict[str, Any] = {
    k: (type(v) if v is not None else int | None) for k, v in NCGRPO_FIELDS.items()
}


@cache
def _config_class() -> type | None:
    """``ncgrpo.trainer.NCGRPOConfig``, or None while that module/class does not exist."""
    try:
        from ncgrpo.trainer import NCGRPOConfig
    except ImportError as e:
        # Only a missing ncgrpo.trainer, or a missing NCGRPOConfig in it, falls back; an import error
        # raised from inside the trainer module is a bug and propagates.
        if e.name != "ncgrpo.trainer":
            raise
        return None
    return NCGRPOConfig


@cache
def _trainer_fields() -> tuple[dict[str, Any], str]:
    """(trainer key -> annotated type, where the names came from)."""
    cls = _config_class()
    origin = "NCGRPOConfig"
    if cls is None:
        from trl import GRPOConfig as cls  # noqa: N813

        origin = "trl.GRPOConfig + NCGRPO_FIELDS"
    try:
        hints = typing.get_type_hints(cls)
    except Exception:
        hints = {}
    fields = {f.name: hints.get(f.name, f.type) for f in dataclasses.fields(cls) if f.init}
    if origin != "NCGRPOConfig":
        for name, tp in _NCGRPO_TYPES.items():
            fields.setdefault(name, tp)
    return fields, origin


def trainer_field_types() -> dict[str, Any]:
    """Trainer key -> annotated type (a string where the annotation could not be resolved)."""
    return dict(_trainer_fields()[0])


def _type_ok(value: Any, tp: Any) -> bool | None:
    """True/False where ``tp`` is a simple type we can check, None where we cannot tell."""
    if tp is Any or isinstance(tp, str):
        return None
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        results = [_type_ok(value, a) for a in typing.get_args(tp)]
        if any(r is True for r in results):
            return True
        return None if any(r is None for r in results) else False
    if tp is type(None):
        return value is None
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        # TRL also takes legacy scalars for some str fields (scale_rewards: true); reject only containers
        return not isinstance(value, (list, dict))
    if origin in (list, Sequence) or tp is list:
        return isinstance(value, list)
    if origin in (dict, Mapping) or tp is dict:
        return isinstance(value, dict)
    return None


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


# ------------------------------------------------------------------------------------ settings
@dataclass
class ModelSettings:
    """``model:`` section."""

    name_or_path: str
    torch_dtype: str = "bfloat16"  # "bfloat16" | "float16" | "float32" | "auto"
    freeze_vision_tower: bool = True
    attn_implementation: str | None = (
        None  # "sdpa", "flash_attention_2", "eager"; None = transformers' default
    )
    #: Image processor pixel budget (NoisyRollout: min 262144, max 1e6); None keeps the processor's own.
    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass
class DataSource:
    """One dataset: ``data.train`` or an entry of ``data.eval``."""

    name: str = "geo3k"  # "geo3k" | "synthetic"
    path: str | None = None  # folder in the hub layout or one parquet file; geo3k: None = hub cache
    split: str = "train"
    limit: int | None = None


@dataclass
class DataSettings:
    """``data:`` section."""

    train: DataSource
    eval: list[DataSource] = field(default_factory=list)
    system_prompt: str | None = None
    math_prompt: str | None = None  # None: ncgrpo.data.types.MATH_PROMPT


_MODEL_KEYS = tuple(f.name for f in dataclasses.fields(ModelSettings))
_SOURCE_KEYS = tuple(f.name for f in dataclasses.fields(DataSource))
_DATA_KEYS = tuple(f.name for f in dataclasses.fields(DataSettings))
_DTYPES = ("bfloat16", "float16", "float32", "auto")


@dataclass
class Recipe:
    """A resolved recipe: what ``ncgrpo train`` builds its run from."""

    name: str
    model: ModelSettings
    data: DataSettings
    rewards: list[str]
    trainer: dict[str, Any]
    source: str = ""  # the recipe file
    bases: list[str] = field(default_factory=list)  # base files merged into it, outermost last
    overrides: list[str] = field(default_factory=list)

    @property
    def method(self) -> str:
        return str(self.trainer.get("rollout_method", NCGRPO_FIELDS["rollout_method"]))

    @property
    def seed(self) -> int:
        return int(self.trainer.get("seed", 42))

    def trainer_kwargs(self, **extra: Any) -> dict[str, Any]:
        """``NCGRPOConfig(**recipe.trainer_kwargs(output_dir=...))``."""
        return {**copy.deepcopy(self.trainer), **extra}

    def to_dict(self) -> dict[str, Any]:
        """The resolved recipe as a plain mapping (loads back with :func:`load_recipe`)."""
        return {
            "name": self.name,
            "model": dataclasses.asdict(self.model),
            "data": dataclasses.asdict(self.data),
            "rewards": list(self.rewards),
            "trainer": copy.deepcopy(self.trainer),
        }

    def to_yaml(self) -> str:
        """Resolved config dump: a header naming where it came from, then the mapping."""
        header = [f"# resolved from {self.source}" if self.source else "# resolved recipe"]
        header += [f"#   base: {b}" for b in self.bases]
        header += [f"#   override: {o}" for o in self.overrides]
        return "\n".join(header) + "\n" + yaml.safe_dump(self.to_dict(), sort_keys=False, allow_unicode=True)


# ------------------------------------------------------------------------------------- loading
def _suggest(key: str, known: Sequence[str]) -> str:
    match = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _unknown(where: str, key: str, known: Sequence[str], section: str | None) -> RecipeError:
    inside = f" in section '{section}'" if section else ""
    return RecipeError(f"{where}: unknown key '{key}'{inside}{_suggest(key, known)}")


def _deep_merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = _deep_merge(dict(out[k]), v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _read_mapping(path: Path, chain: tuple[Path, ...] = ()) -> tuple[dict[str, Any], list[str]]:
    """The file's mapping with its ``base:`` chain merged in; also the base files, nearest first."""
    where = str(path)
    if path in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path))
        raise RecipeError(f"{where}: 'base' include cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if chain:
            raise RecipeError(f"{chain[-1]}: base recipe {where} does not exist") from None
        raise RecipeError(f"{where}: recipe file does not exist") from None
    raw = _yaml_load(text, where)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{where}: a recipe must be a mapping at the top level, got {type(raw).__name__}")
    base = raw.pop("base", None)
    _validate_sections(raw, where)  # each file's own keys, so an error names the file that has them
    if base is None:
        return raw, []
    if not isinstance(base, str):
        raise RecipeError(f"{where}: 'base' must be a path (relative to this file), got {base!r}")
    base_path = (path.parent / base).resolve() if not Path(base).is_absolute() else Path(base)
    merged_base, bases = _read_mapping(base_path, (*chain, path))
    return _deep_merge(merged_base, raw), [str(base_path), *bases]


def _validate_sections(raw: Mapping[str, Any], where: str) -> None:
    """Key-level checks (no required-field checks: a base file may be partial)."""
    for key in raw:
        if key not in _TOP_KEYS or key == "base":
            raise _unknown(where, str(key), [k for k in _TOP_KEYS if k != "base"], None)
    model = raw.get("model")
    if model is not None:
        if not isinstance(model, Mapping):
            raise RecipeError(f"{where}: 'model' must be a mapping")
        for k in model:
            if k not in _MODEL_KEYS:
                raise _unknown(where, str(k), _MODEL_KEYS, "model")
    data = raw.get("data")
    if data is not None:
        if not isinstance(data, Mapping):
            raise RecipeError(f"{where}: 'data' must be a mapping")
        for k in data:
            if k not in _DATA_KEYS:
                raise _unknown(where, str(k), _DATA_KEYS, "data")
        sources = []
        if data.get("train") is not None:
            sources.append(("data.train", data["train"]))
        ev = data.get("eval")
        if ev is not None:
            if not isinstance(ev, list):
                raise RecipeError(f"{where}: 'data.eval' must be a list of datasets")
            sources += [(f"data.eval[{i}]", s) for i, s in enumerate(ev)]
        for label, src in sources:
            if not isinstance(src, Mapping):
                raise RecipeError(f"{where}: '{label}' must be a mapping with keys {list(_SOURCE_KEYS)}")
            for k in src:
                if k not in _SOURCE_KEYS:
                    raise _unknown(where, str(k), _SOURCE_KEYS, label)
    trainer = raw.get("trainer")
    if trainer is not None:
        if not isinstance(trainer, Mapping):
            raise RecipeError(f"{where}: 'trainer' must be a mapping of NCGRPOConfig fields")
        fields, _ = _trainer_fields()
        for k in trainer:
            if k not in fields:
                raise _unknown(where, str(k), list(fields), "trainer")
    rewards = raw.get("rewards")
    if rewards is not None:
        if not isinstance(rewards, list) or not rewards:
            raise RecipeError(f"{where}: 'rewards' must be a non-empty list, e.g. [math_reward]")
        for r in rewards:
            if r not in REWARD_NAMES:
                raise RecipeError(
                    f"{where}: unknown reward '{r}' in 'rewards'{_suggest(str(r), REWARD_NAMES)}; "
                    f"known: {', '.join(REWARD_NAMES)}"
                )


def apply_overrides(raw: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply ``key=value`` overrides to a recipe mapping (a new mapping; dotted keys create sections)."""
    out = copy.deepcopy(raw)
    for item in overrides:
        parts, value = parse_override(item)
        where = f"override '{item}'"
        if parts[0] not in _TOP_KEYS or parts[0] == "base":
            raise _unknown(where, parts[0], [k for k in _TOP_KEYS if k != "base"], None)
        node: Any = out
        for i, p in enumerate(parts[:-1]):
            nxt = node.get(p) if isinstance(node, dict) else None
            if nxt is None:
                nxt = {}
                node[p] = nxt
            elif not isinstance(nxt, dict):
                raise RecipeError(f"{where}: '{'.'.join(parts[: i + 1])}' is not a section")
            node = nxt
        node[parts[-1]] = value
        _validate_sections(out, where)
    return out


def _source(raw: Any, where: str, label: str) -> DataSource:
    src = DataSource(**raw)
    if src.name not in DATA_NAMES:
        raise RecipeError(f"{where}: '{label}.name' must be one of {list(DATA_NAMES)}, got {src.name!r}")
    if src.name == "synthetic" and src.split not in ("train", "validation", "test"):
        raise RecipeError(f"{where}: '{label}.split' of the synthetic suite must be train/validation/test")
    if src.limit is not None and (not isinstance(src.limit, int) or src.limit < 1):
        raise RecipeError(f"{where}: '{label}.limit' must be a positive integer or null, got {src.limit!r}")
    if src.path is not None:
        src.path = os.path.expandvars(os.path.expanduser(str(src.path)))
    return src


def _check_types(trainer: dict[str, Any], where: str) -> None:
    """Reject values of the wrong simple type; turn numbers given for ``str`` fields into strings
    (``trainer.noise_site=14`` means the site ``"14"``)."""
    tps = trainer_field_types()
    for k, v in trainer.items():
        tp = tps.get(k, Any)
        if tp is str and isinstance(v, (int, float)) and not isinstance(v, bool):
            trainer[k] = str(v)
        elif _type_ok(v, tp) is False:
            raise RecipeError(
                f"{where}: 'trainer.{k}' should be {_type_name(tp)}, got {v!r} ({type(v).__name__})"
            )


def _build(raw: Mapping[str, Any], where: str, default_name: str) -> Recipe:
    _validate_sections(raw, where)
    model_raw = raw.get("model")
    if not isinstance(model_raw, Mapping) or not model_raw.get("name_or_path"):
        raise RecipeError(f"{where}: 'model.name_or_path' is required")
    model = ModelSettings(**model_raw)
    model.name_or_path = os.path.expandvars(os.path.expanduser(str(model.name_or_path)))
    if model.torch_dtype not in _DTYPES:
        raise RecipeError(
            f"{where}: 'model.torch_dtype' must be one of {list(_DTYPES)}, got {model.torch_dtype!r}"
        )
    if not isinstance(model.freeze_vision_tower, bool):
        raise RecipeError(f"{where}: 'model.freeze_vision_tower' must be true or false")
    data_raw = raw.get("data")
    if not isinstance(data_raw, Mapping) or data_raw.get("train") is None:
        raise RecipeError(
            f"{where}: 'data.train' is required (e.g. {{name: geo3k, path: ..., split: train}})"
        )
    data = DataSettings(
        train=_source(data_raw["train"], where, "data.train"),
        eval=[_source(s, where, f"data.eval[{i}]") for i, s in enumerate(data_raw.get("eval") or [])],
        system_prompt=data_raw.get("system_prompt"),
        math_prompt=data_raw.get("math_prompt"),
    )
    rewards = list(raw.get("rewards") or ["math_reward"])
    trainer = dict(raw.get("trainer") or {})
    _check_types(trainer, where)
    name = raw.get("name") or default_name
    if not isinstance(name, str):
        raise RecipeError(f"{where}: 'name' must be a string")
    return Recipe(name=name, model=model, data=data, rewards=rewards, trainer=trainer)


def load_recipe(path: str | os.PathLike, overrides: Sequence[str] = ()) -> Recipe:
    """Load, merge (``base:``), override and validate a recipe. Raises :class:`RecipeError`."""
    path = Path(path)
    raw, bases = _read_mapping(path)
    where = str(path)
    if overrides:
        raw = apply_overrides(raw, overrides)
        where = f"{path} (with overrides {' '.join(overrides)})"
    recipe = _build(raw, where, default_name=path.stem)
    recipe.source = str(path)
    recipe.bases = bases
    recipe.overrides = list(overrides)
    return recipe
