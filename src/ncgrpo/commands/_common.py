"""What the CLI and its commands share: the bad-input error and dataclass-backed commands.

:class:`UsageError` (and :data:`BAD_INPUT`) live here, not in ``ncgrpo.cli``, so that ``cli`` imports
the commands and no command imports ``cli`` back.

Commands whose options are one dataclass are parsed the TRL way.

A command registered with :func:`add_dataclass_command` takes ``--config FILE.yaml`` (keys = field
names, ``base:`` includes) plus one ``--flag`` per field (``--batch_size`` and the ``--batch-size``
alias; list fields as space-separated values; flags override the file), with each field's
``metadata["help"]`` as its help text and its ``__post_init__`` as the validation: the same
:class:`ncgrpo.commands.parser.ConfigParser` as ``ncgrpo train``, ``demo`` and ``pretrain``.
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ncgrpo.runs.folder import FolderLock, claim_folder


class UsageError(Exception):
    """Bad input from the user: printed as ``ncgrpo <command>: error: <message>``, exit code 2."""


#: Exceptions that mean "the input is wrong" when they escape a command.
BAD_INPUT = (UsageError, ValueError, OSError, KeyError)


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
    """Register ``name``; its ``func`` builds ``cls`` from the parsed values and calls ``run`` with it."""
    p = sub.add_parser(name, help=help, description=description or help, dataclass_types=lambda: (cls,))

    def func(args: argparse.Namespace) -> int:
        return run(args.parsed_config.build(cls))

    p.set_defaults(func=func, command_name=command_name or name)
    return p


def check_report_folder(out: str | Path, command: str) -> None:
    """Refuse, writing nothing, a ``--out`` of ``compare`` / ``plot`` that is a file, another command's
    folder (a training run, an evaluation, a demo's root, a model) or one another process writes."""

    FolderLock(out, command, kind="report").check()


@contextlib.contextmanager
def report_folder(out: str | Path, command: str) -> Iterator[Path]:
    """Hold ``out``'s lock (kind ``report``, recorded in its ``run.json``) while ``command`` writes
    its tables or figures there."""

    out = Path(out)
    lock = claim_folder(FolderLock(out, command, kind="report"))
    try:
        yield out
    finally:
        lock.release()
