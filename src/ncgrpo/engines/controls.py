"""Matched control interventions for the transformers engine (no hidden-state noise in the forward).

:func:`first_token_temperature` is the control for NC-GRPO's branch-point mechanism (paper section
3.1, "Where the perturbation acts": the latent perturbation only moves the first-token logits, so the
nearest output-space intervention is to sample the noisy half's FIRST token at a higher temperature
and decode the rest exactly as the clean half does).

``generate`` computes logits only at the last prompt position during the prefill forward
(``logits_to_keep=1``) and then divides them by ``temperature`` in its logits processors. Scaling the
flagged rows' prefill logits by ``temperature / first_token_temperature`` therefore makes those rows
sample their first token from ``softmax(logits / first_token_temperature)``; every decode step (KV
cache non-empty) is left untouched, and so are the unflagged rows.

    with first_token_temperature(model, flags, temperature=1.0, first_token_temperature=2.0):
        out = model.generate(**inputs, do_sample=True, temperature=1.0)

:func:`first_token_marginal` samples the flagged rows' first token from the noise-averaged
distribution ``q_bar`` (:mod:`ncgrpo.core.marginal`) without any noise in the model's forward: the
prefill's last-position logits of a flagged row are replaced by ``T * log q_hat``, ``q_hat`` the mean of
``softmax(lm_head(h + sigma ||h|| / sqrt(d) eps_m) / T)`` over a fresh pool of draws per row. Sampling
from ``q_hat`` with a fresh pool per row draws from ``E[q_hat] = q_bar`` exactly, so this control has
NC-GRPO's (``latent``, final-norm site) distribution of groups by construction; a difference between
the two in training is a bug or a numerical effect.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ncgrpo.core.marginal import mixture_log_probs, pool_keys
from ncgrpo.core.noise import NoiseKey
from ncgrpo.engines.branch_point import at_branch_point, find_text_stack, head_function

__all__ = [
    "FirstTokenMarginalHook",
    "FirstTokenTemperatureHook",
    "first_token_marginal",
    "first_token_temperature",
]


class _PrefillHeadHook:
    """Rewrites the LM head's output once per prefill forward (a forward of the top model whose KV
    cache is empty, or the branch forward of a shared prefill: the first token's logits,
    :func:`~ncgrpo.engines.branch_point.at_branch_point`); decode steps pass through. ``calls`` counts rewrites."""

    name = ""  # the control, in messages
    given = ""  # what the caller gives per row, in messages
    per_row = ""

    def __init__(self, n_rows: int) -> None:
        self.n_rows = n_rows
        self.calls = 0
        self._prefill = False

    def top_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._prefill = at_branch_point(kwargs.get("past_key_values"))

    def head_post(self, module: nn.Module, args: tuple, output: Any):
        if not self._prefill:
            return None
        self._prefill = False  # one rewrite per prefill forward
        if output.shape[0] != self.n_rows:
            raise ValueError(
                f"{self.name} got {self.n_rows} {self.given} but the prefill batch has "
                f"{output.shape[0]} rows; pass {self.per_row} per row of the expanded batch"
            )
        return self.rewrite(module, args, output)  # output: [B, T_keep, V]

    def rewrite(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


@contextmanager
def _installed(top: nn.Module, head: nn.Module, hook: _PrefillHeadHook) -> Iterator[_PrefillHeadHook]:
    """``hook`` on ``top``'s forward (prefill detection) and ``head``'s output, removed on exit."""
    handles = [
        top.register_forward_pre_hook(hook.top_pre, with_kwargs=True),
        head.register_forward_hook(hook.head_post),
    ]
    try:
        yield hook
    finally:
        for h in handles:
            h.remove()


class FirstTokenTemperatureHook(_PrefillHeadHook):
    """Handle of :func:`first_token_temperature`: ``calls`` counts prefill forwards it rescaled."""

    name, given, per_row = "first_token_temperature", "row flags", "one flag"

    def __init__(self, flags: torch.Tensor, factor: float) -> None:
        super().__init__(flags.numel())
        self.flags = flags  # [B] bool
        self.factor = factor

    def rewrite(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        scale = torch.where(
            self.flags.to(logits.device),
            torch.tensor(self.factor, dtype=logits.dtype, device=logits.device),
            torch.tensor(1.0, dtype=logits.dtype, device=logits.device),
        )  # [B]
        self.calls += 1
        return logits * scale.view(-1, *([1] * (logits.dim() - 1)))


@contextmanager
def first_token_temperature(
    model: nn.Module,
    flags: Sequence[bool] | torch.Tensor,
    *,
    temperature: float,
    first_token_temperature: float,
) -> Iterator[FirstTokenTemperatureHook]:
    """Make the flagged rows sample their first token at ``first_token_temperature``.

    ``flags``: one bool per row of the prefill batch. ``temperature``: the sampling temperature
    ``generate`` applies (TRL's ``args.temperature``). Hooks are removed on exit, also on error.
    """
    if temperature <= 0 or first_token_temperature <= 0:
        raise ValueError(
            f"temperatures must be > 0, got temperature={temperature}, first_token_temperature={first_token_temperature}"
        )
    top, _, _ = find_text_stack(model)
    head = getattr(top, "lm_head", None)
    if not isinstance(head, nn.Module):
        raise NotImplementedError(f"{type(top).__name__} has no `lm_head` module to rescale")
    hook = FirstTokenTemperatureHook(
        torch.as_tensor(list(flags) if not isinstance(flags, torch.Tensor) else flags, dtype=torch.bool),
        temperature / first_token_temperature,
    )
    with _installed(top, head, hook):
        yield hook


class FirstTokenMarginalHook(_PrefillHeadHook):
    """Handle of :func:`first_token_marginal`: ``calls`` counts prefill forwards it rewrote; ``rows`` the
    rows rewritten in the last one."""

    name, given, per_row = "first_token_marginal", "row keys", "one key (or None)"

    def __init__(
        self,
        keys: list[NoiseKey | None],
        sigma: float | Callable[[], Sequence[float]],
        temperature: float,
        draws: int,
    ) -> None:
        super().__init__(len(keys))
        self.keys = keys
        self.sigma = sigma  # a float, or the rows' sigmas, read at the prefill (the target schedule's solve)
        self.temperature = float(temperature)
        self.draws = int(draws)
        self.rows: list[int] = []
        self.last_logits: torch.Tensor | None = None  # [B, V] float32: what each row sampled from

    def rewrite(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        h = args[0][:, -1]  # [B, d] the final-norm state at the branch point (clean)
        head = head_function(module, "first_token_marginal")  # no re-entry into this hook

        out = logits.clone()
        self.rows = []
        sigmas = [float(self.sigma)] * len(self.keys) if not callable(self.sigma) else list(self.sigma())
        if len(sigmas) != len(self.keys):
            raise ValueError(f"first_token_marginal: {len(sigmas)} sigmas for {len(self.keys)} rows")
        for b, key in enumerate(self.keys):
            if key is None or sigmas[b] <= 0:
                continue
            logq = mixture_log_probs(
                head, h[b], pool_keys(key, self.draws), sigmas[b], temperature=self.temperature
            )
            out[b, -1] = (self.temperature * logq).to(out.dtype)
            self.rows.append(b)
        self.calls += 1
        self.last_logits = out[:, -1].detach().float()
        return out


@contextmanager
def first_token_marginal(
    model: nn.Module,
    keys: Sequence[NoiseKey | None],
    *,
    sigma: float | Callable[[], Sequence[float]],
    temperature: float,
    draws: int = 16,
) -> Iterator[FirstTokenMarginalHook]:
    """Make the rows with a key sample their first token from the noise-averaged distribution ``q_bar``.

    ``keys``: one per row of the prefill batch (``None``: the row samples as usual); row ``b``'s pool is
    :func:`ncgrpo.core.marginal.pool_keys` of its key (``draws`` independent-mode draws). ``sigma``: the
    noise scale whose ``q_bar`` is sampled, or a function giving each row's, called at the prefill (where
    the target schedule has just solved them); ``temperature``: the sampling temperature ``generate``
    applies. Only the final-norm site's ``q_bar`` is defined this way. Hooks are removed on exit, also on
    error.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if not ((callable(sigma) or sigma >= 0) and draws >= 1):
        raise ValueError(f"sigma must be >= 0 and draws >= 1, got sigma={sigma}, draws={draws}")
    top, _, _ = find_text_stack(model)
    head = getattr(top, "lm_head", None)
    if not isinstance(head, nn.Linear):
        raise NotImplementedError(f"{type(top).__name__} has no linear `lm_head` to sample q_bar through")
    hook = FirstTokenMarginalHook(list(keys), sigma, temperature, draws)
    with _installed(top, head, hook):
        yield hook
