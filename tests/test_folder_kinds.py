"""Issue 26: no command clobbers another's results. Every writer claims its folder with a kind
(``run.json``'s ``kind``) and the folder lock; another kind, or a folder another process holds, is
refused before anything is written, naming what was found. In-process ``ncgrpo.cli.main`` calls: each
refusal happens before a model loads, so no test here loads one (the two concurrent real ``ncgrpo
train`` processes are in ``test_train_faults.py``)."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path

import pytest

from ncgrpo.cli import main
from ncgrpo.runs.folder import (
    LOCK_FILE,
    RECORDS_FILE,
    RUN_FILE,
    FolderKindError,
    FolderLock,
    check_folder_kind,
    folder_kind,
)

ROOT = Path(__file__).resolve().parents[1]
TINY_RECIPE = ROOT / "recipes" / "tiny_cpu_latent.yaml"

# run.json of each kind as the previous version wrote it (no "kind")
OLD_EVAL = {"model": "m", "checkpoint": None, "seed": 0, "split": {"geo3k": "test"}, "benchmarks": ["geo3k"],
            "decoding": {"max_new_tokens": 8}, "name": "base", "method": None, "batch_size": 8}  # fmt: skip
OLD_TRAIN = {"name": "r", "method": "latent", "seed": 1, "model": "m", "recipe": None, "output_dir": "x",
             "finished": False}  # fmt: skip


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def eval_folder(root: Path) -> Path:
    d = root / "eval"
    d.mkdir()
    (d / RUN_FILE).write_text(json.dumps(OLD_EVAL))
    (d / RECORDS_FILE).write_text(
        json.dumps({"benchmark": "geo3k", "question_id": "1", "role": "in_domain", "correct": True}) + "\n"
    )
    return d


def train_folder(root: Path) -> Path:
    d = root / "train"
    d.mkdir()
    (d / RUN_FILE).write_text(json.dumps(OLD_TRAIN))
    (d / "metrics.jsonl").write_text('{"step": 1, "loss": 0.1}\n')
    return d


def demo_root(root: Path) -> Path:
    d = root / "demo"
    (d / "suite").mkdir(parents=True)
    (d / "suite" / "suite.json").write_text("{}")
    (d / "train").mkdir()
    (d / "eval").mkdir()
    return d


def model_folder(root: Path) -> Path:
    d = root / "model"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"weights")
    return d


def _train(out: Path) -> list[str]:
    return ["train", "--config", str(TINY_RECIPE), "--output_dir", str(out), "--dataset_name", "geo3k",
            "--dataset_path", str(out.parent / "no-data"), "--model_name_or_path", str(ROOT / "src/ncgrpo/toy/assets/base"), "--dry-run"]  # fmt: skip


def _eval(out: Path) -> list[str]:
    # a model folder that exists (the embedded base; the model source is checked first), never loaded:
    # every refusal below comes before the model
    base = str(ROOT / "src/ncgrpo/toy/assets/base")
    return ["eval", "--model_name_or_path", base, "--benchmarks", "geo3k", "--output_dir", str(out)]


# ------------------------------------------------------------------------------- the folder kinds
def test_kinds_of_folders_written_before_kinds_were_recorded(tmp_path: Path) -> None:
    """Old folders are recognised by what they hold (the documented rules of folder_kind)."""
    assert folder_kind(eval_folder(tmp_path)) == "eval"
    assert folder_kind(train_folder(tmp_path)) == "train"
    assert folder_kind(demo_root(tmp_path)) == "demo"
    assert folder_kind(model_folder(tmp_path)) == "model"
    (tmp_path / "pre").mkdir()
    (tmp_path / "pre" / "pretrain.json").write_text("{}")
    assert folder_kind(tmp_path / "pre") == "pretrain"
    (tmp_path / "rep").mkdir()
    (tmp_path / "rep" / "comparison.md").write_text("|")
    assert folder_kind(tmp_path / "rep") == "report"
    (tmp_path / "records-only").mkdir()
    (tmp_path / "records-only" / RECORDS_FILE).write_text("")
    assert folder_kind(tmp_path / "records-only") == "eval"
    (tmp_path / "ckpt" / "checkpoint-3").mkdir(parents=True)
    assert folder_kind(tmp_path / "ckpt") == "train"
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / LOCK_FILE).write_text("")
    assert folder_kind(tmp_path / "plain") is None and folder_kind(tmp_path / "absent") is None
    # an explicit kind wins over the files
    (tmp_path / "plain" / RUN_FILE).write_text('{"kind": "report"}')
    assert folder_kind(tmp_path / "plain") == "report"


def test_check_folder_kind_names_the_kind_and_how_it_was_found(tmp_path: Path) -> None:
    ev = eval_folder(tmp_path)
    check_folder_kind(ev, "eval")  # its own kind: fine
    check_folder_kind(tmp_path / "new", "train")  # a new folder: fine
    with pytest.raises(FolderKindError, match=r"holds an evaluation .*kind 'eval'.*ncgrpo train"):
        check_folder_kind(ev, "train", "ncgrpo train")
    (tmp_path / "f").write_text("x")
    with pytest.raises(FolderKindError, match="is a file, not a folder"):
        check_folder_kind(tmp_path / "f", "demo", "ncgrpo demo")


# ------------------------------------------------------------- item 2 and 7: train, eval, demo, compare
@pytest.mark.parametrize("make", [eval_folder, demo_root, model_folder])
def test_train_refuses_another_commands_folder_before_writing(tmp_path: Path, capsys, make) -> None:
    folder = make(tmp_path)
    before = _snapshot(folder)
    assert main(_train(folder)) == 2
    err = capsys.readouterr().err
    assert f"ncgrpo train: error: {folder} holds" in err and "pass a new folder" in err
    assert _snapshot(folder) == before  # not even a lock file


def test_eval_refuses_a_train_run_and_a_demo_root_before_loading(tmp_path: Path, capsys) -> None:
    for folder in (train_folder(tmp_path), demo_root(tmp_path)):
        before = _snapshot(folder)
        assert main(_eval(folder)) == 2
        err = capsys.readouterr().err
        assert f"{folder} holds" in err and "ncgrpo eval writes an evaluation" in err, err
        assert "records of" not in err  # not the identity message about records it does not hold
        assert _snapshot(folder) == before


def test_demo_refuses_a_train_run_an_eval_folder_and_a_file(tmp_path: Path, capsys) -> None:
    for folder in (train_folder(tmp_path), eval_folder(tmp_path)):
        before = _snapshot(folder)
        assert main(["demo", "--output_dir", str(folder), "--no_progress"]) == 2
        err = capsys.readouterr().err
        assert f"ncgrpo demo: error: {folder} holds" in err, err
        assert _snapshot(folder) == before
    f = tmp_path / "a-file"
    f.write_text("mine")
    assert main(["demo", "--output_dir", str(f), "--no_progress"]) == 2
    err = capsys.readouterr().err
    assert f"{f} is a file, not a folder" in err and "Errno" not in err
    assert f.read_text() == "mine"


def test_compare_and_plot_refuse_to_write_into_an_eval_folder(tmp_path: Path, capsys) -> None:
    ev = eval_folder(tmp_path)
    before = _snapshot(ev)
    assert main(["compare", "--runs", str(ev), "--baseline", "base", "--out", str(ev)]) == 2
    assert f"{ev} holds an evaluation" in capsys.readouterr().err
    assert main(["plot", "gains", "--runs", str(ev), "--baseline", "base", "--out", str(ev)]) == 2
    assert f"{ev} holds an evaluation" in capsys.readouterr().err
    assert _snapshot(ev) == before


# ------------------------------------------------------------------ a folder another process holds
def _hold(folder: Path, text: str) -> int:
    """Take the folder's flock on a descriptor of our own, as another process's FolderLock would."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.ftruncate(fd, 0)
    os.write(fd, text.encode())
    return fd


