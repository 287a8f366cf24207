"""The ``ncgrpo`` command line: ``ncgrpo <command> [options]``."""

from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules under ncgrpo.commands, in the order --help lists them.
COMMANDS: tuple[str, ...] = ("demo", "train", "eval", "compare", "plot", "pretrain", "probe")


def build_parser() -> argparse.ArgumentParser:
    from ncgrpo import __version__

    parser = argparse.ArgumentParser(
        prog="ncgrpo",
        description="NC-GRPO: noise-contrastive GRPO with latent-space rollout diversification.",
    )
    parser.add_argument("--version", action="version", version=f"ncgrpo {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"ncgrpo.commands.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
