"""eq. (3)'s decay, all of it in one file: the schedule kinds (:data:`SCHEDULE_KINDS`, one decay
function each), the two annealed values the paper defines from them (:func:`sigma_schedule`,
:func:`image_noise_t`) and one schedule object for everything eq. (3) anneals: the noise scale ``sigma_k``
(or, with ``target_marginal_tv``, the noise-averaged first-token TV that ``sigma_k`` is solved for),
NoisyRollout's diffusion step ``t`` and the first-token control's temperature ``T_k``.

The paper anneals ``sigma_k = sigma0 * decay_k`` with NoisyRollout's sigmoid decay (eq. 3). The image
baseline anneals its diffusion step by the same factor (``t_k = int(t0 * decay_k)``, NoisyRollout's own
rule) and the first-token-temperature control its temperature (``T_k = T + (T0 - T) * decay_k``, so it
reaches the sampling temperature exactly when ``sigma_k`` reaches 0). :class:`Schedule` holds the four
settings that define ``decay_k`` (``kind``, ``gamma``, ``k_mid`` and the ``unit`` that ``k`` counts) and
gives all three values, so the trainer, the image method, the temperature control, the verl integration
and the probe cannot disagree.

A new kind is one function here, registered with :func:`schedule_kind` (validation, messages and the
``sigma_schedule`` setting read :data:`SCHEDULE_KINDS`), and its test in tests/core/test_schedule.py.
Pure Python: imports nothing from ncgrpo (the noise and image-noise modules import from here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "NUM_DIFFUSION_STEPS",
    "SCHEDULE_KINDS",
    "SCHEDULE_UNITS",
    "Decay",
    "Schedule",
    "image_noise_t",
    "kinds_text",
    "schedule_kind",
    "sigma_schedule",
]

#: A schedule kind: eq. (3)'s factor at step ``k`` (1-based) of ``K``, from the settings ``gamma`` and
#: ``k_mid``; 1 keeps the full noise, 0 none.
Decay = Callable[[int, int, float, float], float]

#: The schedule kinds by name, in the order messages list them: the one list (a kind not here is
#: refused, naming these). ``SCHEDULE_NOTES`` says what each is for, where that helps a reader.
SCHEDULE_KINDS: dict[str, Decay] = {}
SCHEDULE_NOTES: dict[str, str] = {}

#: What ``k`` counts: TRL optimizer steps, or rollout batches (NoisyRollout's / EasyR1's / verl's step).
SCHEDULE_UNITS = ("optimizer_step", "generation")

#: Length of NoisyRollout's diffusion schedule: the image method's ``t`` lies in ``[0, 999]``.
NUM_DIFFUSION_STEPS = 1000


def schedule_kind(name: str, note: str = "") -> Callable[[Decay], Decay]:
    """Register the decorated function as the schedule kind ``name`` (``note``: what it is for, shown
    in messages, e.g. ``"eq. 3"``). A name already taken is refused."""

    def register(decay: Decay) -> Decay:
        if name in SCHEDULE_KINDS:
            raise ValueError(f"schedule kind {name!r} is already registered")
        SCHEDULE_KINDS[name] = decay
        if note:
            SCHEDULE_NOTES[name] = note
        return decay

    return register


def kinds_text() -> str:
    """The kinds as messages and help texts list them: ``'sigmoid' (eq. 3), 'constant' or 'linear'``."""
    names = [f"{k!r} ({SCHEDULE_NOTES[k]})" if k in SCHEDULE_NOTES else repr(k) for k in SCHEDULE_KINDS]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


@schedule_kind("sigmoid", note="eq. 3")
def _sigmoid(k: int, K: int, gamma: float, k_mid: float) -> float:
    """``1 - sigmoid(gamma * (k - k_mid) / K)``, exactly NoisyRollout's decay (``1 - sigmoid(gamma *
    (k/K - k_mid/K))``); with gamma=30, k_mid=40, K=60 it is ~1 until step ~30, 0.5 at step 40 and
    ~0.007 at step 50."""
    z = gamma * (k - k_mid) / K
    # 1 - sigmoid(z) == sigmoid(-z); written this way it never overflows.
    if z >= 0:
        e = math.exp(-z)
        return e / (1.0 + e)
    return 1.0 / (1.0 + math.exp(z))


@schedule_kind("constant")
def _constant(k: int, K: int, gamma: float, k_mid: float) -> float:
    """1 at every step (ablation)."""
    return 1.0


@schedule_kind("linear")
def _linear(k: int, K: int, gamma: float, k_mid: float) -> float:
    """``1 - k / K``, reaching 0 at the last step (ablation)."""
    return max(0.0, 1.0 - k / K)


def _decay_of(kind: str) -> Decay:
    try:
        return SCHEDULE_KINDS[kind]
    except (KeyError, TypeError):
        raise ValueError(f"unknown schedule kind {kind!r}; use {kinds_text()}") from None


def sigma_schedule(
    step: int,
    total_steps: int,
    sigma0: float,
    *,
    kind: str = "sigmoid",
    gamma: float = 30.0,
    k_mid: float = 40.0,
) -> float:
    """Noise scale ``sigma_k = sigma0 * decay_k`` at training step ``k`` (1-based), eq. (3).

    ``kind``: one of :data:`SCHEDULE_KINDS`: ``sigmoid`` (eq. 3, NoisyRollout's annealing),
    ``constant`` (``sigma0`` at every step) or ``linear`` (``sigma0 * (1 - k / K)``), the ablations.
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if sigma0 < 0 or not math.isfinite(sigma0):
        raise ValueError(f"sigma0 must be a finite number >= 0, got {sigma0}")
    return float(sigma0 * _decay_of(kind)(step, total_steps, gamma, k_mid))


def image_noise_t(
    step: int,
    total_steps: int,
    image_noise_step: int = 500,
    *,
    kind: str = "sigmoid",
    gamma: float = 30.0,
    k_mid: float = 40.0,
) -> int:
    """NoisyRollout's diffusion step for training step ``step``: ``int(image_noise_step * decay)``.

    ``decay`` is eq. (3)'s factor (:func:`sigma_schedule` with ``sigma0=1``), NoisyRollout's annealing:
    with gamma=30, k_mid=40, K=60 and image_noise_step=500, t is 499 (decay is just below 1) through
    step ~25, 496 at step 30, 250 at step 40, 3 at step 50 and 0 at step 60.
    """
    if not 0 <= image_noise_step <= NUM_DIFFUSION_STEPS - 1:
        raise ValueError(
            f"image_noise_step must be in [0, {NUM_DIFFUSION_STEPS - 1}], got {image_noise_step}"
        )
    decay = sigma_schedule(step, total_steps, 1.0, kind=kind, gamma=gamma, k_mid=k_mid)
    return int(image_noise_step * decay)


@dataclass(frozen=True)
class Schedule:
    """eq. (3)'s decay ``decay_k`` and what it anneals.

    ``kind``: one of :data:`SCHEDULE_KINDS`: ``sigmoid`` (eq. 3: ``1 - sigmoid(gamma * (k - k_mid) / K)``),
    ``constant`` (1) or ``linear`` (``1 - k / K``). ``unit``: what ``k`` and ``K`` count (:meth:`position`). Invalid values
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
                f"sigma_schedule='target_marginal_tv': sigma_schedule is eq. (3)'s decay ({kinds_text()}); to hold a noise-averaged first-token TV set target_marginal_tv to its value before "
                "annealing (the decay of sigma_schedule then anneals the target, not sigma)"
            )
        if self.kind not in SCHEDULE_KINDS:
            raise ValueError(f"sigma_schedule={self.kind!r} is an unknown schedule kind: use {kinds_text()}")
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
        return sigma_schedule(k, K, 1.0, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)

    def sigma(self, k: int, K: int, sigma0: float) -> float:
        """``sigma_k`` of eq. (3)."""
        return sigma_schedule(k, K, sigma0, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)

    def target(self, k: int, K: int, target_marginal_tv: float) -> float:
        """The target schedule's annealed target ``target_marginal_tv * decay_k``: eq. (3) anneals the
        noise's effect (the noise-averaged first-token TV) instead of its size."""
        return float(target_marginal_tv) * self.decay(k, K)

    def image_t(self, k: int, K: int, image_noise_step: int) -> int:
        """NoisyRollout's diffusion step at ``k``: ``int(image_noise_step * decay_k)``."""
        return image_noise_t(k, K, image_noise_step, kind=self.kind, gamma=self.gamma, k_mid=self.k_mid)

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
