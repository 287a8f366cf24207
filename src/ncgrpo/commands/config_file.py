"""What :class:`ncgrpo.commands.parser.ConfigParser` reads and gives back: config files with their
``base:`` chain and ``env:`` block (:func:`load_config_file`), the conversion of values to what YAML
writes, :class:`ParsedConfig` (every field's parsed value, the keys set explicitly and the resolved
config), and the old setting spellings still accepted (:data:`RENAMED`, :data:`NEGATED`).
"""

from __future__ import annotations

import difflib
import enum
import os
import sys
import types
import typing
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

__all__ = [
    "NEGATED",
    "RENAMED",
    "RENAMED_REMOVED_IN",
    "ConfigError",
    "ConfigFile",
    "DuplicateKeyError",
    "ParsedConfig",
    "load_config_file",
    "load_yaml",
    "suggest",
]

CONFIG_FLAG = "--config"

#: One name per concept on every command: old spelling -> the name ``ncgrpo train`` uses (or, where a
#: command's setting is another thing of the same kind, the first of these names the command has: the
#: probe writes one file, ``output_file``, not a folder). A parser accepts an old spelling (as a flag or
#: a config key, with a deprecation message on stderr) where it has the new field and no field of the
#: old name, until they are removed in :data:`RENAMED_REMOVED_IN` (CHANGELOG.md).
RENAMED_REMOVED_IN = "0.2.0"
RENAMED: dict[str, tuple[str, ...]] = {
    "sigma": ("sigma0",),
    "site": ("noise_site",),
    "layer_decay": ("noise_layer_decay",),
    "steps": ("max_steps",),
    "out": ("output_dir", "output_file"),
    "model": ("model_name_or_path",),
    "method": ("rollout_method",),
    "threads": ("num_threads",),
    "max_new_tokens": ("max_completion_length",),
}
#: Old boolean spellings that mean the negation of a field (``no_progress: true`` is ``progress: false``;
#: the flag ``--no_progress`` is the field's own negative form and needs no rename).
NEGATED: dict[str, str] = {"no_progress": "progress"}


def _deprecated(old: str, new: str, where: str | None = None) -> None:
    what = f"{where}: key '{old}'" if where else f"--{old}"
    now = f"'{new}'" if where else f"--{new}"
    print(
        f"ncgrpo: warning: {what} is deprecated and will be removed in ncgrpo {RENAMED_REMOVED_IN}; use {now}",
        file=sys.stderr,
    )


class ConfigError(ValueError):
    """A config file, value or flag that does not validate; the message names the file and the key."""


def suggest(word: str, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the nearest of ``known``, or an empty string."""
    match = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


# -------------------------------------------------------------------------------------- files
class DuplicateKeyError(yaml.YAMLError):
    """A mapping that gives one key twice (YAML's loaders keep the last value without a word)."""

    def __init__(self, key: Any, first: int, second: int):
        super().__init__(f"key {key!r} given twice (lines {first} and {second})")
        self.key, self.first, self.second = key, first, second


class UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a mapping (at any depth) giving one key twice: a config with
    ``sigma0: 0.2`` and, further down, ``sigma0: 0.5`` would otherwise run with 0.5 and no message.
    ``<<`` merge keys are left to YAML (an explicit key overriding a merged one is what they are for)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key: YAML's constructor says so
                    continue
                if first is not None:
                    raise DuplicateKeyError(key, first, line)
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (:class:`DuplicateKeyError`)."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


@dataclass
class ConfigFile:
    """A config file with its ``base:`` chain merged: values, the file each key came from, the files,
    and the ``env:`` variables (as strings, base first)."""

    values: dict[str, Any] = field(default_factory=dict)
    origin: dict[str, str] = field(default_factory=dict)
    sources: list[str] = field(default_factory=list)  # the file, then its bases, outermost last
    env: dict[str, str] = field(default_factory=dict)


def _env_strings(path: Path, text: str, env: Any) -> dict[str, str]:
    """The ``env:`` mapping of the file at ``path`` as ``{name: value}`` strings, each value as written
    in the file (the scalar's own text, as a shell would take ``NAME=value``: ``no`` stays "no", not
    YAML's False). ``null``, lists and mappings are errors naming the file and the key."""
    if not isinstance(env, dict):
        raise ConfigError(
            f"{path}: 'env' must be a mapping of environment variables (NAME: value), got {type(env).__name__}"
        )
    node = yaml.compose(text)
    env_node = next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == "env"), None)
    out: dict[str, str] = {}
    for k_node, v_node in env_node.value:
        name = str(k_node.value)
        if not name or "=" in name or "\0" in name:
            raise ConfigError(f"{path}: env: {name!r} is not an environment variable name")
        if not isinstance(v_node, yaml.ScalarNode):
            kind = "mapping" if isinstance(v_node, yaml.MappingNode) else "list"
            raise ConfigError(
                f"{path}: env: '{name}' is a {kind}; an environment variable holds one string (quote it)"
            )
        if v_node.tag == "tag:yaml.org,2002:null" or (v_node.style is None and env.get(name, "") is None):
            raise ConfigError(
                f"{path}: env: '{name}' is null; give it a value (\"\" for an empty string) or remove the key"
            )
        out[name] = str(v_node.value)
    return out


def load_config_file(
    path: str | os.PathLike, known: Iterable[str] | None = None, deprecated: Iterable[str] = ()
) -> ConfigFile:
    """Read ``path`` and its ``base:`` chain (relative to each including file) into one flat mapping.

    ``known``: the valid keys; any other key is an error naming the file that has it (and the nearest
    known key; ``deprecated`` keys are accepted but never suggested). ``env:`` mappings set
    environment variables (base first), as TRL's parser does.
    """
    return _read(Path(path), (), None if known is None else set(known), frozenset(deprecated))


