"""Row counts of each benchmark's public release, per split (checked against the real files where
docs/benchmarks-data.md says so). Test data: the library does not need them."""

from __future__ import annotations

from ncgrpo.data.benchmarks.converters import HALLUSION_PAPER_SPLIT

PUBLISHED_ROWS: dict[str, dict[str, int]] = {
    "geo3k": {"train": 2101, "validation": 300, "test": 601},
    "hallusionbench": {HALLUSION_PAPER_SPLIT: 318, "image": 951, "non_image": 178},
    "mathvista": {"testmini": 1000, "test": 5141},
    "mathverse": {"testmini": 3940},
    "mathvision": {"test": 3040, "testmini": 304},
    "wemath": {"testmini": 1740},
    "pope": {"test": 9000},
    "mmstar": {"val": 1500},
    "ai2d": {"test": 3088},
    "realworldqa": {"test": 765},
    "chartqa": {"test": 2500, "val": 1920, "train": 28299},
    # checked against the real test files (tests/data/test_real_annotations.py)
    "gsm8k": {"test": 1319, "train": 7473},
    "math500": {"test": 500},
}
