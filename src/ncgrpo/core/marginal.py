"""The noise-averaged first-token distribution: what the noisy half of a group actually samples from.

Proposition (first-token marginal; docs/equations.md). At the final-norm site the perturbation of
eq. (2) reaches only the logits of the last prompt position (section 3.1): the KV cache is written from
clean activations, so after the first token every branch decodes from the clean cache exactly as a
clean row does. A noisy row with its own draw ``eps`` therefore samples its first token from
``q_eps = softmax(head(h + sigma ||h|| / sqrt(d) eps) / T)`` and the rest as a clean row would. With
independent draws (``latent``) the noisy rows of a group are independent given the prompt, and each
row's first token is distributed as the mixture

    q_bar = E_eps[q_eps]

so the noisy half is, in distribution, ``n`` rows that sample their first token from ``q_bar`` and
continue clean: NC-GRPO at this site is GRPO whose noisy half starts from ``q_bar``. Antithetic pairs
keep each row's marginal (``-eps ~ eps``) but correlate the two rows of a pair; SPSA's rank-one noise
shares the step's direction ``u`` across rows, and its steering offset ``mu`` shifts every draw, so
its marginal is ``E_r[softmax(head(h + (sigma r u + mu) ||h|| / sqrt(d)) / T)]``. The loss uses clean
log-probabilities, so the expected update depends on the noise only through ``q_bar`` (latent) or the
pair/step joint (antithetic, SPSA).

Consequences for measurement: per-draw distances such as the mean ``TV(q, q_eps)`` describe one draw,
not what the training data sees, and can be an order of magnitude larger than ``TV(q, q_bar)``. This
module computes the marginal, its Monte Carlo error, ``KL(q_bar || q)``, the temperature whose
first-token distribution is closest to ``q_bar``, and samples from ``q_bar`` directly (the
``first_token_marginal`` control).

Solving for the sigma whose marginal TV is a target (:func:`solve_sigma_for_marginal_tv`,
:class:`SigmaSolve`) lives in :mod:`ncgrpo.core.sigma_solve` and is re-exported here.

Pure torch; ``head`` is any callable from hidden states ``# [M, d]`` to logits ``# [M, V]`` (an
``lm_head`` module). No engine imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ncgrpo.core.agreement import tv_of_probs
from ncgrpo.core.noise import NoiseKey, NoiseMode, draw_eps_keys, perturb
from ncgrpo.core.sigma_solve import SigmaSolve, solve_sigma_for_marginal_tv

__all__ = [
    "MARGINAL_DRAW_BASE",
    "MarginalCurve",
    "MarginalEstimate",
    "MarginalTV",
    "antithetic_eps",
    "as_estimate",
    "control_coefficient",
    "estimate_from_units",
    "estimate_marginal_tv",
    "second_order_mean",
    "second_order_term",
    "t_quantile",
    "closest_temperature",
    "branch_eps",
    "marginal_estimate",
    "marginal_keys",
    "marginal_tv",
    "mixture_log_probs",
    "noisy_probs",
    "pool_keys",
    "SigmaSolve",
    "solve_sigma_for_marginal_tv",
]

Head = Callable[[torch.Tensor], torch.Tensor]

#: Draw indices of the extra eps used to estimate ``q_bar`` are negative (``-1 - m``), so they never
#: coincide with a rollout row's draw (``0 .. n-1``, :mod:`ncgrpo.core.plan`).
MARGINAL_DRAW_BASE = -1


def marginal_keys(seed: int, step: int, prompt_id: int, draws: int, *, offset: int = 0) -> list[NoiseKey]:
    """``draws`` keys for Monte Carlo draws of ``q_bar`` of one prompt: ``NoiseKey(seed, step, prompt_id,
    -1 - offset - m)``. Deterministic (a run's metric is reproducible) and disjoint from the rows' draws."""
    return [NoiseKey(seed, step, prompt_id, MARGINAL_DRAW_BASE - offset - m) for m in range(draws)]


def pool_keys(key: NoiseKey, draws: int) -> list[NoiseKey]:
    """The ``first_token_marginal`` control's pool for the row whose own key is ``key``: ``draws`` keys
    ``NoiseKey(seed, step, prompt_id, -2**40 - key.draw * draws - m)``, fresh per row and disjoint from
    the rows' draws and from :func:`marginal_keys`."""
    base = -(1 << 40) - key.draw * draws
    return [NoiseKey(key.seed, key.step, key.prompt_id, base - m) for m in range(draws)]


def branch_eps(keys: Sequence[NoiseKey], d: int, mode: NoiseMode = "independent") -> torch.Tensor:
    """The branch point's (last prompt position's) eps of each key, as the hook draws it
    (:func:`~ncgrpo.core.noise.draw_eps_keys`: the values of ``draw_eps(key, [0], d)``). ``# [M, d]``"""
    return draw_eps_keys(keys, 0, d, mode=mode)


@torch.no_grad()
def noisy_probs(
    head: Head,
    h: torch.Tensor,
    eps: torch.Tensor,
    sigma: float,
    *,
    temperature: float = 1.0,
    steer: torch.Tensor | None = None,
    chunk: int = 256,
) -> torch.Tensor:
    """``q_eps`` for each draw: ``softmax(head(h~_m) / T)`` with ``h~_m = perturb(h, eps_m, sigma, steer)``.

    ``h`` ``# [d]``: the clean state at the branch point (the final norm's output at the last prompt
    position), in the model's dtype, or ``# [M, d]``: one state per draw (several prompts' draws in one
    call); ``eps`` ``# [M, d]``. ``perturb`` is eq. (2)'s own function, so the perturbed states are
    bit-identical to the hook's. Returns ``# [M, V]`` float32.
    """
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    z = _logit_rows(head, h, eps, sigma, steer, chunk)
    return torch.softmax(z / temperature, dim=-1) if z.numel() else z


def antithetic_eps(keys: Sequence[NoiseKey], d: int, mode: NoiseMode = "independent") -> torch.Tensor:
    """The marginal estimate's draws: each key's branch-point eps (:func:`branch_eps`) followed by its
    negative, ``[e_1, -e_1, e_2, -e_2, ...]`` ``# [2 * len(keys), d]``. ``-eps ~ eps``, so every draw is
    still a draw of the noise; a pair's mean cancels every odd order of ``q_eps - q`` in eps, the
    first-order term among them, whose Monte Carlo error is what made the plain mean read small TVs high."""
    e = branch_eps(keys, d, mode)
    return torch.stack([e, -e], 1).reshape(2 * e.shape[0], d)


@torch.no_grad()
def _logit_rows(
    head: Head, h: torch.Tensor, eps: torch.Tensor, sigma: float, steer, chunk: int
) -> torch.Tensor:
    """``head(perturb(h, eps_m, sigma, steer))`` for each draw, float32. ``h`` ``# [d]`` or ``# [M, d]``."""
    if h.dim() == 2 and h.shape[0] != eps.shape[0]:
        raise ValueError(f"noisy_probs: {h.shape[0]} states for {eps.shape[0]} draws")
    out = []
    for lo in range(0, eps.shape[0], chunk):
        e = eps[lo : lo + chunk].to(h.device)
        hs = h.expand(e.shape[0], -1) if h.dim() == 1 else h[lo : lo + chunk]
        out.append(head(perturb(hs, e, float(sigma), steer=steer)).float())
    return torch.cat(out) if out else torch.empty(0, 0)


def second_order_term(p: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The second-order term of ``softmax(z + delta) - softmax(z)`` in ``delta``:
    ``Q_v = p_v / 2 * ((delta_v - p.delta)^2 - sum_u p_u delta_u^2 + (p.delta)^2)``. ``p`` ``# [P, V]``
    (``softmax(z)``), ``delta`` ``# [P, M, V]`` logit displacements (at the sampling temperature).
    ``# [P, M, V]`` in ``delta``'s floating dtype (float32 where it is: a correction term, its rounding
    far below the Monte Carlo error it removes)"""
    p = p.to(delta.device, delta.dtype)[:, None]
    pd = (p * delta).sum(-1, keepdim=True)
    centred = delta - pd
    return 0.5 * p * (centred * centred - (p * delta * delta).sum(-1, keepdim=True) + pd * pd)


@torch.no_grad()
def second_order_mean(
    p: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, chunk: int = 8192
) -> torch.Tensor:
    """``E[second_order_term(p, delta)]`` exactly, for ``delta = scale * W eps`` with ``eps ~ N(0, I_d)``
    (a linear LM head ``W`` ``# [V, d]``: then ``E[delta delta^T] = scale^2 W W^T``):

        E[Q_v] = scale^2 / 2 * p_v * (||W_v - m||^2 - sum_u p_u ||W_u - m||^2),   m = W^T p

    ``p`` ``# [P, V]``, ``scale`` ``# [P]`` (``sigma ||h|| / (sqrt(d) T)`` per prompt). ``O(V d)`` per prompt,
    one LM-head row's cost; ``W`` is read in ``chunk`` rows at a time in float32 (no float copy of a
    large head). ``# [P, V]`` float64 on ``p``'s device"""
    p64 = p.double()
    m = (p.to(weight.device, torch.float32) @ weight.float()) if weight.shape[0] <= chunk else None
    if m is None:
        m = torch.zeros(p.shape[0], weight.shape[1], dtype=torch.float32, device=weight.device)
        for lo in range(0, weight.shape[0], chunk):
            m += p[:, lo : lo + chunk].to(weight.device, torch.float32) @ weight[lo : lo + chunk].float()
    dist = []
    mm = (m * m).sum(-1, keepdim=True)  # [P, 1]
    for lo in range(0, weight.shape[0], chunk):
        w = weight[lo : lo + chunk].float()  # [c, d]
        dist.append(((w * w).sum(-1)[None] - 2.0 * (m @ w.T) + mm).double())  # [P, c] ||W_v - m||^2
    dist64 = torch.cat(dist, 1).to(p64.device)
    centred = dist64 - (p64 * dist64).sum(-1, keepdim=True)
    return 0.5 * scale.double().to(p64.device)[:, None] ** 2 * p64 * centred


@dataclass(frozen=True)
class MarginalTV:
    """``TV(q_i, q_bar_i)`` for ``P`` prompts from Monte Carlo draws (:func:`estimate_marginal_tv`).

    ``tv`` ``# [P]``: the estimate (float64, CPU); ``se``: its jackknife standard error (NaN with fewer
    than three units); ``plugin``: ``0.5 sum_v |mean of the units|`` before the bias correction;
    ``qbar`` ``# [P, V]``: the plain mean of the draws' distributions; ``per_draw``: the mean
    ``TV(q, q_eps)`` (what one draw does); ``units``: the units per prompt (antithetic pairs, or draws).
    The batch figures: :attr:`mean`, :attr:`mean_se` (the prompts' errors are independent) and
    :attr:`half_width`, the 95% interval's half-width (Student's t on ``units - 1`` degrees of freedom,
    the ``±`` every command prints)."""

    tv: torch.Tensor
    se: torch.Tensor
    plugin: torch.Tensor
    qbar: torch.Tensor
    per_draw: torch.Tensor
    units: int

    @property
    def mean(self) -> float:
        return float(self.tv.mean())

    @property
    def mean_se(self) -> float:
        return float(self.se.pow(2).sum().sqrt() / self.se.numel())

    @property
    def half_width(self) -> float:
        return t_quantile(self.units) * self.mean_se


def t_quantile(units: int) -> float:
    """Student's t 0.975 quantile on ``units - 1`` degrees of freedom (NaN below two units): the factor
    from a jackknife standard error over ``units`` units to a 95% interval's half-width."""
    if units < 2:
        return float("nan")
    from scipy.stats import t

    return float(t.ppf(0.975, units - 1))


def control_coefficient(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """The control variate's coefficient per prompt (and per held-out unit): ``beta = sum Cov(x, c) / sum
    Var(c)`` over the units (dim ``-2``) and the vocabulary (dim ``-1``), clamped to ``[0, 1]``. ``x``,
    ``c`` ``# [..., K, V]`` (``c`` centred on its exact mean). ~1 at small sigma, where ``x`` is its
    second-order term plus far smaller ones; falling towards 0 where the Taylor term stops describing the
    draws (large sigma), so the control variate never adds the variance a fixed 1 would there. ``# [...]``"""
    xc = x - x.mean(-2, keepdim=True)
    cc = c - c.mean(-2, keepdim=True)
    var = (cc * cc).sum((-1, -2))
    cov = (xc * cc).sum((-1, -2))
    return _beta(cov, var)


def _beta(cov: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    """``cov / var`` clamped to ``[0, 1]``, 0 where ``var`` is 0 (no control variate to fit)."""
    safe = torch.where(var > 0, var, torch.ones_like(var))
    return torch.where(var > 0, cov / safe, torch.zeros_like(var)).clamp(0.0, 1.0)


def _loo_tv(x: torch.Tensor, c: torch.Tensor | None) -> torch.Tensor:
    """``theta_(i)``: the plug-in TV without unit ``i``, for every ``i`` (the control coefficient fitted
    again without it), from sums: ``x``, ``c`` ``# [P, K, V]`` -> ``# [P, K]``, memory ``O(P K V)``."""
    K = x.shape[1]
    mx = (x.sum(1, keepdim=True) - x) / (K - 1)  # [P, K, V]: the mean of the other units
    if c is None:
        return 0.5 * mx.abs().sum(-1)
    mc = (c.sum(1, keepdim=True) - c) / (K - 1)
    sxc = (x * c).sum(-1)  # [P, K] per unit, summed over V
    scc = (c * c).sum(-1)
    cov = (sxc.sum(1, keepdim=True) - sxc) - (K - 1) * (mx * mc).sum(-1)
    var = (scc.sum(1, keepdim=True) - scc) - (K - 1) * (mc * mc).sum(-1)
    beta = _beta(cov, var)  # [P, K]: control_coefficient without unit i
    return 0.5 * (mx - beta[..., None] * mc).abs().sum(-1)


def estimate_marginal_tv(
    p: torch.Tensor,
    q_draws: torch.Tensor,
    *,
    paired: bool = False,
    correction: torch.Tensor | None = None,
    correction_mean: torch.Tensor | None = None,
    jackknife: bool = True,
) -> MarginalTV:
    """The estimator of ``TV(q_i, q_bar_i)`` behind every noise-effect number (docs/concepts.md, "How the
    noise's effect is measured"), for ``P`` prompts at once.

    ``p`` ``# [P, V]`` the clean distributions; ``q_draws`` ``# [P, M, V]`` each prompt's draws of
    ``q_eps``. Each draw gives ``x_m = q_eps_m - p``, an unbiased estimate of ``q_bar - p``; ``paired``:
    draws ``2j, 2j+1`` are an antithetic pair (:func:`antithetic_eps`) and their mean is one unit (every
    odd order of the noise cancels in it); ``correction``/``correction_mean`` (``# [P, M, V]``, or one per
    unit ``# [P, M / 2, V]`` when paired / ``# [P, V]``: :func:`second_order_term` and its exact mean
    :func:`second_order_mean`) make each unit ``x - beta (c - E[c])`` with :func:`control_coefficient`'s
    ``beta``. Then :func:`estimate_from_units`."""
    if q_draws.dim() != 3 or q_draws.shape[1] < 1 or tuple(p.shape) != (q_draws.shape[0], q_draws.shape[2]):
        raise ValueError(
            f"marginal TV: p {tuple(p.shape)} and q_draws {tuple(q_draws.shape)} do not match ([P, V], [P, M >= 1, V])"
        )
    P, M, V = q_draws.shape
    if paired and M % 2:
        raise ValueError(f"marginal TV: antithetic pairs need an even number of draws, got {M}")
    q = q_draws.float()
    d = q - p.to(q.device, torch.float32)[:, None]  # exact where q is near p (Sterbenz): no cancellation
    per_draw = (0.5 * d.abs().sum(-1)).mean(1).double().cpu()
    qbar = q.mean(1)
    x = d.view(P, M // 2, 2, V).mean(2) if paired else d  # [P, K, V]
    c = None
    if correction is not None:  # the control variate, centred on its exact mean
        c = correction.to(q.device, torch.float32)
        if paired and c.shape[1] == M:
            c = c.view(P, M // 2, 2, V).mean(2)
        c = c - correction_mean.to(q.device, torch.float32)[:, None]
    return estimate_from_units(x, c, qbar=qbar, per_draw=per_draw, jackknife=jackknife)


def estimate_from_units(
    x: torch.Tensor,
    c: torch.Tensor | None,
    *,
    qbar: torch.Tensor,
    per_draw: torch.Tensor,
    jackknife: bool = True,
) -> MarginalTV:
    """The estimate from ``K`` units per prompt: ``x`` ``# [P, K, V]`` (float32: the units are small
    differences, their rounding far below the Monte Carlo error; results float64), each an unbiased estimate of
    ``q_bar - p``, and ``c`` (None, or the control variate centred on its exact mean, same shape). The
    plug-in ``TV = 0.5 sum_v |mean of the units|`` reads high by the units' Monte Carlo error (``|.|`` of a
    noisy mean); the estimate is the delete-one jackknife's ``K theta - (K - 1) mean_i theta_(i)`` (its
    first-order bias removed), floored at 0, and ``se`` the jackknife's standard error (``jackknife=False``
    or fewer than three units: the plug-in, ``se`` NaN)."""
    P, K, _ = x.shape
    m = x.mean(1)
    if c is not None and K > 1:
        m = m - control_coefficient(x, c)[:, None] * c.mean(1)
    plug = (0.5 * m.abs().sum(-1)).double()  # [P]
    qbar = qbar.double().cpu()
    if not jackknife or K < 3:
        nan = torch.full((P,), float("nan"), dtype=torch.float64)
        return MarginalTV(plug.cpu(), nan, plug.cpu(), qbar, per_draw, K)
    loo = _loo_tv(x, c if K > 1 else None).double()  # [P, K]
    tv = (K * plug - (K - 1) * loo.mean(1)).clamp_min(0.0)
    se = ((K - 1) / K * (loo - loo.mean(1, keepdim=True)).pow(2).sum(1)).sqrt()
    return MarginalTV(tv.cpu(), se.cpu(), plug.cpu(), qbar, per_draw, K)


def marginal_tv(p: torch.Tensor, q_draws: torch.Tensor, *, paired: bool = False) -> torch.Tensor:
    """:func:`estimate_marginal_tv`'s ``tv`` from plain draws (no control variate). ``# [P]`` float64"""
    return estimate_marginal_tv(p, q_draws, paired=paired).tv


def _linear_weight(head: Head, d: int, V: int) -> torch.Tensor | None:
    """The LM head's weight ``# [V, d]`` where ``head`` is linear in its input (an ``nn.Linear`` or
    :func:`ncgrpo.engines.branch_point.head_function`'s function, which carries it as ``.weight``), else
    None (the control variate's exact mean needs ``E[delta delta^T] = scale^2 W W^T``)."""
    w = getattr(head, "weight", None)
    if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (V, d):
        return w
    return None


class MarginalCurve:
    """``sigma -> TV(q_i, q_bar_i(sigma))`` for ``P`` prompts, with common random numbers: one object, one
    estimator, for every caller (the probe, the trainer's ``noise/first_token_marginal_tv``, the target
    schedule's solve, ``first_token_temperature_auto``'s calibration).

    ``h`` ``# [P, d]``: each prompt's clean branch-point state (the LM head's input); ``logits`` ``# [P, V]``
    its clean logits; ``keys``: ``pairs`` keys per prompt, prompt-major (the trainer's are
    :func:`marginal_keys`), each one antithetic pair of draws (:func:`antithetic_eps`: ``2 * pairs`` draws
    per prompt). The eps are drawn once, so the curve is a deterministic, continuous function of
    ``sigma`` (what a solver needs). Where the head is linear and the noise isotropic (no steering vector,
    not SPSA's rank-one draws) each draw also carries the second-order control variate
    (:func:`second_order_term`, exact mean :func:`second_order_mean`); the estimate is
    :func:`estimate_marginal_tv`. ``curve(sigma)`` is a :class:`MarginalTV`; ``curve.evals`` counts calls."""

    def __init__(
        self,
        head: Head,
        h: torch.Tensor,
        logits: torch.Tensor,
        keys: Sequence[NoiseKey],
        *,
        temperature: float,
        mode: NoiseMode = "independent",
        steer: torch.Tensor | None = None,
        control_variate: bool = True,
    ) -> None:
        P = h.shape[0]
        if P == 0 or not keys or len(keys) % P or logits.shape[0] != P:
            raise ValueError(
                f"marginal TV: {P} states, {logits.shape[0]} logit rows and {len(keys)} keys do not match "
                "(P >= 1, P and P * pairs)"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.P, self.pairs = P, len(keys) // P
        self.draws = 2 * self.pairs
        self.head, self.steer, self.temperature = head, steer, float(temperature)
        self.eps = antithetic_eps(keys, h.shape[-1], mode)  # [P * draws, d]
        self.hs = h.repeat_interleave(self.draws, 0)  # [P * draws, d]
        self.z = logits.float()
        self.p = torch.softmax(self.z / self.temperature, -1)  # [P, V]
        weight = _linear_weight(head, h.shape[-1], logits.shape[-1])
        self.weight = weight if control_variate and steer is None and mode != "rank_one" else None
        # ||h|| / (sqrt(d) T) as eq. (2) computes the norm (float32): the logit displacement's scale per sigma
        self.unit_scale = h.float().norm(dim=-1) / math.sqrt(h.shape[-1]) / self.temperature
        self.evals = 0
        # the control variate's exact mean is scale^2 times a sigma-free [n, V] term (second_order_mean):
        # computed once per block of prompts, an O(V d) LM-head-sized product per prompt, not once per sigma
        self._unit_mean: dict[tuple[int, int], torch.Tensor] = {}

    @property
    def control_variate(self) -> bool:
        return self.weight is not None

    #: elements (prompts x draws x vocabulary) estimated at once: the estimate's terms of one chunk
    #: stay near 0.25-0.5 GB each at a 152k vocabulary (about six prompts of 64 draws), whatever the batch
    CHUNK_ELEMENTS = 1 << 26

    def __call__(self, sigma: float) -> MarginalTV:
        self.evals += 1
        M, V = self.draws, self.z.shape[-1]
        step = max(1, self.CHUNK_ELEMENTS // (M * V))
        parts = [self.prompts(sigma, lo, min(lo + step, self.P)) for lo in range(0, self.P, step)]
        if len(parts) == 1:
            return parts[0]
        return MarginalTV(
            *(torch.cat([getattr(f, k) for f in parts]) for k in ("tv", "se", "plugin", "qbar", "per_draw")),
            parts[0].units,
        )

    def prompts(self, sigma: float, lo: int, hi: int) -> MarginalTV:
        """The estimate for prompts ``lo:hi`` at ``sigma``, in one block (``curve(sigma)`` joins blocks of
        ``CHUNK_ELEMENTS``; the per-prompt solve, :mod:`ncgrpo.core.prompt_solve`, asks one prompt at a time)."""
        M, n = self.draws, hi - lo
        rows = slice(lo * M, hi * M)
        z = _logit_rows(self.head, self.hs[rows], self.eps[rows], sigma, self.steer, 256).to(self.z.device)
        q = torch.softmax(z / self.temperature, -1).view(n, M, -1)
        p = self.p[lo:hi]
        corr = mean = None
        if self.weight is not None and sigma > 0:
            # the second-order term is even in eps: a pair's is its first draw's (computed once per pair)
            delta = (z.view(n, M // 2, 2, -1)[:, :, 0] - self.z[lo:hi, None]) / self.temperature
            corr = second_order_term(p, delta)
            unit = self._unit_mean.get((lo, hi))
            if unit is None:
                unit = self._unit_mean[(lo, hi)] = second_order_mean(p, self.weight, torch.ones(n))
            mean = unit * (float(sigma) * self.unit_scale[lo:hi].to(p.device)).double()[:, None] ** 2
        return estimate_marginal_tv(p, q, paired=True, correction=corr, correction_mean=mean)


@dataclass(frozen=True)
class MarginalEstimate:
    """One prompt's first-token marginal from Monte Carlo draws (:func:`marginal_estimate`).

    ``tv``: ``TV(q, q_bar)`` (``q`` the clean distribution), the quantity that generates the noisy
    rollouts, bias-corrected (:func:`estimate_marginal_tv`); ``tv_se``: its jackknife standard error;
    ``tv_plugin``: before the correction; ``tv_per_draw``: the mean ``TV(q, q_eps)`` (what one draw does;
    larger); ``kl``: ``KL(q_bar || q)`` in nats; ``units``: the estimate's units (pairs or draws)."""

    tv: float
    tv_se: float
    tv_plugin: float
    tv_per_draw: float
    kl: float
    draws: int
    units: int = 0


def _kl(qbar: torch.Tensor, p: torch.Tensor) -> float:
    qbar, p = qbar.double(), p.double().to(qbar.device)
    return float((qbar * (qbar.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum().clamp_min(0.0))


def as_estimate(found: MarginalTV, p: torch.Tensor, i: int, draws: int) -> MarginalEstimate:
    """Prompt ``i`` of ``found`` as a :class:`MarginalEstimate` (``p`` ``# [P, V]`` the clean distributions)."""
    return MarginalEstimate(
        tv=float(found.tv[i]),
        tv_se=float(found.se[i]),
        tv_plugin=float(found.plugin[i]),
        tv_per_draw=float(found.per_draw[i]),
        kl=_kl(found.qbar[i], p[i]),
        draws=draws,
        units=found.units,
    )


def marginal_estimate(
    p: torch.Tensor, q_draws: torch.Tensor, *, paired: bool = False, correct: bool = True
) -> MarginalEstimate:
    """Estimate ``TV(p, q_bar)`` and ``KL(q_bar || p)`` of one prompt from draws ``q_draws`` ``# [M, V]`` of
    ``q_eps`` (:func:`estimate_marginal_tv` with ``P = 1``; ``paired``: antithetic pairs). For draws whose
    eps and head are at hand, :class:`MarginalCurve` adds the control variate; this is for draws that are
    only distributions (the rollouts' own at a layer site). ``correct=False``: the plug-in, ``tv_se`` NaN."""
    if q_draws.shape[0] < 1:
        raise ValueError("marginal_estimate needs at least one draw")
    found = estimate_marginal_tv(p[None], q_draws[None], paired=paired, jackknife=correct)
    return as_estimate(found, p[None], 0, q_draws.shape[0])


def mixture_log_probs(
    head: Head,
    h: torch.Tensor,
    keys: Sequence[NoiseKey],
    sigma: float,
    *,
    mode: NoiseMode = "independent",
    temperature: float = 1.0,
    steer: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log q_hat`` with ``q_hat = mean_m q_eps_m`` over the draws named by ``keys``. ``# [V]`` float32.

    Sampling a token from ``q_hat`` with a fresh set of keys per row draws it from ``E[q_hat] = q_bar``
    exactly, for any number of keys: the ``first_token_marginal`` control is distributed as NC-GRPO's
    noisy half by construction, and differs from it only in that no eps ever enters the model's
    forward (module docstring).
    """
    d = h.shape[-1]
    q = noisy_probs(head, h, branch_eps(keys, d, mode), sigma, temperature=temperature, steer=steer)
    return q.mean(0).clamp_min(1e-38).log()


@torch.no_grad()
def closest_temperature(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    lo: float = 0.05,
    hi: float = 20.0,
    iters: int = 60,
) -> float:
    """The single temperature ``T*`` minimising the mean ``TV(softmax(z / T*), q_bar)`` over prompts.

    ``logits`` ``# [P, V]`` clean first-token logits (before any temperature), ``targets`` ``# [P, V]``
    the prompts' ``q_bar``. Golden-section search on ``log T`` in ``[lo, hi]`` (the mean TV is unimodal
    in practice; the search returns a local minimum if it is not). ``T*`` near the sampling temperature
    says the noise acts on the rollouts like a small change of first-token temperature.
    """
    z = logits.float()
    t = targets.float().to(z.device)

    def f(log_t: float) -> float:
        return float(tv_of_probs(torch.softmax(z / math.exp(log_t), -1), t).mean())

    a, b = math.log(lo), math.log(hi)
    gr = (math.sqrt(5) - 1) / 2
    c, d = b - gr * (b - a), a + gr * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - gr * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + gr * (b - a)
            fd = f(d)
    return float(math.exp(0.5 * (a + b)))
