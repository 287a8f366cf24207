"""One prefill per group: the rows of a prompt share its prefill up to the branch point.

Every row of a group writes the same clean KV cache up to the last prompt token (paper section 3.1:
at the final-norm site the perturbation acts only there), so :func:`shared_prefill_generate` prefills
each prompt once, minus its last token, expands the cache to the rows, and lets ``generate`` run the
branch point (the last prompt token, where :func:`~ncgrpo.engines.transformers.prefill_noise` and the
controls act) per row; where that would not be exact (a layer noise site, ``positions="all"``) it
falls back to one prefill per row. :func:`share_prompt_prefill` routes ``model.generate`` through it
for callers that do not call ``generate`` themselves (TRL's ``_generate_single_turn``).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ncgrpo.engines.branch_point import _BRANCH_AT, _PREFIX_PASS, unwrap_model
from ncgrpo.engines.transformers import _HOOKED

__all__ = ["SharedPrefill", "share_prompt_prefill", "shared_prefill_generate"]


@dataclass
class SharedPrefill:
    """What one :func:`shared_prefill_generate` call did: ``rows`` generated, ``unique`` prompts
    prefilled (``shared``), or why it fell back to the repeated prefill (``reason``); ``prefix_s``: the
    seconds of the shared prefix pass (vision tower included; CUDA-synchronized)."""

    rows: int
    unique: int
    shared: bool
    reason: str = ""
    prefix_s: float = 0.0


#: Per-row inputs :func:`shared_prefill_generate` knows how to slice to the unique prompts.
_ROW_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids")
#: Image inputs of the Qwen-VL family (flat patches + one grid row per image).
_IMAGE_KEYS = ("pixel_values", "image_grid_thw")
_WARNED: set[str] = set()


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"share_prompt_prefill: the prompt is prefilled once per row: {reason}", stacklevel=3)


def _image_rows(
    top: nn.Module, input_ids: torch.Tensor, grid: torch.Tensor
) -> list[tuple[int, int, int, int]] | None:
    """Per row, ``(patch_start, patch_end, image_start, image_end)``: the slice of the flat
    ``pixel_values`` and of ``image_grid_thw`` its images own (Qwen-VL layout: images in row order,
    ``prod(grid)`` patches each, ``prod(grid) / merge**2`` image tokens each); None when the layout
    cannot be read (the caller falls back)."""
    cfg = top.config
    image_token = getattr(cfg, "image_token_id", None)
    merge = getattr(getattr(cfg, "vision_config", None), "spatial_merge_size", None)
    if image_token is None or merge is None:
        return None
    patches = grid.prod(-1).tolist()
    tokens = [p // (merge * merge) for p in patches]
    per_row = (input_ids == image_token).sum(1).tolist()
    out, img, start = [], 0, 0
    for need in per_row:
        got, end, img0 = 0, start, img
        while got < need and img < len(tokens):
            got += tokens[img]
            end += patches[img]
            img += 1
        if got != need:
            return None
        out.append((start, end, img0, img))
        start = end
    return out if img == len(tokens) else None


def _groups(top: nn.Module, kwargs: dict) -> tuple[list[int], torch.Tensor, list | None] | str:
    """``(first, index, spans)``: the first row of each run of identical consecutive rows (same tokens,
    mask and image pixels), each row's run, and the rows' :func:`_image_rows` (None without images); or
    the reason the batch cannot be shared."""
    ids = kwargs["input_ids"]
    R = ids.shape[0]
    rows = [kwargs[k] for k in _ROW_KEYS if isinstance(kwargs.get(k), torch.Tensor)]
    pix, spans = None, None
    if any(kwargs.get(k) is not None for k in _IMAGE_KEYS):
        if not all(isinstance(kwargs.get(k), torch.Tensor) for k in _IMAGE_KEYS):
            return "pixel_values without image_grid_thw (or the reverse)"
        spans = _image_rows(top, ids, kwargs["image_grid_thw"])
        if spans is None:
            return "the image tokens do not match image_grid_thw"
        pix = kwargs["pixel_values"]
    # row r equals row r - 1 in every per-row input: one comparison per input, read once
    same = torch.ones(max(R - 1, 0), dtype=torch.bool, device=ids.device)
    for t in rows if R > 1 else ():
        same &= (t[1:] == t[:-1]).reshape(R - 1, -1).all(1)
    first, index, g = [0], [0], 0
    for r, equal in enumerate(same.tolist(), start=1):
        if equal and pix is not None:
            (a0, a1, _, _), (b0, b1, _, _) = spans[r], spans[r - 1]
            equal = a1 - a0 == b1 - b0 and torch.equal(pix[a0:a1], pix[b0:b1])
        if not equal:
            first.append(r)
            g += 1
        index.append(g)
    if len(first) == R:
        return "no two consecutive rows share a prompt"
    return first, torch.tensor(index, dtype=torch.long, device=ids.device), spans


def _refusal(top: nn.Module, kwargs: dict, generation_config: Any) -> str:
    """Why this ``generate`` call cannot share the prompt's prefill ("" if it can)."""
    hook = _HOOKED.get(top)
    if hook is not None and hook.layers is not None:
        return "a layer noise site writes the noise into the KV cache, so every row needs its own prefill"
    if hook is not None and hook.positions == "all":
        return 'positions="all" perturbs every prompt position, which only a full prefill computes'
    if not isinstance(kwargs.get("input_ids"), torch.Tensor) or kwargs["input_ids"].dim() != 2:
        return "generate was not given 2-D input_ids"
    if kwargs["input_ids"].shape[1] < 2:
        return "a one-token prompt has no prefix to share"
    known = set(_ROW_KEYS) | set(_IMAGE_KEYS)
    other = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in known]
    if other or kwargs.get("past_key_values") is not None or kwargs.get("inputs_embeds") is not None:
        return f"generate got inputs it cannot share ({other or 'a cache or inputs_embeds'})"
    cfg = generation_config if generation_config is not None else getattr(top, "generation_config", None)
    merged = {k: kwargs.get(k, getattr(cfg, k, None)) for k in ("num_return_sequences", "num_beams", "cache_implementation", "prefill_chunk_size", "use_cache")}  # fmt: skip
    if (merged["num_return_sequences"] or 1) > 1 or (merged["num_beams"] or 1) > 1:
        return "num_return_sequences / num_beams > 1 (pass the rows repeated, as TRL does)"
    if merged["cache_implementation"] not in (None, "dynamic"):
        return f"cache_implementation={merged['cache_implementation']!r} (only the dynamic cache is expanded)"
    if merged["prefill_chunk_size"] is not None or merged["use_cache"] is False:
        return "chunked prefill or use_cache=False"
    if getattr(top.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    mm = kwargs.get("mm_token_type_ids")
    if isinstance(mm, torch.Tensor) and bool(mm[:, -1].ne(0).any()):
        return "a prompt ends in an image token"
    return ""


def shared_prefill_generate(model: nn.Module, generate: Callable | None = None, /, **kwargs: Any):
    """``generate(**kwargs)`` with one prefill per prompt instead of one per row.

    The batch holds each prompt's rows next to each other (TRL's ``RepeatSampler`` order; the image
    method's noisy half has other pixels, so it is its own run). Runs of identical consecutive rows
    (tokens, mask, image pixels) are prefilled once, prompt minus its last token, vision tower
    included, with the position ids ``generate`` would give them (Qwen-VL's 3-D positions and
    ``rope_deltas``); the ``DynamicCache`` is expanded to the rows (``batch_select_indices``, the
    general ``batch_repeat_interleave``) and so is ``rope_deltas``; then ``generate`` runs on the full
    rows from that cache, so its first forward computes only the last prompt token. The branch-point
    hooks (:func:`~ncgrpo.engines.transformers.prefill_noise` at the final-norm site, the controls,
    :func:`~ncgrpo.engines.branch_point.branch_point_capture`) act on that forward
    (:func:`~ncgrpo.engines.branch_point.at_branch_point`) exactly as on a full prefill: the first-token
    logits agree with the repeated path within float rounding (tested: greedy tokens identical).

    Falls back to ``generate(**kwargs)`` (a warning once per reason) where sharing is not exact or not
    supported: a layer noise site (the noise is in the cache), ``positions="all"``, beams /
    ``num_return_sequences`` > 1, a non-dynamic cache, inputs it does not know (videos, embeddings).
    ``generate``: the callable to run (default ``model.generate``). The returned output is
    ``generate``'s; :data:`SharedPrefill` of the call is on ``model``'s top as ``_ncgrpo_last_shared``.
    """
    from transformers import DynamicCache

    top = unwrap_model(model)
    generate = generate if generate is not None else model.generate
    reason = _refusal(top, kwargs, kwargs.get("generation_config"))
    grouped = _groups(top, kwargs) if not reason else reason
    R = kwargs["input_ids"].shape[0] if isinstance(kwargs.get("input_ids"), torch.Tensor) else 0
    if isinstance(grouped, str):
        if reason:
            _warn_once(reason)
        top._ncgrpo_last_shared = SharedPrefill(rows=R, unique=R, shared=False, reason=grouped)
        return generate(**kwargs)
    first, index, spans = grouped
    t0 = time.perf_counter()
    ids = kwargs["input_ids"]
    sel = torch.tensor(first, dtype=torch.long, device=ids.device)
    mask = kwargs.get("attention_mask")
    u_kw: dict[str, Any] = {}
    for k in ("attention_mask", "mm_token_type_ids", "token_type_ids"):
        if isinstance(kwargs.get(k), torch.Tensor):
            u_kw[k] = kwargs[k][sel]
    if spans is not None:
        u_kw["pixel_values"] = torch.cat([kwargs["pixel_values"][spans[r][0] : spans[r][1]] for r in first])
        u_kw["image_grid_thw"] = torch.cat(
            [kwargs["image_grid_thw"][spans[r][2] : spans[r][3]] for r in first]
        )
    u_ids = ids[sel]
    with torch.no_grad():
        # generate's own position ids for the unique prompts (Qwen-VL: 3-D, and sets rope_deltas)
        pos_kw = dict(u_kw)
        position_ids = top._prepare_position_ids_for_generation(u_ids, pos_kw)
        fwd: dict[str, Any] = {"input_ids": u_ids[:, :-1], "position_ids": position_ids[..., :-1]}
        # generate drops an all-ones mask (no padding anywhere in the batch); so does the prefix pass
        if mask is not None and not bool((mask == 1).all()):
            fwd["attention_mask"] = u_kw["attention_mask"][:, :-1]
        for k in ("mm_token_type_ids", "token_type_ids"):
            if k in u_kw:
                fwd[k] = u_kw[k][:, :-1]
        for k in _IMAGE_KEYS:
            if k in u_kw:
                fwd[k] = u_kw[k]
        cache = DynamicCache(config=top.config.get_text_config(decoder=True))
        setattr(cache, _PREFIX_PASS, True)
        base = getattr(top, top.base_model_prefix)
        try:
            base(**fwd, past_key_values=cache, use_cache=True)
        finally:
            setattr(cache, _PREFIX_PASS, False)
        if len(first) != R:
            cache.batch_select_indices(index)
        setattr(cache, _BRANCH_AT, cache.get_seq_length())
        deltas = getattr(base, "rope_deltas", None)
        if isinstance(deltas, torch.Tensor) and deltas.shape[0] == len(first):
            base.rope_deltas = deltas[index.to(deltas.device)]
    if ids.device.type == "cuda":
        torch.cuda.synchronize(ids.device)
    prefix_s = time.perf_counter() - t0
    call = {k: v for k, v in kwargs.items() if k not in _IMAGE_KEYS}
    call["past_key_values"] = cache
    top._ncgrpo_last_shared = SharedPrefill(rows=R, unique=len(first), shared=True, prefix_s=prefix_s)
    return generate(**call)


@contextmanager
def share_prompt_prefill(model: nn.Module, enabled: bool = True) -> Iterator[list[SharedPrefill]]:
    """Route ``model.generate`` through :func:`shared_prefill_generate` inside the block (an instance
    attribute over the class method, removed on exit): for callers that do not call ``generate``
    themselves (TRL's ``_generate_single_turn``). Yields the list of :class:`SharedPrefill` records, one
    per ``generate`` call. ``enabled=False``: no change (the records stay empty)."""
    top = unwrap_model(model)
    calls: list[SharedPrefill] = []
    if not enabled:
        yield calls
        return
    had = "generate" in top.__dict__
    previous = top.__dict__.get("generate")
    original = top.generate

    def generate(*args: Any, **kwargs: Any):
        if len(args) > 1:  # more positional arguments than input_ids: the plain path, every argument kept
            return original(*args, **kwargs)
        if args:  # generate(input_ids, ...) positionally
            kwargs = {"input_ids": args[0], **kwargs}
        out = shared_prefill_generate(top, original, **kwargs)
        calls.append(top._ncgrpo_last_shared)
        return out

    top.generate = generate
    try:
        yield calls
    finally:
        if had:
            top.generate = previous
        else:
            del top.generate
