"""Seed-level statistics, with training seeds as the unit of replication ("Seeds as the unit" in
:mod:`ncgrpo.eval.stats`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ncgrpo.eval.stats.mcnemar import ALPHA, McNemarResult, _as_bool, mcnemar_exact, mcnemar_pooled
from ncgrpo.eval.stats.power import SeedPower, seed_power

#: Resamples of :func:`hierarchical_bootstrap` unless told otherwise: the 2.5% and 97.5% quantiles
#: of 10,000 resamples move by a few hundredths of a point between generator seeds.
BOOTSTRAP_RESAMPLES = 10_000


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
    seeds, the hierarchical bootstrap interval of the same mean difference, and the test's power
    (:func:`~ncgrpo.eval.stats.seed_power`: its minimum detectable difference and the seeds the
    observed difference would need)."""

    ttest: SeedTTest
    bootstrap: BootstrapCI
    power: SeedPower

    @property
    def p(self) -> float:
        return self.ttest.p

    @property
    def mean_pp(self) -> float:
        return self.ttest.mean_pp

    def to_dict(self) -> dict[str, Any]:
        return {
            "ttest": self.ttest.to_dict(),
            "bootstrap": self.bootstrap.to_dict(),
            "power": self.power.to_dict(),
        }


def seed_level(
    seed_pairs: Iterable[tuple[Any, Any]], *, confidence: float = 0.95, **bootstrap: Any
) -> SeedLevel:
    """:func:`seed_ttest`, :func:`hierarchical_bootstrap` and :func:`~ncgrpo.eval.stats.seed_power`
    (at 80% power, alpha 0.05) of the same seed pairs at one ``confidence``; ``bootstrap``: the
    bootstrap's own options (``n_resamples``, ``seed``), defaults and checks there."""
    pairs = _seed_pairs(seed_pairs)
    ttest = seed_ttest(pairs, confidence=confidence)
    return SeedLevel(
        ttest=ttest,
        bootstrap=hierarchical_bootstrap(pairs, confidence=confidence, **bootstrap),
        power=seed_power(ttest),
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
