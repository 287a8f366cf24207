"""``first_token_temperature``: a control. The noisy half gets no hidden noise but samples its first token
at ``T_k``, ``first_token_temperature`` annealed to the sampling temperature ``T`` on eq. (3)'s decay
(:meth:`ncgrpo.core.schedule.Schedule.temperature`). Match ``first_token_temperature`` on the MARGINAL
first-token TV (``ncgrpo probe``'s ``matched T0``), or let ``first_token_temperature_auto`` calibrate it at
the first generation (kept in checkpoints)."""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

from ncgrpo.core.plan import RowPlan
from ncgrpo.engines.controls import first_token_temperature
from ncgrpo.engines.vllm import control_extra_args
from ncgrpo.methods.base import RolloutMethod, TrainerView, read_state, register_method


@dataclass
class ControlState:
    """The temperature control's state (``tr.nc_state``): ``t0``, the calibrated starting temperature
    (``first_token_temperature_auto``; None until the first generation calibrates it)."""

    t0: float | None = None


@register_method
class FirstTokenTemperature(RolloutMethod):
    name = "first_token_temperature"
    target_refusal = (
        "the control's noisy half is set by its first-token temperature T_k, not by a sigma (match T0 to a "
        "TV with ncgrpo probe's matched T0)"
    )
    summary = "control: the noisy half samples its first token at an annealed higher temperature"
    label = "First-token"
    slug = "first-token"
    key_rule = "none"
    marginal = "temperature"
    needs_sampling_temperature = True
    anneals = "the first-token temperature stays near first_token_temperature"
    verl_refusal = None

    def card_settings(self, args: Any) -> list[str]:
        t0 = " calibrated at the first generation" if args.first_token_temperature_auto else ""
        return [f"first_token_temperature {args.first_token_temperature}{t0}"]

    def demo_run(
        self, cfg: Any, sigma0: float, *, target: float | None = None
    ) -> tuple[str, str, dict[str, Any]]:
        """The demo's control row, named by its starting temperature."""
        t0 = cfg.first_token_temperature
        return f"{self.label} T0={t0:g}", f"{self.slug}-t{t0:g}", {"first_token_temperature": t0}

    def t0(self, tr: TrainerView) -> float:
        """The starting temperature: the calibrated one with ``first_token_temperature_auto``."""
        return float(tr.nc_state.t0 if tr.nc_state.t0 is not None else tr.args.first_token_temperature)

    def temperature_at(self, tr: TrainerView, k: int, K: int) -> float:
        """``T_k = T + (T0 - T) * decay_k`` (:meth:`ncgrpo.core.schedule.Schedule.temperature`): annealed to
        the sampling temperature exactly as ``sigma_k`` anneals to 0."""
        return tr.schedule.temperature(k, K, tr.temperature, self.t0(tr))

    def begin_generation(
        self, tr: TrainerView, gen: Any, k: int, K: int, prompt_ids: Any, multimodal_fields: dict
    ) -> None:
        """Calibrates ``tr.nc_state.t0`` once (``first_token_temperature_auto``, on this generation's
        prompts) and sets ``gen.method_values["first_token_temperature"]`` to ``T_k``."""
        gen.sigma_k = 0.0
        if tr.args.first_token_temperature_auto and tr.nc_state.t0 is None:
            tr.nc_state.t0 = tr.calibrate_first_token_t0(gen.plans, prompt_ids, multimodal_fields)
        gen.method_values["first_token_temperature"] = self.temperature_at(tr, k, K)

    def noisy_first_token_temperature(self, tr: TrainerView, gen: Any) -> float:
        """``T_k``: the branch-point metrics measure the noisy rows at it."""
        return gen.method_values["first_token_temperature"]

    def generation_hooks(self, tr: TrainerView, gen: Any, model: Any, stack: ExitStack) -> None:
        """The noisy rows' first-token logits times ``T / T_k`` (:func:`ncgrpo.engines.controls.first_token_temperature`);
        the metrics read its effect from :meth:`noisy_first_token_temperature`."""
        stack.enter_context(
            first_token_temperature(
                model,
                [p.noisy for p in gen.plans],
                temperature=tr.temperature,
                first_token_temperature=self.noisy_first_token_temperature(tr, gen),
            )
        )

    def vllm_logit_scales(self, tr: TrainerView, gen: Any) -> list[float | None]:
        scale = float(tr.temperature) / self.noisy_first_token_temperature(tr, gen)
        return [scale if p.noisy else None for p in gen.plans]

    def verl_extra_args(self, cfg: Any, plan: RowPlan, step: int, temperature: float) -> tuple[float, dict]:
        """The noisy half's first-token logits times ``T / T_k``, no hidden noise."""
        if not temperature > 0:
            raise ValueError(
                f"rollout_method={self.name!r} needs a sampling temperature > 0, got {temperature}"
            )
        t_k = cfg.first_token_temperature_at(step, temperature)
        return 0.0, control_extra_args(float(temperature) / t_k)

    def metrics(self, tr: TrainerView, gen: Any) -> dict[str, float]:
        out = {"control/first_token_temperature": float(self.noisy_first_token_temperature(tr, gen))}
        if tr.nc_state.t0 is not None:
            out["control/first_token_temperature_t0"] = float(tr.nc_state.t0)
        return out

    def init_state(self, tr: TrainerView) -> ControlState:
        return ControlState()

    def state_dict(self, tr: TrainerView) -> dict[str, Any]:
        return {"first_token_temperature_t0": tr.nc_state.t0}

    def load_state_dict(self, tr: TrainerView, path: str) -> None:
        """With ``first_token_temperature_auto``, the calibrated T0 (a resumed run must not calibrate
        again on another batch)."""
        if not tr.args.first_token_temperature_auto:
            return
        t0 = (read_state(path) or {}).get("first_token_temperature_t0")
        if t0 is None:
            raise ValueError(
                f"{path} holds no calibrated first_token_temperature_t0, so the resumed run would calibrate T0 "
                "again on another batch; resume from a checkpoint of this run, or set first_token_temperature "
                "by hand"
            )
        tr.nc_state.t0 = float(t0)
