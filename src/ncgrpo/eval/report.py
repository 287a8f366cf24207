"""Paper-style comparison tables from run directories (the layout of the paper's Tables 1 and 2).

``load_runs`` reads run directories (``run.json`` + ``records.jsonl``, see ``ncgrpo.eval.records``);
``compare`` turns them into a :class:`ComparisonTable`:

- rows are configurations (runs with the same ``name``; several seeds are averaged and, with more
  than one seed, shown as mean ± half-range);
- the main table has the in-domain benchmark(s), then the OOD benchmarks, then "OOD avg" (the
  unweighted mean of the per-benchmark accuracies) and "pooled p" (exact McNemar on the pooled
  OOD questions, vs. the baseline);
- general-role benchmarks go to a second table ending in "Pooled vs. <baseline>" (Table 2);
- best value per column in bold (ties at display precision all bold), ``*`` where p < 0.05 vs.
  the baseline (per benchmark; on "OOD avg" the pooled test).

With several seeds, seed i of a configuration is paired with seed i of the baseline (matching seed
values where they exist, else sorted order) and the McNemar tests pool the pairs of all seed pairs:
question-level tests, for which the questions are the only source of variance. Training seeds are
the unit of replication, so where a configuration has several seed pairs the tables add a
"seed-level p" column beside the pooled one (relabelled "question-level, pooled over seeds"): the
paired t-test over seeds of the per-seed accuracy difference on the same pooled questions
(``stats.seed_ttest``, with the ``stats.hierarchical_bootstrap`` interval in ``seed_tests``). The
baseline's own seed-to-seed difference (``stats.seed_to_seed``) is given as the reference, and a note
says where the question-level and the seed-level test disagree at alpha (``notes``). The seed-level
tests are not in the Holm/Bonferroni family, which stays the family of the paper's McNemar tests.

Every test behind a star is also listed (``tests``) with n01/n10/p and Holm and Bonferroni flags over
the family of all listed tests. Renderers: rich (terminal), Markdown, LaTeX (booktabs), JSON.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ncgrpo.eval.records import EvalRecord, read_records
from ncgrpo.eval.stats import (
    ALPHA,
    BOOTSTRAP_RESAMPLES,
    AlignmentError,
    McNemarResult,
    SeedLevel,
    SeedNull,
    align_seeds,
    bonferroni,
    disagreement_note,
    holm,
    macro_accuracy,
    mcnemar_pooled,
    mean_half_range,
    seed_level,
    seed_to_seed,
)
from ncgrpo.runs.folder import RECORDS_FILE, read_run_json

#: What a pooled McNemar column is, in its header, where seeds were pooled into it.
QUESTION_LEVEL = "question-level, pooled over seeds"
ROLES = ("in_domain", "ood", "general")

# Paper's column labels and order for the benchmarks it reports; keyed by lower-case alphanumerics
# of the benchmark id, so "MathVista", "mathvista" and "math_vista" all match.
_KNOWN: dict[str, str] = {
    "geo3k": "Geo3K",
    "geometry3k": "Geo3K",
    "hallusionbench": "Hallusion",
    "hallusion": "Hallusion",
    "mathvista": "MathVista",
    "mathverse": "MathVerse",
    "mathvision": "MathVision",
    "wemath": "WeMath",
    "pope": "POPE",
    "mmstar": "MMStar",
    "ai2d": "AI2D",
    "realworldqa": "RealWorldQA",
    "chartqa": "ChartQA",
}
_ORDER = list(dict.fromkeys(_KNOWN.values()))


def _norm(benchmark: str) -> str:
    return re.sub(r"[^a-z0-9]", "", benchmark.lower())


def benchmark_label(benchmark: str) -> str:
    """The paper's column label for a known benchmark id, else the id itself."""
    return _KNOWN.get(_norm(benchmark), benchmark)


