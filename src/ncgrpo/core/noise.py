"""The NC-GRPO noise core: pure tensor code, no engine imports.

Everything an engine hook needs to perturb hidden states the way the paper does, and nothing that
knows about transformers, TRL or vLLM (eq. (3)'s annealing of ``sigma``: :mod:`ncgrpo.core.schedule`):

- :func:`calibrated_delta` / :func:`perturb` -- eq. (2), ``h_t + sigma * ||h_t|| / sqrt(d) * eps_t``
  (the calibrated instance of the general form eq. (1)), computed in float32 whatever the model dtype;
- :class:`NoiseKey` / :func:`draw_eps` -- keyed noise streams: the draw for (run seed, step, prompt id,
  branch) is a pure function of those four numbers and of the token's position counted from the end of
  the prompt, so batch layout, padding, process count, device and tensor-parallel rank cannot change it;
- noise modes: independent (default), antithetic pairs (section 3.5), rank-one ``eps_t = r_t u``;
- SPSA steering (eq. 6): :func:`spsa_gradient`, :func:`project_ball`, :func:`spsa_update`;
- :func:`agreement_kernel` -- eq. (4), the representational-agreement kernel used as a metric;
- :func:`depth_decayed_sigmas` -- multi-layer injection scales (the extension section 3.1 names).

Positions are counted from the END of the prompt (0 = last prompt token), because left padding moves
absolute positions but not distances from the end, and because the last prompt token is the only one
whose final-layer state reaches the first-token logits: an engine can draw just the rows it needs
(:func:`draw_eps` with ``positions=[0]``) and get exactly the values a full draw would give there.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

__all__ = [
    "NoiseKey",
    "NoiseMode",
    "RowNoise",
    "agreement_kernel",
    "calibrated_delta",
    "depth_decayed_sigmas",
    "parse_noise_site",
    "draw_direction",
    "draw_eps",
    "draw_eps_keys",
    "noise_seed",
    "perturb",
    "perturb_rows",
    "perturb_selected",
    "project_ball",
    "relative_perturbation",
    "reverse_positions",
    "spsa_gradient",
    "spsa_update",
    "to_device",
]

NoiseMode = Literal["independent", "antithetic", "rank_one"]


# --------------------------------------------------------------------------------------------------
# keyed noise streams
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoiseKey:
    """Identifies one noise draw: (run seed, training step, prompt id, draw index).

    ``prompt_id`` is any stable integer naming the prompt (a dataset index, or a hash of its tokens);
    ``draw`` indexes the draw within the prompt's noisy half (antithetic partners share a draw). A
    row's place in its group is its ``branch`` (:mod:`ncgrpo.core.plan`), a different index.
    """

    seed: int
    step: int
    prompt_id: int
    draw: int


_MASK63 = (1 << 63) - 1


def _seed_bytes(part: int | str) -> bytes:
    """One part of :func:`noise_seed`'s hashed input."""
    if isinstance(part, str):
        b = part.encode()
        return b"s" + struct.pack("<I", len(b)) + b
    return b"i" + int(part).to_bytes(16, "little", signed=True)


def noise_seed(*parts: int | str) -> int:
    """A 63-bit generator seed from a tuple of ints/strings (blake2b; platform independent)."""
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(_seed_bytes(p))
    return int.from_bytes(h.digest(), "little") & _MASK63


def _randn(seed: int, size: int) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return torch.randn(size, generator=g, dtype=torch.float32)


def draw_direction(seed: int, step: int, d: int) -> torch.Tensor:
    """The per-step shared direction ``u ~ N(0, I_d)`` of rank-one noise (section 3.5). ``# [d]``"""
    return _randn(noise_seed("direction", seed, step), d)


