"""Setting up a run, the transformers way: model and processor loading, vision-tower freezing, the
metrics file. Shared by ``ncgrpo train``, ``ncgrpo eval``, the benchmarks and the embedded demo.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ncgrpo.eval.records import METRICS_FILE
from ncgrpo.processors import tokenizer_of  # noqa: F401  (re-exported: the setup API)

__all__ = [
    "METRICS_FILE",
    "VISION_TOWER_PATHS",
    "MetricsCallback",
    "find_vision_tower",
    "freeze_vision_tower",
    "load_model_and_processor",
    "read_run_info",
    "resolve_device",
    "resolve_dtype",
    "train_run",
]

#: Where VL models keep their vision tower, tried in order (Qwen2/2.5/3-VL: ``model.visual``).
VISION_TOWER_PATHS = ("model.visual", "visual", "model.vision_tower", "vision_tower", "model.vision_model")

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
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    freeze_vision: bool = False,
) -> tuple[Any, Any]:
    """``(model, processor)`` for a vision-language checkpoint, ``(model, tokenizer)`` for a text one.

    ``path`` is a local folder (or a hub id already in the cache). ``dtype``: ``auto`` (bfloat16 on a
    GPU that has it, float32 elsewhere) or a name such as ``bfloat16``. ``device``: the model is put
    there in eval mode; ``None`` leaves it where ``from_pretrained`` put it (the Trainer moves it).
    ``min_pixels`` / ``max_pixels`` go to the image processor. ``freeze_vision``: see
    :func:`freeze_vision_tower`. The tokenizer pads on the left, which batched generation needs.
    """
    from transformers import (
        AutoConfig,
        AutoModelForCausalLM,
        AutoModelForImageTextToText,
        AutoProcessor,
        AutoTokenizer,
    )

    import ncgrpo.processors  # noqa: F401  (registers the torchvision-free Qwen VL processors)

    dev = resolve_device(device) if device is not None else None
    try:
        config = AutoConfig.from_pretrained(path)
    except OSError as e:
        raise FileNotFoundError(
            f"cannot load a model config from {path!s}: {e}. Pass a folder written by save_pretrained "
            "(config.json, weights, tokenizer/processor files)."
        ) from None
    kwargs: dict[str, Any] = {"dtype": resolve_dtype(dtype, dev or torch.device("cpu"))}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if is_vision_language(config):
        model = AutoModelForImageTextToText.from_pretrained(path, **kwargs)
        pixels = {k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None}
        processor = AutoProcessor.from_pretrained(path, **pixels)
        if getattr(processor, "image_processor", None) is None:
            raise ValueError(
                f"{path}: AutoProcessor gave {type(processor).__name__}, which has no image processor; "
                "a vision-language model needs its processor saved next to it"
            )
        tok = processor.tokenizer
        if freeze_vision:
            freeze_vision_tower(model)
    else:  # a text-only model has no vision tower: freeze_vision has nothing to do
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        processor = AutoTokenizer.from_pretrained(path)
        tok = processor
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    if dev is not None:
        model.to(dev).eval()
    return model, processor


def find_vision_tower(model) -> tuple[str, Any] | None:
    """``(path, module)`` of the vision tower (first of :data:`VISION_TOWER_PATHS`), or ``None``."""
    for path in VISION_TOWER_PATHS:
        node = model
        for part in path.split("."):
            node = getattr(node, part, None)
            if node is None:
                break
        if node is not None:
            return path, node
    return None


def freeze_vision_tower(model) -> str:
    """Set ``requires_grad=False`` on the vision tower's parameters (the paper's recipe, section 4.1);
    returns where it was found."""
    found = find_vision_tower(model)
    if found is None:
        raise ValueError(
            f"{type(model).__name__}: no vision tower at any of {', '.join(VISION_TOWER_PATHS)}; "
            "set freeze_vision_tower=false for a text-only model"
        )
    path, tower = found
    for p in tower.parameters():
        p.requires_grad_(False)
    return path


def _jsonable(v: Any) -> Any:
    if isinstance(v, (int, float, str, bool)) or v is None:
        return v
    try:
        return float(v)
    except (TypeError, ValueError):
        return str(v)


class MetricsCallback(TrainerCallback):
    """Append each log call to ``path`` (``metrics.jsonl``) as one JSON line with ``"step"`` (main process).

    Each line is written, flushed and fsync'ed on its own, so a killed run leaves at most one torn
    last line, which is cut at the next start. On resume, lines logged after the checkpoint's step
    (work the restart repeats) are dropped so every step appears once.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            self._repair(state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        row = {"step": int(state.global_step)}
        if state.epoch is not None:
            row["epoch"] = float(state.epoch)
        row.update({k: _jsonable(v) for k, v in logs.items()})
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row, sort_keys=False, allow_nan=True) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def _repair(self, resumed_step: int) -> None:
        if not self.path.exists():
            return
        from ncgrpo.eval.records import atomic_write_text

        text = self.path.read_text(encoding="utf-8", errors="replace")
        keep, changed = [], not text.endswith("\n") and bool(text)
        for line in text.splitlines(keepends=True):
            if not line.endswith("\n"):
                continue  # torn last line
            try:
                step = int(json.loads(line).get("step", 0))
            except (ValueError, AttributeError):
                changed = True
                continue
            if step > resumed_step:
                changed = True
                continue
            keep.append(line)
        if changed:
            atomic_write_text(self.path, "".join(keep))


def read_run_info(output_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The run folder's ``run.json`` (what :func:`train_run` wrote), or ``None`` if there is none."""
    from ncgrpo.eval.records import RUN_FILE

    path = Path(output_dir) / RUN_FILE
    if not path.exists():
        return None
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a readable run.json ({e}); move it away or fix it") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return info


def train_run(
    args,
    model,
    processor,
    train_dataset,
    *,
    reward_funcs,
    run_info: dict[str, Any],
    eval_dataset=None,
    callbacks: Sequence[Any] = (),
    resume_from_checkpoint: str | None = None,
    console_logs: bool = True,
):
    """One training run into ``args.output_dir``, the same for ``ncgrpo train`` and the demo.

    Writes ``run.json`` (``run_info`` plus ``finished: false``) before training, appends every log
    call to ``metrics.jsonl`` (:class:`MetricsCallback`), trains (from ``resume_from_checkpoint`` if
    given), saves the final model and processor to the folder and rewrites ``run.json`` with
    ``global_step`` and ``finished: true`` last, so a folder whose ``run.json`` says finished holds a
    complete model. Only the main process writes. ``console_logs=False`` removes TRL's per-step
    printing (a caller with its own progress display). Returns the trainer.
    """
    from accelerate import PartialState
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ncgrpo.eval.records import RUN_FILE, atomic_write_json
    from ncgrpo.trainer import NCGRPOTrainer

    out = Path(args.output_dir)
    state = PartialState()
    info = {**run_info, "output_dir": str(out), "finished": False}
    if state.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / RUN_FILE, info)
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
        callbacks=[MetricsCallback(out / METRICS_FILE), *callbacks],
    )
    if not console_logs:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(str(out))
    if state.is_main_process:
        processor.save_pretrained(str(out))
        atomic_write_json(
            out / RUN_FILE, {**info, "global_step": int(trainer.state.global_step), "finished": True}
        )
    return trainer
