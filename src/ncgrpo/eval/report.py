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
values where they exist, else sorted order) and the tests pool the pairs of all seed pairs.

Every test behind a star is also listed (``tests``) with n01/n10/p and Holm and Bonferroni flags over
the family of all listed tests. Renderers: rich (terminal), Markdown, LaTeX (booktabs), JSON.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from ncgrpo.eval.records import RECORDS_FILE, RUN_FILE, EvalRecord, read_records
from ncgrpo.eval.stats import (
    AlignmentError,
    McNemarResult,
    bonferroni,
    holm,
    macro_accuracy,
    mean_half_range,
    pooled_over_seeds,
)

ALPHA = 0.05
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
    run_file, rec_file = path / RUN_FILE, path / RECORDS_FILE
    if not rec_file.exists():
        raise FileNotFoundError(f"{path}: no {RECORDS_FILE} (is this an `ncgrpo eval --out` directory?)")
    info: dict[str, Any] = {}
    if run_file.exists():
        try:
            info = json.loads(run_file.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{run_file}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{run_file}:{e.lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(info, dict):
            raise ValueError(f"{run_file}: must hold a JSON object, got {type(info).__name__}")
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

    @property
    def significant(self) -> bool:
        return self.test is not None and self.test.p < ALPHA


@dataclass
class Column:
    key: str  # benchmark id, "ood_avg" or "pooled"
    label: str
    kind: str  # "benchmark" | "avg" | "pooled"
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
class ComparisonTable:
    baseline: str
    main: Table
    general: Table | None
    tests: list[TestEntry]

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
        if col.kind == "pooled":
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


def _paired_test(pairs: Sequence[tuple[Run, Run]], bms: list[str]) -> McNemarResult:
    """The pooled McNemar test of ``pairs`` on ``bms``; an alignment error names both folders."""
    try:
        return pooled_over_seeds([(a.subset(bms), b.subset(bms)) for a, b in pairs], bms)
    except AlignmentError:
        for a, b in pairs:  # find the pair at fault and name its folders
            try:
                pooled_over_seeds([(a.subset(bms), b.subset(bms))], bms)
            except AlignmentError as e:
                raise AlignmentError(
                    f"run a = {a.path} ({a.name!r}), run b = {b.path} ({b.name!r}): {e}"
                ) from None
        raise


def _build(
    groups: dict[str, list[Run]],
    baseline: str,
    roles: dict[str, str],
    bms: list[str],
    *,
    title: str,
    with_avg: bool,
    pooled_label: str,
    pooled_scope: str,
    tests: list[TestEntry],
) -> Table:
    """One table; ``tests`` collects every test made. The pooled test pools the OOD columns when
    ``with_avg`` (main table), else all columns (general table)."""
    columns = [Column(bm, benchmark_label(bm), "benchmark", roles[bm]) for bm in bms]
    ood = [bm for bm in bms if roles[bm] == "ood"] if with_avg else bms
    rows: list[Row] = []
    base_runs = groups[baseline]
    for name, runs in groups.items():
        is_base = name == baseline
        pairs = [] if is_base else pair_seeds(runs, base_runs)
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
        if ood and pairs and _covers(runs, ood) and _covers(base_runs, ood):
            pooled_test = _paired_test(pairs, ood)
            tests.append(TestEntry(name, pooled_scope, pooled_test, row.seed_pairs))
        if with_avg:
            avg = row.cells["ood_avg"] = Cell(test=pooled_test)
            if ood and _covers(runs, ood):
                _fill(avg, [macro_accuracy(r.accuracy(bm) for bm in ood) for r in runs])
        row.cells["pooled"] = Cell(test=pooled_test)
        rows.append(row)
    if with_avg:
        columns.append(Column("ood_avg", "OOD avg", "avg"))
    columns.append(Column("pooled", pooled_label, "pooled"))
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
            pooled_scope="pooled OOD",
            tests=tests,
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
            pooled_scope="pooled general",
            tests=tests,
        )
    if main is None:
        main = Table(title="Reasoning benchmarks", columns=[], rows=[])
    if tests:
        holm_p, _ = holm([t.result.p for t in tests])
        bonf_p, _ = bonferroni([t.result.p for t in tests])
        for t, hp, bp in zip(tests, holm_p, bonf_p, strict=True):
            t.holm_p, t.bonferroni_p = float(hp), float(bp)
    return ComparisonTable(baseline=baseline, main=main, general=general, tests=tests)


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
        tt = RichTable(
            title=f"Paired exact McNemar tests vs. {ct.baseline} (Holm/Bonferroni over {len(ct.tests)} tests)"
        )
        for name, justify in [
            ("Configuration", "left"),
            ("Test", "left"),
            ("n", "right"),
            ("n10", "right"),
            ("n01", "right"),
            ("Δ pp", "right"),
            ("p", "right"),
            ("Holm", "left"),
            ("Bonf.", "left"),
        ]:
            tt.add_column(name, justify=justify)
        for t in ct.tests:
            r = t.result
            tt.add_row(
                escape(t.configuration),
                escape(t.scope),
                str(r.n),
                str(r.n10),
                str(r.n01),
                f"{r.diff_pp:+.1f}",
                f"{r.p:.3g}",
                "reject" if t.holm_reject else "—",
                "reject" if t.bonferroni_reject else "—",
            )
        out.append(tt)
    return out


def print_rich(ct: ComparisonTable, console: Any = None) -> None:
    from rich.console import Console
    from rich.measure import Measurement

    console = console or Console()
    width = console.width
    try:
        for renderable in to_rich(ct):
            # At its natural width: a table wider than the terminal wraps rather than truncating numbers.
            natural = Measurement.get(console, console.options.update_width(10_000), renderable).maximum
            console.width = max(width, natural)
            console.print(renderable, crop=False)
    finally:
        console.width = width
