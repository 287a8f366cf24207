"""Driving one training run into its folder: the metrics file and the run driver, shared by
``ncgrpo train`` and the embedded demo (the folder's layout is :mod:`ncgrpo.runs.folder`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ncgrpo.runs.folder import (
    METRICS_FILE,
    RUN_FILE,
    FolderLock,
    _complete_part,
    atomic_write_json,
    atomic_write_text,
    iter_json_lines,
)

__all__ = ["MetricsCallback", "train_run"]


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
        """Cut a torn last line and the lines logged after ``resumed_step``."""
        if not self.path.exists():
            return
        data, torn = _complete_part(self.path.read_bytes())
        lines = data.decode("utf-8", errors="replace").splitlines(keepends=True)
        keep = [
            lines[i - 1]
            for i, row in iter_json_lines(self.path, "metrics line")
            if int(row.get("step", 0)) <= resumed_step
        ]
        if torn or len(keep) != len(lines):
            atomic_write_text(self.path, "".join(keep))


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
    peft_config=None,
):
    """One training run into ``args.output_dir``, the same for ``ncgrpo train`` and the demo.

    The main process holds the folder's lock (:class:`ncgrpo.runs.folder.FolderLock`, kind ``train``)
    throughout: a folder of another kind (an evaluation, a demo's root, a saved model) or one another
    process is writing is refused before anything is written. Writes ``run.json`` (``run_info`` plus
    ``kind: train`` and ``finished: false``) before training, appends every log
    call to ``metrics.jsonl`` (:class:`MetricsCallback`), trains (from ``resume_from_checkpoint`` if
    given), saves the final model and processor to the folder and rewrites ``run.json`` with
    ``global_step`` and ``finished: true`` last, so a folder whose ``run.json`` says finished holds a
    complete model. Only the main process writes. ``console_logs=False`` removes TRL's per-step
    printing (a caller with its own progress display). ``peft_config``: given to the trainer (TRL wraps
    the model; the folder then holds the adapter). Returns the trainer.
    """
    from accelerate import PartialState

    out = Path(args.output_dir)
    state = PartialState()
    lock = FolderLock(out, "ncgrpo train", kind="train")
    if state.is_main_process:
        lock.acquire()  # re-entrant: a no-op where ncgrpo train's prepare_run holds it already
    try:
        return _train_locked(
            args, model, processor, train_dataset, out=out, main_process=state.is_main_process,
            reward_funcs=reward_funcs, run_info=run_info, eval_dataset=eval_dataset, callbacks=callbacks,
            resume_from_checkpoint=resume_from_checkpoint, console_logs=console_logs, peft_config=peft_config,
        )  # fmt: skip
    finally:
        lock.release()


def _train_locked(
    args, model, processor, train_dataset, *, out: Path, main_process: bool, reward_funcs, run_info,
    eval_dataset, callbacks, resume_from_checkpoint, console_logs, peft_config=None,
):  # fmt: skip
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ncgrpo.trainer import NCGRPOTrainer

    info = {**run_info, "kind": "train", "output_dir": str(out), "finished": False}
    if main_process:
        atomic_write_json(out / RUN_FILE, info)
    trainer = NCGRPOTrainer(
        model=model,
        reward_funcs=list(reward_funcs),
        args=args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        processing_class=processor,
        callbacks=[MetricsCallback(out / METRICS_FILE), *callbacks],
        peft_config=peft_config,
    )
    if not console_logs:
        trainer.remove_callback(PrinterCallback)
        trainer.remove_callback(ProgressCallback)
    trainer.train(resume_from_checkpoint=resume_from_checkpoint)
    trainer.save_model(str(out))
    if main_process:
        processor.save_pretrained(str(out))
        atomic_write_json(
            out / RUN_FILE, {**info, "global_step": int(trainer.state.global_step), "finished": True}
        )
    # README.md: the method as run, the base model, the paper (main process only); after `finished`, which
    # speaks of the model: a card that cannot be written must not make a complete run look cut short
    trainer.create_model_card()
    return trainer
