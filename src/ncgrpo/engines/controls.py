"""Matched control interventions for the transformers engine (no hidden-state noise).

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
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ncgrpo.engines.transformers import find_text_stack

__all__ = ["FirstTokenTemperatureHook", "first_token_temperature"]


class FirstTokenTemperatureHook:
    """Handle of :func:`first_token_temperature`: ``calls`` counts prefill forwards it rescaled."""

    def __init__(self, flags: torch.Tensor, factor: float) -> None:
        self.flags = flags  # [B] bool
        self.factor = factor
        self.calls = 0
        self._prefill = False

    def top_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = kwargs.get("past_key_values")
        self._prefill = cache is None or cache.get_seq_length() == 0

    def head_post(self, module: nn.Module, args: tuple, output: Any):
        if not self._prefill:
            return None
        self._prefill = False  # one rescale per prefill forward
        logits = output  # [B, T_keep, V]
        if logits.shape[0] != self.flags.numel():
            raise ValueError(
                f"first_token_temperature got {self.flags.numel()} row flags but the prefill batch has "
                f"{logits.shape[0]} rows; pass one flag per row of the expanded batch"
            )
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
    handles = [
        top.register_forward_pre_hook(hook.top_pre, with_kwargs=True),
        head.register_forward_hook(hook.head_post),
    ]
    try:
        yield hook
    finally:
        for h in handles:
            h.remove()
