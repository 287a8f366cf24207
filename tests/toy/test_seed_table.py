"""ncgrpo.toy.seed_table: the README's several-seed table, from hand-made demo folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from scipy.stats import binomtest

from ncgrpo.eval.records import EvalRecord
from ncgrpo.toy.seed_table import OOD_FAMILIES, POPE, load_runs, main, seed_table

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
    assert lines[0].startswith("| Method | in-domain % (seed 0/1) | p vs base (seed 0/1) |")
    assert lines[2] == "| Base model | 10.0 | | 100.0 | 100.0 | | | 50 |"
    p_v0 = binomtest(5, 5, 0.5).pvalue  # vanilla seed 0: 5 wins, 0 losses against the base
    p_v1 = binomtest(3, 3, 0.5).pvalue
    assert lines[3] == f"| Vanilla GRPO | 60.0/40.0 | {p_v0:.2g}/{p_v1:.2g} | 50.0 | 50.0 | — | — | 0 |"
    p_m0, p_m1 = binomtest(6, 6, 0.5).pvalue, binomtest(6, 6, 0.5).pvalue
    pooled = binomtest(5, 6, 0.5).pvalue  # 2 + 3 wins, 1 + 0 losses
    assert lines[4] == (
        f"| NC-GRPO σ0=0.2 | 70.0/70.0 | {p_m0:.2g}/{p_m1:.2g} | 100.0 | 100.0 | {pooled:.2g} (5/1) | 30.0/30.0 | 0 |"
    )
    assert len(lines) == 5


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
    # rows in the paper's order whatever the folders' order, the propagating site's last
    three = tmp_path / "T5"
    for slug, name in [("first-token-t1.2", "First-token"), ("ncgrpo-sigma0.2-L1", "NC @L1"), ("image", "Image"),
                       ("spsa-sigma0.2", "SPSA"), ("ncgrpo-sigma0.5", "NC 0.5")]:  # fmt: skip
        _write(three, f"{slug}-seed0", name, [True] * 10)
    _, runs = load_runs([one, three, two])
    assert [r.name for r in runs.values()] == [
        "Vanilla GRPO", "NC-GRPO σ0=0.2", "NC 0.5", "Image", "SPSA", "First-token", "NC @L1"]  # fmt: skip
    with pytest.raises(ValueError, match="no eval/ folder"):
        load_runs([tmp_path / "missing"])


def test_command_line(tmp_path, capsys) -> None:
    one, two = _folders(tmp_path)
    assert main([str(one), str(two)]) == 0
    assert "| NC-GRPO σ0=0.2 |" in capsys.readouterr().out
    assert main([str(tmp_path / "nowhere")]) == 2
    assert "ncgrpo.toy.seed_table: error: " in capsys.readouterr().err
    assert main([]) == 2
