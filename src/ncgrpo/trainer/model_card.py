"""The model card (``README.md``) ``NCGRPOTrainer`` writes next to its checkpoints and final model.

TRL's ``GRPOTrainer.create_model_card`` names the base model only when ``config._name_or_path`` is a hub
id (a local folder gives "a fine-tuned version of [None]"), calls the trainer "GRPO" and cites only
DeepSeekMath. This card names the method as run (NC-GRPO's rollout method and noise settings, or vanilla
GRPO), the base model as the run loaded it (hub id, or the folder), the paper, GRPO and TRL, and the
versions. :func:`create_model_card` replaces the TRL method on the trainer class; same signature.
"""

from __future__ import annotations

import os
import textwrap
from pathlib import Path
from typing import Any

from ncgrpo.runs.folder import atomic_write_text

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


def _method(args: Any) -> str:
    m = getattr(args, "rollout_method", "vanilla")
    G = getattr(args, "num_generations", None)
    if m == "vanilla":
        return f"vanilla GRPO (ncgrpo's baseline: no noise; G = {G} rollouts per prompt)"
    parts = [
        f"rollout_method `{m}`",
        f"sigma0 {args.sigma0}",
        f"schedule {args.sigma_schedule} (gamma {args.schedule_gamma}, k_mid {args.schedule_k_mid})",
    ]
    if m != "image":
        parts.append(f"noise site `{args.noise_site}`")
    if getattr(args, "branch_prefix", ""):
        parts.append(f"branch_prefix {args.branch_prefix!r}")
    return f"NC-GRPO (Noise-Contrastive GRPO; G = {G}: {G // 2} clean + {G // 2} noisy rollouts; " + (
        ", ".join(parts) + ")"
    )


def _versions() -> str:
    import importlib.metadata as md

    lines = []
    for pkg in ("ncgrpo", "trl", "transformers", "torch", "datasets", "peft"):
        try:
            lines.append(f"- {pkg}: {md.version(pkg)}")
        except md.PackageNotFoundError:
            continue
    return "\n".join(lines)


def model_card_text(
    trainer: Any, model_name: str | None = None, dataset_name: str | None = None, tags: Any = None
) -> str:
    """The card's Markdown (YAML front matter included) for ``trainer`` as it stands."""
    import yaml

    args = trainer.args
    model_name = model_name or Path(args.output_dir).name
    hub_base, base = _base_model(trainer.model.config)
    tag_set = {"ncgrpo", "nc-grpo", "generated_from_trainer", *getattr(trainer, "_tag_names", [])}
    tag_set.update([tags] if isinstance(tags, str) else (tags or []))
    meta: dict[str, Any] = {"library_name": "transformers", "model_name": model_name, "tags": sorted(tag_set)}
    if hub_base:
        meta["base_model"] = hub_base
    if dataset_name:
        meta["datasets"] = [dataset_name]
    data = f" on the `{dataset_name}` dataset" if dataset_name else ""
    grpo_citation = (getattr(trainer, "_paper", None) or {}).get("citation", "")
    return (
        "---\n"
        + yaml.safe_dump(meta, sort_keys=False)
        + "---\n\n"
        + f"# Model card for {model_name}\n\n"
        + f"This model is a fine-tuned version of {base}{data}, trained with {_method(args)} "
        + "using ncgrpo on [TRL](https://github.com/huggingface/trl)'s GRPOTrainer.\n\n"
        + f"NC-GRPO is the method of *{PAPER}*: half of each rollout group branches from a prefill state "
        + "displaced by scale-calibrated Gaussian noise; the loss, the log-probabilities and evaluation "
        + "never see noise, so the model is used as any checkpoint of its base architecture.\n\n"
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