def test_a_held_folder_is_refused_naming_the_holder(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    fd = _hold(out, "pid 4242 (ncgrpo train) on host elsewhere: ncgrpo train --seed 1\n")
    try:
        before = _snapshot(out)
        assert main(_train(out)) == 2
        err = capsys.readouterr().err
        assert "being written by another process (pid 4242 (ncgrpo train) on host elsewhere" in err
        assert _snapshot(out) == before
        assert (
            main(["compare", "--runs", str(eval_folder(tmp_path)), "--baseline", "b", "--out", str(out)]) == 2
        )
        assert "pid 4242" in capsys.readouterr().err
        assert main(_eval(out)) == 2  # named before eval reads any question (there is no data here)
        assert "pid 4242" in capsys.readouterr().err
        lock = FolderLock(out, "x")
        assert lock.holder().startswith("pid 4242")
    finally:
        os.close(fd)
    assert FolderLock(out, "x").holder() is None  # released: the next writer is free


def test_the_lock_file_names_pid_host_and_command_line(tmp_path: Path) -> None:
    import socket

    with FolderLock(tmp_path / "f", "ncgrpo test", kind="train"):
        text = (tmp_path / "f" / LOCK_FILE).read_text()
    assert text.startswith(f"pid {os.getpid()} (ncgrpo test) on host {socket.gethostname()}: ")


# ------------------------------------------------------------------ old folders still resume
def test_an_old_eval_folder_accepts_its_rerun_and_gains_its_kind(tmp_path: Path) -> None:
    from ncgrpo.eval.evaluate import DecodingSettings, _check_run_file, check_folder, run_identity

    ev = eval_folder(tmp_path)
    ident = run_identity(model_id="m", seed=0, name="base", settings=DecodingSettings(max_new_tokens=8),
                         split={"geo3k": "test"}, benchmarks=["geo3k"])  # fmt: skip
    # a folder from before kinds but with today's model ids (one from before model_id_rule is refused:
    # tests/eval/test_eval_identity.py)
    old = {**OLD_EVAL, "decoding": ident["decoding"], "model_id_rule": ident["model_id_rule"]}
    (ev / RUN_FILE).write_text(json.dumps(old))
    assert check_folder(ev, ident) == old  # the identity of an old folder still matches
    _check_run_file(ev, ident)
    written = json.loads((ev / RUN_FILE).read_text())
    assert written["kind"] == "eval" and all(written[k] == v for k, v in old.items())


def test_an_old_train_folder_is_a_train_folder_and_a_dry_run_leaves_it_as_it_was(
    tmp_path: Path, capsys
) -> None:
    from test_train_cli import write_geo3k_parquet

    data = write_geo3k_parquet(tmp_path / "geo3k")
    out = train_folder(tmp_path)
    args = _train(out)
    args[args.index("--dataset_path") + 1] = str(data)
    before = (out / RUN_FILE).read_bytes()
    assert main(args) == 0, capsys.readouterr().err
    # a dry run accepts the old folder as a train run and leaves its run.json as it was; a real run
    # writes run.json with its kind (test_train_cli's fast runs check "kind": "train")
    assert (out / RUN_FILE).read_bytes() == before and folder_kind(out) == "train"
    assert FolderLock(out).holder() is None  # released at the end of the dry run


# ------------------------------------------------------------------ claim_folder: one way to stamp a kind
def test_claim_folder_records_the_kind_once_and_refuses_another_kind(tmp_path: Path) -> None:
    """A demo's root and a report folder are claimed by the one helper: lock held, run.json's kind
    recorded where it does not say it yet (an old folder gains it; one that says it is left alone);
    a folder of another kind is refused with nothing written and no lock left held."""
    from ncgrpo.runs.folder import claim_folder

    new = tmp_path / "new"
    lock = claim_folder(FolderLock(new, "ncgrpo demo", kind="demo"))
    try:
        assert json.loads((new / RUN_FILE).read_text()) == {"kind": "demo"}
        assert FolderLock(new, "x").holder() is None  # held by this process (re-entrant), not another
        assert str(new.resolve()) in FolderLock._held
    finally:
        lock.release()
    assert str(new.resolve()) not in FolderLock._held

    stamped = new / RUN_FILE
    stamped.write_text('{"kind": "demo"}')  # already says it: not rewritten
    mtime = stamped.stat().st_mtime_ns
    claim_folder(FolderLock(new, "ncgrpo demo", kind="demo")).release()
    assert stamped.stat().st_mtime_ns == mtime and stamped.read_text() == '{"kind": "demo"}'

    old_report = tmp_path / "report"  # written before kinds were recorded: inferred, then stamped
    old_report.mkdir()
    (old_report / "comparison.md").write_text("| table |\n")
    claim_folder(FolderLock(old_report, "ncgrpo compare", kind="report")).release()
    assert json.loads((old_report / RUN_FILE).read_text()) == {"kind": "report"}

    ev = eval_folder(tmp_path)
    before = _snapshot(ev)
    with pytest.raises(FolderKindError, match="holds an evaluation"):
        claim_folder(FolderLock(ev, "ncgrpo demo", kind="demo"))
    assert _snapshot(ev) == before and str(ev.resolve()) not in FolderLock._held
    with pytest.raises(ValueError, match="names no kind"):
        claim_folder(FolderLock(tmp_path / "x", "ncgrpo"))
