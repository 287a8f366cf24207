"""Commands whose options are one dataclass, parsed the TRL way.

A command built with :func:`add_dataclass_command` takes ``--config FILE.yaml`` (keys = field
names) plus one ``--flag`` per field (``--batch_size`` and the ``--batch-size`` alias
``HfArgumentParser`` adds; list fields as space-separated values; flags override the file), with
each field's ``metadata["help"]`` as its help text and its ``__post_init__`` as the validation. The
top-level parser only routes to the command: the rest of the command line is parsed by a
``trl.TrlParser`` built from the dataclass, so ``ncgrpo <command> --help`` lists the fields.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def parse_dataclass(cls: type, argv: Sequence[str], *, prog: str, description: str | None = None) -> Any:
    """``cls`` from ``argv`` (``--config`` file first, flags over it); exits 2 on a bad flag."""
    from trl import TrlParser

    from ncgrpo.cli import UsageError

    argv = list(argv)
    if "--config" in argv:
        i = argv.index("--config")
        if i == len(argv) - 1 or argv[i + 1].startswith("--"):
            raise UsageError("--config needs a YAML file: --config FILE.yaml")
        if not Path(argv[i + 1]).is_file():
            raise UsageError(f"--config {argv[i + 1]}: no such file")
    parser = TrlParser(dataclass_types=[cls], prog=prog, description=description)
    _refuse_repeated_lists(parser, argv)
    try:
        obj, rest = parser.parse_args_and_config(argv, return_remaining_strings=True)
    except TypeError as e:  # a config value of the wrong type reaching the dataclass
        raise UsageError(f"bad option value: {e}") from None
    if rest:
        raise UsageError(f"unrecognized arguments: {' '.join(map(str, rest))} (see {prog} --help)")
    return obj


def add_dataclass_command(
    sub: argparse._SubParsersAction,
    name: str,
    cls: type,
    run: Callable[[Any], int],
    *,
    help: str,
    description: str | None = None,
    command_name: str | None = None,
) -> argparse.ArgumentParser:
    """Register ``name``; its ``func`` parses the remaining arguments into ``cls`` and calls ``run``."""
    command_name = command_name or name
    p = sub.add_parser(name, help=help, description=description or help, add_help=False)

    def func(args: argparse.Namespace) -> int:
        obj = parse_dataclass(cls, args.rest, prog=f"ncgrpo {command_name}", description=description or help)
        return run(obj)

    p.set_defaults(func=func, takes_rest=True, command_name=command_name)
    return p


def _refuse_repeated_lists(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """A list option given twice (``--data a=x --data b=y``) would keep only the last list: refuse."""
    from ncgrpo.cli import UsageError

    dest_of = {o: a.dest for a in parser._actions if a.nargs in ("+", "*") for o in a.option_strings}
    seen: dict[str, str] = {}
    for token in argv:
        flag = token.split("=", 1)[0]
        dest = dest_of.get(flag)
        if dest is None:
            continue
        if dest in seen:
            raise UsageError(
                f"{flag} is given twice; give all its values once, space-separated ({seen[dest]} A B ...)"
            )
        seen[dest] = flag
