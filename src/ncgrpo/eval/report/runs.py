"""Run directories read for the tables: one :class:`Run` per ``run.json`` + ``records.jsonl``, and
seed i of a configuration paired with seed i of the baseline (see :mod:`ncgrpo.eval.report`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ncgrpo.eval.records import EvalRecord, read_records
from ncgrpo.runs.folder import RECORDS_FILE, read_run_json

# --- runs ------------------------------------------------------------------------------------


@dataclass
class Run:
    """One evaluated checkpoint: a run directory's ``run.json`` and its records."""

    path: Path
    name: str
    seed: int | None
    records: list[EvalRecord]
    info: dict[str, Any] = field(default_factory=dict)  # the whole run.json

    @cached_property
    def by_benchmark(self) -> dict[str, list[EvalRecord]]:
        """Records grouped by benchmark, in first-seen order."""
        out: dict[str, list[EvalRecord]] = {}
        for r in self.records:
            out.setdefault(r.benchmark, []).append(r)
        return out

    @property
    def benchmarks(self) -> dict[str, str]:
        """benchmark -> role (of its first record)."""
        return {bm: recs[0].role for bm, recs in self.by_benchmark.items()}

    @property
    def fixed(self) -> bool:
        """A model no training seed made, the base model: an evaluation with no ``seed`` (``ncgrpo eval`` of
        a model that is not a training run), or one whose ``method`` is ``base`` (the demo's)."""
        return self.seed is None or self.info.get("method") == "base"

    def subset(self, benchmarks: Iterable[str]) -> list[EvalRecord]:
        return [r for bm in benchmarks for r in self.by_benchmark.get(bm, [])]

    def accuracy(self, benchmark: str) -> float:
        """Fraction correct on ``benchmark``."""
        recs = self.by_benchmark.get(benchmark)
        if not recs:
            raise KeyError(f"{self.path}: no records for benchmark {benchmark!r}")
        return sum(r.correct for r in recs) / len(recs)


def load_run(path: str | Path) -> Run:
    path = Path(path)
    rec_file = path / RECORDS_FILE
    if not rec_file.exists():
        raise FileNotFoundError(
            f"{path}: no {RECORDS_FILE} (is this an `ncgrpo eval --output_dir` directory?)"
        )
    info: dict[str, Any] = read_run_json(path) or {}
    records = read_records(rec_file)
    if not records:
        raise ValueError(f"{rec_file}: no records")
    return Run(
        path=path, name=str(info.get("name") or path.name), seed=info.get("seed"), records=records, info=info
    )


def load_runs(dirs: Iterable[str | Path]) -> list[Run]:
    """Load run directories; two directories with the same name must differ in seed."""
    runs = [load_run(d) for d in dirs]
    seen: dict[tuple[str, Any], Path] = {}
    for r in runs:
        key = (r.name, r.seed)
        if key in seen:
            raise ValueError(
                f"{seen[key]} and {r.path} are both {r.name!r} with seed {r.seed}; "
                "give seeds of one configuration distinct `seed` values in run.json"
            )
        seen[key] = r.path
    return runs


def _seed_key(seed: Any) -> tuple[int, Any]:
    return (0, seed) if isinstance(seed, int | float) else (1, str(seed))


def pair_seeds(method: Sequence[Run], baseline: Sequence[Run]) -> list[tuple[Run, Run]]:
    """Seed i of the method with seed i of the baseline.

    A side that is one fixed run (:attr:`Run.fixed`: the base model, which no seed made) pairs with every
    run of the other side: a fixed row beside seeded runs, each seed's run compared with the one base
    model (so the seed-level test vs. the base is over the other side's seeds). Otherwise seeds present
    on both sides pair by value; with no seed value in common but equally many seeds, they pair in
    sorted order (e.g. single runs with different seeds).
    """
    if len(baseline) == 1 and baseline[0].fixed:
        return [(r, baseline[0]) for r in sorted(method, key=lambda r: _seed_key(r.seed))]
    if len(method) == 1 and method[0].fixed:
        return [(method[0], r) for r in sorted(baseline, key=lambda r: _seed_key(r.seed))]
    by_a = {r.seed: r for r in method}
    by_b = {r.seed: r for r in baseline}
    common = sorted(by_a.keys() & by_b.keys(), key=_seed_key)
    if common:
        return [(by_a[s], by_b[s]) for s in common]
    if len(method) == len(baseline):
        return list(
            zip(
                sorted(method, key=lambda r: _seed_key(r.seed)),
                sorted(baseline, key=lambda r: _seed_key(r.seed)),
                strict=True,
            )
        )
    raise ValueError(
        f"cannot pair seeds {sorted(by_a, key=_seed_key)} of {method[0].name!r} with seeds "
        f"{sorted(by_b, key=_seed_key)} of {baseline[0].name!r}: give each configuration the same seeds, "
        "or one run without a seed (the base model, paired with every seed)"
    )
