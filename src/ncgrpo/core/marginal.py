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

__all__ = [
    "MARGINAL_DRAW_BASE",
    "MarginalEstimate",
    "closest_temperature",
    "branch_eps",
    "marginal_estimate",
    "marginal_keys",
    "marginal_tv",
    "marginal_tv_curve",
    "mixture_log_probs",
    "noisy_probs",
    "pool_keys",
    "SigmaSolve",
    "sigma_for_marginal_tv",
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
    if h.dim() == 2 and h.shape[0] != eps.shape[0]:
        raise ValueError(f"noisy_probs: {h.shape[0]} states for {eps.shape[0]} draws")
    out = []
    for lo in range(0, eps.shape[0], chunk):
        e = eps[lo : lo + chunk].to(h.device)
        hs = h.expand(e.shape[0], -1) if h.dim() == 1 else h[lo : lo + chunk]
        ht = perturb(hs, e, float(sigma), steer=steer)  # [m, d] h.dtype
        out.append(torch.softmax(head(ht).float() / temperature, dim=-1))
    return torch.cat(out) if out else torch.empty(0, 0)


@dataclass(frozen=True)
class MarginalEstimate:
    """One prompt's first-token marginal, estimated from ``draws`` Monte Carlo draws of eps.

    ``tv``: ``TV(q, q_bar)`` (``q`` the clean distribution), the quantity that generates the noisy
    rollouts; ``tv_se``: its bootstrap standard error over the draws; ``tv_per_draw``: the mean
    ``TV(q, q_eps)`` (what one draw does; larger); ``kl``: ``KL(q_bar || q)`` in nats.

    ``tv`` is the plug-in estimate ``TV(q, mean_m q_eps_m)`` minus the bootstrap estimate of its Monte
    Carlo bias (|.| makes the plug-in biased upward, by about ``0.4 * sum_v sd_v / sqrt(M)`` when
    ``q_bar`` is close to ``q``), floored at 0. ``tv_plugin`` keeps the plug-in value.
    """

    tv: float
    tv_se: float
    tv_plugin: float
    tv_per_draw: float
    kl: float
    draws: int


def _bootstrap_tv(p: torch.Tensor, q: torch.Tensor, bootstrap: int, seeds: Sequence[int]) -> torch.Tensor:
    """``TV(p_i, mean of a resample of q_i's draws)`` for ``bootstrap`` resamples per prompt: ``p`` ``# [P, V]``
    and ``q`` ``# [P, M, V]`` float64, prompt ``i``'s resamples drawn from ``seeds[i]``. ``# [P, bootstrap]``"""
    P, M, _ = q.shape
    # each resample's mean as one matmul: its multiplicities / M times the draws (no Python loop)
    w = torch.zeros(P, bootstrap, M, dtype=q.dtype)
    for i, seed in enumerate(seeds):
        idx = torch.randint(0, M, (bootstrap, M), generator=torch.Generator().manual_seed(int(seed)))
        w[i].scatter_add_(1, idx, torch.ones(bootstrap, M, dtype=q.dtype))
    return tv_of_probs(p[:, None], torch.bmm((w / M).to(q.device), q)).cpu()  # [P, bootstrap]


def marginal_tv(
    p: torch.Tensor, q_draws: torch.Tensor, *, bootstrap: int = 200, seeds: Sequence[int]
) -> torch.Tensor:
    """:class:`MarginalEstimate`'s ``tv`` for several prompts at once (the trainer's per-step metric):
    ``p`` ``# [P, V]`` the clean distributions, ``q_draws`` ``# [P, M, V]`` each prompt's draws of
    ``q_eps``, ``seeds`` one bootstrap seed per prompt. The plug-in ``TV(p, q_bar)`` minus its bootstrap
    bias estimate, floored at 0 (``bootstrap=0``: the plug-in). ``# [P]`` float64 on the CPU"""
    p, q = p.double(), q_draws.double()
    if q.dim() != 3 or q.shape[1] < 1 or p.shape != (q.shape[0], q.shape[2]) or len(seeds) != q.shape[0]:
        raise ValueError(
            f"marginal_tv: p {tuple(p.shape)}, q_draws {tuple(q.shape)} and {len(seeds)} seeds do not match "
            "([P, V], [P, M >= 1, V], P seeds)"
        )
    plug = tv_of_probs(p, q.mean(1)).cpu()  # [P]
    if bootstrap < 1 or q.shape[1] < 2:
        return plug
    boot = _bootstrap_tv(p, q, bootstrap, seeds)
    return (2.0 * plug - boot.mean(1)).clamp_min(0.0)


def marginal_tv_curve(
    head: Head,
    h: torch.Tensor,
    logits: torch.Tensor,
    keys: Sequence[NoiseKey],
    *,
    draws: int,
    temperature: float,
    seeds: Sequence[int],
    mode: NoiseMode = "independent",
    steer: torch.Tensor | None = None,
    bootstrap: int = 32,
) -> Callable[[float], torch.Tensor]:
    """``sigma -> TV(q_i, q_bar_i(sigma))`` for ``P`` prompts at once, with common random numbers.

    ``h`` ``# [P, d]``: each prompt's clean branch-point state (the LM head's input); ``logits`` ``# [P, V]``
    its clean logits; ``keys``: ``draws`` keys per prompt, prompt-major (``P * draws``; the trainer's are
    :func:`marginal_keys`); ``seeds``: one bootstrap seed per prompt. The eps are drawn once, so the
    returned function is a deterministic, continuous function of ``sigma`` (what a solver for the
    ``sigma`` of a target TV needs); each call is :func:`marginal_tv` (bootstrap bias-corrected, ``# [P]``
    float64 on the CPU) of ``draws`` states ``perturb(h_i, eps, sigma)`` through ``head``. The trainer's
    logged ``noise/first_token_marginal_tv`` and the target schedule's solve are both this function."""
    P = h.shape[0]
    if len(keys) != P * draws or len(seeds) != P or logits.shape[0] != P:
        raise ValueError(
            f"marginal_tv_curve: {P} states, {logits.shape[0]} logit rows, {len(seeds)} seeds and {len(keys)} "
            f"keys do not match (P, P, P and P * draws = {P * draws})"
        )
    eps = branch_eps(keys, h.shape[-1], mode)  # [P * draws, d]
    hs = h.repeat_interleave(draws, 0)  # [P * draws, d]
    clean = torch.softmax(logits.float() / temperature, -1)  # [P, V]

    def tv_at(sigma: float) -> torch.Tensor:
        q = noisy_probs(head, hs, eps, sigma, temperature=temperature, steer=steer)  # [P * draws, V]
        return marginal_tv(clean, q.to(clean.device).view(P, draws, -1), bootstrap=bootstrap, seeds=seeds)

    return tv_at


def marginal_estimate(
    p: torch.Tensor,
    q_draws: torch.Tensor,
    *,
    bootstrap: int = 200,
    seed: int = 0,
) -> MarginalEstimate:
    """Estimate ``TV(p, q_bar)`` and ``KL(q_bar || p)`` from draws ``q_draws`` ``# [M, V]`` of ``q_eps``.

    ``p`` ``# [V]`` the clean first-token distribution. The bootstrap (``bootstrap`` resamples of the
    ``M`` draws, seeded) gives the standard error and the bias correction (see
    :class:`MarginalEstimate`); ``bootstrap=0`` skips both (``tv_se`` NaN, ``tv`` the plug-in).
    """
    p = p.double()  # float64 sums: M identical draws average back to exactly p (KL 0 at sigma 0)
    q = q_draws.double()
    M = q.shape[0]
    if M < 1:
        raise ValueError("marginal_estimate needs at least one draw")
    qbar = q.mean(0)
    plug = float(tv_of_probs(p, qbar))
    per_draw = float(tv_of_probs(p[None], q).mean())
    kl = float((qbar * (qbar.clamp_min(1e-30).log() - p.clamp_min(1e-30).log())).sum().clamp_min(0.0))
    se = float("nan")
    tv = plug
    if bootstrap > 0 and M > 1:
        boot = _bootstrap_tv(p[None], q[None], bootstrap, [seed])[0]  # [bootstrap]
        se = float(boot.std(unbiased=True))
        tv = max(0.0, 2.0 * plug - float(boot.mean()))
    return MarginalEstimate(tv=tv, tv_se=se, tv_plugin=plug, tv_per_draw=per_draw, kl=kl, draws=M)


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


def sigma_for_marginal_tv(
    tv_at: Callable[[float], float],
    target: float,
    *,
    hi: float = 4.0,
    iters: int = 30,
    tol: float = 1e-4,
) -> float:
    """The noise scale whose marginal TV equals ``target`` (bisection on ``sigma`` in ``[0, hi]``).

    ``tv_at(sigma)`` must evaluate the marginal TV with common random numbers (the same draws at every
    sigma), so it is a smooth, increasing function of sigma. Returns ``hi`` if even ``hi`` does not
    reach the target (check it), 0 for a target <= 0.
    """
    if not (math.isfinite(target) and 0 <= target <= 1):
        raise ValueError(f"target marginal TV must be in [0, 1], got {target}")
    if target <= 0:
        return 0.0
    if tv_at(hi) < target:
        return float(hi)
    lo_s, hi_s = 0.0, float(hi)
    for _ in range(iters):
        mid = 0.5 * (lo_s + hi_s)
        if tv_at(mid) < target:
            lo_s = mid
        else:
            hi_s = mid
        if hi_s - lo_s < tol:
            break
    return 0.5 * (lo_s + hi_s)


@dataclass(frozen=True)
class SigmaSolve:
    """What :func:`solve_sigma_for_marginal_tv` found: ``sigma``, the TV there (``tv``), how many TV
    evaluations it took (``evals``) and whether ``sigma_max`` bounded it short of the target (``at_max``)."""

    sigma: float
    tv: float
    evals: int
    at_max: bool = False


def solve_sigma_for_marginal_tv(
    tv_at: Callable[[float], float],
    target: float,
    *,
    start: float,
    sigma_max: float,
    rtol: float = 0.02,
    max_evals: int = 12,
) -> SigmaSolve:
    """The noise scale whose marginal TV is ``target`` within ``rtol`` (relative), in few evaluations:
    the target schedule calls it once per generation, each evaluation ``P * draws`` rows through the LM
    head.

    ``tv_at`` must use common random numbers (:func:`marginal_tv_curve`), so it is a deterministic,
    continuous function that grows with ``sigma``; near 0 the marginal TV grows as ``sigma**2`` (the
    first-order term of ``q_eps - q`` averages out over eps). From ``start`` (clamped into
    ``(0, sigma_max]``) the solver extrapolates on that law until the target is bracketed, then
    interpolates in log-log between the bracket's ends (a secant on ``log TV = a + b log sigma``),
    falling back to the bracket's geometric middle where the secant leaves the bracket. Deterministic:
    the same ``tv_at`` and arguments give the same result (a resumed run solves the same sigma_k).
    Returns the closest evaluation after ``max_evals``; ``sigma_max`` (``at_max``) where even it stays
    below the target; ``sigma`` 0 for a target of 0.
    """
    if not (math.isfinite(target) and 0 <= target <= 1):
        raise ValueError(f"target marginal TV must be in [0, 1], got {target}")
    if not (math.isfinite(sigma_max) and sigma_max > 0):
        raise ValueError(f"sigma_max must be a finite number > 0, got {sigma_max}")
    if target <= 0:
        return SigmaSolve(0.0, 0.0, 0)
    s = min(max(float(start), 1e-3 * sigma_max), sigma_max) if math.isfinite(start) else sigma_max / 10
    lo_s, lo_tv = 0.0, 0.0  # largest sigma seen below the target
    hi: tuple[float, float] | None = None  # smallest sigma seen at or above it
    best = SigmaSolve(s, float("nan"), 0)
    for evals in range(1, max_evals + 1):
        tv = float(tv_at(s))
        if not math.isfinite(tv):
            raise ValueError(f"the marginal TV at sigma {s:g} is {tv}: check the model's logits")
        if not math.isfinite(best.tv) or abs(tv - target) < abs(best.tv - target):
            best = SigmaSolve(s, tv, evals)
        if abs(tv - target) <= rtol * target:
            return SigmaSolve(s, tv, evals)
        if tv < target:
            lo_s, lo_tv = s, tv
        elif hi is None or s < hi[0]:
            hi = (s, tv)
        if hi is None:  # not bracketed yet: grow on TV ~ sigma^2, at most 4x per step
            if s >= sigma_max:
                return SigmaSolve(sigma_max, tv, evals, at_max=True)
            grow = math.sqrt(target / tv) if tv > 0 else 4.0
            s = min(s * min(max(grow, 1.1), 4.0), sigma_max)
            continue
        hs, htv = hi
        if lo_s > 0 and lo_tv > 0:  # the secant of log TV on log sigma
            slope = math.log(htv / lo_tv) / math.log(hs / lo_s) if htv > lo_tv else 0.0
            nxt = math.exp(math.log(lo_s) + math.log(target / lo_tv) / slope) if slope > 0 else -1.0
        else:
            nxt = hs * math.sqrt(target / htv)
        if not lo_s < nxt < hs:
            nxt = math.sqrt(lo_s * hs) if lo_s > 0 else hs / 2
        s = nxt
    return SigmaSolve(best.sigma, best.tv, max_evals, at_max=best.sigma >= sigma_max and best.tv < target)