def draw_eps(
    key: NoiseKey,
    positions: Sequence[int] | torch.Tensor,
    d: int,
    *,
    mode: NoiseMode = "independent",
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """Standard-normal noise rows for the given prompt positions (counted from the end).

    Row ``j`` depends only on ``(key, positions[j], d, mode)``: each row has its own generator seed,
    so any subset of positions gives exactly the rows a full draw would give there. Draws happen on
    the CPU and are then moved to ``device``, so every device and every tensor-parallel rank gets
    bit-identical noise. Antithetic partners call this with the same key and negate (see
    :class:`RowNoise`). ``rank_one`` returns ``r_t * u`` with ``u = draw_direction(seed, step, d)``
    shared by every prompt and token of the step and ``r_t ~ N(0, 1)`` per (key, position), so
    ``E ||eps_t||^2 = d`` as for independent noise.

    Returns ``# [len(positions), d]`` float32.
    """
    pos = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
    if any(p < 0 for p in pos):
        raise ValueError("positions are counted from the end of the prompt and must be >= 0")
    if mode in ("independent", "antithetic"):
        rows = [_randn(noise_seed("eps", key.seed, key.step, key.prompt_id, key.draw, p), d) for p in pos]
        out = torch.stack(rows) if rows else torch.empty(0, d)
    elif mode == "rank_one":
        u = draw_direction(key.seed, key.step, d)  # [d]
        r = torch.tensor(
            [_randn(noise_seed("r", key.seed, key.step, key.prompt_id, key.draw, p), 1).item() for p in pos],
            dtype=torch.float32,
        )  # [P]
        out = r[:, None] * u[None, :]
    else:
        raise ValueError(f"unknown noise mode {mode!r}; use 'independent', 'antithetic' or 'rank_one'")
    return out if device is None else out.to(device)


def draw_eps_keys(
    keys: Sequence[NoiseKey], position: int, d: int, *, mode: NoiseMode = "independent"
) -> torch.Tensor:
    """``torch.cat([draw_eps(k, [position], d, mode=mode) for k in keys])``, bit-identical, for many keys
    at once (the branch point's eps of a batch's noisy rows, the Monte Carlo draws of the first-token
    marginal): one generator re-seeded per key, rows written in place. ``# [len(keys), d]`` float32"""
    if position < 0:
        raise ValueError("positions are counted from the end of the prompt and must be >= 0")
    if mode not in ("independent", "antithetic", "rank_one"):
        raise ValueError(f"unknown noise mode {mode!r}; use 'independent', 'antithetic' or 'rank_one'")
    g = torch.Generator(device="cpu")
    tail = _seed_bytes(position)
    prefixes: dict[tuple[int, int, int], Any] = {}

    def seed(stream: str, k: NoiseKey) -> int:  # noise_seed(stream, seed, step, prompt_id, draw, position)
        h = prefixes.get((k.seed, k.step, k.prompt_id))
        if h is None:
            h = prefixes[k.seed, k.step, k.prompt_id] = hashlib.blake2b(
                b"".join(_seed_bytes(p) for p in (stream, k.seed, k.step, k.prompt_id)), digest_size=8
            )
        h = h.copy()
        h.update(_seed_bytes(k.draw) + tail)
        return int.from_bytes(h.digest(), "little") & _MASK63

    if mode != "rank_one":
        out = torch.empty(len(keys), d, dtype=torch.float32)
        for row, k in zip(out.unbind(0), keys, strict=True):
            g.manual_seed(seed("eps", k))
            row.normal_(generator=g)
        return out
    r = torch.empty(len(keys), dtype=torch.float32)
    for i, k in enumerate(keys):
        g.manual_seed(seed("r", k))
        r[i] = torch.randn(1, generator=g, dtype=torch.float32).item()
    us: dict[tuple[int, int], torch.Tensor] = {}
    for k in keys:
        if (k.seed, k.step) not in us:
            us[k.seed, k.step] = draw_direction(k.seed, k.step, d)  # [d]
    u = torch.stack([us[k.seed, k.step] for k in keys]) if keys else torch.empty(0, d)
    return r[:, None] * u


# --------------------------------------------------------------------------------------------------
# eq. (2): calibrated noise
# --------------------------------------------------------------------------------------------------
def _row_norm(h32: torch.Tensor) -> torch.Tensor:
    """||h|| over the last dim without overflow: max|h| * ||h / max|h|||. ``# [..., 1]``"""
    m = h32.abs().amax(dim=-1, keepdim=True)
    safe = torch.where(m > 0, m, torch.ones_like(m))
    return m * torch.linalg.vector_norm(h32 / safe, dim=-1, keepdim=True)


def _check_finite(h: torch.Tensor, what: str = "hidden states") -> None:
    if not torch.isfinite(h).all():
        bad = (~torch.isfinite(h)).nonzero()[0].tolist()
        raise ValueError(
            f"{what} contain a non-finite value (first at index {bad}); refusing to add calibrated noise "
            "to them. Check the model's dtype/overflow before enabling the noise hook."
        )


def calibrated_delta(
    h: torch.Tensor,
    eps: torch.Tensor,
    sigma: float | torch.Tensor,
    *,
    steer: torch.Tensor | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """The displacement of eq. (2) (plus eq. (6)'s steering offset): float32, same shape as ``h``.

    ``delta_t = (sigma * eps_t + mu) * ||h_t|| / sqrt(d)``. ``h``: ``# [..., d]``; ``eps`` broadcastable
    to it; ``sigma`` a float or a tensor broadcastable to ``h[..., :1]``; ``steer`` (mu) ``# [d]``.
    A zero-norm row gets a zero displacement; a non-finite ``h`` is an error, unless
    ``check_finite=False`` (the check reads the tensor on the host: a device sync; a caller that must
    not sync handles non-finite rows itself, as the vLLM engine does).
    """
    h32 = h.float()
    if check_finite:
        _check_finite(h32)
    d = h32.shape[-1]
    scale = _row_norm(h32) / math.sqrt(d)  # [..., 1]
    sig = sigma if isinstance(sigma, torch.Tensor) else torch.tensor(float(sigma))
    direction = sig.to(h32.device, torch.float32) * eps.to(h32.device, torch.float32)
    if steer is not None:
        direction = direction + steer.to(h32.device, torch.float32)
    return scale * direction


def perturb(
    h: torch.Tensor,
    eps: torch.Tensor,
    sigma: float | torch.Tensor,
    *,
    steer: torch.Tensor | None = None,
    check_finite: bool = True,
) -> torch.Tensor:
    """``h~ = h + sigma * ||h|| / sqrt(d) * eps (+ mu * ||h|| / sqrt(d))``, eq. (2) / (6).

    Computed in float32 and cast back to ``h.dtype``, saturating at the dtype's largest finite value
    so a finite input never produces inf or NaN. A non-finite ``h`` is an error; with
    ``check_finite=False`` nothing is read on the host (no device sync) and a row (last dim) holding a
    non-finite value is returned as it was, by ``torch.where``.
    """
    out32 = h.float() + calibrated_delta(h, eps, sigma, steer=steer, check_finite=check_finite)
    if h.dtype.is_floating_point and h.dtype != torch.float32:
        fmax = torch.finfo(h.dtype).max
        out32 = out32.clamp(-fmax, fmax)
    out = out32.to(h.dtype)
    if not check_finite:
        out = torch.where(torch.isfinite(h).all(dim=-1, keepdim=True), out, h)
    return out


def relative_perturbation(h: torch.Tensor, h_tilde: torch.Tensor) -> torch.Tensor:
    """Per-token ``||h~_t - h_t|| / ||h_t||`` (0 where ``||h_t|| = 0``). ``# [...]``"""
    h32 = h.float()
    num = _row_norm(h_tilde.float() - h32)[..., 0]
    den = _row_norm(h32)[..., 0]
    return torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))


