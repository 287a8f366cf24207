"""Issue 26, cryptic data messages: a zero-row parquet (was datasets' "An error occurred while
generating the dataset") and a JSON file holding an object that is not rows (was "row 0 is not a
mapping", no file) name the file and say what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ncgrpo.data.benchmarks import BenchmarkDataError, load_benchmark


def test_a_zero_row_parquet_names_the_file(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "data").mkdir()
    f = tmp_path / "data" / "test-00000-of-00001.parquet"
    pq.write_table(pa.table({"problem": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), f)
    with pytest.raises(
        BenchmarkDataError, match=rf"^{f}: the parquet file holds no rows; remove it or write"
    ):
        load_benchmark("geo3k", tmp_path, split="test")


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ({"a": 1, "b": 2}, r"test.json: holds a JSON object whose value at key 'a' is int, not a row"),
        ("text", r"test.json: holds a JSON str; expected a list of row objects"),
        ([1, 2], r"test.json: row 0 is int, not an object of fields"),
    ],
)
def test_a_json_file_without_rows_names_the_file(tmp_path: Path, content, match) -> None:
    (tmp_path / "data").mkdir()
    f = tmp_path / "data" / "test.json"
    f.write_text(json.dumps(content))
    with pytest.raises(BenchmarkDataError, match=match):
        load_benchmark("mathvista", f, split="test")
