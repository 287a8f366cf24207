"""Per-question evaluation records: schema, crash-safe appends, resumable reads.

A run directory (``ncgrpo eval --out DIR``) holds:

- ``DIR/run.json``: what was evaluated (``name``, ``method``, ``seed``, ``model``, ``checkpoint``,
  ``decoding``); written atomically.
- ``DIR/records.jsonl``: one :class:`EvalRecord` per line, appended and fsync'ed as questions
  finish. A run killed mid-write leaves at most one torn last line, which :func:`read_records`
  drops; duplicate keys (a question recorded twice across a crash) keep the first record.

Statistics and reports (``ncgrpo.eval.stats``, ``ncgrpo.eval.report``) read only these files.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RECORDS_FILE = "records.jsonl"
RUN_FILE = "run.json"
METRICS_FILE = "metrics.jsonl"


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
        if not isinstance(known["correct"], bool):
            raise ValueError(f"{where}: field 'correct' must be true/false, got {known['correct']!r}")
        return cls(**known)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a mix."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


class RecordWriter:
    """Append-only JSONL writer: one line per record, flushed and fsync'ed per batch."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._repair_torn_tail()
        self._f = open(self.path, "a", encoding="utf-8")

    def _repair_torn_tail(self) -> None:
        # A kill during a write can leave a last line without its newline; cut it so the next
        # append starts on a fresh line (the question is simply recomputed).
        if not self.path.exists() or self.path.stat().st_size == 0:
            return
        with open(self.path, "rb+") as f:
            data = f.read()
            if data.endswith(b"\n"):
                return
            cut = data.rfind(b"\n") + 1
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())

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
    """Records of a ``records.jsonl``, first occurrence per key, torn last line dropped.

    A malformed line that is not the last one is an error naming the file and line number.
    """
    path = Path(path)
    seen: set[tuple[str, str]] = set()
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and not line.endswith("\n"):
                break  # torn tail of a killed writer
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        rec = EvalRecord.from_dict(row, where=f"{path}:{i}")
        if rec.key in seen:
            continue
        seen.add(rec.key)
        yield rec


def read_records(path: str | os.PathLike) -> list[EvalRecord]:
    return list(iter_records(path))
