"""Where a benchmark's rows come from: a local file or folder in the hub's layout, or the ``datasets``
cache; :func:`load_benchmark` reads them into questions."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ncgrpo.data.benchmarks.registry import BENCHMARKS, BenchmarkSpec, custom_benchmark
from ncgrpo.data.benchmarks.rows import _ROLES, BenchmarkDataError, RowContext
from ncgrpo.data.types import Question, Role

_PARQUET = (".parquet",)
_JSON = (".json", ".jsonl")


# --------------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------------


def _candidate_files(spec: BenchmarkSpec, folder: Path, split: str) -> list[Path]:
    patterns = [p.format(split=split) for p in spec.files] + [
        f"data/{split}-*.parquet",
        f"data/{split}.parquet",
        f"{split}-*.parquet",
        f"{split}.parquet",
        f"{split}/*.parquet",
        f"*/{split}-*.parquet",
        f"data/{split}.jsonl",
        f"{split}.jsonl",
        f"data/{split}.json",
        f"{split}.json",
    ]
    for pattern in patterns:
        found = sorted(p for p in folder.glob(pattern) if p.is_file())
        if found:
            return found
    return []


def _expected_layout(spec: BenchmarkSpec, split: str) -> str:
    names = [p.format(split=split) for p in spec.files] + [
        f"data/{split}-00000-of-00001.parquet",
        f"{split}.parquet",
        f"{split}.jsonl",
    ]
    return ", ".join(dict.fromkeys(names))


def _read_parquet(files: list[Path], image_columns: tuple[str, ...]):
    """Rows of parquet files via ``datasets``, with image columns left as undecoded structs."""
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    empty = [f for f in files if _parquet_rows(f) == 0]
    if empty:  # datasets would say only "An error occurred while generating the dataset"
        raise BenchmarkDataError(
            f"{empty[0]}: the parquet file holds no rows; remove it or write the split's questions into it"
        )
    try:
        ds = datasets.Dataset.from_parquet([str(f) for f in files])
        return _undecoded(ds, image_columns)
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def _parquet_rows(file: Path) -> int | None:
    """Rows of a parquet file from its footer (None when it is not readable as parquet)."""
    try:
        import pyarrow.parquet as pq

        return int(pq.ParquetFile(file).metadata.num_rows)
    except Exception:  # noqa: BLE001 - the reader below reports unreadable files
        return None


def _undecoded(ds, image_columns: tuple[str, ...]):
    import datasets

    for name, feature in ds.features.items():
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(name, datasets.Image(decode=False))
        elif isinstance(feature, datasets.List | datasets.Sequence) and isinstance(
            getattr(feature, "feature", None), datasets.Image
        ):
            ds = ds.cast_column(name, datasets.List(datasets.Image(decode=False)))
    return ds


def _read_json(file: Path) -> list[dict[str, Any]]:
    text = file.read_text(encoding="utf-8")
    if file.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(text.splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise BenchmarkDataError(f"{file}: line {n + 1} is not valid JSON: {exc}") from None
        return rows
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BenchmarkDataError(f"{file}: not valid JSON: {exc}") from None
    if isinstance(data, dict):  # {"id": row, ...} layouts
        bad = next((k for k, v in data.items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise BenchmarkDataError(
                f"{file}: holds a JSON object whose value at key {bad!r} is {type(data[bad]).__name__}, not a row; "
                'expected a list of row objects ([{...}, ...]) or an object of rows keyed by id ({"id": {...}})'
            )
        data = list(data.values())
    if not isinstance(data, list):
        raise BenchmarkDataError(
            f"{file}: holds a JSON {type(data).__name__}; expected a list of row objects ([{{...}}, ...])"
        )
    return data


def _rows(records, limit: int | None, label: str = "") -> Iterable[tuple[int, dict[str, Any]]]:
    n = len(records)
    stop = n if limit is None else min(n, limit)
    for i in range(stop):
        row = records[i]
        if not isinstance(row, dict):
            where = f"{label}: " if label else ""
            raise BenchmarkDataError(
                f"{where}row {i} is {type(row).__name__}, not an object of fields; each row must be a JSON object"
            )
        yield i, row


def load_benchmark(
    name: str,
    path: str | Path | None = None,
    *,
    split: str | None = None,
    limit: int | None = None,
    role: Role | None = None,
) -> list[Question]:
    """Load benchmark ``name`` as a list of questions.

    ``name``: a key of :data:`BENCHMARKS`, or any other name for a benchmark of one's own read from
    ``path`` (:func:`custom_benchmark`: the geo3k schema, images optional). ``path``: a folder in the
    hub's layout or a single parquet/json/jsonl file; None reads the ``datasets`` cache (offline only if
    cached; built-in benchmarks only). ``split`` defaults to the spec's (``test`` for one's own);
    ``limit`` keeps the first rows only. ``role`` overrides the benchmark's role (in_domain, ood,
    general; one's own: in_domain by default).
    """
    if name in BENCHMARKS:
        spec = BENCHMARKS[name]
        if role is not None:
            if role not in _ROLES:
                raise ValueError(f"role must be one of {sorted(_ROLES)}, got {role!r}")
            spec = dataclasses.replace(spec, role=role)
    elif path is None:
        raise KeyError(
            f"unknown benchmark {name!r}; known: {', '.join(BENCHMARKS)}; a benchmark of your own needs its "
            "file or folder (ncgrpo eval --data NAME=FILE.jsonl[:role])"
        )
    else:
        spec = custom_benchmark(name, role or "in_domain")
    split = split or spec.default_split
    if limit is not None and limit < 0:
        raise ValueError("limit must be >= 0")

    stored = spec.derived_splits.get(split, split)
    if path is None:
        records, ctx = _from_hub(spec, stored)
    else:
        records, ctx = _from_path(spec, Path(path), stored)
    ctx.split = split
    questions = spec.loader(_rows(records, limit, ctx.label), ctx)
    for q in questions:
        if q.role != spec.role and not q.benchmark.startswith("synthetic/"):
            q.role = spec.role
    _check_unique(questions, ctx)
    return questions


def _from_path(spec: BenchmarkSpec, path: Path, split: str):
    if path.is_file():
        files = [path]
        base = path.parent
    elif path.is_dir():
        files = _candidate_files(spec, path, split)
        if not files:
            present = sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file())[:20]
            raise BenchmarkDataError(
                f"{spec.name}: no '{split}' data under {path}; expected one of: {_expected_layout(spec, split)} "
                f"(found: {', '.join(present) or 'nothing'})"
            )
        base = path
    else:
        holding = f"the {spec.hub_id} files" if spec.hub_id else "its rows"
        raise BenchmarkDataError(
            f"{spec.name}: {path} does not exist; pass the file or the folder holding {holding} "
            f"(expected: {_expected_layout(spec, split)})"
        )
    label = f"{spec.name} {files[0]}" if len(files) == 1 else f"{spec.name} {files[0].parent}/{split}-*"
    ctx = RowContext(benchmark=spec.name, label=label, split=split, base_dir=base)
    suffixes = {f.suffix for f in files}
    if suffixes <= set(_PARQUET):
        try:
            records = _read_parquet(files, spec.image_columns)
        except BenchmarkDataError:
            raise
        except Exception as exc:
            raise BenchmarkDataError(f"{label}: cannot read parquet: {exc}") from exc
    elif len(files) == 1 and files[0].suffix in _JSON:
        records = _read_json(files[0])
    else:
        raise BenchmarkDataError(f"{spec.name}: unsupported file type(s) {sorted(suffixes)} in {path}")
    return records, ctx


def _from_hub(spec: BenchmarkSpec, split: str):
    import datasets

    label = f"{spec.name} hub:{spec.hub_id}[{split}]"
    try:
        ds = datasets.load_dataset(spec.hub_id, spec.hub_config, split=split)
    except Exception as exc:
        raise BenchmarkDataError(
            f"{spec.name}: could not load {spec.hub_id} (split '{split}') from the datasets cache "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}). Download it where "
            f"there is network, or pass --data_dir/path pointing at a folder with "
            f"{_expected_layout(spec, split)} (see docs/benchmarks-data.md)."
        ) from exc
    ctx = RowContext(benchmark=spec.name, label=label, split=split, base_dir=None)
    return _undecoded(ds, spec.image_columns), ctx


def _check_unique(questions: list[Question], ctx: RowContext) -> None:
    seen: dict[str, int] = {}
    for k, q in enumerate(questions):
        if q.uid in seen:
            raise BenchmarkDataError(
                f"{ctx.label} row {k}: question_id {q.question_id!r} repeats row {seen[q.uid]} "
                f"(benchmark {q.benchmark})"
            )
        seen[q.uid] = k
