"""The branch point of a transformers model: the forward that computes the prompt's last position.

Every branch-point hook (:func:`~ncgrpo.engines.transformers.prefill_noise`, the controls of
:mod:`ncgrpo.engines.controls`, :func:`branch_point_capture`) finds the language-model stack with
:func:`find_text_stack` (through :func:`unwrap_model`), decides whether a forward is the branch point
with :func:`at_branch_point` (an empty KV cache, or the cache
:func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate` prefilled with the prompt minus its last
token), and reads the LM head there with :func:`head_function`. :func:`eos_token_ids` and
:func:`cut_after_eos` cut the rows ``generate`` returns at their first EOS.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = [
    "BranchPoint",
    "at_branch_point",
    "branch_point_capture",
    "cut_after_eos",
    "eos_token_ids",
    "find_text_stack",
    "head_function",
    "unwrap_model",
]

# Where the language-model stack (the module owning ``.layers`` and the final ``.norm``) lives,
# relative to the unwrapped top-level model. VL models (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) first,
# then text-only causal LMs (Qwen2, Qwen3, Llama, ...).
_STACK_PATHS = ("model.language_model", "model")


def unwrap_model(model: nn.Module) -> nn.Module:
    """Strip DDP/FSDP-style ``.module`` wrappers and PEFT ``PeftModel``/``LoraModel`` layers.

    Returns the transformers model whose ``forward`` ``generate`` calls. Cheap and duck-typed: a
    PEFT model exposes ``get_base_model()``; DDP and ``DataParallel`` expose ``.module``.
    """
    seen = 0
    while seen < 8:
        seen += 1
        if hasattr(model, "get_base_model") and callable(model.get_base_model):
            inner = model.get_base_model()
            if inner is not model:
                model = inner
                continue
        inner = getattr(model, "module", None)
        if isinstance(inner, nn.Module) and not hasattr(model, "lm_head"):
            model = inner
            continue
        break
    return model


def _get_path(root: nn.Module, path: str) -> Any:
    obj: Any = root
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def find_text_stack(model: nn.Module) -> tuple[nn.Module, nn.Module, str]:
    """``(top, stack, path)``: the unwrapped top-level model, its language-model stack, and the
    stack's attribute path. The stack is the module whose forward returns the final-norm output."""
    top = unwrap_model(model)
    for path in _STACK_PATHS:
        stack = _get_path(top, path)
        if isinstance(stack, nn.Module) and isinstance(getattr(stack, "norm", None), nn.Module):
            layers = getattr(stack, "layers", None)
            if isinstance(layers, nn.ModuleList) and len(layers) > 0:
                return top, stack, path
    looked = " or ".join(f"model.{p}.norm" for p in _STACK_PATHS)
    raise NotImplementedError(
        f"prefill_noise does not know where the language-model stack of {type(top).__name__} is: it looked "
        f"for {looked} (a module with a final `.norm` and decoder `.layers`). Supported: Qwen2-VL, "
        "Qwen2.5-VL, Qwen3-VL and text-only Qwen2/Qwen3/Llama causal LMs."
    )


