"""Issue 42: every run knows what made it. ``ncgrpo.runs.provenance`` reads the ncgrpo commit, whether its
source is dirty and the package versions; every run.json records it beside the run's identity (never in
it), and a resume or an append under another commit, other versions or uncommitted code warns, naming
old -> new, and is recorded in ``provenance_history``."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import warnings
from importlib.metadata import version
from pathlib import Path

import pytest

from ncgrpo.runs import provenance as prov
from ncgrpo.runs.provenance import (
    ProvenanceWarning,
    continue_provenance,
    describe,
    provenance,
    provenance_changes,
)

ROOT = Path(__file__).resolve().parents[1]
needs_git = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def _git(cwd: Path, *args: str) -> str:
    env_args = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    return subprocess.run(
        ["git", *env_args, *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout


def _checkout(tmp_path: Path) -> tuple[Path, Path, str]:
    """A git checkout holding src/pkg/__init__.py (committed), a .gitignore, a README; (root, pkg, HEAD)."""
    root = tmp_path / "repo"
    pkg = root / "src" / "pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("x = 1\n")
    (root / "README.md").write_text("readme\n")
    (root / ".gitignore").write_text("__pycache__/\n")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-q", "-m", "c")
    return root, pkg, _git(root, "rev-parse", "HEAD").strip()


@needs_git
def test_a_clean_checkout_gives_its_commit_and_not_dirty(tmp_path: Path) -> None:
    _, pkg, head = _checkout(tmp_path)
    assert prov._source(pkg) == {"commit": head, "commit_from": "git", "dirty": False}


@needs_git
def test_dirty_counts_the_package_source_only_and_the_digest_tells_two_dirty_trees_apart(
    tmp_path: Path,
) -> None:
    root, pkg, head = _checkout(tmp_path)
    (root / "README.md").write_text("edited docs change no run\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "x.pyc").write_bytes(b"ignored")
    assert prov._source(pkg)["dirty"] is False
    (pkg / "__init__.py").write_text("x = 2\n")
    first = prov._source(pkg)
    assert first["commit"] == head and first["dirty"] is True
    assert first["dirty_files"] == ["src/pkg/__init__.py"] and len(first["dirty_digest"]) == 12
    (pkg / "__init__.py").write_text("x = 3\n")
    assert prov._source(pkg)["dirty_digest"] != first["dirty_digest"]  # other uncommitted code
    (pkg / "__init__.py").write_text("x = 2\n")
    assert prov._source(pkg)["dirty_digest"] == first["dirty_digest"]  # the same again
    (pkg / "new.py").write_text("y = 1\n")  # untracked, not ignored: part of the code
    last = prov._source(pkg)
    assert last["dirty_files"] == ["src/pkg/__init__.py", "src/pkg/new.py"]
    assert last["dirty_digest"] != first["dirty_digest"]


@needs_git
def test_a_package_not_tracked_by_the_checkout_around_it_has_no_commit(tmp_path: Path, monkeypatch) -> None:
    """An installed ncgrpo in a project's ignored .venv: the project's commit says nothing of ncgrpo."""
    root, _, _ = _checkout(tmp_path)
    (root / ".gitignore").write_text("__pycache__/\n.venv/\n")
    site = root / ".venv" / "site-packages" / "ncgrpo"
    site.mkdir(parents=True)
    (site / "__init__.py").write_text("")
    monkeypatch.delenv(prov.COMMIT_ENV, raising=False)
    assert prov._source(site) == {"commit": None, "commit_from": None, "dirty": None}
    # a wheel built from a known commit says it through NCGRPO_COMMIT
    monkeypatch.setenv(prov.COMMIT_ENV, "abc123")
    assert prov._source(site) == {"commit": "abc123", "commit_from": "NCGRPO_COMMIT", "dirty": None}


def test_no_git_no_checkout_never_fails(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv(prov.COMMIT_ENV, raising=False)
    assert prov._source(tmp_path) == {"commit": None, "commit_from": None, "dirty": None}  # not a checkout
    monkeypatch.setenv("PATH", str(tmp_path))  # no git at all
    assert prov._git(tmp_path, "status") is None
    assert prov._source(ROOT / "src" / "ncgrpo")["commit"] is None


def test_provenance_has_the_versions_and_is_a_fresh_copy_each_call() -> None:
    p = provenance()
    assert set(p) >= {"ncgrpo_version", "commit", "dirty", "versions"}
    assert set(p["versions"]) == {"python", *prov.PACKAGES}
    assert p["versions"]["torch"] == version("torch") and p["versions"]["trl"] == version("trl")
    assert p["versions"]["python"] == ".".join(map(str, sys.version_info[:3]))
    p["versions"]["torch"] = "changed"
    assert provenance()["versions"]["torch"] == version("torch")  # the cached value is not shared
    json.dumps(p)  # goes into run.json as it is


def test_provenance_imports_no_heavy_module() -> None:
    code = (
        "import sys; from ncgrpo.runs.provenance import provenance; provenance(); "
        "print(sorted(m for m in ('torch', 'transformers', 'trl', 'vllm', 'peft') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _p(commit: str = "a" * 40, torch: str = "2.9.0", dirty: bool = False, digest: str | None = None) -> dict:
    p = {
        "ncgrpo_version": "0.1.0",
        "commit": commit,
        "commit_from": "git",
        "dirty": dirty,
        "versions": {"python": "3.11.7", "torch": torch, "transformers": "5.23.0", "trl": "1.16.0"},
    }
    if dirty:
        p["dirty_digest"] = digest or "d" * 12
    return p


def test_changes_name_old_and_new() -> None:
    assert provenance_changes(_p(), _p()) == []
    assert provenance_changes(_p(), _p(commit="b" * 40, torch="2.10.0")) == [
        "commit aaaaaaaaaaaa -> bbbbbbbbbbbb",
        "torch 2.9.0 -> 2.10.0",
    ]
    assert provenance_changes(_p(), _p(dirty=True, digest="123456789abc")) == [
        "source tree clean -> uncommitted (123456789abc)"
    ]
    same_dirty = provenance_changes(_p(dirty=True), _p(dirty=True))
    assert len(same_dirty) == 1 and "the same then and now" in same_dirty[0]
    assert "no provenance recorded" in provenance_changes(None, _p())[0]
    assert describe(_p()).startswith("commit aaaaaaaaaaaa (clean), python 3.11.7, torch 2.9.0")


def test_continue_warns_and_records_only_what_changed(monkeypatch, tmp_path: Path) -> None:
    now = _p(commit="b" * 40, torch="2.10.0")
    monkeypatch.setattr(prov, "provenance", lambda: json.loads(json.dumps(now)))
    assert continue_provenance(None, event="append", where=tmp_path) == {"provenance": now}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert continue_provenance({"provenance": now}, event="append", where=tmp_path) == {"provenance": now}
    with pytest.warns(ProvenanceWarning, match=r"commit aaaaaaaaaaaa -> bbbbbbbbbbbb; torch 2.9.0 -> 2.10.0"):
        keys = continue_provenance({"provenance": _p()}, event="append", where=tmp_path, new_records=3)
    assert keys["provenance"] == _p()  # what made it first stays
    (entry,) = keys["provenance_history"]
    assert entry == {
        "event": "append",
        "new_records": 3,
        "provenance": now,
        "changes": ["commit aaaaaaaaaaaa -> bbbbbbbbbbbb", "torch 2.9.0 -> 2.10.0"],
    }
    # the next append under the same code compares with the newest entry: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert continue_provenance(keys, event="append", where=tmp_path) == keys
    # a folder from before provenance was recorded: said once, then known
    with pytest.warns(ProvenanceWarning, match="no provenance recorded"):
        old = continue_provenance({"kind": "eval"}, event="append", where=tmp_path)
    assert "provenance" not in old and old["provenance_history"][0]["provenance"] == now


def test_the_same_dirty_tree_is_said_but_not_recorded_twice(monkeypatch, tmp_path: Path) -> None:
    now = _p(dirty=True)
    monkeypatch.setattr(prov, "provenance", lambda: dict(now))
    with pytest.warns(
        ProvenanceWarning,
        match=r"resume with uncommitted changes to the ncgrpo source \(the same as recorded",
    ):
        keys = continue_provenance({"provenance": now}, event="resume", where=tmp_path)
    assert keys == {"provenance": now}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        continue_provenance({"provenance": now}, event="resume", where=tmp_path, warn=False)  # other ranks


# --- ncgrpo train --resume -------------------------------------------------------------------------
import test_train_cli  # noqa: E402
from test_train_cli import MODEL, _args, _fake_complete_checkpoint  # noqa: E402

geo3k = test_train_cli.geo3k  # fixture


def _prepare(out: Path, geo3k: Path, **kw):
    from ncgrpo.commands.parser import ConfigParser
    from ncgrpo.commands.train_prepare import prepare_run
    from ncgrpo.commands.train_settings import train_dataclasses

    argv = _args(out, geo3k, MODEL)[1:]
    return prepare_run(ConfigParser(train_dataclasses).parse_args(argv).parsed_config, **kw)


def test_train_records_provenance_outside_its_identity(tmp_path: Path, geo3k: Path) -> None:
    from ncgrpo.cli import main

    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run")) == 0
    info = json.loads((out / "run.json").read_text())
    assert info["provenance"] == provenance()
    assert "provenance" not in info["identity"] and "versions" not in info["identity"]


def test_resume_under_another_commit_warns_and_records_it(tmp_path: Path, geo3k: Path) -> None:
    from ncgrpo.cli import main

    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run")) == 0
    _fake_complete_checkpoint(out / "checkpoint-1")
    info = json.loads((out / "run.json").read_text())
    recorded = {**info["provenance"], "commit": "0" * 40, "dirty": False}
    recorded["versions"] = {**recorded["versions"], "torch": "2.6.0"}
    (out / "run.json").write_text(json.dumps({**info, "provenance": recorded}))
    now = provenance()
    with pytest.warns(ProvenanceWarning) as seen:
        plan = _prepare(out, geo3k, resume=True)
    message = str(next(w for w in seen if w.category is ProvenanceWarning).message)
    assert f"{out}: resume under other code or packages" in message
    assert f"commit 000000000000 -> {str(now['commit'])[:12] if now['commit'] else 'unknown'}" in message
    assert f"torch 2.6.0 -> {now['versions']['torch']}" in message
    try:
        plan.write_folder()  # what execute_run writes once the model has loaded (a resume: nothing yet)
        # ... and once the checkpoint has loaded (driver._Loaded at train begin): config.yaml, run.json
        from ncgrpo.trainer.run_folder import write_train_run_json

        plan.write_settings()
        write_train_run_json(out, plan.run_info, finished=False)
    finally:
        plan.release()
    written = json.loads((out / "run.json").read_text())
    assert written["provenance"] == recorded  # what made the run's first steps
    (entry,) = written["provenance_history"]
    assert entry["event"] == "resume" and entry["checkpoint"] == "checkpoint-1"
    assert entry["provenance"] == now and f"torch 2.6.0 -> {now['versions']['torch']}" in entry["changes"]
    assert written["identity"] == info["identity"]  # not refused: the identity is unchanged


def test_a_resume_that_starts_over_records_only_this_process(tmp_path: Path, geo3k: Path) -> None:
    from ncgrpo.cli import main

    out = tmp_path / "run"
    assert main(_args(out, geo3k, MODEL, "--dry-run")) == 0
    info = json.loads((out / "run.json").read_text())
    (out / "run.json").write_text(json.dumps({**info, "provenance": _p(commit="0" * 40)}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProvenanceWarning)
        plan = _prepare(out, geo3k, resume=True)  # no checkpoint: nothing of the old run is kept
    plan.release()
    assert plan.run_info["provenance"] == provenance() and "provenance_history" not in plan.run_info


# --- a demo continuing its folder ----------------------------------------------------------------------
def test_a_demo_root_records_what_made_it_and_each_continuation_under_other_code(
    tmp_path: Path, monkeypatch
) -> None:
    from ncgrpo.toy.demo import _record_provenance

    clean = _p(commit="c" * 40)  # this process, clean (the checkout the tests run in may not be)
    monkeypatch.setattr(prov, "provenance", lambda: json.loads(json.dumps(clean)))

    new = tmp_path / "new"
    new.mkdir()
    (new / "run.json").write_text('{"kind": "demo"}')  # as claim_folder leaves a new folder
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProvenanceWarning)
        _record_provenance(new)
        _record_provenance(new)  # continued under the same code: nothing to say
    assert json.loads((new / "run.json").read_text()) == {"kind": "demo", "provenance": clean}

    (new / "train").mkdir()
    (new / "run.json").write_text(json.dumps({"kind": "demo", "provenance": _p(commit="0" * 40)}))
    with pytest.warns(
        ProvenanceWarning, match=r"continue under other code .*commit 000000000000 -> cccccccccccc"
    ):
        _record_provenance(new)
    info = json.loads((new / "run.json").read_text())
    assert info["provenance"]["commit"] == "0" * 40
    assert [h["event"] for h in info["provenance_history"]] == ["continue"]
    assert info["provenance_history"][0]["provenance"] == clean

    old = tmp_path / "old"  # a demo folder from before provenance was recorded
    (old / "eval").mkdir(parents=True)
    (old / "run.json").write_text('{"kind": "demo"}')
    with pytest.warns(ProvenanceWarning, match="no provenance recorded"):
        _record_provenance(old)
    assert "provenance" not in json.loads((old / "run.json").read_text())

    copied = tmp_path / "copied"  # a new demo folder holding runs copied from another (the shared baseline)
    for sub in ("train/grpo-seed0", "eval/grpo-seed0", "eval/base"):
        (copied / sub).mkdir(parents=True)
        (copied / sub / "run.json").write_text(json.dumps({"kind": "x", "provenance": _p(commit="0" * 40)}))
    (copied / "run.json").write_text('{"kind": "demo"}')
    with warnings.catch_warnings():  # each run says what made it: the root is new, nothing to warn about
        warnings.simplefilter("error", ProvenanceWarning)
        _record_provenance(copied)
    assert json.loads((copied / "run.json").read_text()) == {"kind": "demo", "provenance": clean}
    (copied / "eval" / "base" / "run.json").write_text('{"kind": "x"}')  # one copied run that records nothing
    (copied / "run.json").write_text('{"kind": "demo"}')
    with pytest.warns(ProvenanceWarning, match="no provenance recorded"):
        _record_provenance(copied)
