"""The CLI's configuration the TRL way: ``--config FILE.yaml`` plus one ``--flag`` per dataclass field.

:class:`ConfigParser` is ``trl.TrlParser`` (itself ``transformers.HfArgumentParser``) with four additions:

* ``base:`` includes. A config file may name one other file it extends (``base: base/x.yaml``, relative
  to the including file); the chain is merged base-first, a key of the extending file replacing the
  base's value (lists and mappings included). TRL's own parser has no includes; the paper's recipes
  share one protocol block and differ only in the perturbation, which ``base:`` states directly.
* Errors that say where: an unknown key names the file that has it and the nearest known key; a value
  that does not convert names the file and key; an include cycle or a missing base names the files.
  An unknown ``--flag`` suggests the nearest one.
* One conversion rule for files and command lines: a scalar from a file goes through the same argparse
  type as the flag (``max_steps: 1.5`` is rejected like ``--max_steps 1.5``; ``noise_site: 14`` is the
  string ``"14"``). YAML's boolean spellings (``no``, ``off``) are refused for non-boolean fields with a
  hint to quote them.
* Lazy dataclasses: ``dataclass_types`` may be a zero-argument callable, called the first time the
  parser parses or prints help, so a command line with many commands imports heavy classes
  (``NCGRPOConfig``) only for the command that runs.

Command-line flags override the file. Besides the dataclass instances
(:meth:`ConfigParser.parse_args_and_config`, as in TRL), parsing leaves a :class:`ParsedConfig` on the
namespace (``namespace.parsed_config``) holding every field's value, which keys were set explicitly
(in a file or as a flag), and :meth:`ParsedConfig.to_yaml`, the resolved config that loads back with
``--config``. TRL's ``env:`` mapping (environment variables set before the run) is supported too:
each value is set as written in the file, the way a shell would read ``NAME=value`` (``1.0``, ``no``,
``true`` and ``0x10`` stay those strings; YAML's typing of them is ignored); ``null``, a list or a
mapping is an error naming the file and key. The resolved config keeps the ``env:`` block (every
file's, base first), so rerunning from it sets the same environment.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import sys
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from trl import TrlParser

from ncgrpo.commands.config_file import (
    CONFIG_FLAG,
    NEGATED,
    RENAMED,
    ConfigError,
    ConfigFile,
    ParsedConfig,
    _allows,
    _deprecated,
    load_config_file,
    suggest,
)

__all__ = ["ConfigParser", "is_path_field", "known_keys"]


# ------------------------------------------------------------------------------------- parser
#: Setting names that hold paths (files or folders; a list of them for ``compare --runs``), by ending.
_PATH_ENDINGS = ("_dir", "_dirs", "_file", "_files", "_path", "_paths")


def is_path_field(name: str) -> bool:
    """Whether the setting ``name`` holds a path (``output_dir``, ``output_file``, ``dataset_path``,
    ``model_name_or_path``, ``compare --runs``): an empty value is refused where it is parsed."""
    return name.endswith(_PATH_ENDINGS) or name in ("model_name_or_path", "runs")


def _refuse_dangling_link(value: Any, where: str) -> None:
    """A path (or a list of them) through a symbolic link whose target does not exist is an error
    naming the link and its target: creating a folder there fails with a bare "File exists", and
    reading one says "no such file" about a path that is listed."""

    for v in value if isinstance(value, list | tuple) else [value]:
        if not isinstance(v, str | os.PathLike):
            continue
        p = Path(os.path.expanduser(os.fspath(v)))
        for q in (p, *p.parents):
            if q.is_symlink() and not q.exists():
                target = os.readlink(q)
                full = os.path.normpath(os.path.join(os.path.abspath(q.parent), target))
                shown = target if os.path.isabs(target) else f"{target} ({full})"
                raise ConfigError(
                    f"{where} {v}: {q} is a link to {shown}, which does not exist; remove the link, or create "
                    f"{full} (or point the link at a path that exists)"
                )


class ConfigParser(TrlParser):
    """``trl.TrlParser`` with ``base:`` includes, errors that name the file and key, and lazy dataclasses.

    Without dataclass types it is a plain ``argparse.ArgumentParser`` (so a command line can use it as
    the class of every subcommand parser). With them it adds ``--config FILE`` and, as an argparse
    parser, raises :class:`ConfigError` instead of printing its (long) usage and exiting.
    """

    def __init__(
        self,
        dataclass_types: Iterable[type] | Callable[[], Iterable[type]] | type | None = None,
        **kwargs: Any,
    ):
        pending = None
        if callable(dataclass_types) and not isinstance(dataclass_types, type):
            pending, dataclass_types = dataclass_types, None
        self.configurable = dataclass_types is not None or pending is not None
        # never a flag matched by a prefix of its name: --learning would silently mean --learning_rate
        kwargs.setdefault("allow_abbrev", False)
        if self.configurable:
            kwargs.setdefault("formatter_class", argparse.ArgumentDefaultsHelpFormatter)
        else:
            kwargs.setdefault("formatter_class", argparse.HelpFormatter)
        super().__init__(None, **kwargs)
        self._pending = pending
        if self.configurable:
            self.add_argument(
                CONFIG_FLAG,
                metavar="YAML",
                help="config file: one key per field below (flags given here override it); "
                "'base: FILE' extends another file",
            )
            if dataclass_types is not None:
                self._add_types(dataclass_types)

    # -- dataclasses ----------------------------------------------------------------------------
    def _add_types(self, dataclass_types: Iterable[type] | type) -> None:
        if dataclasses.is_dataclass(dataclass_types):
            dataclass_types = [dataclass_types]
        for t in dataclass_types:
            if "config" in t.__dataclass_fields__:
                raise ValueError(f"{t.__name__} has a field named 'config', which --config reserves")
            self.dataclass_types.append(t)
            self._add_dataclass_arguments(t)

    def _add_dataclass_arguments(self, dtype: type) -> None:
        """HfArgumentParser's, with a dataclass's ``help_groups`` (header -> field names) honoured: those
        fields go under their headers, listed first in ``--help``; the dataclass's other fields under its
        ``help_rest_title``, listed last. A dataclass without ``help_groups`` is added as HF adds it."""
        groups: Mapping[str, Sequence[str]] | None = getattr(dtype, "help_groups", None)
        if not groups:
            super()._add_dataclass_arguments(dtype)
            return
        hints = typing.get_type_hints(dtype)
        names = {f.name for f in dataclasses.fields(dtype) if f.init}
        where: dict[str, Any] = {}
        firsts = []
        for title, members in groups.items():
            unknown = [m for m in members if m not in names]
            if unknown:
                raise ValueError(
                    f"{dtype.__name__}.help_groups['{title}'] names no field {', '.join(unknown)}"
                )
            group = self.add_argument_group(title)
            firsts.append(group)
            where.update(dict.fromkeys(members, group))
        rest = self.add_argument_group(getattr(dtype, "help_rest_title", f"{dtype.__name__} settings"))
        # argparse prints groups in creation order: the topic groups go before "options" (the command's
        # own flags and the other dataclasses), the inherited rest after everything added so far
        for group in firsts:
            self._action_groups.remove(group)
        self._action_groups[0:0] = firsts
        for f in dataclasses.fields(dtype):
            if f.init:
                f.type = hints[f.name]
                self._parse_dataclass_field(where.get(f.name, rest), f)

    def _materialize(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._add_types(pending())

    def format_help(self) -> str:
        self._materialize()
        with self._short_usage():
            return super().format_help()

    def format_usage(self) -> str:
        self._materialize()
        with self._short_usage():
            return super().format_usage()

    @contextlib.contextmanager
    def _short_usage(self):
        """The usage line names the command's own flags and ``[--SETTING VALUE]`` for the dataclass
        fields (each listed under its header below), not every field (hundreds of lines for train)."""
        if self.usage is not None or not self.dataclass_types:
            yield
            return
        fields = set(self._fields())
        own = [a for a in self._actions if a.dest not in fields]
        setting = argparse.Action(["--SETTING"], dest="SETTING", metavar="VALUE", required=False)
        formatter = self._get_formatter()
        formatter.add_usage(None, [*own, setting], [], prefix="")
        self.usage = formatter.format_help().strip().replace("%", "%%").replace(self.prog, "%(prog)s", 1)
        try:
            yield
        finally:
            self.usage = None

    def error(self, message: str):
        if self.configurable:
            raise ConfigError(message)
        super().error(message)

    # -- fields ---------------------------------------------------------------------------------
    def _fields(self) -> dict[str, tuple[argparse.Action, Any]]:
        """field name -> (its first argparse action, its annotation)."""
        by_dest: dict[str, argparse.Action] = {}
        for action in self._actions:
            by_dest.setdefault(action.dest, action)
        out = {}
        for t in self.dataclass_types:
            hints = typing.get_type_hints(t)
            for f in dataclasses.fields(t):
                if f.init:
                    out[f.name] = (by_dest[f.name], hints[f.name])
        return out

    def _convert(self, key: str, value: Any, where: str, action: argparse.Action, hint: Any) -> Any:
        if value is None:
            if not _allows(hint, type(None)) and action.default is not None:
                raise ConfigError(f"{where}: '{key}' cannot be null")
            return None
        if action.nargs in ("+", "*"):
            items = value if isinstance(value, list) else [value]
            return [self._scalar(key, v, where, action, hint) for v in items]
        if isinstance(value, (list, dict)):
            if _allows(hint, type(value)):
                return value  # e.g. activation_checkpointing_kwargs: {use_reentrant: false}
            raise ConfigError(f"{where}: '{key}' takes one value, got the {type(value).__name__} {value!r}")
        return self._scalar(key, value, where, action, hint)

    def _scalar(self, key: str, value: Any, where: str, action: argparse.Action, hint: Any) -> Any:
        if isinstance(value, (list, dict)):
            raise ConfigError(f"{where}: '{key}' takes a list of single values, got {value!r}")
        if isinstance(value, bool) and not _allows(hint, bool):
            raise ConfigError(
                f"{where}: '{key}' is not a true/false field, but YAML read its value as the boolean "
                f"{str(value).lower()} (yes/no/on/off are booleans in YAML); quote it, e.g. '{key}: \"no\"'"
            )
        convert = action.type or str
        try:
            out = convert(str(value))
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            name = getattr(convert, "__name__", "value")
            raise ConfigError(f"{where}: '{key}': invalid {name} value {value!r}") from None
        if action.choices is not None and out not in action.choices:
            choices = ", ".join(map(str, action.choices))
            raise ConfigError(f"{where}: '{key}' must be one of {choices}; got {value!r}")
        return out

    # -- parsing --------------------------------------------------------------------------------
    def parse_known_args(self, args: Sequence[str] | None = None, namespace=None):
        self._materialize()
        if not self.configurable:
            return super().parse_known_args(args, namespace)
        argv = list(sys.argv[1:] if args is None else args)
        config = None
        for i, tok in enumerate(argv):
            if tok == CONFIG_FLAG:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError(f"{CONFIG_FLAG} needs a file")
                config = argv[i + 1]
            elif tok.startswith(CONFIG_FLAG + "="):
                config = tok.split("=", 1)[1]
        if config is not None and not config.strip():
            raise ConfigError(
                f"{CONFIG_FLAG} is empty ({config!r}; an unset shell variable?): give a YAML file, or leave "
                f"{CONFIG_FLAG} out"
            )
        fields = self._fields()
        renamed = {
            old: next(n for n in news if n in fields)
            for old, news in RENAMED.items()
            if old not in fields and any(n in fields for n in news)
        }
        negated = {old: new for old, new in NEGATED.items() if new in fields and old not in fields}
        argv = self._rename_flags(argv, renamed)
        self._refuse_unknown_flags(argv)
        self._refuse_repeated_lists(argv)
        loaded = ConfigFile()
        if config:
            loaded = load_config_file(config, fields, deprecated=[*renamed, *negated])
        self._rename_keys(loaded, renamed, negated)
        for key, value in loaded.values.items():
            self._refuse_empty_path(key, value, loaded.origin[key])
        self._refuse_empty_path_flags(argv)
        saved = []
        try:
            for key, value in loaded.values.items():
                action, hint = fields[key]
                converted = self._convert(key, value, loaded.origin[key], action, hint)
                saved.append((action, action.default, action.required))
                action.default, action.required = converted, False
            ns, extras = super().parse_known_args(argv, namespace)
        finally:
            for action, default, required in reversed(saved):
                action.default, action.required = default, required
        if extras:
            flag = next((e for e in extras if e.startswith("-")), None)
            if flag is not None:
                name = flag.split("=", 1)[0]
                raise ConfigError(f"unknown option {name}{suggest(name, self._option_string_actions)}")
            raise ConfigError(
                f"unexpected argument {extras[0]!r}: every setting is a flag, e.g. --sigma0 0.5, "
                "or a key in the --config file"
            )
        given = [
            self._option_string_actions[tok.split("=", 1)[0]].dest
            for tok in argv
            if tok.startswith("--") and tok.split("=", 1)[0] in self._option_string_actions
        ]
        explicit = list(dict.fromkeys([*loaded.values, *(k for k in given if k in fields)]))
        for key in explicit:
            if is_path_field(key):
                where = f"--{key}" if key in given else f"{loaded.origin.get(key)}: '{key}'"
                _refuse_dangling_link(getattr(ns, key), where)
        values = {}
        for t in self.dataclass_types:
            values[t] = {}
            for f in dataclasses.fields(t):
                if f.init:
                    values[t][f.name] = getattr(ns, f.name)
                    delattr(ns, f.name)
        ns.parsed_config = ParsedConfig(
            types=list(self.dataclass_types),
            values=values,
            explicit=explicit,
            config=config,
            sources=loaded.sources,
            argv=argv,
            env=dict(loaded.env),
        )
        return ns, []

    @staticmethod
    def _refuse_empty_path(key: str, value: Any, where: str | None) -> None:
        """A path setting given as ``''`` (or blanks): an unset shell variable (``--output_dir $OUT``)
        would otherwise mean the current folder (``Path('') == Path('.')``) or the default, without a
        word. ``where``: the config file that set it, or None for the command line."""
        if not is_path_field(key):
            return
        values = value if isinstance(value, list | tuple) else [value]
        if not any(isinstance(v, str) and not v.strip() for v in values):
            return
        what = "holds an empty path" if isinstance(value, list | tuple) else "is empty"
        if where is None:
            raise ConfigError(
                f"--{key} {what} ({value!r}; an unset shell variable?): give a path (leave --{key} out for "
                "its default)"
            )
        raise ConfigError(
            f"{where}: '{key}' {what} ({value!r}): give a path (remove the key for its default)"
        )

    def _refuse_empty_path_flags(self, argv: Sequence[str]) -> None:
        """:meth:`_refuse_empty_path` for the command line, on the strings as typed (a ``Path`` field's
        argparse type would already have made ``''`` into ``Path('.')``)."""
        for i, tok in enumerate(argv):
            if not tok.startswith("--"):
                continue
            flag, eq, value = tok.partition("=")
            action = self._option_string_actions.get(flag)
            if action is None or not is_path_field(action.dest):
                continue
            if eq:
                values = [value]
            elif action.nargs in ("+", "*"):
                values = list(itertools.takewhile(lambda t: not t.startswith("-"), argv[i + 1 :]))
            else:
                values = argv[i + 1 : i + 2]
            if action.nargs not in ("+", "*"):
                values = values[0] if values else None
            self._refuse_empty_path(action.dest, values, None)

    @staticmethod
    def _rename_flags(argv: Sequence[str], renamed: Mapping[str, str]) -> list[str]:
        """``--old`` / ``--old=v`` (underscores or dashes) -> ``--new``, with a deprecation message."""
        spelled = {f"--{o}": n for o, n in renamed.items()}
        spelled.update({f"--{o.replace('_', '-')}": n for o, n in renamed.items()})
        out = []
        for tok in argv:
            flag, eq, value = tok.partition("=")
            new = spelled.get(flag)
            if new is None:
                out.append(tok)
                continue
            _deprecated(flag[2:], new)
            out.append(f"--{new}{eq}{value}")
        return out

    @staticmethod
    def _rename_keys(loaded: ConfigFile, renamed: Mapping[str, str], negated: Mapping[str, str]) -> None:
        """Old config keys -> their new names in ``loaded`` (negated booleans inverted)."""
        for old, new in [*renamed.items(), *negated.items()]:
            if old not in loaded.values:
                continue
            where = loaded.origin.pop(old)
            if new in loaded.values:
                raise ConfigError(f"{where}: '{old}' and '{new}' are one setting; keep only '{new}'")
            _deprecated(old, new, where)
            value = loaded.values.pop(old)
            if old in negated:
                if not isinstance(value, bool):
                    raise ConfigError(f"{where}: '{old}' takes true or false, got {value!r}")
                value = not value
            loaded.values[new] = value
            loaded.origin[new] = where

    def _refuse_unknown_flags(self, argv: Sequence[str]) -> None:
        """An unknown ``--flag`` is an error naming the nearest known one, before argparse's own checks
        (which would first say "the following arguments are required: --runs" for ``--run``)."""
        for tok in argv:
            if tok == "--":
                return
            flag = tok.split("=", 1)[0]
            if tok.startswith("--") and flag not in self._option_string_actions:
                raise ConfigError(f"unknown option {flag}{suggest(flag, self._option_string_actions)}")

    def _refuse_repeated_lists(self, argv: Sequence[str]) -> None:
        """A list option given twice (``--data a=x --data b=y``) would keep only the last list: refuse."""
        dest_of = {o: a.dest for a in self._actions if a.nargs in ("+", "*") for o in a.option_strings}
        seen: dict[str, str] = {}
        for token in argv:
            flag = token.split("=", 1)[0]
            dest = dest_of.get(flag)
            if dest is None:
                continue
            if dest in seen:
                raise ConfigError(
                    f"{flag} is given twice; give all its values once, space-separated ({seen[dest]} A B ...)"
                )
            seen[dest] = flag

    def parse_args_and_config(
        self,
        args: Iterable[str] | None = None,
        return_remaining_strings: bool = False,
        fail_with_unknown_args: bool = True,
        separate_remaining_strings: bool = False,
    ) -> tuple[Any, ...]:
        """The dataclass instances, in the order of ``dataclass_types`` (TRL's API); then a namespace
        with any non-dataclass arguments. Unknown arguments are always an error."""
        if return_remaining_strings or not fail_with_unknown_args:
            raise ValueError("ConfigParser rejects unknown arguments; remaining strings are not returned")
        ns = self.parse_args(None if args is None else list(args))
        parsed: ParsedConfig = ns.parsed_config
        out = [parsed.build(t) for t in parsed.types]
        rest = {k: v for k, v in vars(ns).items() if k != "parsed_config"}
        if any(k != "config" for k in rest):
            out.append(argparse.Namespace(**rest))
        return tuple(out)

    def parse_args_into_dataclasses(self, args=None, return_remaining_strings: bool = False, **kwargs: Any):
        """HfArgumentParser's entry point, routed through :meth:`parse_args_and_config` (``--config``
        included; ``.args`` files are not read)."""
        return self.parse_args_and_config(args, return_remaining_strings=return_remaining_strings)


def known_keys(parser: ConfigParser) -> Mapping[str, Any]:
    """Every config key the parser accepts (field name -> annotation)."""
    parser._materialize()
    return {k: hint for k, (_, hint) in parser._fields().items()}
