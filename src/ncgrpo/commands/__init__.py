"""Subcommands of the ``ncgrpo`` CLI.

Each module here exposes ``add_parser(subparsers)``, which registers one subcommand and sets
``func=<callable(args) -> int>`` as its default. Commands whose options are one dataclass (``eval``,
``compare``, ``plot``) register through :func:`ncgrpo.commands._common.add_dataclass_command`:
``cli.main`` hands them the rest of the command line (``takes_rest``) and a ``trl.TrlParser`` parses
it. Heavy imports (torch, transformers) happen inside ``func`` so that ``ncgrpo compare`` and
``ncgrpo --help`` stay fast.
"""
