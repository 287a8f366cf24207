"""Paired statistics of the paper's evaluation protocol (section 4.1, "Evaluation").

Every comparison in the paper is paired per question: both models answer the same questions and an
exact McNemar test looks only at the discordant pairs (one model right, the other wrong).

- :func:`mcnemar_exact`: one test on two paired boolean arrays (a = method, b = baseline).
- :func:`align`: pair two runs' records by ``(benchmark, question_id)``; refuses runs that do not
  cover the same questions.
- :func:`per_benchmark`, :func:`pooled`: one test per benchmark, and one test on the concatenated
  pairs of several benchmarks ("pooled McNemar over n=10,038 OOD questions").
- :func:`pooled_over_seeds`: concatenate the pairs of seed i of the method with seed i of the
  baseline ("pooling per-question records across seeds (n=21,342)").
- :func:`mean_half_range`: the paper's "mean ± half-range, N=2".
- Seed-level statistics, with training seeds as the unit of replication (below, "Seeds as the unit").
- :func:`holm`, :func:`bonferroni`: family-wise corrections (Limitations: "p-values are
  uncorrected (~15 tests): headline results survive Bonferroni").

Note the two averages differ on purpose: a table's "OOD avg" is the unweighted mean of the
per-benchmark accuracies (:func:`macro_accuracy`), while the pooled test pools questions, so large
benchmarks weigh more in it.

Seeds as the unit
-----------------
Every McNemar test above, pooled over seeds or not, treats the questions as the only source of
variance: it asks whether *these trained models* differ on the population of questions. Whether the
*method* differs needs the seeds: two vanilla seeds already answer 10-15% of a toy's questions
differently, as often as a method differs from vanilla. So beside the paper's tests:

- :func:`seed_ttest` (the primary seed-level test): per seed s the accuracy difference
  ``method_s - baseline_s`` on the same questions, and a paired t-test over the seeds (df = S - 1),
  the standard test with seeds as the unit; its t interval of the mean difference.
- :func:`hierarchical_bootstrap`: a confidence interval of the same mean difference that resamples
  seeds, then questions within each seed, so both sources of variance are in it.
- :func:`seed_to_seed`: the null reference, how often two seeds of one method differ and their
  question-level McNemar; a method-vs-baseline "differ %" is read against it.
- :func:`disagreement_note`: a one-line note when the question-level pooled test and the
  seed-level test fall on different sides of alpha.
- :func:`seed_power` (:mod:`ncgrpo.eval.stats.power`): what the seed-level test could detect. With
  two or more seeds, the minimum detectable difference at 80% power and alpha 0.05 given the observed
  seed-to-seed sd (:func:`min_detectable_diff`, from the noncentral t power :func:`ttest_power`) and
  the seeds the observed difference would need (:func:`seeds_needed`); with one seed per arm, that no
  seed-level claim can be made, and the seeds the difference would need at the embedded base's
  seed-to-seed sd (:data:`REFERENCE_SEED_SD_PP`).

Plain numpy/scipy only: no torch, nothing from ncgrpo that imports torch.
"""

from __future__ import annotations

from ncgrpo.eval.stats.mcnemar import (
    ALPHA,
    AlignmentError,
    McNemarResult,
    Paired,
    align,
    align_seeds,
    bonferroni,
    holm,
    macro_accuracy,
    mcnemar_exact,
    mcnemar_pooled,
    mean_half_range,
    per_benchmark,
    pooled,
    pooled_over_seeds,
)
from ncgrpo.eval.stats.power import (
    MDD_LABEL,
    POWER,
    REFERENCE_SEED_SD_PP,
    SEEDS_NEEDED_CAP,
    SEEDS_NEEDED_LABEL,
    SeedPower,
    min_detectable_diff,
    pooled_sd,
    seed_power,
    seeds_needed,
    ttest_power,
)
from ncgrpo.eval.stats.seeds import (
    BOOTSTRAP_RESAMPLES,
    BootstrapCI,
    SeedLevel,
    SeedNull,
    SeedTTest,
    disagreement_note,
    hierarchical_bootstrap,
    paired_ttest,
    seed_differences,
    seed_level,
    seed_to_seed,
    seed_ttest,
)

__all__ = [
    "ALPHA",
    "BOOTSTRAP_RESAMPLES",
    "MDD_LABEL",
    "POWER",
    "REFERENCE_SEED_SD_PP",
    "SEEDS_NEEDED_CAP",
    "SEEDS_NEEDED_LABEL",
    "AlignmentError",
    "BootstrapCI",
    "McNemarResult",
    "Paired",
    "SeedLevel",
    "SeedNull",
    "SeedPower",
    "SeedTTest",
    "align",
    "align_seeds",
    "bonferroni",
    "disagreement_note",
    "hierarchical_bootstrap",
    "holm",
    "macro_accuracy",
    "mcnemar_exact",
    "mcnemar_pooled",
    "mean_half_range",
    "min_detectable_diff",
    "paired_ttest",
    "per_benchmark",
    "pooled",
    "pooled_over_seeds",
    "pooled_sd",
    "seed_differences",
    "seed_level",
    "seed_power",
    "seed_to_seed",
    "seed_ttest",
    "seeds_needed",
    "ttest_power",
]
