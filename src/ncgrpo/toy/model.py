"""The embedded model's builders: a local tokenizer, processor and tiny Qwen2.5-VL, all from configs.

Nothing here touches the Hugging Face hub: the tokenizer is a byte-level BPE trained on a small corpus,
the processor wraps the PIL image processor of Qwen2-VL (torchvision is not required), and the models
are instantiated from configs with a fixed seed. The point is that every part of ncgrpo (hidden-state
hooks, the TRL trainer, the eval runner, the CPU demo) runs the *real* transformers code paths,
only at toy scale.

Typical use::

    tok = build_tokenizer()
    proc = build_processor(tok)
    model = tiny_qwen2_5_vl(processor=proc)
    save_tiny(model, proc, "runs/tiny-vl")   # loadable with AutoModelForImageTextToText / AutoProcessor

Without torchvision the upstream Qwen VL processors cannot be built or loaded (their video processor
needs it), so the processors here are :mod:`ncgrpo.processors`' subclasses without a video slot.
The Qwen2-VL, Qwen3-VL and text-only builders the tests use live in ``tests/tiny_models.py``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast, Qwen2_5_VLConfig
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

from ncgrpo.models import tokenizer_of
from ncgrpo.processors import IMAGE_ONLY_PROCESSORS

__all__ = [
    "DEFAULT_CORPUS",
    "QWEN_CHAT_TEMPLATE",
    "CONTROL_TOKENS",
    "SPECIAL_TOKENS",
    "THINK_TOKENS",
    "build_processor",
    "build_tokenizer",
    "count_parameters",
    "save_tiny",
    "tiny_qwen2_5_vl",
    "tiny_qwen2_5_vl_config",
    "tiny_vl_model",
]

# --------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------

# Qwen control tokens: trained in as specials, so they take ids 0..6 in this order and are skipped by
# `decode(..., skip_special_tokens=True)`.
CONTROL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",  # pad (and bos_token_id in Qwen configs; the tokenizer adds no bos)
    "<|im_start|>",
    "<|im_end|>",  # eos
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
# Reasoning tags: added tokens that are NOT special (as in Qwen3), so they survive skip_special_tokens
# decoding that the format reward sees. They take the last two ids.
THINK_TOKENS: tuple[str, ...] = ("<think>", "</think>")
SPECIAL_TOKENS: tuple[str, ...] = CONTROL_TOKENS + THINK_TOKENS
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# Qwen2.5-VL's ChatML template (as shipped with Qwen/Qwen2.5-VL-*-Instruct), with `add_vision_id`.
QWEN_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}"
    "{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}"
    "{% endif %}"
    "{% endfor %}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

DEFAULT_CORPUS: tuple[str, ...] = (
    "You are a helpful assistant.",
    "You FIRST think about the reasoning process as an internal monologue and then provide the final "
    "answer. The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST "
    "BE put in \\boxed{}.",
    "<think> The triangle has sides 3, 4 and 5, so it is a right triangle. </think> The area is \\boxed{6}.",
    "<think> 2 + 2 = 4 and 4 * 3 = 12. </think> \\boxed{12}",
    "Find the value of x in the figure. Round to the nearest tenth if necessary.",
    "In the circle with center O, the measure of angle AOB is 120 degrees. Find the length of arc AB.",
    "What is the perimeter of the rectangle? The width is 7 cm and the length is 12 cm.",
    "Solve for x: 3x + 5 = 20. Subtract 5 from both sides to get 3x = 15, so x = 5.",
    "The sum of the interior angles of a polygon with n sides is (n - 2) * 180 degrees.",
    "If a = 1/2 and b = 3/4, then a + b = 5/4 and a * b = 3/8.",
    "The hypotenuse c satisfies a^2 + b^2 = c^2. With a = 6 and b = 8 we get c = 10.",
    "Question: How many apples are left if you start with 10 and eat 3? Answer: 7",
    "The image shows a bar chart. Which category has the highest value? Answer yes or no.",
    "Is the line AB parallel to CD? answer \\boxed{yes} or \\boxed{no}",
    "The quick brown fox jumps over the lazy dog.",
    "Let f(x) = x^2 - 4x + 3. The roots are x = 1 and x = 3, and the vertex is at (2, -1).",
    "The probability of rolling a sum of 7 with two dice is 6/36 = 1/6.",
    "Therefore, the answer is 42. Let's verify: 6 * 7 = 42.",
    "A circle has radius r = 5, so its area is 25 pi and its circumference is 10 pi.",
    "Step 1: read the problem. Step 2: write the equation. Step 3: solve it. Step 4: check the result.",
    "0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 30 45 60 90 100 180 360 1000",
    "sin cos tan sqrt log exp pi theta alpha beta gamma angle degree triangle square circle",
)


def build_tokenizer(corpus: Iterable[str] | None = None, *, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a tiny byte-level BPE tokenizer with Qwen-style special tokens and the ChatML template.

    Deterministic: the same corpus and vocab_size give the same vocabulary (the BPE trainer breaks ties
    by pair order). `CONTROL_TOKENS` get ids 0..6 and are special; `<think>`/`</think>` are added,
    non-special tokens with the last two ids. None of them is ever split. Every byte is in the alphabet,
    so any string round-trips through encode/decode. `len(tokenizer) <= vocab_size` (equal unless the
    corpus runs out of merges).
    """

    texts = list(DEFAULT_CORPUS if corpus is None else corpus)
    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < min_vocab:
        raise ValueError(f"vocab_size must be >= {min_vocab} (special tokens + 256 bytes), got {vocab_size}")

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(THINK_TOKENS),
        min_frequency=1,
        special_tokens=list(CONTROL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        chat_template=QWEN_CHAT_TEMPLATE,
    )
    hf.add_special_tokens(
        {"additional_special_tokens": [t for t in CONTROL_TOKENS if t not in (EOS_TOKEN, PAD_TOKEN)]}
    )
    missing = [t for t in SPECIAL_TOKENS if t not in hf.get_vocab()]
    assert not missing, f"special tokens missing from vocab: {missing}"
    return hf


