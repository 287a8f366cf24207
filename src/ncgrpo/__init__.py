"""ncgrpo: Noise-Contrastive GRPO (latent-space rollout diversification for RLVR).

Where things are (each folder is one layer; a layer imports only the ones above it; the order and
the check: tests/test_layers.py):

- ``ncgrpo.core``: the paper's math as pure tensor code (noise, schedule, advantages, image noise,
  the one row plan). Imports no engine.
- ``ncgrpo.runs``: the run folder's one home: ``runs.folder`` (file names, atomic writers, the
  ``run.json`` reader, run identity, checkpoint completeness, the folder lock).
- ``ncgrpo.rewards``, ``ncgrpo.data``: the one rule-based scorer; benchmark loaders and prompts.
- ``ncgrpo.models``: model and processor loading, vision-tower freezing, ``tokenizer_of``
  (``ncgrpo.processors``: the torchvision-free Qwen VL processors it loads).
- ``ncgrpo.engines``: thin adapters that apply the core inside an inference engine (transformers;
  vLLM's plugin).
- ``ncgrpo.methods``: the rollout methods, one module each, registered by name
  (``get_method(name)``): everything that differs by method, asked by every other part
  (docs/extending.md).
- ``ncgrpo.rollout``: ``generate_groups``, a method's two-pass groups through the transformers engine
  without the trainer (benchmarks, notebooks).
- ``ncgrpo.trainer``: ``NCGRPOConfig`` / ``NCGRPOTrainer``, the TRL seam.
- ``ncgrpo.eval``: greedy evaluation, records, statistics, tables, plots, and the probe
  (``eval.probe``: a model's noise response measured before training).
- ``ncgrpo.driver``: preparing and executing one training run (the datasets, the model, the LoRA
  adapter, the metrics callback, the trainer), shared by ``ncgrpo train`` and the demo; it sits above
  the trainer.
- ``ncgrpo.toy``: the embedded default (synthetic suite, tiny base model, demo); the library never
  imports it.
- ``ncgrpo.commands`` / ``ncgrpo.cli``: the command line, its config parser (``commands.parser``) and
  ``ncgrpo train``'s argument dataclasses and preparation, as TRL's ``scripts/grpo.py``
  (``commands.train_settings``, ``commands.train_prepare``); nothing imports them.

``from ncgrpo import NCGRPOConfig, NCGRPOTrainer`` works (imported on first use: TRL is heavy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["NCGRPOConfig", "NCGRPOTrainer", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from ncgrpo.trainer import NCGRPOConfig, NCGRPOTrainer


def __getattr__(name: str) -> Any:
    if name in ("NCGRPOConfig", "NCGRPOTrainer"):
        from ncgrpo import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module 'ncgrpo' has no attribute {name!r}")