def _read(
    path: Path, chain: tuple[Path, ...], known: set[str] | None, deprecated: frozenset[str] = frozenset()
) -> ConfigFile:
    if path.resolve() in chain:
        cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
        raise ConfigError(f"{path}: 'base' include cycle: {cycle}")
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if chain:
            raise ConfigError(f"{chain[-1]}: base file {path} does not exist") from None
        raise ConfigError(f"{path}: config file does not exist") from None
    except IsADirectoryError:
        if chain:
            raise ConfigError(f"{chain[-1]}: base {path} is a folder; 'base' names a YAML file") from None
        raise ConfigError(f"{path}: is a folder; --config takes a YAML file") from None
    except UnicodeDecodeError as e:
        where = f"{chain[-1]}: base file {path}" if chain else str(path)
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        where = f"{chain[-1]}: base file {path}" if chain else str(path)
        raise ConfigError(f"{where}: cannot read it ({e.strerror or e})") from None
    try:
        data = load_yaml(text)
    except DuplicateKeyError as e:
        where = f"{path} (the base of {chain[-1]})" if chain else str(path)
        raise ConfigError(
            f"{where}: key {str(e.key)!r} is given twice (lines {e.first} and {e.second}); YAML would keep "
            "only the last value without a word, so keep one of them"
        ) from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{path}: a config file must be a YAML mapping (key: value), got {type(data).__name__}"
        )
    base = data.pop("base", None)
    has_env = "env" in data
    env = _env_strings(path, text, data.pop("env")) if has_env and data["env"] is not None else {}
    if known is not None:
        for key in data:
            if key not in known and key not in deprecated:
                raise ConfigError(f"{path}: unknown key '{key}'{suggest(str(key), known)}")
    if base is None:
        out = ConfigFile(sources=[str(path)])
    else:
        if not isinstance(base, str):
            raise ConfigError(f"{path}: 'base' must be a file path (relative to this file), got {base!r}")
        base_path = Path(os.path.expanduser(base))
        if not base_path.is_absolute():
            base_path = path.parent / base_path
        out = _read(base_path, (*chain, path.resolve()), known, deprecated)
        out.sources.insert(0, str(path))
    for key, value in env.items():
        os.environ[key] = value
    out.env.update(env)
    out.values.update(data)
    out.origin.update({k: str(path) for k in data})
    return out


# --------------------------------------------------------------------------------- conversion
def _allows(hint: Any, kind: type) -> bool:
    """Whether the annotation ``hint`` admits values of ``kind`` (list/dict/bool/NoneType)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_allows(a, kind) for a in typing.get_args(hint))
    if hint is kind or origin is kind:
        return True
    return kind is list and origin in (Sequence, tuple)


def _plain(value: Any) -> Any:
    """A value as YAML can write it (paths and enums as strings)."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


def _without_config(argv: Sequence[str]) -> list[str]:
    out, skip = [], False
    for tok in argv:
        if skip:
            skip = False
        elif tok == CONFIG_FLAG:
            skip = True
        elif not tok.startswith(CONFIG_FLAG + "="):
            out.append(tok)
    return out


@dataclass
class ParsedConfig:
    """Every dataclass field's parsed value, before the dataclasses are built."""

    types: list[type]
    values: dict[type, dict[str, Any]]
    explicit: list[str]  # keys set in the config file(s) or on the command line, in that order
    config: str | None = None  # the --config file
    sources: list[str] = field(default_factory=list)  # it and its bases
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # the files' env: variables, set while parsing

    def owner(self, key: str) -> type:
        for t in self.types:
            if key in self.values[t]:
                return t
        raise KeyError(f"no field '{key}' in {', '.join(t.__name__ for t in self.types)}")

    def get(self, key: str) -> Any:
        return self.values[self.owner(key)][key]

    def set(self, key: str, value: Any) -> None:
        """Set a field's value and record it as explicit (it is written by :meth:`to_yaml`)."""
        self.values[self.owner(key)][key] = value
        if key not in self.explicit:
            self.explicit.append(key)

    def build(self, cls: type) -> Any:
        """The dataclass instance (its ``__post_init__`` validates)."""
        return cls(**self.values[cls])

    def to_dict(self) -> dict[str, Any]:
        """The explicit keys with their values, in dataclass field order."""
        keys = set(self.explicit)
        return {k: _plain(v) for t in self.types for k, v in self.values[t].items() if k in keys}

    def to_yaml(self) -> str:
        """The resolved config: a flat YAML mapping that loads back with ``--config``."""
        header = ["# resolved config; rerun with --config THIS_FILE"]
        if self.config:
            header.append(f"# from {self.config}")
            header += [f"#   base: {s}" for s in self.sources[1:]]
        flags = _without_config(self.argv)
        if flags:
            header.append("# command line: " + " ".join(flags))
        keys = set(self.explicit)
        blocks = []
        for t in self.types:
            block = {k: _plain(v) for k, v in self.values[t].items() if k in keys}
            if block:
                body = yaml.safe_dump(block, sort_keys=False, allow_unicode=True, default_flow_style=False)
                blocks.append(f"# {t.__name__}\n{body}")
        if self.env:
            body = yaml.safe_dump({"env": dict(self.env)}, sort_keys=False, allow_unicode=True)
            blocks.append(f"# environment variables set before the run\n{body}")
        return "\n".join(header) + "\n" + "".join(blocks)
