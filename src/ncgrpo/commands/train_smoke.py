"""``ncgrpo train``'s settings that the command line changes beyond the values it gives: what it gave
(:func:`command_line_keys`), ``--smoke``'s overlay that shrinks any recipe to a CPU minute on the
embedded base (:data:`SMOKE_SETTINGS`, :func:`smoke_settings`, :func:`apply_smoke`), and settings a
config file states as functions of others, which follow an override of those (:func:`resolve_derived`).
The argument dataclasses and the run's identity: :mod:`ncgrpo.commands.train_settings`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = [
    "SMOKE_GENERATIONS",
    "SMOKE_SETTINGS",
    "apply_smoke",
    "command_line_keys",
    "config_file_values",
    "resolve_derived",
    "smoke_settings",
]

#: What ``--smoke`` sets (each unless given on the command line): the embedded base and the synthetic
#: suite instead of the recipe's model and data (a text recipe, one whose data is a data file: the
#: embedded base's language model as a text-only Qwen2 and addition word problems in the recipe's
#: prompt / answer columns, :mod:`ncgrpo.toy.text_base`), one prompt's group per micro-batch, two rollout
#: batches, 48-token answers, float32 on the transformers engine, and ``branch_prefix '<think>'`` (on the
#: embedded base the first token after the generation prompt is ``<think>`` with probability ~1, which
#: leaves the paper's final-norm noise inert; the prefix moves the branch point to the first reasoning
#: token: README, "Read marginal TV"). Kept from the recipe: the method and its settings, G, the
#: reward, the optimizer, the ratio ``steps_per_generation / gradient_accumulation_steps`` (updates per
#: rollout batch) and eq. (3)'s schedule scaled to the shorter run. ``model_name_or_path`` is filled in
#: by :func:`smoke_settings`; ``per_device_train_batch_size``, ``max_steps``, ``schedule_k_mid`` and a
#: layer ``noise_site`` are derived from the recipe there.
SMOKE_SETTINGS: dict[str, Any] = {
    "dataset_name": "synthetic",
    "dataset_path": None,
    "dataset_train_limit": 16,
    "eval_dataset_name": None,
    "eval_dataset_path": None,
    "eval_dataset_limit": 12,
    "min_pixels": None,
    "max_pixels": None,
    "gradient_accumulation_steps": 1,
    "max_completion_length": 48,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "use_vllm": False,
    "vllm_mode": "colocate",
    "branch_prefix": "<think>",
    "logging_steps": 1,
    "report_to": ["none"],
}
#: Rollout batches a smoke run trains (the schedule's K in generations).
SMOKE_GENERATIONS = 2


def command_line_keys(parsed) -> set[str]:
    """The fields the command line gave (``--x``, ``--x=v``, ``--x-y``, ``--no_x``), from ``parsed.argv``."""
    fields = {k for t in parsed.types for k in parsed.values[t]}
    given = set()
    for tok in parsed.argv:
        if not tok.startswith("--"):
            continue
        name = tok[2:].split("=", 1)[0].replace("-", "_")
        if name in fields:
            given.add(name)
        elif name.startswith("no_") and name[3:] in fields:
            given.add(name[3:])
    return given


def config_file_values(parsed) -> dict[str, Any]:
    """The config file's values (its ``base:`` chain merged), as written."""
    if not parsed.config:
        return {}
    from ncgrpo.commands.config_file import load_config_file

    return dict(load_config_file(parsed.config).values)