# --------------------------------------------------------------------------------------------------
# batched application for engine hooks
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RowNoise:
    """What to do to one batch row's prompt states. ``sigma == 0`` or ``key is None`` means clean.

    ``sign`` is -1 for the second member of an antithetic pair (it reuses its partner's key).
    ``steer`` (mu of eq. 6) is added to noisy rows only.
    """

    sigma: float = 0.0
    key: NoiseKey | None = None
    sign: float = 1.0
    mode: NoiseMode = "independent"

    def __post_init__(self) -> None:
        # NaN compares False with everything, so a NaN sigma would silently read as "clean" and an
        # infinite one turn the states into NaN: both are refused here, as is a negative sigma.
        if not math.isfinite(float(self.sigma)) or self.sigma < 0:
            raise ValueError(f"RowNoise.sigma must be a finite number >= 0, got {self.sigma}")
        if self.sign not in (1.0, -1.0):
            raise ValueError(f"RowNoise.sign must be +1 or -1, got {self.sign}")

    @property
    def noisy(self) -> bool:
        return self.key is not None and self.sigma > 0


def reverse_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Distance of each real token from the end of its prompt; -1 on padding. ``# [B, T]``

    Works for left and right padding alike (only real tokens are counted).
    """
    m = attention_mask.to(torch.long)
    after = m.flip(1).cumsum(1).flip(1) - m  # real tokens strictly after t
    return torch.where(m.bool(), after, torch.full_like(after, -1))


def perturb_rows(
    h: torch.Tensor,
    rows: Sequence[RowNoise],
    *,
    attention_mask: torch.Tensor | None = None,
    last_k: int | None = None,
    steer: torch.Tensor | None = None,
    sigma_scale: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply per-row calibrated noise to a batch of prompt states.

    ``h``: ``# [B, T, d]`` states of a prefill forward; ``rows``: one :class:`RowNoise` per batch row;
    ``attention_mask``: ``# [B, T]`` (all ones if None); ``last_k``: perturb only the last ``k`` real
    tokens of each prompt (the fast path when only those reach the logits; the values there are
    identical to a full draw's); ``sigma_scale`` multiplies every row's sigma (depth-decayed sites).

    Returns ``(h_tilde, rel)`` where ``rel`` ``# [B]`` is the mean per-token relative perturbation
    ``||h~_t - h_t|| / ||h_t||`` over each row's perturbed tokens (0 for clean rows). Clean rows are
    returned bit-identical.
    """
    if h.dim() != 3:
        raise ValueError(f"expected hidden states of shape [B, T, d], got {tuple(h.shape)}")
    if not math.isfinite(sigma_scale) or sigma_scale < 0:
        raise ValueError(f"sigma_scale must be a finite number >= 0, got {sigma_scale}")
    B, T, d = h.shape
    if len(rows) != B:
        raise ValueError(f"got {len(rows)} RowNoise entries for a batch of {B} rows")
    mask = torch.ones(B, T, dtype=torch.long, device=h.device) if attention_mask is None else attention_mask
    if mask.shape != (B, T):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected {(B, T)}")
    rev = reverse_positions(mask.cpu())  # [B, T] on the CPU: index bookkeeping costs one transfer
    sel = rev >= 0
    if last_k is not None:
        sel &= rev < last_k
    noisy = torch.tensor([spec.noisy for spec in rows], dtype=torch.bool)  # [B]
    sel &= noisy[:, None]
    out = h.clone()
    rel = torch.zeros(B, dtype=torch.float32)
    bi, ti = sel.nonzero(as_tuple=True)  # [N] row-major: rows ascending, positions ascending
    if bi.numel() == 0:
        return out, rel
    draws = [(rows[b], rev[b, ti[bi == b]]) for b in bi.unique_consecutive().tolist()]
    bi_dev, ti_dev = bi.to(h.device), ti.to(h.device)
    h_sel = h[bi_dev, ti_dev]  # [N, d]
    new = perturb_selected(h_sel, draws, steer=steer, sigma_scale=sigma_scale)  # [N, d]
    out[bi_dev, ti_dev] = new
    per_token = relative_perturbation(h_sel, new).cpu()  # [N]
    counts = torch.bincount(bi, minlength=B).clamp_min(1)
    rel.index_add_(0, bi, per_token)
    return out, rel / counts


