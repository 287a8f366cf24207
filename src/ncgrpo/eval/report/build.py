"""Building a :class:`ComparisonTable` from runs: columns in the paper's order and labels, cells filled
per configuration, bold best values, stars and the tests behind them (see :mod:`ncgrpo.eval.report`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from ncgrpo.data.benchmarks import BENCHMARKS, known_benchmark
from ncgrpo.eval.report.conditions import check_comparable, check_same_questions
from ncgrpo.eval.report.runs import Run, _seed_key, pair_seeds
from ncgrpo.eval.report.table import (
    Cell,
    Column,
    ComparisonTable,
    Row,
    SeedTestEntry,
    SingleSeedEntry,
    Table,
    TestEntry,
)
from ncgrpo.eval.stats import (
    MDD_LABEL,
    SEEDS_NEEDED_LABEL,
    AlignmentError,
    McNemarResult,
    SeedNull,
    align_seeds,
    bonferroni,
    holm,
    macro_accuracy,
    mcnemar_pooled,
    mean_half_range,
    seed_level,
    seed_power,
    seed_to_seed,
    seed_ttest,
)

#: What a pooled McNemar column is, in its header, where seeds were pooled into it.
QUESTION_LEVEL = "question-level, pooled over seeds"
ROLES = ("in_domain", "ood", "general")


def benchmark_label(benchmark: str) -> str:
    """The paper's column label for a known benchmark id, else the id itself."""
    spec = known_benchmark(benchmark)
    return spec.label if spec else benchmark


def _paper_rank(benchmark: str) -> int:
    spec = known_benchmark(benchmark)
    return list(BENCHMARKS).index(spec.name) if spec else len(BENCHMARKS)


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
    single_seed: list[SingleSeedEntry],
) -> Table:
    """One table; ``tests`` and ``seed_tests`` collect every test made, ``seed_null`` the baseline's
    seed-to-seed reference, ``single_seed`` the configurations with one seed pair. The pooled test
    pools the OOD columns when ``with_avg`` (main table), else all columns (general table). With
    several seed pairs in some row, the pooled column says it is question-level and a seed-level
    column follows it, then the seed-level test's MDD and the seeds its mean difference needs."""
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
            else:
                power = seed_power(seed_ttest(arrays))
                single_seed.append(SingleSeedEntry(name, pooled_scope, row.seed_pairs, power))
        if with_avg:
            avg = row.cells["ood_avg"] = Cell(test=pooled_test)
            if ood and _covers(runs, ood):
                _fill(avg, [macro_accuracy(r.accuracy(bm) for bm in ood) for r in runs])
        row.cells["pooled"] = Cell(test=pooled_test)
        if seeds_pooled:
            row.cells["seed_level"] = seed_cell
            row.cells["mdd_pp"] = Cell(seed_level=seed_cell.seed_level)
            row.cells["seeds_needed"] = Cell(seed_level=seed_cell.seed_level)
        rows.append(row)
    if with_avg:
        columns.append(Column("ood_avg", "OOD avg", "avg"))
    columns.append(
        Column("pooled", f"{pooled_label} ({QUESTION_LEVEL})" if seeds_pooled else pooled_label, "pooled")
    )
    if seeds_pooled:
        columns.append(Column("seed_level", seed_label, "seed"))
        columns.append(Column("mdd_pp", MDD_LABEL, "mdd"))
        columns.append(Column("seeds_needed", SEEDS_NEEDED_LABEL, "seeds_needed"))
    if ood and len(base_runs) > 1 and _covers(base_runs, ood):
        arrays = _aligned([(r, base_runs[0]) for r in base_runs], ood)  # one question order for all seeds
        seed_null[pooled_scope] = seed_to_seed(
            {r.seed: a for r, (a, _) in zip(base_runs, arrays, strict=True)}
        )
    table = Table(title=title, columns=columns, rows=rows, scope=pooled_scope)
    _mark_bold(table)
    return table


def compare(
    runs: Sequence[Run],
    baseline: str,
    benchmarks: Sequence[str] | None = None,
    *,
    allow_different: Sequence[str] = (),
) -> ComparisonTable:
    """Build the main (in-domain + OOD) and general tables of ``runs`` against ``baseline``.

    ``benchmarks`` restricts (and orders) the columns; by default every benchmark in the runs, in the
    paper's order for the benchmarks it reports. Raises ``stats.AlignmentError`` when a
    configuration and the baseline did not answer the same questions of a benchmark, and ValueError
    when the runs were not evaluated under the same conditions (:func:`~ncgrpo.eval.report.conditions.
    check_comparable`: benchmark data, decoding settings, grader, engine) but for the fields
    ``allow_different`` names, whose differences the table then carries in ``differences``.
    """
    differences = check_comparable(runs, allow_different)
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
    single_seed: list[SingleSeedEntry] = []
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
            single_seed=single_seed,
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
            single_seed=single_seed,
        )
    # the pairs tested above were checked by align; this covers the cells no test pairs
    check_same_questions(runs)
    if main is None:
        main = Table(title="Reasoning benchmarks", columns=[], rows=[])
    if tests:
        holm_p, _ = holm([t.result.p for t in tests])
        bonf_p, _ = bonferroni([t.result.p for t in tests])
        for t, hp, bp in zip(tests, holm_p, bonf_p, strict=True):
            t.holm_p, t.bonferroni_p = float(hp), float(bp)
    return ComparisonTable(
        baseline=baseline,
        main=main,
        general=general,
        tests=tests,
        seed_tests=seed_tests,
        seed_null=seed_null,
        single_seed=single_seed,
        differences=differences,
    )
