"""``vanilla``: GRPO unchanged. No noisy half; ``NCGRPOTrainer`` runs TRL's own path (bit-identical
first step, tested) and every engine generates the group as TRL does."""

from __future__ import annotations

from typing import Any

from ncgrpo.methods.base import RolloutMethod, TrainerView, register_method


@register_method
class Vanilla(RolloutMethod):
    name = "vanilla"
    target_refusal = "vanilla GRPO has no noisy half"
    summary = "GRPO unchanged (TRL's path): the baseline"
    label = "Vanilla GRPO"
    slug = "grpo"
    two_pass = False
    baseline = True
    key_rule = "none"
    anneals = "nothing is annealed (no noise)"
    verl_refusal = None
    probe_refusal = "vanilla GRPO puts no noise anywhere, so there is nothing to measure"

    card_title = "vanilla GRPO"

    def card_line(self, args: Any, schedule: str) -> str:
        G = getattr(args, "num_generations", None)
        return f"vanilla GRPO (ncgrpo's baseline: no noise; G = {G} rollouts per prompt)"

    def check_vllm(self, vllm_mode: str) -> None:
        return None  # TRL's own path on every engine

    def metrics(self, tr: TrainerView, gen: Any) -> dict[str, float]:
        return {}
