"""``ncgrpo train --config RECIPE.yaml [--FIELD VALUE ...] [--resume] [--dry-run]``: one GRPO/NC-GRPO run.

Argument parsing only; the run is :func:`ncgrpo.training.prepare_run` (resolve the run folder, write
``config.yaml`` and ``run.json``, build the datasets) then :func:`ncgrpo.training.execute_run` (load
the model, train, save). Every field of ``ScriptArguments``, ``NCGRPOConfig`` and ``ModelArguments``
is a flag and a config key (``ncgrpo train --help`` lists them); flags override the file.
"""

from __future__ import annotations

import argparse
import sys

HELP = "train with GRPO / NC-GRPO from a recipe (recipes/*.yaml)"


def _dataclasses():
    from ncgrpo.training import train_dataclasses

    return train_dataclasses()


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help=HELP,
        description=HELP + ". Multi-GPU: accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml "
        "-m ncgrpo.cli train --config RECIPE ...",
        dataclass_types=_dataclasses,
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
        help="train into a folder whose run.json says the run finished (it is replaced)",
    )
    p.add_argument(
        "--dry-run",
        "--dry_run",
        action="store_true",
        help="resolve the config, write it and build the dataset, then stop (no model)",
    )
    p.set_defaults(func=run)
    return p


def _synthetic_suite(folder, seed: int) -> None:
    from ncgrpo.toy.synthetic import build_suite, export_geo3k

    export_geo3k(build_suite(seed=seed), folder)


def run(args: argparse.Namespace) -> int:
    from ncgrpo.training import execute_run, prepare_run

    plan = prepare_run(
        args.parsed_config,
        resume=args.resume,
        dry_run=args.dry_run,
        force=args.force,
        overwrite=args.overwrite,
        synthetic=_synthetic_suite,
    )
    if plan.main_process:
        for note in plan.notes:
            print(f"ncgrpo train: {note}", file=sys.stderr)
        print(
            f"ncgrpo train: {plan.name} ({plan.method}), {len(plan.train_dataset)} training prompts, "
            f"{plan.n_eval} eval prompts -> {plan.output_dir}"
        )
    if not args.dry_run:
        execute_run(plan)
    return 0
