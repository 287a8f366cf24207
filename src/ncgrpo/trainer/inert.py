"""The inert-noise warning: say once, loudly, when training's prefill noise changes nothing.

At the paper's site the displacement reaches only the first-token logits (section 3.1), so when the
model's first token is (nearly) certain NC-GRPO samples vanilla GRPO's rollouts while the user pays
for NC-GRPO. The trainer feeds :class:`InertNoiseMonitor` its step metrics; the monitor reads
``noise/first_token_marginal_tv`` (``TV(q, q_bar)``: the distance between the clean first-token
distribution and the noise-averaged one the noisy half actually samples from, :mod:`ncgrpo.core.marginal`)
and, where that is not logged (layer sites, the image method), the per-draw ``noise/first_token_tv``.
If the value stays below its threshold for the first ``steps`` steps that had ``sigma_k > 0``, the
monitor returns one warning message (then never again). The per-draw TV overstates what the rollouts
see (up to ~10x), so it only decides where the marginal is not available.
``noise/first_token_divergence`` (sampled noisy first tokens that differ from the clean argmax) is no
such measure: with an uncertain first token it is high under temperature sampling even with no noise.
Pure: no trainer, no logging; the caller emits the message.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "INERT_MARGINAL_THRESHOLD",
    "INERT_STEPS",
    "INERT_THRESHOLD",
    "InertNoiseMonitor",
    "InertNoiseWarning",
]

#: Default: warn when the marginal first-token TV stays below 0.002 (``ncgrpo probe``'s "inert") ...
INERT_MARGINAL_THRESHOLD = 0.002
#: ... or, where only the per-draw TV is logged, when that stays below 0.01 ...
INERT_THRESHOLD = 0.01
#: ... over the first 3 noisy steps.
INERT_STEPS = 3

MARGINAL_METRIC = "noise/first_token_marginal_tv"
PER_DRAW_METRIC = "noise/first_token_tv"


class InertNoiseWarning(UserWarning):
    """The prefill noise changed (almost) no first token in the first noisy steps."""


@dataclass
class InertNoiseMonitor:
    """Feed it ``(step, sigma_k, metrics)`` per generation (:meth:`update_from`); it returns a message once.

    Steps with ``sigma_k <= 0`` are ignored (nothing to detect). The first ``steps`` noisy steps
    decide: all below the threshold -> the warning, else silence for the rest of the run.
    """

    threshold: float = INERT_MARGINAL_THRESHOLD
    steps: int = INERT_STEPS
    site: str = "final_norm"
    branch_prefix: str = ""
    metric: str = MARGINAL_METRIC
    fallback_threshold: float = INERT_THRESHOLD
    fallback_metric: str = PER_DRAW_METRIC
    seen: list[tuple[int, float, float]] = field(default_factory=list)
    used: str = ""
    done: bool = False

    def update_from(self, step: int, sigma_k: float, metrics: Mapping[str, float]) -> str | None:
        """Read :attr:`metric` from ``metrics`` (else :attr:`fallback_metric`) and :meth:`update`."""
        if self.metric in metrics:
            return self.update(step, sigma_k, metrics[self.metric], metric=self.metric)
        if self.fallback_metric in metrics:
            return self.update(step, sigma_k, metrics[self.fallback_metric], metric=self.fallback_metric)
        return None

    def update(
        self, step: int, sigma_k: float, effect: float | None, *, metric: str | None = None
    ) -> str | None:
        """``effect``: this step's value of ``metric`` (default :attr:`metric`; ``None``: not measured)."""
        if self.done or effect is None or not sigma_k > 0:
            return None
        metric = metric or self.metric
        self.used = metric
        threshold = self.threshold if metric == self.metric else self.fallback_threshold
        self.seen.append((int(step), float(sigma_k), float(effect)))
        if effect >= threshold:
            self.done = True
            return None
        if len(self.seen) < self.steps:
            return None
        self.done = True
        return self.message()

    def message(self) -> str:
        metric = self.used or self.metric
        threshold = self.threshold if metric == self.metric else self.fallback_threshold
        name = metric.rsplit("/", 1)[-1]
        figures = ", ".join(f"step {k}: sigma_k={s:.3g}, {name}={d:.4f}" for k, s, d in self.seen)
        prefix = f"branch_prefix={self.branch_prefix!r}" if self.branch_prefix else "no branch_prefix"
        return (
            f"NC-GRPO noise looks inert: {metric} stayed below {threshold:g} for the first "
            f"{len(self.seen)} noisy steps ({figures}) at noise_site={self.site!r} with {prefix}. The noisy half is "
            "then sampling (almost) the same rollouts as the clean half (vanilla GRPO at twice the cost). Measure it "
            "with `ncgrpo probe`; usual fixes: set branch_prefix (e.g. '<think>') so the prefill ends where "
            "reasoning begins, raise sigma0, or use a layer noise_site."
        )
