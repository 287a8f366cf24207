"""Paper-style tables (Tables 1 and 2 layout) from run directories, and the `compare` command."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from ncgrpo import cli
from ncgrpo.eval.records import EvalRecord, RecordWriter
from ncgrpo.eval.report import compare, format_p, latex_text, load_runs, print_rich, to_latex, to_markdown
from ncgrpo.eval.stats import (
    MDD_LABEL,
    REFERENCE_SEED_SD_PP,
    SEEDS_NEEDED_LABEL,
    AlignmentError,
    mcnemar_exact,
    mcnemar_pooled,
    min_detectable_diff,
    seed_level,
    seed_to_seed,
    seeds_needed,
)
from ncgrpo.runs.folder import RECORDS_FILE, RUN_FILE, atomic_write_json

N = 1000  # questions per benchmark
POWER_LABELS = [MDD_LABEL, SEEDS_NEEDED_LABEL]  # the seed-level test's power columns, after its p
MAIN = [
    ("geo3k", "in_domain"),
    ("hallusionbench", "ood"),
    ("mathvista", "ood"),
    ("mathverse", "ood"),
    ("mathvision", "ood"),
    ("wemath", "ood"),
]
GENERAL = [
    ("pope", "general"),
    ("mmstar", "general"),
    ("ai2d", "general"),
    ("realworldqa", "general"),
    ("chartqa", "general"),
]


def outcomes(base_pct: float, pct: float, losses: int) -> tuple[np.ndarray, np.ndarray]:
    """(method, baseline) outcomes on N questions with the given accuracies.

    The baseline answers the first kb questions; the method has n01 = losses + max(0, kb - km) and
    n10 = losses + max(0, km - kb), so ``losses`` = 0 makes the change one-sided.
    """
    kb, km = round(base_pct * N / 100), round(pct * N / 100)
    n01, n10 = losses + max(0, kb - km), losses + max(0, km - kb)
    b = np.arange(N) < kb
    a = b.copy()
    a[:n01] = False
    a[kb : kb + n10] = True
    assert a.sum() == km
    return a, b


def write_run(root: Path, name: str, seed: int | None, columns: dict[str, tuple[str, np.ndarray]]) -> Path:
    d = root / f"{name}-{seed}".replace(" ", "_").replace("=", "")
    atomic_write_json(d / RUN_FILE, {"name": name, "method": name, "seed": seed, "model": "synthetic"})
    with RecordWriter(d / RECORDS_FILE) as w:
        for bm, (role, correct) in columns.items():
            w.write(
                EvalRecord(bm, f"q{i:04d}", role, "", "", None, "", bool(c), "synthetic", seed=seed)
                for i, c in enumerate(correct)
            )
    return d


# Paper Table 1. Losses per benchmark: 0 makes a one-sided change (p tiny, starred); 40 makes the
# paper's small unstarred differences non-significant (e.g. Geo3K +1.0: 50 vs 40, p = 0.34).
VANILLA = [52.9, 70.2, 70.7, 43.0, 27.1, 49.1]
NC02 = ([53.9, 71.3, 70.1, 44.9, 28.4, 50.5], [40, 40, 40, 0, 40, 40])
NC05 = ([53.7, 71.0, 71.2, 45.3, 27.6, 52.1], [40, 40, 40, 0, 40, 0])


@pytest.fixture
def table1_dirs(tmp_path: Path) -> list[Path]:
    dirs = [
        write_run(
            tmp_path,
            "Vanilla GRPO",
            1,
            {bm: (role, outcomes(v, v, 0)[1]) for (bm, role), v in zip(MAIN, VANILLA, strict=True)},
        )
    ]
    for name, (accs, losses) in [("NC-GRPO σ0=0.2", NC02), ("NC-GRPO σ0=0.5", NC05)]:
        cols = {
            bm: (role, outcomes(v, acc, loss)[0])
            for (bm, role), v, acc, loss in zip(MAIN, VANILLA, accs, losses, strict=True)
        }
        dirs.append(write_run(tmp_path, name, 1, cols))
    return dirs


def md_rows(md: str, section: str) -> list[list[str]]:
    block = md.split(f"## {section}")[1].split("\n\n")[1]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]] for line in block.strip().splitlines()]


def test_table1_layout_values_bold_and_stars(table1_dirs):
    ct = compare(load_runs(table1_dirs), "Vanilla GRPO")
    assert [c.label for c in ct.main.columns] == [
        "Geo3K",
        "Hallusion",
        "MathVista",
        "MathVerse",
        "MathVision",
        "WeMath",
        "OOD avg",
        "pooled p",
    ]
    assert [r.name for r in ct.main.rows] == ["Vanilla GRPO", "NC-GRPO σ0=0.2", "NC-GRPO σ0=0.5"]
    assert ct.general is None
    rows = md_rows(to_markdown(ct), "Reasoning benchmarks")
    assert rows[0] == [
        "Method",
        "Geo3K (ID)",
        "Hallusion",
        "MathVista",
        "MathVerse",
        "MathVision",
        "WeMath",
        "OOD avg",
        "pooled p",
    ]
    assert all(len(r) == 9 for r in rows)
    # OOD avg = unweighted mean of the five OOD accuracies: 52.02 -> 52.0, 53.04 -> 53.0, and
    # 53.44 -> 53.4 for σ0=0.5 (the paper prints 53.5, averaged before rounding its benchmarks).
    assert rows[2][:1] == ["Vanilla GRPO"]
    assert rows[2][1:8] == ["52.9", "70.2", "70.7", "43.0", "27.1", "49.1", "52.0"]
    assert rows[3][1:8] == ["**53.9**", "**71.3**", "70.1", "44.9\\*", "**28.4**", "50.5", "53.0\\*"]
    assert rows[4][1:8] == ["53.7", "71.0", "**71.2**", "**45.3**\\*", "27.6", "**52.1**\\*", "**53.4**\\*"]
    assert rows[2][8] == "—" and rows[3][8].startswith("p=") and rows[4][8] == "p<1e-4 (+)"


def test_table1_latex_matches_paper_markup(table1_dirs):
    tex = to_latex(compare(load_runs(table1_dirs), "Vanilla GRPO"))
    assert "\\begin{tabular}{lcccccccc}" in tex and "\\toprule" in tex and "\\bottomrule" in tex
    body = [ln.strip() for ln in tex.splitlines() if ln.strip().endswith("\\\\")]
    assert all(ln.count("&") == 8 for ln in body)  # 9 columns in every row
    assert body[0].startswith("Method & Geo3K (ID) & Hallusion")
    assert body[2] == (
        "NC-GRPO $\\sigma_0{=}0.2$ & \\textbf{53.9} & \\textbf{71.3} & 70.1 & 44.9$^*$ & "
        "\\textbf{28.4} & 50.5 & 53.0$^*$ & $p{=}0.011$ (+) \\\\"
    )
    assert "\\textbf{45.3}$^*$" in body[3] and "$p{<}10^{-4}$ (+)" in body[3]


def test_pooled_column_is_the_pooled_ood_test(table1_dirs):
    runs = load_runs(table1_dirs)
    ct = compare(runs, "Vanilla GRPO")
    nc = ct.main.rows[1]
    a = np.concatenate(
        [
            outcomes(v, acc, loss)[0]
            for v, acc, loss in zip(VANILLA[1:], NC02[0][1:], NC02[1][1:], strict=True)
        ]
    )
    b = np.concatenate([outcomes(v, v, 0)[1] for v in VANILLA[1:]])
    assert nc.cells["pooled"].test == mcnemar_exact(a, b) == nc.cells["ood_avg"].test
    assert nc.cells["pooled"].test.n == 5 * N  # OOD only: the in-domain benchmark is not pooled
    # Listed tests: 6 per-benchmark + 1 pooled per configuration, Holm <= Bonferroni adjusted.
    assert len(ct.tests) == 14
    assert [t.scope for t in ct.tests[:7]] == [bm for bm, _ in MAIN] + ["pooled OOD"]
    assert all(t.holm_p <= t.bonferroni_p for t in ct.tests)
    mv = next(t for t in ct.tests if t.configuration == "NC-GRPO σ0=0.2" and t.scope == "mathverse")
    assert (mv.result.n10, mv.result.n01) == (19, 0) and mv.holm_reject and mv.bonferroni_reject


def test_general_table_layout(tmp_path):
    # Paper Table 2 (vanilla and σ0=0.5 rows): ties bold together (66.3 twice in the paper's RealWorldQA).
    van = [86.8, 62.9, 81.1, 65.9, 80.3]
    nc = [85.9, 63.3, 79.7, 66.3, 80.4]
    van_cols = {bm: (role, outcomes(v, v, 0)[1]) for (bm, role), v in zip(GENERAL, van, strict=True)}
    # One-sided changes: pooled n10 = 4 + 4 + 1 = 9, n01 = 9 + 14 = 23 -> a significant regression.
    nc_cols = {bm: (role, outcomes(v, x, 0)[0]) for (bm, role), v, x in zip(GENERAL, van, nc, strict=True)}
    ir_cols = {
        bm: (role, outcomes(v, x, 5)[0])
        for (bm, role), v, x in zip(GENERAL, van, [86.5, 63.9, 81.0, 66.3, 80.6], strict=True)
    }
    dirs = [
        write_run(tmp_path, "Vanilla GRPO", 0, van_cols),
        write_run(tmp_path, "NC", 0, nc_cols),
        write_run(tmp_path, "Image", 0, ir_cols),
    ]
    ct = compare(load_runs(dirs), "Vanilla GRPO")
    assert ct.main.columns == [] and ct.general is not None
    assert [c.label for c in ct.general.columns] == [
        "POPE",
        "MMStar",
        "AI2D",
        "RealWorldQA",
        "ChartQA",
        "Pooled vs. Vanilla GRPO",
    ]
    md = to_markdown(ct)
    assert "## Reasoning benchmarks" not in md
    rows = md_rows(md, "General capability")
    assert all(len(r) == 7 for r in rows)
    assert rows[3][4] == "**66.3**" and rows[4][4] == "**66.3**"  # tie at display precision
    assert rows[2][1] == "**86.8**" and rows[3][1] == "85.9\\*"  # regression of 9 one-sided questions
    pooled = ct.general.rows[1].cells["pooled"].test
    assert pooled.n == 5 * N and pooled.diff_pp < 0
    assert rows[3][6].endswith("(−)")
    tex = to_latex(ct)
    assert "Pooled vs.\\ Vanilla GRPO" not in tex  # header is escaped text, not a sentence
    assert "& Pooled vs. Vanilla GRPO \\\\" in tex and "($-$)" in tex


def test_seeds_mean_half_range_and_seed_pairing(tmp_path):
    # Two seeds per configuration, one OOD benchmark. Vanilla 51.8 / 52.0 -> 51.9 ± 0.1 (paper).
    rng = np.random.default_rng(0)
    dirs, arrays = [], {}
    for seed, (bv, bn) in {1: (51.8, 52.8), 2: (52.0, 53.2)}.items():
        a, b = outcomes(bv, bn, 30)
        perm = rng.permutation(N)
        a, b = a[perm], b[perm]
        arrays[seed] = (a, b)
        dirs.append(write_run(tmp_path, "Vanilla", seed, {"mathvista": ("ood", b)}))
        dirs.append(write_run(tmp_path, "NC", seed, {"mathvista": ("ood", a)}))
    ct = compare(load_runs(dirs), "Vanilla")
    van, nc = ct.main.rows
    assert van.cells["mathvista"].mean == pytest.approx(51.9) and van.cells[
        "mathvista"
    ].half_range == pytest.approx(0.1)
    assert nc.cells["ood_avg"].mean == pytest.approx(53.0) and nc.cells[
        "ood_avg"
    ].half_range == pytest.approx(0.2)
    assert nc.seed_pairs == [(1, 1), (2, 2)]
    direct = mcnemar_exact(
        np.concatenate([arrays[1][0], arrays[2][0]]), np.concatenate([arrays[1][1], arrays[2][1]])
    )
    assert nc.cells["mathvista"].test == direct and direct.n == 2 * N
    rows = md_rows(to_markdown(ct), "Reasoning benchmarks")
    assert rows[2][1] == "51.9 ± 0.1"
    # two seed pairs: the pooled column says what it is, the seed-level test and its power follow it
    assert rows[0][-4:] == ["pooled p (question-level, pooled over seeds)", "seed-level p", *POWER_LABELS]
    assert nc.cells["seed_level"].seed_level.ttest.n_seeds == 2
    assert "$\\pm$" in to_latex(ct)


def test_misaligned_runs_are_refused(tmp_path):
    b = np.ones(10, dtype=bool)
    d1 = write_run(tmp_path, "Vanilla", 0, {"mathvista": ("ood", b)})
    d2 = write_run(tmp_path, "NC", 0, {"mathvista": ("ood", b[:7])})
    with pytest.raises(AlignmentError, match=r"missing from run a: 3 \(mathvista/q0007"):
        compare(load_runs([d1, d2]), "Vanilla")


def test_input_errors(tmp_path, table1_dirs):
    with pytest.raises(ValueError, match="baseline 'nope'"):
        compare(load_runs(table1_dirs), "nope")
    with pytest.raises(ValueError, match="not in any run"):
        compare(load_runs(table1_dirs), "Vanilla GRPO", ["mathvista", "nope"])
    with pytest.raises(ValueError, match="both 'Vanilla GRPO' with seed 1"):
        load_runs([table1_dirs[0], table1_dirs[0]])
    with pytest.raises(FileNotFoundError, match="no records.jsonl"):
        load_runs([tmp_path / "empty"])


def test_benchmark_subset_and_missing_benchmark(tmp_path, table1_dirs):
    ct = compare(load_runs(table1_dirs), "Vanilla GRPO", ["wemath", "geo3k"])
    assert [c.key for c in ct.main.columns] == ["geo3k", "wemath", "ood_avg", "pooled"]  # ID first
    assert ct.main.rows[0].cells["ood_avg"].mean == pytest.approx(49.1)
    # A configuration that skipped a benchmark shows a dash there, and no OOD avg / pooled test.
    partial = write_run(tmp_path, "Partial", 1, {"geo3k": ("in_domain", outcomes(52.9, 52.9, 0)[1])})
    ct = compare(load_runs([*table1_dirs, partial]), "Vanilla GRPO")
    row = md_rows(to_markdown(ct), "Reasoning benchmarks")[-1]
    assert row[0] == "Partial" and row[1] == "52.9" and row[2:] == ["—"] * 7


@pytest.mark.parametrize(
    "p,plain,latex",
    [
        (0.67, "=0.67", "{=}0.67"),
        (0.0007, "=0.00070", "{=}0.00070"),
        (0.090, "=0.090", "{=}0.090"),
        (1.0, "=1.00", "{=}1.00"),
        (5e-5, "<1e-4", "{<}10^{-4}"),
    ],
)
def test_format_p(p, plain, latex):
    assert format_p(p) == plain and format_p(p, latex=True) == latex


def test_latex_text():
    assert latex_text("NC-GRPO σ0=0.5") == "NC-GRPO $\\sigma_0{=}0.5$"
    assert latex_text("a_b & 50% σ") == "a\\_b \\& 50\\% $\\sigma$"


def test_rich_output_has_every_number_untruncated(table1_dirs):
    from rich.console import Console

    console = Console(width=60, record=True, color_system=None)
    print_rich(compare(load_runs(table1_dirs), "Vanilla GRPO"), console)
    text = console.export_text()
    for value in ["52.9", "53.9", "44.9*", "53.4*", "p<1e-4 (+)", "MathVision", "reject"]:
        assert value in text
    assert "…" not in text.split("Paired")[0]


def test_compare_cli_end_to_end(tmp_path, table1_dirs, capsys):
    out = tmp_path / "report"
    argv = [
        "compare",
        "--runs",
        *map(str, table1_dirs),
        "--baseline",
        "Vanilla GRPO",
        "--output_dir",
        str(out),
    ]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "Reasoning benchmarks" in printed and "53.0*" in printed
    md = (out / "comparison.md").read_text()
    assert "| NC-GRPO σ0=0.2 | **53.9** |" in md and "## Paired tests" in md
    assert "\\textbf{53.4}$^*$" in (out / "comparison.tex").read_text()
    data = json.loads((out / "comparison.json").read_text())
    assert data["family_size"] == 14 and data["baseline"] == "Vanilla GRPO"
    t = next(
        t for t in data["tests"] if t["scope"] == "pooled OOD" and t["configuration"] == "NC-GRPO σ0=0.5"
    )
    assert t["n"] == 5 * N and t["p"] < 1e-4 and t["holm_reject"] is True
    # Errors are reported, not raised.
    assert cli.main(["compare", "--runs", str(table1_dirs[0]), "--baseline", "nope"]) == 2
    assert "ncgrpo compare: error: baseline 'nope'" in capsys.readouterr().err
    # the same folder twice (also spelled differently) is named as such
    twice = [str(table1_dirs[0]), str(table1_dirs[0]) + "/"]
    assert cli.main(["compare", "--runs", *twice, "--baseline", "Vanilla GRPO"]) == 2
    assert "the same folder twice" in capsys.readouterr().err


def test_compare_cli_reads_a_config_file_and_flags_override_it(tmp_path, table1_dirs, capsys):
    cfg = tmp_path / "compare.yaml"
    cfg.write_text(
        json.dumps({"runs": [str(d) for d in table1_dirs], "baseline": "nope", "benchmarks": ["mathvista"]})
    )  # JSON is YAML
    out = tmp_path / "o"
    assert (
        cli.main(["compare", "--config", str(cfg), "--baseline", "Vanilla GRPO", "--output_dir", str(out)])
        == 0
    )
    data = json.loads((out / "comparison.json").read_text())
    assert data["baseline"] == "Vanilla GRPO"
    assert [c["key"] for c in data["main"]["columns"] if c["kind"] == "benchmark"] == ["mathvista"]
    capsys.readouterr()
    cfg.write_text("runs: [a]\nbaseline: x\n")
    assert cli.main(["compare", "--config", str(cfg)]) == 2
    assert "ncgrpo compare: error: --runs: a is not a folder" in capsys.readouterr().err
    cfg.write_text(f"runs: [{table1_dirs[0]}]\nbaseline: x\nbatch: 3\n")
    assert cli.main(["compare", "--config", str(cfg)]) == 2
    assert f"{cfg}: unknown key 'batch'" in capsys.readouterr().err
    assert cli.main(["compare", "--config", str(tmp_path / "none.yaml")]) == 2
    assert "none.yaml: config file does not exist" in capsys.readouterr().err


# --- seeds as the unit -----------------------------------------------------------------------


@pytest.fixture
def three_seed_dirs(tmp_path: Path) -> tuple[list[Path], dict[str, dict[int, np.ndarray]]]:
    """Vanilla at 50% in three seeds (its seeds differ from each other), and three configurations:

    - "Lucky": +5 / +0.5 / -1 pp (55 wins, 10 losses pooled): question-level significant, not seed-level;
    - "Steady": +1.2 / +1.0 / +1.1 pp with 40 losses a seed: seed-level significant, not question-level;
    - "Same": vanilla's own outcomes: difference 0, p 1 on both levels.
    """
    rng = np.random.default_rng(7)
    arrays: dict[str, dict[int, np.ndarray]] = {"Vanilla": {}, "Lucky": {}, "Steady": {}, "Same": {}}
    dirs = []
    for seed, (lucky, steady) in enumerate([(55.0, 51.2), (50.5, 51.0), (49.0, 51.1)]):
        perm = rng.permutation(N)  # another seed's vanilla answers other questions right
        base = outcomes(50.0, 50.0, 0)[1][perm]
        arrays["Vanilla"][seed] = base
        arrays["Lucky"][seed] = outcomes(50.0, lucky, 0)[0][perm]
        arrays["Steady"][seed] = outcomes(50.0, steady, 40)[0][perm]
        arrays["Same"][seed] = base.copy()
    for name, by_seed in arrays.items():
        for seed, x in by_seed.items():
            dirs.append(write_run(tmp_path, name, seed, {"geo3k": ("in_domain", x), "mathvista": ("ood", x)}))
    return dirs, arrays


def test_seed_level_column_beside_the_question_level_pooled_test(three_seed_dirs):
    dirs, arrays = three_seed_dirs
    ct = compare(load_runs(dirs), "Vanilla")
    assert [c.label for c in ct.main.columns] == [
        "Geo3K",
        "MathVista",
        "OOD avg",
        "pooled p (question-level, pooled over seeds)",
        "seed-level p",
        "MDD at 80% power (pts)",
        "seeds needed for the mean diff",
    ]
    pairs = {
        name: [(arrays[name][s], arrays["Vanilla"][s]) for s in range(3)]
        for name in ("Lucky", "Steady", "Same")
    }
    by_name = {r.name: r for r in ct.main.rows}
    for name, p in pairs.items():
        cell = by_name[name].cells["seed_level"]
        assert cell.seed_level == seed_level(p)  # the same numbers as stats on the arrays
        assert by_name[name].cells["pooled"].test == mcnemar_pooled(p)
    assert by_name["Vanilla"].cells["seed_level"].seed_level is None
    lucky, steady, same = (by_name[n].cells for n in ("Lucky", "Steady", "Same"))
    assert lucky["pooled"].test.p < 0.05 < lucky["seed_level"].seed_level.p
    assert steady["seed_level"].seed_level.p < 0.05 < steady["pooled"].test.p
    assert same["seed_level"].seed_level.mean_pp == 0 and same["seed_level"].seed_level.p == 1.0
    assert lucky["seed_level"].seed_level.ttest.diffs_pp == pytest.approx((5.0, 0.5, -1.0))
    # the baseline's seed-to-seed reference, on the pooled OOD questions
    null = ct.seed_null["pooled OOD"]
    assert null == seed_to_seed(arrays["Vanilla"])
    assert null.mean_differ > 0.4  # independent permutations: two vanilla seeds differ on ~half
    entry = next(t for t in ct.seed_tests if t.configuration == "Lucky")
    assert entry.differ == pytest.approx(np.mean([(a != b).mean() for a, b in pairs["Lucky"]]))
    # one note per disagreement, none where the two tests agree
    assert len(ct.notes) == 2
    assert ct.notes[0].startswith("Lucky (pooled OOD): question-level pooled McNemar p ")
    assert ct.notes[1].startswith("Steady (pooled OOD): seed-level p = ")
    # the Holm/Bonferroni family is still the McNemar tests only
    assert len(ct.tests) == 3 * 3


def test_seed_level_markdown_latex_json(three_seed_dirs):
    dirs, _ = three_seed_dirs
    ct = compare(load_runs(dirs), "Vanilla")
    md = to_markdown(ct)
    rows = md_rows(md, "Reasoning benchmarks")
    assert rows[0][-4:] == ["pooled p (question-level, pooled over seeds)", "seed-level p", *POWER_LABELS]
    assert rows[2][-4:] == ["—", "—", "—", "—"]  # the baseline
    same = next(r for r in rows if r[0] == "Same")
    assert same[-4:] == ["p=1.00", "p=1.00 (+0.0 pp)", "n/a", "n/a"]  # no spread: nothing to size them with
    lucky = next(r for r in rows if r[0] == "Lucky")
    level = ct.main.rows[1].cells["seed_level"].seed_level
    assert lucky[-3] == f"p{format_p(level.p)} (+1.5 pp)"
    # Lucky's per-seed differences +5.0/+0.5/-1.0: sd 3.12 over 3 seeds
    sd = float(np.std([5.0, 0.5, -1.0], ddof=1))
    assert lucky[-2:] == [f"{min_detectable_diff(sd, 3):.1f}", str(seeds_needed(1.5, sd))]
    section = md.split("## Seed-level tests")[1].split("## Paired tests")[0]
    assert "| Lucky | pooled OOD | 0/0, 1/1, 2/2 | +5.0/+0.5/-1.0 | +1.5 |" in section
    assert "Reference (pooled OOD): two seeds of Vanilla answer" in section
    assert "- Lucky (pooled OOD): question-level pooled McNemar p " in section
    assert md.index("## Seed-level tests") < md.index("## Paired tests")
    tex = to_latex(ct)
    assert "seeds needed for the mean diff \\\\" in tex and "$p{=}1.00$ (+0.0 pp) & n/a & n/a" in tex
    assert "MDD at 80\\% power (pts)" in tex
    data = json.loads(json.dumps(ct.to_json()), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert [t["configuration"] for t in data["seed_tests"]] == ["Lucky", "Steady", "Same"]
    assert data["seed_tests"][2]["ttest"]["p"] == 1.0 and data["seed_tests"][0]["note"].startswith("Lucky")
    assert data["seed_to_seed"]["pooled OOD"]["baseline"] == "Vanilla" and len(data["notes"]) == 2
    power = data["seed_tests"][0]["power"]  # Lucky
    assert power["mdd_pp"] == pytest.approx(min_detectable_diff(sd, 3)) and power["sd_source"] == "observed"
    lucky_cells = data["main"]["rows"][1]["cells"]
    assert lucky_cells["mdd_pp"] == {"mdd_pp": power["mdd_pp"]}
    assert (
        lucky_cells["seeds_needed"] == {"seeds_needed": power["seeds_needed"]} and power["seeds_needed"] > 3
    )
    assert data["main"]["rows"][3]["cells"]["mdd_pp"] == {"mdd_pp": None}  # Same: nan -> null
    assert data["single_seed"] == []


def test_one_seed_each_adds_no_seed_level_column(table1_dirs):
    ct = compare(load_runs(table1_dirs), "Vanilla GRPO")
    assert [c.kind for c in ct.main.columns].count("seed") == 0 and ct.main.columns[-1].label == "pooled p"
    assert ct.seed_tests == [] and ct.seed_null == {} and ct.notes == []
    assert "Seed-level" not in to_markdown(ct) and "question-level" not in to_latex(ct)
    # every configuration's note under its table: one seed per arm, no seed-level claim
    assert [(e.configuration, e.scope) for e in ct.single_seed] == [
        ("NC-GRPO σ0=0.2", "pooled OOD"),
        ("NC-GRPO σ0=0.5", "pooled OOD"),
    ]
    for e in ct.single_seed:
        assert e.power.n_seeds == 1 and e.power.seeds_needed == seeds_needed(
            e.power.mean_pp, REFERENCE_SEED_SD_PP
        )
        assert f"- {e.note}" in to_markdown(ct) and latex_text(e.note) in to_latex(ct)
    assert json.loads(json.dumps(ct.to_json()))["single_seed"][0]["note"] == ct.single_seed[0].note


def test_seed_level_with_a_single_seed_configuration(three_seed_dirs, tmp_path):
    # A configuration with one seed beside three-seed ones: no seed-level test for it (a dash).
    dirs, arrays = three_seed_dirs
    one = write_run(tmp_path / "one", "One", 0, {"geo3k": ("in_domain", arrays["Lucky"][0]),
                                                 "mathvista": ("ood", arrays["Lucky"][0])})  # fmt: skip
    ct = compare(load_runs([*dirs, one]), "Vanilla")
    row = md_rows(to_markdown(ct), "Reasoning benchmarks")[-1]
    assert row[0] == "One" and row[-4].startswith("p") and row[-3:] == ["—", "—", "—"]
    assert "One" not in [t.configuration for t in ct.seed_tests]
    # instead, a note under the table: its +5.0 pts at the embedded base's seed-to-seed sd
    (entry,) = ct.single_seed
    need = seeds_needed(5.0, REFERENCE_SEED_SD_PP)
    assert (entry.configuration, entry.power.seeds_needed, entry.power.sd_source) == (
        "One",
        need,
        "reference",
    )
    assert entry.note == (
        "One (pooled OOD): one seed per arm: no seed-level claim can be made (no seed-to-seed spread to test "
        f"against); if its per-seed difference varied across seeds as on ncgrpo's embedded base (sd "
        f"{REFERENCE_SEED_SD_PP:.2f} pts, the README's seed table), the observed difference of +5.0 pts "
        f"would need {need} seeds per arm for 80% power at alpha 0.05"
    )
    table = to_markdown(ct).split("## Seed-level tests")[0]
    assert f"\n- {entry.note}\n" in table
    from rich.console import Console

    console = Console(width=100, record=True, color_system=None)
    print_rich(ct, console)
    assert entry.note in " ".join(console.export_text().split())  # the table's caption, wrapped


def test_rich_output_has_the_seed_level_tests_and_notes(three_seed_dirs):
    from rich.console import Console

    dirs, _ = three_seed_dirs
    console = Console(width=80, record=True, color_system=None)
    print_rich(compare(load_runs(dirs), "Vanilla"), console)
    text = console.export_text()
    assert "seed-level p" in text and "Seed-level tests vs. Vanilla" in text
    assert "Reference (pooled OOD)" in text and "Note: Lucky (pooled OOD)" in text


def test_compare_cli_writes_the_seed_level_tests(tmp_path, three_seed_dirs, capsys):
    dirs, _ = three_seed_dirs
    out = tmp_path / "report"
    assert (
        cli.main(["compare", "--runs", *map(str, dirs), "--baseline", "Vanilla", "--output_dir", str(out)])
        == 0
    )
    assert "Note: Steady (pooled OOD)" in capsys.readouterr().out
    assert "## Seed-level tests" in (out / "comparison.md").read_text()
    data = json.loads((out / "comparison.json").read_text())
    assert len(data["seed_tests"]) == 3 and len(data["notes"]) == 2


def _reask(d: Path, *, prompt_hash: str = "", gold: str = "", only: str = "q0003") -> None:
    """Rewrite one record of ``d`` as if it had been asked another question under the same id."""
    rows = [json.loads(line) for line in (d / RECORDS_FILE).read_text().splitlines()]
    for r in rows:
        r["prompt_hash"] = r["prompt_hash"] or "h-" + r["question_id"]
        r["gold"] = r["gold"] or "g-" + r["question_id"]
        if r["question_id"] == only:
            r["prompt_hash"] = prompt_hash or r["prompt_hash"]
            r["gold"] = gold or r["gold"]
    (d / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_paired_records_must_be_the_same_question(tmp_path, capsys):
    """Issue 26, item 4: one model evaluated on suites of two seeds shares question ids but not the
    questions (prompt_hash and gold differ): compare refuses, naming the first such id and both
    folders, instead of reporting paired McNemar tests on them."""
    b = np.arange(10) % 2 == 0
    d1 = write_run(tmp_path, "Vanilla", 0, {"mathvista": ("ood", b)})
    d2 = write_run(tmp_path, "NC", 0, {"mathvista": ("ood", b)})
    _reask(d1)
    _reask(d2)
    compare(load_runs([d1, d2]), "Vanilla")  # same questions: fine
    _reask(d2, prompt_hash="other-prompt", only="q0003")
    _reask(d2, gold="other-gold", only="q0005")
    with pytest.raises(AlignmentError, match=r"question mathvista/q0003 is not the same question") as e:
        compare(load_runs([d1, d2]), "Vanilla")
    assert str(d1) in str(e.value) and str(d2) in str(e.value) and "prompt_hash" in str(e.value)
    assert cli.main(["compare", "--runs", str(d1), str(d2), "--baseline", "Vanilla"]) == 2
    assert "mathvista/q0003 is not the same question" in capsys.readouterr().err
    _reask(d2, prompt_hash="h-q0003", only="q0003")  # only the gold differs now
    with pytest.raises(AlignmentError, match=r"mathvista/q0005 .*gold 'other-gold' vs 'g-q0005'"):
        compare(load_runs([d1, d2]), "Vanilla")


def test_compare_out_is_a_report_folder_with_its_kind(tmp_path, table1_dirs, capsys):
    out = tmp_path / "report"
    assert (
        cli.main(
            [
                "compare",
                "--runs",
                *map(str, table1_dirs),
                "--baseline",
                "Vanilla GRPO",
                "--output_dir",
                str(out),
            ]
        )
        == 0
    )
    assert json.loads((out / RUN_FILE).read_text()) == {"kind": "report"}
    capsys.readouterr()
    # a report folder is not a run: compare --runs on it is refused by what it lacks
    assert cli.main(["compare", "--runs", str(out), "--baseline", "x"]) == 2
    assert "no records.jsonl" in capsys.readouterr().err


# --- pairing by the question's pixels (issue 32, item 9) ---------------------------------------------


def _figure(seed: int, size: int = 28):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))


def _reencoded(image, **png):
    """``image`` written to PNG bytes with ``png`` options and opened again (same pixels, other bytes)."""
    import io

    from PIL import Image

    buf = io.BytesIO()
    image.save(buf, format="PNG", **png)
    return Image.open(io.BytesIO(buf.getvalue())), buf.getvalue()


def test_compare_pairs_by_the_figure_not_only_the_text(tmp_path, capsys):
    """Geometry3K reuses question texts and golds under different figures: two runs whose q1 showed
    another figure (same text, same gold) are not paired; the same figure stored with other PNG bytes is."""
    from ncgrpo.data.types import Question
    from ncgrpo.eval.evaluate import DecodingSettings, evaluate
    from ncgrpo.models import load_model_and_processor
    from tiny_models import save_tiny_vl

    model, proc = load_model_and_processor(save_tiny_vl(tmp_path / "vl"), device="cpu")
    figures = [_figure(i) for i in range(3)]
    compact, small_bytes = _reencoded(figures[1], compress_level=9)
    loose, big_bytes = _reencoded(figures[1], compress_level=0)
    assert small_bytes != big_bytes  # the same pixels stored as other bytes

    def run(name: str, q1_figure) -> Path:
        qs = [
            Question("geo3k", f"q{i}", "<image>Find x.", "3", images=[im], role="in_domain")
            for i, im in enumerate([figures[0], q1_figure, figures[2]])
        ]
        out = tmp_path / name
        settings = DecodingSettings(max_new_tokens=2, batch_size=3)
        evaluate(model, proc, qs, out, model_id="m", name=name, settings=settings, progress=False)
        return out

    base, same, other = run("base", compact), run("same", loose), run("other", _figure(7))
    recs = {d.name: {r.question_id: r for r in load_runs([d])[0].records} for d in (base, same, other)}
    assert recs["base"]["q1"].prompt_hash == recs["other"]["q1"].prompt_hash  # the text alone cannot tell
    assert recs["base"]["q1"].image_hash == recs["same"]["q1"].image_hash != recs["other"]["q1"].image_hash
    assert recs["base"]["q0"].image_hash == recs["other"]["q0"].image_hash
    compare(load_runs([base, same]), "base")  # same pixels, other PNG bytes: paired
    with pytest.raises(AlignmentError, match=r"question geo3k/q1 is not the same question .*image pixels"):
        compare(load_runs([base, other]), "base")
    assert cli.main(["compare", "--runs", str(base), str(other), "--baseline", "base"]) == 2
    assert "geo3k/q1 is not the same question" in capsys.readouterr().err

    # records written before image_hash existed load, and pair on the text and gold as they did
    lines = (other / RECORDS_FILE).read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    for row in rows:
        del row["image_hash"]
    (other / RECORDS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert {r.image_hash for r in load_runs([other])[0].records} == {""}
    compare(load_runs([base, other]), "base")


def test_seeds_needed_over_the_cap_in_every_renderer() -> None:
    from ncgrpo.eval.report import Cell, Column, ComparisonTable, Row, Table

    # per-seed differences +0.1/-5.0/+5.0 pts: a mean of +0.03 at an sd of 5 needs ~180,000 seeds
    pairs = [outcomes(50.0, 50.0 + d, 100) for d in (0.1, -5.0, 5.0)]
    level = seed_level(pairs)
    assert level.power.seeds_needed is None and level.power.undefined == "more than 10,000 seeds"
    columns = [Column("mdd_pp", MDD_LABEL, "mdd"), Column("seeds_needed", SEEDS_NEEDED_LABEL, "seeds_needed")]
    cells = {"mdd_pp": Cell(seed_level=level), "seeds_needed": Cell(seed_level=level)}
    ct = ComparisonTable("B", Table("T", columns, [Row("A", 3, cells)]), None, [])
    assert md_rows(to_markdown(ct), "T")[2] == ["A", f"{level.power.mdd_pp:.1f}", ">10,000"]
    assert f"A & {level.power.mdd_pp:.1f} & $>$10,000 \\\\" in to_latex(ct)
    assert ct.to_json()["main"]["rows"][0]["cells"]["seeds_needed"] == {"seeds_needed": None}


def test_gsm8k_and_math500_join_the_seed_tables_with_their_role_and_label(tmp_path):
    """Issue 44: the text benchmarks' records go into `ncgrpo compare`'s several-seed table like any
    built-in benchmark: role ood (the main table and its OOD average), the labels GSM8K and MATH-500,
    after the paper's columns."""
    dirs = []
    for seed in (1, 2):
        cols = {
            "geo3k": ("in_domain", outcomes(50, 50, 0)[1]),
            "gsm8k": ("ood", outcomes(40 + seed, 40 + seed, 0)[1]),
            "math500": ("ood", outcomes(20, 20, 0)[1]),
        }
        dirs.append(write_run(tmp_path, "Vanilla", seed, cols))
        cols = {
            bm: (role, outcomes(50 if bm == "geo3k" else 30, 52, 10)[0]) for bm, (role, _) in cols.items()
        }
        dirs.append(write_run(tmp_path, "NC", seed, cols))
    ct = compare(load_runs(dirs), "Vanilla")
    assert [(c.label, c.role) for c in ct.main.columns if c.role] == [
        ("Geo3K", "in_domain"),
        ("GSM8K", "ood"),
        ("MATH-500", "ood"),
    ]
    van = ct.main.rows[0]
    assert van.cells["gsm8k"].mean == pytest.approx(41.5) and van.cells["math500"].mean == pytest.approx(20)
    assert van.cells["ood_avg"].mean == pytest.approx((41.5 + 20) / 2)
    assert ct.general is None or not ct.general.columns
    rows = md_rows(to_markdown(ct), "Reasoning benchmarks")
    assert "GSM8K" in rows[0] and "MATH-500" in rows[0]
