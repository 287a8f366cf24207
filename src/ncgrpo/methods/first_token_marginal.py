"""``first_token_marginal``: a control. The noisy half's first token is sampled from the noise-averaged
distribution ``q_bar`` of ``sigma_k`` (:func:`ncgrpo.engines.controls.first_token_marginal`) and no noise
enters the forward. At the final-norm site this is NC-GRPO's own distribution of groups
(:mod:`ncgrpo.core.marginal`); a training difference between the two is a bug or numerics."""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from ncgrpo.engines.controls import first_token_marginal
from ncgrpo.methods.base import RolloutMethod, TrainerView, register_method


@register_method
class FirstTokenMarginal(RolloutMethod):
    name = "first_token_marginal"
    target_refusal = None
    summary = "control: the noisy half samples its first token from latent noise's q_bar, clean forward"
    label = "First-token q̄"
    slug = "first-token-marginal"
    key_rule = "row"
    uses_sigma = True
    marginal = "draws"
    final_norm_only = (
        "samples the first token from the final-norm site's noise-averaged distribution q_bar; a layer site has "
        "no such q_bar through the LM head alone"
    )
    vllm_refusal = (
        "it runs on the transformers generate path only: the vLLM plugin has no hook that replaces a first-token "
        "logit row by log q_bar"
    )
    verl_refusal = (
        "the q_bar control samples the first token from a pool of noisy logit rows, which the vLLM plugin does "
        "not implement. Use ncgrpo's TRL trainer (transformers engine)"
    )

    def card_settings(self, args: Any) -> list[str]:
        return [f"first_token_marginal_draws {args.first_token_marginal_draws}"]

    def generation_hooks(self, tr: TrainerView, gen: Any, model: Any, stack: ExitStack) -> Any:
        """The noisy rows' first-token logits replaced by ``T * log q_hat`` of a fresh pool of draws
        (:func:`ncgrpo.engines.controls.first_token_marginal`); returned: the metrics read its rows."""
        return stack.enter_context(
            first_token_marginal(
                model,
                [p.key if p.noisy else None for p in gen.plans],
                # read at the prefill: the target schedule solves sigma there (gen.row_sigma per prompt)
                sigma=lambda: gen.row_sigma or [gen.sigma_k] * len(gen.plans),
                temperature=tr.temperature,
                draws=tr.args.first_token_marginal_draws,
            )
        )
