"""Qwen VL processors that work without torchvision.

transformers 5.23's Qwen VL processors take a ``video_processor``, and every video processor needs
torchvision, so neither ``Qwen2_5_VLProcessor(...)`` nor ``AutoProcessor.from_pretrained`` works on a
machine without it (CPU-only torch, where PyPI's torchvision does not import). These subclasses drop
the video slot and are otherwise the upstream classes (same ``__call__``, chat template, token
expansion). They are registered with ``AutoProcessor`` (under private config keys, so no upstream
mapping changes) when this module is imported: ``AutoProcessor.from_pretrained(saved_dir)`` then loads
a folder whose ``processor_config.json`` names one of them in any process that imported this module
(:func:`ncgrpo.models.load_model_and_processor` does).

The class names keep the ``Tiny`` prefix they were first saved under, so existing folders still load.
"""

from __future__ import annotations

__all__ = [
    "IMAGE_ONLY_PROCESSORS",
    "TinyQwen2VLProcessor",
    "TinyQwen2_5_VLProcessor",
    "TinyQwen3VLProcessor",
]


def _make_image_only(base):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    name = f"Tiny{base.__name__}"
    return type(
        name,
        (base,),
        {
            "__init__": __init__,
            "__module__": __name__,
            "__doc__": (f"`{base.__name__}` without a video processor (works without torchvision)."),
        },
    )


def _image_only_processors():
    from transformers import Qwen2_5_VLProcessor, Qwen2VLProcessor, Qwen3VLProcessor

    return {
        "qwen2_5_vl": _make_image_only(Qwen2_5_VLProcessor),
        "qwen2_vl": _make_image_only(Qwen2VLProcessor),
        "qwen3_vl": _make_image_only(Qwen3VLProcessor),
    }


IMAGE_ONLY_PROCESSORS = _image_only_processors()
TinyQwen2_5_VLProcessor = IMAGE_ONLY_PROCESSORS["qwen2_5_vl"]
TinyQwen2VLProcessor = IMAGE_ONLY_PROCESSORS["qwen2_vl"]
TinyQwen3VLProcessor = IMAGE_ONLY_PROCESSORS["qwen3_vl"]


def _register_with_auto_processor() -> None:
    from transformers import AutoProcessor, PreTrainedConfig

    for kind, cls in IMAGE_ONLY_PROCESSORS.items():
        # A private config class as the mapping key: AutoProcessor finds the processor by the class name
        # saved in processor_config.json, and the mapping for real Qwen configs stays untouched.
        key = type(
            f"_NcgrpoTiny{cls.__name__}Key", (PreTrainedConfig,), {"model_type": f"ncgrpo_tiny_{kind}"}
        )
        AutoProcessor.register(key, cls, exist_ok=True)


_register_with_auto_processor()
