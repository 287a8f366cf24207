"""Loaders for the paper's evaluation benchmarks (and the registry that names them).

Every loader turns the rows of one public dataset, in the layout its hub repository uses, into
:class:`~ncgrpo.data.types.Question` objects in one convention (docs/benchmarks-data.md):

- multiple choice: ``choices`` holds the options in order, ``answer`` the gold letter,
  ``answer_type="choice"``, and ``problem`` lists the options as ``"A. ...\\nB. ..."`` followed by
  :data:`CHOICE_INSTRUCTION` (asks for the letter in ``\\boxed{}``);
- yes/no: ``answer`` is ``"yes"`` or ``"no"``, ``answer_type="yesno"``;
- numeric: ``answer_type="number"``; anything else ``"free"``.

Sources: ``path`` is a local folder laid out as on the hub (``data/test-00000-of-00001.parquet``,
``<split>.parquet``, ...) or one file (parquet, json, jsonl); with ``path=None`` the rows come from the
``datasets`` cache through ``datasets.load_dataset(hub_id, ...)``, which works offline only when the
dataset is cached. A missing file or a malformed row raises :class:`BenchmarkDataError` naming the
file, the row index and the field (``"geo3k test.parquet row 17: field 'answer' is empty"``).
"""

from __future__ import annotations

from ncgrpo.data.benchmarks.registry import (
    BENCHMARKS,
    ROLE_NAMES,
    BenchmarkSpec,
    custom_benchmark,
    known_benchmark,
    parse_role,
)
from ncgrpo.data.benchmarks.rows import (
    CHOICE_INSTRUCTION,
    YESNO_INSTRUCTION,
    BenchmarkDataError,
    RowContext,
    format_choice_problem,
)
from ncgrpo.data.benchmarks.sources import load_benchmark

__all__ = [
    "BENCHMARKS",
    "CHOICE_INSTRUCTION",
    "YESNO_INSTRUCTION",
    "BenchmarkDataError",
    "BenchmarkSpec",
    "ROLE_NAMES",
    "RowContext",
    "custom_benchmark",
    "format_choice_problem",
    "known_benchmark",
    "load_benchmark",
    "parse_role",
]
