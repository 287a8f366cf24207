"""Per-question evaluation records: schema, crash-safe appends, resumable reads.

A run directory (``ncgrpo eval --output_dir DIR``) holds:

- ``DIR/run.json``: what was evaluated (``name``, ``method``, ``seed``, ``model``, ``engine``,
  ``checkpoint``, ``decoding``, ``split``, ``benchmarks``); written atomically. The identity part of
  it is checked when a rerun appends to the folder (``ncgrpo.eval.evaluate``).
- ``DIR/records.jsonl``: one :class:`EvalRecord` per line, appended and fsync'ed as questions
  finish (per batch with the transformers engine, per engine step with vLLM); ``decoding`` names the
  engine. A run killed mid-write leaves at most a torn tail (bytes after the last newline, possibly
  half a UTF-8 character), which :func:`read_records` ignores and :class:`RecordWriter` cuts;
  a question recorded twice counts once if both records agree, else reading is an error.
- ``DIR/.ncgrpo.lock``: the advisory lock (:class:`ncgrpo.runs.folder.FolderLock`) a writer holds; one
  writer at a time.

File names, atomic writers, the JSON-lines reader and the lock are :mod:`ncgrpo.runs.folder`'s.

Statistics and reports (``ncgrpo.eval.stats``, ``ncgrpo.eval.report``) read only these files.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ncgrpo.runs.folder import iter_json_lines, repair_torn_tail


@dataclass
class EvalRecord:
    benchmark: str
    question_id: str
    role: str  # "in_domain" | "ood" | "general"
    prompt_hash: str
    output: str
    extracted: str | None
    gold: str
    correct: bool
    model: str
    checkpoint: str | None = None
    seed: int | None = None
    decoding: dict[str, Any] = field(default_factory=dict)
    #: sha256 of the question's decoded image pixels (``ncgrpo.data.prompts.image_hash``); ``""`` for a
    #: question without images and in records written before the field existed (their pairing checks
    #: the prompt text and gold only).
    image_hash: str = ""
    #: The evaluated configuration's display name and training method (run.json ``name``, ``method``)
    #: when the record was written: an eval of a training run carries the run's. None in older records.
    name: str | None = None
    method: str | None = None

    @property
    def key(self) -> tuple[str, str]:
        return (self.benchmark, self.question_id)

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, sort_keys=True)

    @classmethod
    def from_dict(cls, row: dict[str, Any], *, where: str = "record") -> EvalRecord:
        missing = [k for k in ("benchmark", "question_id", "role", "correct") if k not in row]
        if missing:
            raise ValueError(f"{where}: missing field(s) {missing}")
        known = {f: row[f] for f in cls.__dataclass_fields__ if f in row}
        known.setdefault("prompt_hash", "")
        known.setdefault("output", "")
        known.setdefault("extracted", None)
        known.setdefault("gold", "")
        known.setdefault("model", "")
        known.setdefault("image_hash", "")
        if not isinstance(known["correct"], bool):
            raise ValueError(f"{where}: field 'correct' must be true/false, got {known['correct']!r}")
        return cls(**known)

    def outcome(self) -> tuple[Any, ...]:
        """What the statistics read from a record; two records of one question must agree on it."""
        return (self.role, self.gold, self.extracted, self.correct)


#: Decoding fields a record (or run.json) written before they existed lacks: their value then.
LEGACY_DECODING: dict[str, Any] = {"engine": "transformers", "grader": "ncgrpo"}


def record_producer(record: EvalRecord) -> dict[str, Any]:
    """What made a record, from the record alone: the model id (a hash of its weights' contents since
    run.json ``model_id_rule`` ``weights-sha256``), checkpoint, seed and the decoding settings but the
    batch size (:data:`LEGACY_DECODING` for fields older records lack). Records carry it so that a
    folder whose run.json is lost is still checked, and a comparison can tell its producers apart."""
    decoding = {**LEGACY_DECODING, **record.decoding}
    decoding.pop("batch_size", None)
    return {"model": record.model, "checkpoint": record.checkpoint, "seed": record.seed, "decoding": decoding}


class DuplicateRecordError(ValueError):
    """One question recorded twice with different outcomes (e.g. two writers into one folder)."""


# --- reading -----------------------------------------------------------------------------------


class RecordWriter:
    """Append-only JSONL writer: one line per record, flushed and fsync'ed per batch.

    Opening it cuts a torn tail left by a killed writer (see :func:`repair_torn_tail`).
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        repair_torn_tail(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, records: Iterable[EvalRecord]) -> None:
        lines = "".join(r.to_json() + "\n" for r in records)
        if not lines:
            return
        self._f.write(lines)
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_records(path: str | os.PathLike) -> Iterator[EvalRecord]:
    """Records of a ``records.jsonl``, one per question, torn tail ignored (the file is not changed).

    - Bytes after the last newline are a torn write (a killed writer) and are skipped, whatever
      they hold: half a line, half a UTF-8 character, even a whole record whose newline was lost
      (the question is recomputed; :class:`RecordWriter` cuts those bytes before appending).
    - A complete line that is not UTF-8, not JSON or not a record is an error naming file and line.
    - A question recorded twice with the same outcome counts once; with different outcomes (role,
      gold, extracted answer or correctness) it is a :class:`DuplicateRecordError` naming the ids.
    """
    path = Path(path)
    seen: dict[tuple[str, str], tuple[int, EvalRecord]] = {}
    conflicts: list[str] = []
    for i, row in iter_json_lines(path, "record"):
        rec = EvalRecord.from_dict(row, where=f"{path}:{i}")
        first = seen.get(rec.key)
        if first is None:
            seen[rec.key] = (i, rec)
        elif first[1].outcome() != rec.outcome():
            conflicts.append(f"{rec.benchmark}/{rec.question_id} (lines {first[0]} and {i})")
    if conflicts:
        more = f" and {len(conflicts) - 5} more" if len(conflicts) > 5 else ""
        raise DuplicateRecordError(
            f"{path}: question(s) recorded twice with different outcomes: {', '.join(conflicts[:5])}{more}; "
            "the folder mixes two evaluations -- delete the wrong lines or evaluate into a new folder"
        )
    for _, rec in seen.values():
        yield rec


def read_records(path: str | os.PathLike) -> list[EvalRecord]:
    return list(iter_records(path))
