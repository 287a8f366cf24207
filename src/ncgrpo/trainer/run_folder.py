"""The run folder ``NCGRPOTrainer`` leaves in ``output_dir``: ``metrics.jsonl`` and ``run.json``, the files
``ncgrpo train`` writes, so a run trained through the library is read by ``ncgrpo eval``, ``ncgrpo plot
dynamics`` and ``ncgrpo compare`` as one trained by the command (its name, method and seed carried).

- :class:`MetricsCallback`: every log call appended to ``metrics.jsonl`` (the trainer adds it itself,
  first among its callbacks; ``ncgrpo train`` and the demo use the same one).
- :func:`write_train_run_json`: the one writer of a training run's ``run.json`` (``ncgrpo train``'s driver
  and the library path both call it).
- :func:`library_run_info` / :func:`recorded_train`: what :meth:`NCGRPOTrainer.train` records around
  TRL's ``train`` when no driver records the folder itself (``ncgrpo train`` and the demo write
  ``run.json`` with the recipe and the command's identity, and switch the trainer's own record off).
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ncgrpo.runs.folder import (
    RUN_FILE,
    FolderLock,
    _complete_part,
    atomic_write_json,
    atomic_write_text,
    changed_identity,
    check_folder_kind,
    folder_kind,
    iter_json_lines,
    read_run_json,
)
from ncgrpo.runs.identity import run_identity_keys
from ncgrpo.runs.provenance import continue_provenance

__all__ = [
    "MetricsCallback",
    "library_run_info",
    "recorded_train",
    "write_train_run_json",
]


# ------------------------------------------------------------------------------------ metrics.jsonl
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


# ------------------------------------------------------------------------------------ run.json
def write_train_run_json(
    out: str | os.PathLike, run_info: Mapping[str, Any], *, finished: bool, global_step: int | None = None
) -> dict[str, Any]:
    """Write a training run's ``run.json`` into ``out`` (atomically) and return what was written:
    ``run_info`` (``name``, ``method``, ``seed``, ``model``, ``recipe``, ``identity``, ...) plus ``kind:
    train``, ``output_dir``, ``finished`` and, once finished, ``global_step``. The one writer of a
    training run's ``run.json``, for ``ncgrpo train``, the demo and ``NCGRPOTrainer`` alike."""
    info = {**run_info, "kind": "train", "output_dir": str(out), "finished": bool(finished)}
    if global_step is not None:
        info["global_step"] = int(global_step)
    atomic_write_json(Path(out) / RUN_FILE, info)
    return info


def _plain(value: Any) -> Any:
    """``value`` as JSON holds it (tuples as lists, enums and other objects as their text)."""
    return json.loads(json.dumps(value, default=lambda v: getattr(v, "value", str(v))))


def _model_of(trainer: Any) -> Any:
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = getattr(model, "get_base_model", None)  # a peft model: the model it adapts
    return base() if callable(base) else model


def library_run_info(trainer: Any) -> dict[str, Any]:
    """``run.json``'s content (before :func:`write_train_run_json` adds the state) for a run trained
    through ``NCGRPOTrainer``: ``name`` (``run_name`` when set, else the output folder's name), ``method``
    (``rollout_method``), ``seed``, ``model`` (the base model's ``_name_or_path``), ``recipe`` (none),
    ``trained_with: NCGRPOTrainer`` and ``identity``: every ``NCGRPOConfig`` setting that makes the run
    what it is (:func:`ncgrpo.runs.identity.run_identity_keys`, as ``ncgrpo train`` and the demo record
    it), with the base model as ``model_name_or_path`` and its weights' ``dtype``."""
    args = trainer.args
    out = Path(args.output_dir)
    name = args.run_name or out.resolve().name
    model = _model_of(trainer)
    model_name = str(getattr(model.config, "_name_or_path", "") or "") or None
    dtype = getattr(model, "dtype", None)
    values = args.to_dict()  # as TrainingArguments serialises itself: enums as values, tokens hidden
    values["model_name_or_path"] = model_name
    values["dtype"] = None if dtype is None else str(dtype).removeprefix("torch.")
    identity = {k: _plain(values.get(k)) for k in run_identity_keys((type(args),))}
    return {
        "name": name,
        "method": str(args.rollout_method),
        "seed": int(args.seed),
        "model": model_name,
        "recipe": None,
        "trained_with": "NCGRPOTrainer",
        "identity": identity,
    }


