"""The ``ncgrpo`` command line: ``ncgrpo [--debug] <command> [options]``.

One error style for every command: bad input (a :class:`UsageError`, or a ``ValueError`` /
``OSError`` / ``KeyError`` raised while reading the user's files and settings) ends in
``ncgrpo <command>: error: <what, where, how to fix>`` on stderr and exit code 2, with no traceback
unless ``--debug`` is given. Anything else is a bug: ``ncgrpo <command>: internal error: ...``, exit
code 1, and ``--debug`` shows where.

Commands whose settings are dataclasses parse them the TRL way (:class:`ncgrpo.commands.parser.ConfigParser`):
``--config FILE.yaml`` plus one ``--flag`` per field, lists as space-separated values, flags with
underscores and dash aliases; the parsed values arrive as ``args.parsed_config``.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import warnings
from pathlib import Path

from ncgrpo import __version__
from ncgrpo.commands import compare, demo, plot, pretrain, probe, train
from ncgrpo.commands import eval as eval_command
from ncgrpo.commands._common import BAD_INPUT, UsageError
from ncgrpo.commands.config_file import suggest
from ncgrpo.commands.parser import ConfigParser

__all__ = ["BAD_INPUT", "COMMANDS", "UsageError", "build_parser", "main"]

# Subcommand modules, in the order --help lists them (each registers itself by ``add_parser``).
_MODULES = (demo, train, eval_command, compare, plot, pretrain, probe)
COMMANDS: tuple[str, ...] = tuple(m.__name__.rsplit(".", 1)[1] for m in _MODULES)


class _TopParser(argparse.ArgumentParser):
    """The ``ncgrpo`` parser: no flag is matched by a prefix of its name (``--deb`` is not ``--debug``),
    and an unknown flag or command gets the nearest known one."""

    def __init__(self, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(**kwargs)

    def error(self, message: str):
        m = re.search(r"invalid choice: '([^']*)'", message)
        if m:
            message += suggest(m.group(1), COMMANDS)
        m = re.match(r"unrecognized arguments: (\S+)", message)
        if m and m.group(1).startswith("-"):
            message += suggest(m.group(1).split("=", 1)[0], self._option_string_actions)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(
        prog="ncgrpo",
        description="NC-GRPO: noise-contrastive GRPO with latent-space rollout diversification.",
    )
    parser.add_argument("--version", action="version", version=f"ncgrpo {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an error (also NCGRPO_DEBUG=1)"
    )

    # a subcommand gets dataclass-backed parsing by add_parser(..., dataclass_types=...); without them
    # ConfigParser is a plain ArgumentParser
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=ConfigParser)
    for module in _MODULES:
        module.add_parser(sub)
    return parser


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in str(e):
        return f"{e.filename}: {e.strerror or e}"
    return str(e) or type(e).__name__


def _prog(name: str | None) -> str:
    return f"ncgrpo {name}" if name else "ncgrpo"


def _warning_printer(name: str | None):
    """``warnings.showwarning`` for a command: ncgrpo's own warnings (raised in its code, or pointed by
    their ``stacklevel`` at the program that called it) read ``ncgrpo <command>: warning: ...`` like its
    errors; other libraries' keep Python's format with their location."""

    default = warnings.showwarning
    package = str(Path(__file__).resolve().parent)
    entry = (str(Path(sys.argv[0]).resolve()) if sys.argv and sys.argv[0] else "", "<frozen runpy>")

    def show(message, category, filename, lineno, file=None, line=None):
        ours = category.__module__.startswith("ncgrpo") or str(filename).startswith(package)
        if ours or str(filename) in entry:
            print(f"{_prog(name)}: warning: {message}", file=file or sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    # known before parsing, so errors raised while parsing a command's config carry its name
    name = next((a for a in argv if a in COMMANDS), None)
    debug = "--debug" in argv[: argv.index(name) if name else len(argv)] or bool(
        os.environ.get("NCGRPO_DEBUG")
    )

    # not while a caller records warnings (catch_warnings(record=True), as pytest does): it gets them as they are
    recording = getattr(getattr(warnings, "_showwarnmsg_impl", None), "__self__", None) is not None
    try:
        with warnings.catch_warnings():
            if not recording:
                warnings.showwarning = _warning_printer(name)
            for tok in argv[: argv.index(name) if name else len(argv)]:
                # ncgrpo's own flags stand before the command; argparse would let the command's parser
                # fail first (its required flags) and never name an unknown one here
                if tok.startswith("-") and tok.split("=", 1)[0] not in parser._option_string_actions:
                    parser.error(f"unrecognized arguments: {tok}")
            args = parser.parse_args(argv)
            if getattr(args, "func", None) is None:
                parser.print_help()
                return 2
            name = getattr(args, "command_name", None) or args.command
            if not recording:
                warnings.showwarning = _warning_printer(name)
            return int(args.func(args) or 0)
    except BAD_INPUT as e:
        if debug:
            raise
        print(f"{_prog(name)}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{_prog(name)}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: say so briefly; --debug shows where
        if debug:
            raise
        print(
            f"{_prog(name)}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