# --------------------------------------------------------------------------------------------------
# Processor
# --------------------------------------------------------------------------------------------------


def _image_processor(*, image_size: int, patch_size: int, merge_size: int, temporal_patch_size: int = 2):
    # The torchvision backend (`Qwen2VLImageProcessor`) needs torchvision; the PIL backend does not.

    factor = patch_size * merge_size
    # smart_resize rounds each side to a multiple of `factor` and keeps the area within
    # [min_pixels, max_pixels]: every image becomes at most ~image_size x image_size pixels,
    # i.e. at most (image_size / factor)^2 merged tokens (4 for the defaults 56 / 14 / 2).
    max_pixels = max(image_size, factor) ** 2
    min_pixels = factor * factor
    return Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        temporal_patch_size=temporal_patch_size,
        merge_size=merge_size,
    )


def build_processor(
    tokenizer: PreTrainedTokenizerFast | None = None,
    *,
    image_size: int | None = None,
    patch_size: int | None = None,
    merge_size: int = 2,
    kind: Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl"] = "qwen2_5_vl",
):
    """A Qwen2.5-VL processor (subclass of `Qwen2_5_VLProcessor`) around `tokenizer` for tiny images.

    Images are resized so their area is at most `image_size**2` pixels (default `2 * patch_size *
    merge_size`, i.e. 56): a 56x56 or 64x64 image gives a 4x4 patch grid, i.e. 4 `<|image_pad|>` tokens
    after the 2x2 merge. No video processor is attached (:mod:`ncgrpo.processors`). `kind`
    selects the Qwen2-VL or Qwen3-VL processor instead; Qwen3-VL defaults to 16-pixel patches (and so to
    64-pixel images). All use Qwen2.5-VL's chat template.
    """
    if tokenizer is None:
        tokenizer = build_tokenizer()
    if patch_size is None:
        patch_size = 16 if kind == "qwen3_vl" else 14  # Qwen3-VL's vision tower uses 16-pixel patches
    if image_size is None:
        image_size = 2 * patch_size * merge_size
    image_processor = _image_processor(image_size=image_size, patch_size=patch_size, merge_size=merge_size)
    if kind not in IMAGE_ONLY_PROCESSORS:
        raise ValueError(f"unknown processor kind {kind!r}; expected one of {sorted(IMAGE_ONLY_PROCESSORS)}")
    return IMAGE_ONLY_PROCESSORS[kind](
        image_processor=image_processor, tokenizer=tokenizer, chat_template=QWEN_CHAT_TEMPLATE
    )