def _paper_rank(benchmark: str) -> int:
    label = _KNOWN.get(_norm(benchmark))
    return _ORDER.index(label) if label else len(_ORDER)


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

    Seeds present on both sides pair by value; with no seed value in common but equally many seeds,
    they pair in sorted order (e.g. single runs with different seeds).
    """
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
        f"{sorted(by_b, key=_seed_key)} of {baseline[0].name!r}"
    )


# --- the table model -------------------------------------------------------------------------


@dataclass
class Cell:
    """One configuration x column: accuracy in percent (mean over seeds) and its test vs. baseline."""

    mean: float | None = None  # percent; None: not evaluated
    half_range: float | None = None  # percent, only with > 1 seed
    test: McNemarResult | None = None
    bold: bool = False
    seed_level: SeedLevel | None = None  # only in a "seed" column

    @property
    def significant(self) -> bool:
        return self.test is not None and self.test.p < ALPHA


@dataclass
class Column:
    key: str  # benchmark id, "ood_avg", "pooled" or "seed_level"
    label: str
    kind: str  # "benchmark" | "avg" | "pooled" | "seed"
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


def _nan_none(x: float) -> float | None:
    return None if isinstance(x, float) and math.isnan(x) else x


def _json_clean(obj: Any) -> Any:
    """nan -> None, tuples -> lists (JSON has no NaN)."""
    if isinstance(obj, dict):
        return {k: _json_clean(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_clean(v) for v in obj]
    return _nan_none(obj)


@dataclass
class ComparisonTable:
    baseline: str
    main: Table
    general: Table | None
    tests: list[TestEntry]
    seed_tests: list[SeedTestEntry] = field(default_factory=list)
    seed_null: dict[str, SeedNull] = field(default_factory=dict)  # scope -> the baseline's seed-to-seed

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
                        "cells": {
                            k: {
                                "mean": c.mean,
                                "half_range": c.half_range,
                                "bold": c.bold,
                                "test": c.test.to_dict() if c.test else None,
                                "seed_level": _json_clean(c.seed_level.to_dict()) if c.seed_level else None,
                            }
                            for k, c in r.cells.items()
                        },
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
            "notes": self.notes,
        }


# --- building it -----------------------------------------------------------------------------


def _roles(runs: Sequence[Run], benchmarks: Sequence[str] | None) -> dict[str, str]:
    roles: dict[str, str] = {}
    for run in runs:
        for bm, role in run.benchmarks.items():
            if role not in ROLES:
                raise ValueError(f"{run.path}: benchmark {bm!r} has unknown role {role!r} (one of {ROLES})")
            if roles.setdefault(bm, role) != role:
                raise ValueError(f"benchmark {bm!r} is {roles[bm]!r} in one run and {role!r} in {run.path}")
    if benchmarks is None:
        return dict(sorted(roles.items(), key=lambda kv: _paper_rank(kv[0])))  # stable: ties keep first-seen
    unknown = [b for b in benchmarks if b not in roles]
    if unknown:
        raise ValueError(f"benchmark(s) {unknown} not in any run (have: {sorted(roles)})")
    return {b: roles[b] for b in benchmarks}


def _covers(runs: Sequence[Run], benchmarks: Iterable[str]) -> bool:
    return all(bm in run.benchmarks for run in runs for bm in benchmarks)


def _fill(cell: Cell, values: list[float]) -> None:
    mean, half = mean_half_range(values)
    cell.mean = 100 * mean
    cell.half_range = 100 * half if len(values) > 1 else None


def _mark_bold(table: Table, decimals: int = 1) -> None:
    for col in table.columns:
        if col.kind in ("pooled", "seed"):
            continue
        vals = [
            round(r.cells[col.key].mean, decimals) for r in table.rows if r.cells[col.key].mean is not None
        ]
        if len(vals) < 2:
            continue
        best = max(vals)
        for r in table.rows:
            c = r.cells[col.key]
            c.bold = c.mean is not None and round(c.mean, decimals) == best


def _aligned(pairs: Sequence[tuple[Run, Run]], bms: list[str]) -> list[tuple[Any, Any]]:
    """Per run pair, the paired outcomes (a, b) on ``bms`` (``stats.align_seeds``); an alignment
    error names both folders."""
    out = []
    for a, b in pairs:
        try:
            out += align_seeds([(a.subset(bms), b.subset(bms))], bms)
        except AlignmentError as e:
            raise AlignmentError(
                f"run a = {a.path} ({a.name!r}), run b = {b.path} ({b.name!r}): {e}"
            ) from None
    return out


def _paired_test(pairs: Sequence[tuple[Run, Run]], bms: list[str]) -> McNemarResult:
    """The pooled McNemar test of ``pairs`` on ``bms``; an alignment error names both folders."""
    return mcnemar_pooled(_aligned(pairs, bms))


def _build(
    groups: dict[str, list[Run]],
    baseline: str,
    roles: dict[str, str],
    bms: list[str],
    *,
    title: str,
    with_avg: bool,
    pooled_label: str,
    seed_label: str,
    pooled_scope: str,
    tests: list[TestEntry],
    seed_tests: list[SeedTestEntry],
    seed_null: dict[str, SeedNull],
) -> Table:
    """One table; ``tests`` and ``seed_tests`` collect every test made, ``seed_null`` the baseline's
    seed-to-seed reference. The pooled test pools the OOD columns when ``with_avg`` (main table),
    else all columns (general table). With several seed pairs in some row, the pooled column says it
    is question-level and a seed-level column follows it."""
    columns = [Column(bm, benchmark_label(bm), "benchmark", roles[bm]) for bm in bms]
    ood = [bm for bm in bms if roles[bm] == "ood"] if with_avg else bms
    rows: list[Row] = []
    base_runs = groups[baseline]
    all_pairs = {
        name: [] if name == baseline else pair_seeds(runs, base_runs) for name, runs in groups.items()
    }
    seeds_pooled = any(len(pairs) > 1 for pairs in all_pairs.values())
    for name, runs in groups.items():
        pairs = all_pairs[name]
        row = Row(name=name, n_seeds=len(runs), cells={}, seed_pairs=[(a.seed, b.seed) for a, b in pairs])
        for bm in bms:
            cell = row.cells[bm] = Cell()
            if not _covers(runs, [bm]):
                continue
            _fill(cell, [r.accuracy(bm) for r in runs])
            if pairs and _covers(base_runs, [bm]):
                cell.test = _paired_test(pairs, [bm])
                tests.append(TestEntry(name, bm, cell.test, row.seed_pairs))
        pooled_test = None
        seed_cell = Cell()
        if ood and pairs and _covers(runs, ood) and _covers(base_runs, ood):
            arrays = _aligned(pairs, ood)
            pooled_test = mcnemar_pooled(arrays)
            tests.append(TestEntry(name, pooled_scope, pooled_test, row.seed_pairs))
            if len(pairs) > 1:
                seed_cell.seed_level = seed_level(arrays)
                differ = sum(float((a != b).mean()) for a, b in arrays) / len(arrays)
                seed_tests.append(
                    SeedTestEntry(
                        name, pooled_scope, row.seed_pairs, seed_cell.seed_level, pooled_test, differ
                    )
                )
        if with_avg:
            avg = row.cells["ood_avg"] = Cell(test=pooled_test)
            if ood and _covers(runs, ood):
                _fill(avg, [macro_accuracy(r.accuracy(bm) for bm in ood) for r in runs])
        row.cells["pooled"] = Cell(test=pooled_test)
        if seeds_pooled:
            row.cells["seed_level"] = seed_cell
        rows.append(row)
    if with_avg:
        columns.append(Column("ood_avg", "OOD avg", "avg"))
    columns.append(
        Column("pooled", f"{pooled_label} ({QUESTION_LEVEL})" if seeds_pooled else pooled_label, "pooled")
    )
    if seeds_pooled:
        columns.append(Column("seed_level", seed_label, "seed"))
    if ood and len(base_runs) > 1 and _covers(base_runs, ood):
        arrays = _aligned([(r, base_runs[0]) for r in base_runs], ood)  # one question order for all seeds
        seed_null[pooled_scope] = seed_to_seed(
            {r.seed: a for r, (a, _) in zip(base_runs, arrays, strict=True)}
        )
    table = Table(title=title, columns=columns, rows=rows)
    _mark_bold(table)
    return table


def compare(runs: Sequence[Run], baseline: str, benchmarks: Sequence[str] | None = None) -> ComparisonTable:
    """Build the main (in-domain + OOD) and general tables of ``runs`` against ``baseline``.

    ``benchmarks`` restricts (and orders) the columns; by default every benchmark in the runs, in the
    paper's order for the benchmarks it reports. Raises ``stats.AlignmentError`` when a
    configuration and the baseline did not answer the same questions of a benchmark.
    """
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.name, []).append(r)
    if baseline not in groups:
        raise ValueError(f"baseline {baseline!r} is not among the runs' names: {sorted(groups)}")
    groups = {baseline: groups.pop(baseline), **groups}  # baseline first, as in the paper
    for g in groups.values():
        g.sort(key=lambda r: _seed_key(r.seed))

    roles = _roles(runs, benchmarks)
    tests: list[TestEntry] = []
    seed_tests: list[SeedTestEntry] = []
    seed_null: dict[str, SeedNull] = {}
    main_bms = [b for b in roles if roles[b] == "in_domain"] + [b for b in roles if roles[b] == "ood"]
    gen_bms = [b for b in roles if roles[b] == "general"]
    main = (
        _build(
            groups,
            baseline,
            roles,
            main_bms,
            title="Reasoning benchmarks",
            with_avg=True,
            pooled_label="pooled p",
            seed_label="seed-level p",
            pooled_scope="pooled OOD",
            tests=tests,
            seed_tests=seed_tests,
            seed_null=seed_null,
        )
        if main_bms
        else None
    )
    general = None
    if gen_bms:
        gen_groups = {
            n: g
            for n, g in groups.items()
            if n == baseline or any(b in r.benchmarks for r in g for b in gen_bms)
        }
        general = _build(
            gen_groups,
            baseline,
            roles,
            gen_bms,
            title="General capability",
            with_avg=False,
            pooled_label=f"Pooled vs. {baseline}",
            seed_label=f"Seed-level vs. {baseline}",
            pooled_scope="pooled general",
            tests=tests,
            seed_tests=seed_tests,
            seed_null=seed_null,
        )
    if main is None:
        main = Table(title="Reasoning benchmarks", columns=[], rows=[])
    if tests:
        holm_p, _ = holm([t.result.p for t in tests])
        bonf_p, _ = bonferroni([t.result.p for t in tests])
        for t, hp, bp in zip(tests, holm_p, bonf_p, strict=True):
            t.holm_p, t.bonferroni_p = float(hp), float(bp)
    return ComparisonTable(
        baseline=baseline, main=main, general=general, tests=tests, seed_tests=seed_tests, seed_null=seed_null
    )


# --- rendering -------------------------------------------------------------------------------


def format_p(p: float, *, latex: bool = False) -> str:
    """The paper's p style: two decimals from 0.1 up, two significant digits below, ``<1e-4`` floor."""
    if p < 1e-4:
        return "{<}10^{-4}" if latex else "<1e-4"
    text = f"{p:.2f}" if p >= 0.1 else f"{p:#.2g}"
    return f"{{=}}{text}" if latex else f"={text}"