def smoke_settings(parsed) -> dict[str, Any]:
    """:data:`SMOKE_SETTINGS` for this recipe, with what is derived from it: the embedded base as the
    model, ``per_device_train_batch_size`` = G (one prompt's group per micro-batch), ``max_steps`` =
    :data:`SMOKE_GENERATIONS` rollout batches at the recipe's updates per rollout batch,
    ``schedule_k_mid`` scaled by the same factor as ``max_steps`` (eq. (3) anneals at the same point of
    the run), a layer ``noise_site`` past the embedded base's layers moved to its middle layer, and
    ``run_name`` + ``-smoke`` (so the default output folder is not the full run's)."""
    from ncgrpo.core.noise import parse_noise_site
    from ncgrpo.data.files import is_data_file
    from ncgrpo.models import text_layers
    from ncgrpo.toy.base_model import ensure_base_model

    out = dict(SMOKE_SETTINGS)
    if is_data_file(parsed.get("dataset_name")):
        # a text recipe: text-only on both sides, the recipe's columns kept (ncgrpo.toy.text_base)
        from ncgrpo.toy.text_base import ensure_text_base_model, ensure_text_smoke_data

        base = ensure_text_base_model()
        prompt_column, answer_column = parsed.get("prompt_column"), parsed.get("answer_column")
        out["dataset_name"] = str(ensure_text_smoke_data(prompt_column or "prompt", answer_column))
    else:
        base = ensure_base_model()
    out["model_name_or_path"] = str(base)
    g = int(parsed.get("num_generations") or 2)
    ga = int(parsed.get("gradient_accumulation_steps") or 1)
    spg = parsed.get("steps_per_generation")
    file, given = config_file_values(parsed), command_line_keys(parsed)
    file_spg, file_ga = file.get("steps_per_generation"), file.get("gradient_accumulation_steps")
    if "steps_per_generation" not in given and file_spg and file_ga:
        # the file's ratio: resolve_derived keeps it when gradient_accumulation_steps is overridden
        spg, ga = int(file_spg), int(file_ga)
    updates = spg // ga if spg is not None and spg % ga == 0 and spg >= ga else 1
    out["per_device_train_batch_size"] = g
    # TRL's eval batch must hold whole groups too (its default 8 refuses G = 12 once eval is turned on)
    out["per_device_eval_batch_size"] = g
    out["max_steps"] = SMOKE_GENERATIONS * updates
    # k_mid scaled from the recipe's length to the run's (--max_steps given here wins over the smoke's)
    full_steps = file.get("max_steps") if "max_steps" in given else parsed.get("max_steps")
    steps = parsed.get("max_steps") if "max_steps" in given else out["max_steps"]
    if full_steps and full_steps > 0 and steps and steps > 0 and parsed.get("schedule_k_mid") is not None:
        out["schedule_k_mid"] = round(float(parsed.get("schedule_k_mid")) * steps / full_steps, 4)
    site = parse_noise_site(str(parsed.get("noise_site")))
    layers = text_layers(base)
    if site != "final_norm" and layers is not None and max(site) >= layers:
        out["noise_site"] = str(layers // 2)
    name = parsed.get("run_name") or (Path(parsed.config).stem if parsed.config else "ncgrpo")
    out["run_name"] = f"{name}-smoke"
    return out


def apply_smoke(parsed, given: set[str]) -> tuple[list[str], set[str]]:
    """Overlay :func:`smoke_settings` on the recipe (a flag given on the command line still wins);
    returns the notes (what changed) and the keys it set."""
    notes = []
    settings = smoke_settings(parsed)
    applied = set()
    for key, value in settings.items():
        if key in given:
            continue
        before = parsed.get(key)
        parsed.set(key, value)
        applied.add(key)
        if key in ("noise_site", "schedule_k_mid") and before != value:
            why = (
                "the embedded base has no such layer; its middle one"
                if key == "noise_site"
                else "scaled with max_steps"
            )
            notes.append(f"--smoke: {key} {before} -> {value} ({why})")
    text = settings["dataset_name"] != "synthetic"
    notes.append(
        f"--smoke: {parsed.get('rollout_method')} on the embedded base"
        + ("'s language model (text-only)" if text else "")
        + f" ({settings['model_name_or_path']}), {parsed.get('max_steps')} steps, "
        f"G={parsed.get('num_generations')}, branch_prefix {parsed.get('branch_prefix')!r}, "
        + (
            f"addition word problems in the recipe's columns ({settings['dataset_name']})"
            if text
            else "the synthetic suite"
        )
    )
    return notes, applied


def resolve_derived(parsed, overridden: set[str], file_values: dict[str, Any]) -> list[str]:
    """Settings a file states as functions of others follow an override of those others, or the run is
    refused naming both values; returns notes. ``overridden``: the keys the command line (or
    ``--smoke``) set over the file.

    - ``steps_per_generation`` (micro-batches per rollout batch): a file that sets it with
      ``gradient_accumulation_steps`` sets the updates per rollout batch (the recipes: 192 / 48 = 4); an
      override of ``gradient_accumulation_steps`` alone keeps that ratio. Where the file's value is no
      multiple of it, or the file sets ``steps_per_generation`` alone, the override is refused.
    - ``dtype`` (the weights as loaded) follows ``bf16`` / ``fp16`` when those are overridden and
      ``dtype`` is not: ``--bf16 false`` on a bf16 recipe loads float32 weights.
    """
    notes = []
    ga_key, spg_key = "gradient_accumulation_steps", "steps_per_generation"
    file_spg = file_values.get(spg_key)
    if ga_key in overridden and spg_key not in overridden and file_spg is not None:
        ga = parsed.get(ga_key)
        file_ga = file_values.get(ga_key)
        where = parsed.config
        if file_ga is None or file_spg % file_ga != 0:
            stated = f"with gradient_accumulation_steps {file_ga}" if file_ga is not None else "alone"
            raise ValueError(
                f"gradient_accumulation_steps {ga} overrides {where}, but its steps_per_generation {file_spg} "
                f"(set {stated}) was not: TRL would generate {file_spg} micro-batches per rollout batch, "
                f"{file_spg / ga:g} updates of {ga} micro-batches each; pass --steps_per_generation too"
            )
        new = file_spg // file_ga * ga
        if new != parsed.get(spg_key):
            notes.append(
                f"steps_per_generation {file_spg} -> {new}: {where} sets it to {file_spg // file_ga} x "
                f"gradient_accumulation_steps ({file_spg // file_ga} updates per rollout batch), which is "
                f"now {ga}; pass --steps_per_generation to set it yourself"
            )
            parsed.set(spg_key, new)
    if "dtype" not in overridden and {"bf16", "fp16"} & overridden:
        dtype = parsed.get("dtype")
        bf16, fp16 = parsed.get("bf16"), parsed.get("fp16")
        mixed = "bfloat16" if bf16 else "float16" if fp16 else "float32"
        if dtype in ("bfloat16", "float16", "float32") and dtype != mixed:
            flag = "bf16" if "bf16" in overridden else "fp16"
            notes.append(
                f"dtype {dtype} -> {mixed}: the weights follow {flag}={parsed.get(flag)}; "
                "pass --dtype to load them otherwise"
            )
            parsed.set("dtype", mixed)
    return notes
