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
import json
import os
import sys
from pathlib import Path
from typing import Any

from ncgrpo.config import Recipe, RecipeError, load_recipe

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RUN_FILE = "run.json"

#: Where VL models keep their vision tower, tried in order (Qwen2/2.5/3-VL: ``model.visual``).
VISION_TOWER_PATHS = ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model")


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
            from ncgrpo.data.synthetic import build_suite, export_geo3k

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


def find_vision_tower(model) -> tuple[str, Any] | None:
    for path in VISION_TOWER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None:
            return path, node
    return None


def freeze_vision_tower(model) -> str:
    """Set ``requires_grad=False`` on the vision tower's parameters; returns where it was found."""
    found = find_vision_tower(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__}: no vision tower at any of {', '.join(VISION_TOWER_PATHS)}; "
            "set model.freeze_vision_tower=false for a text-only model"
        )
    path, tower = found
    for p in tower.parameters():
        p.requires_grad_(False)
    return path


def _register_local_processor(name_or_path: str) -> None:
    """Folders saved by ``ncgrpo.models.tiny`` name processor classes that module registers on import."""
    cfg = Path(name_or_path) / "processor_config.json"
    try:
        cls = json.loads(cfg.read_text(encoding="utf-8")).get("processor_class", "")
    except (OSError, ValueError):
        return
    if str(cls).startswith("Tiny"):
        import ncgrpo.models.tiny  # noqa: F401 -- registers the Tiny* processors with AutoProcessor


def load_model_and_processor(recipe: Recipe):
    """(model, processor or tokenizer, is_vision_language)."""
    import torch
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
    )

    m = recipe.model
    config = AutoConfig.from_pretrained(m.name_or_path)
    is_vl = getattr(config, "vision_config", None) is not None
    kwargs: dict[str, Any] = {}
    if m.torch_dtype != "auto":
        kwargs["dtype"] = getattr(torch, m.torch_dtype)
    else:
        kwargs["dtype"] = "auto"
    if m.attn_implementation:
        kwargs["attn_implementation"] = m.attn_implementation
    cls = AutoModelForImageTextToText if is_vl else AutoModelForCausalLM
    model = cls.from_pretrained(m.name_or_path, **kwargs)
    if is_vl:
        _register_local_processor(m.name_or_path)
        pixels = {
            k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v is not None
        }
        processor = AutoProcessor.from_pretrained(m.name_or_path, **pixels)
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(
                f"{m.name_or_path}: AutoProcessor gave {type(processor).__name__}, which has no image processor; "
                "a vision-language model needs its processor saved next to it"
            )
        if m.freeze_vision_tower:
            freeze_vision_tower(model)
    else:
        processor = AutoTokenizer.from_pretrained(m.name_or_path)
    return model, processor, is_vl


# ------------------------------------------------------------------------------------- metrics
def _metrics_callback_class():
    from transformers import TrainerCallback

    class MetricsCallback(TrainerCallback):
        """Append each log call to ``metrics.jsonl`` as one JSON line with ``"step"`` (main process).

        Each line is written, flushed and fsync'ed on its own, so a killed run leaves at most one torn
        last line, which is cut at the next start. On resume, lines logged after the checkpoint's step
        (work the restart repeats) are dropped so every step appears once.
        """

        def __init__(self, path: str | os.PathLike):
            self.path = Path(path)

        def on_train_begin(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                self._repair(state.global_step)

        def on_log(self, args, state, control, logs=None, **kwargs):
            if not state.is_world_process_zero or not logs:
                return
            row = {"step": int(state.global_step)}
            if state.epoch is not None:
                row["epoch"] = float(state.epoch)
            row.update({k: _jsonable(v) for k, v in logs.items()})
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, sort_keys=False, allow_nan=True) + "\n")
                f.flush()
                os.fsync(f.fileno())

        def _repair(self, resumed_step: int) -> None:
            if not self.path.exists():
                return
            from ncgrpo.records import atomic_write_text

            text = self.path.read_text(encoding="utf-8")
            keep, changed = [], not text.endswith("\n") and bool(text)
            for line in text.splitlines(keepends=True):
                if not line.endswith("\n"):
                    continue  # torn last line
                try:
                    step = int(json.loads(line).get("step", 0))
                except (ValueError, AttributeError):
                    changed = True
                    continue
                if step > resumed_step:
                    changed = True
                    continue
                keep.append(line)
            if changed:
                atomic_write_text(self.path, "".join(keep))

    return MetricsCallback


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


def MetricsCallback(path: str | os.PathLike):  # noqa: N802 -- a class built lazily (transformers import)
    """A ``TrainerCallback`` writing ``path`` (see the class docstring)."""
    return _metrics_callback_class()(path)


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

    from ncgrpo.records import atomic_write_json, atomic_write_text

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

    model, processor, _ = load_model_and_processor(recipe)
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
