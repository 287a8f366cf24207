"""Faults and bad input on the evaluation side (issue 10, classes 1 and 5).

Each test reproduces a fault with the real thing -- torn bytes on disk, a second OS process, SIGKILL --
and checks the new behaviour. Before (for the record): a records file cut inside a UTF-8 character
made every rerun die with UnicodeDecodeError; another ``--split`` silently reused the folder's records;
two evals into one folder recorded every question twice and conflicting duplicates were resolved
"first wins"; ``--batch-size 0`` wrote run.json before failing (so every correct rerun was refused),
and a smaller batch size on rerun was refused; atomically written files were 0600 whatever the umask.
"""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ncgrpo
from ncgrpo import cli
from ncgrpo.eval.evaluate import DecodingSettings, evaluate
from ncgrpo.eval.records import DuplicateRecordError, EvalRecord, RecordWriter, read_records
from ncgrpo.runs.folder import LOCK_FILE, RECORDS_FILE, RUN_FILE, FolderLock, atomic_write_json
from ncgrpo.toy.suite import build_suite, export_geo3k
from tiny_models import save_tiny_vl

SRC = str(Path(ncgrpo.__file__).resolve().parents[1])
ENV = {
    **os.environ,
    "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "OMP_NUM_THREADS": "1",
}


@pytest.fixture(scope="module")
def tiny_vl_dir(tmp_path_factory) -> Path:
    return save_tiny_vl(tmp_path_factory.mktemp("tiny-vl"))


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    export_geo3k(build_suite(seed=0, sizes={"train": 2, "validation": 1, "test": 4}), out)
    return out


@pytest.fixture(scope="module")
def model_and_processor(tiny_vl_dir):
    from ncgrpo.models import load_model_and_processor

    return load_model_and_processor(tiny_vl_dir, device="cpu")


def _questions(suite_dir: Path, split: str = "test"):
    from ncgrpo.eval.questions import load_questions

    return load_questions(["synthetic"], {"synthetic": suite_dir}, split, None)


