"""ncgrpo.toy.seed_table: the README's several-seed table, from hand-made demo folders."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import binomtest, ttest_1samp, ttest_rel

from ncgrpo.eval.records import EvalRecord
from ncgrpo.eval.stats import REFERENCE_SEED_SD_PP, min_detectable_diff, seeds_needed
from ncgrpo.toy.seed_table import EXPORT_FORMAT, OOD_FAMILIES, POPE, export, load_runs, main, seed_table

GEO = "synthetic/geometry"


def _write(folder: Path, run: str, name: str, geo: list[bool], other: bool = True, outputs=None) -> None:
    d = folder / "eval" / run
    d.mkdir(parents=True)
    (d / "run.json").write_text(json.dumps({"name": name}))
    rows = []
    for i, ok in enumerate(geo):
        out = (outputs or {}).get(i, "<think>the shape has 3 sides.</think> \\boxed{3}")
        rows.append(EvalRecord(GEO, f"q{i}", "in_domain", "h", out, "3", "3", ok, "m"))
    for fam in (*OOD_FAMILIES, POPE):
        rows.append(EvalRecord(fam, "q0", "ood", "h", "x", "1", "1", other, "m"))
    (d / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in rows))


def _folders(tmp_path: Path) -> tuple[Path, Path]:
    base = [True] + [False] * 9  # 10 in-domain questions
    shortcut = {i: "<think>answer: 4.</think> \\boxed{4}" for i in range(5)}
    one, two = tmp_path / "T1", tmp_path / "T2"
    for folder in (one, two):
        _write(folder, "base", "Base model", base, outputs=shortcut)
        _write(folder, "grpo-seed0", "Vanilla GRPO (seed 0)", [True] * 6 + [False] * 4)
        _write(folder, "grpo-seed1", "Vanilla GRPO (seed 1)", [True] * 4 + [False] * 6, other=False)
    # method: seed 0 wins 2 / loses 1 against vanilla, seed 1 wins 3 / loses 0
    _write(
        two,
        "ncgrpo-sigma0.2-seed0",
        "NC-GRPO σ0=0.2 (seed 0)",
        [True] * 5 + [False, True, True] + [False] * 2,
    )
    _write(two, "ncgrpo-sigma0.2-seed1", "NC-GRPO σ0=0.2 (seed 1)", [True] * 7 + [False] * 3)
    return one, two


def test_table_numbers_match_the_records(tmp_path) -> None:
    one, two = _folders(tmp_path)
    lines = seed_table([one, two]).splitlines()
    assert lines[0] == (
        "| Method | in-domain % (seed 0/1) | p vs base (seed 0/1) | OOD avg % | POPE % | "
        "question-level pooled p vs vanilla (wins/losses) | seed-level p vs vanilla (mean diff, pts) | "
        "MDD at 80% power (pts) | seeds needed for the mean diff | differ from vanilla % (seed 0/1) | shortcut % |"
    )
    assert lines[1] == "|---|---|---|---:|---:|---:|---:|---:|---:|---|---:|"
    assert lines[2] == "| Base model | 10.0 | | 100.0 | 100.0 | | | | | | 50 |"
    p_v0 = binomtest(5, 5, 0.5).pvalue  # vanilla seed 0: 5 wins, 0 losses against the base
    p_v1 = binomtest(3, 3, 0.5).pvalue
    assert (
        lines[3]
        == f"| Vanilla GRPO | 60.0/40.0 | {p_v0:.2g}/{p_v1:.2g} | 50.0 | 50.0 | — | — | — | — | — | 0 |"
    )
    # vanilla seed 0 vs seed 1: they differ on q4 and q5 (seed 0 right both times)
    assert lines[4] == (
        f"| Vanilla seed-to-seed (seeds 0-1) | | | | | {binomtest(2, 2, 0.5).pvalue:.2g} (2/0) | | | | 20.0 | |"
    )
    p_m0, p_m1 = binomtest(6, 6, 0.5).pvalue, binomtest(6, 6, 0.5).pvalue
    pooled = binomtest(5, 6, 0.5).pvalue  # 2 + 3 wins, 1 + 0 losses
    # seed-level: the method is +10 and +30 points over vanilla in seeds 0 and 1
    seed_p = ttest_rel([70.0, 70.0], [60.0, 40.0]).pvalue
    # and its power: the sd of +10/+30 is 14.1 pts; over 2 seeds the MDD is 11.55 sd (163.3 pts), and
    # +20 pts (1.41 sd) needs 7 seeds (the noncentral t power: 0.79 at 6 seeds, 0.87 at 7)
    sd = float(np.std([10.0, 30.0], ddof=1))
    assert min_detectable_diff(sd, 2) == pytest.approx(163.3, abs=0.05) and seeds_needed(20.0, sd) == 7
    assert lines[5] == (
        f"| NC-GRPO σ0=0.2 | 70.0/70.0 | {p_m0:.2g}/{p_m1:.2g} | 100.0 | 100.0 | {pooled:.2g} (5/1) | "
        f"{seed_p:.2g} (+20.0) | 163.3 | 7 | 30.0/30.0 | 0 |"
    )
    assert len(lines) == 8  # both tests non-significant: no note; then what made the records
    assert lines[6] == "" and lines[7].startswith("Made by: unknown")


def _three_seeds(tmp_path: Path, method: dict[str, list[tuple[int, int]]]) -> Path:
    """One folder, 20 in-domain questions, vanilla right on the first 10 in each seed; each method's
    seed s wins/loses the given (wins, losses) questions against vanilla."""
    folder = tmp_path / "S"
    vanilla = [True] * 10 + [False] * 10
    _write(folder, "base", "Base model", [False] * 20)
    for s in range(3):
        _write(folder, f"grpo-seed{s}", "Vanilla GRPO", vanilla)
    for slug, counts in method.items():
        for s, (wins, losses) in enumerate(counts):
            geo = [False] * losses + [True] * (10 - losses) + [True] * wins + [False] * (10 - wins)
            _write(folder, f"{slug}-seed{s}", f"{slug} (seed {s})", geo)
    return folder


def test_notes_where_question_level_and_seed_level_disagree(tmp_path) -> None:
    folder = _three_seeds(
        tmp_path,
        {
            "spsa-sigma0.2": [(3, 1), (2, 0), (4, 1)],  # +10/+10/+15 pts: seed-level only
            "image": [(10, 0), (0, 0), (0, 1)],  # +50/0/-5 pts: question-level only
            "antithetic-sigma0.2": [(1, 1), (0, 0), (2, 2)],  # 0 in every seed: neither
        },
    )
    text = seed_table([folder])
    table, notes, made = text.split("\n\n")
    assert made.startswith("Made by: unknown")  # hand-made run.json: no provenance
    rows = {line.split(" | ")[0][2:]: line for line in table.splitlines()[2:]}
    assert list(rows) == ["Base model", "Vanilla GRPO", "Vanilla seed-to-seed (seeds 0-1/1-2)", "image",
                          "antithetic-sigma0.2", "spsa-sigma0.2"]  # fmt: skip
    # vanilla's seeds answer alike here: the reference says 0% differ, p = 1
    assert rows["Vanilla seed-to-seed (seeds 0-1/1-2)"] == (
        "| Vanilla seed-to-seed (seeds 0-1/1-2) | | | | | 1 (0/0) | | | | 0.0/0.0 | |"
    )
    spsa_p = ttest_1samp([10.0, 10.0, 15.0], 0.0).pvalue
    spsa_pooled = binomtest(9, 11, 0.5).pvalue
    assert spsa_p < 0.05 < spsa_pooled
    sd = float(np.std([10.0, 10.0, 15.0], ddof=1))
    power = f"{min_detectable_diff(sd, 3):.1f} | {seeds_needed(35 / 3, sd)}"
    assert (
        f"| {spsa_pooled:.2g} (9/2) | {spsa_p:.2g} (+11.7) | {power} | 20.0/10.0/25.0 |"
        in rows["spsa-sigma0.2"]
    )
    image_p = ttest_1samp([50.0, 0.0, -5.0], 0.0).pvalue
    image_pooled = binomtest(10, 11, 0.5).pvalue
    assert image_pooled < 0.05 < image_p
    sd = float(np.std([50.0, 0.0, -5.0], ddof=1))
    power = f"{min_detectable_diff(sd, 3):.1f} | {seeds_needed(15.0, sd)}"
    assert f"| {image_pooled:.2g} (10/1) | {image_p:.2g} (+15.0) | {power} |" in rows["image"]
    # no spread between the seeds: nothing to size the MDD or the seeds with
    assert "| 1 (3/3) | 1 (+0.0) | n/a | n/a | 10.0/0.0/20.0 |" in rows["antithetic-sigma0.2"]
    assert notes.splitlines() == [
        f"- image: question-level pooled McNemar p = {image_pooled:.2g} is below 0.05 but seed-level "
        f"p = {image_p:.2g} (3 seeds) is not: these models differ on the questions, but not detectably "
        "more than retraining with another seed changes them",
        f"- spsa-sigma0.2: seed-level p = {spsa_p:.2g} (3 seeds) is below 0.05 but question-level pooled "
        f"McNemar p = {spsa_pooled:.2g} is not: the seeds agree on the difference, but it is small against "
        "the per-question noise",
    ]


def test_seed_level_cell_when_the_t_test_is_undefined(tmp_path) -> None:
    folder = _three_seeds(tmp_path, {"spsa-sigma0.2": [(2, 0), (2, 0), (2, 0)]})  # +10 pts every seed
    row = seed_table([folder]).split("\n\n")[0].splitlines()[-1]
    assert f"| {binomtest(6, 6, 0.5).pvalue:.2g} (6/0) | n/a (+10.0) | n/a | n/a |" in row


def test_one_seed_rows_say_no_seed_level_claim_can_be_made(tmp_path) -> None:
    folder = tmp_path / "S"
    _write(folder, "base", "Base model", [False] * 20)
    _write(folder, "grpo-seed0", "Vanilla GRPO", [True] * 10 + [False] * 10)
    _write(folder, "spsa-sigma0.2-seed0", "SPSA (seed 0)", [True] * 11 + [False] * 9)  # +5 pts
    table, notes, _ = seed_table([folder]).split("\n\n")
    assert table.splitlines()[-1].endswith(
        f"| {binomtest(1, 1, 0.5).pvalue:.2g} (1/0) | n/a (+5.0) | n/a | n/a | 5.0 | 0 |"
    )
    need = seeds_needed(5.0, REFERENCE_SEED_SD_PP)
    assert need == 5  # +5 pts at the reference sd of 2.5 pts: 2 sd, power 0.75 at 4 seeds, 0.91 at 5
    assert notes.splitlines() == [
        "- SPSA: one seed per arm: no seed-level claim can be made (no seed-to-seed spread to test against); "
        "if its per-seed difference varied across seeds as on ncgrpo's embedded base (sd 2.50 pts, the README's "
        f"seed table), the observed difference of +5.0 pts would need {need} seeds per arm for 80% power at alpha 0.05"
    ]


def test_folders_must_agree_and_pair(tmp_path) -> None:
    one, two = _folders(tmp_path)
    base, runs = load_runs([one, two])
    assert list(runs) == ["grpo", "ncgrpo-sigma0.2"] and sorted(runs["grpo"].seeds) == [0, 1]
    # a folder evaluated against another base model's records is refused
    other = tmp_path / "T3"
    _write(other, "base", "Base model", [False] * 10)
    with pytest.raises(ValueError, match="T3: its base-model records differ"):
        load_runs([one, other])
    # a method seed with no vanilla partner
    lone = tmp_path / "T4"
    _write(
        lone, "base", "Base model", [True] + [False] * 9, outputs={i: "<think>answer: 4." for i in range(5)}
    )
    _write(lone, "grpo-seed0", "Vanilla GRPO", [True] * 10)
    _write(lone, "spsa-seed5", "SPSA", [True] * 10)
    with pytest.raises(ValueError, match="SPSA: seed 5 has no vanilla GRPO run"):
        seed_table([lone])
    # a run evaluated on other test questions (same ids, other gold answers)
    other_split = tmp_path / "T6"
    _write(other_split, "base", "Base model", [True] + [False] * 9)
    _write(other_split, "grpo-seed0", "Vanilla GRPO", [True] * 10)
    records = other_split / "eval" / "grpo-seed0" / "records.jsonl"
    records.write_text(records.read_text().replace('"gold": "3"', '"gold": "4"', 1))
    with pytest.raises(ValueError, match=r"Vanilla GRPO seed 0: question synthetic/geometry/q0 has gold '4'"):
        load_runs([other_split])
    # rows in the paper's order whatever the folders' order, the propagating site's last
    three = tmp_path / "T5"
    for slug, name in [("first-token-t1.2", "First-token"), ("ncgrpo-sigma0.2-L1", "NC @L1"), ("image", "Image"),
                       ("first-token-marginal", "First-token marginal"),
                       ("spsa-sigma0.2", "SPSA"), ("ncgrpo-sigma0.5", "NC 0.5")]:  # fmt: skip
        _write(three, f"{slug}-seed0", name, [True] * 10)
    _, runs = load_runs([one, three, two])
    assert [r.name for r in runs.values()] == [
        "Vanilla GRPO", "NC-GRPO σ0=0.2", "NC 0.5", "Image", "SPSA", "First-token", "First-token marginal",
        "NC @L1"]  # fmt: skip
    with pytest.raises(ValueError, match="no eval/ folder"):
        load_runs([tmp_path / "missing"])


def test_command_line(tmp_path, capsys) -> None:
    one, two = _folders(tmp_path)
    assert main([str(one), str(two)]) == 0
    assert "| NC-GRPO σ0=0.2 |" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "ncgrpo.toy.seed_table: error: " in capsys.readouterr().err
    assert main([]) == 2


# --- the committed form of the records -------------------------------------------------------


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]


def test_export_prints_the_same_table(tmp_path) -> None:
    one, two = _folders(tmp_path)
    dest = tmp_path / "records"
    written, removed = export([one, two], dest)
    assert sorted(p.name for p in written) == sorted(p.name for p in dest.iterdir()) == [
        "base.jsonl.gz", "grpo-seed0.jsonl.gz", "grpo-seed1.jsonl.gz", "manifest.json",
        "ncgrpo-sigma0.2-seed0.jsonl.gz", "ncgrpo-sigma0.2-seed1.jsonl.gz"]  # fmt: skip
    assert removed == []
    assert seed_table([dest]) == seed_table([one, two])
    # an export beside a demo folder is one more folder: the same base records, the same table
    part = tmp_path / "part"
    export([one], part)
    assert seed_table([part, two]) == seed_table([one, two])
    # each file: a header with the run's display name and the decoding it was evaluated with (and its
    # model id where the run.json has one), then the table's fields, sorted
    rows = _lines(dest / "ncgrpo-sigma0.2-seed1.jsonl.gz")
    assert rows[0].pop("decoding")["grader"] == "ncgrpo"
    assert rows[0] == {
        "format": EXPORT_FORMAT,
        "name": "NC-GRPO σ0=0.2",
        "seed": 1,
        "slug": "ncgrpo-sigma0.2",
    }
    assert set(rows[1]) == {"benchmark", "question_id", "role", "gold", "correct", "shortcut"}
    keys = [(r["benchmark"], r["question_id"]) for r in rows[1:]]
    assert keys == sorted(keys) and len(keys) == 10 + len(OOD_FAMILIES) + 1
    assert sum(r["shortcut"] for r in _lines(dest / "base.jsonl.gz")[1:]) == 5


def test_export_bytes_are_deterministic_and_stale_runs_go(tmp_path) -> None:
    one, two = _folders(tmp_path)
    a, b = tmp_path / "a", tmp_path / "b"
    export([one, two], a)
    export([one, two], b)
    for f in a.iterdir():
        assert f.read_bytes() == (b / f.name).read_bytes(), f.name  # manifest.json too: no time stamp
        if f.name != "manifest.json":
            assert f.read_bytes()[3:8] == bytes(5)  # gzip header: no flags (no file name), mtime 0
    # a run no longer given is removed from DEST; files that are not exports are left alone
    (b / "spsa-sigma0.2-seed3.jsonl.gz").write_bytes((b / "grpo-seed0.jsonl.gz").read_bytes())
    (b / "NOTES.md").write_text("keep me")
    _, removed = export([one], b)
    assert sorted(p.name for p in removed) == [
        "ncgrpo-sigma0.2-seed0.jsonl.gz", "ncgrpo-sigma0.2-seed1.jsonl.gz", "spsa-sigma0.2-seed3.jsonl.gz"]  # fmt: skip
    assert (b / "NOTES.md").read_text() == "keep me"
    assert seed_table([b]) == seed_table([one])
    assert not list(b.glob(".*.tmp"))  # no temporary file left behind


def test_export_read_errors_name_the_file(tmp_path) -> None:
    one, two = _folders(tmp_path)
    dest = tmp_path / "records"
    export([one, two], dest)
    good = (dest / "grpo-seed1.jsonl.gz").read_bytes()
    (dest / "grpo-seed1.jsonl.gz").write_bytes(b"not gzip")
    with pytest.raises(ValueError, match=r"grpo-seed1.jsonl.gz: not a gzip file"):
        seed_table([dest])
    (dest / "grpo-seed1.jsonl.gz").write_bytes(good)
    (dest / "grpo-seed1.jsonl.gz").rename(dest / "grpo-seed4.jsonl.gz")  # header and name disagree
    with pytest.raises(ValueError, match=r"grpo-seed4.jsonl.gz:1: header says run 'grpo' seed 1"):
        seed_table([dest])
    (dest / "grpo-seed4.jsonl.gz").unlink()
    rows = _lines(dest / "grpo-seed0.jsonl.gz")
    del rows[3]["correct"]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (dest / "grpo-seed0.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    with pytest.raises(ValueError, match=r"grpo-seed0.jsonl.gz:4: missing field\(s\) \['correct'\]"):
        seed_table([dest])
    (dest / "grpo-seed0.jsonl.gz").write_bytes(gzip.compress(b'{"benchmark": "x"}\n'))
    with pytest.raises(ValueError, match=r"grpo-seed0.jsonl.gz:1: not a seed-table export"):
        seed_table([dest])


def test_export_command_line(tmp_path, capsys) -> None:
    one, two = _folders(tmp_path)
    dest = tmp_path / "records"
    assert main(["--export", str(dest), str(one), str(two)]) == 0
    out, err = capsys.readouterr()
    assert out == seed_table([one, two]) and f"wrote 6 files to {dest}" in err
    assert main([str(dest)]) == 0 and capsys.readouterr().out == out
    assert main(["--export", str(dest)]) == 2
    assert "--export needs DEST and at least one FOLDER" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["--export", str(tmp_path / "file"), str(one)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err


def _set(run_dir: Path, **info) -> None:
    """Add run.json fields (as ncgrpo eval writes them) to a hand-made run folder."""
    path = run_dir / "run.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **info}))


def test_shared_vanilla_runs_must_be_the_same_runs(tmp_path) -> None:
    """Issue 35: two demo folders whose vanilla runs differ (e.g. other --max_steps) were paired: the
    first folder's vanilla counted, the second's methods were tested against it."""
    one, two = _folders(tmp_path)
    # the same records, other trained weights (model ids hash the weights' contents)
    _set(one / "eval" / "grpo-seed0", model="grpo-seed0@aaaaaaaaaaaa")
    _set(two / "eval" / "grpo-seed0", model="grpo-seed0@bbbbbbbbbbbb")
    with pytest.raises(ValueError, match=r"T2: its Vanilla GRPO seed 0 \(grpo-seed0\) differs from the first folder's "
                       r"\(.*T1\): model is 'grpo-seed0@aaaaaaaaaaaa' there, 'grpo-seed0@bbbbbbbbbbbb' here"):  # fmt: skip
        seed_table([one, two])
    _set(two / "eval" / "grpo-seed0", model="grpo-seed0@aaaaaaaaaaaa")
    assert seed_table([one, two])
    # folders (or exports) without model ids: compared on their records
    d = two / "eval" / "grpo-seed1"
    rows = [json.loads(line) for line in (d / "records.jsonl").read_text().splitlines()]
    rows[0]["correct"] = not rows[0]["correct"]
    (d / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"grpo-seed1\) differs .*their records differ \(2 question outcome"):
        seed_table([one, two])
    dest = tmp_path / "export"
    export([one], dest)
    with pytest.raises(ValueError, match=r"their records differ"):
        seed_table([dest, two])


def test_runs_decoded_otherwise_are_refused(tmp_path) -> None:
    one, two = _folders(tmp_path)
    for folder in (one, two):
        for d in (folder / "eval").iterdir():
            _set(d, decoding={"max_new_tokens": 8, "grader": "ncgrpo"})
    assert seed_table([one, two])
    _set(two / "eval" / "ncgrpo-sigma0.2-seed1", decoding={"max_new_tokens": 64, "grader": "ncgrpo"})
    with pytest.raises(ValueError, match=r"not evaluated under the same decoding settings: max_new_tokens is 8 .*, 64 "
                       r"for ncgrpo-sigma0.2 seed 1"):  # fmt: skip
        seed_table([one, two])
    # an export keeps the decoding: the check holds on the committed form too
    dest = tmp_path / "export"
    export([one], dest)
    with pytest.raises(ValueError, match="max_new_tokens is 8"):
        seed_table([dest, two])


# --- what made the records (issue 42) -----------------------------------------------------------


def _stamp(folder: Path, run: str, kind: str, prov: dict, history: list | None = None) -> None:
    d = folder / kind / run
    d.mkdir(parents=True, exist_ok=True)
    path = d / "run.json"
    info = json.loads(path.read_text()) if path.is_file() else {}
    info["provenance"] = prov
    if history:
        info["provenance_history"] = history
    path.write_text(json.dumps(info))


def _prov(commit: str, torch: str = "2.9.0", dirty: bool = False) -> dict:
    p = {"commit": commit, "dirty": dirty, "versions": {"python": "3.11.7", "torch": torch, "trl": "1.16.0"}}
    return {**p, "dirty_digest": "abcdef123456"} if dirty else p


def test_export_writes_a_manifest_and_the_table_names_the_commit_that_made_the_runs(tmp_path, capsys) -> None:
    from ncgrpo.runs.provenance import provenance

    one, two = _folders(tmp_path)
    for folder in (one, two):
        for run in [p.name for p in (folder / "eval").iterdir()]:
            _stamp(folder, run, "eval", _prov("a" * 40))
            if run != "base":
                _stamp(folder, run, "train", _prov("a" * 40))
    # one run resumed under another commit and torch, with uncommitted changes
    resumed = {
        "event": "resume",
        "provenance": _prov("b" * 40, torch="2.10.0", dirty=True),
        "changes": ["..."],
    }
    _stamp(two, "ncgrpo-sigma0.2-seed1", "train", _prov("a" * 40), [resumed])
    live = seed_table([one, two])
    made = live.split("\n\n")[-1]
    assert made == (
        "Made by: ncgrpo commits aaaaaaaaaaaa, bbbbbbbbbbbb with uncommitted changes (abcdef123456); "
        "python 3.11.7, torch 2.9.0/2.10.0, TRL 1.16.0.\n"
    )
    dest = tmp_path / "records"
    assert main(["--export", str(dest), str(one), str(two)]) == 0
    assert capsys.readouterr().out == live  # the export's table says the same
    assert seed_table([dest]) == live
    manifest = json.loads((dest / "manifest.json").read_text())
    now = provenance()
    assert manifest["command"] == f"python -m ncgrpo.toy.seed_table --export {dest} {one} {two}"
    assert manifest["folders"] == [str(one), str(two)]
    assert manifest["commit"] == now["commit"] and manifest["dirty"] == now["dirty"]
    assert manifest["versions"] == now["versions"]  # what exported them
    assert manifest["runs"]["base"] == {"eval": {"provenance": _prov("a" * 40)}}
    assert manifest["runs"]["ncgrpo-sigma0.2-seed1"]["train"]["provenance_history"] == [resumed]
    assert set(manifest["runs"]) == {"base", "grpo-seed0", "grpo-seed1", "ncgrpo-sigma0.2-seed0",
                                     "ncgrpo-sigma0.2-seed1"}  # fmt: skip
    # an export of the export keeps the runs' provenance
    again = tmp_path / "again"
    export([dest], again)
    assert json.loads((again / "manifest.json").read_text())["runs"] == manifest["runs"]
    assert seed_table([again]) == live


def test_records_without_provenance_or_manifest_say_the_commit_is_unknown(tmp_path) -> None:
    one, two = _folders(tmp_path)
    _stamp(two, "ncgrpo-sigma0.2-seed0", "eval", _prov("a" * 40))
    made = seed_table([one, two]).split("\n\n")[-1]
    assert (
        made
        == "Made by: ncgrpo commit aaaaaaaaaaaa; python 3.11.7, torch 2.9.0, TRL 1.16.0; unknown in part for 4 of 5 "
        "runs (a training or evaluation run.json without provenance).\n"
    )
    # evaluated under a known commit, but trained before provenance was recorded: unknown in part
    (two / "train" / "ncgrpo-sigma0.2-seed0").mkdir(parents=True)
    (two / "train" / "ncgrpo-sigma0.2-seed0" / "run.json").write_text('{"kind": "train", "finished": true}')
    assert "unknown in part for 5 of 5 runs" in seed_table([one, two])
    (two / "train" / "ncgrpo-sigma0.2-seed0" / "run.json").unlink()
    (two / "train" / "ncgrpo-sigma0.2-seed0").rmdir()
    (two / "train").rmdir()
    dest = tmp_path / "records"
    export([one, two], dest)
    (dest / "manifest.json").unlink()  # as the records exported before manifests
    made = seed_table([dest]).split("\n\n")[-1]
    assert made.startswith("Made by: unknown (no commit or package versions recorded")
    (dest / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"manifest.json: not a JSON manifest"):
        seed_table([dest])


def test_rows_follow_the_method_registry_so_a_new_method_needs_no_edit_here(tmp_path) -> None:
    """The row order comes from the registered methods (registration order, each run under the longest
    method stem that names it), not from a list of names typed in the table: a method registered from
    a test, whose stem ``ncgrpo-toy`` begins with NC-GRPO's, gets its own rank after the built-ins and
    before runs of no registered method."""
    from ncgrpo.methods import RolloutMethod, register_method, unregister_method

    folder = tmp_path / "T"
    _write(folder, "base", "Base model", [True] + [False] * 9)
    for run, name in [
        ("grpo-seed0", "Vanilla GRPO"),
        ("aa-unknown-seed0", "Unknown"),
        ("ncgrpo-toy-sigma0.2-seed0", "Toy σ0=0.2"),
        ("image-sigma0.2-seed0", "NoisyRollout (image) σ0=0.2"),
        ("ncgrpo-sigma0.2-seed0", "NC-GRPO σ0=0.2"),
    ]:
        _write(folder, run, f"{name} (seed 0)", [True] * 5 + [False] * 5)

    @register_method
    class Toy(RolloutMethod):
        name = "ncgrpo_toy"  # run folders ncgrpo-toy-...: the default slug
        uses_sigma = True
        noise_mode = "independent"

    try:
        assert (
            Toy().demo_run(type("Cfg", (), {"noise_site": "final_norm"})(), 0.2)[1] == "ncgrpo-toy-sigma0.2"
        )
        registered = list(load_runs([folder])[1])
        table = seed_table([folder])
    finally:
        unregister_method("ncgrpo_toy")
    assert registered == ["grpo", "ncgrpo-sigma0.2", "image-sigma0.2", "ncgrpo-toy-sigma0.2", "aa-unknown"]
    rows = [line.split(" | ")[0] for line in table.splitlines() if line.startswith("| ")][1:]
    assert rows == ["| Base model", "| Vanilla GRPO", "| NC-GRPO σ0=0.2", "| NoisyRollout (image) σ0=0.2",
                    "| Toy σ0=0.2", "| Unknown"]  # fmt: skip
    # unregistered, the same run is read as one of NC-GRPO's (its stem begins the run's)
    assert list(load_runs([folder])[1]) == [
        "grpo",
        "ncgrpo-sigma0.2",
        "ncgrpo-toy-sigma0.2",
        "image-sigma0.2",
        "aa-unknown",
    ]
