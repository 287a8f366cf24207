"""Per-question evaluation records: schema, crash-safe appends, resumable reads.

A run directory (``ncgrpo eval --out DIR``) holds:

- ``DIR/run.json``: what was evaluated (``name``, ``method``, ``seed``, ``model``, ``checkpoint``,
  ``decoding``, ``split``, ``benchmarks``); written atomically. The identity part of it is checked
  when a rerun appends to the folder (``ncgrpo.eval.evaluate``).
- ``DIR/records.jsonl``: one :class:`EvalRecord` per line, appended and fsync'ed as questions
  finish. A run killed mid-write leaves at most a torn tail (bytes after the last newline, possibly
  half a UTF-8 character), which :func:`read_records` ignores and :class:`RecordWriter` cuts;
  a question recorded twice counts once if both records agree, else reading is an error.
- ``DIR/.ncgrpo.lock``: the advisory lock (:class:`FolderLock`) a writer holds; one writer at a time.

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

    def outcome(self) -> tuple[Any, ...]:
        """What the statistics read from a record; two records of one question must agree on it."""
        return (self.role, self.gold, self.extracted, self.correct)


class DuplicateRecordError(ValueError):
    """One question recorded twice with different outcomes (e.g. two writers into one folder)."""


class FolderBusyError(ValueError):
    """Another process holds the advisory lock of an output folder."""


def _umask() -> int:
    # No way to read the umask without setting it (before Linux's /proc "Umask:" line); set it back
    # at once. Called only around file creation, never from threads that create files themselves.
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` so a reader sees the old file or the new one, never a mix.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 less the umask), not the
    0600 of the temporary file it is written through.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
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


# --- reading -----------------------------------------------------------------------------------


def _complete_part(data: bytes) -> tuple[bytes, int]:
    """(the newline-terminated part of ``data``, bytes after it). Writers end every record with a
    newline, so anything after the last one is a torn write: a cut line, possibly cut inside a
    multi-byte UTF-8 character."""
    cut = data.rfind(b"\n") + 1
    return data[:cut], len(data) - cut


def iter_json_lines(path: str | os.PathLike, what: str = "row") -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each complete line of a JSONL file written one line at a time.

    Bytes after the last newline are a torn write and are skipped (the file is not changed); blank
    lines are skipped; a complete line that is not UTF-8, not JSON or not a JSON object is an error
    naming the file and line (``what`` names the kind of row in that message).
    """
    path = Path(path)
    data, _ = _complete_part(path.read_bytes())
    for i, raw in enumerate(data.splitlines(), start=1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{i}: a {what} must be a JSON object, got {type(row).__name__}")
        yield i, row


def repair_torn_tail(path: str | os.PathLike) -> int:
    """Cut the bytes after the last newline of ``path`` (a killed writer's torn record), fsync'ed.

    Returns the number of bytes cut (0 when the file ends cleanly or does not exist).
    """
    path = Path(path)
    if not path.exists():
        return 0
    with open(path, "rb+") as f:
        _, torn = _complete_part(f.read())
        if torn:
            f.truncate(f.tell() - torn)
            f.flush()
            os.fsync(f.fileno())
    return torn


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


# --- one writer per folder -----------------------------------------------------------------------

LOCK_FILE = ".ncgrpo.lock"


class FolderLock:
    """Advisory exclusive lock (``fcntl.flock``) on ``DIR/.ncgrpo.lock``, held while writing ``DIR``.

    A second process fails at once with :class:`FolderBusyError` naming the holder's pid (written
    into the lock file). The kernel drops the lock when its holder dies, even by SIGKILL, so a
    stale lock file never blocks a rerun. The lock file stays; it holds only the last holder's pid.
    Re-entrant within one process: an inner lock on a folder this process holds is a no-op.
    """

    _held: dict[str, int] = {}  # resolved folder -> nesting depth, in this process

    def __init__(self, folder: str | os.PathLike, what: str = "ncgrpo"):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.what = what
        self._fd: int | None = None
        self._key: str | None = None

    def acquire(self) -> None:
        import fcntl

        self.folder.mkdir(parents=True, exist_ok=True)
        key = str(self.folder.resolve())
        if key in FolderLock._held:
            FolderLock._held[key] += 1
            self._key = key
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise FolderBusyError(
                f"{self.folder} is being written by another process ({holder}, lock {self.path}); "
                "wait for it to finish or use another output folder"
            ) from None
        except OSError as e:  # e.g. a file system without flock support
            os.close(fd)
            raise OSError(
                e.errno, f"{self.path}: cannot take the folder lock ({e.strerror}); use a local folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} ({self.what})\n".encode(), 0)
        self._fd = fd
        self._key = key
        FolderLock._held[key] = 1

    def release(self) -> None:
        if self._key is None:
            return
        FolderLock._held[self._key] -= 1
        if FolderLock._held[self._key] == 0:
            del FolderLock._held[self._key]
        self._key = None
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