def _resuming(resume_from_checkpoint: Any) -> bool:
    return resume_from_checkpoint is not None and resume_from_checkpoint is not False


def _check_fresh_start(out: Path, previous: Mapping[str, Any] | None) -> None:
    """A run started from scratch into a folder holding a finished run or checkpoints is refused, as
    ``ncgrpo train`` refuses it (TRL would mix the new run's checkpoints and metrics with the old)."""
    checkpoints = sorted(out.glob("checkpoint-[0-9]*")) if out.is_dir() else []
    if previous is not None and previous.get("finished"):
        raise ValueError(
            f"NCGRPOTrainer.train: {out} holds a finished run ({previous.get('name')!r}, "
            f"{previous.get('global_step')} steps; {out / RUN_FILE}); set output_dir to another folder, "
            "or remove that one to train it again"
        )
    if checkpoints:
        raise ValueError(
            f"NCGRPOTrainer.train: {out} already holds {checkpoints[-1].name}; pass "
            "resume_from_checkpoint=True to continue that run, or set output_dir to another folder"
        )


@contextlib.contextmanager
def recorded_train(trainer: Any, resume_from_checkpoint: Any = None) -> Iterator[None]:
    """``run.json`` around one ``train`` call of a library run: the output folder's lock taken
    (:class:`~ncgrpo.runs.folder.FolderLock`; a folder another process writes is refused), ``run.json``
    written with ``finished: false`` before training and rewritten with ``global_step`` and ``finished:
    true`` when ``train`` returns (the weights are the caller's ``save_model``'s, as in TRL's scripts).
    Only the main process writes; every process makes the read-only checks, so a refusal stops them
    all rather than leaving the others waiting in the first collective.

    Refused: a folder of another kind (an evaluation, a demo's root; a saved model, an earlier TRL run's
    final save, is written over as TRL does); started from scratch, a folder holding a finished run or
    checkpoints. Resumed (``resume_from_checkpoint`` given), the settings that make the run
    (``identity``) are compared with the ones ``run.json`` records: a difference is a warning naming
    each setting and is kept in ``forced_changes`` (as ``ncgrpo train --resume --force`` keeps it)."""
    out = Path(trainer.args.output_dir)
    what = "NCGRPOTrainer.train"
    if folder_kind(out) != "model":
        check_folder_kind(out, "train", what)
    if not _resuming(resume_from_checkpoint):
        _check_fresh_start(out, read_run_json(out, hint="move it away or fix it"))
    if not trainer.is_world_process_zero():
        yield
        return
    lock = FolderLock(out, what)
    lock.acquire()
    try:
        previous = read_run_json(out, hint="move it away or fix it")
        info = library_run_info(trainer)
        resumed = _resuming(resume_from_checkpoint)
        if not resumed:
            _check_fresh_start(out, previous)  # again under the lock: another process may have written
        # what made the run (ncgrpo's commit and the packages' versions), as ncgrpo train records it; a
        # resume under other code or packages is warned and kept in provenance_history
        info.update(continue_provenance(previous if resumed else None, event="resume", where=out))
        if resumed and previous is not None:
            forced = list(previous.get("forced_changes") or [])
            old = previous.get("identity")
            changed = (
                changed_identity(old, info["identity"], info["identity"]) if isinstance(old, dict) else []
            )
            if changed:
                warnings.warn(
                    f"{what}: resuming {out} with settings that change the run (as recorded in "
                    f"{out / RUN_FILE} -> now): {'; '.join(changed)}; recorded in run.json's forced_changes",
                    UserWarning,
                    stacklevel=4,
                )
            if forced or changed:
                info["forced_changes"] = [*forced, *changed]
        write_train_run_json(out, info, finished=False)
        yield
        write_train_run_json(out, info, finished=True, global_step=int(trainer.state.global_step))
    finally:
        lock.release()
