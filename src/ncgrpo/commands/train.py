"""``ncgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--resume] [--dry-run]``: one GRPO/NC-GRPO run.

As TRL's ``scripts/grpo.py``: the settings are three dataclasses parsed together by
:class:`ncgrpo.commands.parser.ConfigParser` (``--config recipe.yaml`` plus one ``--flag`` per field; flags
override the file): :class:`ScriptArguments` (data and rewards), ``NCGRPOConfig`` (the trainer) and
:class:`ModelArguments` (``trl.ModelConfig`` plus the vision settings); ``ncgrpo train --help`` lists
them (:mod:`ncgrpo.commands.train_settings`). The pipeline is
:func:`ncgrpo.commands.train_prepare.prepare_run` (resolve the run folder, refuse one holding checkpoints
unless resuming, build the trainer's settings and the datasets, check everything that needs no weights;
a dry run then writes ``config.yaml`` and ``run.json`` and stops) then :func:`ncgrpo.driver.execute_run` (load
the model, then write the run folder, train through :func:`ncgrpo.driver.train_run`, save). ``--smoke``
shrinks any recipe to a CPU minute on the embedded base (:func:`ncgrpo.commands.train_smoke.apply_smoke`).
"""

from __future__ import annotations

import argparse
import sys

from ncgrpo.commands.train_prepare import prepare_run
from ncgrpo.commands.train_settings import train_dataclasses

__all__ = ["add_parser", "run"]


# ------------------------------------------------------------------------------------ the command
HELP = "train with GRPO / NC-GRPO from a recipe (recipes/*.yaml)"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help=HELP,
        description=HELP + ". Multi-GPU: accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml "
        "-m ncgrpo.cli train --config RECIPE ...",
        dataclass_types=train_dataclasses,
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in the run folder"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="with --resume: resume even if settings that change the run differ from the run's config.yaml",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start the run again in its folder (finished or not): once the folder is locked, its checkpoints, "
        "metrics.jsonl and final weights are removed (not with --resume: pick one)",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        help="every check the run makes before it loads the model (settings, the model's config, the data "
        "against the batch), then write the resolved config and stop (no weights loaded)",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the recipe shrunk to a CPU minute: same method and settings, on the embedded base and the "
        "synthetic suite, two rollout batches, G kept (recipes/README.md, 'Trying a recipe small'); "
        "flags given here still override",
    )
    p.set_defaults(func=run)
    return p


def _synthetic_suite(folder, seed: int) -> None:
    from ncgrpo.toy.suite import build_suite, export_geo3k

    export_geo3k(build_suite(seed=seed), folder)


def run(args: argparse.Namespace) -> int:
    from ncgrpo.driver import execute_run  # transformers: imported when the command runs

    plan = prepare_run(
        args.parsed_config,
        resume=args.resume,
        dry_run=args.dry_run,
        force=args.force,
        overwrite=args.overwrite,
        smoke=args.smoke,
        synthetic=_synthetic_suite,
    )
    if plan.main_process:
        for note in plan.notes:
            print(f"ncgrpo train: {note}", file=sys.stderr)
        print(
            f"ncgrpo train: {plan.name} ({plan.method}), {len(plan.train_dataset)} training prompts, "
            f"{plan.n_eval} eval prompts -> {plan.output_dir}"
        )
    try:
        if not args.dry_run:
            execute_run(plan)
    finally:
        plan.release()
    return 0