def _header(col: Column) -> str:
    return f"{col.label} (ID)" if col.role == "in_domain" else col.label


def _value(cell: Cell, pm: str) -> str:
    text = f"{cell.mean:.1f}"
    if cell.half_range is not None:
        text += f"{pm}{cell.half_range:.1f}"
    return text


def _pooled_text(cell: Cell, *, latex: bool, minus: str) -> str:
    if cell.test is None:
        return ""
    text = f"p{format_p(cell.test.p, latex=latex)}"
    if latex:
        text = f"${text}$"
    if cell.significant:
        text += " (+)" if cell.test.diff_pp > 0 else f" ({minus})"
    return text


def _seed_text(cell: Cell, *, latex: bool, minus: str) -> str:
    """ "p=0.015 (+1.2 pp)": the seed-level p and the mean per-seed difference; "n/a" where the
    t-test is undefined (see ``stats.paired_ttest``)."""
    level = cell.seed_level
    if level is None:
        return ""
    diff = f"{level.mean_pp:+.1f}".replace("-", minus)
    if math.isnan(level.p):
        return f"n/a ({diff} pp)"
    if latex:
        return f"$p{format_p(level.p, latex=True)}$ ({diff} pp)"
    return f"p{format_p(level.p)} ({diff} pp)"


def _cells(table: Table, row: Row, style: str) -> list[str]:
    """Cell strings of one row: style "md" (Markdown), "latex" or "rich" (rich markup)."""
    dash = {"md": "—", "latex": "---", "rich": "—"}[style]
    pm = {"md": " ± ", "latex": " $\\pm$ ", "rich": " ± "}[style]
    out = []
    for col in table.columns:
        cell = row.cells[col.key]
        if col.kind == "pooled":
            text = _pooled_text(cell, latex=style == "latex", minus="$-$" if style == "latex" else "−")
            out.append(text or dash)
            continue
        if col.kind == "seed":
            text = _seed_text(cell, latex=style == "latex", minus="$-$" if style == "latex" else "−")
            out.append(text or dash)
            continue
        if cell.mean is None:
            out.append(dash)
            continue
        text = _value(cell, pm)
        if cell.bold:
            text = {"md": f"**{text}**", "latex": f"\\textbf{{{text}}}", "rich": f"[bold]{text}[/bold]"}[
                style
            ]
        if cell.significant:
            text += {"md": "\\*", "latex": "$^*$", "rich": "[yellow]*[/yellow]"}[style]
        out.append(text)
    return out