def _token_ids(tokenizer) -> dict[str, int]:
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    bad = [t for t, i in ids.items() if i is None or i == tokenizer.unk_token_id]
    if bad:
        raise ValueError(f"tokenizer lacks Qwen special tokens {bad}; build it with build_tokenizer()")
    return ids


# --------------------------------------------------------------------------------------------------
# Configs and models
# --------------------------------------------------------------------------------------------------


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim/2 rotary frequencies over (temporal, height, width) like Qwen's [16, 24, 24]."""
    half = head_dim // 2
    if half < 3:
        raise ValueError(f"head_dim {head_dim} too small for 3-axis M-RoPE")
    hw = (half * 3) // 8  # 24/64 each for height and width in Qwen2.5-VL
    hw = max(hw, 1)
    t = half - 2 * hw
    if t < 1:
        t, hw = 1, (half - 1) // 2
        t = half - 2 * hw
    sec = [t, hw, hw]
    assert sum(sec) == half
    return sec


def _special_config_fields(tokenizer, vocab_size: int | None) -> tuple[dict[str, int], int]:
    if tokenizer is None:
        tokenizer = build_tokenizer()
    ids = _token_ids(tokenizer)
    n = len(tokenizer)
    vocab_size = n if vocab_size is None else vocab_size
    if vocab_size < n:
        raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer ({n} tokens)")
    return ids, vocab_size


def _mrope_text_config(
    ids: dict[str, int], *, hidden_size: int, num_attention_heads: int, rope_theta: float, **fields: Any
) -> dict[str, Any]:
    """Text-tower config of Qwen2-VL / Qwen2.5-VL: M-RoPE sections from the head dim, special ids."""
    return dict(
        hidden_size=hidden_size,
        num_attention_heads=num_attention_heads,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": _mrope_section(hidden_size // num_attention_heads),
        },
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        **fields,
    )


def _vl_config_kwargs(
    text_config, vision_config, ids: dict[str, int], tie_word_embeddings: bool
) -> dict[str, Any]:
    """Top-level VL config fields shared by every Qwen VL generation: sub-configs and special-token ids."""
    return dict(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )


def tiny_qwen2_5_vl_config(
    *,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_intermediate_size: int = 32,
    vision_num_heads: int = 4,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 2,
    window_size: int = 112,
    rope_theta: float = 1e4,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    tokenizer=None,
    **overrides: Any,
):
    """A `Qwen2_5_VLConfig` at toy scale with special-token ids taken from `tokenizer`.

    `vocab_size` defaults to `len(tokenizer)`. `overrides` go to the top-level config (e.g.
    `attn_implementation`). M-RoPE sections are derived from the head dim so they sum to head_dim/2.
    """

    tokenizer = tokenizer_of(tokenizer) if tokenizer is not None else None
    ids, vocab_size = _special_config_fields(tokenizer, vocab_size)
    text_config = _mrope_text_config(
        ids,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_theta=rope_theta,
        tie_word_embeddings=tie_word_embeddings,
    )
    n_vis = vision_depth
    vision_config = dict(
        depth=n_vis,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size,
        num_heads=vision_num_heads,
        out_hidden_size=hidden_size,
        patch_size=patch_size,
        spatial_merge_size=spatial_merge_size,
        temporal_patch_size=temporal_patch_size,
        window_size=window_size,
        # last block full attention, the rest windowed, like the real model's [7, 15, 23, 31]
        fullatt_block_indexes=[n_vis - 1],
    )
    kw = _vl_config_kwargs(text_config, vision_config, ids, tie_word_embeddings)
    kw.update(overrides)
    return Qwen2_5_VLConfig(**kw)