def to_device(t: torch.Tensor, device: torch.device, *, sync_free: bool = False) -> torch.Tensor:
    """``t`` on ``device``. ``sync_free``: a host tensor goes to a CUDA device by an asynchronous copy
    from pinned memory, so the host does not wait for the device (a plain copy from pageable memory
    does)."""
    if sync_free and device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def perturb_selected(
    h_sel: torch.Tensor,
    draws: Sequence[tuple[RowNoise, Sequence[int] | torch.Tensor]],
    *,
    steer: torch.Tensor | None = None,
    sigma_scale: float = 1.0,
    sync_free: bool = False,
) -> torch.Tensor:
    """Eq. (2) (with eq. (6)'s ``steer``) on selected prompt states, each with its keyed noise.

    ``h_sel``: ``# [N, d]`` states grouped by prompt; ``draws``: one ``(RowNoise, positions)`` per
    noisy prompt, in ``h_sel``'s order, ``positions`` the reverse positions (:func:`draw_eps`) of its
    states, so the ``len(positions)`` values sum to N; ``sigma_scale`` multiplies every sigma. The noise
    is drawn on the CPU and goes to the device in one copy for eps and one for sigma.

    ``sync_free`` (an engine step that must not wait for the device, as vLLM's): the copies are
    asynchronous from pinned memory (:func:`to_device`), nothing is read back, and a state holding a
    non-finite value is returned as it was (:func:`perturb` ``check_finite=False``) instead of raising.
    Returns ``# [N, d]``, the values :func:`perturb_rows` gives those states.
    """
    if not draws:
        return h_sel.clone()
    d = h_sel.shape[-1]
    pos_lists = [
        [int(p) for p in (pos.tolist() if isinstance(pos, torch.Tensor) else pos)] for _, pos in draws
    ]
    if (
        len({(spec.mode, *pos) for (spec, _), pos in zip(draws, pos_lists, strict=True)}) == 1
        and len(pos_lists[0]) == 1
    ):
        # one state per prompt at one position (the branch point): one generator for every key
        eps = draw_eps_keys([spec.key for spec, _ in draws], pos_lists[0][0], d, mode=draws[0][0].mode)
    else:
        eps = torch.cat(
            [
                draw_eps(spec.key, pos, d, mode=spec.mode)
                for (spec, _), pos in zip(draws, pos_lists, strict=True)
            ]
        )
    sig = torch.cat([torch.full((len(pos), 1), spec.sigma * sigma_scale * spec.sign) for spec, pos in draws])
    eps, sig = (to_device(t, h_sel.device, sync_free=sync_free) for t in (eps, sig))  # [N, d], [N, 1]
    mu = None if steer is None else to_device(steer, h_sel.device, sync_free=sync_free)  # [d]
    return perturb(h_sel, eps, sig, steer=mu, check_finite=not sync_free)


