"""``spsa``: antithetic pairs of rank-one noise ``eps_t = r_t u_k`` plus the steering vector ``mu`` (eq. 6)
on every noisy prefill; after rewards ``mu <- Pi(mu + spsa_lr * g)``, ``g`` from the pairs' reward gaps
weighted by their branch-point scalar ``r_p`` (:func:`ncgrpo.core.spsa.spsa_step`). Every rank runs the
update on the same gathered rewards, so ``mu`` stays identical across processes; it is saved in
checkpoints (``ncgrpo_state.pt``) and restored."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ncgrpo.core.plan import RowPlan
from ncgrpo.core.spsa import spsa_step
from ncgrpo.methods.antithetic import Antithetic
from ncgrpo.methods.base import TrainerView, read_state, register_method


@dataclass
class SpsaState:
    """SPSA's state (``tr.nc_state``): the steering vector ``mu`` of eq. (6), float32 ``[hidden]``."""

    mu: torch.Tensor


@register_method
class Spsa(Antithetic):
    name = "spsa"
    target_refusal = (
        "SPSA's update (eq. 6) divides by sigma_k and stops below spsa_min_sigma_ratio * sigma0, so a "
        "solved sigma_k would change what the steering vector learns; untested, so refused"
    )
    summary = "antithetic rank-one noise plus a steering vector mu learned by SPSA (eq. 6)"
    label = "SPSA"
    slug = "spsa"
    noise_mode = "rank_one"
    final_norm_only = (
        "steers along the rank-one direction u_k of the final-norm state (eq. 6); a layer site would perturb "
        "decoder-layer inputs with per-layer draws, so the perturbation and the mu update would use different "
        "directions"
    )
    verl_refusal = (
        "eq. (6) updates the steering vector mu from each step's pair rewards on the trainer and must send it "
        "to every agent-loop worker before the next step's rollouts; that round trip is not built for verl. Use "
        "ncgrpo's TRL trainer for the SPSA probe"
    )

    def card_settings(self, args: Any) -> list[str]:
        return [f"spsa_lr {args.spsa_lr}, spsa_mu_max {args.spsa_mu_max}", *super().card_settings(args)]

    def steer(self, tr: TrainerView) -> Any:
        return tr.nc_state.mu

    def init_state(self, tr: TrainerView) -> SpsaState:
        """``mu``: zeros of the hidden size."""
        return SpsaState(torch.zeros(tr.hidden_size(), dtype=torch.float32))

    def after_rewards(
        self, tr: TrainerView, gen: Any, plans: list[RowPlan], rewards: Any, metrics: dict[str, float]
    ) -> None:
        """Logs and records (``gen.method_values["mu_norm"]``) ``spsa/mu_norm`` before this step's update,
        logs ``spsa/updated``; updates ``tr.nc_state.mu``."""
        mu_norm = float(torch.linalg.vector_norm(tr.nc_state.mu))
        metrics["spsa/mu_norm"] = gen.method_values["mu_norm"] = mu_norm
        metrics["spsa/updated"] = float(self.update(tr, plans, rewards, gen.sigma_k, gen.step))

    @staticmethod
    def update(tr: TrainerView, plans: list[RowPlan], rewards: torch.Tensor, sigma_k: float, k: int) -> bool:
        """eq. (6): ``mu <- Pi(mu + eta * g)`` from the antithetic reward gaps of this step
        (:func:`ncgrpo.core.spsa.spsa_step`); returns whether ``mu`` was updated.

        No update once ``sigma_k < spsa_min_sigma_ratio * sigma0``: the two-point estimate divides the
        reward gap by ``2 sigma_k``, and the gap between two long stochastic decodes does not shrink with
        the perturbation, so as the schedule anneals ``sigma_k`` to ~1e-5 the step ``eta * g`` grows
        like ``1 / sigma_k`` (19, 535 and 2.3e4 at k = 45, 50, 60 of the paper's schedule against
        ``mu_max = 1``) and throws ``mu`` to the ball's edge along that step's random direction.
        """
        a = tr.args
        if not sigma_k > 0 or sigma_k < a.spsa_min_sigma_ratio * a.sigma0:
            return False
        max_step = None if a.spsa_max_step_ratio is None else a.spsa_max_step_ratio * a.spsa_mu_max
        mu = spsa_step(
            tr.nc_state.mu, plans, rewards, sigma_k, seed=tr.noise_base_seed, step=k, lr=a.spsa_lr,
            mu_max=a.spsa_mu_max, max_step=max_step,
        )  # fmt: skip
        if mu is None:
            return False
        tr.nc_state.mu = mu
        return True

    def state_dict(self, tr: TrainerView) -> dict[str, Any]:
        return {"spsa_mu": tr.nc_state.mu}

    def load_state_dict(self, tr: TrainerView, path: str) -> None:
        state = read_state(path)
        if state is None:
            raise FileNotFoundError(
                f"{path} is missing: this checkpoint was not written by an NC-GRPO spsa run, so the steering vector "
                "mu cannot be restored"
            )
        if state.get("spsa_mu") is None:
            raise ValueError(
                f"{path} holds no spsa_mu (written by rollout_method={state.get('rollout_method')!r})"
            )
        tr.nc_state.mu = state["spsa_mu"].float()
