"""Qwen VL processors that work without torchvision.

transformers 5.23's Qwen VL processors take a ``video_processor``, and every video processor needs
torchvision, so neither ``Qwen2_5_VLProcessor(...)`` nor ``AutoProcessor.from_pretrained`` works on a
machine without it (CPU-only torch, where PyPI's torchvision does not import). These subclasses drop
the video slot and are otherwise the upstream classes (same ``__call__``, chat template, token
expansion). They are registered with ``AutoProcessor`` (under private config keys, so no upstream
mapping changes) when this module is imported: ``AutoProcessor.from_pretrained(saved_dir)`` then loads
a folder whose ``processor_config.json`` names one of them in any process that imported this module
(:func:`ncgrpo.models.load_model_and_processor` does).

A checkpoint from the hub names the upstream class (``preprocessor_config.json``'s ``processor_class``:
``Qwen2VLProcessor``, ``Qwen2_5_VLProcessor``, ``Qwen3VLProcessor``), which ``AutoProcessor`` cannot build
without torchvision. :func:`from_pretrained` (what :func:`ncgrpo.models.load_processor` calls) builds it
with ``AutoProcessor`` where torchvision is installed, and the image-only subclass of the same class
from the same files where it is not: same image processor, tokenizer, chat template, text and image
processing; videos are refused with that reason. Saved again (a checkpoint of a model trained here), it
names the upstream class and keeps the source's video processor settings, so the folder loads with
``AutoProcessor`` wherever torchvision is installed.

A folder saved by the Qwen2-VL or Qwen2.5-VL image-only processor names it (``TinyQwen2_5_VLProcessor``),
which ``AutoProcessor`` finds only in a process that imported this module; elsewhere it falls back to a
bare tokenizer, with which TRL fails (``KeyError: 'pixel_values'``). :func:`name_standard_processor`
rewrites such a folder to name :data:`STANDARD_IMAGE_ONLY_PROCESSOR`, a transformers class that does the
same image processing with no video slot, so ``AutoProcessor.from_pretrained(folder)`` gives a working
processor in any process, torchvision or not (the embedded base is saved so).

The class names keep the ``Tiny`` prefix they were first saved under, so existing folders still load.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoProcessor,
    PreTrainedConfig,
    Qwen2_5_VLProcessor,
    Qwen2VLProcessor,
    Qwen3VLProcessor,
)
from transformers.models.auto.processing_auto import PROCESSOR_MAPPING_NAMES
from transformers.utils import cached_file, is_torchvision_available

from ncgrpo.runs.folder import atomic_write_json

__all__ = [
    "IMAGE_ONLY_PROCESSORS",
    "STANDARD_IMAGE_ONLY_PROCESSOR",
    "from_pretrained",
    "image_only_kind",
    "image_only_processor",
    "name_standard_processor",
    "saved_processor_class",
    "TinyQwen2VLProcessor",
    "TinyQwen2_5_VLProcessor",
    "TinyQwen3VLProcessor",
]


def _make_image_only(base):
    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        base.__init__(self, image_processor, tokenizer, None, chat_template=chat_template, **kwargs)

    def __call__(self, images=None, text=None, videos=None, **kwargs):
        if videos is not None:  # the upstream __call__ would drop them silently without a video processor
            raise ValueError(
                f"{type(self).__name__} has no video processor: it is {base.__name__} without one, for "
                "machines without torchvision (transformers' video processors need it); load the checkpoint "
                "with torchvision installed to process videos"
            )
        return base.__call__(self, images=images, text=text, **kwargs)

    def to_dict(self):
        out = base.to_dict(self)
        upstream = getattr(self, "_upstream", None)  # (class name, video processor dict): from_pretrained
        if upstream is not None:
            out["processor_class"] = upstream[0]
            if upstream[1] is not None:
                out["video_processor"] = upstream[1]
        return out

    def save_pretrained(self, save_directory, *args, **kwargs):
        files = base.save_pretrained(self, save_directory, *args, **kwargs)
        upstream = getattr(self, "_upstream", None)
        if upstream is not None:  # the tokenizer was saved naming this class
            _set_json_key(Path(save_directory) / "tokenizer_config.json", "processor_class", upstream[0])
        return files

    name = f"Tiny{base.__name__}"
    return type(
        name,
        (base,),
        {
            "__init__": __init__,
            "__call__": __call__,
            "to_dict": to_dict,
            "save_pretrained": save_pretrained,
            "__module__": __name__,
            "__doc__": (
                f"`{base.__name__}` without a video processor (works without torchvision). Loaded from a "
                f"checkpoint naming `{base.__name__}` (:func:`from_pretrained`), it saves as that checkpoint "
                "did: the upstream class name and its video processor settings, so the saved folder loads "
                "with `AutoProcessor` wherever torchvision is installed."
            ),
        },
    )


def _set_json_key(file: Path, key: str, value) -> None:
    if not file.is_file():
        return
    data = json.loads(file.read_text(encoding="utf-8"))
    if data.get(key) != value:
        data[key] = value
        atomic_write_json(file, data)


def _image_only_processors():
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
    for kind, cls in IMAGE_ONLY_PROCESSORS.items():
        # A private config class as the mapping key: AutoProcessor finds the processor by the class name
        # saved in processor_config.json, and the mapping for real Qwen configs stays untouched.
        key = type(
            f"_NcgrpoTiny{cls.__name__}Key", (PreTrainedConfig,), {"model_type": f"ncgrpo_tiny_{kind}"}
        )
        AutoProcessor.register(key, cls, exist_ok=True)


_register_with_auto_processor()

#: The upstream processor each image-only class stands in for, by the class name a checkpoint saves.
_UPSTREAM = {
    "Qwen2VLProcessor": "qwen2_vl",
    "Qwen2_5_VLProcessor": "qwen2_5_vl",
    "Qwen3VLProcessor": "qwen3_vl",
}
_UPSTREAM_NAMES = {kind: name for name, kind in _UPSTREAM.items()}
#: Where ``AutoProcessor`` reads the processor class, in its order (the config's model type last).
_CLASS_FILES = (
    "processor_config.json",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "tokenizer_config.json",
)


def _read_json(path, name: str) -> dict | None:
    file = cached_file(
        path,
        name,
        _raise_exceptions_for_missing_entries=False,
        _raise_exceptions_for_connection_errors=False,
        _raise_exceptions_for_gated_repo=False,
    )
    if file is None:
        return None
    with open(file, encoding="utf-8") as f:
        return json.load(f)


def _video_processor_dict(path) -> dict | None:
    """The video processor settings the upstream class reads from ``path`` (transformers' order: the
    ``video_processor`` section of ``processor_config.json``, ``video_preprocessor_config.json``, then the
    image processor's ``preprocessor_config.json``), without ``processor_class``; ``None`` if none."""
    nested = _read_json(path, "processor_config.json") or {}
    found = nested.get("video_processor")
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        if found is None:
            found = _read_json(path, name)
    if found is None:
        return None
    return {k: v for k, v in found.items() if k != "processor_class"}


def saved_processor_class(path, config=None) -> str | None:
    """The processor class a checkpoint names, found as ``AutoProcessor`` finds it: ``processor_class``
    in the first of :data:`_CLASS_FILES` that has one, else the upstream processor of the model type
    (``config``, or the folder's ``config.json``); ``None`` if neither names one."""

    for name in _CLASS_FILES:
        found = (_read_json(path, name) or {}).get("processor_class")
        if found:
            return found
    if config is None:
        try:
            config = AutoConfig.from_pretrained(path)
        except (OSError, ValueError):
            return None
    names = PROCESSOR_MAPPING_NAMES.get(getattr(config, "model_type", None))
    return names if isinstance(names, str) or names is None else names[0]


def image_only_kind(path, config=None) -> str | None:
    """``"qwen2_vl"``, ``"qwen2_5_vl"`` or ``"qwen3_vl"`` when the checkpoint at ``path`` names that upstream
    Qwen VL processor and torchvision is not installed, so ``AutoProcessor`` cannot build it (its video
    processor needs torchvision); ``None`` when ``AutoProcessor`` is the way to load it."""

    if is_torchvision_available():
        return None
    return _UPSTREAM.get(saved_processor_class(path, config) or "")


def from_pretrained(path, config=None, **kwargs):
    """``AutoProcessor.from_pretrained(path, **kwargs)``, except that a checkpoint naming an upstream Qwen
    VL processor (a hub checkpoint of Qwen2-VL, Qwen2.5-VL, Qwen3-VL or a model saved from one) loads as
    its image-only subclass when torchvision is not installed (:func:`image_only_kind`; the upstream
    class would raise "Qwen2VLVideoProcessor requires the Torchvision library"). Nothing is written."""

    kind = image_only_kind(path, config)
    if kind is not None:
        processor = IMAGE_ONLY_PROCESSORS[kind].from_pretrained(path, **kwargs)
        processor._upstream = (_UPSTREAM_NAMES[kind], _video_processor_dict(path))
        return processor
    # PaddleOCRVLProcessor's image_processor_class attribute makes transformers 5.2x log a deprecation
    # warning that only transformers can act on; the loading itself is the standard one
    log = logging.getLogger("transformers.processing_utils")
    level = log.level
    log.setLevel(max(level, logging.ERROR))
    try:
        return AutoProcessor.from_pretrained(path, **kwargs)
    finally:
        log.setLevel(level)


def image_only_processor(path, **kwargs):
    """What ``NCGRPOTrainer(model=path)`` loads in place of TRL's ``AutoProcessor.from_pretrained``:
    the image-only processor (left padding and truncation, as TRL asks) when :func:`image_only_kind`
    says ``AutoProcessor`` cannot build the checkpoint's processor here, else ``None`` (TRL loads it)."""
    if image_only_kind(path) is None:
        return None
    return from_pretrained(path, truncation_side="left", padding_side="left", **kwargs)


#: transformers' processor class that processes text and images exactly as ``Qwen2VLProcessor`` /
#: ``Qwen2_5_VLProcessor`` do (each image's ``<|image_pad|>`` expanded to ``image_grid_thw.prod() //
#: merge_size**2`` tokens, the same image processor, tokenizer and chat template; output keys and tensors
#: equal, tests/test_processors.py) and has no video slot, so it loads without torchvision. It reads
#: the image token from the tokenizer (``image_token`` in ``tokenizer_config.json``).
STANDARD_IMAGE_ONLY_PROCESSOR = "PaddleOCRVLProcessor"
_STANDARD_OK = {"TinyQwen2VLProcessor", "TinyQwen2_5_VLProcessor", STANDARD_IMAGE_ONLY_PROCESSOR}


def name_standard_processor(folder) -> None:
    """Make ``folder`` (saved by ``TinyQwen2_5_VLProcessor`` or ``TinyQwen2VLProcessor``) load with
    ``AutoProcessor`` and no ncgrpo import: ``processor_class`` in ``processor_config.json`` and
    ``tokenizer_config.json`` becomes :data:`STANDARD_IMAGE_ONLY_PROCESSOR`, and the tokenizer names its
    image token (``"image_token": "<|image_pad|>"``, the token the Qwen processors use). The processor
    config also gets a ``video_processor`` section (the image processor's settings, for transformers'
    ``Qwen2VLVideoProcessor``, which is what transformers derives from a hub checkpoint without one), which
    the standard class ignores and the upstream class needs: vLLM, which builds ``Qwen2_5_VLProcessor``
    itself where torchvision is installed, loads the folder too. Nothing else changes (weights, image
    processor, vocabulary, chat template). Idempotent. A folder saved by another processor (Qwen3-VL's,
    whose text settings differ) is refused."""
    folder = Path(folder)
    files = [folder / "processor_config.json", folder / "tokenizer_config.json"]
    data = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"{f}: missing; save the processor with save_pretrained first")
        data[f] = json.loads(f.read_text(encoding="utf-8"))
        name = data[f].get("processor_class")
        if name not in _STANDARD_OK:
            raise ValueError(
                f"{f}: processor_class {name!r} is not one of {sorted(_STANDARD_OK)}; only a Qwen2-VL or "
                "Qwen2.5-VL image-only processor's folder can name the standard class"
            )
    for d in data.values():
        d["processor_class"] = STANDARD_IMAGE_ONLY_PROCESSOR
    data[files[1]].setdefault("image_token", "<|image_pad|>")
    image = data[files[0]].get("image_processor")
    if isinstance(image, dict) and "video_processor" not in data[files[0]]:
        video = {k: v for k, v in image.items() if k != "image_processor_type"}
        data[files[0]]["video_processor"] = {**video, "video_processor_type": "Qwen2VLVideoProcessor"}
    for f, d in data.items():
        atomic_write_json(f, d)
