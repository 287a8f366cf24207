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


def test_image_hash_is_the_pixels_not_the_file() -> None:
    """Issue 32, item 9: records hash the figures' decoded pixels, in order."""
    import io

    import numpy as np
    from PIL import Image

    from ncgrpo.data.prompts import image_hash

    pixels = np.random.default_rng(0).integers(0, 256, (9, 7, 3), dtype=np.uint8)
    a = Image.fromarray(pixels)
    stored = {}
    for fmt, kw in (
        ("PNG", {"compress_level": 0}),
        ("PNG", {"compress_level": 9}),
        ("BMP", {}),
        ("TIFF", {}),
    ):
        buf = io.BytesIO()
        a.save(buf, format=fmt, **kw)
        stored[(fmt, str(kw))] = buf.getvalue()
    assert len(set(stored.values())) == 4  # four files ...
    hashes = {image_hash([Image.open(io.BytesIO(b))]) for b in stored.values()}
    assert hashes == {image_hash([a])} and len(image_hash([a])) == 16  # ... one picture
    changed = pixels.copy()
    changed[4, 3, 0] ^= 1  # one channel of one pixel
    assert image_hash([Image.fromarray(changed)]) != image_hash([a])
    b = Image.fromarray(np.zeros((9, 7, 3), dtype=np.uint8))
    assert image_hash([a, b]) != image_hash([b, a])  # order is part of the question
    assert image_hash([a.transpose(Image.Transpose.TRANSPOSE)]) != image_hash([a])
    assert image_hash([]) == ""