# --------------------------------------------------------------------------------------------------
# eq. (6): SPSA steering
# --------------------------------------------------------------------------------------------------
def spsa_gradient(
    reward_plus: torch.Tensor | Sequence[float],
    reward_minus: torch.Tensor | Sequence[float],
    sigma: float,
    u: torch.Tensor,
    *,
    r: torch.Tensor | Sequence[float] | None = None,
) -> torch.Tensor:
    """Two-point SPSA estimate of the reward gradient along ``u``, eq. (6).

    ``g = (mean(R+) - mean(R-)) / (2 sigma) * u``, where ``R+``/``R-`` are the rewards of the
    ``+eps``/``-eps`` members of each antithetic pair. When the pairs' branch-point displacement is
    ``r_p * u`` with per-pair scalars ``r_p`` (rank-one noise at the last prompt token), pass ``r`` and
    each pair's gap is weighted by ``r_p``: ``g = mean_p((R+_p - R-_p) r_p) / (2 sigma) * u``, which is
    eq. (6) when every ``r_p = 1``. Returns zeros when ``sigma == 0`` (noise fully annealed).
    """
    rp = torch.as_tensor(reward_plus, dtype=torch.float32)
    rm = torch.as_tensor(reward_minus, dtype=torch.float32)
    if rp.shape != rm.shape:
        raise ValueError(f"reward_plus and reward_minus must pair up, got shapes {rp.shape} and {rm.shape}")
    if sigma <= 0 or rp.numel() == 0:
        return torch.zeros_like(u, dtype=torch.float32)
    gap = rp - rm
    if r is not None:
        gap = gap * torch.as_tensor(r, dtype=torch.float32)
    return (gap.mean() / (2.0 * sigma)) * u.float()