def _generation_config(ids: dict[str, int]) -> GenerationConfig:
    # Mirrors Qwen2.5-VL-Instruct's generation_config.json (eos = [<|im_end|>, <|endoftext|>]),
    # but greedy by default so tests are deterministic; callers pass do_sample/temperature as needed.
    return GenerationConfig(
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=[ids[EOS_TOKEN], ids[PAD_TOKEN]],
        pad_token_id=ids[PAD_TOKEN],
        do_sample=False,
    )


def _instantiate(model_cls, config, *, seed: int, dtype: torch.dtype, attn_implementation: str):
    config._attn_implementation = attn_implementation
    # Text/vision sub-configs must see the same attention implementation.
    for sub in ("text_config", "vision_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
    model = model.to(dtype)
    model.eval()
    return model


def tiny_vl_model(
    cls_name: str,
    make_config,
    *,
    tokenizer=None,
    processor=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """Random-init tiny VL model ``transformers.<cls_name>`` from ``make_config(tokenizer=..., **overrides)``.

    Patch/merge sizes follow ``processor`` when given.
    """

    tok = tokenizer_of(processor) if processor is not None else tokenizer
    if tok is None:
        tok = build_tokenizer()
    if processor is not None:
        ip = processor.image_processor
        overrides.setdefault("patch_size", ip.patch_size)
        overrides.setdefault("spatial_merge_size", ip.merge_size)
        overrides.setdefault("temporal_patch_size", ip.temporal_patch_size)
    config = make_config(tokenizer=tok, **overrides)
    model = _instantiate(
        getattr(transformers, cls_name),
        config,
        seed=seed,
        dtype=dtype,
        attn_implementation=attn_implementation,
    )
    model.generation_config = _generation_config(_token_ids(tok))
    return model


def tiny_qwen2_5_vl(*, tokenizer=None, processor=None, seed: int = 0, **overrides: Any):
    """Tiny random `Qwen2_5_VLForConditionalGeneration` (float32, sdpa attention, fixed seed)."""
    return tiny_vl_model(
        "Qwen2_5_VLForConditionalGeneration",
        tiny_qwen2_5_vl_config,
        tokenizer=tokenizer,
        processor=processor,
        seed=seed,
        **overrides,
    )


# --------------------------------------------------------------------------------------------------
# Save / count
# --------------------------------------------------------------------------------------------------


def save_tiny(model: PreTrainedModel, processor_or_tokenizer, out_dir: str | os.PathLike) -> Path:
    """Save model + processor (or tokenizer) so the Auto* classes load them offline from `out_dir`.

    VL: `AutoModelForImageTextToText.from_pretrained(out_dir)` and `AutoProcessor.from_pretrained(out_dir)`;
    text: `AutoModelForCausalLM` / `AutoTokenizer`.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    processor_or_tokenizer.save_pretrained(out)
    return out


def count_parameters(model: torch.nn.Module) -> dict[str, int]:
    """Parameter counts: total, and for VL models the vision tower and the language side."""
    total = sum(p.numel() for p in model.parameters())
    out = {"total": total}
    visual = getattr(getattr(model, "model", None), "visual", None)
    if visual is not None:
        out["vision"] = sum(p.numel() for p in visual.parameters())
        out["language"] = total - out["vision"]
    return out
