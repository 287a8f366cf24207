"""The model card (``README.md``) ``NCGRPOTrainer`` writes next to its checkpoints and final model.

TRL's ``GRPOTrainer.create_model_card`` names the base model only when ``config._name_or_path`` is a hub
id (a local folder gives "a fine-tuned version of [None]"), calls the trainer "GRPO" and cites only
DeepSeekMath. This card names the method as run (NC-GRPO's rollout method and noise settings, or vanilla
GRPO), the base model as the run loaded it (hub id, or the folder), the paper, GRPO and TRL, and the
versions. It also says what made the model (sigma0, or the target TV the schedule held; the noise site,
the rewards, the data, the steps), and how to load the folder: a LoRA run's folder holds the adapter
only, so the card names its base and gives the ``PeftModel.from_pretrained`` lines.
:func:`create_model_card` replaces the TRL method on the trainer class; same signature.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from ncgrpo.methods import RolloutMethod, baseline_method, get_method
from ncgrpo.runs.folder import atomic_write_text, read_run_json

__all__ = ["PAPER", "PAPER_CITATION", "create_model_card", "model_card_text"]

#: The paper ncgrpo implements (as README.md's Citation section and CITATION.cff give it).
PAPER = (
    "Perturb the Thought, Not the Pixels: Latent-Space Rollout Diversification for Reinforcement Learning "
    "of Vision-Language Models (Michael Jerge, Joseph Pelczar, Justin Downes; WACV 2027)"
)
PAPER_CITATION = textwrap.dedent("""\
    @inproceedings{jerge2027perturb,
      title     = {Perturb the Thought, Not the Pixels: Latent-Space Rollout Diversification for
                   Reinforcement Learning of Vision--Language Models},
      author    = {Jerge, Michael and Pelczar, Joseph and Downes, Justin},
      booktitle = {Proceedings of the IEEE/CVF Winter Conference on Applications of Computer Vision (WACV)},
      year      = {2027}
    }""")

_TRL_CITATION = textwrap.dedent("""\
    @software{vonwerra2020trl,
      title   = {{TRL: Transformers Reinforcement Learning}},
      author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallou{\\'e}dec, Quentin},
      license = {Apache-2.0},
      url     = {https://github.com/huggingface/trl},
      year    = {2020}
    }""")


def _base_model(config: Any) -> tuple[str | None, str]:
    """``(hub id or None, how the card names the base)`` from the model config's ``_name_or_path``."""
    name = str(getattr(config, "_name_or_path", "") or "")
    if not name:
        return None, "a base model whose config records no name or path"
    if os.path.isdir(name):
        return None, f"the local checkpoint `{name}`"
    return name, f"[{name}](https://huggingface.co/{name})"


def _schedule(args: Any) -> str:
    """Eq. (3)'s schedule as the run used it."""
    kind = getattr(args, "sigma_schedule", "sigmoid")
    if kind == "sigmoid":
        return (
            f"schedule sigmoid (eq. 3: gamma {args.schedule_gamma}, k_mid {args.schedule_k_mid} "
            f"{args.schedule_unit.replace('_', ' ')}s)"
        )
    if kind == "constant":
        return "schedule constant (no annealing)"
    return f"schedule {kind} (over the run's {args.schedule_unit.replace('_', ' ')}s)"


def _method(args: Any) -> str:
    return _rollout(args).card_line(args, _schedule(args))


def _short_method(args: Any) -> str:
    return _rollout(args).card_title


def _rollout(args: Any) -> RolloutMethod:
    """The method as run (the baseline for arguments without a ``rollout_method``)."""
    m = getattr(args, "rollout_method", None)
    return baseline_method() if m is None else get_method(m)


def _rewards(trainer: Any) -> str:
    names = list(getattr(trainer, "reward_func_names", None) or [])
    weights = getattr(trainer, "reward_weights", None)
    weights = [float(w) for w in weights] if weights is not None else [1.0] * len(names)
    if not names:
        return "not recorded"
    return ", ".join(f"`{n}` (weight {w:g})" for n, w in zip(names, weights, strict=False))


def _data(trainer: Any, dataset_name: str | None) -> str:
    """The training data: the name given to the card, else what ``ncgrpo train`` recorded (``run.json``'s
    identity: dataset_name, dataset_path, split, limit), else the dataset's own name; and its size."""
    parts: list[str] = []
    try:
        ident = (read_run_json(trainer.args.output_dir) or {}).get("identity") or {}
    except ValueError:  # an unreadable run.json costs only this line's detail
        ident = {}
    ds = getattr(trainer, "train_dataset", None)
    name = (
        dataset_name or ident.get("dataset_name") or getattr(getattr(ds, "info", None), "dataset_name", None)
    )
    if name:
        parts.append(f"`{name}`")
        if ident.get("dataset_path"):
            parts.append(f"from `{ident['dataset_path']}`")
        if ident.get("dataset_train_split"):
            parts.append(f"split `{ident['dataset_train_split']}`")
        if ident.get("dataset_train_limit"):
            parts.append(f"first {ident['dataset_train_limit']} rows")
    try:
        n: int | None = len(ds)
    except TypeError:
        n = None
    text = ", ".join(parts)
    if n is not None:
        text = f"{text} ({n} training prompts)" if text else f"{n} training prompts"
    return text or "not recorded (an iterable dataset passed to NCGRPOTrainer)"


def _adapter(trainer: Any) -> Any:
    """The LoRA (PEFT) config of the trained model, or None for full weights."""
    model = (
        trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    )
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    return next(iter(configs.values()))


def _model_class(trainer: Any) -> str:
    model = (
        trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    )
    base = getattr(model, "get_base_model", None)
    return type(base() if callable(base) else model).__name__


def _q(text: str) -> str:
    """A Python string literal of ``text`` (double quotes)."""
    import json

    return json.dumps(str(text))


def _usage(trainer: Any, base_id: str, folder: str) -> str:
    """How to load what the folder holds: the adapter on its base, or the full model."""
    cls = _model_class(trainer)
    lora = _adapter(trainer)
    if lora is None:
        return (
            "The folder holds full weights (`config.json`, `model.safetensors`) of the base architecture; NC-GRPO's "
            "noise acts only while rollouts are generated, so the model loads and runs as any checkpoint of it:\n\n"
            f"```python\nfrom transformers import {cls}\n\nmodel = {cls}.from_pretrained({_q(folder)})\n```\n\n"
            f"`ncgrpo eval --model_name_or_path {folder}` evaluates it."
        )
    targets = lora.target_modules
    targets = sorted(targets) if isinstance(targets, (set, list, tuple)) else targets
    return (
        "The folder holds a **LoRA adapter only** (`adapter_config.json`, `adapter_model.safetensors`: "
        f"r {lora.r}, lora_alpha {lora.lora_alpha}, target modules {targets}"
        + (f", excluded `{lora.exclude_modules}`" if getattr(lora, "exclude_modules", None) else "")
        + f"), not a model: it needs its base, {base_id}. Load the base, then the adapter on it:\n\n"
        f"```python\nfrom peft import PeftModel\nfrom transformers import {cls}\n\n"
        f"base = {cls}.from_pretrained({_q(lora.base_model_name_or_path or base_id)})\n"
        f"model = PeftModel.from_pretrained(base, {_q(folder)})\n"
        "model = model.merge_and_unload()  # optional: plain weights, no peft at inference\n```\n\n"
        f"`ncgrpo eval --model_name_or_path {folder}` loads the adapter on its base and merges it."
    )


def _ncgrpo_version() -> str:
    """The installed ncgrpo's version (the package metadata ``ncgrpo.__version__`` equals)."""
    import importlib.metadata as md

    try:
        return md.version("ncgrpo")
    except md.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def _versions() -> str:
    import importlib.metadata as md

    lines = [f"- ncgrpo: {_ncgrpo_version()}"]
    for pkg in ("trl", "transformers", "torch", "datasets", "peft"):
        try:
            lines.append(f"- {pkg}: {md.version(pkg)}")
        except md.PackageNotFoundError:
            continue
    return "\n".join(lines)


def model_card_text(
    trainer: Any, model_name: str | None = None, dataset_name: str | None = None, tags: Any = None
) -> str:
    """The card's Markdown (YAML front matter included) for ``trainer`` as it stands: what made the model
    (method, sigma0 or the target TV and the schedule, noise site, rewards, data, steps, LoRA), how to
    load what the folder holds (the adapter on its base, or the full model) and the versions."""
    import yaml

    args = trainer.args
    model_name = model_name or Path(args.output_dir).name
    hub_base, base = _base_model(trainer.model.config)
    lora = _adapter(trainer)
    tag_set = {"ncgrpo", "nc-grpo", "generated_from_trainer", *getattr(trainer, "_tag_names", [])}
    tag_set.update([tags] if isinstance(tags, str) else (tags or []))
    if lora is not None:
        tag_set.update(["lora", "peft"])
    meta: dict[str, Any] = {
        "library_name": "peft" if lora is not None else "transformers",
        "model_name": model_name,
        "tags": sorted(tag_set),
    }
    if hub_base:
        meta["base_model"] = hub_base
    if dataset_name:
        meta["datasets"] = [dataset_name]
    data = f" on the `{dataset_name}` dataset" if dataset_name else ""
    what = "A LoRA adapter for" if lora is not None else "This model is a fine-tuned version of"
    state = getattr(trainer, "state", None)
    step = getattr(state, "global_step", None)
    steps = f"{step} of max_steps {args.max_steps}" if step is not None else f"max_steps {args.max_steps}"
    trained = [
        f"- Method: {_method(args)}",
        f"- Rewards: {_rewards(trainer)}",
        f"- Data: {_data(trainer, dataset_name)}",
        f"- Optimizer steps: {steps}; learning_rate {args.learning_rate}; seed {args.seed}",
        "- Weights: "
        + (
            f"LoRA adapter (r {lora.r}, lora_alpha {lora.lora_alpha}) on {base}"
            if lora is not None
            else "full fine-tune"
        ),
        f"- ncgrpo {_ncgrpo_version()}",
    ]
    grpo_citation = (getattr(trainer, "_paper", None) or {}).get("citation", "")
    return (
        "---\n"
        + yaml.safe_dump(meta, sort_keys=False)
        + "---\n\n"
        + f"# Model card for {model_name}\n\n"
        + f"{what} {base}{data}, trained with {_short_method(args)} "
        + "using ncgrpo on [TRL](https://github.com/huggingface/trl)'s GRPOTrainer.\n\n"
        + "## What made it\n\n"
        + "\n".join(trained)
        + "\n\n## Loading it\n\n"
        + _usage(trainer, base, str(args.output_dir))
        + "\n\n## The method\n\n"
        + f"NC-GRPO is the method of *{PAPER}*: half of each rollout group branches from a prefill state "
        + "displaced by scale-calibrated Gaussian noise; the loss, the log-probabilities and evaluation "
        + "never see noise.\n\n"
        + "## Framework versions\n\n"
        + _versions()
        + "\n\n## Citations\n\nCite NC-GRPO as:\n\n```bibtex\n"
        + PAPER_CITATION
        + "\n```\n\n"
        + (f"Cite GRPO as:\n\n```bibtex\n{grpo_citation}\n```\n\n" if grpo_citation else "")
        + f"Cite TRL as:\n\n```bibtex\n{_TRL_CITATION}\n```\n"
    )


def create_model_card(
    self: Any, model_name: str | None = None, dataset_name: str | None = None, tags: Any = None
) -> None:
    """``Trainer.create_model_card`` for ``NCGRPOTrainer``: writes ``output_dir/README.md`` on the main
    process (TRL calls it at every checkpoint save)."""
    if not self.is_world_process_zero():
        return
    out = Path(self.args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "README.md", model_card_text(self, model_name, dataset_name, tags))
