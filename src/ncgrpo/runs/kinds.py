"""What a run folder holds: its kind (:data:`KINDS`, ``run.json``'s ``kind``, or inferred from the files
of a folder written before kinds were recorded) and the check that refuses to write one command's
results into another command's folder (:func:`check_folder_kind`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ncgrpo.runs.files import CONFIG_FILE, METRICS_FILE, RECORDS_FILE, RUN_FILE, read_run_json

__all__ = ["KINDS", "FolderKindError", "check_folder_kind", "folder_kind"]


#: What each folder kind holds (``run.json``'s ``kind``), as messages name it.
KINDS: dict[str, str] = {
    "train": "a training run (ncgrpo train, NCGRPOTrainer, or one of a demo's runs)",
    "eval": "an evaluation (ncgrpo eval: run.json + records.jsonl)",
    "demo": "a demo's output folder (ncgrpo demo)",
    "pretrain": "a base model built by ncgrpo pretrain",
    "report": "tables and figures (ncgrpo compare --output_dir / ncgrpo plot --output_dir)",
    "model": "a saved model (config.json and weights) that no ncgrpo command wrote",
}


class FolderKindError(ValueError):
    """An output folder holds another command's results (another :data:`KINDS` entry)."""


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def _inferred_kind(folder: Path, info: Mapping[str, Any] | None) -> tuple[str | None, str]:
    """(kind, what it was read from) of a folder: see :func:`folder_kind`."""
    if info is not None and isinstance(info.get("kind"), str):
        return info["kind"], f"{RUN_FILE} says kind {info['kind']!r}"
    run = f"{RUN_FILE} (no kind: written before kinds were recorded)"
    if info is not None and ("decoding" in info or "benchmarks" in info):
        return "eval", f"{run} with 'decoding'/'benchmarks'"
    if info is not None and ("finished" in info or "recipe" in info):
        return "train", f"{run} with 'finished'/'recipe'"

    def has(name: str) -> bool:
        return (folder / name).exists()

    if has(RECORDS_FILE):
        return "eval", f"{RECORDS_FILE} present"
    if has(CONFIG_FILE) or has(METRICS_FILE) or any(folder.glob("checkpoint-[0-9]*")):
        return "train", f"{CONFIG_FILE}, {METRICS_FILE} or checkpoint-N present"
    if (
        has("summary.json")
        or has("suite/suite.json")
        or ((folder / "train").is_dir() and (folder / "eval").is_dir())
    ):
        return "demo", "summary.json, suite/ or train/ + eval/ present"
    if has("pretrain.json"):
        return "pretrain", "pretrain.json present"
    if has("comparison.json") or has("comparison.md"):
        return "report", "comparison.json/.md present"
    if has("config.json") and any(has(w) for w in _WEIGHT_FILES):
        return "model", "config.json and model weights present"
    return None, ""


def folder_kind(folder: str | os.PathLike) -> str | None:
    """The kind of ``folder`` (a :data:`KINDS` key), or ``None`` for a folder no command wrote (absent,
    empty, or holding only other files).

    ``run.json``'s ``kind`` when it has one. A folder written before kinds were recorded (a
    ``run.json`` without ``kind``, or none) is recognised by what it holds, first match wins:

    - ``eval``: ``run.json`` has ``decoding`` or ``benchmarks`` (every ``ncgrpo eval`` wrote both), or
      ``records.jsonl`` is present;
    - ``train``: ``run.json`` has ``finished`` or ``recipe`` (``ncgrpo train`` and the demo's runs wrote
      them), or ``config.yaml``, ``metrics.jsonl`` or a ``checkpoint-N/`` is present;
    - ``demo``: ``summary.json``, ``suite/suite.json``, or both ``train/`` and ``eval/`` sub-folders;
    - ``pretrain``: ``pretrain.json``;
    - ``report``: ``comparison.json`` or ``comparison.md``;
    - ``model``: ``config.json`` beside model weights (a saved model: no command writes into it).

    So an old folder resumes (train, eval, demo) exactly as before, and its ``run.json`` gains its kind
    the next time its own command writes it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return None
    return _inferred_kind(folder, read_run_json(folder, hint="move it away or fix it"))[0]


_UNREAD: Any = object()  # check_folder_kind's info when the caller has not read run.json


def check_folder_kind(
    folder: str | os.PathLike, kind: str, what: str = "ncgrpo", *, info: Any = _UNREAD
) -> None:
    """Refuse (:class:`FolderKindError`) to write ``kind`` results into ``folder`` when it is a file or
    holds another kind (:func:`folder_kind`); reads only. ``what``: the command, for the message.
    ``info``: the folder's run.json (None: it has none) when the caller has read it already."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise FolderKindError(
            f"{folder} is a file, not a folder; {what} writes a folder there: pass a new folder path"
        )
    if not folder.is_dir():
        return
    if info is _UNREAD:
        info = read_run_json(folder, hint="move it away or fix it")
    found, evidence = _inferred_kind(folder, info)
    if found is None or found == kind:
        return
    raise FolderKindError(
        f"{folder} holds {KINDS.get(found, repr(found))} (kind {found!r}: {evidence}); {what} writes "
        f"{KINDS.get(kind, kind)} and never into another command's folder: pass a new folder"
    )
