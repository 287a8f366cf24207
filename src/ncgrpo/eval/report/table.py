"""The table model: cells, columns, rows, tables and the tests behind their stars, as
:func:`ncgrpo.eval.report.compare` builds them and the renderers read them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ncgrpo.eval.stats import ALPHA, McNemarResult, SeedLevel, SeedNull, SeedPower, disagreement_note

# --- the table model -------------------------------------------------------------------------


@dataclass
class Cell:
    """One configuration x column: accuracy in percent (mean over seeds) and its test vs. baseline."""

    mean: float | None = None  # percent; None: not evaluated
    half_range: float | None = None  # percent, only with > 1 seed
    test: McNemarResult | None = None
    bold: bool = False
    seed_level: SeedLevel | None = None  # only in the "seed", "mdd" and "seeds_needed" columns

    @property
    def significant(self) -> bool:
        return self.test is not None and self.test.p < ALPHA


@dataclass
class Column:
    key: str  # benchmark id, "ood_avg", "pooled", "seed_level", "mdd_pp" or "seeds_needed"
    label: str
    kind: str  # "benchmark" | "avg" | "pooled" | "seed" | "mdd" | "seeds_needed"
    role: str | None = None


@dataclass
class Row:
    name: str
    n_seeds: int
    cells: dict[str, Cell]
    seed_pairs: list[tuple[Any, Any]] = field(default_factory=list)  # (method seed, baseline seed)


@dataclass
class Table:
    title: str
    columns: list[Column]
    rows: list[Row]
    scope: str = ""  # the pooled test's scope ("pooled OOD" / "pooled general")


@dataclass
class TestEntry:
    """One paired test vs. the baseline, as listed under the tables."""

    configuration: str
    scope: str  # a benchmark id, or "pooled OOD" / "pooled general"
    result: McNemarResult
    seeds: list[tuple[Any, Any]]
    holm_p: float = math.nan
    bonferroni_p: float = math.nan

    @property
    def holm_reject(self) -> bool:
        return self.holm_p < ALPHA

    @property
    def bonferroni_reject(self) -> bool:
        return self.bonferroni_p < ALPHA


@dataclass
class SeedTestEntry:
    """The seed-level test of one configuration vs. the baseline on a pooled scope, beside the
    question-level McNemar test of the same scope pooled over the same seed pairs."""

    configuration: str
    scope: str  # "pooled OOD" / "pooled general"
    seeds: list[tuple[Any, Any]]
    result: SeedLevel
    question_level: McNemarResult
    differ: float  # mean over the seed pairs of the share of questions whose outcome differs

    @property
    def note(self) -> str | None:
        """A one-line note when this test and the question-level one disagree at ALPHA."""
        return disagreement_note(
            self.question_level.p,
            self.result.p,
            n_seeds=self.result.ttest.n_seeds,
            label=f"{self.configuration} ({self.scope})",
        )


@dataclass
class SingleSeedEntry:
    """A configuration with one seed pair on a pooled scope: no seed-level claim can be made; ``power``
    (``stats.seed_power`` of its one per-seed difference) has the seeds that difference would need at
    the embedded base's seed-to-seed sd."""

    configuration: str
    scope: str
    seeds: list[tuple[Any, Any]]
    power: SeedPower

    @property
    def note(self) -> str:
        return self.power.note(f"{self.configuration} ({self.scope})") or ""


def _nan_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def _json_clean(obj: Any) -> Any:
    """nan -> None, tuples -> lists (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: _json_clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_clean(v) for v in obj]
    return _nan_none(obj)


def _cell_json(key: str, c: Cell) -> dict[str, Any]:
    """One cell in comparison.json; the power columns' cells hold their one number (the whole
    seed-level result is in the "seed_level" cell beside them)."""
    if key in ("mdd_pp", "seeds_needed"):
        return {key: _json_clean(getattr(c.seed_level.power, key)) if c.seed_level else None}
    return {
        "mean": c.mean,
        "half_range": c.half_range,
        "bold": c.bold,
        "test": c.test.to_dict() if c.test else None,
        "seed_level": _json_clean(c.seed_level.to_dict()) if c.seed_level else None,
    }


@dataclass
class ComparisonTable:
    baseline: str
    main: Table
    general: Table | None
    tests: list[TestEntry]
    seed_tests: list[SeedTestEntry] = field(default_factory=list)
    seed_null: dict[str, SeedNull] = field(default_factory=dict)  # scope -> the baseline's seed-to-seed
    #: Configurations with one seed pair, whose note says no seed-level claim can be made.
    single_seed: list[SingleSeedEntry] = field(default_factory=list)
    #: Conditions the runs differ in, allowed explicitly (``compare(allow_different=...)``): one line
    #: each, shown above the tables.
    differences: list[str] = field(default_factory=list)

    @property
    def header(self) -> str | None:
        """The line above the tables where the runs were not evaluated alike (None where they were)."""
        if not self.differences:
            return None
        return "Runs evaluated under different conditions (allowed): " + " | ".join(self.differences)

    @property
    def notes(self) -> list[str]:
        """Where the question-level pooled test and the seed-level test disagree at ALPHA."""
        return [n for n in (t.note for t in self.seed_tests) if n]

    def to_json(self) -> dict[str, Any]:
        def table(t: Table | None) -> dict[str, Any] | None:
            if t is None:
                return None
            return {
                "title": t.title,
                "columns": [c.__dict__ for c in t.columns],
                "rows": [
                    {
                        "name": r.name,
                        "n_seeds": r.n_seeds,
                        "seed_pairs": r.seed_pairs,
                        "cells": {k: _cell_json(k, c) for k, c in r.cells.items()},
                    }
                    for r in t.rows
                ],
            }

        return {
            "baseline": self.baseline,
            "alpha": ALPHA,
            "family_size": len(self.tests),
            "main": table(self.main),
            "general": table(self.general),
            "tests": [
                {
                    "configuration": t.configuration,
                    "scope": t.scope,
                    "seed_pairs": t.seeds,
                    **t.result.to_dict(),
                    "holm_p": t.holm_p,
                    "holm_reject": t.holm_reject,
                    "bonferroni_p": t.bonferroni_p,
                    "bonferroni_reject": t.bonferroni_reject,
                }
                for t in self.tests
            ],
            "seed_tests": [
                {
                    "configuration": t.configuration,
                    "scope": t.scope,
                    "seed_pairs": t.seeds,
                    **_json_clean(t.result.to_dict()),
                    "question_level": t.question_level.to_dict(),
                    "differ": t.differ,
                    "note": t.note,
                }
                for t in self.seed_tests
            ],
            "seed_to_seed": {
                scope: {"baseline": self.baseline, **null.to_dict()} for scope, null in self.seed_null.items()
            },
            "single_seed": [
                {
                    "configuration": e.configuration,
                    "scope": e.scope,
                    "seed_pairs": e.seeds,
                    "power": _json_clean(e.power.to_dict()),
                    "note": e.note,
                }
                for e in self.single_seed
            ],
            "notes": self.notes,
            "differences": self.differences,
        }
