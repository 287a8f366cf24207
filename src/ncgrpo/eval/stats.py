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

Plain numpy/scipy only: no torch, nothing from ncgrpo that imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

__all__ = [
    "ALPHA",
    "BOOTSTRAP_RESAMPLES",
    "AlignmentError",
    "BootstrapCI",
    "McNemarResult",
    "Paired",
    "SeedLevel",
    "SeedNull",
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
    "paired_ttest",
    "per_benchmark",
    "pooled",
    "pooled_over_seeds",
    "seed_differences",
    "seed_level",
    "seed_to_seed",
    "seed_ttest",
]

#: Significance level of the paper's tests (and of :func:`disagreement_note`).
ALPHA = 0.05
#: Resamples of :func:`hierarchical_bootstrap` unless told otherwise: the 2.5% and 97.5% quantiles
#: of 10,000 resamples move by a few hundredths of a point between generator seeds.
BOOTSTRAP_RESAMPLES = 10_000


class RecordLike(Protocol):
    benchmark: str
    question_id: str
    correct: bool


@dataclass(frozen=True)
class McNemarResult:
    """Exact McNemar test of method ``a`` against baseline ``b`` on ``n`` paired questions.

    Discordant counts are indexed (a, b): ``n10`` = method right and baseline wrong (the method's
    wins), ``n01`` = method wrong and baseline right (its losses). ``acc_a``/``acc_b`` are fractions
    in [0, 1]; ``diff_pp`` is ``acc_a - acc_b`` in percentage points.
    """

    n: int
    n01: int
    n10: int
    p: float
    acc_a: float
    acc_b: float
    diff_pp: float

    @property
    def discordant(self) -> int:
        return self.n01 + self.n10

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _as_bool(x: Any, name: str) -> np.ndarray:
    arr = np.asarray(x)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.dtype != bool:
        if arr.size and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold booleans (or 0/1)")
        arr = arr.astype(bool)
    return arr


