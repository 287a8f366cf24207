"""``latent``: NC-GRPO (eq. 2). The noisy half's prefill states are displaced,
``h + sigma_k * ||h|| / sqrt(d) * eps`` with one independent keyed draw per row, at the final-norm
site (the paper's) or at the inputs of the layers in ``noise_site`` (the propagating variant)."""

from __future__ import annotations

from typing import Any

from ncgrpo.core.plan import RowPlan
from ncgrpo.engines.vllm import noise_extra_args
from ncgrpo.methods.base import RolloutMethod, register_method


@register_method
class Latent(RolloutMethod):
    name = "latent"
    target_refusal = None
    summary = "NC-GRPO: eq. (2) noise on the noisy half's prefill hidden states"
    label = "NC-GRPO"
    slug = "ncgrpo"
    in_demo_by_default = True
    key_rule = "row"
    noise_mode = "independent"
    uses_sigma = True
    marginal = "draws"
    verl_refusal = None
    probe_refusal = None

    def verl_extra_args(self, cfg: Any, plan: RowPlan, step: int, temperature: float) -> tuple[float, dict]:
        sigma = cfg.sigma_at(step)
        return sigma, noise_extra_args(self.row_noise(plan, sigma))