def _argv(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return [
        "eval", "--model_name_or_path", str(model), "--benchmarks", "synthetic", "--data", f"synthetic={data}",
        "--split", "test", "--output_dir", str(out), "--batch_size", "1", "--max_new_tokens", "16",
        "--no_progress", "--device", "cpu", *extra,
    ]  # fmt: skip


def _popen(argv: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ncgrpo", *argv], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )


def _complete_lines(path: Path) -> list[dict]:
    """The records on disk, byte-exact: every newline-terminated line (a torn tail is not one)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    return [json.loads(line) for line in data[: data.rfind(b"\n") + 1].splitlines() if line.strip()]


def _outcomes(rows: list[dict]) -> dict[tuple[str, str], tuple]:
    return {(r["benchmark"], r["question_id"]): (r["output"], r["extracted"], r["correct"]) for r in rows}


def _record(qid: str, correct: bool, output: str = "x") -> EvalRecord:
    return EvalRecord("b", qid, "ood", "h", output, "1", "1", correct, "m")


# --- torn bytes ----------------------------------------------------------------------------------
def test_tail_torn_inside_a_utf8_character_is_ignored_then_cut_and_recomputed(
    model_and_processor, suite_dir, tmp_path
) -> None:
    model, proc = model_and_processor
    qs = _questions(suite_dir)[:3]
    settings = DecodingSettings(max_new_tokens=4, batch_size=1)
    evaluate(model, proc, qs[:2], tmp_path, model_id="m", settings=settings, progress=False)
    path = tmp_path / RECORDS_FILE
    whole = path.read_bytes()
    line = (_record("q", True, output="σσσ").to_json() + "\n").encode()
    cut = line.index("σ".encode()) + 1  # a full disk stopped the write inside a 2-byte character
    path.write_bytes(whole + line[:cut])
    with pytest.raises(UnicodeDecodeError):
        path.read_text(encoding="utf-8")  # the fault is real: the file is not valid UTF-8
    assert len(read_records(path)) == 2  # reading tolerates it and does not touch the file
    assert path.read_bytes() == whole + line[:cut]
    s = evaluate(model, proc, qs, tmp_path, model_id="m", settings=settings, progress=False)
    assert s.newly_recorded == 1
    rows = _complete_lines(path)
    assert len(rows) == 3 and path.read_bytes().endswith(b"\n")
    assert sorted((r["benchmark"], r["question_id"]) for r in rows) == sorted(
        (q.benchmark, q.question_id) for q in qs
    )


def test_a_complete_record_missing_only_its_newline_is_recomputed_not_lost(
    model_and_processor, suite_dir, tmp_path
) -> None:
    # Before, the reader kept such a last line (valid JSON) and the writer then cut it: the
    # question was skipped as done and never recorded.
    model, proc = model_and_processor
    qs = _questions(suite_dir)[:2]
    settings = DecodingSettings(max_new_tokens=4, batch_size=1)
    evaluate(model, proc, qs, tmp_path, model_id="m", settings=settings, progress=False)
    path = tmp_path / RECORDS_FILE
    path.write_bytes(path.read_bytes()[:-1])  # the last record's newline never reached the disk
    evaluate(model, proc, qs, tmp_path, model_id="m", settings=settings, progress=False)
    keys = [(r["benchmark"], r["question_id"]) for r in _complete_lines(path)]
    assert sorted(keys) == sorted((q.benchmark, q.question_id) for q in qs)


def test_bad_bytes_inside_the_file_are_an_error_naming_the_line(tmp_path) -> None:
    path = tmp_path / RECORDS_FILE
    with RecordWriter(path) as w:
        w.write([_record("1", True), _record("2", False)])
    lines = path.read_bytes().splitlines(keepends=True)
    path.write_bytes(lines[0] + b'{"benchmark": "b\xce"}\n' + lines[1])
    with pytest.raises(ValueError, match=r"records.jsonl:2: not UTF-8"):
        read_records(path)


# --- duplicates ------------------------------------------------------------------------------------
def test_identical_duplicates_collapse_and_conflicting_ones_name_the_ids(tmp_path, capsys) -> None:
    path = tmp_path / RECORDS_FILE
    with RecordWriter(path) as w:
        w.write([_record("1", True), _record("2", False), _record("1", True)])
    assert [r.question_id for r in read_records(path)] == ["1", "2"]
    with RecordWriter(path) as w:
        w.write([_record("2", True)])  # question 2 again, now correct
    with pytest.raises(DuplicateRecordError, match=r"b/2 \(lines 2 and 4\)"):
        read_records(path)
    atomic_write_json(tmp_path / RUN_FILE, {"name": "x"})
    other = tmp_path.parent / (tmp_path.name + "-other")
    other.mkdir()
    with RecordWriter(other / RECORDS_FILE) as w:
        w.write([_record("1", True), _record("2", True)])
    atomic_write_json(other / RUN_FILE, {"name": "y"})
    assert cli.main(["compare", "--runs", str(tmp_path), str(other), "--baseline", "y"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo compare: error:") and str(path) in err and "b/2" in err


# --- identity ----------------------------------------------------------------------------------------
def test_run_identity_split_seed_and_decoding_refused_batch_size_allowed(
    model_and_processor, suite_dir, tmp_path
) -> None:
    model, proc = model_and_processor
    test_qs, val_qs = _questions(suite_dir, "test")[:2], _questions(suite_dir, "validation")[:2]
    # (Real benchmarks number questions per split, so the same (benchmark, id) can exist in two
    # splits: matching by those alone is how another split's records used to be reused silently.)

    def run(qs, split="test", seed=1, batch_size=2, max_new_tokens=4):
        s = DecodingSettings(max_new_tokens=max_new_tokens, batch_size=batch_size)
        return evaluate(
            model, proc, qs, tmp_path, model_id="m", seed=seed, split={"synthetic": split},
            benchmarks=["synthetic"], settings=s, progress=False,
        )  # fmt: skip

    run(test_qs[:1])
    before = (tmp_path / RECORDS_FILE).read_bytes()
    for kw, key in [
        ({"qs": val_qs, "split": "validation"}, "split"),
        ({"qs": test_qs, "seed": 2}, "seed"),
        ({"qs": test_qs, "max_new_tokens": 5}, "decoding"),
    ]:
        with pytest.raises(ValueError, match=f"; {key} is |: {key} is "):
            run(**kw)
        assert (tmp_path / RECORDS_FILE).read_bytes() == before  # nothing written
    assert run(test_qs, batch_size=1).newly_recorded == 1  # a smaller batch after an OOM: allowed
    info = json.loads((tmp_path / RUN_FILE).read_text())
    assert info["batch_size"] == 1 and info["name"] == "m"


def test_rerun_without_name_keeps_the_folders_name(model_and_processor, suite_dir, tmp_path) -> None:
    # Before, a rerun without --name renamed the run to its model id, regrouping it in tables.
    model, proc = model_and_processor
    qs = _questions(suite_dir)[:2]
    s = DecodingSettings(max_new_tokens=2, batch_size=1)
    evaluate(model, proc, qs[:1], tmp_path, model_id="m", name="vanilla", settings=s, progress=False)
    evaluate(model, proc, qs, tmp_path, model_id="m", settings=s, progress=False)
    assert json.loads((tmp_path / RUN_FILE).read_text())["name"] == "vanilla"


def test_cli_refuses_another_split_or_benchmark_set(tiny_vl_dir, suite_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    assert cli.main(_argv(tiny_vl_dir, suite_dir, out, "--limit", "2")) == 0
    n = len(_complete_lines(out / RECORDS_FILE))
    argv = _argv(tiny_vl_dir, suite_dir, out, "--limit", "2")
    argv[argv.index("--split") + 1] = "validation"
    capsys.readouterr()
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo eval: error:") and "split" in err and str(out / RUN_FILE) in err
    assert len(_complete_lines(out / RECORDS_FILE)) == n
    # a larger batch and more questions of the same split: allowed, and it completes the folder
    assert cli.main([*_argv(tiny_vl_dir, suite_dir, out, "--limit", "3"), "--batch-size", "3"]) == 0
    assert len(_complete_lines(out / RECORDS_FILE)) > n


# --- validation before writing ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (["--batch-size", "0"], "--batch_size must be >= 1"),
        (["--limit", "0"], "--limit must be >= 1"),
        (["--max_new_tokens", "-1"], "--max_new_tokens must be >= 1"),
        (["--benchmarks", ","], "empty benchmark name"),
        (["--benchmarks", "synthetic", "nope"], "unknown benchmark"),
        (["--data", "synthetic"], "NAME=PATH"),
        (["--data", "synthetic=/no/such/folder"], "does not exist"),
        (["--split", ""], "--split is empty"),
        (["--model_name_or_path", "/no/such/model"], "--model_name_or_path /no/such/model"),
        (["--bogus", "1"], "unknown option --bogus"),
    ],
)
def test_bad_arguments_exit_2_and_write_nothing(
    tiny_vl_dir, suite_dir, tmp_path, capsys, extra, match
) -> None:
    out = tmp_path / "run"
    argv = _argv(tiny_vl_dir, suite_dir, out)
    flag = extra[0]
    if flag in argv and flag != "--data":
        i = argv.index(flag)
        j = i + 1
        while j < len(argv) and not argv[j].startswith("--"):
            j += 1
        argv[i:j] = extra
    elif flag == "--data":
        argv[argv.index("--data") + 1] = extra[1]
    else:
        argv += extra
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo eval: error:") and match in err, err
    assert "Traceback" not in err
    assert not out.exists()
    if flag == "--batch-size":  # and the correct rerun is not refused afterwards
        assert cli.main(_argv(tiny_vl_dir, suite_dir, out, "--limit", "1")) == 0


def test_zero_row_data_file_names_the_file(tiny_vl_dir, tmp_path, capsys) -> None:
    import pyarrow.parquet as pq

    src = Path(__file__).parents[1] / "data" / "fixtures" / "geo3k" / "data" / "test-00000-of-00001.parquet"
    empty = tmp_path / "empty.parquet"
    pq.write_table(pq.read_table(src).slice(0, 0), empty)
    out = tmp_path / "run"
    argv = [
        "eval",
        "--model_name_or_path",
        str(tiny_vl_dir),
        "--benchmarks",
        "geo3k",
        "--data",
        f"geo3k={empty}",
    ]
    assert cli.main([*argv, "--output_dir", str(out), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo eval: error:") and str(empty) in err and not out.exists()


def test_compare_names_a_broken_run_json(tmp_path, capsys) -> None:
    with RecordWriter(tmp_path / RECORDS_FILE) as w:
        w.write([_record("1", True)])
    (tmp_path / RUN_FILE).write_text('{"name": "x",', encoding="utf-8")
    assert cli.main(["compare", "--runs", str(tmp_path), "--baseline", "x"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / RUN_FILE}:1: not valid JSON" in err


def test_compare_alignment_error_names_both_folders(tmp_path, capsys) -> None:
    dirs = []
    for name, ids in (("base", ["1", "2"]), ("meth", ["1"])):
        d = tmp_path / name
        with RecordWriter(d / RECORDS_FILE) as w:
            w.write([_record(i, True) for i in ids])
        atomic_write_json(d / RUN_FILE, {"name": name})
        dirs.append(str(d))
    assert cli.main(["compare", "--runs", *dirs, "--baseline", "base"]) == 2
    err = capsys.readouterr().err
    assert "missing from run a" in err and f"run a = {dirs[1]}" in err and f"run b = {dirs[0]}" in err


# --- umask -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_atomic_writes_follow_the_umask(tmp_path, mask) -> None:
    old = os.umask(mask)
    try:
        atomic_write_json(tmp_path / "a.json", {"x": 1})
        with open(tmp_path / "plain", "w") as f:
            f.write("x")
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "a.json").stat().st_mode)
    assert mode == 0o666 & ~mask == stat.S_IMODE((tmp_path / "plain").stat().st_mode)


# --- the lock: real concurrent processes -------------------------------------------------------------------
def test_second_eval_into_a_busy_folder_fails_naming_the_holder(tiny_vl_dir, suite_dir, tmp_path) -> None:
    out = tmp_path / "run"
    argv = _argv(tiny_vl_dir, suite_dir, out)
    first = _popen(argv)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None and not _complete_lines(out / RECORDS_FILE):
            time.sleep(0.05)
        assert first.poll() is None, "the first eval finished before it could be paused"
        first.send_signal(signal.SIGSTOP)  # holds the lock, mid-run
        second = subprocess.run(
            [sys.executable, "-m", "ncgrpo", *argv], env=ENV, capture_output=True, text=True, timeout=300
        )
        assert second.returncode == 2, second.stderr[-2000:]
        assert f"pid {first.pid}" in second.stderr and "being written by another process" in second.stderr
        assert second.stderr.startswith("ncgrpo eval: error:")
        first.send_signal(signal.SIGCONT)
        assert first.wait(timeout=300) == 0, first.stderr.read()[-2000:]
    finally:
        if first.poll() is None:
            first.kill()
    rows = _complete_lines(out / RECORDS_FILE)
    keys = [(r["benchmark"], r["question_id"]) for r in rows]
    assert len(keys) == len(set(keys)) == len(_questions(suite_dir))


def test_a_lock_held_by_a_killed_process_does_not_block(tmp_path) -> None:
    code = (
        "import sys, time; from ncgrpo.runs.folder import FolderLock; "
        f"FolderLock({str(tmp_path)!r}, 'holder').acquire(); print('locked', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(ValueError, match=f"pid {holder.pid} \\(holder\\)"):
            FolderLock(tmp_path).acquire()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    with FolderLock(tmp_path, "next"):  # the kernel dropped the dead holder's lock
        assert (tmp_path / LOCK_FILE).read_text().startswith(f"pid {os.getpid()} (next)")


# --- fault injection: SIGKILL at random points, then rerun -------------------------------------------------
def _kill_loop(
    tiny_vl_dir: Path, suite_dir: Path, tmp_path: Path, kills: int, seed: int, budget_s: float
) -> None:
    """Kill ``ncgrpo eval`` ``kills`` times at random points; after every killed run check that each
    question is recorded at most once with the uninterrupted run's outcome; finally rerun to the end
    and check every question is recorded exactly once with identical outcomes."""
    rng = random.Random(seed)
    ref_dir, out = tmp_path / "reference", tmp_path / "killed"
    t0 = time.time()
    assert cli.main(_argv(tiny_vl_dir, suite_dir, ref_dir)) == 0
    reference = _outcomes(_complete_lines(ref_dir / RECORDS_FILE))
    n = len(_questions(suite_dir))
    assert len(reference) == n
    records = out / RECORDS_FILE
    done_kills = 0
    where = {"start-up": 0, "answering": 0, "left a torn tail": 0}
    deadline = time.time() + budget_s
    while done_kills < kills:
        assert time.time() < deadline, f"only {done_kills} kills in {budget_s:.0f} s"
        before = len(_complete_lines(records))
        if before == n:  # the folder completed: start over so kills keep landing mid-run
            for f in out.iterdir():
                f.unlink()
            before = 0
        batch = rng.choice(["1", "2", "3"])  # batch size may differ between reruns
        p = _popen([*_argv(tiny_vl_dir, suite_dir, out), "--batch_size", batch])
        phase = "start-up" if rng.random() < 0.25 else "answering"
        if phase == "start-up":  # somewhere in imports, model load, lock, run.json
            time.sleep(rng.uniform(0.0, 6.0))
        else:  # while answering: after the first new record, a random moment later
            while p.poll() is None and len(_complete_lines(records)) <= before:
                time.sleep(0.01)
            time.sleep(rng.uniform(0.0, 0.8))
        if p.poll() is not None:
            assert p.returncode == 0, p.stderr.read()[-2000:]
            continue  # finished before the kill: not counted
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=60)
        done_kills += 1
        where[phase] += 1
        where["left a torn tail"] += bool(records.exists() and not records.read_bytes().endswith(b"\n"))
        if rng.random() < 0.3 and records.exists():  # and sometimes a disk-full torn write on top
            line = (_record("torn", True, output="ωωω").to_json() + "\n").encode()
            with open(records, "ab") as f:
                f.write(line[: line.index("ω".encode()) + 1])
        rows = _complete_lines(records)
        keys = [(r["benchmark"], r["question_id"]) for r in rows]
        assert len(keys) == len(set(keys)), f"kill {done_kills}: a question recorded twice"
        assert all(reference[k] == v for k, v in _outcomes(rows).items()), (
            f"kill {done_kills}: outcome differs"
        )
    assert cli.main(_argv(tiny_vl_dir, suite_dir, out)) == 0
    rows = _complete_lines(records)
    assert len(rows) == n and _outcomes(rows) == reference
    assert records.read_bytes().endswith(b"\n")
    print(f"{done_kills} kills {where}, {time.time() - t0:.0f} s")


def test_sigkill_at_random_points_then_rerun_fast(tiny_vl_dir, suite_dir, tmp_path) -> None:
    _kill_loop(tiny_vl_dir, suite_dir, tmp_path, kills=3, seed=0, budget_s=240)


@pytest.mark.slow
def test_sigkill_at_random_points_then_rerun_24_times(tiny_vl_dir, suite_dir, tmp_path) -> None:
    _kill_loop(tiny_vl_dir, suite_dir, tmp_path, kills=24, seed=1, budget_s=900)


def test_a_list_option_given_twice_is_refused_not_truncated(tiny_vl_dir, suite_dir, tmp_path, capsys) -> None:
    out = tmp_path / "run"
    argv = [*_argv(tiny_vl_dir, suite_dir, out), "--data", f"synthetic={suite_dir}"]
    assert cli.main(argv) == 2
    assert "--data is given twice" in capsys.readouterr().err and not out.exists()


def test_eval_refuses_cuda_without_a_gpu_before_writing(tmp_path, capsys, monkeypatch):
    """--device cuda where torch sees no GPU: exit 2 with the reason, nothing written (it used to fail
    inside the model load with an AssertionError)."""
    import torch

    from ncgrpo.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "ev"
    argv = ["eval", "--model_name_or_path", str(tmp_path), "--benchmarks", "geo3k", "--output_dir", str(out),
            "--device", "cuda"]  # fmt: skip
    assert main(argv) == 2
    assert "sees no CUDA device" in capsys.readouterr().err
    assert not out.exists()


# --- issue 26 (items 14, 16) and issue 25 (the engine in the identity) ----------------------------
def _text_model_dir(out: Path) -> Path:
    from tiny_models import build_tokenizer, save_tiny, tiny_text_model

    tok = build_tokenizer()
    return save_tiny(tiny_text_model("qwen2", tokenizer=tok), tok, out)


def _text_questions_file(path: Path, n: int = 3) -> Path:
    """``n`` image-free questions in HallusionBench's layout (its ``non_image`` split)."""
    rows = [
        {"question": f"Is {i} plus {i} equal to {2 * i}?", "gt_answer": "1", "category": "math",
         "subcategory": "add", "set_id": "0", "figure_id": "0", "question_id": str(i), "visual_input": "0"}
        for i in range(n)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_a_truncated_safetensors_file_is_a_usage_error_naming_it(tmp_path, capsys) -> None:
    """Issue 26 item 14: a checkpoint whose model.safetensors was cut short (an interrupted copy) used
    to end in 'internal error: SafetensorError'; now exit 2 naming the file, and nothing written."""
    model = _text_model_dir(tmp_path / "model")
    weights = model / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size // 2)
    data = _text_questions_file(tmp_path / "q.jsonl")
    out = tmp_path / "run"
    capsys.readouterr()  # the model's save progress
    argv = ["eval", "--model_name_or_path", str(model), "--benchmarks", "hallusionbench", "--data",
            f"hallusionbench={data}", "--split", "non_image", "--output_dir", str(out), "--no_progress",
            "--device", "cpu"]  # fmt: skip
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo eval: error:") and str(weights) in err and "truncated" in err, err
    assert "internal error" not in err and "Traceback" not in err
    assert not out.exists()


def test_image_questions_for_a_text_only_model_are_refused_before_anything_is_written(
    suite_dir, tmp_path, capsys
) -> None:
    """Issue 26 item 16: the refusal used to come after run.json and an empty records.jsonl were
    written (poisoning the folder for the rerun with the right model). Now: from the model's config,
    before the folder exists; an existing folder is left byte for byte as it was."""
    model = _text_model_dir(tmp_path / "model")
    out = tmp_path / "run"
    argv = _argv(model, suite_dir, out)
    capsys.readouterr()  # the model's save progress
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("ncgrpo eval: error:") and "text-only" in err and str(model) in err, err
    assert not out.exists()
    out.mkdir()  # an existing (empty) folder: still nothing written into it, not even the lock
    assert cli.main(argv) == 2
    assert list(out.iterdir()) == []
    # the library refuses the same way, before its folder exists
    from ncgrpo.models import load_model_and_processor

    m, tok = load_model_and_processor(model, device="cpu")
    lib_out = tmp_path / "lib"
    with pytest.raises(ValueError, match="text-only"):
        evaluate(
            m, tok, _questions(suite_dir), lib_out, model_id="m", settings=DecodingSettings(max_new_tokens=2)
        )
    assert not lib_out.exists()


def test_the_engine_is_part_of_the_identity_and_old_folders_read_as_transformers(tmp_path) -> None:
    from ncgrpo.eval.evaluate import check_folder, run_identity

    out = tmp_path / "run"
    out.mkdir()
    tf = run_identity(model_id="m", engine="transformers")
    atomic_write_json(out / RUN_FILE, tf)
    assert check_folder(out, run_identity(model_id="m")) is not None  # the default engine
    with pytest.raises(ValueError, match="engine is 'transformers' there, 'vllm' now"):
        check_folder(out, run_identity(model_id="m", engine="vllm"))
    # a folder written before run.json had `engine` holds transformers records
    atomic_write_json(out / RUN_FILE, {k: v for k, v in tf.items() if k != "engine"})
    assert check_folder(out, run_identity(model_id="m", engine="transformers")) is not None
    with pytest.raises(ValueError, match="engine is 'transformers' there, 'vllm' now"):
        check_folder(out, run_identity(model_id="m", engine="vllm"))
    with pytest.raises(ValueError, match="engine must be one of"):
        run_identity(model_id="m", engine="tgi")


def test_engine_option_is_checked_before_anything_is_written(
    tiny_vl_dir, suite_dir, tmp_path, capsys
) -> None:
    import importlib.util

    out = tmp_path / "run"
    assert cli.main(_argv(tiny_vl_dir, suite_dir, out, "--engine", "tgi")) == 2
    assert "--engine must be one of transformers, vllm" in capsys.readouterr().err and not out.exists()
    if importlib.util.find_spec("vllm") is None:  # this environment (.venv) has no vLLM
        assert cli.main(_argv(tiny_vl_dir, suite_dir, out, "--engine", "vllm")) == 2
        err = capsys.readouterr().err
        assert "vLLM is not installed" in err and "setup_vllm.sh" in err and not out.exists()


def test_a_rerun_reads_run_json_once_per_check(model_and_processor, suite_dir, tmp_path, monkeypatch) -> None:
    # Before, check_folder read run.json twice (the kind check, then the identity check), and evaluate
    # checked twice (before the lock, refusing with nothing written; under it): 4 reads for one rerun.
    from ncgrpo.eval.evaluate import check_folder, run_identity

    model, proc = model_and_processor
    qs = _questions(suite_dir)[:2]
    s = DecodingSettings(max_new_tokens=2, batch_size=1)
    evaluate(model, proc, qs[:1], tmp_path, model_id="m", settings=s, progress=False)
    reads: list[Path] = []
    read_text = Path.read_text

    def counting(self: Path, *a, **k):
        if self.name == RUN_FILE:
            reads.append(self)
        return read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counting)
    assert check_folder(tmp_path, run_identity(model_id="m", settings=s))["model"] == "m"
    assert len(reads) == 1
    reads.clear()
    assert evaluate(model, proc, qs, tmp_path, model_id="m", settings=s, progress=False).newly_recorded == 1
    assert len(reads) == 2  # before the lock (nothing written on refusal), then under it
