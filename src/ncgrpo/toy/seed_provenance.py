"""What made a seed table's records: each run's ``provenance`` as its run folders' run.json recorded
it (:mod:`ncgrpo.runs.provenance`), an export's ``manifest.json`` that keeps them beside the compact
records (:func:`manifest`, read back by :func:`runs_provenance`), and the one line under the table that
names the commit(s) and package versions (:func:`made_by`). The table: :mod:`ncgrpo.toy.seed_table`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ncgrpo.runs.folder import read_run_json
from ncgrpo.runs.provenance import provenance
from ncgrpo.toy.seed_runs import BASE_DIR

__all__ = ["MANIFEST_FILE", "MANIFEST_FORMAT", "made_by", "manifest", "runs_provenance"]

#: An export's record of what made it (see :mod:`ncgrpo.toy.seed_table`), and its format line.
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "ncgrpo.seed_table.manifest/1"


def _run_key(slug: str, seed: int | None) -> str:
    return BASE_DIR if seed is None else f"{slug}-seed{seed}"


def _folder_provenance(info: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run folder's ``provenance`` and ``provenance_history`` (None: its run.json records neither)."""
    kept = {k: (info or {}).get(k) for k in ("provenance", "provenance_history")}
    kept = {k: v for k, v in kept.items() if v}
    return kept or None


def _read_manifest(folder: Path) -> dict[str, Any] | None:
    """An export's ``manifest.json`` (None: exported before manifests were written); errors name it."""
    path = folder / MANIFEST_FILE
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a JSON manifest ({e})") from None
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise ValueError(f"{path}: not a seed-table manifest (its format must be {MANIFEST_FORMAT!r})")
    if not isinstance(data.get("runs"), dict):
        raise ValueError(f"{path}: 'runs' must be an object (run -> its provenance)")
    return data


def runs_provenance(where: dict[tuple[str, int | None], Path]) -> dict[str, dict[str, Any] | None]:
    """``{run: {"train": ..., "eval": ...} or None}`` for each run of the table (``base``,
    ``<slug>-seed<N>``), read where the table read it: a demo folder's ``eval/<run>/run.json`` and
    ``train/<run>/run.json`` (:func:`_folder_provenance`; None for a folder whose run.json records
    none), an export's manifest (None where it has none)."""
    out: dict[str, dict[str, Any] | None] = {}
    manifests: dict[Path, dict[str, Any] | None] = {}
    for (slug, seed), folder in sorted(
        where.items(), key=lambda kv: (kv[0][1] is not None, kv[0][0], kv[0][1] or 0)
    ):
        run = _run_key(slug, seed)
        if (folder / "eval").is_dir():
            parts = {
                kind: _folder_provenance(read_run_json(folder / kind / run, hint="move it away or fix it"))
                for kind in ("train", "eval")
                if (folder / kind / run).is_dir()
            }
            out[run] = parts or None  # a part None: that run.json records no provenance
        else:
            if folder not in manifests:
                manifests[folder] = _read_manifest(folder)
            found = (manifests[folder] or {}).get("runs", {}).get(run)
            out[run] = found if isinstance(found, dict) and found else None
    return out


def manifest(
    folders: Sequence[str | Path], runs: dict[str, dict[str, Any] | None], command: str | None
) -> dict[str, Any]:
    """``manifest.json`` of an export: its format, the command line, the folders read, what made the
    export (this process's :func:`ncgrpo.runs.provenance.provenance`: commit, dirty, package versions)
    and ``runs``: each run's own provenance (``{"train": {"provenance", "provenance_history"}, "eval":
    {...}}``; None where its run.json records none). No time stamp: the same export gives the same bytes."""
    return {
        "format": MANIFEST_FORMAT,
        "command": command,
        "folders": [str(f) for f in folders],
        **provenance(),
        "runs": runs,
    }


def _made(p: dict[str, Any]) -> str:
    commit = str(p.get("commit"))[:12] if p.get("commit") else "unknown"
    tree = {True: f" with uncommitted changes ({p.get('dirty_digest')})", False: ""}.get(p.get("dirty"), "")
    return f"{commit}{tree}"


def made_by(runs: dict[str, dict[str, Any] | None]) -> str:
    """One line under the table: the commit(s) that made the runs' records (training and evaluation,
    a resume's or an append's too) and their package versions, as the runs' run.json recorded them.
    A run is counted as unknown in part when its training or its evaluation recorded no provenance, or
    only for a later resume or append (what made its first part is unknown)."""
    commits: dict[str, None] = {}
    versions: dict[str, dict[str, None]] = {}
    unknown = 0
    for entry in runs.values():
        provs = []
        parts = list((entry or {}).values()) or [None]
        for part in parts:
            if not isinstance(part, dict):
                continue
            if isinstance(part.get("provenance"), dict):
                provs.append(part["provenance"])
            provs += [
                h["provenance"]
                for h in part.get("provenance_history") or []
                if isinstance(h, dict) and isinstance(h.get("provenance"), dict)
            ]
        if any(not isinstance(part, dict) or not isinstance(part.get("provenance"), dict) for part in parts):
            unknown += 1
        for p in provs:
            commits[_made(p)] = None
            for k, v in (p.get("versions") or {}).items():
                if v is not None:
                    versions.setdefault(k, {})[v] = None
    if not commits:
        return (
            "Made by: unknown (no commit or package versions recorded: the runs predate run.json's "
            f"provenance, or the export has no {MANIFEST_FILE})."
        )
    names = {"trl": "TRL"}
    text = f"Made by: ncgrpo commit{'s' if len(commits) > 1 else ''} {', '.join(commits)}"
    if versions:
        text += "; " + ", ".join(f"{names.get(k, k)} {'/'.join(v)}" for k, v in versions.items())
    if unknown:
        text += (
            f"; unknown in part for {unknown} of {len(runs)} runs (a training or evaluation run.json "
            "without provenance)"
        )
    return text + "."
