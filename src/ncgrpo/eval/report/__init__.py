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
Beside the seed-level p come the test's power columns (``stats.seed_power``): the minimum detectable
difference at 80% power and alpha 0.05 given the seeds' observed spread ("MDD at 80% power (pts)"),
and the seeds per arm the observed mean difference would need ("seeds needed for the mean diff"). A
configuration with one seed pair gets a note under its table instead (``single_seed``): no
seed-level claim can be made, and its difference would need so many seeds at the embedded base's
seed-to-seed spread.

Every test behind a star is also listed (``tests``) with n01/n10/p and Holm and Bonferroni flags over
the family of all listed tests. Renderers: rich (terminal), Markdown, LaTeX (booktabs), JSON.
"""

from __future__ import annotations

from ncgrpo.eval.report.build import QUESTION_LEVEL, ROLES, benchmark_label, compare
from ncgrpo.eval.report.render import (
    format_p,
    latex_text,
    print_rich,
    seed_reference,
    seed_tests_markdown,
    single_seed_notes,
    tests_markdown,
    to_latex,
    to_markdown,
    to_rich,
)
from ncgrpo.eval.report.runs import Run, load_run, load_runs, pair_seeds
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

__all__ = [
    "QUESTION_LEVEL",
    "ROLES",
    "Cell",
    "Column",
    "ComparisonTable",
    "Row",
    "Run",
    "SeedTestEntry",
    "SingleSeedEntry",
    "Table",
    "TestEntry",
    "benchmark_label",
    "compare",
    "format_p",
    "latex_text",
    "load_run",
    "load_runs",
    "pair_seeds",
    "print_rich",
    "seed_reference",
    "seed_tests_markdown",
    "single_seed_notes",
    "tests_markdown",
    "to_latex",
    "to_markdown",
    "to_rich",
]