def eos_token_ids(model: nn.Module, generation_config: Any = None) -> set[int]:
    """The end-of-sequence token ids ``generate`` stops at: ``generation_config``'s if it names any,
    else the model's own ``generation_config``'s (empty when neither does)."""
    for cfg in (generation_config, getattr(model, "generation_config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is None:
            continue
        ids = {int(eos)} if isinstance(eos, int) else {int(e) for e in eos}
        if ids:
            return ids
    return set()


def cut_after_eos(rows: Sequence[Sequence[int]], eos: set[int]) -> list[list[int]]:
    """Each row of generated ids up to and including its first EOS (``generate`` pads finished rows
    after their EOS)."""
    out = []
    for ids in rows:
        cut = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        out.append(list(ids[:cut]))
    return out


#: Attributes :func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate` sets on the cache it
#: prefills: ``_PREFIX_PASS`` while the prompt minus its last token is computed (every hook stays
#: inert), then ``_BRANCH_AT``: the cache length at which the next forward is the branch point (the
#: last prompt token).
_PREFIX_PASS = "_ncgrpo_prefix_pass"
_BRANCH_AT = "_ncgrpo_branch_at"


def at_branch_point(cache: Any) -> bool:
    """Whether a forward with KV cache ``cache`` computes the prompt's last position for the first time:
    an empty cache (the ordinary prefill) or a cache
    :func:`~ncgrpo.engines.shared_prefill.shared_prefill_generate` filled with the prompt minus its last
    token and nothing since. False during that shared prefix pass itself and on every decode step.
    Every branch-point hook (the noise, the controls) decides with this."""
    if cache is None:
        return True
    if getattr(cache, _PREFIX_PASS, False):
        return False
    n = cache.get_seq_length()
    return n == 0 or n == getattr(cache, _BRANCH_AT, -1)


@dataclass
class BranchPoint:
    """What :func:`branch_point_capture` read at the first ``lm_head`` call (the prefill)."""

    logits: torch.Tensor | None = None  # [B, V] float32, last position, before any temperature
    states: torch.Tensor | None = None  # [B, d] the LM head's input there (model dtype)
    extra: Any = None  # what ``on_branch`` returned


def head_function(module: nn.Module, who: str, otherwise: str = "") -> Callable[[torch.Tensor], torch.Tensor]:
    """The LM head ``module`` as a plain function (``F.linear`` on its weights: no forward hooks run,
    so it can be called from inside the head's own forward hook). Called where the weights are not
    gathered (a DeepSpeed ZeRO-3 partition), it raises, naming ``who`` needs them and ``otherwise``.
    The function carries the weight as ``.weight`` (the head is linear in its input:
    :class:`ncgrpo.core.marginal.MarginalCurve` computes its control variate's mean from it)."""

    def head(x: torch.Tensor) -> torch.Tensor:
        if module.weight.numel() == 0:  # a ZeRO-3 partition: not gathered even inside the forward
            raise RuntimeError(
                f"{who} reads the LM head's weights inside the prefill, but they are partitioned there "
                f"(DeepSpeed ZeRO-3 with ds3_gather_for_generation=False). Set ds3_gather_for_generation=True"
                + (f", {otherwise}." if otherwise else ".")
            )
        return torch.nn.functional.linear(x, module.weight, getattr(module, "bias", None))

    head.weight = module.weight  # type: ignore[attr-defined]  # linear: the marginal's control variate reads it
    return head


@contextmanager
def branch_point_capture(model: nn.Module, on_branch: Callable | None = None) -> Iterator[BranchPoint]:
    """Read the branch point (the prompt's last position) of the next forward of ``model``: an
    ``lm_head`` forward hook keeps the first call's last-position logits and the head's input there.
    The hook runs inside the forward, so it also works where weights are only gathered during
    ``generate`` (ZeRO-3); it is removed on exit. ``on_branch(head, logits, states)``, if given, runs
    there too (``head``: the LM head as a plain function, no hooks, its weights as gathered for the
    forward) and its result is kept in ``point.extra``: computations that need the LM head's weights
    after the prefill (the first-token marginal) must happen here, not after ``generate`` returns."""
    point = BranchPoint()

    def capture(module, args, output):
        if point.logits is None:
            handle.remove()  # only the first call is read: the decode steps run without this hook
            point.logits = output[:, -1].detach().float()
            point.states = args[0][:, -1].detach()
            if on_branch is not None:
                head = head_function(
                    module,
                    "NC-GRPO's first-token marginal (noise/first_token_marginal_tv, first_token_temperature_auto)",
                    "or marginal_tv_draws=0 and no first_token_temperature_auto",
                )
                point.extra = on_branch(head, point.logits, point.states)

    handle = find_text_stack(model)[0].lm_head.register_forward_hook(capture)
    try:
        yield point
    finally:
        handle.remove()
