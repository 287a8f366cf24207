"""The ``ncgrpo`` command line: ``ncgrpo [--debug] <command> [options]``.

One error style for every command: bad input (a :class:`UsageError`, or a ``ValueError`` /
``OSError`` / ``KeyError`` raised while reading the user's files and settings) ends in
``ncgrpo <command>: error: <what, where, how to fix>`` on stderr and exit code 2, with no traceback
unless ``--debug`` is given. Anything else is a bug: ``ncgrpo <command>: internal error: ...``, exit
code 1, and ``--debug`` shows where.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Subcommand modules under ncgrpo.commands, in the order --help lists them.
COMMANDS: tuple[str, ...] = ("demo", "train", "eval", "compare", "plot", "pretrain")


class UsageError(Exception):
    """Bad input from the user: printed as ``ncgrpo <command>: error: <message>``, exit code 2."""


#: Exceptions that mean "the input is wrong" when they escape a command.
BAD_INPUT = (UsageError, ValueError, OSError, KeyError)


def build_parser() -> argparse.ArgumentParser:
    from ncgrpo import __version__

    parser = argparse.ArgumentParser(
        prog="ncgrpo",
        description="NC-GRPO: noise-contrastive GRPO with latent-space rollout diversification.",
    )
    parser.add_argument("--version", action="version", version=f"ncgrpo {__version__}")
    parser.add_argument(
        "--debug", action="store_true", help="show the Python traceback of an error (also NCGRPO_DEBUG=1)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"ncgrpo.commands.{name}").add_parser(sub)
    return parser


def _message(e: BaseException) -> str:
    if isinstance(e, KeyError) and e.args:
        return str(e.args[0])
    if isinstance(e, OSError) and e.filename is not None and str(e.filename) not in str(e):
        return f"{e.filename}: {e.strerror or e}"
    return str(e) or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Dataclass-style commands (see ncgrpo.commands._dataclass_args) parse the rest of the line
    # themselves; for the others anything unrecognised is an error, as with parse_args.
    args, rest = parser.parse_known_args(argv)
    if getattr(args, "takes_rest", False):
        args.rest = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    debug = bool(args.debug or os.environ.get("NCGRPO_DEBUG"))
    name = getattr(args, "command_name", None) or args.command
    try:
        return int(args.func(args) or 0)
    except BAD_INPUT as e:
        if debug:
            raise
        print(f"ncgrpo {name}: error: {_message(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"ncgrpo {name}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - a bug: say so briefly; --debug shows where
        if debug:
            raise
        print(
            f"ncgrpo {name}: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
