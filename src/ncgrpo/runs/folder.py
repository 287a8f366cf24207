"""A run folder: its file names, how they are written, who may write, and what is read back.

Every command writes its outputs into one folder; this module is the one place that knows the layout:

- ``run.json`` (:data:`RUN_FILE`): what the folder holds, written atomically (:func:`atomic_write_json`),
  read back by :func:`read_run_json`. A training run (``ncgrpo train``, the demo, ``NCGRPOTrainer``:
  :func:`ncgrpo.trainer.run_folder.write_train_run_json`) records ``name``,
  ``method``, ``seed``, ``model``, ``recipe``, ``output_dir``, ``finished`` (and ``global_step`` once
  finished); an evaluation (``ncgrpo eval``) records its identity (``model``, ``checkpoint``, ``seed``,
  ``split``, ``benchmarks``, ``decoding``) plus ``name``, ``method`` and the last ``batch_size``. Every
  kind records ``provenance`` (what made it: commit, dirty tree, package versions) and, once resumed or
  appended to under another, ``provenance_history`` (:mod:`ncgrpo.runs.provenance`; not identity).
- ``config.yaml`` (:data:`CONFIG_FILE`): a training run's resolved settings, read by ``--resume``.
- ``metrics.jsonl`` (:data:`METRICS_FILE`), ``records.jsonl`` (:data:`RECORDS_FILE`): JSON lines,
  appended and fsync'ed one line at a time, so a kill leaves at most a torn last line
  (:func:`iter_json_lines` skips it, :func:`repair_torn_tail` cuts it).
- ``checkpoint-N/`` (Trainer checkpoints, plus :data:`STATE_FILE` for NC-GRPO's own state): resumed
  from the newest complete one (:func:`last_complete_checkpoint`).
- ``.ncgrpo.lock`` (:data:`LOCK_FILE`): the advisory lock a writer holds (:class:`FolderLock`).

Every folder a command writes has a kind (:data:`KINDS`), recorded as ``run.json``'s ``kind``: ``train``
(``ncgrpo train`` and each of a demo's training runs), ``eval`` (``ncgrpo eval``, a demo's evaluations),
``demo`` (a demo's root), ``pretrain`` (``ncgrpo pretrain``'s model folder) and ``report`` (``compare
--output_dir``, ``plot --output_dir``). A writer claims its folder with ``FolderLock(folder, what, kind=...)``: a folder
of another kind (:func:`folder_kind`, which also infers the kind of folders written before kinds were
recorded) or one another process holds is refused before anything is written, naming what was found.
A script that is no command (``examples/*.py``) claims its folder by :func:`claim_script_folder`.

A run's identity (what must not change when a folder is resumed or appended to) is compared by
:func:`changed_identity`.

This module is the one import for all of it; each part lives in its own module: the files, how they
are written and read (:mod:`ncgrpo.runs.files`), a folder's kind (:mod:`ncgrpo.runs.kinds`),
checkpoints and ``--overwrite``'s clearing (:mod:`ncgrpo.runs.checkpoints`), the writer's lock and a
folder's claim (:mod:`ncgrpo.runs.lock`), the identity comparison (:mod:`ncgrpo.runs.identity`).
"""

from __future__ import annotations

from ncgrpo.runs.checkpoints import (
    CRC_CHECK_MAX_BYTES,
    TRAIN_OUTPUTS,
    TRAINER_STATE_KEYS,
    checkpoint_problem,
    checkpoint_step,
    checkpoint_weight_files,
    clear_train_outputs,
    last_complete_checkpoint,
)
from ncgrpo.runs.files import (
    CONFIG_FILE,
    LOCK_FILE,
    METRICS_FILE,
    RECORDS_FILE,
    RUN_FILE,
    STATE_FILE,
    DiskFullError,
    _complete_part,  # noqa: F401 - ncgrpo.trainer.run_folder reads a metrics file's whole lines with it
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    disk_full_error,
    iter_json_lines,
    json_rows,
    read_run_json,
    repair_torn_tail,
)
from ncgrpo.runs.identity import changed_identity
from ncgrpo.runs.kinds import KINDS, FolderKindError, check_folder_kind, folder_kind
from ncgrpo.runs.lock import (
    FolderBusyError,
    FolderLock,
    claim_folder,
    claim_script_folder,
    finish_script_folder,
)

__all__ = [
    "CONFIG_FILE",
    "LOCK_FILE",
    "METRICS_FILE",
    "RECORDS_FILE",
    "RUN_FILE",
    "STATE_FILE",
    "KINDS",
    "DiskFullError",
    "FolderBusyError",
    "FolderKindError",
    "FolderLock",
    "check_folder_kind",
    "claim_folder",
    "claim_script_folder",
    "finish_script_folder",
    "disk_full_error",
    "clear_train_outputs",
    "folder_kind",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "changed_identity",
    "checkpoint_problem",
    "checkpoint_step",
    "checkpoint_weight_files",
    "iter_json_lines",
    "json_rows",
    "last_complete_checkpoint",
    "read_run_json",
    "repair_torn_tail",
    "CRC_CHECK_MAX_BYTES",
    "TRAINER_STATE_KEYS",
    "TRAIN_OUTPUTS",
]