def _legend(ct: ComparisonTable, table: Table, *, latex: bool = False) -> str:
    pooled = any(c.kind == "avg" for c in table.columns)
    seeds = any(r.n_seeds > 1 for r in table.rows)
    seed_level = any(c.kind == "seed" for c in table.columns)
    text = _legend_head(ct, pooled, seeds, latex=latex)
    if seed_level:
        p = "$p$" if latex else "p"
        text += (
            f" Pooled {p} and the stars are question-level: McNemar tests over the questions of every seed "
            f"pair. Seed-level {p} (primary with several seeds, seeds being the unit of replication): paired "
            "t-test over training seeds of the per-seed accuracy difference on the same questions, with the "
            "mean difference in points."
        )
    return text


def _legend_head(ct: ComparisonTable, pooled: bool, seeds: bool, *, latex: bool) -> str:
    if latex:
        base = latex_text(ct.baseline)
        text = (
            f"Accuracy (\\%) vs.\\ {base}. Bold: best per column. $^*$: exact McNemar $p{{<}}{ALPHA}$ vs.\\ "
            f"{base} on paired per-question outcomes"
        )
        text += (
            " (OOD avg: pooled over the OOD questions). OOD avg: unweighted mean of the OOD benchmarks."
            if pooled
            else "; Pooled: one test over all questions of these benchmarks."
        )
        return text + (" $\\pm$: half-range over seeds." if seeds else "")
    text = (
        f"Accuracy (%) vs. {ct.baseline}. Bold: best per column. *: exact McNemar p<{ALPHA} vs. "
        f"{ct.baseline} on paired per-question outcomes"
    )
    text += (
        " (OOD avg: pooled over the OOD questions). OOD avg: unweighted mean of the OOD benchmarks."
        if pooled
        else "; Pooled: one test over all questions of these benchmarks."
    )
    return text + (" ±: half-range over seeds." if seeds else "")