def project_ball(mu: torch.Tensor, radius: float) -> torch.Tensor:
    """Euclidean projection onto ``{||mu|| <= radius}`` (the Pi of eq. 6)."""
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    n = torch.linalg.vector_norm(mu.float())
    if n <= radius:
        return mu
    return mu * (radius / n)


def spsa_update(
    mu: torch.Tensor, grad: torch.Tensor, lr: float, mu_max: float, max_step: float | None = None
) -> torch.Tensor:
    """``mu_{k+1} = Pi_{||.|| <= mu_max}(mu_k + lr * g_k)``, eq. (6).

    ``max_step``: if given, the step ``lr * g_k`` is first scaled down to that norm (a bounded update:
    one two-point estimate, a single reward-gap sample, cannot move ``mu`` further than that).
    """
    step = lr * grad.float()
    if max_step is not None:
        norm = float(torch.linalg.vector_norm(step))
        if norm > max_step:
            step = step * (max_step / norm)
    return project_ball(mu.float() + step, mu_max)


# --------------------------------------------------------------------------------------------------
# eq. (4): representational agreement
# --------------------------------------------------------------------------------------------------
def agreement_kernel(states: torch.Tensor, tau: float | None = None) -> torch.Tensor:
    """L2-Gaussian agreement between branch states, eq. (4). ``states``: ``# [m, d]`` -> ``# [m, m]``.

    ``kappa_ij = exp(-||h_i - h_j||^2 / (2 tau^2))`` with ``tau`` the RMS of the pairwise distances
    (i != j) unless given. If every pair coincides the kernel is all ones.
    """
    x = states.float()
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"agreement_kernel needs at least two states of shape [m, d], got {tuple(x.shape)}")
    d2 = torch.cdist(x, x).pow(2)  # [m, m]
    m = x.shape[0]
    if tau is None:
        off = d2[~torch.eye(m, dtype=torch.bool)]
        tau2 = off.mean()
        if tau2 <= 0:
            return torch.ones(m, m)
    else:
        tau2 = torch.tensor(float(tau) ** 2)
    return torch.exp(-d2 / (2.0 * tau2))


# --------------------------------------------------------------------------------------------------
# multi-layer injection
# --------------------------------------------------------------------------------------------------
def parse_noise_site(site: str | int | Sequence[int]) -> str | list[int]:
    """``"final_norm"`` -> ``"final_norm"``; ``"12"`` / ``"10,14"`` (or ints) -> sorted layer list."""
    if isinstance(site, int):
        site = str(site)
    if not isinstance(site, str):
        site = ",".join(str(int(s)) for s in site)
    s = site.strip()
    if s == "final_norm":
        return "final_norm"
    try:
        layers = [int(p) for p in s.split(",")]
    except ValueError:
        raise ValueError(
            f"noise_site={site!r} is not understood: use 'final_norm' (the paper's site) or comma-separated "
            "decoder-layer indices such as '12' or '10,14' (the propagating variant)"
        ) from None
    if any(layer < 0 for layer in layers) or len(set(layers)) != len(layers):
        raise ValueError(f"noise_site={site!r}: layer indices must be distinct and >= 0")
    return sorted(layers)


def depth_decayed_sigmas(layers: Sequence[int], decay: float) -> dict[int, float]:
    """Per-layer sigma multipliers for multi-layer injection: the top-most site gets 1, the next
    one down ``decay``, then ``decay**2`` ... (section 3.1's "depth-decayed scales")."""
    if not 0 < decay <= 1:
        raise ValueError(f"layer decay must be in (0, 1], got {decay}")
    if len(set(layers)) != len(layers):
        raise ValueError(f"noise layers must be distinct, got {list(layers)}")
    ordered = sorted(layers, reverse=True)
    return {layer: decay**i for i, layer in enumerate(ordered)}
