"""``ncgrpo train --config RECIPE [KEY=VALUE ...] [--output-dir DIR] [--resume]``: one GRPO/NC-GRPO run.

What it does, in order (every process under ``accelerate launch`` runs the same steps; only the main
process writes files):

1. resolves the recipe (``ncgrpo.config.load_recipe``: ``base:`` includes, overrides, validation) and
   writes it to ``OUTPUT/config.yaml`` plus ``OUTPUT/run.json`` (name, method, seed, model);
2. builds the training set (Geometry3K or the synthetic suite in its schema) in TRL's form;
3. loads the model (``AutoModelForImageTextToText`` for VL checkpoints, else ``AutoModelForCausalLM``;
   offline, a local folder), freezes the vision tower if asked, and loads its processor;
4. runs ``NCGRPOTrainer`` with the recipe's reward functions, appending every log call to
   ``OUTPUT/metrics.jsonl``, and saves the final model to ``OUTPUT``.

``--resume`` continues from the last ``checkpoint-*`` in ``OUTPUT`` (transformers'
``get_last_checkpoint``); without it an output folder that already holds checkpoints is refused.
``--dry-run`` stops after step 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ncgrpo.config import Recipe, RecipeError, load_recipe

CONFIG_FILE = "config.yaml"


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "train",
        help="train with GRPO / NC-GRPO from a recipe (recipes/*.yaml)",
        description="Train one run from a recipe. KEY=VALUE overrides use dotted keys and YAML values, "
        "e.g. trainer.sigma0=0.5 trainer.max_steps=10 model.name_or_path=/models/qwen. "
        "Multi-GPU: accelerate launch --config_file recipes/accelerate/zero3_8gpu.yaml -m ncgrpo.cli train ...",
    )
    p.add_argument(
        "--config", required=True, type=Path, metavar="RECIPE", help="recipe YAML (recipes/*.yaml)"
    )
    p.add_argument(
        "overrides", nargs="*", metavar="KEY=VALUE", help="recipe overrides (dotted keys), after the options"
    )
    p.add_argument(
        "--output-dir",
        type=Path,
        metavar="DIR",
        help="run folder (default: trainer.output_dir, else runs/NAME)",
    )
    p.add_argument(
        "--resume", action="store_true", help="continue from the last checkpoint in the run folder"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="resolve the recipe and build the dataset, then stop (no model)",
    )
    p.set_defaults(func=run)
    return p


# ------------------------------------------------------------------------------------- pieces
def output_dir_for(recipe: Recipe, cli_output_dir: Path | None) -> Path:
    if cli_output_dir is not None:
        return Path(cli_output_dir)
    if recipe.trainer.get("output_dir"):
        return Path(recipe.trainer["output_dir"])
    return Path("runs") / recipe.name


def last_checkpoint(output_dir: Path) -> str | None:
    if not output_dir.is_dir():
        return None
    from transformers.trainer_utils import get_last_checkpoint

    return get_last_checkpoint(str(output_dir))


def run_info(recipe: Recipe, output_dir: Path) -> dict[str, Any]:
    return {
        "name": recipe.name,
        "method": recipe.method,
        "seed": recipe.seed,
        "model": recipe.model.name_or_path,
        "recipe": recipe.source,
        "output_dir": str(output_dir),
    }


def _questions(source, seed: int, output_dir: Path):
    from ncgrpo.data.geometry3k import load_geometry3k

    path = source.path
    if source.name == "synthetic" and path is None:
        # No exported folder given: generate the suite (seeded by the run seed) into the run folder once.
        path = output_dir / "synthetic-data"
        if not (path / "data").is_dir():
            from ncgrpo.toy.synthetic import build_suite, export_geo3k

            export_geo3k(build_suite(seed=seed), path)
    return load_geometry3k(path, source.split, limit=source.limit)


def build_dataset(recipe: Recipe, source, output_dir: Path):
    """One ``data`` entry as the TRL dataset ``to_trl_dataset`` makes (prompt, images, answer, ...)."""
    from ncgrpo.data.geometry3k import to_trl_dataset

    kwargs: dict[str, Any] = {"system_prompt": recipe.data.system_prompt}
    if recipe.data.math_prompt is not None:
        kwargs["math_prompt"] = recipe.data.math_prompt
    return to_trl_dataset(_questions(source, recipe.seed, output_dir), **kwargs)


def build_datasets(recipe: Recipe, output_dir: Path):
    """(train dataset, eval dataset or dict of them or None)."""
    train = build_dataset(recipe, recipe.data.train, output_dir)
    evals = {}
    for src in recipe.data.eval:
        key = f"{src.name}_{src.split}"
        evals[key if key not in evals else f"{key}_{len(evals)}"] = build_dataset(recipe, src, output_dir)
    if not evals:
        return train, None
    return train, (next(iter(evals.values())) if len(evals) == 1 else evals)


def reward_functions(names: list[str]) -> list:
    from ncgrpo import rewards

    return [getattr(rewards, name) for name in names]


def load_model(recipe: Recipe):
    """(model, processor or tokenizer) for the recipe's model settings."""
    from ncgrpo.training import load_model_and_processor

    m = recipe.model
    return load_model_and_processor(
        m.name_or_path,
        dtype=m.torch_dtype,
        device=None,
        attn_implementation=m.attn_implementation,
        min_pixels=m.min_pixels,
        max_pixels=m.max_pixels,
        freeze_vision=m.freeze_vision_tower,
    )


