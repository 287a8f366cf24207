"""A run folder's files: their names, how they are written (atomically; a full disk named as such) and
how they are read back (JSON lines that skip or cut a torn last line, ``run.json``). The folder's layout
as a whole: :mod:`ncgrpo.runs.folder`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "CONFIG_FILE",
    "LOCK_FILE",
    "METRICS_FILE",
    "RECORDS_FILE",
    "RUN_FILE",
    "STATE_FILE",
    "DiskFullError",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_write_text",
    "disk_full_error",
    "iter_json_lines",
    "json_rows",
    "read_run_json",
    "repair_torn_tail",
]

RUN_FILE = "run.json"
CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
RECORDS_FILE = "records.jsonl"
LOCK_FILE = ".ncgrpo.lock"
#: NC-GRPO's own state in a Trainer checkpoint (noise schedule position, SPSA's ``mu``, ...).
STATE_FILE = "ncgrpo_state.pt"


class DiskFullError(ValueError):
    """A write ran out of room (a full disk, a quota, a file-size limit): :func:`disk_full_error`."""


# --- writing ------------------------------------------------------------------------------------
#: What a write that ran out of room says, where no errno survives (PyTorch's zip writer raises a
#: RuntimeError "file write failed"; safetensors' Rust writer its own error).
_FULL_TEXTS = ("no space left on device", "file too large", "disk quota exceeded", "file write failed")


def _full_reason(exc: BaseException) -> str | None:

    full = {errno.ENOSPC, errno.EFBIG, getattr(errno, "EDQUOT", errno.ENOSPC)}
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in full:
            return f"{os.strerror(e.errno)} (errno {errno.errorcode.get(e.errno, e.errno)})"
        text = str(e).lower()
        if any(t in text for t in _FULL_TEXTS):
            return f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}"
        e = e.__cause__ or e.__context__
    return None


def disk_full_error(exc: BaseException, folder: str | os.PathLike, then: str = "") -> DiskFullError | None:
    """A :class:`DiskFullError` naming ``folder`` and the free space of its file system
    (``shutil.disk_usage``) when ``exc`` (or what caused it) is a write that ran out of room (ENOSPC,
    EDQUOT, EFBIG, or the text PyTorch's and safetensors' writers say it with); else ``None``.
    ``then``: what to do next, appended."""

    why = _full_reason(exc)
    if why is None:
        return None
    where = Path(folder)
    probe = where
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    try:
        free = f"{shutil.disk_usage(probe).free / 2**30:.2f} GiB free on its file system"
    except OSError:
        free = "free space unknown"
    tail = f"; {then}" if then else ""
    return DiskFullError(
        f"{where}: writing it failed for lack of room: {why}; {free} (a file-size limit, ulimit -f, "
        f"gives the same error){tail}"
    )


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


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so a reader sees the old file or the new one, never a mix.

    The file gets the mode a plain ``open(path, "w")`` would give (0666 less the umask), not the
    0600 of the temporary file it is written through.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~_umask())
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """:func:`atomic_write_bytes` of ``text`` in UTF-8."""
    atomic_write_bytes(path, text.encode("utf-8"))


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

    def lines() -> Iterator[tuple[int, str]]:
        for i, raw in enumerate(data.splitlines(), start=1):
            try:
                yield i, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{path}:{i}: not UTF-8 text ({e.reason} at byte {e.start})") from None

    yield from json_rows(lines(), path, what)


def json_rows(
    lines: Iterable[tuple[int, str]], where: str | os.PathLike, what: str = "row"
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, object)`` of each non-blank ``(line number, text)``: a line that is not JSON or
    not a JSON object is an error naming ``where`` and the line (``what``: the kind of row)."""
    for i, line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}:{i}: not valid JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}:{i}: a {what} must be a JSON object, got {type(row).__name__}")
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


def read_run_json(folder: str | os.PathLike, *, hint: str | None = None) -> dict[str, Any] | None:
    """The folder's ``run.json`` as a dict, or ``None`` when there is none: the one reader of every
    kind of run folder (training, evaluation, demo). A file that is not UTF-8, not JSON or not a JSON
    object is a ``ValueError`` naming the file (and line), followed by ``hint`` (what to do) if given."""
    path = Path(folder) / RUN_FILE
    if not path.exists():
        return None
    tail = f"; {hint}" if hint else ""
    try:
        info = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}){tail}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: not valid JSON ({e.msg}){tail}") from None
    if not isinstance(info, dict):
        raise ValueError(f"{path}: must hold a JSON object, got {type(info).__name__}{tail}")
    return info
