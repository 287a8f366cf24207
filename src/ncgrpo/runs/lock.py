"""One writer per run folder: the advisory lock a writer holds (:class:`FolderLock`), claiming a folder
with its kind (:func:`claim_folder`), and the claim of a script that is no ncgrpo command
(:func:`claim_script_folder`, :func:`finish_script_folder`).
"""

from __future__ import annotations

import fcntl
import os
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

from ncgrpo.runs.files import LOCK_FILE, RUN_FILE, atomic_write_json, read_run_json
from ncgrpo.runs.kinds import FolderKindError, check_folder_kind

__all__ = ["FolderBusyError", "FolderLock", "claim_folder", "claim_script_folder", "finish_script_folder"]


class FolderBusyError(ValueError):
    """Another process holds the advisory lock of an output folder."""


class FolderLock:
    """Advisory exclusive lock (``fcntl.flock``) on ``DIR/.ncgrpo.lock``, held while writing ``DIR``.

    A second process fails at once with :class:`FolderBusyError` naming the holder (its pid, host and
    command line, written into the lock file). The kernel drops the lock when its holder dies, even by
    SIGKILL, so a stale lock file never blocks a rerun. The lock file stays; it holds only the last
    holder. Re-entrant within one process: an inner lock on a folder this process holds is a no-op.

    ``kind`` (a :data:`KINDS` key): the folder must be new or of that kind (:func:`check_folder_kind`),
    checked before the folder or the lock file is created and again once the lock is held.
    :meth:`check` does the same checks without taking the lock or writing anything (for a command to
    refuse before it loads a model).
    """

    _held: dict[str, int] = {}  # resolved folder -> nesting depth, in this process

    def __init__(self, folder: str | os.PathLike, what: str = "ncgrpo", *, kind: str | None = None):
        self.folder = Path(folder)
        self.path = self.folder / LOCK_FILE
        self.what = what
        self.kind = kind
        self._fd: int | None = None
        self._key: str | None = None

    def _busy_error(self, holder: str) -> FolderBusyError:
        return FolderBusyError(
            f"{self.folder} is being written by another process ({holder or 'unknown'}; lock {self.path}); "
            "wait for it to finish or use another output folder"
        )

    def _check_target(self) -> None:
        """A file, or a folder of another kind, is refused (:func:`check_folder_kind`)."""
        if self.kind is not None:
            check_folder_kind(self.folder, self.kind, self.what)
        elif self.folder.exists() and not self.folder.is_dir():
            raise FolderKindError(f"{self.folder} is a file, not a folder; pass a folder path")

    def check(self) -> None:
        """Refuse now what :meth:`acquire` would refuse (a file, another kind, another holder); writes
        nothing."""
        self._check_target()
        holder = self.holder()
        if holder is not None:
            raise self._busy_error(holder)

    def holder(self) -> str | None:
        """Who holds the lock (the lock file's text), or ``None`` when no other process does."""

        if not self.path.is_file() or str(self.folder.resolve()) in FolderLock._held:
            return None
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return os.pread(fd, 2000, 0).decode("utf-8", "replace").strip() or "unknown"
        except OSError:
            return None
        finally:
            os.close(fd)  # closing drops a lock taken just now
        return None

    def acquire(self) -> None:

        key = str(self.folder.resolve())
        if key in FolderLock._held:
            FolderLock._held[key] += 1
            self._key = key
            return
        self._check_target()
        self.folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 2000, 0).decode("utf-8", "replace").strip()
            os.close(fd)
            raise self._busy_error(holder) from None
        except OSError as e:  # e.g. a file system without flock support
            os.close(fd)
            raise OSError(
                e.errno, f"{self.path}: cannot take the folder lock ({e.strerror}); use a local folder"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if self.kind is not None:  # again under the lock: another writer may have finished meanwhile
                check_folder_kind(self.folder, self.kind, self.what)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text(self.what).encode("utf-8", "replace"), 0)
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


def claim_folder(lock: FolderLock) -> FolderLock:
    """Take ``lock`` (which names a kind) and record that kind as the folder's ``run.json`` where it
    does not say it yet (a new folder, or one written before kinds were recorded): how a command whose
    folder holds no run.json of its own (a demo's root, a report folder) claims it. Returns the lock,
    held; the caller releases it."""
    if lock.kind is None:
        raise ValueError(f"claim_folder: the lock on {lock.folder} names no kind to record")
    lock.acquire()
    try:
        if (read_run_json(lock.folder) or {}).get("kind") != lock.kind:
            atomic_write_json(lock.folder / RUN_FILE, {"kind": lock.kind})
    except BaseException:
        lock.release()
        raise
    return lock


def claim_script_folder(folder: str | os.PathLike, script: str, kind: str) -> FolderLock:
    """The output folder of a script that is no ncgrpo command (``examples/*.py``), claimed as every
    command claims its own: refused (``ValueError``, the message names the folder and what to do) when
    the path is empty (an unset shell variable), a file, a folder of another kind
    (:func:`check_folder_kind`), one another process writes, or a folder that holds anything but this
    script's own earlier output (``run.json``'s ``script``): a finished ``ncgrpo train`` run, say, whose
    weights the script would replace. Takes the lock and writes ``run.json`` (``kind``, ``script``,
    ``finished: false``); :func:`finish_script_folder` marks it finished. Returns the lock, held (the
    process's exit releases it)."""
    if not str(folder).strip():
        raise ValueError(
            f"--output_dir is empty ({str(folder)!r}; an unset shell variable?): give a new folder path"
        )
    lock = FolderLock(folder, script, kind=kind)
    lock.check()  # a file, another kind, another writer
    info = read_run_json(lock.folder, hint="move it away or fix it") if lock.folder.is_dir() else None
    if lock.folder.is_dir() and (info or {}).get("script") != script:
        found = sorted(p.name for p in lock.folder.iterdir() if p.name != LOCK_FILE)
        if found:
            what = (
                f"a finished run ({info.get('name') or info.get('script')!r})"
                if (info or {}).get("finished")
                else "files " + ", ".join(found[:5]) + (" ..." if len(found) > 5 else "")
            )
            raise ValueError(
                f"{lock.folder} already holds {what}, which {script} did not write; it writes a new folder "
                "(or its own earlier output): pass another --output_dir"
            )
    lock.acquire()
    try:
        atomic_write_json(
            lock.folder / RUN_FILE, {"kind": kind, "script": script, "name": script, "finished": False}
        )
    except BaseException:
        lock.release()
        raise
    return lock


def finish_script_folder(lock: FolderLock, **extra: Any) -> None:
    """Mark a :func:`claim_script_folder` folder's ``run.json`` finished (with ``extra``: e.g.
    ``global_step``) and release its lock."""
    try:
        info = read_run_json(lock.folder) or {}
        atomic_write_json(lock.folder / RUN_FILE, {**info, **extra, "finished": True})
    finally:
        lock.release()


def _holder_text(what: str) -> str:
    """``pid N (what) on host H: command line``: what a refused second writer is told."""

    try:
        cmd = shlex.join(sys.argv)
    except TypeError:
        cmd = " ".join(map(str, sys.argv))
    if len(cmd) > 1000:  # the start (the command) and the end (the last flags) say most
        cmd = cmd[:400] + " ... " + cmd[-595:]
    return f"pid {os.getpid()} ({what}) on host {socket.gethostname()}: {cmd}\n"
