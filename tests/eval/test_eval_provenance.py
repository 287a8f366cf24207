"""Issue 42: an evaluation folder records what made its records (``provenance``: commit, dirty source,
package versions), outside its identity; records appended under another commit or other versions are
accepted, said (a ``ProvenanceWarning`` naming old -> new) and recorded in ``provenance_history``."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from ncgrpo.cli import main
from ncgrpo.runs.folder import RECORDS_FILE, RUN_FILE
from ncgrpo.runs.provenance import ProvenanceWarning, provenance
from ncgrpo.toy.suite import build_suite, export_geo3k
from tiny_models import save_tiny_vl


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_vl(tmp_path_factory.mktemp("run") / "checkpoint-2", seed=0)


@pytest.fixture(scope="module")
def suite_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    export_geo3k(build_suite(seed=0, sizes={"train": 1, "validation": 1, "test": 3}), out)
    return out


def _eval(model: Path, data: Path, out: Path, limit: int) -> int:
    return main(
        [
            "eval", "--model_name_or_path", str(model), "--benchmarks", "synthetic",
            "--data", f"synthetic={data}", "--split", "test", "--output_dir", str(out),
            "--max_new_tokens", "2", "--no_progress", "--device", "cpu", "--limit", str(limit),
        ]
    )  # fmt: skip


def _records(out: Path) -> int:
    return len((out / RECORDS_FILE).read_text().splitlines())


def test_an_append_under_another_commit_is_recorded_not_refused(model, suite_dir, tmp_path) -> None:
    out = tmp_path / "eval"
    assert _eval(model, suite_dir, out, 1) == 0
    info = json.loads((out / RUN_FILE).read_text())
    now = provenance()
    assert info["provenance"] == now and "provenance_history" not in info
    first = _records(out)
    # the records so far were made by another commit and another transformers
    old = {
        **now,
        "commit": "f" * 40,
        "dirty": False,
        "versions": {**now["versions"], "transformers": "5.10.4"},
    }
    (out / RUN_FILE).write_text(json.dumps({**info, "provenance": old}))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ProvenanceWarning)
        assert _eval(model, suite_dir, out, 1) == 0  # nothing new to record: nothing appended, nothing said
    assert "provenance_history" not in json.loads((out / RUN_FILE).read_text())
    with pytest.warns(ProvenanceWarning, match=r"append under other code .*commit ffffffffffff -> ") as seen:
        assert _eval(model, suite_dir, out, 3) == 0
    assert f"transformers 5.10.4 -> {now['versions']['transformers']}" in str(seen[0].message)
    assert _records(out) > first  # appended, not refused
    written = json.loads((out / RUN_FILE).read_text())
    assert written["provenance"] == old
    (entry,) = written["provenance_history"]
    assert entry["event"] == "append" and entry["new_records"] == _records(out) - first
    assert entry["provenance"] == now


def test_an_old_folder_without_provenance_is_appended_to_and_says_so(model, suite_dir, tmp_path) -> None:
    out = tmp_path / "eval"
    assert _eval(model, suite_dir, out, 1) == 0
    info = json.loads((out / RUN_FILE).read_text())
    del info["provenance"]
    (out / RUN_FILE).write_text(json.dumps(info))
    with pytest.warns(ProvenanceWarning, match="no provenance recorded"):
        assert _eval(model, suite_dir, out, 2) == 0
    written = json.loads((out / RUN_FILE).read_text())
    assert "provenance" not in written  # unknown stays unknown
    assert written["provenance_history"][0]["provenance"] == provenance()


def test_records_whose_run_json_was_lost_are_not_claimed_by_this_process(model, suite_dir, tmp_path) -> None:
    out = tmp_path / "eval"
    assert _eval(model, suite_dir, out, 1) == 0
    (out / RUN_FILE).unlink()
    with pytest.warns(ProvenanceWarning, match="no provenance recorded"):
        assert _eval(model, suite_dir, out, 2) == 0
    written = json.loads((out / RUN_FILE).read_text())
    assert "provenance" not in written and written["provenance_history"][0]["event"] == "append"
