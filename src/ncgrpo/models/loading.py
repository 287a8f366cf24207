"""Load a model and its processor (or tokenizer) from a local folder, the transformers way."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on a GPU that supports it, float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def is_vision_language(config: Any) -> bool:
    return getattr(config, "vision_config", None) is not None


def load_model_and_processor(
    path: str | Path,
    *,
    dtype: str | torch.dtype | None = "auto",
    device: str | None = "auto",
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """``(model, processor)`` for a vision-language checkpoint, ``(model, tokenizer)`` for a text one.

    ``path`` is a local folder (or a hub id already in the cache). The model is put in eval mode on
    ``device``. The processor's tokenizer is set to left padding, which batched generation needs.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
    )

    # Registers the video-less processor classes of ncgrpo's tiny models with AutoProcessor, so their
    # saved folders load in any process (the upstream Qwen processors need torchvision for video).
    import ncgrpo.models.tiny  # noqa: F401

    dev = resolve_device(device)
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise FileNotFoundError(
            f"cannot load a model config from {path!s}: {e}. Pass a folder written by save_pretrained "
            "(config.json, weights, tokenizer/processor files)."
        ) from None
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype, dev)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if is_vision_language(config):
        model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        processor = AutoProcessor.from_pretrained(path)
        tok = processor.tokenizer
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        processor = AutoTokenizer.from_pretrained(path)
        tok = processor
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model.to(dev).eval()
    return model, processor


def tokenizer_of(processor: Any) -> Any:
    """The tokenizer behind a processor (or the tokenizer itself)."""
    return getattr(processor, "tokenizer", processor)