def mcnemar_exact(a: Any, b: Any) -> McNemarResult:
    """Two-sided exact McNemar test: binomial test of ``n10`` out of ``n01 + n10`` at p = 1/2.

    ``a`` (method) and ``b`` (baseline) are paired boolean arrays (``a[i]``, ``b[i]``: the same
    question). With no discordant pair there is no evidence either way and ``p = 1``.
    """
    a = _as_bool(a, "a")
    b = _as_bool(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired arrays differ in length: {a.size} vs {b.size}")
    n = int(a.size)
    if n == 0:
        raise ValueError("mcnemar_exact needs at least one paired question")
    from scipy.stats import binomtest  # slow to import (~1-2 s); only when a test is run

    n10 = int(np.count_nonzero(a & ~b))
    n01 = int(np.count_nonzero(~a & b))
    p = 1.0 if n01 + n10 == 0 else float(binomtest(n10, n01 + n10, 0.5).pvalue)
    acc_a = float(a.mean())
    acc_b = float(b.mean())
    return McNemarResult(
        n=n, n01=n01, n10=n10, p=min(p, 1.0), acc_a=acc_a, acc_b=acc_b, diff_pp=100.0 * (n10 - n01) / n
    )


def mcnemar_pooled(pairs: Iterable[tuple[Any, Any]]) -> McNemarResult:
    """One exact McNemar test on the concatenation of several paired (a, b) arrays."""
    pairs = list(pairs)
    if not pairs:
        raise ValueError("mcnemar_pooled needs at least one (a, b) pair of arrays")
    a = np.concatenate([_as_bool(x, "a") for x, _ in pairs])
    b = np.concatenate([_as_bool(y, "b") for _, y in pairs])
    return mcnemar_exact(a, b)


# --- pairing records -------------------------------------------------------------------------


class AlignmentError(ValueError):
    """Two runs do not cover the same questions, so they cannot be compared per question."""


@dataclass(frozen=True)
class Paired:
    """Outcomes of two runs on the same questions, in ``keys`` order (sorted)."""

    keys: list[tuple[str, str]]  # (benchmark, question_id)
    a: np.ndarray  # [n] bool, method correct
    b: np.ndarray  # [n] bool, baseline correct

    def test(self) -> McNemarResult:
        return mcnemar_exact(self.a, self.b)


def _outcomes(records: Iterable[RecordLike], benchmark: str | None, side: str) -> dict[tuple[str, str], bool]:
    out: dict[tuple[str, str], bool] = {}
    for r in records:
        if benchmark is not None and r.benchmark != benchmark:
            continue
        key = (r.benchmark, str(r.question_id))
        if key in out and out[key] != bool(r.correct):
            raise AlignmentError(
                f"run {side}: question {key[0]}/{key[1]} appears twice with different outcomes"
            )
        out[key] = bool(r.correct)
    return out


def _asked(
    records: Iterable[RecordLike], benchmark: str | None
) -> dict[tuple[str, str], tuple[str, str, str]]:
    """(benchmark, question_id) -> (prompt_hash, gold, image_hash) as recorded ("" where a record has
    none: image_hash in records written before it existed, or for a question without images)."""
    return {
        (r.benchmark, str(r.question_id)): (
            str(getattr(r, "prompt_hash", "") or ""),
            str(getattr(r, "gold", "") or ""),
            str(getattr(r, "image_hash", "") or ""),
        )
        for r in records
        if benchmark is None or r.benchmark == benchmark
    }


def _check_same_questions(
    records_a: Iterable[RecordLike], records_b: Iterable[RecordLike], benchmark: str | None
) -> None:
    qa, qb = _asked(records_a, benchmark), _asked(records_b, benchmark)
    for key in sorted(qa.keys() & qb.keys()):
        (ha, ga, ia), (hb, gb, ib) = qa[key], qb[key]
        what = []
        if ha and hb and ha != hb:
            what.append(f"prompt_hash {ha} vs {hb}")
        if ga and gb and ga != gb:
            what.append(f"gold {ga!r} vs {gb!r}")
        if ia and ib and ia != ib:
            what.append(f"image pixels (image_hash) {ia} vs {ib}")
        if what:
            raise AlignmentError(
                f"question {key[0]}/{key[1]} is not the same question in the two runs ({'; '.join(what)}): "
                "they were evaluated on different question sets that reuse ids (e.g. a suite built with "
                "another seed, or a figure changed under the same text); compare runs evaluated on the same data"
            )


def _name_some(keys: set[tuple[str, str]], limit: int = 5) -> str:
    shown = ", ".join(f"{bm}/{qid}" for bm, qid in sorted(keys)[:limit])
    more = len(keys) - limit
    return shown + (f", ... ({more} more)" if more > 0 else "")


def align(
    records_a: Iterable[RecordLike], records_b: Iterable[RecordLike], *, benchmark: str | None = None
) -> Paired:
    """Pair two runs' records by ``(benchmark, question_id)`` (restricted to ``benchmark`` if given).

    Raises :class:`AlignmentError` naming some missing ids on each side, with counts, when the two
    runs did not answer the same questions (e.g. an unfinished evaluation): a paired test on the
    intersection would silently compare different question sets across configurations. Also when a
    shared ``(benchmark, question_id)`` was not the same question in the two runs: records that carry
    a ``prompt_hash``, a ``gold`` answer or an ``image_hash`` (the figures' pixels; both non-empty) must
    agree on them, else the error names the first such id (e.g. suites generated with two seeds reuse
    ids for other questions; a figure redrawn under the same text and gold).
    """
    records_a, records_b = list(records_a), list(records_b)
    oa = _outcomes(records_a, benchmark, "a")
    ob = _outcomes(records_b, benchmark, "b")
    only_a = oa.keys() - ob.keys()
    only_b = ob.keys() - oa.keys()
    scope = f" on benchmark {benchmark!r}" if benchmark is not None else ""
    if not oa and not ob:
        raise AlignmentError(f"no records{scope} in either run")
    if only_a or only_b:
        parts = [f"runs do not cover the same questions{scope} ({len(oa)} vs {len(ob)} questions)"]
        if only_b:
            parts.append(f"missing from run a: {len(only_b)} ({_name_some(only_b)})")
        if only_a:
            parts.append(f"missing from run b: {len(only_a)} ({_name_some(only_a)})")
        raise AlignmentError("; ".join(parts))
    keys = sorted(oa)
    _check_same_questions(records_a, records_b, benchmark)
    return Paired(
        keys=keys,
        a=np.array([oa[k] for k in keys], dtype=bool),
        b=np.array([ob[k] for k in keys], dtype=bool),
    )


def per_benchmark(
    records_a: Sequence[RecordLike], records_b: Sequence[RecordLike], benchmarks: Iterable[str] | None = None
) -> dict[str, McNemarResult]:
    """One exact McNemar test per benchmark (default: every benchmark either run has)."""
    if benchmarks is None:
        benchmarks = sorted({r.benchmark for r in records_a} | {r.benchmark for r in records_b})
    return {bm: align(records_a, records_b, benchmark=bm).test() for bm in benchmarks}


def pooled(
    records_a: Sequence[RecordLike], records_b: Sequence[RecordLike], benchmarks: Iterable[str]
) -> McNemarResult:
    """One test on the concatenated paired outcomes of all questions of ``benchmarks``."""
    return pooled_over_seeds([(records_a, records_b)], benchmarks)


def pooled_over_seeds(
    seed_pairs: Sequence[tuple[Sequence[RecordLike], Sequence[RecordLike]]], benchmarks: Iterable[str]
) -> McNemarResult:
    """One test on the pairs of every (method seed i, baseline seed i) run pair and benchmark.

    Each question contributes once per seed pair: two seeds of 10,671 OOD questions (HallusionBench's full
    image split) give the paper's n = 21,342, while its single-seed n = 10,038 is the deduplicated
    ``image_paper`` split (docs/benchmarks-data.md, "Counts").
    """
    return mcnemar_pooled(align_seeds(seed_pairs, benchmarks))


def align_seeds(
    seed_pairs: Sequence[tuple[Sequence[RecordLike], Sequence[RecordLike]]], benchmarks: Iterable[str]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per (method seed i, baseline seed i) run pair: the paired outcomes (a, b) on the questions of
    ``benchmarks``, concatenated in benchmark order (each aligned with :func:`align`).

    The input of the seed-level tests, which need the pairs of each seed apart; concatenating the
    returned pairs is what :func:`pooled_over_seeds` tests.
    """
    benchmarks = list(benchmarks)
    if not benchmarks:
        raise ValueError("pooled test needs at least one benchmark")
    out = []
    for ra, rb in seed_pairs:
        paired = [align(ra, rb, benchmark=bm) for bm in benchmarks]
        out.append((np.concatenate([p.a for p in paired]), np.concatenate([p.b for p in paired])))
    return out


# --- summaries and corrections ---------------------------------------------------------------


def macro_accuracy(accuracies: Mapping[str, float] | Iterable[float]) -> float:
    """Unweighted mean of per-benchmark accuracies (the tables' "OOD avg")."""
    vals = list(accuracies.values()) if isinstance(accuracies, Mapping) else list(accuracies)
    if not vals:
        raise ValueError("macro_accuracy of no benchmarks")
    return float(np.mean(vals))


def mean_half_range(values: Iterable[float]) -> tuple[float, float]:
    """Mean and half-range ``(max - min) / 2`` over seeds (the paper's "mean ± half-range, N=2")."""
    v = np.asarray(list(values), dtype=float)
    if v.size == 0:
        raise ValueError("mean_half_range of no values")
    return float(v.mean()), float((v.max() - v.min()) / 2)


def _pvals(pvalues: Iterable[float]) -> np.ndarray:
    p = np.asarray(list(pvalues), dtype=float)
    if p.ndim != 1 or ((p < 0) | (p > 1) | np.isnan(p)).any():
        raise ValueError("p-values must be a flat list of numbers in [0, 1]")
    return p


def bonferroni(pvalues: Iterable[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Bonferroni over a family of m tests: adjusted ``min(1, m p)``; reject where adjusted < alpha."""
    p = _pvals(pvalues)
    adj = np.minimum(1.0, p * p.size)
    return adj, adj < alpha


def holm(pvalues: Iterable[float], alpha: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """Holm's step-down correction (Holm 1979), in the input order.

    Sort p ascending; the i-th smallest (i = 0..m-1) gets ``(m - i) p_(i)``, made monotone with a
    running max and capped at 1. Rejecting where the adjusted value is < alpha is the step-down
    rule "reject p_(i) while p_(i) < alpha / (m - i), stop at the first failure".
    """
    p = _pvals(pvalues)
    m = p.size
    order = np.argsort(p, kind="stable")
    stepped = np.maximum.accumulate((m - np.arange(m)) * p[order])
    adj = np.empty(m)
    adj[order] = np.minimum(1.0, stepped)
    return adj, adj < alpha


# --- seeds as the unit -----------------------------------------------------------------------


def _seed_pairs(seed_pairs: Iterable[tuple[Any, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
    out = []
    for i, (a, b) in enumerate(seed_pairs):
        a, b = _as_bool(a, f"a of seed pair {i}"), _as_bool(b, f"b of seed pair {i}")
        if a.shape != b.shape:
            raise ValueError(f"seed pair {i}: paired arrays differ in length: {a.size} vs {b.size}")
        if a.size == 0:
            raise ValueError(f"seed pair {i} has no paired question")
        out.append((a, b))
    if not out:
        raise ValueError("a seed-level test needs at least one seed pair")
    return out


def seed_differences(seed_pairs: Iterable[tuple[Any, Any]]) -> np.ndarray:
    """Per seed pair ``(a_s, b_s)`` (method and baseline outcomes on the same questions), the accuracy
    difference ``acc(a_s) - acc(b_s)`` in percentage points.

    Computed from the discordant counts, ``100 (n10 - n01) / n``, so two seeds with the same counts
    give bit-identical differences (the t-test's "all differences equal" case is exact).
    """
    return np.array(
        [
            100.0 * (np.count_nonzero(a & ~b) - np.count_nonzero(~a & b)) / a.size
            for a, b in _seed_pairs(seed_pairs)
        ]
    )


@dataclass(frozen=True)
class SeedTTest:
    """Paired t-test over training seeds of the per-seed accuracy difference (method - baseline).

    ``diffs_pp`` are the per-seed differences in percentage points, ``mean_pp`` their mean, ``sd_pp``
    their sample standard deviation (ddof 1), ``t = mean / (sd / sqrt(S))`` on ``df = S - 1``,
    ``p`` two-sided, ``ci_low_pp``/``ci_high_pp`` the t interval of the mean at ``confidence``.
    ``undefined`` is empty when the test is defined, else says why ``p`` is 1 or nan (see
    :func:`paired_ttest`).
    """

    n_seeds: int
    diffs_pp: tuple[float, ...]
    mean_pp: float
    sd_pp: float
    t: float
    df: int
    p: float
    ci_low_pp: float
    ci_high_pp: float
    confidence: float
    undefined: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_confidence(confidence: float) -> None:
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")


def paired_ttest(diffs_pp: Iterable[float], *, confidence: float = 0.95) -> SeedTTest:
    """Two-sided one-sample t-test of per-seed differences against 0 (= scipy's ``ttest_rel`` of the
    per-seed accuracies, ``ttest_1samp`` of their differences), with the t interval of the mean.

    Where the t statistic does not exist, no number pretends to be a test:

    - fewer than 2 seeds: ``p = nan`` (and sd, t and the interval nan). One seed has no
      seed-to-seed spread to test against; ``p = 1`` would read as "no difference".
    - every difference 0 (e.g. a method identical to the baseline): ``p = 1``, interval [0, 0] --
      the data are exactly the null.
    - every difference equal but not 0 (zero spread, t = ±inf): ``p = nan``, the interval is the
      single point. With few seeds a tied spread is chance, and p = 0 would overstate it.
    """
    _check_confidence(confidence)
    d = np.asarray(list(diffs_pp), dtype=float)
    if d.ndim != 1 or d.size == 0 or not np.isfinite(d).all():
        raise ValueError("paired_ttest needs a flat, non-empty list of finite differences")
    s = int(d.size)
    mean = float(d.mean())

    def result(sd: float, t: float, p: float, low: float, high: float, undefined: str = "") -> SeedTTest:
        diffs = tuple(float(x) for x in d)
        return SeedTTest(s, diffs, mean, sd, t, s - 1, p, low, high, confidence, undefined)

    if s < 2:
        return result(math.nan, math.nan, math.nan, math.nan, math.nan, "one seed: no seed-to-seed spread")
    if np.ptp(d) == 0:
        if mean == 0:
            return result(0.0, 0.0, 1.0, 0.0, 0.0, "every seed's difference is 0")
        return result(
            0.0, math.nan, math.nan, mean, mean, f"every seed's difference is {mean:+.2f} pp (no spread)"
        )
    from scipy.stats import t as t_dist

    sd = float(d.std(ddof=1))
    se = sd / math.sqrt(s)
    t = mean / se
    p = float(min(1.0, 2.0 * t_dist.sf(abs(t), s - 1)))
    half = float(t_dist.ppf(0.5 + confidence / 2, s - 1)) * se
    return result(sd, float(t), p, mean - half, mean + half)


def seed_ttest(seed_pairs: Iterable[tuple[Any, Any]], *, confidence: float = 0.95) -> SeedTTest:
    """:func:`paired_ttest` of :func:`seed_differences`: the primary seed-level test.

    Primary because training seeds are the unit of replication: a new run of a method is a new seed,
    and the paired t-test over seeds is the standard test of whether a method's mean effect is
    larger than seed-to-seed variation. It ignores the (smaller, with hundreds of questions)
    sampling error of each seed's accuracy; :func:`hierarchical_bootstrap` adds it.
    """
    return paired_ttest(seed_differences(seed_pairs), confidence=confidence)


@dataclass(frozen=True)
class BootstrapCI:
    """Percentile interval of the mean per-seed accuracy difference (pp) from ``n_resamples``
    hierarchical resamples drawn with ``numpy.random.default_rng(seed)``."""

    mean_pp: float
    low_pp: float
    high_pp: float
    confidence: float
    n_resamples: int
    seed: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def hierarchical_bootstrap(
    seed_pairs: Iterable[tuple[Any, Any]],
    *,
    confidence: float = 0.95,
    n_resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = 0,
) -> BootstrapCI:
    """Two-stage bootstrap interval of the mean difference ``mean_s (acc(a_s) - acc(b_s))`` in pp.

    Each resample draws S seeds with replacement, then, within each drawn seed, its n questions with
    replacement, keeping a question's two outcomes together (paired); the statistic is the mean over
    the drawn seeds of their resampled differences. Both sources of variance, which seeds were
    trained and which questions were asked, are in the interval; it is the interval to quote beside
    the t-test's, which has only the first.

    Resampling questions is done exactly through its counts: a seed's resampled difference depends
    only on how many wins (n10), losses (n01) and ties it draws, which are multinomial with the
    seed's shares, so the cost is O(n_resamples x S) whatever the number of questions.
    Deterministic for a given ``seed``.
    """
    _check_confidence(confidence)
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be >= 1, got {n_resamples}")
    pairs = _seed_pairs(seed_pairs)
    counts = [(a.size, np.count_nonzero(a & ~b), np.count_nonzero(~a & b)) for a, b in pairs]
    point = float(np.mean([100.0 * (n10 - n01) / n for n, n10, n01 in counts]))
    rng = np.random.default_rng(seed)
    s = len(pairs)
    drawn = rng.integers(0, s, size=(n_resamples, s))
    diffs = np.empty((n_resamples, s))
    for i, (n, n10, n01) in enumerate(counts):
        where = drawn == i
        m = int(where.sum())
        if m:
            k = rng.multinomial(n, [n10 / n, n01 / n, max(0.0, 1.0 - (n10 + n01) / n)], size=m)
            diffs[where] = 100.0 * (k[:, 0] - k[:, 1]) / n
    means = diffs.mean(axis=1)
    low, high = np.quantile(means, [0.5 - confidence / 2, 0.5 + confidence / 2])
    return BootstrapCI(
        mean_pp=point,
        low_pp=float(low),
        high_pp=float(high),
        confidence=confidence,
        n_resamples=n_resamples,
        seed=seed,
    )


@dataclass(frozen=True)
class SeedLevel:
    """The seed-level comparison of one method with the baseline: the primary paired t-test over
    seeds and the hierarchical bootstrap interval of the same mean difference."""

    ttest: SeedTTest
    bootstrap: BootstrapCI

    @property
    def p(self) -> float:
        return self.ttest.p

    @property
    def mean_pp(self) -> float:
        return self.ttest.mean_pp

    def to_dict(self) -> dict[str, Any]:
        return {"ttest": self.ttest.to_dict(), "bootstrap": self.bootstrap.to_dict()}


def seed_level(
    seed_pairs: Iterable[tuple[Any, Any]], *, confidence: float = 0.95, **bootstrap: Any
) -> SeedLevel:
    """:func:`seed_ttest` and :func:`hierarchical_bootstrap` of the same seed pairs at one ``confidence``;
    ``bootstrap``: the bootstrap's own options (``n_resamples``, ``seed``), defaults and checks there."""
    pairs = _seed_pairs(seed_pairs)
    return SeedLevel(
        ttest=seed_ttest(pairs, confidence=confidence),
        bootstrap=hierarchical_bootstrap(pairs, confidence=confidence, **bootstrap),
    )


@dataclass(frozen=True)
class SeedNull:
    """How two seeds of one method differ: the reference a method-vs-baseline comparison is read against.

    Per seed pair (``pairs[k] = (i, j)``): ``differ[k]``, the share (0-1) of questions on which seed
    i and seed j differ in correctness, and ``tests[k]``, their exact McNemar test (a = seed i,
    b = seed j). ``pooled`` is one McNemar test on the concatenated pairs (the question-level test
    that pooling over seeds would run between two seeds of the same method).
    """

    pairs: tuple[tuple[Any, Any], ...]
    differ: tuple[float, ...]
    tests: tuple[McNemarResult, ...]
    pooled: McNemarResult

    @property
    def mean_differ(self) -> float:
        """Mean over the seed pairs of the share of questions whose correctness differs."""
        return float(np.mean(self.differ))

    def to_dict(self) -> dict[str, Any]:
        return {
            "pairs": [list(p) for p in self.pairs],
            "differ": list(self.differ),
            "mean_differ": self.mean_differ,
            "tests": [t.to_dict() for t in self.tests],
            "pooled": self.pooled.to_dict(),
        }


def seed_to_seed(outcomes: Mapping[Any, Any], pairs: Sequence[tuple[Any, Any]] | None = None) -> SeedNull:
    """The seed-to-seed null of one method from its seeds' outcomes on the same questions.

    ``outcomes`` maps a seed to its boolean outcomes, every array in the same question order (e.g.
    :func:`align` against one of the seeds). ``pairs`` chooses the seed pairs; by default every
    unordered pair ``(i, j)``, i before j in the mapping's order.
    """
    arrays = {s: _as_bool(x, f"outcomes of seed {s}") for s, x in outcomes.items()}
    if len(arrays) < 2:
        raise ValueError(f"seed_to_seed needs at least two seeds, got {list(arrays)}")
    sizes = {s: x.size for s, x in arrays.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"seeds answered different numbers of questions: {sizes}")
    seeds = list(arrays)
    if pairs is None:
        pairs = [(seeds[i], seeds[j]) for i in range(len(seeds)) for j in range(i + 1, len(seeds))]
    pairs = [tuple(p) for p in pairs]
    if not pairs:
        raise ValueError("seed_to_seed needs at least one seed pair")
    for i, j in pairs:
        if i not in arrays or j not in arrays:
            raise ValueError(f"seed pair ({i}, {j}): no outcomes for seed {i if i not in arrays else j}")
        if i == j:
            raise ValueError(f"seed pair ({i}, {j}) pairs a seed with itself")
    return SeedNull(
        pairs=tuple(pairs),
        differ=tuple(float((arrays[i] != arrays[j]).mean()) for i, j in pairs),
        tests=tuple(mcnemar_exact(arrays[i], arrays[j]) for i, j in pairs),
        pooled=mcnemar_pooled((arrays[i], arrays[j]) for i, j in pairs),
    )


def _p_is(p: float) -> str:
    return "p < 1e-4" if p < 1e-4 else f"p = {p:.2g}"


def disagreement_note(
    question_p: float, seed_p: float, *, n_seeds: int, alpha: float = ALPHA, label: str = ""
) -> str | None:
    """A one-line note when the question-level pooled McNemar p and the seed-level p fall on
    different sides of ``alpha`` (one significant, the other not); else None. None also when either
    p is nan (the seed-level test undefined: nothing to disagree with).

    The two ask different questions: the pooled McNemar whether these trained models differ on
    the questions, the seed-level test whether the method's effect is larger than what retraining
    with another seed changes. The note says which one holds, so neither is quoted alone.
    """
    if math.isnan(question_p) or math.isnan(seed_p):
        return None
    q_sig, s_sig = question_p < alpha, seed_p < alpha
    if q_sig == s_sig:
        return None
    head = f"{label}: " if label else ""
    q, s = f"question-level pooled McNemar {_p_is(question_p)}", f"seed-level {_p_is(seed_p)}"
    if q_sig:
        return (
            f"{head}{q} is below {alpha} but {s} ({n_seeds} seeds) is not: these models differ on the "
            "questions, but not detectably more than retraining with another seed changes them"
        )
    return (
        f"{head}{s} ({n_seeds} seeds) is below {alpha} but {q} is not: the seeds agree on the "
        "difference, but it is small against the per-question noise"
    )