# ----------------------------------------------------------------------------------------- run
def _err(msg: str) -> int:
    print(f"ncgrpo train: error: {msg}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace) -> int:
    try:
        recipe = load_recipe(args.config, args.overrides)
    except RecipeError as e:
        return _err(str(e))
    output_dir = output_dir_for(recipe, args.output_dir)
    recipe.trainer["output_dir"] = str(output_dir)  # the resolved config records where the run lives

    checkpoint = last_checkpoint(output_dir)
    if checkpoint is not None and not args.resume and not args.dry_run:
        return _err(
            f"{output_dir} already holds {Path(checkpoint).name}; pass --resume or another --output-dir"
        )
    if args.resume and checkpoint is None:
        print(f"ncgrpo train: no checkpoint in {output_dir}; starting from scratch", file=sys.stderr)

    if not args.dry_run:
        # Built first: its checks fail fast, and its distributed settings (backend, timeout) are the
        # ones the shared PartialState below is initialised with.
        from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer

        trainer_kwargs = recipe.trainer_kwargs()
        trainer_kwargs.setdefault("run_name", recipe.name)
        try:
            config = NCGRPOConfig(**trainer_kwargs)
        except (TypeError, ValueError) as e:
            return _err(f"{recipe.source}: trainer settings rejected by NCGRPOConfig: {e}")
        _ = config.device  # initialise the distributed state with the config's settings

    from accelerate import PartialState

    from ncgrpo.eval.records import RUN_FILE, atomic_write_json, atomic_write_text
    from ncgrpo.training import METRICS_FILE, MetricsCallback

    state = PartialState()
    if state.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output_dir / CONFIG_FILE, recipe.to_yaml())
        atomic_write_json(output_dir / RUN_FILE, run_info(recipe, output_dir))

    with state.main_process_first():
        train_ds, eval_ds = build_datasets(recipe, output_dir)
    n_eval = (
        0
        if eval_ds is None
        else (len(eval_ds) if not isinstance(eval_ds, dict) else sum(map(len, eval_ds.values())))
    )
    if state.is_main_process:
        print(
            f"ncgrpo train: {recipe.name} ({recipe.method}), {len(train_ds)} training prompts, "
            f"{n_eval} eval prompts -> {output_dir}"
        )
    if args.dry_run:
        return 0

    model, processor = load_model(recipe)
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=reward_functions(recipe.rewards),
        args=config,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        processing_class=processor,
        callbacks=[MetricsCallback(output_dir / METRICS_FILE)],
    )
    trainer.train(resume_from_checkpoint=checkpoint if args.resume else None)
    trainer.save_model(str(output_dir))
    if state.is_main_process:
        processor.save_pretrained(str(output_dir))
        info = run_info(recipe, output_dir)
        info["global_step"] = int(trainer.state.global_step)
        atomic_write_json(output_dir / RUN_FILE, info)
    return 0
