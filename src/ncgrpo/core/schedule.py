"""One schedule object for everything eq. (3) anneals: the noise scale ``sigma_k`` (or, with
``target_marginal_tv``, the noise-averaged first-token TV that ``sigma_k`` is solved for), NoisyRollout's
diffusion step ``t`` and the first-token control's temperature ``T_k``.

The paper anneals ``sigma_k = sigma0 * decay_k`` with NoisyRollout's sigmoid decay (eq. 3,
:func:`ncgrpo.core.noise.sigma_schedule`). The image baseline anneals its diffusion step by the same
factor (``t_k = int(t0 * decay_k)``, NoisyRollout's own rule) and the first-token-temperature control
its temperature (``T_k = T + (T0 - T) * decay_k``, so it reaches the sampling temperature exactly when
``sigma_k`` reaches 0). :class:`Schedule` holds the four settings that define ``decay_k`` (``kind``,
``gamma``, ``k_mid`` and the ``unit`` that ``k`` counts) and gives all three values, so the trainer,
the image method, the temperature control, the verl integration and the probe cannot disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ncgrpo.core.noise import sigma_schedule

__all__ = ["SCHEDULE_KINDS", "SCHEDULE_UNITS", "Schedule"]

#: eq. (3) (``sigmoid``) and the two ablations.
SCHEDULE_KINDS = ("sigmoid", "constant", "linear")
#: What ``k`` counts: TRL optimizer steps, or rollout batches (NoisyRollout's / EasyR1's / verl's step).
SCHEDULE_UNITS = ("optimizer_step", "generation")


@dataclass(frozen=True)
class Schedule:
    """eq. (3)'s decay ``decay_k`` and what it anneals.

    ``kind``: ``sigmoid`` (eq. 3: ``1 - sigmoid(gamma * (k - k_mid) / K)``), ``constant`` (1) or
    ``linear`` (``1 - k / K``). ``unit``: what ``k`` and ``K`` count (:meth:`position`). Invalid values
    raise ``ValueError`` naming the setting (the config fields are ``sigma_schedule``,
    ``schedule_gamma``, ``schedule_k_mid`` and ``schedule_unit``).
    """

    kind: str = "sigmoid"
    gamma: float = 30.0
    k_mid: float = 40.0
    unit: str = "optimizer_step"

    def __post_init__(self) -> None:
        if self.kind == "target_marginal_tv":
            raise ValueError(
                "sigma_schedule='target_marginal_tv': sigma_schedule is eq. (3)'s decay (sigmoid, constant or "
                "linear); to hold a noise-averaged first-token TV set target_marginal_tv to its value before "
                "annealing (the decay of sigma_schedule then anneals the target, not sigma)"
            )
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(
                f"sigma_schedule={self.kind!r} is an unknown schedule kind: use 'sigmoid' (eq. 3), 'constant' or 'linear'"
            )
        for name, v in (("schedule_gamma", self.gamma), ("schedule_k_mid", self.k_mid)):
            if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
        if self.gamma < 0:
            raise ValueError(
                f"schedule_gamma must be >= 0 (a negative gamma anneals backwards: the noise grows during "
                f"training), got {self.gamma}"
            )
        if self.k_mid < 0:
            raise ValueError(
                f"schedule_k_mid is the step where eq. (3) halves sigma and must be >= 0, got {self.k_mid}"
            )
        if self.unit not in SCHEDULE_UNITS:
            raise ValueError(f"schedule_unit must be 'optimizer_step' or 'generation', got {self.unit!r}")

    @classmethod
    def from_args(cls, args: Any, *, unit: str | None = None) -> Schedule:
        """From a config holding ``sigma_schedule``, ``schedule_gamma``, ``schedule_k_mid`` (and
        ``schedule_unit`` unless ``unit`` is given): ``NCGRPOConfig``, verl's ``ncgrpo:`` block."""
        return cls(
            kind=args.sigma_schedule,
            gamma=args.schedule_gamma,
            k_mid=args.schedule_k_mid,
            unit=unit if unit is not None else getattr(args, "schedule_unit", "optimizer_step"),
        )

    # -- the three annealed values ------------------------------------------------------------------
    def decay(self, k: int, K: int) -> float:
        """eq. (3)'s factor at step ``k`` of ``K`` (1 before the anneal, 0 after)."""
        return sigma_schedule(k, K, 1.0, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)  # type: ignore[arg-type]

    def sigma(self, k: int, K: int, sigma0: float) -> float:
        """``sigma_k`` of eq. (3)."""
        return sigma_schedule(k, K, sigma0, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)  # type: ignore[arg-type]

    def target(self, k: int, K: int, target_marginal_tv: float) -> float:
        """The target schedule's annealed target ``target_marginal_tv * decay_k``: eq. (3) anneals the
        noise's effect (the noise-averaged first-token TV) instead of its size."""
        return float(target_marginal_tv) * self.decay(k, K)

    def image_t(self, k: int, K: int, image_noise_step: int) -> int:
        """NoisyRollout's diffusion step at ``k``: ``int(image_noise_step * decay_k)``."""
        from ncgrpo.core.image_noise import image_noise_t

        return image_noise_t(k, K, image_noise_step, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)  # type: ignore[arg-type]

    def temperature(self, k: int, K: int, temperature: float, t0: float) -> float:
        """The first-token control's temperature at ``k``: ``T + (T0 - T) * decay_k``, annealed to the
        sampling temperature ``T`` exactly as ``sigma_k`` anneals to 0."""
        t = float(temperature)
        return t + (float(t0) - t) * self.decay(k, K)

    # -- what k counts ------------------------------------------------------------------------------
    def position(
        self,
        global_step: int,
        max_steps: int,
        *,
        steps_per_generation: int = 1,
        gradient_accumulation_steps: int = 1,
    ) -> tuple[int, int]:
        """``(k, K)`` of eq. (3) for the generation that feeds optimizer step ``global_step + 1``.

        ``unit="optimizer_step"``: ``k = global_step + 1``, ``K = max_steps``. ``"generation"``: one
        rollout batch feeds ``m = steps_per_generation / gradient_accumulation_steps`` optimizer steps
        (TRL generates once per ``steps_per_generation`` micro-batches), so ``k = global_step // m + 1``
        and ``K = ceil(max_steps / m)``: NoisyRollout's count, where a step is one rollout batch (512
        prompts) updated in several mini-batches (4 x 128).
        """
        step = int(global_step)
        K = max(int(max_steps), 1)
        if self.unit == "optimizer_step":
            return step + 1, K
        m = max(1, int(steps_per_generation) // max(1, int(gradient_accumulation_steps)))
        return step // m + 1, max(1, math.ceil(K / m))

    def anneals_before(self, K: int | None) -> bool:
        """Whether the sigmoid's midpoint lies within ``K`` steps (False: it never anneals in this run)."""
        return not (self.kind == "sigmoid" and K is not None and K > 0 and self.k_mid > K)
