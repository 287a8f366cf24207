"""What the trainer measures at the branch point and records per generation: the lm_head
capture and prefill hooks, the first-token TV / agreement / noise-averaged TV metrics
(``noise/*``), the first-token temperature calibration, :class:`StepRecord`."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field

import torch

from ncgrpo.core import noise as nz
from ncgrpo.core.plan import (
    NOISE_MODE,
    SIGMA_METHODS,
    RowPlan,
)

IS_RATIO_USED = "sampling/importance_sampling_ratio_used"


def importance_ratio_stats(ratio: torch.Tensor, mask: torch.Tensor, *, sequence_level: bool) -> torch.Tensor:
    """``[min, mean, max]`` of the importance-sampling ratios the loss multiplies by (after NC-GRPO's
    noisy-row policy), over the entries TRL's ``sampling/importance_sampling_ratio/*`` take: every row
    of a sequence-level ratio (``# [B, 1]``), the ``mask``-ed completion tokens of a token-level one
    (``# [B, T]``). Zeros when there is none (TRL's convention). ``# [3]``"""
    flat = ratio.flatten() if sequence_level else ratio[mask.bool()]
    flat = flat.detach().float()
    if flat.numel() == 0:
        return torch.zeros(3)
    return torch.stack([flat.min(), flat.mean(), flat.max()]).cpu()


@dataclass
class StepRecord:
    """What NC-GRPO did at one generation (kept in ``trainer.nc_history``; identical on every rank).

    ``rows``: the global plan (:meth:`RowPlan.as_tuple` per global row); ``local_rows``: the plan this
    rank's hook applied (its slice of ``rows``); ``rewards`` / ``advantages``: the global weighted
    rewards and the advantages TRL trains on; ``rel``: the measured relative perturbation per global
    row (0 on clean rows; on the vLLM path measured by the trainer's own prompt-only pass), all in global
    row order.
    """

    step: int
    total_steps: int
    sigma_k: float
    image_t: int | None
    rows: list[tuple]
    rewards: list[float]
    advantages: list[float]
    local_rows: list[tuple] = field(default_factory=list)
    rel: list[float] = field(default_factory=list)
    mu_norm: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class _LocalGen:
    """Per-generation scratch filled in ``_generate_single_turn`` (local rows only)."""

    step: int
    total_steps: int
    sigma_k: float
    plans: list[RowPlan]
    schedule_k: int = 0  # k of eq. (3) in `schedule_unit`
    image_t: int | None = None
    first_token_temperature: float | None = None  # the control's T_k
    rel: torch.Tensor | None = None  # [L]
    branch_argmax: torch.Tensor | None = None  # [L] argmax of the logits at the branch point
    branch_marginal: torch.Tensor | None = None  # [L] TV(q, q_bar) on each group's first noisy row, else NaN
    branch_tv: torch.Tensor | None = None  # [L] first-token TV vs the clean partner (NaN: clean row)
    branch_agreement: torch.Tensor | None = None  # [L] eq. (4) on first-token distributions
    first_token: torch.Tensor | None = None  # [L]
    gen_pixel_values: torch.Tensor | None = None  # what generate saw (image method; for tests)


class BranchPointMetrics:
    """The branch-point measurements of :class:`~ncgrpo.trainer.NCGRPOTrainer` (a mixin)."""

    def _nc_unwrapped_model(self):
        """``accelerator.unwrap_model(self.model)``, looked up again only when ``self.model`` is another
        object: accelerate walks every submodule (and asks importlib about DeepSpeed) on each call, ~0.1 ms
        of every generation at the tiny sizes."""
        cached = getattr(self, "_nc_unwrap_cache", None)
        if cached is None or cached[0] is not self.model:
            cached = self._nc_unwrap_cache = (self.model, self.accelerator.unwrap_model(self.model))
        return cached[1]

    def _calibrate_first_token_t0(self, plans: list[RowPlan], prompt_ids, multimodal_fields) -> float:
        """``first_token_temperature_auto``: one clean prompt-only pass of the local rows, then per prompt the
        noise-averaged first-token TV of latent noise at ``sigma0`` (:mod:`ncgrpo.core.marginal`,
        ``max(marginal_tv_draws, 64)`` draws through the LM head) and the ``T0`` whose first-token TV on those
        prompts equals its mean (:func:`ncgrpo.core.agreement.match_first_token_temperature`). Each process
        calibrates on its own prompts; the values are averaged over processes so every rank uses one T0."""
        from ncgrpo.core.agreement import match_first_token_temperature
        from ncgrpo.core.marginal import branch_eps, marginal_estimate, marginal_keys, noisy_probs

        a = self.args
        T = float(self.temperature)
        first = {}
        for i, p in enumerate(plans):
            first.setdefault(p.group, i)
        rows = sorted(first.values())

        def marginal_tvs(head, logits, states) -> list[float]:  # inside the head's forward (ZeRO-3)
            tvs = []
            for i in rows:
                keys = marginal_keys(
                    self.noise_base_seed, 0, plans[i].prompt_id, max(a.marginal_tv_draws, 64)
                )
                eps = branch_eps(keys, states.shape[-1])
                draws = noisy_probs(head, states[i], eps, a.sigma0, temperature=T)
                clean = torch.softmax(logits[i].float() / T, -1)
                tvs.append(marginal_estimate(clean, draws.to(clean.device), seed=i).tv)
            return tvs

        model = self._nc_unwrapped_model()
        with self._nc_branch_point_hooks(model, [nz.RowNoise()] * len(plans), marginal_tvs) as (_, point):
            self._nc_prefill_only(prompt_ids, multimodal_fields)
        logits, tvs = point.logits, point.extra
        target = min(max(sum(tvs) / len(tvs), 0.0), 1.0)
        t0 = match_first_token_temperature(logits[rows].float().cpu(), target, temperature=T)
        both = self._gather(torch.tensor([[t0, target]], dtype=torch.float64))  # [processes, 2]
        t0, target = (float(x) for x in both.mean(0))
        if self.accelerator.is_main_process:
            print(
                f"ncgrpo: first_token_temperature_auto: T0 = {t0:.4f} (noise-averaged first-token TV {target:.4f} "
                f"of latent noise at sigma0 = {a.sigma0:g} on {len(rows)} prompts per process)"
            )
        return t0

    @contextmanager
    def _nc_branch_point_hooks(self, model, rows: list, on_branch=None):
        """Around one prefill of ``model`` (``generate``'s first forward): eq. (2) on ``rows``
        (:func:`ncgrpo.engines.transformers.prefill_noise` with this run's site, positions and SPSA's ``mu``)
        and the last-position logits of that forward (the branch point), read by an ``lm_head`` hook
        inside the forward so it also works where weights are only gathered during generate (ZeRO-3).
        Yields ``(hook, point)``: after the prefill ``point.logits`` holds ``[L, V]`` float32 logits and
        ``point.states`` the LM head's input at that position ``[L, d]`` (model dtype; the clean
        final-norm state on clean rows), and ``point.extra`` what ``on_branch(head, logits, states)`` returned
        inside the head's forward; see :func:`ncgrpo.engines.branch_point.branch_point_capture`."""
        from ncgrpo.engines.branch_point import branch_point_capture
        from ncgrpo.engines.transformers import prefill_noise

        a = self.args
        with ExitStack() as stack:
            point = stack.enter_context(branch_point_capture(model, on_branch))
            hook = stack.enter_context(
                prefill_noise(
                    model,
                    rows,
                    site=a.noise_site_parsed,
                    layer_decay=a.noise_layer_decay,
                    steer=self.spsa_mu,
                    positions=a.noise_positions,
                )
            )
            yield hook, point

    def _nc_record_branch_point(self, gen: _LocalGen, hook, point, *, control=None) -> None:
        """Fill ``gen.rel`` / ``branch_argmax`` / ``branch_tv`` / ``branch_agreement`` /
        ``branch_marginal`` from one prefill under :meth:`_nc_branch_point_hooks` (both engines' paths go
        through here). ``control``: the ``first_token_marginal`` hook, whose rewritten rows are what its
        noisy rows sampled from."""
        if hook.records:
            gen.rel = hook.records[0].rel.float()  # the prefill
        if point.logits is not None:
            logits = point.logits
            gen.branch_argmax = logits.argmax(-1).cpu()
            noisy_logits = None
            if control is not None and control.last_logits is not None:
                noisy_logits = control.last_logits.to(logits.device)
            gen.branch_tv, gen.branch_agreement = self._branch_point_stats(
                gen.plans, logits, gen.first_token_temperature, noisy_logits=noisy_logits
            )
            gen.branch_marginal = point.extra  # _branch_point_marginal, run inside the head's forward

    def _branch_point_marginal(
        self, gen: _LocalGen, head, logits: torch.Tensor, states: torch.Tensor
    ) -> torch.Tensor | None:
        """``TV(q, q_bar)`` per group with a clean row on this rank, on the group's first noisy row (NaN
        elsewhere): the distribution the noisy half's first tokens are sampled from
        (:mod:`ncgrpo.core.marginal`). Hidden-noise methods at the final-norm site and
        ``first_token_marginal``: ``marginal_tv_draws`` draws ``NoiseKey(seed, step, prompt_id, -1 - m)``
        (the row's own noise mode and SPSA's ``mu``) through the LM head on the clean partner's state,
        bootstrap bias-corrected; the temperature control: exact (its q_bar is ``softmax(z / T_k)``).
        None where it is not defined this way (image method, layer sites) or ``marginal_tv_draws=0``.
        Runs inside the LM head's forward (``on_branch`` of :meth:`_nc_branch_point_hooks`; ``head`` its
        weights as a function), where ZeRO-3 has them gathered."""
        from ncgrpo.core.agreement import first_token_tv
        from ncgrpo.core.marginal import branch_eps, marginal_keys, marginal_tv, noisy_probs

        a = self.args
        T = float(self.temperature)
        out = torch.full((len(gen.plans),), float("nan"))
        clean_of: dict[int, int] = {}
        first_noisy: dict[int, int] = {}
        for i, p in enumerate(gen.plans):
            (first_noisy if p.noisy else clean_of).setdefault(p.group, i)
        pairs = [(i, clean_of[g]) for g, i in first_noisy.items() if g in clean_of]
        if not pairs:
            return None
        if self.method == "first_token_temperature":
            idx, cidx = [i for i, _ in pairs], [c for _, c in pairs]
            z = logits[cidx]
            out[idx] = first_token_tv(z, z, t_a=gen.first_token_temperature, t_b=T).cpu()
            return out
        final_norm = a.noise_site_parsed == "final_norm"
        if self.method not in SIGMA_METHODS or not final_norm or a.marginal_tv_draws < 1:
            return None
        if gen.sigma_k <= 0:
            out[[i for i, _ in pairs]] = 0.0
            return out
        mode = NOISE_MODE.get(self.method, "independent")
        steer = self.spsa_mu if self.method == "spsa" else None
        M = a.marginal_tv_draws
        noisy = [gen.plans[i] for i, _ in pairs]
        # every pair's draws in one call: P * M keyed eps, through the head on the clean partners' states
        keys = [k for p in noisy for k in marginal_keys(p.key.seed, p.key.step, p.prompt_id, M)]
        eps = branch_eps(keys, states.shape[-1], mode)  # [P * M, d]
        cidx = torch.tensor([c for _, c in pairs])
        h = states[cidx.to(states.device)].repeat_interleave(M, 0)  # [P * M, d]
        draws = noisy_probs(head, h, eps, gen.sigma_k, temperature=T, steer=steer)  # [P * M, V]
        clean = torch.softmax(logits[cidx.to(logits.device)].float() / T, -1)  # [P, V]
        draws = draws.to(clean.device).view(len(pairs), M, -1)
        tv = marginal_tv(clean, draws, bootstrap=32, seeds=[p.prompt_id for p in noisy])  # [P]
        out[[i for i, _ in pairs]] = tv.float()
        return out

    def _branch_point_stats(
        self,
        plans: list[RowPlan],
        logits: torch.Tensor,
        noisy_temperature: float | None,
        *,
        noisy_logits: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per local row: TV between its first-token distribution and its clean partner's, and eq. (4)'s
        kernel on the two (:mod:`ncgrpo.core.agreement`); NaN on clean rows and on noisy rows whose
        group has no clean row on this rank. The control's noisy rows sample at their first-token
        temperature, the rest at the sampling temperature; ``noisy_logits`` (``first_token_marginal``): the
        rows' rewritten logits, what they sampled from."""
        from ncgrpo.core.agreement import agreement_of_probs, tv_of_probs

        T = float(self.temperature)
        tv = torch.full((len(plans),), float("nan"))
        agree = torch.full((len(plans),), float("nan"))
        clean_of: dict[int, int] = {}
        for i, p in enumerate(plans):
            if not p.noisy:
                clean_of.setdefault(p.group, i)
        pairs = [(i, clean_of[p.group]) for i, p in enumerate(plans) if p.noisy and p.group in clean_of]
        if not pairs:
            return tv, agree
        idx = torch.tensor([i for i, _ in pairs])
        cidx = torch.tensor([c for _, c in pairs])
        # one softmax of every row at T (row-wise: each row's values are those of its own softmax), read
        # by both statistics: the clean partners' p and, unless rewritten, the noisy rows' q
        probs = torch.softmax(logits.float() / T, -1)
        p, q = probs[cidx.to(probs.device)], probs[idx.to(probs.device)]
        if noisy_temperature is not None:  # the control: the noisy rows' logits are the clean ones, rescaled
            clean_z = logits[cidx.to(logits.device)]
            q = torch.softmax((clean_z * (T / noisy_temperature)).float() / T, -1)
        if noisy_logits is not None:
            q = torch.softmax(noisy_logits[idx.to(noisy_logits.device)].float() / T, -1)
        tv[idx] = tv_of_probs(q, p).cpu()  # first_token_tv(noisy, clean) at T
        agree[idx] = agreement_of_probs(p, q).cpu()  # branch_point_agreement(clean, noisy) at T
        return tv, agree
