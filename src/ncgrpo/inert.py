"""The inert-noise warning: say once, loudly, when training's prefill noise changes nothing.

At the paper's site the displacement reaches only the first-token logits (section 3.1), so when the
model's first token is (nearly) certain NC-GRPO samples vanilla GRPO's rollouts while the user pays
for NC-GRPO. The trainer logs ``noise/first_token_divergence`` (the share of noisy rows whose first
token differs from the clean branch point's argmax) every step; :class:`InertNoiseMonitor` watches it
and, if it stays below ``threshold`` for the first ``steps`` steps that had ``sigma_k > 0``, returns
one warning message (then never again). Pure: no trainer, no logging; the caller emits the message.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["INERT_STEPS", "INERT_THRESHOLD", "InertNoiseMonitor", "InertNoiseWarning"]

#: Default: warn when the first-token divergence stays below 1% ...
INERT_THRESHOLD = 0.01
#: ... over the first 3 noisy steps.
INERT_STEPS = 3


class InertNoiseWarning(UserWarning):
    """The prefill noise changed (almost) no first token in the first noisy steps."""


@dataclass
class InertNoiseMonitor:
    """Feed it ``(step, sigma_k, first_token_divergence)`` per generation; it returns a message once.

    Steps with ``sigma_k <= 0`` are ignored (nothing to detect). The first ``steps`` noisy steps
    decide: all below ``threshold`` -> the warning, else silence for the rest of the run.
    """

    threshold: float = INERT_THRESHOLD
    steps: int = INERT_STEPS
    site: str = "final_norm"
    branch_prefix: str = ""
    seen: list[tuple[int, float, float]] = field(default_factory=list)
    done: bool = False

    def update(self, step: int, sigma_k: float, divergence: float | None) -> str | None:
        if self.done or divergence is None or not sigma_k > 0:
            return None
        self.seen.append((int(step), float(sigma_k), float(divergence)))
        if divergence >= self.threshold:
            self.done = True
            return None
        if len(self.seen) < self.steps:
            return None
        self.done = True
        return self.message()

    def message(self) -> str:
        figures = ", ".join(f"step {k}: sigma_k={s:.3g}, divergence={d:.4f}" for k, s, d in self.seen)
        prefix = f"branch_prefix={self.branch_prefix!r}" if self.branch_prefix else "no branch_prefix"
        return (
            f"NC-GRPO noise looks inert: noise/first_token_divergence stayed below {self.threshold:g} for the first "
            f"{len(self.seen)} noisy steps ({figures}) at noise_site={self.site!r} with {prefix}. The noisy half is "
            "then sampling the same rollouts as the clean half (vanilla GRPO at twice the cost). Measure it with "
            "`ncgrpo probe`; usual fixes: set branch_prefix (e.g. '<think>') so the prefill ends where reasoning "
            "begins, raise sigma0, or use a layer noise_site."
        )
