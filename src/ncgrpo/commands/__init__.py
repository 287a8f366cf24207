"""Subcommands of the ``ncgrpo`` CLI.

Each module here exposes ``add_parser(subparsers)``, which registers one subcommand and sets
``func=<callable(args) -> int>`` as its default; ``ncgrpo.cli`` imports them by name. Commands whose
options are one dataclass (``eval``, ``compare``, ``plot``, ``probe``) register through
:func:`ncgrpo.commands._common.add_dataclass_command` (the same
:class:`ncgrpo.commands.parser.ConfigParser` as ``train``, ``demo`` and ``pretrain``); :class:`~ncgrpo.commands._common.UsageError` lives there too.
``train`` is ``ncgrpo train``; its argument dataclasses are ``train_settings`` and its preparation
``train_prepare``, as TRL's ``scripts/grpo.py`` (the execution is the library's :mod:`ncgrpo.driver`);
``parser`` and ``config_file`` are the config parser every command uses.
Heavy imports (torch, transformers) happen inside the functions that run a command, so that
``ncgrpo --help`` and ``ncgrpo compare`` stay fast (tested).
"""
