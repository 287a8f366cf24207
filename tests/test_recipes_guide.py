"""recipes/README.md says what to expect and what is proven (issue 33): a status line per path, "probe
first" with branch_prefix and ``ncgrpo probe``, and the paper's numbers for every paper recipe, whose
rows are consistent (the OOD average is the mean of the five OOD benchmarks, to the paper's rounding)
and name recipe files that exist; README.md says the status where users choose a recipe."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "recipes" / "README.md"


def _section() -> str:
    text = GUIDE.read_text()
    m = re.search(r"^## What to expect and what is proven\n(.*?)(?=^## )", text, re.S | re.M)
    assert m, "recipes/README.md has no 'What to expect and what is proven' section"
    return m.group(1)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]  # \| is a pipe in a cell


def _numbers_table(section: str) -> dict[str, list[str]]:
    """recipe -> [Geo3K, HallusionBench, MathVista, MathVerse, MathVision, WeMath, OOD avg] cells."""
    rows = {}
    for line in section.splitlines():
        cells = _cells(line)
        name = re.match(r"`([\w.]+)`", cells[0])
        if len(cells) == 9 and name:
            rows[name.group(1)] = cells[2:]
    return rows


def test_status_per_path() -> None:
    status = {}
    for line in _section().splitlines():
        cells = _cells(line)
        if len(cells) == 2:
            status[cells[0]] = cells[1]
    never = [k for k, v in status.items() if v.startswith("never run")]
    for path in ("vLLM colocated", "vLLM server", "V2 model runner", "verl"):
        assert any(path in k for k in never), f"no 'never run' status line for {path}: {status}"
    assert any("transformers engine" in k and "H100" in v for k, v in status.items())
    assert any("CPU" in k and v.startswith("checked on CPU") for k, v in status.items())


def test_probe_first() -> None:
    section = _section()
    assert "ncgrpo probe" in section and "--branch_prefix '<think>'" in section and "inert" in section


def test_every_paper_recipe_has_the_papers_numbers() -> None:
    rows = _numbers_table(_section())
    assert len(rows) >= 12, rows
    for name in rows:
        assert (ROOT / "recipes" / f"{name}.yaml").is_file(), (
            f"the table names a recipe that does not exist: {name}"
        )
    not_in_paper = ("_separate", "first_token", "propagating", "_server", "tiny_")
    for recipe in (ROOT / "recipes").glob("*.yaml"):
        if not any(k in recipe.stem for k in not_in_paper):
            assert recipe.stem in rows, (
                f"{recipe.name}: a paper recipe without the paper's numbers in recipes/README.md"
            )


def test_full_rows_are_consistent() -> None:
    """Transcription check: where all five OOD benchmarks are given, their mean is the OOD average."""
    checked = 0
    for name, cells in _numbers_table(_section()).items():
        values = [re.match(r"[\d.]+", c) for c in cells[1:]]  # the five OOD benchmarks and their average
        if all(values):
            *ood, avg = (float(v.group(0)) for v in values)
            assert abs(sum(ood) / 5 - avg) <= 0.1 + 1e-9, f"{name}: mean of {ood} is not {avg}"
            checked += 1
    assert checked >= 8


def test_readme_says_the_status_where_users_choose_a_recipe() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "recipes/README.md#what-to-expect-and-what-is-proven" in readme
    m = re.search(r"\*\*Status of the paper recipes' paths\*\*(.*?)\n\n", readme, re.S)
    assert m and "never run on a GPU" in m.group(1).replace("\n", " ") and "verl" in m.group(1)
