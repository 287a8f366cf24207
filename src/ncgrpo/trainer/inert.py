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

Inert noise is not the only reason a noisy run can log exactly vanilla's steps: when no group had
reward variance (every reward of every group equal, e.g. every completion clipped at a short
``max_completion_length`` and scored 0), every advantage is zero, nothing is learned whatever the
rollouts were, and the logged reward, reward std, loss and length of two different sets of rollouts
coincide. :func:`reward_variance` reads that from the logged ``frac_reward_zero_std`` (TRL's share of
groups whose rewards all agree; ``reward_std`` where it is missing) so a diagnosis can tell "the noise
did nothing" from "no group had reward variance".
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "RewardVariance",
    "reward_variance",
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


@dataclass
class RewardVariance:
    """What the logged training steps say about reward variance within groups."""

    steps: int  # logged training steps (rows with a reward)
    flat_steps: int  # of them, steps where no group had reward variance
    mean_reward: float | None = None
    mean_length: float | None = None
    clipped_ratio: float | None = None  # mean share of completions cut at max_completion_length

    @property
    def none_at_all(self) -> bool:
        """No group had reward variance at any logged step: zero advantages throughout."""
        return self.steps > 0 and self.flat_steps == self.steps

    def describe(self) -> str:
        parts = [
            f"no group had reward variance at any of the {self.steps} logged steps (frac_reward_zero_std 1"
        ]
        if self.mean_reward is not None:
            parts.append(f", mean reward {self.mean_reward:.3g}")
        if self.mean_length is not None:
            parts.append(f", mean completion length {self.mean_length:.3g} tokens")
        if self.clipped_ratio is not None:
            parts.append(f", {100 * self.clipped_ratio:.0f}% of completions clipped at max_completion_length")
        return "".join(parts) + ")"


def reward_variance(rows: Iterable[Mapping[str, Any]]) -> RewardVariance:
    """Summarise the training rows of a ``metrics.jsonl`` (those with a ``reward``): a step has no
    reward variance when its ``frac_reward_zero_std`` is 1 (every group's rewards equal), or, where
    that is not logged, when its ``reward_std`` is 0 (then every reward of the batch was equal)."""

    def num(row: Mapping[str, Any], key: str) -> float | None:
        v = row.get(key)
        return (
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) else None
        )

    steps = flat = 0
    rewards, lengths, clipped = [], [], []
    for row in rows:
        if num(row, "reward") is None:
            continue
        steps += 1
        zero = num(row, "frac_reward_zero_std")
        std = num(row, "reward_std")
        if (zero is not None and zero >= 1.0) or (zero is None and std is not None and std == 0.0):
            flat += 1
        rewards.append(num(row, "reward"))
        for key, out in (("completions/mean_length", lengths), ("completions/clipped_ratio", clipped)):
            if num(row, key) is not None:
                out.append(num(row, key))

    def mean(xs: list) -> float | None:
        return sum(xs) / len(xs) if xs else None

    return RewardVariance(steps, flat, mean(rewards), mean(lengths), mean(clipped))


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
