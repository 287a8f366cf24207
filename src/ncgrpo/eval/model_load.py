"""The model an evaluation decodes with: loaded for its engine (a transformers model, a PEFT adapter
merged into its base, or a vLLM engine) and checked before any question is asked (finite weights,
images only for a model that reads them, an adapter's base model where it says).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import ncgrpo.processors  # noqa: F401  (registers the torchvision-free Qwen VL classes with AutoConfig)
from ncgrpo.data.types import Question
from ncgrpo.eval.decoding import ENGINES, DecodingSettings, engine_of
from ncgrpo.eval.vllm_engine import load_vllm_engine
from ncgrpo.models import is_vision_language, load_model_and_processor, load_processor

__all__ = [
    "ADAPTER_CONFIG",
    "adapter_base",
    "check_adapter_base",
    "check_finite_weights",
    "check_images",
    "config_reads_images",
    "load_adapter",
    "load_for_eval",
    "takes_images",
]


def takes_images(model: Any, processor: Any) -> bool:
    """Whether the model at hand reads images: a vLLM engine says so itself; a transformers model
    does when its processor has an image processor."""
    if engine_of(model) != "transformers":
        return bool(model.is_vision_language)
    return getattr(processor, "image_processor", None) is not None


def check_images(questions: Sequence[Question], reads_images: bool | None, model_name: str) -> None:
    """Refuse questions with images for a text-only model (``reads_images`` False; None: unknown,
    nothing to check): its prompts would hold image placeholder tokens and no image."""
    if reads_images is False:
        q = next((q for q in questions if q.images), None)
        if q is not None:
            raise ValueError(
                f"{q.uid}: questions have images but {model_name} is text-only (no vision config or "
                "image processor); evaluate a vision-language model, or benchmarks without images"
            )


def config_reads_images(path: str | Path) -> bool | None:
    """Whether the model at ``path`` is a vision-language model, from its config alone (no weights);
    None if the config cannot be read here (the model load then names the problem). A PEFT adapter
    folder is its base model's config."""
    try:
        from transformers import AutoConfig

        return is_vision_language(AutoConfig.from_pretrained(adapter_base(path) or path))
    except Exception:  # noqa: BLE001 - unreadable here: the model load names the problem
        return None


def load_for_eval(
    path: str | Path,
    *,
    engine: str = "transformers",
    dtype: str = "auto",
    device: str = "auto",
    settings: DecodingSettings | None = None,
    questions: Sequence[Question] = (),
) -> tuple[Any, Any]:
    """``(model, processor)`` for :func:`evaluate` on ``engine``: a transformers model in eval mode, or
    a :class:`~ncgrpo.eval.vllm_engine.VLLMEvalEngine` sized for ``questions`` and ``settings``."""
    base = adapter_base(path)
    if engine == "vllm":
        if base is not None:
            raise ValueError(
                f"{path} is a PEFT adapter folder (adapter_config.json, base {base}); --engine vllm loads full "
                "weights: evaluate it with --engine transformers (the adapter is merged into its base on load), "
                "or save PeftModel.from_pretrained(base, path).merge_and_unload() and evaluate that folder"
            )
        return load_vllm_engine(
            path, dtype=dtype, device=device, settings=settings or DecodingSettings(), questions=questions
        )
    if engine != "transformers":
        raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if base is not None:
        model, processor = load_adapter(path, base, dtype=dtype, device=device)
    else:
        model, processor = load_model_and_processor(path, dtype=dtype, device=device)
    check_finite_weights(model, path)
    return model, processor


def check_finite_weights(model: Any, path: str | Path) -> None:
    """A model (an adapter merged into its base included) whose weights hold a NaN or inf is a
    ``ValueError`` naming the first such parameter: it would answer every question with the same
    token and be scored as a model that knows nothing."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and not bool(torch.isfinite(p).all()):
                raise ValueError(
                    f"{path}: the model's weights hold non-finite values (NaN or inf in {name}); a diverged or "
                    "damaged checkpoint: evaluate an earlier one"
                )


#: What ``save_pretrained`` of a PEFT model writes beside the adapter weights.
ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(path: str | Path) -> str | None:
    """The base model a PEFT adapter folder names (``adapter_config.json``'s ``base_model_name_or_path``;
    ``ncgrpo train --use_peft true`` writes its run folder so), or None for anything else (a model
    folder: one with its own ``config.json``)."""
    folder = Path(path)
    f = folder / ADAPTER_CONFIG
    if not f.is_file() or (folder / "config.json").is_file():
        return None
    try:
        base = json.loads(f.read_text(encoding="utf-8")).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError) as e:
        raise ValueError(f"{f}: cannot read the adapter's config ({e})") from None
    if not base:
        raise ValueError(
            f"{f} names no base_model_name_or_path; the adapter cannot be loaded without its base"
        )
    return str(base)


def check_adapter_base(path: str | Path) -> None:
    """A PEFT adapter folder whose base model is a path that is not there (moved or deleted since the
    adapter was trained) is a ``ValueError`` naming the base and ``adapter_config.json``; anything else
    passes (a hub id is left to the load)."""
    base = adapter_base(path)
    if base is not None and base.startswith((".", "/", "~")) and not Path(base).expanduser().exists():
        raise ValueError(
            f"{path}: the adapter's base model {base} (base_model_name_or_path in {Path(path) / ADAPTER_CONFIG}) "
            "does not exist here; put the base model back there, or set base_model_name_or_path to where it "
            "is now"
        )


def load_adapter(
    path: str | Path, base: str, *, dtype: str = "auto", device: str = "auto"
) -> tuple[Any, Any]:
    """``(model, processor)`` of a PEFT adapter folder: its base loaded as
    :func:`ncgrpo.models.load_model_and_processor` loads a model, the adapter applied
    (``PeftModel.from_pretrained``) and merged into the weights (``merge_and_unload``), so evaluation
    runs the plain model the adapter defines. The processor saved beside the adapter (``ncgrpo train``
    saves it there) is used when the folder has one, else the base's."""
    try:
        from peft import PeftModel
    except ImportError:
        raise ValueError(
            f"{path} is a PEFT adapter folder; loading it needs peft: pip install 'ncgrpo[peft]'"
        ) from None
    check_adapter_base(path)
    model, processor = load_model_and_processor(base, dtype=dtype, device=device)
    model = PeftModel.from_pretrained(model, str(path)).merge_and_unload()
    model.eval()
    folder = Path(path)
    if any(
        (folder / f).is_file()
        for f in ("processor_config.json", "preprocessor_config.json", "tokenizer.json")
    ):
        processor = load_processor(folder, config=model.config)
    return model, processor


#: The small files of a model folder that change what it answers (config, tokenizer, chat template,
