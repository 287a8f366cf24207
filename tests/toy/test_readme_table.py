"""The README's several-seed tables are what the seed-table tool prints from the committed records.

Each table sits in README.md between the lines ``<!-- NAME:begin -->`` and ``<!-- NAME:end -->``, its
records committed under ``docs/records/NAME/`` (written by ``python -m ncgrpo.toy.seed_table --export
docs/records/NAME FOLDER...``): ``seed-table`` (the methods of the paper and the controls) and
``seed-table-target`` (issue 36's rows: the target schedule and the propagating site, each with the
vanilla runs trained beside it). A row edited by hand, or left behind when the records or the statistics
change, fails here.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path

import pytest

from ncgrpo.eval.records import EvalRecord
from ncgrpo.toy.seed_table import OOD_FAMILIES, POPE, export, seed_table

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RECORDS = ROOT / "docs" / "records" / "seed-table"
BEGIN, END = "<!-- seed-table:begin -->", "<!-- seed-table:end -->"
#: every README table: its block name (the markers) -> its committed records
BLOCKS = {"seed-table": RECORDS, "seed-table-target": ROOT / "docs" / "records" / "seed-table-target"}


def _markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:begin -->", f"<!-- {name}:end -->"


def _regenerate(records: Path, name: str) -> str:
    begin, end = _markers(name)
    rel = records.relative_to(ROOT) if records.is_relative_to(ROOT) else records
    return (
        f"regenerate it with `python -m ncgrpo.toy.seed_table {rel}` and paste the output between the lines "
        f"{begin} and {end} (new runs: first `python -m ncgrpo.toy.seed_table --export {rel} FOLDER...`)"
    )


def readme_block(text: str, where: str = "README.md", name: str = "seed-table") -> str:
    """The text between the marker lines of table ``name`` (each alone on its line, once, begin before end)."""
    BEGIN, END = _markers(name)
    lines = text.splitlines()
    begins = [i for i, line in enumerate(lines) if line.strip() == BEGIN]
    ends = [i for i, line in enumerate(lines) if line.strip() == END]
    if len(begins) != 1 or len(ends) != 1 or begins[0] > ends[0]:
        raise AssertionError(
            f"{where}: needs exactly one line {BEGIN} and, after it, one line {END} around the seed table "
            f"(found {len(begins)} and {len(ends)})"
        )
    return "\n".join(lines[begins[0] + 1 : ends[0]]).strip("\n")


def table_mismatch(
    readme_text: str, records: Path, where: str = "README.md", name: str = "seed-table"
) -> str | None:
    """None when the README block ``name`` equals the table of ``records``; else a message with the diff."""
    block = readme_block(readme_text, where, name)
    expected = seed_table([records]).strip("\n")
    if block == expected:
        return None
    diff = "\n".join(
        difflib.unified_diff(
            block.splitlines(), expected.splitlines(), "README block", "from the records", lineterm=""
        )
    )
    return f"{where}: the seed table {name} is not what {records} gives; {_regenerate(records, name)}\n{diff}"


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_readme_seed_table_regenerates_from_the_committed_records(name: str) -> None:
    records = BLOCKS[name]
    assert records.is_dir(), f"{records.relative_to(ROOT)} is not committed: no records for README's {name}"
    message = table_mismatch(README.read_text(encoding="utf-8"), records, name=name)
    assert message is None, message


# --- the check itself, on hand-made records (runs whether or not the real ones are committed) ---


def _demo_folder(root: Path) -> Path:
    def write(run: str, name: str, geo: list[bool]) -> None:
        d = root / "eval" / run
        d.mkdir(parents=True)
        (d / "run.json").write_text(json.dumps({"name": name}))
        rows = [
            EvalRecord("synthetic/geometry", f"q{i}", "in_domain", "h", "x", "1", "1", ok, "m")
            for i, ok in enumerate(geo)
        ]
        rows += [EvalRecord(f, "q0", "ood", "h", "x", "1", "1", True, "m") for f in (*OOD_FAMILIES, POPE)]
        (d / "records.jsonl").write_text("".join(r.to_json() + "\n" for r in rows))

    write("base", "Base model", [False] * 10)
    write("grpo-seed0", "Vanilla GRPO (seed 0)", [True] * 5 + [False] * 5)
    write("grpo-seed1", "Vanilla GRPO (seed 1)", [True] * 4 + [False] * 6)
    write("spsa-sigma0.2-seed0", "SPSA σ0=0.2 (seed 0)", [True] * 7 + [False] * 3)
    write("spsa-sigma0.2-seed1", "SPSA σ0=0.2 (seed 1)", [True] * 6 + [False] * 4)
    return root


def test_the_check_passes_on_a_fresh_table_and_fails_on_a_stale_row(tmp_path) -> None:
    records = tmp_path / "records"
    export([_demo_folder(tmp_path / "demo")], records)
    table = seed_table([records])
    readme = f"# Title\n\nSome text.\n\n{BEGIN}\n{table}{END}\n\nMore text.\n"
    assert table_mismatch(readme, records) is None
    stale = readme.replace("| SPSA σ0=0.2 | 70.0/60.0 |", "| SPSA σ0=0.2 | 71.0/60.0 |")
    assert stale != readme
    message = table_mismatch(stale, records)
    assert message is not None and "python -m ncgrpo.toy.seed_table" in message
    assert "-| SPSA σ0=0.2 | 71.0/60.0 |" in message and "+| SPSA σ0=0.2 | 70.0/60.0 |" in message


def test_markers_must_be_there_once(tmp_path) -> None:
    with pytest.raises(AssertionError, match="needs exactly one line <!-- seed-table:begin -->"):
        readme_block("no markers here")
    with pytest.raises(AssertionError, match=r"found 2 and 1"):
        readme_block(f"{BEGIN}\n{BEGIN}\n|a|\n{END}\n")
    with pytest.raises(AssertionError, match="needs exactly one line"):
        readme_block(f"{END}\n|a|\n{BEGIN}\n")
    assert readme_block(f"x\n{BEGIN}\n\n| a |\n\n{END}\n") == "| a |"
