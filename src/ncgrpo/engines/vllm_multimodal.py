"""Image prompts for vLLM as token ids: the placeholder form vLLM 0.31 expects.

A Qwen-VL processor (what TRL tokenises prompts with) expands each image's one ``<|image_pad|>`` into
as many pads as the image has merged patches. vLLM 0.31's multimodal processor always applies its own
prompt update to token-id prompts (``BaseMultiModalProcessor._maybe_apply_prompt_updates``: it no
longer checks whether the ids already hold the expanded run): each image replaces the FIRST
``<|image_pad|>`` it finds by the full run. Given the processor's expanded ids, the engine's prompt
then holds the image's run followed by the rest of the old run as plain text tokens (16 image tokens
give 31 pads, only the first 16 carrying the image), and every rollout is generated from a prompt that
is not the one the trainer scores. TRL 1.16's colocate mode sends exactly those expanded ids
(``trl/generation/vllm_generation.py``: ``{"prompt_token_ids": ids, "multi_modal_data": ...}``), so
the ids are collapsed to one placeholder per image before they reach the engine; vLLM expands them
back to the processor's ids (tested: ``tests/engines/test_vllm_vlm.py``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "collapse_image_placeholders",
    "collapse_vllm_image_prompts",
    "image_token_id_of",
    "install_image_prompt_collapse",
]


def image_token_id_of(processing_class) -> int | None:
    """The processor's image placeholder id (``processor.image_token_id``, else ``<|image_pad|>``'s
    id in its tokenizer); ``None`` for a text-only tokenizer."""
    tid = getattr(processing_class, "image_token_id", None)
    if tid is not None:
        return int(tid)
    tok = getattr(processing_class, "tokenizer", None)
    if tok is None:
        return None
    tid = tok.convert_tokens_to_ids("<|image_pad|>")
    return None if tid is None or tid == tok.unk_token_id else int(tid)


def collapse_image_placeholders(prompt_ids: Sequence[int], image_token_id: int, num_images: int) -> list[int]:
    """``prompt_ids`` with each run of ``image_token_id`` shortened to one token.

    ``num_images``: the images the prompt carries; the ids must hold exactly that many runs (the Qwen
    chat template puts ``<|vision_start|>`` / ``<|vision_end|>`` around each, so two images never form
    one run), else ``ValueError``.
    """
    out: list[int] = []
    runs = 0
    prev = None
    for t in prompt_ids:
        t = int(t)
        if t == image_token_id:
            if prev == image_token_id:
                continue
            runs += 1
        out.append(t)
        prev = t
    if runs != num_images:
        raise ValueError(
            f"the prompt has {runs} run(s) of image tokens (id {image_token_id}) but carries {num_images} "
            "image(s): it needs one run per image"
        )
    return out


def collapse_vllm_image_prompts(prompts: Sequence[Any], image_token_id: int | None) -> list[Any]:
    """vLLM prompts with their images' placeholder runs collapsed (:func:`collapse_image_placeholders`).

    ``prompts``: what ``LLM.generate`` takes; a dict with ``prompt_token_ids`` and an ``image`` in its
    ``multi_modal_data`` (one image or a list) gets a copy with collapsed ids, anything else is returned
    as is (text prompts, prompts without images, ``image_token_id`` ``None``).
    """
    if image_token_id is None:
        return list(prompts)
    out = []
    for p in prompts:
        mm = p.get("multi_modal_data") if isinstance(p, dict) else None
        if not mm or "prompt_token_ids" not in p or mm.get("image") is None:
            out.append(p)
            continue
        images = mm["image"]
        n = len(images) if isinstance(images, list | tuple) else 1
        out.append(
            dict(p, prompt_token_ids=collapse_image_placeholders(p["prompt_token_ids"], image_token_id, n))
        )
    return out


def install_image_prompt_collapse(llm, processing_class) -> bool:
    """Make every ``llm.generate`` call of this ``vllm.LLM`` collapse its image prompts'
    placeholder runs (:func:`collapse_vllm_image_prompts`) before vLLM sees them.

    For TRL's colocate mode, whose ``VLLMGeneration.generate`` builds the rows from the processor's
    expanded ids: call it once on ``trainer.vllm_generation.llm`` for EVERY method (vanilla included,
    or the baseline keeps the doubled prompts). Per instance (the instance's class is swapped for a
    subclass; other engines are untouched), idempotent, and it survives a temporary instance-level
    ``llm.generate`` wrapper being set and deleted (``NCGRPOTrainer._nc_vllm_requests`` does that).
    Returns False, installing nothing, when ``processing_class`` has no image placeholder (a text model).
    """
    tid = image_token_id_of(processing_class)
    if tid is None:
        return False
    cls = type(llm)
    if getattr(cls, "_ncgrpo_image_token_id", None) == tid:
        return True
    base = cls.__bases__[0] if hasattr(cls, "_ncgrpo_image_token_id") else cls

    def generate(self, prompts=None, *args, **kwargs):
        if isinstance(prompts, dict):
            prompts = collapse_vllm_image_prompts([prompts], tid)[0]
        elif isinstance(prompts, list | tuple):
            prompts = collapse_vllm_image_prompts(prompts, tid)
        return base.generate(self, prompts, *args, **kwargs)

    generate.__doc__ = base.generate.__doc__
    llm.__class__ = type(
        base.__name__,
        (base,),
        {"generate": generate, "_ncgrpo_image_token_id": tid, "__module__": base.__module__},
    )
    return True
