"""Subcommands of the ``ncgrpo`` CLI.

Each module here exposes ``add_parser(subparsers)``, which registers one subcommand and sets
``func=<callable(args) -> int>`` as its default. Heavy imports (torch, transformers) happen inside
``func`` so that ``ncgrpo compare`` and ``ncgrpo --help`` stay fast.
"""
