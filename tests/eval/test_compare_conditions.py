"""``ncgrpo compare`` puts runs in one table only when they were evaluated alike (issue 35): the same
decoding settings, grader and engine, and the same benchmark data; a difference is an error naming it,
or, allowed with ``--allow_different``, a line above the tables."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncgrpo import cli
from ncgrpo.eval.evaluate import DecodingSettings
from ncgrpo.eval.records import EvalRecord, RecordWriter
from ncgrpo.eval.report import compare, load_runs, to_latex, to_markdown
from ncgrpo.eval.stats import AlignmentError
from ncgrpo.runs.folder import RECORDS_FILE, RUN_FILE, atomic_write_json


def _run(root: Path, name: str, *, outcomes=(True, False, True, False), benchmark="mathvista",
         prompt="p", **settings) -> Path:  # fmt: skip
    """An eval folder as ``ncgrpo eval`` writes it: run.json and records carrying the decoding."""
    s = DecodingSettings(**settings)
    decoding = {**s.to_dict(), "engine": "transformers"}
    d = root / name
    atomic_write_json(
        d / RUN_FILE,
        {"kind": "eval", "name": name, "seed": 0, "model": f"{name}@0", "engine": "transformers",
         "decoding": s.identity(), "model_id_rule": "weights-sha256"},
    )  # fmt: skip
    with RecordWriter(d / RECORDS_FILE) as w:
        w.write(
            EvalRecord(benchmark, f"q{i}", "ood", f"{prompt}{i}", "", None, f"g{i}", ok, f"{name}@0",
                       seed=0, decoding=decoding)
            for i, ok in enumerate(outcomes)
        )  # fmt: skip
    return d


def _compare(*args: str) -> list[str]:
    return ["compare", "--runs", *args[:-1], "--baseline", args[-1]]


def test_other_answer_budgets_are_refused_or_shown(tmp_path, capsys) -> None:
    a = _run(tmp_path, "Vanilla", max_new_tokens=8)
    b = _run(tmp_path, "NC", max_new_tokens=64)
    with pytest.raises(ValueError, match=r"max_new_tokens is 8 in .*Vanilla; 64 in .*NC"):
        compare(load_runs([a, b]), "Vanilla")
    capsys.readouterr()
    assert cli.main(_compare(str(a), str(b), "Vanilla")) == 2
    err = capsys.readouterr().err
    assert (
        "ncgrpo compare: error:" in err
        and "max_new_tokens is 8" in err
        and "--allow_different max_new_tokens" in err
    )
    out = tmp_path / "report"
    argv = _compare(str(a), str(b), "Vanilla") + [
        "--allow_different",
        "max_new_tokens",
        "--output_dir",
        str(out),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "different conditions" in printed and "max_new_tokens" in printed
    md = (out / "comparison.md").read_text()
    assert md.startswith("**Runs evaluated under different conditions (allowed): max_new_tokens is 8 in ")
    assert "max\\_new\\_tokens is 8" in (out / "comparison.tex").read_text()
    assert json.loads((out / "comparison.json").read_text())["differences"][0].startswith(
        "max_new_tokens is 8"
    )
    ct = compare(load_runs([a, b]), "Vanilla", allow_different=["max_new_tokens"])
    assert ct.differences and ct.header in to_markdown(ct) and "max\\_new\\_tokens" in to_latex(ct)


def test_other_graders_are_refused(tmp_path, capsys) -> None:
    a = _run(tmp_path, "Vanilla", grader="ncgrpo")
    b = _run(tmp_path, "NC", grader="mathruler")
    assert cli.main(_compare(str(a), str(b), "Vanilla")) == 2
    err = capsys.readouterr().err
    assert "grader is 'ncgrpo' in " in err and "'mathruler' in " in err
    # alike runs compare with no header line
    c = _run(tmp_path, "NC2", grader="ncgrpo")
    ct = compare(load_runs([a, c]), "Vanilla")
    assert ct.differences == [] and ct.header is None and not to_markdown(ct).startswith("**")


def test_prompts_cannot_be_allowed_to_differ(tmp_path, capsys) -> None:
    a = _run(tmp_path, "Vanilla")
    b = _run(tmp_path, "NC", math_prompt="Answer briefly.")
    assert cli.main(_compare(str(a), str(b), "Vanilla") + ["--allow_different", "math_prompt"]) == 2
    assert "--allow_different math_prompt: not a setting runs may differ in" in capsys.readouterr().err
    assert cli.main(_compare(str(a), str(b), "Vanilla")) == 2
    err = capsys.readouterr().err
    assert "math_prompt is " in err and "--allow_different" not in err  # nothing to allow here


def test_a_folder_whose_records_mix_settings_is_named(tmp_path) -> None:
    a = _run(tmp_path, "Vanilla", max_new_tokens=8)
    b = _run(tmp_path, "NC", max_new_tokens=8)
    rows = [json.loads(line) for line in (b / RECORDS_FILE).read_text().splitlines()]
    rows[-1]["decoding"]["max_new_tokens"] = 64  # appended by another evaluation
    (b / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(
        ValueError, match=r"NC: its records were decoded under two max_new_tokens values, 8 .* and 64"
    ):
        compare(load_runs([a, b]), "Vanilla")


def test_unpaired_runs_on_other_data_are_refused(tmp_path) -> None:
    """The baseline has no records of chartqa, so no test pairs the two chartqa columns; they still
    must be the same questions to share a column."""
    base = _run(tmp_path, "Vanilla")
    one = _run(tmp_path / "x", "NC", benchmark="chartqa")
    two = _run(tmp_path / "y", "SPSA", benchmark="chartqa", prompt="other")
    for d in (one, two):  # each also answered the baseline's questions
        with RecordWriter(d / RECORDS_FILE) as w:
            w.write(r for r in load_runs([base])[0].records)
    with pytest.raises(
        AlignmentError, match=r"question chartqa/q0 is not the same question .*prompt_hash other0 vs p0"
    ):
        compare(load_runs([base, one, two]), "Vanilla")


def test_plot_gains_checks_the_runs_alike(tmp_path, capsys) -> None:
    a = _run(tmp_path, "Vanilla", max_new_tokens=8)
    b = _run(tmp_path, "NC", max_new_tokens=64)
    out = tmp_path / "figures"
    argv = ["plot", "gains", "--runs", str(a), str(b), "--baseline", "Vanilla", "--output_dir", str(out)]
    assert cli.main(argv) == 2
    assert "max_new_tokens is 8" in capsys.readouterr().err
    assert not out.exists()  # refused before anything is written
    assert cli.main([*argv, "--allow_different", "max_new_tokens"]) == 0
    assert (out / "gains.png").is_file()