def _tables(ct: ComparisonTable) -> list[Table]:
    return [t for t in (ct.main, ct.general) if t is not None and t.columns]


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("*", "\\*")


def tests_markdown(ct: ComparisonTable) -> str:
    """Every test vs. the baseline with its discordant counts and corrected flags."""
    m = len(ct.tests)
    lines = [
        f"Exact McNemar tests vs. {ct.baseline} (n10: method right, baseline wrong; n01: the reverse). "
        f"Holm and Bonferroni over this family of {m} tests, alpha={ALPHA}.",
        "",
        "| Configuration | Test | Seeds | n | n10 | n01 | Δ pp | p | Holm | Bonferroni |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for t in ct.tests:
        r = t.result
        seeds = ", ".join(f"{a}/{b}" for a, b in t.seeds)
        lines.append(
            f"| {_md_escape(t.configuration)} | {_md_escape(t.scope)} | {seeds} | {r.n} | {r.n10} | {r.n01} | "
            f"{r.diff_pp:+.1f} | {r.p:.3g} | {'reject' if t.holm_reject else '—'} (p={t.holm_p:.3g}) | "
            f"{'reject' if t.bonferroni_reject else '—'} (p={t.bonferroni_p:.3g}) |"
        )
    return "\n".join(lines) + "\n"


def _ci(low: float, high: float) -> str:
    return "—" if math.isnan(low) else f"[{low:+.1f}, {high:+.1f}]"


def seed_reference(ct: ComparisonTable, scope: str) -> str | None:
    """The baseline's seed-to-seed line for ``scope``: what two seeds of one method already differ by."""
    null = ct.seed_null.get(scope)
    if null is None:
        return None
    per_pair = "/".join(f"{100 * d:.1f}" for d in null.differ)
    pairs = ", ".join(f"{i}/{j}" for i, j in null.pairs)
    q = null.pooled
    return (
        f"Reference ({scope}): two seeds of {ct.baseline} answer {100 * null.mean_differ:.1f}% of the questions "
        f"differently (mean over seed pairs {pairs}: {per_pair}%); question-level McNemar between them, "
        f"pooled over those pairs: p={q.p:.3g} ({q.n10}/{q.n01}). Read a configuration's differ % against it."
    )


def seed_tests_markdown(ct: ComparisonTable) -> str:
    """The seed-level tests, the baseline's seed-to-seed reference, and the notes where the
    question-level and seed-level tests disagree."""
    conf = ct.seed_tests[0].result.ttest.confidence if ct.seed_tests else 0.95
    b = ct.seed_tests[0].result.bootstrap.n_resamples if ct.seed_tests else BOOTSTRAP_RESAMPLES
    lines = [
        f"Training seeds as the unit (primary with several seeds): per seed pair the accuracy difference vs. "
        f"{ct.baseline} on the pooled questions, a paired t-test over the seeds (df = seeds − 1) and its "
        f"{100 * conf:.0f}% t interval; the hierarchical bootstrap interval ({b} resamples of seeds, then of "
        "questions within each seed) adds the question variance. Question-level p: the pooled McNemar test "
        "beside it, which treats the questions as the only source of variance. Differ %: share of questions "
        "answered differently, mean over the seed pairs. Not part of the Holm/Bonferroni family.",
        "",
    ]
    if ct.seed_tests:
        lines += [
            "| Configuration | Test | Seeds | Δ pp per seed | mean Δ pp | t CI | bootstrap CI | seed-level p | "
            "question-level p | differ % |",
            "|---|---|---|---|---:|---|---|---:|---:|---:|",
        ]
        for t in ct.seed_tests:
            tt, bs = t.result.ttest, t.result.bootstrap
            seeds = ", ".join(f"{a}/{b}" for a, b in t.seeds)
            p = "n/a" if math.isnan(tt.p) else f"{tt.p:.3g}"
            lines.append(
                f"| {_md_escape(t.configuration)} | {_md_escape(t.scope)} | {seeds} | "
                f"{'/'.join(f'{d:+.1f}' for d in tt.diffs_pp)} | {tt.mean_pp:+.1f} | "
                f"{_ci(tt.ci_low_pp, tt.ci_high_pp)} | {_ci(bs.low_pp, bs.high_pp)} | {p} | "
                f"{t.question_level.p:.3g} | {100 * t.differ:.1f} |"
            )
        lines.append("")
    refs = [r for r in (seed_reference(ct, scope) for scope in ct.seed_null) if r]
    lines += [_md_escape(r) for r in refs]
    if ct.notes:
        lines += ["", "Where the two tests disagree:", ""] + [f"- {_md_escape(n)}" for n in ct.notes]
    return "\n".join(lines).rstrip("\n") + "\n"


def to_markdown(ct: ComparisonTable, *, with_tests: bool = True) -> str:
    parts = []
    for table in _tables(ct):
        head = ["Method"] + [_header(c) for c in table.columns]
        lines = [
            f"## {table.title}",
            "",
            "| " + " | ".join(_md_escape(h) for h in head) + " |",
            "|" + "---|" + "---:|" * len(table.columns),
        ]
        for row in table.rows:
            lines.append("| " + " | ".join([_md_escape(row.name)] + _cells(table, row, "md")) + " |")
        lines += ["", _md_escape(_legend(ct, table))]
        parts.append("\n".join(lines) + "\n")
    if ct.seed_tests or ct.seed_null:
        parts.append("## Seed-level tests\n\n" + seed_tests_markdown(ct))
    if with_tests and ct.tests:
        parts.append("## Paired tests\n\n" + tests_markdown(ct))
    return "\n".join(parts)


_LATEX_SPECIAL = {
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
    "\\": r"\textbackslash{}",
}


def latex_text(text: str) -> str:
    """Escape a label for LaTeX; ``σ0=0.2`` becomes ``$\\sigma_0{=}0.2$`` as in the paper."""
    parts = re.split(r"(σ\d*=?[\d.]*)", text)
    out = []
    for part in parts:
        m = re.fullmatch(r"σ(\d*)(=?)([\d.]*)", part)
        if m:
            sub = f"_{m.group(1)}" if m.group(1) else ""
            eq = "{=}" if m.group(2) else ""
            out.append(f"$\\sigma{sub}{eq}{m.group(3)}$")
        else:
            out.append("".join(_LATEX_SPECIAL.get(ch, ch) for ch in part))
    return "".join(out)


def to_latex(ct: ComparisonTable) -> str:
    """booktabs tables in the paper's style (``\\textbf`` best, ``$^*$`` significant)."""
    blocks = []
    for table in _tables(ct):
        head = ["Method"] + [_header(c) for c in table.columns]
        lines = [
            "\\begin{table*}[t]",
            "  \\centering",
            "  \\small",
            "  \\begin{tabular}{l" + "c" * len(table.columns) + "}",
            "    \\toprule",
            "    " + " & ".join(latex_text(h) for h in head) + " \\\\",
            "    \\midrule",
        ]
        for row in table.rows:
            lines.append("    " + " & ".join([latex_text(row.name)] + _cells(table, row, "latex")) + " \\\\")
        lines += [
            "    \\bottomrule",
            "  \\end{tabular}",
            f"  \\caption{{\\textbf{{{latex_text(table.title)}.}} {_legend(ct, table, latex=True)}}}",
            "\\end{table*}",
        ]
        blocks.append("\n".join(lines))
    return "% Generated by `ncgrpo compare`; needs \\usepackage{booktabs}.\n" + "\n\n".join(blocks) + "\n"


def to_rich(ct: ComparisonTable) -> list[Any]:
    """rich renderables: one table per results table, then the test listing."""
    from rich.markup import escape
    from rich.table import Table as RichTable
    from rich.text import Text

    out: list[Any] = []
    for table in _tables(ct):
        rt = RichTable(title=table.title, caption=_legend(ct, table), caption_justify="left")
        rows = [_cells(table, row, "rich") for row in table.rows]
        rt.add_column("Method", no_wrap=True)
        for col in table.columns:
            rt.add_column(
                escape(_header(col)),
                justify="right",
                no_wrap=True,
                style="on grey15" if col.kind == "avg" else None,
            )
        for row, cells in zip(table.rows, rows, strict=True):
            rt.add_row(escape(row.name), *cells)
        out.append(rt)
    if ct.tests:
        columns = ["Configuration", "Test", "n", "n10", "n01", "Δ pp", "p", "Holm", "Bonf."]
        rows = [
            [
                escape(t.configuration), escape(t.scope), str(t.result.n), str(t.result.n10), str(t.result.n01),
                f"{t.result.diff_pp:+.1f}", f"{t.result.p:.3g}", "reject" if t.holm_reject else "—",
                "reject" if t.bonferroni_reject else "—",
            ]
            for t in ct.tests
        ]  # fmt: skip
        title = f"Paired exact McNemar tests vs. {ct.baseline} (Holm/Bonferroni over {len(ct.tests)} tests)"
        out.append(_rich_table(title, columns, "llrrrrrll", rows))
    if ct.seed_tests:
        columns = ["Configuration", "Test", "Δ pp per seed", "mean Δ pp", "t CI", "bootstrap CI", "seed-level p",
                   "question-level p", "differ %"]  # fmt: skip
        rows = [
            [
                escape(t.configuration), escape(t.scope), "/".join(f"{d:+.1f}" for d in t.result.ttest.diffs_pp),
                f"{t.result.ttest.mean_pp:+.1f}", _ci(t.result.ttest.ci_low_pp, t.result.ttest.ci_high_pp),
                _ci(t.result.bootstrap.low_pp, t.result.bootstrap.high_pp),
                "n/a" if math.isnan(t.result.ttest.p) else f"{t.result.ttest.p:.3g}",
                f"{t.question_level.p:.3g}", f"{100 * t.differ:.1f}",
            ]
            for t in ct.seed_tests
        ]  # fmt: skip
        title = f"Seed-level tests vs. {ct.baseline} (paired t-test over training seeds; primary with several seeds)"
        out.append(_rich_table(title, columns, "lllrllrrr", rows))
    lines = [r for r in (seed_reference(ct, scope) for scope in ct.seed_null) if r]
    lines += [f"Note: {n}" for n in ct.notes]
    if lines:
        out.append(Text("\n".join(lines)))
    return out


def _rich_table(title: str, columns: list[str], justify: str, rows: list[list[str]]) -> Any:
    """A rich table: one column per name, ``justify`` one letter per column (l: left, r: right)."""
    from rich.table import Table as RichTable

    table = RichTable(title=title)
    for name, j in zip(columns, justify, strict=True):
        table.add_column(name, justify="left" if j == "l" else "right")
    for row in rows:
        table.add_row(*row)
    return table


def print_rich(ct: ComparisonTable, console: Any = None) -> None:
    from rich.console import Console
    from rich.measure import Measurement
    from rich.text import Text

    console = console or Console()
    width = console.width
    try:
        for renderable in to_rich(ct):
            # At its natural width: a table wider than the terminal wraps rather than truncating numbers.
            # Text (the reference line, the notes) wraps at the terminal's width.
            natural = (
                Measurement.get(console, console.options.update_width(10_000), renderable).maximum
                if not isinstance(renderable, Text)
                else width
            )
            console.width = max(width, natural)
            console.print(renderable, crop=False)
    finally:
        console.width = width
